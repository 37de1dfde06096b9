"""A tensor subtracted from the scores (``s - bias``): read as the added mask ``s + neg(bias)``.

ALiBi is often written as a subtraction (``s - slopes * distance``), a causal mask as ``s - inf * triu(ones)``,
a padding mask as ``s - (1 - keep) * 1e4``. The matcher rewrites the subtraction in the graph to
``s + neg(bias)`` (the same function bit for bit: IEEE subtraction is addition of the negation) and reads the
negation as an added mask, which every later step (mask proofs, scale after the sum, the KV cache's terms per
key) already handles. Covered: outputs and gradients (inputs and a learned bias) in float32 and float64, later
calls with other lengths, the causal proof through the negation, rows with every key hidden (NaN as written),
``compile=True``; refused with a reason: integer tensors (their negation wraps), ``alpha != 1``, the scores
subtracted from a tensor, a bias that broadcasts the scores to a larger shape.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from support import Fn

import attnopt

B, H, T, D = 2, 4, 8, 8
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.float64: dict(atol=1e-10, rtol=1e-9)}


def _alibi(t: int, dtype: torch.dtype) -> torch.Tensor:
    i = torch.arange(t)
    slopes = torch.tensor([2.0 ** -(h + 1) for h in range(H)])
    return (slopes[:, None, None] * (i[None, :] - i[:, None]).abs()).to(dtype)  # (H, T, T), subtracted


def _check(model: nn.Module, make_inputs, dtype: torch.dtype, lengths=(T, 5, 11)) -> attnopt.Report:
    """Outputs and the gradients of every floating input and parameter equal the model's, at each length
    (the first call captures; later ones run the rewritten graph or capture it again for the new length)."""
    torch._dynamo.reset()
    opt = attnopt.optimize(model)
    for t in lengths:
        inputs = make_inputs(t)
        a = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
        e = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
        out, ref = opt(*a), model(*e)
        torch.testing.assert_close(out, ref, **TOL[dtype], equal_nan=True)
        cot = torch.randn_like(ref)
        wrt_a = [x for x in a if x.requires_grad] + [p for p in model.parameters()]
        wrt_e = [x for x in e if x.requires_grad] + [p for p in model.parameters()]
        ga = torch.autograd.grad((out.nan_to_num() * cot).sum(), wrt_a, allow_unused=True)
        ge = torch.autograd.grad((ref.nan_to_num() * cot).sum(), wrt_e, allow_unused=True)
        for x, y in zip(ga, ge):
            assert (x is None) == (y is None)
            if x is not None:
                torch.testing.assert_close(x, y, atol=10 * TOL[dtype]["atol"], rtol=10 * TOL[dtype]["rtol"],
                                           equal_nan=True)
    return attnopt.explain(opt)


def _qkv(t: int, dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.randn(B, H, t, D, dtype=dtype) for _ in range(3)]


SPELLINGS = {
    "operator": lambda self, q, k, v: ((q @ k.transpose(-2, -1)) / math.sqrt(D)
                                       - _alibi(q.shape[-2], q.dtype)).softmax(-1) @ v,
    "torch.sub": lambda self, q, k, v: torch.sub(q @ k.mT * D ** -0.5, _alibi(q.shape[-2], q.dtype)).softmax(-1) @ v,
    "method": lambda self, q, k, v: (q @ k.mT).mul(D ** -0.5).sub(_alibi(q.shape[-2], q.dtype)).softmax(-1) @ v,
    "rsub": lambda self, q, k, v: torch.rsub(_alibi(q.shape[-2], q.dtype), q @ k.mT).softmax(-1) @ v,
    "scaled_after": lambda self, q, k, v: ((q @ k.mT - _alibi(q.shape[-2], q.dtype)) / math.sqrt(D)).softmax(-1) @ v,
    "twice": lambda self, q, k, v: (q @ k.mT - _alibi(q.shape[-2], q.dtype) - 0.5 * _alibi(q.shape[-2], q.dtype))
    .softmax(-1) @ v,
    "row_mean": lambda self, q, k, v: (q @ k.mT).sub((q @ k.mT).mean(-1, keepdim=True)).softmax(-1) @ v,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("how", list(SPELLINGS))
def test_a_subtracted_bias_is_rewritten_exactly(how: str, dtype: torch.dtype) -> None:
    report = _check(Fn(SPELLINGS[how]).to(dtype), lambda t: _qkv(t, dtype), dtype)
    assert report.records and report.rewritten == len(report.records), str(report)
    assert all("- mask" in " ".join(r.spelling) for r in report.records), str(report)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_learned_bias_subtracted_gets_its_gradient(dtype: torch.dtype) -> None:
    model = Fn(lambda self, q, k, v: (q @ k.mT / math.sqrt(D) - self.bias[:, :q.shape[-2], :q.shape[-2]])
               .softmax(-1) @ v, bias=torch.randn(H, 16, 16, dtype=dtype))
    report = _check(model, lambda t: _qkv(t, dtype), dtype)
    assert report.rewritten == len(report.records) >= 1, str(report)


def test_an_infinite_causal_mask_subtracted_is_proven_causal() -> None:
    def fn(self, q, k, v):
        t = q.shape[-2]
        return (q @ k.mT / math.sqrt(D) - torch.full((t, t), math.inf).triu(1)).softmax(-1) @ v

    report = _check(Fn(fn), lambda t: _qkv(t, torch.float32), torch.float32)
    assert report.rewritten == len(report.records) >= 1, str(report)
    assert all(r.spec.causal == "top_left" for r in report.records), str(report)


def test_a_subtracted_buffer_of_infinities_is_proven_causal() -> None:
    model = Fn(lambda self, q, k, v: (q @ k.mT - self.hide[:q.shape[-2], :q.shape[-2]]).softmax(-1) @ v,
               buffers={"hide": torch.full((16, 16), math.inf).triu(1)})
    report = _check(model, lambda t: _qkv(t, torch.float32), torch.float32)
    assert all(r.spec.causal == "top_left" for r in report.records), str(report)


@pytest.mark.parametrize("fill", [1e4, torch.finfo(torch.float32).max, math.inf])
def test_a_subtracted_padding_mask_keeps_rows_without_keys_as_written(fill: float) -> None:
    """``s - (1 - keep) * fill``; batch row 1 pads every key: uniform rows (finite fills) or NaN (inf, where
    ``0 * inf`` also puts NaN into the kept keys' bias), as the model computes them."""
    def inputs(t):
        keep = torch.ones(B, t)
        keep[1] = 0
        keep[0, t // 2:] = 0
        return [*_qkv(t, torch.float32), keep]

    model = Fn(lambda self, q, k, v, keep: (q @ k.mT - (1 - keep[:, None, None, :]) * fill).softmax(-1) @ v)
    report = _check(model, inputs, torch.float32)
    assert report.rewritten == len(report.records) >= 1, str(report)


def test_rewritten_with_compile() -> None:
    model = Fn(SPELLINGS["operator"])
    torch._dynamo.reset()
    opt = attnopt.optimize(model, compile=True)
    for t in (T, 5):
        q, k, v = _qkv(t, torch.float32)
        torch.testing.assert_close(opt(q, k, v), model(q, k, v), **TOL[torch.float32])
    report = attnopt.explain(opt)
    assert report.records and report.rewritten == len(report.records), str(report)


@pytest.mark.parametrize("fn,why", [
    (lambda self, q, k, v: (q @ k.mT - torch.ones(q.shape[-2], q.shape[-2], dtype=torch.int64)).softmax(-1) @ v,
     "torch.int64 tensor is subtracted"),
    (lambda self, q, k, v: (q @ k.mT - torch.ones(q.shape[-2], q.shape[-2], dtype=torch.uint8)).softmax(-1) @ v,
     "torch.uint8 tensor is subtracted"),
    (lambda self, q, k, v: torch.sub(q @ k.mT, _alibi(q.shape[-2], q.dtype), alpha=2).softmax(-1) @ v,
     "pass through `sub`"),
    (lambda self, q, k, v: (_alibi(q.shape[-2], q.dtype) - q @ k.mT).softmax(-1) @ v,
     "subtracted from another tensor"),
    (lambda self, q, k, v: ((q @ k.mT - torch.zeros(3, 1, H, q.shape[-2], q.shape[-2])).softmax(-1) @ v).mean(0),
     "broadcasts the scores"),
], ids=["int64", "uint8", "alpha", "bias_minus_scores", "broadcast_up"])
def test_look_alikes_are_left_alone_with_a_reason(fn, why: str) -> None:
    model = Fn(fn)
    report = _check(model, lambda t: _qkv(t, torch.float32), torch.float32, lengths=(T,))
    (record,) = report.records
    assert record.decision == "left alone" and why in record.reason, record.reason


@pytest.mark.parametrize("op", [torch.sub, torch.add])
def test_a_score_op_writing_an_out_tensor_is_left_alone_and_still_writes_it(op) -> None:
    """``torch.sub(s, b, out=buf)`` also writes ``buf``, which the caller reads: a rewrite dropping the op would
    leave it unwritten. Next to a rewritten site (the graph runs as rewritten)."""
    def fn(self, q, k, v, b, buf):
        plain = (q @ k.mT * 0.3).softmax(-1) @ v
        written = op(q @ k.mT, b, out=buf).softmax(-1) @ v
        return plain + written

    model = Fn(fn)
    torch._dynamo.reset()
    opt = attnopt.optimize(model)
    q, k, v = _qkv(T, torch.float32)
    b = torch.randn(T, T)
    mine, theirs = torch.zeros(B, H, T, T), torch.zeros(B, H, T, T)
    torch.testing.assert_close(opt(q, k, v, b, mine), model(q, k, v, b, theirs), **TOL[torch.float32])
    torch.testing.assert_close(mine, theirs)
    decisions = sorted((r.decision, r.reason) for r in attnopt.explain(opt).records)
    assert [d for d, _ in decisions] == ["left alone", "rewritten"], decisions
    assert "also writes its `out=` tensor" in decisions[0][1], decisions
