"""KV-cached generation for causal language models written without a cache.

``attnopt.generate(model, idx, max_new_tokens)`` gives the tokens the plain loop gives
(``generate_plain``: run the whole sequence, take the last logits, pick, append, repeat), but
runs each new token once. ``cached(model)`` builds the object it uses, for users who drive
decoding themselves::

    lm = attnopt.generation.cached(model)         # capture + proof; max_len from the model
    logits = lm.prefill(idx)                       # (B, T0, vocab), caches filled
    logits = lm.step(next_tokens)                  # (B, t, vocab) for positions T0 .. T0 + t - 1
    print(lm.describe())                           # sites, max_len, cache bytes

How the cached model is built, and why it computes the same function:

1. **Capture** ``forward(idx)`` with ``torch.export`` (batch and sequence dims dynamic), so every
   node carries symbolic shapes and the sequence length is one symbol ``T``. Parameters are the
   model's own tensors (shared, not copied).
2. **Keep the logits**: the graph returns only the logits (a tensor, the first item of a tuple such
   as nanoGPT's ``(logits, loss)``, or ``.logits``); everything else is dead code. Spellings export
   adds (``type_as``, ``.float()``, full slices, inactive dropout) are read back as casts and identities.
3. **Find sites** (``passes/find_sites.py``) and replace every proven *causal* site with a
   :class:`KVCacheAttention` module called as ``(q, k, v, scale, offset)``. A mask the symbolic proof
   cannot read but that is computed from sizes alone (Hugging Face builds its causal mask from
   position ids) gets a :class:`MaskCheck`: it is evaluated for every ``(batch, length)`` the cache
   serves and must be exactly causal there, else the call raises. Sites with another mask or active
   dropout stay as written, so step 4 refuses them.
4. **Prove positions** (``passes/positions.py``): every other op acts on each position alone, or
   reads positions only through ``arange(T)`` / ``table[:T]``; otherwise
   :class:`~attnopt.passes.positions.PositionError` names the op and its source line.
5. **Shift positions**: the graph takes ``(tokens, offset)``; ``arange(T)`` becomes
   ``arange(offset, offset + t)`` and ``table[:T]`` becomes ``table[offset:offset + t]``.
6. **Pin what the capture read**: every ``prefill``/``step`` first checks that the model's tensors the
   graph reads are the same objects with the dtype and device of the capture, that the buffers a causal
   proof read (nanoGPT's ``tril``) still hold the proven pattern (object identity and version counter; the
   pattern read again when the version moved), and that the plain Python attributes of every submodule
   (numbers, flags, strings, dtypes, ``training``, ...), which the capture turned into constants, and the
   submodules themselves are unchanged. Otherwise it raises :class:`ModelChangedError` naming the tensor,
   module or attribute. In-place weight updates reach the cache: one before ``prefill`` is simply used; one
   after it (version counter or storage moved) makes the cached keys and values of the prefix stale, so the
   next ``step`` recomputes the whole sequence (the token history the :class:`CachedLM` keeps) with the new
   weights, as the model as written does, and continues from there.

Each site writes its new K and V into a cache preallocated to ``max_len`` positions (K and V are
computed per position, so the cached rows equal the full recompute's) and attends over
``cache[:offset + t]`` with the causal rule aligned bottom-right: no mask for one new token,
``is_causal`` for the prefill, an explicit lower-band mask for several new tokens after a prefix.
Attention runs through the candidate ``variant`` names (``sdpa`` by default; ``auto`` lets the
selector time the prefill and decode shapes); outputs match the model as written within the
dtype's tolerance, like every attnopt rewrite. Dropout must be inactive (``model.eval()``).
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import math
import operator
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
from tabulate import tabulate

from .candidates import get_candidate
from .canon import meta_value, shape_of
from .passes.find_sites import Match, find_sites
from .passes.masks import Add
from .passes.positions import PositionError, PositionPlan, analyse_positions, offset_positions
from .passes.rewrite_sdpa import rewrite_sites
from .runtime import AttentionSite, candidate_layout, is_band
from .selector import Selector
from .site import AttentionSpec

aten = torch.ops.aten

#: Config attributes that name a model's maximum number of positions, most specific first.
_CONFIG_MAX = ("block_size", "max_position_embeddings", "n_positions", "max_seq_len", "n_ctx")


class KVCacheAttention(nn.Module):
    """One causal self-attention site with its K/V cache: ``(q, k, v, scale, offset) -> out``.

    q: ``(..., t, D)`` for the ``t`` new positions ``offset .. offset + t - 1``; k, v: their keys and
    values (``(..., Hkv, t, D)``, unrepeated for GQA). The cache is allocated on the first call at
    offset 0 with ``max_len`` positions.
    """

    def __init__(self, name: str, spec: AttentionSpec, max_len: int, where: str = "", candidate: str = "sdpa",
                 selector: Any = None):
        super().__init__()
        self.site_name = name
        self.spec = spec
        self.max_len = max_len
        self.where = where
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        # The candidate choice (and, for "auto", the selector's per-shape tuning) is AttentionSite's.
        self.chooser = AttentionSite(name, spec, candidate, where=where)
        self.chooser.selector = selector

    def extra_repr(self) -> str:
        return f"{self.site_name}: max_len={self.max_len}, {self.chooser.candidate}, {self.spec.describe()}"

    def reset(self) -> None:
        self.k_cache = self.v_cache = None

    @property
    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k_cache, self.v_cache) if t is not None)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None,
                offset: int) -> torch.Tensor:
        t = q.size(-2)
        end = offset + t
        if self.k_cache is None or offset == 0:
            self.k_cache = k.new_empty((*k.shape[:-2], self.max_len, k.size(-1)))
            self.v_cache = v.new_empty((*v.shape[:-2], self.max_len, v.size(-1)))
        assert self.v_cache is not None
        self.k_cache[..., offset:end, :] = k
        self.v_cache[..., offset:end, :] = v
        keys, values = self.k_cache[..., :end, :], self.v_cache[..., :end, :]
        q, keys, values, lead = candidate_layout(q, keys, values)
        mask = None
        if 1 < t < end:  # several new tokens after a prefix: query i sees keys <= offset + i
            mask = torch.ones(t, end, dtype=torch.bool, device=q.device).tril(diagonal=offset)
        kwargs = dict(attn_mask=mask, dropout_p=0.0, is_causal=t > 1 and t == end,
                      scale=self.spec.scale if scale is None else float(scale), enable_gqa=self.spec.gqa)
        with torch.autograd.profiler.record_function(f"attnopt::{self.site_name}"):
            out = self.chooser._call(q, keys, values, kwargs)  # chosen, checked per shape key, with fallbacks
        if lead:
            out = out.reshape(out.shape[lead:])
        if self.spec.out_dtype is not None and out.dtype != self.spec.out_dtype:
            out = out.to(self.spec.out_dtype)
        return out


class MaskCheck:
    """A site mask computed from sizes alone that the symbolic proof could not read (e.g. Hugging Face's
    masks, built from position ids with comparisons and a packed-sequence ``cumsum``).

    The mask's subgraph (token ids enter only through their sizes) is a function of the batch size
    and length alone. The cached model drops it and attends causally, which is exact exactly when
    that function gives the causal pattern (keep ``j <= i``; masked entries ``-inf`` or the dtype's
    minimum) at every length the cache serves: the cached model evaluates it for each new
    ``(batch, length)`` before running (one mask computation, as the model itself does per call).
    """

    def __init__(self, module: fx.GraphModule, term: Any, site_name: str, where: str):
        self.module = module
        self.additive = isinstance(term, Add)
        self.keep_when_true = getattr(term, "keep_when_true", False)
        self.site_name = site_name
        self.where = where
        self.checked: set[tuple[int, int]] = set()
        self.changed: str | None = None  # a model tensor it reads that changed after cached() (see _Watch)

    @classmethod
    def of(cls, gm: fx.GraphModule, m: Match, tokens: fx.Node, upto: int = 8) -> MaskCheck | str:
        """The check for ``m``'s mask (already checked at lengths ``1..upto``), or why it cannot be used."""
        if len(m.mask.terms) != 1:
            return "it combines several masks"
        term = m.mask.terms[0]
        node = term.mask if isinstance(term, Add) else term.cond
        pending, seen = [node], set()
        while pending:
            n = pending.pop()
            if n in seen:
                continue
            seen.add(n)
            if n is tokens:
                return "its mask depends on the token values"
            if n.op == "call_function" and n.target is aten.sym_size.int:
                continue  # only the tokens' sizes
            if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) \
                    and torch.Tag.nondeterministic_seeded in n.target.tags:
                return "its mask is random"
            pending.extend(n.all_input_nodes)
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        graph.graph_copy(gm.graph, env)
        graph.output(env[node])
        graph.eliminate_dead_code()
        where = " ".join(x for x in (m.record.module_path, m.record.source) if x)
        check = cls(fx.GraphModule(gm, graph), term, m.record.name, where)
        for length in range(1, upto + 1):  # refuse masks that are plainly not causal now, not at the first call
            try:
                if not check.holds(2, length, tokens.meta["val"].device):
                    return f"its mask is not causal at length {length}"
            except Exception as e:  # noqa: BLE001 - a mask attnopt cannot evaluate is a mask it cannot trust
                return f"its mask could not be evaluated at length {length} ({type(e).__name__}: {e})"
        return check

    def holds(self, batch: int, length: int, device: torch.device) -> bool:
        """The mask for ``batch`` sequences of ``length`` tokens is exactly the causal pattern."""
        if (batch, length) in self.checked:
            return True
        with torch.no_grad():
            mask = self.module(torch.zeros(batch, length, dtype=torch.long, device=device))
        if mask.dim() < 2 or tuple(mask.shape[-2:]) != (length, length):
            return False
        lower = torch.ones(length, length, dtype=torch.bool, device=mask.device).tril().expand(mask.shape)
        if self.additive:
            masked = torch.isneginf(mask) | (mask <= torch.finfo(mask.dtype).min)
            ok = torch.equal(mask == 0, lower) and bool((masked | lower).all())
        else:
            keep = mask if self.keep_when_true else ~mask
            ok = torch.equal(keep, lower)
        if ok:
            self.checked.add((batch, length))
        return ok


