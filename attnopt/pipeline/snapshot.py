"""Leave no trace: ``explain(model, *args)`` runs the model once and puts back everything the run changed.

:func:`model_kept` snapshots what one call may change (parameters, buffers, plain attributes, the
random generators, tensors reachable from the inputs) and restores it afterwards; above the copy
limits it says which state it could not keep.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import random
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

#: Parameters are copied before explain's forward up to this many bytes in all; above it they are
#: checked by version counter only (a forward that writes a parameter in place is then reported).
EXPLAIN_PARAM_COPY_LIMIT = 1 << 28


#: Other tensors and numpy arrays the model holds (plain attributes such as a KV cache, values inside
#: containers and plain objects) are copied up to this many bytes in all, in the order they are found;
#: the rest are checked by version counter only (a forward that writes one in place is then reported).
EXPLAIN_STATE_COPY_LIMIT = 1 << 28


#: How deep explain looks for state under a module's ``__dict__``: plain objects' ``__dict__``s this
#: many levels, containers (lists, tuples, dicts, sets) nested this deep.
EXPLAIN_OBJECT_DEPTH = 2


EXPLAIN_NEST_DEPTH = 8


#: At most this many container items are snapshotted; beyond it a warning says what was left out.
EXPLAIN_ITEM_LIMIT = 1_000_000


#: Values with no state of their own to restore.
_ATOMS = (str, bytes, int, float, complex, type(None), type(Ellipsis), range, slice,
          torch.dtype, torch.device, torch.layout, torch.memory_format)


#: Objects of classes from these packages are not "plain": their ``__dict__`` is not the user's state
#: (a logger's manager holds every logger of the process; an fx.Graph is torch's).
_FOREIGN = frozenset(sys.stdlib_module_names) | {"builtins", "torch", "numpy"}


@contextlib.contextmanager
def model_kept(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[None]:
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
                          f"in place; above the {EXPLAIN_STATE_COPY_LIMIT} bytes explain copies of the tensors "
                          "and arrays the model holds, they were not snapshotted, so their values could not be "
                          "restored", stacklevel=4)
        if snap.stopped:
            warnings.warn(f"attnopt.explain: the model holds more than {EXPLAIN_ITEM_LIMIT} items of state; "
                          f"{', '.join(snap.stopped[:8])}{' ...' if len(snap.stopped) > 8 else ''} were not "
                          "snapshotted, so what the forward changed there stays changed", stacklevel=4)
        if problems:
            warnings.warn(f"attnopt.explain: could not restore {', '.join(problems)}", stacklevel=4)


class _Snapshot:
    """What a forward can change that is reachable from a module tree, kept to be put back in place.

    Walks the modules (those registered and any found in attributes), every value in their
    ``__dict__``s, into lists, tuples, dicts, sets and deques (``EXPLAIN_NEST_DEPTH`` deep) and into
    plain objects' ``__dict__``s (``EXPLAIN_OBJECT_DEPTH`` levels). Mutable containers (the
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
        if self.items > EXPLAIN_ITEM_LIMIT:
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
        if id(v) in self.seen or nest >= EXPLAIN_NEST_DEPTH:
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
        elif objects < EXPLAIN_OBJECT_DEPTH and _plain(v):
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
        budget = EXPLAIN_STATE_COPY_LIMIT
        out = []
        for t, name in self.tensors.values():
            if _is_lazy(t):
                continue
            kind = "param" if id(t) in params else "buffer" if id(t) in buffers else "state"
            if kind == "param":
                keep = self.param_bytes <= EXPLAIN_PARAM_COPY_LIMIT
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
