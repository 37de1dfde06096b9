"""Sliding-window masks: proven as a band, passed to candidates as ``window=w``.

A causal sliding window (query ``i`` keeps keys ``i - w < j <= i``) written as a mask is read by
the band interpreter (``attnopt.passes.masks``) from buffers, ``tril``/``triu`` chains, index
arithmetic over ``arange`` and several masks in a row. The site then passes ``is_causal=True,
window=w``: FlexAttention turns it into a ``block_mask``, the tiled kernel skips the hidden
blocks, and SDPA receives the band as a boolean mask. Outputs and gradients equal the original.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from support import capture

import attnopt
from attnopt.kernels import reference, registry
from attnopt.kernels.bands import window_keep
from attnopt.kernels.registry import FunctionCandidate
from attnopt.kernels.tiled import count_blocks
from attnopt.passes.find_sites import Match, find_sites
from attnopt.passes.masks import BandReader

W = 3
CALLS: list[dict] = []


def _spy(q, k, v, **kwargs):
    CALLS.append(dict(kwargs))
    return reference.reference_attention(q, k, v, **kwargs)


@pytest.fixture(autouse=True)
def spy_candidate(monkeypatch: pytest.MonkeyPatch):
    """``spy`` records the keywords a windowed candidate receives; ``spy_sdpa`` those an SDPA-like one gets."""
    monkeypatch.setitem(registry._REGISTRY, "spy", FunctionCandidate("spy", _spy, lambda s: None, windowed=True))
    monkeypatch.setitem(registry._REGISTRY, "spy_sdpa", FunctionCandidate("spy_sdpa", _spy, lambda s: None))
    CALLS.clear()
    torch._dynamo.reset()
    yield


# ----------------------------------------------------------------------------- spellings of a window


def _tril_triu(t, dev):
    return torch.ones(t, t, dtype=torch.bool, device=dev).tril().triu(-(W - 1))


def _tril_minus_tril(t, dev):
    ones = torch.ones(t, t, dtype=torch.bool, device=dev)
    return ones.tril() & ~ones.tril(-W)


def _arange_broadcast(t, dev):
    i = torch.arange(t, device=dev)[:, None]
    j = torch.arange(t, device=dev)[None, :]
    return (i >= j) & (i - j < W)


def _arange_distance(t, dev):
    i = torch.arange(t, device=dev)
    d = i.view(-1, 1) - i.view(1, -1)  # q_idx - kv_idx
    return torch.logical_and(d >= 0, d <= W - 1)


def _float_band(t, dev):
    ones = torch.ones(t, t, device=dev)
    return (ones.tril() * ones.triu(-(W - 1))) == 1


SPELLINGS = {"tril_triu": _tril_triu, "tril_minus_tril": _tril_minus_tril, "arange_broadcast": _arange_broadcast,
             "arange_distance": _arange_distance, "float_band": _float_band}


class KeepMask(nn.Module):
    """``masked_fill(~keep, -inf)`` with ``keep`` built by one spelling."""

    def __init__(self, spelling):
        super().__init__()
        self.spelling = spelling

    def forward(self, q, k, v):
        keep = self.spelling(q.size(-2), q.device)
        s = (q @ k.transpose(-2, -1)) * q.size(-1) ** -0.5
        return s.masked_fill(~keep, float("-inf")).softmax(-1) @ v


class TwoFills(nn.Module):
    """A causal mask, then a second mask hiding keys ``W`` or more behind."""

    def forward(self, q, k, v):
        t = q.size(-2)
        s = (q @ k.transpose(-2, -1)) * q.size(-1) ** -0.5
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=q.device).tril(-W), float("-inf"))
        return s.softmax(-1) @ v


class AdditiveMin(nn.Module):
    """An additive mask of the dtype's minimum built from index comparisons (Hugging Face style)."""

    def forward(self, q, k, v):
        t = q.size(-2)
        i = torch.arange(t, device=q.device)
        hidden = (i[None, :] > i[:, None]) | (i[:, None] - i[None, :] >= W)
        mask = torch.zeros(t, t, dtype=q.dtype, device=q.device).masked_fill(hidden, torch.finfo(q.dtype).min)
        return ((q @ k.transpose(-2, -1)) * q.size(-1) ** -0.5 + mask).softmax(-1) @ v


class WindowBuffer(nn.Module):
    """A registered float window buffer, sliced top-left or bottom-right like nanoGPT's ``bias``."""

    def __init__(self, n: int = 16, bottom_right: bool = False):
        super().__init__()
        ones = torch.ones(n, n)
        self.register_buffer("bias", (ones.tril() * ones.triu(-(W - 1))).view(1, 1, n, n))
        self.bottom_right = bottom_right

    def forward(self, q, k, v):
        tq, tk = q.size(-2), k.size(-2)
        b = self.bias[:, :, tk - tq:tk, :tk] if self.bottom_right else self.bias[:, :, :tq, :tk]
        s = (q @ k.transpose(-2, -1)) * q.size(-1) ** -0.5
        return s.masked_fill(b == 0, float("-inf")).softmax(-1) @ v


