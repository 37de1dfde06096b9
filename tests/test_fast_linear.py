"""The cached LM's linear layers: F.linear or oneDNN by timing a pass over the weights, oneDNN's results checked.

The decision is forced both ways with a fake timer (``time_passes``), so no test depends on which kernel is
faster, or right, on the machine that runs it: a kernel that returns wrong values is injected instead.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from llama_style import LlamaConfig, LlamaStyle

from attnopt.generation import cached, generate, generate_plain
from attnopt.kernels import linear as fast
from attnopt.models import GPTConfig, NanoGPT

needs_onednn = pytest.mark.skipif(fast.onednn_linear() is None, reason="this torch build has no oneDNN")


def timer(onednn: float, default: float):
    """A ``time_passes`` that reports fixed seconds per round (with a little spread) and runs nothing."""
    calls: list[int] = []

    def fake(fns, rounds):
        calls.append(rounds)
        assert set(fns) == {"onednn", "F.linear"}
        spread = [1 + 0.001 * (i % 3) for i in range(rounds)]
        return {"onednn": [onednn * s for s in spread], "F.linear": [default * s for s in spread]}

    fake.calls = calls
    return fake


@pytest.fixture(autouse=True)
def fresh_decisions():
    fast.clear()
    yield
    fast.clear()


def group(*shapes: tuple[int, int], bias: bool = True, dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    pairs = [(torch.randn(n, k, dtype=dtype), torch.randn(n, dtype=dtype) if bias else None) for n, k in shapes]
    return pairs, fast.register(pairs, "test")


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [(1, 1), (2, 3), (1, 17), (5,)])
@pytest.mark.parametrize("bias", [True, False])
def test_onednn_when_faster_and_same_values(monkeypatch, dtype, rows, bias) -> None:
    monkeypatch.setattr(fast, "time_passes", timer(onednn=1.0, default=2.0))
    pairs, g = group((48, 32), (32, 48), bias=bias, dtype=dtype)
    used = []
    real = fast.onednn_linear()
    monkeypatch.setattr(fast, "_onednn_op", lambda *a: used.append(1) or real(*a))
    for w, b in pairs:
        x = torch.randn(*rows, w.size(1), dtype=dtype)
        with torch.no_grad():
            got = fast.linear(x, w, b, g)
        want = F.linear(x.double(), w.double(), None if b is None else b.double())
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * 10)
        assert got.dtype == dtype and got.shape == (*rows, w.size(0))
    assert len(used) == 2 * len(pairs)  # each weight's check at the decision, then each call
    (d,) = fast.decisions(g)
    assert d["kernel"] == "onednn" and d["onednn / F.linear"] == pytest.approx(0.5, rel=0.01)


@pytest.mark.parametrize("onednn, verdict", [(2.0, "slower"), (1.01, "tie")])
def test_f_linear_unless_clearly_faster(monkeypatch, onednn, verdict) -> None:
    monkeypatch.setattr(fast, "time_passes", timer(onednn=onednn, default=1.0))
    pairs, g = group((16, 8))
    w, b = pairs[0]
    x = torch.randn(1, 8)
    with torch.no_grad():
        assert torch.equal(fast.linear(x, w, b, g), F.linear(x, w, b))
    (d,) = fast.decisions(g)
    assert d["kernel"] == "F.linear"
    if fast.onednn_linear() is not None:
        assert verdict in d["reason"]


@needs_onednn
def test_a_wrong_kernel_is_never_used(monkeypatch) -> None:
    """oneDNN's results are checked against a float64 reference before any timing: one wrong value refuses it."""
    fake = timer(onednn=0.1, default=1.0)
    monkeypatch.setattr(fast, "time_passes", fake)
    real = fast.onednn_linear()

    def off_by_a_little(x, w, b, *rest):
        y = real(x, w, b, *rest)
        return y + 1e-3 * y.abs().max()

    monkeypatch.setattr(fast, "_onednn_op", off_by_a_little)
    pairs, g = group((64, 64), (64, 64))
    w, b = pairs[1]
    x = torch.randn(1, 64)
    with torch.no_grad():
        assert torch.equal(fast.linear(x, w, b, g), F.linear(x, w, b))
    (d,) = fast.decisions(g)
    assert d["kernel"] == "F.linear" and "outside the rounding bound" in d["reason"]
    assert not fake.calls  # refused before timing


