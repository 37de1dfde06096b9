"""KV-cached generation: same logits and tokens as the full-recompute loop, and refusals that name the op."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from llama_style import LlamaConfig, LlamaStyle

from attnopt import generation
from attnopt.generation import CachedLM, PositionError, cached, generate, generate_plain
from attnopt.models import GPTConfig, NanoGPT

VOCAB = 64


def _nanogpt(**kw) -> NanoGPT:
    torch.manual_seed(0)
    cfg = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, block_size=24)
    cfg.update(kw)
    return NanoGPT(GPTConfig(**cfg)).eval()


def _llama(**kw) -> LlamaStyle:
    torch.manual_seed(0)
    return LlamaStyle(LlamaConfig(**kw)).eval()


@pytest.fixture(scope="module")
def nano() -> tuple[NanoGPT, CachedLM]:
    model = _nanogpt()
    return model, cached(model)


@pytest.fixture(scope="module")
def llama() -> tuple[LlamaStyle, CachedLM]:
    model = _llama()
    return model, cached(model)


@pytest.fixture(params=["nanogpt", "llama-gqa"])
def lm(request, nano, llama) -> tuple[nn.Module, CachedLM]:
    return nano if request.param == "nanogpt" else llama


# ----------------------------------------------------------------------------- exactness


def test_prefill_and_steps_match_the_full_recompute(lm):
    model, c = lm
    idx = torch.randint(0, VOCAB, (3, 5))
    torch.testing.assert_close(c.prefill(idx), model(idx), atol=1e-5, rtol=1e-5)
    seq = idx
    for t in (1, 3, 1, 2):  # one token (no mask), several (bottom-right mask), again one
        new = torch.randint(0, VOCAB, (3, t))
        seq = torch.cat((seq, new), dim=1)
        torch.testing.assert_close(c.step(new), model(seq)[:, -t:], atol=1e-5, rtol=1e-5)
    assert c.length == seq.size(1) == 12


@given(chunks=st.lists(st.integers(1, 5), min_size=1, max_size=6), batch=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_any_split_into_prefill_and_steps_gives_the_full_logits(nano, chunks, batch, seed):
    """Feeding a sequence in arbitrary pieces (first piece = prefill) equals one forward over all of it."""
    model, c = nano
    seq = torch.randint(0, VOCAB, (batch, sum(chunks)), generator=torch.Generator().manual_seed(seed))
    pieces, start = [], 0
    for i, n in enumerate(chunks):
        piece = seq[:, start:start + n]
        pieces.append(c.prefill(piece) if i == 0 else c.step(piece))
        start += n
    torch.testing.assert_close(torch.cat(pieces, dim=1), model(seq), atol=1e-5, rtol=1e-5)


def test_greedy_tokens_equal_the_plain_loop(lm):
    model, c = lm
    idx = torch.randint(0, VOCAB, (2, 4))
    out = generate(c, idx, 15)
    assert out.shape == (2, 19) and torch.equal(out[:, :4], idx)
    assert torch.equal(out, generate_plain(model, idx, 15))


def test_seeded_sampling_equals_the_plain_loop(lm):
    model, c = lm
    idx = torch.randint(0, VOCAB, (2, 3))
    kw = dict(do_sample=True, temperature=1.3, top_k=20)
    got = generate(c, idx, 16, generator=torch.Generator().manual_seed(7), **kw)
    ref = generate_plain(model, idx, 16, generator=torch.Generator().manual_seed(7), **kw)
    other = generate_plain(model, idx, 16, generator=torch.Generator().manual_seed(8), **kw)
    assert torch.equal(got, ref)
    assert not torch.equal(ref, other)  # the samples do depend on the generator


def test_auto_variant_tunes_prefill_and_decode_shapes_and_keeps_the_tokens():
    model = _nanogpt()
    idx = torch.randint(0, VOCAB, (2, 5))
    c = cached(model, variant="auto")
    assert torch.equal(generate(c, idx, 6), generate_plain(model, idx, 6))
    keys = [k for s in c.sites for k in s.tuning]
    assert {k.tq for k in keys} == {8, 1}  # the prefill (5 -> bucket 8) and the one-token steps
    assert all(e.choice in e.timings_ms for s in c.sites for e in s.tuning.values())
    m = cached(model, variant="math")
    assert torch.equal(generate(m, idx, 6), generate_plain(model, idx, 6))
    with pytest.raises(ValueError, match="unknown candidate 'fastest'"):
        cached(model, variant="fastest")


def test_compiled_cache_gives_the_same_tokens():
    model = _nanogpt()
    idx = torch.randint(0, VOCAB, (2, 5))
    c = cached(model, compile=True)
    assert torch.equal(generate(c, idx, 5), generate_plain(model, idx, 5))
    with pytest.raises(ValueError, match="compile=True needs a fixed candidate"):
        cached(model, variant="auto", compile=True)


def test_compiled_cache_keeps_one_graph_across_batch_sizes():
    """The K/V caches are module attributes, which dynamo takes as static: without marking their batch axis
    dynamic, the second batch size compiled the step again."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from attnopt.pipeline.kv import _dynamic_batch

    model = _nanogpt()
    c = cached(model)
    counter = CompileCounterWithBackend("aot_eager")  # (dynamo alone does not specialise the batch; AOT does)
    torch._dynamo.reset()
    c.run = _dynamic_batch(torch.compile(c.graph_module, dynamic=True, backend=counter), c.sites)
    counts = []
    for b, t in [(2, 5), (3, 5), (4, 7), (2, 3)]:
        idx = torch.randint(0, VOCAB, (b, t))
        assert torch.equal(generate(c, idx, 3), generate_plain(model, idx, 3))
        counts.append(counter.frame_count)
    assert counts == counts[:1] * 4  # the first batch's graphs serve the others (unmarked: one more compile)


