"""The small vocabulary every spelling is read into before matching.

Real code writes the same operation many ways: ``q @ k``, ``torch.matmul(q, k)``,
``q.matmul(k)``, ``torch.bmm(q, k)``, ``torch.einsum("bhqd,bhkd->bhqk", q, k)``, and the
ATen forms that ``torch.export`` records. :func:`read` turns one FX node into one
:class:`Op` of a fixed ``kind`` with its operands in a fixed order, so the matcher
asks "is this a matmul?" once instead of once per spelling.

Example::

    >>> op = read(node)           # node: call_function operator.matmul(q, kt)
    >>> op.kind, op.args
    ('matmul', (q, kt, False))    # (left, right, right_is_transposed)

Kinds and canonical ``args``:

========== =============================================================
matmul     ``(a, b, b_transposed)``: ``a @ b`` or, when transposed, ``a @ b.mT``
baddbmm    ``(input, a, b, beta, alpha)``: ``beta * input + alpha * (a @ b)`` (function, method, in place)
unary      ``(x, name, *params)``: an elementwise function of one tensor (``tanh``, ``sigmoid``,
           ``clamp`` with constant ``min``/``max``), as in score modifiers
floor      ``(x, c)``: ``torch.max(x, c)``/``maximum`` (``Op.mode == "maximum"``) or ``clamp_min(x, c)``
           (``"clamp"``), ``c`` a number or a tensor node (XGLM's ``torch.max(s, full((), finfo.min))``)
repeat_interleave ``(x, repeats, dim)`` with ``dim`` normalised to non-negative
transpose  ``(x, d0, d1)`` with dims normalised to non-negative
permute    ``(x, dims)``
scale      ``(x, factor, "mul" | "div")``: a product or quotient with a scalar
add        ``(a, b)``
masked_fill ``(x, cond, value)``
where      ``(cond, a, b)``
softmax    ``(x, dim, dtype)`` with ``dim`` normalised to non-negative; ``Op.mode == "safe"`` for
           ``aten._safe_softmax`` (a row whose every score is ``-inf`` gives zeros, not NaN)
cast       ``(x,)``: a dtype conversion; the target dtype is read from the node's meta
identity   ``(x,)``: ``contiguous``/``clone``: same values
dropout    ``(x, p, mode)`` with mode ``"on"``, ``"off"`` or ``"module"`` (nn.Dropout's flag)
eq / ne    ``(a, b)``; also ``le``, ``lt``, ``ge``, ``gt`` (comparisons, as in masks built from indices)
and / or   ``(a, b)``: ``&``, ``|``, ``logical_and``, ``bitwise_or``, ...
sub        ``(a, b)``: ``a - b`` (index arithmetic in masks; between the product and the softmax, a
           subtracted tensor is rewritten in place to ``a + neg(b)``, see ``find_sites``)
neg        ``(x,)``: ``-x``
not        ``(x,)``
tril/triu  ``(x, diagonal)``
getitem    ``(x, index)``
view       ``(x,)``: view/reshape/unsqueeze/expand/broadcast_to: a reshaping whose result shape is in meta
factory    ``(fill_value, dtype)``: ones/full/new_ones/new_full/ones_like/zeros_like/full_like/zeros/empty,
           ``torch.tensor(number)`` and ``aten.scalar_tensor`` (fill None for empty/empty_like)
========== =============================================================

In-place methods (``mul_``, ``div_``, ``add_``, ``masked_fill_``, ``baddbmm_``, ``tanh_``) read
as their functional kind; :func:`functionalize_inplace` first makes every later use of the
mutated tensor read the in-place node, so the chain is a plain data-flow path.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

aten = torch.ops.aten


@dataclass(frozen=True)
class Op:
    """One node read into the canonical vocabulary."""

    kind: str
    args: tuple[Any, ...]
    spelling: str
    mode: str = ""  # a variant of the kind with other semantics: "safe" for aten._safe_softmax


# ----------------------------------------------------------------------------- meta helpers


def meta_value(node: Any) -> Any:
    """The example value recorded for ``node`` by dynamo, export or shape propagation."""
    if not isinstance(node, fx.Node):
        return node
    for key in ("val", "example_value"):
        if key in node.meta:
            return node.meta[key]
    tm = node.meta.get("tensor_meta")
    if tm is not None:
        return tm
    return None


def shape_of(node: Any) -> tuple[Any, ...] | None:
    """Shape of the tensor a node produces, with symbolic sizes kept, or None if unknown."""
    v = meta_value(node)
    shape = getattr(v, "shape", None)
    return tuple(shape) if shape is not None else None


def dtype_of(node: Any) -> torch.dtype | None:
    v = meta_value(node)
    return getattr(v, "dtype", None)


def attr_value(root: torch.nn.Module, target: str) -> Any:
    """The object a ``get_attr`` node with ``target`` reads from ``root`` (None if missing)."""
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def is_scalar(x: Any) -> bool:
    """A Python number, a symbolic number, or a node that produces one (not a tensor)."""
    if isinstance(x, (int, float, torch.SymInt, torch.SymFloat)) and not isinstance(x, bool):
        return True
    if isinstance(x, fx.Node):
        v = meta_value(x)
        return isinstance(v, (int, float, torch.SymInt, torch.SymFloat)) and not isinstance(v, bool)
    return False


def is_zero_dim_tensor(x: Any) -> bool:
    s = shape_of(x) if isinstance(x, fx.Node) else None
    return s is not None and len(s) == 0


def _norm_dim(dim: Any, ndim: int | None) -> Any:
    if isinstance(dim, int) and ndim is not None and dim < 0:
        return dim + ndim
    return dim


def _ndim(node: Any) -> int | None:
    s = shape_of(node)
    return len(s) if s is not None else None


# ----------------------------------------------------------------------------- argument access


def _arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


# ----------------------------------------------------------------------------- dtype conversions


def holds_exactly(dtype: torch.dtype | None, compute: torch.dtype | None) -> bool:
    """Every value of floating dtype ``compute`` is a value of floating dtype ``dtype`` (same, or wider:
    float16/bfloat16 -> float32 -> float64). float16 and bfloat16 hold each other's values only in part."""
    if dtype is None or compute is None or not dtype.is_floating_point or not compute.is_floating_point:
        return False
    if dtype == compute:
        return True
    fi, fc = torch.finfo(dtype), torch.finfo(compute)
    return fi.bits > fc.bits and fi.eps <= fc.eps and fi.max >= fc.max and fi.tiny <= fc.tiny \
        and fi.smallest_normal <= fc.smallest_normal


def convert_scalar(value: Any, dtype: torch.dtype) -> Any:
    """One element ``value`` (a Python bool, int or float holding it exactly) converted to ``dtype`` as
    torch converts tensors: floats truncate toward zero into integers, integers wrap around (two's
    complement), bool is "nonzero", floats round to the nearest value of a narrower float (or overflow
    to inf). Raises ValueError where the conversion is not defined: NaN, inf or a float outside an
    integer dtype's range (C++ leaves those to the platform), or a value that is not a plain number.
    """
    if isinstance(value, bool):
        value = int(value)
    if not isinstance(value, (int, float)):
        raise ValueError(f"{value!r} is not a number")
    if dtype == torch.bool:
        return value != 0 or value != value  # nonzero; NaN is True
    if dtype.is_complex:
        raise ValueError("complex dtype")
    if dtype.is_floating_point:
        if isinstance(value, int):
            if not -2 ** 63 <= value < 2 ** 63:
                raise ValueError(f"{value} does not fit in int64")
            return torch.tensor(value, dtype=torch.int64).to(dtype).item()
        return torch.tensor(value, dtype=torch.float64).to(dtype).item()
    info = torch.iinfo(dtype)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{value} has no {dtype} value")
        value = math.trunc(value)
        if not info.min <= value <= info.max:
            raise ValueError(f"{value} is outside the range of {dtype}")
        return value
    wrapped = value & ((1 << info.bits) - 1)
    return wrapped - (1 << info.bits) if info.min < 0 and wrapped > info.max else wrapped


