"""Mask analysis: turn the ops between the score product and the softmax into one SDPA mask.

Matches the chain of mask ops that ``find_sites`` collected (``masked_fill``, ``where`` and
additions, in program order) and emits a :class:`MaskPlan`: the mask kind SDPA receives
(``bool`` keep-mask or ``additive``), whether it is *proven* causal, and which buffers that
proof read (so the runtime can check they did not change).

Causality is proven by a small abstract interpreter over the mask's own subgraph
(:class:`BandReader`). Every value is a :class:`Band`: a tensor whose element ``[..., i, j]``
depends only on ``d = j - i``, piecewise constant between ascending ``cuts`` (leading dims,
e.g. ``expand(B, 1, T, T)``, carry the same band). Constants, ``tril``/``triu``, comparisons,
``~``, ``&``, ``|``, ``where``/``masked_fill`` of constants, casts, ``expand`` and slices of the last
two dims (which shift the cuts) map to bands; so do buffers whose values form a band (read once
and guarded at run time), and index arithmetic over ``arange`` (:class:`_Affine`:
``arange(T)[:, None] - arange(T)[None, :] < w``). A boolean term the reader cannot see (a padding
mask computed from an input) may be ANDed in (or ORed, hiding nothing): the proof then assumes
it keeps every key, and the site checks that on every call (``plan.conditions``). Anything else
is "unknown" and the mask is passed to SDPA as a tensor (always exact, just not as fast).

The terms together must keep exactly ``d <= hi`` (causal, ``hi`` = 0 top-left or ``Tk - Tq``
bottom-right) or ``hi - w < d <= hi`` (a causal sliding window of width ``w``).

Example: nanoGPT's ``att.masked_fill(self.bias[:, :, :T, :T] == 0, float('-inf'))`` with a
``tril(ones)`` buffer reads as ``keep = Band(T, T, cuts=(0,), values=(True, False))``: causal,
top-left aligned, guarded on ``self.bias``. Mistral's ``(kv <= q) & (kv > q - 4)`` reads as
``Band(T, T, (-4, 0), (False, True, False))``: a window of 4.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..kernels.bands import band_pattern
from ..spec import Refusal
from .canon import aliases, attr_value, convert_scalar, dtype_of, is_call_input, meta_value, mutated, read, shape_of


@dataclass(frozen=True)
class Fill:
    """``scores.masked_fill(cond, value)``; ``keep_when_true`` for ``where(cond, scores, value)``."""

    cond: fx.Node
    value: float
    keep_when_true: bool = False
    dtype: torch.dtype | None = None  # of the filled scores (a later cast may change the softmax input's)
    #: method calls ``(name, args)`` that bring ``cond`` from the layout of the scores it was applied to (a
    #: view that folds or unfolds their leading axes) to the site's layout; empty when they are the same
    relayout: tuple[tuple[str, tuple[Any, ...]], ...] = ()
    #: ``cond`` is a 0/1 factor, not a bool: ``scores * cond + value * (1 - cond)`` (OpenAI-GPT), which keeps
    #: the score where ``cond`` is 1 and fills ``value`` where it is 0; the rewrite checks on every call
    #: that ``cond`` holds only those two values (:func:`attnopt.passes.rewrite_sdpa.binary_keep`)
    binary: bool = False


@dataclass(frozen=True)
class Add:
    """``scores + mask``; with ``factor``, the sum was scaled afterwards: ``(scores + mask) * factor``.

    The scaled sum is ``scores * factor + mask * factor``, so SDPA receives ``mask * factor``,
    except where the mask holds the dtype's minimum: a key masked that way stays masked at any
    positive factor, and keeping the minimum lets the site recognise rows with every key masked.
    """

    mask: fx.Node
    factor: float = 1.0
    dtype: torch.dtype | None = None  # the sum's: a bool or integer mask is converted to it (type promotion)
    relayout: tuple[tuple[str, tuple[Any, ...]], ...] = ()  # as for :class:`Fill`


@dataclass
class MaskPlan:
    kind: str  # "none" | "bool" | "additive"
    terms: list[Any] = field(default_factory=list)
    causal: str | None = None
    nan_rows: bool = False
    guarded: list[fx.Node] = field(default_factory=list)  # buffers the causal proof read
    min_rows: str = "none"  # see AttentionSpec.min_rows
    fill_spelling: str = ""
    bound_fill: float | None = None  # a finite fill (-1e4, -100): exact under a bound checked per call
    fill_with_adds: bool = False  # with ``bound_fill``: added masks too (rows the fill may weigh run as written)
    window: int | None = None  # with ``causal``: keys at most ``window - 1`` behind the query are kept
    patterns: list[tuple[tuple[Any, ...], tuple[Any, ...]]] = field(default_factory=list)  # per guarded buffer
    conditions: list[tuple[fx.Node, bool]] = field(default_factory=list)  # run-time terms the proof assumes


@dataclass(frozen=True)
class Band:
    """A tensor whose leading dims are 1 and whose element ``[i, j]`` depends only on ``d = j - i``.

    ``values[n]`` holds where exactly ``n`` of the ascending ``cuts`` are below ``d``: ``values[0]``
    for ``d <= cuts[0]``, ``values[1]`` for ``cuts[0] < d <= cuts[1]``, ..., ``values[-1]`` above the
    last cut. A lower-triangular keep-mask is ``Band(T, T, (0,), (True, False))``; a causal sliding
    window of width ``w`` is ``Band(T, T, (-w, 0), (False, True, False))``. Cuts may be symbolic
    (a bottom-right slice shifts them by ``Tk - Tq``); their order must be provable.
    """

    rows: Any
    cols: Any
    cuts: tuple[Any, ...]
    values: tuple[Any, ...]

    @classmethod
    def const(cls, rows: Any, cols: Any, value: Any) -> Band:
        return cls(rows, cols, (), (value,))

    def map(self, f: Any) -> Band:
        return _normal(Band(self.rows, self.cols, self.cuts, tuple(f(v) for v in self.values)))

    def shifted(self, by: Any, rows: Any, cols: Any) -> Band:
        return Band(rows, cols, tuple(c + by for c in self.cuts), self.values)


@dataclass(frozen=True)
class _Affine:
    """An integer tensor whose element is ``const + sum(coef[d] * index[d])`` (``arange`` and its views)."""

    shape: tuple[Any, ...]
    coef: tuple[Any, ...]  # 0 on size-1 dims
    const: Any


class _Unknown(Refusal):
    """The band reader cannot read a value; the mask then goes to SDPA as a tensor (no reason needed)."""


def same(a: Any, b: Any) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        return bool(statically_known_true(a == b))
    except Exception:  # noqa: BLE001 - an unprovable comparison is simply not proven
        return False


def _less(a: Any, b: Any) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a < b
    try:
        return bool(statically_known_true(a < b))
    except Exception:  # noqa: BLE001
        return False


def _order(a: Any, b: Any) -> int:
    """-1, 0 or 1 as ``a`` is provably below, equal to or above ``b``; raises when unprovable."""
    if same(a, b):
        return 0
    if _less(a, b):
        return -1
    if _less(b, a):
        return 1
    raise _Unknown


def _normal(b: Band) -> Band:
    """Drop cuts with equal values on both sides."""
    cuts, values = [], [b.values[0]]
    for c, v in zip(b.cuts, b.values[1:]):
        if v == values[-1] and type(v) is type(values[-1]):
            continue
        cuts.append(c)
        values.append(v)
    return Band(b.rows, b.cols, tuple(cuts), tuple(values))


def _merge(a: Band, b: Band, f: Any) -> Band:
    """The band of ``f(a[i, j], b[i, j])`` (cuts of both, in proven order)."""
    cuts: list[Any] = []
    for c in (*a.cuts, *b.cuts):
        pos = 0
        while pos < len(cuts) and _order(cuts[pos], c) < 0:
            pos += 1
        if pos < len(cuts) and _order(cuts[pos], c) == 0:
            continue
        cuts.insert(pos, c)

    def at(band: Band, lower: Any) -> Any:  # value in the region just above cut `lower` (None: the lowest)
        if lower is None:
            return band.values[0]
        return band.values[sum(1 for c in band.cuts if _order(c, lower) <= 0)]

    values = tuple(f(at(a, lo), at(b, lo)) for lo in (None, *cuts))
    return _normal(Band(a.rows, a.cols, tuple(cuts), values))


def _value(x: Any) -> Any:
    """Python or symbolic value of an argument (node meta for nodes)."""
    if isinstance(x, fx.Node):
        v = meta_value(x)
        if isinstance(v, (int, float, torch.SymInt, torch.SymFloat)):
            return v
        raise _Unknown
    return x


_COMPARE = {"le": lambda x, y: x <= y, "lt": lambda x, y: x < y, "ge": lambda x, y: x >= y,
            "gt": lambda x, y: x > y, "eq": lambda x, y: x == y, "ne": lambda x, y: x != y}
_COMBINE = {"and": lambda x, y: bool(x) and bool(y), "or": lambda x, y: bool(x) or bool(y),
            "add": lambda x, y: x + y, "mul": lambda x, y: x * y}


class BandReader:
    """Abstract interpreter from mask-subgraph nodes to :class:`Band` values.

    Reads constants and buffers (``tril``/``triu``, ``ones``, ``full``), index arithmetic
    (``arange(T)[:, None] >= arange(T)[None, :]``, ``q_idx - kv_idx < w``), comparisons, ``~``,
    ``&``, ``|``, ``where``/``masked_fill`` of constants, casts and slices of the last two dims.
    Anything else raises ``_Unknown``.
    """

    def __init__(self, root: torch.nn.Module, concrete: dict[fx.Node, torch.Tensor]):
        self.root = root
        self.concrete = concrete
        self.guarded: list[fx.Node] = []
        self.patterns: dict[fx.Node, Band] = {}  # guarded buffer -> its band over the whole buffer
        self.conditions: list[tuple[fx.Node, bool]] = []  # run-time bool tensors: (node, must be all True)

    def band(self, node: Any) -> Band:
        if not isinstance(node, fx.Node) or mutated(node):
            raise _Unknown  # a tensor written in place after it was built is not what its op computes
        shape = shape_of(node)
        if shape is None or len(shape) < 2:
            raise _Unknown
        # Leading dims may be larger than 1 (``expand(B, 1, T, T)``): every rule below builds values
        # that depend on (i, j) only, so they are constant along them. Buffers must have them 1.
        rows, cols = shape[-2], shape[-1]
        if node.op in ("placeholder", "get_attr"):
            return self._buffer(node, rows, cols)
        op = read(node, self.root)
        if op is None:
            raise _Unknown
        k = op.kind
        if k == "factory":
            fill = _value(op.args[0])
            if not isinstance(fill, (int, float, bool)):
                raise _Unknown
            return _convert(Band.const(rows, cols, fill), dtype_of(node))  # ones(.., dtype=bool): True
        if k in ("tril", "triu"):
            src = self._operand(op.args[0], rows, cols)
            diag = _value(op.args[1])
            zero = False if src.values and isinstance(src.values[0], bool) else 0
            if k == "tril":  # keep d <= diag
                return _merge(src, Band(rows, cols, (diag,), (True, False)), lambda x, m: x if m else zero)
            return _merge(src, Band(rows, cols, (diag - 1,), (False, True)), lambda x, m: x if m else zero)
        if k in _COMPARE:
            return self._compare(k, op.args[0], op.args[1], rows, cols)
        if k == "not":
            b = self.band(op.args[0])
            if dtype_of(node) != torch.bool or not all(isinstance(v, bool) for v in b.values):
                raise _Unknown  # ~ on integers is bitwise
            return b.map(lambda v: not v)
        if k in _COMBINE:
            a, c = op.args
            if k in ("add", "mul") and not (isinstance(a, fx.Node) and isinstance(c, fx.Node)):
                raise _Unknown
            dt = dtype_of(node)
            if k in ("and", "or"):
                if dt != torch.bool:
                    raise _Unknown  # & and | on integers are bitwise
                return self._logical(k, a, c, rows, cols)
            if dt is None or not dt.is_floating_point:
                raise _Unknown  # integer sums and products wrap around
            return _convert(_merge(self._operand(a, rows, cols), self._operand(c, rows, cols), _COMBINE[k]),
                            dtype_of(node))
        if k in ("where", "masked_fill"):
            cond, yes, no = (op.args if k == "where" else (op.args[1], op.args[2], op.args[0]))
            merged = _merge(self._operand(cond, rows, cols), self._operand(yes, rows, cols),
                            lambda c, y: (bool(c), y))
            return _convert(_merge(merged, self._operand(no, rows, cols), lambda cy, n: cy[1] if cy[0] else n),
                            dtype_of(node))
        if k == "neg":
            dt = dtype_of(node)
            if dt is None or not dt.is_floating_point:
                raise _Unknown  # integer negation wraps
            return self.band(op.args[0]).map(lambda v: -v)
        if k in ("cast", "identity", "view"):
            b = self.band(op.args[0])
            if not (same(b.rows, rows) and same(b.cols, cols)):
                raise _Unknown
            return _convert(b, dtype_of(node))
        if k == "getitem":
            return self._slice(node, op.args[0], op.args[1], rows, cols)
        raise _Unknown

    def _logical(self, k: str, a: Any, c: Any, rows: Any, cols: Any) -> Band:
        """``a & c`` or ``a | c``; one operand may be a run-time tensor (a padding mask): a condition.

        ``band & x`` equals ``band`` whenever ``x`` is all True, and ``band | x`` whenever ``x`` is all
        False. The site checks that on every call (``plan.conditions``) and passes the mask tensor
        when it does not hold.
        """
        known, assumed = [], []
        for x in (a, c):
            mark = (len(self.guarded), len(self.conditions))
            try:
                known.append(self._operand(x, rows, cols))
            except _Unknown:
                del self.guarded[mark[0]:], self.conditions[mark[1]:]
                if not (isinstance(x, fx.Node) and dtype_of(x) == torch.bool and _broadcasts(x, rows, cols)
                        and not _written(x)):
                    raise
                assumed.append((x, k == "and"))
                known.append(Band.const(rows, cols, k == "and"))
        if len(assumed) == 2:
            raise _Unknown  # nothing is known about either side
        self.conditions.extend(assumed)
        return _merge(known[0], known[1], _COMBINE[k])

    def _operand(self, x: Any, rows: Any, cols: Any) -> Band:
        """A node's band, or a number as a constant band."""
        if isinstance(x, fx.Node):
            if shape_of(x) is not None and len(shape_of(x) or ()) == 0:
                op = read(x, self.root)  # a 0-d tensor: only a constant factory (zeros(()), new_ones(())) is known
                if op is None or op.kind != "factory" or mutated(x) or not isinstance(op.args[0], (int, float, bool)):
                    raise _Unknown
                return _convert(Band.const(rows, cols, op.args[0]), dtype_of(x))
            b = self.band(x)
            if not ((same(b.rows, rows) or same(b.rows, 1)) and (same(b.cols, cols) or same(b.cols, 1))):
                raise _Unknown
            if (same(b.rows, 1) and not same(rows, 1)) or (same(b.cols, 1) and not same(cols, 1)):
                if b.cuts:
                    raise _Unknown  # a broadcast row or column is constant only if the band is
            return b
        v = _value(x)
        if not isinstance(v, (int, float, bool)):
            raise _Unknown
        return Band.const(rows, cols, v)

    def _compare(self, k: str, a: Any, b: Any, rows: Any, cols: Any) -> Band:
        """``a <op> b`` where both sides are index arithmetic (or one is a band and the other a number)."""
        try:
            diff = self._affine_diff(a, b)
        except _Unknown:
            if isinstance(a, fx.Node) and not isinstance(b, fx.Node):
                s = _value(b)
                src = dtype_of(a)
                if src is None or not isinstance(s, (int, float, bool)):
                    raise _Unknown from None
                # torch compares in the promoted dtype: a float16 band against 0.1 compares 0.1 in float16
                common = torch.result_type(torch.empty(1, dtype=src), s)
                band = _convert(self.band(a), common)
                try:
                    s = convert_scalar(s, common)
                except ValueError:
                    raise _Unknown from None
                return band.map(lambda v: bool(_COMPARE[k](v, s)))
            raise
        ci, cj, c = diff  # a - b = ci * i + cj * j + c
        if same(rows, 1) and cj in (1, -1):
            ci = -cj  # one query row (a decode step): i is always 0, so any coefficient of it is the same
        if same(cols, 1) and ci in (1, -1):
            cj = -ci
        if ci == 0 and cj == 0:
            if not isinstance(c, int):
                raise _Unknown
            return Band.const(rows, cols, bool(_COMPARE[k](c, 0)))
        if not (ci == -cj and ci in (1, -1)):
            raise _Unknown
        # a - b = s * (i - j) + c = -s * d + c with d = j - i
        s = ci
        if k in ("eq", "ne"):
            target = c * s  # d == c * s  (s = +-1)
            band = Band(rows, cols, (target - 1, target), (False, True, False))
            return band if k == "eq" else band.map(lambda v: not v)
        # Normalise to  d <= t  (True below) or  d > t  (True above).
        if s == 1:  # -d + c  <op>  0
            table = {"le": ("above_eq", c), "lt": ("above", c), "ge": ("below_eq", c), "gt": ("below", c)}
        else:  # d + c <op> 0
            table = {"le": ("below_eq", -c), "lt": ("below", -c), "ge": ("above_eq", -c), "gt": ("above", -c)}
        how, t = table[k]
        if how == "below_eq":  # d <= t
            return Band(rows, cols, (t,), (True, False))
        if how == "below":  # d < t  <=>  d <= t - 1
            return Band(rows, cols, (t - 1,), (True, False))
        if how == "above_eq":  # d >= t  <=>  d > t - 1
            return Band(rows, cols, (t - 1,), (False, True))
        return Band(rows, cols, (t,), (False, True))  # d > t

    def _affine_diff(self, a: Any, b: Any) -> tuple[Any, Any, Any]:
        """``a - b`` as ``(coef of the row index, coef of the column index, constant)``."""
        x = self._affine_or_number(a)
        y = self._affine_or_number(b)
        if not isinstance(x, _Affine) and not isinstance(y, _Affine):
            raise _Unknown
        d = _affine_sum(x, y, -1)
        nd = len(d.shape)
        if nd < 2 or any(c != 0 for c in d.coef[:-2]):
            if nd == 1 and d.coef[0] == 0:
                return 0, 0, d.const
            raise _Unknown
        return d.coef[-2], d.coef[-1], d.const

    def _affine_or_number(self, x: Any) -> Any:
        if isinstance(x, fx.Node) and not isinstance(meta_value(x), torch.Tensor):
            return _value(x)
        if isinstance(x, fx.Node):
            return self.affine(x)
        return _value(x)

    def affine(self, node: fx.Node) -> _Affine:
        """``node`` as index arithmetic over ``arange``."""
        if mutated(node):
            raise _Unknown
        if dtype_of(node) not in (torch.int32, torch.int64):
            raise _Unknown  # narrower or unsigned integers wrap around
        shape = shape_of(node)
        if shape is None:
            raise _Unknown
        if node.op == "call_function" and node.target in _ARANGE:
            args = [_value(a) for a in node.args]
            kw = {name: _value(node.kwargs[name]) for name in ("start", "end", "step") if name in node.kwargs}
            if len(args) == 1:
                args = [kw.get("start", 0), args[0], kw.get("step", 1)]  # arange(end) (start/step may be keywords)
            elif len(args) == 2:
                args = [args[0], args[1], kw.get("step", 1)]
            elif not args:
                args = [kw.get("start", 0), kw.get("end"), kw.get("step", 1)]
            start, step = args[0], args[2]
            if not isinstance(step, int) or not isinstance(start, (int, torch.SymInt)):
                raise _Unknown
            return _Affine(tuple(shape), (step,), start)
        op = read(node, self.root)
        if op is None:
            raise _Unknown
        if op.kind in ("add", "sub") or (op.kind == "scale" and op.args[2] == "mul"):
            if op.kind == "scale":
                x, factor = self.affine(op.args[0]), _value(op.args[1])
                if not isinstance(factor, int):
                    raise _Unknown
                return _Affine(x.shape, tuple(c * factor for c in x.coef), x.const * factor)
            left, right = self._affine_or_number(op.args[0]), self._affine_or_number(op.args[1])
            out = _affine_sum(left, right, 1 if op.kind == "add" else -1)
            if tuple(out.shape) != tuple(shape) and not all(same(p, r) for p, r in zip(out.shape, shape)):
                raise _Unknown
            return out
        if op.kind in ("cast", "identity"):
            if dtype_of(node) == torch.int32 and dtype_of(op.args[0]) != torch.int32:
                raise _Unknown  # int64 -> int32 may wrap around
            return self.affine(op.args[0])
        if op.kind == "view":
            return _reshaped(self.affine(op.args[0]), tuple(shape), node)
        if op.kind == "getitem":
            return _indexed(self.affine(op.args[0]), op.args[1], tuple(shape))
        raise _Unknown

    def _buffer(self, node: fx.Node, rows: Any, cols: Any) -> Band:
        t = self.concrete.get(node)
        if t is None and node.op == "get_attr":
            t = attr_value(self.root, str(node.target))
        if not isinstance(t, torch.Tensor) or t.dim() < 2 or t.is_meta:
            raise _Unknown
        if t.requires_grad or getattr(meta_value(node), "requires_grad", False):
            raise _Unknown  # is_causal would drop the gradient that reaches this tensor through the mask
        pattern = band_pattern(t)
        if pattern is None:
            raise _Unknown
        cuts, values = pattern
        self.guarded.append(node)
        self.patterns[node] = Band(rows, cols, cuts, values)
        return Band(rows, cols, cuts, values)

    def _slice(self, node: fx.Node, src: Any, index: Any, rows: Any, cols: Any) -> Band:
        b = self.band(src)
        if not isinstance(index, tuple):
            index = (index,)
        src_nd = len(shape_of(src) or ())
        full = list(index)
        if any(e is Ellipsis for e in full):
            pos = full.index(Ellipsis)
            n_real = sum(1 for e in full if e is not None and e is not Ellipsis)
            full = full[:pos] + [slice(None)] * (src_nd - n_real) + full[pos + 1:]
        full += [slice(None)] * (src_nd - sum(1 for e in full if e is not None))
        if any(e is None for e in full[-2:]):
            raise _Unknown  # a new dim among the last two: the source's rows or columns move to a leading dim
        entries = [e for e in index if e is not None]  # None adds a leading dim of size 1
        if any(e is Ellipsis for e in entries):
            pos = entries.index(Ellipsis)
            src_nd = len(shape_of(src) or ())
            entries = entries[:pos] + [slice(None)] * (src_nd - len(entries) + 1) + entries[pos + 1:]
        src_nd = len(shape_of(src) or ())
        entries = entries + [slice(None)] * (src_nd - len(entries))
        if len(entries) != src_nd or not all(isinstance(e, slice) for e in entries):
            raise _Unknown
        for e in entries[:-2]:
            if e.step not in (None, 1):
                raise _Unknown
        r, c = entries[-2], entries[-1]
        if r.step not in (None, 1) or c.step not in (None, 1):
            raise _Unknown
        r0 = 0 if r.start is None else _value(r.start)
        c0 = 0 if c.start is None else _value(c.start)
        if (isinstance(r0, int) and r0 < 0) or (isinstance(c0, int) and c0 < 0):
            raise _Unknown
        return b.shifted(r0 - c0, rows, cols)


