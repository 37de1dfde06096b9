"""Exactness under in-place writes and dtype conversions (issue 16, classes 2 and 3).

Class 2: the fused site runs where ``P @ V`` was and reads q, k, v, the masks, added biases and
0-d scale tensors there. A write to one of them (or to a tensor it views) after the product read
it and before ``P @ V`` would make the site read the new value; such sites are left alone with a
reason that names the write. Writes before the read, to tensors the site does not read, or to the
site's own scores are fine and the site is still rewritten.

Class 3: only value-preserving conversions are transparent. Between the product and the softmax a
cast must keep or widen the compute dtype; after the softmax it may go back to the dtype of v (the
``softmax(s.float()).to(q.dtype)`` pattern); casts to integers or bool, and narrowing ones, are not
identities. The mask interpreter applies the conversion to the band's values (truncation,
wrap-around, nonzero) or proves nothing.

Every model is compared with the model as written, through ``attnopt.optimize`` (dynamo) and, where
symbolic_trace can follow it, ``attnopt.rewrite(symbolic_trace(model), inputs)``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import attnopt

B, H, T, D = 2, 2, 5, 8
NEG = float("-inf")
C = D ** -0.5


def qkv(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    return tuple(torch.randn(B, H, T, D, dtype=dtype) for _ in range(3))


def kt(k: torch.Tensor) -> torch.Tensor:
    return k.transpose(-2, -1)


def clones(inputs):
    return [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]


def run_optimize(model: nn.Module, inputs, atol=1e-5, rtol=1e-4) -> attnopt.Report:
    """``optimize(model)`` equals the model as written (each on its own copy of the inputs)."""
    model.eval()
    opt = attnopt.optimize(model, variant="sdpa")
    with torch.no_grad():
        expected = model(*clones(inputs))
        actual = opt(*clones(inputs))
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, equal_nan=True)
    return attnopt.explain(opt)


def run_rewrite(model: nn.Module, inputs, atol=1e-5, rtol=1e-4) -> attnopt.Report:
    """``rewrite(symbolic_trace(model), inputs)`` equals the traced model (each on its own copy)."""
    model.eval()
    gm = fx.symbolic_trace(model)
    new = attnopt.rewrite(gm, clones(inputs), variant="sdpa")
    with torch.no_grad():
        expected = gm(*clones(inputs))
        actual = new(*clones(inputs))
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, equal_nan=True)
    return new.meta["attnopt_report"]


def assert_left_alone(report: attnopt.Report, *words: str) -> str:
    assert report.rewritten == 0, str(report)
    (record,) = report.records
    assert record.decision == "left alone", record.reason
    for w in words:
        assert w in record.reason, record.reason
    return record.reason


# ============================================================================ class 2: in-place writes


class BiasCloneWritten(nn.Module):
    """``b = bias.clone(); s = qk*c + b; b.mul_(0.5)``: the sum read the old b."""

    def __init__(self):
        super().__init__()
        self.register_buffer("bias", torch.randn(1, H, T, T))

    def forward(self, q, k, v):
        b = self.bias.clone()
        s = q @ kt(k) * C + b
        b.mul_(0.5)
        return s.softmax(-1) @ v


class QWrittenAfterProduct(nn.Module):
    def forward(self, q, k, v):
        s = q @ kt(k)
        q.mul_(2)
        return (s * C).softmax(-1) @ v


class KWrittenAfterProduct(nn.Module):
    def forward(self, q, k, v):
        s = q @ kt(k)
        k.add_(1.0)
        return (s * C).softmax(-1) @ v


class MaskZeroedAfterFill(nn.Module):
    def forward(self, q, k, v, m):
        s = (q @ kt(k) * C).masked_fill(m, NEG)
        m.zero_()
        return s.softmax(-1) @ v


class MaskSetitemAfterFill(nn.Module):
    def forward(self, q, k, v, m):
        s = (q @ kt(k) * C).masked_fill(m, NEG)
        m[..., 0] = True
        return s.softmax(-1) @ v


class ScaleTensorFilled(nn.Module):
    """A 0-d scale tensor set to zero after the scores were scaled by it."""

    def forward(self, q, k, v, t):
        s = (q @ kt(k)) * t
        t.fill_(0)
        return s.softmax(-1) @ v


class ViewBaseWritten(nn.Module):
    """q is a view of x; x is written after the product."""

    def forward(self, x, k, v):
        q = x.view(B, H, T, D)
        s = q @ kt(k) * C
        x.mul_(2)
        return s.softmax(-1) @ v


class OutKwargWrite(nn.Module):
    def forward(self, q, k, v, bias):
        b = bias.clone()
        s = q @ kt(k) * C + b
        torch.mul(b, 0.5, out=b)
        return s.softmax(-1) @ v


class InplaceOperatorWrite(nn.Module):
    """``b += 1`` (dynamo keeps the old name) after the sum read b."""

    def forward(self, q, k, v, bias):
        b = bias.clone()
        s = q @ kt(k) * C + b
        b += 1.0
        return s.softmax(-1) @ v


class ActOnBias(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.act = act

    def forward(self, q, k, v, bias):
        b = bias.clone()
        s = q @ kt(k) * C + b
        self.act(b)
        return s.softmax(-1) @ v


class InplaceModuleWrite(ActOnBias):
    """An ``inplace=True`` module applied to the bias after the sum read it."""

    def __init__(self):
        super().__init__(nn.ReLU(inplace=True))


class RepeatKvSourceWritten(nn.Module):
    """GQA: the site reads v's unrepeated source, which is written after ``repeat_kv`` copied it."""

    def forward(self, q, k, v):
        def rep(x):
            return x[:, :, None].expand(B, 1, H, T, D).reshape(B, H, T, D)

        kk, vv = rep(k), rep(v)
        s = q @ kt(kk) * C
        v.mul_(3.0)
        return s.softmax(-1) @ vv


