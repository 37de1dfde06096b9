"""Spellings from the Hugging Face transformers sweep (benchmarks/bench_transformers.py) that attnopt left alone:
each rewritten with outputs and gradients equal in float32 and float64, on later calls with other shapes and values,
and the look-alikes that must stay refused, each with its reason."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from support import Fn

import attnopt

B, H, HKV, T, D = 2, 4, 2, 8, 16
DTYPES = [torch.float32, torch.float64]


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {torch.float64: {"atol": 1e-10, "rtol": 1e-9}, torch.float32: {"atol": 1e-5, "rtol": 1e-4}}.get(
        dtype, {"atol": 2e-2, "rtol": 2e-2})


def _same(opt: nn.Module, model: nn.Module, inputs: list, grads: int | None = None) -> None:
    """Outputs equal, and the gradients of the first ``grads`` floating inputs and of every parameter."""
    grads = len(inputs) if grads is None else grads
    a = [x.clone().requires_grad_(i < grads and x.is_floating_point()) if isinstance(x, torch.Tensor) else x
         for i, x in enumerate(inputs)]
    e = [x.clone().requires_grad_(i < grads and x.is_floating_point()) if isinstance(x, torch.Tensor) else x
         for i, x in enumerate(inputs)]
    out, ref = opt(*a), model(*e)
    tol = _tol(ref.dtype)
    torch.testing.assert_close(out, ref, **tol)
    cot = torch.randn_like(ref)
    wrt_a = [x for x in a if isinstance(x, torch.Tensor) and x.requires_grad] + list(model.parameters())
    wrt_e = [x for x in e if isinstance(x, torch.Tensor) and x.requires_grad] + list(model.parameters())
    ga = torch.autograd.grad((out * cot).sum(), wrt_a, allow_unused=True)
    ge = torch.autograd.grad((ref * cot).sum(), wrt_e, allow_unused=True)
    for x, y in zip(ga, ge):
        assert (x is None) == (y is None)
        if x is not None:
            torch.testing.assert_close(x, y, atol=10 * tol["atol"], rtol=10 * tol["rtol"])


def _rewritten(opt: nn.Module, words: str = "") -> None:
    """Every site of every captured graph rewritten, its spec naming ``words``."""
    report = attnopt.explain(opt)
    assert report.records and report.rewritten == len(report.records), str(report)
    assert all(words in r.spec.describe() for r in report.records), str(report)


def _left_alone(opt: nn.Module, words: str) -> None:
    (record,) = attnopt.explain(opt).records
    assert record.decision == "left alone" and words in record.reason, record.reason


# ----------------------------------------------------------------------------- Inkling2: a cast after the sink's cat

class InklingSink(nn.Module):
    """Inkling2 (modeling_inkling2.py:538): per-token sinks from a projection, ``cat([w, sinks], -1).float()``,
    the softmax, the sink's column dropped and the probabilities cast back to q's dtype."""

    def __init__(self, cast: str = "float"):
        super().__init__()
        self.sink_proj = nn.Linear(D, H)
        self.cast = cast

    def forward(self, q, k, v, x, mask):
        k, v = (t[:, :, None].expand(-1, -1, H // HKV, -1, -1).reshape(q.size(0), H, -1, D) for t in (k, v))
        w = torch.matmul(q, k.transpose(2, 3)) * D ** -0.5
        w = w + mask
        sinks = self.sink_proj(x).transpose(1, 2).unsqueeze(-1)  # (B, H, T, 1)
        c = torch.cat([w, sinks], dim=-1)
        c = c.float() if self.cast == "float" else c.to(q.dtype) if self.cast == "same" else c.double()
        p = torch.softmax(c, dim=-1)[..., :-1].to(q.dtype)
        p = nn.functional.dropout(p, p=0.0, training=self.training)
        return torch.matmul(p, v)


def _inkling_inputs(b: int, t: int, dtype: torch.dtype, pad: int = 0) -> list[torch.Tensor]:
    q = torch.randn(b, H, t, D, dtype=dtype)
    k, v = torch.randn(b, HKV, t, D, dtype=dtype), torch.randn(b, HKV, t, D, dtype=dtype)
    mask = torch.zeros(b, 1, t, t, dtype=dtype).masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(),
                                                           torch.finfo(dtype).min)
    mask[-1, ..., :pad] = torch.finfo(dtype).min  # left padding: early rows keep only the sink
    return [q, k, v, torch.randn(b, t, D, dtype=dtype), mask]


@pytest.mark.parametrize("dtype", DTYPES)
def test_inkling2_sink_cast_after_the_cat_is_one_more_key(dtype: torch.dtype) -> None:
    model = InklingSink("float" if dtype == torch.float32 else "same").to(dtype)
    opt = attnopt.optimize(model, variant="sdpa")
    for b, t, pad in ((B, T, 0), (1, 5, 2), (3, 11, 4)):
        _same(opt, model, _inkling_inputs(b, t, dtype, pad), grads=4)
    _rewritten(opt, "attention sink")


def test_inkling2_sink_widened_from_bfloat16() -> None:
    model = InklingSink("float").to(torch.bfloat16)  # D = 16: the scale 1/4 is a power of two
    opt = attnopt.optimize(model, variant="sdpa")
    _same(opt, model, _inkling_inputs(B, T, torch.bfloat16, 3), grads=4)
    _rewritten(opt, "attention sink")


def test_inkling2_sink_narrowed_or_read_elsewhere_is_left_alone() -> None:
    # float64 scores and sinks cast to float32 before the softmax: a lossy conversion
    model = InklingSink("float").to(torch.float64)
    opt = attnopt.optimize(model)
    inputs = _inkling_inputs(B, T, torch.float64)
    torch.testing.assert_close(opt(*inputs), model(*inputs))
    _left_alone(opt, "lossy conversion")

    def cat_returned(self, q, k, v, sinks):  # the concatenated (and cast) scores are returned too
        c = torch.cat([q @ k.transpose(-2, -1), sinks], -1).float()
        return torch.softmax(c, -1)[..., :-1] @ v, c

    def cast_to_int(self, q, k, v, sinks):  # rounded to integers before the softmax
        c = torch.cat([q @ k.transpose(-2, -1), sinks], -1).int()
        return torch.softmax(c.float(), -1)[..., :-1] @ v

    for body, words in ((cat_returned, "returned"), (cast_to_int, "not an attention sink")):
        model = Fn(body)
        opt = attnopt.optimize(model)
        q, k, v = (torch.randn(B, H, T, D) for _ in range(3))
        sinks = torch.randn(B, H, T, 1)
        out, ref = opt(q, k, v, sinks), model(q, k, v, sinks)
        torch.testing.assert_close(out, ref)
        _left_alone(opt, words)


# ----------------------------------------------------------------------------- Granite-SWA: a sink as an lse scale

class GraniteSink(nn.Module):
    """Granite-SWA (modeling_granite_swa.py:111): a learned per-head sink applied after ``P @ V`` as the scale
    ``sigmoid(logsumexp(s) - sink)``, which is one more key whose logit is the sink."""

    def __init__(self, keepdim: bool = False, upcast: torch.dtype = torch.float32):
        super().__init__()
        self.sinks = nn.Parameter(torch.randn(H))
        self.keepdim, self.upcast = keepdim, upcast  # as written, the scale and the softmax are in float32

    def forward(self, q, k, v, mask):
        k, v = (t[:, :, None].expand(-1, -1, H // HKV, -1, -1).reshape(q.size(0), H, -1, D) for t in (k, v))
        w = torch.matmul(q, k.transpose(2, 3)) * D ** -0.5
        w = w + mask
        if self.keepdim:
            lse = torch.logsumexp(w, dim=-1, keepdim=True)
            scale = (lse - self.sinks.view(1, -1, 1, 1)).sigmoid()
        else:
            lse = torch.logsumexp(w, dim=-1)  # (B, H, Tq)
            scale = (lse - self.sinks.view(1, -1, 1)).to(self.upcast).sigmoid().unsqueeze(-1)
        p = torch.softmax(w, dim=-1, dtype=self.upcast).to(q.dtype)
        p = nn.functional.dropout(p, p=0.0, training=self.training)
        out = torch.matmul(p, v)
        return out * scale.to(out.dtype)


def _granite_inputs(b: int, t: int, dtype: torch.dtype, pad: int = 0, fill: float | None = None) -> list:
    q, k, v, _, mask = _inkling_inputs(b, t, dtype, pad)
    if fill is not None:
        mask = mask.masked_fill(mask == torch.finfo(dtype).min, fill)
    return [q, k, v, mask]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("keepdim", [False, True])
def test_granite_swa_lse_sink_scale_is_one_more_key(dtype: torch.dtype, keepdim: bool) -> None:
    model = GraniteSink(keepdim, upcast=torch.float32 if dtype == torch.float32 else dtype).to(dtype)
    opt = attnopt.optimize(model, variant="sdpa")
    for b, t, pad in ((B, T, 0), (1, 5, 2), (3, 11, 4)):  # left padding hides every key of early rows
        _same(opt, model, _granite_inputs(b, t, dtype, pad))
    _rewritten(opt, "attention sink")


def test_granite_swa_in_bfloat16_and_narrowed_in_float64() -> None:
    model = GraniteSink().to(torch.bfloat16)  # the scale computed in float32, then rounded to bfloat16
    opt = attnopt.optimize(model, variant="sdpa")
    _same(opt, model, _granite_inputs(B, T, torch.bfloat16, 3))
    _rewritten(opt, "attention sink")
    model = GraniteSink().to(torch.float64)  # float64 scores: the scale rounded to float32 before the sigmoid
    opt = attnopt.optimize(model)
    inputs = _granite_inputs(B, T, torch.float64)
    torch.testing.assert_close(opt(*inputs), model(*inputs))
    _left_alone(opt, "the sink scale is converted from torch.float64 to torch.float32")


def test_granite_swa_rows_hidden_by_minus_inf_stay_nan() -> None:
    """A row whose every score is -inf is ``NaN * sigmoid(-inf)`` as written: NaN, where a sink key gives zero."""
    model = GraniteSink()
    opt = attnopt.optimize(model, variant="sdpa")
    inputs = _granite_inputs(B, T, torch.float32, pad=3, fill=float("-inf"))
    out, ref = opt(*inputs), model(*inputs)
    assert ref[-1, :, :3].isnan().all() and not ref[0].isnan().any()
    torch.testing.assert_close(out, ref, equal_nan=True)
    _rewritten(opt, "attention sink")


def test_lse_look_alikes_are_left_alone() -> None:
    sinks = torch.randn(H)

    def inverted(self, q, k, v):  # sigmoid(sink - lse) = 1 - the sink's scale
        w = q @ k.transpose(-2, -1)
        scale = (self.sinks.view(1, -1, 1) - torch.logsumexp(w, -1)).sigmoid().unsqueeze(-1)
        return (torch.softmax(w, -1) @ v) * scale

    def not_sigmoid(self, q, k, v):  # exp(lse - sink): no probability
        w = q @ k.transpose(-2, -1)
        scale = (torch.logsumexp(w, -1) - self.sinks.view(1, -1, 1)).exp().unsqueeze(-1)
        return (torch.softmax(w, -1) @ v) * scale

    def over_queries(self, q, k, v):  # logsumexp over the query axis
        w = q @ k.transpose(-2, -1)
        scale = (torch.logsumexp(w, -2) - self.sinks.view(1, -1, 1)).sigmoid().unsqueeze(-1)
        return (torch.softmax(w, -1) @ v) * scale

    def lse_returned(self, q, k, v):  # the logsumexp is returned too
        w = q @ k.transpose(-2, -1)
        lse = torch.logsumexp(w, -1)
        scale = (lse - self.sinks.view(1, -1, 1)).sigmoid().unsqueeze(-1)
        return (torch.softmax(w, -1) @ v) * scale, lse

    def unscaled_returned(self, q, k, v):  # P @ V is returned unscaled as well
        w = q @ k.transpose(-2, -1)
        scale = (torch.logsumexp(w, -1) - self.sinks.view(1, -1, 1)).sigmoid().unsqueeze(-1)
        o = torch.softmax(w, -1) @ v
        return o * scale, o

    def added(self, q, k, v):  # the scale added, not multiplied
        w = q @ k.transpose(-2, -1)
        scale = (torch.logsumexp(w, -1) - self.sinks.view(1, -1, 1)).sigmoid().unsqueeze(-1)
        return (torch.softmax(w, -1) @ v) + scale

    cases = {inverted: "not `logsumexp(s) - sink`", not_sigmoid: "passes through", over_queries: "key axis",
             lse_returned: "read elsewhere", unscaled_returned: "P @ V (`o`) is read elsewhere too",
             added: "passes through"}
    q, k, v = (torch.randn(B, H, T, D) for _ in range(3))
    for body, words in cases.items():
        model = Fn(body, sinks=sinks)
        opt = attnopt.optimize(model)
        torch.testing.assert_close(opt(q, k, v), model(q, k, v))
        (record,) = attnopt.explain(opt).records
        assert record.decision == "left alone" and "logsumexp" in record.reason and words in record.reason, \
            (body.__name__, record.reason)


# ----------------------------------------------------------------------------- Flaubert / XLM: masked_fill_ in place

class FlaubertFill(nn.Module):
    """Flaubert (modeling_flaubert.py:150): the padding mask viewed and expanded to the scores' shape, filled in
    place with the dtype's minimum, the softmax of an upcast, ``type_as`` the (written) scores."""

    def __init__(self, upcast: torch.dtype = torch.float32):
        super().__init__()
        self.upcast = upcast

    def forward(self, q, k, v, mask):
        q = q / D ** 0.5
        scores = torch.matmul(q, k.transpose(2, 3))
        mask = (mask == 0).view(q.size(0), 1, 1, k.size(2)).expand_as(scores)
        scores.masked_fill_(mask, torch.finfo(scores.dtype).min)
        weights = nn.functional.softmax(scores.to(self.upcast), dim=-1).type_as(scores)
        weights = nn.functional.dropout(weights, p=0.0, training=self.training)
        return torch.matmul(weights, v)