def _written(x: fx.Node) -> bool:
    """``x``, or a tensor it is a view of, is written in place somewhere in the graph."""
    cur: Any = x
    for _ in range(16):
        if mutated(cur):
            return True
        if not (isinstance(cur, fx.Node) and cur.op in ("call_function", "call_method") and cur.args
                and isinstance(cur.args[0], fx.Node) and aliases(cur)):
            return False
        cur = cur.args[0]
    return True


def _broadcasts(x: fx.Node, rows: Any, cols: Any) -> bool:
    """``x``'s last two dims broadcast against ``(rows, cols)``."""
    shape = shape_of(x)
    if shape is None or len(shape) == 0:
        return False
    last = (1,) * max(0, 2 - len(shape)) + tuple(shape[-2:])
    return (same(last[0], 1) or same(last[0], rows)) and (same(last[1], 1) or same(last[1], cols))


_ARANGE = (torch.arange, torch.ops.aten.arange.default, torch.ops.aten.arange.start,
           torch.ops.aten.arange.start_step)


def _affine_sum(x: Any, y: Any, sign: int) -> _Affine:
    """``x + sign * y`` for affine values or numbers, broadcast like tensors."""
    if not isinstance(x, _Affine):
        x = _Affine((), (), x)
    if not isinstance(y, _Affine):
        y = _Affine((), (), y)
    n = max(len(x.shape), len(y.shape))
    xs = (1,) * (n - len(x.shape)) + tuple(x.shape)
    ys = (1,) * (n - len(y.shape)) + tuple(y.shape)
    xc = (0,) * (n - len(x.coef)) + tuple(x.coef)
    yc = (0,) * (n - len(y.coef)) + tuple(y.coef)
    shape, coef = [], []
    for a, b, ca, cb in zip(xs, ys, xc, yc):
        if same(a, b) or same(b, 1):
            shape.append(a)
        elif same(a, 1):
            shape.append(b)
        else:
            raise _Unknown
        coef.append((0 if same(a, 1) else ca) + sign * (0 if same(b, 1) else cb))
    return _Affine(tuple(shape), tuple(coef), x.const + sign * y.const)


