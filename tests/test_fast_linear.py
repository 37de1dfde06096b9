"""The cached LM's linear layers: as written or oneDNN, by timing a pass over the weights; oneDNN's results checked.

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
from attnopt.models import GPTConfig, NanoGPT
from attnopt.runtime import linear as fast

needs_onednn = pytest.mark.skipif(fast.onednn_linear() is None, reason="this torch build has no oneDNN")


def timer(onednn: float, default: float):
    """A ``time_passes`` that reports fixed seconds per round (with a little spread) and runs nothing."""
    calls: list[int] = []

    def fake(fns, rounds):
        calls.append(rounds)
        assert set(fns) == {"onednn", "as written"}
        spread = [1 + 0.001 * (i % 3) for i in range(rounds)]
        return {"onednn": [onednn * s for s in spread], "as written": [default * s for s in spread]}

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
    assert d["kernel"] == "onednn" and d["onednn / as written"] == pytest.approx(0.5, rel=0.01)


@pytest.mark.parametrize("onednn, verdict", [(2.0, "slower"), (1.01, "tie")])
def test_f_linear_unless_clearly_faster(monkeypatch, onednn, verdict) -> None:
    monkeypatch.setattr(fast, "time_passes", timer(onednn=onednn, default=1.0))
    pairs, g = group((16, 8))
    w, b = pairs[0]
    x = torch.randn(1, 8)
    with torch.no_grad():
        assert torch.equal(fast.linear(x, w, b, g), F.linear(x, w, b))
    (d,) = fast.decisions(g)
    assert d["kernel"] == "as written"
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
    assert d["kernel"] == "as written" and "outside the rounding bound" in d["reason"]
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
    assert d["kernel"] == "as written" and ("float64" in d["reason"] or "no oneDNN" in d["reason"])


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
    assert d["kernel"] == "as written" and "freed" in d["reason"] and not fake.calls


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


@pytest.mark.parametrize("faster", ["onednn", "as written"])
@pytest.mark.parametrize("build", [_nano, _llama])
def test_cached_model_routes_its_linear_layers_and_keeps_the_tokens(monkeypatch, faster, build) -> None:
    """Either kernel, the cached model's tokens are the plain loop's (single prompt and a ragged batch)."""
    monkeypatch.setattr(fast, "time_passes", timer(onednn=1.0 if faster == "onednn" else 3.0, default=2.0))
    model = build()
    lm = cached(model)
    routed = [n for gm in (lm.run, lm.rows_module) for n in gm.graph.nodes if n.target is fast.linear]
    left = [n for gm in (lm.run, lm.rows_module) for n in gm.graph.nodes
            if n.target is torch.ops.aten.linear.default]
    assert routed and not left and len(lm.linear_groups) == 1  # the ragged graph shares it
    vocab = 64  # both models' vocabulary
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (2, 5), generator=gen)
    assert torch.equal(generate(lm, prompt, 6), generate_plain(model, prompt, 6))
    prompts = [torch.randint(0, vocab, (n,), generator=gen) for n in (3, 6)]
    ragged = generate(lm, prompts, 4)  # a list in, a list out: each prompt with its new tokens
    for row, p in zip(ragged, prompts):
        assert torch.equal(row, generate_plain(model, p[None], 4)[0])
    chosen = {d["kernel"] for d in fast.decisions()}
    assert chosen == ({"onednn"} if faster == "onednn" and fast.onednn_linear() is not None else {"as written"})
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


def _forced_group(monkeypatch, *shapes, **kw):
    monkeypatch.setattr(fast, "time_passes", timer(onednn=1.0, default=2.0))
    return group(*shapes, **kw)


def _decided_onednn(monkeypatch, rows: int):
    """A layer ``(w, b)`` of a group that chose oneDNN for ``x`` ``(rows, 8)``: ``(w, b, x, g)``."""
    pairs, g = _forced_group(monkeypatch, (16, 8))
    w, b = pairs[0]
    x = torch.randn(rows, 8)
    with torch.no_grad():
        fast.linear(x, w, b, g)
    assert fast.decisions(g)[0]["kernel"] == "onednn"
    return w, b, x, g


@needs_onednn
def test_a_bias_that_is_not_contiguous_takes_the_op_as_written(monkeypatch) -> None:
    """oneDNN reads a bias as if it were contiguous: a strided one set after the decision (``.data =``,
    ``load_state_dict`` into a strided view) must not reach it."""
    w, b, x, g = _decided_onednn(monkeypatch, 1)
    with torch.no_grad():
        b.data = torch.randn(32)[::2]
        assert torch.equal(fast.linear(x, w, b, g), F.linear(x, w, b))
        expanded = torch.randn(1).expand(16)
        assert torch.equal(fast.linear(x, w, expanded, g), F.linear(x, w, expanded))


@needs_onednn
def test_autocast_takes_the_op_as_written(monkeypatch) -> None:
    """``aten.linear`` is on autocast's lists and oneDNN's op is not: under autocast the layer stays as written."""
    w, b, x, g = _decided_onednn(monkeypatch, 2)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got, want = fast.linear(x, w, b, g), F.linear(x, w, b)
    assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want)


@needs_onednn
def test_addmm_with_a_weight_stored_in_out(monkeypatch) -> None:
    """GPT-2's Conv1D: ``addmm(b, x, w)`` with ``w`` ``(in, out)``, by oneDNN on ``w.t()``."""
    monkeypatch.setattr(fast, "time_passes", timer(onednn=1.0, default=2.0))
    torch.manual_seed(0)
    w, b = torch.randn(24, 40), torch.randn(40)
    g = fast.register([(w, b, True)], "conv1d")
    x = torch.randn(3, 24)
    with torch.no_grad():
        got = fast.addmm(b, x, w, g)
    want = torch.addmm(b.double(), x.double(), w.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert fast.decisions(g)[0]["kernel"] == "onednn"


def test_the_same_tensors_share_a_group() -> None:
    pairs, g = group((8, 4), (4, 8))
    assert fast.register(pairs, "again") == g
    assert fast.register(pairs[:1], "fewer") != g
    assert fast.register([(w, b, True) for w, b in pairs], "in_out") != g


@needs_onednn
def test_the_check_covers_every_chunk_of_outputs(monkeypatch) -> None:
    """The float64 check goes a few output features at a time: a wrong value in the last chunk is caught."""
    monkeypatch.setattr(fast, "time_passes", timer(onednn=0.1, default=1.0))
    monkeypatch.setattr(fast, "_CHECK_OUTPUTS", 4)
    real = fast.onednn_linear()

    def last_wrong(x, w, b, *rest):
        y = real(x, w, b, *rest).clone()
        y[..., -1] += 1e-2 * y.abs().max()
        return y

    monkeypatch.setattr(fast, "_onednn_op", last_wrong)
    pairs, g = group((10, 16))
    w, b = pairs[0]
    with torch.no_grad():
        fast.linear(torch.randn(1, 16), w, b, g)
    (d,) = fast.decisions(g)
    assert d["kernel"] == "as written" and "outside the rounding bound" in d["reason"]


@pytest.mark.parametrize("faster", ["onednn", "as written"])
def test_hugging_face_gpt2_conv1d_layers_are_routed_and_keep_the_tokens(monkeypatch, faster) -> None:
    transformers = pytest.importorskip("transformers")
    monkeypatch.setattr(fast, "time_passes", timer(onednn=1.0 if faster == "onednn" else 3.0, default=2.0))
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                     bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(config).eval()
    lm = cached(model)
    routed = [n for n in lm.run.graph.nodes if n.target is fast.addmm]
    assert len(routed) == 4 * config.n_layer  # c_attn, c_proj, c_fc, mlp c_proj
    prompt = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    assert torch.equal(generate(lm, prompt, 6), generate_plain(model, prompt, 6))
    with torch.no_grad():
        full = model(prompt).logits
        torch.testing.assert_close(lm.prefill(prompt), full, rtol=1e-4, atol=1e-4)
    chosen = {d["kernel"] for d in fast.decisions()}
    assert chosen == ({"onednn"} if faster == "onednn" and fast.onednn_linear() is not None else {"as written"})


@needs_onednn
def test_mkldnn_switched_off_and_a_broadcast_bias_take_the_op_as_written(monkeypatch) -> None:
    w, b, x, g = _decided_onednn(monkeypatch, 1)
    with torch.no_grad():
        with torch.backends.mkldnn.flags(enabled=False):
            used = []
            real = fast._onednn_op
            monkeypatch.setattr(fast, "_onednn_op", lambda *a: used.append(1) or real(*a))
            assert torch.equal(fast.linear(x, w, b, g), F.linear(x, w, b)) and not used
        one = torch.full((1,), 0.5)  # F.linear broadcasts a size-1 bias; oneDNN does not
        assert torch.equal(fast.linear(x, w, one, g), F.linear(x, w, one))


def test_a_group_with_a_freed_bias_is_not_taken_for_a_layer_without_one() -> None:
    torch.manual_seed(0)
    w, b = torch.randn(8, 4), torch.randn(8)
    g = fast.register([(w, b)], "with bias")
    del b
    gc.collect()
    assert fast.register([(w, None)], "without") != g


def test_groups_of_freed_tensors_are_dropped() -> None:
    pairs, g = group((8, 4))
    with torch.no_grad():
        fast.linear(torch.randn(1, 4), *pairs[0], g)
    assert fast.decisions(g)
    del pairs
    gc.collect()
    group((4, 2))  # registering drops the dead group
    assert g not in fast._GROUPS and fast.decisions(g) == []
    assert torch.equal(fast.linear(torch.ones(1, 4), torch.ones(2, 4), None, g), torch.full((1, 2), 4.0))


@needs_onednn
def test_onednn_is_checked_once_per_group_for_one_row_and_for_several(monkeypatch) -> None:
    pairs, g = _forced_group(monkeypatch, (16, 8), (8, 16))
    checks = []
    real = fast._within_rounding
    monkeypatch.setattr(fast, "_within_rounding", lambda *a: checks.append(1) or real(*a))
    with torch.no_grad():
        for rows in (1, 1, 5, 40, 300):
            fast.linear(torch.randn(rows, 8), *pairs[0], g)
    assert len(fast.decisions(g)) == 4 and len(checks) == 2 * len(pairs)


def test_a_compiled_cached_model_routes_nothing() -> None:
    """``compile=True``: Inductor picks the kernels; no group, nothing in describe()."""
    lm = cached(_nano(), compile=True)
    assert lm.linear_groups == [] and "linear layers" not in lm.describe()


def test_a_trace_decides_nothing(monkeypatch) -> None:
    """Fake tensors (a graph traced by make_fx or export) have no values to time or check."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake = timer(onednn=1.0, default=2.0)
    monkeypatch.setattr(fast, "time_passes", fake)
    pairs, g = group((8, 4))
    with FakeTensorMode(allow_non_fake_inputs=True):
        y = fast.linear(torch.empty(3, 4), *pairs[0], g)
    assert y.shape == (3, 8) and fast.decisions(g) == [] and not fake.calls