def test_the_step_graph_reads_the_models_own_tensors_and_sites():
    """``cached`` runs a copy of the graph whose tensors sit in its instance dict (fewer lookups per step): the
    same objects as the capture's, the same KV-cache sites, so a weight written in place is seen."""
    model = _nanogpt()
    c = cached(model)
    gm, run = c.graph_module, c.run
    assert run is not gm and run.graph is not gm.graph
    for node in (n for n in run.graph.nodes if n.op == "get_attr"):
        assert node.target in vars(run)  # found without nn.Module.__getattr__
    got = {id(getattr(run, n.target)) for n in run.graph.nodes if n.op == "get_attr"}
    want = set()
    for n in (n for n in gm.graph.nodes if n.op == "get_attr"):
        obj = gm
        for part in str(n.target).split("."):
            obj = getattr(obj, part)
        want.add(id(obj))
    assert got == want
    assert [run.get_submodule(n.target) for n in run.graph.nodes if n.op == "call_module"] == \
        [gm.get_submodule(n.target) for n in gm.graph.nodes if n.op == "call_module"]
    idx = torch.randint(0, VOCAB, (2, 5))
    assert torch.equal(generate(c, idx, 4), generate_plain(model, idx, 4))
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)  # written in place, read by the step graph
    assert torch.equal(generate(c, idx, 4), generate_plain(model, idx, 4))


@pytest.mark.parametrize("window", [None, 4])
def test_cached_graph_traces_in_one_piece(window):
    """The compiled step is one graph: a site that dynamo cannot trace through (a graph break at each of
    them, then the recompile limit) would leave ``compile=True`` slower than the eager cache. Both the
    prefix cache and the sliding window's ring."""
    torch.manual_seed(0)
    model = _nanogpt() if window is None else TinyLM(MaskedAttention(window=window), block_size=24).eval()
    idx = torch.randint(0, VOCAB, (2, 5))
    c = cached(model)
    assert [s.window for s in c.sites] == [window] * len(c.sites)
    c.run = torch.compile(c.graph_module, dynamic=True, fullgraph=True, backend="eager")  # raises on a break
    assert torch.equal(generate(c, idx, 5), generate_plain(model, idx, 5))


def test_generate_from_a_module_and_batch_of_one():
    model = _llama(rope_tables=False)  # rotary angles computed from arange(T) in forward
    idx = torch.randint(0, VOCAB, (1, 6))
    assert torch.equal(generate(model, idx, 10), generate_plain(model, idx, 10))


