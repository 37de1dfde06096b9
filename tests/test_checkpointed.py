"""Attention inside activation checkpointing (and other higher-order op bodies) is rewritten, still checkpointed.

Dynamo captures ``torch.utils.checkpoint.checkpoint`` as ``tag_activation_checkpoint(wrap_body_0, ...)``
with the attention in the body. Every test compares outputs and gradients with the model as written, and
counts the SDPA calls: two per site and step (the forward and the checkpoint's recomputation in the backward).
"""

from __future__ import annotations

import copy
import functools
import math
import warnings

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from support import capture
from torch.utils.checkpoint import checkpoint

import attnopt
from attnopt.models import Block, GPTConfig
from attnopt.passes.hop import bodies
from attnopt.runtime.site import AttentionSite

CONFIG = GPTConfig(block_size=16, vocab_size=32, n_layer=2, n_head=2, n_embd=16)


@pytest.fixture
def sdpa_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per ``F.scaled_dot_product_attention`` call (the model as written makes none)."""
    calls: list[int] = []
    real = F.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counting)
    return calls


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    t = q.size(-2)
    s = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


class CheckpointedFunction(nn.Module):
    def __init__(self, reentrant: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.reentrant = reentrant

    def forward(self, q, k, v):
        return self.proj(checkpoint(attention, q, k, v, use_reentrant=self.reentrant))


class CheckpointedBlocks(nn.Module):
    """nanoGPT blocks, each run as ``checkpoint(block, x)`` (``wrapper``: ``checkpoint_wrapper(block)``)."""

    def __init__(self, config: GPTConfig = CONFIG, wrapper: bool = False, nested: bool = False) -> None:
        super().__init__()
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        if wrapper:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

            self.h = nn.ModuleList(checkpoint_wrapper(b) for b in self.h)
        self.wrapper, self.nested = wrapper, nested

    def forward(self, x):
        for block in self.h:
            if self.wrapper:
                x = block(x)
            elif self.nested:
                x = checkpoint(lambda y, b=block: checkpoint(b, y, use_reentrant=False), x, use_reentrant=False)
            else:
                x = checkpoint(block, x, use_reentrant=False)
        return x


def grads_of(fn, model: nn.Module, *inputs: torch.Tensor) -> list[torch.Tensor]:
    """Output and gradients of the inputs and parameters (``.backward()``, which reentrant checkpoints need)."""
    for t in inputs:
        t.grad = None
    model.zero_grad(set_to_none=True)
    out = fn(*inputs)
    (out * out).sum().backward()
    params = [p.grad for p in model.parameters() if p.requires_grad]
    return [out.detach(), *(t.grad for t in inputs), *params]


def graph_fn(gm: fx.GraphModule, example: list) -> object:
    """``gm`` (a captured graph: it takes the example inputs, buffers included) called as ``fn(*inputs)``."""
    return lambda *inputs: gm(*example)[0]


def assert_same(got: list[torch.Tensor], expected: list[torch.Tensor], **tol) -> None:
    assert len(got) == len(expected)
    for a, e in zip(got, expected):
        torch.testing.assert_close(a, e, **tol)


def leaves(*shape: int, n: int = 1, dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    return [torch.randn(*shape, dtype=dtype, requires_grad=True) for _ in range(n)]


def body_records(opt: nn.Module) -> list:
    return [r for r in attnopt.explain(opt).records if "inside" in r.extra]


# ----------------------------------------------------------------------------- the three forms


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_function_is_rewritten_with_exact_gradients(reentrant: bool, sdpa_calls: list[int]) -> None:
    """``checkpoint(attn, q, k, v)``; dynamo captures the reentrant form as the same op (run non-reentrant)."""
    model = CheckpointedFunction(reentrant).double()
    opt = attnopt.optimize(copy.deepcopy(model), variant="sdpa")
    counts = []
    for t in (8, 8, 12, 12):  # a second call, then another length (a recompile)
        inputs = leaves(2, 2, t, 8, n=3)
        before = len(sdpa_calls)
        got = grads_of(opt, opt._orig_mod, *inputs)
        counts.append(len(sdpa_calls) - before)
        assert_same(got, grads_of(model, model, *inputs))
    assert counts[1] == counts[3] == 2  # a warm call: the forward and the checkpoint's recomputation
    (record,) = {r.name: r for r in body_records(opt)}.values()
    assert record.rewritten
    assert record.name == "wrap_body_0_site0"
    assert "inside activation checkpointing (wrap_body_0), still checkpointed" in record.reason
    assert "activation checkpointing" in record.extra["inside"]


@pytest.mark.parametrize("form", ["checkpoint", "checkpoint_wrapper", "nested"])
def test_checkpointed_blocks_are_rewritten_with_exact_gradients(form: str, sdpa_calls: list[int]) -> None:
    model = CheckpointedBlocks(wrapper=form == "checkpoint_wrapper", nested=form == "nested").double()
    opt = attnopt.optimize(copy.deepcopy(model), variant="sdpa")
    x = leaves(2, 8, CONFIG.n_embd)[0]
    assert_same(grads_of(opt, opt._orig_mod, x), grads_of(model, model, x))
    before = len(sdpa_calls)
    assert_same(grads_of(opt, opt._orig_mod, x), grads_of(model, model, x))
    # each block recomputed once in the backward (also when nested: the inner checkpoint's is its own)
    per_site = 3 if form == "nested" else 2
    assert len(sdpa_calls) - before == per_site * CONFIG.n_layer
    records = body_records(opt)
    assert len(records) == CONFIG.n_layer and all(r.rewritten for r in records)
    assert all("causal" in r.reason for r in records)  # the tril buffer is proven inside the body
    names = [r.name for r in attnopt.explain(opt).records]
    assert len(names) == len(set(names))
    if form == "nested":
        assert all(r.name.count("wrap_body") == 2 for r in records)  # wrap_body_2_wrap_body_1_site0


def test_the_rewritten_graph_still_checkpoints_and_saves_what_the_original_saves() -> None:
    """The op call stays; the body holds the site; the caller's body is not edited; memory is the original's."""
    model = CheckpointedBlocks().double()
    x = leaves(2, 8, CONFIG.n_embd)[0]
    gm, example = capture(model, x)
    new = attnopt.rewrite(gm, example, variant="sdpa")
    hops = [n for n in new.graph.nodes if n.op == "call_function" and "checkpoint" in str(n.target)]
    assert len(hops) == CONFIG.n_layer
    for body in bodies(new):
        assert body.op == "tag_activation_checkpoint" and body.checkpointed
        sites = [m for m in body.module.children() if isinstance(m, AttentionSite)]
        assert len(sites) == 1
        assert not [n for n in body.module.graph.nodes if "softmax" in str(n.target)]
    for body in bodies(gm):  # the caller's graph and bodies are as captured
        assert [n for n in body.module.graph.nodes if "softmax" in str(n.target)]

    def saved_bytes(fn) -> tuple[int, torch.Tensor]:
        total = [0]

        def pack(t: torch.Tensor) -> torch.Tensor:
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn(*example)[0]
        return total[0], out

    plain = copy.deepcopy(model)
    plain.forward = lambda y: functools.reduce(lambda acc, b: b(acc), plain.h, y)  # the same blocks, no checkpoint
    (kept, out), (kept0, out0) = saved_bytes(new), saved_bytes(gm)
    assert kept == kept0  # only the checkpoints' inputs: the attention's activations are recomputed
    assert saved_bytes(lambda *a: (plain(x),))[0] > 2 * kept  # (without checkpointing far more is kept)
    torch.testing.assert_close(out, out0)


def test_a_body_shared_by_two_calls_is_rewritten_once_and_proven_for_both(sdpa_calls: list[int]) -> None:
    """Two op calls running one body: one site; a mask only one call passes as causal is not proven causal."""

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("first", torch.ones(8, 8, dtype=torch.bool).tril())
            self.register_buffer("second", torch.ones(8, 8, dtype=torch.bool))  # hides nothing: not causal

        def forward(self, q, k, v):
            a = checkpoint(masked, q, k, v, self.first, use_reentrant=False)
            return a + checkpoint(masked, k, q, v, self.second, use_reentrant=False)

    def masked(q, k, v, keep):
        s = (q @ k.transpose(-2, -1) * 0.3).masked_fill(~keep, float("-inf"))
        return torch.softmax(s, dim=-1) @ v

    model = Two().double()
    inputs = leaves(2, 2, 8, 8, n=3)
    gm, example = capture(model, *inputs)
    hops = [n for n in gm.graph.nodes if n.op == "call_function" and "checkpoint" in str(n.target)]
    hops[1].args[0].target = hops[0].args[0].target  # both calls now run wrap_body_0
    gm.graph.lint()
    gm.recompile()
    (shared,) = bodies(gm)
    assert len(shared.calls) == 2
    new = attnopt.rewrite(gm, example, variant="sdpa")
    (record,) = attnopt.explain(new).records
    assert record.rewritten and "causal" not in record.reason  # the two calls' masks differ
    assert_same(grads_of(graph_fn(new, example), model, *inputs), grads_of(model, model, *inputs))
    assert sdpa_calls


def test_rewrite_proves_a_checkpointed_graph_again_for_other_inputs() -> None:
    """``rewrite()`` of a captured graph called with float32 inputs after a float64 proof: the body's shapes
    follow the new inputs, and the graph as written keeps its own body (it is never the rewritten one)."""

    class Plain(nn.Module):
        def forward(self, q, k, v):
            return checkpoint(attention, q, k, v, use_reentrant=False)

    gm, example = capture(Plain(), *leaves(2, 2, 8, 8, n=3))
    new = attnopt.rewrite(gm, example, variant="sdpa")
    inputs = leaves(2, 2, 8, 8, n=3, dtype=torch.float32)
    got = grads_of(graph_fn(new, inputs), nn.Module(), *inputs)
    assert got[0].dtype == torch.float32
    assert_same(got, grads_of(graph_fn(gm, inputs), nn.Module(), *inputs))
    records = attnopt.explain(new).records
    assert [r.rewritten for r in records] == [True, True]  # proven for each signature
    assert [n for n in gm.wrap_body_0.graph.nodes if "softmax" in str(n.target)]


# ----------------------------------------------------------------------------- what changes between calls


def test_a_causal_buffer_written_after_the_proof_is_read_again(sdpa_calls: list[int]) -> None:
    model = CheckpointedBlocks().double()
    opt = attnopt.optimize(copy.deepcopy(model), variant="sdpa")
    x = leaves(2, 8, CONFIG.n_embd)[0]
    assert_same(grads_of(opt, opt._orig_mod, x), grads_of(model, model, x))
    for m in (model, opt._orig_mod):
        m.h[0].attn.bias.fill_(1.0)  # block 0 now attends to every key: the causal proof no longer holds
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = grads_of(opt, opt._orig_mod, x)
    assert any("no longer holds" in str(w.message) for w in caught)
    assert_same(got, grads_of(model, model, x))


def test_train_and_eval_switch_on_later_calls_with_dropout_inside_the_checkpoint(sdpa_calls: list[int]) -> None:
    """Active dropout in a checkpointed body: that graph runs as written through AOTAutograd (its replay is
    exact); in eval mode the same body is rewritten; switching back and forth stays exact."""
    model = CheckpointedBlocks(GPTConfig(**{**CONFIG.__dict__, "dropout": 0.3})).double()
    opt = attnopt.optimize(copy.deepcopy(model), variant="sdpa")
    x = leaves(2, 8, CONFIG.n_embd)[0]
    for mode in ("eval", "train", "eval", "train"):
        for m in (model, opt._orig_mod):
            getattr(m, mode)()
        results = []
        for fn, m in ((opt, opt._orig_mod), (model, model)):
            torch.manual_seed(3)
            results.append(grads_of(fn, m, x))
        assert_same(*results)
    report = attnopt.explain(opt)
    assert any("checkpointing around random ops" in f for f in report.failures)
    assert any(r.rewritten for r in body_records(opt))  # the eval-mode graph


def test_rewrite_leaves_attention_dropout_inside_a_checkpoint_alone() -> None:
    """``rewrite()`` has no backend to reroute the graph: the site itself is left alone, with why."""
    model = CheckpointedBlocks(GPTConfig(**{**CONFIG.__dict__, "dropout": 0.3})).double().train()
    gm, example = capture(model, leaves(2, 8, CONFIG.n_embd)[0])
    records = attnopt.explain(attnopt.rewrite(gm, example, variant="sdpa")).records
    assert len(records) == CONFIG.n_layer and not any(r.rewritten for r in records)
    assert all("dropout inside activation checkpointing" in r.reason for r in records)


def test_variant_auto_tunes_inside_the_checkpoint_without_breaking_the_recomputation(sdpa_calls: list[int]) -> None:
    """Tuning and the reference check run autograd passes of their own: outside the checkpoint's hooks."""
    model = CheckpointedBlocks().double()
    opt = attnopt.optimize(copy.deepcopy(model))
    x = leaves(2, 8, CONFIG.n_embd)[0]
    for _ in range(2):
        assert_same(grads_of(opt, opt._orig_mod, x), grads_of(model, model, x))
    records = body_records(opt)
    assert records and all(r.rewritten and r.extra.get("tuning") for r in records)