class ModelChangedError(RuntimeError):
    """The model changed after :func:`cached` in a way the cached model does not follow.

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


def _stamp(t: torch.Tensor) -> tuple[int, int]:
    """What moves when ``t``'s values may have changed: its version counter (in-place writes) and storage
    address (``.data =``, dtype and device conversions)."""
    return (-1 if t.is_inference() else t._version), t.data_ptr()


_MISSING = object()
_VERSION = operator.attrgetter("_version")
#: nn.Module's own bookkeeping in ``__dict__`` (hook dicts, ``_compiled_call_impl``, ...), not the model's attributes.
_MODULE_INTERNALS = frozenset(nn.Module().__dict__) - {"training"}
_PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.memory_format,
          torch.layout, enum.Enum)
_HOOKS = ("_forward_hooks", "_forward_pre_hooks")


def _plain(value: Any) -> Any:
    """``value`` with its types as a comparable key when it is a plain value (a number, bool, string, None,
    dtype, device, enum, or a tuple/list of those), else ``_MISSING``."""
    if isinstance(value, _PLAIN):
        return type(value), value
    if isinstance(value, (tuple, list)):
        items = tuple(_plain(v) for v in value)
        return _MISSING if any(i is _MISSING for i in items) else (type(value), items)
    return _MISSING


def _moved(links: tuple[list[Any], list[Any], list[Any]]) -> bool:
    """Whether any ``dicts[i][keys[i]]`` is not ``objects[i]`` (missing counts as None), in C loops."""
    dicts, keys, objects = links
    return any(map(operator.is_not, map(dict.get, dicts, keys), objects))


def _columns(rows: list[tuple[Any, ...]], width: int) -> tuple[list[Any], ...]:
    return tuple(list(c) for c in zip(*rows)) if rows else tuple([] for _ in range(width))


def _mutable(value: Any) -> bool:
    return isinstance(value, list) or isinstance(value, tuple) and any(_mutable(v) for v in value)


class _Attrs:
    """The plain Python state of a model that ``torch.export`` turned into constants of the graph.

    For every submodule: its plain ``__dict__`` entries (numbers, bools, strings, None, dtypes, devices,
    enums and tuples/lists of those, and ``training``), its children (by identity) and how many forward
    hooks it has; the same plain entries of config objects a module holds (dataclasses, or objects with
    ``to_dict`` such as Hugging Face configs). :meth:`check` compares by identity first (one dict lookup per
    entry; lists by value), and only on a difference compares values, so an equal value assigned again is
    no change; a real change raises :class:`ModelChangedError` naming the attribute's path.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self._keep(*self._take())

    def _keep(self, snapshot: dict[str, Any], same: list[Any], lists: list[Any], sizes: list[Any]) -> None:
        self.snapshot, self.lists = snapshot, lists
        self.same = _columns(same, 3)
        self.sized, self.sizes = _columns(sizes, 2)

    def _take(self) -> tuple[dict[str, tuple[str, Any, Any]], list[Any], list[Any], list[Any]]:
        """``{path: (kind, key, shown)}`` for every pinned item, and the lists :meth:`check` walks."""
        snap: dict[str, tuple[str, Any, Any]] = {}
        same: list[tuple[dict[str, Any], str, Any]] = []  # (dict, key, object): must be that very object
        lists: list[tuple[dict[str, Any], str, Any]] = []  # (dict, key, frozen): mutable, compared by value
        sizes: list[tuple[Any, int]] = []  # (dict, len): an entry added or removed
        owners, seen = [], set()
        for path, mod in self.model.named_modules():
            owners.append((path, mod))
            seen.add(id(mod))
        for path, obj in owners:
            d = obj.__dict__
            sizes.append((d, len(d)))
            module = isinstance(obj, nn.Module)
            if module:
                for name, child in obj._modules.items():
                    key = f"{path}.{name}" if path else name
                    snap[key + " (module)"] = ("module", id(child), type(child).__name__)
                    same.append((obj._modules, name, child))
                sizes.append((obj._modules, len(obj._modules)))
                for hooks in _HOOKS:
                    snap[f"{path or '<root>'} {hooks}"] = ("hooks", len(d[hooks]), len(d[hooks]))
                    sizes.append((d[hooks], len(d[hooks])))
            for name, value in d.items():
                if module and name in _MODULE_INTERNALS:
                    continue
                key = f"{path}.{name}" if path else name
                frozen = _plain(value)
                if frozen is not _MISSING:
                    snap[key] = ("value", frozen, value)
                    if _mutable(value):
                        lists.append((d, name, frozen))
                    else:
                        same.append((d, name, value))
                elif module and id(value) not in seen and not isinstance(value, type) and (
                        dataclasses.is_dataclass(value) or callable(getattr(value, "to_dict", None))) \
                        and hasattr(value, "__dict__"):
                    seen.add(id(value))
                    owners.append((key, value))  # a config object: its fields, one level down
        return snap, same, lists, sizes

    def check(self) -> None:
        if _moved(self.same) or list(map(len, self.sized)) != self.sizes:
            return self._compare()
        for d, key, frozen in self.lists:
            if _plain(d.get(key, _MISSING)) != frozen:
                return self._compare()
        return None

    def _compare(self) -> None:
        before, (now, same, lists, sizes) = self.snapshot, self._take()
        name = type(self.model).__name__
        again = "call attnopt.generation.cached(model) again to build the cached model from the model as it is now"
        for path in [*before, *(p for p in now if p not in before)]:
            old, new = before.get(path), now.get(path)
            if old is not None and new is not None and old[:2] == new[:2]:
                continue
            kind = (old or new)[0]  # type: ignore[index]
            if kind == "module":
                what = ("was added" if old is None else "was removed" if new is None
                        else f"was replaced by another {new[2]}")
                raise ModelChangedError(
                    f"submodule `{path[:-len(' (module)')]}` of {name} {what} after attnopt.generation.cached(model); "
                    f"the cached graph runs the forward captured from the old one: {again}")
            if kind == "hooks":
                raise ModelChangedError(
                    f"`{path}` of {name}: forward hooks were added or removed after attnopt.generation.cached(model) "
                    f"({old[1] if old else 0} at capture, {new[1] if new else 0} now); the cached graph does not "
                    f"run them as the model as written now does: {again}")
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
        self._keep(now, same, lists, sizes)
        return None


