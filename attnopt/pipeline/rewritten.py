"""What ``rewrite(gm)`` returns: a graph module that proves its rewrite again for each new input signature.

A :class:`RewrittenGraphModule` keeps the user's graph module and, per signature of its inputs
(shapes, dtypes, devices, strides as :class:`SignaturePattern` reads them), the rewrite proven for
that signature (at most :data:`MAX_SIGNATURES`; beyond that calls run the graph as written).
:class:`SignatureGuard` decides which proven rewrite a call may use.
"""

from __future__ import annotations

import copy
import inspect
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from ..config import OptimizeConfig
from ..passes.canon import meta_value
from ..runtime.site import AttentionSite
from ..selection.selector import Selector
from .optimize import run_pipeline
from .report import Report
from .steps import copy_graph

log = logging.getLogger(__name__)

#: How many input signatures besides the proven one a rewritten GraphModule proves and keeps.
MAX_SIGNATURES = 8


_SHAPE_META = ("val", "example_value", "tensor_meta")


class RewrittenGraphModule(fx.GraphModule):
    """What :func:`~attnopt.api.rewrite` returns: the rewritten graph, run for the input signature it was proven on.

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


def plain_copy(gm: fx.GraphModule) -> fx.GraphModule:
    new = copy_graph(gm)
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


class SignaturePattern:
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

    def __deepcopy__(self, memo: dict[int, Any]) -> SignaturePattern:
        new = copy.copy(self)  # the shape environment and its expressions are shared, not copied
        new.bound = set(self.bound)
        return new

    @classmethod
    def before_proof(cls, gm: fx.GraphModule, example_inputs: Sequence[Any] | None) -> SignaturePattern:
        from ..passes.shapes import has_shapes

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


class SignatureGuard:
    """Dispatches a :class:`RewrittenGraphModule`'s calls by input signature."""

    def __init__(self, *, original: fx.GraphModule, delegate: fx.GraphModule | None, config: OptimizeConfig,
                 selector: Selector | None, report: Report, pattern: SignaturePattern) -> None:
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

    def __deepcopy__(self, memo: dict[int, Any]) -> SignatureGuard:
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

        provable = (key is not None and inputs is not None and len(self.proven) < MAX_SIGNATURES
                    and not any(isinstance(x, FakeTensor) or (isinstance(x, torch.Tensor) and x.is_meta)
                                for x in inputs)
                    and not torch.compiler.is_compiling())
        if not provable:
            if key is not None and len(self.proven) >= MAX_SIGNATURES and not self.warned:
                self.warned = True
                log.warning("attnopt: this rewritten GraphModule has been proven for %d input signatures; "
                            "calls with other signatures run the graph as written", MAX_SIGNATURES + 1)
            return self.original_target
        self.original_target.follow(gm)
        work = plain_copy(self.original)
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
