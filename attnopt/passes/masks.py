"""Mask analysis: turn the ops between the score product and the softmax into one SDPA mask.

Matches the chain of mask ops that ``find_sites`` collected (``masked_fill``, ``where`` and
additions, in program order) and emits a :class:`MaskPlan`: the mask kind SDPA receives
(``bool`` keep-mask or ``additive``), whether it is *proven* causal, and which buffers that
proof read (so the runtime can check they did not change).

Causality is proven by a small abstract interpreter over the mask's own subgraph. Every
value is a :class:`Band`: a tensor whose leading dims are 1 and whose element ``[i, j]`` is
``below`` when ``j - i <= offset`` and ``above`` otherwise. ``tril``/``triu`` of a constant,
``== 0``, ``~``, casts, slices of the last two dims (which shift the offset) and buffers
holding a lower-triangular pattern all map to a band; anything else is "unknown" and the mask
is passed to SDPA as a tensor (always exact, just not as fast as ``is_causal``).

Example: nanoGPT's ``att.masked_fill(self.bias[:, :, :T, :T] == 0, float('-inf'))`` with a
``tril(ones)`` buffer reads as ``keep = Band(offset=0, below=True, above=False)`` over
``(T, T)``: causal, top-left aligned, guarded on ``self.bias``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..canon import attr_value, dtype_of, meta_value, mutated, read, shape_of
from ..runtime import is_lower_pattern


@dataclass(frozen=True)
class Fill:
    """``scores.masked_fill(cond, value)``; ``keep_when_true`` for ``where(cond, scores, value)``."""

    cond: fx.Node
    value: float
    keep_when_true: bool = False
    dtype: torch.dtype | None = None  # of the filled scores (a later cast may change the softmax input's)


@dataclass(frozen=True)
class Add:
    """``scores + mask``."""

    mask: fx.Node


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


@dataclass(frozen=True)
class Band:
    rows: Any
    cols: Any
    offset: Any
    below: Any
    above: Any


class _Unknown(Exception):
    pass


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        return bool(statically_known_true(a == b))
    except Exception:  # noqa: BLE001 - an unprovable comparison is simply not proven
        return False


def _value(x: Any) -> Any:
    """Python or symbolic value of an argument (node meta for nodes)."""
    if isinstance(x, fx.Node):
        v = meta_value(x)
        if isinstance(v, (int, float, torch.SymInt, torch.SymFloat)):
            return v
        raise _Unknown
    return x


class BandReader:
    """Abstract interpreter from mask-subgraph nodes to :class:`Band` values."""

    def __init__(self, root: torch.nn.Module, concrete: dict[fx.Node, torch.Tensor]):
        self.root = root
        self.concrete = concrete
        self.guarded: list[fx.Node] = []

    def band(self, node: Any) -> Band:
        if not isinstance(node, fx.Node) or mutated(node):
            raise _Unknown  # a tensor written in place after it was built is not what its op computes
        shape = shape_of(node)
        if shape is None or len(shape) < 2:
            raise _Unknown
        if not all(_same(s, 1) for s in shape[:-2]):
            raise _Unknown
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
            return _convert(Band(rows, cols, 0, fill, fill), dtype_of(node))  # ones(.., dtype=bool): True
        if k in ("tril", "triu"):
            src = self.band(op.args[0])
            if src.below != src.above:
                raise _Unknown
            diag = _value(op.args[1])
            zero = False if isinstance(src.below, bool) else 0
            if k == "tril":
                return Band(rows, cols, diag, src.below, zero)
            return Band(rows, cols, diag - 1, zero, src.below)
        if k in ("eq", "ne"):
            src, other = op.args
            if isinstance(src, fx.Node) and not isinstance(other, fx.Node):
                b, s = self.band(src), _value(other)
            else:
                raise _Unknown
            f = (lambda v: v == s) if k == "eq" else (lambda v: v != s)
            return Band(rows, cols, b.offset, bool(f(b.below)), bool(f(b.above)))
        if k == "not":
            b = self.band(op.args[0])
            if not (isinstance(b.below, bool) and isinstance(b.above, bool)):
                raise _Unknown
            return Band(rows, cols, b.offset, not b.below, not b.above)
        if k in ("cast", "identity", "view"):
            b = self.band(op.args[0])
            if not (_same(b.rows, rows) and _same(b.cols, cols)):
                raise _Unknown
            return _convert(b, dtype_of(node))
        if k == "getitem":
            return self._slice(node, op.args[0], op.args[1], rows, cols)
        raise _Unknown

    def _buffer(self, node: fx.Node, rows: Any, cols: Any) -> Band:
        t = self.concrete.get(node)
        if t is None and node.op == "get_attr":
            t = attr_value(self.root, str(node.target))
        if not isinstance(t, torch.Tensor) or t.dim() < 2 or t.is_meta:
            raise _Unknown
        if t.requires_grad or getattr(meta_value(node), "requires_grad", False):
            raise _Unknown  # is_causal would drop the gradient that reaches this tensor through the mask
        t2 = t.detach().reshape(t.shape[-2], t.shape[-1])
        n, m = t2.shape
        if n < 1 or m < 2:
            raise _Unknown
        below, above = t2[0, 0].item(), t2[0, 1].item()
        if below == above or not is_lower_pattern(t2, below, above):
            raise _Unknown
        self.guarded.append(node)
        return Band(rows, cols, 0, below, above)

    def _slice(self, node: fx.Node, src: Any, index: Any, rows: Any, cols: Any) -> Band:
        b = self.band(src)
        if not isinstance(index, tuple):
            index = (index,)
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
        return Band(rows, cols, b.offset - c0 + r0, b.below, b.above)


def _convert(b: Band, dtype: torch.dtype | None) -> Band:
    if dtype is None:
        return b
    if dtype == torch.bool:
        return Band(b.rows, b.cols, b.offset, bool(b.below), bool(b.above))
    if dtype.is_floating_point:
        return Band(b.rows, b.cols, b.offset, float(b.below), float(b.above))
    return b


def _neg_large(value: float, dtype: torch.dtype | None) -> str | None:
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
    Only fills of one value with no added masks are planned (mixed values change which keys a
    fully masked row averages).
    """
    values = {_in_dtype(f.value, f.dtype or score_dtype) for f in finite}
    if len(values) != 1 or any(isinstance(t, Add) for t in terms) or len(finite) != len(terms):
        return (f"the mask fills scores with {finite[0].value!r} together with other masks or values; a finite fill "
                "(neither -inf nor the dtype's minimum) is rewritten only alone, since it changes rows where every "
                "key is masked")
    (value,) = values
    if not math.isfinite(value) or value > -1.0:
        return (f"the mask fills scores with {value!r}, which does not suppress the masked keys; left as written")
    plan = MaskPlan("additive", list(terms), bound_fill=value)  # min_rows: set with the causal proof
    plan.fill_spelling = f"{value:g}"
    return plan


