"""Views of the scores or probabilities that only fold or unfold leading axes (issue 14, item 2).

``(B*H, T, S) <-> (B, H, T, S)`` keeps every row a row and every (T, S) block a block, so the site is rewritten,
with masks added in either layout brought to the site's; views that move, split or resize the query or key axis
are refused with their reason. Each accepted spelling is checked for outputs and gradients, also on later calls
with other batch sizes and lengths (dynamo's symbolic graph).
"""

from __future__ import annotations

import math

import pytest
import support
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers

import attnopt
from attnopt.passes.find_sites import Layout, fold_view, relayout
from attnopt.passes.masks import same

B, H, T, S, D = 2, 4, 6, 5, 8


class Fn(nn.Module):
    def __init__(self, body):
        super().__init__()
        self.body = body

    def forward(self, *args):
        return self.body(*args)


def _bart(q, k, v, mask):  # fairseq / MVP: 3-D bmm, scores viewed 4-D for the mask and back
    b, h, t, d = q.shape
    s_ = k.size(2)
    q3, k3, v3 = (x.reshape(b * h, -1, d) for x in (q * d ** -0.5, k, v))
    w = torch.bmm(q3, k3.transpose(1, 2))
    w = w.view(b, h, t, s_) + mask
    w = w.view(b * h, t, s_)
    return torch.bmm(F.softmax(w, dim=-1), v3).view(b, h, t, d)


def _reshape_fn(q, k, v, mask):  # the same with torch.reshape / .reshape
    b, h, t, d = q.shape
    q3, k3, v3 = (x.flatten(0, 1) for x in (q, k, v))
    w = torch.reshape(q3 @ k3.transpose(-1, -2) / math.sqrt(d), (b, h, t, -1)) + mask
    return (w.reshape(b * h, t, -1).softmax(-1) @ v3).view(b, h, t, d)


def _bloom(q, k, v, mask, alibi):  # baddbmm with an ALiBi bias (B*H, 1, S), 4-D mask, probabilities viewed 3-D
    b, h, t, d = q.shape
    q3, v3 = q.reshape(b * h, -1, d), v.reshape(b * h, -1, d)
    k3 = k.reshape(b * h, -1, d).transpose(-1, -2)
    w = alibi.baddbmm(batch1=q3, batch2=k3, beta=1.0, alpha=d ** -0.5).view(b, h, t, -1) + mask
    p = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.bmm(p.view(b * h, t, -1), v3)


def _probs_to_3d(q, k, v, mask):  # 4-D product, probabilities folded to 3-D for the value product
    b, h, t, d = q.shape
    p = (q @ k.transpose(-2, -1) * d ** -0.5 + mask).softmax(-1)
    return torch.bmm(p.reshape(b * h, t, -1), v.reshape(b * h, -1, d))


def _mask_in_each_layout(q, k, v, mask3, mask4):  # (B*H, T, S) added 3-D, (B, 1, 1, S) added 4-D
    b, h, t, d = q.shape
    q3, k3, v3 = (x.reshape(b * h, -1, d) for x in (q, k, v))
    w = torch.bmm(q3, k3.transpose(1, 2)) + mask3
    w = (w.view(b, h, t, -1) + mask4).view(b * h, t, -1)
    return torch.bmm(w.softmax(-1), v3)


def _unsqueezed(q, k, v, mask):  # (B*H, T, S).unsqueeze(0): (1, B*H, T, S)
    b, h, t, d = q.shape
    q3, k3, v3 = (x.reshape(b * h, -1, d) for x in (q, k, v))
    w = torch.bmm(q3, k3.transpose(1, 2)).unsqueeze(0) + mask.reshape(1, b * h, t, -1)
    return torch.bmm(w.view(b * h, t, -1).softmax(-1), v3)


