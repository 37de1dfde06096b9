"""Exactness of what a rewritten site does at run time, on every later call.

Each test pins one mechanism (see the classes of the exactness issue): proofs that read tensors the
site cannot pin by address, candidates checked against the reference on the call's own inputs,
double backward, backward under autocast, rows whose every key is hidden by a large fill (their
gradients and their dropout), and the half-type contract. All compare with the model as written.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import attnopt
from attnopt.kernels import registry, sdpa
from attnopt.kernels.reference import reference_attention
from attnopt.kernels.registry import FunctionCandidate
from attnopt.kernels.tiled import tiled_attention

B, H, T, D = 2, 2, 8, 8


def qkv(t: int = T, grad: bool = False, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [torch.randn(B, H, t, D, dtype=dtype, requires_grad=grad) for _ in range(3)]


@contextlib.contextmanager
def quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# ----------------------------------------------------------------------------- class 1: proofs about call inputs


class MaskArg(nn.Module):
    """The mask is a forward argument, rebuilt by the caller for every batch."""

    def forward(self, q, k, v, keep):
        s = (q @ k.transpose(-2, -1)) * D**-0.5
        s = s.masked_fill(keep == 0, float("-inf"))
        return s.softmax(-1) @ v


@pytest.mark.parametrize("variant", ["auto", "sdpa"])
def test_a_mask_argument_proven_causal_once_is_checked_again_on_every_call(variant: str) -> None:
    model = MaskArg()
    opt = attnopt.optimize(model, variant=variant)
    q, k, v = qkv()
    with torch.no_grad():
        for lookahead in (0, 2, 0, 3):  # fresh tensors, freed in between: addresses are reused
            keep = torch.ones(T, T).tril(lookahead)
            with quiet():
                out = opt(q, k, v, keep)
            torch.testing.assert_close(out, model(q, k, v, keep))
            del keep


@pytest.mark.parametrize("variant", ["auto", "sdpa"])
def test_a_mask_argument_refilled_through_numpy_is_checked_again(variant: str) -> None:
    """The same object, written without a version bump: a proof about a call input is never carried over."""
    model = MaskArg()
    opt = attnopt.optimize(model, variant=variant)
    q, k, v = qkv()
    buf = torch.ones(T, T).tril().numpy()
    keep = torch.from_numpy(buf)
    with torch.no_grad():
        torch.testing.assert_close(opt(q, k, v, keep), model(q, k, v, keep))
        buf[:] = torch.ones(T, T).tril(2).numpy()
        with quiet():
            torch.testing.assert_close(opt(q, k, v, keep), model(q, k, v, keep))


def test_a_mask_argument_made_in_inference_mode() -> None:
    model = MaskArg()
    opt = attnopt.optimize(model, variant="sdpa")
    q, k, v = qkv()
    with torch.inference_mode():
        for lookahead in (0, 2):
            keep = torch.ones(T, T).tril(lookahead)
            with quiet():
                torch.testing.assert_close(opt(q, k, v, keep), model(q, k, v, keep))


def test_a_mask_argument_is_checked_per_call_with_compile_true() -> None:
    if registry.get_candidate("flex").available("cpu") is not None:  # same requirement: a C++ compiler
        pytest.skip("compile=True needs a C++ compiler")
    model = MaskArg()
    opt = attnopt.optimize(model, variant="sdpa", compile=True)
    q, k, v = qkv()
    with torch.no_grad():
        for lookahead in (0, 2, 0, 3):
            keep = torch.ones(T, T).tril(lookahead)
            with quiet():
                torch.testing.assert_close(opt(q, k, v, keep), model(q, k, v, keep))
            del keep


def test_a_padding_term_anded_into_a_mask_argument_is_checked_per_call() -> None:
    class PadArg(nn.Module):
        def forward(self, q, k, v, keep, pad):
            s = (q @ k.transpose(-2, -1)) * D**-0.5
            s = s.masked_fill(~(keep.bool() & pad[:, None, None, :]), float("-inf"))
            return s.softmax(-1) @ v

    model = PadArg()
    opt = attnopt.optimize(model, variant="sdpa")
    q, k, v = qkv()
    pad = torch.ones(B, T, dtype=torch.bool)
    with torch.no_grad():
        for lookahead in (0, 2):
            keep = torch.ones(T, T).tril(lookahead)
            with quiet():
                torch.testing.assert_close(opt(q, k, v, keep, pad), model(q, k, v, keep, pad))
            del keep


class TrilBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("bias", torch.ones(T, T).tril())

    def forward(self, q, k, v):
        s = (q @ k.transpose(-2, -1)) * D**-0.5
        s = s.masked_fill(self.bias[: q.size(-2), : q.size(-2)] == 0, float("-inf"))
        return s.softmax(-1) @ v


def test_a_buffer_deleted_and_registered_again_is_checked_on_its_values() -> None:
    model = TrilBuffer()
    opt = attnopt.optimize(model, variant="sdpa")
    q, k, v = qkv()
    with torch.no_grad():
        torch.testing.assert_close(opt(q, k, v), model(q, k, v))
        del model.bias  # freed: the new buffer may well land at the same address
        model.register_buffer("bias", torch.ones(T, T).tril(2))
        with quiet():
            torch.testing.assert_close(opt(q, k, v), model(q, k, v))


def test_buffer_guard_pins_the_object_not_the_address() -> None:
    from attnopt.kernels.bands import band_pattern
    from attnopt.runtime.guards import BufferGuard

    t = torch.ones(T, T).tril()
    g = BufferGuard.of(t, *band_pattern(t))
    assert g.holds(t) and g.pinned_to(t)
    other = torch.ones(T, T).tril()  # equal values, another object: checked on its values, then pinned
    assert not g.pinned_to(other) and g.holds(other) and g.pinned_to(other)
    other.fill_(1.0)  # the version counter moves: checked again, and fails
    with quiet():
        assert not g.holds(other)
    strict = BufferGuard.of(t, *band_pattern(t), strict=True)
    assert strict.holds(t)
    t.data.fill_(1.0)  # .data bypasses the version counter: only strict mode sees it
    with quiet():
        assert not strict.holds(t)


def test_strict_mode_rechecks_a_buffer_written_through_data(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNOPT_STRICT", "1")
    model = TrilBuffer()
    opt = attnopt.optimize(model, variant="sdpa")
    q, k, v = qkv()
    with torch.no_grad():
        torch.testing.assert_close(opt(q, k, v), model(q, k, v))
        model.bias.data.fill_(1.0)  # no version bump
        with quiet():
            torch.testing.assert_close(opt(q, k, v), model(q, k, v))


# ----------------------------------------------------------------------------- class 6/13: candidates checked


def _wrong(q, k, v, **kwargs):
    return sdpa._sdpa(q, k, v, **kwargs) + 0.5


@pytest.fixture
def wrong_candidate():
    cand = FunctionCandidate("wrong_for_test", _wrong, sdpa._sdpa_supports, "a deliberately wrong kernel")
    registry.register_candidate(cand)
    yield cand.name
    registry._REGISTRY.pop(cand.name, None)


class Causal(nn.Module):
    def forward(self, q, k, v):
        t = q.size(-2)
        s = (q @ k.transpose(-2, -1)) * D**-0.5
        s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool, device=q.device).tril(), float("-inf"))
        return F.softmax(s, dim=-1) @ v


def test_a_forced_candidate_that_is_wrong_is_dropped_with_a_warning(wrong_candidate: str) -> None:
    model = Causal()
    opt = attnopt.optimize(model, variant=wrong_candidate)
    q, k, v = qkv(grad=True)
    with pytest.warns(UserWarning, match="wrong_for_test.*does not match the reference"):
        out = opt(q, k, v)
    torch.testing.assert_close(out, model(q, k, v))
    (rec,) = attnopt.explain(opt).records
    assert any("wrong_for_test" in name for name in rec.extra["rejected"]), rec.extra
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # decided once per shape key: no warning on the next call
        torch.testing.assert_close(opt(q, k, v), model(q, k, v))


def test_verify_true_cannot_pass_a_wrong_candidate(wrong_candidate: str) -> None:
    model = Causal()
    q, k, v = qkv()
    opt = attnopt.optimize(model, variant=wrong_candidate, verify=True)
    with quiet(), torch.no_grad():
        torch.testing.assert_close(opt(q, k, v), model(q, k, v))
    (rec,) = attnopt.explain(opt).records
    assert rec.extra.get("rejected") or not rec.rewritten, "the wrong kernel must be rejected or the site dropped"
    assert not rec.extra.get("verified") or rec.extra.get("rejected")


def test_a_candidate_is_checked_again_for_a_new_shape_key(wrong_candidate: str) -> None:
    model = Causal()
    opt = attnopt.optimize(model, variant=wrong_candidate)
    with quiet(), torch.no_grad():
        for t in (8, 64):
            q, k, v = qkv(t)
            torch.testing.assert_close(opt(q, k, v), model(q, k, v))
    rejected = [name for rec in attnopt.explain(opt).records for name in rec.extra.get("rejected", {})]
    assert len(rejected) == 2, rejected


def test_bf16_is_no_less_accurate_than_the_model_as_written() -> None:
    """Logits with std ~4 in bfloat16: the rewrite must be at least as close to float64 as the original."""
    model = Causal()
    opt = attnopt.optimize(model)
    q, k, v = (torch.randn(1, 2, 64, 16) * 2.0 for _ in range(3))
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    with torch.no_grad():
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # no candidate may be dropped for bf16 rounding
            out = opt(qb, kb, vb).double()
        written = model(qb, kb, vb).double()
        exact = model(qb.double(), kb.double(), vb.double())
    assert (out - exact).abs().max() <= (written - exact).abs().max() + 1e-3


# ----------------------------------------------------------------------------- class 5: higher-order autograd


@pytest.mark.parametrize("variant", ["auto", "sdpa", "tiled64", "sdpa_flash"])
def test_double_backward_equals_the_model_as_written(variant: str) -> None:
    model = Causal()
    opt = attnopt.optimize(model, variant=variant)
    q0, k0, v0 = qkv(grad=True)

    def penalty(fn):
        out = fn(q0, k0, v0)
        (gq,) = torch.autograd.grad(out.square().sum(), q0, create_graph=True)
        return torch.autograd.grad(gq.square().sum(), (q0, k0, v0))

    with quiet():
        got = penalty(opt)
    for a, e in zip(got, penalty(model)):
        torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-4)


def test_hvp_through_an_optimized_model() -> None:
    model = Causal()
    opt = attnopt.optimize(model, variant="sdpa")
    k, v = qkv()[1:]
    x, dx = torch.randn(B, H, T, D), torch.randn(B, H, T, D)
    with quiet():
        _, got = torch.autograd.functional.hvp(lambda q: opt(q, k, v).square().sum(), x, dx)
    _, want = torch.autograd.functional.hvp(lambda q: model(q, k, v).square().sum(), x, dx)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- class 12: backward under autocast


class Projected(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 1, D)).permute(2, 0, 3, 1, 4)
        t = x.size(1)
        s = (q @ k.transpose(-2, -1)) * D**-0.5
        s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool, device=x.device).tril(), float("-inf"))
        return (s.softmax(-1) @ v).float().sum()


@pytest.mark.parametrize("variant", ["tiled64", "sdpa"])
def test_backward_under_autocast_trains(variant: str) -> None:
    model = Projected()
    opt = attnopt.optimize(model, variant=variant)
    x = torch.randn(B, T, D)
    with torch.autocast("cpu", torch.bfloat16), quiet():
        opt(x).backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with torch.autocast("cpu", torch.bfloat16):
        model(x).backward()
    for a, e in zip(got, [p.grad for p in model.parameters()]):
        torch.testing.assert_close(a, e, atol=0.1, rtol=0.05)


def test_tiled_attention_backward_under_autocast() -> None:
    x = torch.randn(B, H, T, D, requires_grad=True)
    lin = nn.Linear(D, D)
    with torch.autocast("cpu", torch.bfloat16):
        q = lin(x)
        tiled_attention(q, q, q, is_causal=True).float().sum().backward()
    assert x.grad is not None and bool(torch.isfinite(x.grad).all())


# ----------------------------------------------------------------------------- class 11: rows hidden by large fills


class AddedPadding(nn.Module):
    """``(1 - keep) * fill`` added to the scores: Hugging Face's older additive padding masks."""

    def __init__(self, fill: float) -> None:
        super().__init__()
        self.fill = fill

    def forward(self, q, k, v, keep):
        s = (q @ k.transpose(-2, -1)) * D**-0.5
        s = s + (1.0 - keep[:, None, None, :]) * self.fill
        return s.softmax(-1) @ v


