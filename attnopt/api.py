"""Public entry points: ``optimize``, ``rewrite``, ``explain``."""

from __future__ import annotations

import collections
import contextlib
import copy
import enum
import functools
import inspect
import logging
import os
import random
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from .backend import attnopt_backend
from .canon import meta_value
from .config import OptimizeConfig
from .pipeline import _copy, run_pipeline
from .report import Report
from .runtime import AUTO, AttentionSite
from .selector import Selector

log = logging.getLogger("attnopt")

_REPORT_ATTR = "_attnopt_report"
_SELECTOR_ATTR = "_attnopt_selector"


def optimize(model: nn.Module, *, variant: str = "auto", compile: bool = False, verify: bool = False,
             dynamic: bool | None = None, memory_budget: int | str | None = None,
             selector: Selector | None = None) -> nn.Module:
    """Return ``model`` with every provable attention site running through a faster candidate.

    The result is ``torch.compile(model, backend=<attnopt>)``: same call signature, same
    parameters, same outputs and gradients. Graphs are captured on the first call and again
    for new shapes (dynamo recompiles; with ``dynamic=None`` the second shape makes sizes
    symbolic). ``attnopt.explain(opt)`` shows what was found and decided.

    Args:
        model: the ``nn.Module`` to optimize; its code is not changed.
        variant: ``"auto"`` (time every legal candidate on this device for the real shapes and
            keep the fastest; see :mod:`attnopt.selector`), ``"sdpa"``, ``"eager"`` (rewrite
            nothing), or a registered candidate name (``attnopt.candidate_names()``). The
            environment variable ``ATTNOPT_VARIANT`` overrides it.
        compile: hand the rewritten graphs to Inductor (needs a C++ compiler on CPU).
        verify: on first inputs, run original and rewritten graphs and drop rewrites that
            differ beyond the dtype's tolerance (with a warning).
        dynamic: passed to ``torch.compile``.
        memory_budget: peak bytes one attention call may allocate (int, or e.g. ``"512MiB"``);
            with ``variant="auto"`` candidates above it are not chosen.
        selector: a :class:`~attnopt.selector.Selector` to use (e.g. with another cache or
            timer); by default one per optimized model, with the on-disk tuning cache.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"attnopt.optimize expects a torch.nn.Module, got {type(model).__name__}; "
                        "wrap a function in an nn.Module or use attnopt.rewrite on a GraphModule")
    variant = _variant_from_env(variant)
    if memory_budget is not None and variant != "auto" and os.environ.get("ATTNOPT_VARIANT"):
        raise ValueError(f"memory_budget needs variant='auto', but ATTNOPT_VARIANT={variant!r} is set in the "
                         "environment; unset it or drop memory_budget")
    config = OptimizeConfig(variant=variant, compile=compile, verify=verify, memory_budget=memory_budget)
    if selector is not None and config.memory_budget is not None:
        raise ValueError("pass memory_budget to the Selector you give, not to optimize()")
    if selector is not None and config.candidate != AUTO:
        log.warning("variant=%r: the selector passed to optimize() is not used", variant)
    if config.candidate == AUTO and selector is None:
        selector = Selector(memory_budget=config.memory_budget)
    report = Report()
    backend = functools.partial(attnopt_backend, config=config, report=report, selector=selector)
    opt = torch.compile(model, backend=backend, dynamic=dynamic)
    object.__setattr__(opt, _REPORT_ATTR, report)
    object.__setattr__(opt, _SELECTOR_ATTR, selector)
    return opt


def _variant_from_env(variant: str) -> str:
    env = os.environ.get("ATTNOPT_VARIANT", "").strip()
    if env and env != variant:
        log.info("ATTNOPT_VARIANT=%s overrides variant=%r", env, variant)
        return env
    return variant


def tune(model: nn.Module, inputs: Sequence[Any] | Callable[[int, int], Sequence[Any]], *,
         batch_sizes: Sequence[int] | None = None, seq_lens: Sequence[int] | None = None, grad: bool = False,
         progress: bool = True, **optimize_kwargs: Any) -> nn.Module:
    """Tune ahead of time: run ``model`` on every input (or sweep point) so each site chooses per shape.

    ``inputs`` is either a list of argument tuples, or ``make_inputs(batch_size, seq_len)`` with
    ``batch_sizes`` and ``seq_lens`` giving the sweep. ``model`` may be a model returned by
    :func:`optimize` (it is tuned in place) or a plain module (it is optimized first with
    ``optimize_kwargs``). The timings go to the tuning cache on disk, so later processes on
    the same machine start tuned. ``grad=True`` tunes the forward+backward shapes of training.
    Returns the optimized model. A tqdm bar shows progress.

    Under ``torch.distributed`` call it with the same sweep on every rank: rank 0 tunes each
    point and broadcasts its choice, so every rank runs the same kernels. (Shapes first met in a
    forward are chosen by each rank for itself: a collective there could hang.)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"attnopt.tune expects a torch.nn.Module, got {type(model).__name__}")
    if callable(inputs):
        if not batch_sizes or not seq_lens:
            raise ValueError("with make_inputs(batch_size, seq_len), give batch_sizes=[...] and seq_lens=[...]")
        make = inputs
        points = [(b, t) for b in batch_sizes for t in seq_lens]
        calls: list[Any] = [functools.partial(make, b, t) for b, t in points]
        labels = [f"B={b} T={t}" for b, t in points]
    else:
        if batch_sizes or seq_lens:
            raise ValueError("batch_sizes/seq_lens go with a make_inputs(batch_size, seq_len) function, "
                             "not with a list of inputs")
        seq = list(inputs)
        if not seq:
            raise ValueError("attnopt.tune needs at least one input")
        calls = [(lambda a=a: a if isinstance(a, (tuple, list)) else (a,)) for a in seq]
        labels = [f"input {i}" for i in range(len(seq))]
    optimized = isinstance(getattr(model, _REPORT_ATTR, None), Report)
    if optimized and optimize_kwargs:
        raise ValueError(f"model is already optimized; {sorted(optimize_kwargs)} apply to attnopt.optimize, "
                         "pass them there or pass the plain model to tune")
    opt = model if optimized else optimize(model, **optimize_kwargs)
    from tqdm.auto import tqdm

    selector = getattr(opt, _SELECTOR_ATTR, None)
    if selector is not None:
        selector.collective = True  # every rank runs this same sweep: rank 0 tunes, all run its choices
    try:
        _sweep(opt, labels, calls, grad, progress, tqdm)
    finally:
        if selector is not None:
            selector.collective = False
    if selector is not None:
        selector.share()
    return opt