def _resolve(model: nn.Module, path: str) -> tuple[dict[str, Any] | None, list[tuple[dict[str, Any], str, Any]]]:
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


class _Watch:
    """Checks, before every prefill and step, that the model still is what the cached model was built from.

    Every tensor the cached graph (or a :class:`MaskCheck`) reads is pinned to its *object*: a parameter or
    buffer replaced by another one is not what the graph computes with, so the call raises
    :class:`ModelChangedError`. In-place writes reach the graph (it shares the tensors), so weight updates
    need nothing; but a buffer whose *values* a causal proof read (its band pattern) is also pinned to its
    version counter and storage: when either moved, the pattern is checked again (:func:`runtime.is_band`)
    and the call raises if it no longer holds. A proof-only buffer (the rewritten graph no longer reads it)
    may be replaced by another tensor holding the same pattern. Mask checks read again after their
    tensors changed. A tensor the graph reads converted to another dtype or device (the same object with
    other data: ``model.double()``) raises; the plain attributes of the model are checked by :class:`_Attrs`.
    :meth:`check` returns whether a tensor the graph reads was written (version or storage moved) since the
    last check. The per-call cost is one dict lookup per module and tensor on the pinned names, and one
    version and address read per pinned tensor, plus :class:`_Attrs`.
    """

    def __init__(self, model: nn.Module, pins: list[_Pin]):
        self.model = model
        self.pins = pins
        self.valued = [p for p in pins if p.patterns or p.checks]
        self.links: tuple[list[Any], ...] = ([], [], [])
        self._link()
        self.attrs = _Attrs(model)

    def _link(self) -> None:
        seen: set[tuple[int, str]] = set()
        links = []
        for p in self.pins:
            for d, key, obj in _resolve(self.model, p.path)[1]:
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
        written = self._tensors()
        self.attrs.check()
        return written

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
            where, _ = _resolve(self.model, p.path)
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

    Built by :func:`cached`. ``prefill(idx)`` starts a batch of sequences; ``step(tokens)`` appends
    tokens to all of them. ``length`` is the number of positions cached so far. The token ids of the
    sequences are kept (``batch * max_len`` ids), so that a ``step`` after the model's weights were written
    in place can recompute the whole sequence with the new weights (see :meth:`step`).

    Attributes:
        max_len: positions the caches hold (prompt plus generated tokens fed back).
        bytes_per_token: cache bytes per position of one sequence (K and V of every site).
        cache_bytes: bytes allocated now (``batch * max_len * bytes_per_token`` after a prefill).
        sites: the cached attention modules, in graph order.
        graph_module: the rewritten graph, ``forward(tokens, offset) -> logits``.
        plan: what the position analysis found (shifted position readers, length bounds).
    """

    def __init__(self, graph_module: fx.GraphModule, sites: list[KVCacheAttention], max_len: int,
                 max_len_source: str, bytes_per_token: int | None, plan: PositionPlan, name: str):
        self.graph_module = graph_module
        self.sites = sites
        self.max_len = max_len
        self.max_len_source = max_len_source
        self.bytes_per_token = bytes_per_token
        self.plan = plan
        self.name = name
        self.length = 0
        self.batch: int | None = None
        self.mask_checks: list[MaskCheck] = []
        self.watch: _Watch | None = None  # the model's tensors the cache depends on (see _Watch)
        self.run = graph_module  # or its torch.compile'd version (cached(..., compile=True))
        self.tokens: torch.Tensor | None = None  # (batch, max_len): the ids of positions 0 .. length - 1
        self.stale = False  # weights the graph reads were written since the caches were filled

    @property
    def cache_bytes(self) -> int:
        return sum(s.cache_bytes for s in self.sites)

    def reset(self) -> None:
        """Forget the cached sequences and free the caches."""
        for s in self.sites:
            s.reset()
        self.length, self.batch, self.tokens, self.stale = 0, None, None, False

    def prefill(self, idx: torch.Tensor) -> torch.Tensor:
        """Run the prompt ``idx`` ``(B, T0)``; return its logits ``(B, T0, vocab)`` and cache K and V.

        Computes with the model's weights as they are now (updates made in place before are used).

        Raises:
            ModelChangedError: the model is no longer the one captured (see :class:`ModelChangedError`).
        """
        _check_tokens(idx, "idx")
        self.reset()
        if self.watch is not None:
            self.watch.check()
        self._check_room(idx.size(1))
        self._check_masks(idx.size(0), idx.size(1), idx.device)
        with torch.no_grad():
            logits = self.run(idx, 0)
        self.tokens = idx.new_empty((idx.size(0), self.max_len))
        self.tokens[:, :idx.size(1)] = idx
        self.length, self.batch = idx.size(1), idx.size(0)
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
        _check_tokens(tokens, "tokens")
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

    def _check_masks(self, batch: int, length: int, device: torch.device) -> None:
        for c in self.mask_checks:
            try:
                ok = c.holds(batch, length, device)
            except Exception as e:
                raise PositionError(f"the mask of {c.site_name} ({c.where}) could not be evaluated for {batch} "
                                    f"sequence(s) of {length} tokens: {type(e).__name__}: {e}") from e
            if not ok and c.changed is not None:
                raise ModelChangedError(
                    f"`{c.changed}` of {self.name} changed after attnopt.generation.cached(model), and the mask of "
                    f"{c.site_name} ({c.where}) it builds is no longer causal for {batch} sequence(s) of {length} "
                    "tokens; call attnopt.generation.cached(model) again to build the cached model from the model "
                    "as it is now")
            if not ok:
                raise PositionError(f"the mask of {c.site_name} ({c.where}) is not causal for {batch} sequence(s) "
                                    f"of {length} tokens, so the cache would not compute what the model does")

    def _check_room(self, needed: int) -> None:
        if needed > self.max_len:
            raise ValueError(f"{needed} positions exceed max_len={self.max_len} ({self.max_len_source}); "
                             "build the cached model with a larger max_len if the model allows it, "
                             "or start again with a shorter sequence")

    def describe(self) -> str:
        """Sites, length limit and cache memory as text."""
        checked = {c.site_name for c in self.mask_checks}
        rows = [[s.site_name, s.where, s.spec.describe()
                 + (" (mask checked causal at each length)" if s.site_name in checked else "")] for s in self.sites]
        per = "unknown" if self.bytes_per_token is None else f"{self.bytes_per_token} B"
        lines = [f"attnopt cached {self.name}: {len(self.sites)} attention site(s) cached, "
                 f"max_len={self.max_len} ({self.max_len_source})",
                 f"cache: {per} per position per sequence; allocated {self.cache_bytes} B"
                 + (f" for batch {self.batch}, {self.length} position(s) used" if self.batch else ""),
                 "", tabulate(rows, headers=["site", "where", "attention"])]
        if self.watch is not None and self.watch.paths:
            lines.append("buffers the causal proof read, checked before every call: "
                         + ", ".join(f"`{p}`" for p in self.watch.paths))
        if self.plan.shifted:
            lines.append("positions shifted by the cache length: "
                         + ", ".join(f"`{n.name}`" for n in self.plan.shifted))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"CachedLM({self.name}, sites={len(self.sites)}, max_len={self.max_len}, length={self.length})"


# ----------------------------------------------------------------------------- building


def cached(model: nn.Module, max_len: int | None = None, *, variant: str = "sdpa", compile: bool = False) -> CachedLM:
    """Capture ``model`` (a causal LM, ``forward(idx) -> logits (B, T, vocab)``) and build its cached version.

    Args:
        model: returns logits for every position: a tensor, a tuple whose first item is the logits
            (nanoGPT's ``(logits, loss)``), or an object with ``.logits``. Dropout must be inactive.
        max_len: positions the caches hold. Default: the model's maximum positions when they can be
            found (``config.block_size``/``max_position_embeddings``/..., position tables, length checks
            in ``forward``). A value beyond a position table or check of the model is refused.
        variant: the candidate that attends to the cache: ``"sdpa"`` (default), any registered
            candidate, or ``"auto"``: the selector times the legal candidates for the prefill and
            decode shapes (per power-of-two bucket of the cached length; the tuning cache on disk
            makes later runs free) and keeps the fastest.
        compile: hand the cached graph to Inductor (``torch.compile(..., dynamic=True)``): fused
            elementwise ops, fewer dispatches per step. Compiling takes tens of seconds on the first
            prefill and step; not with ``variant="auto"`` (the choice must be made before tracing).

    Masks that only a run-time check can show causal (see :class:`MaskCheck`) are checked at each new
    ``(batch, length)`` by ``prefill``/``step``, which raise ``PositionError`` if one is not. ``prefill``
    and ``step`` raise :class:`ModelChangedError` once a tensor of ``model`` the cached graph reads was
    replaced by another object or converted to another dtype or device, a buffer a causal proof read lost
    the proven pattern, or a plain attribute of a submodule (or its ``training`` flag, its children, its
    forward hooks) differs from the capture. Weights written in place are followed: before a ``prefill``
    they are used by it; after it, the next ``step`` recomputes the sequence with them (see
    :meth:`CachedLM.step`).

    Raises:
        PositionError: the model is not provably cacheable; the message names the op and line.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"attnopt.generation.cached expects a torch.nn.Module, got {type(model).__name__}")
    if max_len is not None and (not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 1):
        raise ValueError(f"max_len must be a positive int or None, got {max_len!r}")
    if variant != "auto":
        get_candidate(variant)  # a clear error for an unknown name
    elif compile:
        raise ValueError("compile=True needs a fixed candidate (e.g. variant='sdpa'): the selector times "
                         "candidates eagerly, which a compiled graph cannot do")
    if not isinstance(compile, bool):
        raise TypeError(f"compile must be True or False, got {compile!r}")
    selector = Selector() if variant == "auto" else None
    declared = _config_max(model)
    example_len = 4 if declared is None else max(2, min(4, declared))
    gm, tokens, ep = _capture(model, example_len)
    graph = gm.graph
    found = [f for f in find_sites(gm, {}) if isinstance(f, Match)]
    chosen, notes, checks = [], {}, []
    for m in found:
        why = _not_cacheable(m.spec)
        if why is not None and m.spec.causal is None and m.spec.mask != "none":
            check = MaskCheck.of(gm, m, tokens, min(8, declared or 8))  # a mask of sizes alone: causal?
            if isinstance(check, MaskCheck):
                why, checks = _not_cacheable(m.spec, mask_checked=True), [*checks, check]
            else:
                why = f"{why[:-1]}: {check})"
        if why is None:
            chosen.append(m)
        else:
            where = " ".join(x for x in (m.record.module_path, m.record.source) if x)
            for n in m.internal:
                notes[n] = f"it belongs to the attention {m.record.name} ({where}), which {why}"
    proofs = [(str(buf.target), cuts, values, m.record.name) for m in chosen
              for buf, (cuts, values) in zip(m.mask.guarded, m.mask.patterns) if buf.op == "get_attr"]
    if chosen:
        rewrite_sites(gm, chosen, "sdpa", {})
    with graph.inserting_after(tokens):
        offset = graph.placeholder("offset")
    sites, site_nodes = [], []
    for node in list(graph.nodes):
        if node.op != "call_module" or not isinstance(gm.get_submodule(str(node.target)), AttentionSite):
            continue
        old: AttentionSite = gm.get_submodule(str(node.target))  # type: ignore[assignment]
        q, k, v, _mask, scale = node.args[:5]
        site = KVCacheAttention(old.site_name, old.spec, 1, old.where, variant, selector)
        name = f"attnopt_kv_{old.site_name}"
        gm.add_submodule(name, site)
        with graph.inserting_before(node):
            new = graph.call_module(name, (q, k, v, scale, offset))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        sites.append(site)
        site_nodes.append(new)
    graph.eliminate_dead_code()
    gm.delete_all_unused_submodules()
    plan = analyse_positions(gm, tokens, site_nodes, notes)  # no sites: position-wise, nothing to cache
    offset_positions(gm, plan, offset)
    limit, source = _resolve_max_len(max_len, declared, plan, ep, tokens)
    for s in sites:
        s.max_len = limit
    lm = CachedLM(gm, sites, limit, source, _bytes_per_token(site_nodes, tokens), plan, type(model).__name__)
    lm.mask_checks = [c for c in checks if c.site_name in {s.site_name for s in sites}]
    lm.watch = _watch(model, gm, proofs, lm.mask_checks)
    if compile:
        lm.run = torch.compile(gm, dynamic=True)
    return lm


