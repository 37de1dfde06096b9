"""nn.MultiheadAttention with discarded weights: need_weights=False, NaN rows restored (attnopt/passes/mha.py).

Every mask form PyTorch accepts (key_padding_mask bool/float, batched and unbatched; attn_mask
bool/float, ``[L, S]`` and ``[B*H, L, S]``; both together; ``is_causal=True``), both
``batch_first`` layouts, with and without query rows whose keys are all masked. Outputs must
equal the call as written (NaN rows included); without dead rows, gradients w.r.t. the input
and every MHA parameter must too.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import attnopt
from attnopt.passes.mha import dead_rows, restore_nan_rows

B, H, L, E = 2, 2, 5, 8
NEG = float("-inf")
MIN = torch.finfo(torch.float32).min


class MHA(nn.Module):
    """``nn.MultiheadAttention`` as most code calls it: weights returned by default, then dropped."""

    def __init__(self, batch_first: bool = False, dropout: float = 0.0, **kw):
        super().__init__()
        self.batch_first = batch_first
        self.mha = nn.MultiheadAttention(E, H, batch_first=batch_first, dropout=dropout, **kw)

    def forward(self, x, key_padding_mask=None, attn_mask=None, is_causal=False):
        return self.mha(x, x, x, key_padding_mask=key_padding_mask, attn_mask=attn_mask, is_causal=is_causal)[0]


class FunctionalMHA(MHA):
    """``F.multi_head_attention_forward`` called directly (sequence-first): masks reach it as given."""

    def forward(self, x, key_padding_mask=None, attn_mask=None, is_causal=False):
        m = self.mha
        return F.multi_head_attention_forward(
            x, x, x, E, H, m.in_proj_weight, m.in_proj_bias, m.bias_k, m.bias_v, m.add_zero_attn, m.dropout,
            m.out_proj.weight, m.out_proj.bias, training=self.training, key_padding_mask=key_padding_mask,
            attn_mask=attn_mask, is_causal=is_causal)[0]


def _x(batch_first: bool = False, unbatched: bool = False) -> torch.Tensor:
    shape = (L, E) if unbatched else (B, L, E) if batch_first else (L, B, E)
    return torch.randn(shape, requires_grad=True)


def _padding(dead: bool, dtype: torch.dtype = torch.bool, fill: float = NEG) -> torch.Tensor:
    """(B, L) key padding: the last keys of sequence 0 padded, every key of sequence 1 too when ``dead``."""
    pad = torch.zeros(B, L, dtype=torch.bool)
    pad[0, -2:] = True
    if dead:
        pad[1] = True
    return pad if dtype is torch.bool else torch.zeros(B, L).masked_fill(pad, fill)


def _run(model: nn.Module, x: torch.Tensor, *args, grads: bool = True, **kwargs):
    """Outputs (and gradients w.r.t. x and every parameter) of ``model`` as written and optimized."""
    opt = attnopt.optimize(model)
    params = [x, *model.parameters()]
    results = []
    for m in (model, opt):
        with torch.set_grad_enabled(grads):
            out = m(x, *args, **kwargs)
        g = torch.autograd.grad(out.nan_to_num().square().sum(), params) if grads else None
        results.append((out, g))
    (ref, g_ref), (out, g) = results
    (rec,) = attnopt.explain(opt).records
    return ref, out, g_ref, g, rec


def _check(model: nn.Module, x: torch.Tensor, *args, dead: bool, grads: bool = True, **kwargs):
    ref, out, g_ref, g, rec = _run(model, x, *args, grads=grads, **kwargs)
    assert rec.decision == "rewritten", rec.reason
    assert rec.rewrite.startswith("need_weights=False")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4, equal_nan=True)
    assert bool(torch.isnan(ref).any()) == dead  # the case holds the rows it is named for
    if grads and not dead:
        for a, b in zip(g, g_ref):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    return rec


# ----------------------------------------------------------------------------- key_padding_mask


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("dead", [False, True])
def test_bool_padding(batch_first: bool, dead: bool) -> None:
    rec = _check(MHA(batch_first), _x(batch_first), _padding(dead), dead=dead)
    assert rec.rewrite == "need_weights=False, NaN rows restored"
    assert "key_padding_mask" in rec.spelling


@pytest.mark.parametrize("batch_first", [False, True])
def test_dead_rows_land_on_their_sequence(batch_first: bool) -> None:
    """Only sequence 1 is fully padded: NaN there, numbers in sequence 0 (the [L, B] layout is read right)."""
    model, x = MHA(batch_first), _x(batch_first)
    out = attnopt.optimize(model)(x, _padding(True))
    nan = torch.isnan(out).all(-1)
    seq1 = nan[1] if batch_first else nan[:, 1]
    assert seq1.all() and int(nan.sum()) == L


@pytest.mark.parametrize("dead", [False, True])
def test_unbatched_padding(dead: bool) -> None:
    pad = torch.zeros(L, dtype=torch.bool)
    pad[-1] = True
    if dead:
        pad[:] = True
    _check(MHA(), _x(unbatched=True), pad, dead=dead)


@pytest.mark.parametrize("dead", [False, True])
def test_float_padding_without_gradients(dead: bool) -> None:
    """A float mask that is an input is rewritten when no gradients are needed."""
    _check(MHA(), _x(), _padding(dead, torch.float32), dead=dead, grads=False)


def test_finfo_min_padding_is_uniform_both_ways() -> None:
    """A row of finfo.min keys is uniform attention as written, not NaN, and stays so."""
    _check(MHA(), _x(), _padding(True, torch.float32, MIN), dead=False, grads=False)


def test_two_finite_fills_add_up_to_minus_infinity() -> None:
    """finfo.min padding plus a finfo.min attn_mask overflows to -inf when the call merges them: NaN rows."""
    am = torch.full((L, L), MIN)
    pad = _padding(True, torch.float32, MIN)
    _check(MHA(), _x(), pad, am, dead=True, grads=False)


# ----------------------------------------------------------------------------- attn_mask


@pytest.mark.parametrize("dead", [False, True])
@pytest.mark.parametrize("batch_first", [False, True])
def test_bool_attn_mask_2d(batch_first: bool, dead: bool) -> None:
    am = torch.ones(L, L, dtype=torch.bool).triu(1)  # causal: True = masked
    if dead:
        am[2] = True
    _check(MHA(batch_first), _x(batch_first), None, am, dead=dead)


@pytest.mark.parametrize("dead", [False, True])
def test_bool_attn_mask_per_head(dead: bool) -> None:
    """[B*H, L, S]: a row dead in one head only is NaN in the output (the projection mixes heads)."""
    am = torch.zeros(B * H, L, L, dtype=torch.bool)
    am[:, :, 0] = True
    if dead:
        am[H + 1, 3] = True  # sequence 1, head 1, query 3
    rec = _check(MHA(), _x(), None, am, dead=dead)
    assert "attn_mask" in rec.spelling


def test_per_head_dead_row_position() -> None:
    am = torch.zeros(B * H, L, L, dtype=torch.bool)
    am[H + 1, 3] = True
    out = attnopt.optimize(MHA())(_x(), None, am)
    nan = torch.isnan(out).any(-1)  # (L, B)
    assert nan[3, 1] and int(nan.sum()) == 1


@pytest.mark.parametrize("dead", [False, True])
def test_unbatched_per_head_attn_mask(dead: bool) -> None:
    am = torch.zeros(H, L, L, dtype=torch.bool)
    am[:, :, -1] = True
    if dead:
        am[0, 1] = True
    _check(MHA(), _x(unbatched=True), None, am, dead=dead)


@pytest.mark.parametrize("dead", [False, True])
def test_float_attn_mask_without_gradients(dead: bool) -> None:
    am = torch.zeros(B * H, L, L).masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), NEG)
    if dead:
        am[0, 4] = NEG
    _check(MHA(), _x(), None, am, dead=dead, grads=False)


def test_positive_infinity_in_a_float_mask() -> None:
    """+inf on a key makes the row NaN as written (inf - inf in the softmax); it stays NaN."""
    am = torch.zeros(L, L)
    am[1, 2] = float("inf")
    _check(MHA(), _x(), None, am, dead=True, grads=False)


class CausalInGraph(MHA):
    """The mask is built in forward, as ``nn.Transformer.generate_square_subsequent_mask`` does."""

    def forward(self, x, key_padding_mask=None, attn_mask=None, is_causal=True):
        t = x.shape[1] if self.batch_first else x.shape[0]
        mask = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
        return self.mha(x, x, x, key_padding_mask=key_padding_mask, attn_mask=mask, is_causal=is_causal)[0]


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("batch_first", [False, True])
def test_float_causal_mask_built_in_forward_keeps_gradients(batch_first: bool, is_causal: bool) -> None:
    """-inf fills read from the graph: no swamped rows possible, so gradients are exact and it is rewritten."""
    rec = _check(CausalInGraph(batch_first), _x(batch_first), is_causal=is_causal, dead=False)
    assert ("is_causal hint dropped" in rec.rewrite) == is_causal


def test_is_causal_hint_with_another_mask_follows_the_mask() -> None:
    """As written, need_weights=True applies attn_mask and ignores the hint; the rewrite must too."""
    am = torch.zeros(L, L, dtype=torch.bool)
    am[:, 0] = True  # not causal
    rec = _check(MHA(), _x(), None, am, is_causal=True, dead=False)
    assert rec.rewrite == "need_weights=False, is_causal hint dropped, NaN rows restored"
    assert "is_causal=True" in rec.spelling


# ----------------------------------------------------------------------------- both masks


@pytest.mark.parametrize("dead", [False, True])
@pytest.mark.parametrize("batch_first", [False, True])
def test_bool_padding_and_bool_attn_mask(batch_first: bool, dead: bool) -> None:
    am = torch.ones(L, L, dtype=torch.bool).triu(1)
    pad = torch.zeros(B, L, dtype=torch.bool)
    pad[1, 0] = dead  # with the causal mask, query 0 of sequence 1 has no key left
    pad[0, -1] = True
    _check(MHA(batch_first), _x(batch_first), pad, am, dead=dead)


@pytest.mark.parametrize("dead", [False, True])
def test_bool_padding_with_float_attn_mask(dead: bool) -> None:
    """Mixed types (PyTorch warns, nn.MultiheadAttention breaks the graph): F.multi_head_attention_forward."""
    am = torch.zeros(L, L)
    am[:, -1] = NEG
    pad = torch.zeros(B, L, dtype=torch.bool)
    pad[0, :-1] = dead  # sequence 0 keeps only the last key, which attn_mask removes
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Support for mismatched key_padding_mask")
        _check(FunctionalMHA(), _x(), pad, am, dead=dead, grads=False)


# ----------------------------------------------------------------------------- extra keys


@pytest.mark.parametrize("kw", [{"add_bias_kv": True}, {"add_zero_attn": True}], ids=["bias_kv", "zero_attn"])
def test_appended_keys_keep_fully_padded_rows_alive(kw: dict) -> None:
    """bias_k and add_zero_attn append a key no mask covers: no NaN rows as written, none after."""
    _check(MHA(**kw), _x(), _padding(True), dead=False)


# ----------------------------------------------------------------------------- left alone


def test_float_mask_input_with_gradients_is_left_alone() -> None:
    ref, out, _, _, rec = _run(MHA(), _x(), _padding(False, torch.float32))
    assert rec.decision == "left alone"
    assert "float key_padding_mask whose values attnopt cannot read" in rec.reason
    assert "torch.no_grad()" in rec.reason
    torch.testing.assert_close(out, ref)


class FilledInGraph(MHA):
    """Padding filled with finfo.min in forward, as Hugging Face models build it."""

    def forward(self, x, key_padding_mask=None, attn_mask=None, is_causal=False):
        pad = torch.zeros(key_padding_mask.shape, dtype=x.dtype).masked_fill(key_padding_mask, MIN)
        return self.mha(x, x, x, key_padding_mask=pad)[0]


def test_finfo_min_fill_with_gradients_is_left_alone() -> None:
    """A fully padded row is uniform attention as written; SDPA's backward gets its gradient wrong."""
    ref, out, g_ref, g, rec = _run(FilledInGraph(), _x(), _padding(True))
    assert rec.decision == "left alone"
    assert "mask filled with -3.40282e+38" in rec.reason and "fill with -inf" in rec.reason
    torch.testing.assert_close(out, ref)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b)