def _sweep(opt: nn.Module, labels: list[str], calls: list[Any], grad: bool, progress: bool, tqdm: Any) -> None:
    for label, make_args in tqdm(list(zip(labels, calls)), desc="attnopt tune", unit="point", disable=not progress):
        args = tuple(make_args())
        log.info("tuning %s", label)
        # With grad=True the forward runs with autograd on, so the sites see (and the selector times,
        # forward and backward, on its own inputs) the training key; no backward touches .grad here.
        with torch.enable_grad() if grad else torch.no_grad():
            opt(*args)


def rewrite(gm: fx.GraphModule, example_inputs: Sequence[Any] | None = None, *, variant: str = "auto",
            verify: bool = False) -> fx.GraphModule:
    """Rewrite the attention in a GraphModule you already have (symbolic_trace, torch.export).

    ``gm`` is not modified; a new GraphModule sharing its parameters is returned, with the
    report in ``new_gm.meta["attnopt_report"]``. Graphs without shape metadata (``symbolic_trace``)
    need ``example_inputs``; causal masks read from buffers are proven on their current values.

    The proof reads the shapes it was given (a ``symbolic_trace`` graph's sizes come from
    ``example_inputs``: ``k.size(-1) ** -0.5`` is a number there), so the returned module runs the
    rewritten graph only for inputs with the signature the proof saw: tensor shapes, dtypes and
    devices, and the values of non-tensor inputs. A graph whose shapes are symbolic (``torch.export``
    with dynamic dims) serves every size its shape environment allows, provided the proof added no
    guard to it. Any other signature is proven again on its own inputs (kept for up to
    ``_MAX_SIGNATURES`` signatures, each added to the report) and beyond that runs as written.
    """
    if isinstance(gm, torch.export.ExportedProgram):
        raise TypeError("pass exported_program.module() (a GraphModule), not the ExportedProgram")
    if not isinstance(gm, fx.GraphModule):
        raise TypeError(f"attnopt.rewrite expects a torch.fx.GraphModule, got {type(gm).__name__}; "
                        "for an nn.Module use attnopt.optimize(model)")
    if example_inputs is not None:
        example_inputs = tuple(example_inputs)
        n = sum(1 for node in gm.graph.nodes if node.op == "placeholder")
        if len(example_inputs) != n:
            raise TypeError(f"the GraphModule takes {n} input(s), got {len(example_inputs)} example input(s)")
    config = OptimizeConfig(variant=_variant_from_env(variant), verify=verify)
    selector = Selector(memory_budget=config.memory_budget) if config.candidate == AUTO else None
    original = _plain_copy(gm)  # the graph as written, for other signatures (shares gm's parameters)
    pattern = _Pattern.before_proof(gm, example_inputs)
    new_gm, records = run_pipeline(gm, example_inputs, config, selector=selector)
    pattern.after_proof()
    report = Report(records=records, graphs=1)
    new_gm.meta["attnopt_report"] = report
    guarded = RewrittenGraphModule(new_gm, new_gm.graph, class_name=type(new_gm).__name__)
    guarded.meta = new_gm.meta
    guarded.training = new_gm.training
    guarded.__dict__["_attnopt_guard"] = _SignatureGuard(
        original=original, delegate=gm if isinstance(gm, RewrittenGraphModule) else None,
        config=config, selector=selector, report=report, pattern=pattern)
    return guarded


#: How many input signatures besides the proven one a rewritten GraphModule proves and keeps.
_MAX_SIGNATURES = 8

_SHAPE_META = ("val", "example_value", "tensor_meta")