def _inputs(name: str):
    q, k, v = qkv()
    if name in ("MaskZeroedAfterFill", "MaskSetitemAfterFill"):
        return [q, k, v, torch.rand(1, 1, T, T) > 0.6]
    if name == "ScaleTensorFilled":
        return [q, k, v, torch.tensor(0.7)]
    if name == "ViewBaseWritten":
        return [q.reshape(B * H * T, D).clone(), k, v]
    if name in ("OutKwargWrite", "InplaceOperatorWrite", "InplaceModuleWrite"):
        return [q, k, v, torch.randn(1, H, T, T)]
    if name == "RepeatKvSourceWritten":
        return [q, torch.randn(B, 1, T, D), torch.randn(B, 1, T, D)]
    return [q, k, v]


WRITTEN = {
    BiasCloneWritten: ".mul_()", QWrittenAfterProduct: ".mul_()", KWrittenAfterProduct: ".add_()",
    MaskZeroedAfterFill: ".zero_()", MaskSetitemAfterFill: "setitem", ScaleTensorFilled: ".fill_()",
    ViewBaseWritten: ".mul_()", OutKwargWrite: "out=", InplaceOperatorWrite: "+=",
    InplaceModuleWrite: "", RepeatKvSourceWritten: ".mul_()",
}


@pytest.mark.parametrize("cls", list(WRITTEN), ids=lambda c: c.__name__)
def test_write_between_product_and_pv_is_left_alone_with_the_write_named(cls) -> None:
    inputs = _inputs(cls.__name__)
    report = run_optimize(cls(), inputs)
    reason = assert_left_alone(report, "written in place", "the fused kernel would read the new value")
    assert WRITTEN[cls] in reason, reason
    assert "test_exact_inplace_casts.py:" in reason, reason  # the place of the write


# symbolic_trace cannot follow `b += 1` in place (a Proxy has no __iadd__: it becomes b = b + 1) nor `m[...] = x`,
# and it runs `self.bias.clone().mul_()` at trace time (a constant): the bias passed as an input covers it
TRACEABLE = [c for c in WRITTEN if c not in (InplaceOperatorWrite, MaskSetitemAfterFill, BiasCloneWritten)]


@pytest.mark.parametrize("cls", TRACEABLE, ids=lambda c: c.__name__)
def test_write_between_product_and_pv_on_a_symbolic_trace_graph(cls) -> None:
    inputs = _inputs(cls.__name__)
    report = run_rewrite(cls(), inputs)
    assert_left_alone(report, "written in place")


# ---------------------------------------------------------------------------- look-alikes: still rewritten


class QWrittenBeforeProduct(nn.Module):
    def forward(self, q, k, v):
        q.mul_(2)
        return (q @ kt(k) * C).softmax(-1) @ v


class BiasWrittenBeforeItsUse(nn.Module):
    """The bias is written after the product but before the sum reads it: the site reads that value too."""

    def forward(self, q, k, v, bias):
        b = bias.clone()
        s = q @ kt(k) * C
        b.mul_(0.5)
        return (s + b).softmax(-1) @ v


class OtherTensorWritten(nn.Module):
    """A tensor the site does not read is written in the middle."""

    def forward(self, q, k, v, bias):
        y = bias.clone()
        s = q @ kt(k) * C
        y.mul_(2)
        return s.softmax(-1) @ v, y


class VMadeInGraphWritten(nn.Module):
    """v is read by P @ V itself: a write to it before that is what both read. (v is made in the graph: a
    write to a graph input could change q or k, which may share its memory at run time.)"""

    def forward(self, q, k, v):
        p = (q @ kt(k) * C).softmax(-1)
        v = v * 1.0
        v.mul_(2)
        return p @ v


class ScoresInplace(nn.Module):
    """The site's own scores, written in place (functionalized)."""

    def forward(self, q, k, v, m):
        s = q @ kt(k)
        s.div_(D ** 0.5)
        s.masked_fill_(m, NEG)
        return s.softmax(-1) @ v


class WrittenAfterPV(nn.Module):
    def forward(self, q, k, v):
        out = (q @ kt(k) * C).softmax(-1) @ v
        q.mul_(2)
        return out


def _lookalike_inputs(cls):
    q, k, v = qkv()
    if cls in (BiasWrittenBeforeItsUse, OtherTensorWritten):
        return [q, k, v, torch.randn(1, H, T, T)]
    if cls is ScoresInplace:
        return [q, k, v, torch.ones(T, T, dtype=torch.bool).triu(1)]
    return [q, k, v]


LOOKALIKES = [QWrittenBeforeProduct, BiasWrittenBeforeItsUse, OtherTensorWritten, VMadeInGraphWritten, ScoresInplace,
              WrittenAfterPV]


@pytest.mark.parametrize("cls", LOOKALIKES, ids=lambda c: c.__name__)
def test_writes_the_site_does_not_see_are_still_rewritten(cls) -> None:
    report = run_optimize(cls(), _lookalike_inputs(cls))
    assert report.rewritten == 1, str(report)


@pytest.mark.parametrize("cls", [QWrittenBeforeProduct, BiasWrittenBeforeItsUse, VMadeInGraphWritten, WrittenAfterPV],
                         ids=lambda c: c.__name__)
def test_writes_the_site_does_not_see_on_a_symbolic_trace_graph(cls) -> None:
    report = run_rewrite(cls(), _lookalike_inputs(cls))
    assert report.rewritten == 1, str(report)


# ============================================================================ class 3: lossy conversions


class FakeQuantLogits(nn.Module):
    def forward(self, q, k, v):
        s = (q @ kt(k) * 3.0).to(torch.int8).to(torch.float32)
        return s.softmax(-1) @ v


