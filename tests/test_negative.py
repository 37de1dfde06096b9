"""Look-alikes that must NOT be rewritten (attention-spellings.md, section F), and the fully-masked-row policy.

Each look-alike is checked three ways: ``explain()`` rewrites nothing and says why (a reason that
names the condition that failed), ``optimize()`` leaves the outputs exactly as written, and the
captured graph keeps its softmax.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from support import Fn

import attnopt

B, H, T, D = 2, 2, 6, 8


def qkv(tq: int = T, tk: int = T) -> tuple[torch.Tensor, ...]:
    return torch.randn(B, H, tq, D), torch.randn(B, H, tk, D), torch.randn(B, H, tk, D)


def scores(q, k):
    return (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))


LOOKALIKES = {
    # softmax over the query axis
    "softmax_over_queries": (lambda m, q, k, v: F.softmax(scores(q, k), dim=-2) @ v, "dim 2, the query axis"),
    "softmax_over_heads": (lambda m, q, k, v: F.softmax(scores(q, k), dim=1) @ v, "dim 1, the head axis"),
    # non-softmax normalisations
    "sigmoid": (lambda m, q, k, v: torch.sigmoid(scores(q, k)) @ v, None),
    "exp_sum_written_out": (lambda m, q, k, v: (lambda e: e / e.sum(-1, keepdim=True))(scores(q, k).exp()) @ v,
                            None),
    "base_2": (lambda m, q, k, v: (lambda e: e / e.sum(-1, keepdim=True))(torch.exp2(scores(q, k))) @ v, None),
    "linear_attention": (lambda m, q, k, v: (F.elu(q) + 1) @ ((F.elu(k) + 1).transpose(-2, -1) @ v), None),
    # the probabilities or the scores used elsewhere
    "probs_returned": (lambda m, q, k, v: (lambda p: (p @ v, p))(F.softmax(scores(q, k), -1)),
                       "probabilities are returned to the caller"),
    "scores_returned": (lambda m, q, k, v: (lambda s: (F.softmax(s, -1) @ v, s))(scores(q, k)),
                        "scores are returned to the caller"),
    "probs_summed_too": (lambda m, q, k, v: (lambda p: p @ v + p.sum())(F.softmax(scores(q, k), -1)),
                         "also read by `sum`"),
    # a mask or product after the softmax without renormalising
    "mask_after_softmax": (lambda m, q, k, v: (F.softmax(scores(q, k), -1)
                                               * torch.ones(T, T).tril()) @ v, "after the softmax"),
    "scale_after_softmax": (lambda m, q, k, v: (F.softmax(scores(q, k), -1) * 2.0) @ v, "after the softmax"),
    # heads mixed between the product and the softmax (talking heads)
    "talking_heads": (lambda m, q, k, v: F.softmax(torch.einsum("bhqk,hg->bgqk", scores(q, k), m.mix), -1) @ v,
                      "between the product and the softmax"),
    # (an extra logit column dropped after the softmax is an attention sink: tests/test_sinks.py)
    # a finite fill next to a fill of another value: fully masked rows would average a different set of keys
    "fill_minus_1e4_and_minus_inf": (lambda m, q, k, v: F.softmax(scores(q, k).masked_fill(
        torch.ones(T, T, dtype=torch.bool).triu(1), -1e4).masked_fill(torch.eye(T, dtype=torch.bool), float("-inf")),
        -1) @ v, "together with fills of other values"),
    "fill_positive": (lambda m, q, k, v: F.softmax(torch.where(
        torch.ones(T, T, dtype=torch.bool).tril(), scores(q, k), 5.0), -1) @ v, "does not suppress the masked keys"),
}
PARAMS = {"talking_heads": {"mix": torch.randn(H, H)}}


def first(out):
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("name", list(LOOKALIKES))
def test_lookalike_is_not_rewritten_and_explained(name: str) -> None:
    fn, why = LOOKALIKES[name]
    model = Fn(fn, **PARAMS.get(name, {}))
    inputs = qkv()
    report = attnopt.explain(model, *inputs)
    assert report.rewritten == 0, str(report)
    assert report.failures == []
    if why is None:
        # no softmax at all: nothing that looks like attention is found, and the report says so
        assert len(report.records) == 0, str(report)
        assert "no softmax found" in str(report)
    else:
        assert len(report.records) == 1, str(report)
        (record,) = report.records
        assert record.decision in ("left alone", "not attention")
        assert why in record.reason, record.reason
        assert record.reason in str(report).replace("\n", " ") or record.reason[:30] in str(report)

    opt = attnopt.optimize(model)
    with torch.no_grad():
        expected, actual = model(*inputs), opt(*inputs)
    for e, a in zip(expected if isinstance(expected, tuple) else (expected,),
                    actual if isinstance(actual, tuple) else (actual,)):
        assert torch.equal(e, a), name
    assert attnopt.explain(opt).rewritten == 0


def test_lookalike_next_to_real_attention_only_the_real_one_is_rewritten() -> None:
    """One graph with a site and a look-alike: the site is rewritten, the look-alike keeps its softmax."""

    def fn(m, q, k, v):
        real = F.softmax(scores(q, k), -1) @ v
        fake = F.softmax(scores(q, k), -2) @ v
        return real + fake

    model = Fn(fn)
    inputs = qkv()
    report = attnopt.explain(model, *inputs)
    assert report.rewritten == 1 and len(report.records) == 2, str(report)
    opt = attnopt.optimize(model)
    with torch.no_grad():
        torch.testing.assert_close(opt(*inputs), model(*inputs), atol=1e-5, rtol=1e-4)


# ----------------------------------------------------------------------------- fully masked rows


class PaddedAttention(nn.Module):
    """``masked_fill(~keep, fill)`` with a padding keep-mask passed in: [B, 1, Tq, Tk]."""

    def __init__(self, fill: str):
        super().__init__()
        self.fill = fill

    def forward(self, q, k, v, keep):
        att = scores(q, k)
        value = float("-inf") if self.fill == "-inf" else torch.finfo(att.dtype).min
        att = att.masked_fill(~keep, value)
        return F.softmax(att, dim=-1) @ v


def padding_with_dead_rows() -> torch.Tensor:
    keep = torch.rand(B, 1, T, T) < 0.7
    keep[..., 0] = True
    keep[0, 0, 2, :] = False  # batch 0, query 2: every key masked
    keep[1, 0, 5, :] = False  # batch 1, query 5
    return keep


def test_fully_masked_rows_with_minus_inf_are_nan_exactly_where_the_original_is() -> None:
    model = PaddedAttention("-inf")
    inputs = (*qkv(), padding_with_dead_rows())
    expected = model(*inputs)
    nan_rows = torch.isnan(expected).all(-1)
    assert nan_rows.sum() == 2 * H and not torch.isnan(expected[~nan_rows]).any()

    report = attnopt.explain(model, *inputs)
    assert report.rewritten == 1, str(report)
    assert report.records[0].spec.nan_rows
    opt = attnopt.optimize(model)
    actual = opt(*inputs)
    assert torch.equal(torch.isnan(actual), torch.isnan(expected))
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-4, equal_nan=True)


def test_fully_masked_rows_with_dtype_min_are_a_uniform_average_like_the_original() -> None:
    model = PaddedAttention("min")
    q, k, v, keep = (*qkv(), padding_with_dead_rows())
    expected = model(q, k, v, keep)
    assert not torch.isnan(expected).any()
    torch.testing.assert_close(expected[0, :, 2], v[0].mean(-2), atol=1e-5, rtol=1e-4)  # uniform over all keys

    report = attnopt.explain(model, q, k, v, keep)
    assert report.rewritten == 1, str(report)
    opt = attnopt.optimize(model)
    actual = opt(q, k, v, keep)
    assert not torch.isnan(actual).any()
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(actual[1, :, 5], v[1].mean(-2), atol=1e-5, rtol=1e-4)


def test_fully_masked_rows_gradients_match_where_defined() -> None:
    """dtype-min fill: gradients through dead rows (uniform averages) equal the original's."""
    model = PaddedAttention("min")
    q, k, v, keep = (*qkv(), padding_with_dead_rows())
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    opt = attnopt.optimize(model)
    cot = torch.randn(B, H, T, D)
    (opt(*leaves, keep) * cot).sum().backward()
    (model(*ref_leaves, keep) * cot).sum().backward()
    assert attnopt.explain(opt).rewritten == 1
    for a, b in zip(leaves, ref_leaves):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4)