def _watch(model: nn.Module, gm: fx.GraphModule, proofs: list[tuple[str, Any, Any, str]],
           checks: list[MaskCheck]) -> _Watch:
    """Pin the model's tensors that ``gm`` and the mask checks read, and the buffers the causal proofs read."""
    pins: dict[str, _Pin] = {}

    def pin(path: str, read: bool) -> _Pin | None:
        if path not in pins:
            where, _ = _resolve(model, path)
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
    return _Watch(model, list(pins.values()))


def _not_cacheable(spec: AttentionSpec, mask_checked: bool = False) -> str | None:
    if spec.causal is None and not mask_checked:
        mask = "it has no mask" if spec.mask == "none" else f"its {spec.mask} mask is not proven causal"
        return f"is not proven to be causal self-attention ({mask})"
    if spec.dropout_mode == "on":
        return "has active dropout (call model.eval() before generating)"
    if spec.score_mod is not None:
        return f"modifies its scores ({spec.score_mod})"
    if spec.conditions:
        return ("is causal only while a mask term computed at run time (e.g. a padding mask) hides no key, "
                "which the cache cannot check")
    if spec.window is not None:
        return f"attends through a sliding window of {spec.window} keys, which the cache does not apply yet"
    if spec.fill_value is not None:
        return (f"fills masked scores with the finite value {spec.fill_value:g}, which is exact only under a "
                "per-call bound the cache does not check")
    return None