@pytest.mark.parametrize("fill", [-1e4, -1e9, -1e30])
@pytest.mark.parametrize("variant", ["auto", "sdpa", "tiled64"])
def test_gradients_of_rows_fully_hidden_by_a_large_finite_fill(fill: float, variant: str) -> None:
    model = AddedPadding(fill)
    opt = attnopt.optimize(model, variant=variant)
    q, k, v = qkv(grad=True)
    full = torch.ones(B, T)
    with quiet():
        opt(q, k, v, full).sum().backward()  # the candidates are checked on this call: no padded row
    keep = torch.ones(B, T)
    keep[1] = 0.0  # a later call: one batch entry is all padding
    for t in (q, k, v):
        t.grad = None
    with quiet():
        out = opt(q, k, v, keep)
    (out * torch.arange(out.numel()).view_as(out).sin()).sum().backward()
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    want_out = model(q, k, v, keep)
    (want_out * torch.arange(out.numel()).view_as(out).sin()).sum().backward()
    torch.testing.assert_close(out, want_out)
    for a, e in zip(got, [t.grad for t in (q, k, v)]):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-4)


def test_a_rewritten_graph_compiled_by_the_user_keeps_exact_gradients_on_padded_rows() -> None:
    """Inside a compiled graph the mask's values are unknown: the row rule must hold for every call."""
    model = AddedPadding(-1e9)
    q, k, v = qkv(grad=True)
    gm = attnopt.rewrite(torch.fx.symbolic_trace(model), (q, k, v, torch.ones(B, T)), variant="sdpa")
    compiled = torch.compile(gm, backend="aot_eager")
    keep = torch.ones(B, T)
    keep[1] = 0.0
    grads = []
    for fn in (compiled, model):
        out = fn(q, k, v, keep)
        grads.append(torch.autograd.grad((out * out.detach().cos()).sum(), (q, k, v)))
    for a, e in zip(*grads):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-4)