def _padded(b: int, t: int, dtype: torch.dtype, pad: int) -> list[torch.Tensor]:
    q, k, v = (torch.randn(b, H, t, D, dtype=dtype) for _ in range(3))
    mask = torch.ones(b, t, dtype=torch.long)
    mask[-1, t - pad:] = 0  # right padding
    return [q, k, v, mask]


@pytest.mark.parametrize("dtype", DTYPES)
def test_flaubert_inplace_fill_reads_like_the_out_of_place_one(dtype: torch.dtype) -> None:
    model = FlaubertFill(torch.float32 if dtype == torch.float32 else dtype)
    opt = attnopt.optimize(model, variant="sdpa")
    for b, t, pad in ((B, T, 3), (1, 5, 0), (3, 11, 4)):
        _same(opt, model, _padded(b, t, dtype, pad), grads=3)
    _rewritten(opt)


def test_inplace_fills_that_are_not_the_scores_own_are_left_alone() -> None:
    def read_before(self, q, k, v, mask):  # the scores' values are read before the write: a copy is kept
        scores = q @ k.transpose(2, 3)
        raw = scores * 1.0
        scores.masked_fill_((mask == 0).view(q.size(0), 1, 1, -1), -1e4)
        return torch.softmax(scores, -1) @ v + raw.sum()

    def cond_written(self, q, k, v, mask):  # the condition is written after the fill, before P @ V
        scores = q @ k.transpose(2, 3)
        cond = (mask == 0).view(q.size(0), 1, 1, -1)
        scores = scores.masked_fill(cond, -1e4)
        p = torch.softmax(scores, -1)
        cond.logical_not_()
        return (p @ v).masked_fill(cond.view(q.size(0), 1, -1, 1)[:, :, : q.size(2)], 0.0)

    def fill_not_constant(self, q, k, v, mask):  # the fill value is computed from an input
        scores = q @ k.transpose(2, 3)
        scores.masked_fill_((mask == 0).view(q.size(0), 1, 1, -1).expand_as(scores), v.detach().min())
        return torch.softmax(scores, -1) @ v

    cases = {read_before: "the attention scores are", cond_written: "written in place",
             fill_not_constant: "masked_fill value"}
    for body, words in cases.items():
        model = Fn(body)
        opt = attnopt.optimize(model)
        inputs = _padded(B, T, torch.float32, 3)
        torch.testing.assert_close(opt(*inputs), model(*inputs))
        (record,) = attnopt.explain(opt).records
        assert record.decision == "left alone" and words in record.reason, (body.__name__, record.reason)


