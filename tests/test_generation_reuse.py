"""``generate(model, ...)`` captures a module once: later calls reuse the cached model until the module changes."""

from __future__ import annotations

import gc
import math
import types
import weakref

import pytest
import torch

from attnopt import generation
from attnopt.generation import cached, generate, generate_plain
from attnopt.models import GPTConfig, NanoGPT
from attnopt.pipeline.kv import build_cached

VOCAB = 64


def _nanogpt(seed: int = 0) -> NanoGPT:
    torch.manual_seed(seed)
    return NanoGPT(GPTConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, block_size=24, dropout=0.0)).eval()


@pytest.fixture
def captures(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the captures ``generate`` makes (calls of ``build_cached``, which ``cached`` is too)."""
    calls: list[int] = []

    def counting(model, *args, **kw):
        calls.append(1)
        return build_cached(model, *args, **kw)

    monkeypatch.setattr(generation, "build_cached", counting)
    return calls


def _idx(batch: int = 2, length: int = 5, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_a_second_generate_reuses_the_capture_and_gives_the_same_tokens(captures):
    model = _nanogpt()
    first = generate(model, _idx(), 6)
    second = generate(model, _idx(seed=2), 6)
    assert len(captures) == 1
    assert torch.equal(first, generate_plain(model, _idx(), 6))
    assert torch.equal(second, generate_plain(model, _idx(seed=2), 6))
    # other options are another cached model
    generate(model, _idx(), 3, max_len=16)
    assert len(captures) == 2


def test_the_kept_cached_model_holds_no_cache_memory_between_calls():
    model = _nanogpt()
    generate(model, _idx(), 4)
    ((_, lm),) = generation._REUSED[model].values()
    assert lm.cache_bytes == 0 and lm.length == 0


def test_weights_written_in_place_are_used_by_the_next_generate(captures):
    model = _nanogpt()
    generate(model, _idx(), 4)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    assert torch.equal(generate(model, _idx(), 6), generate_plain(model, _idx(), 6))
    assert len(captures) == 1  # same objects: the cached graph computes with them


def test_a_replaced_weight_makes_generate_capture_again(captures):
    model = _nanogpt()
    generate(model, _idx(), 4)
    other = _nanogpt(seed=5)
    model.load_state_dict(other.state_dict(), assign=True)  # new tensor objects
    assert torch.equal(generate(model, _idx(), 6), generate_plain(model, _idx(), 6))
    assert len(captures) == 2


def test_a_changed_attribute_makes_generate_capture_again(captures):
    model = _nanogpt()
    generate(model, _idx(), 4)
    attn = model.h[0].attn
    attn.n_head = 2  # the value it had: no change
    generate(model, _idx(), 4)
    assert len(captures) == 1
    attn.n_head = 1  # the capture made the head count a constant of the graph
    assert torch.equal(generate(model, _idx(), 6), generate_plain(model, _idx(), 6))
    assert len(captures) == 2


def test_a_patched_forward_makes_generate_capture_again(captures):
    model = _nanogpt()
    generate(model, _idx(), 4)
    attn = model.h[0].attn
    plain_forward = type(attn).forward

    def doubled(self, x):  # another function: the scores doubled before the softmax
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = 2 * (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf")).softmax(dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).reshape(b, t, c))

    attn.forward = types.MethodType(doubled, attn)
    try:
        got = generate(model, _idx(), 6)
        assert len(captures) == 2
        assert torch.equal(got, generate_plain(model, _idx(), 6))
    finally:
        attn.forward = types.MethodType(plain_forward, attn)


def test_the_reuse_does_not_keep_the_module_alive():
    model = _nanogpt()
    generate(model, _idx(), 3)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_memory_budget_sizes_and_limits_the_cache():
    model = _nanogpt()
    lm = cached(model, max_len=16)
    per_token = lm.bytes_per_token
    assert per_token == 2 * 1 * 16 * 4  # K and V, 1 layer, 2 heads x 8 dims, fp32
    assert lm.bytes_per_sequence == 16 * per_token
    assert lm.sequences_that_fit(10 * 16 * per_token) == 10
    assert lm.sequences_that_fit(10 * 16 * per_token, length=8) == 20
    assert lm.sequences_that_fit() is None  # no budget given

    budget = 3 * 16 * per_token
    lm = cached(model, max_len=16, memory_budget=budget)
    assert "3 sequence(s) of max_len=16 fit" in lm.describe()
    lm.prefill(_idx(batch=3))  # fits
    assert lm.cache_bytes == budget
    with pytest.raises(ValueError, match=r"batch of at most 3.*max_len <= 12"):
        lm.prefill(_idx(batch=4))
    with pytest.raises(ValueError, match=r"max_len <= 3 or a larger memory_budget"):
        cached(model, max_len=16, memory_budget=3 * per_token)
    with pytest.raises(ValueError, match="memory_budget"):
        cached(model, memory_budget="lots")
    lm = cached(model, max_len=16, memory_budget=f"{budget / 2**10:.1f}KiB")
    assert lm.memory_budget == budget