def _in_dtype(value: float, dtype: torch.dtype | None) -> float:
    """``value`` as the dtype stores it (``-1e4`` is ``-9984`` in bfloat16)."""
    return torch.tensor(value, dtype=dtype or torch.float32).item()


def plan_mask(terms: list[Any], tq: Any, tk: Any, score_dtype: torch.dtype | None,
              root: torch.nn.Module, concrete: dict[fx.Node, torch.Tensor]) -> MaskPlan | str:
    """Decide how SDPA receives the masks in ``terms``, or return why it cannot exactly."""
    if not terms:
        return MaskPlan("none")
    fills = [t for t in terms if isinstance(t, Fill)]
    for f in fills:
        if dtype_of(f.cond) != torch.bool:
            return f"the mask condition has dtype {dtype_of(f.cond)}, not torch.bool"
    finite = [f for f in fills if _neg_large(f.value, f.dtype or score_dtype) is None]
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

    # Causal proof: exactly one term whose keep-pattern is a lower band over (tq, tk).
    if len(terms) == 1:
        reader = BandReader(root, concrete)
        t = terms[0]
        try:
            if isinstance(t, Fill):
                b = reader.band(t.cond)
                keep_below = b.below if t.keep_when_true else not b.below
                keep_above = b.above if t.keep_when_true else not b.above
                ok = keep_below is True and keep_above is False
            else:
                b = reader.band(t.mask)
                ok = (b.below == 0 and isinstance(b.above, float)
                      and _neg_large(b.above, dtype_of(t.mask) or score_dtype) is not None)
            if ok and _same(b.rows, tq) and _same(b.cols, tk):
                if _same(b.offset, 0):
                    plan.causal = "top_left"
                elif _same(b.offset, tk - tq):
                    plan.causal = "bottom_right"
                plan.guarded = reader.guarded if plan.causal else []
        except _Unknown:
            pass
    # A row with every key masked by -inf is NaN as written; SDPA gives zeros there. Top-left
    # causal masks keep key 0 in every row, so only other masks need the NaN rows restored
    # (and guarded ones, for the run where the guard fails and the mask tensor is used).
    has_inf = any(isinstance(t, Fill) and t.value == -math.inf for t in terms) or any(
        isinstance(t, Add) for t in terms)
    plan.nan_rows = has_inf and (plan.causal != "top_left" or bool(plan.guarded))
    if plan.kind == "additive" and (plan.causal != "top_left" or plan.guarded):
        plan.min_rows = "mean" if all(isinstance(t, Fill) for t in terms) else "math"
    return plan
