"""A finite fill next to added masks: OpenAI-GPT's ``w * b + -1e4 * (1 - b)`` then ``+ attention_mask``, and the
same with ``masked_fill(~causal, -1e4)`` before or after the added mask (``runtime/site.MixedFillSite``).

As written, a filled key carries weight ``exp(-1e4 - rowmax)``: nothing where the row keeps another key, but a
left-padded query whose keys up to itself are all padded averages its *later* keys (filled with ``-1e4``, not
padded), not every key. The site serves the ordinary rows with the fused candidate (the filled keys dropped) and
computes the rows where the fill may carry weight as written. Each test compares outputs and gradients with the
code as written and checks which path served the call; one checks that the rows computed as written are ones the
candidate alone would get wrong, so the tests can fail.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers
from support import assert_param_grads_close, count_sdpa, fallbacks

import attnopt

B, H, T, D = 3, 2, 6, 8
MIN = torch.finfo(torch.float32).min


class Mixed(nn.Module):
    """Causal by a finite fill, plus an additive padding mask, in one of three spellings."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.register_buffer("b", torch.tril(torch.ones(T, T)).view(1, 1, T, T))

    def forward(self, q, k, v, mask):
        tq, tk = q.size(-2), k.size(-2)
        w = (q @ k.transpose(-2, -1)) / D**0.5
        b = self.b[:, :, :tq, :tk]
        if self.how == "openai":  # OpenAI-GPT
            w = w * b + -1e4 * (1 - b) + mask
        elif self.how == "fill_then_add":
            w = w.masked_fill(b == 0, -1e4) + mask
        else:  # add_then_fill: the fill replaces the added mask too
            w = (w + mask).masked_fill(b == 0, -1e4)
        return w.softmax(-1) @ v


SPELLINGS = ["openai", "fill_then_add", "add_then_fill"]


def _padding(kind: str) -> torch.Tensor:
    """``(B, 1, 1, T)``: 0 where kept, the dtype's minimum where padded (HF's extended attention mask)."""
    keep = torch.ones(B, T, dtype=torch.bool)
    if kind == "left":
        keep[0, :2] = False
        keep[1, :3] = False
    elif kind == "right":
        keep[0, 4:] = False
    return torch.zeros(B, 1, 1, T).masked_fill(~keep[:, None, None, :], MIN)