class HardAttention(nn.Module):
    def forward(self, q, k, v):
        p = (q @ kt(k) * C).softmax(-1)
        return p.bool().to(v.dtype) @ v


class HardAttentionThreshold(nn.Module):
    """``p.to(torch.int64)`` truncates every weight below 1 to 0."""

    def forward(self, q, k, v):
        p = (q @ kt(k) * 10.0).softmax(-1)
        return p.to(torch.int64).to(v.dtype) @ v


class Bf16RoundTrip(nn.Module):
    def forward(self, q, k, v):
        s = (q @ kt(k) * C).to(torch.bfloat16).float()
        return s.softmax(-1) @ v


class Bf16Softmax(nn.Module):
    def forward(self, q, k, v):
        return (q @ kt(k) * C).bfloat16().softmax(-1).float() @ v


class HalfOverflow(nn.Module):
    """fp32 logits above 65504 cast to half: inf, then NaN rows as written."""

    def forward(self, q, k, v):
        return (q @ kt(k) * 1e5).half().softmax(-1).float() @ v


class SoftmaxDtypeNarrows(nn.Module):
    def forward(self, q, k, v):
        return torch.softmax(q @ kt(k) * 3.0, -1, dtype=torch.bfloat16).float() @ v


class ProbsNarrowed(nn.Module):
    """fp32 probabilities rounded to bf16 and back before ``P @ V`` (v is fp32)."""

    def forward(self, q, k, v):
        return (q @ kt(k) * C).softmax(-1).bfloat16().float() @ v


class WiderValues(nn.Module):
    """fp32 scores, float64 values: ``P @ V`` runs in float64 as written; the kernel would round v to fp32."""

    def forward(self, q, k, v):
        return (q @ kt(k) * C).softmax(-1).double() @ v.double()


LOSSY = {
    FakeQuantLogits: ("scores", "torch.int8"), HardAttention: ("probabilities", "torch.bool"),
    HardAttentionThreshold: ("probabilities", "torch.int64"), Bf16RoundTrip: ("scores", "torch.bfloat16"),
    Bf16Softmax: ("scores", "torch.bfloat16"), HalfOverflow: ("scores", "torch.float16"),
    SoftmaxDtypeNarrows: ("scores", "torch.bfloat16"), ProbsNarrowed: ("probabilities", "torch.bfloat16"),
    WiderValues: (None, "torch.float64"),
}


@pytest.mark.parametrize("cls", list(LOSSY), ids=lambda c: c.__name__)
def test_lossy_conversion_is_left_alone_with_the_cast_named(cls) -> None:
    what, dtype = LOSSY[cls]
    report = run_optimize(cls(), list(qkv()), atol=0, rtol=0)
    assert_left_alone(report, f"the {what} are converted to {dtype}" if what else f"v has dtype {dtype}",
                      "a lossy conversion")


@pytest.mark.parametrize("cls", list(LOSSY), ids=lambda c: c.__name__)
def test_lossy_conversion_on_a_symbolic_trace_graph(cls) -> None:
    report = run_rewrite(cls(), list(qkv()), atol=0, rtol=0)
    assert_left_alone(report, "a lossy conversion")


# ---------------------------------------------------------------------------- conversions that stay


class HfSoftmaxDtype(nn.Module):
    """HF eager: ``softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)``."""

    def forward(self, q, k, v, mask):
        s = q @ kt(k) * C + mask
        return torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype) @ v


class FloatRoundTripTypeAs(nn.Module):
    def forward(self, q, k, v):
        s = q @ kt(k) * C
        return torch.softmax(s.float(), dim=-1).type_as(s) @ v


class FinfoMinFill(nn.Module):
    def forward(self, q, k, v, keep):
        s = (q @ kt(k) * C).masked_fill(~keep, torch.finfo(q.dtype).min)
        return s.softmax(-1) @ v


class WidenedBeforeSoftmax(nn.Module):
    """bf16 scores widened to fp32, the softmax in fp32, the probabilities back to v's dtype."""

    def forward(self, q, k, v):
        return (q @ kt(k) * C).float().softmax(-1).to(v.dtype) @ v


class SameDtypeCasts(nn.Module):
    def forward(self, q, k, v):
        s = (q @ kt(k)).to(q.dtype) * C
        return s.softmax(-1).to(torch.float32) @ v


@pytest.mark.parametrize("cls,dtype", [(HfSoftmaxDtype, torch.bfloat16), (FloatRoundTripTypeAs, torch.float16),
                                       (FloatRoundTripTypeAs, torch.bfloat16), (FinfoMinFill, torch.bfloat16),
                                       (WidenedBeforeSoftmax, torch.bfloat16), (SameDtypeCasts, torch.float32),
                                       (HfSoftmaxDtype, torch.float32)],
                         ids=lambda x: getattr(x, "__name__", str(x)))
def test_value_preserving_conversions_are_still_rewritten(cls, dtype) -> None:
    q, k, v = qkv(dtype)
    inputs = [q, k, v]
    if cls is HfSoftmaxDtype:
        inputs.append(torch.where(torch.rand(1, 1, T, T) > 0.7, torch.finfo(dtype).min, 0.0).to(dtype))
    if cls is FinfoMinFill:
        inputs.append(torch.rand(1, 1, T, T) > 0.3)
    tol = 2e-2 if dtype != torch.float32 else 1e-5
    report = run_optimize(cls(), inputs, atol=tol, rtol=tol)
    assert report.rewritten == 1, str(report)


# ---------------------------------------------------------------------------- the mask interpreter