def _windows(q, k, v, bias, mask):  # Swin: (B*nW, H, N, N) viewed (B, nW, H, N, N) for the window mask
    nw = mask.size(0)
    w = q @ k.transpose(-2, -1) * 0.25 + bias  # bias (1, H, N, N)
    bw, h, n, _ = w.shape
    w = w.view(bw // nw, nw, h, n, n) + mask.unsqueeze(1).unsqueeze(0)
    return w.view(-1, h, n, n).softmax(-1) @ v


def _inputs(kind: str, b: int = B, t: int = T, s: int = S) -> tuple[torch.Tensor, ...]:
    q = torch.randn(b, H, t, D)
    k, v = torch.randn(b, H, s, D), torch.randn(b, H, s, D)
    if kind == "bloom":
        return q, k, v, torch.randn(b, 1, t, s), torch.randn(b * H, 1, s)
    if kind == "layouts":
        return q, k, v, torch.randn(b * H, t, s), torch.randn(b, 1, 1, s)
    if kind == "unsqueezed":
        return q, k, v, torch.randn(b, H, t, s)
    return q, k, v, torch.randn(b, 1, t, s)


def _check(model, inputs, atol=1e-5, rtol=1e-4):
    leaves = [x.clone().requires_grad_() for x in inputs]
    ref_leaves = [x.clone().requires_grad_() for x in inputs]
    out, ref = model[0](*leaves), model[1](*ref_leaves)
    out, ref = (x[0] if isinstance(x, (tuple, list)) else x for x in (out, ref))  # a GraphModule's outputs
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    cot = torch.randn_like(ref)
    g = torch.autograd.grad((out * cot).sum(), leaves)
    g_ref = torch.autograd.grad((ref * cot).sum(), ref_leaves)
    for i, (a, r) in enumerate(zip(g, g_ref)):
        torch.testing.assert_close(a, r, atol=10 * atol, rtol=10 * rtol, msg=f"gradient {i}")


ACCEPTED = {
    "bart_view_mask_view": (_bart, "mask"),
    "reshape": (_reshape_fn, "mask"),
    "bloom_baddbmm_alibi": (_bloom, "bloom"),
    "probabilities_to_3d": (_probs_to_3d, "mask"),
    "masks_in_each_layout": (_mask_in_each_layout, "layouts"),
    "unsqueeze": (_unsqueezed, "unsqueezed"),
}


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_fold_unfold_views_are_rewritten_exactly_at_every_batch_size(name: str) -> None:
    body, kind = ACCEPTED[name]
    model = Fn(body)
    opt = attnopt.optimize(model, variant="sdpa")
    for b, t, s in ((B, T, S), (3, 7, 4), (5, 3, 9)):  # the second shape recompiles with symbolic sizes
        _check((opt, model), _inputs(kind, b, t, s))
    report = attnopt.explain(opt)
    assert report.graphs >= 2 and report.rewritten == report.graphs, str(report)
    assert all(r.decision == "rewritten" for r in report.records), str(report)


def test_mask_added_in_the_viewed_layout_is_passed_unexpanded() -> None:
    """BART's (B, 1, T, S) mask is added in the (B, H) layout: the site runs there, so the mask is not expanded."""
    from tests.support import capture

    model = Fn(_bart)
    inputs = _inputs("mask")
    gm, ex = capture(model, *inputs)
    new = attnopt.rewrite(gm, ex, variant="sdpa")
    assert new.meta["attnopt_report"].rewritten == 1
    assert "expand" not in new.code and "bmm" not in new.code, new.code
    _check((new, gm), ex)


def test_window_mask_through_a_five_dim_view() -> None:
    """Swin: the (1, nW, 1, N, N) mask is expanded over the batch only and folded to (B*nW, 1, N, N)."""
    nw, n = 3, 4
    model = Fn(_windows)
    opt = attnopt.optimize(model, variant="sdpa")
    for b in (2, 3, 5):
        q, k, v = (torch.randn(b * nw, H, n, D) for _ in range(3))
        mask = torch.where(torch.rand(nw, n, n) > 0.3, 0.0, -100.0)
        _check((opt, model), (q, k, v, torch.randn(1, H, n, n), mask))
    report = attnopt.explain(opt)
    assert all(r.decision == "rewritten" for r in report.records), str(report)


def test_exported_and_decomposed_matmul_is_rewritten() -> None:
    """``run_decompositions`` spells ``q @ k^T`` as expand + view + bmm + _unsafe_view."""

    def body(q, k, v, mask):
        return ((q @ k.transpose(-2, -1)) * 0.3 + mask).softmax(-1) @ v

    inputs = _inputs("mask")
    ep = torch.export.export(Fn(body), inputs).run_decompositions()
    gm = ep.module()
    new = attnopt.rewrite(gm, variant="sdpa")
    report = new.meta["attnopt_report"]
    assert report.rewritten == 1, str(report)
    _check((new, Fn(body)), inputs)


# ----------------------------------------------------------------------------- look-alikes


def _swap(q, k, v):  # (B*H, T, S) viewed (B, H, S, T): the query and key axes trade places
    b, h, t, d = q.shape
    w = torch.bmm(q.flatten(0, 1), k.flatten(0, 1).transpose(1, 2)).view(b, h, k.size(2), t)
    return w.softmax(-1).reshape(b * h, t, -1) @ v.flatten(0, 1)


def _rows(q, k, v):  # (B*H, T, S) viewed (B*H*T, S): the query axis folded into the batch
    b, h, t, d = q.shape
    w = torch.bmm(q.flatten(0, 1), k.flatten(0, 1).transpose(1, 2)).view(b * h * t, -1)
    return torch.bmm(w.softmax(-1).view(b * h, t, -1), v.flatten(0, 1))


def _heads_and_queries(q, k, v):  # (B*H, T, S) viewed (B, T, H, S) with T != H
    b, h, t, d = q.shape
    w = torch.bmm(q.flatten(0, 1), k.flatten(0, 1).transpose(1, 2)).view(b, t, h, -1)
    return torch.bmm(w.softmax(-1).reshape(b * h, t, -1), v.flatten(0, 1))


def _key_axis(q, k, v):  # the key axis split: (B*H, T, S) viewed (B*H, T, S // 5, 5)... the last axis changes
    b, h, t, d = q.shape
    w = torch.bmm(q.flatten(0, 1), k.flatten(0, 1).transpose(1, 2)).view(b * h, t, -1, 5)
    return (w.softmax(-1).view(b * h, t, -1) @ v.flatten(0, 1))


def _broadcast(q, k, v):  # the scores broadcast by expand (one head's scores for every head)
    w = (q[:, :1] @ k[:, :1].transpose(-2, -1)).expand(-1, q.size(1), -1, -1)
    return w.softmax(-1) @ v


LOOKALIKES = {
    "swap_query_key": (_swap, (B, H, T, D), (B, H, S, D), "changes the key axis"),
    "fold_query_axis": (_rows, (B, H, T, D), (B, H, S, D), "folds the query axis into the batch"),
    "mix_heads_and_queries": (_heads_and_queries, (B, H, T, D), (B, H, S, D), "does not keep the query axis"),
    "split_key_axis": (_key_axis, (B, H, T, D), (B, H, 10, D), "changes the key axis"),
    "expand_scores": (_broadcast, (B, H, T, D), (B, H, S, D), "broadcast by"),
}


@pytest.mark.parametrize("name", list(LOOKALIKES))
def test_views_that_move_the_query_or_key_axis_are_refused(name: str) -> None:
    body, qs, ks, why = LOOKALIKES[name]
    model = Fn(body)
    q, k, v = torch.randn(*qs), torch.randn(*ks), torch.randn(*ks)
    report = attnopt.explain(model, q, k, v)
    assert report.rewritten == 0, str(report)
    reasons = " | ".join(r.reason or "" for r in report.records)
    assert why in reasons, reasons
    opt = attnopt.optimize(model, variant="sdpa")
    with torch.no_grad():
        torch.testing.assert_close(opt(q, k, v), model(q, k, v), atol=0, rtol=0)


def test_heads_and_queries_of_one_size_view_the_same_rows() -> None:
    """(B*H, T, S) viewed (B, T, H, S) when T == H is the row-major view (B, H, T, S): the same numbers."""
    model = Fn(_heads_and_queries)
    q, k, v = torch.randn(B, H, H, D), torch.randn(B, H, S, D), torch.randn(B, H, S, D)
    opt = attnopt.optimize(model, variant="sdpa")
    _check((opt, model), (q, k, v))


def test_unprovable_factorisation_and_layout_helpers() -> None:
    """The proof is from shapes: the fold keeps the last two sizes, the leading products must be provably equal."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    b, n = env.create_unbacked_symint(), env.create_unbacked_symint()
    assert not same(b * 4, n * 4)  # sizes of unknown relation: not the same fold
    src = Layout((b * 4,), (None,))
    dst = Layout((b, 4), (None, 4))
    # a full (B*H, 1, S) bias from (B*H,) to (B, H): unflatten with the one unknown size inferred
    assert relayout((b * 4,), src, dst, "the bias") == (("unflatten", (0, (-1, 4))),)
    # a broadcast (1, 1, S) term needs nothing; a (B, 1) term into (B*H,) must be expanded, which needs B
    assert relayout((1,), src, dst, "the mask") == ()
    with pytest.raises(Exception, match="not known at run time"):
        relayout((1, 4), Layout((b, 4), (None, 4)), src, "the mask")
    assert callable(fold_view)


# ----------------------------------------------------------------------------- real model code


def _mvp():
    cfg = transformers.MvpConfig(vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1,
                                 encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                 decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                                 attn_implementation="eager")
    return transformers.MvpForConditionalGeneration(cfg), 3, True


def _bart_model():
    cfg = transformers.BartConfig(vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                  decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                                  attn_implementation="eager")
    return transformers.BartForConditionalGeneration(cfg), 3, True


def _bloom_model():
    cfg = transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4, attention_dropout=0.0,
                                   hidden_dropout=0.0, attn_implementation="eager")
    return transformers.BloomForCausalLM(cfg), 2, False


def _falcon_alibi():
    cfg = transformers.FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    alibi=True, new_decoder_architecture=False, multi_query=False,
                                    attention_dropout=0.0, hidden_dropout=0.0, attn_implementation="eager")
    return transformers.FalconForCausalLM(cfg), 2, False


@pytest.mark.parametrize("build", [_mvp, _bart_model, _bloom_model, _falcon_alibi],
                         ids=["mvp-fairseq-views", "bart", "bloom-baddbmm-alibi", "falcon-alibi"])
def test_hf_models_with_viewed_scores_are_rewritten_outputs_and_grads_equal(build) -> None:
    torch.manual_seed(0)
    model, sites, seq2seq = build()
    model.train()  # dropout 0: gradients through the sites
    ids = torch.randint(3, 64, (2, 10))
    pad = torch.ones(2, 10, dtype=torch.long)
    pad[1, 7:] = 0  # right padding in the second sequence
    inputs = {"input_ids": ids, "attention_mask": pad}
    if seq2seq:
        inputs["decoder_input_ids"] = torch.randint(3, 64, (2, 7))
    opt = attnopt.optimize(model, variant="sdpa")
    out, ref = opt(**inputs).logits, model(**inputs).logits
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    report = attnopt.explain(opt)
    assert report.rewritten == sites and all(r.decision == "rewritten" for r in report.records), str(report)
    support.assert_param_grads_close(model, out, ref)


def test_views_with_unprovable_symbolic_sizes_are_refused() -> None:
    """A view whose query size, or (with T * S possibly 0) leading product, cannot be proven kept is refused."""
    import torch.fx as fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from attnopt.passes.find_sites import NearMiss

    env = ShapeEnv()
    b, c, t = (env.create_unbacked_symint() for _ in range(3))
    with FakeTensorMode(shape_env=env):
        src = torch.empty(b * 4, t, 5)
        cases = {"query": (torch.empty(b, 4, c, 5), "does not keep the query axis"),
                 "blocks": (torch.empty(c, 4, t, 5), "cannot be proven to hold the same number of blocks"),
                 "kept": (torch.empty(b, 4, t, 5), None)}
    for out, why in cases.values():
        g = fx.Graph()
        x = g.placeholder("x")
        y = g.call_method("view", (x, 1, 4, 1, 5))
        x.meta["val"], y.meta["val"] = src, out
        if why is None:
            assert fold_view(y, "scores") is x
        else:
            with pytest.raises(NearMiss, match=why):
                fold_view(y, "scores")


def _rank5_nest(self, x):
    """timm NesT: q, k, v of shape (B, H, T, N, d), a block axis T beside the heads."""
    b, t, n, c = x.shape
    q, k, v = self.qkv(x).reshape(b, t, n, 3, 4, c // 4).permute(3, 0, 4, 1, 2, 5).unbind(0)
    attn = ((q @ k.transpose(-2, -1)) * 0.25).softmax(dim=-1)
    return (attn @ v).permute(0, 2, 3, 4, 1).reshape(b, t, n, c)


def _rank5_windows(self, x, mask):
    """timm Twins (locally-grouped attention): (B, nW, H, N, d) with a per-window additive mask."""
    b, w, n, c = x.shape
    q, k, v = self.qkv(x).reshape(b, w, n, 3, 4, c // 4).permute(3, 0, 1, 4, 2, 5)
    attn = (q @ k.transpose(-2, -1)) * 0.25 + mask.unsqueeze(1)  # mask (nW, N, N)
    return attn.softmax(-1) @ v


@pytest.mark.parametrize("body", [_rank5_nest, _rank5_windows], ids=["nest", "windows"])
def test_rank5_operands_fold_their_leading_axes(body) -> None:
    model = support.Fn(body)  # (this file's own Fn passes no module)
    model.qkv = torch.nn.Linear(16, 48)
    opt = attnopt.optimize(model, variant="sdpa")
    for shape in ((2, 3, 5, 16), (3, 2, 7, 16)):  # the second recompiles with symbolic sizes
        x = torch.randn(*shape)
        inputs = [x] if body is _rank5_nest else [x, torch.randn(shape[1], shape[2], shape[2])]
        leaves = [t.clone().requires_grad_() for t in inputs]
        out, ref = opt(*leaves), model(*inputs)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
        params = list(model.parameters())
        g = torch.autograd.grad(out.square().sum(), params)
        g_ref = torch.autograd.grad(ref.square().sum(), params)
        for a, e in zip(g, g_ref):
            torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-4)
    report = attnopt.explain(opt)
    assert report.records and all(r.decision == "rewritten" for r in report.records), str(report)