def _inputs(grad: bool, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    return tuple(torch.randn(B, H, T, D, dtype=dtype, requires_grad=grad) for _ in range(3))


@pytest.mark.parametrize("how", SPELLINGS)
@pytest.mark.parametrize("pad", ["none", "left", "right"])
@pytest.mark.parametrize("grad", [False, True])
def test_finite_fill_with_padding_is_rewritten_and_exact(how, pad, grad, monkeypatch):
    model = Mixed(how)
    mask = _padding(pad)
    q, k, v = _inputs(grad)
    ref = model(q, k, v, mask)
    opt = attnopt.optimize(model, variant="sdpa")
    opt(q, k, v, mask)  # the first call of a shape also checks the candidate against the reference
    calls = count_sdpa(monkeypatch)
    got = opt(q, k, v, mask)
    report = str(attnopt.explain(opt))
    assert "1 of 1 attention site(s) rewritten" in report, report
    assert "(bounded)" in report, report
    assert calls[0] == 1  # the fused candidate served the call
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
    partly = [w for w in fallbacks(opt) if "the candidate, and those rows as written" in w]
    assert bool(partly) == (pad == "left")  # only left padding hides every key up to a query
    if grad:
        g = torch.randn_like(ref)
        want = torch.autograd.grad(ref, (q, k, v), g)
        have = torch.autograd.grad(got, (q, k, v), g)
        for a, b in zip(have, want):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


def test_rows_computed_as_written_are_ones_the_candidate_gets_wrong():
    """A left-padded query keeps no key: as written it averages its later keys (filled with -1e4), which SDPA
    given the fill as a mask does not: the site must compute those rows as written."""
    model = Mixed("openai")
    mask = _padding("left")
    q, k, v = _inputs(False)
    ref = model(q, k, v, mask)
    b = model.b[:, :, :T, :T]
    candidate = F.scaled_dot_product_attention(q, k, v, attn_mask=(-1e4 * (1 - b) + mask))
    assert (candidate[0, :, :2] - ref[0, :, :2]).abs().max() > 1e-2  # the padded queries of row 0
    later = v[0, :, 2:].mean(-2)  # query 0 of row 0 averages keys 1..5, query 1 keys 2..5 (not padded ones)
    torch.testing.assert_close(ref[0, :, 1], later, atol=1e-5, rtol=1e-5)
    opt = attnopt.optimize(model, variant="sdpa")
    torch.testing.assert_close(opt(q, k, v, mask), ref, atol=2e-5, rtol=1e-4)


def test_scores_large_enough_to_weigh_the_fill_run_as_written():
    """With ``|q| |k|`` near 1e4 the bound fails on every row: the whole call as written, and still exact."""
    model = Mixed("fill_then_add")
    mask = _padding("right")
    q, k, v = _inputs(False)
    q, k = q * 60, k * 60
    ref = model(q, k, v, mask)
    opt = attnopt.optimize(model, variant="sdpa")
    torch.testing.assert_close(opt(q, k, v, mask), ref, atol=2e-5, rtol=1e-4)
    assert any("past half the queries: the call as written" in w for w in fallbacks(opt)), fallbacks(opt)


def test_a_soft_added_mask_that_makes_the_fill_weigh():
    """The added mask is any float: where it pushes a row's kept keys below the fill, the fill weighs."""
    model = Mixed("openai")
    torch.manual_seed(1)
    mask = torch.randn(B, 1, T, T)
    mask[2, :, 4, :5] = -3e4  # row 4 of batch 2: its kept keys sit far below the filled key 5
    q, k, v = _inputs(True)
    ref = model(q, k, v, mask)
    assert (ref[2, :, 4] - v[2, :, 5]).abs().max() < 1e-4  # as written that row is key 5, a filled key
    opt = attnopt.optimize(model, variant="sdpa")
    got = opt(q, k, v, mask)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


def test_double_backward_through_the_rows_as_written():
    model = Mixed("openai")
    mask = _padding("left")
    q, k, v = _inputs(True)
    opt = attnopt.optimize(model, variant="sdpa")
    grads = []
    for fn in (model, opt):
        out = fn(q, k, v, mask)
        (gq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
        grads.append(torch.autograd.grad(gq.sum(), (q, k, v)))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=1e-4)


def test_bfloat16_against_float64():
    """In bfloat16 the fill is -9984 as stored; the rewrite is no further from float64 than the code as written."""
    model = Mixed("openai")
    mask = _padding("left")
    q, k, v = _inputs(False, torch.bfloat16)
    ref64 = model.double()(q.double(), k.double(), v.double(), mask.double())
    model = model.to(torch.bfloat16)
    eager = model(q, k, v, mask.to(torch.bfloat16))
    opt = attnopt.optimize(model, variant="sdpa")
    got = opt(q, k, v, mask.to(torch.bfloat16))
    err_eager = (eager.double() - ref64).abs().max().item()
    err_opt = (got.double() - ref64).abs().max().item()
    assert err_opt <= 2 * err_eager + 1e-2, (err_opt, err_eager)


@pytest.mark.parametrize("pad", ["left", "right"])
def test_openai_gpt_with_a_padding_mask(pad):
    cfg = transformers.OpenAIGPTConfig(vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                       attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.OpenAIGPTModel(cfg).eval()
    ids = torch.randint(0, 50, (2, 8))
    am = torch.ones(2, 8, dtype=torch.long)
    if pad == "left":
        am[0, :3] = 0
    else:
        am[0, 5:] = 0
    ref = model(ids, attention_mask=am).last_hidden_state
    opt = attnopt.optimize(model)
    got = opt(ids, attention_mask=am).last_hidden_state
    report = str(attnopt.explain(opt))
    assert "2 of 2 attention site(s) rewritten" in report, report
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
    assert_param_grads_close(model, got, ref)


def test_rows_served_under_their_own_bound_when_the_call_wide_bound_fails():
    """Scores large enough that the fill may weigh in rows with a plain mask, while a large added mask keeps the
    fill negligible in the others: those rows go to the candidate with the added mask's values (float64, so
    the comparison is exact enough at these magnitudes)."""
    model = Mixed("openai").double()
    torch.manual_seed(3)
    q, k, v = (torch.randn(B, H, T, D, dtype=torch.float64) for _ in range(3))
    q, k = q * 60, k * 60  # |scale| max|q| max|k| is about 2e4: the call-wide bound fails
    mask = torch.zeros(B, 1, T, T, dtype=torch.float64)
    kept = torch.ones(T, T, dtype=torch.bool).tril()
    kept[:2] = False  # rows 2..: their kept keys get a large added value that dwarfs the fill
    mask = mask.masked_fill(kept, 1e6) + kept * 3e4 * torch.randn(B, 1, T, T, dtype=torch.float64)
    ref = model(q, k, v, mask)
    opt = attnopt.optimize(model, variant="sdpa")
    torch.testing.assert_close(opt(q, k, v, mask), ref, atol=1e-6, rtol=1e-6)
    assert any("the candidate, and those rows as written" in w for w in fallbacks(opt)), fallbacks(opt)


def test_later_calls_with_other_shapes_and_a_mask_written_in_place():
    """Nothing about the rows is kept from one call to the next: another length, another batch, the same mask
    tensor written in place (a fresh padding at the same address), each call exact."""
    model = Mixed("openai")
    opt = attnopt.optimize(model, variant="sdpa")
    torch.manual_seed(5)
    mask = _padding("left")
    for step in range(4):
        b, t = (B, T) if step % 2 == 0 else (1, T - 2)
        q, k, v = (torch.randn(b, H, t, D) for _ in range(3))
        m = mask[:b, :, :, :t]
        torch.testing.assert_close(opt(q, k, v, m), model(q, k, v, m), atol=2e-5, rtol=1e-4)
        mask.zero_() if step == 1 else mask[:, :, :, : step + 1].fill_(MIN)  # in place: other rows padded