def _reshaped(x: _Affine, shape: tuple[Any, ...], node: fx.Node) -> _Affine:
    """A view that only adds or drops size-1 dims, or an ``expand`` (aligned from the right, like broadcasting)."""
    if node.target in ("expand", "broadcast_to", torch.broadcast_to, torch.ops.aten.expand.default):
        if len(shape) < len(x.shape):
            raise _Unknown
        lead = len(shape) - len(x.shape)
        coef = [0] * lead
        for s, c, n in zip(x.shape, x.coef, shape[lead:]):
            if same(s, n):
                coef.append(c)
            elif same(s, 1):
                coef.append(0)  # a broadcast dim: the same value along it
            else:
                raise _Unknown
        return _Affine(shape, tuple(coef), x.const)
    src = [(s, c) for s, c in zip(x.shape, x.coef) if not same(s, 1)]
    coef = []
    for n in shape:
        if src and same(src[0][0], n):
            coef.append(src.pop(0)[1])
        elif same(n, 1):
            coef.append(0)
        else:
            raise _Unknown
    if src:
        raise _Unknown
    return _Affine(shape, tuple(coef), x.const)


def _indexed(x: _Affine, index: Any, shape: tuple[Any, ...]) -> _Affine:
    """``x[index]`` for slices, ``None`` and ``...``."""
    if not isinstance(index, tuple):
        index = (index,)
    n_real = sum(1 for e in index if e is not None and e is not Ellipsis)
    if any(e is Ellipsis for e in index):
        pos = index.index(Ellipsis)
        index = index[:pos] + (slice(None),) * (len(x.shape) - n_real) + index[pos + 1:]
    coef, const, dim = [], x.const, 0
    for e in index:
        if e is None:
            coef.append(0)
            continue
        if not isinstance(e, slice) or dim >= len(x.shape):
            raise _Unknown
        start = 0 if e.start is None else _value(e.start)
        step = 1 if e.step is None else _value(e.step)
        if not isinstance(step, int) or (isinstance(start, int) and start < 0):
            raise _Unknown
        const = const + x.coef[dim] * start
        coef.append(x.coef[dim] * step)
        dim += 1
    coef.extend(x.coef[dim:])
    if len(coef) != len(shape):
        raise _Unknown
    return _Affine(shape, tuple(0 if same(s, 1) else c for s, c in zip(shape, coef)), const)