def _capture(model: nn.Module, example_len: int) -> tuple[fx.GraphModule, fx.Node, Any]:
    """``forward(idx)`` as an ATen graph with symbolic batch and length, returning only the logits."""
    param = next(iter(model.parameters()), None)
    device = param.device if param is not None else torch.device("cpu")
    example = torch.zeros(2, example_len, dtype=torch.long, device=device)
    dim = torch.export.Dim.AUTO
    params = list(inspect.signature(model.forward).parameters)
    # Hugging Face models build their own cache object unless told not to; it is not part of the logits.
    kwargs = {"use_cache": False} if "use_cache" in params else {}
    dynamic = {params[0]: {0: dim, 1: dim}, **{k: None for k in kwargs}} if params else None
    try:
        ep = torch.export.export(model, (example,), kwargs, dynamic_shapes=dynamic)
    except Exception as e:
        raise RuntimeError(f"torch.export could not capture {type(model).__name__}.forward(idx) with a dynamic "
                           f"batch and sequence length: {type(e).__name__}: {e}") from e
    if ep.graph_signature.buffers_to_mutate:
        raise PositionError(f"{type(model).__name__}.forward writes its buffers "
                            f"({', '.join(ep.graph_signature.buffers_to_mutate.values())}); a model that keeps "
                            "state between calls cannot be cached by attnopt")
    module = ep.module()
    graph = module.graph
    graph._codegen = fx.graph.CodeGen()  # plain forward(tokens, ...) -> logits, no pytree wrapping
    for node in list(graph.nodes):
        if node.op == "call_module" and str(node.target).startswith("_guards"):
            graph.erase_node(node)  # input range checks; the cache checks max_len itself
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for extra in placeholders[1:]:  # use_cache=False: specialised at capture, unused
        if not extra.users:
            graph.erase_node(extra)
            placeholders.remove(extra)
    if len(placeholders) != 1:
        raise PositionError(f"{type(model).__name__}.forward(idx) was captured with {len(placeholders)} inputs; "
                            "only forward(idx) with token ids is supported")
    out = next(n for n in graph.nodes if n.op == "output")
    flat = list(out.args[0]) if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    sentinels = [torch.empty(0) for _ in flat]
    try:
        chosen = _logits(pytree.tree_unflatten(sentinels, ep.call_spec.out_spec))
        index = next(i for i, s in enumerate(sentinels) if s is chosen)
    except (TypeError, StopIteration) as e:
        raise PositionError(f"{type(model).__name__}.forward must return logits: a tensor, a tuple whose first "
                            "item is the logits, or an object with .logits") from e
    out.args = (flat[index],)
    gm = fx.GraphModule(module, graph, class_name=f"Cached{type(model).__name__}")
    _tidy(gm)
    return gm, placeholders[0], ep