# ----------------------------------------------------------------------------- near-miss wording


class Block(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def forward(self, q, k, v):
        att = scores(q, k)
        if self.kind == "query_axis":
            return F.softmax(att, dim=2) @ v
        p = F.softmax(att, dim=-1)
        return p @ v, p  # the probabilities are returned


class Outer(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.layers = nn.ModuleList([nn.Module()])
        self.layers[0].attn = Block(kind)

    def forward(self, q, k, v):
        return self.layers[0].attn(q, k, v)


def _line_of(text: str) -> int:
    import inspect

    src, start = inspect.getsourcelines(Block.forward)
    return start + next(i for i, line in enumerate(src) if text in line)


@pytest.mark.parametrize("kind", ["query_axis", "probs_returned"])
def test_near_miss_reason_names_the_condition_the_module_and_the_source_line(kind: str) -> None:
    report = attnopt.explain(Outer(kind), *qkv())
    (record,) = report.records
    assert not record.rewritten
    if kind == "query_axis":
        where = f"layers.0.attn (test_negative.py:{_line_of('dim=2')})"
        assert record.reason.startswith(f"softmax is over dim 2, the query axis, not the last (key) axis of the 4-D "
                                        f"scores at {where}"), record.reason
    else:
        where = f"layers.0.attn (test_negative.py:{_line_of('p = F.softmax')})"
        assert record.reason.startswith("the attention probabilities are returned to the caller (or across a graph "
                                        f"break) at {where}"), record.reason
    assert record.module_path == "layers.0.attn"
