"""Masks that look like a causal band but are not (or are, spelled unusually): regressions from review.

Each model is run through ``attnopt.optimize`` and compared with the code as written (NaN where
it is NaN). Where the interpreter must not prove a band, the spec says so; where the spelling is
unusual but the band is real, it is proven.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import attnopt

NEG = float("-inf")


def scores(q, k):
    return q @ k.transpose(-2, -1)


class ScaledAddedMin(nn.Module):
    """``(s + mask) * 2`` with a ``finfo.min`` mask: the minimum overflows to ``-inf`` as written."""

    def forward(self, q, k, v, mask):
        return torch.softmax((scores(q, k) + mask) * 2.0, -1) @ v


class ConditionWrittenAfterUse(nn.Module):
    """A padding term ANDed into the mask, then changed in place: the mask keeps the old values."""

    def forward(self, q, k, v, am):
        t = q.size(-2)
        p = am > 0
        keep = torch.ones(t, t, dtype=torch.bool).tril() & p[:, None, None, :]
        p.fill_(True)
        return torch.softmax(scores(q, k).masked_fill(~keep, NEG), -1) @ v


class ExpandedKeyIndex(nn.Module):
    """``arange(T)[None, :].expand(T, T)`` is the key index (broadcast from the right): a window of 2."""

    def forward(self, q, k, v):
        t = q.size(-2)
        pos = torch.arange(t)
        kv_idx = pos[None, :].expand(t, t)
        keep = torch.ones(t, t, dtype=torch.bool).tril() & (pos[:, None] - kv_idx < 2)
        return torch.softmax(scores(q, k).masked_fill(~keep, NEG), -1) @ v


class Uint8Distance(nn.Module):
    """``i - j >= 0`` in uint8 wraps around: always True."""

    def forward(self, q, k, v):
        t = q.size(-2)
        i = torch.arange(t, dtype=torch.uint8)[:, None]
        j = torch.arange(t, dtype=torch.uint8)[None, :]
        return torch.softmax(scores(q, k).masked_fill(~((i - j) >= 0), NEG), -1) @ v


class Uint8BitwiseNot(nn.Module):
    """``~`` on uint8 is bitwise: ``~0 = 255`` and ``~1 = 254`` are both True."""

    def forward(self, q, k, v):
        t = q.size(-2)
        up = torch.ones(t, t, dtype=torch.uint8).triu(1)
        keep = (~(up & up)).bool()
        return torch.softmax(scores(q, k).masked_fill(~keep, NEG), -1) @ v


class OrThroughAlias(nn.Module):
    """``alias |= extra`` changes ``keep`` too."""

    def forward(self, q, k, v, extra):
        t = q.size(-2)
        keep = torch.ones(t, t, dtype=torch.bool).tril()
        alias = keep
        alias |= extra
        return torch.softmax(scores(q, k).masked_fill(~keep, NEG), -1) @ v


class AddThroughAlias(nn.Module):
    """``alias += extra`` changes an additive causal mask."""

    def forward(self, q, k, v, extra):
        t = q.size(-2)
        m = torch.zeros(t, t).masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), NEG)
        alias = m
        alias += extra
        return torch.softmax(scores(q, k) + m, -1) @ v


class OutKeyword(nn.Module):
    """``torch.logical_and(keep, pad, out=keep)`` writes ``keep``."""

    def forward(self, q, k, v, pad):
        t = q.size(-2)
        keep = torch.ones(t, t, dtype=torch.bool).tril()
        torch.logical_and(keep, pad, out=keep)
        return torch.softmax(scores(q, k).masked_fill(~keep, NEG), -1) @ v


class ArangeKeywords(nn.Module):
    def forward(self, q, k, v):
        t = q.size(-2)
        keep = torch.arange(start=0, end=t)[:, None] >= torch.arange(end=t)[None, :]
        return torch.softmax(scores(q, k).masked_fill(~keep, NEG), -1) @ v


def _inputs(name: str):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 4) for _ in range(3))
    extra = {
        "scaled_added_min": [torch.zeros(1, 1, 6, 6).index_fill(-1, torch.tensor([4, 5]), torch.finfo().min)],
        "condition_written_after_use": [torch.tensor([[0.0, 0.0, 1.0, 1.0, 1.0, 1.0]])],
        "or_through_alias": [torch.zeros(6, 6, dtype=torch.bool).index_put((torch.tensor([0]), torch.tensor([5])),
                                                                           torch.tensor(True))],
        "add_through_alias": [torch.zeros(6, 6).index_fill(-1, torch.tensor([0]), NEG)],
        "out_keyword": [torch.rand(6, 6) < 0.7],
    }.get(name, [])
    return (q, k, v, *extra)


CASES = {  # name: (model, what the spec must say: "causal", "window 2" or None for no band proven)
    "scaled_added_min": (ScaledAddedMin, None),
    "condition_written_after_use": (ConditionWrittenAfterUse, None),
    "expanded_key_index": (ExpandedKeyIndex, "window 2"),
    "uint8_distance": (Uint8Distance, None),
    "uint8_bitwise_not": (Uint8BitwiseNot, None),
    "or_through_alias": (OrThroughAlias, None),
    "add_through_alias": (AddThroughAlias, None),
    "out_keyword": (OutKeyword, None),
    "arange_keywords": (ArangeKeywords, "causal"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_unusual_masks_are_exact_and_proven_only_when_true(name: str) -> None:
    build, proven = CASES[name]
    model = build()
    args = _inputs(name)
    ref = model(*args)
    opt = attnopt.optimize(model, variant="sdpa")
    out = opt(*args)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4, equal_nan=True)
    (rec,) = attnopt.explain(opt).records
    assert rec.rewritten, rec.reason
    if proven is None:
        assert rec.spec.causal is None and rec.spec.window is None, rec.reason
    elif proven == "causal":
        assert rec.spec.causal == "top_left" and rec.spec.window is None, rec.reason
    else:
        assert rec.spec.window == int(proven.split()[1]), rec.reason


def test_clamp_with_an_infinite_bound_reads_as_a_one_sided_clamp() -> None:
    class ClampInf(nn.Module):
        def forward(self, q, k, v):
            return torch.softmax(scores(q, k).clamp(min=NEG, max=5.0), -1) @ v

    q, k, v = _inputs("clamp")
    opt = attnopt.optimize(ClampInf(), variant="math")
    torch.testing.assert_close(opt(q, k, v), ClampInf()(q, k, v))
    (rec,) = attnopt.explain(opt).records
    assert rec.rewritten and "clamp(s, None, 5)" in rec.reason, rec.reason
