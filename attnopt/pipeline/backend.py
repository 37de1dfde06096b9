"""attnopt's dynamo backend: ``torch.compile(model, backend="attnopt")``.

Dynamo captures the graph (graph breaks, Python control flow, guards and recompiles for new
shapes are its job) and calls :func:`attnopt_backend` once per captured graph with the
graph's example inputs. The backend runs :func:`attnopt.pipeline.optimize.run_pipeline` and returns
the rewritten graph's ``forward`` (eager, no C++ compiler needed) or, with
``compile=True``, Inductor's compiled version of it. Any failure leaves the graph as
captured and warns with the cause: attnopt never breaks a model.

Registered as the ``attnopt`` entry point of the ``torch_dynamo_backends`` group.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from ..config import OptimizeConfig
from ..env import AUTO, source_key
from ..passes.hop import bodies
from ..runtime.guards import BufferGuard
from ..runtime.site import GUARDED_ARGS_START, AttentionSite
from ..selection.selector import Selector
from ..spec import LEFT_ALONE
from .optimize import run_pipeline
from .report import Report
from .steps import new_selector

log = logging.getLogger(__name__)

#: Report of the graphs compiled through ``backend="attnopt"`` by name (no ``optimize`` wrapper).
_DEFAULT_REPORT = Report()


def last_report() -> Report:
    """Sites seen by ``torch.compile(..., backend="attnopt")`` calls made without ``optimize``."""
    return _DEFAULT_REPORT


def attnopt_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], *,
                    config: OptimizeConfig | None = None, report: Report | None = None,
                    selector: Selector | None = None, **options: Any) -> Callable[..., Any]:
    """Dynamo backend: rewrite the attention in ``gm`` and return a callable that runs it."""
    config = config or OptimizeConfig(**options)
    if selector is None and config.candidate == AUTO:
        selector = new_selector(config.memory_budget, shared=True)  # one per budget for the process
    report = _DEFAULT_REPORT if report is None else report
    graph_id = report.graphs
    report.graphs += 1
    why = random_in_checkpoint(gm)
    if why is not None:
        # Run as written, but not on dynamo's eager replay of the checkpoint (see random_in_checkpoint).
        msg = f"graph {graph_id}: {why}; it runs as written through AOTAutograd, whose replay is exact"
        report.failures.append(msg)
        log.info("%s", msg)
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)
    try:
        new_gm, records = run_pipeline(gm, example_inputs, config, graph_id, selector)
    except Exception as e:  # noqa: BLE001 - never break the user's model; report why instead
        msg = f"graph {graph_id}: {type(e).__name__}: {e}"
        report.failures.append(msg)
        warnings.warn(f"attnopt: could not rewrite captured {msg}; it runs as written", stacklevel=2)
        log.warning("capture failed for %s", msg, exc_info=True)
        return _finish(gm, example_inputs, config)
    report.records.extend(records)
    try:
        return _finish(new_gm, example_inputs, config, fallback=gm)
    except Exception as e:  # noqa: BLE001 - Inductor could not take the rewrite: compile the graph as written
        if isinstance(e, torch._dynamo.exc.RestartAnalysis):
            raise  # dynamo's own signal to trace the frame again (e.g. scalars made tensors): not a failure
        if not (config.compile and any(r.rewritten for r in records)):
            raise
        msg = f"graph {graph_id}: Inductor could not compile the rewritten graph: {type(e).__name__}: {e}"
        report.failures.append(msg)
        warnings.warn(f"attnopt: {msg}; it is compiled as written", stacklevel=2)
        log.warning("%s", msg, exc_info=True)
        for r in records:
            if r.rewritten:
                r.decision, r.rewrite = LEFT_ALONE, ""
                r.reason = f"Inductor could not compile the rewritten graph ({type(e).__name__}); compiled as written"
        return _finish(gm, example_inputs, config)


#: Calls that draw random numbers (the eager replay of a checkpoint would draw them again).
_RANDOM_FUNCTIONS = frozenset(
    getattr(mod, name) for mod, names in (
        (torch.nn.functional, ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
                               "feature_alpha_dropout", "rrelu", "gumbel_softmax")),
        (torch, ("dropout", "rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "randperm",
                 "bernoulli", "multinomial", "normal", "poisson", "alpha_dropout", "feature_dropout")),
    ) for name in names if hasattr(mod, name))
_RANDOM_METHODS = frozenset(("bernoulli", "bernoulli_", "uniform_", "normal_", "random_", "exponential_",
                             "geometric_", "cauchy_", "log_normal_", "multinomial"))


def _draws_random(gm: fx.GraphModule) -> bool:
    for node in gm.graph.nodes:
        if node.op == "call_method" and node.target in _RANDOM_METHODS:
            return True
        if node.op == "call_function":
            if node.target in _RANDOM_FUNCTIONS and not _inactive_dropout(node):
                return True
            tags = getattr(node.target, "tags", ())
            if torch.Tag.nondeterministic_seeded in tags:
                return True
        if node.op == "call_module" and isinstance(gm.get_submodule(str(node.target)), torch.nn.Dropout):
            return True
    return any(_draws_random(sub) for sub in gm.children() if isinstance(sub, fx.GraphModule))


def _inactive_dropout(node: fx.Node) -> bool:
    """``F.dropout(x, 0.0, ...)`` or ``F.dropout(x, p, training=False)`` with constants: it draws nothing."""
    if "dropout" not in getattr(node.target, "__name__", ""):
        return False
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    training = node.args[2] if len(node.args) > 2 else node.kwargs.get("training", node.kwargs.get("train", True))
    return (isinstance(p, (int, float)) and p == 0) or training is False


def random_in_checkpoint(gm: fx.GraphModule) -> str | None:
    """Why ``gm`` must not run eagerly as captured: activation checkpointing around random ops, else None.

    Dynamo captures ``torch.utils.checkpoint.checkpoint`` as a higher-order op whose body it replays
    for the backward; run eagerly (any backend that returns the graph's ``forward``, as attnopt does)
    the replay draws new random numbers, so a dropout inside gets other masks in the backward than in
    the forward and the gradients are silently wrong (``torch.compile(backend="eager")`` shows the same).
    Bodies that draw nothing are rewritten inside, still checkpointed (``passes/hop.py``).
    """
    for node in gm.graph.nodes:
        if node.op != "call_function" or "checkpoint" not in getattr(node.target, "__name__", ""):
            continue
        body = node.args[0] if node.args else None
        if isinstance(body, fx.Node) and body.op == "get_attr":
            sub = gm.get_submodule(str(body.target))
            if isinstance(sub, fx.GraphModule) and _draws_random(sub):
                return f"activation checkpointing around random ops ({node.format_node()[:60]})"
    return None


class _FirstOrderOnly(torch.autograd.Function):
    """The identity, whose backward refuses to be recorded (``create_graph=True`` through it raises)."""

    @staticmethod
    def forward(ctx: Any, *xs: torch.Tensor) -> Any:
        return tuple(x.clone() for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        if torch.is_grad_enabled():  # the engine records the backward: create_graph=True
            raise RuntimeError(
                "attnopt: a backward with create_graph=True (a double backward) reaches a torch.autograd.Function "
                "of the model; dynamo's capture runs its backward without recording it, so the second-order "
                "terms through it would be silently lost. Run this model as written for double backward")
        return grads


def _custom_function_apply(*args: Any, **kwargs: Any) -> Any:
    """Dynamo's ``autograd_function_apply`` (a user's ``torch.autograd.Function``), its outputs marked so that a
    double backward through them raises (see :func:`guard_custom_functions`)."""
    out = torch.ops.higher_order.autograd_function_apply(*args, **kwargs)
    if not torch.is_grad_enabled():
        return out
    single = isinstance(out, torch.Tensor)
    outs = (out,) if single else tuple(out)
    marked = [i for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.requires_grad]
    if not marked:
        return out
    guarded = list(outs)
    for i, o in zip(marked, _FirstOrderOnly.apply(*(outs[i] for i in marked))):
        guarded[i] = o
    return guarded[0] if single else type(out)(guarded) if isinstance(out, tuple) else guarded


def guard_custom_functions(gm: fx.GraphModule) -> int:
    """Mark the outputs of every user ``torch.autograd.Function`` in ``gm`` (and its subgraphs).

    Run eagerly as dynamo captures it, such a Function's backward runs with gradients disabled (its backward
    body starts with ``_set_grad_enabled(False)``): a double backward (``autograd.grad(..., create_graph=True)``
    then another ``grad``) silently loses the second-order terms through the custom backward
    (``torch.compile(backend="eager")`` shows the same). With the outputs passed through
    :class:`_FirstOrderOnly`, first-order gradients are unchanged (the attention is still rewritten, its
    per-call dispatch kept) and a ``create_graph=True`` backward that reaches the Function raises instead.
    Returns how many calls were marked.
    """
    marked = 0
    apply = getattr(torch.ops.higher_order, "autograd_function_apply", None)
    for node in gm.graph.nodes:
        if node.op == "call_function" and apply is not None and node.target is apply:
            node.target = _custom_function_apply
            marked += 1
    if marked:
        gm.recompile()
    return marked + sum(guard_custom_functions(sub) for sub in gm.children() if isinstance(sub, fx.GraphModule))


def _finish(gm: fx.GraphModule, example_inputs: Sequence[Any], config: OptimizeConfig,
            fallback: fx.GraphModule | None = None) -> Callable[..., Any]:
    if not config.compile:
        guard_custom_functions(gm)
        return gm.forward
    from torch._inductor.compile_fx import compile_fx

    _tune_before_tracing(gm, example_inputs)
    for site in gm.modules():
        if isinstance(site, AttentionSite):
            # part of the site's state, so of the key under which Inductor's caches keep the compiled graph
            site.traced_by = source_key()
    compiled = compile_fx(gm, list(example_inputs))
    guards = _boundary_guards(gm)
    if not guards or fallback is None:
        return compiled
    original = fallback.forward

    def run(*args: Any) -> Any:
        # Inside compiled code the causal proof is baked in; check its buffers here.
        if all(g.holds(args[i]) for i, g in guards):
            return compiled(*args)
        return original(*args)

    return run


def _tune_before_tracing(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    """Run ``gm`` once eagerly so sites choose, and check their candidate, before Inductor bakes one in.

    "auto" sites tune; every site checks the candidate it will run against the reference on these
    inputs (a forced ``variant="flex"`` that is wrong here is replaced before it is compiled).
    """
    from torch._subclasses.fake_tensor import FakeTensor

    sites = [m for m in gm.modules() if isinstance(m, AttentionSite)]
    # A graph for dynamic shapes (sizes passed as SymInts) cannot run eagerly, and one run would check one shape
    # only: its sites run candidates checked at every shape (``DispatchingSite._for_every_shape``).
    if not sites or any(isinstance(x, (FakeTensor, torch.SymInt, torch.SymFloat, torch.SymBool))
                        for x in example_inputs):
        return
    # On copies of the buffers and inputs, with the random state restored: the run must leave no
    # trace (running statistics, in-place caches, counters, the RNG stream).
    buffers = {name: b.clone() for name, b in gm.named_buffers()}
    inputs = [x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
              for x in example_inputs]
    for site in sites:
        site.tuning_run = True
    try:
        cuda = sorted({x.device for x in inputs if isinstance(x, torch.Tensor) and x.device.type == "cuda"}, key=str)
        with torch.random.fork_rng(devices=cuda):
            torch.func.functional_call(gm, buffers, tuple(inputs), strict=False)
    except Exception as e:  # noqa: BLE001 - tuning is an optimisation; the sites then run their fallback
        log.warning("could not tune before compiling: %r", e)
    finally:
        for site in sites:
            site.tuning_run = False


def _boundary_guards(gm: fx.GraphModule) -> list[tuple[int, Any]]:
    """(input index, guard) for each buffer guard of a site that reads an input of ``gm`` (in ``gm``'s own
    graph, or in a higher-order op body that ``gm`` passes the input to)."""
    placeholders = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    out = []
    graphs: list[tuple[fx.GraphModule, Callable[[fx.Node], list[Any]]]] = [(gm, lambda n: [n])]
    graphs += [(b.module, lambda n, b=b: b.sources.get(n, [None])) for b in bodies(gm)]
    for owner, roots in graphs:
        for node in owner.graph.nodes:
            if node.op != "call_module":
                continue
            mod = owner.get_submodule(str(node.target))
            if isinstance(mod, AttentionSite) and mod.guards:
                for g, arg in zip(mod.guards, node.args[GUARDED_ARGS_START:]):
                    for root in roots(arg) if isinstance(arg, fx.Node) else []:
                        if root in placeholders and isinstance(g, BufferGuard):
                            out.append((placeholders[root], g))
    return out
