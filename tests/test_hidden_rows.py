"""Rows whose every key is hidden by a large fill, with gradients: the fused candidate, those rows as written.

A left-padded batch gives a causal decoder query rows whose every key holds the dtype's minimum. As
written such a row is uniform; a fused backward rebuilds its probabilities from a log-sum-exp that has
lost ``log(Tk)``. With gradients the site runs the candidate for the whole call (the hidden rows' mask
set to 0) and the computation as written for the first ``P`` queries (``P`` = 1 + the last hidden row),
taking the written rows where every key is hidden; calls whose hidden rows reach past half the queries,
and calls with dropout, run as written whole. Every test compares outputs and the gradients of q, k, v
(and of the mask or the bias when they require it) with the model as written, and counts what ran: the
candidate, and the fallbacks the site records for ``explain()``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers
from support import fallbacks as support_fallbacks

import attnopt
from attnopt.runtime.site import AttentionSite

B, H, T, D = 2, 4, 8, 8
MIN = torch.finfo(torch.float32).min
PARTLY = "rows with every key hidden, with gradients: the candidate, and those rows as written"
WHOLLY = "rows with every key hidden, with gradients, past half the queries: the call as written"
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@contextlib.contextmanager
def counting_sdpa() -> Iterator[list[int]]:
    """How many times ``F.scaled_dot_product_attention`` runs (the sdpa candidate calls it through ``F``)."""
    calls = [0]
    orig = F.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls[0] += 1
        return orig(*args, **kwargs)

    F.scaled_dot_product_attention = counted
    try:
        yield calls
    finally:
        F.scaled_dot_product_attention = orig


class AddedMask(nn.Module):
    """``softmax(q k^T * scale + mask) @ v``: a float mask of any broadcast shape, e.g. a causal mask with padding."""

    def forward(self, q, k, v, mask):
        s = (q @ k.transpose(-2, -1)) * D**-0.5 + mask
        return s.softmax(-1) @ v


class FillThenBias(nn.Module):
    """``masked_fill(hide, min)`` then an added bias: a filled score gets no gradient, the bias does."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(H, T, T) * 0.1)

    def forward(self, q, k, v, hide):
        s = (q @ k.transpose(-2, -1)) * D**-0.5
        s = s.masked_fill(hide, torch.finfo(s.dtype).min)
        return (s + self.bias).softmax(-1) @ v