_FULL_END = 2**63 - 1  # the end ``x[a:]`` records in ATen graphs


def _tidy(gm: fx.GraphModule) -> None:
    """Undo spellings ``torch.export`` adds, so attention matches as it does in dynamo graphs.

    ``aten._assert_tensor_metadata`` (a dtype check after ``.float()``) is dropped; ``a.type_as(b)`` and
    ``a.float()`` (``aten.to.dtype``) become ``aten._to_copy(a, dtype=...)``; ``x[:, :]`` (a slice from 0 to
    the end) and inactive dropout (``aten.dropout(x, p, train=False)`` or ``p == 0``) become ``x``.
    None of them changes a value; active dropout stays, and the position analysis refuses it.
    """
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten._assert_tensor_metadata.default:
            graph.erase_node(node)
        elif node.target in (aten.type_as.default, aten.to.dtype):
            with graph.inserting_before(node):
                cast = graph.call_function(aten._to_copy.default, (node.args[0],), {"dtype": meta_value(node).dtype})
            cast.meta.update(node.meta)
            node.replace_all_uses_with(cast)
            graph.erase_node(node)
        elif node.target is aten.slice.Tensor and tuple(node.args[2:]) in ((0, _FULL_END), (None, _FULL_END),
                                                                          (0, _FULL_END, 1), (None, _FULL_END, 1)) \
                or node.target is aten.dropout.default and (node.args[1] == 0 or node.args[2] is False):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()