class BufferCast(nn.Module):
    """``masked_fill(buffer.to(dtype) == 0, -inf)`` over a buffer of ``values * tril``."""

    def __init__(self, buf: torch.Tensor, dtype: torch.dtype, op: str = "eq0"):
        super().__init__()
        self.register_buffer("bias", buf)
        self.dtype, self.op = dtype, op

    def forward(self, q, k, v):
        t = q.size(-2)
        b = self.bias[:, :, :t, :t].to(self.dtype)
        masked = b == 0 if self.op == "eq0" else ~b if self.op == "not" else b != 1
        return (q @ kt(k) * C).masked_fill(masked, NEG).softmax(-1) @ v


def _tril(dtype=torch.float32):
    return torch.tril(torch.ones(1, 1, T, T, dtype=dtype))


MASK_CASES = {
    # int cast truncates 0.5 to 0: every key masked as written (NaN rows), not causal
    "half_tril_to_int64": (BufferCast(0.5 * _tril(), torch.int64), None),
    "neg_half_tril_to_int32": (BufferCast(-0.5 * _tril(), torch.int32), None),
    # uint8 wraps 256 to 0
    "int_256_tril_to_uint8": (BufferCast(256 * _tril(torch.int64), torch.uint8), None),
    # a float out of uint8's range has no defined conversion: nothing proven
    "float_300_tril_to_uint8": (BufferCast(300.0 * _tril(), torch.uint8), None),
    # int8 wraps 128 to -128 (nonzero: still causal), and 1.5 truncates to 1
    "int_128_tril_to_int8": (BufferCast(128 * _tril(torch.int64), torch.int8), "top_left"),
    "one_and_half_to_int64_ne1": (BufferCast(1.5 * _tril(), torch.int64, "ne1"), "top_left"),
    # bool is "nonzero": 0.5 is True; nanoGPT's uint8 tril buffer .bool()
    "half_tril_to_bool": (BufferCast(0.5 * _tril(), torch.bool, "not"), "top_left"),
    "uint8_tril_to_bool": (BufferCast(_tril(torch.uint8), torch.bool, "not"), "top_left"),
    # float16 rounds 1e-8 to 0: every key masked as written
    "tiny_tril_to_half": (BufferCast(1e-8 * _tril(), torch.float16), None),
}


@pytest.mark.parametrize("name", list(MASK_CASES))
def test_mask_interpreter_applies_the_conversion(name: str) -> None:
    model, causal = MASK_CASES[name]
    report = run_optimize(model, list(qkv()))
    assert report.rewritten == 1, str(report)
    assert report.records[0].spec.causal == causal, report.records[0].reason


class TracedCast(nn.Module):
    """The band arrives as an argument (symbolic_trace folds ops on a buffer into a constant)."""

    def forward(self, q, k, v, band):
        return (q @ kt(k) * C).masked_fill(band.to(torch.int64) == 0, NEG).softmax(-1) @ v


@pytest.mark.parametrize("scale,causal", [(0.5, None), (1.0, "top_left")])
def test_mask_interpreter_applies_the_conversion_on_a_symbolic_trace_graph(scale: float, causal) -> None:
    report = run_rewrite(TracedCast(), [*qkv(), scale * _tril()])
    assert report.rewritten == 1 and report.records[0].spec.causal == causal, str(report)


# ============================================================================ more spellings and graphs


class QImul(nn.Module):
    def forward(self, q, k, v):
        s = q @ kt(k)
        q *= 2
        return (s * C).softmax(-1) @ v


class KBaseSetitem(nn.Module):
    """k is a slice (a view) of x; x is written through ``x[...] = ...`` after the product."""

    def forward(self, q, x, v):
        s = q @ kt(x[..., :D]) * C
        x[..., 0] = 5.0
        return s.softmax(-1) @ v


def test_writes_through_an_operator_and_a_base_view_are_left_alone() -> None:
    q, k, v = qkv()
    assert_left_alone(run_optimize(QImul(), [q, k, v]), "`q` is written in place")
    report = run_optimize(KBaseSetitem(), [q, torch.randn(B, H, T, D + 2), v])
    assert_left_alone(report, "`k` is written in place by setitem", "shares its memory")


class SharedMask(nn.Module):
    """One mask for two sites, written between them: each site reads it as its own sum did."""

    def __init__(self, write_between: bool):
        super().__init__()
        self.write_between = write_between

    def forward(self, q, k, v, q2, mask):
        m = mask.clone()
        s1 = q @ kt(k) * C + m
        if self.write_between:
            o1 = s1.softmax(-1) @ v
            m.mul_(2.0)
            return o1 + (q2 @ kt(k) * C + m).softmax(-1) @ v
        s2 = q2 @ kt(k) * C + m
        m.mul_(2.0)  # after both sums read it, before both products with v
        return s1.softmax(-1) @ v + s2.softmax(-1) @ v


@pytest.mark.parametrize("write_between", [True, False])
def test_a_mask_shared_by_two_sites(write_between: bool) -> None:
    q, k, v = qkv()
    report = run_optimize(SharedMask(write_between), [q, k, v, torch.randn_like(q), torch.randn(1, 1, T, T)])
    assert report.rewritten == (2 if write_between else 0), str(report)


@pytest.mark.parametrize("cls,why", [(QWrittenAfterProduct, "written in place"),
                                     (MaskZeroedAfterFill, "written in place"),
                                     (FakeQuantLogits, None), (HardAttention, None)],
                         ids=lambda x: getattr(x, "__name__", str(x)))
