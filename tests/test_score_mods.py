"""Score modifiers (attention-spellings.md, section G) and the ``flex`` candidate.

A score modifier is an elementwise function between the product and the softmax, such as
tanh soft-capping ``c * tanh(s / c)``. The matcher reads it into an
:class:`~attnopt.spec.ElementwiseScoreMod` (FlexAttention's signature); SDPA cannot apply it,
so the site is left alone under ``variant="sdpa"`` and rewritten for candidates that take
``score_mod=`` (``flex``, ``math``, the tiled kernels), with outputs and gradients equal to the
original's.

FlexAttention compiles a kernel per shape and mask kind (seconds each on a CPU), so only one
test runs the compiled kernel; the others check the candidate's own wiring (masks, causal
block mask, GQA, score_mod order) on ``flex_attention`` uncompiled, which computes the same
function.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from support import capture

import attnopt
from attnopt.kernels import flex as flex_mod
from attnopt.kernels.reference import reference_attention
from attnopt.kernels.registry import get_candidate
from attnopt.spec import AttentionSpec, ElementwiseScoreMod

B, H, T, D = 2, 2, 8, 8
CAP = 5.0


class SoftCapped(nn.Module):
    """Gemma-2 style: scale, divide by the cap, tanh, multiply by the cap, causal mask, softmax."""

    def __init__(self, where_mask: str = "causal", mod_after_mask: bool = False):
        super().__init__()
        self.where_mask = where_mask
        self.mod_after_mask = mod_after_mask

    def forward(self, q, k, v):
        att = (q @ k.transpose(-2, -1)) * D ** -0.5
        keep = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool).tril()
        if self.mod_after_mask:
            att = att.masked_fill(~keep, float("-inf"))
        att = att / CAP
        att = torch.tanh(att)
        att = att * CAP
        if self.where_mask == "causal" and not self.mod_after_mask:
            att = att.masked_fill(~keep, float("-inf"))
        return F.softmax(att, dim=-1) @ v


def qkv():
    return tuple(torch.randn(B, H, T, D) * 3 for _ in range(3))


def rewrite(model: nn.Module, *inputs, variant: str):
    gm, ex = capture(model, *inputs)
    return gm, ex, attnopt.rewrite(gm, ex, variant=variant)


# ----------------------------------------------------------------------------- reading the modifier


def test_softcap_is_read_as_a_score_mod_and_sdpa_refuses_it_with_reason() -> None:
    q, k, v = qkv()
    _, _, new = rewrite(SoftCapped(), q, k, v, variant="sdpa")
    (record,) = new.meta["attnopt_report"].records
    assert not record.rewritten
    assert "score modifier" in record.reason and "5*tanh(s)" in record.reason, record.reason


def test_score_mod_after_a_mask_is_left_alone_with_reason() -> None:
    q, k, v = qkv()
    _, _, new = rewrite(SoftCapped(mod_after_mask=True), q, k, v, variant="math")
    (record,) = new.meta["attnopt_report"].records
    assert not record.rewritten and "applied after a mask" in record.reason, record.reason


def test_elementwise_score_mod_steps_and_description() -> None:
    mod = ElementwiseScoreMod((("tanh",), ("mul", 30.0)))
    s = torch.randn(5) * 100
    idx = torch.zeros(())
    torch.testing.assert_close(mod(s, idx, idx, idx, idx), 30.0 * torch.tanh(s))
    assert mod.describe() == "30*tanh(s)"
    with pytest.raises(ValueError, match="unknown score modifier step"):
        ElementwiseScoreMod((("exp",),))


@pytest.mark.parametrize("variant", ["math", "tiled64"])
def test_softcap_rewritten_exactly_for_score_mod_candidates(variant: str) -> None:
    q, k, v = qkv()
    gm, ex, new = rewrite(SoftCapped(), q, k, v, variant=variant)
    (record,) = new.meta["attnopt_report"].records
    assert record.rewritten, record.reason
    assert record.spec.score_mod == "5*tanh(s)" and record.spec.causal == "top_left"
    assert record.spec.scale == pytest.approx(D ** -0.5 / CAP)
    leaves = [t.clone().requires_grad_() for t in ex]
    ref_leaves = [t.clone().requires_grad_() for t in ex]
    out, ref = new(*leaves)[0], gm(*ref_leaves)[0]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    cot = torch.randn_like(ref)
    (out * cot).sum().backward()
    (ref * cot).sum().backward()
    for a, b in zip(leaves, ref_leaves):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- the flex candidate


def test_flex_supports_and_refuses_with_reasons() -> None:
    cand = get_candidate("flex")
    assert cand.supports(AttentionSpec(scale=0.1, score_mod="5*tanh(s)")) is None
    why = cand.supports(AttentionSpec(scale=0.1, dropout_p=0.1, dropout_mode="on"))
    assert why is not None and "dropout" in why
    assert cand.available(torch.device("cpu")) in (None, "compiling FlexAttention on CPU needs a C++ compiler "
                                                         "(set CXX or install g++)")
    with pytest.raises(ValueError, match="no dropout"):
        cand(*qkv(), attn_mask=None, dropout_p=0.5, is_causal=False, scale=1.0, enable_gqa=False)


@pytest.fixture
def uncompiled_flex(monkeypatch: pytest.MonkeyPatch):
    """``flex`` on FlexAttention's uncompiled implementation: the same function, no per-shape compile."""
    monkeypatch.setattr(flex_mod, "_compiled", lambda: flex_mod.flex_attention)


