"""The tiled kernel computes reference_attention's function: outputs, gradients, masks, GQA, skipping."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import attnopt
from attnopt.kernels.reference import reference_attention
from attnopt.kernels.registry import candidate_names, get_candidate
from attnopt.kernels.tiled import count_blocks, tiled_attention
from attnopt.models import CausalSelfAttention, GPTConfig
from attnopt.selection.measure import peak_memory
from attnopt.spec import AttentionSpec


def softcap(score, b, h, q_idx, kv_idx):
    return 2.0 * torch.tanh(score / 2.0)


SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625])


def alibi(score, b, h, q_idx, kv_idx):
    return score + SLOPES.to(score.dtype)[h] * (kv_idx - q_idx) + 0.01 * b


SCORE_MODS = {"none": None, "softcap": softcap, "alibi": alibi}


def keep_mask(tq: int, tk: int, causal: bool, window: int | None) -> torch.Tensor:
    """(Tq, Tk) pairs the causal (top-left) and window masks leave visible, written densely."""
    qi, kj = torch.arange(tq)[:, None], torch.arange(tk)[None, :]
    keep = torch.ones(tq, tk, dtype=torch.bool)
    if causal:
        keep &= kj <= qi
    if window is not None:
        keep &= qi - kj < window
    return keep


def reference_with_zero_rows(q, k, v, *, mask, causal, window, scale, gqa, score_mod):
    """reference_attention on the same function written with one dense mask, and the rows it masks fully.

    Fully masked rows are NaN in the plain computation; here they attend everywhere instead and the
    caller zeroes their output and upstream gradient, which is what the tiled kernel promises.
    """
    B, H, tq, _ = q.shape
    tk = k.size(-2)
    keep = keep_mask(tq, tk, causal, window).expand(B, H, tq, tk)
    if mask is not None and mask.dtype == torch.bool:
        keep = keep & mask
    dead = ~keep.any(-1, keepdim=True)  # (B, H, Tq, 1)
    keep = keep | dead
    if mask is not None and mask.dtype != torch.bool:
        full = mask.masked_fill(~keep, float("-inf"))
    else:
        full = keep
    out = reference_attention(q, k, v, attn_mask=full, scale=scale, enable_gqa=gqa, score_mod=score_mod)
    return out, dead


@st.composite
def cases(draw):
    hkv = draw(st.integers(1, 2))
    group = draw(st.integers(1, 3))
    mask_kind = draw(st.sampled_from(["none", "bool", "additive", "additive_grad"]))
    bcast = draw(st.lists(st.booleans(), min_size=4, max_size=4))  # which of (B, H, Tq, Tk) the mask has
    return dict(B=draw(st.integers(1, 2)), Hkv=hkv, H=hkv * group, Tq=draw(st.integers(1, 13)),
                Tk=draw(st.integers(1, 13)), D=draw(st.integers(1, 6)), Dv=draw(st.integers(1, 6)),
                block_q=draw(st.integers(1, 5)), block_k=draw(st.integers(1, 5)), causal=draw(st.booleans()),
                window=draw(st.one_of(st.none(), st.integers(1, 6))), mask_kind=mask_kind, bcast=bcast,
                drop_dims=draw(st.integers(0, 2)), score_mod=draw(st.sampled_from(sorted(SCORE_MODS))))


def make_mask(c: dict) -> torch.Tensor | None:
    if c["mask_kind"] == "none":
        return None
    shape = [n if has else 1 for n, has in zip((c["B"], c["H"], c["Tq"], c["Tk"]), c["bcast"])]
    while c["drop_dims"] and len(shape) > 2 and shape[0] == 1:  # also exercise 2-D and 3-D masks
        shape = shape[1:]
        c = {**c, "drop_dims": c["drop_dims"] - 1}
    if c["mask_kind"] == "bool":
        return torch.rand(shape) > 0.3
    return torch.randn(shape).requires_grad_(c["mask_kind"] == "additive_grad")


@given(cases())
def test_outputs_and_gradients_match_reference(c):
    q = torch.randn(c["B"], c["H"], c["Tq"], c["D"], requires_grad=True)
    k = torch.randn(c["B"], c["Hkv"], c["Tk"], c["D"], requires_grad=True)
    v = torch.randn(c["B"], c["Hkv"], c["Tk"], c["Dv"], requires_grad=True)
    mask = make_mask(c)
    gqa, score_mod, scale = c["H"] != c["Hkv"], SCORE_MODS[c["score_mod"]], 0.7
    out = tiled_attention(q, k, v, attn_mask=mask, is_causal=c["causal"], scale=scale, enable_gqa=gqa,
                          score_mod=score_mod, block_q=c["block_q"], block_k=c["block_k"], window=c["window"])
    ref, dead = reference_with_zero_rows(q, k, v, mask=mask, causal=c["causal"], window=c["window"], scale=scale,
                                         gqa=gqa, score_mod=score_mod)
    assert out.shape == ref.shape
    assert torch.all(out.masked_select(dead) == 0)
    torch.testing.assert_close(out.masked_fill(dead, 0), ref.masked_fill(dead, 0), atol=2e-5, rtol=2e-5)

    leaves = [q, k, v] + ([mask] if mask is not None and mask.requires_grad else [])
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, g)
    want = torch.autograd.grad(ref, leaves, g.masked_fill(dead, 0))
    for name, a, b in zip(["q", "k", "v", "mask"], got, want):
        assert a.shape == b.shape, name
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, atol=5e-5, rtol=5e-5, msg=lambda m, name=name: f"grad of {name}: {m}")


@pytest.mark.parametrize("mask_shape", [(11,), (10, 1), (1, 4, 1, 11), (2, 1, 10, 1), (10, 11), (2, 4, 10, 11)])
@pytest.mark.parametrize("causal, window", [(False, None), (True, 4)])
def test_broadcast_additive_mask_gets_its_gradient_summed_over_blocks(mask_shape, causal, window):
    q, k, v = torch.randn(2, 4, 10, 4), torch.randn(2, 2, 11, 4), torch.randn(2, 2, 11, 3)
    bias = torch.randn(mask_shape)
    leaves = [t.requires_grad_() for t in (q, k, v, bias)]
    out = tiled_attention(q, k, v, attn_mask=bias, is_causal=causal, window=window, enable_gqa=True,
                          score_mod=alibi, block_q=3, block_k=4)
    ref, dead = reference_with_zero_rows(q, k, v, mask=bias, causal=causal, window=window, scale=None, gqa=True,
                                         score_mod=alibi)
    assert not dead.any()
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, leaves, g), torch.autograd.grad(ref, leaves, g)):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=5e-5)


@pytest.mark.parametrize("tq, tk, gqa", [(9, 9, False), (5, 11, True), (11, 6, False)])
def test_is_causal_is_sdpa_top_left(tq, tk, gqa):
    hkv = 2 if gqa else 4
    q, k, v = torch.randn(2, 4, tq, 8), torch.randn(2, hkv, tk, 8), torch.randn(2, hkv, tk, 8)
    out = tiled_attention(q, k, v, is_causal=True, enable_gqa=gqa, block_q=4, block_k=3)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    torch.testing.assert_close(out, sdpa, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_within_tolerance_of_float32(dtype):
    q, k = torch.randn(2, 4, 21, 16, dtype=dtype), torch.randn(2, 2, 19, 16, dtype=dtype)
    v, bias = torch.randn(2, 2, 19, 16, dtype=dtype), torch.randn(1, 4, 21, 19, dtype=dtype)
    leaves = [t.requires_grad_() for t in (q, k, v, bias)]
    kw = dict(is_causal=True, scale=0.25, enable_gqa=True, score_mod=softcap)
    out = tiled_attention(q, k, v, attn_mask=bias, block_q=8, block_k=5, **kw)
    assert out.dtype == dtype
    wide = [t.detach().float().requires_grad_() for t in leaves]
    ref = reference_attention(*wide[:3], attn_mask=wide[3], **kw)
    g = torch.randn_like(ref)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    got = torch.autograd.grad(out, leaves, g.to(dtype))
    want = torch.autograd.grad(ref, wide, g)
    for a, b in zip(got, want):
        assert a.dtype == dtype
        torch.testing.assert_close(a.float(), b, atol=5e-2, rtol=5e-2)


def test_gradcheck_float64():
    kw = dict(is_causal=True, window=3, scale=0.6, enable_gqa=True, score_mod=alibi, block_q=2, block_k=3)
    inputs = (torch.randn(1, 2, 5, 3, dtype=torch.float64, requires_grad=True),
              torch.randn(1, 1, 6, 3, dtype=torch.float64, requires_grad=True),
              torch.randn(1, 1, 6, 2, dtype=torch.float64, requires_grad=True),
              torch.randn(2, 1, 6, dtype=torch.float64, requires_grad=True))
    assert torch.autograd.gradcheck(lambda q, k, v, m: tiled_attention(q, k, v, attn_mask=m, **kw), inputs)


def test_fully_masked_rows_are_zero_with_zero_gradients():
    q, k, v = (torch.randn(1, 2, 6, 4, requires_grad=True) for _ in range(3))
    keep = torch.rand(1, 2, 6, 6) > 0.4
    keep[0, 0, 1] = False
    keep[0, 1, 4] = False
    out = tiled_attention(q, k, v, attn_mask=keep, block_q=4, block_k=4)
    assert torch.equal(out[0, 0, 1], torch.zeros(4)) and torch.equal(out[0, 1, 4], torch.zeros(4))
    out.sum().backward()
    assert torch.equal(q.grad[0, 0, 1], torch.zeros(4)) and torch.equal(q.grad[0, 1, 4], torch.zeros(4))
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    # a window that leaves late queries no key (Tq > Tk) kills whole rows too
    out = tiled_attention(q, k[:, :, :2], v[:, :, :2], window=2, block_q=2, block_k=2)
    assert torch.equal(out[:, :, 3:], torch.zeros(1, 2, 3, 4)) and out[:, :, :3].abs().sum() > 0


@pytest.mark.parametrize("tq, tk, causal, window, bq, bk", [
    (16, 16, True, None, 4, 4), (16, 16, True, 5, 4, 4), (13, 16, True, 3, 3, 5), (16, 7, False, 3, 4, 2),
    (10, 10, False, None, 3, 4),
])
def test_masked_blocks_are_skipped_forward_and_backward(tq, tk, causal, window, bq, bk):
    q = torch.randn(1, 1, tq, 4, requires_grad=True)
    k, v = torch.randn(1, 1, tk, 4), torch.randn(1, 1, tk, 4)
    keep = keep_mask(tq, tk, causal, window)
    visible = sum(bool(keep[i:i + bq, j:j + bk].any()) for i in range(0, tq, bq) for j in range(0, tk, bk))
    with count_blocks() as n:
        out = tiled_attention(q, k, v, is_causal=causal, window=window, block_q=bq, block_k=bk)
        assert n["forward"] == visible and n["backward"] == 0
        out.sum().backward()
    assert n["backward"] == visible
    with count_blocks() as after:
        pass
    assert after["forward"] == 0  # counting stops with the with block


def test_memory_grows_with_blocks_not_with_the_score_matrix():
    t, block = 1024, 64
    q, k, v = (torch.randn(1, 1, t, 4, requires_grad=True) for _ in range(3))
    bias = torch.randn(1, 1, 1, t, requires_grad=True)  # broadcast: sliced per block, never expanded
    keep = torch.ones(1, 1, t, t, dtype=torch.bool)  # full size: sliced per block, never copied

    def fwd_bwd(q, k, v):
        with torch.enable_grad():
            out = tiled_attention(q, k, v, attn_mask=bias, is_causal=True, block_q=block, block_k=block)
            out.sum().backward()
            return tiled_attention(q, k, v, attn_mask=keep, is_causal=True, block_q=block, block_k=block)

    one_score_matrix = t * t * 4  # what the plain computation allocates several times over
    assert peak_memory(fwd_bwd, q, k, v, warmup=0) < one_score_matrix / 8


def test_candidates_registered_and_refuse_dropout():
    names = {"tiled64", "tiled128", "tiled256"}
    assert names <= set(candidate_names())
    plain = AttentionSpec(scale=0.5, causal="top_left")
    for name in names:
        cand = get_candidate(name)
        assert cand.supports(plain) is None
        assert cand.supports(AttentionSpec(scale=0.5, mask="additive", gqa=True, score_mod="tanh soft-cap")) is None
        for mode in ("on", "module"):
            assert cand.supports(AttentionSpec(scale=0.5, dropout_p=0.1, dropout_mode=mode)) == \
                "the tiled kernel has no dropout"
    q, k, v = torch.randn(1, 4, 150, 8), torch.randn(1, 2, 150, 8), torch.randn(1, 2, 150, 8)
    kw = dict(attn_mask=None, dropout_p=0.0, is_causal=True, scale=0.3, enable_gqa=True)
    ref = reference_attention(q, k, v, **kw)
    with count_blocks() as n:
        torch.testing.assert_close(get_candidate("tiled128")(q, k, v, **kw), ref, atol=1e-5, rtol=1e-5)
    assert n["forward"] == 3  # 128-row blocks: (0,0), (1,0), (1,1)
    torch.testing.assert_close(get_candidate("tiled64")(q, k, v, score_mod=softcap, **kw),
                               reference_attention(q, k, v, score_mod=softcap, **kw), atol=1e-5, rtol=1e-5)


def test_optimize_with_tiled_candidate_matches_the_block():
    cfg = GPTConfig(block_size=32, vocab_size=64, n_layer=1, n_head=4, n_embd=32, dropout=0.0)
    model = CausalSelfAttention(cfg).eval()
    x = torch.randn(2, 19, cfg.n_embd, requires_grad=True)
    opt = attnopt.optimize(model, variant="tiled64")
    with count_blocks() as n:
        opt(x)  # the first call of a shape key also checks the kernel against the reference
    assert n["forward"] == 2 and n["backward"] == 1
    with count_blocks() as n:
        out = opt(x)
    ref = model(x)
    assert n["forward"] == 1  # the kernel ran (no fallback): one 64x64 block covers T=19
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert [r.rewrite for r in attnopt.explain(opt).records] == ["tiled64"]
    (gx,) = torch.autograd.grad(out.square().sum(), x)
    (rx,) = torch.autograd.grad(ref.square().sum(), x)
    torch.testing.assert_close(gx, rx, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kwargs, match", [
    (dict(dropout_p=0.1), "no dropout"),
    (dict(k=torch.randn(1, 3, 5, 4), v=torch.randn(1, 3, 5, 4)), "pass enable_gqa=True"),
    (dict(k=torch.randn(1, 4, 5, 4), v=torch.randn(1, 4, 5, 4), enable_gqa=True), "Hkv must divide H"),
    (dict(q=torch.randn(6, 5, 4)), "4-D"),
    (dict(v=torch.randn(1, 6, 5, 4, dtype=torch.float64)), "share one floating dtype"),
    (dict(attn_mask=torch.zeros(2, 6, 5, 5)), "does not broadcast"),
    (dict(attn_mask=torch.zeros(5, 5, dtype=torch.int64)), "bool .* or floating"),
    (dict(block_q=0), "block_q must be a positive int"),
    (dict(window=0), "window must be None or a positive int"),
    (dict(score_mod=lambda s, b, h, i, j: s.sum(-1)), "score_mod must return a tensor shaped like"),
])
def test_bad_input_raises_clear_errors(kwargs, match):
    args = dict(q=torch.randn(1, 6, 5, 4), k=torch.randn(1, 6, 5, 4), v=torch.randn(1, 6, 5, 4)) | kwargs
    with pytest.raises(ValueError, match=match):
        tiled_attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def test_score_mod_reading_a_grad_requiring_tensor_is_refused():
    slope = torch.tensor(0.5, requires_grad=True)
    q = torch.randn(1, 1, 4, 4, requires_grad=True)
    with pytest.raises(ValueError, match="requires grad"):
        tiled_attention(q, q, q, score_mod=lambda s, b, h, i, j: s + slope * (j - i))
    with torch.no_grad():  # no gradient asked for: nothing is lost
        out = tiled_attention(q, q, q, score_mod=lambda s, b, h, i, j: s + slope * (j - i))
    with torch.no_grad():
        ref = reference_attention(q, q, q, score_mod=lambda s, b, h, i, j: s + slope * (j - i))
    torch.testing.assert_close(out, ref)
