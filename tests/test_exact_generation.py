"""Exactness of the KV-cached generator (issue 16, classes 9 and 10).

Class 9: the position analysis must never accept a graph whose cached run differs from the full
recompute. Every spelling below was accepted on main and gave other logits (0.4-1.2): a bag of all
tokens gathered with ``index_select`` and averaged, a constant row expanded to ``T`` rows and summed
over time. They are refused now, naming the op that mixes positions and its line; the row-wise
spellings of the same ops stay accepted and exact.

Class 10: a :class:`~attnopt.generation.CachedLM` attends causally because a proof read the model's
causal buffer (nanoGPT's ``tril``). Once that buffer no longer holds the proven pattern (written in
place, loaded from another state dict, deleted and registered again) the cache must not keep
serving the causal model's logits: ``prefill`` and ``step`` raise and say to call ``cached`` again.

The same for everything else the capture fixed: plain Python attributes the forward reads (a float scale, a
causal flag, ``training``, a config dataclass field, a submodule swapped), the weights' dtype and device
(``model.double()``) raise; weights written in place after a prefill are followed (the next step recomputes
the sequence with them), as the model as written recomputes every position.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from attnopt.generation import CachedLM, ModelChangedError, PositionError, cached, generate, generate_plain
from attnopt.models import GPTConfig, NanoGPT

VOCAB = 32


class Extra(NanoGPT):
    """nanoGPT with one extra term added to the embeddings: ``x + fn(model, idx, x, pos)``."""

    def __init__(self, fn, n_layer: int = 1):
        torch.manual_seed(0)
        super().__init__(GPTConfig(n_layer=n_layer, n_embd=16, n_head=2, vocab_size=VOCAB, block_size=16))
        self.fn = fn
        self.eval()

    def forward(self, idx):
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        x = x + self.fn(self, idx, x, pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _pieces_match(model, c: CachedLM, prompt: int = 5, steps=(1, 3, 1), batch: int = 2) -> None:
    """Prefill and steps of several lengths give the full recompute's logits."""
    seq = torch.randint(0, VOCAB, (batch, prompt))
    got = [c.prefill(seq)]
    for t in steps:
        new = torch.randint(0, VOCAB, (batch, t))
        seq = torch.cat((seq, new), dim=1)
        got.append(c.step(new))
    torch.testing.assert_close(torch.cat(got, dim=1), model(seq), atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- class 9: refusals


# Each was accepted on main with logits off by the figure in the comment.
MIXERS = {
    # a bag of all tokens: index_select's index is token-valued, so dim 0 of the result is time
    "index_select-token-bag": (lambda m, idx, x, pos: torch.index_select(m.wte.weight, 0, idx[0]).mean(0),
                               "aten.mean", "dim 0"),  # 0.37
    # a bag of all positions: the same with a position-valued index
    "index_select-position-bag": (lambda m, idx, x, pos: m.wpe.weight.index_select(0, pos).sum(0),
                                  "aten.sum", "dim 0"),  # 1.2
    # a constant row expanded to T rows is T rows: its sum over time is T times the row
    "expand-constant-sum": (lambda m, idx, x, pos: m.wpe.weight[:1].expand(idx.size(1), -1).sum(0),
                            "aten.sum", "dim 0"),  # 0.54
    "expand_as-constant-sum": (lambda m, idx, x, pos: m.wpe.weight[:1].expand_as(x).sum(1, keepdim=True),
                               "aten.sum", "dim 1"),  # 0.54
}


@pytest.mark.parametrize("name", list(MIXERS))
def test_reductions_over_time_of_gathered_or_expanded_values_are_refused(name):
    fn, op, dim = MIXERS[name]
    model = Extra(fn)
    idx = torch.randint(0, VOCAB, (2, 5))
    generate_plain(model, idx, 2)  # the model as written runs
    with pytest.raises(PositionError) as info:
        generate(model, idx, 2)
    msg = str(info.value)
    assert op in msg and "test_exact_generation.py:" in msg and f"works along the sequence axis ({dim})" in msg, msg


def test_row_wise_gathers_stay_accepted_and_exact():
    """The same ops read one row per position: accepted, and the cache equals the full recompute."""
    rowwise = [
        lambda m, idx, x, pos: m.wpe.weight.index_select(0, pos),  # a position table by index_select
        lambda m, idx, x, pos: m.wte.weight.index_select(0, idx[0]),  # sequence 0's tokens, broadcast
        lambda m, idx, x, pos: m.wpe.weight[:1].expand_as(x) * 0.5,  # a constant row per position
    ]
    for i, fn in enumerate(rowwise):
        model = Extra(fn)
        c = cached(model)
        _pieces_match(model, c)
        _pieces_match(model, c, prompt=1, steps=(2, 1), batch=1)
        if i == 0:  # a position index bounds the length by the table's rows
            assert any("index_select" in what and rows == 16 for what, rows in c.plan.bounds), c.plan.bounds


# ----------------------------------------------------------------------------- class 10: proof buffers


def _nano(n_layer: int = 2) -> NanoGPT:
    torch.manual_seed(0)
    return NanoGPT(GPTConfig(n_layer=n_layer, n_embd=16, n_head=2, vocab_size=VOCAB, block_size=16)).eval()


def test_causal_buffer_written_in_place_stops_the_cache():
    model = _nano()
    c = cached(model)
    idx = torch.randint(0, VOCAB, (2, 5))
    c.prefill(idx)
    model.h[1].attn.bias.fill_(1)  # the model as written now attends to the future
    assert (model(idx)[:, 0] - c.graph_module(idx, 0)[:, 0]).abs().max() > 1e-3
    with pytest.raises(ModelChangedError, match=r"h\.1\.attn\.bias.*attnopt\.generation\.cached\(model\) again"):
        c.step(torch.randint(0, VOCAB, (2, 1)))
    with pytest.raises(ModelChangedError, match=r"h\.1\.attn\.bias"):
        c.prefill(idx)
    with pytest.raises(ModelChangedError):
        generate(c, idx, 3)
    with pytest.raises(PositionError):  # built again: the model is no longer causal
        cached(model)


def test_in_place_writes_that_keep_the_pattern_keep_the_cache():
    model = _nano()
    c = cached(model)
    bias = model.h[0].attn.bias
    bias.copy_(bias.clone())  # the version moves; the values do not
    model.load_state_dict(model.state_dict())  # copy_ of every tensor, the same values
    _pieces_match(model, c)
    with torch.no_grad():
        model.h[0].mlp.c_fc.weight.mul_(1.5)  # a weight update reaches the cache (shared tensors)
    _pieces_match(model, c, batch=3)


def test_load_state_dict_with_another_mask_stops_the_cache():
    model = _nano()
    c = cached(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["h.0.attn.bias"] = torch.ones_like(state["h.0.attn.bias"])
    model.load_state_dict(state)
    with pytest.raises(ModelChangedError, match=r"h\.0\.attn\.bias"):
        c.prefill(torch.randint(0, VOCAB, (1, 4)))


def test_causal_buffer_registered_again_is_detected():
    """``del m.bias; m.register_buffer('bias', ...)``: another tensor, version 0, maybe at the old address. The
    rewritten graph no longer reads the buffer, so a new one with the proven pattern keeps the cache (and is
    pinned in its turn); one without it stops the cache."""
    model = _nano()
    c = cached(model)
    attn = model.h[0].attn
    t = attn.bias.size(-1)
    for fresh in (torch.tril(torch.ones(t, t)), torch.ones(t, t)):
        del attn.bias
        attn.register_buffer("bias", fresh.view(1, 1, t, t))
        if fresh.sum() < t * t:
            _pieces_match(model, c)
            attn.bias.fill_(1)  # the new buffer is the one pinned now
            with pytest.raises(ModelChangedError, match=r"h\.0\.attn\.bias"):
                c.prefill(torch.randint(0, VOCAB, (1, 4)))
        else:
            with pytest.raises(ModelChangedError, match=r"h\.0\.attn\.bias.*causal pattern"):
                c.prefill(torch.randint(0, VOCAB, (1, 4)))


def test_replaced_weights_are_detected():
    """A parameter replaced by another tensor (``assign=True``, ``m.w = nn.Parameter(...)``) is not the one the
    cached graph reads: the cache refuses instead of computing with the old weights."""
    model = _nano(n_layer=1)
    c = cached(model)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach() * 2)
    with pytest.raises(ModelChangedError, match=r"lm_head\.weight"):
        c.prefill(torch.randint(0, VOCAB, (1, 4)))
    model2 = _nano(n_layer=1)
    c2 = cached(model2)
    model2.load_state_dict({k: v.clone() for k, v in model2.state_dict().items()}, assign=True)
    with pytest.raises(ModelChangedError, match="replaced"):
        c2.prefill(torch.randint(0, VOCAB, (1, 4)))


@pytest.mark.parametrize("name", ["wte", "lm_head"])
def test_untying_tied_weights_is_detected(name):
    """Tied weights (``lm_head.weight = wte.weight``, as nanoGPT and GPT-2 tie them): the graph reads the tensor
    under one name. Replacing it under either name unties the two, which the model as written then computes
    with: the cache refuses."""
    model = _nano(n_layer=1)
    model.lm_head.weight = model.wte.weight
    c = cached(model)
    idx = torch.randint(0, VOCAB, (1, 4))
    generate(c, idx, 2)
    getattr(model, name).weight = torch.nn.Parameter(torch.randn_like(model.wte.weight))
    with pytest.raises(ModelChangedError, match=rf"{name}\.weight"):
        generate(c, idx, 2)


def test_a_forward_that_writes_its_buffers_is_refused():
    """A call counter kept in a buffer (``self.calls += 1``): the logits depend on how often forward ran, which a
    cache that runs new tokens only cannot reproduce. torch.export may list no buffer mutation for it while the
    graph writes the buffer in place, so the graph itself is read."""
    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = _nano(n_layer=1)
            self.register_buffer("calls", torch.zeros(()))
            self.register_buffer("bias", torch.randn(VOCAB))

        def forward(self, idx):
            self.calls += 1
            return self.inner(idx) + self.calls * self.bias

    with pytest.raises(PositionError, match=r"writes its buffers or parameters \(calls\)"):
        cached(Counter().eval())


def test_a_patched_forward_and_a_global_hook_are_detected():
    """A submodule's ``forward`` replaced on the instance, and a hook registered for every module
    (``register_module_forward_hook``), change what the model as written computes: the cache refuses."""
    model = _nano(n_layer=1)
    c = cached(model)
    idx = torch.randint(0, VOCAB, (1, 4))
    generate(c, idx, 2)
    orig = model.h[0].mlp.forward
    model.h[0].mlp.forward = lambda x: orig(x) * 3.0
    with pytest.raises(ModelChangedError, match=r"`h\.0\.mlp\.forward` .* set on the instance"):
        generate(c, idx, 2)
    del model.h[0].mlp.forward  # the class's forward again: the cache serves again
    assert torch.equal(generate(c, idx, 3), generate_plain(model, idx, 3))
    handle = nn.modules.module.register_module_forward_hook(lambda m, args, out: out)
    try:
        with pytest.raises(ModelChangedError, match="_global_forward_hooks"):
            generate(c, idx, 2)
    finally:
        handle.remove()
    assert torch.equal(generate(c, idx, 3), generate_plain(model, idx, 3))


class CumsumMaskAttention(nn.Module):
    """Causal through a mask the symbolic proof cannot read (``tril.cumsum(0) > 0`` is ``tril``), from a buffer."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.register_buffer("tri", torch.tril(torch.ones(16, 16)))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (y.view(b, t, 2, 8).transpose(1, 2) for y in self.qkv(x).split(16, dim=2))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(8))
        att = att.masked_fill(~(self.tri[:t, :t].cumsum(0) > 0), float("-inf"))
        return (F.softmax(att, dim=-1) @ v).transpose(1, 2).reshape(b, t, c)


class OneSite(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.config = GPTConfig(block_size=16, vocab_size=VOCAB, n_embd=16)
        self.wte = nn.Embedding(VOCAB, 16)
        self.mix = CumsumMaskAttention()
        self.head = nn.Linear(16, VOCAB)
        self.eval()

    def forward(self, idx):
        return self.head(self.mix(self.wte(idx)))


def test_a_run_time_mask_check_reads_its_buffer_again_after_a_write():
    """A mask checked causal per (batch, length) is checked again once a buffer it reads changed."""
    model = OneSite()
    c = cached(model)
    assert len(c.mask_checks) == 1
    _pieces_match(model, c)
    model.mix.tri.fill_(1)
    with pytest.raises(ModelChangedError, match=r"`mix\.tri`.*no longer causal for 2 sequence\(s\) of 5 tokens"):
        _pieces_match(model, c)


# ----------------------------------------------------------------------------- the model changed after cached()
# A CachedLM is the model's forward captured once: Python attributes the forward read are constants of the
# graph, the K/V rows of the prefix were computed with the weights of the prefill, and every op was captured
# for the tensors' dtypes and devices. Each test below changed one of these on main, and the CachedLM went
# on returning other logits than the model as written (figures in the comments) or crashed.


class FlagAttention(nn.Module):
    """Self-attention whose forward reads plain attributes: a causal flag, an optional temperature, an output act."""

    def __init__(self, c: int = 16, heads: int = 2):
        super().__init__()
        self.qkv = nn.Linear(c, 3 * c)
        self.heads = heads
        self.causal = True
        self.act = nn.Identity()

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (y.view(b, t, self.heads, c // self.heads).transpose(1, 2) for y in self.qkv(x).split(c, dim=2))
        q = q / getattr(self, "temperature", 1.0)
        att = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(q.size(-1)))
        if self.causal:
            att = att + torch.full((t, t), float("-inf"), device=x.device).triu(1)
        y = F.softmax(att, dim=-1) @ v
        return self.act(y.transpose(1, 2).reshape(b, t, c))


@dataclasses.dataclass
class Extras:
    logit_bias: float = 0.0


class Knobs(NanoGPT):
    """2-layer nanoGPT (dropout 0.1, built in eval mode) with FlagAttention blocks and a float logit scale."""

    def __init__(self):
        torch.manual_seed(0)
        super().__init__(GPTConfig(n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB, block_size=16, dropout=0.1))
        for block in self.h:
            block.attn = FlagAttention()
        self.logit_scale = 1.0
        self.extras = Extras()
        self.eval()

    def forward(self, idx):
        return super().forward(idx) * self.logit_scale + self.extras.logit_bias


@pytest.fixture(scope="module")
def knobs() -> tuple[Knobs, CachedLM]:
    model = Knobs()
    return model, cached(model)


def _set(obj, name, value):
    if value is _GONE:
        delattr(obj, name)
    else:
        setattr(obj, name, value)


_GONE = object()
EDITS = {  # (object of the model, attribute, new value, the path the error names); each was served stale on main
    "float-on-the-model": (lambda m: m, "logit_scale", 3.0, "logit_scale"),  # 3.66
    "bool-flag-of-a-block": (lambda m: m.h[1].attn, "causal", False, r"h\.1\.attn\.causal"),  # 0.0855
    "attribute-added": (lambda m: m.h[0].attn, "temperature", 0.5, r"h\.0\.attn\.temperature"),  # read by getattr
    "config-field": (lambda m: m.extras, "logit_bias", 0.25, r"extras\.logit_bias"),  # a dataclass the model holds
    "module-replaced": (lambda m: m.h[0].attn, "act", nn.Tanh(), r"h\.0\.attn\.act"),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_plain_attributes_the_forward_reads_are_pinned(knobs, edit):
    model, c = knobs
    owner, name, value, path = EDITS[edit]
    obj = owner(model)
    old = getattr(obj, name, _GONE)
    idx = torch.randint(0, VOCAB, (2, 5))
    c.prefill(idx)
    new = torch.randint(0, VOCAB, (2, 1))
    seq = torch.cat((idx, new), dim=1)
    _set(obj, name, value)
    try:
        assert (model(seq) - c.graph_module(seq, 0)).abs().max() > 1e-3  # the model as written now differs
        with pytest.raises(ModelChangedError, match=path + r".*attnopt\.generation\.cached\(model\) again"):
            c.step(new)
        with pytest.raises(ModelChangedError, match=path):
            c.prefill(idx)
    finally:
        _set(obj, name, old)
    _pieces_match(model, c)  # the value restored: the cache serves again


def test_an_equal_value_assigned_again_keeps_the_cache(knobs):
    model, c = knobs
    model.logit_scale = float("1.0")  # another object, the same value
    model.h[0].attn.note = torch.zeros(1)  # a tensor attribute the forward does not read (not a plain value)
    try:
        _pieces_match(model, c)
    finally:
        del model.h[0].attn.note


def test_train_mode_after_cached_is_refused_and_eval_resumes(knobs):
    """Built in eval mode: the model as written applies dropout after .train(), the cache would not."""
    model, c = knobs
    idx = torch.randint(0, VOCAB, (2, 5))
    c.prefill(idx)
    model.train()
    try:
        with pytest.raises(ModelChangedError, match=r"training mode.*dropout.*model\.eval\(\)"):
            c.step(torch.randint(0, VOCAB, (2, 1)))
    finally:
        model.eval()
    _pieces_match(model, c)


@pytest.mark.parametrize("path", ["h.1.attn.qkv.weight", "wte.weight", "lm_head.weight", "h.0.ln_1.bias"])
def test_weights_written_in_place_after_prefill_are_followed(knobs, path):
    """The prefix's cached K and V were computed with the old weights; the model as written recomputes every
    position with the new ones (0.28 for a block's qkv weight, 0.27 for wte.weight on main)."""
    model, c = knobs
    weight = model.get_parameter(path)
    saved = weight.detach().clone()
    idx = torch.randint(0, VOCAB, (2, 5))
    c.prefill(idx)
    try:
        with torch.no_grad():
            weight.mul_(1.5).add_(0.1)
        seq = idx
        for t in (1, 2, 1):  # the first step after the write, then steps over the new cache
            new = torch.randint(0, VOCAB, (2, t))
            seq = torch.cat((seq, new), dim=1)
            torch.testing.assert_close(c.step(new), model(seq)[:, -t:], atol=1e-5, rtol=1e-5)
        assert c.length == seq.size(1)
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    _pieces_match(model, c)


def test_a_weight_write_during_a_refused_step_is_followed_once_the_model_is_back(knobs):
    """Weights written while the model was in training mode (a training step between generations): the refused
    step must not leave the stale keys and values to the next one."""
    model, c = knobs
    weight = model.h[0].attn.qkv.weight
    saved = weight.detach().clone()
    idx = torch.randint(0, VOCAB, (2, 5))
    c.prefill(idx)
    model.train()
    with torch.no_grad():
        weight.mul_(1.5)
    try:
        with pytest.raises(ModelChangedError, match="training mode"):
            c.step(idx[:, :1])
        model.eval()
        new = torch.randint(0, VOCAB, (2, 2))
        torch.testing.assert_close(c.step(new), model(torch.cat((idx, new), dim=1))[:, -2:], atol=1e-5, rtol=1e-5)
    finally:
        model.eval()
        with torch.no_grad():
            weight.copy_(saved)


def test_dtype_changes_are_refused(knobs):
    """``model.double()`` keeps the same tensor objects with other data: on main step() crashed with a dtype
    mismatch deep in the graph. Now prefill and step raise and say to build the cached model again; converted
    back, the same dtypes with new data are served exactly. (A device change is detected alike.)"""
    model, c = knobs
    state = {k: v.clone() for k, v in model.state_dict().items()}
    idx = torch.randint(0, VOCAB, (2, 5))
    try:
        for convert, what in ((nn.Module.double, "torch.float64"), (nn.Module.bfloat16, "torch.bfloat16")):
            c.prefill(idx)
            convert(model)
            with pytest.raises(ModelChangedError, match=r"converted from torch.float32 on cpu to " + what
                               + r".*attnopt\.generation\.cached\(model\) again"):
                c.step(torch.randint(0, VOCAB, (2, 1)))
            with pytest.raises(ModelChangedError, match=what):
                c.prefill(idx)
            model.float().load_state_dict(state)
        _pieces_match(model, c)
    finally:
        model.float().load_state_dict(state)


def test_cached_again_after_a_dtype_change_serves_the_new_dtype():
    model = _nano(n_layer=1).double()
    c = cached(model)
    seq = torch.randint(0, VOCAB, (2, 6))
    out = torch.cat((c.prefill(seq[:, :4]), c.step(seq[:, 4:5]), c.step(seq[:, 5:])), dim=1)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, model(seq), atol=1e-10, rtol=1e-10)