def test_finfo_min_fill_without_gradients_is_rewritten() -> None:
    _check(FilledInGraph(), _x(), _padding(True), dead=False, grads=False)


def test_dropout_in_training_is_left_alone() -> None:
    model = MHA(dropout=0.1)
    _, _, _, _, rec = _run(model, _x(), _padding(False), grads=False)
    assert rec.decision == "left alone"
    assert "dropout p=0.1 in training mode" in rec.reason and "model.eval()" in rec.reason


def test_dropout_in_eval_is_rewritten() -> None:
    _check(MHA(dropout=0.1).eval(), _x(), _padding(True), dead=True)


def test_unmasked_dropout_in_training_is_left_alone_too() -> None:
    _, _, _, _, rec = _run(MHA(dropout=0.1), _x(), grads=False)
    assert rec.decision == "left alone" and "random stream" in rec.reason


def test_eager_variant_reports_without_rewriting() -> None:
    model = MHA()
    opt = attnopt.optimize(model, variant="eager")
    opt(_x(), _padding(True))
    (rec,) = attnopt.explain(opt).records
    assert rec.decision == "left alone" and rec.reason == "variant='eager': left as written"


def test_weights_read_by_the_caller_are_not_touched() -> None:
    class Kept(MHA):
        def forward(self, x, key_padding_mask=None, attn_mask=None, is_causal=False):
            out, w = self.mha(x, x, x, key_padding_mask=key_padding_mask)
            return out, w

    opt = attnopt.optimize(Kept())
    opt(_x(), _padding(False))
    assert attnopt.explain(opt).records == []