def test_tiled_attention_gradients_on_rows_fully_hidden_by_minus_1e9() -> None:
    q, k, v = qkv(grad=True)
    keep = torch.ones(B, 1, 1, T)
    keep[1] = 0.0
    mask = (1 - keep) * -1e9
    grads = []
    for fn in (tiled_attention, reference_attention):
        out = fn(q, k, v, attn_mask=mask, scale=0.5)
        grads.append(torch.autograd.grad((out * out).sum(), (q, k, v)))
    for a, e in zip(*grads):
        torch.testing.assert_close(a, e)


class FillThenBias(nn.Module):
    """``masked_fill(pad, min)`` then an added bias: the fill cuts the score's gradient, the bias does not."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(H, T, T) * 0.1)

    def forward(self, q, k, v, pad):
        s = (q @ k.transpose(-2, -1)) * D**-0.5
        s = s.masked_fill(pad[:, None, None, :], torch.finfo(s.dtype).min)
        s = s + self.bias
        return s.softmax(-1) @ v


@pytest.mark.parametrize("variant", ["auto", "sdpa"])
def test_a_fill_then_a_bias_keeps_the_fills_cut_gradient_on_fully_padded_rows(variant: str) -> None:
    model = FillThenBias()
    opt = attnopt.optimize(model, variant=variant)
    q, k, v = qkv(grad=True)
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[1] = True
    results = []
    for fn in (opt, model):
        for t in (q, k, v):
            t.grad = None
        model.zero_grad()
        with quiet():
            out = fn(q, k, v, pad)
        (out * out).sum().backward()
        results.append([out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone(), model.bias.grad.clone()])
    for a, e in zip(*results):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-4)


# ----------------------------------------------------------------------------- class 7: dropout on fully masked rows


class MinFillDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, q, k, v, pad):
        s = (q @ k.transpose(-2, -1)) * D**-0.5
        s = s.masked_fill(pad[:, None, None, :], torch.finfo(s.dtype).min)
        return self.drop(s.softmax(-1)) @ v


def _one_entry_all_padded() -> torch.Tensor:
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[1] = True
    return pad


def test_dropout_on_rows_every_key_masked_is_random_as_written() -> None:
    model = MinFillDropout().train()
    opt = attnopt.optimize(model, variant="sdpa")
    q, k, v = qkv()
    pad = _one_entry_all_padded()
    with torch.no_grad(), quiet():
        got = torch.stack([opt(q, k, v, pad)[1, 0, 0] for _ in range(200)])
    want = torch.stack([model(q, k, v, pad)[1, 0, 0] for _ in range(200)])
    assert got.std(0).min() > 0.05  # random, as written (the mean of v every call would give 0)
    torch.testing.assert_close(got.std(0), want.std(0), atol=0.15, rtol=0.3)
    torch.testing.assert_close(got.mean(0), want.mean(0), atol=0.2, rtol=0.3)


def test_no_dropout_keeps_the_mean_of_v_rows_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without dropout or gradients, fully masked rows are the mean of v next to the fused kernel."""
    from attnopt.runtime.site import AttentionSite

    def never(*args, **kwargs):
        raise AssertionError("the computation as written ran; the fast path was expected")

    monkeypatch.setattr(AttentionSite, "_as_written", never)
    model = MinFillDropout().eval()
    opt = attnopt.optimize(model, variant="sdpa")
    q, k, v = qkv()
    pad = _one_entry_all_padded()
    with torch.no_grad():
        out = opt(q, k, v, pad)
        torch.testing.assert_close(out, model(q, k, v, pad))
    torch.testing.assert_close(out[1], v[1].mean(-2, keepdim=True).expand_as(out[1]))