def _config_max(model: nn.Module) -> int | None:
    config = getattr(model, "config", getattr(model, "cfg", None))
    for name in _CONFIG_MAX:
        value = getattr(config, name, None) if config is not None else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _resolve_max_len(requested: int | None, declared: int | None, plan: PositionPlan, ep: Any,
                     tokens: fx.Node) -> tuple[int, str]:
    """The cache length: requested, else declared by the config, else the tightest bound the graph shows."""
    hard = list(plan.bounds)
    seq = plan.seq
    vr = ep.range_constraints.get(seq)
    if vr is not None:
        if isinstance(vr.upper, (int, sympy.Integer)):
            hard.append(("a length check in forward", int(vr.upper)))
    tightest = min(hard, key=lambda b: b[1], default=None)
    if requested is not None:
        if tightest is not None and requested > tightest[1]:
            raise ValueError(f"max_len={requested} exceeds what the model can index: {tightest[1]} positions "
                             f"({tightest[0]})")
        return requested, "requested"
    if declared is not None:
        if tightest is not None and declared > tightest[1]:
            return tightest[1], tightest[0]
        return declared, "the model's config"
    if tightest is not None:
        return tightest[1], tightest[0]
    raise ValueError("could not find the model's maximum number of positions (no config.block_size / "
                     "max_position_embeddings, position table or length check); pass max_len=")


def _bytes_per_token(site_nodes: list[fx.Node], tokens: fx.Node) -> int | None:
    """K and V bytes per position of one sequence, read from the symbolic shapes of the site inputs."""
    shape = shape_of(tokens)
    assert shape is not None
    per_seq = shape[0] * shape[1]
    total = 0
    for node in site_nodes:
        for x in node.args[1:3]:
            val = meta_value(x)
            if not isinstance(val, torch.Tensor):
                return None
            count = sympy.simplify(sympy.sympify(val.numel()) / sympy.sympify(per_seq))
            if not count.is_Integer:
                return None
            total += int(count) * val.element_size()
    return total