@pytest.mark.parametrize("mask", ["none", "causal", "bool", "additive", "gqa_causal"])
def test_flex_wiring_equals_the_reference(mask: str, uncompiled_flex) -> None:
    q, k, v = qkv()
    kwargs: dict = dict(attn_mask=None, is_causal=False, enable_gqa=False)
    if mask == "causal":
        kwargs["is_causal"] = True
    elif mask == "bool":
        keep = torch.rand(B, 1, T, T) < 0.6
        keep[..., 0] = True
        kwargs["attn_mask"] = keep
    elif mask == "additive":
        kwargs["attn_mask"] = torch.randn(1, H, 1, T)
    elif mask == "gqa_causal":
        k, v = k[:, :1], v[:, :1]
        kwargs.update(is_causal=True, enable_gqa=True)
    mod = ElementwiseScoreMod((("tanh",), ("mul", CAP)))
    with torch.no_grad():
        out = get_candidate("flex")(q, k, v, dropout_p=0.0, scale=0.2, score_mod=mod, **kwargs)
    ref = reference_attention(q, k, v, scale=0.2, score_mod=mod, **kwargs)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    # the modifier matters here: without it the result differs
    plain = reference_attention(q, k, v, scale=0.2, **kwargs)
    assert not torch.allclose(out, plain, atol=1e-3)


def test_flex_needing_gradients_on_cpu_is_exact(uncompiled_flex) -> None:
    q, k, v = (t.requires_grad_() for t in qkv())
    mod = ElementwiseScoreMod((("tanh",), ("mul", CAP)))
    out = get_candidate("flex")(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True, scale=0.2,
                                enable_gqa=False, score_mod=mod)
    ref = reference_attention(q, k, v, is_causal=True, scale=0.2, score_mod=mod)
    torch.testing.assert_close(out, ref)
    g = torch.autograd.grad(out.sum(), (q, k, v))
    g_ref = torch.autograd.grad(ref.sum(), (q, k, v))
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b)


def test_optimize_with_compiled_flex_equals_the_original() -> None:
    """End to end through ``optimize(variant="flex")``: the compiled FlexAttention kernel runs."""
    if get_candidate("flex").available(torch.device("cpu")) is not None:
        pytest.fail("this machine has a C++ compiler (the CI image does); FlexAttention must compile here")
    flex_mod.clear_caches()
    model = SoftCapped().eval()
    q, k, v = qkv()
    opt = attnopt.optimize(model, variant="flex")
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = opt(q, k, v)
        ref = model(q, k, v)
    # Exact whether or not the upstream kernel is right on this machine: the site checks flex against
    # the reference on this call and, if it differs, drops it with a warning and runs the reference.
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    report = attnopt.explain(opt)
    assert report.rewritten == 1 and report.records[0].rewrite == "flex", str(report)
    assert flex_mod._compiled.cache_info().currsize == 1  # the compiled kernel was run (and checked)
    rejected = report.records[0].extra.get("rejected", {})
    assert bool(rejected) == any("'flex' does not match" in str(w.message) for w in caught), (rejected, caught)
    assert math.isfinite(out.abs().max().item())


