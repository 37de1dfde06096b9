"""Unit tests of the mask plan and the causal proof (``attnopt.passes.masks``).

A proven causal mask lets the site call SDPA with ``is_causal=True`` and no mask tensor; an
unproven one is passed as a tensor (slower, still exact). A spy candidate records what each
site passed, so the tests can tell the two apart; outputs always equal the original's.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from support import capture

import attnopt
from attnopt.kernels import registry
from attnopt.kernels.registry import FunctionCandidate
from attnopt.passes.find_sites import Match, find_sites
from attnopt.passes.masks import Band, BandReader, MaskPlan

CALLS: list[dict] = []


def _spy(q, k, v, **kwargs):
    CALLS.append(kwargs)
    return registry.get_candidate("sdpa")(q, k, v, **kwargs)


@pytest.fixture(autouse=True)
def spy_candidate(monkeypatch: pytest.MonkeyPatch):
    """A candidate ``spy`` that records the SDPA keyword arguments of every call."""
    monkeypatch.setitem(registry._REGISTRY, "spy", FunctionCandidate("spy", _spy, lambda spec: None))
    CALLS.clear()
    yield


def plan_of(model: nn.Module, *inputs) -> MaskPlan:
    """The mask plan find_sites proves for the one site of ``model(*inputs)``."""
    gm, ex = capture(model, *inputs)
    concrete = {n: t for n, t in zip((n for n in gm.graph.nodes if n.op == "placeholder"), ex)}
    (found,) = find_sites(gm, concrete)
    assert isinstance(found, Match), found.reason
    return found.mask


def rewritten(model: nn.Module, *inputs) -> tuple[fx.GraphModule, list, fx.GraphModule]:
    gm, ex = capture(model, *inputs)
    new = attnopt.rewrite(gm, ex, variant="spy")
    report = new.meta["attnopt_report"]
    assert report.rewritten == 1, str(report)
    return gm, ex, new


def call(gm: fx.GraphModule, ex: list) -> torch.Tensor:
    out = gm(*ex)
    return out[0] if isinstance(out, (tuple, list)) else out


def qkv(tq: int, tk: int, b: int = 2, h: int = 2, d: int = 8) -> tuple[torch.Tensor, ...]:
    return torch.randn(b, h, tq, d), torch.randn(b, h, tk, d), torch.randn(b, h, tk, d)


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, equal_nan=True)
    assert torch.equal(torch.isnan(a), torch.isnan(b))


class Attn(nn.Module):
    """``softmax(q @ k^T / sqrt(d) + mask) @ v`` with the mask written by ``self.mask``."""

    def __init__(self, n: int = 12, buffer: torch.Tensor | None = None):
        super().__init__()
        if buffer is not None:
            self.register_buffer("bias", buffer)
        self.n = n

    def mask(self, att: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, q, k, v):
        att = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
        att = self.mask(att)
        return F.softmax(att, dim=-1) @ v


def tril_float(n: int = 12) -> torch.Tensor:
    return torch.tril(torch.ones(n, n)).view(1, 1, n, n)


class TopLeftSlice(Attn):
    def mask(self, att):
        tq, tk = att.shape[-2:]
        return att.masked_fill(self.bias[:, :, :tq, :tk] == 0, float("-inf"))


class BottomRightSlice(Attn):
    def mask(self, att):
        tq, tk = att.shape[-2:]
        return att.masked_fill(self.bias[:, :, tk - tq:tk, :tk] == 0, float("-inf"))


class BoolBufferNot(Attn):
    def mask(self, att):
        tq, tk = att.shape[-2:]
        return att.masked_fill(~self.bias[:, :, :tq, :tk], float("-inf"))


class Uint8BufferBool(Attn):
    def mask(self, att):
        tq, tk = att.shape[-2:]
        return torch.where(self.bias[:, :, :tq, :tk].bool(), att, torch.finfo(att.dtype).min)


# ----------------------------------------------------------------------------- buffers


@pytest.mark.parametrize("tq, tk", [(6, 6), (3, 7), (1, 5)])
def test_tril_buffer_top_left_slice_is_causal_top_left(tq: int, tk: int) -> None:
    model = TopLeftSlice(buffer=tril_float())
    q, k, v = qkv(tq, tk)
    plan = plan_of(model, q, k, v)
    assert plan.kind == "bool" and plan.causal == "top_left"
    assert [n.name for n in plan.guarded] == ["l_self_buffers_bias_"]  # the proof read the buffer: guarded
    gm, ex, new = rewritten(model, q, k, v)
    assert_same(call(new, ex), model(q, k, v))
    assert CALLS[-1]["is_causal"] is True and CALLS[-1]["attn_mask"] is None


@pytest.mark.parametrize("tq, tk", [(3, 7), (1, 9)])
def test_bottom_right_slice_is_causal_bottom_right(tq: int, tk: int) -> None:
    model = BottomRightSlice(buffer=tril_float())
    q, k, v = qkv(tq, tk)
    plan = plan_of(model, q, k, v)
    assert plan.causal == "bottom_right"
    gm, ex, new = rewritten(model, q, k, v)
    assert_same(call(new, ex), model(q, k, v))
    # SDPA's is_causal is top-left: with Tq != Tk a bottom-right mask must go in as a tensor
    assert CALLS[-1]["is_causal"] is False and CALLS[-1]["attn_mask"] is not None


def test_bottom_right_slice_with_equal_lengths_uses_is_causal() -> None:
    model = BottomRightSlice(buffer=tril_float())
    q, k, v = qkv(5, 5)
    gm, ex, new = rewritten(model, q, k, v)
    assert_same(call(new, ex), model(q, k, v))
    assert CALLS[-1]["is_causal"] is True


@pytest.mark.parametrize("model", [BoolBufferNot(buffer=torch.ones(12, 12, dtype=torch.bool).tril().view(1, 1, 12, 12)),
                                   Uint8BufferBool(buffer=torch.ones(12, 12, dtype=torch.uint8).tril()[None, None])],
                         ids=["bool", "uint8"])
def test_bool_and_uint8_tril_buffers_are_causal(model: Attn) -> None:
    q, k, v = qkv(6, 6)
    assert plan_of(model, q, k, v).causal == "top_left"
    gm, ex, new = rewritten(model, q, k, v)
    assert_same(call(new, ex), model(q, k, v))


@pytest.mark.parametrize("pattern", ["two_sided_band", "tril_diag1", "triu", "random"])
def test_non_triangular_buffer_is_not_causal_but_rewritten_with_the_mask(pattern: str) -> None:
    n = 12
    ones = torch.ones(n, n)
    buf = {"two_sided_band": ones.tril(1) * ones.triu(-2), "tril_diag1": ones.tril(1), "triu": ones.triu(),
           "random": (torch.rand(n, n) < 0.6).float().fill_diagonal_(1.0)}[pattern].view(1, 1, n, n)
    model = TopLeftSlice(buffer=buf)
    q, k, v = qkv(6, 6)
    plan = plan_of(model, q, k, v)
    assert plan.causal is None and plan.guarded == []
    gm, ex, new = rewritten(model, q, k, v)
    assert_same(call(new, ex), model(q, k, v))
    assert CALLS[-1]["is_causal"] is False and CALLS[-1]["attn_mask"] is not None


# ----------------------------------------------------------------------------- masks built at run time


class OnesTrilWhere(Attn):
    def mask(self, att):
        tq, tk = att.shape[-2:]
        keep = torch.ones(tq, tk, dtype=torch.bool, device=att.device).tril()
        return torch.where(keep, att, float("-inf"))


class TorchTrilOnes(Attn):
    def mask(self, att):
        tq, tk = att.shape[-2:]
        return att.masked_fill(torch.tril(torch.ones(tq, tk, dtype=torch.bool)) == 0, float("-inf"))


class FullTriuAdd(Attn):
    def mask(self, att):
        tq, tk = att.shape[-2:]
        return att + torch.full((tq, tk), float("-inf"), device=att.device).triu(1)


class NewFullTriuAdd(Attn):
    def mask(self, att):
        tq, tk = att.shape[-2:]
        return att + att.new_full((tq, tk), float("-inf")).triu(1)


class OnesTriuShifted(Attn):
    """``torch.ones(i, j, dtype=bool).triu(j - i + 1)``: the bottom-right causal mask of decoding."""

    def mask(self, att):
        i, j = att.shape[-2:]
        return att.masked_fill(torch.ones(i, j, dtype=torch.bool, device=att.device).triu(j - i + 1), float("-inf"))


@pytest.mark.parametrize("cls, tq, tk, causal", [
    (OnesTrilWhere, 6, 6, "top_left"),
    (OnesTrilWhere, 3, 7, "top_left"),
    (TorchTrilOnes, 6, 6, "top_left"),
    (FullTriuAdd, 6, 6, "top_left"),
    (NewFullTriuAdd, 6, 6, "top_left"),
    (OnesTriuShifted, 6, 6, "top_left"),
    (OnesTriuShifted, 3, 8, "bottom_right"),
    (OnesTriuShifted, 1, 8, "bottom_right"),
])
def test_run_time_builders_are_proven_causal(cls, tq: int, tk: int, causal: str) -> None:
    model = cls()
    q, k, v = qkv(tq, tk)
    plan = plan_of(model, q, k, v)
    assert plan.causal == causal
    assert plan.guarded == []  # built from constants: nothing can change it later
    gm, ex, new = rewritten(model, q, k, v)
    assert_same(call(new, ex), model(q, k, v))
    if causal == "top_left":
        assert CALLS[-1]["is_causal"] is True and CALLS[-1]["attn_mask"] is None


def test_band_reader_on_builders() -> None:
    def f(x):
        return (torch.ones(5, 7, dtype=torch.bool).tril(2), torch.full((5, 7), float("-inf")).triu(1),
                ~torch.ones(5, 7, dtype=torch.bool).triu(1), torch.ones(5, 7).tril()[1:, 2:] == 0,
                torch.ones(5, 7, dtype=torch.bool).tril() & x)

    store: dict = {}

    def backend(gm, ex):
        store["gm"] = gm
        return gm.forward

    torch._dynamo.reset()
    torch.compile(f, backend=backend, fullgraph=True)(torch.ones(5, 7, dtype=torch.bool))
    gm = store["gm"]
    outs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    reader = BandReader(gm, {})
    assert reader.band(outs[0]) == Band(5, 7, (2,), (True, False))
    b = reader.band(outs[1])
    assert (b.cuts, b.values) == ((0,), (0.0, -math.inf))
    assert reader.band(outs[2]) == Band(5, 7, (0,), (True, False))
    # slicing rows [1:] and cols [2:] shifts the diagonal by 1 - 2; `== 0` flips the values
    assert reader.band(outs[3]) == Band(4, 5, (-1,), (False, True))
    # a run-time input ANDed in: the band holds while it is all True (a condition the site checks per call)
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    assert reader.band(outs[4]) == Band(5, 7, (0,), (True, False))
    assert reader.conditions == [(x, True)]
    assert reader.guarded == []


# ----------------------------------------------------------------------------- buffers changed in place


def _nanogpt_case(tq: int = 6):
    model = TopLeftSlice(buffer=tril_float())
    q, k, v = qkv(tq, tq)
    gm, ex, new = rewritten(model, q, k, v)
    assert any(t is model.bias for t in ex), "dynamo passes the live buffer to the graph"
    return model, (q, k, v), ex, new


@pytest.mark.parametrize("edit", ["mask_one_more_key", "unmask_a_future_key", "zero_", "fill_ones"])
def test_buffer_changed_in_place_is_followed(edit: str) -> None:
    model, inputs, ex, new = _nanogpt_case()
    assert_same(call(new, ex), model(*inputs))
    assert CALLS[-1]["is_causal"] is True
    with torch.no_grad():
        if edit == "mask_one_more_key":
            model.bias[0, 0, 4, 1] = 0.0
        elif edit == "unmask_a_future_key":
            model.bias[0, 0, 1, 4] = 1.0
        elif edit == "zero_":
            model.bias.zero_()  # every key masked: every row NaN as written
        else:
            model.bias.fill_(1.0)  # nothing masked
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = call(new, ex)
    expected = model(*inputs)
    assert_same(out, expected)
    if edit == "zero_":
        assert torch.isnan(expected).all()
    assert CALLS[-1]["is_causal"] is False and CALLS[-1]["attn_mask"] is not None
    assert any("no longer holds the proven causal pattern" in str(w.message) for w in caught)

    # restoring the pattern makes is_causal legal again
    with torch.no_grad():
        model.bias.copy_(tril_float())
    assert_same(call(new, ex), model(*inputs))
    assert CALLS[-1]["is_causal"] is True


def test_buffer_replaced_by_a_new_tensor_is_checked() -> None:
    """A call with a different (non-triangular) tensor in the buffer's slot uses that tensor's values."""
    model, inputs, ex, new = _nanogpt_case()
    other = torch.ones_like(model.bias).triu()
    ex2 = [other if t is model.bias else t for t in ex]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = call(new, ex2)
    model.bias = other
    assert_same(out, model(*inputs))


def test_buffer_changed_in_place_end_to_end() -> None:
    model = TopLeftSlice(buffer=tril_float())
    q, k, v = qkv(6, 6)
    opt = attnopt.optimize(model, variant="spy")
    assert_same(opt(q, k, v), model(q, k, v))
    assert attnopt.explain(opt).rewritten == 1 and CALLS[-1]["is_causal"] is True
    with torch.no_grad():
        model.bias[0, 0, 5, 0] = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = opt(q, k, v)
    assert_same(out, model(q, k, v))
    assert CALLS[-1]["is_causal"] is False


# ----------------------------------------------------------------------------- gradients to mask tensors


class LearnedTriangularBias(nn.Module):
    """An additive bias that is a parameter and happens to start out causal-shaped."""

    def __init__(self, n: int = 6):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(n, n).masked_fill(torch.ones(n, n).triu(1).bool(), -1e30))
        with torch.no_grad():
            self.bias.copy_(torch.where(torch.ones(n, n).tril().bool(), 0.0, torch.finfo(torch.float32).min))

    def forward(self, q, k, v):
        att = q @ k.transpose(-2, -1) * 0.3 + self.bias
        return att.softmax(-1) @ v


def test_triangular_parameter_is_not_replaced_by_is_causal() -> None:
    """is_causal would cut the gradient that reaches a learned bias through the mask."""
    model = LearnedTriangularBias()
    q, k, v = qkv(6, 6)
    assert plan_of(model, q, k, v).causal is None
    gm, ex, new = rewritten(model, q, k, v)
    assert CALLS == [] or CALLS[-1]["attn_mask"] is not None
    cot = torch.randn(2, 2, 6, 8)
    (call(new, ex) * cot).sum().backward()
    g_new = model.bias.grad.clone()
    model.bias.grad = None
    (model(q, k, v) * cot).sum().backward()
    assert CALLS[-1]["attn_mask"] is not None
    torch.testing.assert_close(g_new, model.bias.grad, atol=1e-5, rtol=1e-4)
    assert g_new.abs().sum() > 0


# ----------------------------------------------------------------------------- finite fills


class FiniteFill(nn.Module):
    def __init__(self, fill: float, also_inf: bool = False):
        super().__init__()
        self.fill, self.also_inf = fill, also_inf

    def forward(self, q, k, v, masked):
        att = (q @ k.transpose(-2, -1)) * 0.25
        att = att.masked_fill(masked, self.fill)
        if self.also_inf:
            att = att.masked_fill(torch.eye(att.size(-1), dtype=torch.bool), float("-inf"))
        return F.softmax(att, -1) @ v


def test_finite_fill_plan_passes_the_dtype_minimum_and_checks_a_bound() -> None:
    q, k, v = (torch.randn(1, 2, 5, 4) for _ in range(3))
    masked = torch.rand(1, 1, 5, 5) < 0.4
    masked[..., 0] = False
    plan = plan_of(FiniteFill(-1e4), q, k, v, masked)
    assert plan.kind == "additive" and plan.bound_fill == -1e4 and plan.min_rows == "mean"
    assert plan.causal is None
    gm, ex, new = rewritten(FiniteFill(-1e4), q, k, v, masked)
    torch.testing.assert_close(call(new, ex), call(gm, ex), atol=1e-5, rtol=1e-4)
    assert len(CALLS) == 2  # checked against the reference on the first call of its shape key, then run
    kwargs = CALLS[-1]
    mask = kwargs["attn_mask"]
    assert not kwargs["is_causal"] and mask.dtype == torch.float32
    assert torch.equal(mask == torch.finfo(torch.float32).min, masked.expand_as(mask))


class LegacyGPT2(nn.Module):
    """Early Hugging Face GPT-2: ``w * b + -1e4 * (1 - b)`` written as ``where(tril, w, -1e4)``."""

    def __init__(self, n: int = 8):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(n, n, dtype=torch.bool)).view(1, 1, n, n))

    def forward(self, q, k, v):
        w = (q @ k.transpose(-2, -1)) / math.sqrt(v.size(-1))
        tq, tk = w.shape[-2:]
        w = torch.where(self.bias[:, :, tk - tq:tk, :tk], w, -1e4)
        return F.softmax(w, dim=-1) @ v


@pytest.mark.parametrize("big_scores", [False, True])
def test_finite_fill_with_a_causal_buffer_uses_is_causal_while_the_bound_holds(big_scores: bool) -> None:
    q, k, v = (torch.randn(2, 2, 8, 4) for _ in range(3))
    if big_scores:  # scores near -1e4: the fill is not negligible and the site computes it as written
        q, k = torch.full_like(q, 100.0), torch.full_like(k, -50.0)
    model = LegacyGPT2()
    plan = plan_of(model, q, k, v)
    assert plan.bound_fill == -1e4 and plan.causal == "top_left"
    gm, ex, new = rewritten(model, q, k, v)
    torch.testing.assert_close(call(new, ex), call(gm, ex), atol=1e-5, rtol=1e-4)
    assert len(CALLS) == (0 if big_scores else 2)  # the candidate runs only under the bound (checked, then run)
    if not big_scores:
        assert all(c["is_causal"] and c["attn_mask"] is None for c in CALLS)


def test_finite_fill_with_other_masks_is_refused() -> None:
    q, k, v = (torch.randn(1, 2, 5, 4) for _ in range(3))
    report = attnopt.explain(FiniteFill(-1e4, also_inf=True), q, k, v, torch.ones(5, 5, dtype=torch.bool).triu(1),
                             variant="spy")
    assert report.rewritten == 0 and "together with fills of other values" in report.records[0].reason


# ----------------------------------------------------------------------------- run-time terms (padding masks)


class CausalAndPadding(nn.Module):
    """``tril & pad[b, kv]`` (or ``triu(1) | ~pad``): causal exactly when no key is padded."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form

    def forward(self, q, k, v, pad):
        t = q.size(-2)
        i = torch.arange(t, device=q.device)
        causal = i[None, :] <= i[:, None]
        s = (q @ k.transpose(-2, -1)) * q.size(-1) ** -0.5
        if self.form == "and":
            keep = causal[None, None] & pad[:, None, None, :]
            return s.masked_fill(~keep, float("-inf")).softmax(-1) @ v
        if self.form == "or":
            hidden = ~causal[None, None] | ~pad[:, None, None, :]
            return s.masked_fill(hidden, float("-inf")).softmax(-1) @ v
        keep = (causal[None, None] & pad[:, None, None, :]).expand(q.size(0), 1, t, t)  # Hugging Face style
        return (s + torch.where(keep, torch.zeros((), dtype=s.dtype), torch.finfo(s.dtype).min)).softmax(-1) @ v