def _convert(b: Band, dtype: torch.dtype | None) -> Band:
    """The band ``b`` converted to ``dtype`` as torch converts its values (see :func:`canon.convert_scalar`):
    ``0.5`` is ``0`` in int64, ``256`` is ``0`` in uint8, bool is "nonzero". A conversion torch leaves
    undefined (a float out of an integer's range), or an unknown dtype, proves nothing."""
    if dtype is None:
        raise _Unknown
    try:
        return b.map(lambda v: convert_scalar(v, dtype))
    except ValueError:
        raise _Unknown from None


def neg_large(value: float, dtype: torch.dtype | None) -> str | None:
    """'inf' for -inf, 'min' for the dtype's most negative finite value, else None."""
    if value == -math.inf:
        return "inf"
    if dtype is not None and dtype.is_floating_point and value == torch.finfo(dtype).min:
        return "min"
    return None


def _bounded_fill_plan(terms: list[Any], finite: list[Fill], score_dtype: torch.dtype | None) -> MaskPlan | str:
    """Masks that fill a finite value such as ``-1e4`` or ``-100``.

    ``softmax(scores.masked_fill(m, f))`` is not SDPA with a boolean mask: masked keys keep the
    weight ``exp(f - rowmax)``, and a row with every key masked is the mean of v. It *is*
    equal within any dtype's tolerance when every kept score ``s`` satisfies
    ``Tk * exp(f - s) < 2**-60``, which holds when ``f + |scale| * max|q_i| * max|k_j| + log(Tk) <= -42``
    (Cauchy-Schwarz bounds every score). The plan passes the dtype's minimum at the masked
    positions (rows with every key masked then become the mean of v, exactly as written) and the
    site checks the bound on every call, computing the fill as written when it does not hold.
    A causal pattern is still proven (``plan_mask``), so a legacy ``masked_fill(~tril, -1e4)``
    runs with ``is_causal`` whenever the bound holds.
    Fills of one value are planned, alone or with added masks (OpenAI-GPT's ``w * b + -1e4 * (1 - b)``
    followed by ``+ attention_mask``). With added masks the plan is ``fill_with_adds``: the mask
    tensor holds the fill as written (``-1e4`` plus what is added after it) and the site is told where
    the fills are (``filled``); a row may then weigh its filled keys (a left-padded query whose every
    other key is padded averages its filled keys as written), so the site computes the rows where the
    bound does not hold as written (:class:`~attnopt.runtime.site.MixedFillSite`). Fills of several
    values, or a finite fill next to ``-inf``/minimum fills, are left as written.
    """
    values = {_in_dtype(f.value, f.dtype or score_dtype) for f in finite}
    fills = [t for t in terms if isinstance(t, Fill)]
    if len(values) != 1 or len(finite) != len(fills):
        return (f"the mask fills scores with {finite[0].value!r} together with fills of other values; a finite fill "
                "(neither -inf nor the dtype's minimum) is rewritten only next to added masks or alone, since mixed "
                "fill values change which keys a row with every key masked averages")
    (value,) = values
    if not math.isfinite(value) or value > -1.0:
        return (f"the mask fills scores with {value!r}, which does not suppress the masked keys; left as written")
    plan = MaskPlan("additive", list(terms), bound_fill=value)  # min_rows: set with the causal proof
    plan.fill_with_adds = len(fills) != len(terms)
    plan.fill_spelling = f"{value:g}" + (", added" if plan.fill_with_adds else "")
    return plan


