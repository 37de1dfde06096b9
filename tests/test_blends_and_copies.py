"""Spellings read since the second coverage round: 0/1 keep factors, identity modifiers, dead copies, learned
per-head logit scales before a bias (issue 14 items 4, 10 and 14)."""

from __future__ import annotations

import pytest
import torch
import transformers  # part of the dev extra
from support import Fn

import attnopt

T, D, H = 8, 8, 4


def _tril(t: int = T) -> torch.Tensor:
    return torch.tril(torch.ones(t, t)).view(1, 1, t, t)


BLENDS = {
    "w*b + c*(1-b)": lambda w, b: w * b + -1e4 * (1 - b),
    "b*w + (1-b)*c": lambda w, b: b * w + (1 - b) * -1e4,
    "c*(1-b) + w*b": lambda w, b: -1e9 * (1.0 - b) + w * b,
}


def _blend_body(blend):
    def body(self, q, k, v):
        w = q @ k.transpose(-2, -1) / D ** 0.5
        b = self.bias[:, :, : w.size(-2), : w.size(-1)]  # OpenAI-GPT crops its buffer
        return torch.softmax(blend(w, b), dim=-1) @ v
    return body


def _qkv(b: int = 2, t: int = T, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [torch.randn(b, H, t, D, dtype=dtype) for _ in range(3)]


def _same_outputs_and_grads(opt, model, inputs, atol=1e-5, rtol=1e-4) -> None:
    a = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
    e = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out, ref = opt(*a), model(*e)
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    cot = torch.randn_like(ref)
    fa, fe = [x for x in a if x.requires_grad], [x for x in e if x.requires_grad]
    for ga, ge in zip(torch.autograd.grad((out * cot).sum(), fa), torch.autograd.grad((ref * cot).sum(), fe)):
        torch.testing.assert_close(ga, ge, atol=10 * atol, rtol=10 * rtol)


@pytest.mark.parametrize("name", list(BLENDS))
def test_keep_factor_blend_is_a_causal_fill(name: str) -> None:
    model = Fn(_blend_body(BLENDS[name]), buffers={"bias": _tril(16)})
    opt = attnopt.optimize(model, variant="sdpa")
    for b, t in ((2, T), (1, 5), (3, 11)):  # later calls: other batch sizes, other crops of the buffer
        _same_outputs_and_grads(opt, model, _qkv(b, t))
    report = attnopt.explain(opt)
    assert all(r.decision == "rewritten" for r in report.records), str(report)
    assert "causal" in report.records[0].spec.describe(), str(report)


def test_keep_factor_blend_in_bfloat16() -> None:
    model = Fn(_blend_body(BLENDS["w*b + c*(1-b)"]), buffers={"bias": _tril().bfloat16()})
    opt = attnopt.optimize(model, variant="sdpa")
    _same_outputs_and_grads(opt, model, _qkv(dtype=torch.bfloat16), atol=2e-2, rtol=2e-2)
    assert attnopt.explain(opt).rewritten == 1


def test_keep_factor_that_is_not_proven_zero_one_is_left_alone() -> None:
    soft = Fn(_blend_body(BLENDS["w*b + c*(1-b)"]), buffers={"bias": _tril() * 0.5 + 0.25})  # a soft gate
    opt = attnopt.optimize(soft, variant="sdpa")
    _same_outputs_and_grads(opt, soft, _qkv())
    (record,) = attnopt.explain(opt).records
    assert record.decision == "left alone" and "0 and 1" in record.reason, record.reason

    def runtime_factor(self, q, k, v, m):  # an input: any value may come
        w = q @ k.transpose(-2, -1)
        return torch.softmax(w * m + -1e4 * (1 - m), dim=-1) @ v

    model = Fn(runtime_factor)
    opt = attnopt.optimize(model, variant="sdpa")
    m = (torch.rand(2, 1, T, T) > 0.3).float()
    q, k, v = _qkv()
    torch.testing.assert_close(opt(q, k, v, m), model(q, k, v, m))
    (record,) = attnopt.explain(opt).records
    assert record.decision == "left alone" and "0 and 1" in record.reason, record.reason


def test_keep_factor_buffer_written_after_optimize() -> None:
    model = Fn(_blend_body(BLENDS["w*b + c*(1-b)"]), buffers={"bias": _tril()})
    opt = attnopt.optimize(model, variant="sdpa")
    q, k, v = _qkv()
    torch.testing.assert_close(opt(q, k, v), model(q, k, v))
    model.bias[..., 0, :] = 1.0  # still 0/1: another pattern, the mask tensor is passed
    torch.testing.assert_close(opt(q, k, v), model(q, k, v))
    model.bias.mul_(0.5)  # no longer a mask: the call says so instead of computing something else
    with pytest.raises(ValueError, match="0 and 1"):
        opt(q, k, v)


def test_openai_gpt_is_rewritten_outputs_and_grads_equal() -> None:
    cfg = transformers.OpenAIGPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32,
                                       attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, attn_implementation="eager")
    model = transformers.OpenAIGPTModel(cfg)
    ids = torch.randint(0, 64, (2, 12))
    opt = attnopt.optimize(model)
    out, ref = opt(input_ids=ids).last_hidden_state, model(input_ids=ids).last_hidden_state
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    g = torch.autograd.grad(out.square().sum(), list(model.parameters()), allow_unused=True)
    g_ref = torch.autograd.grad(ref.square().sum(), list(model.parameters()), allow_unused=True)
    for a, e in zip(g, g_ref):
        if e is not None:
            torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-3)
    report = attnopt.explain(opt)
    assert report.rewritten == 2 and len(report.records) == 2, str(report)