# ----------------------------------------------------------------------------- explain() and the helper


def test_explain_says_what_was_done() -> None:
    opt = attnopt.optimize(MHA())
    opt(_x(), _padding(True))
    text = str(attnopt.explain(opt))
    assert "1 of 1 attention site(s) rewritten" in text
    assert "nn.MultiheadAttention(need_weights=True)" in text and "[0] key_padding_mask" in text
    assert "-> need_weights=False, NaN rows restored: the attention" in text
    (rec,) = attnopt.explain(opt).records
    assert rec.reason == ("the attention weights are discarded by the caller; PyTorch computes the output with "
                          "SDPA; query rows whose keys are all masked are set to NaN, as the call computes them")


def test_the_graph_calls_restore_nan_rows() -> None:
    from support import capture

    gm, ex = capture(MHA(), _x(), _padding(True))
    new = attnopt.rewrite(gm, ex, variant="sdpa")
    calls = [n for n in new.graph.nodes if n.op == "call_function"]
    mha = next(n for n in calls if n.target is F.multi_head_attention_forward)
    assert mha.kwargs["need_weights"] is False
    (fix,) = [n for n in calls if n.target is restore_nan_rows]
    assert fix.args[0].args == (mha, 0) and fix.args[3] == H


def test_dead_rows_matches_the_softmax_as_written() -> None:
    """dead_rows against the rows the explicit computation (softmax of the merged mask) leaves NaN."""
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        pad = torch.rand(B, L, generator=g) < 0.5
        am = torch.rand(B * H, L, L, generator=g) < 0.6
        padding = torch.zeros(B, L).masked_fill(pad, NEG).repeat_interleave(H, 0)[:, None]  # (B*H, 1, S)
        merged = torch.zeros(B * H, L, L).masked_fill(am, NEG) + padding
        expected = merged.softmax(-1).isnan().any(-1).view(B, H, L).any(1)
        assert torch.equal(dead_rows(pad, am, H, torch.float32), expected)


def test_restore_nan_rows_needs_a_mask() -> None:
    with pytest.raises(ValueError, match="needs a key_padding_mask or an attn_mask"):
        restore_nan_rows(torch.zeros(L, B, E), None, None, H)


def test_inductor_traces_the_restored_rows() -> None:
    model, x, pad = MHA(), _x(), _padding(True)
    opt = attnopt.optimize(model, compile=True)
    torch.testing.assert_close(opt(x, pad), model(x, pad), atol=1e-5, rtol=1e-4, equal_nan=True)
    assert attnopt.explain(opt).rewritten == 1 and not attnopt.explain(opt).failures
