"""Spellings of position-wise code that real causal LMs use, read by the KV cache's position proof.

Each is taken from a Hugging Face family (named per model) and written here small:

* rotary tables interleaved per pair with ``repeat_interleave`` on the feature axis (GPT-J, CodeGen, Cohere);
* a position table tiled per batch row with ``repeat`` (BLOOM's ALiBi table);
* key and value heads picked from a fused projection with a fixed index, ``x[..., [-2], :]`` (Falcon);
* positions counted from ones, ``ones(B, T).cumsum(1) - 1`` (OPT, from an all-ones ``attention_mask``);
* a fill made a tensor in forward, ``torch.tensor(finfo.min)`` in ``torch.where`` (GPT-Neo), and a floor
  ``torch.max(s, torch.tensor(finfo.min))`` on heads folded into the batch, ``(B*H, T, D)`` with ``bmm`` (XGLM);
* conditions on the length that ``torch.export`` records in other forms than ``T <= n`` (``2 + T <= 34``);
* elementwise ops PyTorch does not tag ``pointwise``: ``a | b``, ``torch.where(m, 0, x)`` (Gemma 4),
  ``torch.polar`` (DeepSeek V2), and ``view_as``;
* ``x.squeeze()`` without dims, refused: at batch 1 or with one new token it would squeeze the batch or the
  sequence axis too.

Each is cached and gives the plain loop's tokens, also for ragged prompts; the same ops across positions
(along the time axis) are refused, naming the op.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from attnopt.generation import PositionError, cached, generate, generate_plain
from attnopt.passes.kv_capture import forward_kwargs, logits_of

V, C, H = 40, 16, 2
D = C // H


def _alone(model, prompts, n):
    return [generate_plain(model, p[None], n)[0] for p in prompts]


def assert_cached_exactly(model, max_len=None):
    """``cached(model)``'s prefill and a step of 3 give the full recompute's logits (a tensor or ``.logits``);
    ``generate`` gives the plain loop's tokens, batched and for ragged prompts (6, 1, 3) each against that prompt
    alone."""
    lm = cached(model, max_len=max_len)
    idx = torch.randint(0, V, (2, 5))
    with torch.no_grad():
        seq = torch.cat((idx, idx[:, :3]), 1)
        full = logits_of(model(seq, **forward_kwargs(model, seq)))  # all-ones attention_mask where forward needs one
        torch.testing.assert_close(lm.prefill(idx), full[:, :5], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lm.step(idx[:, :3]), full[:, 5:], atol=1e-5, rtol=1e-5)
    assert torch.equal(generate(lm, idx, 9), generate_plain(model, idx, 9))
    prompts = [torch.randint(0, V, (n,)) for n in (6, 1, 3)]
    assert all(torch.equal(g, a) for g, a in zip(generate(lm, prompts, 8), _alone(model, prompts, 8)))
    return lm


class Base(nn.Module):
    def __init__(self, block_size: int = 24):
        super().__init__()
        torch.manual_seed(0)
        self.block_size = block_size
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(block_size, C)
        self.qkv, self.proj, self.head = nn.Linear(C, 3 * C), nn.Linear(C, C), nn.Linear(C, V)
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size, dtype=torch.bool)))

    def embed(self, idx):
        return self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))

    def block(self, x):
        q, k, v = self.heads(x)
        return self.head(x + self.merge(self.attend(q, k, v)))

    def attend(self, q, k, v):
        T = q.size(-2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(D)
        att = att.masked_fill(~self.bias[:T, :T], float("-inf")).softmax(-1)
        return att @ v

    def heads(self, x):
        B, T, _ = x.shape
        return [t.view(B, T, H, D).transpose(1, 2) for t in self.qkv(x).split(C, 2)]

    def merge(self, y):
        B, _, T, _ = y.shape
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Interleaved(Base):
    """GPT-J's rotary: sin and cos per pair of features, ``repeat_interleave(2, dim=-1)``."""

    def __init__(self, along_time: bool = False):
        super().__init__()
        self.along_time = along_time
        self.register_buffer("inv", 1.0 / (100 ** (torch.arange(0, D, 2).float() / D)))

    def rotate(self, x, sin, cos):
        pairs = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
        return x * cos + pairs * sin

    def forward(self, idx):
        B, T = idx.shape
        x = self.wte(idx)
        freqs = torch.arange(T, device=idx.device).float()[:, None] * self.inv  # (T, D/2)
        sin, cos = freqs.sin().repeat_interleave(2, dim=-1), freqs.cos().repeat_interleave(2, dim=-1)
        if self.along_time:
            x = x.repeat_interleave(2, dim=1)[:, 1::2]  # each position twice, then every other one: mixes times
        q, k, v = self.heads(x)
        q, k = self.rotate(q, sin, cos), self.rotate(k, sin, cos)
        return self.head(x + self.merge(self.attend(q, k, v)))