# ----------------------------------------------------------------------------- what counts as an attention site

def _hyper_connection(self, x, streams):
    """DeepSeek-V4 / GLM5-Next (modeling_deepseek_v4.py:982): a mixing matrix from a projection, softmaxed, made
    doubly stochastic and applied to the residual streams: a product after a softmax, but of projected features."""
    n = streams.size(-2)
    comb = nn.functional.linear(x.float(), self.w.float()).view(*x.shape[:-1], n, n)
    comb = torch.softmax(comb * self.scale[0] + self.base.view(n, n), dim=-1) + 1e-6
    comb = comb / (comb.sum(dim=-2, keepdim=True) + 1e-6)
    return torch.matmul(comb, streams)


def _weight_scores(self, x, streams):
    """Scores from a product with a (transposed) parameter, probabilities applied to activations."""
    n = streams.size(-2)
    return torch.softmax((x @ self.w.t()).view(*x.shape[:-1], n, n), dim=-1) @ streams


def _attention_changed_after(self, x, streams):
    """Real attention (two activations), the probabilities changed after the softmax: left alone, counted."""
    p = torch.softmax(streams @ streams.transpose(-2, -1), dim=-1)
    return (p + 1e-6) @ streams


@pytest.mark.parametrize("body, decision", [(_hyper_connection, "not attention"), (_weight_scores, "not attention"),
                                            (_attention_changed_after, "left alone")])