@pytest.mark.parametrize("form", ["and", "or", "hf_where"])
def test_causal_proof_with_a_padding_term_is_checked_per_call(form: str) -> None:
    model = CausalAndPadding(form)
    q, k, v = qkv(6, 6)
    full = torch.ones(2, 6, dtype=torch.bool)
    opt = attnopt.optimize(model, variant="spy")
    assert_same(opt(q, k, v, full), model(q, k, v, full))
    (rec,) = attnopt.explain(opt).records
    assert rec.spec.causal == "top_left" and rec.spec.conditions == 1, rec.reason
    assert "run-time mask term" in rec.reason
    assert CALLS[-1]["is_causal"] is True and CALLS[-1]["attn_mask"] is None

    padded = full.clone()
    padded[1, :2] = False  # left padding: the second sequence's first queries see no key
    q2, k2, v2 = (t.clone().requires_grad_(True) for t in (q, k, v))
    before = len(CALLS)
    out, ref = opt(q2, k2, v2, padded), model(q, k, v, padded)
    assert_same(out, ref)
    # the mask tensor is passed (rows of the dtype's minimum run the reference computation instead)
    assert len(CALLS) > before or form == "hf_where"
    assert all(c["is_causal"] is False and c["attn_mask"] is not None for c in CALLS[before:])
    if form == "hf_where":  # rows of the dtype's minimum: uniform as written, gradients too
        g = torch.autograd.grad(out.sum(), (q2, k2, v2))
        q3, k3, v3 = (t.clone().requires_grad_(True) for t in (q, k, v))
        g_ref = torch.autograd.grad(model(q3, k3, v3, padded).sum(), (q3, k3, v3))
        for a, b in zip(g, g_ref):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_a_term_of_two_run_time_masks_is_not_a_proof() -> None:
    class TwoInputs(nn.Module):
        def forward(self, q, k, v, a, b):
            s = q @ k.transpose(-2, -1)
            return s.masked_fill(~(a & b), float("-inf")).softmax(-1) @ v

    q, k, v = qkv(5, 5)
    a = torch.rand(5, 5) < 0.7  # inputs read as no band: neither side of `&` is known
    a[:, 0] = True
    plan = plan_of(TwoInputs(), q, k, v, a, a.clone())
    assert plan.causal is None and plan.conditions == []


def test_compiled_graph_passes_the_mask_for_run_time_terms() -> None:
    model = CausalAndPadding("and")
    q, k, v = qkv(6, 6)
    full = torch.ones(2, 6, dtype=torch.bool)
    padded = full.clone()
    padded[0, -1] = False
    opt = attnopt.optimize(model, variant="sdpa", compile=True)
    assert_same(opt(q, k, v, full), model(q, k, v, full))
    assert_same(opt(q, k, v, padded), model(q, k, v, padded))