# ----------------------------------------------------------------------------- readers

Reader = Callable[[fx.Node, Any], "Op | None"]


def _matmul(node: fx.Node, _: Any) -> Op:
    return Op("matmul", (node.args[0], node.args[1], False), _spell(node))


def _baddbmm(node: fx.Node, _: Any) -> Op:
    inp = node.args[0]
    a, b = _arg(node, 1, "batch1"), _arg(node, 2, "batch2")
    aten_form = node.op == "call_function" and node.target in (aten.baddbmm.default, aten.baddbmm)
    beta = _arg(node, 3, "beta", 1) if aten_form else node.kwargs.get("beta", 1)
    alpha = _arg(node, 4, "alpha", 1) if aten_form else node.kwargs.get("alpha", 1)
    if a is None or b is None:
        raise ValueError("baddbmm without both batch operands")
    return Op("baddbmm", (inp, a, b, beta, alpha), _spell(node))


def _neg(node: fx.Node, _: Any) -> Op | None:
    if len(node.args) != 1 or node.kwargs or not isinstance(node.args[0], fx.Node):
        return None
    return Op("neg", (node.args[0],), _spell(node))


def _unary(name: str) -> Reader:
    def read_(node: fx.Node, _: Any) -> Op | None:
        if len(node.args) != 1 or node.kwargs:
            return None
        return Op("unary", (node.args[0], name), _spell(node))

    return read_


def _clamp(node: fx.Node, _: Any) -> Op | None:
    """``clamp``/``clip`` with constant bounds: the unary ``("clamp", min, max)``; infinite bounds are no bound."""
    lo, hi = _arg(node, 1, "min"), _arg(node, 2, "max")
    for b in (lo, hi):
        if b is not None and (isinstance(b, (bool, fx.Node)) or not isinstance(b, (int, float)) or b != b):
            return None  # a tensor, a run-time number or NaN
    lo = None if lo is not None and lo == -math.inf else lo
    hi = None if hi is not None and hi == math.inf else hi
    if (lo is None and hi is None) or any(b is not None and not math.isfinite(b) for b in (lo, hi)):
        return None  # no bound at all, or an impossible one (clamp(min=inf))
    return Op("unary", (node.args[0], "clamp", None if lo is None else float(lo), None if hi is None else float(hi)),
              _spell(node))


def _floor_at(mode: str) -> Reader:
    """``torch.max(x, c)`` / ``torch.maximum(x, c)`` (``mode="maximum"``) and ``clamp_min(x, c)`` (``"clamp"``):
    the elementwise ``("floor", x, c)``, with ``c`` a number or a tensor node (the caller reads its value).
    ``torch.max(x, dim)``, the reduction, is not read."""

    def read_(node: fx.Node, _: Any) -> Op | None:
        if node.kwargs.get("out") is not None or len(node.args) + len(node.kwargs) != 2:
            return None
        x, other = node.args[0], _arg(node, 1, "other" if mode == "maximum" else "min")
        if mode == "maximum":  # both operands are tensors (an int is the reduction's dim); either order
            if not (isinstance(x, fx.Node) and isinstance(other, fx.Node)):
                return None
            if is_zero_dim_tensor(x) and not is_zero_dim_tensor(other):
                x, other = other, x
        elif not isinstance(x, fx.Node) or isinstance(other, bool):
            return None
        return Op("floor", (x, other), _spell(node), mode=mode)

    return read_


def _repeat_interleave(node: fx.Node, _: Any) -> Op | None:
    x = node.args[0]
    reps = _arg(node, 1, "repeats")
    dim = _arg(node, 2, "dim")
    if dim is None:
        return None
    return Op("repeat_interleave", (x, reps, _norm_dim(dim, _ndim(x))), _spell(node))


_EINSUM_TERM = re.compile(r"^(\.\.\.)?([a-zA-Z]*)$")


def parse_einsum_product(equation: str) -> tuple[str, ...] | None:
    """Classify a two-operand einsum as a batched matmul.

    Returns ``("nt",)`` for ``a @ b.mT`` (``...id,...jd->...ij``), ``("nn",)`` for ``a @ b``
    (``...ij,...jd->...id``), or None. Batch letters must appear in the same order in all
    three terms; ``...`` counts as a batch prefix.
    """
    eq = equation.replace(" ", "")
    if "->" not in eq:
        return None
    lhs, out = eq.split("->")
    parts = lhs.split(",")
    if len(parts) != 2:
        return None
    terms = [parts[0], parts[1], out]
    parsed = []
    for t in terms:
        m = _EINSUM_TERM.match(t)
        if not m:
            return None
        parsed.append((m.group(1) or "", m.group(2)))
    if len({p[0] for p in parsed}) != 1:
        return None
    (_, a), (_, b), (_, o) = parsed
    if min(len(a), len(b), len(o)) < 2 or not (len(a) == len(b) == len(o)):
        return None
    if len(set(a)) != len(a) or len(set(b)) != len(b) or len(set(o)) != len(o):
        return None
    batch = a[:-2]
    if b[:-2] != batch or o[:-2] != batch:
        return None
    i, x = a[-2], a[-1]
    if len({i, x} | set(batch)) != len(batch) + 2:
        return None
    if b[-1] == x and o[-2:] == i + b[-2] and b[-2] not in a and b[-2] not in batch:
        return ("nt",)
    if b[-2] == x and o[-2:] == i + b[-1] and b[-1] not in a and b[-1] not in batch:
        return ("nn",)
    return None


def _einsum(node: fx.Node, _: Any) -> Op | None:
    eq = node.args[0]
    operands = node.args[1:]
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if not isinstance(eq, str) or len(operands) != 2:
        return None
    form = parse_einsum_product(eq)
    if form is None:
        return None
    return Op("matmul", (operands[0], operands[1], form[0] == "nt"), f'einsum("{eq}")')


def _transpose(node: fx.Node, _: Any) -> Op:
    x = node.args[0]
    nd = _ndim(x)
    d0 = _norm_dim(_arg(node, 1, "dim0"), nd)
    d1 = _norm_dim(_arg(node, 2, "dim1"), nd)
    return Op("transpose", (x, min(d0, d1), max(d0, d1)) if isinstance(d0, int) and isinstance(d1, int)
              else (x, d0, d1), _spell(node))


def _permute(node: fx.Node, _: Any) -> Op:
    x = node.args[0]
    dims = node.args[1:] if len(node.args) > 2 or not isinstance(_arg(node, 1, "dims"), (list, tuple)) \
        else tuple(node.args[1])
    if len(node.args) == 1:
        dims = tuple(node.kwargs.get("dims", ()))
    nd = _ndim(x)
    dims = tuple(_norm_dim(d, nd) for d in dims)
    ident = tuple(range(len(dims)))
    diff = [i for i, d in enumerate(dims) if d != i]
    if len(diff) == 2 and dims[diff[0]] == diff[1] and dims[diff[1]] == diff[0] and sorted(dims) == list(ident):
        return Op("transpose", (x, diff[0], diff[1]), _spell(node))
    return Op("permute", (x, dims), _spell(node))


