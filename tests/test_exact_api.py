"""Exactness of the public API (issue 16, classes 4 and 8).

Class 4: ``rewrite()`` proves a graph on the example inputs' shapes (``symbolic_trace`` graphs get
their shapes from them), so sizes read by the proof (``k.size(-1) ** -0.5``, ``tril(diagonal=Tk - Tq)``,
a view's head size) are constants of that proof. The module it returns runs the proven rewrite only
for inputs with the signature the proof saw and re-proves for others; every call must equal the
graph as written, outputs and gradients.

Class 8: ``explain(model, *inputs)`` runs a forward; nothing about the model (parameters, buffers,
their values and ``requires_grad``, training flags, tensors and values held in attributes, containers
and plain objects) nor the random state (torch, Python, numpy) may change.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import attnopt
from attnopt.runtime.site import AttentionSite


def _same(new: nn.Module, ref: nn.Module, *inputs: torch.Tensor, **kw: torch.Tensor) -> None:
    """``new`` and ``ref`` agree on outputs and on gradients with respect to every input."""
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    leaves2 = [x.detach().clone().requires_grad_(True) for x in inputs]
    kw1 = {k: v.detach().clone().requires_grad_(True) for k, v in kw.items()}
    kw2 = {k: v.detach().clone().requires_grad_(True) for k, v in kw.items()}
    out, want = new(*leaves, **kw1), ref(*leaves2, **kw2)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    cot = torch.randn_like(want)
    g = torch.autograd.grad((out * cot).sum(), leaves + list(kw1.values()))
    g_ref = torch.autograd.grad((want * cot).sum(), leaves2 + list(kw2.values()))
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _randn(*shapes: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(torch.randn(*s) for s in shapes)


# --------------------------------------------------------------------------------------------
# Class 4: shapes baked in by rewrite()


class ScaleFromSize(nn.Module):
    def forward(self, q, k, v):
        s = q @ k.transpose(-2, -1) * k.size(-1) ** -0.5
        return s.softmax(-1) @ v


class BottomRight(nn.Module):
    def forward(self, q, k, v):
        tq, tk = q.size(-2), k.size(-2)
        s = q @ k.transpose(-2, -1) / 2.0
        keep = s.new_ones(tq, tk, dtype=torch.bool).tril(diagonal=tk - tq)
        return s.masked_fill(~keep, float("-inf")).softmax(-1) @ v


class BottomRightOnes(nn.Module):
    """The same mask built with ``torch.ones`` (export's ``aten.new_ones`` reads the scores)."""

    def forward(self, q, k, v):
        tq, tk = q.size(-2), k.size(-2)
        keep = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(diagonal=tk - tq)
        return (q @ k.transpose(-2, -1) / 2.0).masked_fill(~keep, float("-inf")).softmax(-1) @ v


class ViewHeads(nn.Module):
    """Heads split by a view that reads ``x.size(1)`` and ``x.size(2)``; the scale is the head size's."""

    def forward(self, x):
        b, t, c = x.size(0), x.size(1), x.size(2)
        h = x.view(b, x.size(1), 2, c // 2).transpose(1, 2)
        s = h @ h.transpose(-2, -1) * (c // 2) ** -0.5
        return (s.softmax(-1) @ h).transpose(1, 2).reshape(b, t, c)


class ScaleArg(nn.Module):
    """A non-tensor input: its value is read by the proof as the scale."""

    def forward(self, q, k, v, scale: float):
        return (q @ k.transpose(-2, -1) * scale).softmax(-1) @ v


@pytest.mark.parametrize("model, proven, called", [
    (ScaleFromSize(), [(1, 2, 4, 16)] * 3, [(1, 2, 4, 32)] * 3),
    (BottomRight(), [(1, 2, 8, 4)] * 3, [(1, 2, 4, 4), (1, 2, 8, 4), (1, 2, 8, 4)]),  # top-left at Tq == Tk
    (BottomRight(), [(1, 2, 4, 4), (1, 2, 8, 4), (1, 2, 8, 4)], [(1, 2, 8, 4)] * 3),
    (BottomRight(), [(1, 2, 4, 4), (1, 2, 8, 4), (1, 2, 8, 4)], [(1, 2, 2, 4), (1, 2, 8, 4), (1, 2, 8, 4)]),
    (ViewHeads(), [(2, 4, 8)], [(2, 6, 16)]),
], ids=["scale-from-head-size", "tril-square-then-4x8", "tril-4x8-then-square", "tril-4x8-then-2x8", "view"])
def test_rewrite_at_other_shapes_equals_the_traced_graph(model, proven, called):
    gm = fx.symbolic_trace(model)
    new = attnopt.rewrite(gm, _randn(*proven), variant="sdpa")
    assert attnopt.explain(new).rewritten == 1
    _same(new, gm, *_randn(*called))
    _same(new, model, *_randn(*called))
    _same(new, gm, *_randn(*proven))  # and the proven shapes still run right


def test_new_signature_is_proven_again_and_cached():
    gm = fx.symbolic_trace(ScaleFromSize())
    new = attnopt.rewrite(gm, _randn(*[(1, 2, 4, 16)] * 3))  # "auto": each signature tunes with the same selector
    report = new.meta["attnopt_report"]
    for _ in range(2):
        _same(new, gm, *_randn(*[(1, 2, 4, 16)] * 3))  # fresh tensors, same signature: the proven graph
    assert report.graphs == 1
    for _ in range(2):
        _same(new, gm, *_randn(*[(1, 2, 4, 32)] * 3))
    assert report.graphs == 2 and report.rewritten == 2  # proven once more for D=32, then cached
    assert attnopt.explain(new) is report
    assert report.records[1].reason.startswith("scale=0.1767")  # 32 ** -0.5, not 16's


def test_non_tensor_input_values_are_part_of_the_signature():
    gm = fx.symbolic_trace(ScaleArg())
    q, k, v = _randn(*[(1, 2, 4, 8)] * 3)
    new = attnopt.rewrite(gm, (q, k, v, 0.5), variant="sdpa")
    torch.testing.assert_close(new(q, k, v, 0.5), gm(q, k, v, 0.5), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(new(q, k, v, 0.25), gm(q, k, v, 0.25), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(new(q, k, v, scale=2.0), gm(q, k, v, 2.0), atol=1e-5, rtol=1e-5)


def test_keyword_inputs_at_a_new_shape():
    gm = fx.symbolic_trace(ScaleFromSize())
    new = attnopt.rewrite(gm, _randn(*[(1, 2, 4, 16)] * 3), variant="sdpa")
    q, k, v = _randn(*[(1, 2, 4, 32)] * 3)
    _same(new, gm, q, k=k, v=v)


def test_dtype_is_part_of_the_signature():
    gm = fx.symbolic_trace(ScaleFromSize())
    new = attnopt.rewrite(gm, _randn(*[(1, 2, 4, 16)] * 3), variant="sdpa")
    q, k, v = (x.double() for x in _randn(*[(1, 2, 4, 16)] * 3))
    torch.testing.assert_close(new(q, k, v), gm(q, k, v))
    assert new.meta["attnopt_report"].graphs == 2


def test_rewritten_module_keeps_its_graph_module_surface():
    gm = fx.symbolic_trace(ScaleFromSize())
    new = attnopt.rewrite(gm, _randn(*[(1, 2, 4, 16)] * 3), variant="sdpa")
    assert isinstance(new, fx.GraphModule)
    assert "attnopt_site0" in new.code and "attnopt_site0" in str(new)
    assert [n for n, m in new.named_modules() if isinstance(m, AttentionSite)] == ["attnopt_site0"]
    new(*_randn(*[(1, 2, 4, 32)] * 3))  # a re-proof registers nothing on the module
    assert [n for n, m in new.named_modules() if isinstance(m, AttentionSite)] == ["attnopt_site0"]
    assert list(new.state_dict()) == list(gm.state_dict())


def test_deepcopy_keeps_the_signature_guard():
    model = WithParams()
    gm = fx.symbolic_trace(model)
    first = attnopt.rewrite(gm, (torch.randn(2, 4, 8),), variant="sdpa")
    first(torch.randn(2, 5, 8))  # one more signature proven before the copy
    new = copy.deepcopy(first)
    assert new.meta["attnopt_report"] is not first.meta["attnopt_report"]
    for t in (5, 6):
        _same(new, model, torch.randn(2, t, 8))
    assert new.meta["attnopt_report"].graphs == 3 and first.meta["attnopt_report"].graphs == 2
    new.qkv = nn.Linear(8, 24)  # a submodule swapped on the copy reaches its other signatures, not the model
    ref = copy.deepcopy(model)
    ref.qkv = new.qkv
    _same(new, ref, torch.randn(2, 6, 8))
    assert model.qkv is gm.qkv is first.qkv and model.qkv is not new.qkv


def test_beyond_the_signature_bound_the_graph_runs_as_written(monkeypatch):
    import attnopt.pipeline.rewritten as rewritten

    monkeypatch.setattr(rewritten, "MAX_SIGNATURES", 1)
    gm = fx.symbolic_trace(ScaleFromSize())
    new = attnopt.rewrite(gm, _randn(*[(1, 2, 4, 16)] * 3), variant="sdpa")
    for d in (32, 8, 4, 32):
        _same(new, gm, *_randn(*[(1, 2, 4, d)] * 3))
    assert new.meta["attnopt_report"].graphs == 2  # one re-proof kept; the rest ran as written


class WithParams(nn.Module):
    def __init__(self, c: int = 8):
        super().__init__()
        self.qkv = nn.Linear(c, 3 * c)
        self.register_buffer("gain", torch.ones(()))

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        s = q @ k.transpose(-2, -1) * q.size(-1) ** -0.5 * self.gain
        return s.softmax(-1) @ v


def test_reproven_graph_follows_the_module_state():
    """Parameters are shared, training flags and replaced buffers followed at a new signature."""
    model = WithParams()
    gm = fx.symbolic_trace(model)
    new = attnopt.rewrite(gm, (torch.randn(2, 4, 8),), variant="sdpa")
    assert all(a is b for a, b in zip(new.parameters(), model.parameters()))
    x = torch.randn(2, 6, 8, requires_grad=True)
    _same(new, model, x)
    new.gain = torch.full((), 2.0)  # a buffer replaced on the rewritten module reaches every signature
    model.gain = torch.full((), 2.0)
    _same(new, model, torch.randn(2, 4, 8))
    _same(new, model, torch.randn(2, 6, 8))
    with torch.no_grad():
        model.qkv.weight.mul_(0.5)  # shared parameters: a weight update reaches every signature
    _same(new, model, torch.randn(2, 6, 8))
    new.train()
    assert all(m.training for m in new.modules())


def test_export_graph_with_a_dynamic_length_is_not_proven_again():
    from torch.export import Dim

    model = BottomRightOnes()
    q, k, v = _randn(*[(1, 2, 8, 4)] * 3)
    tq, tk = Dim("tq", min=2, max=32), Dim("tk", min=2, max=32)
    gm = torch.export.export(model, (q, k, v), dynamic_shapes=({2: tq}, {2: tk}, {2: tk})).module()
    new = attnopt.rewrite(gm, variant="sdpa")
    assert attnopt.explain(new).records[0].spec.causal == "bottom_right"
    for t in (8, 4, 2):
        _same(new, model, *_randn((1, 2, t, 4), (1, 2, 8, 4), (1, 2, 8, 4)))
    assert new.meta["attnopt_report"].graphs == 1  # the proof was symbolic: one graph serves every length
    with pytest.raises(Exception, match="Guard failed|Expected input"):  # export's own input check, as written
        new(*_randn((1, 2, 4, 8), (1, 2, 8, 8), (1, 2, 8, 8)))


def test_a_proof_that_reads_a_concrete_size_of_a_symbolic_graph_is_kept_to_that_size(monkeypatch):
    """A proof that specialises a symbol (a guard added to the shape environment) holds at that size only."""
    from torch.export import Dim

    import attnopt.pipeline.steps as pipeline

    real = pipeline.find_sites

    def specialising(gm, concrete):
        for node in gm.graph.nodes:
            if node.op == "placeholder" and isinstance(node.meta.get("val"), torch.Tensor):
                int(node.meta["val"].shape[2])  # reads the length as a number: a guard on the symbol
        return real(gm, concrete)

    monkeypatch.setattr(pipeline, "find_sites", specialising)
    model = BottomRightOnes()
    tq, tk = Dim("tq", min=2, max=32), Dim("tk", min=2, max=32)
    ex = _randn(*[(1, 2, 8, 4)] * 3)
    gm = torch.export.export(model, ex, dynamic_shapes=({2: tq}, {2: tk}, {2: tk})).module()
    new = attnopt.rewrite(gm, variant="sdpa")
    monkeypatch.setattr(pipeline, "find_sites", real)
    _same(new, model, *_randn(*[(1, 2, 8, 4)] * 3))
    assert new.meta["attnopt_report"].graphs == 1
    _same(new, model, *_randn((1, 2, 4, 4), (1, 2, 8, 4), (1, 2, 8, 4)))
    assert new.meta["attnopt_report"].graphs == 2  # proven again for Tq=4


def test_export_graph_with_static_shapes_runs_its_own_input_check_at_other_shapes():
    model = ScaleFromSize()
    ex = _randn(*[(1, 2, 4, 16)] * 3)
    gm = torch.export.export(model, ex).module()
    new = attnopt.rewrite(gm, variant="sdpa")
    _same(new, model, *_randn(*[(1, 2, 4, 16)] * 3))
    with pytest.raises(Exception, match="Guard failed|Expected input"):
        new(*_randn(*[(1, 2, 4, 32)] * 3))


# --------------------------------------------------------------------------------------------
# Class 8: explain(model, *inputs) changes nothing about the model


class NormedAttention(nn.Module):
    def __init__(self, c: int = 8, p: float = 0.0):
        super().__init__()
        self.norm = nn.BatchNorm1d(c)
        self.qkv = nn.Linear(c, 3 * c)
        self.drop = nn.Dropout(p)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.frozen = nn.Linear(c, c)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        self.calls.add_(1)
        x = self.norm(x.transpose(1, 2)).transpose(1, 2)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        s = q @ k.transpose(-2, -1) * q.size(-1) ** -0.5
        return self.frozen(self.drop(s.softmax(-1)) @ v)


def _state(model: nn.Module) -> dict:
    return {
        "tensors": {n: (t, t.detach().clone(), t.requires_grad) for n, t in
                    [*model.named_parameters(), *model.named_buffers()]},
        "training": {n: m.training for n, m in model.named_modules()},
    }


def _assert_unchanged(model: nn.Module, before: dict) -> None:
    after = dict([*model.named_parameters(), *model.named_buffers()])
    assert set(after) == set(before["tensors"])
    for name, (obj, value, rg) in before["tensors"].items():
        assert after[name] is obj, f"{name} is another tensor object"
        assert torch.equal(after[name], value), f"{name} changed"
        assert after[name].requires_grad == rg
    assert {n: m.training for n, m in model.named_modules()} == before["training"]


def test_explain_leaves_batchnorm_stats_and_in_place_buffers_alone():
    model = NormedAttention().train()
    model.frozen.eval()  # a submodule in another mode than its parent stays so
    before = _state(model)
    report = attnopt.explain(model, torch.randn(2, 6, 8))
    assert report.rewritten == 1
    _assert_unchanged(model, before)
    assert model.norm.num_batches_tracked.item() == 0 and model.calls.item() == 0


def test_explain_leaves_the_random_stream_alone():
    model = NormedAttention(p=0.5).train()
    x = torch.randn(2, 6, 8)
    torch.manual_seed(123)
    want = torch.rand(4)
    torch.manual_seed(123)
    attnopt.explain(model, x)
    torch.testing.assert_close(torch.rand(4), want, rtol=0, atol=0)


def test_explain_of_an_optimized_model_leaves_it_alone():
    model = NormedAttention(p=0.5).train()
    opt = attnopt.optimize(model)
    opt(torch.randn(2, 6, 8))
    before = _state(model)
    x = torch.randn(2, 6, 8)
    torch.manual_seed(7)
    want = torch.rand(4)
    torch.manual_seed(7)
    report = attnopt.explain(opt, x)
    torch.testing.assert_close(torch.rand(4), want, rtol=0, atol=0)
    assert report.rewritten >= 1
    _assert_unchanged(model, before)


class Counter(nn.Module):
    """Writes state several ways: a buffer reassigned, a Python counter, and raises on request."""

    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(3))
        self.steps = 0

    def forward(self, q, k, v, fail: bool = False):
        self.total = self.total + q.sum()
        self.steps += 1
        out = (q @ k.transpose(-2, -1)).softmax(-1) @ v
        if fail:
            raise ValueError("forward failed on purpose")
        return out


def test_explain_restores_reassigned_buffers_and_attributes_even_when_forward_raises():
    model = Counter()
    buf = model.total
    qkv = _randn(*[(1, 2, 4, 8)] * 3)
    attnopt.explain(model, *qkv)
    assert model.total is buf and torch.equal(buf, torch.zeros(3)) and model.steps == 0
    with pytest.raises(ValueError, match="on purpose"):
        attnopt.explain(model, *qkv, fail=True)
    assert model.total is buf and torch.equal(buf, torch.zeros(3)) and model.steps == 0
    assert dict(model.named_buffers()) == {"total": buf}


def test_explain_still_runs_the_model_with_the_inputs_given():
    model = NormedAttention().eval()
    report = attnopt.explain(model, torch.randn(2, 6, 8))
    assert report.rewritten == 1 and "qkv" not in report.records[0].reason


def test_rewrite_leaves_submodule_training_flags_alone():
    model = WithParams().train()
    model.qkv.eval()
    gm = fx.symbolic_trace(model)
    attnopt.rewrite(gm, (torch.randn(2, 4, 8),), variant="sdpa")
    assert gm.training and not gm.qkv.training



# Everything reachable from the modules' ``__dict__``s is state: tensors kept as plain attributes
# (a KV cache, as Meta's llama reference keeps ``cache_k``), tensors and values inside containers and
# inside plain objects, and the global random generators. explain restores them in place.


def _attn(q, k, v):
    return ((q @ k.transpose(-2, -1)) * 0.25).softmax(-1) @ v


class KVCacheAttribute(nn.Module):
    def __init__(self):
        super().__init__()
        self.cache_k = torch.zeros(2, 2, 8, 8)
        self.log = {"calls": []}

    def forward(self, q, k, v):
        import random

        import numpy as np

        self.cache_k[:, :, :5] = k
        self.log["calls"].append(1)
        np.random.rand()
        random.random()
        return _attn(q, k, v)


@pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace")
def test_explain_restores_a_plain_tensor_cache_a_nested_list_and_the_numpy_and_python_rngs():
    import random

    import numpy as np

    model = KVCacheAttribute()
    cache, log, calls = model.cache_k, model.log, model.log["calls"]
    np.random.seed(5)
    random.seed(5)
    want_np, want_py = np.random.get_state()[1].copy(), random.getstate()
    attnopt.explain(model, *_randn(*[(2, 2, 5, 8)] * 3))
    assert model.cache_k is cache and cache.abs().sum().item() == 0
    assert model.log is log and log["calls"] is calls and log == {"calls": []}
    assert (np.random.get_state()[1] == want_np).all() and random.getstate() == want_py


class _Inner:
    def __init__(self):
        self.hist = []
        self.last = torch.zeros(2)


class _Stats:
    def __init__(self):
        self.n = 0
        self.inner = _Inner()


class StateEverywhere(nn.Module):
    """In-place and rebinding writes to tensors and values held in containers and plain objects."""

    def __init__(self):
        super().__init__()
        self.mem = [torch.zeros(3), {"t": torch.zeros(2)}]
        self.pair = (torch.zeros(2), [0])
        self.step = torch.zeros(())
        self.seen = torch.zeros(())
        self.tags = {"a"}
        self.stats = _Stats()

    def forward(self, q, k, v):
        self.mem[0].add_(1)
        self.mem[1]["t"] += 2
        self.mem[1]["new"] = 1
        self.mem.append(torch.ones(1))
        self.pair[0].fill_(3)
        self.pair[1].append(1)
        self.step += 1                  # in place on the same 0-d tensor
        self.seen = self.seen + 1       # rebinding the attribute
        self.tags.add("b")
        self.stats.n += 1
        self.stats.added = True
        self.stats.inner.hist.append(1)
        self.stats.inner.last.add_(5)
        self.stats.inner = _Inner() if q.sum() > 1e9 else self.stats.inner
        return _attn(q, k, v)


def test_explain_restores_tensors_and_values_inside_containers_and_plain_objects_in_place():
    model = StateEverywhere()
    mem, d, t0, t1, pair, step, seen = (model.mem, model.mem[1], model.mem[0], model.mem[1]["t"],
                                        model.pair, model.step, model.seen)
    tags, stats, inner, hist, last = model.tags, model.stats, model.stats.inner, model.stats.inner.hist, \
        model.stats.inner.last
    attnopt.explain(model, *_randn(*[(1, 2, 4, 8)] * 3))
    assert model.mem is mem and len(mem) == 2 and mem[0] is t0 and mem[1] is d and d["t"] is t1
    assert set(d) == {"t"} and t0.abs().sum() == 0 and t1.abs().sum() == 0
    assert model.pair is pair and pair[0].abs().sum() == 0 and pair[1] == [0]
    assert model.step is step and step.item() == 0 and model.seen is seen and seen.item() == 0
    assert model.tags is tags and tags == {"a"}
    assert model.stats is stats and stats.n == 0 and not hasattr(stats, "added")
    assert stats.inner is inner and inner.hist is hist and hist == [] and inner.last is last
    assert last.abs().sum() == 0


class OwnGenerators(nn.Module):
    def __init__(self):
        super().__init__()
        import random

        import numpy as np

        self.gen = torch.Generator().manual_seed(1)
        self.np_rng = np.random.default_rng(1)
        self.py_rng = random.Random(1)
        self.table = np.zeros(4)

    def forward(self, q, k, v):
        torch.rand(1, generator=self.gen)
        self.np_rng.random()
        self.py_rng.random()
        self.table[1] = 7.0
        return _attn(q, k, v)


def test_explain_restores_generators_and_numpy_arrays_held_by_the_model():
    model = OwnGenerators()
    ref = OwnGenerators()
    table = model.table
    attnopt.explain(model, *_randn(*[(1, 2, 4, 8)] * 3))
    assert model.table is table and not table.any()
    assert torch.equal(torch.rand(3, generator=model.gen), torch.rand(3, generator=ref.gen))
    assert model.np_rng.random() == ref.np_rng.random() and model.py_rng.random() == ref.py_rng.random()


@pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace")
def test_explain_warns_about_state_above_the_copy_budget(monkeypatch):
    import attnopt.pipeline.snapshot as snapshot

    monkeypatch.setattr(snapshot, "EXPLAIN_STATE_COPY_LIMIT", 100)  # cache_k is 1 KiB
    model = KVCacheAttribute()
    with pytest.warns(UserWarning, match=r"cache_k"):
        attnopt.explain(model, *_randn(*[(2, 2, 5, 8)] * 3))
    assert model.log == {"calls": []}  # the rest is still restored
