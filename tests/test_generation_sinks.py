"""Attention sinks and learnt temperatures in a cached causal LM.

An attention sink (gpt-oss: ``softmax(cat([s, sink], -1) - rowmax)[..., :-1] @ v``; Granite-SWA: ``softmax(s) @ v
* sigmoid(logsumexp(s) - sink)``) is one more key per row, whose score is the sink and whose value is zero: the
KV cache adds it to the cached keys at every call (prefill, steps, ragged rows, sliding windows). A 0-d scale
tensor (a learnt temperature; divided by, or one per head) multiplies the cached scores as written.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from test_generation_spellings import Base, D, H, V, assert_cached_exactly

from attnopt.generation import cached


class Sinks(Base):
    """gpt-oss's eager attention, small: per-head sink logits, GQA by ``repeat_interleave``, optionally a window."""

    def __init__(self, how: str = "cat", window: int | None = None):
        super().__init__()
        torch.manual_seed(2)
        self.how, self.window = how, window
        self.sinks = nn.Parameter(torch.randn(H) * 2)
        self.temp = nn.Parameter(torch.tensor(0.7))
        self.head_temp = nn.Parameter(torch.rand(1, H, 1, 1) + 0.5)

    def attend(self, q, k, v):
        B, _, T, _ = q.shape
        s = q @ k.transpose(-2, -1) / math.sqrt(D)
        if self.how == "temperature":
            s = s * self.temp
        elif self.how == "temperatures":  # divided by one, times a per-head one
            s = s / self.temp * self.head_temp
        if self.window is None:
            s = s.masked_fill(~self.bias[:T, :T], float("-inf"))
        else:  # Mistral's window: -inf above the diagonal and `window` or more behind
            inf = torch.full((T, T), float("-inf"))
            s = s + inf.triu(1) + inf.tril(-self.window)
        if self.how.startswith("temperature"):
            return s.softmax(-1) @ v
        sink = self.sinks.reshape(1, -1, 1, 1).expand(B, -1, T, -1)
        if self.how == "lse":
            return (s.softmax(-1) @ v) * torch.sigmoid(torch.logsumexp(s, -1, keepdim=True) - sink)
        c = torch.cat([s, sink], dim=-1)
        c = c - c.max(dim=-1, keepdim=True).values
        return c.softmax(-1)[..., :-1] @ v

    def forward(self, idx):
        return self.block(self.embed(idx))


@pytest.mark.parametrize("how, window", [("cat", None), ("lse", None), ("cat", 3), ("temperature", None),
                                         ("temperatures", None)],
                         ids=["gpt-oss-sink", "granite-sink", "sink-in-a-window", "learnt-temperature",
                              "divided-and-per-head-temperatures"])
def test_sinks_and_temperatures_are_cached_exactly(how, window):
    assert_cached_exactly(Sinks(how, window).eval())


def test_a_sink_changes_the_cached_result():
    """The sink is not dropped on the way: without it the cached logits would differ."""
    model = Sinks("cat").eval()
    lm = cached(model)
    idx = torch.randint(0, V, (1, 6))
    with torch.no_grad():
        want = model(idx)
        model.sinks.fill_(-1e4)  # weights written in place are followed: no sink left
        gone = model(idx)
        assert (want - gone).abs().max() > 1e-3
        torch.testing.assert_close(lm.prefill(idx), gone, atol=1e-5, rtol=1e-5)