class Tiled(Base):
    """A position table tiled per batch row with ``repeat`` (BLOOM's ALiBi table ``(H, 1, T).repeat(B, 1, 1)``)."""

    def __init__(self, along_time: bool = False):
        super().__init__()
        self.along_time = along_time

    def forward(self, idx):
        B, T = idx.shape
        pe = self.wpe(torch.arange(T, device=idx.device))[None].repeat(B, 1, 1)  # (B, T, C)
        x = self.wte(idx) + pe
        if self.along_time:
            x = x + x.repeat(1, 2, 1)[:, T:]  # the sequence tiled twice along time
        return self.block(x)


class PickedHeads(Base):
    """Falcon's multi-query split: a fused projection viewed ``(B, T, H + 2, D)``, queries ``[..., :-2, :]``, the
    key and value heads by a fixed index ``[..., [-2], :]`` and ``[..., [-1], :]``."""

    def __init__(self):
        super().__init__()
        self.fused = nn.Linear(C, (H + 2) * D)

    def forward(self, idx):
        B, T = idx.shape
        x = self.embed(idx)
        f = self.fused(x).view(B, T, H + 2, D)
        q, k, v = f[..., :-2, :], f[..., [-2], :], f[..., [-1], :]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2).expand(B, H, T, D), v.transpose(1, 2).expand(B, H, T, D)
        return self.head(x + self.merge(self.attend(q, k, v)))


class Counted(Base):
    """OPT's positions: ``cumsum`` of an all-ones mask (built in forward, or the ``attention_mask`` it requires)
    along time, minus one, as indices of a learned table (with OPT's offset of 2)."""

    def __init__(self, takes_mask: bool = False, dtype: torch.dtype = torch.float32, ones: float = 1.0):
        super().__init__()
        self.dtype, self.ones = dtype, ones
        self.wpe = nn.Embedding(26, C)
        if takes_mask:
            self.forward = self.forward_with_mask  # type: ignore[method-assign]

    def embed(self, idx, mask):
        pos = (torch.cumsum(mask, dim=1) * mask - 1).long()
        x = self.wte(idx) + self.wpe(pos + 2)
        return self.block(x)

    def forward(self, idx):
        B, T = idx.shape
        return self.embed(idx, torch.full((B, T), self.ones, dtype=self.dtype, device=idx.device))

    def forward_with_mask(self, idx, attention_mask):
        return self.embed(idx, attention_mask)


class FoldedHeads(Base):
    """XGLM's attention: heads folded into the batch, ``bmm`` on ``(B*H, T, D)``, a causal mask filled with
    ``torch.tensor(finfo.min)`` in ``torch.where`` (GPT-Neo) and the scores floored at the minimum with
    ``torch.max(s, torch.tensor(finfo.min))``; and a length check ``if T + 2 > 34: raise``."""


    def forward(self, idx):
        B, T = idx.shape
        if T + 2 > 34:
            raise ValueError("too long")
        x = self.embed(idx)
        q, k, v = (t.view(B, T, H, D).transpose(1, 2).reshape(B * H, T, D) for t in self.qkv(x).split(C, 2))
        s = torch.bmm(q, k.transpose(1, 2)).view(B, H, T, T) / math.sqrt(D)
        s = torch.where(self.bias[:T, :T], s, torch.tensor(torch.finfo(s.dtype).min))
        s = torch.max(s, torch.tensor(torch.finfo(s.dtype).min))
        y = torch.bmm(s.view(B * H, T, T).softmax(-1), v).view(B, H, T, D)
        return self.head(x + self.merge(y))


