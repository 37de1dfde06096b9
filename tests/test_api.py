"""End-to-end tests of the public API: optimize, rewrite, explain, the backend, errors, safety."""

from __future__ import annotations

import copy
import logging
import math
import operator
import warnings

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from support import capture

import attnopt
from attnopt.models import CausalSelfAttention, GPTConfig, NanoGPT
from attnopt.runtime.site import AttentionSite

CFG = GPTConfig(block_size=32, vocab_size=64, n_layer=2, n_head=4, n_embd=32, dropout=0.0)


def _sites(gm: fx.GraphModule) -> list[AttentionSite]:
    return [m for m in gm.modules() if isinstance(m, AttentionSite)]


def test_optimize_nanogpt_outputs_and_grads_match():
    model = NanoGPT(CFG).eval()
    idx = torch.randint(0, CFG.vocab_size, (2, 24))
    opt = attnopt.optimize(model)
    ref = model(idx)
    out = opt(idx)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    report = attnopt.explain(opt)
    assert report.rewritten == CFG.n_layer
    assert all(r.spec is not None and r.spec.causal == "top_left" for r in report.records)
    g_ref = torch.autograd.grad(ref.square().sum(), list(model.parameters()))
    g_out = torch.autograd.grad(out.square().sum(), list(model.parameters()))
    for a, b in zip(g_out, g_ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_new_shapes_recapture_with_symbolic_sizes():
    model = NanoGPT(CFG).eval()
    opt = attnopt.optimize(model)
    for b, t in [(2, 16), (3, 9), (1, 31), (2, 1)]:
        idx = torch.randint(0, CFG.vocab_size, (b, t))
        torch.testing.assert_close(opt(idx), model(idx), atol=1e-5, rtol=1e-5)
    report = attnopt.explain(opt)
    assert report.graphs >= 2  # dynamo recaptured with symbolic sizes
    assert report.rewritten == CFG.n_layer * report.graphs


def test_variant_eager_rewrites_nothing_and_explains_why():
    model = NanoGPT(CFG).eval()
    idx = torch.randint(0, CFG.vocab_size, (1, 8))
    opt = attnopt.optimize(model, variant="eager")
    torch.testing.assert_close(opt(idx), model(idx))
    report = attnopt.explain(opt)
    assert report.rewritten == 0
    assert all("variant='eager'" in r.reason for r in report.records)


def test_variant_math_candidate_forced():
    model = CausalSelfAttention(CFG).eval()
    x = torch.randn(2, 10, CFG.n_embd)
    opt = attnopt.optimize(model, variant="math")
    torch.testing.assert_close(opt(x), model(x), atol=1e-5, rtol=1e-5)
    assert [r.rewrite for r in attnopt.explain(opt).records] == ["math"]


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: attnopt.optimize(lambda x: x), "torch.nn.Module"),
        (lambda: attnopt.optimize(nn.Linear(2, 2), variant="fast"), "accepted values: 'auto', 'sdpa', 'eager'"),
        (lambda: attnopt.optimize(nn.Linear(2, 2), verify="yes"), "verify must be True or False"),
        (lambda: attnopt.rewrite(nn.Linear(2, 2)), "GraphModule"),
        (lambda: attnopt.explain(CausalSelfAttention(CFG), torch.randn(1, 4, 32), torch.randn(1)), "do not match"),
    ],
)
def test_bad_arguments_raise_clear_errors(call, match):
    with pytest.raises((TypeError, ValueError), match=match):
        call()


def test_backend_registered_by_name_through_entry_point():
    model = CausalSelfAttention(CFG).eval()
    x = torch.randn(2, 12, CFG.n_embd)
    before = attnopt.last_report().rewritten
    out = torch.compile(model, backend="attnopt")(x)
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)
    assert attnopt.last_report().rewritten == before + 1


def test_compile_true_hands_graph_to_inductor():
    model = CausalSelfAttention(CFG).eval()
    x = torch.randn(2, 12, CFG.n_embd)
    opt = attnopt.optimize(model, compile=True)
    torch.testing.assert_close(opt(x), model(x), atol=1e-5, rtol=1e-5)
    assert attnopt.explain(opt).rewritten == 1