def test_gradients_take_f_linear(monkeypatch) -> None:
    """oneDNN's op has no autograd formula: with gradients needed, F.linear, whatever the group chose."""
    monkeypatch.setattr(fast, "time_passes", timer(onednn=1.0, default=2.0))
    pairs, g = group((8, 4))
    w, b = pairs[0]
    w.requires_grad_(True)
    x = torch.randn(3, 4, requires_grad=True)
    with torch.no_grad():
        fast.linear(x, w, b, g)  # decides (oneDNN where available)
    y = fast.linear(x, w, b, g)
    y.square().sum().backward()
    xr, wr = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    F.linear(xr, wr, b).square().sum().backward()
    assert torch.equal(x.grad, xr.grad) and torch.equal(w.grad, wr.grad)


def test_unsupported_operands_take_f_linear(monkeypatch) -> None:
    monkeypatch.setattr(fast, "time_passes", timer(onednn=1.0, default=2.0))
    pairs, g = group((8, 4), dtype=torch.float64)
    w, b = pairs[0]
    x = torch.randn(2, 4, dtype=torch.float64)
    with torch.no_grad():
        assert torch.equal(fast.linear(x, w, b, g), F.linear(x, w, b))
    (d,) = fast.decisions(g)
    assert d["kernel"] == "F.linear" and ("float64" in d["reason"] or "no oneDNN" in d["reason"])


def test_a_freed_weight_is_not_timed(monkeypatch) -> None:
    fake = timer(onednn=1.0, default=2.0)
    monkeypatch.setattr(fast, "time_passes", fake)
    pairs, g = group((8, 4), (8, 4))
    w, b = pairs[0]
    del pairs
    gc.collect()
    with torch.no_grad():
        fast.linear(torch.randn(1, 4), w, b, g)
    (d,) = fast.decisions(g)
    assert d["kernel"] == "F.linear" and "freed" in d["reason"] and not fake.calls


def test_each_row_bucket_and_thread_count_decides_once(monkeypatch) -> None:
    fake = timer(onednn=2.0, default=1.0)
    monkeypatch.setattr(fast, "time_passes", fake)
    pairs, g = group((8, 4))
    w, b = pairs[0]
    with torch.no_grad():
        for rows in (1, 1, 2, 3, 4, 7, 1):
            fast.linear(torch.randn(rows, 4), w, b, g)
    assert sorted(d["rows"] for d in fast.decisions(g)) == ["1-1", "2-3", "4-7"]
    if fast.onednn_linear() is not None:
        assert len(fake.calls) == 3


def _nano() -> NanoGPT:
    torch.manual_seed(0)
    return NanoGPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=32)).eval()


def _llama() -> LlamaStyle:
    torch.manual_seed(0)
    return LlamaStyle(LlamaConfig()).eval()


@pytest.mark.parametrize("faster", ["onednn", "F.linear"])
@pytest.mark.parametrize("build", [_nano, _llama])
def test_cached_model_routes_its_linear_layers_and_keeps_the_tokens(monkeypatch, faster, build) -> None:
    """Either kernel, the cached model's tokens are the plain loop's (single prompt and a ragged batch)."""
    monkeypatch.setattr(fast, "time_passes", timer(onednn=1.0 if faster == "onednn" else 3.0, default=2.0))
    model = build()
    lm = cached(model)
    routed = [n for gm in (lm.run, lm.rows_module) for n in gm.graph.nodes if n.target is fast.linear]
    left = [n for gm in (lm.run, lm.rows_module) for n in gm.graph.nodes
            if n.target is torch.ops.aten.linear.default]
    assert routed and not left and len(lm.linear_groups) == 2
    vocab = 64  # both models' vocabulary
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (2, 5), generator=gen)
    assert torch.equal(generate(lm, prompt, 6), generate_plain(model, prompt, 6))
    prompts = [torch.randint(0, vocab, (n,), generator=gen) for n in (3, 6)]
    ragged = generate(lm, prompts, 4)  # a list in, a list out: each prompt with its new tokens
    for row, p in zip(ragged, prompts):
        assert torch.equal(row, generate_plain(model, p[None], 4)[0])
    chosen = {d["kernel"] for d in fast.decisions()}
    assert chosen == ({"onednn"} if faster == "onednn" and fast.onednn_linear() is not None else {"F.linear"})
    assert "linear layers" in lm.describe()


def test_undecided_calls_take_f_linear_and_decide_nothing(monkeypatch) -> None:
    """The capture's probes run inside ``undecided()``: no timing at sizes a generation rarely meets."""
    fake = timer(onednn=1.0, default=2.0)
    monkeypatch.setattr(fast, "time_passes", fake)
    pairs, g = group((8, 4))
    w, b = pairs[0]
    x = torch.randn(300, 4)
    with torch.no_grad(), fast.undecided():
        assert torch.equal(fast.linear(x, w, b, g), F.linear(x, w, b))
    assert fast.decisions(g) == [] and not fake.calls
    with torch.no_grad():
        fast.linear(x, w, b, g)
    assert len(fast.decisions(g)) == 1