def _in_dtype(value: float, dtype: torch.dtype | None) -> float:
    """``value`` as the dtype stores it (``-1e4`` is ``-9984`` in bfloat16)."""
    return torch.tensor(value, dtype=dtype or torch.float32).item()


def _keep_band(terms: list[Any], reader: BandReader, score_dtype: torch.dtype | None) -> Band:
    """Where the terms together keep a key (True) as one band; raises ``_Unknown`` otherwise."""
    keep: Band | None = None
    for t in terms:
        if isinstance(t, Fill):
            b = reader.band(t.cond)
            if t.binary:  # a 0/1 factor keeps where it is 1
                if not all(isinstance(v, (bool, int, float)) and v in (0, 1) for v in b.values):
                    raise _Unknown
                b = b.map(lambda v: v == 1)
            if not all(isinstance(v, bool) for v in b.values):
                raise _Unknown
            k = b if t.keep_when_true else b.map(lambda v: not v)
        else:
            b = reader.band(t.mask)
            dt = dtype_of(t.mask) or score_dtype
            if dt is not None and not dt.is_floating_point and t.dtype is not None:
                b, dt = _convert(b, t.dtype), t.dtype  # a bool/integer mask adds its values in the sum's dtype

            def kept(v: Any, dt: torch.dtype | None = dt) -> bool:
                if v == 0:
                    return True
                if isinstance(v, float) and neg_large(v, dt) is not None:
                    return False
                raise _Unknown  # a bias, not a mask
            k = Band(b.rows, b.cols, b.cuts, tuple(kept(v) for v in b.values))
        keep = k if keep is None else _merge(keep, k, lambda x, y: x and y)
    if keep is None:
        raise _Unknown
    return _normal(keep)


