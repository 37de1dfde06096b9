"""Attention sinks (issue 14 item 8): a logit column concatenated to the scores and dropped after the softmax,
rewritten as one more key with a zero value; outputs and gradients (the sink's too) equal."""

from __future__ import annotations

import pytest
import torch
import transformers  # part of the dev extra
from support import Fn

import attnopt
from attnopt.runtime.sinks import sink_operands

B, H, HKV, T, D = 2, 4, 2, 8, 16
MIN = torch.finfo(torch.float32).min


def _gpt_oss(self, q, k, v, mask):
    """gpt-oss: a learned per-head sink after the mask, the row maximum subtracted, the sink's column dropped."""
    k, v = (t.repeat_interleave(H // HKV, dim=1) for t in (k, v))
    w = q @ k.transpose(2, 3) * D ** -0.5
    if mask is not None:
        w = w + mask
    sinks = self.sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
    c = torch.cat([w, sinks], dim=-1)
    c = c - c.max(dim=-1, keepdim=True).values
    p = torch.softmax(c, dim=-1, dtype=c.dtype)[..., :-1]
    return p.to(v.dtype) @ v


def _first_column(self, q, k, v, mask):
    """x-transformers: the sink first, a causal masked_fill with -finfo.max, no shift, a per-row sink."""
    sim = torch.einsum("b h i d, b h j d -> b h i j", q, k) * D ** -0.5
    i, j = sim.shape[-2:]
    causal = torch.ones((i, j), dtype=torch.bool, device=q.device).triu(j - i + 1)
    sim = sim.masked_fill(causal, -torch.finfo(sim.dtype).max)
    sink = (q * self.w).sum(-1, keepdim=True)  # a sink that depends on the query
    sim = torch.cat((sink, sim), dim=-1)
    attn = sim.softmax(dim=-1)[..., 1:]
    return torch.einsum("b h i j, b h j d -> b h i d", attn, v)


def _inputs(kind: str, b: int = B, t: int = T, dtype: torch.dtype = torch.float32):
    q = torch.randn(b, H, t, D, dtype=dtype)
    hk = HKV if kind == "gpt_oss" else H
    k, v = torch.randn(b, hk, t, D, dtype=dtype), torch.randn(b, hk, t, D, dtype=dtype)
    mask = torch.zeros(b, 1, t, t, dtype=dtype).masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), -torch.inf)
    mask[-1, ..., : t // 2] = torch.finfo(dtype).min  # left padding: early rows have every key hidden
    return q, k, v, mask


def _model(kind: str, dtype: torch.dtype = torch.float32) -> Fn:
    if kind == "gpt_oss":
        return Fn(_gpt_oss, sinks=torch.randn(H, dtype=dtype)).to(dtype)
    return Fn(_first_column, w=torch.randn(D, dtype=dtype) / D).to(dtype)


def _check(opt, model, inputs, atol, rtol) -> None:
    a = [x if x is None else x.clone().requires_grad_(i < 3) for i, x in enumerate(inputs)]
    e = [x if x is None else x.clone().requires_grad_(i < 3) for i, x in enumerate(inputs)]
    out, ref = opt(*a), model(*e)
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    cot = torch.randn_like(ref)
    params = list(model.parameters())
    ga = torch.autograd.grad((out * cot).sum(), a[:3] + params)
    ge = torch.autograd.grad((ref * cot).sum(), e[:3] + params)
    for x, y in zip(ga, ge):
        torch.testing.assert_close(x, y, atol=10 * atol, rtol=10 * rtol)


@pytest.mark.parametrize("kind", ["gpt_oss", "first_column"])
def test_sink_is_one_more_key_at_every_shape(kind: str) -> None:
    model = _model(kind)
    opt = attnopt.optimize(model, variant="sdpa")
    for b, t in ((B, T), (1, 5), (3, 11)):
        inputs = _inputs(kind, b, t)
        if kind == "first_column":
            inputs = inputs[:3] + (None,)
        _check(opt, model, inputs, atol=1e-5, rtol=1e-4)
    report = attnopt.explain(opt)
    assert report.rewritten == len(report.records) >= 2, str(report)
    assert all("attention sink" in r.spec.describe() for r in report.records), str(report)


def test_sink_without_a_mask_and_in_bfloat16() -> None:
    model = _model("gpt_oss")
    opt = attnopt.optimize(model, variant="sdpa")
    q, k, v, _ = _inputs("gpt_oss")
    _check(opt, model, (q, k, v, None), atol=1e-5, rtol=1e-4)
    model16 = _model("gpt_oss", torch.bfloat16)
    opt16 = attnopt.optimize(model16, variant="sdpa")  # scale 1/4: a power of two, the sink's column is exact
    _check(opt16, model16, _inputs("gpt_oss", dtype=torch.bfloat16), atol=2e-2, rtol=2e-2)
    assert attnopt.explain(opt16).rewritten == 1


def test_sinks_that_cannot_be_one_more_key_are_left_alone() -> None:
    def soft_capped(self, q, k, v):
        w = 30.0 * torch.tanh(q @ k.transpose(-2, -1) / 30.0)
        c = torch.cat([w, self.sinks.reshape(1, -1, 1, 1).expand(q.size(0), -1, q.size(2), 1)], -1)
        return torch.softmax(c, -1)[..., :-1] @ v

    def sliced_only(self, q, k, v):  # a column dropped that no sink added
        return torch.softmax(q @ k.transpose(-2, -1), -1)[..., :-1] @ v[..., :-1, :]

    def odd_scale_half(self, q, k, v):
        w = q @ k.transpose(-2, -1) / 3.0
        c = torch.cat([w, self.sinks.reshape(1, -1, 1, 1).expand(q.size(0), -1, q.size(2), 1)], -1)
        return torch.softmax(c, -1)[..., :-1] @ v

    def grouped_5d(self, q, k, v):  # heads as (Hkv, G): the site folds the leading axes, the sink would not follow
        b, h, t, d = q.shape
        q, k, v = q.view(b, 2, h // 2, t, d), k[:, :2, None].expand(b, 2, h // 2, t, d), v[:, :2, None].expand(
            b, 2, h // 2, t, d)
        w = q @ k.transpose(-2, -1)
        c = torch.cat([w, self.sinks.view(1, 2, h // 2, 1, 1).expand(b, 2, h // 2, t, 1)], -1)
        return (torch.softmax(c, -1)[..., :-1] @ v).reshape(b, h, t, d)

    cases = {soft_capped: ("score modifier", torch.float32), sliced_only: ("sink", torch.float32),
             odd_scale_half: ("power of two", torch.bfloat16), grouped_5d: ("more than 4 dims", torch.float32)}
    for body, (words, dtype) in cases.items():
        model = Fn(body, sinks=torch.randn(H)).to(dtype)
        opt = attnopt.optimize(model)
        q, k, v = (torch.randn(B, H, T, D, dtype=dtype) for _ in range(3))
        torch.testing.assert_close(opt(q, k, v), model(q, k, v))
        (record,) = attnopt.explain(opt).records
        assert record.decision == "left alone" and words in record.reason, (body.__name__, record.reason)


def test_sink_helpers_widen_to_a_multiple_of_eight() -> None:
    q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 6)
    qa, ka, va, keep = sink_operands(q, k, v, torch.randn(1, 2, 3, 1), 0.25, causal=True)
    assert qa.shape == (1, 2, 3, 16) and ka.shape == (1, 2, 6, 16) and va.shape == (1, 2, 6, 6)
    assert bool((va[..., -1, :] == 0).all()) and bool((ka[..., :-1, 8:] == 0).all())
    assert keep.shape == (3, 6) and bool(keep[:, -1].all()) and not bool(keep[0, 1])
    assert sink_operands(q, k, v, torch.randn(1, 2, 3, 1), 0.25)[3] is None
    padded = sink_operands(q, k, v, torch.randn(1, 2, 3, 1), 0.25, torch.zeros(1, 1, 1, 5))[3]
    assert padded.shape == (1, 1, 1, 6) and padded.dtype != torch.bool


class _Sinks(torch.nn.Module):
    def __init__(self, sinks: torch.Tensor):
        super().__init__()
        self.sinks = torch.nn.Parameter(sinks)

    def forward(self, q, k, v, mask=None):
        w = q @ k.transpose(-2, -1) * 0.25
        if mask is not None:
            w = w + mask
        c = torch.cat([w, self.sinks.reshape(1, -1, 1, 1).expand(q.size(0), -1, q.size(2), 1)], dim=-1)
        return torch.softmax(c, dim=-1)[..., :-1] @ v


@pytest.mark.parametrize("value", [float("-inf"), torch.finfo(torch.float32).min, -1e30])
def test_sinks_that_hide_their_key_stay_finite(value: float) -> None:
    """A sink of -inf, or one whose quotient by the scale overflows, has weight 0: not a NaN row."""
    model = _Sinks(torch.tensor([value, 0.5]))
    opt = attnopt.optimize(model, variant="sdpa")
    q, k, v = (torch.randn(2, 2, 4, 16) for _ in range(3))
    mask = torch.zeros(2, 1, 4, 4)
    mask[1, ..., :2, :] = torch.finfo(torch.float32).min  # rows with every real key hidden too
    for m in (None, mask):
        out, ref = opt(q, k, v, m), model(q, k, v, m)
        assert not out.isnan().any()
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    report = attnopt.explain(opt)
    assert report.records and all(r.rewritten for r in report.records), str(report)


def test_sink_of_another_dtype_or_written_after_the_cat_is_left_alone() -> None:
    class Wider(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.sinks = torch.nn.Parameter(torch.tensor([64.24]))

        def forward(self, q, k, v):
            w = (q @ k.transpose(-2, -1)).float() * 0.25  # fp32 scores and sink, bf16 q and k
            c = torch.cat([w, self.sinks.reshape(1, -1, 1, 1).expand(q.size(0), -1, q.size(2), 1)], dim=-1)
            return torch.softmax(c, dim=-1)[..., :-1].to(v.dtype) @ v

    class Written(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(16))

        def forward(self, q, k, v):
            sink = (q * self.w).sum(-1, keepdim=True)
            c = torch.cat([q @ k.transpose(-2, -1) * 0.25, sink], dim=-1)
            sink.zero_()  # after the concatenation read it
            return torch.softmax(c, dim=-1)[..., :-1] @ v

    for model, dtype, words in ((Wider(), torch.bfloat16, "rounded"), (Written(), torch.float32, "sink")):
        opt = attnopt.optimize(model, variant="sdpa")
        q, k, v = (torch.randn(1, 1, 3, 16, dtype=dtype) for _ in range(3))
        with torch.no_grad():
            torch.testing.assert_close(opt(q, k, v), model(q, k, v))
        (record,) = attnopt.explain(opt).records
        assert record.decision == "left alone" and words in record.reason, record.reason


def test_hf_gpt_oss_with_and_without_padding() -> None:
    cfg = transformers.GptOssConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=32, vocab_size=64, num_local_experts=2, num_experts_per_tok=1, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], pad_token_id=0, bos_token_id=0, eos_token_id=0,
        attn_implementation="eager")
    model = transformers.GptOssForCausalLM(cfg).eval()
    ids = torch.randint(1, 64, (2, 10))
    pad = torch.ones(2, 10, dtype=torch.long)
    pad[1, :3] = 0
    opt = attnopt.optimize(model)
    for kw in (dict(input_ids=ids), dict(input_ids=ids, attention_mask=pad)):
        out, ref = opt(**kw).logits, model(**kw).logits
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
        params = [p for p in model.parameters() if p.requires_grad]
        ga = torch.autograd.grad(out.square().sum(), params, allow_unused=True)
        ge = torch.autograd.grad(ref.square().sum(), params, allow_unused=True)
        for x, y in zip(ga, ge):
            if y is not None:
                torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-3)
    records = [r for r in attnopt.explain(opt).records if "self_attn" in r.module_path]
    assert records and any(r.rewritten for r in records), str(attnopt.explain(opt))
    assert all("attention sink" in r.spec.describe() for r in records if r.rewritten)