class Untagged(Base):
    """Elementwise ops PyTorch does not tag pointwise: ``a | b`` of masks and ``torch.where(m, scalar, x)``
    (Gemma 4 pads placeholder ids so), ``torch.polar`` of rotary angles (DeepSeek V2); and ``view_as``."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv", 1.0 / (100 ** (torch.arange(0, D, 2).float() / D)))

    def forward(self, idx):
        idx = torch.where((idx == 3) | (idx == 5), 0, idx)
        x = self.embed(idx)
        angles = torch.arange(idx.size(1), dtype=torch.float32)[:, None] * self.inv
        rot = torch.polar(torch.ones_like(angles), angles)

        def rope(t):
            pairs = torch.view_as_complex(t.reshape(*t.shape[:-1], -1, 2))
            return torch.view_as_real(pairs * rot).view_as(t)

        q, k, v = self.heads(x)
        return self.head(x + self.merge(self.attend(rope(q), rope(k), v)))


class PostMasked(Base):
    """The scores masked, and the probabilities zeroed again on the same condition (``masked_fill(m, 0)`` after the
    softmax): the rewrite zeroes rows with every key hidden, which a causal mask never has."""

    def attend(self, q, k, v):
        T = q.size(-2)
        hidden = ~self.bias[:T, :T]
        att = ((q @ k.transpose(-2, -1)) / math.sqrt(D)).masked_fill(hidden, float("-inf")).softmax(-1)
        return att.masked_fill(hidden, 0.0) @ v

    def forward(self, idx):
        return self.block(self.embed(idx))


class GradModeBlock(Base):
    """A ``with torch.enable_grad():`` (or ``no_grad``) block in forward, which export keeps as a higher-order op
    around its body: grad mode changes no value, so the block is read as its body."""

    def __init__(self, mode: str = "enable_grad"):
        super().__init__()
        self.mode = mode

    def forward(self, idx):
        x = self.embed(idx)
        with getattr(torch, self.mode)():
            x = x * 3 + 1
        return self.block(x)


@pytest.mark.parametrize("model", [Interleaved(), Tiled(), PickedHeads(), Counted(), Counted(takes_mask=True),
                                   Counted(dtype=torch.long), FoldedHeads(), Untagged(), PostMasked(),
                                   GradModeBlock(), GradModeBlock("no_grad")],
                         ids=["repeat_interleave", "repeat", "fixed-index", "cumsum-of-ones", "cumsum-of-the-mask",
                              "cumsum-of-long-ones", "folded-heads", "untagged-elementwise", "masked-again-after",
                              "enable-grad-block", "no-grad-block"])
def test_position_wise_spellings_are_cached_exactly(model):
    assert_cached_exactly(model.eval())


@pytest.mark.parametrize("model, op, why", [
    (Interleaved(along_time=True), "aten.repeat_interleave", "repeats along the sequence axis (dim 1)"),
    (Tiled(along_time=True), "aten.repeat", "repeats along the sequence axis"),
    (Counted(ones=2.0), "aten.cumsum", "works along the sequence axis"),
], ids=["repeat_interleave-along-time", "repeat-along-time", "cumsum-of-twos"])
def test_the_same_ops_across_positions_are_refused(model, op, why):
    with pytest.raises(PositionError) as info:
        cached(model.eval())
    msg = str(info.value)
    assert op in msg and why in msg and "test_generation_spellings.py:" in msg, msg


class Squeezed(Base):
    def forward(self, idx):
        x = self.embed(idx)
        return self.block(x + self.qkv(x)[..., :1].squeeze().unsqueeze(-1))


def test_squeeze_without_dims_is_refused():
    """At one new token the sequence axis has size 1: ``squeeze()`` would drop it there, and only there."""
    with pytest.raises(PositionError, match=r"aten.squeeze at test_generation_spellings.py:\d+ squeezes an axis whose "
                                            r"size is not fixed"):
        cached(Squeezed().eval())


def test_a_count_of_ones_in_a_half_type_bounds_max_len():
    """bf16 holds every whole number only up to 256: the count is exact that far, and max_len says so."""
    model = Counted(dtype=torch.bfloat16).eval()
    model.wpe = nn.Embedding(300, C)
    model.bias = torch.tril(torch.ones(300, 300, dtype=torch.bool))
    lm = cached(model)
    assert lm.max_len == 256 and "bfloat16 (exact up to 256)" in lm.max_len_source
    idx = torch.randint(0, V, (1, 4))
    assert torch.equal(generate(lm, idx, 5), generate_plain(model, idx, 5))


def test_a_length_check_in_another_form_becomes_max_len():
    """``if T + 2 > 34: raise`` is recorded as ``2 + T <= 34``: evaluated at every length, a bound of 32."""
    model = FoldedHeads().eval()
    model.wpe = nn.Embedding(40, C)
    model.bias = torch.tril(torch.ones(40, 40, dtype=torch.bool))
    lm = cached(model)
    assert lm.max_len == 32 and "`2 + L['idx'].size()[1] <= 34`" in lm.max_len_source, lm.max_len_source
    with pytest.raises(ValueError, match="more than max_len=32"):
        generate(lm, torch.randint(0, V, (1, 30)), 4)


class Branchy(Base):
    """A branch on the length export records as a condition: at one length (compared), or at many (refused)."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how

    def forward(self, idx):
        B, T = idx.shape
        x = self.embed(idx)
        if self.how == "seven" and T != 7:
            x = x * 1.0  # the same values either way: the probe at length 7 agrees
        if self.how == "seven-differs" and T != 7:
            x = x * 2.0
        if self.how == "thirds" and T % 3 == 0:
            x = x * 2.0
        return self.block(x)