# ----------------------------------------------------------------------------- decoding


def _logits(out: Any) -> torch.Tensor:
    """The logits of a forward's result: a tensor, ``(logits, ...)``, or ``.logits``."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise TypeError(f"the model returned {type(out).__name__}; expected logits: a tensor, a tuple whose first "
                    "item is the logits, or an object with .logits")


def _check_tokens(idx: Any, what: str) -> None:
    if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.dtype not in (torch.long, torch.int):
        got = f"{tuple(idx.shape)} {idx.dtype}" if isinstance(idx, torch.Tensor) else type(idx).__name__
        raise ValueError(f"{what} must be token ids of shape (batch, length) and dtype torch.long, got {got}; "
                         "add a batch dim with idx[None]")
    if idx.size(1) < 1:
        raise ValueError(f"{what} must hold at least one token per sequence")


def _check_sampling(max_new_tokens: Any, temperature: Any, top_k: Any, do_sample: Any, generator: Any) -> None:
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if not isinstance(temperature, (int, float)) or not temperature > 0 or not math.isfinite(temperature):
        raise ValueError(f"temperature must be a positive number, got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
    if not isinstance(do_sample, bool):
        raise TypeError(f"do_sample must be True or False, got {do_sample!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")


def _next_token(logits: torch.Tensor, temperature: float, top_k: int | None, do_sample: bool,
                generator: torch.Generator | None) -> torch.Tensor:
    """Pick one token per row from the last position's logits ``(B, vocab)``: argmax, or a sample."""
    if not do_sample:
        return torch.argmax(logits, dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        logits = logits.masked_fill(logits < v[:, [-1]], float("-inf"))
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)


def _check_total(idx: torch.Tensor, max_new_tokens: int, max_len: int | None) -> None:
    needed = idx.size(1) + max_new_tokens - 1  # the last new token is never fed back
    if max_len is not None and max_new_tokens > 0 and needed > max_len:
        raise ValueError(f"a prompt of {idx.size(1)} tokens plus {max_new_tokens} new ones needs {needed} positions, "
                         f"more than max_len={max_len}; generate fewer tokens or shorten the prompt")


def generate_plain(model: nn.Module, idx: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
                   top_k: int | None = None, do_sample: bool = False, generator: torch.Generator | None = None,
                   max_len: int | None = None) -> torch.Tensor:
    """The full-recompute loop: run the whole sequence for every new token. Returns ``(B, T0 + max_new_tokens)``.

    The reference :func:`generate` is checked against; it picks tokens with the same ops in the same
    order, so a generator seeded alike gives the same samples.
    """
    _check_tokens(idx, "idx")
    _check_sampling(max_new_tokens, temperature, top_k, do_sample, generator)
    _check_total(idx, max_new_tokens, max_len)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = _logits(model(idx))
            nxt = _next_token(logits[:, -1, :], temperature, top_k, do_sample, generator)
            idx = torch.cat((idx, nxt), dim=1)
    return idx


def generate(model: nn.Module | CachedLM, idx: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int | None = None, do_sample: bool = False, generator: torch.Generator | None = None,
             max_len: int | None = None, variant: str = "sdpa", compile: bool = False) -> torch.Tensor:
    """Generate ``max_new_tokens`` tokens after ``idx`` ``(B, T0)`` with a KV cache; returns ``(B, T0 + N)``.

    Same tokens as :func:`generate_plain` (greedy: argmax of the last logits; ``do_sample=True``: scale by
    ``temperature``, keep the ``top_k`` largest, sample with ``generator``). ``model`` is a causal LM
    (see :func:`cached`) or a :class:`CachedLM` built before (capture takes seconds; reuse it).
    ``variant`` and ``compile`` are passed to :func:`cached` when ``model`` is a module.

    Raises:
        PositionError: the model cannot be cached exactly (the message names the op and line).
        ModelChangedError: ``model`` is a :class:`CachedLM` whose model changed since it was built (see
            :func:`cached`).
        ValueError: bad arguments, or the prompt plus new tokens exceed ``max_len``.
    """
    _check_tokens(idx, "idx")
    _check_sampling(max_new_tokens, temperature, top_k, do_sample, generator)
    if isinstance(model, CachedLM):
        if max_len is not None and max_len != model.max_len:
            raise ValueError(f"max_len={max_len} differs from the CachedLM's max_len={model.max_len}; "
                             "build another with attnopt.generation.cached(model, max_len=...)")
        lm = model
    else:
        lm = cached(model, max_len=max_len, variant=variant, compile=compile)
    _check_total(idx, max_new_tokens, lm.max_len)
    if max_new_tokens == 0:
        return idx
    out = [idx]
    logits = lm.prefill(idx)
    for i in range(max_new_tokens):
        nxt = _next_token(logits[:, -1, :], temperature, top_k, do_sample, generator)
        out.append(nxt)
        if i + 1 < max_new_tokens:
            logits = lm.step(nxt)
    return torch.cat(out, dim=1)


__all__ = ["CachedLM", "KVCacheAttention", "MaskCheck", "ModelChangedError", "PositionError", "cached", "generate",
           "generate_plain"]