def test_torch_export_graphs(cls, why: str | None) -> None:
    """export keeps in-place ops (``aten.mul_``); its casts (``aten.to.dtype``) are outside the vocabulary."""
    inputs = _inputs(cls.__name__) if cls in WRITTEN else list(qkv())
    model = cls().eval()
    gm = torch.export.export(model, tuple(clones(inputs))).module()
    new = attnopt.rewrite(gm, clones(inputs), variant="sdpa")
    with torch.no_grad():
        torch.testing.assert_close(new(*clones(inputs)), model(*clones(inputs)), atol=0, rtol=0, equal_nan=True)
    report = new.meta["attnopt_report"]
    assert report.rewritten == 0, str(report)
    if why is not None:
        assert_left_alone(report, why)


class NoOpCastUnderAutocast(nn.Module):
    """Under autocast the scores are already bfloat16 (q is fp32): ``.to(torch.bfloat16)`` changes nothing."""

    def forward(self, q, k, v):
        return (q @ kt(k) * C).to(torch.bfloat16).softmax(-1).to(torch.bfloat16) @ v


def test_a_cast_to_the_dtype_the_scores_already_have_stays_transparent() -> None:
    q, k, v = qkv()
    model = NoOpCastUnderAutocast().eval()
    opt = attnopt.optimize(model, variant="sdpa")
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        expected, actual = model(q, k, v), opt(q, k, v)
    torch.testing.assert_close(actual.float(), expected.float(), atol=2e-2, rtol=2e-2)
    assert attnopt.explain(opt).rewritten == 1


# ---------------------------------------------------------------------------- the canon helpers


def test_convert_scalar_follows_torch() -> None:
    from attnopt.passes.canon import convert_scalar

    cases = [(0.5, torch.int64), (-0.5, torch.int32), (1.9, torch.int8), (-1.9, torch.int16), (256, torch.uint8),
             (128, torch.int8), (-129, torch.int8), (0.5, torch.bool), (0, torch.bool), (True, torch.float16),
             (1e-8, torch.float16), (0.1, torch.float32), (0.1, torch.bfloat16), (1e5, torch.float16),
             (2 ** 40 + 1, torch.float32), (-1, torch.uint8)]
    for value, dtype in cases:
        src = torch.tensor(value)
        assert convert_scalar(value, dtype) == src.to(dtype).item(), (value, dtype)
    for value, dtype in [(300.0, torch.uint8), (-1.5, torch.uint8), (float("inf"), torch.int64),
                         (float("nan"), torch.int32), (1e30, torch.int64)]:
        with pytest.raises(ValueError):
            convert_scalar(value, dtype)


def test_holds_exactly() -> None:
    from attnopt.passes.canon import holds_exactly

    f16, bf16, f32, f64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
    assert all(holds_exactly(w, n) for w, n in [(f32, f16), (f32, bf16), (f64, f32), (f32, f32), (f64, bf16)])
    assert not any(holds_exactly(w, n) for w, n in [(f16, bf16), (bf16, f16), (bf16, f32), (f16, f32),
                                                     (torch.int64, f32), (f32, torch.int8), (torch.bool, f16)])


# ============================================================================ review: more writes, views, aliases
import torch.nn.functional as F  # noqa: E402


def _seeded(model: nn.Module, make_inputs, atol=1e-5, rtol=1e-4, rewrite: bool = False):
    """The optimized model equals the model as written; each call gets fresh inputs from ``make_inputs``
    (which may alias each other) and the same random seed. Returns the report."""
    model.eval()
    if rewrite:
        gm = fx.symbolic_trace(model)
        torch.manual_seed(0)
        opt = attnopt.rewrite(gm, make_inputs(), variant="sdpa")
        reference = gm
    else:
        opt = attnopt.optimize(model, variant="sdpa")
        reference = model
    with torch.no_grad():
        torch.manual_seed(0)
        expected = reference(*make_inputs())
        torch.manual_seed(0)
        actual = opt(*make_inputs())
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, equal_nan=True)
    return opt.meta["attnopt_report"] if rewrite else attnopt.explain(opt)


_FIXED = [torch.randn(B, H, T, D) for _ in range(3)] + [torch.randn(1, H, T, T)]


def _fixed_inputs():
    return [x.clone() for x in _FIXED]


# positional `inplace` flags of torch.nn.functional activations (and dropout's fourth argument)
POSITIONAL_INPLACE = {
    "relu": lambda b: F.relu(b, True),
    "relu6": lambda b: F.relu6(b, True),
    "hardtanh": lambda b: F.hardtanh(b, -.1, .1, True),
    "leaky_relu": lambda b: F.leaky_relu(b, .5, True),
    "elu": lambda b: F.elu(b, 1.0, True),
    "celu": lambda b: F.celu(b, 1.0, True),
    "selu": lambda b: F.selu(b, True),
    "rrelu": lambda b: F.rrelu(b, .1, .3, False, True),
    "hardswish": lambda b: F.hardswish(b, True),
    "mish": lambda b: F.mish(b, True),
    "hardsigmoid": lambda b: F.hardsigmoid(b, True),
    "silu": lambda b: F.silu(b, True),
    "threshold": lambda b: F.threshold(b, 0.0, 3.0, True),
    "dropout": lambda b: F.dropout(b, .5, True, True),
    "alpha_dropout": lambda b: F.alpha_dropout(b, .5, True, True),
    "input_keyword": lambda b: F.relu(input=b, inplace=True),
    "hardtanh_module": nn.Hardtanh(-.1, .1, inplace=True),
    "leaky_relu_module": nn.LeakyReLU(.5, inplace=True),
}