def test_nanogpt_tuple_output_is_read_as_logits():
    class WithLoss(NanoGPT):
        def forward(self, idx):
            return super().forward(idx), None

    torch.manual_seed(0)
    model = WithLoss(GPTConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, block_size=16)).eval()
    idx = torch.randint(0, VOCAB, (2, 4))
    assert torch.equal(generate(model, idx, 6), generate_plain(model, idx, 6))


# ----------------------------------------------------------------------------- cache and limits


def test_cache_memory_and_gqa_heads(nano, llama):
    (_, c_nano), (llama_model, c_llama) = nano, llama
    assert c_nano.bytes_per_token == 2 * 2 * 32 * 4  # layers * (K + V) * C * fp32
    cfg = llama_model.cfg
    assert c_llama.bytes_per_token == cfg.n_layers * 2 * cfg.n_kv_heads * (cfg.dim // cfg.n_heads) * 4
    c_llama.prefill(torch.randint(0, VOCAB, (3, 4)))
    assert c_llama.sites[0].k_cache.shape == (3, cfg.n_kv_heads, cfg.max_seq_len, cfg.dim // cfg.n_heads)
    assert c_llama.cache_bytes == 3 * cfg.max_seq_len * c_llama.bytes_per_token
    text = c_llama.describe()
    assert "2 attention site(s)" in text and "GQA" in text and f"{c_llama.bytes_per_token} B" in text


def test_max_len_found_in_the_model_and_enforced(nano, llama):
    (_, c_nano), (_, c_llama) = nano, llama
    assert c_nano.max_len == 24 and c_llama.max_len == 48
    c_nano.prefill(torch.randint(0, VOCAB, (1, 20)))
    with pytest.raises(ValueError, match="exceed max_len=24"):
        c_nano.step(torch.randint(0, VOCAB, (1, 5)))
    with pytest.raises(ValueError, match="exceed max_len=24"):
        c_nano.prefill(torch.randint(0, VOCAB, (1, 25)))
    with pytest.raises(ValueError, match="needs 30 positions, more than max_len=24"):
        generate(c_nano, torch.randint(0, VOCAB, (1, 10)), 21)


def test_max_len_beyond_a_position_table_is_refused():
    model = _nanogpt(n_layer=1)
    with pytest.raises(ValueError, match=r"max_len=40 exceeds .* 24 positions"):
        cached(model, max_len=40)
    assert cached(model, max_len=10).max_len == 10


def test_bad_calls_say_what_to_do(nano):
    model, c = nano
    c.reset()
    with pytest.raises(RuntimeError, match="call prefill"):
        c.step(torch.zeros(1, 1, dtype=torch.long))
    c.prefill(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="batch size 1 but the cached sequences 2"):
        c.step(torch.zeros(1, 1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"add a batch dim"):
        generate(c, torch.zeros(5, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="temperature"):
        generate(c, torch.zeros(1, 3, dtype=torch.long), 3, do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="top_k"):
        generate_plain(model, torch.zeros(1, 3, dtype=torch.long), 3, top_k=0)
    with pytest.raises(TypeError, match="nn.Module"):
        cached(lambda idx: idx)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- refusals


class TinyLM(nn.Module):
    """Embeddings, one op under test, a head: the op decides whether a cache is exact."""

    def __init__(self, mix: nn.Module, block_size: int = 16):
        super().__init__()
        self.config = GPTConfig(block_size=block_size, vocab_size=VOCAB, n_embd=16)
        self.wte = nn.Embedding(VOCAB, 16)
        self.mix = mix
        self.head = nn.Linear(16, VOCAB)

    def forward(self, idx):
        return self.head(self.mix(self.wte(idx)))


class CausalConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(16, 16, kernel_size=3, padding=2)

    def forward(self, x):
        t = x.size(1)
        return self.conv(x.transpose(1, 2))[:, :, :t].transpose(1, 2)


class Cumsum(nn.Module):
    def forward(self, x):
        return x.cumsum(dim=1)


class MeanPool(nn.Module):
    def forward(self, x):
        return x - x.mean(dim=1, keepdim=True)


class ByLength(nn.Module):
    def forward(self, x):
        return x / x.size(1)


class Bidirectional(nn.Module):
    """nanoGPT's attention without its causal mask."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (y.view(b, t, 2, 8).transpose(1, 2) for y in self.qkv(x).split(16, dim=2))
        att = F.softmax((q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(8)), dim=-1)
        return (att @ v).transpose(1, 2).reshape(b, t, c)


class RollAll(nn.Module):
    def forward(self, x):
        return x + x.roll(1)  # no dims: rolls the flattened tensor, across positions


class ExpandedCumsum(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.randn(16))

    def forward(self, x):
        return x + 0.1 * self.b.expand(x.size(1), 16).cumsum(0)  # a constant, accumulated over time


@pytest.mark.parametrize("mix, op, why", [
    (RollAll(), "aten.roll", "works along the sequence axis"),
    (ExpandedCumsum(), "aten.cumsum", "works along the sequence axis"),
    (CausalConv(), "aten.conv1d", "not known to act on each position separately"),
    (Cumsum(), "aten.cumsum", "works along the sequence axis"),
    (MeanPool(), "aten.mean", "works along the sequence axis"),
    (ByLength(), "aten.div", "uses the sequence length"),
    (Bidirectional(), "aten.matmul", "not proven to be causal self-attention (it has no mask)"),
], ids=["roll-flattened", "expanded-constant-cumsum", "causal-conv",
        "cumsum", "mean-pool", "divide-by-length", "bidirectional-attention"])
def test_sequence_mixing_is_refused_naming_op_and_line(mix, op, why):
    with pytest.raises(PositionError) as info:
        cached(TinyLM(mix))
    msg = str(info.value)
    assert op in msg and why in msg and "test_generation.py:" in msg, msg


def test_active_dropout_is_refused():
    model = _nanogpt(n_layer=1, dropout=0.1).train()
    with pytest.raises(PositionError, match=r"aten.dropout at models.py:\d+.*call model.eval\(\)"):
        cached(model)


def test_last_position_only_output_is_refused():
    class LastOnly(NanoGPT):
        def forward(self, idx):
            return super().forward(idx)[:, -1:, :]

    torch.manual_seed(0)
    model = LastOnly(GPTConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, block_size=16)).eval()
    with pytest.raises(PositionError, match="slices the sequence axis"):
        cached(model)


class MaskedAttention(nn.Module):
    """Attention with a mask built from sizes: causal within a window of ``window`` keys, or all zeros."""

    def __init__(self, window: int | None):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.window = window

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (y.view(b, t, 2, 8).transpose(1, 2) for y in self.qkv(x).split(16, dim=2))
        if self.window is None:
            mask = torch.zeros(t, t)
        else:
            mask = torch.full((t, t), float("-inf")).triu(1) + torch.full((t, t), float("-inf")).tril(-self.window)
        att = F.softmax(q @ k.transpose(-2, -1) * (1.0 / math.sqrt(8)) + mask, dim=-1)
        return (att @ v).transpose(1, 2).reshape(b, t, c)


def test_size_only_mask_that_is_not_causal_is_refused():
    with pytest.raises(PositionError, match=r"its mask is not causal at length 2"):
        cached(TinyLM(MaskedAttention(window=None)))


def test_sliding_window_mask_is_cached_with_its_width():
    """A proven causal window keeps only its last 10 keys (tests/test_generation_windows.py has the rest)."""
    torch.manual_seed(0)
    model = TinyLM(MaskedAttention(window=10), block_size=24).eval()
    c = cached(model)
    assert [s.capacity for s in c.sites] == [10] and "sliding window 10" in c.describe()
    idx = torch.randint(0, VOCAB, (2, 12))  # longer than the window
    assert torch.equal(generate(c, idx, 12), generate_plain(model, idx, 12))


def test_a_cached_model_says_it_cannot_be_copied():
    import copy
    import pickle

    c = cached(_nanogpt())
    for fn in (copy.deepcopy, copy.copy, pickle.dumps):
        with pytest.raises(TypeError, match=r"cannot be copied or pickled.*attnopt\.generation\.cached\(model\)"):
            fn(c)


def test_public_names():
    assert set(generation.__all__) >= {"cached", "generate", "generate_plain", "CachedLM"}