def _scale_or_binary(kind: str) -> Reader:
    """mul/div with a scalar become ``scale``; anything else stays a binary op of ``kind``."""

    def read_(node: fx.Node, _: Any) -> Op | None:
        a, b = node.args[0], _arg(node, 1, "other")
        if kind == "div" and node.kwargs.get("rounding_mode") is not None:
            return None
        if kind in ("mul", "div"):
            if is_scalar(b) or is_zero_dim_tensor(b):
                return Op("scale", (a, b, kind), _spell(node))
            if kind == "mul" and (is_scalar(a) or is_zero_dim_tensor(a)):
                return Op("scale", (b, a, "mul"), _spell(node))
            return Op(kind, (a, b), _spell(node))
        alpha = node.kwargs.get("alpha", 1)
        if alpha != 1:
            return None
        return Op(kind, (a, b), _spell(node))

    return read_


def _alpha_one(kind: str, swapped: bool = False) -> Reader:
    """``aten.add.Scalar`` / ``aten.sub.Scalar``, whose ``alpha`` may be positional, and with ``swapped``
    ``aten.rsub(a, b)``, which is ``b - a`` (export's spelling of ``1 - m``); only with ``alpha`` 1."""

    def read_(node: fx.Node, _: Any) -> Op | None:
        if _arg(node, 2, "alpha", 1) != 1:
            return None
        a, b = node.args[0], _arg(node, 1, "other")
        return Op(kind, (b, a) if swapped else (a, b), _spell(node))

    return read_


def _masked_fill(node: fx.Node, _: Any) -> Op:
    return Op("masked_fill", (node.args[0], _arg(node, 1, "mask"), _arg(node, 2, "value")), _spell(node))


def _where(node: fx.Node, _: Any) -> Op | None:
    if len(node.args) + len(node.kwargs) != 3:
        return None
    return Op("where", (node.args[0], _arg(node, 1, "input"), _arg(node, 2, "other")), _spell(node))


def _softmax(node: fx.Node, _: Any) -> Op:
    x = node.args[0]
    dim = _arg(node, 1, "dim")
    if node.op == "call_function" and node.target is F.softmax:
        dtype = _arg(node, 3, "dtype")
    else:
        dtype = _arg(node, 2, "dtype")
    return Op("softmax", (x, _norm_dim(dim, _ndim(x)), dtype), _spell(node))


def _aten_softmax(node: fx.Node, _: Any) -> Op:
    x = node.args[0]
    return Op("softmax", (x, _norm_dim(node.args[1], _ndim(x)), None), _spell(node))


def _safe_softmax(node: fx.Node, _: Any) -> Op:
    """``aten._safe_softmax(x, dim, dtype=None)`` (what ``torch.export`` records for ``F.softmax`` in some
    graphs): softmax, except that a row whose every score is ``-inf`` gives zeros instead of NaN."""
    x = node.args[0]
    return Op("softmax", (x, _norm_dim(_arg(node, 1, "dim"), _ndim(x)), _arg(node, 2, "dtype")), _spell(node),
              mode="safe")


def _softmax_module(node: fx.Node, mod: Any) -> Op:
    x = node.args[0]
    return Op("softmax", (x, _norm_dim(mod.dim, _ndim(x)), None), f"nn.Softmax(dim={mod.dim})")


def _cast(node: fx.Node, _: Any) -> Op | None:
    # .to(...) is a cast only when it can change nothing but the dtype.
    if dtype_of(node) is None:
        return None
    if node.target == "to" or node.target in _ATEN_TO:
        src = shape_of(node.args[0])
        if src is None or tuple(src) != tuple(shape_of(node) or ()):
            return None
        src_dev = getattr(meta_value(node.args[0]), "device", None)
        dst_dev = getattr(meta_value(node), "device", None)
        if src_dev is not None and dst_dev is not None and src_dev != dst_dev:
            return None
    return Op("cast", (node.args[0],), _spell(node))


#: ATen conversions that may also move the tensor (read as a cast only when shape and device stay).
_ATEN_TO = (aten._to_copy.default, aten._to_copy, aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.to)


def _identity(node: fx.Node, _: Any) -> Op | None:
    if node.target == "contiguous" and (len(node.args) > 1 or node.kwargs):
        return None
    return Op("identity", (node.args[0],), _spell(node))


def _dropout_fn(node: fx.Node, _: Any) -> Op | None:
    x = node.args[0]
    p = _arg(node, 1, "p", 0.5)
    training = _arg(node, 2, "training", True) if node.target is F.dropout else _arg(node, 2, "train", True)
    inplace = _arg(node, 3, "inplace", False) if node.target is F.dropout else False
    if not isinstance(training, bool) or not (isinstance(p, (int, float)) or is_scalar(p)) or inplace:
        return None
    if not isinstance(p, (int, float)):  # a run-time number (dynamo made the module's p an input)
        return Op("dropout", (x, p, "on" if training else "off"), _spell(node))
    return Op("dropout", (x, float(p), "on" if training and p > 0 else "off"), _spell(node))


def _dropout_module(node: fx.Node, mod: Any) -> Op | None:
    if getattr(mod, "inplace", False):
        return None
    return Op("dropout", (node.args[0], float(mod.p), "module" if mod.p > 0 else "off"), f"nn.Dropout(p={mod.p})")


def _binary(kind: str) -> Reader:
    def read_(node: fx.Node, _: Any) -> Op:
        return Op(kind, (node.args[0], _arg(node, 1, "other")), _spell(node))

    return read_


def _not(node: fx.Node, _: Any) -> Op:
    return Op("not", (node.args[0],), _spell(node))


def _tri(kind: str) -> Reader:
    def read_(node: fx.Node, _: Any) -> Op:
        return Op(kind, (node.args[0], _arg(node, 1, "diagonal", 0)), _spell(node))

    return read_


def _getitem(node: fx.Node, _: Any) -> Op:
    return Op("getitem", (node.args[0], node.args[1]), _spell(node))


def _aten_slice(node: fx.Node, _: Any) -> Op | None:
    """``aten.slice(x, dim, start, end, step)`` read as the ``getitem`` of one dim."""
    x = node.args[0]
    nd = _ndim(x)
    dim = _norm_dim(_arg(node, 1, "dim", 0), nd)
    if not isinstance(dim, int) or nd is None:
        return None
    sl = slice(_arg(node, 2, "start"), _arg(node, 3, "end"), _arg(node, 4, "step", 1))
    index = tuple(slice(None) for _ in range(dim)) + (sl,)
    return Op("getitem", (x, index), _spell(node))


def _view(node: fx.Node, _: Any) -> Op:
    return Op("view", (node.args[0],), _spell(node))


def _factory(fill_index: int | None, fill: Any = None) -> Reader:
    def read_(node: fx.Node, _: Any) -> Op | None:
        if node.kwargs.get("requires_grad"):
            return None  # a leaf the backward reaches: not a constant to fold into a mask
        value = fill if fill_index is None else _arg(node, fill_index, "fill_value")
        return Op("factory", (value, dtype_of(node)), _spell(node))

    return read_