class AddThenFill(nn.Module):
    """An added mask holding the dtype's minimum, then a ``masked_fill``: the added part keeps its gradient."""

    def forward(self, q, k, v, add, hide):
        a = (q @ k.transpose(-2, -1) + add).masked_fill(hide, torch.finfo(q.dtype).min)
        return F.softmax(a, -1) @ v


@pytest.mark.parametrize("variant", ["auto", "sdpa", "math"])
def test_a_row_hidden_partly_by_an_added_minimum_and_partly_by_a_fill(variant: str) -> None:
    model = AddThenFill()
    opt = attnopt.optimize(model, variant=variant)
    q, k, v = (torch.randn(1, 1, 2, 4, requires_grad=True) for _ in range(3))
    add = torch.tensor([[0.0, torch.finfo(torch.float32).min]] * 2)
    hide = torch.tensor([[False, False], [True, False]])  # row 1: key 0 filled, key 1 hidden by the added minimum
    grads = []
    for fn in (opt, model):
        with quiet():
            out = fn(q, k, v, add, hide)
        grads.append([out.detach(), *torch.autograd.grad((out * out).sum(), (q, k, v))])
    for a, e in zip(*grads):
        torch.testing.assert_close(a, e)



# ----------------------------------------------------------------------------- checkpointing around dropout


class CheckpointedDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.5)

    def block(self, x):
        return self.lin(self.drop(self.lin(x)))

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def test_activation_checkpointing_around_dropout_keeps_exact_gradients() -> None:
    """Dynamo's eager replay of a checkpoint draws new dropout masks; such graphs run through AOTAutograd."""
    model = CheckpointedDropout().train()
    opt = attnopt.optimize(copy.deepcopy(model))
    x = torch.randn(4, 16)
    results = []
    for fn, mod in ((model, model), (opt, opt._orig_mod)):
        torch.manual_seed(1)
        y = fn(x)
        y.sum().backward()
        results.append((y.detach(), mod.lin.weight.grad.clone()))
    (y0, g0), (y1, g1) = results
    torch.testing.assert_close(y1, y0)
    torch.testing.assert_close(g1, g0)
    assert any("checkpointing around random ops" in f for f in attnopt.explain(opt).failures)


def test_checkpointing_without_active_dropout_is_not_rerouted() -> None:
    model = CheckpointedDropout().train()
    model.drop.p = 0.0
    opt = attnopt.optimize(model)
    opt(torch.randn(4, 16)).sum().backward()
    assert not attnopt.explain(opt).failures