def qkv(tq: int = 10, tk: int | None = None, grad: bool = False) -> tuple[torch.Tensor, ...]:
    tk = tq if tk is None else tk
    out = torch.randn(2, 2, tq, 8), torch.randn(2, 2, tk, 8), torch.randn(2, 2, tk, 8)
    return tuple(t.requires_grad_(grad) for t in out)


def assert_same_with_grads(model: nn.Module, opt: nn.Module, tq: int = 10, tk: int | None = None) -> None:
    q, k, v = qkv(tq, tk, grad=True)
    out, ref = opt(q, k, v), model(q, k, v)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4, equal_nan=True)
    if torch.isnan(ref).any():
        return
    g = torch.autograd.grad(out.square().sum(), (q, k, v))
    g_ref = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


MODELS = {**{f"keep-{name}": (lambda f=f: KeepMask(f)) for name, f in SPELLINGS.items()},
          "two-fills": TwoFills, "additive-min": AdditiveMin, "buffer": WindowBuffer,
          "buffer-bottom-right": lambda: WindowBuffer(bottom_right=True)}


@pytest.mark.parametrize("name", list(MODELS))
def test_window_spellings_are_proven_and_reach_candidates_as_window(name: str) -> None:
    model = MODELS[name]()
    opt = attnopt.optimize(model, variant="spy")
    assert_same_with_grads(model, opt)
    (rec,) = attnopt.explain(opt).records
    assert rec.rewritten, rec.reason
    assert rec.spec.window == W and rec.spec.causal is not None, rec.spec.describe()
    assert f"sliding window {W}" in rec.reason
    assert CALLS[-1]["window"] == W and CALLS[-1]["is_causal"] is True and CALLS[-1]["attn_mask"] is None


@pytest.mark.parametrize("name", ["keep-arange_broadcast", "additive-min", "buffer"])
def test_candidates_without_windows_receive_the_band_as_a_bool_mask(name: str) -> None:
    model = MODELS[name]()
    opt = attnopt.optimize(model, variant="spy_sdpa")
    assert_same_with_grads(model, opt)
    kw = CALLS[-1]
    assert "window" not in kw and kw["is_causal"] is False
    assert torch.equal(kw["attn_mask"], window_keep(10, 10, W, "cpu"))


@pytest.mark.parametrize("variant", ["sdpa", "tiled64", "math"])
def test_window_is_exact_with_each_candidate(variant: str) -> None:
    model = KeepMask(_arange_broadcast)
    opt = attnopt.optimize(model, variant=variant)
    for t in (10, 17, 5):  # new lengths are recaptured with symbolic sizes
        assert_same_with_grads(model, opt, tq=t)
    records = attnopt.explain(opt).records
    assert len(records) >= 2  # the static capture and the symbolic one
    assert all(r.spec.window == W for r in records), [r.reason for r in records]


def test_tiled_kernel_skips_blocks_outside_the_window() -> None:
    from attnopt.kernels.tiled import tiled_attention

    q, k, v = (torch.randn(1, 1, 64, 8) for _ in range(3))
    out = registry.get_candidate("tiled64")(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True,
                                              scale=0.3, enable_gqa=False, window=W)
    expected = reference.reference_attention(q, k, v, attn_mask=window_keep(64, 64, W, "cpu"), scale=0.3)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
    with count_blocks() as n:
        small = tiled_attention(q, k, v, is_causal=True, window=W, scale=0.3, block_q=8, block_k=8)
    torch.testing.assert_close(small, expected, atol=1e-5, rtol=1e-4)
    assert n["forward"] == 8 + 7  # the diagonal block and the one before it (rows 8i.. reach back 2 keys)


def test_bottom_right_window_with_fewer_queries_is_exact() -> None:
    model = WindowBuffer(bottom_right=True)
    opt = attnopt.optimize(model, variant="spy")
    assert_same_with_grads(model, opt, tq=10)
    assert_same_with_grads(model, opt, tq=3, tk=10)  # Tq != Tk: the alignment differs, the mask tensor is passed
    kw = CALLS[-1]
    assert "window" not in kw and kw["attn_mask"] is not None


def test_top_left_window_with_more_queries_than_keys_restores_nan_rows() -> None:
    model = WindowBuffer()
    opt = attnopt.optimize(model, variant="spy")
    q, k, v = qkv(12, 6)
    ref = model(q, k, v)
    assert torch.isnan(ref[:, :, 8:]).all()  # rows 8.. see no key of the 6 inside their window
    torch.testing.assert_close(opt(q, k, v), ref, atol=1e-5, rtol=1e-4, equal_nan=True)
    assert "window" not in CALLS[-1]


def test_window_buffer_changed_in_place_falls_back_to_the_mask() -> None:
    model = WindowBuffer()
    opt = attnopt.optimize(model, variant="spy")
    q, k, v = qkv()
    torch.testing.assert_close(opt(q, k, v), model(q, k, v), atol=1e-5, rtol=1e-4)
    assert CALLS[-1]["window"] == W
    with torch.no_grad():
        model.bias[0, 0, 5, 1] = 1.0  # one key beyond the window becomes visible
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = opt(q, k, v)
    torch.testing.assert_close(out, model(q, k, v), atol=1e-5, rtol=1e-4)
    assert "window" not in CALLS[-1] and CALLS[-1]["attn_mask"] is not None
    assert any("no longer holds the proven causal pattern" in str(w.message) for w in caught)