class RewrittenGraphModule(fx.GraphModule):
    """What :func:`rewrite` returns: the rewritten graph, run for the input signature it was proven on.

    It is a ``GraphModule`` (``.graph``, ``.code``, its ``attnopt_site*`` submodules, parameters
    shared with the input graph module). Called with inputs of another signature (shapes, dtypes,
    devices, values of non-tensor inputs), it proves the input graph again on those inputs and runs
    that rewrite (cached per signature), or runs the graph as written. Calling ``.forward``
    directly, or interpreting ``.graph``, runs the proven rewrite whatever the inputs.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        guard = self.__dict__.get("_attnopt_guard")
        if guard is None:
            return super().__call__(*args, **kwargs)
        return guard.call(self, args, kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> RewrittenGraphModule:
        res = super().__deepcopy__(memo)
        guard = self.__dict__.get("_attnopt_guard")
        if guard is not None:
            res.__dict__["_attnopt_guard"] = copy.deepcopy(guard, memo)
        return res  # type: ignore[return-value]


def _plain_copy(gm: fx.GraphModule) -> fx.GraphModule:
    new = _copy(gm)
    new.meta.pop("attnopt_report", None)
    return new



class _Unkeyable(Exception):
    """An input whose value cannot be compared with a later call's (the call runs as written)."""


def _key(x: Any) -> Any:
    """A hashable description of what the proof may read from one input: metadata, not values."""
    if isinstance(x, _MetaKey):
        return x.key
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(int(d) for d in x.shape), x.dtype, x.device, x.layout)
    if isinstance(x, bool) or x is None or isinstance(x, (int, str, torch.dtype, torch.device, torch.layout)):
        return (type(x).__name__, x)
    if isinstance(x, float):
        return ("float", x.hex())  # tells -0.0 from 0.0; nan equals nan
    if isinstance(x, complex):
        return ("complex", x.real.hex(), x.imag.hex())
    if isinstance(x, (tuple, list)):
        return (type(x).__name__, tuple(_key(y) for y in x))
    if isinstance(x, dict):
        return ("dict", tuple((k, _key(v)) for k, v in x.items()))
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise _Unkeyable(type(x).__name__)
    try:
        hash(x)
    except TypeError as e:
        raise _Unkeyable(type(x).__name__) from e
    return ("object", type(x), x)


def _shape_env(values: Sequence[Any]) -> Any:
    for v in values:
        sizes: list[Any] = []
        if isinstance(v, torch.Tensor):
            sizes = list(v.shape)
        elif isinstance(v, (torch.SymInt, torch.SymFloat)):
            sizes = [v]
        for s in sizes:
            if isinstance(s, torch.SymInt):
                return s.node.shape_env
    return None


class _Pattern:
    """The input signature a proof saw: concrete (a key to compare) or symbolic (sizes to bind).

    A graph whose placeholders carry symbolic sizes was proven on symbols; that proof holds for every
    binding of them that satisfies the shape environment's guards and ranges, as long as the proof
    itself added no guard or replacement (one would mean it read a concrete size). Otherwise the
    signature is the concrete one: the example inputs', or the placeholders' metadata with each
    symbol at its hint.
    """

    def __init__(self) -> None:
        self.key: Any = None          # concrete signature; None: never matched concretely
        self.specs: list[Any] | None = None  # symbolic: per input ("tensor", dims, dtype, device) or ("sym", expr)
        self.env: Any = None
        self._env_state: Any = None
        self.bound: set[Any] = set()  # keys already found to bind the symbols (bounded)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Pattern:
        new = copy.copy(self)  # the shape environment and its expressions are shared, not copied
        new.bound = set(self.bound)
        return new

    @classmethod
    def before_proof(cls, gm: fx.GraphModule, example_inputs: Sequence[Any] | None) -> _Pattern:
        from .passes.shapes import has_shapes

        p = cls()
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        metas = [meta_value(n) for n in placeholders] if has_shapes(gm) else None
        env = _shape_env(metas) if metas is not None else None
        if env is not None:
            p.env, p.specs = env, [_spec(m) for m in metas]  # type: ignore[union-attr]
            p._env_state = _env_state(env)
        try:
            p.key = _key(tuple(_concrete(m) for m in metas)) if metas is not None else None
        except _Unkeyable:
            p.key = None
        if p.key is None and example_inputs is not None:
            try:
                p.key = _key(tuple(example_inputs))
            except _Unkeyable:
                p.key = None
        return p

    def after_proof(self) -> None:
        if self.env is not None and _env_state(self.env) != self._env_state:
            self.specs = None  # the proof specialised a symbol: only the concrete signature is proven
            log.info("attnopt.rewrite: the proof read a concrete size of a symbolic graph; "
                     "other sizes are proven again")

    def matches(self, key: Any, inputs: tuple[Any, ...] | None) -> bool:
        if self.key is not None and key == self.key:
            return True
        if self.specs is None or inputs is None or len(inputs) != len(self.specs):
            return False
        if key in self.bound:
            return True
        try:
            ok = _binds(self.specs, inputs, self.env)
        except Exception:  # noqa: BLE001 - anything unexpected: not proven for these inputs
            return False
        if ok and len(self.bound) < 256:
            self.bound.add(key)
        return ok


def _env_state(env: Any) -> Any:
    return (len(env.guards), dict(env.replacements), dict(env.var_to_range),
            len(getattr(env, "deferred_runtime_asserts", {}) or {}))