def test_sites_count_softmaxes_of_a_product_of_two_activations(body, decision: str) -> None:
    n, d = 4, 16
    model = Fn(body, w=torch.randn(n * n, d), base=torch.randn(n * n), scale=torch.randn(3))
    opt = attnopt.optimize(model)
    x, streams = torch.randn(B, T, d), torch.randn(B, T, n, d)
    torch.testing.assert_close(opt(x, streams), model(x, streams))
    report = attnopt.explain(opt)
    (record,) = report.records
    assert record.decision == decision, record.reason
    if decision == "not attention":
        assert "0 of 0 attention site" in str(report), str(report)


def test_chunked_probabilities_are_attention_left_alone() -> None:
    """Longformer's layout (modeling_longformer.py:820): the probabilities transposed out of the softmax's layout and
    padded on their way to the product with values: an attention layer (counted), not rewritten."""
    def chunked(self, q, k, v):
        p = torch.softmax(torch.einsum("bthd,bshd->bths", q, k), dim=-1)  # (B, T, H, S)
        p = nn.functional.pad(p.transpose(1, 2), (0, 1))[..., :-1]  # (B, H, T, S)
        return p @ v

    model = Fn(chunked)
    opt = attnopt.optimize(model)
    q, k = torch.randn(B, T, H, D), torch.randn(B, T, H, D)
    v = torch.randn(B, H, T, D)
    torch.testing.assert_close(opt(q, k, v), model(q, k, v))
    report = attnopt.explain(opt)
    (record,) = report.records
    assert record.decision == "left alone" and "re-laid out by .transpose()" in record.reason, record.reason
    assert "0 of 1 attention site" in str(report), str(report)