IDENTITY = {
    "s + 0": lambda s: s + 0,
    "0.0 + s": lambda s: 0.0 + s,
    "s - 0": lambda s: s - 0.0,
}


@pytest.mark.parametrize("name", list(IDENTITY))
def test_identity_steps_are_no_score_modifier(name: str) -> None:
    def body(self, q, k, v, mask):
        s = IDENTITY[name](q @ k.transpose(-2, -1) * D ** -0.5)
        return torch.softmax(s + mask, dim=-1) @ v

    model = Fn(body)
    opt = attnopt.optimize(model, variant="sdpa")  # a score modifier would make SDPA refuse the site
    q, k, v = _qkv()
    mask = torch.randn(2, 1, T, T)
    _same_outputs_and_grads(opt, model, [q, k, v, mask])
    (record,) = attnopt.explain(opt).records
    assert record.decision == "rewritten" and "score_mod" not in record.reason, record.reason


def _kept_copies(self, q, k, v):
    sim = torch.einsum("b h i d, b h j d -> b h i j", q, k) * D ** -0.5
    qk = sim.clone()  # x-transformers keeps these for its intermediates; the caller drops them
    also = sim.detach().float()
    del qk, also
    return sim.softmax(dim=-1) @ v


def test_dead_copies_of_the_scores_do_not_block_the_site() -> None:
    model = Fn(_kept_copies)
    opt = attnopt.optimize(model, variant="sdpa")
    _same_outputs_and_grads(opt, model, _qkv())
    assert attnopt.explain(opt).rewritten == 1, str(attnopt.explain(opt))


def test_copies_that_are_used_or_written_still_block_the_site() -> None:
    def returned(self, q, k, v):
        sim = q @ k.transpose(-2, -1)
        return sim.softmax(dim=-1) @ v, sim.clone()

    def written(self, q, k, v):
        sim = q @ k.transpose(-2, -1)
        c = sim.clone()
        c.mul_(2.0)  # an in-place write has no users either: not a dead copy
        return sim.softmax(dim=-1) @ v + c.sum()

    for body in (returned, written):
        model = Fn(body)
        opt = attnopt.optimize(model, variant="sdpa")
        q, k, v = _qkv()
        out, ref = opt(q, k, v), model(q, k, v)
        for a, e in zip(out if isinstance(out, tuple) else (out,), ref if isinstance(ref, tuple) else (ref,)):
            torch.testing.assert_close(a, e)
        (record,) = attnopt.explain(opt).records
        assert record.decision == "left alone" and "clone" in record.reason, record.reason