def _causal_shape(keep: Band) -> tuple[Any, int | None]:
    """``(hi, window)`` when ``keep`` is ``d <= hi`` (window None) or ``hi - window < d <= hi``."""
    if keep.values == (True, False):
        return keep.cuts[0], None
    if keep.values == (False, True, False):
        lo, hi = keep.cuts
        width = hi - lo
        if isinstance(width, int) and width >= 1:
            return hi, width
        try:
            w = int(width)  # a symbolic difference that simplifies to a number
        except (TypeError, ValueError):
            return None, None
        return (hi, w) if w >= 1 else (None, None)
    return None, None


def _never_inf(t: Add, root: torch.nn.Module, concrete: dict[fx.Node, torch.Tensor]) -> bool:
    """The added mask holds no infinity in the sum's dtype, so it can hide no key: a bool mask (0 or 1), an
    integer mask whose dtype's range is finite there (int64 in float32, uint8 in float16), or a mask built in the
    graph from constants alone (no buffer, no input) whose every value is finite (``torch.zeros(1, 1, T, S)``)."""
    md = dtype_of(t.mask)
    if md is not None and t.dtype is not None and t.dtype.is_floating_point and not md.is_floating_point \
            and not md.is_complex:
        info = None if md == torch.bool else torch.iinfo(md)
        if info is None or max(-info.min, info.max) <= torch.finfo(t.dtype).max:
            return True
    reader = BandReader(root, concrete)
    try:
        b = reader.band(t.mask)
        if t.dtype is not None and dtype_of(t.mask) != t.dtype:
            b = _convert(b, t.dtype)
    except _Unknown:
        return False
    if reader.guarded or reader.conditions:
        return False
    return all(isinstance(v, (int, float, bool)) and math.isfinite(float(v)) for v in b.values)