# ----------------------------------------------------------------------------- not windows


def _two_sided(t, dev):
    i = torch.arange(t, device=dev)
    return (i[:, None] - i[None, :]).abs() < W  # local attention both ways: not causal


def _window_of_future(t, dev):
    i = torch.arange(t, device=dev)
    return (i[None, :] >= i[:, None]) & (i[None, :] - i[:, None] < W)  # keys ahead of the query


def _scaled_distance(t, dev):
    i = torch.arange(t, device=dev)
    return (i[:, None] >= i[None, :]) & (2 * (i[:, None] - i[None, :]) < W)  # width W / 2: still a window


@pytest.mark.parametrize("spelling", [_two_sided, _window_of_future], ids=["two-sided", "future"])
def test_other_bands_are_passed_as_mask_tensors(spelling) -> None:
    model = KeepMask(spelling)
    opt = attnopt.optimize(model, variant="spy")
    assert_same_with_grads(model, opt)
    (rec,) = attnopt.explain(opt).records
    assert rec.rewritten and rec.spec.window is None and rec.spec.causal is None
    assert CALLS[-1]["attn_mask"] is not None and "window" not in CALLS[-1]


def test_unproven_index_arithmetic_keeps_the_mask() -> None:
    model = KeepMask(_scaled_distance)  # a factor of 2 on the distance is not read: the mask is passed
    opt = attnopt.optimize(model, variant="spy")
    assert_same_with_grads(model, opt)
    assert CALLS[-1]["attn_mask"] is not None


def test_band_reader_reads_index_comparisons() -> None:
    model = KeepMask(_arange_broadcast)
    gm, ex = capture(model, *qkv())
    (m,) = find_sites(gm, dict(zip((n for n in gm.graph.nodes if n.op == "placeholder"), ex)))
    assert isinstance(m, Match)
    reader = BandReader(gm, {})
    keep = next(n for n in gm.graph.nodes if n.name == "keep")
    band = reader.band(keep)
    assert band.cuts == (-W, 0) and band.values == (False, True, False)


# ----------------------------------------------------------------------------- score modifiers with a window


class SoftcapWindow(nn.Module):
    """Gemma-2 style: tanh soft-capping, then a sliding-window mask."""

    def forward(self, q, k, v):
        t = q.size(-2)
        s = (q @ k.transpose(-2, -1)) * q.size(-1) ** -0.5
        s = torch.tanh(s / 30.0) * 30.0
        i = torch.arange(t, device=q.device)
        keep = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < W)
        return s.masked_fill(~keep, float("-inf")).softmax(-1) @ v


def test_softcap_with_window_runs_flex_with_a_window_block_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    from attnopt.kernels import flex

    if registry.get_candidate("flex").available("cpu") is not None:
        pytest.skip(registry.get_candidate("flex").available("cpu"))
    built = []
    original = flex.create_block_mask

    def recording(mask_mod, **kwargs):
        built.append((mask_mod, kwargs["Q_LEN"], kwargs["KV_LEN"]))
        return original(mask_mod, **kwargs)

    flex.clear_caches()
    monkeypatch.setattr(flex, "create_block_mask", recording)
    model = SoftcapWindow()
    opt = attnopt.optimize(model, variant="flex")
    q, k, v = qkv(24)
    with torch.no_grad():
        torch.testing.assert_close(opt(q, k, v), model(q, k, v), atol=1e-5, rtol=1e-4)
    (mask_mod, tq, tk), = built
    i = torch.arange(24)[:, None]
    j = torch.arange(24)[None, :]
    assert (tq, tk) == (24, 24)
    ones = torch.ones(24, 24, dtype=torch.bool)
    assert torch.equal(mask_mod(0, 0, i, j), ones.tril() & ~ones.tril(-W))  # written independently
    (rec,) = attnopt.explain(opt).records
    assert "sliding window" in rec.reason and "score_mod" in rec.reason
    flex.clear_caches()


@pytest.mark.parametrize("variant", ["tiled64", "math"])
def test_softcap_with_window_is_exact_with_gradients(variant: str) -> None:
    model = SoftcapWindow()
    opt = attnopt.optimize(model, variant=variant)
    assert_same_with_grads(model, opt, tq=20)


def test_selector_tries_flex_for_windows_although_sdpa_serves() -> None:
    from attnopt.selection.selector import Selector
    from attnopt.spec import AttentionSpec

    if registry.get_candidate("flex").available("cpu") is not None:
        pytest.skip(registry.get_candidate("flex").available("cpu"))
    sel = Selector(cache=False)
    legal, why = sel.legal(AttentionSpec(scale=1.0, causal="top_left", window=4), "cpu")
    assert "flex" in legal and "sdpa" in legal and "tiled64" in legal
    legal, why = sel.legal(AttentionSpec(scale=1.0, causal="top_left"), "cpu")
    assert "flex" not in legal and "tried only where SDPA cannot serve" in why["flex"]