class Traceable(nn.Module):
    """Single-head attention that symbolic_trace can follow (no Python math on sizes)."""

    def __init__(self, d: int = 8, t: int = 16):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.softmax = nn.Softmax(dim=-1)
        self.drop = nn.Dropout(0.25)
        self.register_buffer("mask", torch.tril(torch.ones(t, t, dtype=torch.bool)))
        self.scale = d**-0.5

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        s = torch.matmul(q, k.transpose(1, 2)) * self.scale
        s = s.masked_fill(~self.mask, float("-inf"))
        return self.drop(self.softmax(s)) @ v


def test_rewrite_symbolic_trace_graph_with_example_inputs():
    model = Traceable().eval()
    x = torch.randn(2, 16, 8)
    gm = fx.symbolic_trace(model)
    with pytest.raises(ValueError, match="pass example inputs"):
        attnopt.rewrite(gm)
    new = attnopt.rewrite(gm, (x,))
    assert "attnopt_site0" in new.code and "attnopt_site0" not in gm.code  # the input graph is untouched
    torch.testing.assert_close(new(x), model(x), atol=1e-5, rtol=1e-5)
    report = attnopt.explain(new)
    assert report.rewritten == 1
    spec = report.records[0].spec
    assert spec.causal == "top_left" and spec.dropout_mode == "module"
    # nn.Dropout semantics follow the GraphModule's mode: active in train(), off in eval().
    new.train()
    torch.manual_seed(0)
    assert not torch.allclose(new(x), model(x))
    new.eval()
    torch.testing.assert_close(new(x), model(x), atol=1e-5, rtol=1e-5)


def test_rewrite_export_graph():
    model = CausalSelfAttention(CFG).eval()
    x = torch.randn(2, 16, CFG.n_embd)
    gm = torch.export.export(model, (x,)).module()
    new = attnopt.rewrite(gm)
    torch.testing.assert_close(new(x), model(x), atol=1e-5, rtol=1e-5)
    report = attnopt.explain(new)
    assert report.rewritten == 1 and report.records[0].spec.causal == "top_left"


def test_rewriting_twice_changes_nothing():
    model = CausalSelfAttention(CFG).eval()
    gm, inputs = capture(model, torch.randn(2, 8, CFG.n_embd))
    once = attnopt.rewrite(gm, inputs)
    twice = attnopt.rewrite(once, inputs)
    assert attnopt.explain(twice).rewritten == 0
    assert twice.code == once.code


def test_explain_report_names_source_and_renders_table():
    model = NanoGPT(CFG).eval()
    report = attnopt.explain(model, torch.randint(0, CFG.vocab_size, (1, 8)))
    text = str(report)
    assert "2 of 2 attention site(s) rewritten" in text
    assert "h.0.attn" in text and "h.1.attn" in text
    assert all(r.source.startswith("models.py:") for r in report.records)
    d = report.to_dict()
    assert d["rewritten"] == 2 and len(d["records"]) == 2


def test_explain_logs_on_attnopt_logger(caplog):
    with caplog.at_level(logging.INFO, logger="attnopt"):
        attnopt.explain(CausalSelfAttention(CFG).eval(), torch.randn(1, 4, CFG.n_embd))
    assert any("rewritten" in rec.getMessage() for rec in caplog.records)


def test_training_mode_dropout_active_exactly_when_original():
    cfg = GPTConfig(**{**CFG.__dict__, "dropout": 0.5})
    model = CausalSelfAttention(cfg)
    x = torch.randn(2, 12, cfg.n_embd)
    opt = attnopt.optimize(model)
    model.train()
    out_train = opt(x)
    assert attnopt.explain(opt).records[0].spec.dropout_mode == "on"
    # Dropout zeroes attention weights: the output differs from the deterministic eval output.
    model.eval()
    out_eval = opt(x)
    torch.testing.assert_close(out_eval, model(x), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out_train, out_eval)
    # eval() made dynamo recapture with dropout off; that graph's site is exact.
    assert [r.spec.dropout_mode for r in attnopt.explain(opt).records] == ["on", "off"]