def causal_with_padding(pad: list[int], left: bool = True, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A (B, 1, T, T) additive mask as Hugging Face builds it: causal, and ``pad[b]`` padded keys (left or right).

    With left padding the first ``pad[b]`` queries of entry ``b`` see padded keys only: every key hidden.
    """
    i = torch.arange(T)
    keep = (i[None, :] <= i[:, None]).expand(len(pad), 1, T, T).clone()
    for b, n in enumerate(pad):
        if n:
            keep[b, ..., slice(0, n) if left else slice(T - n, T)] = False
    return torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)


def scattered(rows: dict[int, list[int]], shape: tuple[int, ...] = (B, 1, T, T)) -> torch.Tensor:
    """A float mask hiding every key of the given query rows per batch entry (and nothing else)."""
    mask = torch.zeros(shape)
    for b, rs in rows.items():
        for r in rs:
            mask[b, ..., r, :] = MIN
    return mask


def fallbacks(opt: nn.Module) -> dict[str, int]:
    """``support.fallbacks`` for a model whose every site was rewritten."""
    report = attnopt.explain(opt)
    assert report.rewritten == len(report.records) >= 1, str(report)
    return support_fallbacks(opt)


def qkv(dtype: torch.dtype = torch.float32, heads_kv: int = H) -> list[torch.Tensor]:
    return [torch.randn(B, h, T, D, dtype=dtype, requires_grad=True) for h in (H, heads_kv, heads_kv)]


def run(fn, inputs: list[torch.Tensor], extra: list[torch.Tensor]) -> list[torch.Tensor]:
    """The output and the gradients of every input that requires them, for a fixed non-uniform output gradient."""
    for t in inputs + extra:
        t.grad = None
    with quiet():
        out = fn(*inputs)
    (out.float() * torch.arange(out.numel()).view_as(out).sin()).sum().backward()
    return [out.detach().float()] + [t.grad.float().clone() for t in inputs + extra if t.requires_grad]


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor], dtype: torch.dtype) -> None:
    assert len(got) == len(want)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, **TOL[dtype])


# ----------------------------------------------------------------------------- left padding, the common case


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask_grad", [False, True], ids=["mask", "mask-with-grad"])
def test_left_padding_runs_the_candidate_and_those_rows_as_written(dtype: torch.dtype, mask_grad: bool) -> None:
    model = AddedMask()
    opt = attnopt.optimize(model, variant="sdpa")
    q, k, v = qkv(dtype)
    mask = causal_with_padding([0, 3], dtype=dtype).requires_grad_(mask_grad)
    want = run(model, [q, k, v, mask], [])
    with counting_sdpa() as calls:
        got = run(opt, [q, k, v, mask], [])
        before = calls[0]
        got = run(opt, [q, k, v, mask], [])  # a later call: no check, one candidate call
    assert calls[0] - before == 1
    assert_same(got, want, dtype)
    assert fallbacks(opt) == {PARTLY: 2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_right_padding_hides_no_row_of_a_causal_mask(dtype: torch.dtype) -> None:
    model = AddedMask()
    opt = attnopt.optimize(model, variant="sdpa")
    q, k, v = qkv(dtype)
    mask = causal_with_padding([0, 3], left=False, dtype=dtype)  # every query keeps key 0
    assert_same(run(opt, [q, k, v, mask], []), run(model, [q, k, v, mask], []), dtype)
    assert fallbacks(opt) == {}


def test_hidden_rows_past_half_the_queries_run_the_call_as_written() -> None:
    """Rows at the end (every key of the last three queries hidden): P = T, so the whole call as written."""
    model = AddedMask()
    opt = attnopt.optimize(model, variant="sdpa")
    q, k, v = qkv()
    mask = scattered({1: [5, 6, 7]})
    with counting_sdpa() as calls:
        got = run(opt, [q, k, v, mask], [])
    assert calls[0] == 0
    assert_same(got, run(model, [q, k, v, mask], []), torch.float32)
    assert fallbacks(opt) == {WHOLLY: 1}


@pytest.mark.parametrize("shape", [(B, 1, T, T), (1, 1, T, T), (B, H, T, T), (T, T)],
                         ids=["B1TS", "11TS", "BHTS", "TS"])
def test_scattered_hidden_rows_in_broadcast_masks(shape: tuple[int, ...]) -> None:
    model = AddedMask()
    opt = attnopt.optimize(model, variant="sdpa")
    q, k, v = qkv()
    rows = {0: [1, 3]} if shape[0] == B and len(shape) == 4 else {0: [0, 2]}
    if len(shape) == 2:
        mask = scattered(rows, (1, T, T))[0]
    else:
        mask = scattered(rows, shape) + torch.randn(shape) * 0.5  # hidden rows stay at most -SATURATED
        mask.requires_grad_(True)
    with quiet():
        opt(q, k, v, torch.zeros(shape))  # the check on a mask without hidden rows
    got = run(opt, [q, k, v, mask], [])
    assert_same(got, run(model, [q, k, v, mask], []), torch.float32)
    assert fallbacks(opt) == {PARTLY: 1}


def test_rows_hidden_with_minus_inf_stay_nan_as_written() -> None:
    """A row of -inf is NaN as written (output and the gradients it reaches); the site keeps that."""
    model = AddedMask()
    opt = attnopt.optimize(model, variant="sdpa")
    q, k, v = qkv()
    mask = causal_with_padding([0, 2])
    mask[1, :, 0, :] = float("-inf")  # row 0 of entry 1: every key -inf; row 1: the minimum
    with quiet():
        out = opt(q, k, v, mask)
    want = model(q, k, v, mask)
    torch.testing.assert_close(out, want, equal_nan=True)
    assert bool(out[1, :, 0].isnan().all()) and not bool(out[0].isnan().any())
    ga = torch.autograd.grad((out[0] * 1.0).sum() + out[1, :, 1:].sum(), (q, k, v), allow_unused=True)
    gw = torch.autograd.grad((want[0] * 1.0).sum() + want[1, :, 1:].sum(), (q, k, v), allow_unused=True)
    for a, e in zip(ga, gw):
        torch.testing.assert_close(a, e, atol=2e-5, rtol=1e-4, equal_nan=True)


def test_a_fill_then_a_bias_keeps_the_cut_gradient_on_left_padded_rows() -> None:
    """The mask's fills replace the score (no gradient there), the bias adds: rows as written keep both."""
    model = FillThenBias()
    opt = attnopt.optimize(model, variant="sdpa")
    q, k, v = qkv()
    hide = causal_with_padding([0, 3]) < 0  # (B, 1, T, T) bool: causal and left padding
    want = run(model, [q, k, v, hide], [model.bias])
    model.bias.grad = None
    got = run(opt, [q, k, v, hide], [model.bias])
    assert_same(got, want, torch.float32)
    assert fallbacks(opt) == {PARTLY: 1}


def test_gqa_site_with_left_padding() -> None:
    """Grouped heads as a site receives them (k, v unrepeated, enable_gqa)."""
    from attnopt.kernels.reference import reference_attention
    from attnopt.spec import AttentionSpec

    site = AttentionSite("s", AttentionSpec(scale=D**-0.5, mask="additive", nan_rows=True, gqa=True,
                                            min_rows="math"), "sdpa")
    q, k, v = qkv(heads_kv=2)
    mask = causal_with_padding([2, 0])
    got = run(lambda *a: site(*a), [q, k, v, mask], [])
    want = run(lambda q, k, v, m: reference_attention(q, k, v, attn_mask=m, scale=D**-0.5, enable_gqa=True),
               [q, k, v, mask], [])
    assert_same(got, want, torch.float32)
    assert site.fallbacks == {PARTLY: 1}


# ----------------------------------------------------------------------------- later calls, other values


def test_every_call_follows_its_own_mask_values() -> None:
    """Fresh masks at reused addresses, a mask written in place, other padding: each call as written."""
    model = AddedMask()
    opt = attnopt.optimize(model, variant="sdpa")
    q, k, v = qkv()
    mask = causal_with_padding([0, 0])
    for step in range(6):
        if step % 3 == 0:
            mask = causal_with_padding([0, 0])  # no hidden row
        elif step % 3 == 1:
            mask = causal_with_padding([3, 1])  # fresh: the freed one's memory is reused
        else:
            with torch.no_grad():
                mask[0, :, :2, :] = MIN  # in place: entry 0 now hides its first two rows
        assert_same(run(opt, [q, k, v, mask], []), run(model, [q, k, v, mask], []), torch.float32)
    assert fallbacks(opt) == {PARTLY: 4}


def test_no_grad_and_inference_mode_keep_the_fused_rows() -> None:
    model = AddedMask()
    opt = attnopt.optimize(model, variant="sdpa")
    q, k, v = (t.detach() for t in qkv())
    mask = causal_with_padding([0, 3])
    for ctx in (torch.no_grad, torch.inference_mode):
        with ctx(), counting_sdpa() as calls:
            out = opt(q, k, v, mask)
        assert calls[0] >= 1
        torch.testing.assert_close(out, model(q, k, v, mask))
    assert fallbacks(opt) == {}


def test_double_backward_through_left_padded_rows() -> None:
    """Gradients of gradients (create_graph=True), then backward again: as written."""
    model = AddedMask()
    opt = attnopt.optimize(model, variant="sdpa")
    q, k, v = qkv()
    mask = causal_with_padding([0, 3])
    results = []
    for fn in (opt, model):
        for t in (q, k, v):
            t.grad = None
        with quiet():
            out = fn(q, k, v, mask)
        gq, gk, gv = torch.autograd.grad((out * out.sin()).sum(), (q, k, v), create_graph=True)
        (gq.square().sum() + gk.square().sum() + gv.square().sum()).backward()
        results.append([out.detach(), gq.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()])
    assert_same(results[0], results[1], torch.float32)


def test_dropout_with_hidden_rows_runs_the_call_as_written() -> None:
    class Dropped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.drop = nn.Dropout(0.5)

        def forward(self, q, k, v, mask):
            return self.drop(((q @ k.transpose(-2, -1)) * D**-0.5 + mask).softmax(-1)) @ v

    opt = attnopt.optimize(Dropped().train(), variant="sdpa")
    q, k, v = qkv()
    with quiet():
        opt(q, k, v, causal_with_padding([0, 3])).sum().backward()
    assert fallbacks(opt) == {"rows with every key hidden, with dropout: the call as written": 1}


def test_explain_shows_the_run_time_fallbacks_with_their_count() -> None:
    model = AddedMask()
    opt = attnopt.optimize(model, variant="sdpa")
    q, k, v = qkv()
    for pad in ([0, 3], [0, 3], [0, 0]):
        run(opt, [q, k, v, causal_with_padding(pad)], [])
    report = attnopt.explain(opt)
    text = str(report)
    assert "at run time 1 of them ran 2 call(s) as written (wholly or in part)" in text, text
    assert "; at run time 2" in text, text  # the site's row (the table wraps the reason over its lines)
    assert report.to_dict()["records"][0]["fallbacks"] == {PARTLY: 2}
    assert [r.name for r in report.falling_back] == ["site0"]


def test_torch_func_grad_through_a_site_with_left_padding() -> None:
    from attnopt.kernels.reference import reference_attention
    from attnopt.spec import AttentionSpec

    site = AttentionSite("s", AttentionSpec(scale=D**-0.5, mask="additive", nan_rows=True, min_rows="math"), "sdpa")
    q, k, v = (t.detach() for t in qkv())
    mask = causal_with_padding([0, 3])
    w = torch.randn(B, H, T, D)

    def loss(fn):
        return lambda q, k, v: (fn(q, k, v) * w).sum()

    with quiet():
        got = torch.func.grad(loss(lambda q, k, v: site(q, k, v, mask)), argnums=(0, 1, 2))(q, k, v)
    want = torch.func.grad(loss(lambda q, k, v: reference_attention(q, k, v, attn_mask=mask, scale=D**-0.5)),
                           argnums=(0, 1, 2))(q, k, v)
    assert_same(list(got), list(want), torch.float32)


def test_compile_true_keeps_exact_gradients_on_left_padded_rows() -> None:
    """Inside a compiled graph the mask's values are unknown: calls with gradients run as written there."""
    model = AddedMask()
    opt = attnopt.optimize(model, variant="sdpa", compile=True)
    q, k, v = qkv()
    for pad in ([0, 3], [0, 0]):
        mask = causal_with_padding(pad)
        assert_same(run(opt, [q, k, v, mask], []), run(model, [q, k, v, mask], []), torch.float32)


# ----------------------------------------------------------------------------- Hugging Face causal decoders


def _llama() -> nn.Module:
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=64, vocab_size=64, bos_token_id=0, eos_token_id=0,
                                   attn_implementation="eager")
    return transformers.LlamaForCausalLM(cfg)