def _tensor_of_number(node: fx.Node, _: Any) -> Op | None:
    """``torch.tensor(c)`` / ``aten.scalar_tensor(c)`` of a plain number: a 0-d constant tensor (a list, a
    tensor or a run-time number is not read)."""
    value = _arg(node, 0, "data" if node.target is torch.tensor else "s")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or node.kwargs.get("requires_grad"):
        return None
    return Op("factory", (value, dtype_of(node)), _spell(node))


def _spell(node: fx.Node) -> str:
    t = node.target
    if node.op == "call_method":
        return f".{t}()"
    if isinstance(t, torch._ops.OpOverload):
        return f"aten.{t.__name__.split('.')[0]}"
    if isinstance(t, torch._ops.OpOverloadPacket):
        return f"aten.{t.__name__}"
    names = {operator.matmul: "@", operator.mul: "*", operator.truediv: "/", operator.add: "+",
             operator.imul: "*=", operator.itruediv: "/=", operator.iadd: "+="}
    if t in names:
        return names[t]
    return getattr(t, "__name__", str(t))


# (opcode, target) -> reader. Methods are keyed by name, functions by object.
_FUNCTIONS: dict[Any, Reader] = {
    operator.matmul: _matmul, torch.matmul: _matmul, torch.bmm: _matmul,
    aten.matmul.default: _matmul, aten.bmm.default: _matmul,
    torch.einsum: _einsum, aten.einsum.default: _einsum,
    torch.transpose: _transpose, torch.swapaxes: _transpose, aten.transpose.int: _transpose,
    torch.permute: _permute, aten.permute.default: _permute,
    operator.mul: _scale_or_binary("mul"), torch.mul: _scale_or_binary("mul"),
    operator.imul: _scale_or_binary("mul"),
    aten.mul.Tensor: _scale_or_binary("mul"), aten.mul.Scalar: _scale_or_binary("mul"),
    operator.truediv: _scale_or_binary("div"), torch.div: _scale_or_binary("div"),
    torch.true_divide: _scale_or_binary("div"), operator.itruediv: _scale_or_binary("div"),
    aten.div.Tensor: _scale_or_binary("div"), aten.div.Scalar: _scale_or_binary("div"),
    operator.add: _scale_or_binary("add"), torch.add: _scale_or_binary("add"),
    operator.iadd: _scale_or_binary("add"),
    aten.add.Tensor: _scale_or_binary("add"), aten.add.Scalar: _alpha_one("add"),
    aten.sub.Scalar: _alpha_one("sub"), **dict.fromkeys((aten.rsub.Scalar, aten.rsub.Tensor, torch.rsub),
                                                        _alpha_one("sub", swapped=True)),
    # in place, as torch.export records ``s += m`` (later ops read the in-place node's result)
    aten.add_.Tensor: _scale_or_binary("add"), aten.mul_.Tensor: _scale_or_binary("mul"),
    aten.div_.Tensor: _scale_or_binary("div"),
    torch.masked_fill: _masked_fill, aten.masked_fill.Scalar: _masked_fill, aten.masked_fill.Tensor: _masked_fill,
    torch.where: _where, aten.where.self: _where, aten.where.ScalarOther: _where, aten.where.ScalarSelf: _where,
    F.softmax: _softmax, torch.softmax: _softmax, aten.softmax.int: _softmax, aten._softmax.default: _aten_softmax,
    aten._safe_softmax.default: _safe_softmax,
    aten._to_copy.default: _cast, aten.to.dtype: _cast, aten.to.dtype_layout: _cast, aten.to.device: _cast,
    aten.alias.default: _identity, aten.clone.default: _identity, aten.contiguous.default: _identity,
    F.dropout: _dropout_fn, torch.dropout: _dropout_fn, aten.dropout.default: _dropout_fn,
    operator.eq: _binary("eq"), torch.eq: _binary("eq"), aten.eq.Scalar: _binary("eq"), aten.eq.Tensor: _binary("eq"),
    operator.ne: _binary("ne"), torch.ne: _binary("ne"), aten.ne.Scalar: _binary("ne"), aten.ne.Tensor: _binary("ne"),
    **{f: _binary(name) for name in ("le", "lt", "ge", "gt")
       for f in (getattr(operator, name), getattr(torch, name), getattr(aten, name).Tensor,
                 getattr(aten, name).Scalar)},
    operator.and_: _binary("and"), torch.logical_and: _binary("and"), torch.bitwise_and: _binary("and"),
    aten.logical_and.default: _binary("and"), aten.bitwise_and.Tensor: _binary("and"),
    operator.or_: _binary("or"), torch.logical_or: _binary("or"), torch.bitwise_or: _binary("or"),
    aten.logical_or.default: _binary("or"), aten.bitwise_or.Tensor: _binary("or"),
    operator.sub: _scale_or_binary("sub"), torch.sub: _scale_or_binary("sub"), aten.sub.Tensor: _scale_or_binary("sub"),
    operator.invert: _not, torch.logical_not: _not, torch.bitwise_not: _not,
    aten.logical_not.default: _not, aten.bitwise_not.default: _not,
    torch.tril: _tri("tril"), torch.triu: _tri("triu"),
    aten.tril.default: _tri("tril"), aten.triu.default: _tri("triu"),
    operator.getitem: _getitem, aten.slice.Tensor: _aten_slice,
    torch.reshape: _view, torch.unsqueeze: _view, aten.view.default: _view, aten.reshape.default: _view,
    aten.unsqueeze.default: _view, aten.expand.default: _view, aten._unsafe_view.default: _view,
    torch.ones: _factory(None, 1), torch.ones_like: _factory(None, 1), aten.ones.default: _factory(None, 1),
    aten.ones_like.default: _factory(None, 1), torch.zeros_like: _factory(None, 0),
    aten.zeros_like.default: _factory(None, 0), torch.full_like: _factory(1), aten.full_like.default: _factory(1),
    torch.empty_like: _factory(None, None), aten.empty_like.default: _factory(None, None),
    torch.full: _factory(1), aten.full.default: _factory(1),
    torch.tensor: _tensor_of_number, aten.scalar_tensor.default: _tensor_of_number,
    torch.scalar_tensor: _tensor_of_number,
    torch.zeros: _factory(None, 0), aten.zeros.default: _factory(None, 0),
    torch.empty: _factory(None, None), aten.empty.memory_format: _factory(None, None),
    torch.broadcast_to: _view,
    torch.baddbmm: _baddbmm, aten.baddbmm.default: _baddbmm,
    operator.neg: _neg, torch.neg: _neg, torch.negative: _neg, aten.neg.default: _neg,
    torch.tanh: _unary("tanh"), F.tanh: _unary("tanh"), aten.tanh.default: _unary("tanh"),
    torch.sigmoid: _unary("sigmoid"), F.sigmoid: _unary("sigmoid"), aten.sigmoid.default: _unary("sigmoid"),
    torch.clamp: _clamp, torch.clip: _clamp, aten.clamp.default: _clamp,
    torch.max: _floor_at("maximum"), torch.maximum: _floor_at("maximum"), aten.maximum.default: _floor_at("maximum"),
    aten.max.other: _floor_at("maximum"),
    torch.clamp_min: _floor_at("clamp"), aten.clamp_min.default: _floor_at("clamp"),
    torch.repeat_interleave: _repeat_interleave, aten.repeat_interleave.self_int: _repeat_interleave,
}