def test_bfloat16_within_tolerance():
    model = CausalSelfAttention(CFG).to(torch.bfloat16).eval()
    x = torch.randn(2, 16, CFG.n_embd, dtype=torch.bfloat16)
    opt = attnopt.optimize(model)
    out = opt(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), model(x).float(), atol=2e-2, rtol=2e-2)
    assert attnopt.explain(opt).rewritten == 1


def test_causal_buffer_changed_in_place_is_followed():
    model = CausalSelfAttention(CFG).eval()
    x = torch.randn(1, 8, CFG.n_embd)
    opt = attnopt.optimize(model)
    opt(x)
    with torch.no_grad():
        model.bias.fill_(1.0)  # no longer causal: every key visible
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = opt(x)
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)
    assert any("no longer holds the proven causal pattern" in str(m.message) for m in w)


class Padded(nn.Module):
    """Encoder-style attention with a key padding mask filled with ``fill``."""

    def __init__(self, fill: float):
        super().__init__()
        self.fill = fill

    def forward(self, q, k, v, keep):
        s = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
        s = s.masked_fill(~keep, self.fill)
        return F.softmax(s, dim=-1) @ v


@pytest.mark.parametrize("fill", [float("-inf"), torch.finfo(torch.float32).min])
def test_fully_masked_rows_policy(fill):
    """-inf: NaN rows as written (SDPA alone would give zeros); dtype min: uniform average."""
    q, k, v = (torch.randn(2, 2, 5, 4) for _ in range(3))
    keep = torch.rand(2, 1, 5, 5) > 0.3
    keep[0, 0, 2] = False  # query 2 of batch 0 sees no key
    keep[:, :, :, 0] |= torch.arange(5).view(1, 5) != 2  # every other row keeps a key
    model = Padded(fill)
    opt = attnopt.optimize(model)
    ref, out = model(q, k, v, keep), opt(q, k, v, keep)
    assert attnopt.explain(opt).rewritten == 1
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5, equal_nan=True)
    if fill == float("-inf"):
        assert torch.isnan(out[0, :, 2]).all() and not torch.isnan(out[1]).any()
    else:
        torch.testing.assert_close(out[0, :, 2], v[0].mean(-2), atol=1e-5, rtol=1e-5)


def test_verify_keeps_exact_rewrites_and_drops_wrong_ones(monkeypatch):
    model = CausalSelfAttention(CFG).eval()
    x = torch.randn(2, 8, CFG.n_embd)
    opt = attnopt.optimize(model, verify=True)
    torch.testing.assert_close(opt(x), model(x), atol=1e-5, rtol=1e-5)
    assert attnopt.explain(opt).records[0].extra.get("verified") is True

    # A candidate that is wrong must be caught by verify and dropped with a warning.
    from attnopt.kernels.reference import reference_attention
    from attnopt.kernels.registry import _REGISTRY, FunctionCandidate

    def wrong(q, k, v, **kw):
        return reference_attention(q, k, v, **kw) * 1.5

    monkeypatch.setitem(_REGISTRY, "wrong", FunctionCandidate("wrong", wrong, lambda s: None))
    torch._dynamo.reset()
    bad = attnopt.optimize(copy.deepcopy(model), variant="wrong", verify=True)
    with pytest.warns(UserWarning, match="dropped the rewrite"):
        out = bad(x)
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)
    rec = attnopt.explain(bad).records[0]
    assert not rec.rewritten and "verify" in rec.reason


def test_failing_candidate_falls_back_with_warning(monkeypatch):
    from attnopt.kernels.registry import _REGISTRY, FunctionCandidate

    def broken(q, k, v, **kw):
        raise RuntimeError("kernel unavailable")

    monkeypatch.setitem(_REGISTRY, "broken", FunctionCandidate("broken", broken, lambda s: None))
    model = CausalSelfAttention(CFG).eval()
    x = torch.randn(2, 8, CFG.n_embd)
    opt = attnopt.optimize(model, variant="broken")
    with pytest.warns(UserWarning, match="kernel unavailable"):
        out = opt(x)
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)