def test_swinv2_cosine_attention_with_a_clamped_logit_scale() -> None:
    cfg = transformers.Swinv2Config(image_size=32, patch_size=4, embed_dim=16, depths=[2], num_heads=[2],
                                    window_size=4, drop_path_rate=0.0, attn_implementation="eager")
    model = transformers.Swinv2Model(cfg).double()  # float64: its float32 gradients are noise-bound even as written
    x = torch.randn(1, 3, 32, 32, dtype=torch.float64)
    opt = attnopt.optimize(model)
    out, ref = opt(pixel_values=x).last_hidden_state, model(pixel_values=x).last_hidden_state
    torch.testing.assert_close(out, ref, atol=1e-9, rtol=1e-7)
    g = torch.autograd.grad(out.square().sum(), list(model.parameters()), allow_unused=True)
    g_ref = torch.autograd.grad(ref.square().sum(), list(model.parameters()), allow_unused=True)
    for a, e in zip(g, g_ref):
        if e is not None:
            torch.testing.assert_close(a, e, atol=1e-9, rtol=1e-7)
    report = attnopt.explain(opt)
    assert report.rewritten == 2 and len(report.records) == 2, str(report)


def _zeroed_again(self, q, k, v, pad):
    """FastSpeech2-Conformer / CPM-Ant: the probabilities zeroed where the scores were masked."""
    hidden = pad.unsqueeze(1).eq(0)  # (B, 1, 1 or T, T), True = hidden
    s = (q @ k.transpose(-2, -1) / D ** 0.5).masked_fill(hidden, torch.finfo(q.dtype).min)
    p = torch.softmax(s, dim=-1).masked_fill(hidden, 0.0)
    return p @ v


def _zeroed_rebuilt(self, q, k, v, pad):
    """The condition written twice (CPM-Ant): the same expression of the same tensor."""
    s = torch.masked_fill(q @ k.transpose(-2, -1), pad.view(pad.size(0), 1, -1, pad.size(-1)) == torch.tensor(False),
                          torch.scalar_tensor(float("-inf")))
    p = torch.masked_fill(torch.softmax(s, dim=-1), pad.view(pad.size(0), 1, -1, pad.size(-1)) == torch.tensor(False),
                          torch.scalar_tensor(0.0))
    return p @ v


@pytest.mark.parametrize("body", [_zeroed_again, _zeroed_rebuilt], ids=["same-node", "rebuilt"])
def test_probabilities_zeroed_where_the_scores_were_masked(body) -> None:
    model = Fn(body)
    opt = attnopt.optimize(model, variant="sdpa")
    for b, t in ((2, T), (3, 6)):
        q, k, v = _qkv(b, t)
        rebuilt = body is _zeroed_rebuilt
        pad = torch.ones(b, t, t, dtype=torch.bool) if rebuilt else torch.ones(b, 1, t, dtype=torch.long)
        pad[-1, ..., : t // 2] = 0  # keys hidden; with the rebuilt 3-D mask some rows lose every key
        if rebuilt:
            pad[0, 1] = False
        _same_outputs_and_grads(opt, model, [q, k, v, pad])
    (record,) = {r.name: r for r in attnopt.explain(opt).records}.values()
    assert record.decision == "rewritten" and "every key hidden are zero" in record.spec.describe(), record.reason


@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["bias-added", "bias-subtracted"])
def test_rows_zeroed_whole_next_to_a_bias_keep_every_gradient(sign: float) -> None:
    """``softmax(s.masked_fill(m, -inf) + b).masked_fill(m, 0) @ v`` with a row of ``m`` all True: that row's
    probabilities are NaN before the zeroing and 0 after, so as written v's gradient is finite and the bias's is
    NaN in that row only. The rows the site computes as written zero their probabilities too."""
    def body(self, q, k, v, b, m):
        s = (q @ k.transpose(-2, -1) * 0.3).masked_fill(m, float("-inf")) + sign * b
        return s.softmax(-1).masked_fill(m, 0.0) @ v

    model = Fn(body)
    opt = attnopt.optimize(model, variant="sdpa")
    for b, t in ((2, T), (1, 5)):
        q, k, v = _qkv(b, t)
        m = torch.rand(b, 1, t, t) < 0.3
        m[0, 0, 1] = True  # query 1 sees no key
        inputs = [q, k, v, torch.randn(t, t), m]
        a = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
        e = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
        out, ref = opt(*a), model(*e)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
        cot = torch.randn_like(ref)
        got = torch.autograd.grad((out * cot).sum(), a[:4])
        want = torch.autograd.grad((ref * cot).sum(), e[:4])
        assert not any(g.isnan().any() for g in want[:3])  # q, k, v: finite as written
        assert want[3][1].isnan().all() and not want[3][0].isnan().any()  # the bias: NaN in the hidden row only
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-3, equal_nan=True)
    records = attnopt.explain(opt).records  # (a graph per shape)
    assert records and all(r.decision == "rewritten" and "every key hidden are zero" in r.spec.describe()
                           for r in records), str(attnopt.explain(opt))