_METHODS: dict[str, Reader] = {
    "matmul": _matmul, "bmm": _matmul, "__matmul__": _matmul,
    "transpose": _transpose, "swapaxes": _transpose, "permute": _permute,
    "mul": _scale_or_binary("mul"), "__mul__": _scale_or_binary("mul"),
    "div": _scale_or_binary("div"), "true_divide": _scale_or_binary("div"), "__truediv__": _scale_or_binary("div"),
    "add": _scale_or_binary("add"), "__add__": _scale_or_binary("add"),
    "masked_fill": _masked_fill,  # not "where": x.where(cond, y) means where(cond, x, y)
    "softmax": _softmax,
    "to": _cast, "float": _cast, "half": _cast, "bfloat16": _cast, "double": _cast, "bool": _cast,
    "type": _cast, "type_as": _cast,
    "contiguous": _identity, "clone": _identity,
    "eq": _binary("eq"), "__eq__": _binary("eq"), "ne": _binary("ne"), "__ne__": _binary("ne"),
    **{m: _binary(name) for name in ("le", "lt", "ge", "gt") for m in (name, f"__{name}__")},
    "logical_and": _binary("and"), "bitwise_and": _binary("and"), "__and__": _binary("and"),
    "logical_or": _binary("or"), "bitwise_or": _binary("or"), "__or__": _binary("or"),
    "sub": _scale_or_binary("sub"), "__sub__": _scale_or_binary("sub"),
    "neg": _neg, "negative": _neg, "__neg__": _neg,
    "logical_not": _not, "bitwise_not": _not, "__invert__": _not,
    "tril": _tri("tril"), "triu": _tri("triu"),
    "view": _view, "reshape": _view, "unsqueeze": _view, "expand": _view,
    "new_ones": _factory(None, 1), "new_full": _factory(2), "new_zeros": _factory(None, 0),
    "new_empty": _factory(None, None), "broadcast_to": _view,
    "baddbmm": _baddbmm, "tanh": _unary("tanh"), "repeat_interleave": _repeat_interleave,
    "sigmoid": _unary("sigmoid"), "clamp": _clamp, "clip": _clamp,
    "max": _floor_at("maximum"), "maximum": _floor_at("maximum"), "clamp_min": _floor_at("clamp"),
    # in place: functionalize_inplace makes later uses read these nodes
    "mul_": _scale_or_binary("mul"), "div_": _scale_or_binary("div"), "add_": _scale_or_binary("add"),
    "masked_fill_": _masked_fill, "baddbmm_": _baddbmm, "tanh_": _unary("tanh"),
    "sigmoid_": _unary("sigmoid"), "clamp_": _clamp, "clip_": _clamp,
}

#: In-place methods whose result is their first argument, mutated.
INPLACE_METHODS = frozenset(("mul_", "div_", "add_", "masked_fill_", "baddbmm_", "tanh_", "sigmoid_", "clamp_",
                             "clip_"))

_MODULES: dict[type, Reader] = {
    torch.nn.Softmax: _softmax_module,
    torch.nn.Dropout: _dropout_module,
}


#: ``torch.ops.aten.<op>`` called without an overload (``aten._safe_softmax(s, -1)``, ``aten.mul(q, c)``) reads
#: like its overloads: every overload of one op in the table has one reader (the first listed is kept).
_PACKETS: dict[Any, Reader] = {}
for _target, _reader in _FUNCTIONS.items():
    if isinstance(_target, torch._ops.OpOverload):
        _PACKETS.setdefault(_target.overloadpacket, _reader)
del _target, _reader


def read(node: Any, root: torch.nn.Module | None = None) -> Op | None:
    """Read one FX node into the canonical vocabulary, or None if it is outside it."""
    if not isinstance(node, fx.Node):
        return None
    if node.kwargs.get("out") is not None:
        return None  # ``torch.sub(s, b, out=buf)`` also writes ``buf``: a rewrite that drops the op would drop that
    reader: Reader | None = None
    context: Any = None
    if node.op == "call_function":
        try:
            reader = _FUNCTIONS.get(node.target) or _PACKETS.get(node.target)
        except TypeError:  # unhashable target
            reader = None
    elif node.op == "call_method":
        reader = _METHODS.get(node.target)  # type: ignore[arg-type]
    elif node.op == "call_module" and root is not None:
        try:
            context = root.get_submodule(node.target)  # type: ignore[arg-type]
        except AttributeError:
            return None
        reader = _MODULES.get(type(context))
    if reader is None:
        return None
    try:
        return reader(node, context)
    except (IndexError, KeyError, TypeError, ValueError):
        return None


#: Kinds whose result is always a new tensor (never a view of an input), so mutating it in place
#: changes nothing else.
_FRESH_KINDS = frozenset(("matmul", "baddbmm", "scale", "add", "sub", "mul", "div", "masked_fill", "where",
                          "unary", "neg"))


#: Methods ``x.<name>(node)`` whose result depends on ``node``'s shape only (``node`` not the first argument).
_SHAPE_OF_OTHER = frozenset(("expand_as", "view_as", "reshape_as"))
#: Methods ``node.<name>(...)`` and attributes ``node.<name>`` that return its shape, rank, dtype or device.
_SHAPE_METHODS = frozenset(("size", "dim", "ndimension", "numel", "nelement"))
_SHAPE_ATTRS = frozenset(("shape", "ndim", "dtype", "device", "is_cuda"))
_SYM_SIZES = frozenset(getattr(torch.ops.aten, name) for name in ("sym_size", "sym_numel")
                       if hasattr(torch.ops.aten, name))
#: The ATen forms ``torch.export`` records for ``x.expand_as(node)`` and the like.
_ATEN_SHAPE_OF_OTHER = frozenset(getattr(torch.ops.aten, name) for name in _SHAPE_OF_OTHER
                                 if hasattr(torch.ops.aten, name))


def reads_only_shape(user: fx.Node, node: fx.Node) -> bool:
    """``user`` reads ``node``'s shape (rank, dtype, device), never its values or strides:
    ``mask.view(B, 1, 1, S).expand_as(scores)``, ``x.view_as(scores)``, ``scores.size(-1)``, ``scores.shape``,
    ``scores.dim()``, ``aten.sym_size.int(scores, 0)``. Not ``scores.stride()``, ``scores.is_contiguous()``, nor
    ``scores.view_as(x)`` (the scores' values)."""
    if user.kwargs.get("out") is not None or not user.args:
        return False
    if user.op == "call_method":
        name = str(user.target)
        if name in _SHAPE_OF_OTHER:
            return len(user.args) == 2 and user.args[0] is not node and user.args[1] is node and not user.kwargs
        return name in _SHAPE_METHODS and user.args[0] is node and node not in user.args[1:] \
            and node not in user.kwargs.values()
    if user.op != "call_function":
        return False
    if user.target is getattr:
        return len(user.args) == 2 and user.args[0] is node and user.args[1] in _SHAPE_ATTRS
    targets = {user.target} | ({user.target.overloadpacket} if isinstance(user.target, torch._ops.OpOverload)
                               else set())
    if targets & _ATEN_SHAPE_OF_OTHER:
        return len(user.args) == 2 and user.args[0] is not node and user.args[1] is node and not user.kwargs
    if user.target is torch.ops.aten._assert_tensor_metadata.default:  # export's dtype/device/layout check
        return user.args[0] is node and node not in (*user.args[1:], *user.kwargs.values()) \
            and (len(user.args) < 3 or user.args[2] is None) and user.kwargs.get("stride") is None
    return bool(targets & _SYM_SIZES) and user.args[0] is node and node not in user.args[1:]