class ActOnK(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.act = act

    def forward(self, q, k, v, bias):
        s = q @ kt(k) * C
        self.act(k)
        return s.softmax(-1) @ v


@pytest.mark.parametrize("name", list(POSITIONAL_INPLACE))
@pytest.mark.parametrize("where", [ActOnBias, ActOnK], ids=lambda c: c.__name__)
def test_positional_inplace_flags_are_writes(name: str, where) -> None:
    report = _seeded(where(POSITIONAL_INPLACE[name]), _fixed_inputs)
    assert_left_alone(report, "written in place")


@pytest.mark.parametrize("name", ["relu", "hardtanh", "dropout", "rrelu", "hardtanh_module"])
def test_positional_inplace_flags_on_a_symbolic_trace_graph(name: str) -> None:
    report = _seeded(ActOnBias(POSITIONAL_INPLACE[name]), _fixed_inputs, rewrite=True)
    assert_left_alone(report, "written in place")


def test_an_inplace_flag_that_is_false_is_not_a_write() -> None:
    report = _seeded(ActOnBias(lambda b: F.hardtanh(b, -.1, .1, False)), _fixed_inputs)
    assert report.rewritten == 1, str(report)


def test_inplace_parameter_found_by_signature() -> None:
    from attnopt.passes.canon import inplace_flag

    g = fx.Graph()
    x = g.placeholder("x")
    cases = [(F.relu, (x, True), {}, True), (F.relu, (x,), {}, False), (F.hardtanh, (x, -1., 1., True), {}, True),
             (F.dropout, (x, .5, True, True), {}, True), (F.dropout, (x, .5, True), {"inplace": True}, True),
             (F.dropout, (x, .5, True, False), {}, False), (F.leaky_relu, (x,), {"negative_slope": .1}, False),
             (torch.relu, (x,), {}, False)]
    for fn, args, kwargs, want in cases:
        node = g.call_function(fn, args, kwargs)
        assert inplace_flag(node) is want, (fn, args, kwargs)


# views made by torch.* function forms, and by methods, of the base the site's q and k are split from
BASE_VIEWS = {
    "torch.swapaxes": lambda x: torch.swapaxes(x, 0, 1),
    "torch.swapdims": lambda x: torch.swapdims(x, 0, 1),
    "torch.movedim": lambda x: torch.movedim(x, 0, 1),
    "torch.moveaxis": lambda x: torch.moveaxis(x, 0, 1),
    "torch.as_strided": lambda x: torch.as_strided(x, x.shape, x.stride()),
    "torch.ravel": lambda x: torch.ravel(x),
    "torch.tensor_split": lambda x: torch.tensor_split(x, 2, dim=-1)[0],
    "torch.hsplit": lambda x: torch.hsplit(x, 2)[0],
    "torch.vsplit": lambda x: torch.vsplit(x, 2)[0],
    "torch.dsplit": lambda x: torch.dsplit(x, [1])[1],
    "torch.squeeze": lambda x: torch.squeeze(x),
    "torch.unflatten": lambda x: torch.unflatten(x, -1, (2, D)),
    "torch.view_as_real": lambda x: torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (D, 2)))),
    "torch.narrow_copy_then_view": lambda x: torch.flatten(torch.narrow(x, 0, 0, 1)),
    ".movedim": lambda x: x.movedim(0, 1),
    ".swapdims": lambda x: x.swapdims(0, 1),
    ".moveaxis": lambda x: x.moveaxis(0, 1),
    ".ravel": lambda x: x.ravel(),
    ".tensor_split": lambda x: x.tensor_split(2, -1)[1],
    ".unflatten": lambda x: x.unflatten(-1, (2, D)),
    ".view_as": lambda x: x.view_as(x),
}


class CatBaseViewWritten(nn.Module):
    def __init__(self, view):
        super().__init__()
        self.view = view

    def forward(self, q, k, v, bias):
        base = torch.cat([q, k], -1)
        qq, kk = base.split(D, -1)
        s = (qq @ kt(kk)) * C
        self.view(base).mul_(2)
        return s.softmax(-1) @ qq


@pytest.mark.parametrize("name", list(BASE_VIEWS))
def test_a_write_through_any_view_of_the_base_is_seen(name: str) -> None:
    report = _seeded(CatBaseViewWritten(BASE_VIEWS[name]), _fixed_inputs)
    assert_left_alone(report, "written in place", "shares its memory")


class TensorSplitInput(nn.Module):
    def forward(self, x, v):
        qq, kk = torch.tensor_split(x, 2, dim=-1)
        s = (qq @ kt(kk)) * C
        x.mul_(2)
        return s.softmax(-1) @ qq


def test_torch_tensor_split_of_an_input_written_later() -> None:
    x = torch.randn(B, H, T, 2 * D)
    report = _seeded(TensorSplitInput(), lambda: [x.clone(), x.new_zeros(1)])
    assert_left_alone(report, "written in place", "shares its memory")


def test_unknown_ops_may_alias_and_known_fresh_ones_do_not() -> None:
    from attnopt.passes.canon import may_alias

    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    cases = [
        (g.call_function(torch.cat, ([x, y],)), x, False),
        (g.call_function(torch.swapaxes, (x, 0, 1)), x, True),
        (g.call_function(torch.tensor_split, (x, 2)), x, True),
        (g.call_function(torch.exp, (x,)), x, False),
        (g.call_function(torch.matmul, (x, y)), y, False),
        (g.call_function(F.dropout, (x, 0.5, False)), x, True),  # returns x itself when not training
        (g.call_function(torch.einsum, ("ij->ji", x)), x, True),  # a permuted view
        (g.call_method("type_as", (x, y)), x, True),  # x itself when the dtypes agree
        (g.call_method("masked_fill", (x, y, 0.0)), y, False),
        (g.call_function(torch.ops.aten.add_.Tensor, (x, y)), y, False),
        (g.call_function(torch.ops.aten.add_.Tensor, (x, y)), x, True),
        (g.call_function(torch.ops.aten.alias.default, (x,)), x, True),
        (g.call_function(lambda a: a, (x,)), x, True),  # unknown: may return its input
        (g.call_method("copy_", (x, y)), x, True),  # an in-place method returns self ...
        (g.call_method("copy_", (x, y)), y, False),  # ... and never its source
        (g.call_method("set_", (x, y)), y, True),  # except set_, which makes self share the source's memory
        (g.call_function(torch.ops.attnopt_tests.scaled, (x, 2.0)), x, False),  # a custom op: new memory
        (g.call_function(torch.ops.attnopt_tests.halve_, (x,)), x, True),  # a custom op writing its argument
    ]
    for node, inp, want in cases:
        assert may_alias(node, inp) is want, (node.target, inp, want)


