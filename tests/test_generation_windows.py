"""Sliding windows in the KV cache: a proven causal window of ``w`` keys keeps ``w`` positions per sequence.

Keys more than ``w - 1`` positions back are never attended (a ring buffer overwrites them); the tokens and
logits equal the full recompute of the model as written, for prompts longer than the window, steps of one
and of several tokens, ragged batches. Masks that are not a causal window are refused, naming why.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from llama_style import LlamaConfig, LlamaStyle

from attnopt.generation import PositionError, cached, generate, generate_plain
from attnopt.models import GPTConfig

VOCAB = 32
WINDOW = 4


class WindowedLlama(LlamaStyle):
    """tests/llama_style.py with a Mistral-style mask: ``-inf`` above the diagonal and ``window`` or more behind."""

    def __init__(self, window: int, **kw):
        torch.manual_seed(0)
        super().__init__(LlamaConfig(vocab_size=VOCAB, n_layers=1, max_seq_len=40, **kw))
        self.window = window
        self.eval()

    def forward(self, idx):
        _, t = idx.shape
        h = self.tok_embeddings(idx)
        cos, sin = self.cos_cached[:t], self.sin_cached[:t]
        inf = torch.full((t, t), float("-inf"), device=idx.device)
        mask = inf.triu(1) + inf.tril(-self.window)
        for layer in self.layers:
            h = layer(h, cos, sin, mask)
        return self.output(self.norm(h))


@pytest.fixture(scope="module")
def windowed():
    model = WindowedLlama(WINDOW)
    return model, cached(model)


def test_steps_of_any_size_give_the_full_recompute_logits(windowed):
    model, c = windowed
    assert [s.capacity for s in c.sites] == [WINDOW] and "sliding window 4" in c.describe()
    seq = torch.randint(0, VOCAB, (2, 7))  # a prompt longer than the window
    got = [c.prefill(seq)]
    for t in (1, 1, 3, 6, 1, 2):  # several tokens, fewer and more than the window, after a prefix
        new = torch.randint(0, VOCAB, (2, t))
        seq = torch.cat((seq, new), dim=1)
        got.append(c.step(new))
    torch.testing.assert_close(torch.cat(got, dim=1), model(seq), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("prompt", [1, 3, WINDOW, 10])
def test_tokens_equal_the_plain_loop_and_memory_stays_within_the_window(windowed, prompt):
    model, c = windowed
    idx = torch.randint(0, VOCAB, (2, prompt))
    assert torch.equal(generate(c, idx, 40 - prompt), generate_plain(model, idx, 40 - prompt))  # to max_len
    assert c.cache_bytes == 2 * WINDOW * c.bytes_per_token  # 40 positions, 4 kept
    assert c.bytes_per_sequence == WINDOW * c.bytes_per_token
    kw = dict(do_sample=True, top_k=10)
    assert torch.equal(generate(c, idx, 12, generator=torch.Generator().manual_seed(prompt), **kw),
                       generate_plain(model, idx, 12, generator=torch.Generator().manual_seed(prompt), **kw))


def test_ragged_prompts_in_a_window_each_get_their_own_tokens(windowed):
    model, c = windowed
    prompts = [torch.randint(0, VOCAB, (n,)) for n in (9, 1, 4, 2)]
    got = generate(c, prompts, 15)
    assert all(torch.equal(g, generate_plain(model, p[None], 15)[0]) for g, p in zip(got, prompts))
    from attnopt.generation import left_pad

    ids, mask = left_pad(prompts)
    seqs = list(prompts)
    c.prefill(ids, mask)
    for t in (1, 5, 2):  # a ragged batch, several tokens per step, across the ring's end
        new = torch.randint(0, VOCAB, (4, t))
        out = c.step(new)
        for b in range(4):
            seqs[b] = torch.cat((seqs[b], new[b]))
            torch.testing.assert_close(out[b], model(seqs[b][None])[0, -t:], atol=1e-5, rtol=1e-5)


def test_a_budget_counts_the_window_not_max_len():
    model = WindowedLlama(WINDOW)
    c = cached(model, memory_budget=10 * WINDOW * 128)  # 128 B per position: K and V, 2 KV heads of 8, fp32
    assert c.bytes_per_token == 128 and c.sequences_that_fit() == 10 and c.sequences_that_fit(length=2) == 20
    c.prefill(torch.zeros(10, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"use a batch of at most 10"):
        c.prefill(torch.zeros(11, 3, dtype=torch.long))


class Band(nn.Module):
    """One attention over embeddings whose mask keeps keys ``lo < j - i <= hi`` (or a width from the length)."""

    def __init__(self, lo: int, hi: int, grows: bool = False):
        super().__init__()
        self.config = GPTConfig(block_size=32, vocab_size=VOCAB, n_embd=16)
        self.wte = nn.Embedding(VOCAB, 16)
        self.qkv = nn.Linear(16, 48)
        self.head = nn.Linear(16, VOCAB)
        self.lo, self.hi, self.grows = lo, hi, grows

    def forward(self, idx):
        x = self.wte(idx)
        b, t, c = x.shape
        q, k, v = (y.view(b, t, 2, 8).transpose(1, 2) for y in self.qkv(x).split(16, dim=2))
        if self.grows:  # a window of half the length: a different width at every length
            i = torch.arange(t, device=idx.device)
            keep = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < max(1, t // 2))
            mask = torch.zeros(t, t, device=idx.device).masked_fill(~keep, float("-inf"))
        else:
            inf = torch.full((t, t), float("-inf"), device=idx.device)
            mask = inf.triu(self.hi + 1) + inf.tril(self.lo)
        att = F.softmax(q @ k.transpose(-2, -1) * (1.0 / math.sqrt(8)) + mask, dim=-1)
        return self.head((att @ v).transpose(1, 2).reshape(b, t, c))


@pytest.mark.parametrize(("model", "why"), [
    (Band(-3, 2), "not proven to be causal self-attention"),  # a local band that also sees 2 keys ahead
    (Band(0, 0, grows=True), r"its mask is not a causal window of \d+ keys at length 2"),
], ids=["band-sees-ahead", "width-from-length"])
def test_masks_that_are_not_a_causal_window_are_refused(model, why):
    with pytest.raises(PositionError, match=why) as info:
        cached(model.eval())
    assert "test_generation_windows.py:" in str(info.value)