# ----------------------------------------------------------------------------- MiMo-V2: the row maximum subtracted

class RowMaxShift(nn.Module):
    """MiMo-V2-Flash (modeling_mimo_v2_flash.py:322) without a sink: ``w - w.max(-1, keepdim=True).values``
    before the softmax, which changes neither the probabilities nor their gradients."""

    def __init__(self, how: str = "values"):
        super().__init__()
        self.how = how

    def forward(self, q, k, v, mask):
        w = torch.matmul(q, k.transpose(2, 3)) * D ** -0.5 + mask
        if self.how == "values":
            w = w - w.max(dim=-1, keepdim=True).values
        elif self.how == "amax_detached":
            w = w - torch.amax(w, -1, keepdim=True).detach()
        elif self.how == "over_queries":  # a maximum per key: not a shift of each row
            w = w - w.max(dim=-2, keepdim=True).values
        else:  # the maximum also returned: read elsewhere
            m = w.max(dim=-1, keepdim=True).values
            return torch.softmax(w - m, dim=-1) @ v, m
        return torch.softmax(w, dim=-1, dtype=w.dtype) @ v


def _shift_inputs(b: int, t: int, dtype: torch.dtype, pad: int = 0) -> list[torch.Tensor]:
    q, k, v = (torch.randn(b, H, t, D, dtype=dtype) for _ in range(3))
    return [q, k, v, _inkling_inputs(b, t, dtype, pad)[-1]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("how", ["values", "amax_detached"])
def test_the_row_maximum_subtracted_is_no_change(dtype: torch.dtype, how: str) -> None:
    model = RowMaxShift(how).to(dtype)
    opt = attnopt.optimize(model, variant="sdpa")
    for b, t, pad in ((B, T, 0), (1, 5, 2), (3, 11, 4)):  # left padding: rows of the dtype's minimum
        _same(opt, model, _shift_inputs(b, t, dtype, pad), grads=4)
    _rewritten(opt)
    assert "- rowmax" in " ".join(attnopt.explain(opt).records[0].spelling)


@pytest.mark.parametrize("how", ["over_queries", "returned"])
def test_shifts_that_are_not_the_row_maximum_are_left_alone(how: str) -> None:
    model = RowMaxShift(how)
    opt = attnopt.optimize(model, variant="sdpa")
    inputs = _shift_inputs(B, T, torch.float32)
    out, ref = opt(*inputs), model(*inputs)
    torch.testing.assert_close(out, ref)
    _left_alone(opt, "the attention scores are also read by `max`")  # (the subtraction itself is read as a mask)


# ----------------------------------------------------------------------------- look-alikes the breaker found

def _lse_after_shift(self, q, k, v, sinks):  # the lse sink of the *shifted* scores: the shift cannot be dropped
    w = q @ k.transpose(-2, -1) * D ** -0.5
    w = w - w.max(-1, keepdim=True).values
    scale = torch.sigmoid(torch.logsumexp(w, -1) - sinks.view(1, -1, 1))[..., None]
    return (torch.softmax(w, -1) @ v) * scale


def _sub_alpha(self, q, k, v, sinks):  # torch.sub(w, m, alpha=2) is no shift by the maximum
    w = q @ k.transpose(-2, -1) * D ** -0.5
    return torch.softmax(torch.sub(w, w.max(-1, keepdim=True).values, alpha=2), -1) @ v


def _amax_indexed(self, q, k, v, sinks):  # amax(...)[0] picks batch 0's maxima, not a (values, indices) pair
    w = q @ k.transpose(-2, -1) * D ** -0.5
    return torch.softmax(w - torch.amax(w, -1, keepdim=True)[0], -1) @ v


@pytest.mark.parametrize("body", [_lse_after_shift, _sub_alpha, _amax_indexed], ids=lambda f: f.__name__)
def test_shift_look_alikes_are_never_rewritten_wrong(body) -> None:
    model = Fn(body)
    opt = attnopt.optimize(model, variant="sdpa")
    q, k, v = (torch.randn(B, H, T, D) for _ in range(3))
    sinks = torch.randn(H)
    torch.testing.assert_close(opt(q, k, v, sinks), model(q, k, v, sinks))
    assert attnopt.explain(opt).rewritten == 0, str(attnopt.explain(opt))


def test_an_infinite_granite_sink_gives_the_row_zero_as_written() -> None:
    """``sigmoid(logsumexp(s) - inf) = 0``: the row is 0 as written, and no gradient reaches the sink there."""
    model = GraniteSink()
    with torch.no_grad():
        model.sinks[1] = float("inf")
    opt = attnopt.optimize(model, variant="sdpa")
    _same(opt, model, _granite_inputs(B, T, torch.float32, 2))
    _rewritten(opt, "attention sink")