# graph inputs that share memory at run time: a write to one may change what the site reads from another
class WriteVReadK(nn.Module):
    def forward(self, q, k, v):
        p = ((q @ kt(k)) * 0.25).softmax(-1)
        v.mul_(2)
        return p @ k


class WriteVReadV(nn.Module):
    def forward(self, q, k, v):
        p = ((q @ kt(k)) * 0.25).softmax(-1)
        v.mul_(2)
        return p @ v


class WriteBufferReadQ(nn.Module):
    """Module state written in the window: it may be the tensor the caller passed as q."""

    def __init__(self):
        super().__init__()
        self.register_buffer("state", torch.zeros(B, H, T, D))

    def forward(self, q, k, v):
        p = ((q @ kt(k)) * 0.25).softmax(-1)
        self.state.add_(1.0)
        return p @ v


def _sharing_inputs():
    q, k = _FIXED[0], _FIXED[1]
    a = q.clone()
    return [a, k.clone(), a.view(B, H, T, D)]


@pytest.mark.parametrize("cls", [WriteVReadK, WriteVReadV], ids=lambda c: c.__name__)
@pytest.mark.parametrize("rewrite", [False, True], ids=["optimize", "rewrite"])
def test_a_write_to_a_graph_input_may_change_another_graph_input(cls, rewrite: bool) -> None:
    report = _seeded(cls(), _sharing_inputs, rewrite=rewrite)
    assert_left_alone(report, "may share memory with the attention's inputs at run time")


def test_a_write_to_module_state_may_change_a_graph_input() -> None:
    assert_left_alone(_seeded(WriteBufferReadQ(), lambda: [x.clone() for x in _FIXED[:3]]),
                      "may share memory with the attention's inputs at run time")


class WriteInGraphTensor(nn.Module):
    """The written tensor is made inside the graph (a product): it cannot share memory with an input."""

    def forward(self, q, k, v):
        p = ((q @ kt(k)) * 0.25).softmax(-1)
        w = v * 1.0
        w.mul_(2)
        return p @ w


def test_a_write_to_a_tensor_made_in_the_graph_is_fine() -> None:
    assert _seeded(WriteInGraphTensor(), _sharing_inputs).rewritten == 1


class CopyIntoFreshTensor(nn.Module):
    """A cache-style ``fresh.copy_(src)`` in the window (a state cache filled from an input): the result is
    the fresh tensor, so the write touches neither ``src`` nor anything the site reads."""

    def __init__(self):
        super().__init__()
        self.register_buffer("state", torch.zeros(B, H, T, D))

    def forward(self, q, k, v, bias):
        p = ((q @ kt(k)) * 0.25 + bias).softmax(-1)
        cache = torch.zeros(B, H, T, D)
        cache.copy_(v * self.state + k)
        cache.add_(1.0)
        return p @ v, cache


def test_a_copy_into_a_fresh_tensor_writes_only_that_tensor() -> None:
    # through dynamo only: symbolic_trace evaluates ``torch.zeros(...)`` once into a module constant, which
    # is module state (and kept by every call), so there the write is rightly refused
    report = _seeded(CopyIntoFreshTensor(), lambda: [x.clone() for x in _FIXED])
    assert report.rewritten == 1, str(report)