def _expr(s: Any) -> Any:
    if isinstance(s, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return s.node.expr
    return s


def _spec(m: Any) -> Any:
    if isinstance(m, torch.Tensor):
        return ("tensor", tuple(_expr(d) for d in m.shape), m.dtype, m.device, m.layout)
    if hasattr(m, "shape") and hasattr(m, "dtype"):  # TensorMetadata: no device recorded
        return ("tensor", tuple(_expr(d) for d in m.shape), m.dtype, None, None)
    if isinstance(m, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("sym", _expr(m))
    return ("value", _key(m))


def _concrete(m: Any) -> Any:
    """A placeholder's metadata as the value it stands for, symbols at their hints (fake tensors as such)."""

    def hint(s: Any) -> Any:
        if isinstance(s, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            h = s.node.hint
            if h is None:
                raise _Unkeyable("unbacked symbol")
            return h
        return s

    if isinstance(m, torch.Tensor):
        return _MetaKey(("tensor", tuple(int(hint(d)) for d in m.shape), m.dtype, m.device, m.layout))
    if hasattr(m, "shape") and hasattr(m, "dtype"):
        raise _Unkeyable("tensor metadata without a device")
    return hint(m)


class _MetaKey:
    """A key already computed (``_key`` returns it unchanged inside a tuple)."""

    def __init__(self, key: Any) -> None:
        self.key = key


def _binds(specs: list[Any], inputs: tuple[Any, ...], env: Any) -> bool:
    import sympy

    binding: dict[Any, Any] = {}
    later: list[tuple[Any, Any]] = []

    def dim(want: Any, got: Any) -> bool:
        if isinstance(want, (int, float, bool)):
            return want == got
        if isinstance(want, sympy.Symbol):
            if binding.setdefault(want, got) != got:
                return False
            return True
        later.append((want, got))
        return True

    for spec, x in zip(specs, inputs):
        if spec[0] == "tensor":
            _, dims, dtype, device, layout = spec
            if not isinstance(x, torch.Tensor) or x.dtype != dtype or x.dim() != len(dims):
                return False
            if (device is not None and x.device != device) or (layout is not None and x.layout != layout):
                return False
            if not all(dim(w, int(g)) for w, g in zip(dims, x.shape)):
                return False
        elif spec[0] == "sym":
            if isinstance(x, (bool, torch.Tensor)) or not isinstance(x, (int, float)) or not dim(spec[1], x):
                return False
        elif _key(x) != spec[1]:
            return False
    subs = {s: sympy.Integer(v) if isinstance(v, int) else sympy.Float(v) for s, v in binding.items()}

    def holds(expr: Any) -> bool:
        value = sympy.sympify(env.replace(sympy.sympify(expr))).xreplace(subs)
        return value is sympy.true or (value.is_number and bool(value))

    for expr, got in later:
        value = sympy.sympify(expr).xreplace(subs)
        if not value.is_number or value != got:
            return False
    for g in env.guards:
        if not holds(g.expr):
            return False
    for sym, target in env.replacements.items():
        if sym in subs and not holds(sympy.Eq(sym, target)):
            return False
    for sym, v in subs.items():
        vr = env.var_to_range.get(sym)
        if vr is not None and not (bool(vr.lower <= v) and bool(v <= vr.upper)):
            return False
    return True


class _SignatureGuard:
    """Dispatches a :class:`RewrittenGraphModule`'s calls by input signature."""

    def __init__(self, *, original: fx.GraphModule, delegate: fx.GraphModule | None, config: OptimizeConfig,
                 selector: Selector | None, report: Report, pattern: _Pattern) -> None:
        self.original = original      # the graph as written (parameters shared)
        self.delegate = delegate      # a RewrittenGraphModule that was rewritten again: it dispatches itself
        self.config = config
        self.selector = selector
        self.report = report
        self.pattern = pattern
        self.shared = {id(m) for m in original.modules()} - {id(original)}  # the input graph module's modules
        self.names = {str(n.target) for n in original.graph.nodes if n.op in ("get_attr", "call_module")}
        self.original_target = _Target(original, self.shared, self.names)
        self.proven: dict[Any, _Target] = {}
        self.warned = False
        params = inspect.signature(original.forward).parameters.values()
        self.flat = all(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
        self.n_inputs = sum(1 for n in original.graph.nodes if n.op == "placeholder")

    def __deepcopy__(self, memo: dict[int, Any]) -> _SignatureGuard:
        new = copy.copy(self)
        memo[id(self)] = new
        new.original = copy.deepcopy(self.original, memo)
        new.delegate = copy.deepcopy(self.delegate, memo)
        new.selector = copy.deepcopy(self.selector, memo)
        new.report = copy.deepcopy(self.report, memo)
        new.pattern = copy.deepcopy(self.pattern, memo)
        new.shared = {id(m) for m in new.original.modules()} - {id(new.original)}  # ids of the copies
        new.original_target = _Target(new.original, new.shared, self.names)
        new.proven = {}
        for key, target in self.proven.items():
            gm = copy.deepcopy(target.gm, memo)
            new.proven[key] = new.original_target if gm is new.original else _Target(gm, new.shared, self.names)
        return new

    def _inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
        """The call's inputs in placeholder order, or None when they cannot be lined up with them."""
        if not kwargs and self.flat and len(args) == self.n_inputs:
            return args
        try:
            bound = inspect.signature(self.original.forward).bind(*args, **kwargs)
        except TypeError:
            return None
        bound.apply_defaults()
        if bound.kwargs or not self.flat or len(bound.args) != self.n_inputs:
            return None
        return tuple(bound.args)

    def call(self, gm: RewrittenGraphModule, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        inputs = self._inputs(args, kwargs)
        try:
            key = _key(inputs) if inputs is not None else None
        except _Unkeyable:
            key = None
        if key is not None and self.pattern.matches(key, inputs):
            return super(RewrittenGraphModule, gm).__call__(*args, **kwargs)
        if self.delegate is not None:
            return self.delegate(*args, **kwargs)
        target = self.proven.get(key) if key is not None else None
        if target is None:
            target = self._prove(gm, key, inputs)
        target.follow(gm)
        return target.gm(*args, **kwargs)

    def _prove(self, gm: RewrittenGraphModule, key: Any, inputs: tuple[Any, ...] | None) -> _Target:
        from torch._subclasses.fake_tensor import FakeTensor

        provable = (key is not None and inputs is not None and len(self.proven) < _MAX_SIGNATURES
                    and not any(isinstance(x, FakeTensor) or (isinstance(x, torch.Tensor) and x.is_meta)
                                for x in inputs)
                    and not torch.compiler.is_compiling())
        if not provable:
            if key is not None and len(self.proven) >= _MAX_SIGNATURES and not self.warned:
                self.warned = True
                log.warning("attnopt: this rewritten GraphModule has been proven for %d input signatures; "
                            "calls with other signatures run the graph as written", _MAX_SIGNATURES + 1)
            return self.original_target
        self.original_target.follow(gm)
        work = _plain_copy(self.original)
        for node in work.graph.nodes:  # shapes from these inputs, not the ones first proven
            for k in _SHAPE_META:
                node.meta.pop(k, None)
        graph_id = self.report.graphs
        try:
            new, records = run_pipeline(work, inputs, self.config, graph_id, self.selector)
        except Exception as e:  # noqa: BLE001 - never break the user's model: run it as written
            msg = f"graph {graph_id}: {type(e).__name__}: {e}"
            self.report.failures.append(msg)
            log.warning("attnopt.rewrite: could not prove the graph again for new inputs (%s); "
                        "they run as written", msg)
            new, records = self.original, []
        self.report.graphs += 1
        self.report.records.extend(records)
        target = self.original_target if new is self.original else _Target(new, self.shared, self.names)
        self.proven[key] = target
        return target


def _path(root: nn.Module, target: str) -> tuple[nn.Module, str] | None:
    *parents, name = target.split(".")
    mod = root
    for p in parents:
        mod = mod._modules.get(p)  # type: ignore[assignment]
        if mod is None:
            return None
    return mod, name


def _lookup(root: nn.Module, target: str) -> tuple[str, Any] | None:
    where = _path(root, target)
    if where is None:
        return None
    mod, name = where
    for kind in ("_parameters", "_buffers", "_modules"):
        d = getattr(mod, kind)
        if name in d:
            return kind, d[name]
    if name in mod.__dict__:
        return "__dict__", mod.__dict__[name]
    return None


class _Target:
    """A graph module a :class:`RewrittenGraphModule` dispatches to, kept in step with it.

    It shares the input graph module's submodules and tensors; what the rewritten module holds
    now (a buffer replaced, ``.to()``, a submodule swapped, its training mode) is copied into the
    target's own namespaces before each call, never into a shared submodule.
    """

    def __init__(self, gm: fx.GraphModule, shared: set[int], names: set[str]) -> None:
        self.gm = gm
        self.owned = {id(m) for m in gm.modules() if id(m) not in shared}
        self.sites = [m for m in gm.modules() if isinstance(m, AttentionSite)]
        # Only names the graph as written reads: the rewrite's own site modules are never replaced.
        self.targets = [t for t in dict.fromkeys(str(n.target) for n in gm.graph.nodes
                                                 if n.op in ("get_attr", "call_module")) if t in names]

    def follow(self, owner: nn.Module) -> None:
        if self.gm.training != owner.training:
            self.gm.training = owner.training
            for m in self.sites:
                m.training = owner.training
        for target in self.targets:
            mine = _lookup(owner, target)
            if mine is None:
                continue
            where = _path(self.gm, target)
            if where is None or id(where[0]) not in self.owned:
                continue
            theirs = _lookup(self.gm, target)
            if theirs is not None and theirs[1] is mine[1]:
                continue
            mod, name = where
            for kind in ("_parameters", "_buffers", "_modules"):
                getattr(mod, kind).pop(name, None)
            mod.__dict__.pop(name, None)
            if mine[0] == "__dict__":
                mod.__dict__[name] = mine[1]
            else:
                getattr(mod, mine[0])[name] = mine[1]


def explain(model: nn.Module | fx.GraphModule, *args: Any, variant: str = "auto", **kwargs: Any) -> Report:
    """What attnopt finds and decides for ``model`` called with ``args``/``kwargs``.

    For a model returned by ``optimize`` called without inputs, the report of what it has
    captured so far. Otherwise the model is captured on the inputs (one forward run, no
    gradients) and the report is returned; nothing about ``model`` changes: its parameters and
    buffers (the same tensor objects, their values and ``requires_grad``), its attributes and
    training flags, tensors it holds as plain attributes (a KV cache) or inside lists, tuples, dicts,
    sets and plain objects (their contents too, restored in place), and the random number
    generators' states (torch's, Python's, numpy's) are restored after the forward, also when it
    raises. Above a memory budget, tensors are not copied; a write to one is then reported.
    """
    report = getattr(model, _REPORT_ATTR, None)
    if isinstance(report, Report):
        if args or kwargs:
            _check_call(model, args, kwargs)
            with _model_kept(getattr(model, "_orig_mod", model), args, kwargs), torch.no_grad():
                model(*args, **kwargs)
        return report
    if isinstance(model, fx.GraphModule) and "attnopt_report" in model.meta:
        return model.meta["attnopt_report"]
    if not isinstance(model, nn.Module):
        raise TypeError(f"attnopt.explain expects a torch.nn.Module, got {type(model).__name__}")
    _check_call(model, args, kwargs)
    report = Report()
    config = OptimizeConfig(variant=_variant_from_env(variant))
    backend = functools.partial(attnopt_backend, config=config, report=report)
    with _model_kept(model, args, kwargs), torch.no_grad():
        torch.compile(model, backend=backend)(*args, **kwargs)
    return report


#: Parameters are copied before explain's forward up to this many bytes in all; above it they are
#: checked by version counter only (a forward that writes a parameter in place is then reported).
_EXPLAIN_PARAM_COPY_LIMIT = 1 << 28
#: Other tensors and numpy arrays the model holds (plain attributes such as a KV cache, values inside
#: containers and plain objects) are copied up to this many bytes in all, in the order they are found;
#: the rest are checked by version counter only (a forward that writes one in place is then reported).
_EXPLAIN_STATE_COPY_LIMIT = 1 << 28
#: How deep explain looks for state under a module's ``__dict__``: plain objects' ``__dict__``s this
#: many levels, containers (lists, tuples, dicts, sets) nested this deep.
_EXPLAIN_OBJECT_DEPTH = 2
_EXPLAIN_NEST_DEPTH = 8
#: At most this many container items are snapshotted; beyond it a warning says what was left out.
_EXPLAIN_ITEM_LIMIT = 1_000_000

#: Values with no state of their own to restore.
_ATOMS = (str, bytes, int, float, complex, type(None), type(Ellipsis), range, slice,
          torch.dtype, torch.device, torch.layout, torch.memory_format)
#: Objects of classes from these packages are not "plain": their ``__dict__`` is not the user's state
#: (a logger's manager holds every logger of the process; an fx.Graph is torch's).
_FOREIGN = frozenset(sys.stdlib_module_names) | {"builtins", "torch", "numpy"}


@contextlib.contextmanager
def _model_kept(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[None]:
    """Restore everything a forward of ``model`` can change about it, and the random state.

    What is reachable from the modules' ``__dict__``s is snapshotted (:class:`_Snapshot`): each
    module's ``__dict__`` (parameters, buffers, submodules, hooks, attributes, training flag), the
    lists, tuples, dicts and sets in it and plain objects' ``__dict__``s two levels down, their
    contents restored in place; every tensor found (parameters, buffers, a plain tensor attribute
    such as a KV cache, a tensor in a container) is the same object afterwards with its value
    (restored with ``copy_`` only when it changed), ``requires_grad`` and ``.grad``; numpy arrays,
    and generators the model holds (``torch.Generator``, ``random.Random``, numpy's) likewise. The
    CPU and CUDA generators are forked; Python's ``random`` and numpy's global state (when numpy is
    imported) are saved and set back. Nothing is replaced by a copy: a reference the user holds to
    any of these objects sees it restored.
    """
    snap = _Snapshot(model)
    tensors = snap.tensors_kept()
    devices = sorted({t.device.index or 0 for t, *_ in tensors if t.is_cuda}
                     | {x.device.index or 0 for x in [*args, *kwargs.values()]
                        if isinstance(x, torch.Tensor) and x.is_cuda})
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        devices = sorted(set(devices) | {torch.cuda.current_device()})
    py_state = random.getstate()
    np = sys.modules.get("numpy")
    try:
        np_state = np.random.get_state() if np is not None else None
    except Exception:  # noqa: BLE001 - numpy half imported
        np_state = None
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(py_state)
        if np_state is not None:
            np.random.set_state(np_state)
        problems = snap.restore()
        lost_params: list[str] = []
        lost: list[tuple[str, int]] = []
        for t, saved, requires_grad, version, grad, name, kind in tensors:
            try:
                with torch.no_grad():
                    if saved is not None:
                        if (version is None or _version(t) != version) or not _equal(t, saved):
                            if t.shape != saved.shape or t.stride() != saved.stride():
                                t.set_(saved)  # resized or set_ to other storage: the same object again
                            else:
                                t.copy_(saved)
                    elif version is not None and _version(t) != version:
                        if kind == "param":
                            lost_params.append(name)
                        else:
                            lost.append((name, _nbytes(t)))
                if t.is_leaf:
                    if t.requires_grad != requires_grad:
                        t.requires_grad_(requires_grad)
                    if t.grad is not grad:
                        t.grad = grad
            except Exception as e:  # noqa: BLE001 - restore the rest, then say what was not
                problems.append(f"{name} ({type(e).__name__}: {e})")
        lost += snap.arrays_lost
        if lost_params:
            warnings.warn(f"attnopt.explain: the forward wrote parameter(s) {', '.join(lost_params)} in place; "
                          f"the model's parameters ({snap.param_bytes} bytes) are above the size explain copies, "
                          "so their values could not be restored", stacklevel=4)
        if lost:
            warnings.warn(f"attnopt.explain: the forward wrote {', '.join(f'{n} ({b} bytes)' for n, b in lost)} "
                          f"in place; above the {_EXPLAIN_STATE_COPY_LIMIT} bytes explain copies of the tensors "
                          "and arrays the model holds, they were not snapshotted, so their values could not be "
                          "restored", stacklevel=4)
        if snap.stopped:
            warnings.warn(f"attnopt.explain: the model holds more than {_EXPLAIN_ITEM_LIMIT} items of state; "
                          f"{', '.join(snap.stopped[:8])}{' ...' if len(snap.stopped) > 8 else ''} were not "
                          "snapshotted, so what the forward changed there stays changed", stacklevel=4)
        if problems:
            warnings.warn(f"attnopt.explain: could not restore {', '.join(problems)}", stacklevel=4)


class _Snapshot:
    """What a forward can change that is reachable from a module tree, kept to be put back in place.

    Walks the modules (those registered and any found in attributes), every value in their
    ``__dict__``s, into lists, tuples, dicts, sets and deques (``_EXPLAIN_NEST_DEPTH`` deep) and into
    plain objects' ``__dict__``s (``_EXPLAIN_OBJECT_DEPTH`` levels). Mutable containers (the
    ``__dict__``s among them) keep a list of their items; tensors, numpy arrays and generators
    are collected for their values.
    """

    def __init__(self, model: nn.Module) -> None:
        self.np = sys.modules.get("numpy")
        self.seen: set[int] = set()
        self.alive: list[Any] = []  # every object walked stays alive until restored: no id is reused
        self.modules: list[nn.Module] = []
        self.classes: list[tuple[Any, type]] = []
        self.containers: list[tuple[Any, list[Any]]] = []
        self.tensors: dict[int, tuple[torch.Tensor, str]] = {}
        self.arrays: list[tuple[Any, Any, str]] = []
        self.arrays_lost: list[tuple[str, int]] = []
        self.generators: list[tuple[Any, Any, str]] = []
        self.items = 0
        self.stopped: list[str] = []
        self.param_bytes = 0
        self.queue: collections.deque[tuple[nn.Module, str]] = collections.deque()
        self._module(model, "")
        while self.queue:
            self._walk_module(*self.queue.popleft())

    def _module(self, m: nn.Module, path: str) -> None:
        if id(m) in self.seen:
            return
        self.seen.add(id(m))
        self.modules.append(m)
        self.classes.append((m, type(m)))  # e.g. a lazy module becomes its full class
        self.queue.append((m, path))

    def _walk_module(self, m: nn.Module, path: str) -> None:
        prefix = f"{path}." if path else ""
        d = m.__dict__
        self.seen.add(id(d))
        for k, v in self._keep(d, list(d.items()), path or type(m).__name__):
            if k in ("_parameters", "_buffers", "_modules") and isinstance(v, dict) and id(v) not in self.seen:
                self.seen.add(id(v))
                self.alive.append(v)
                for name, x in self._keep(v, list(v.items()), prefix + k):
                    if isinstance(x, nn.Module):
                        self._module(x, prefix + name)
                    elif isinstance(x, torch.Tensor):
                        self.tensors.setdefault(id(x), (x, prefix + name))
            elif not isinstance(v, _ATOMS):
                self._visit(v, prefix + k, 0, 0)

    def _keep(self, obj: Any, items: list[Any], path: str) -> list[Any]:
        self.items += len(items)
        if self.items > _EXPLAIN_ITEM_LIMIT:
            self.stopped.append(path)
            return []
        self.containers.append((obj, items))
        return items

    def _visit(self, v: Any, path: str, objects: int, nest: int) -> None:
        if isinstance(v, torch.Tensor):
            self.tensors.setdefault(id(v), (v, path))
            return
        if isinstance(v, nn.Module):
            self._module(v, path)
            return
        if id(v) in self.seen or nest >= _EXPLAIN_NEST_DEPTH:
            return
        self.seen.add(id(v))
        self.alive.append(v)
        np = self.np
        if isinstance(v, dict):
            for k, x in self._keep(v, list(v.items()), path):
                if not isinstance(k, _ATOMS):
                    self._visit(k, f"{path} key", objects, nest + 1)
                if not isinstance(x, _ATOMS):
                    self._visit(x, f"{path}[{_short(k)}]", objects, nest + 1)
            return
        if isinstance(v, (list, set, collections.deque)):
            items = self._keep(v, list(v), path)
        elif isinstance(v, (tuple, frozenset)):
            items = list(v)
        else:
            items = None
        if items is not None:
            for i, x in enumerate(items):
                if not isinstance(x, _ATOMS):
                    self._visit(x, f"{path}[{i}]", objects, nest + 1)
            return
        state = _generator_state(v, np)
        if state is not None:
            self.generators.append((v, state, path))
        elif np is not None and isinstance(v, np.ndarray):
            self.arrays.append((v, None, path))
        elif objects < _EXPLAIN_OBJECT_DEPTH and _plain(v):
            self.classes.append((v, type(v)))
            d = vars(v)
            self.seen.add(id(d))
            for k, x in self._keep(d, list(d.items()), path):
                if not isinstance(x, _ATOMS):
                    self._visit(x, f"{path}.{k}", objects + 1, nest + 1)

    def tensors_kept(self) -> list[tuple[torch.Tensor, torch.Tensor | None, bool, int | None, Any, str, str]]:
        """``(tensor, its copy or None, requires_grad, version, grad, name, kind)`` for each tensor found."""
        params = {id(p) for m in self.modules for p in m._parameters.values() if p is not None}
        buffers = {id(b) for m in self.modules for b in m._buffers.values() if b is not None}
        self.param_bytes = sum(_nbytes(self.tensors[i][0]) for i in params if i in self.tensors)
        budget = _EXPLAIN_STATE_COPY_LIMIT
        out = []
        for t, name in self.tensors.values():
            if _is_lazy(t):
                continue
            kind = "param" if id(t) in params else "buffer" if id(t) in buffers else "state"
            if kind == "param":
                keep = self.param_bytes <= _EXPLAIN_PARAM_COPY_LIMIT
            elif kind == "buffer":
                keep = True
            else:
                keep = _nbytes(t) <= budget
                budget -= _nbytes(t) if keep else 0
            saved = None
            if keep:
                try:
                    saved = t.detach().clone()
                except Exception:  # noqa: BLE001 - a subclass that cannot be cloned: checked by version only
                    saved = None
            grad = t.grad if t.is_leaf else None
            out.append((t, saved, t.requires_grad, _version(t), grad, name, kind))
        for i, (a, _, name) in enumerate(self.arrays):
            keep = a.nbytes <= budget
            budget -= a.nbytes if keep else 0
            self.arrays[i] = (a, a.copy() if keep else None, name)
        return out

    def restore(self) -> list[str]:
        """Put every container's items, object's class, generator's state and array's values back."""
        problems = []
        for obj, cls in self.classes:
            if type(obj) is not cls:
                try:
                    obj.__class__ = cls
                except TypeError as e:
                    problems.append(f"the class of {type(obj).__name__} ({e})")
        for obj, items in self.containers:
            try:
                _put_back(obj, items)
            except Exception as e:  # noqa: BLE001 - restore the rest, then say what was not
                problems.append(f"a {type(obj).__name__} ({type(e).__name__}: {e})")
        for g, state, name in self.generators:
            try:
                _set_generator_state(g, state, self.np)
            except Exception as e:  # noqa: BLE001
                problems.append(f"{name} ({type(e).__name__}: {e})")
        for a, saved, name in self.arrays:
            try:
                if saved is None:
                    continue  # arrays have no version counter: a write is not seen
                if a.shape != saved.shape or a.dtype != saved.dtype:
                    problems.append(f"{name} (reshaped in place)")
                elif not self.np.array_equal(a, saved):
                    self.np.copyto(a, saved)
            except Exception as e:  # noqa: BLE001
                problems.append(f"{name} ({type(e).__name__}: {e})")
        return problems


def _short(k: Any) -> str:
    r = repr(k)
    return r if len(r) <= 40 else r[:37] + "..."


def _plain(v: Any) -> bool:
    """An instance of a user's class (not the standard library's, torch's or numpy's) with a ``__dict__``."""
    if isinstance(v, (type, enum.Enum)):
        return False
    top = (getattr(type(v), "__module__", None) or "builtins").partition(".")[0]
    if top in _FOREIGN:
        return False
    try:
        return type(vars(v)) is dict
    except TypeError:
        return False


def _generator_state(g: Any, np: Any) -> Any:
    if isinstance(g, torch.Generator):
        return g.get_state()
    if isinstance(g, random.Random):
        return g.getstate()
    if np is not None:
        if isinstance(g, np.random.Generator):
            return g.bit_generator.state
        if isinstance(g, np.random.RandomState):
            return g.get_state()
        if isinstance(g, np.random.BitGenerator):
            return g.state
    return None


def _set_generator_state(g: Any, state: Any, np: Any) -> None:
    if isinstance(g, torch.Generator):
        g.set_state(state)
    elif isinstance(g, random.Random):
        g.setstate(state)
    elif isinstance(g, np.random.Generator):
        g.bit_generator.state = state
    elif isinstance(g, np.random.RandomState):
        g.set_state(state)
    else:
        g.state = state


def _put_back(obj: Any, items: list[Any]) -> None:
    """Give a dict, list, set or deque its snapshotted items again, in place (only when they differ)."""
    if isinstance(obj, dict):
        now = list(obj.items())
        if len(now) == len(items) and all(a[0] is b[0] and a[1] is b[1] for a, b in zip(now, items)):
            return
        obj.clear()
        obj.update(items)
        return
    now = list(obj)
    if len(now) == len(items) and all(a is b for a, b in zip(now, items)):
        return
    if isinstance(obj, list):
        obj[:] = items
    elif isinstance(obj, set):
        obj.clear()
        obj.update(items)
    else:
        obj.clear()
        obj.extend(items)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except (RuntimeError, AttributeError):  # inference tensors have no version counter
        return None


def _is_lazy(t: torch.Tensor) -> bool:
    return isinstance(t, nn.parameter.UninitializedTensorMixin)


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    except RuntimeError:
        return False

def _check_call(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    fn = getattr(model, "_orig_mod", model).forward
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"these inputs do not match {type(getattr(model, '_orig_mod', model)).__name__}"
                        f".forward{sig}: {e}") from e


__all__ = ["optimize", "rewrite", "explain", "tune"]