def functionalize_inplace(gm: fx.GraphModule) -> int:
    """Make every use of a tensor after an in-place method on it read that method's node.

    ``s.div_(c)`` leaves later code reading ``s`` (dynamo keeps the name), so the data flow
    ``s -> div_ -> softmax`` is invisible in the graph. For a tensor that an out-of-place op
    created (no other tensor can alias it) and that nobody read before the in-place call (its shape
    aside: ``mask.expand_as(s)``, ``s.size(-1)``), the later users are pointed at the in-place node,
    which returns the same tensor: values are unchanged and the chain reads like functional code.
    Returns how many nodes were rewired.

    Example::

        s = q @ kT; s.div_(8.0); p = s.softmax(-1)   ->   p = div_.softmax(-1)
    """
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    changed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_method" or node.target not in INPLACE_METHODS or not node.args:
            continue
        src = node.args[0]
        if not isinstance(src, fx.Node):
            continue
        op = read(src, gm)
        fresh = op is not None and op.kind in _FRESH_KINDS and src.op in ("call_function", "call_method")
        if not fresh:
            continue
        if any(order[u] < order[node] for u in src.users if u is not node and not reads_only_shape(u, src)):
            continue  # read before the mutation (maybe a view): leave the graph as it is
        # (a reader of its shape alone, Flaubert's ``mask.view(...).expand_as(scores)``, neither sees the values
        # nor holds a view of them)
        later = [u for u in src.users if u is not node and order[u] > order[node]]
        for u in later:
            u.replace_input_with(src, node)
            changed += 1
    if changed:
        gm.graph.lint()
        gm.recompile()
    return changed


_VIEW_METHODS = frozenset((
    "view", "view_as", "reshape", "reshape_as", "transpose", "permute", "t", "T", "mT", "unsqueeze", "squeeze",
    "expand", "expand_as", "narrow", "select", "flatten", "unflatten", "as_strided", "diagonal", "unfold", "split",
    "chunk", "unbind", "contiguous", "detach", "__getitem__", "to", "type_as", "float", "half", "bfloat16", "bool",
))
_VIEW_FUNCTIONS = frozenset((
    operator.getitem, torch.transpose, torch.permute, torch.reshape, torch.unsqueeze, torch.squeeze, torch.narrow,
    torch.select, torch.flatten, torch.diagonal, torch.split, torch.chunk, torch.unbind, torch.t, torch.detach,
))


_INPLACE_OPERATORS = frozenset((
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.imod,
    operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift, operator.imatmul,
))


_INPLACE_INDEX_CACHE: dict[Any, int | None] = {}

#: Where signatures are unavailable (a wrapped or C function): the position of ``inplace`` in
#: ``torch.nn.functional``'s activations and dropouts, by name.
_INPLACE_POSITION = {
    **dict.fromkeys(("relu", "relu6", "selu", "silu", "mish", "hardswish", "hardsigmoid"), 1),
    **dict.fromkeys(("elu", "celu", "leaky_relu"), 2),
    **dict.fromkeys(("hardtanh", "threshold", "dropout", "alpha_dropout", "feature_alpha_dropout", "dropout1d",
                     "dropout2d", "dropout3d"), 3),
    "rrelu": 4,
}


def _inplace_param(target: Any) -> tuple[int, bool] | None:
    """(position, default) of ``target``'s ``inplace`` parameter, or None if it has none."""
    try:
        if target in _INPLACE_INDEX_CACHE:
            return _INPLACE_INDEX_CACHE[target]  # type: ignore[return-value]
    except TypeError:  # unhashable
        return None
    found: tuple[int, bool] | None = None
    try:
        import inspect

        params = list(inspect.signature(target).parameters.values())
        for i, prm in enumerate(params):
            if prm.name == "inplace" and prm.kind in (prm.POSITIONAL_OR_KEYWORD, prm.KEYWORD_ONLY):
                pos = i if prm.kind is prm.POSITIONAL_OR_KEYWORD else -1
                found = (pos, prm.default is True)
                break
    except (TypeError, ValueError):
        name = getattr(target, "__name__", "")
        if getattr(target, "__module__", "") in ("torch.nn.functional", "torch._C._nn") and name in _INPLACE_POSITION:
            found = (_INPLACE_POSITION[name], False)
    _INPLACE_INDEX_CACHE[target] = found  # type: ignore[assignment]
    return found


def _first_input(user: fx.Node) -> Any:
    """The tensor an op acts on: its first argument, or ``input=``/``self=`` given by keyword."""
    if user.args:
        return user.args[0]
    return user.kwargs.get("input", user.kwargs.get("self"))


def inplace_flag(user: fx.Node) -> bool:
    """``user`` is called with ``inplace=True``: by keyword, by position (``F.relu(x, True)``,
    ``F.dropout(x, p, training, True)``; the parameter is found in the target's signature), or by
    the parameter's default."""
    if "inplace" in user.kwargs:
        return user.kwargs["inplace"] is True
    if user.op != "call_function":
        return False
    param = _inplace_param(user.target)
    if param is None:
        return False
    pos, default = param
    if 0 <= pos < len(user.args):
        return user.args[pos] is True
    return default


def _schemas(target: Any) -> list[Any]:
    """The schemas of an ATen or custom op: one for an ``OpOverload``, every overload's for a packet
    (``torch.ops.mylib.op``, resolved at call time); none for anything else."""
    if isinstance(target, torch._ops.OpOverload):
        return [target._schema]
    if isinstance(target, torch._ops.OpOverloadPacket):
        out = []
        for name in target.overloads():
            try:
                out.append(getattr(target, name)._schema)
            except (AttributeError, RuntimeError):
                continue
        return out
    schema = getattr(target, "_schema", None)
    return [schema] if schema is not None else []


def _packet_fresh(packet: Any) -> bool:
    """Every overload of an op packet (a custom op called as ``torch.ops.ns.op``) returns new tensors."""
    verdicts = []
    for name in packet.overloads():
        try:
            verdicts.append(_overload_fresh(getattr(packet, name)))
        except (AttributeError, RuntimeError):
            return False
    return bool(verdicts) and all(v is True for v in verdicts)


def _holds(value: Any, node: fx.Node) -> bool:
    """``value`` is ``node`` or a list/tuple holding it (``torch._foreach_mul_([k], 2)``, ``out=(values, idx)``)."""
    return value is node or isinstance(value, (list, tuple)) and any(v is node for v in value)