@pytest.mark.parametrize("variant, twice", [("math", False), ("sdpa", True), ("sdpa", False)],
                         ids=["math", "sdpa-double-backward", "sdpa"])
def test_rows_zeroed_whole_under_a_bool_mask_keep_v_s_gradient(variant: str, twice: bool) -> None:
    """``softmax(s.masked_fill(m, -inf)).masked_fill(m, 0) @ v`` (a bool mask) with a row of ``m`` all True: as
    written v's gradient is finite; a candidate that computed that row's NaN probabilities gave NaN for all of v
    (``NaN^T @ 0``), in the reference computation and under double backward."""
    def body(self, q, k, v, m):
        s = (q @ k.transpose(-2, -1) * 0.5).masked_fill(m, float("-inf"))
        return s.softmax(-1).masked_fill(m, 0.0) @ v

    model = Fn(body)
    opt = attnopt.optimize(model, variant=variant)
    q, k, v = (t.double() for t in _qkv(2, 5))
    m = torch.rand(2, 1, 5, 5) < 0.3
    m[..., 2, :] = True  # query 2 sees no key, in every batch entry
    a = [x.clone().requires_grad_(x.is_floating_point()) for x in (q, k, v)]
    e = [x.clone().requires_grad_(x.is_floating_point()) for x in (q, k, v)]
    out, ref = opt(*a, m), model(*e, m)
    torch.testing.assert_close(out, ref)
    cot = torch.randn_like(ref)
    got = torch.autograd.grad((out * cot).sum(), a, create_graph=twice)
    want = torch.autograd.grad((ref * cot).sum(), e, create_graph=twice)
    assert not any(w.isnan().any() for w in want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    if twice:  # second order: the gradient of v's gradient with respect to q
        torch.testing.assert_close(torch.autograd.grad(got[2].sum(), a[0], allow_unused=True)[0],
                                   torch.autograd.grad(want[2].sum(), e[0], allow_unused=True)[0])
    (record,) = attnopt.explain(opt).records
    assert record.decision == "rewritten" and "bool mask" in record.spec.describe(), record.reason


def test_probabilities_zeroed_elsewhere_are_left_alone() -> None:
    def other_mask(self, q, k, v, pad, drop):
        s = (q @ k.transpose(-2, -1)).masked_fill(pad, float("-inf"))
        return torch.softmax(s, dim=-1).masked_fill(drop, 0.0) @ v

    model = Fn(other_mask)
    opt = attnopt.optimize(model, variant="sdpa")
    q, k, v = _qkv()
    pad, drop = torch.zeros(2, 1, T, T, dtype=torch.bool), torch.rand(2, 1, T, T) > 0.7
    torch.testing.assert_close(opt(q, k, v, pad, drop), model(q, k, v, pad, drop))
    (record,) = attnopt.explain(opt).records
    assert record.decision == "left alone" and "zeroed" in record.reason, record.reason


def test_keep_factor_from_a_call_input_or_after_a_mask_is_left_alone() -> None:
    def from_input(self, q, k, v, m):  # 0/1 on the first call, soft on the next: no proof to carry over
        return torch.softmax((q @ k.transpose(-2, -1)) * m + -1e9 * (1 - m), dim=-1) @ v

    def after_pad(self, q, k, v, pad):  # -inf * 0 is NaN as written where the factor is 0
        w = q @ k.transpose(-2, -1) / D ** 0.5 + pad
        b = self.bias[:, :, : w.size(-2), : w.size(-1)]
        return torch.softmax(w * b + torch.finfo(torch.float32).min * (1 - b), dim=-1) @ v

    q, k, v = _qkv()
    tril = _tril()
    pad = torch.zeros(2, 1, 1, T)
    pad[-1, ..., : T // 2] = float("-inf")
    for model, calls, words in ((Fn(from_input), [(tril,), (tril * 0.5 + 0.25,)], "0 and 1"),
                                (Fn(after_pad, buffers={"bias": _tril()}), [(pad,)], "after another mask")):
        opt = attnopt.optimize(model, variant="sdpa")
        for extra in calls:
            torch.testing.assert_close(opt(q, k, v, *extra), model(q, k, v, *extra), equal_nan=True)
        (record,) = attnopt.explain(opt).records
        assert record.decision == "left alone" and words in record.reason, record.reason