def test_pipeline_failure_runs_graph_as_written(monkeypatch):
    import attnopt.pipeline.steps as pipeline

    def boom(*a, **k):
        raise RuntimeError("matcher exploded")

    monkeypatch.setattr(pipeline, "find_sites", boom)
    model = CausalSelfAttention(CFG).eval()
    x = torch.randn(2, 8, CFG.n_embd)
    opt = attnopt.optimize(model)
    with pytest.warns(UserWarning, match="matcher exploded"):
        out = opt(x)
    torch.testing.assert_close(out, model(x))
    assert attnopt.explain(opt).failures


def test_import_touches_no_device_and_site_module_prints_spec():
    import subprocess
    import sys

    code = ("import attnopt, torch, sys; "
            "sys.exit(1 if torch.cuda.is_initialized() else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
    gm, inputs = capture(CausalSelfAttention(CFG).eval(), torch.randn(1, 4, CFG.n_embd))
    new = attnopt.rewrite(gm, inputs)
    (site,) = _sites(new)
    assert "causal (top-left)" in repr(site)


class AddedMask(nn.Module):
    def forward(self, q, k, v, mask):
        s = q @ k.transpose(-2, -1) * q.size(-1) ** -0.5 + mask
        return torch.softmax(s, dim=-1) @ v


def test_added_min_mask_rows_keep_gradients_of_the_original():
    """A row whose added mask is all dtype-min is uniform as written; its gradients must match too."""
    q, k, v = (torch.randn(2, 2, 6, 4, requires_grad=True) for _ in range(3))
    mask = torch.zeros(2, 1, 6, 6)
    mask[1, 0, 3] = torch.finfo(torch.float32).min  # query 3 of batch 1 sees every key as min
    mask[0, 0, :, 4:] = torch.finfo(torch.float32).min
    model = AddedMask()
    opt = attnopt.optimize(model)
    cot = torch.randn(2, 2, 6, 4)
    ref = torch.autograd.grad((model(q, k, v, mask) * cot).sum(), (q, k, v))
    out = torch.autograd.grad((opt(q, k, v, mask) * cot).sum(), (q, k, v))
    assert attnopt.explain(opt).records[0].spec.min_rows == "math"
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


class UpcastFill(nn.Module):
    def forward(self, q, k, v, keep):
        s = (q @ k.transpose(-2, -1)).float().masked_fill(~keep, torch.finfo(torch.float32).min)
        return torch.softmax(s, dim=-1).to(q.dtype) @ v


def test_fill_with_a_minimum_that_q_dtype_cannot_hold_is_left_alone():
    q, k, v = (torch.randn(1, 2, 4, 8, dtype=torch.bfloat16) for _ in range(3))
    keep = torch.rand(1, 1, 4, 4) > 0.5
    report = attnopt.explain(UpcastFill(), q, k, v, keep)
    assert report.rewritten == 0 and "float32 minimum" in report.records[0].reason


class NewFullMask(nn.Module):
    """A run-time mask built with ``scores.new_full``: the scores lend only their dtype and device."""

    def forward(self, q, k, v):
        s = q @ k.transpose(-2, -1) * q.size(-1) ** -0.5
        t = s.size(-1)
        s = s + s.new_full((t, t), float("-inf")).triu(2)  # offset 2: not causal, passed as a mask
        return s.softmax(-1) @ v


def test_mask_built_from_scores_metadata_does_not_keep_the_product():
    q, k, v = (torch.randn(2, 2, 6, 4) for _ in range(3))
    gm, inputs = capture(NewFullMask(), q, k, v)
    new = attnopt.rewrite(gm, inputs)
    assert attnopt.explain(new).rewritten == 1
    products = [n for n in new.graph.nodes if n.target in (operator.matmul, torch.matmul)]
    assert products == [], new.code  # q @ k^T is gone; new_full reads q's dtype instead
    torch.testing.assert_close(new(*inputs)[0], NewFullMask()(q, k, v), atol=1e-5, rtol=1e-5)