def test_a_candidate_with_its_own_backward_inside_the_checkpoint() -> None:
    model = CheckpointedBlocks().double()
    opt = attnopt.optimize(copy.deepcopy(model), variant="tiled64")
    x = leaves(2, 8, CONFIG.n_embd)[0]
    for _ in range(2):
        assert_same(grads_of(opt, opt._orig_mod, x), grads_of(model, model, x))
    assert all(r.rewrite == "tiled64" for r in body_records(opt))


def test_selective_checkpointing_policy_keeps_exact_gradients(sdpa_calls: list[int]) -> None:
    """A ``context_fn`` that saves matmuls: the saved outputs are matched by position, so the forward and the
    recomputation must run the same operations (tuning and checks run outside the policy's modes)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    saved = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    class Selective(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = Block(CONFIG)

        def forward(self, x):
            context = functools.partial(create_selective_checkpoint_contexts, policy)
            return checkpoint(self.block, x, use_reentrant=False, context_fn=context)

    model = Selective().double()
    opt = attnopt.optimize(copy.deepcopy(model))
    x = leaves(2, 8, CONFIG.n_embd)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            assert_same(grads_of(opt, opt._orig_mod, x), grads_of(model, model, x))
    assert sdpa_calls and all(r.rewritten for r in body_records(opt))


def test_compiled_checkpointed_blocks_are_exact_and_guard_their_buffers() -> None:
    """``compile=True``: Inductor gets the rewritten bodies; a causal buffer inside one is checked at the boundary."""
    model = CheckpointedBlocks().double()
    opt = attnopt.optimize(copy.deepcopy(model), variant="sdpa", compile=True)
    x = leaves(2, 8, CONFIG.n_embd)[0]
    assert_same(grads_of(opt, opt._orig_mod, x), grads_of(model, model, x))
    assert all(r.rewritten for r in body_records(opt)) and not attnopt.explain(opt).failures
    for m in (model, opt._orig_mod):
        m.h[1].attn.bias.fill_(1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_same(grads_of(opt, opt._orig_mod, x), grads_of(model, model, x))


def test_a_rewrite_inductor_cannot_compile_is_compiled_as_written_and_reported(monkeypatch) -> None:
    import torch._inductor.compile_fx as inductor

    real = inductor.compile_fx

    def refusing(gm, example_inputs, *args, **kwargs):
        if any(isinstance(m, AttentionSite) for m in gm.modules()):
            raise RuntimeError("no lowering for this")
        return real(gm, example_inputs, *args, **kwargs)

    monkeypatch.setattr(inductor, "compile_fx", refusing)
    model = CheckpointedFunction().double()
    opt = attnopt.optimize(copy.deepcopy(model), variant="sdpa", compile=True)
    inputs = leaves(2, 2, 8, 8, n=3)
    with pytest.warns(UserWarning, match="Inductor could not compile the rewritten graph"):
        got = grads_of(opt, opt._orig_mod, *inputs)
    assert_same(got, grads_of(model, model, *inputs))
    report = attnopt.explain(opt)
    assert any("no lowering for this" in f for f in report.failures)
    assert report.records and not any(r.rewritten for r in report.records)
    assert all("compiled as written" in r.reason for r in report.records)


def test_dynamos_restart_signal_from_inductor_is_not_taken_for_a_failure(monkeypatch) -> None:
    # dynamo asks to trace the frame again by raising TensorifyScalarRestartAnalysis (Inductor's pass that turns
    # scalars into tensors, with dynamic=True); the backend passes it on: the rewrite is compiled on the second trace
    import torch._inductor.compile_fx as inductor

    real = inductor.compile_fx
    restarts = []

    def restarting(gm, example_inputs, *args, **kwargs):
        if not restarts and any(isinstance(m, AttentionSite) for m in gm.modules()):
            restarts.append(1)
            raise torch._dynamo.exc.TensorifyScalarRestartAnalysis()
        return real(gm, example_inputs, *args, **kwargs)

    monkeypatch.setattr(inductor, "compile_fx", restarting)
    model = CheckpointedFunction().double()
    opt = attnopt.optimize(copy.deepcopy(model), variant="sdpa", compile=True)
    inputs = leaves(2, 2, 8, 8, n=3)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*Inductor could not compile")
        got = grads_of(opt, opt._orig_mod, *inputs)
    assert restarts == [1]
    assert_same(got, grads_of(model, model, *inputs))
    report = attnopt.explain(opt)
    assert not report.failures and any(r.rewritten for r in report.records)


# ----------------------------------------------------------------------------- other bodies


def test_attention_inside_wrap_is_rewritten_and_not_checkpointed(sdpa_calls: list[int]) -> None:
    from torch._higher_order_ops.wrap import wrap

    class Wrapped(nn.Module):
        def forward(self, q, k, v):
            return wrap(attention, q, k, v)

    model = Wrapped()
    inputs = leaves(2, 2, 8, 8, n=3)
    gm, example = capture(model, *inputs)
    new = attnopt.rewrite(gm, example, variant="sdpa")
    (body,) = bodies(new)
    assert body.op == "wrap" and not body.checkpointed
    (site,) = [m for m in body.module.children() if isinstance(m, AttentionSite)]
    (record,) = attnopt.explain(new).records
    assert record.rewritten and record.reason.endswith("inside wrap (wrap_body_0)")
    assert_same(grads_of(graph_fn(new, example), model, *inputs), grads_of(model, model, *inputs))
    assert sdpa_calls


def test_attention_inside_cond_is_reported_left_alone() -> None:
    class Branchy(nn.Module):
        def forward(self, q, k, v):
            return torch.cond(q.sum() > 0, attention, lambda a, b, c: attention(b, a, c), (q, k, v))

    model = Branchy()
    inputs = leaves(2, 2, 8, 8, n=3, dtype=torch.float32)
    opt = attnopt.optimize(copy.deepcopy(model), variant="sdpa")
    out = opt(*inputs)
    torch.testing.assert_close(out, model(*inputs))
    records = body_records(opt)
    assert len(records) == 2 and not any(r.rewritten for r in records)
    assert all("inside a `cond` body" in r.reason for r in records)


def test_a_graph_without_bodies_has_none() -> None:
    gm, _ = capture(CheckpointedFunction().double(), *leaves(2, 2, 8, 8, n=3))
    assert [b.path for b in bodies(gm)] == ["wrap_body_0"]
    assert bodies(fx.symbolic_trace(nn.Linear(4, 4))) == []


# ----------------------------------------------------------------------------- a real model


def _hf_model(name: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    if name == "gpt2":
        config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                         attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0, attn_implementation="eager")
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      attention_dropout=0.0, attn_implementation="eager")
    return transformers.LlamaForCausalLM(config)


def _sets_state_under_checkpoint(model: nn.Module) -> bool:
    """The attention modules' ``forward`` is the ``kernels`` package's hub-kernel wrapper (Hugging Face's
    ``use_kernelized_func``, installed with transformers >= 5.25): it sets a context variable on every call,
    a side effect dynamo refuses inside activation checkpointing, so the checkpointed layer runs as written."""
    return any("/kernels/" in getattr(getattr(type(m).forward, "__code__", None), "co_filename", "")
               for m in model.modules() if type(m).__name__.endswith("Attention"))


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hugging_face_model_with_gradient_checkpointing(name: str, sdpa_calls: list[int]) -> None:
    """Rewritten and still checkpointed, with exact gradients; where the installed transformers wraps the
    attention in a hub-kernel wrapper (Llama with transformers >= 5.25), dynamo cannot trace the checkpointed
    layer and it runs as written: exact, and no site claims a rewrite."""
    model = _hf_model(name)
    layers = model.config.num_hidden_layers
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = attnopt.optimize(copy.deepcopy(model), variant="sdpa")
    ids = torch.randint(0, 64, (2, 8))
    results = []
    for fn, m in ((opt, opt._orig_mod), (model, model)):
        m.zero_grad(set_to_none=True)
        before = len(sdpa_calls)
        loss = fn(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append([loss.detach(), *(p.grad for p in m.parameters())])
        if fn is opt:
            rewritten_calls = len(sdpa_calls) - before
    assert_same(*results, atol=1e-5, rtol=1e-4)
    records = body_records(opt)
    if _sets_state_under_checkpoint(model):
        assert name == "llama"  # GPT-2's attention has no hub-kernel wrapper
        assert not any(r.rewritten for r in attnopt.explain(opt).records) and rewritten_calls == 0
        return
    assert len(records) == layers and all(r.rewritten for r in records)
    assert all("still checkpointed" in r.reason for r in records)
    assert rewritten_calls >= 2 * layers  # the forward and the checkpoint's recomputation (and a first check)


@pytest.mark.parametrize("variant", ["sdpa", "auto"])
def test_an_optimized_module_checkpointed_eagerly_keeps_exact_gradients(variant: str, tmp_path, monkeypatch) -> None:
    """``checkpoint(attnopt.optimize(block), x)``: the sites' first-call tuning and reference check run
    apart from the checkpoint's hooks (they used to raise CheckpointError, or hang with "auto")."""
    import threading

    monkeypatch.setenv("ATTNOPT_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    block = Block(CONFIG).double().eval()
    opt = attnopt.optimize(copy.deepcopy(block), variant=variant)
    x = leaves(2, 8, CONFIG.n_embd)[0]
    result: dict[str, object] = {}

    def run() -> None:
        try:
            for t in (8, 6):  # a new shape on the second call: the tuning and check run again
                xt = x[:, :t].detach().requires_grad_()
                got = grads_of(lambda z: checkpoint(opt, z, use_reentrant=False), opt, xt)
                expected = grads_of(block, block, xt)
                assert_same(got, expected)
            result["ok"] = True
        except BaseException as e:  # noqa: BLE001 - reported to the test thread
            result["error"] = e

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout=240)
    assert not worker.is_alive(), "checkpoint(optimized module) hung"
    if "error" in result:
        raise result["error"]  # type: ignore[misc]
    assert result.get("ok")
