"""The cached causal LM at run time: ``prefill``/``step``, and the watch over the model it was built from.

:class:`CachedLM` runs new tokens only, attending to the caches of its
:class:`~attnopt.runtime.kv_cache.KVCacheAttention` sites. :class:`Watch` (built by
:func:`watch_model`) pins the model's tensors the cached graph reads, the buffers its causal
proofs read and the plain attributes the capture made constants, and raises
:class:`ModelChangedError` when one changes in a way the cache does not follow.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import enum
import functools
import operator
import sys
import types
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from tabulate import tabulate

from ..env import parse_bytes
from ..kernels.bands import is_band
from ..spec import PositionError
from .kv_cache import KVCacheAttention, MaskCheck, Rows
from .linear import decisions as linear_decisions


class ModelChangedError(RuntimeError):
    """The model changed after :func:`~attnopt.pipeline.kv.cached` in a way the cached model does not follow.

    A tensor the cached graph computes with was replaced by another object (assigned, deleted and
    registered again, ``load_state_dict(..., assign=True)``) or converted to another dtype or device
    (``model.double()``, ``.bfloat16()``, ``.to(device)``: the same objects with other data); a buffer a
    causal proof read (nanoGPT's ``tril`` mask) no longer holds the proven pattern; a plain attribute of a
    submodule or of a config dataclass it holds (a number, flag, string, dtype, ... that the capture made a
    constant), its ``training`` flag (``model.train()``), its submodules or its forward hooks differ from
    the capture. The message names the tensor, module or attribute; build the cached model again with
    ``attnopt.generation.cached(model)`` (which refuses a model that is no longer causal). An attribute set
    back to its value at capture (``model.eval()`` again) makes the cached model serve again.
    """


def _held(ref: weakref.ref) -> nn.Module:
    """The model behind a weak reference (a cached model must not keep its model alive), or why not."""
    model = ref()
    if model is None:
        raise ModelChangedError("the model this cached model was built from was deleted; build one for the "
                                "model you use now with attnopt.generation.cached(model)")
    return model


@dataclass
class _Pin:
    """One model tensor the cached model depends on, by its name in the model."""

    path: str
    tensor: torch.Tensor  # the object at capture (held: identity, not the address, which the allocator reuses)
    read: bool  # the cached graph or a mask check computes with this very object
    patterns: list[tuple[tuple[Any, ...], tuple[Any, ...], str]] = field(default_factory=list)  # (cuts, values, site)
    checks: list[MaskCheck] = field(default_factory=list)  # run-time mask checks that read its values
    version: int = 0
    ptr: int = 0
    dtype: torch.dtype | None = None  # at capture: the graph's ops were captured for it
    device: torch.device | None = None
    inference: bool = False  # an inference tensor has no version counter: only its storage is watched

    def __post_init__(self) -> None:
        self.dtype, self.device, self.inference = self.tensor.dtype, self.tensor.device, self.tensor.is_inference()
        self.version, self.ptr = _stamp(self.tensor)


def global_state(device_type: str = "cpu") -> tuple[Any, ...]:
    """The global settings a capture bakes into the graph's dtypes: the default dtype (``torch.ones(T, T)``) and
    autocast, on the CPU and on ``device_type``."""
    kinds = dict.fromkeys(("cpu", device_type))
    return (torch.get_default_dtype(),
            *((kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)) for kind in kinds))


def _stamp(t: torch.Tensor) -> tuple[int, int]:
    """What moves when ``t``'s values may have changed: its version counter (in-place writes) and storage
    address (``.data =``, dtype and device conversions)."""
    return (-1 if t.is_inference() else t._version), t.data_ptr()


_MISSING = object()


_VERSION = operator.attrgetter("_version")


#: nn.Module's own bookkeeping in ``__dict__`` (hook dicts, ``_compiled_call_impl``, ...), not the model's attributes.
_MODULE_INTERNALS = frozenset(nn.Module().__dict__) - {"training"}


try:  # numpy's scalars (``np.float32(0.5)``) are plain values; its arrays are compared by value when small
    import numpy as _np

    _NUMPY_SCALARS: tuple[type, ...] = (_np.generic,)
    _ARRAYS: tuple[type, ...] = (_np.ndarray,)
except ImportError:  # pragma: no cover - numpy ships with every torch wheel attnopt supports
    _NUMPY_SCALARS = _ARRAYS = ()

_PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.memory_format,
          torch.layout, enum.Enum, *_NUMPY_SCALARS)

#: A numpy array forward reads is compared by value on every call up to this size, by identity above it.
_ARRAY_BYTES = 1 << 16


#: Functions a module may hold and call (``self.act = F.gelu``): pinned by identity.
_FUNCTIONS = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, functools.partial)

_HOOKS = ("_forward_hooks", "_forward_pre_hooks")
#: Hooks every module runs (``nn.modules.module.register_module_forward_hook``): a dict per kind, by name.
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks")


def _plain(value: Any, held: bool = False) -> Any:
    """``value`` with its types as a comparable key when it is a plain value (a number, bool, string, None,
    dtype, device, enum, or a tuple/list/dict of those), else ``_MISSING``. Inside a tuple, list or dict
    (``held``), a tensor or a function counts by identity: ``self.extra["bias"] = new`` replaces what forward
    read as a constant."""
    if isinstance(value, _PLAIN):
        if isinstance(value, (float, complex, *_NUMPY_SCALARS)) and bool(value != value):
            return type(value), "nan"  # NaN is unequal to itself: another NaN is no change
        return type(value), value
    if isinstance(value, (torch.finfo, torch.iinfo)):  # ``self.lim = torch.finfo(dtype)``: by its dtype's limits
        return type(value), str(value)
    if isinstance(value, _ARRAYS) and value.nbytes <= _ARRAY_BYTES:  # mutable: by value (``_mutable``)
        return type(value), value.dtype.str, value.shape, value.tobytes()
    if held and (isinstance(value, (torch.Tensor, *_FUNCTIONS, type, *_ARRAYS)) or _holds_fields(value)):
        return type(value), id(value)  # an object with fields inside a tuple: its fields are pinned apart
    if isinstance(value, (tuple, list, collections.deque)):
        items = tuple(_plain(v, True) for v in value)
        return _MISSING if any(i is _MISSING for i in items) else (type(value), items)
    if isinstance(value, (set, frozenset)):
        members = [_plain(v, True) for v in value]
        return _MISSING if any(i is _MISSING for i in members) else (type(value), frozenset(members))
    if isinstance(value, dict):  # ``self.opts["mult"]``: compared by value on every call, like a list
        pairs = tuple((_plain(k), _plain(v, True)) for k, v in value.items())
        return _MISSING if any(_MISSING in p for p in pairs) else (type(value), pairs)
    return _MISSING


def _moved(links: tuple[list[Any], list[Any], list[Any]]) -> bool:
    """Whether any ``dicts[i][keys[i]]`` is not ``objects[i]`` (missing counts as None), in C loops."""
    dicts, keys, objects = links
    return any(map(operator.is_not, map(dict.get, dicts, keys), objects))


def _moved_in(links: tuple[list[Any], list[Any], list[Any]]) -> bool:
    """:func:`_moved` through getters (a class namespace's ``get``, ``getattr`` on a closure cell), in C loops; an
    emptied cell counts as moved."""
    getters, keys, objects = links
    try:
        return any(map(operator.is_not, map(_call, getters, keys), objects))
    except (AttributeError, ValueError):
        return True


_call = getattr(operator, "call", lambda f, *args: f(*args))  # operator.call: Python 3.11


def _getter(holder: Any) -> Any:
    """``holder[key]`` as a C call: a namespace's ``get``, or ``getattr`` on the object a :class:`_Fields` views."""
    return functools.partial(getattr, holder.obj) if isinstance(holder, _Fields) else holder.get


#: How many objects with fields deep the watch follows a model's attributes (``self.cfg.sub.temp``: 2).
_DEPTH = 4


def _columns(rows: list[tuple[Any, ...]], width: int) -> tuple[list[Any], ...]:
    return tuple(list(c) for c in zip(*rows)) if rows else tuple([] for _ in range(width))


def _kinds(value: Any) -> Any:
    """The types of a flat container's items (and a dict's values), in C loops: ``1`` set to ``1.0`` or ``True``
    compares equal and is not the same constant."""
    if isinstance(value, dict):
        return tuple(map(type, value)), tuple(map(type, value.values()))
    return frozenset(map(type, value)) if isinstance(value, (set, frozenset)) else tuple(map(type, value))


def _flat_copy(value: Any) -> tuple[Any, Any] | None:
    """``(shallow copy, item types)`` of a list, tuple, deque, set or dict of plain values (a vocabulary, an
    ``id2label``), which :meth:`_Attrs.check` compares at C speed; None for anything else."""
    if not isinstance(value, (list, tuple, collections.deque, set, frozenset, dict)):
        return None
    items = [*value, *value.values()] if isinstance(value, dict) else value
    if not all(isinstance(v, _PLAIN) and not isinstance(v, (float, complex, *_NUMPY_SCALARS)) for v in items):
        return None  # floats: NaN compares unequal to itself; containers and objects: by ``_plain``
    return copy.copy(value), _kinds(value)


def _mutable(value: Any) -> bool:
    return isinstance(value, (list, dict, set, collections.deque, *_ARRAYS)) or \
        isinstance(value, (tuple, frozenset)) and any(_mutable(v) for v in value)


def _shown(value: Any) -> Any:
    """``value`` as an error message shows it later: a copy of a list or dict (the live one may change), a
    tensor by its shape and dtype."""
    if isinstance(value, torch.Tensor):
        return _Shown(f"a tensor {tuple(value.shape)} {str(value.dtype).replace('torch.', '')} at {id(value):#x}")
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(map(_shown, value)) if isinstance(value, list) else tuple(map(_shown, value))
    if isinstance(value, dict) and any(isinstance(v, torch.Tensor) for v in value.values()):
        return {k: _shown(v) for k, v in value.items()}
    if _mutable(value):
        try:
            return copy.deepcopy(value)
        except Exception:  # noqa: BLE001 - it holds objects that cannot be copied (a module, a lock): its text
            return _Shown(repr(value)[:200])
    return value


class _Shown(str):
    """A description that ``repr`` shows as it is."""

    def __repr__(self) -> str:
        return str(self)


def _holds_fields(value: Any) -> bool:
    """An object whose fields a forward may read as constants: a config (a dataclass, or ``to_dict`` as Hugging
    Face's), a ``SimpleNamespace``, or a plain or callable instance of a class of the user's (not torch's)."""
    try:  # an attribute bag's ``__getattr__`` or a property may raise anything
        if isinstance(value, (type, nn.Module, torch.Tensor)):
            return False
        if not isinstance(getattr(value, "__dict__", None), dict):
            # fields in slots only (``@dataclass(slots=True)``, a class with ``__slots__``) of the user's
            return bool(_slot_names(type(value))) and _users(type(value)) and not callable(value)
        if dataclasses.is_dataclass(value) or callable(getattr(value, "to_dict", None)) \
                or isinstance(value, types.SimpleNamespace):
            return True
    except Exception:  # noqa: BLE001 - not an object whose fields can be read: not pinned by its fields
        return False
    home = type(value).__module__ or ""
    if home.startswith(("torch", "builtins", "logging", "typing", "weakref")):
        return False
    # a callable object of the user's (``self.act = Scaler(1.0)``): its fields, and what its ``__call__`` reads
    return not callable(value) or not isinstance(value, (*_FUNCTIONS, type)) and _users(type(value))


#: Fields of a Hugging Face config that record where it came from (``save_pretrained`` sets ``architectures``),
#: read by loading and saving code, never by a model's forward: not pinned.
_HF_CONFIG_RECORDS = frozenset(("architectures", "_name_or_path", "name_or_path", "transformers_version",
                                "_commit_hash"))


def _hf_config(obj: Any) -> bool:
    """``obj`` is a Hugging Face model config (a subclass of ``transformers``' ``PreTrainedConfig``)."""
    return any(k.__name__.lower() == "pretrainedconfig" and (k.__module__ or "").startswith("transformers")
               for k in type(obj).__mro__)


def _slot_names(cls: type) -> tuple[str, ...]:
    """The attribute names ``cls`` and its bases keep in slots (``__slots__``), without ``__weakref__``/``__dict__``."""
    names: list[str] = []
    for klass in cls.__mro__:
        slots = vars(klass).get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__weakref__", "__dict__") and name not in names:
                names.append(name)
    return tuple(names)


def _user_methods(cls: type) -> list[Any]:
    """``forward`` (``__call__`` of a callable object) of ``cls`` and the methods of the user's classes it reaches by
    name (``self.post(x)``; static and class methods, properties), not torch's."""
    found: dict[str, list[Any]] = {}  # every class's definition of a name: ``super().forward()`` reaches the base's
    for klass in cls.__mro__:
        if (klass.__module__ or "").startswith(("torch", "builtins")):
            continue
        for name, value in vars(klass).items():
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            elif isinstance(value, property):
                value = value.fget
            if isinstance(value, types.FunctionType):
                found.setdefault(name, []).append(value)
    out, todo, seen = [], [*found.get("forward", ()), *found.get("__call__", ())], set()
    while todo:
        fn = todo.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        out.append(fn)
        codes = [fn.__code__]
        while codes:
            c = codes.pop()
            codes.extend(x for x in c.co_consts if isinstance(x, types.CodeType))
            todo.extend(f for n in c.co_names for f in found.get(n, ()))
    return out


#: Modules whose attributes a forward reads are libraries' (their functions and constants do not change under it).
_LIBRARIES = frozenset({"torch", "builtins", "typing", "numpy", "math", "cmath", "functools", "itertools", "operator",
                        "collections", "logging", "warnings", "abc", "enum", "dataclasses", "inspect", "types",
                        "weakref", "copy", "re", "attnopt"})


#: The standard library's top-level modules (a name in code that happens to be one is no import of the user's).
_STDLIB = frozenset(getattr(sys, "stdlib_module_names", ()))

#: Tools that run beside a model, never inside its forward's numbers (test runners and their plugins, progress
#: bars, notebooks): their code and state (timers, registries) change under a model without changing it.
#: (pytest's assertion rewriting makes a test module's code read ``_pytest``.)
_TOOLS = frozenset({"_pytest", "pytest", "pluggy", "hypothesis", "xdist", "execnet", "tqdm", "rich", "IPython",
                    "ipykernel", "jupyter_client", "traitlets", "tornado", "zmq", "coverage", "pdb", "debugpy",
                    "tabulate", "matplotlib", "PIL", "pandas", "scipy", "sklearn"})


def _users(value: Any) -> bool:
    """A function, class or module of the user's (defined outside torch, the standard library, the standard
    helpers, attnopt and the tools in ``_TOOLS``)."""
    if isinstance(value, types.ModuleType):
        home = value.__name__
    elif isinstance(value, (types.FunctionType, type)):
        home = value.__module__ or ""
    else:
        return False
    top = home.split(".")[0]
    return top not in _LIBRARIES and top not in _TOOLS and top not in _STDLIB


class _Fields:
    """An object's attributes seen through a dict's ``get`` (a closure cell, a ``functools.partial``), so that the
    watch's lists hold them like dict entries."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return getattr(self.obj, key)
        except (AttributeError, ValueError):  # an empty closure cell raises ValueError
            return default


def _code_names(fn: Any) -> set[str]:
    """The names ``fn``'s code (its nested code too) reads as globals or attributes, and the identifiers among its
    string constants (``getattr(self, "temperature", 1.0)``)."""
    names: set[str] = set()
    codes = [fn.__code__] if hasattr(fn, "__code__") else []
    while codes:
        c = codes.pop()
        codes.extend(x for x in c.co_consts if isinstance(x, types.CodeType))
        names.update(c.co_names)
        names.update(x for x in c.co_consts if isinstance(x, str) and x.isidentifier())
    return names


def _readable(value: Any) -> bool:
    """A value the watch pins: a plain value, an object with fields, a tensor, an array, or a function or class."""
    return (_plain(value) is not _MISSING or _holds_fields(value) or isinstance(value, (torch.Tensor, *_ARRAYS))
            or isinstance(value, (*_FUNCTIONS, type, staticmethod, classmethod, property)))


def _class_reads(klass: type, names: set[str]) -> list[tuple[str, Any, str, Any]]:
    """``(key, namespace, name, value)`` for the class attributes named in ``names`` of ``klass`` and of the user's
    classes it derives from (``self.temperature`` where the class sets it, a helper method, ``Block.scale``)."""
    out = []
    bases = [b for b in klass.__mro__ if _users(b)]
    defined = set().union(*(vars(b).keys() for b in bases)) if bases else set()
    for base in bases:
        space = vars(base)
        for name in names & space.keys():
            if not (name.startswith("__") and name.endswith("__")) and _readable(space[name]):
                out.append((f"{base.__qualname__}.{name} (class attribute)", space, name, space[name]))
        # a name a base defines, set later on a class before it in the MRO, would shadow what the capture read:
        # pinned as absent (a name no class defines, set later: the class namespaces' sizes, see ``_take``)
        for name in (names & defined) - space.keys():
            if not (name.startswith("__") and name.endswith("__")):
                out.append((f"{base.__qualname__}.{name} (class attribute)", space, name, None))
    return out


def _closure_reads(fn: Any) -> list[tuple[str, Any, str, Any]]:
    """``(key, cell view, "cell_contents", value)`` for the variables ``fn`` closes over (a class or function
    defined inside another function reads them), and a ``functools.partial``'s arguments."""
    if isinstance(fn, functools.partial):
        view = _Fields(fn)
        name = getattr(fn.func, "__qualname__", repr(fn.func))
        return [(f"functools.partial({name}, ...).{part}", view, part, getattr(fn, part))
                for part in ("func", "args", "keywords")]
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is None or not fn.__closure__:
        return []
    out = []
    for var, cell in zip(code.co_freevars, fn.__closure__):
        value = _Fields(cell).get("cell_contents", _MISSING)
        if value is not _MISSING and var != "__class__" and _readable(value):
            out.append((f"{fn.__qualname__}'s closure variable {var}", _Fields(cell), "cell_contents", value))
    return out


def _global_reads(fn: Any, depth: int = 3) -> list[tuple[str, Any, str, Any]]:
    """``(key, holder, name, value)`` for the Python state ``fn`` reads that a capture makes constant: the plain
    module-level values (and objects with fields, see :func:`_holds_fields`), tensors, functions and classes it
    reads by name (its nested code too: lambdas, comprehensions); the attributes it names of a module or class of
    the user's it reads (``knobs.SCALE``, ``Block.scale``); the variables it closes over; and the same for the
    user's functions it calls, ``depth`` calls down. ``holder`` has a dict's ``get``: a module's globals, a
    class's namespace, a closure cell's :class:`_Fields`."""
    out: list[tuple[str, Any, str, Any]] = []
    seen: set[int] = set()

    def walk(f: Any, left: int) -> None:
        code = getattr(f, "__code__", None)
        g = getattr(f, "__globals__", None)
        if code is None or g is None or id(code) in seen:
            return
        seen.add(id(code))
        out.extend(_closure_reads(f))
        names = _code_names(f)
        out.extend(_tensor_reads(names))
        where = g.get("__name__", "?")
        # a module imported inside the function (``import knobs`` in forward) is no global: read like one
        inner = [(name, sys.modules[name]) for name in names - g.keys()
                 if isinstance(sys.modules.get(name), types.ModuleType) and _users(sys.modules[name])]
        for name, value in [*((n, g[n]) for n in names & g.keys()), *inner]:
            if isinstance(value, types.ModuleType) and not _users(value):
                # ``torch``, ``F``, ``math``: the attributes this code names, by identity or value (``F.gelu``
                # patched is not what the capture traced), and so in the submodules it names
                # (``torch.nn.functional.gelu``), not followed further
                _library_reads(value, names, out)
                continue
            if not (_readable(value) or isinstance(value, types.ModuleType) and _users(value)):
                continue
            if name in g:  # (a module imported inside: its attributes below, it is no global)
                out.append((f"global `{name}` of {where}", g, name, value))
                if isinstance(value, (type, *_FUNCTIONS)) and not _users(value):
                    continue  # a library's function or class under a global name (``from torch import cat``): by
                    # identity, not followed
            if isinstance(value, types.ModuleType):  # ``knobs.SCALE``: the attributes this code names
                modules, done = [value], {id(value)}
                while modules:  # and those of its submodules the code names (``from pkg import sub``)
                    space = vars(modules.pop())
                    for attr in names & space.keys():
                        item = space[attr]
                        if isinstance(item, types.ModuleType):
                            if _users(item) and id(item) not in done:
                                done.add(id(item))
                                modules.append(item)
                                out.append((f"{item.__name__} (module)", space, attr, item))
                            continue
                        if _readable(item):  # a library's function or class there: by identity, not followed
                            out.append((f"{space.get('__name__', '?')}.{attr}", space, attr, item))
                            if left > 0 and isinstance(item, types.FunctionType) and _users(item):
                                walk(item, left - 1)
            elif isinstance(value, type):
                out.extend(_class_reads(value, names))
            elif left > 0 and isinstance(value, types.FunctionType):
                walk(value, left - 1)

    walk(getattr(fn, "__func__", fn), depth)
    return out


def _library_reads(module: types.ModuleType, names: set[str], out: list[tuple[str, Any, str, Any]],
                   depth: int = 3) -> None:
    """``(key, namespace, name, value)`` for the functions, classes and plain values that ``names`` names in a
    library module and, ``depth`` levels down, in the submodules they name (``torch.nn.functional.gelu``: ``nn``,
    ``functional``, ``gelu``)."""
    todo, done = [(module, depth)], set()
    while todo:
        mod, left = todo.pop()
        if id(mod) in done:
            continue
        done.add(id(mod))
        space = vars(mod)
        for attr in names & space.keys():
            item = space[attr]
            if isinstance(item, types.ModuleType):
                if left > 0:
                    todo.append((item, left - 1))
            elif isinstance(item, (*_FUNCTIONS, type)) or _plain(item) is not _MISSING:
                out.append((f"{mod.__name__}.{attr}", space, attr, item))


def _tensor_reads(names: set[str]) -> list[tuple[str, Any, str, Any]]:
    """``(key, namespace, name, value)`` for the ``torch.Tensor`` methods ``names`` names (``y.sigmoid()``), as the
    class defines them or absent (defined by its C base): ``torch.Tensor.sigmoid = ...`` patched."""
    tensor = vars(torch.Tensor)
    return [(f"torch.Tensor.{attr}", tensor, attr, tensor.get(attr)) for attr in names & _TENSOR_ATTRS]


#: The attributes of ``torch.Tensor`` (its methods, a name a forward may call on a tensor).
_TENSOR_ATTRS = frozenset(a for a in dir(torch.Tensor) if not a.startswith("__"))


class _Attrs:
    """The Python state of a model that ``torch.export`` turned into constants of the graph.

    For every submodule: its ``__dict__`` entries (plain values, numpy values, containers of those, tensors,
    functions, and ``training``), its children (by identity) and its forward hooks; objects with fields it holds
    (configs, namespaces, plain objects, also inside tuples), followed ``_DEPTH`` levels down; and what the
    user's code of its class reads (:func:`_global_reads`, :func:`_class_reads`, :func:`_closure_reads`):
    module-level values and functions, attributes of the user's modules and classes, closure variables, a
    held ``partial``'s arguments. :meth:`check` compares by identity first (C loops over ``same`` and
    ``views``; containers by value, flat ones in C), and only on a difference takes the snapshot again and
    compares it, so an equal value assigned again is no change; a real change raises
    :class:`ModelChangedError` naming the path. Tensors held here are also watched for in-place writes
    (the cache then recomputes, as for weights).
    """

    def __init__(self, model: nn.Module):
        self._model = weakref.ref(model)
        self._keep(*self._take())

    @property
    def model(self) -> nn.Module:
        return _held(self._model)

    def _keep(self, snapshot: dict[str, Any], same: list[Any], lists: list[Any], sizes: list[Any],
              views: list[Any]) -> None:
        self.snapshot, self.lists = snapshot, lists
        self.same = _columns(same, 3)
        self.views = _columns([(_getter(h), k, o) for h, k, o in views], 3)
        self.sized, self.sizes = _columns(sizes, 2)

    def _take(self) -> tuple[dict[str, tuple[str, Any, Any]], list[Any], list[Any], list[Any], list[Any]]:
        """``{path: (kind, key, shown)}`` for every pinned item, and the lists :meth:`check` walks."""
        snap: dict[str, tuple[str, Any, Any]] = {}
        same: list[tuple[dict[str, Any], str, Any]] = []  # (dict, key, object): must be that very object
        views: list[tuple[Any, str, Any]] = []  # the same through another holder's ``get`` (class, cell, partial)
        lists: list[tuple[Any, str, Any, Any]] = []  # (holder, key, frozen, flat copy): compared by value
        sizes: list[tuple[Any, int]] = []  # (dict, len): an entry added or removed
        owners: list[tuple[str, Any, int]] = []  # (path, object, depth): modules, then objects with fields
        seen: set[int] = set()
        reads: dict[type, list[tuple[str, Any, str, Any]]] = {}  # per class: every layer shares it
        read_names: set[str] = set()  # attribute names the user's code reads (an object set under one matters)
        held_tensors: list[torch.Tensor] = []  # tensors pinned here (a config's, a global): their writes are followed

        def follow(path: str, obj: Any, depth: int) -> None:
            if id(obj) not in seen and depth <= _DEPTH:
                seen.add(id(obj))
                owners.append((path, obj, depth))

        def pin(key: str, holder: Any, name: str, value: Any, depth: int, as_name: bool = False) -> None:
            """Pin ``holder[name]`` (now ``value``): plain values by value, objects by identity (an object with
            fields is followed: its own fields are pinned too, ``depth`` levels down). ``as_name``: a dtype and
            its name are the same value (a Hugging Face config's ``dtype``, which ``save_pretrained`` sets to
            the name)."""
            if key in snap:
                return
            frozen = _plain(str(value).removeprefix("torch.") if as_name and isinstance(value, torch.dtype)
                            else value)
            if frozen is _MISSING:
                if not _readable(value):
                    return
                if _holds_fields(value):  # by its fields: another config with the same fields is no change
                    follow(key, value, depth + 1)
                    frozen = (type(value), "fields")
                else:
                    frozen = ("tensor", id(value)) if isinstance(value, torch.Tensor) else (type(value), id(value))
                    if isinstance(value, torch.Tensor):
                        held_tensors.append(value)
            elif isinstance(value, (tuple, list, dict)):  # objects with fields inside: pinned by identity, followed
                items = value.items() if isinstance(value, dict) else enumerate(value)
                for k, item in items:
                    if _holds_fields(item):
                        follow(f"{key}[{k!r}]", item, depth + 1)
                    elif isinstance(item, torch.Tensor):
                        held_tensors.append(item)
            # "object": one (a tensor, a function, a config) set after the capture matters only under a name the
            # user's code reads (``_compare``)
            snap[key] = ("value" if _plain(value) is not _MISSING else "object", frozen, _shown(value))
            if _mutable(value) and _plain(value) is not _MISSING:
                lists.append((holder, name, frozen, _flat_copy(value)))
            elif type(holder) is dict:
                same.append((holder, name, value))
            else:
                views.append((holder, name, value))
            if isinstance(value, (tuple, list, dict)):  # a function of the user's held in a container (``acts``)
                for k, item in (value.items() if isinstance(value, dict) else enumerate(value)):
                    if isinstance(item, types.FunctionType) and _users(item):
                        pin(f"{key}[{k!r}]", {"function": item}, "function", item, depth)  # its code, defaults, reads
            inner = value.__func__ if isinstance(value, (staticmethod, classmethod)) else \
                value.fget if isinstance(value, property) else value
            if isinstance(inner, types.FunctionType) and _users(inner):
                # its code and defaults replaced in place (IPython's autoreload, ``f.__defaults__ = ...``): the
                # same function object computing something else; defaults compared by value (a mutable default
                # changed in place)
                fields = _Fields(inner)
                code = inner.__code__
                snap[f"{key}.__code__"] = ("value", (type(code), id(code)), _Shown(f"code at {id(code):#x}"))
                views.append((fields, "__code__", code))
                for attr in ("__defaults__", "__kwdefaults__"):
                    part = getattr(inner, attr)
                    if _plain(part) is not _MISSING:
                        pin(f"{key}.{attr}", fields, attr, part, depth)
                    else:  # (an object that is no plain value among them: by identity)
                        snap[f"{key}.{attr}"] = ("value", (type(part), id(part)), _Shown(f"{attr} at {id(part):#x}"))
                        views.append((fields, attr, part))
                if inner is not value:
                    value = inner  # what the wrapped function reads, below
            if isinstance(value, _FUNCTIONS) and (not isinstance(value, types.FunctionType) or _users(value)):
                # what a held function of the user's reads: its globals, closure, partial arguments (a library's
                # function reads its library, which does not change under it)
                for k, h, n, v in _global_reads(value) if not isinstance(value, functools.partial) else ():
                    pin(k, h, n, v, depth)
                for k, h, n, v in _closure_reads(value):
                    pin(k, h, n, v, depth)

        for path, mod in self.model.named_modules():
            follow(path, mod, 0)
        for hooks in _GLOBAL_HOOKS:
            held = getattr(nn.modules.module, hooks)
            snap[f"torch.nn.modules.module.{hooks}"] = ("hooks", len(held), len(held))
            sizes.append((held, len(held)))
        for path, obj, depth in owners:  # grows while walked: objects with fields found on the way
            d = getattr(obj, "__dict__", None)
            if not isinstance(obj, nn.Module) and _slot_names(type(obj)):
                # fields in slots (beside a ``__dict__`` or not): each through the object's view (an unset slot
                # pinned as None)
                view = _Fields(obj)
                for name in _slot_names(type(obj)):
                    pin(f"{path}.{name}" if path else name, view, name, view.get(name), depth)
            if d is None:
                d = {}
            else:
                sizes.append((d, len(d)))
            module = isinstance(obj, nn.Module)
            if type(obj) not in reads:  # what forward and the other methods of the user's classes read
                methods = _user_methods(type(obj))
                names = set().union(*map(_code_names, methods)) if methods else set()
                read_names |= names
                for base in type(obj).__mro__:  # a class attribute added later may be one forward reads
                    if _users(base):
                        sizes.append((vars(base), len(vars(base))))
                reads[type(obj)] = [*(r for fn in methods for r in (*_global_reads(fn), *_closure_reads(fn))),
                                    *_class_reads(type(obj), names)]
            for key, holder, name, value in reads[type(obj)]:
                pin(key, holder, name, value, depth)
            if module:
                for kind, table in (("parameters", obj._parameters), ("buffers", obj._buffers)):
                    # ``register_buffer`` after the capture, or a None slot given a tensor: forward may read it
                    names_ = tuple(n for n, t in table.items() if t is not None)
                    snap[f"{path or '<root>'} ({kind})"] = ("tensors", names_, names_)
                    sizes.append((table, len(table)))
                    for name, value in table.items():
                        if value is None:
                            same.append((table, name, None))
                for name, child in obj._modules.items():
                    key = f"{path}.{name}" if path else name
                    snap[key + " (module)"] = ("module", id(child), type(child).__name__)
                    same.append((obj._modules, name, child))
                sizes.append((obj._modules, len(obj._modules)))
                for hooks in _HOOKS:
                    held = d[hooks]
                    snap[f"{path or '<root>'} {hooks}"] = ("hooks", tuple(map(id, held.values())), len(held))
                    sizes.append((held, len(held)))
                    for name, hook in held.items():  # one removed and another added: same count, not the same
                        same.append((held, name, hook))
                # ``forward`` set on the instance (a monkey patch) is what ``_call_impl`` runs
                snap[f"{path or '<root>'} (forward)"] = ("forward", id(d.get("forward")), d.get("forward"))
                same.append((d, "forward", d.get("forward")))
            hf_config = not module and _hf_config(obj)
            for name, value in d.items():
                if module and name in _MODULE_INTERNALS:
                    continue
                if module and isinstance(value, nn.Module):
                    continue  # submodules live in ``_modules`` (pinned above)
                if hf_config and name in _HF_CONFIG_RECORDS:
                    continue  # what a Hugging Face config records about its checkpoint, which no forward reads
                pin(f"{path}.{name}" if path else name, d, name, value, depth, as_name=hf_config and name == "dtype")
        self.read_names = read_names
        self.held = [t for t in {id(t): t for t in held_tensors}.values() if not t.is_inference()]
        self.versions = list(map(_VERSION, self.held))
        return snap, same, lists, sizes, views

    def check(self) -> bool:
        """Raise :class:`ModelChangedError` on a change; True if a tensor pinned here (a config's, a module-level
        one the graph reads as a constant) was written in place since the last check (keys and values are stale)."""
        versions = list(map(_VERSION, self.held))
        written = versions != self.versions
        self.versions = versions
        if _moved(self.same) or list(map(len, self.sized)) != self.sizes or _moved_in(self.views):
            self._compare()
            return written
        for d, key, frozen, flat in self.lists:
            now = d.get(key, _MISSING)
            if flat is not None:  # a flat container: compared and typed in C loops, then as ``_plain`` on a change
                if type(now) is not type(flat[0]) or now != flat[0] or _kinds(now) != flat[1]:
                    self._compare()
                    return written
            elif _plain(now) != frozen:
                self._compare()
                return written
        return written

    def _compare(self) -> None:
        before, (now, same, lists, sizes, views) = self.snapshot, self._take()
        name = type(self.model).__name__
        again = "call attnopt.generation.cached(model) again to build the cached model from the model as it is now"
        for path in [*before, *(p for p in now if p not in before)]:
            old, new = before.get(path), now.get(path)
            if old is not None and new is not None and old[:2] == new[:2]:
                continue
            kind = (old or new)[0]  # type: ignore[index]
            if old is None and kind == "object" and path.rsplit(".", 1)[-1] not in self.read_names:
                continue  # a tensor or object set after the capture under a name the user's code does not read
            if kind == "module":
                what = ("was added" if old is None else "was removed" if new is None
                        else f"was replaced by another {new[2]}")
                raise ModelChangedError(
                    f"submodule `{path[:-len(' (module)')]}` of {name} {what} after attnopt.generation.cached(model); "
                    f"the cached graph runs the forward captured from the old one: {again}")
            if kind == "forward":
                where = path[:-len(" (forward)")]
                raise ModelChangedError(
                    f"`{where}.forward` of {name} was set on the instance after attnopt.generation.cached(model) (a "
                    f"patched forward); the cached graph runs the forward captured: {again}")
            if kind == "tensors":
                raise ModelChangedError(
                    f"`{path}` of {name} changed after attnopt.generation.cached(model) ({list(old[2]) if old else []} "
                    f"at capture, {list(new[2]) if new else []} now): forward may read a tensor the capture did "
                    f"not see: {again}")
            if kind == "hooks":
                raise ModelChangedError(
                    f"`{path}` of {name}: forward hooks were added, removed or replaced after "
                    f"attnopt.generation.cached(model) ({old[2] if old else 0} at capture, {new[2] if new else 0} "
                    f"now); the cached graph does not run them as the model as written now does: {again}")
            if path == "training" or path.endswith(".training"):
                if old is not None and new is not None and new[2] is True:
                    raise ModelChangedError(
                        f"`{path}` of {name} was switched to training mode (model.train()) after "
                        "attnopt.generation.cached(model), which was built in eval mode: generation with active "
                        "dropout (or other training-mode behaviour) is not supported by the cache; call "
                        "model.eval() before prefill/step")
                raise ModelChangedError(
                    f"`{path}` of {name} was switched to eval mode after attnopt.generation.cached(model), which "
                    f"captured it in training mode: call model.train() again, or build it in eval mode: {again}")
            shown = ("was set to " + repr(new[2]) + " (it did not exist at capture)" if old is None
                     else "was deleted" if new is None else f"changed from {old[2]!r} to {new[2]!r}")
            raise ModelChangedError(
                f"`{path}` of {name} {shown} after attnopt.generation.cached(model); the capture read Python "
                f"attributes as constants, so the cached graph computes with the old value: {again}")
        # No difference (an equal value assigned again, a non-plain attribute added): the fast lists follow
        # the objects there now. After a difference they keep the capture's, so every call compares again.
        # Objects set after the capture stay out of the snapshot: their removal is no change either.
        now = {k: v for k, v in now.items() if k in before or v[0] != "object"
               or k.rsplit(".", 1)[-1] in self.read_names}
        self._keep(now, same, lists, sizes, views)
        return None


def _resolve_path(model: nn.Module, path: str) -> tuple[dict[str, Any] | None, list[tuple[dict[str, Any], str, Any]]]:
    """The chain of dicts that hold ``path`` in ``model`` (``_modules`` down to ``_parameters``/``_buffers``/
    ``__dict__``) as ``(dict, key, object)``; the first item is the last dict, None when the name is gone."""
    *mods, name = path.split(".")
    links: list[tuple[dict[str, Any], str, Any]] = []
    owner: Any = model
    for part in mods:
        child = owner._modules.get(part) if isinstance(owner, nn.Module) else None
        if child is None:
            return None, links
        links.append((owner._modules, part, child))
        owner = child
    for where in (owner._parameters, owner._buffers, owner.__dict__):
        if name in where:
            links.append((where, name, where[name]))
            return where, links
    return None, links


class Watch:
    """Checks, before every prefill and step, that the model still is what the cached model was built from.

    Every tensor the cached graph (or a :class:`MaskCheck`) reads is pinned to its *object*: a parameter or
    buffer replaced by another one is not what the graph computes with, so the call raises
    :class:`ModelChangedError`. In-place writes reach the graph (it shares the tensors), so weight updates
    need nothing; but a buffer whose *values* a causal proof read (its band pattern) is also pinned to its
    version counter and storage: when either moved, the pattern is checked again (``kernels.bands.is_band``)
    and the call raises if it no longer holds. A proof-only buffer (the rewritten graph no longer reads it)
    may be replaced by another tensor holding the same pattern. Mask checks read again after their
    tensors changed. A tensor the graph reads converted to another dtype or device (the same object with
    other data: ``model.double()``) raises; the plain attributes of the model are checked by :class:`_Attrs`.
    :meth:`check` returns whether a tensor the graph reads was written (version or storage moved) since the
    last check. The per-call cost is one dict lookup per module and tensor on the pinned names, and one
    version and address read per pinned tensor, plus :class:`_Attrs`.
    """

    def __init__(self, model: nn.Module, pins: list[_Pin]):
        self._model = weakref.ref(model)
        self.pins = pins
        self.device_type = pins[0].device.type if pins and pins[0].device is not None else "cpu"
        self.state = global_state(self.device_type)
        self.valued = [p for p in pins if p.patterns or p.checks]
        self.links: tuple[list[Any], ...] = ([], [], [])
        self._link()
        self.attrs = _Attrs(model)

    @property
    def model(self) -> nn.Module:
        return _held(self._model)

    def _link(self) -> None:
        seen: set[tuple[int, str]] = set()
        links = []
        for p in self.pins:
            for d, key, obj in _resolve_path(self.model, p.path)[1]:
                if (id(d), key) not in seen:
                    seen.add((id(d), key))
                    links.append((d, key, obj))
        self.links = _columns(links, 3)
        self.tensors = [p.tensor for p in self.pins]
        self.counted = [p.tensor for p in self.pins if not p.inference]
        self.ptrs = [p.ptr for p in self.pins]
        self.versions = [p.version for p in self.pins if not p.inference]

    @property
    def paths(self) -> list[str]:
        return [p.path for p in self.valued]

    def check(self) -> bool:
        """Raise :class:`ModelChangedError` if the model is not the captured one; True if a tensor the graph
        reads was written since the last check (so keys and values cached before are stale)."""
        if self._model() is None:
            _held(self._model)  # raises: the model was deleted
        if global_state(self.device_type) != self.state:
            self._state_changed()
        written = self._tensors()
        written |= self.attrs.check()
        return written

    def _state_changed(self) -> None:
        def shown(state: tuple[Any, ...]) -> str:
            default, *casts = state
            on = [f"torch.autocast({kind!r}, dtype={str(dtype).replace('torch.', '')})" for kind, enabled, dtype
                  in casts if enabled]
            return f"default dtype {str(default).replace('torch.', '')}, " + (", ".join(on) or "no autocast")
        raise ModelChangedError(
            f"this cached {type(self.model).__name__} was captured with {shown(self.state)} and is called with "
            f"{shown(global_state(self.device_type))}: the captured graph computes in the dtypes of the capture, "
            "while the model as written follows the settings of each call. Call it under the settings it was "
            "built with, or build one for these with attnopt.generation.cached(model) under them "
            "(attnopt.generate(model, ...) keeps one per setting)")

    def _tensors(self) -> bool:
        if _moved(self.links) or list(map(_VERSION, self.counted)) != self.versions \
                or list(map(torch.Tensor.data_ptr, self.tensors)) != self.ptrs:
            return self._recheck()
        return False

    def _recheck(self) -> bool:
        name = type(self.model).__name__
        again = "call attnopt.generation.cached(model) again to build the cached model from the model as it is now"
        written = False
        for p in self.pins:
            where, _ = _resolve_path(self.model, p.path)
            now = where[p.path.rsplit(".", 1)[-1]] if where is not None else None
            if now is not p.tensor:
                what = "was deleted" if now is None else "was replaced by another object"
                if p.read or not isinstance(now, torch.Tensor):
                    raise ModelChangedError(
                        f"`{p.path}` of {name} {what} after attnopt.generation.cached(model) (assigned, registered "
                        f"again or loaded with assign=True); the cached model computes with the old tensor: {again}")
                p.tensor = now  # a proof-only buffer: the pattern decides below
            elif _stamp(now) == (p.version, p.ptr):
                continue
            elif p.read and (now.dtype != p.dtype or now.device != p.device):
                raise ModelChangedError(
                    f"`{p.path}` of {name} was converted from {p.dtype} on {p.device} to {now.dtype} on {now.device} "
                    f"after attnopt.generation.cached(model) (model.double(), .bfloat16(), .to(...)); the cached "
                    f"graph was captured for {p.dtype} on {p.device}: {again}")
            written |= p.read
            for cuts, values, site in p.patterns:
                if not is_band(now, cuts, values):
                    raise ModelChangedError(
                        f"`{p.path}` of {name} changed after attnopt.generation.cached(model) and no longer holds "
                        f"the causal pattern the proof of {site} read, so the cache, which attends causally there, "
                        f"no longer computes what the model as written does with the new values; {again}")
            for c in p.checks:
                c.checked.clear()  # evaluated again, on the new values
                c.changed = p.path
            p.version, p.ptr = _stamp(now)
        self._link()
        return written


class CachedLM:
    """A causal LM that runs new tokens only, attending to cached keys and values.

    Built by :func:`~attnopt.pipeline.kv.cached`. ``prefill(idx)`` starts a batch of sequences; ``step(tokens)`` appends
    tokens to all of them. ``length`` is the number of positions cached so far (the longest sequence's). The token
    ids of the sequences are kept (``batch * max_len`` ids), so that a ``step`` after the model's weights were
    written in place can recompute the whole sequence with the new weights (see :meth:`step`).

    A *ragged* batch (``prefill(idx, attention_mask)`` with left padding) holds sequences of different lengths:
    each starts at position 0 and is computed as if it ran alone (the padding is never attended). Its calls run
    :attr:`rows_module`, the cached graph with the rows folded into the time axis (see
    :class:`~attnopt.runtime.kv_cache.Rows`), never compiled.

    Attributes:
        max_len: positions a sequence may reach (prompt plus generated tokens fed back).
        bytes_per_token: cache bytes per position of one sequence (K and V of every site).
        bytes_per_sequence: cache bytes one sequence takes: ``bytes_per_token * max_len``, less where a
            sliding-window site keeps only its window.
        cache_bytes: bytes allocated now (``batch * bytes_per_sequence`` after a prefill).
        lengths: ``(batch,)`` positions cached per sequence of a ragged batch, else None.
        sites: the cached attention modules, in graph order.
        graph_module: the rewritten graph, ``forward(tokens, offset) -> logits``.
        rows_module: the same with ``forward(tokens (1, R*t), rows, positions) -> logits`` for ragged batches.
        plan: what the position analysis found (a :class:`~attnopt.passes.positions.PositionPlan`: shifted
            position readers, length bounds).
    """

    def __init__(self, graph_module: fx.GraphModule, sites: list[KVCacheAttention], max_len: int,
                 max_len_source: str, plan: Any, name: str, rows: fx.GraphModule | None = None):
        self.graph_module = graph_module
        self.rows_module = rows
        self.sites = sites
        self.max_len = max_len
        self.max_len_source = max_len_source
        self.plan = plan
        self.name = name
        self.memory_budget: int | None = None  # bytes the K/V caches may take (cached(..., memory_budget=))
        self.length = 0
        self.lengths: torch.Tensor | None = None
        self.batch: int | None = None
        self.mask_checks: list[MaskCheck] = []
        self.watch: Watch | None = None  # the model's tensors the cache depends on (see Watch)
        self.run = graph_module  # or its torch.compile'd version (cached(..., compile=True))
        self.tokens: torch.Tensor | None = None  # (batch, max_len): the ids of positions 0 .. length - 1 per row
        self.stale = False  # weights the graph reads were written since the caches were filled
        self.epoch = 0  # counts resets (every prefill starts one): who filled the caches last
        self.linear_groups: list[int] = []  # attnopt.runtime.linear groups of the eager graphs' linear layers

    @property
    def bytes_per_token(self) -> int | None:
        per = [s.bytes_per_token for s in self.sites]
        return None if any(p is None for p in per) else sum(per)  # type: ignore[misc]

    @property
    def cache_bytes(self) -> int:
        return sum(s.cache_bytes for s in self.sites)

    def reset(self) -> None:
        """Forget the cached sequences and free the caches."""
        for s in self.sites:
            s.reset()
        self.length, self.lengths, self.batch, self.tokens, self.stale = 0, None, None, None, False
        self.epoch += 1

    def prefill(self, idx: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run the prompt ``idx`` ``(B, T0)``; return its logits ``(B, T0, vocab)`` and cache K and V.

        ``attention_mask`` ``(B, T0)`` (1 = token, 0 = padding) makes a ragged batch of left-padded prompts:
        row ``b``'s tokens are ``idx[b, mask[b] == 1]``, at positions ``0 ..``, and its logits are those of that
        prompt run alone (the logits at padding are not meaningful). A mask of ones is a plain batch.
        Computes with the model's weights as they are now (updates made in place before are used).

        Raises:
            ModelChangedError: the model is no longer the one captured (see :class:`ModelChangedError`).
        """
        check_tokens(idx, "idx")
        pad = None if attention_mask is None else padding_of(attention_mask, idx)
        self.reset()
        if self.watch is not None:
            self.watch.check()
        batch, t = idx.shape
        lengths = None if pad is None else t - pad
        self._check_room(t if lengths is None else int(lengths.max()))
        self._check_budget(batch)
        if lengths is None:
            self._check_masks(batch, t, idx.device)
            with torch.no_grad():
                logits = self.run(idx, 0)
            self.tokens = idx.new_empty((batch, self.max_len))
            self.tokens[:, :t] = idx
        else:
            assert pad is not None
            self._check_rows(lengths, idx.device)
            logits = self._run_rows(idx, torch.zeros_like(pad), pad)
            self.tokens = idx.new_zeros((batch, self.max_len))  # row b's tokens from column 0
            shift = (torch.arange(t, device=idx.device)[None, :] + pad[:, None]).clamp(max=t - 1)
            self.tokens[:, :t] = idx.gather(1, shift)
        self.length, self.lengths, self.batch = t if lengths is None else int(lengths.max()), lengths, batch
        return logits

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append ``tokens`` ``(B, t)`` to every sequence; return their logits ``(B, t, vocab)``.

        If a tensor the cached graph reads was written in place since the last ``prefill``/``step`` (an
        optimizer step, ``weight.mul_(...)``, ``load_state_dict``, ``.data =`` with the same dtype; seen by
        its version counter or storage address), the cached keys and values were computed with the old
        weights while the model as written recomputes every position with the new ones. The step then runs
        the whole sequence kept so far plus ``tokens`` from position 0 (as a prefill, refilling the caches)
        and returns the logits of ``tokens``: the full recompute's, at a prefill's cost once.
        Writes that bypass the version counter (through ``.data``, ``.numpy()``, DLPack) are not seen, as
        for attnopt's other guards (see the README's Exactness section).

        Raises:
            ModelChangedError: the model is no longer the one captured (see :class:`ModelChangedError`).
        """
        check_tokens(tokens, "tokens")
        if self.batch is None:
            raise RuntimeError("call prefill(idx) before step(tokens): the cache is empty")
        if tokens.size(0) != self.batch:
            raise ValueError(f"tokens has batch size {tokens.size(0)} but the cached sequences {self.batch}; "
                             "call prefill(idx) to start a new batch")
        if self.watch is not None:
            try:
                self.stale = self.watch.check() or self.stale
            except ModelChangedError:
                self.stale = True  # whatever moved with it: recompute once the model is the captured one again
                raise
        if self.lengths is not None:
            return self._step_rows(tokens)
        t = tokens.size(1)
        end = self.length + t
        self._check_room(end)
        self._check_masks(self.batch, end, tokens.device)
        assert self.tokens is not None
        self.tokens[:, self.length:end] = tokens
        with torch.no_grad():
            if self.stale:
                logits = self.run(self.tokens[:, :end], 0)[:, -t:]
                self.stale = False
            else:
                logits = self.run(tokens, self.length)
        self.length = end
        return logits

    def _step_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """:meth:`step` for a ragged batch: row ``b`` continues at its own position ``lengths[b]``."""
        assert self.lengths is not None and self.tokens is not None
        t = tokens.size(1)
        ends = self.lengths + t
        self._check_room(int(ends.max()))
        self._check_rows(ends, tokens.device)
        new = self.lengths[:, None] + torch.arange(t, device=tokens.device)[None, :]
        self.tokens.scatter_(1, new, tokens.to(self.tokens.dtype))  # int32 prompts, int64 picks
        if self.stale:  # recompute every row from position 0: its history, left-padded to the longest
            longest = int(ends.max())
            pad = longest - ends
            at = (torch.arange(longest, device=tokens.device)[None, :] - pad[:, None]).clamp(min=0)
            logits = self._run_rows(self.tokens.gather(1, at), torch.zeros_like(pad), pad)[:, -t:]
            self.stale = False
        else:
            logits = self._run_rows(tokens, self.lengths, torch.zeros_like(self.lengths))
        self.lengths, self.length = ends, int(ends.max())
        return logits

    def _run_rows(self, ids: torch.Tensor, start: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        """Logits ``(R, t, vocab)`` of ``ids`` ``(R, t)``, row ``b`` at ``start[b]`` after ``pad[b]`` padding slots."""
        if self.rows_module is None:
            raise RuntimeError(f"this cached {self.name} cannot serve ragged batches (it has no rows module); "
                               "build it with attnopt.generation.cached(model)")
        rows = Rows(start, pad, ids.size(1))
        with torch.no_grad():
            logits = self.rows_module(ids.reshape(1, -1), rows, rows.positions)
        return logits.reshape(ids.size(0), ids.size(1), -1)

    def _check_rows(self, lengths: torch.Tensor, device: torch.device) -> None:
        """Each sequence of a ragged batch is computed as if alone: the mask checks hold for one of its length."""
        if self.mask_checks:
            for n in sorted(set(lengths.tolist())):
                self._check_masks(1, n, device)

    def _check_masks(self, batch: int, length: int, device: torch.device) -> None:
        for c in self.mask_checks:
            try:
                ok = c.holds(batch, length, device)
            except Exception as e:
                raise PositionError(f"the mask of {c.site_name} ({c.where}) could not be evaluated for {batch} "
                                    f"sequence(s) of {length} tokens: {type(e).__name__}: {e}") from e
            shape = "causal" if c.window is None else f"a causal window of {c.window} keys"
            if not ok and c.changed is not None:
                raise ModelChangedError(
                    f"`{c.changed}` of {self.name} changed after attnopt.generation.cached(model), and the mask of "
                    f"{c.site_name} ({c.where}) it builds is no longer {shape} for {batch} sequence(s) of {length} "
                    "tokens; call attnopt.generation.cached(model) again to build the cached model from the model "
                    "as it is now")
            wider = c.find_window(length, device) if not ok and c.window is None else None
            if wider is not None:
                raise PositionError(
                    f"the mask of {c.site_name} ({c.where}) is a sliding window of {wider} keys at {length} tokens, "
                    f"which the cached model did not see when it read the mask at {c.probe} tokens; set "
                    f"`config.sliding_window = {wider}` on the model (where to read the mask: the mask decides) "
                    "and build it again with attnopt.generation.cached(model)")
            if not ok:
                raise PositionError(f"the mask of {c.site_name} ({c.where}) is not {shape} for {batch} sequence(s) "
                                    f"of {length} tokens, so the cache would not compute what the model does")

    def _check_room(self, needed: int) -> None:
        if needed > self.max_len:
            raise ValueError(f"{needed} positions exceed max_len={self.max_len} ({self.max_len_source}); "
                             "build the cached model with a larger max_len if the model allows it, "
                             "or start again with a shorter sequence")

    def _bytes_for(self, length: int) -> int | None:
        """Cache bytes of one sequence whose caches hold ``length`` positions (a window site: at most its window)."""
        per = [s.bytes_per_token for s in self.sites]
        if any(p is None for p in per):
            return None
        return sum(p * (length if s.window is None else min(s.window, length))  # type: ignore[operator]
                   for p, s in zip(per, self.sites))

    @property
    def bytes_per_sequence(self) -> int | None:
        """Cache bytes one sequence takes: the caches are allocated for ``max_len`` positions (a sliding-window
        site: its window) at prefill."""
        return self._bytes_for(self.max_len)

    def longest_that_fits(self, budget: int) -> int:
        """The largest ``max_len`` whose sequence fits in ``budget`` bytes (may exceed the model's limit)."""
        lo, hi = 0, 1
        while (self._bytes_for(hi) or 0) <= budget and hi < 2**40:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if (self._bytes_for(mid) or 0) <= budget else (lo, mid)
        return lo

    def sequences_that_fit(self, budget: int | str | None = None, length: int | None = None) -> int | None:
        """How many sequences of ``length`` positions (default ``max_len``) fit in ``budget`` bytes of cache.

        ``budget`` defaults to the ``memory_budget`` given to :func:`~attnopt.pipeline.kv.cached`. The caches
        of this cached model hold ``max_len`` positions per sequence (a sliding-window site: its window) whatever
        the length used; build it with ``max_len=length`` to have that many fit. None when the bytes per position
        or the budget are unknown.
        """
        budget = self.memory_budget if budget is None else parse_bytes(budget)
        if budget is None or self.bytes_per_token is None:
            return None
        if length is not None and (not isinstance(length, int) or isinstance(length, bool) or length < 1):
            raise ValueError(f"length must be a positive int or None, got {length!r}")
        per = self._bytes_for(length or self.max_len)
        return budget // per if per else None

    def _check_budget(self, batch: int) -> None:
        per = self.bytes_per_sequence
        if self.memory_budget is None or per is None or batch * per <= self.memory_budget:
            return
        fit = self.memory_budget // per
        raise ValueError(
            f"a batch of {batch} sequence(s) needs {_size(batch * per)} of K/V cache ({self.bytes_per_token} B per "
            f"position per sequence, max_len={self.max_len}), more than memory_budget={_size(self.memory_budget)}: "
            f"use a batch of at most {fit}, or build the cached model with max_len <= "
            f"{self.longest_that_fits(self.memory_budget // batch)} for this batch "
            f"(attnopt.generation.cached(model, max_len=...)), or give a larger memory_budget")

    def describe(self) -> str:
        """Sites, length limit and cache memory as text."""
        checked = {c.site_name: c for c in self.mask_checks}
        rows = [[s.site_name, s.where, s.spec.describe()
                 + ("" if s.site_name not in checked else " (mask checked causal at each length)"
                    if checked[s.site_name].window is None else
                    f" (mask checked a causal window of {checked[s.site_name].window} at each length)")
                 + ("" if s.window is None else f"; cache keeps the last {s.capacity} positions")
                 + ("; a term per key (ALiBi) kept with the keys" if s.keeps_key_bias else "")
                 + (" (relative to the last key: kept as slope * j in float64)" if s.relative_key_bias else "")]
                for s in self.sites]
        per = "unknown" if self.bytes_per_token is None else f"{self.bytes_per_token} B"
        bounded = "max_len positions" + ("" if all(s.window is None for s in self.sites) else
                                         ", sliding-window sites their window")
        lines = [f"attnopt cached {self.name}: {len(self.sites)} attention site(s) cached, "
                 f"max_len={self.max_len} ({self.max_len_source})",
                 f"cache: {per} per position per sequence"
                 + ("" if self.bytes_per_sequence is None else f", {_size(self.bytes_per_sequence)} per sequence "
                    f"({bounded})") + f"; allocated {_size(self.cache_bytes)}"
                 + (f" for batch {self.batch}, {self.length} position(s) used" if self.batch else ""),
                 *([f"memory budget {_size(self.memory_budget)}: {self.sequences_that_fit()} sequence(s) of "
                    f"max_len={self.max_len} fit"] if self.memory_budget is not None else []),
                 "", tabulate(rows, headers=["site", "where", "attention"])]
        if self.watch is not None and self.watch.paths:
            lines.append("buffers the causal proof read, checked before every call: "
                         + ", ".join(f"`{p}`" for p in self.watch.paths))
        if self.plan.shifted:
            lines.append("positions shifted by the cache length: "
                         + ", ".join(f"`{n.name}`" for n in self.plan.shifted))
        chosen = [d for g in self.linear_groups for d in linear_decisions(g)]
        if chosen:
            lines += ["", "linear layers (as written or oneDNN, by timing one pass over the weights; see "
                      "attnopt.runtime.linear):",
                      tabulate([[d["group"], d["rows"], d["dtype"], d["threads"], d["kernel"],
                                 d.get("onednn / as written", "-"), d["reason"]] for d in chosen],
                               headers=["graph", "rows", "dtype", "threads", "kernel", "onednn / as written", "why"])]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"CachedLM({self.name}, sites={len(self.sites)}, max_len={self.max_len}, length={self.length})"

    def _not_copied(self, *_: Any) -> Any:
        raise TypeError(f"a CachedLM ({self.name}) cannot be copied or pickled: it holds the captured graph, its "
                        "caches and a watch over the model it was built from; build another one with "
                        "attnopt.generation.cached(model) (on a copy of the model, for a copy)")

    __deepcopy__ = __copy__ = __reduce_ex__ = _not_copied


def _size(n: int) -> str:
    """Bytes as text: ``1536 B``, ``1.5 KiB``, ``3.2 MiB``, ``1.1 GiB``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def check_tokens(idx: Any, what: str) -> None:
    if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.dtype not in (torch.long, torch.int):
        got = f"{tuple(idx.shape)} {idx.dtype}" if isinstance(idx, torch.Tensor) else type(idx).__name__
        raise ValueError(f"{what} must be token ids of shape (batch, length) and dtype torch.long, got {got}; "
                         "add a batch dim with idx[None]" + (", or pass prompts of different lengths as a list of "
                                                             "1-D tensors" if isinstance(idx, list) else ""))
    if idx.size(1) < 1:
        raise ValueError(f"{what} must hold at least one token per sequence")


def padding_of(attention_mask: Any, idx: torch.Tensor) -> torch.Tensor | None:
    """``(B,)`` padding slots before each row's tokens, read from a left-padded ``attention_mask``; None if none."""
    m = attention_mask
    if not isinstance(m, torch.Tensor) or tuple(m.shape) != tuple(idx.shape) or m.is_floating_point() \
            or m.is_complex():
        got = f"{tuple(m.shape)} {m.dtype}" if isinstance(m, torch.Tensor) else type(m).__name__
        raise ValueError(f"attention_mask must be a (batch, length) = {tuple(idx.shape)} tensor of 0/1 (or bool) "
                         f"like the token ids, got {got}")
    if m.device != idx.device:
        raise ValueError(f"attention_mask is on {m.device} but the token ids on {idx.device}")
    m = m.long()
    if bool(((m != 0) & (m != 1)).any()):
        raise ValueError("attention_mask must hold 0 (padding) and 1 (token) only")
    empty = (~m.bool().any(1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"attention_mask row(s) {empty} hold no token: give every sequence at least one token "
                         "(a prompt of one token is enough), or leave the row out of the batch")
    if not bool(m[:, -1].all()) or bool((m[:, 1:] < m[:, :-1]).any()):
        rows = sorted(set((~m[:, -1].bool()).nonzero().flatten().tolist())
                      | set((m[:, 1:] < m[:, :-1]).any(1).nonzero().flatten().tolist()))
        raise ValueError(f"attention_mask row(s) {rows} are not left-padded (zeros, then the tokens, ones to the "
                         "end): decoder-only generation appends after the last token, so pad on the left "
                         "(tokenizer.padding_side = 'left'), or pass the prompts as a list of 1-D tensors")
    pad = (m == 0).sum(1)
    return pad if bool(pad.any()) else None


def left_pad(prompts: Any, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of different lengths (1-D token tensors) as left-padded ids ``(B, T)`` and their attention mask."""
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"prompts must be a non-empty list of 1-D token tensors, got {type(prompts).__name__}")
    for i, p in enumerate(prompts):
        if not isinstance(p, torch.Tensor) or p.dim() != 1 or p.dtype not in (torch.long, torch.int) \
                or p.numel() < 1:
            got = f"{tuple(p.shape)} {p.dtype}" if isinstance(p, torch.Tensor) else type(p).__name__
            raise ValueError(f"prompt {i} must be a 1-D tensor of at least one token id (torch.long), got {got}")
        if p.device != prompts[0].device or p.dtype != prompts[0].dtype:
            raise ValueError(f"prompt {i} is {p.dtype} on {p.device}, prompt 0 {prompts[0].dtype} on "
                             f"{prompts[0].device}: give every prompt the same dtype and device")
    longest = max(p.numel() for p in prompts)
    ids = prompts[0].new_full((len(prompts), longest), pad_id)
    mask = torch.zeros(len(prompts), longest, dtype=torch.long, device=ids.device)
    for i, p in enumerate(prompts):
        ids[i, longest - p.numel():] = p
        mask[i, longest - p.numel():] = 1
    return ids, mask


def watch_model(model: nn.Module, gm: fx.GraphModule, proofs: list[tuple[str, Any, Any, str]],
           checks: list[MaskCheck]) -> Watch:
    """_Pin the model's tensors that ``gm`` and the mask checks read, and the buffers the causal proofs read."""
    pins: dict[str, _Pin] = {}

    def pin(path: str, read: bool) -> _Pin | None:
        if path not in pins:
            where, _ = _resolve_path(model, path)
            t = where[path.rsplit(".", 1)[-1]] if where is not None else None
            if not isinstance(t, torch.Tensor):
                return None  # not the model's (a constant export lifted): nothing outside can change it
            pins[path] = _Pin(path, t, read)
        pins[path].read |= read
        return pins[path]

    for module in (gm, *(c.module for c in checks)):
        for node in module.graph.nodes:
            if node.op == "get_attr":
                pin(str(node.target), True)
    for c in checks:
        for node in c.module.graph.nodes:
            p = pin(str(node.target), True) if node.op == "get_attr" else None
            if p is not None and c not in p.checks:
                p.checks.append(c)
    for path, cuts, values, site in proofs:
        p = pin(path, False)
        if p is not None:
            p.patterns.append((tuple(cuts), tuple(values), site))
    # A tensor held under several names (tied embeddings: ``lm_head.weight is wte.weight``) is read by the graph
    # under one of them; the model computes with each, so each is pinned: replacing one unties them.
    names: dict[int, list[str]] = {}
    for name, t in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
        names.setdefault(id(t), []).append(name)
    for p in list(pins.values()):
        for name in names.get(id(p.tensor), ()):
            alias = pin(name, p.read)
            if alias is not None and p.patterns and alias is not p:
                alias.patterns.extend(p.patterns)
    return Watch(model, list(pins.values()))