def _gpt2() -> nn.Module:
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32, attn_pdrop=0.0,
                                  resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                                  attn_implementation="eager")
    return transformers.GPT2LMHeadModel(cfg)


@pytest.mark.parametrize("build", [_llama, _gpt2], ids=["llama-gqa", "gpt2"])
def test_a_causal_decoder_trains_on_a_left_padded_batch_with_sdpa(build) -> None:
    model = build().train()  # dropout 0
    ids = torch.randint(0, 64, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding, as for batched generation
    opt = attnopt.optimize(model, variant="sdpa")
    params = [p for p in model.parameters() if p.requires_grad]
    results = []
    for fn in (opt, opt, model):
        with quiet(), counting_sdpa() as calls:
            logits = fn(input_ids=ids, attention_mask=mask).logits
        grads = torch.autograd.grad(logits.square().mean(), params, allow_unused=True)
        results.append((calls[0], logits.detach(), grads))
    assert results[1][0] == 2  # a later call: one SDPA call per layer
    _, got, g_got = results[1]
    _, want, g_want = results[2]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for a, e in zip(g_got, g_want):
        if e is None:
            assert a is None
        else:
            torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-4)
    report = attnopt.explain(opt)
    assert report.falling_back and all(set(r.extra["fallbacks"]) == {PARTLY} for r in report.falling_back)
    # train -> eval -> train: each mode as written; in inference the fused kernel serves every row
    for mode in ("eval", "train"):
        getattr(model, mode)()
        with quiet():
            torch.testing.assert_close(opt(input_ids=ids, attention_mask=mask).logits,
                                       model(input_ids=ids, attention_mask=mask).logits, atol=1e-5, rtol=1e-5)
        if mode == "eval":
            with torch.no_grad(), quiet():
                opt(input_ids=ids, attention_mask=mask)  # a new signature (no gradients): checked
                with counting_sdpa() as calls:
                    opt(input_ids=ids, attention_mask=mask)
            assert calls[0] == 2