def test_a_single_excluded_length_is_compared_and_many_are_refused():
    model = Branchy("seven").eval()
    lm = cached(model)
    idx = torch.randint(0, V, (1, 3))
    assert torch.equal(generate(lm, idx, 8), generate_plain(model, idx, 8))
    with pytest.raises(PositionError, match="differs from the model as written on a prompt of 7 token"):
        cached(Branchy("seven-differs").eval())
    with pytest.raises(PositionError, match=r"another path at 21845 lengths \(3, 6, 9, 12, 15, 18, 21, 24, \.\.\.\)"):
        cached(Branchy("thirds").eval())


class RowsFolded(Base):
    """Causal attention whose scores are viewed ``(B*H*T, T)`` around the softmax: a spelling the site finder
    leaves alone, so the cache cannot serve it; the refusal says which attention and why."""


    def forward(self, idx):
        B, T = idx.shape
        x = self.embed(idx)
        q, k, v = self.heads(x)
        att = ((q @ k.transpose(-2, -1)) / math.sqrt(D)).masked_fill(~self.bias[:T, :T], float("-inf"))
        att = att.reshape(B * H * T, T).softmax(-1).view(B, H, T, T)
        return self.head(x + self.merge(att @ v))


def test_an_attention_left_alone_is_named_with_its_reason():
    with pytest.raises(PositionError, match=r"aten.matmul at test_generation_spellings.py:\d+ mixes positions.*; it is "
                                            r"part of the attention site0 \(.*\), which attnopt left alone: .+"):
        cached(RowsFolded().eval())


def test_a_padding_token_outside_the_vocabulary_says_so():
    model = Interleaved().eval()
    with pytest.raises(ValueError, match=f"pad_token_id=500 is not a token of the model's vocabulary of {V}"):
        generate(model, torch.randint(0, V, (2, 3)), 4, eos_token_id=3, pad_token_id=500)