# ----------------------------------------------------------------------------- other elementwise modifiers


OTHER_MODS = {
    "clamp": (lambda s: torch.clamp(s, -2.0, 2.0), "clamp(s, -2, 2)"),
    "clip_min_method": (lambda s: s.clip(min=-1.0), "clamp(s, -1, None)"),
    "clamp_inplace_max": (lambda s: s.clamp_(max=1.5), "clamp(s, None, 1.5)"),
    "sigmoid_scaled": (lambda s: torch.sigmoid(s) * 8.0, "8*sigmoid(s)"),
    "shift": (lambda s: s + 1.5, "(s + 1.5)"),
    "shift_inside_tanh": (lambda s: torch.tanh(s / 4.0 - 0.25) * 4.0, "4*tanh((s - 0.25))"),
}


class Modified(nn.Module):
    def __init__(self, mod):
        super().__init__()
        self.mod = mod

    def forward(self, q, k, v):
        att = self.mod((q @ k.transpose(-2, -1)) * D ** -0.5)
        keep = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
        return F.softmax(att.masked_fill(~keep, float("-inf")), dim=-1) @ v


@pytest.mark.parametrize("variant", ["math", "tiled64"])
@pytest.mark.parametrize("name", list(OTHER_MODS))
def test_other_elementwise_modifiers_are_exact(name: str, variant: str) -> None:
    fn, described = OTHER_MODS[name]
    model = Modified(fn)
    q, k, v = (t.requires_grad_(True) for t in qkv())
    gm, ex, new = rewrite(model, q, k, v, variant=variant)
    (record,) = new.meta["attnopt_report"].records
    assert record.rewritten, record.reason
    assert described in record.reason and "causal" in record.reason, record.reason
    out, ref = new(*ex)[0], model(q, k, v)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    g = torch.autograd.grad(out.square().sum(), (q, k, v))
    g_ref = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for a, b in zip(g, g_ref):  # fp32 gradients of O(10) summed over blocks in another order
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)


def test_a_shift_after_a_mask_is_left_alone_with_reason() -> None:
    def fn(m, q, k, v):
        keep = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool).tril()
        att = (q @ k.transpose(-2, -1)).masked_fill(~keep, float("-inf")) + 2.0
        return att.softmax(-1) @ v

    class Fn(nn.Module):
        def forward(self, q, k, v):
            return fn(self, q, k, v)

    _, _, new = rewrite(Fn(), *qkv(), variant="math")
    (record,) = new.meta["attnopt_report"].records
    assert not record.rewritten and "(s + 2) is applied after a mask" in record.reason, record.reason


def test_score_mod_steps_are_validated() -> None:
    with pytest.raises(ValueError, match="unknown score modifier step"):
        ElementwiseScoreMod((("clamp", None, None),))
    with pytest.raises(ValueError, match="unknown score modifier step"):
        ElementwiseScoreMod((("add", float("inf")),))


def test_without_a_compiler_flex_sites_are_left_alone_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flex_mod, "_cpp_compiler", lambda: None)
    q, k, v = qkv()
    model = SoftCapped()
    opt = attnopt.optimize(model, variant="flex")
    torch.testing.assert_close(opt(q, k, v), model(q, k, v))
    (record,) = attnopt.explain(opt).records
    assert not record.rewritten and "C++ compiler" in record.reason, record.reason
    torch._dynamo.reset()
    opt = attnopt.optimize(model)  # auto: the tiled kernel or math serve it instead
    torch.testing.assert_close(opt(q, k, v), model(q, k, v), atol=1e-5, rtol=1e-4)
    (record,) = attnopt.explain(opt).records
    assert record.rewritten and "flex" not in record.extra["candidates"], record.extra
    (entry,) = record.extra["tuning"].values()
    assert "C++ compiler" in entry.rejected["flex"] and entry.choice != "flex"