def _writes(user: fx.Node, node: fx.Node) -> bool:
    if _holds(user.kwargs.get("out"), node):
        return True  # torch.logical_and(keep, pad, out=keep); torch.sort(x, out=(values, indices))
    if user.op in ("call_function", "call_method") and _first_input(user) is node and inplace_flag(user):
        return True  # F.relu(x, True), F.hardtanh(x, -1, 1, True), F.dropout(x, p, True, True)
    first = bool(user.args) and user.args[0] is node
    if user.op == "call_method":
        name = str(user.target)
        if name.startswith("__i") and name.endswith("__"):
            return first  # x.__iand__(y)
        return first and name.endswith("_") and not name.startswith("__")
    if user.op == "call_function":
        if user.target is operator.setitem or user.target in _INPLACE_OPERATORS:
            return first  # x[...] = y; x &= y through another name (dynamo keeps the old name for aliases)
        for schema in _schemas(user.target):
            for i, a in enumerate(schema.arguments):
                if a.alias_info is not None and a.alias_info.is_write:
                    value = user.args[i] if i < len(user.args) else user.kwargs.get(a.name)
                    if _holds(value, node):
                        return True  # a mutated argument, or a tensor in a mutated list (``Tensor(a!)[]``)
        if getattr(user.target, "__module__", None) in ("_operator", "operator"):
            return False  # operator.and_/or_ are `&`/`|`, not in-place methods
        name = getattr(user.target, "__name__", "")
        # torch.relu_(x); torch._foreach_mul_([k], 2.0): the first argument (or a tensor of it) is written
        return name.endswith("_") and not name.endswith("__") and bool(user.args) and _holds(user.args[0], node)
    return False


#: In-place methods that change no element (flags and bookkeeping), so they are not writes of values.
_METADATA_INPLACE = frozenset(("requires_grad_", "share_memory_", "retain_grad"))


def writes(user: fx.Node, node: fx.Node, root: torch.nn.Module | None = None) -> bool:
    """``user`` writes ``node``'s memory: an in-place method or function, ``out=``, ``x[...] = y``, an
    in-place operator (``x += y``), an ``inplace`` flag that is on (a function's argument by keyword or
    position, see :func:`inplace_flag`; or a module's flag in a ``symbolic_trace`` graph, where
    ``nn.ReLU(inplace=True)`` stays a ``call_module``)."""
    if user.op == "call_method" and str(user.target) in _METADATA_INPLACE:
        return False
    if _writes(user, node):
        return True
    first = bool(user.args) and user.args[0] is node
    if user.op == "call_module" and first:
        if root is None:
            return True  # an unknown module may write its input
        try:
            mod = root.get_submodule(str(user.target))
        except AttributeError:
            return True
        return bool(getattr(mod, "inplace", False))
    return False


#: Views and the like that ``aliases`` does not list (their result may share memory with the first argument).
_MORE_VIEW_METHODS = frozenset((
    "swapaxes", "swapdims", "movedim", "moveaxis", "ravel", "view_as_real", "view_as_complex", "tensor_split",
    "split_with_sizes", "hsplit", "vsplit", "dsplit", "type", "double", "long", "int", "short", "char", "byte",
    "cpu", "cuda", "alias", "squeeze_", "unsqueeze_", "t_", "transpose_", "as_strided_",
))
#: Modules whose result may be their input itself or a view of it.
_VIEW_MODULES = (torch.nn.Identity, torch.nn.Flatten, torch.nn.Unflatten, torch.nn.Dropout, torch.nn.Dropout1d,
                 torch.nn.Dropout2d, torch.nn.Dropout3d, torch.nn.AlphaDropout, torch.nn.FeatureAlphaDropout)


#: Kinds of the vocabulary whose result is always a new tensor (their in-place spellings, ``mul_``,
#: ``masked_fill_``, are writes and alias their first argument: :func:`writes` is asked first).
_FRESH_RESULT_KINDS = _FRESH_KINDS | frozenset(("softmax", "eq", "ne", "le", "lt", "ge", "gt", "and", "or", "not",
                                                "tril", "triu", "factory"))

#: Functions known to return a new tensor whose ATen op is composite (its schema says nothing).
_FRESH_FUNCTIONS = frozenset(f for f in (
    F.linear, F.layer_norm, F.group_norm, F.embedding, F.scaled_dot_product_attention, F.normalize, F.gelu,
    F.silu, F.softplus, F.log_softmax, torch.stack, torch.cat, getattr(torch, "concat", None),
    getattr(torch, "concatenate", None), getattr(F, "rms_norm", None), torch.matmul, torch.bmm, torch.mm,
    torch.baddbmm, torch.addmm, torch.layer_norm, torch.outer, torch.cumsum, torch.arange, torch.zeros, torch.ones,
    torch.full, torch.empty, torch.tensor, torch.rand, torch.randn, torch.randint,
) if f is not None)

#: ``operator`` functions, by the ATen op they run on tensors.
_OPERATOR_ATEN = {"neg": "neg", "pow": "pow", "mod": "remainder", "floordiv": "floor_divide", "xor": "bitwise_xor",
                  "abs": "abs", "lshift": "bitwise_left_shift", "rshift": "bitwise_right_shift"}

_TORCH_NAMESPACES = ("torch", "torch._C._VariableFunctions", "torch._C._nn", "torch.nn.functional",
                     "torch.functional", "torch.special", "torch._C._special")

_FRESH_CACHE: dict[Any, bool] = {}


#: ATen ops that return a view or the input itself although their schema says nothing (``unsafe_split``,
#: ``_unsafe_view``; ``dequantize`` of a float tensor is the tensor).
def _schema_lies(name: str) -> bool:
    base = name.split("::")[-1].split(".")[0]
    return "unsafe" in base or base in ("dequantize", "_reshape_alias", "_reshape_copy_alias")


def _overload_fresh(op: Any) -> bool | None:
    """True: ``op`` returns new tensors; False: it may return an alias of an input; None: not a tensor op."""
    schema = op._schema
    if _schema_lies(schema.name):
        return False
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return None  # an in-place or out= variant: a write, seen by `writes`
    try:
        composite = op.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd)
    except RuntimeError:
        return None  # a TorchScript builtin on numbers (aten::add.int)
    if any(r.alias_info is not None for r in schema.returns):
        return False
    # a composite op's schema promises nothing: aten::dropout, type_as and einsum return their input (or a
    # view of it) in some cases
    return not composite


def returns_fresh(op: Any) -> bool:
    """``op`` (an ATen overload) provably returns new tensors: not an alias of an input, whatever its schema
    says (``einsum("ij->ij", x)`` and ``_unsafe_view`` return views their schemas do not declare)."""
    return isinstance(op, torch._ops.OpOverload) and _overload_fresh(op) is True


def _aten_fresh(name: str) -> bool:
    """Every tensor overload of ``aten::<name>`` returns new tensors."""
    key = ("aten", name)
    if key in _FRESH_CACHE:
        return _FRESH_CACHE[key]
    verdict = False
    try:
        packet = getattr(torch.ops.aten, name)
        seen = [_overload_fresh(getattr(packet, ov)) for ov in packet.overloads()]
        tensor_ops = [v for v in seen if v is not None]
        verdict = bool(tensor_ops) and all(tensor_ops)
    except (AttributeError, RuntimeError):
        verdict = False
    _FRESH_CACHE[key] = verdict
    return verdict


