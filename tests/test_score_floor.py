"""Scores floored at the dtype's minimum right before the softmax: ``torch.max(s + mask, finfo.min)`` (XGLM; old
OPT and BioGPT code), ``torch.maximum``, ``clamp(min=finfo.min)``, ``clamp_min``.

The floor raises only ``-inf`` entries to the minimum. Rows that keep a key do not change; a row whose every key
is masked is uniform as written, ``-inf`` keys included. So the site floors its mask tensor, and applies the floor
as spelled to the rows it computes as written: ``torch.maximum`` halves the gradient where the scores tie with
the minimum, ``clamp_min`` does not. Every test compares outputs and the gradients of q, k, v with the code as
written, on masks holding ``-inf``, the minimum and fully masked rows, and checks that the fused candidate ran.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import assert_param_grads_close, count_sdpa

import attnopt
from attnopt.runtime.site import floored_mask

B, H, T, D = 2, 2, 6, 8
MIN = torch.finfo(torch.float32).min


def _floor(s: torch.Tensor, how: str) -> torch.Tensor:
    low = torch.finfo(s.dtype).min
    if how == "max":  # XGLM
        return torch.max(s, torch.full((), low, device=s.device))
    if how == "maximum":
        return torch.maximum(s, torch.tensor(low, dtype=s.dtype))
    if how == "method":
        return s.max(torch.tensor(low, dtype=s.dtype))
    if how == "clamp":
        return torch.clamp(s, min=low)
    return s.clamp_min(low)


SPELLINGS = ["max", "maximum", "method", "clamp", "clamp_min"]


class Floored(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.how = how

    def forward(self, q, k, v, mask):
        s = (q @ k.transpose(-2, -1)) * D**-0.5 + mask
        return _floor(s, self.how).softmax(-1) @ v


def _mask() -> torch.Tensor:
    """Causal with padding: -inf and the minimum mixed, a row hidden by each and a row hidden by both."""
    mask = torch.zeros(B, 1, T, T).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    mask[0, :, :, :2] = MIN  # left padding of 2: rows 0 and 1 hide every key (-inf and the minimum)
    mask[1, :, 2, :] = float("-inf")  # one row of -inf alone: uniform as written, NaN without the floor
    return mask


def _inputs(grad: bool) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    return tuple(torch.randn(B, H, T, D, requires_grad=grad) for _ in range(3))


def _specs(opt: nn.Module) -> list:
    """The specs of the rewritten sites, from ``explain()``'s records."""
    return [r.spec for r in attnopt.explain(opt) if r.rewritten]


@pytest.mark.parametrize("how", SPELLINGS)
@pytest.mark.parametrize("grad", [False, True])
def test_floor_is_rewritten_and_exact(how, grad, monkeypatch):
    model = Floored(how)
    mask = _mask()
    q, k, v = _inputs(grad)
    ref = model(q, k, v, mask)
    assert not ref.isnan().any()  # the floor makes every row uniform or a weighted mean
    opt = attnopt.optimize(model, variant="sdpa")
    calls = count_sdpa(monkeypatch)
    got = opt(q, k, v, mask)
    report = str(attnopt.explain(opt))
    assert "1 of 1 attention site(s) rewritten" in report, report
    assert all("floored at the dtype's minimum" in s.describe() for s in _specs(opt))
    assert [s.score_floor for s in _specs(opt)] == ["clamp" if how.startswith("clamp") else "maximum"]
    assert calls[0] >= 1  # the fused candidate served the call (the hidden rows aside)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
    if grad:
        g = torch.randn_like(ref)
        want = torch.autograd.grad(ref, (q, k, v), g)
        have = torch.autograd.grad(got, (q, k, v), g)
        for a, b in zip(have, want):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


def test_maximum_and_clamp_differ_in_gradient_on_a_masked_row():
    """The reason the site keeps the spelling: where the scores tie with the minimum, ``maximum`` sends half the
    gradient and ``clamp_min`` all of it (the test above checks both against the code as written)."""
    mask = torch.full((1, 1, 1, T), MIN)
    q, k, v = (torch.randn(1, 1, 1, D, requires_grad=True), torch.randn(1, 1, T, D, requires_grad=True),
               torch.randn(1, 1, T, D))
    g = [torch.autograd.grad((Floored(how)(q, k, v, mask) * torch.arange(D)).sum(), q)[0]
         for how in ("maximum", "clamp")]
    assert g[1].abs().sum() > 0
    torch.testing.assert_close(g[0] * 2, g[1])


def test_floor_at_minus_inf_is_no_step():
    class AtInf(nn.Module):
        def forward(self, q, k, v, mask):
            s = (q @ k.transpose(-2, -1)) * D**-0.5 + mask
            return torch.max(s, torch.tensor(float("-inf"))).softmax(-1) @ v

    mask = torch.zeros(B, 1, T, T)
    mask[0, :, :, :2] = float("-inf")
    q, k, v = _inputs(False)
    opt = attnopt.optimize(AtInf(), variant="sdpa")
    torch.testing.assert_close(opt(q, k, v, mask), AtInf()(q, k, v, mask))
    assert [s.score_floor for s in _specs(opt)] == [None]