@torch.library.custom_op("attnopt_tests::scaled", mutates_args=())
def _scaled(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x * factor


@_scaled.register_fake
def _(x: torch.Tensor, factor: float) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("attnopt_tests::halve_", mutates_args=("x",))
def _halve_(x: torch.Tensor) -> None:
    x.mul_(0.5)


@_halve_.register_fake
def _(x: torch.Tensor) -> None:
    return None


class CustomOpResultWritten(nn.Module):
    """A custom op (a mixture-of-experts kernel) returns new memory, even from module state: writing its
    result in the window is fine."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(B, H, T, D))

    def forward(self, q, k, v, bias):
        p = ((q @ kt(k)) * 0.25 + bias).softmax(-1)
        out = torch.ops.attnopt_tests.scaled(self.weight, 2.0)
        out.add_(1.0)
        return p @ v, out


class CustomOpWritesTheBias(nn.Module):
    """A custom op that mutates its argument writes the added bias in the window."""

    def forward(self, q, k, v, bias):
        s = (q @ kt(k)) * 0.25 + bias
        torch.ops.attnopt_tests.halve_(bias)
        return s.softmax(-1) @ (v + bias.sum())


def test_a_custom_op_result_is_new_memory() -> None:
    report = _seeded(CustomOpResultWritten(), lambda: [x.clone() for x in _FIXED])
    assert report.rewritten == 1, str(report)


def test_a_custom_op_that_mutates_the_bias_is_refused() -> None:
    report = _seeded(CustomOpWritesTheBias(), lambda: [x.clone() for x in _FIXED])
    assert_left_alone(report, "written in place")


# factories that read only the scores' shape, dtype and device
class OnesLikeMask(nn.Module):
    def forward(self, q, k, v):
        s = q @ kt(k) * C
        return s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), NEG).softmax(-1) @ v


class FullLikeMask(nn.Module):
    def forward(self, q, k, v):
        s = q @ kt(k) * C
        return (s + torch.full_like(s, NEG).triu(1)).softmax(-1) @ v


class ZerosLikeMask(nn.Module):
    def forward(self, q, k, v):
        s = q @ kt(k) * C
        keep = torch.zeros_like(s, dtype=torch.bool).logical_not().tril()
        return s.masked_fill(~keep, NEG).softmax(-1) @ v


@pytest.mark.parametrize("cls", [OnesLikeMask, FullLikeMask, ZerosLikeMask], ids=lambda c: c.__name__)
@pytest.mark.parametrize("rewrite", [False, True], ids=["optimize", "rewrite"])
def test_like_factories_of_the_scores_read_only_their_metadata(cls, rewrite: bool) -> None:
    report = _seeded(cls(), lambda: [x.clone() for x in _FIXED[:3]], rewrite=rewrite)
    assert report.rewritten == 1, str(report)
    assert report.records[0].spec.causal, str(report)


def test_a_like_factory_no_longer_keeps_the_scores_alive() -> None:
    import operator

    new = attnopt.rewrite(fx.symbolic_trace(OnesLikeMask().eval()), [x.clone() for x in _FIXED[:3]], variant="sdpa")
    assert new.meta["attnopt_report"].rewritten == 1
    graphs = [m.graph for m in new.modules() if isinstance(m, fx.GraphModule)]
    assert not any(n.target is operator.matmul for g in graphs for n in g.nodes), [str(g) for g in graphs]


def test_reads_only_dtype_on_like_factories() -> None:
    from attnopt.passes.find_sites import reads_only_dtype

    g = fx.Graph()
    s, x = g.placeholder("s"), g.placeholder("x")
    s.meta["val"] = torch.empty(2, 2)
    x.meta["val"] = torch.empty(())
    yes = [g.call_function(torch.ones_like, (s,), {"dtype": torch.bool}), g.call_function(torch.zeros_like, (s,)),
           g.call_function(torch.empty_like, (s,)), g.call_function(torch.full_like, (s, -1.0)),
           g.call_function(torch.rand_like, (s,)), g.call_function(torch.ops.aten.ones_like.default, (s,))]
    no = [g.call_function(torch.full_like, (s, x)), g.call_function(torch.full_like, (s, s)),
          g.call_function(torch.full_like, (s,), {"fill_value": x}), g.call_function(torch.ones_like, (x,)),
          g.call_function(torch.add, (s, 1))]
    assert all(reads_only_dtype(n, s) for n in yes)
    assert not any(reads_only_dtype(n, s) for n in no)


# writes a schema or a name shows only through a list, a tuple of outputs, or an op whose schema hides a view
@torch.library.custom_op("attnopt_tests::scale_all_", mutates_args=["xs"])
def _scale_all_(xs: list[torch.Tensor]) -> None:
    for x in xs:
        x.mul_(3.0)


@_scale_all_.register_fake
def _(xs: list[torch.Tensor]) -> None:
    return None


HIDDEN_WRITES = {
    "foreach": lambda k: torch._foreach_mul_([k], 3.0),
    "custom_op_list": lambda k: torch.ops.attnopt_tests.scale_all_([k]),
    "unsafe_split": lambda k: torch.unsafe_split(k, 4, -1)[0].mul_(3.0),
    "unsafe_split_method": lambda k: k.unsafe_split(4, -1)[1].mul_(3.0),
    "aten_unsafe_view": lambda k: torch.ops.aten._unsafe_view.default(k, [-1]).mul_(3.0),
    "aten_unsafe_split": lambda k: torch.ops.aten.unsafe_split.Tensor(k, 4, -1)[0].mul_(3.0),
    "dequantize": lambda k: k.dequantize().mul_(3.0),
}


class HiddenWrite(nn.Module):
    def __init__(self, write):
        super().__init__()
        self.write = write

    def forward(self, q, k, v):
        k = k * 1.0
        p = ((q @ kt(k)) * 0.25).softmax(-1)
        self.write(k)  # as written, p was computed from the old k
        return p @ k


@pytest.mark.parametrize("name", list(HIDDEN_WRITES))
def test_writes_through_lists_and_unannotated_views_are_seen(name: str) -> None:
    assert_left_alone(_seeded(HiddenWrite(HIDDEN_WRITES[name]), lambda: [x.clone() for x in _FIXED[:3]]),
                      "written in place")


class SortOutTuple(nn.Module):
    def forward(self, q, k, v):
        k = k * 1.0
        p = ((q @ kt(k)) * 0.25).softmax(-1)
        torch.sort(q * 1.0, dim=-1, out=(k, torch.empty(k.shape, dtype=torch.long)))
        return p @ k


def test_a_tuple_of_outputs_is_a_write_of_each() -> None:
    assert_left_alone(_seeded(SortOutTuple(), lambda: [x.clone() for x in _FIXED[:3]], rewrite=True),
                      "written in place")


class BufferResetAfterTheMask(nn.Module):
    """The causal buffer is zeroed (through a list) after the mask was built from it: the mask as built is the
    one the attention uses, so it must not be rebuilt later from the zeroed buffer."""

    def __init__(self):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(T, T)).view(1, 1, T, T))

    def forward(self, q, k, v):
        mask = self.bias[:, :, :T, :T] == 0
        torch._foreach_mul_([self.bias], 0.0)
        return ((q @ kt(k)) * 0.25).masked_fill(mask, NEG).softmax(-1) @ v


def test_a_buffer_written_through_a_list_after_its_mask_is_built() -> None:
    model = BufferResetAfterTheMask().eval()
    written = copy.deepcopy(model)  # each call zeroes its own buffer: one copy for each side
    opt = attnopt.optimize(model, variant="sdpa")
    with torch.no_grad():
        torch.testing.assert_close(opt(*_FIXED[:3]), written(*_FIXED[:3]))
