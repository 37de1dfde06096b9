"""Stopping and streaming: end tokens, stop callbacks, per-sequence finish in a batch, ``stream``."""

from __future__ import annotations

import pytest
import torch

from attnopt.generation import cached, generate, generate_plain, stream
from attnopt.models import GPTConfig, NanoGPT

VOCAB = 16  # few tokens, so that greedy decoding meets a chosen end token soon


@pytest.fixture(scope="module")
def model() -> NanoGPT:
    torch.manual_seed(0)
    return NanoGPT(GPTConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, block_size=40, dropout=0.0)).eval()


@pytest.fixture(scope="module")
def lm(model):
    return cached(model)


def _idx(batch: int = 3, length: int = 4, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _first_new_token(model, idx, n=12) -> int:
    """A token greedy decoding of row 0 produces within ``n`` steps (and what row 0 produces first)."""
    return int(generate_plain(model, idx, n)[0, idx.size(1) + 2])


def test_eos_finishes_each_sequence_and_pads_it(model, lm):
    idx = _idx()
    eos = _first_new_token(model, idx)
    plain = generate_plain(model, idx, 12, eos_token_id=eos, pad_token_id=0)
    got = generate(lm, idx, 12, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(got, plain)
    new = got[:, idx.size(1):]
    assert int(new[0, 2]) == eos  # row 0 meets the end token at its third new token (how eos was chosen)
    for row in new:
        hits = (row == eos).nonzero()
        if len(hits):  # everything after the first end token is padding
            assert (row[int(hits[0]) + 1:] == 0).all()
    # without stopping, row 0 goes on past the end token with the model's own tokens
    free = generate(lm, idx, 12)
    assert torch.equal(free[0, : idx.size(1) + 3], got[0, : idx.size(1) + 3])
    assert not torch.equal(free[0, idx.size(1) + 3:], got[0, idx.size(1) + 3:])


def test_generation_ends_when_every_sequence_finished(model, lm):
    idx = _idx(batch=1)
    eos = _first_new_token(model, idx)
    got = generate(lm, idx, 12, eos_token_id=eos)
    assert got.size(1) < idx.size(1) + 12 and int(got[0, -1]) == eos
    assert torch.equal(got, generate_plain(model, idx, 12, eos_token_id=eos))


def test_several_end_tokens_and_a_stop_callback(model, lm):
    idx = _idx()
    ends = [_first_new_token(model, idx), (_first_new_token(model, idx) + 1) % VOCAB]
    seen = []

    def stop(ids):
        seen.append(ids.shape)
        return ids.size(1) >= idx.size(1) + 5  # every sequence, after five new tokens

    got = generate(lm, idx, 12, eos_token_id=ends, stop=stop)
    assert got.size(1) <= idx.size(1) + 5
    assert seen[0] == (3, idx.size(1) + 1)  # called with the new token appended
    assert torch.equal(got, generate_plain(model, idx, 12, eos_token_id=ends, stop=stop))


def test_a_per_sequence_stop_tensor(model, lm):
    idx = _idx()

    def stop(ids):
        return torch.tensor([True, False, False]) if ids.size(1) >= idx.size(1) + 2 else torch.zeros(3, dtype=bool)

    got = generate(lm, idx, 6, stop=stop, pad_token_id=VOCAB - 1)
    assert got.size(1) == idx.size(1) + 6
    assert (got[0, idx.size(1) + 2:] == VOCAB - 1).all()  # row 0 finished after its second token
    assert torch.equal(got, generate_plain(model, idx, 6, stop=stop, pad_token_id=VOCAB - 1))


def test_seeded_sampling_with_stopping_matches_the_plain_loop(model, lm):
    idx = _idx()
    eos = 3
    kw = dict(do_sample=True, temperature=0.8, top_k=5, eos_token_id=eos)
    got = generate(lm, idx, 10, generator=torch.Generator().manual_seed(7), **kw)
    plain = generate_plain(model, idx, 10, generator=torch.Generator().manual_seed(7), **kw)
    assert torch.equal(got, plain)


def test_stream_yields_what_generate_returns(model, lm):
    idx = _idx()
    parts = list(stream(lm, idx, 7))
    assert all(p.shape == (3, 1) for p in parts) and len(parts) == 7
    assert torch.equal(torch.cat([idx, *parts], dim=1), generate(lm, idx, 7))


def test_stream_is_lazy_and_closing_it_frees_the_cache(model):
    idx = _idx()
    it = stream(model, idx, 20)
    first = next(it)
    assert first.shape == (3, 1)
    it.close()
    from attnopt import generation

    ((_, kept),) = [v for k, v in generation._REUSED[model].items() if k == generation._key(model, None, "sdpa", False)]
    assert kept.cache_bytes == 0
    # and a model reused after an early close gives the right tokens
    assert torch.equal(generate(model, idx, 5), generate_plain(model, idx, 5))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"eos_token_id": -1}, "eos_token_id must be a token id"),
    ({"eos_token_id": [1, "a"]}, "eos_token_id must be a token id"),
    ({"stop": 3}, "stop must be a callable"),
    ({"pad_token_id": 1.5}, "pad_token_id must be a token id"),
    ({"stop": lambda ids: False}, "pass pad_token_id"),  # a batch of 3 that may stop per sequence, no pad
])
def test_bad_stopping_arguments_say_what_to_pass(lm, kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        generate(lm, _idx(), 4, **kwargs)


def test_a_stop_returning_the_wrong_shape_is_an_error(lm):
    with pytest.raises(ValueError, match=r"stop must return a bool or a \(3,\) bool tensor"):
        generate(lm, _idx(), 4, stop=lambda ids: torch.zeros(2, dtype=torch.bool), pad_token_id=0)


def test_interleaved_streams_on_one_module_each_get_their_own_caches(model):
    a_idx, b_idx = _idx(batch=1, length=4, seed=3), _idx(batch=2, length=6, seed=4)
    a, b = stream(model, a_idx, 6), stream(model, b_idx, 6)
    got_a, got_b = [], []
    for _ in range(6):  # a's prefill, b's prefill, then their steps in turn
        got_a.append(next(a))
        got_b.append(next(b))
    assert torch.equal(torch.cat([a_idx, *got_a], 1), generate_plain(model, a_idx, 6))
    assert torch.equal(torch.cat([b_idx, *got_b], 1), generate_plain(model, b_idx, 6))


def test_two_streams_on_one_cached_model_refuse_rather_than_mix_their_caches(lm):
    a = stream(lm, _idx(seed=5), 6)
    next(a)
    b = stream(lm, _idx(seed=6), 6)
    next(b)  # its prefill refills the caches a was decoding with
    with pytest.raises(RuntimeError, match="another prefill or reset ran on this CachedLM"):
        next(a)