def _fresh_result(user: fx.Node) -> bool:
    """``user``'s result is known to be new memory (it shares none with any input): a kind of the vocabulary
    that always computes (matmul, arithmetic, softmax, comparisons, factories), an ATen op whose schema
    returns no alias and that is not composite, or a function known to compute."""
    op = read(user)
    if op is not None and op.kind in _FRESH_RESULT_KINDS:
        return True
    t = user.target
    if user.op == "call_method":
        name = str(t)
        return not name.endswith("_") and not name.startswith("_") and _aten_fresh(name)
    if isinstance(t, torch._ops.OpOverload):
        return _overload_fresh(t) is True
    if isinstance(t, torch._ops.OpOverloadPacket):
        return _packet_fresh(t)
    try:
        if t in _FRESH_FUNCTIONS:
            return True
    except TypeError:
        return False
    module = getattr(t, "__module__", None)
    name = getattr(t, "__name__", "")
    if module in ("_operator", "operator"):
        return name in _OPERATOR_ATEN and _aten_fresh(_OPERATOR_ATEN[name])
    if module in _TORCH_NAMESPACES and isinstance(name, str) and not name.endswith("_") and not name.startswith("_"):
        try:
            if getattr(torch, name, None) is not t and getattr(F, name, None) is not t \
                    and getattr(torch._C._nn, name, None) is not t and getattr(torch.special, name, None) is not t:
                return False  # not the public function of that name
        except TypeError:
            return False
        return _aten_fresh(name)
    return False


def _maybe_tensor(value: Any) -> bool:
    """An example value that is (or holds) a tensor, or unknown (None)."""
    if value is None:
        return True
    if isinstance(value, (list, tuple)):
        return any(_maybe_tensor(v) for v in value) if value else False
    from torch.fx.passes.shape_prop import TensorMetadata

    return isinstance(value, (torch.Tensor, TensorMetadata))


def _tensor_node(node: Any) -> bool:
    return isinstance(node, fx.Node) and _maybe_tensor(meta_value(node))


def may_alias(user: fx.Node, inp: Any, root: torch.nn.Module | None = None) -> bool:
    """``user``'s result may share memory with its tensor input ``inp``: a view, the in-place result,
    ``out=``. Conservative: an op counts as possibly aliasing every tensor input unless its result is known
    to be new (:func:`_fresh_result`); the explicit view lists are the fast path for the first argument."""
    if not isinstance(inp, fx.Node) or user.op not in ("call_function", "call_method", "call_module") \
            or inp not in user.all_input_nodes:
        return False
    if user.kwargs.get("out") is inp or writes(user, inp, root):
        return True
    if not _tensor_node(inp) or not _tensor_node(user):
        return False  # a size, a number, a dtype: no memory to share
    first = _first_input(user) is inp
    if _inplace_result_is_self(user):
        return first  # ``x.copy_(src)`` returns x: the result is the written tensor, never ``src``
    if user.op == "call_module":
        if not first:
            return False
        if root is None:
            return True
        try:
            return isinstance(root.get_submodule(str(user.target)), _VIEW_MODULES)
        except AttributeError:
            return True
    if user.op == "call_method" and (str(user.target) in _VIEW_METHODS or str(user.target) in _MORE_VIEW_METHODS):
        return first
    if user.op == "call_function":
        try:
            listed = user.target in _VIEW_FUNCTIONS
        except TypeError:
            listed = False
        if listed or user.target is getattr:
            return first  # x.T, x.mT, x.data
        if isinstance(user.target, torch._ops.OpOverload):
            if _schema_lies(user.target._schema.name):
                return True  # aten._unsafe_view, aten.unsafe_split: a view whose schema does not say so
            verdict = _overload_fresh(user.target)
            op = read(user)
            if verdict is True or (op is not None and op.kind in _FRESH_RESULT_KINDS):
                return False  # a new tensor (aten.matmul is composite, but always computes one)
            try:
                composite = user.target.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd)
            except RuntimeError:
                composite = True
            if not composite:
                return _passed_to_alias(user, inp)  # only the arguments the schema marks share memory
            return True
    return not _fresh_result(user)


#: In-place methods whose result is not simply ``self`` with its own memory: ``set_`` makes ``self`` share the
#: argument's storage.
_INPLACE_THAT_SHARE = frozenset(("set_",))


def _inplace_result_is_self(user: fx.Node) -> bool:
    """``user`` is an in-place tensor method (``x.copy_(src)``, ``x.add_(y)``, ``x.masked_fill_(m, v)``):
    it returns ``self``, so its result shares memory with ``self`` only, not with the other arguments."""
    if user.op != "call_method":
        return False
    name = str(user.target)
    return name.endswith("_") and not name.endswith("__") and not name.startswith("_") \
        and name not in _INPLACE_THAT_SHARE and "out" not in user.kwargs


def _passed_to_alias(user: fx.Node, inp: fx.Node) -> bool:
    """``inp`` is passed to a schema argument with alias information (``Tensor(a) self``)."""
    schema = user.target._schema  # type: ignore[union-attr]
    for i, a in enumerate(schema.arguments):
        value = user.args[i] if i < len(user.args) else user.kwargs.get(a.name)
        values = value if isinstance(value, (list, tuple)) else (value,)
        if a.alias_info is not None and any(v is inp for v in values):
            return True
    return False


def alias_group(node: fx.Node, root: torch.nn.Module | None = None) -> set[fx.Node]:
    """Every node whose tensor may share memory with ``node``'s: the connected set of nodes joined by
    :func:`may_alias` (a view and its base, the views of a base, an op's result and any input it may
    return), found in both directions. ``get_attr`` nodes of one attribute (symbolic_trace makes one per
    access) are one tensor. Conservative: an op not known to compute a new tensor joins its inputs."""
    group: set[fx.Node] = set()
    pending = [node]
    attrs: list[fx.Node] | None = None
    while pending:
        cur = pending.pop()
        if cur in group:
            continue
        group.add(cur)
        if cur.op in ("call_function", "call_method", "call_module"):
            pending.extend(i for i in cur.all_input_nodes if i not in group and may_alias(cur, i, root))
        pending.extend(u for u in cur.users if u not in group and may_alias(u, cur, root))
        if cur.op == "get_attr":
            if attrs is None:
                attrs = [n for n in cur.graph.nodes if n.op == "get_attr"]
            obj = attr_value(root, str(cur.target)) if root is not None else None
            pending.extend(n for n in attrs if n not in group and (n.target == cur.target or (
                isinstance(obj, torch.Tensor) and attr_value(root, str(n.target)) is obj)))  # type: ignore[arg-type]
    return group


def aliases(user: fx.Node) -> bool:
    """``user``'s result may be a view of (share memory with) its first argument. Conservative: an op not
    known to compute a new tensor may return its input."""
    first = _first_input(user)
    return isinstance(first, fx.Node) and may_alias(user, first)


def is_call_input(node: fx.Node) -> bool:
    """``node`` is an argument of the user's ``forward``, not module state (a parameter, buffer or attribute).

    ``get_attr`` nodes are module state; so are dynamo's placeholders for ``self``'s tensors, whose
    targets dynamo derives from their source (``L['self']._buffers['bias']`` -> ``L_self_buffers_bias_``)
    and for globals (``G_...``). Every other placeholder is a call input.
    """
    if node.op != "placeholder":
        return False
    return not str(node.target).startswith(("L_self_", "G_"))


def mutated(node: Any, depth: int = 8) -> bool:
    """``node``'s tensor (or a view of it) is written in place somewhere in the graph.

    Proofs that read what a node *computes* (a ``tril`` band, a ``zeros`` input) do not hold
    for a tensor changed afterwards (``keep[:4, :4] = True``, ``bias.masked_fill_(...)``).
    Conservative: ops that may return an alias count as views.
    """
    if not isinstance(node, fx.Node) or depth < 0:
        return False
    for user in node.users:
        if _writes(user, node):
            return True
        if may_alias(user, node) and mutated(user, depth - 1):
            return True
    return False