def plan_mask(terms: list[Any], tq: Any, tk: Any, score_dtype: torch.dtype | None,
              root: torch.nn.Module, concrete: dict[fx.Node, torch.Tensor]) -> MaskPlan | str:
    """Decide how SDPA receives the masks in ``terms``, or return why it cannot exactly."""
    if not terms:
        return MaskPlan("none")
    fills = [t for t in terms if isinstance(t, Fill)]
    for f in fills:
        if f.binary:
            dt = dtype_of(f.cond)
            if dt is None or dt.is_complex or dt == torch.bool:
                return f"the 0/1 keep factor has dtype {dt}"
            reader = BandReader(root, concrete)
            try:
                values = reader.band(f.cond).values
            except _Unknown:
                values = ()
            if any(is_call_input(n) for n in reader.guarded):
                values = ()  # a call input holds other values on another call: no proof to carry over
            if not values or not all(isinstance(v, (bool, int, float)) and v in (0, 1) for v in values):
                return (f"`scores * {f.cond.name} + c * (1 - {f.cond.name})` is a mask only where "
                        f"`{f.cond.name}` holds nothing but 0 and 1, which attnopt cannot prove at capture (it "
                        "reads buffers and constants, not call inputs: a soft or run-time factor is left as written)")
        elif dtype_of(f.cond) != torch.bool:
            return f"the mask condition has dtype {dtype_of(f.cond)}, not torch.bool"
    finite = [f for f in fills if neg_large(f.value, f.dtype or score_dtype) is None]
    if finite:
        bounded = _bounded_fill_plan(terms, finite, score_dtype)
        if isinstance(bounded, str):
            return bounded
        plan = bounded
    else:
        all_inf_fills = all(isinstance(t, Fill) and t.value == -math.inf for t in terms)
        plan = MaskPlan("bool" if all_inf_fills else "additive", list(terms))
        plan.fill_spelling = ", ".join("-inf" if isinstance(t, Fill) and t.value == -math.inf else
                                       "dtype min" if isinstance(t, Fill) else "added" for t in terms)

    # Causal proof: the terms together keep exactly a lower band (causal) or a causal window.
    reader = BandReader(root, concrete)
    try:
        keep = _keep_band(terms, reader, score_dtype)
        if same(keep.rows, tq) and same(keep.cols, tk):
            hi, window = _causal_shape(keep)
            if hi is not None and same(hi, 0):
                plan.causal = "top_left"
            elif hi is not None and same(hi, tk - tq):
                plan.causal = "bottom_right"
            if plan.causal:
                plan.window = window
                plan.guarded = list(reader.guarded)
                plan.patterns = [(reader.patterns[n].cuts, reader.patterns[n].values) for n in reader.guarded]
                plan.conditions = list(reader.conditions)
    except _Unknown:
        pass
    if (plan.window is not None or plan.conditions) and plan.bound_fill is not None:
        # the bounded site has no window and no per-call conditions
        plan.causal, plan.window, plan.guarded, plan.patterns, plan.conditions = None, None, [], [], []
    # A row with every key masked by -inf is NaN as written; SDPA gives zeros there. Top-left
    # causal masks keep key 0 in every row, so only other masks need the NaN rows restored
    # (and guarded ones, for the run where the guard fails and the mask tensor is used).
    has_inf = any(isinstance(t, Fill) and t.value == -math.inf for t in terms) or any(
        isinstance(t, Add) and not _never_inf(t, root, concrete) for t in terms)
    # A top-left window keeps key i in row i only while i < Tk, so its mask tensor stays in play.
    always_causal = plan.causal == "top_left" and not plan.guarded and not plan.conditions and plan.window is None
    plan.nan_rows = has_inf and not always_causal
    if plan.kind == "additive" and not always_causal:
        plan.min_rows = "mean" if all(isinstance(t, Fill) for t in terms) else "math"
    return plan