def test_max_len_from_the_text_config_of_a_composite_config():
    """Gemma 3's causal LM holds a composite config; its text config has the number of positions."""
    import types

    from attnopt.passes.kv_capture import config_max

    model = nn.Module()
    text = types.SimpleNamespace(max_position_embeddings=12)
    model.config = types.SimpleNamespace(get_text_config=lambda: text)
    assert config_max(model) == 12
    model.config = types.SimpleNamespace(max_position_embeddings=20, get_text_config=lambda: text)
    assert config_max(model) == 20  # its own first

    def ambiguous():  # Hugging Face's, for a config with several candidate text configs
        raise ValueError("Multiple valid text configs were found in the model config")

    model.config = types.SimpleNamespace(max_position_embeddings=20, get_text_config=ambiguous)
    assert config_max(model) == 20  # the top-level config's, not the error


class SoftCapped(Base):
    """Gemma 2's soft-cap on the scores, ``30 * tanh(s / 30)``: elementwise, so the cache applies it as written."""


    def attend(self, q, k, v):
        T = q.size(-2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(D) * 40.0  # large scores: the cap changes them
        att = torch.tanh(att / 30.0) * 30.0
        att = att.masked_fill(~self.bias[:T, :T], float("-inf")).softmax(-1)
        return att @ v

    def forward(self, idx):
        B, T = idx.shape
        x = self.embed(idx)
        return self.block(x)


@pytest.mark.parametrize("variant", ["sdpa", "tiled128"])
def test_a_soft_capped_score_is_cached_with_its_cap(variant):
    """SDPA cannot apply the cap: a fixed ``sdpa`` gives way to ``math``; a candidate that can keeps it."""
    model = SoftCapped().eval()
    lm = cached(model, variant=variant)
    assert all(s.score_mod is not None for s in lm.sites) and "tanh" in lm.describe()
    assert all(s.candidate == ("math" if variant == "sdpa" else variant) for s in lm.sites)
    idx = torch.randint(0, V, (2, 5))
    assert torch.equal(generate(lm, idx, 9), generate_plain(model, idx, 9))
    prompts = [torch.randint(0, V, (n,)) for n in (6, 1, 3)]
    assert all(torch.equal(g, a) for g, a in zip(generate(lm, prompts, 8), _alone(model, prompts, 8)))


class InPlace(Base):
    """Writes in place through a view: the tensor viewed is read through its own node, which the write's node
    does not reach, so the proof must not miss what the write adds (an OPT-style count made of a tensor of
    ones masked in place; a cumsum over time added into a clone through a view)."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.wpe = nn.Embedding(26, C)
        gate = torch.zeros(24)
        gate[4:] = 1.0  # zero for the lengths the small-size probe compares: only the proof can see it
        self.register_buffer("gate", gate)

    def forward(self, idx):
        B, T = idx.shape
        if self.how == "masked-ones":
            m = torch.ones(B, T, dtype=torch.long, device=idx.device)
            m[:, :] *= (idx != 0).long()  # no longer ones everywhere
            x = self.wte(idx) + self.wpe(m.cumsum(1) * m)
        else:
            x = self.embed(idx)
            y = x.clone()
            y.view(B, T, C).add_(x.cumsum(1) * self.gate[:T, None])
            x = y
        return self.block(x)


@pytest.mark.parametrize("how, why", [
    ("masked-ones", r"aten.copy_ at test_generation_spellings.py:\d+ is not known to act on each position"),
    ("added-through-a-view", r"aten.cumsum at test_generation_spellings.py:\d+ works along the sequence axis"),
])
def test_writes_in_place_through_a_view_are_not_missed(how, why):
    with pytest.raises(PositionError, match=why):
        cached(InPlace(how).eval())


class HiddenAlias(Base):
    """Ops whose result is a view their schema does not declare (``einsum("vc->vc", t)``, ``_unsafe_view``): a
    write through one reaches the tensor viewed; and a scale computed from the length as a plain number."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.register_buffer("tab", torch.randn(V, C) * 0.3)

    def forward(self, idx):
        B, T = idx.shape
        x = self.embed(idx)
        if self.how in ("einsum", "unsafe_view"):
            tab = self.tab * 1.0  # made in forward, then written through a view no schema declares
            d = torch.einsum("vc->vc", tab) if self.how == "einsum" else torch.ops.aten._unsafe_view(tab, [V, C])
            d[:T].add_(x.mean(0))  # rows 0..T-1 of tab: position t's data, read below by token id
            x = x + nn.functional.embedding(idx, tab)
        elif self.how in ("buffer", "buffer-type-as"):  # the buffer itself, written at every call
            if self.how == "buffer":
                torch.einsum("vc->vc", self.tab)[:T].mul_(0.5)
            else:
                self.tab.type_as(x).mul_(0.5)  # the same tensor when the dtypes agree
            x = x + nn.functional.embedding(idx, self.tab)
        return self.block(x)

    def attend(self, q, k, v):
        if self.how != "length-scale":
            return super().attend(q, k, v)
        T = q.size(-2)
        att = (q @ k.transpose(-2, -1)) / torch.sym_max(T, 8)  # the same at every length the probe runs (< 8)
        return att.masked_fill(~self.bias[:T, :T], float("-inf")).softmax(-1) @ v


@pytest.mark.parametrize("how, why", [
    ("einsum", r"aten.add_ at test_generation_spellings.py:\d+ writes in place into a view of another tensor"),
    ("unsafe_view", r"aten.add_ at test_generation_spellings.py:\d+ writes in place into a view of another tensor"),
    ("buffer", r"writes its buffers or parameters \(tab\)"),
    ("buffer-type-as", r"writes its buffers or parameters \(tab\)"),
    ("length-scale", r"uses the sequence length \(in `\w+`\) as a value"),
])
def test_aliases_no_schema_declares_and_a_scale_from_the_length_are_refused(how, why):
    model = HiddenAlias(how).eval()
    before = model.tab.clone()
    with pytest.raises(PositionError, match=why):
        cached(model)
    assert torch.equal(model.tab, before)  # refused before any run of the model


class RaisesShort(Base):
    def forward(self, idx):
        B, T = idx.shape
        if 12 // (T - 1) > 2:  # the model as written cannot run on one token
            idx = idx * 1
        x = self.wte(idx)
        return self.block(x)


def test_a_model_that_raises_at_a_probed_size_is_refused_saying_so():
    model = RaisesShort()
    model.config = type("Config", (), {"max_position_embeddings": 24})()
    with pytest.raises(PositionError, match="as written raises ZeroDivisionError.* on 1 token"):
        cached(model.eval())


class BatchAndLength(Base):
    def __init__(self, how: str):
        super().__init__()
        self.how = how

    def forward(self, idx):
        B, T = idx.shape
        x = self.embed(idx)
        if (self.how == "batch" and B == 3 and T > 1) or (self.how == "length" and T == 7 and B > 1):
            x = x * 2
        return self.block(x)


@pytest.mark.parametrize("how, where", [("batch", "2 token.* at batch 3"), ("length", "7 token.* at batch 2")])
def test_an_excluded_size_is_compared_at_two_values_of_the_other(how, where):
    with pytest.raises(PositionError, match=f"differs from the model as written on a prompt of {where}"):
        cached(BatchAndLength(how).eval())


SCALE = 1.0


def _scaled(x):
    return x * SCALE


class Parent(Base):
    def forward(self, idx):
        x = self.wte(idx) * SCALE
        return self.block(x)


class Child(Parent):
    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.act = _scaled

    def forward(self, idx):
        out = super().forward(idx)
        return self.act(out) if self.how == "function" else out


@pytest.mark.parametrize("how", ["super", "function"])
def test_globals_read_by_a_base_forward_or_a_held_function_are_watched(how, monkeypatch):
    from attnopt.generation import ModelChangedError

    model = Child(how).eval()
    lm = cached(model)
    idx = torch.randint(0, V, (1, 3))
    lm.prefill(idx)
    monkeypatch.setitem(globals(), "SCALE", -2.0)
    with pytest.raises(ModelChangedError, match="SCALE"):
        lm.step(idx[:, :1])
    assert torch.equal(generate(model, idx, 4), generate_plain(model, idx, 4))


class Assembled(Base):
    """DeepSeek's and MiniCPM3's keys put together in a tensor made empty in forward: ``k = q.new_empty(...)``,
    ``k[..., :a].copy_(x)``, ``k[..., a:].copy_(y)``. ``shift=True`` writes each position one step later (a
    slice of the time axis), which mixes positions."""

    def __init__(self, shift: bool = False):
        super().__init__()
        self.shift = shift

    def forward(self, idx):
        B, T = idx.shape
        x = self.embed(idx)
        q, k, v = self.heads(x)
        keys = k.new_empty(B, H, T, D) if not self.shift else k.new_zeros(B, H, T, D)
        if self.shift:
            keys[:, :, 1:].copy_(k[:, :, :-1])
        else:
            keys[..., : D // 2].copy_(k[..., : D // 2] * 2)
            keys[..., D // 2:].copy_(k[..., D // 2:])
        return self.head(x + self.merge(self.attend(q, keys, v)))


def test_slices_written_into_a_fresh_tensor_are_followed():
    model = Assembled().eval()
    lm = cached(model)
    idx = torch.randint(0, V, (2, 5))
    assert torch.equal(generate(lm, idx, 9), generate_plain(model, idx, 9))
    prompts = [torch.randint(0, V, (n,)) for n in (6, 1, 3)]
    assert all(torch.equal(g, a) for g, a in zip(generate(lm, prompts, 8), _alone(model, prompts, 8)))
    with pytest.raises(PositionError, match=r"aten.slice at test_generation_spellings.py:\d+ slices the sequence "
                                            r"axis"):  # the slice written into, reached through the write
        cached(Assembled(shift=True).eval())


class ViewedBeforeWritten(Assembled):
    """A view of the fresh tensor taken before the writes and read after them reads the written tokens: it
    is not followed (the view's kind was set before the writes), so the model is refused."""

    def forward(self, idx):
        B, T = idx.shape
        x = self.embed(idx)
        q, k, v = self.heads(x)
        keys = k.new_zeros(B, H, T, D)
        early = keys.view(B, H, T, D)
        keys[..., : D // 2].copy_(k[..., : D // 2])
        keys[..., D // 2:].copy_(k[..., D // 2:])
        return self.head(x + self.merge(self.attend(q, early, v)))


def test_a_view_taken_before_the_writes_is_not_followed():
    with pytest.raises(PositionError, match="writes in place into a view"):
        cached(ViewedBeforeWritten().eval())


class WrittenMask(Base):
    """A key mask that depends on the tokens, written into a slice of a fresh tensor (``copy_``), or a table
    written through ``out=`` into a view of a buffer and then summed over time: both mix positions where only
    the writes show it (from position 4 on: beyond the lengths the small-size probe compares)."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how

    def forward(self, idx):
        B, T = idx.shape
        x = self.embed(idx)
        q, k, v = self.heads(x)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(D)
        att = att.masked_fill(~self.bias[:T, :T], float("-inf"))
        if self.how == "mask":
            keys = torch.zeros(B, T, 2, device=idx.device)
            late = (torch.arange(T, device=idx.device) >= 4)[None, :]
            keys[..., :1].copy_(((idx == 7).float() * late.float())[..., None])
            att = att.masked_fill(keys[..., 0].bool()[:, None, None, :] & ~torch.eye(T, dtype=torch.bool),
                                  float("-inf"))
        y = self.merge(att.softmax(-1) @ v)
        if self.how == "out":
            buf = torch.zeros(24, C)
            torch.mul(x[0].detach(), 1.0, out=buf[:T])
            y = y + buf[4:].sum(0)
        return self.head(x + y)


@pytest.mark.parametrize("how, why", [("mask", "its mask depends on the token values"),
                                      ("out", "aten.mul at .* writes in place into a view")])
def test_what_is_written_into_a_mask_or_through_out_is_seen(how, why):
    with pytest.raises(PositionError, match=why):
        cached(WrittenMask(how).eval())