@pytest.mark.parametrize("case, reason", [
    ("value", "floored at -10000"),
    ("early", "before other steps"),
    ("half", "in float16"),
    ("upcast", "the floor is applied in torch.float64"),  # its minimum lies below every float32 score
    ("twice", "floored twice"),  # each maximum halves a tie's gradient again
])
def test_other_floors_are_left_alone_with_their_reason(case, reason):
    class Other(nn.Module):
        def forward(self, q, k, v, mask):
            s = (q @ k.transpose(-2, -1)) * D**-0.5
            if case == "value":
                s = torch.max(s + mask, torch.tensor(-1e4))
            elif case == "early":
                s = torch.max(s, torch.tensor(torch.finfo(s.dtype).min)) + mask
            elif case == "upcast":
                s = (s + mask).double()
                s = torch.max(s, torch.tensor(torch.finfo(s.dtype).min, dtype=s.dtype)).float()
            elif case == "twice":
                low = torch.tensor(torch.finfo(s.dtype).min)
                s = torch.max(torch.max(s + mask, low), low)
            else:
                s = torch.max(s + mask, torch.tensor(torch.finfo(s.dtype).min, dtype=s.dtype))
            return s.softmax(-1) @ v

    dtype = torch.float16 if case == "half" else torch.float32
    q, k, v = (t.to(dtype) for t in _inputs(False))
    mask = _mask().to(dtype)
    opt = attnopt.optimize(Other(), variant="sdpa")
    out = opt(q, k, v, mask)
    torch.testing.assert_close(out, Other()(q, k, v, mask), equal_nan=True)
    (record,) = list(attnopt.explain(opt))
    assert not record.rewritten and reason in record.reason, record.reason


def test_floored_mask_raises_minus_inf_alone():
    m = torch.tensor([[0.0, float("-inf"), MIN, -5.0]])
    assert floored_mask(m, torch.float32).tolist() == [[0.0, MIN, MIN, -5.0]]


def _xglm() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.XGLMConfig(vocab_size=64, d_model=32, ffn_dim=64, num_layers=2, attention_heads=4,
                                  max_position_embeddings=32, dropout=0.0, attention_dropout=0.0,
                                  activation_dropout=0.0)
    cfg._attn_implementation = "eager"
    return transformers.XGLMForCausalLM(cfg)


@pytest.mark.parametrize("train", [False, True])
def test_xglm_with_a_left_padded_batch(train):
    """XGLM's ``torch.max(attn_weights, full((), finfo.min))``: rewritten in both layers, same logits and gradients
    with pad rows whose every key is hidden."""
    model = _xglm().train(train)
    ids = torch.randint(0, 64, (2, 7))
    am = torch.ones(2, 7, dtype=torch.long)
    am[0, :3] = 0
    opt = attnopt.optimize(model, variant="sdpa")
    ref = model(input_ids=ids, attention_mask=am).logits
    got = opt(input_ids=ids, attention_mask=am).logits
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
    report = attnopt.explain(opt)
    assert [s.score_floor for s in _specs(opt)] == ["maximum"] * 2
    assert "2 of 2 attention site(s) rewritten" in str(report), str(report)
    if train:
        assert_param_grads_close(model, got, ref, atol=2e-5, reduction="sum")


@pytest.mark.parametrize("fill", ["min", "-inf"])
def test_floor_after_a_masked_fill(fill):
    """After ``masked_fill(pad, min)`` (no gradient reaches a filled score) the floor is rewritten, rows with every
    key filled exact in value and gradient; after a ``-inf`` fill alone (a boolean mask) it is left alone."""
    class FilledThenFloored(nn.Module):
        def forward(self, q, k, v, pad):
            s = (q @ k.transpose(-2, -1)) * D**-0.5
            s = s.masked_fill(pad, torch.finfo(s.dtype).min if fill == "min" else float("-inf"))
            return torch.max(s, torch.tensor(torch.finfo(s.dtype).min)).softmax(-1) @ v

    pad = torch.zeros(B, 1, T, T, dtype=torch.bool)
    pad[0, :, :2, :] = True  # two rows of batch 0 hide every key
    pad[1, :, :, :3] = True
    model = FilledThenFloored()
    q, k, v = _inputs(True)
    ref = model(q, k, v, pad)
    opt = attnopt.optimize(model, variant="sdpa")
    got = opt(q, k, v, pad)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
    if fill == "min":
        assert [s.score_floor for s in _specs(opt)] == ["maximum"]
    else:
        (record,) = list(attnopt.explain(opt))
        assert not record.rewritten and "the mask only fills -inf" in record.reason


VALUES = (0.0, float("-inf"), MIN, -5.0, 1.25)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_floor_property(data):
    """Any floor spelling, mask shape and mix of 0, -inf, the minimum and finite values (rows hidden by -inf, by
    the minimum or by both, cross-attention lengths), with and without gradients: the rewrite equals the code."""
    how = data.draw(st.sampled_from(SPELLINGS))
    b, h, tq, tk = (data.draw(st.integers(1, n)) for n in (2, 2, 5, 5))
    shape = data.draw(st.sampled_from([(b, 1, tq, tk), (1, h, tq, tk), (tq, tk), (b, 1, 1, tk)]))
    mask = torch.tensor(data.draw(st.lists(st.sampled_from(VALUES), min_size=math.prod(shape),
                                           max_size=math.prod(shape)))).view(shape)
    grad = data.draw(st.booleans())
    torch.manual_seed(data.draw(st.integers(0, 1000)))
    q = torch.randn(b, h, tq, D, requires_grad=grad)
    k, v = (torch.randn(b, h, tk, D, requires_grad=grad) for _ in range(2))
    model = Floored(how)
    torch._dynamo.reset()
    opt = attnopt.optimize(model, variant="sdpa")
    ref, got = model(q, k, v, mask), opt(q, k, v, mask)
    assert [s.score_floor for s in _specs(opt)] == ["clamp" if how.startswith("clamp") else "maximum"]
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
    if grad:
        g = torch.randn_like(ref)
        for a, w in zip(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
            torch.testing.assert_close(a, w, atol=2e-5, rtol=1e-4)
