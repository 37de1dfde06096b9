"""Find attention sites: prove that a softmax computes ``softmax(scale * q @ k^T + mask) @ v``.

Matches, for every softmax node, the chain around it in the canonical vocabulary of
:mod:`attnopt.passes.canon`::

    product = q @ kT                          (matmul / bmm / einsum, K pre-transposed or not)
    scores  = product (* or / scalar)*        (scale after the product; a scale on q stays on q)
                      (masked_fill | where | + mask | * m + c * (1 - m))*   (masks, proven by passes/masks.py)
                      (cast | contiguous)*
                      [torch.max(scores, finfo.min) | clamp(scores, min=finfo.min)]   (a floor, XGLM)
                      [cat([scores, sink], -1) [- rowmax] (cast)*]   (an attention sink, dropped after the softmax)
    probs   = softmax(scores, dim=last)       (any spelling, with or without dtype=)
              (cast | dropout | contiguous | [..., :-1] after a sink | masked_fill(m, 0) as before it)*
    out     = probs @ v [* sigmoid(logsumexp(scores, -1) - sink)]   (a sink as a scale of P @ V: one more key)

and emits a :class:`Match` (the nodes to replace and the proven :class:`AttentionSpec`) or a
near miss: a :class:`SiteRecord` whose ``reason`` names the first condition that failed.
The matcher is a table of named rules, :data:`RULES`, run in order on a shared partial match; the
first rule that cannot prove its condition refuses, names itself in ``record.extra["rule"]`` and
counts in :data:`REFUSALS`. Conditions are proven from the shapes in ``node.meta``, never from
variable names:

* *softmax over the key axis*: the scores' shape is known and the softmax is over its last axis;
* *probabilities reach P @ V*: through casts, copies and at most one dropout to ``P @ V`` (or
  ``v^T @ P^T``), every step the only user of the one before (readers of the dtype or shape alone do
  not count), so nothing else sees the probabilities;
* *scores come from q @ k^T*: back through scales, masks, biases, score modifiers and casts to the
  product (or ``baddbmm``), again every intermediate with exactly one user; a ``masked_fill``/``where``
  fills a number, or a 0-d tensor built in the graph from one (``torch.full([], finfo.min)``); a blend
  ``scores * m + c * (1 - m)`` is a fill of ``c`` where a 0/1 factor ``m`` is 0; an attention sink's
  concatenation (and a shift by the row maximum, which softmax ignores, and casts of the concatenated
  scores: Inkling2's ``cat([s, sinks], -1).float()``) is read here too, and so is a sink applied after
  ``P @ V`` as ``* sigmoid(logsumexp(s, -1) - sink)`` (Granite-SWA; the scores' one other reader);
  ``s + 0`` is no step at all;
* *conversions keep every value*: only widening casts (or back to the compute dtype; v's on the
  probabilities);
* *scale, score modifier, then masks*: the scale is a scalar; an elementwise modifier comes before
  any mask; a factor after a mask is a positive constant;
* *q, k, v shapes line up*: q, k, v have the same rank (2-4), keys and values one length, the
  scores are not broadcast beyond ``q @ k^T``, and a replaced node whose shape alone is read elsewhere
  (``mask.view(B, 1, 1, S).expand_as(scores)``, ``scores.size(-1)``) has a static shape or q's leading
  dims by Tk, so the rewrite can hand that reader a one-element stand-in of that shape;
* *heads match or are shared*: equal batch/head dims, or heads that ``repeat_kv`` (unsqueeze +
  expand + reshape) provably shares in groups, or one broadcast head: what ``enable_gqa`` reproduces;
* *the output has SDPA's shape*: ``[..., Tq, Dv]``;
* *masks are planned*: passes/masks.py reads them as one SDPA mask; masks have the scores' dtype
  (a bool or integer mask added to the scores is passed as the float values type promotion adds)
  and do not broadcast the scores up; ``aten._safe_softmax`` (zeros for rows whose every score is
  ``-inf``) only where no row can be masked entirely;
* *q and k share a floating dtype*, the compute dtype;
* *fills hold in the compute dtype*: finite fills that stay exact;
* *a sink is one more key*: an attention sink (``cat([scores, sink], -1)``, its column dropped after the
  softmax) has a number as scale (a power of two in half types), no score modifier, no finite fill, and
  the scores in the product's layout;
* *zeroed probabilities were masked*: a ``masked_fill(m, 0)`` of the probabilities zeroes the keys the
  scores' own ``-inf`` or dtype-minimum fill hid (the same condition), so it changes only rows where every
  key is hidden, which become zero;
* *a floor at the dtype's minimum*: ``torch.max(s, finfo.min)`` right before the softmax (XGLM), once, in the
  dtype the scores are computed in (not after an upcast), not in float16 and not next to a finite fill, a sink,
  zeroed probabilities or a ``-inf``-only mask;
* *v is floating*;
* *assemble the match*: the :class:`AttentionSpec` and the :class:`Match` (never refuses);
* *no in-place write inside the site*: nothing the site reads is written between its first read
  and ``P @ V``.

Example: nanoGPT's block yields one Match with ``spec.describe() == "scale=0.125, causal
(top-left), dropout p=0.1"``; ``q @ k.transpose(-2, -1)`` softmaxed over ``dim=-2`` is refused by
*softmax over the key axis*: "softmax is over dim 2, the query axis, not the last (key) axis of the
4-D scores".
"""

from __future__ import annotations

import logging
import math
import operator
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, NoReturn

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..spec import LEFT_ALONE, NOT_ATTENTION, AttentionSpec, ElementwiseScoreMod, Refusal, SiteRecord
from .canon import (
    Op,
    alias_group,
    attr_value,
    convert_scalar,
    dtype_of,
    functionalize_inplace,
    holds_exactly,
    is_scalar,
    is_zero_dim_tensor,
    meta_value,
    mutated,
    read,
    reads_only_shape,
    shape_of,
    writes,
)
from .masks import Add, Fill, MaskPlan, neg_large, plan_mask, same

log = logging.getLogger(__name__)


@dataclass
class Match:
    """A proven site: what to feed the replacement and which nodes it replaces."""

    record: SiteRecord
    softmax: fx.Node
    output: fx.Node  # the P @ V node whose users receive the replacement
    q: fx.Node
    k: fx.Node | None  # None: the key is ``k_t`` transposed back (a view)
    k_t: fx.Node | None
    v: fx.Node
    spec: AttentionSpec
    mask: MaskPlan
    scale_tensors: list[tuple[Any, str]] = field(default_factory=list)  # folded into q
    scale_nodes: list[tuple[Any, str]] = field(default_factory=list)  # run-time numbers (SymFloat)
    dropout_p: Any = None  # a run-time dropout probability node, when not a constant
    dropout_module: str | None = None
    internal: list[fx.Node] = field(default_factory=list)
    score_mod: ElementwiseScoreMod | None = None
    v_transposed: bool = False  # the site wrote ``v^T @ P^T``: v is [.., Dv, Tk], the output [.., Dv, Tq]
    #: method calls ``(name, args)`` that bring q, k, v to the site's layout and its output back to the layout
    #: of ``P @ V``, when views of the scores or probabilities fold or unfold their leading axes (see
    #: :func:`relayout`); an argument :class:`SizeOf` is a size read at run time
    q_relayout: tuple[tuple[str, tuple[Any, ...]], ...] = ()
    k_relayout: tuple[tuple[str, tuple[Any, ...]], ...] = ()
    v_relayout: tuple[tuple[str, tuple[Any, ...]], ...] = ()
    out_relayout: tuple[tuple[str, tuple[Any, ...]], ...] = ()
    #: attention-sink logits ``[..., Tq, 1]``: concatenated to the scores before the softmax, their column
    #: dropped after it (see :func:`attnopt.runtime.sinks.sink_operands`)
    sink: fx.Node | None = None
    #: the sink is a logit per row read from ``P @ V * sigmoid(logsumexp(s) - sink)`` (Granite-SWA), of
    #: logsumexp's shape ``[..., Tq]``: its column is ``sink.unsqueeze(-1)``
    sink_unsqueeze: bool = False
    #: rows whose every score is ``-inf`` are NaN as written (``NaN * sigmoid(-inf)``), restored after the site
    #: from its mask (the sink's key would give them zero)
    sink_nan_rows: bool = False
    #: the sink is read from ``sigmoid(logsumexp(s) - sink)``: a ``+inf`` sink gives the row 0 as written
    #: (``sigmoid(-inf)``), which one more key reproduces with the largest finite logit (see ``sink_operands``)
    sink_lse: bool = False
    #: the condition of a ``masked_fill`` before the softmax whose keys the probabilities zero again after it
    #: (``softmax(s.masked_fill(m, -inf)).masked_fill(m, 0)``): rows where it hides every key are zero
    zero_rows: fx.Node | None = None
    #: additive mask terms of one value per key (``[..., 1, Tk]``: ALiBi's ``slope * j``), set apart by the KV
    #: cache, which keeps them with the keys; empty for every other route (:func:`attnopt.pipeline.kv.cached`)
    key_bias: list[Any] = field(default_factory=list)
    #: the key terms are one per key only up to a constant per row (MPT's, relative to the last key): the cache
    #: adds them anchored at their largest (see ``KVCacheAttention.relative_key_bias``)
    relative_key_bias: bool = False


class NearMiss(Refusal):
    """A softmax that is not (provably) attention; ``str(e)`` says which condition failed."""


def place_of(node: fx.Node) -> tuple[str, str]:
    """(module path, file:line) of the user code that produced ``node``."""
    stack = node.meta.get("nn_module_stack") or {}
    path = ""
    if stack:
        path = list(stack.values())[-1][0]
        path = path.replace("L['self'].", "").replace("L['self']", "").replace("L['", "").replace("']", "")
        path = path.replace("_modules.", "").replace("._modules", "")
    trace = node.meta.get("stack_trace") or ""
    source = ""
    for line in trace.strip().splitlines():
        line = line.strip()
        if line.startswith("File "):
            try:
                fname = line.split('"')[1]
                lineno = line.split("line ")[1].split(",")[0]
                source = f"{fname.rsplit('/', 1)[-1]}:{lineno}"
            except IndexError:
                pass
    return path, source


def _at(node: fx.Node) -> str:
    """`` at <module path> (<file:line>)`` for ``node``, or what of it is known."""
    path, source = place_of(node)
    if path and source:
        return f" at {path} ({source})"
    return f" at {path or source}" if path or source else ""


def _user_desc(n: fx.Node, node: fx.Node) -> str:
    """How ``n`` uses ``node``, in words, with where it happens."""
    if n.op == "output":
        return f"returned to the caller (or across a graph break){_at(node)}"
    what = getattr(n.target, "__name__", n.target) if n.op != "call_module" else f"module {n.target}"
    return f"also read by `{what}`{_at(n)}"


_METADATA_METHODS = ("new_full", "new_ones", "new_zeros", "new_empty")

#: Factories whose result depends only on their first argument's shape, dtype, device and layout (the
#: value ``full_like`` fills, and ``randint_like``'s bounds, come after it).
LIKE_FACTORIES = frozenset(f for name in ("ones_like", "zeros_like", "empty_like", "full_like", "rand_like",
                                          "randn_like", "randint_like")
                           for f in (getattr(torch, name), getattr(torch.ops.aten, name).default))


def _is_tensor_node(x: Any) -> bool:
    if not isinstance(x, fx.Node):
        return False
    v = meta_value(x)
    return v is None or isinstance(v, torch.Tensor) or hasattr(v, "shape")


def reads_only_like(user: fx.Node, node: fx.Node) -> bool:
    """``user`` is ``torch.ones_like(node, ...)`` (or zeros/empty/full/rand/randn/randint): it reads
    ``node``'s shape, dtype and device, never its values. Not so when another argument is a tensor
    (``full_like(s, x)`` with a tensor ``x``: its value depends on a tensor)."""
    if user.op != "call_function" or user.kwargs.get("out") is not None:
        return False
    try:
        if user.target not in LIKE_FACTORIES:
            return False
    except TypeError:
        return False
    if not user.args or user.args[0] is not node:
        return False
    others = [*user.args[1:], *user.kwargs.values()]
    return not any(_is_tensor_node(a) for a in others) and not any(isinstance(a, (list, tuple)) for a in others)


def reads_only_dtype(user: fx.Node, node: fx.Node) -> bool:
    """``user`` reads only ``node``'s dtype/device (and shape), not its values:
    ``softmax(s.float()).type_as(s)``, ``s + s.new_full((T, T), -inf).triu(1)``,
    ``s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), -inf)``."""
    if reads_only_like(user, node):
        return True
    if user.op != "call_method" or user.kwargs.get("out") is not None:
        return False
    if user.target == "type_as":
        return len(user.args) == 2 and user.args[0] is not node and user.args[1] is node and not user.kwargs
    return user.target in _METADATA_METHODS and user.args[0] is node and node not in user.args[1:] \
        and node not in user.kwargs.values()


def _only_user(node: fx.Node, what: str, expected: fx.Node | None = None) -> fx.Node:
    """The one user of ``node`` that reads its values (``expected``, the next step of the match, when given)."""
    users = [u for u in node.users if not reads_only_dtype(u, node) and not reads_only_shape(u, node)]
    if len(users) != 1:
        # name the unexpected users first: the caller, then anything that is not the next attention step
        named = sorted(users, key=lambda u: (u.op != "output", _is_attention_step(u)))
        if expected is not None and expected in named and len(named) > 1:
            named.remove(expected)
        elif len(named) > 1 and _is_attention_step(named[-1]):
            named = named[:-1]
        others = "; ".join(_user_desc(u, node) for u in named[:3])
        raise NearMiss(f"the {what} are {others or 'not used'}: they cannot be replaced by a fused kernel that "
                       "never materialises them")
    return users[0]


def _is_attention_step(n: fx.Node) -> bool:
    op = read(n)
    return op is not None and op.kind in ("matmul", "softmax", "scale", "masked_fill", "where", "add", "cast",
                                          "dropout", "identity", "unary", "baddbmm")


def _scale_value(x: Any) -> float | torch.SymFloat | None:
    if isinstance(x, fx.Node):
        v = meta_value(x)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
        return None
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    return None


# ----------------------------------------------------------------------------- layouts

@dataclass(frozen=True)
class SizeOf:
    """``node.size(dim)``, read at run time (an argument of a :data:`Match` relayout step)."""

    node: fx.Node
    dim: int


#: The views that re-index a tensor in row-major order (``view``, ``reshape`` and ``unsqueeze``, as methods,
#: functions and ATen ops, ``_unsafe_view`` included); ``expand``/``broadcast_to`` only to the same shape.
_REINDEX = frozenset(("view", "reshape", "unsqueeze", torch.reshape, torch.unsqueeze, torch.ops.aten.view.default,
                      torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default,
                      torch.ops.aten.unsqueeze.default))


def _lead_product(dims: tuple[Any, ...]) -> Any:
    return math.prod(dims, start=1)


def fold_view(node: fx.Node, what: str) -> fx.Node:
    """The input of ``node``, a view of the attention scores (or probabilities) that is transparent to attention:
    it keeps the key axis last and the query axis second-to-last with their sizes, and only folds or unfolds the
    leading (batch, head) axes, ``(B*H, T, S) <-> (B, H, T, S)``.

    A view re-indexes in row-major order, so with the last two sizes kept, element ``[..., t, s]`` of leading
    block ``i`` (counted row-major) is element ``[..., t, s]`` of block ``i`` after it: every row stays a row,
    every block a block. An ``expand`` to the same shape changes nothing. Raises :class:`NearMiss` naming what
    the view changes otherwise (the key axis, the query axis, a broadcast, an unprovable factorisation)."""
    op = read(node)
    assert op is not None and op.kind == "view"
    src, out = shape_of(op.args[0]), shape_of(node)
    where = f"{op.spelling}{_at(node)}"
    if src is None or out is None:
        raise NearMiss(f"the {what} pass through {where} whose shapes are unknown")
    if len(src) == len(out) and all(same(a, b) for a, b in zip(src, out)):
        return op.args[0]  # the same shape: no change at all
    try:
        reindex = node.target in _REINDEX
    except TypeError:
        reindex = False
    if not reindex:
        raise NearMiss(f"the {what} are broadcast by {where} from {list(src)} to {list(out)} between the product "
                       "and the product with values", NOT_ATTENTION)
    if len(src) < 2 or len(out) < 2:
        raise NearMiss(f"the {what} pass through {where}, {list(src)} -> {list(out)}: it folds the query axis "
                       "into the batch (only views that keep the query and key axes are read)", NOT_ATTENTION)
    if not same(src[-1], out[-1]):
        raise NearMiss(f"the {what} pass through {where}, {list(src)} -> {list(out)}: it changes the key axis "
                       f"(last, size {src[-1]}) to size {out[-1]}", NOT_ATTENTION)
    if not same(src[-2], out[-2]) and (same(out[-2], _lead_product(tuple(src[:-1])))
                                       or same(src[-2], _lead_product(tuple(out[:-1])))):
        raise NearMiss(f"the {what} pass through {where}, {list(src)} -> {list(out)}: it folds the query axis "
                       "into the batch (or out of it); only views that keep the query and key axes are read",
                       NOT_ATTENTION)
    if not same(src[-2], out[-2]):
        raise NearMiss(f"the {what} pass through {where}, {list(src)} -> {list(out)}: it does not keep the query "
                       f"axis (second to last, size {src[-2]}) in place (it splits, folds or swaps it)",
                       NOT_ATTENTION)
    # A view keeps the element count, so with (T, S) kept and T * S > 0 the leading dims hold as many blocks
    # (sympy need not factor ``(s0 // 3) * (s0 // (s0 // 3))``); otherwise their products must be provably equal.
    if not (_positive(src[-1] * src[-2]) or same(_lead_product(tuple(src[:-2])), _lead_product(tuple(out[:-2])))):
        raise NearMiss(f"the {what} pass through {where}, {list(src)} -> {list(out)}, whose leading dims cannot be "
                       "proven to hold the same number of blocks", NOT_ATTENTION)
    return op.args[0]


def _positive(x: Any) -> bool:
    if isinstance(x, int):
        return x > 0
    try:
        return bool(statically_known_true(x > 0))
    except Exception:  # noqa: BLE001 - an unprovable comparison is simply not proven
        return False


def _not_one(x: Any) -> bool:
    """``x`` is provably not 1: a mask dim of that size that broadcasts against the scores equals theirs."""
    if isinstance(x, int):
        return x != 1
    try:
        return bool(statically_known_true(x != 1))
    except Exception:  # noqa: BLE001
        return False


@dataclass(frozen=True)
class Layout:
    """The leading (batch, head) dims of the scores at one point of a site: ``shape`` as ``node.meta`` has them
    (ints or SymInts), ``sizes`` the same as values the rewrite can pass at run time (an int, a SymInt node, a
    :class:`SizeOf`), None where unknown (a ``-1`` in a view)."""

    shape: tuple[Any, ...]
    sizes: tuple[Any, ...]

    @classmethod
    def of(cls, node: fx.Node, anchor: fx.Node | None = None) -> Layout:
        """The layout of ``node``'s result; sizes from ``anchor``'s (a tensor the site keeps, with the same leading
        dims) or from the shape a view was given."""
        shape = tuple((shape_of(node) or ())[:-2])
        given: list[Any] = [None] * len(shape)
        if anchor is not None:
            given = [SizeOf(anchor, i) for i in range(len(shape))]
        elif node.op in ("call_method", "call_function") and node.target in ("view", "reshape", torch.reshape,
                                                                              torch.ops.aten.view.default,
                                                                              torch.ops.aten.reshape.default,
                                                                              torch.ops.aten._unsafe_view.default):
            args = list(node.args[1:])
            if len(args) == 1 and isinstance(args[0], (list, tuple, torch.Size)):
                args = list(args[0])
            if len(args) == len(shape) + 2:
                given = [a if isinstance(a, fx.Node) or (isinstance(a, int) and a >= 0) else None for a in args[:-2]]
        sizes = tuple(d if type(d) is int else g for d, g in zip(shape, given))
        return cls(shape, sizes)

    def same_as(self, other: Layout) -> bool:
        return len(self.shape) == len(other.shape) and all(same(a, b) for a, b in zip(self.shape, other.shape))

    def resolved(self, anchors: list[Layout]) -> Layout:
        """Unknown sizes read from an anchor layout's dim of provably the same size."""
        sizes = list(self.sizes)
        for i, (d, g) in enumerate(zip(self.shape, sizes)):
            if g is None:
                sizes[i] = next((a.sizes[j] for a in anchors for j, e in enumerate(a.shape)
                                 if a.sizes[j] is not None and same(d, e)), None)
        return Layout(self.shape, tuple(sizes))

    def __str__(self) -> str:
        return str(list(self.shape))


def _groups(src: tuple[Any, ...], dst: tuple[Any, ...]) -> list[tuple[int, int]] | None:
    """Consecutive runs of ``src`` dims whose products are the ``dst`` dims (``dst`` folds ``src``), else None."""
    out: list[tuple[int, int]] = []
    i = 0
    for d in dst:
        a, p = i, 1
        while i < len(src):
            p = p * src[i]
            i += 1
            if same(p, d):
                break
        else:
            return None
        out.append((a, i - 1))
    while out and i < len(src) and same(src[i], 1):
        out[-1] = (out[-1][0], i)
        i += 1
    return out if i == len(src) and out else None


def relayout(lead: tuple[Any, ...], src: Layout, dst: Layout, what: str) -> tuple[tuple[str, tuple[Any, ...]], ...]:
    """Method calls that bring a tensor of leading dims ``lead`` (broadcast against the scores in layout ``src``:
    each dim 1 or ``src``'s) to layout ``dst``, where it broadcasts the same way against the same scores.

    A dim of 1 everywhere stays broadcast; dims ``dst`` folds together are flattened (expanded first where only
    some of them are broadcast); otherwise the tensor is expanded to ``src`` (only where broadcast), flattened
    and unflattened to ``dst``. Example: ``(B*H, 1, S)`` from ``(B*H,)`` to ``(B, H)`` is ``unflatten(0, (B, H))``;
    Swin's ``(1, nW, 1, N, N)`` from ``(B, nW, H)`` to ``(B*nW, H)`` is ``expand(B, -1, -1, -1, -1)`` then
    ``flatten(0, 1)``."""
    s, d = src.shape, dst.shape
    if len(lead) > len(s):
        raise NearMiss("the mask has more dims than the scores")
    if src.same_as(dst):
        return ()
    if all(same(x, 1) for x in lead):
        return () if len(lead) <= len(d) else (("flatten", (0, len(lead) - 1)),)
    steps: list[tuple[str, tuple[Any, ...]]] = [("unsqueeze", (0,))] * (len(s) - len(lead))
    lead = (1,) * (len(s) - len(lead)) + tuple(lead)
    # a dim that is not 1 broadcasts against the scores' (the code as written added it) only by being equal
    full = [same(x, a) or _not_one(x) for x, a in zip(lead, s)]
    if not all(f or same(x, 1) for f, x in zip(full, lead)):
        raise NearMiss(f"{what} has leading dims {list(lead)} that may or may not be broadcast against the scores' "
                       f"{src}")

    def size(i: int) -> Any:
        if src.sizes[i] is None:
            raise NearMiss(f"{what}, applied to the scores viewed with leading dims {src}, must be expanded to "
                           f"them, and size {i} of that view is not known at run time (a -1)")
        return src.sizes[i]

    def expand(dims: list[int]) -> None:
        if dims:
            steps.append(("expand", tuple(size(i) if i in dims else -1 for i in range(len(s))) + (-1, -1)))

    groups = _groups(s, d)
    if groups is not None:  # dst folds runs of src: flatten each run, expanding runs only partly broadcast
        expand([i for a, b in groups if not all(full[a:b + 1]) and not all(same(x, 1) for x in lead[a:b + 1])
                for i in range(a, b + 1) if not full[i]])
        steps.extend(("flatten", (a, b)) for a, b in reversed(groups) if b > a)
        return tuple(steps)
    if not d:
        raise NearMiss(f"{what} cannot be brought from leading dims {src} to none")
    expand([i for i, f in enumerate(full) if not f])
    if len(s) > 1:
        steps.append(("flatten", (0, len(s) - 1)))
    if len(d) > 1:
        sizes = [-1 if g is None else g for g in dst.sizes]
        if sizes.count(-1) > 1:
            raise NearMiss(f"{what} must be brought to leading dims {dst}, whose sizes are not known at run time")
        steps.append(("unflatten", (0, tuple(sizes))))
    return tuple(steps)


# ----------------------------------------------------------------------------- the rules

@dataclass
class _Partial:
    """A match in progress: what the rules so far have proven, for the rules after them."""

    gm: fx.GraphModule
    softmax: fx.Node
    concrete: dict[fx.Node, torch.Tensor]
    record: SiteRecord
    sm: Op  # the softmax as read: (scores, dim, dtype)
    scores_in: fx.Node  # the softmax's input
    s_shape: tuple[Any, ...] = ()  # the scores' shape and rank
    nd: int = 0
    internal: list[fx.Node] = field(default_factory=list)  # the nodes the site replaces
    # forward: probabilities -> P @ V
    dropout: tuple[Any, str] = (0.0, "off")  # (p, mode)
    dropout_module: str | None = None
    post_casts: list[fx.Node] = field(default_factory=list)
    pv: fx.Node | None = None
    v: Any = None
    v_transposed: bool = False
    views: list[fx.Node] = field(default_factory=list)  # views that fold/unfold leading axes, in program order
    # backward: scores <- product
    chain: list[tuple[str, Any]] = field(default_factory=list)  # (kind, payload) in program order
    product: fx.Node | None = None
    q: Any = None
    k_t: Any = None  # the product's right operand (k itself when ``k_transposed``)
    k_transposed: bool = False
    # the chain read: scale, score modifier, masks
    scale: float = 1.0
    scale_tensors: list[tuple[Any, str]] = field(default_factory=list)
    scale_nodes: list[tuple[Any, str]] = field(default_factory=list)
    masks: list[Any] = field(default_factory=list)
    mask_layouts: list[Layout] = field(default_factory=list)  # the layout each mask term was applied in
    mods: list[tuple[Any, ...]] = field(default_factory=list)
    score_mod: ElementwiseScoreMod | None = None
    # operands
    k: fx.Node | None = None  # None: the key is ``k_t`` transposed back
    key_shape: Any = None
    q_shape: Any = None
    v_shape: Any = None
    out_shape: Any = None
    tq: Any = None
    tk: Any = None
    gqa: bool = False
    k_src: Any = None  # k and v as the site reads them (behind repeat_kv when ``gqa``)
    v_src: Any = None
    plan: MaskPlan | None = None
    q_dtype: torch.dtype | None = None
    site_lead: int | None = None  # the site's number of leading dims, when views changed them
    relayouts: tuple[Any, ...] = ((), (), (), ())  # q, k, v, out (see Match)
    # an attention sink: the probabilities lose one key column, the scores gained it by a concatenation
    sink_drop: str | None = None  # "first" | "last": the column the probabilities drop
    sink: fx.Node | None = None  # the sink logits concatenated to the scores, shape [..., Tq, 1]
    sink_scale: fx.Node | None = None  # ``P @ V * sigmoid(logsumexp(s) - sink)``: the product, the site's output
    sink_unsqueeze: bool = False  # that sink has logsumexp's shape [..., Tq] (keepdim=False)
    zeroed: fx.Node | None = None  # ``probs.masked_fill(cond, 0)`` after the softmax: its condition
    zero_cond: fx.Node | None = None  # the scores' own fill condition it was proven equal to
    score_floor: str | None = None  # "maximum" | "clamp": the scores floored at their dtype's minimum (XGLM)
    floor_dtype: torch.dtype | None = None  # the dtype the floor is applied in
    match: Match | None = None


def _softmax_axis(st: _Partial) -> None:
    """The scores have a known shape and the softmax runs over their last (key) axis."""
    s_shape = shape_of(st.scores_in)
    if s_shape is None:
        raise NearMiss("no shape information for the scores (capture with example inputs)", NOT_ATTENTION)
    st.s_shape, st.nd = s_shape, len(s_shape)
    dim, nd = st.sm.args[1], st.nd
    if dim != nd - 1:
        axes = {4: ("batch", "head", "query", "key"), 3: ("batch", "query", "key"), 2: ("query", "key")}.get(nd)
        name = f", the {axes[dim]} axis" if axes and isinstance(dim, int) and 0 <= dim < nd else ""
        raise NearMiss(f"softmax is over dim {dim}{name}, not the last (key) axis of the {nd}-D scores"
                       f"{_at(st.softmax)}", NOT_ATTENTION)


def _forward_to_pv(st: _Partial) -> None:
    """From the softmax through casts, copies and at most one dropout to ``P @ V`` (or ``v^T @ P^T``),
    each step the only user of the one before."""
    cur = st.softmax
    while st.pv is None:
        try:
            user = _only_user(cur, "attention probabilities")
        except NearMiss:
            if not any(read(u, st.gm) is not None and read(u, st.gm).kind == "matmul"  # type: ignore[union-attr]
                       for u in cur.users):
                raise NearMiss("the softmax output does not feed a product with values", NOT_ATTENTION) from None
            raise
        op = read(user, st.gm)
        if op is None:
            raise NearMiss(f"the probabilities pass through `{getattr(user.target, '__name__', user.target)}`"
                           f"{_at(user)} before the product with values",
                           NOT_ATTENTION if cur is st.softmax else LEFT_ALONE)
        if op.kind in ("cast", "identity", "dropout") and op.args[0] is cur:
            _transparent_step(st, user, op)
            cur = user
        elif op.kind == "view" and op.args[0] is cur:
            if not _same_shape(fold_view(user, "probabilities"), user):  # folds/unfolds leading axes, else refused
                st.views.append(user)
            st.record.spelling.append(op.spelling)
            st.internal.append(user)
            cur = user
        elif op.kind == "transpose" and op.args[0] is cur and (op.args[1], op.args[2]) == (st.nd - 2, st.nd - 1):
            _transposed_pv(st, cur, user, op)
        elif op.kind == "getitem" and op.args[0] is cur and st.sink_drop is None \
                and _drops_one_key(op.args[1], st.nd) is not None:
            st.sink_drop = _drops_one_key(op.args[1], st.nd)  # checked against the scores in _back_to_product
            st.record.spelling.append("[..., :-1]" if st.sink_drop == "last" else "[..., 1:]")
            st.internal.append(user)
            cur = user
        elif op.kind == "masked_fill" and op.args[0] is cur and st.zeroed is None and isinstance(op.args[1], fx.Node) \
                and _fill_value(op.args[2]) == 0.0 and not st.views:
            st.zeroed = op.args[1]  # proven the scores' own mask in _zeroed_rows, once the masks are read
            st.record.spelling.append("masked_fill(m, 0)")
            st.internal.append(user)
            cur = user
        elif op.kind == "matmul":
            _pv(st, cur, user, op)
        elif op.kind in ("transpose", "permute"):
            raise NearMiss(f"the probabilities are re-laid out by {op.spelling}{_at(user)} (not a swap of the query "
                           "and key axes) before the product with values; only P @ V (or v^T @ P^T) in the "
                           "softmax's layout is read, not a chunked one (Longformer's sliding window)", NOT_ATTENTION)
        else:
            raise NearMiss(f"the probabilities are changed by {op.spelling}{_at(user)} after the softmax "
                           "(a mask or product after the softmax without renormalising)",
                           NOT_ATTENTION if op.kind not in ("scale", "mul", "add", "masked_fill", "where")
                           else LEFT_ALONE)


def _transparent_step(st: _Partial, user: fx.Node, op: Op) -> None:
    """A cast, a copy or the (one) dropout on the probabilities: part of the site."""
    if op.kind == "dropout":
        if st.dropout[1] != "off":
            raise NearMiss("two dropouts on the probabilities")
        st.dropout = (op.args[1], op.args[2])
        if op.args[2] == "module":
            st.dropout_module = str(user.target)
    elif op.kind == "cast":
        st.post_casts.append(user)
    st.record.spelling.append(op.spelling)
    st.internal.append(user)


def _transposed_pv(st: _Partial, cur: fx.Node, user: fx.Node, op: Op) -> None:
    """Transposed P·V layout: out^T = v^T @ P^T (e.g. ``bmm(v, p.transpose(1, 2))`` on [B, C, HW])."""
    pt_user = _only_user(user, "attention probabilities")
    pop_ = read(pt_user, st.gm)
    if pop_ is None or pop_.kind != "matmul" or pop_.args[1] is not user or pop_.args[0] is user or pop_.args[2]:
        raise NearMiss("the transposed probabilities do not feed a product `v^T @ P^T`",
                       NOT_ATTENTION if cur is st.softmax else LEFT_ALONE)
    st.internal.append(user)
    st.pv, st.v, st.v_transposed = pt_user, pop_.args[0], True
    st.record.spelling.extend([op.spelling, f"v^T {pop_.spelling} P^T"])


def _pv(st: _Partial, cur: fx.Node, user: fx.Node, op: Op) -> None:
    """``P @ V``: the probabilities are the left operand, v is not transposed."""
    a, b, b_t = op.args
    if a is not cur or b is cur:
        raise NearMiss("the probabilities are the right operand of the product with values, not transposed "
                       "(only `v^T @ P^T` is rewritten)")
    if b_t:
        raise NearMiss("the values are multiplied transposed (einsum over their last axis)")
    st.pv, st.v = user, b
    st.record.spelling.append(op.spelling)


def _back_to_product(st: _Partial) -> None:
    """Back from the softmax through scales, masks, biases, score modifiers and casts to ``q @ k^T``
    (``baddbmm`` included), each step the only user of the one before."""
    record = st.record
    post_spelling, record.spelling = record.spelling, []
    chain: list[tuple[str, Any]] = []  # collected backwards; reversed into program order below
    cur = st.scores_in
    if not _lse_sink(st):  # (the sink scale of Granite-SWA reads the scores too)
        _only_user(cur, "attention scores", st.softmax)  # the softmax's own input: returned or stored elsewhere?
    if st.sink_drop is not None:
        cur = _sink_column(st, cur, chain)
    elif st.sink_scale is None:  # (an lse sink reads the shifted scores: its logit is relative to them)
        shift = _row_max_shift(cur)  # ``s - s.max(-1, keepdim=True).values`` (MiMo-V2): softmax is shift-invariant
        if shift is not None:
            st.internal.extend((cur, *shift[1]))
            record.spelling.append("- rowmax")
            cur = shift[0]
    while True:
        op = read(cur, st.gm)
        if op is None:
            out = " and also writes its `out=` tensor" if isinstance(cur, fx.Node) and cur.kwargs.get("out") \
                is not None else ""
            raise NearMiss(f"the scores pass through `{getattr(cur.target, '__name__', cur.target)}`{_at(cur)} "
                           f"between the product and the softmax{out}", NOT_ATTENTION)
        if op.kind == "baddbmm":
            _baddbmm_terms(op, chain, record)
            break
        if op.kind == "view":
            nxt = fold_view(cur, "scores")  # only folds or unfolds leading axes, else refused
            chain.append(("view", cur))
            record.spelling.append(op.spelling)
            if not _same_shape(nxt, cur):
                st.views.insert(0, cur)
            st.internal.append(cur)
            _only_user(nxt, "attention scores", cur)
            cur = nxt
            continue
        floor = _score_floor(op, cur, chain)
        if floor is not None:  # torch.max(s, finfo.min) right before the softmax (XGLM); -inf: no step at all
            mode, x = floor
            if mode is not None and st.score_floor is not None:  # each floor halves a tie's gradient again
                raise NearMiss(f"the scores are floored twice before the softmax ({op.spelling}{_at(cur)}); only one "
                               "floor at the dtype's minimum is read")
            if mode is not None:
                st.score_floor, st.floor_dtype = mode, dtype_of(cur)
            record.spelling.append(f"{op.spelling}(·, min)" if mode else f"{op.spelling}(·, -inf)")
            st.internal.append(cur)
            _only_user(x, "attention scores", cur)
            cur = x
            continue
        blend = _keep_blend(op, cur) if op.kind == "add" else None
        if blend is not None:  # scores * m + c * (1 - m): a fill of c where the 0/1 factor m is 0
            scores, m, c, replaced = blend
            _only_user(replaced[0], "attention scores", cur)
            chain.append(("mask", Fill(m, _stored(c, dtype_of(cur)), True, dtype_of(cur), binary=True)))
            record.spelling.append("* m + c * (1 - m)")
            st.internal.extend((cur, *replaced))
            _only_user(scores, "attention scores", replaced[0])
            cur = scores
            continue
        nxt = _step_back(op, cur, chain, record)
        if nxt is None:
            if op.kind == "matmul":
                break
            raise NearMiss(f"the scores pass through {op.spelling}{_at(cur)} between the product and the softmax",
                           NOT_ATTENTION)
        st.internal.append(cur)
        _only_user(nxt, "attention scores", cur)
        cur = nxt
    chain.reverse()
    st.chain, st.product = chain, cur
    st.internal.append(cur)
    pop = read(cur, st.gm)
    assert pop is not None
    record.spelling = [pop.spelling, *reversed(record.spelling), *post_spelling]
    st.q, st.k_t, st.k_transposed = pop.args if pop.kind == "matmul" else (pop.args[1], pop.args[2], False)


def _drops_one_key(index: Any, nd: int) -> str | None:
    """"last" for ``p[..., :-1]``, "first" for ``p[..., 1:]`` (every other axis whole), else None."""
    full = list(index) if isinstance(index, tuple) else [index]
    if Ellipsis in full:
        i = full.index(Ellipsis)
        full = full[:i] + [slice(None)] * (nd - len(full) + 1) + full[i + 1:]
    if len(full) != nd or not all(isinstance(e, slice) and e == slice(None) for e in full[:-1]):
        return None
    last = full[-1]
    if not isinstance(last, slice):
        return None
    # ATen's slice spells ``:-1`` as ``slice(0, -1, 1)`` and ``1:`` with the end 2**63 - 1
    start = None if last.start == 0 else last.start
    end = None if last.stop == 2**63 - 1 else last.stop
    step = None if last.step == 1 else last.step
    if (start, end, step) == (None, -1, None):
        return "last"
    if (start, end, step) == (1, None, None):
        return "first"
    return None


_CATS = frozenset((torch.cat, torch.concat, torch.concatenate, torch.ops.aten.cat.default))


def _sink_column(st: _Partial, cur: fx.Node, chain: list[tuple[str, Any]]) -> fx.Node:
    """The scores behind an attention sink: ``cat([scores, sink], -1)`` (or ``[sink, scores]``, matching the
    column the probabilities drop), optionally shifted by its row maximum first (``c - c.max(-1,
    keepdim=True).values``: softmax does not change under a shift, nor does its gradient), and converted
    before the softmax (Inkling2's ``cat([scores, sinks], -1).float()``: a cast of the sink's column and the
    scores alike, put on ``chain`` for *conversions keep every value*). Records the sink (``[..., Tq, 1]``, the
    scores' dtype) and returns the scores."""
    nodes: list[fx.Node] = []
    cur = _sink_casts(st, cur, chain, nodes)
    shift = _row_max_shift(cur)
    if shift is not None:
        nodes.extend((cur, *shift[1]))
        st.record.spelling.append("- rowmax")
        cur = _sink_casts(st, shift[0], chain, nodes)
    op_ok = cur.op == "call_function" and cur.target in _CATS
    parts = cur.args[0] if op_ok and cur.args else None
    dim = cur.kwargs.get("dim", cur.args[1] if len(cur.args) > 1 else 0) if op_ok else None
    if not (isinstance(parts, (list, tuple)) and len(parts) == 2 and dim in (-1, st.nd - 1)):
        raise NearMiss(f"the probabilities drop a key column{_at(st.softmax)} that is not an attention sink "
                       "concatenated to the scores (`torch.cat([scores, sink], dim=-1)`)", LEFT_ALONE)
    scores, sink = parts if st.sink_drop == "last" else parts[::-1]
    ss, ks = shape_of(scores), shape_of(sink)
    if not (isinstance(scores, fx.Node) and isinstance(sink, fx.Node) and ss is not None and ks is not None
            and len(ks) == len(ss) and same(ks[-1], 1) and _same_dims(ks[:-1], ss[:-1])
            and dtype_of(sink) == dtype_of(scores)):
        raise NearMiss(f"the column concatenated to the scores{_at(cur)} is not a sink of shape [..., Tq, 1] in "
                       "the scores' dtype", LEFT_ALONE)
    # (its readers were checked: the softmax alone, or the shift and its maximum alone)
    st.internal.extend((*nodes, cur))
    st.record.spelling.append("cat(sink)")
    st.sink = sink
    st.s_shape = ss  # the scores' own shape: Tk keys, the sink's column aside
    _only_user(scores, "attention scores", cur)
    return scores


_LOGSUMEXP = frozenset((torch.logsumexp, torch.ops.aten.logsumexp.default, "logsumexp"))


def _is_logsumexp(node: fx.Node) -> bool:
    try:
        return node.op in ("call_function", "call_method") and node.target in _LOGSUMEXP
    except TypeError:
        return False


def _lse_sink(st: _Partial) -> bool:
    """A sink applied after ``P @ V`` as the scale ``sigmoid(logsumexp(s) - sink)`` (Granite-SWA,
    modeling_granite_swa.py:111): True when the softmax's scores are also read by a ``logsumexp`` over their key
    axis that is exactly that, recorded as an attention sink (one more key whose logit is ``sink``).

    ``softmax(s) @ v * sigmoid(lse(s) - sink) = softmax(s) @ v * Z / (Z + exp(sink))`` with ``Z = exp(lse(s))``:
    the product with values of ``softmax([s, sink])[..., :-1]``, and so are its gradients (one function of
    ``s``, ``v`` and ``sink``). Proven: the scores are read by the softmax and that ``logsumexp`` alone; it is
    ``lse - sink`` (not ``sink - lse``, which is ``1 -`` the scale) of lse's shape, then value-keeping casts,
    ``sigmoid``, a trailing axis of 1 (unless ``keepdim=True``), casts to ``P @ V``'s dtype, and a product with
    ``P @ V``, every step the only reader of the one before and ``P @ V`` read by that product alone, which keeps
    its shape and dtype. False when no ``logsumexp`` reads the scores; a refusal naming what differs otherwise."""
    s = st.scores_in
    readers = [u for u in s.users if not reads_only_dtype(u, s) and not reads_only_shape(u, s)]
    lse = next((u for u in readers if _is_logsumexp(u)), None)
    if lse is None or st.sink_drop is not None or set(readers) != {st.softmax, lse} or st.pv is None:
        return False

    def refuse(why: str) -> NoReturn:
        raise NearMiss(f"the attention scores are also read by `logsumexp`{_at(lse)}, which is not a sink scale "
                       f"`(P @ V) * sigmoid(logsumexp(s, -1) - sink)`: {why}", LEFT_ALONE)

    dim = lse.kwargs.get("dim", lse.args[1] if len(lse.args) > 1 else None)
    keep = lse.kwargs.get("keepdim", lse.args[2] if len(lse.args) > 2 else False)
    dims = tuple(dim) if isinstance(dim, (list, tuple)) else (dim,)
    if lse.args[0] is not s or len(dims) != 1 or dims[0] not in (-1, st.nd - 1) or keep not in (True, False):
        refuse("it is not over the key axis alone")
    nodes = [lse]

    def only(node: fx.Node) -> fx.Node:
        users = [u for u in node.users if not reads_only_dtype(u, node) and not reads_only_shape(u, node)]
        if len(users) != 1:
            refuse(f"`{node.name}` is read {'nowhere' if not users else 'elsewhere too'}")
        return users[0]

    sub = only(lse)
    sop = read(sub, st.gm)
    if sop is None or sop.kind != "sub" or sop.args[0] is not lse or not isinstance(sop.args[1], fx.Node):
        refuse("its only reader is not `logsumexp(s) - sink`")
    sink, lse_shape, sink_shape = sop.args[1], shape_of(lse), shape_of(sop.args[1])
    if lse_shape is None or sink_shape is None or len(sink_shape) > len(lse_shape) \
            or not _same_shape(sub, lse) or not (dtype_of(sink) or torch.int64).is_floating_point \
            or dtype_of(sub) != dtype_of(lse):
        refuse(f"the sink `{sink.name}` is not a floating tensor broadcast against logsumexp's {list(lse_shape or ())}")
    nodes.append(sub)
    cur, sigmoid, unsqueezed = sub, False, bool(keep)
    while True:
        user = only(cur)
        op = read(user, st.gm)
        if op is None or op.args[0] is not cur and op.kind != "mul":
            refuse(f"`{cur.name}` passes through `{getattr(user.target, '__name__', user.target)}`{_at(user)}")
        if op.kind == "cast":
            src, dst = dtype_of(cur), dtype_of(user)
            if src is None or dst is None or not dst.is_floating_point \
                    or not (holds_exactly(dst, src) or sigmoid and dst == dtype_of(st.pv)):
                refuse(f"the sink scale is converted from {src} to {dst} by {op.spelling}{_at(user)}")
        elif op.kind == "unary" and op.args[1] == "sigmoid" and not sigmoid:
            sigmoid = True
        elif op.kind == "view" and sigmoid and not unsqueezed and shape_of(user) is not None \
                and _same_dims(tuple(shape_of(user)), (*shape_of(cur), 1)):  # type: ignore[misc]
            unsqueezed = True  # any view that only appends an axis of 1
        elif op.kind == "mul" and sigmoid and unsqueezed and st.pv in op.args[:2] and cur in op.args[:2] \
                and op.args[0] is not op.args[1]:
            break
        else:
            refuse(f"`{cur.name}` passes through {op.spelling}{_at(user)} (only casts, one sigmoid, a trailing "
                   "axis of 1 and the product with P @ V are read)")
        nodes.append(user)
        cur = user
    pv_readers = [u for u in st.pv.users if not reads_only_dtype(u, st.pv) and not reads_only_shape(u, st.pv)]
    if pv_readers != [user]:
        refuse(f"P @ V (`{st.pv.name}`) is read elsewhere too, unscaled")
    if not _same_shape(user, st.pv) or dtype_of(user) != dtype_of(st.pv):
        refuse(f"the scaled product{_at(user)} has another shape or dtype than P @ V")
    st.internal.extend(nodes)
    st.sink, st.sink_scale, st.sink_unsqueeze = sink, user, not keep
    st.record.spelling.append("* sigmoid(logsumexp - sink)")
    return True


def _sink_casts(st: _Partial, cur: fx.Node, chain: list[tuple[str, Any]], nodes: list[fx.Node]) -> fx.Node:
    """Back through conversions and copies of the concatenated scores (each the only reader of the one before):
    the casts go on ``chain`` (checked with the scores' own by :func:`_check_casts`), the steps on ``nodes``."""
    while True:
        op = read(cur, st.gm)
        if op is None or op.kind not in ("cast", "identity") or not isinstance(op.args[0], fx.Node):
            return cur
        if op.kind == "cast":
            chain.append(("cast", cur))
        st.record.spelling.append(op.spelling)
        nodes.append(cur)
        _only_user(op.args[0], "attention scores", cur)
        cur = op.args[0]


def _row_max_shift(node: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """``(x, [max nodes])`` when ``node`` is ``x - x.max(-1, keepdim=True).values`` (or ``[0]``, ``amax``,
    ``torch.max``/``torch.amax``, a ``.detach()`` on the maximum), each max node used only there."""
    aten = torch.ops.aten
    if not (node.op == "call_function" and node.target in (operator.sub, torch.sub, aten.sub.Tensor)) \
            or len(node.args) != 2 or node.kwargs:
        return None  # (``torch.sub(x, m, alpha=2)`` is no shift by the maximum)
    x, m = node.args
    if not (isinstance(x, fx.Node) and isinstance(m, fx.Node)):
        return None
    chain: list[fx.Node] = []  # from the shift's operand back to the reduction (excluded)
    cur = m
    while len(cur.users) == 1 and isinstance(cur.args[0] if cur.args else None, fx.Node) and (
            cur.op == "call_method" and cur.target == "detach"
            or cur.op == "call_function" and cur.target in (torch.detach, aten.detach.default)
            or cur.op == "call_function" and cur.target is operator.getitem and cur.args[1] == 0
            or cur.op == "call_function" and cur.target is getattr and cur.args[1] == "values"):
        chain.append(cur)
        cur = cur.args[0]
    if len(cur.users) != 1:
        return None
    reduced = cur.op == "call_method" and cur.target in ("max", "amax") or \
        cur.op == "call_function" and cur.target in (torch.max, torch.amax, aten.max.dim, aten.amax.default)
    if not reduced or not cur.args or cur.args[0] is not x:
        return None
    dim = cur.kwargs.get("dim", cur.args[1] if len(cur.args) > 1 else None)
    keep = cur.kwargs.get("keepdim", cur.args[2] if len(cur.args) > 2 else False)
    nd = len(shape_of(x) or ())
    dims = dim if isinstance(dim, (list, tuple)) else (dim,)
    picks = [c for c in chain if c.target in (operator.getitem, getattr)]
    if cur.target in ("max", torch.max, aten.max.dim):
        # torch.max(x, dim) returns (values, indices): its values, picked right off the reduction, are a shift
        if len(picks) != 1 or picks[0] is not chain[-1]:
            return None
    elif picks:  # amax returns the maxima themselves: ``[0]`` would index them (batch 0's rows)
        return None
    if keep is not True or len(dims) != 1 or dims[0] not in (-1, nd - 1):
        return None
    if set(x.users) != {node, cur}:
        return None
    return x, [*chain, cur]


def _casts(st: _Partial) -> None:
    """The conversions on the scores and the probabilities keep every value (:func:`_check_casts`)."""
    _check_casts(st.softmax, st.sm.args[2], [n for kind, n in st.chain if kind == "cast"], st.post_casts,
                 dtype_of(st.q), dtype_of(st.v))


def _scale_mods_masks(st: _Partial) -> None:
    """The chain in program order: one scalar scale, an elementwise score modifier before any mask, then the
    masks (a constant positive factor may follow them). Each mask keeps the layout of the scores it was
    applied to (views may fold or unfold their leading axes); a per-head factor tensor is applied in the
    product's layout."""
    product_layout = layout = Layout.of(st.product)
    for kind, payload in st.chain:
        if kind == "view":
            layout = Layout.of(payload)
        elif kind == "mod":
            _add_mod(st, payload)
        elif kind == "mask":
            if isinstance(payload, Fill) and payload.binary and st.masks:
                # an earlier mask may hold -inf, and `-inf * 0` is NaN as written where the factor is 0
                raise NearMiss("the scores are blended with a 0/1 factor (`w * m + c * (1 - m)`) after another mask; "
                               "the blend is read as a fill only on the scores themselves")
            st.masks.append(payload)
            st.mask_layouts.append(layout)
        elif kind == "scale":
            factor = payload[0]
            if isinstance(factor, fx.Node) and not is_zero_dim_tensor(factor) and _scale_value(factor) is None \
                    and not layout.same_as(product_layout):
                raise NearMiss(f"the scores are scaled by the tensor `{factor.name}` in a view of them "
                               f"(leading dims {layout}, the product's {product_layout}); only per-head factors "
                               "applied in the product's layout are rewritten")
            _add_scale(st, *payload)
    if not math.isfinite(st.scale):
        raise NearMiss(f"the scale {st.scale} is not finite")
    try:
        st.score_mod = ElementwiseScoreMod(tuple(st.mods)) if st.mods else None
    except ValueError as e:
        raise NearMiss(f"the score modifier is not one attnopt reads: {e}") from e


def _add_mod(st: _Partial, payload: tuple[Any, ...]) -> None:
    """An elementwise score modifier, which must come before every mask."""
    if st.masks:
        try:
            step = ElementwiseScoreMod((payload,)).describe()
        except ValueError:
            step = str(payload[0])
        raise NearMiss(f"the score modifier {step} is applied after a mask (it would change the "
                       "masked scores too)")
    st.mods.append(payload)


def _add_scale(st: _Partial, factor: Any, how: str) -> None:
    """A factor on the scores: into the scale, or, after a modifier or mask, into those."""
    value = _scale_value(factor)
    if st.mods or st.masks:
        if value is None or value == 0 or not math.isfinite(value):
            raise NearMiss(f"the scores are scaled by `{factor}` after a "
                           f"{'score modifier' if st.mods and not st.masks else 'mask'}; only constant non-zero "
                           "factors are rewritten there")
        c = value if how == "mul" else 1.0 / value
        if st.masks:  # scale after a mask: the masked values are scaled too
            if c <= 0:
                raise NearMiss(f"the scores are scaled by {c:g} after a mask; a negative factor turns the mask over")
            st.masks = [_scaled_mask(t, c, how, value) for t in st.masks]
            if st.mods:  # c * mask(mod(s)) = mask'(c * mod(s)): the factor joins the modifier, not the scale
                st.mods.append(("mul", c))
            else:
                st.scale *= c
        elif c != 1.0:  # a factor of one after a modifier changes nothing
            st.mods.append(("mul", c))
        return
    if value is None:
        if isinstance(factor, fx.Node) and (is_zero_dim_tensor(factor) or _per_row_block_factor(factor, st.q)):
            st.scale_tensors.append((factor, how))  # folded into q, so gradients still reach it
            return
        if is_scalar(factor):  # a number only known at run time (e.g. a float module attribute)
            st.scale_nodes.append((factor, how))
            return
        raise NearMiss(f"the scale `{factor}` is not a number known at capture")
    if how == "div":
        if value == 0:
            raise NearMiss("the scores are divided by zero")
        st.scale = st.scale / value
    else:
        st.scale = st.scale * value


def _operand_shapes(st: _Partial) -> None:
    """q [.., Tq, D], k [.., Tk, D], v [.., Tk, Dv] of one rank (2 to 4); the scores are q @ k^T's shape, and a
    shape that is read elsewhere can be rebuilt (:func:`_shape_readers`)."""
    if st.k_transposed:
        st.k, st.k_t = st.k_t, None
    else:
        kop = read(st.k_t, st.gm)
        kt_shape = shape_of(st.k_t)
        if kop is not None and kop.kind == "transpose" and kt_shape is not None \
                and (kop.args[1], kop.args[2]) == (len(kt_shape) - 2, len(kt_shape) - 1):
            st.k = kop.args[0]
            st.record.spelling.insert(1, "k" + kop.spelling.replace("()", "(-2, -1)")
                                      if kop.spelling.startswith(".") else f"{kop.spelling}(k)")
    key_shape = shape_of(st.k) if st.k is not None else _t_shape(shape_of(st.k_t))
    q_shape, v_shape, out_shape = shape_of(st.q), shape_of(st.v), shape_of(st.pv)
    if st.v_transposed:  # v^T @ P^T: read the shapes of v and of the output as if untransposed
        v_shape, out_shape = _t_shape(v_shape), _t_shape(out_shape)
    if key_shape is None or q_shape is None or v_shape is None or out_shape is None:
        raise NearMiss("missing shape information for q, k or v")
    if st.views:  # the site's layout is chosen below (_relayouts); v has the probabilities' leading dims
        if not (len(q_shape) == len(key_shape) and 2 <= len(q_shape) <= 6 and 2 <= len(v_shape) <= 6):
            raise NearMiss(f"q, k, v have ranks {len(q_shape)}, {len(key_shape)}, {len(v_shape)}; with views of the "
                           "scores, q and k of one rank (2 to 6) are rewritten")
    elif not (len(q_shape) == len(key_shape) == len(v_shape) and 2 <= len(q_shape) <= 6):
        raise NearMiss(f"q, k, v have ranks {len(q_shape)}, {len(key_shape)}, {len(v_shape)}; "
                       "equal ranks of 2 to 6 are rewritten")
    st.key_shape, st.q_shape, st.v_shape, st.out_shape = key_shape, q_shape, v_shape, out_shape
    st.tq, st.tk = q_shape[-2], key_shape[-2]
    if not same(v_shape[-2], st.tk):
        raise NearMiss("the values' sequence axis does not match the keys'")
    if not (same(st.s_shape[-2], st.tq) and same(st.s_shape[-1], st.tk)):
        raise NearMiss("the scores are broadcast to a larger shape than q @ k^T")
    _shape_readers(st)


def _heads(st: _Partial) -> None:
    """Equal batch/head dims, or key/value heads that ``enable_gqa`` reproduces: one head broadcast to every
    query head, or heads that ``repeat_kv`` (``repeat_interleave``, ``expand``) shares in groups."""
    q_shape, key_shape, v_shape = st.q_shape, st.key_shape, st.v_shape
    st.k_src, st.v_src = st.k, st.v
    if st.views or len(q_shape) > 4:
        # viewed scores: the products broadcast nothing, so q, k and v are brought to the site's layout whole
        lp, lv = shape_of(st.product)[:-2], shape_of(_p_operand(st))[:-2]  # type: ignore[index]
        if st.v_transposed or not (_same_dims(q_shape[:-2], lp) and _same_dims(key_shape[:-2], lp)
                                   and _same_dims(v_shape[:-2], lv)):
            raise NearMiss(f"the scores are viewed (leading axes folded or unfolded) or of rank 5 or more, and "
                           f"batch/head dims of q "
                           f"{list(q_shape[:-2])}, k {list(key_shape[:-2])} and v {list(v_shape[:-2])} are broadcast "
                           "inside a product (or v is transposed); with such views only equal ones are rewritten")
        return
    heads_differ = not all(same(a, b) for a, b in zip(q_shape[:-2], key_shape[:-2])) or \
        not all(same(a, b) for a, b in zip(q_shape[:-2], v_shape[:-2]))
    if heads_differ and len(q_shape) == 4 and same(q_shape[0], key_shape[0]) and same(q_shape[0], v_shape[0]) \
            and same(key_shape[1], 1) and same(v_shape[1], 1):
        st.gqa = True  # one key/value head broadcast against every query head: enable_gqa with Hkv = 1
        st.record.spelling.append("one kv head (broadcast)")
    elif heads_differ:
        raise NearMiss(f"batch/head dims of q {list(q_shape[:-2])}, k {list(key_shape[:-2])} and "
                       f"v {list(v_shape[:-2])} differ (broadcast inside the product)")
    elif len(q_shape) == 4 and st.k is not None and not st.v_transposed:
        (k0, how_k), (v0, how_v) = _kv_source(st.gm, st.k), _kv_source(st.gm, st.v)
        if k0 is not None and v0 is not None and same(shape_of(k0)[1], shape_of(v0)[1]):  # type: ignore[index]
            st.k_src, st.v_src, st.gqa = k0, v0, True
            st.record.spelling.append(how_k if how_k == how_v else f"{how_k}/{how_v}")


def _output_shape(st: _Partial) -> None:
    """The site's output is [..., Tq, Dv], the shape SDPA returns."""
    if not (same(st.out_shape[-2], st.tq) and same(st.out_shape[-1], st.v_shape[-1])):
        raise NearMiss("the output shape is not [..., Tq, Dv]")


def _masks(st: _Partial) -> None:
    """passes/masks.py reads the masks as one SDPA mask; each has no more dims than the scores, and an
    additive one the scores' dtype (or bool/integer, which the sum promotes: :func:`promoted_mask`); an
    ``aten._safe_softmax`` has no row that the mask may hide entirely (:func:`_safe_rows`)."""
    if st.views or len(st.q_shape) > 4:  # rank 5 or 6 (a window or group axis): the site folds leading axes
        _relayouts(st)
    plan = plan_mask(st.masks, st.tq, st.tk, dtype_of(st.scores_in), st.gm, st.concrete)
    if isinstance(plan, str):
        raise NearMiss(plan)
    st.plan = plan
    for t, layout in zip(st.masks, st.mask_layouts):
        m = t.mask if isinstance(t, Add) else t.cond
        ms = shape_of(m)
        if ms is None or len(ms) > len(layout.shape) + 2:
            raise NearMiss("the mask has more dims than the scores")
        if isinstance(t, Add) and dtype_of(m) != dtype_of(st.product) and not promoted_mask(t, dtype_of(st.product)):
            raise NearMiss(f"the additive mask has dtype {dtype_of(m)} but the scores {dtype_of(st.product)}")
    _safe_rows(st)


def _p_operand(st: _Partial) -> fx.Node:
    """The probabilities as ``P @ V`` reads them."""
    op = read(st.pv, st.gm)
    assert op is not None
    return op.args[1] if st.v_transposed else op.args[0]


def _same_dims(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))


def _relayouts(st: _Partial) -> None:
    """Views fold or unfold the scores' leading axes: choose the site's layout and bring every mask term, q, k, v
    (and the output, back) to it. The site's layout is the one a partly broadcast mask was added in (so it is
    not expanded), else the one with the most leading dims up to two (q, k, v as candidates take them, 4-D)."""
    product = Layout.of(st.product, anchor=st.q)
    pv = Layout.of(_p_operand(st), anchor=st.v)
    anchors = [product, pv]
    layouts = [product, *(Layout.of(n).resolved(anchors) for n in st.views), pv]
    st.mask_layouts = [m.resolved(anchors) for m in st.mask_layouts]

    def lead(t: Any) -> tuple[Any, ...]:
        return tuple((shape_of(t.mask if isinstance(t, Add) else t.cond) or ())[:-2])

    def partly(t: Any, layout: Layout) -> bool:
        dims = (1,) * (len(layout.shape) - len(lead(t))) + lead(t)
        return not all(same(x, 1) for x in dims) and not all(same(x, a) or _not_one(x)
                                                             for x, a in zip(dims, layout.shape))

    within = [m for t, m in zip(st.masks, st.mask_layouts) if partly(t, m) and len(m.shape) <= 2]
    fits = [m for m in layouts if len(m.shape) <= 2]
    if not within and not fits:
        # more than two leading dims everywhere (q, k, v of rank 5: timm's Twins/NesT window axis): the site
        # folds all of them but the head axis into one batch axis
        *outer, head = product.shape
        folded = outer[0]
        for d in outer[1:]:
            folded = folded * d
        fits = [Layout((folded, head), (None, product.sizes[-1]))]
    site = within[0] if within else max(fits, key=lambda m: len(m.shape))
    st.masks = [replace(t, relayout=relayout(lead(t), m, site, "the mask"))
                for t, m in zip(st.masks, st.mask_layouts)]
    st.relayouts = (relayout(product.shape, product, site, "q"), relayout(product.shape, product, site, "k"),
                    relayout(pv.shape, pv, site, "v"), relayout(site.shape, site, pv, "the output"))
    st.site_lead = len(site.shape)
    st.record.spelling.append(f"leading axes viewed (site {len(site.shape) + 2}-D)")


def promoted_mask(t: Add, scores_dtype: torch.dtype | None) -> bool:
    """A bool or integer mask added to floating scores of ``scores_dtype``: type promotion converts it to the
    scores' dtype (``True`` is 1, ``False`` 0) and the sum keeps that dtype, so passing ``mask.to(dtype)`` to
    the kernel adds the same values."""
    md = dtype_of(t.mask)
    return md is not None and not md.is_floating_point and not md.is_complex and scores_dtype is not None \
        and scores_dtype.is_floating_point and t.dtype == scores_dtype


def _safe_rows(st: _Partial) -> None:
    """``aten._safe_softmax`` gives zeros for a row whose every score is ``-inf``; the site's policy for such
    rows (NaN, as ``softmax`` gives) holds only where no row can be filled that way."""
    assert st.plan is not None
    if st.sm.mode == "safe" and st.plan.nan_rows:
        raise NearMiss(f"{st.sm.spelling}{_at(st.softmax)} gives zeros for rows whose every key is masked with "
                       f"-inf, and the mask ({st.plan.fill_spelling}) may mask every key of a row; only rewritten "
                       "when no row can be fully masked (no mask, a constant finite one, or a proven top-left "
                       "causal one)")


def _shape_readers(st: _Partial) -> None:
    """A node the site replaces whose shape is read elsewhere (``mask.expand_as(scores)``, ``scores.size(-1)``)
    has a shape the rewrite rebuilds without computing it: static, or provably q's leading dims by Tk."""
    for node in (st.softmax, *st.internal):
        readers = [u for u in node.users if reads_only_shape(u, node)]
        if not readers:
            continue
        shape = shape_of(node)
        if shape is not None and all(type(d) is int for d in shape):
            continue
        q_lead = tuple(st.q_shape[:-1])
        if shape is None or len(shape) != len(q_lead) + 1 or not all(same(a, b) for a, b in zip(shape, q_lead)) \
                or not same(shape[-1], st.tk):
            what = getattr(readers[0].target, "__name__", readers[0].target)
            raise NearMiss(f"`{node.name}` is read by `{what}`{_at(readers[0])} for its shape "
                           f"{list(shape or ())}, which is neither static nor provably q's leading dims by Tk")


def _qk_dtype(st: _Partial) -> None:
    """q and k have one floating dtype, the one the site computes in."""
    q_dtype, k_dtype = dtype_of(st.q), dtype_of(st.k if st.k is not None else st.k_t)
    if q_dtype != k_dtype or q_dtype is None or not q_dtype.is_floating_point:
        raise NearMiss(f"q and k have dtypes {q_dtype} and {k_dtype}")
    st.q_dtype = q_dtype


def _fills(st: _Partial) -> None:
    """A finite fill stays exact: no score modifier before a bounded fill, and a dtype minimum that exists in
    the dtype SDPA adds masks in."""
    plan = st.plan
    assert plan is not None
    if plan.bound_fill is not None and st.score_mod is not None:
        raise NearMiss(f"the mask fills scores with {plan.bound_fill:g} after a score modifier; the bound that makes "
                       "such a finite fill exact does not hold through the modifier")
    if plan.kind == "additive" and plan.bound_fill is None:
        for t in st.masks:
            if isinstance(t, Fill) and t.value != -math.inf and t.dtype != st.q_dtype:
                raise NearMiss(f"the scores are filled with the {t.dtype} minimum but SDPA adds masks in "
                               f"{st.q_dtype}, where that value does not exist")


def _floor_rule(st: _Partial) -> None:
    """A floor at the dtype's minimum (see :func:`_score_floor`) with a plain mask: applied in the dtype the
    scores are computed in (not after an upcast), no finite fill, sink or zeroed rows next to it, and not in
    float16, where a score below -16 next to the minimum overflows to
    ``-inf`` as written (the floor then changes which keys a masked row averages, per call)."""
    if st.score_floor is None:
        return
    assert st.plan is not None
    why = None
    if st.floor_dtype != st.q_dtype:
        why = (f"the floor is applied in {st.floor_dtype}, the scores are computed in {st.q_dtype} (the minimum of "
               "the wider dtype lies below every masked score of the narrower)")
    elif st.q_dtype == torch.float16 or dtype_of(st.scores_in) == torch.float16:
        why = ("in float16 a score below -16 added to the minimum overflows to -inf, so which keys a masked row "
               "averages depends on the scores")
    elif st.plan.bound_fill is not None:
        why = f"the mask also fills a finite value ({st.plan.bound_fill:g})"
    elif st.sink is not None:
        why = "the scores carry an attention sink"
    elif st.zero_cond is not None:
        why = "the probabilities are zeroed again after the softmax"
    elif st.plan.kind == "bool":
        why = "the mask only fills -inf (a row it hides entirely would need the fills' gradients cut as written)"
    if why:
        raise NearMiss(f"the scores are floored at the dtype's minimum and {why}; left as written")


def _zeroed_rows(st: _Partial) -> None:
    """Probabilities zeroed again where the scores were masked (``softmax(s.masked_fill(m, -inf))
    .masked_fill(m, 0)``, FastSpeech2-Conformer, CPM-Ant): the condition is one the scores were filled
    with ``-inf`` or the dtype's minimum at (the same node, or the same expression of the same tensors).
    Such a key already has probability 0 in every row that keeps another key, so only rows where ``m``
    hides every key change: they are zero, and send no gradient, as written."""
    if st.zeroed is None:
        return
    for t in st.masks:
        if isinstance(t, Fill) and not t.keep_when_true and not t.binary and not t.relayout \
                and neg_large(t.value, t.dtype) is not None and _same_expression(t.cond, st.zeroed):
            st.zero_cond = t.cond
            return
    raise NearMiss(f"the probabilities are zeroed by masked_fill(`{st.zeroed.name}`, 0){_at(st.zeroed)} after the "
                   "softmax where the scores were not provably masked (only the scores' own -inf or dtype-minimum "
                   "fill condition is read there)", LEFT_ALONE)


def _same_expression(a: Any, b: Any, depth: int = 6) -> bool:
    """``a`` and ``b`` provably hold the same value: one node, equal constants, or one deterministic function or
    method of provably equal arguments (``m.view(B, 1, T, S) == torch.tensor(False)`` written twice); leaves
    must be the same node and written nowhere."""
    if a is b:
        return not (isinstance(a, fx.Node) and a.op in ("placeholder", "get_attr") and mutated(a))
    if isinstance(a, fx.Node) != isinstance(b, fx.Node) or depth < 0:
        return False
    if not isinstance(a, fx.Node):
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            return len(a) == len(b) and all(_same_expression(x, y, depth) for x, y in zip(a, b))
        return type(a) is type(b) and a == b
    if a.op != b.op or a.op not in ("call_function", "call_method") or a.target != b.target \
            or set(a.kwargs) != set(b.kwargs) or len(a.args) != len(b.args) or mutated(a) or mutated(b):
        return False
    if isinstance(a.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in a.target.tags:
        return False
    if a.target in (torch.rand, torch.randn, torch.randint, torch.rand_like, torch.randn_like, torch.bernoulli) \
            or str(a.target).startswith(("rand", "normal_", "bernoulli", "uniform_", "random_")):
        return False
    return all(_same_expression(x, y, depth - 1) for x, y in zip(a.args, b.args)) and all(
        _same_expression(a.kwargs[k], b.kwargs[k], depth - 1) for k in a.kwargs)


def _sink_rule(st: _Partial) -> None:
    """An attention sink becomes one more key (:func:`attnopt.runtime.sinks.sink_operands`): q is scaled
    before the site, so in half types the scale is a number and a power of two (that product is then exact);
    the sink has q's dtype; no score modifier (it would change the sink's column too), no finite fill, and
    the site's own layout (no views of the scores, ``P @ V`` as written)."""
    if st.sink is None:
        return
    assert st.plan is not None
    why = None
    if st.score_mod is not None:
        why = f"a score modifier ({st.score_mod.describe()}) is applied to the scores"
    elif (st.scale_tensors or st.scale_nodes) and st.q_dtype in (torch.float16, torch.bfloat16):
        why = (f"in {st.q_dtype} the scale is a tensor or a run-time number (q scaled before the site would be "
               "rounded)")
    elif st.scale == 0.0:
        why = "the scale is zero"
    elif st.q_dtype in (torch.float16, torch.bfloat16) and math.frexp(abs(st.scale))[0] != 0.5:
        why = (f"in {st.q_dtype} q scaled before the site would be rounded (the scale {st.scale:g} is no power of "
               "two: head dims 4, 16, 64 and 256 give one)")
    elif dtype_of(st.sink) != st.q_dtype:
        why = f"the sink is {dtype_of(st.sink)} and q, k are {st.q_dtype} (it would be rounded to theirs)"
    elif st.plan.bound_fill is not None:
        why = f"the mask fills a finite value ({st.plan.bound_fill:g})"
    elif st.views or st.v_transposed:
        why = "the scores or probabilities are viewed in another layout, or v is multiplied transposed"
    elif any(st.relayouts):
        why = ("the heads are laid out in more than 4 dims (the site folds their leading axes, which the sink's "
               "logits would have to follow)")
    if why:
        raise NearMiss(f"the attention sink is left as written: {why} (a sink becomes one more key with no score "
                       "modifier, no finite fill, the scores in the layout of q @ k^T and, in half types, a power "
                       "of two as scale)")


def _v_dtype(st: _Partial) -> None:
    """v has a floating dtype."""
    v_dtype = dtype_of(st.v)
    if v_dtype is None or not v_dtype.is_floating_point:
        raise NearMiss(f"v has dtype {v_dtype}")


def _assemble(st: _Partial) -> None:
    """The proven :class:`AttentionSpec` and the :class:`Match` (never refuses)."""
    plan, dropout, record = st.plan, st.dropout, st.record
    assert plan is not None and st.pv is not None
    runtime_p = dropout[1] != "off" and not isinstance(dropout[0], (int, float))
    spec = AttentionSpec(
        scale=float(st.scale), mask=plan.kind, causal=plan.causal, nan_rows=plan.nan_rows,
        dropout_p=float(dropout[0]) if dropout[1] != "off" and not runtime_p else 0.0, dropout_mode=dropout[1],
        runtime_scale=bool(st.scale_nodes), runtime_dropout=runtime_p, min_rows=plan.min_rows,
        gqa=st.gqa, ndim=len(st.q_shape) if st.site_lead is None else st.site_lead + 2,
        compute_dtype=st.q_dtype, out_dtype=dtype_of(st.pv),  # type: ignore
        score_mod=st.score_mod.describe() if st.score_mod is not None else None, fill_value=plan.bound_fill,
        window=plan.window, conditions=len(plan.conditions),
    )
    if st.zero_cond is not None:
        spec = replace(spec, zero_rows=True)
    if st.score_floor is not None:  # no -inf is left in a floored mask: every row has a value, none is NaN
        spec = replace(spec, score_floor=st.score_floor, nan_rows=False)
    if st.sink is not None:  # one more key, never masked: no row is hidden entirely, the mask goes as a tensor
        structural = plan.causal == "top_left" and not plan.guarded and not plan.conditions and plan.window is None
        spec = replace(spec, causal=None, window=None, conditions=0, nan_rows=False, min_rows="none", sink=True,
                       mask="bool" if structural else plan.kind)
    if plan.kind != "none":
        shape = "" if not plan.causal else ", causal" if plan.window is None else f", window {plan.window}"
        record.spelling.append(f"mask({plan.fill_spelling}{shape})")
    st.internal.extend([st.softmax, st.pv] + ([st.sink_scale] if st.sink_scale is not None else []))
    st.match = Match(record=record, softmax=st.softmax, output=st.sink_scale or st.pv, q=st.q, k=st.k_src,
                     k_t=st.k_t if st.k is None else None, v=st.v_src, spec=spec, mask=plan,
                     scale_tensors=st.scale_tensors, scale_nodes=st.scale_nodes,
                     dropout_p=dropout[0] if runtime_p else None, dropout_module=st.dropout_module,
                     internal=st.internal, score_mod=st.score_mod, v_transposed=st.v_transposed,
                     q_relayout=st.relayouts[0], k_relayout=st.relayouts[1], v_relayout=st.relayouts[2],
                     out_relayout=st.relayouts[3], sink=st.sink, zero_rows=st.zero_cond,
                     sink_unsqueeze=st.sink_unsqueeze, sink_nan_rows=st.sink_scale is not None and plan.nan_rows,
                     sink_lse=st.sink_scale is not None)


def _no_write_in_window(st: _Partial) -> None:
    """Nothing the site reads is written in place between its first read and ``P @ V``."""
    assert st.match is not None
    _check_no_write_before_site(st.gm, st.match)


#: The matcher: (name, rule) run in order on one softmax; the first rule that cannot prove its condition
#: refuses the site. To read a new spelling, change the one rule it belongs to.
RULES: tuple[tuple[str, Callable[[_Partial], None]], ...] = (
    ("softmax over the key axis", _softmax_axis),  # shape known, dim = last
    ("probabilities reach P @ V", _forward_to_pv),  # casts, copies, one dropout, then P @ V or v^T @ P^T
    ("scores come from q @ k^T", _back_to_product),  # scales, masks, biases, modifiers, casts back to the product
    ("conversions keep every value", _casts),  # widening casts only, or the HF ``.to(v.dtype)``
    ("scale, score modifier, then masks", _scale_mods_masks),  # the chain read in program order
    ("q, k, v shapes line up", _operand_shapes),  # equal ranks 2-4, one key length, scores not broadcast
    ("heads match or are shared", _heads),  # equal batch/head dims, or enable_gqa's grouping
    ("the output has SDPA's shape", _output_shape),  # [..., Tq, Dv]
    ("masks are planned", _masks),  # passes/masks.py: one SDPA mask, causal or windowed where proven
    ("q and k share a floating dtype", _qk_dtype),  # the compute dtype
    ("fills hold in the compute dtype", _fills),  # finite fills that stay exact
    ("a sink is one more key", _sink_rule),  # a number as scale, no modifier, the site's own layout
    ("zeroed probabilities were masked", _zeroed_rows),  # probs.masked_fill(m, 0) where the scores were hidden
    ("a floor at the dtype's minimum", _floor_rule),  # torch.max(s, finfo.min): no fp16, no finite fill or sink
    ("v is floating", _v_dtype),  # no integer or bool values
    ("assemble the match", _assemble),  # the AttentionSpec and the Match; never refuses
    ("no in-place write inside the site", _no_write_in_window),  # the fused kernel reads what P @ V would
)

#: Refusals per rule name, over every softmax matched since import (``REFUSALS.clear()`` resets them).
REFUSALS: Counter[str] = Counter()


def match_site(gm: fx.GraphModule, softmax: fx.Node, concrete: dict[fx.Node, torch.Tensor],
               index: int) -> Match | SiteRecord:
    """Try to prove that ``softmax`` is an attention site; return a Match or a near-miss record.

    A near miss's record says why (``reason``) and which rule refused (``extra["rule"]``).
    """
    path, source = place_of(softmax)
    record = SiteRecord(name=f"site{index}", module_path=path, source=source)
    try:
        return _match(gm, softmax, concrete, record)
    except NearMiss as e:
        # an attention layer that is not rewritten still counts among the sites ("N of M rewritten"); a softmax
        # of anything but a product of two activations, or whose probabilities reach no product, does not
        attention = feeds_value_product(gm, softmax) and scores_from_activations(gm, softmax)
        record.decision = LEFT_ALONE if attention else NOT_ATTENTION if e.decision == LEFT_ALONE else e.decision
        record.reason = str(e)
        return record


#: Ops between the probabilities and their product with values that keep them the attention's weights (or
#: change them elementwise: ``(p + eps) @ v`` is still an attention layer, left alone).
_ON_THE_WAY = frozenset(("cast", "identity", "view", "dropout", "scale", "masked_fill", "where", "transpose",
                         "permute", "getitem", "add", "sub", "mul", "div", "unary"))


#: Ops that regroup the probabilities into another layout (Longformer's chunked ``F.pad`` and ``as_strided``).
_REGROUPS = frozenset((torch.nn.functional.pad, torch._C._nn.pad, torch.cat, torch.concat, torch.as_strided,
                       torch.narrow, torch.ops.aten.constant_pad_nd.default, torch.ops.aten.as_strided.default,
                       "as_strided", "narrow", "unfold", "expand", "expand_as", "repeat", "repeat_interleave"))


def _regroups(node: fx.Node) -> bool:
    try:
        return node.op in ("call_function", "call_method") and node.target in _REGROUPS
    except TypeError:
        return False


def feeds_value_product(gm: fx.GraphModule, softmax: fx.Node, depth: int = 16) -> bool:
    """``softmax`` is over the last axis and its output reaches a product (``@``, ``bmm``, ``einsum``,
    ``baddbmm``) through casts, views, dropout, fills, slices, regroupings (``F.pad``, ``as_strided``) or
    elementwise arithmetic: with scores from a product of two activations (:func:`scores_from_activations`), an
    attention layer, rewritten or not."""
    sm, shape = read(softmax, gm), shape_of(softmax)
    if sm is None or shape is None or sm.args[1] != len(shape) - 1:
        return False
    frontier = [softmax]
    for _ in range(depth):
        later = []
        for node in frontier:
            for user in node.users:
                if _product_operands(gm, user) is not None:
                    return True
                op = read(user, gm)
                if op is not None and op.kind in _ON_THE_WAY or _regroups(user):
                    later.append(user)
        frontier = later
    return False


#: Ops that project their input with weights (``F.linear``, convolutions, embeddings): scores computed by one are
#: no product of two activations, whatever their input was.
_PROJECTIONS = frozenset(f for f in (
    torch.nn.functional.linear, torch.nn.functional.bilinear, torch.nn.functional.embedding, torch.addmm,
    torch.nn.functional.conv1d, torch.nn.functional.conv2d, torch.nn.functional.conv3d, torch.conv1d, torch.conv2d,
    torch.conv3d, torch.ops.aten.linear.default, torch.ops.aten.addmm.default, torch.ops.aten.embedding.default,
    torch.ops.aten.convolution.default) if f is not None)


def _is_parameter(gm: fx.GraphModule, x: Any, depth: int = 6) -> bool:
    """``x`` is a parameter, or computed from parameters (and constants) alone: ``self.w.t()``, ``self.fn.float()``."""
    if not isinstance(x, fx.Node) or depth < 0:
        return False
    if x.op == "placeholder":
        return isinstance(x.meta.get("example_value", x.meta.get("val")), torch.nn.Parameter)
    if x.op == "get_attr":
        return isinstance(attr_value(gm, str(x.target)), torch.nn.Parameter)
    inputs = x.all_input_nodes
    return x.op in ("call_function", "call_method") and bool(inputs) and all(
        _is_parameter(gm, n, depth - 1) for n in inputs)


def _projects(gm: fx.GraphModule, node: fx.Node) -> bool:
    """``node`` applies weights to its input: a projection (or a call of a module that holds parameters)."""
    if node.op == "call_module":
        try:
            return any(True for _ in gm.get_submodule(str(node.target)).parameters())
        except AttributeError:
            return False
    try:
        return node.op == "call_function" and node.target in _PROJECTIONS
    except TypeError:
        return False


_PRODUCT_TARGETS = frozenset((torch.matmul, torch.bmm, torch.mm, torch.einsum, operator.matmul, "matmul", "bmm",
                              "mm", "__matmul__", torch.ops.aten.bmm.default, torch.ops.aten.mm.default,
                              torch.ops.aten.einsum.default))


def _product_operands(gm: fx.GraphModule, node: fx.Node) -> list[Any] | None:
    """The tensor operands of ``node`` when it is a product (any ``einsum`` layout included), else None."""
    op = read(node, gm)
    if op is not None and op.kind in ("matmul", "baddbmm"):
        return list(op.args[:2] if op.kind == "matmul" else op.args[1:3])
    try:
        if node.op not in ("call_function", "call_method") or node.target not in _PRODUCT_TARGETS:
            return None
    except TypeError:
        return None
    args = node.args[1:] if node.target in (torch.einsum, torch.ops.aten.einsum.default) else node.args
    if len(args) == 1 and isinstance(args[0], (list, tuple)):
        args = args[0]
    return [a for a in args if isinstance(a, fx.Node)]


def scores_from_activations(gm: fx.GraphModule, softmax: fx.Node, depth: int = 32) -> bool:
    """The softmax's input is computed from a product (``@``, ``bmm``, ``einsum``, ``baddbmm``) of two activations,
    neither a parameter: what makes a softmax attention rather than a gate or router over projected features
    (DeepSeek-V4's hyper-connection ``softmax(F.linear(x, fn) * scale + base)``).

    Searches back from the scores through any op but a projection (``F.linear``, a convolution, an embedding, a
    module with parameters, a product with a parameter), never into parameters, ``depth`` steps at most."""
    frontier = [x for x in softmax.all_input_nodes]
    seen: set[fx.Node] = set()
    for _ in range(depth):
        later: list[fx.Node] = []
        for node in frontier:
            if node in seen or node.op in ("placeholder", "get_attr", "output") or _is_parameter(gm, node):
                continue
            seen.add(node)
            operands = _product_operands(gm, node)
            if operands is not None:
                if len(operands) == 2 and not any(_is_parameter(gm, x) for x in operands):
                    return True
                continue  # a product with weights: a projection
            if not _projects(gm, node):
                later.extend(node.all_input_nodes)
        frontier = later
    return False


def _match(gm: fx.GraphModule, softmax: fx.Node, concrete: dict[fx.Node, torch.Tensor],
           record: SiteRecord) -> Match:
    """Run :data:`RULES` in order; a refusal names its rule on the record, in :data:`REFUSALS` and the log."""
    sm = read(softmax, gm)
    assert sm is not None and sm.kind == "softmax"
    record.spelling.append(sm.spelling)
    st = _Partial(gm, softmax, concrete, record, sm, scores_in=sm.args[0])
    for name, rule in RULES:
        try:
            rule(st)
        except NearMiss as e:
            REFUSALS[name] += 1
            record.extra["rule"] = name
            log.debug("%s (%s %s): rule %r refuses: %s", record.name, record.module_path, record.source, name, e)
            raise
    assert st.match is not None
    return st.match


# ----------------------------------------------------------------------------- dtype conversions

def _check_casts(softmax: fx.Node, softmax_dtype: Any, pre: list[fx.Node], post: list[fx.Node],
                 compute: torch.dtype | None, v_dtype: torch.dtype | None) -> None:
    """Only value-preserving conversions are read as transparent.

    Between the product and the softmax (``pre``, and the softmax's own ``dtype=``) a conversion
    must hold every value of its source or of the compute dtype (q's): the same dtype or a wider
    float (``s.float()`` on bfloat16 scores), or back to the compute dtype. On the probabilities
    (``post``) a float conversion may also go to v's dtype, the ``softmax(s.float()).to(q.dtype) @ v``
    pattern: the site computes in the compute dtype and returns the original's output dtype.
    Conversions to integers or bool (fake quantisation, hard attention) and narrowing ones (fp32
    logits rounded to bfloat16, or to float16 where values above 65504 overflow) change values,
    so the site is left as written.
    """
    if compute is None:
        return  # q's dtype is unknown: refused below ("q and k have dtypes ...")
    if v_dtype is not None and v_dtype.is_floating_point and not holds_exactly(compute, v_dtype):
        raise NearMiss(f"v has dtype {v_dtype} but q {compute}: the fused kernel computes in {compute} and would "
                       f"round v (a lossy conversion)")
    steps: list[tuple[str, fx.Node, torch.dtype | None, torch.dtype | None, str]] = [
        ("scores", n, dtype_of(n.args[0]), dtype_of(n), read(n).spelling if read(n) else str(n.target))  # type: ignore
        for n in pre]
    if isinstance(softmax_dtype, torch.dtype):
        steps.append(("scores", softmax, dtype_of(softmax.args[0]), softmax_dtype, "softmax(dtype=...)"))
    steps += [("probabilities", n, dtype_of(n.args[0]), dtype_of(n),
               read(n).spelling if read(n) else str(n.target)) for n in post]  # type: ignore[union-attr]
    for what, node, src, dst, spelling in steps:
        if dst is None or src is None:
            raise NearMiss(f"the {what} pass through a conversion {spelling}{_at(node)} whose dtypes are unknown")
        if not (src.is_floating_point and dst.is_floating_point):
            kind = "integer" if not dst.is_floating_point and dst != torch.bool else "boolean"
            raise NearMiss(f"the {what} are converted to {dst} by {spelling}{_at(node)} (a lossy conversion: "
                           f"{'from ' + str(src) if not src.is_floating_point else kind + ' values'}, "
                           "not the values as computed)")
        if holds_exactly(dst, src) or holds_exactly(dst, compute) or (what == "probabilities" and dst == v_dtype):
            continue  # every value kept (widening, or back to at least the compute dtype), or the HF pattern
        raise NearMiss(f"the {what} are converted to {dst} by {spelling}{_at(node)} (a lossy conversion: "
                       f"{dst} does not hold every {compute} value; the fused kernel computes in {compute})")


# ----------------------------------------------------------------------------- in-place writes

_METADATA_READS = frozenset(("size", "dim", "ndimension", "numel", "stride", "is_contiguous", "get_device",
                             "element_size", "nelement"))


def _reads_values(user: fx.Node) -> bool:
    """``user`` may read its input's values (not only its shape, dtype or device)."""
    if user.op == "call_method" and str(user.target) in _METADATA_READS:
        return False
    if user.op == "call_function":
        name = getattr(user.target, "__name__", "")
        if name in ("sym_size", "sym_stride", "sym_numel", "sym_storage_offset") or user.target in (
                torch.ops.aten.sym_size.int,):
            return False
        if user.target is getattr and len(user.args) > 1 and user.args[1] in ("shape", "dtype", "device", "ndim",
                                                                                  "is_cuda", "requires_grad"):
            return False
    return True


def _site_inputs(m: Match) -> list[tuple[fx.Node, str]]:
    """Every tensor the site reads where ``P @ V`` was, with the role it plays."""
    named: list[tuple[Any, str]] = [(m.q, "q"), (m.k if m.k is not None else m.k_t, "k"), (m.v, "v")]
    for t in m.mask.terms:
        named.append((t.mask, "the added mask") if isinstance(t, Add) else (t.cond, "the mask condition"))
    named += [(n, "a buffer the causal proof read") for n in m.mask.guarded]
    named += [(n, "a mask term the proof assumes") for n, _ in m.mask.conditions]
    named += [(f, "the scale tensor") for f, _ in m.scale_tensors]
    if m.sink is not None:
        named.append((m.sink, "the attention sink"))
    named += [(f, "the run-time scale") for f, _ in m.scale_nodes]
    if m.dropout_p is not None:
        named.append((m.dropout_p, "the dropout probability"))
    out, seen = [], set()
    for node, role in named:
        if isinstance(node, fx.Node) and node not in seen and not isinstance(
                meta_value(node), (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)):
            seen.add(node)
            out.append((node, role))
    return out


def _write_spelling(w: fx.Node) -> str:
    if isinstance(w.kwargs.get("out"), fx.Node):
        return f"`{getattr(w.target, '__name__', w.target)}(..., out=)`"
    if w.op == "call_method":
        return f".{w.target}()"
    if w.op == "call_module":
        return f"module `{w.target}` (inplace=True)"
    if w.kwargs.get("inplace") is True:
        return f"`{getattr(w.target, '__name__', w.target)}(..., inplace=True)`"
    if w.target is operator.setitem:
        return "setitem (`x[...] = ...`)"
    op = read(w)
    return op.spelling if op is not None else str(getattr(w.target, "__name__", w.target))


def _check_no_write_before_site(gm: fx.GraphModule, m: Match) -> None:
    """Refuse a site whose inputs are written between their first read and ``P @ V``.

    The site runs where ``P @ V`` was and reads q, k, v, the masks, added biases and 0-d scale
    tensors there. A write to one of them (or to any tensor sharing its memory: a view, its base,
    another view of the base) after the original computation read it and before ``P @ V`` would
    make the site read the new value, so the site is left as written. Writes before that first
    read are seen by both; writes to the site's own scores are part of the computation.
    """
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    end = order[m.output]
    inputs = _site_inputs(m)
    # The site's own computation: its nodes and what they are computed from, back to q, k, v (behind
    # transposes and repeat_kv), scale tensors and the mask's leaves. An input's first read is its first
    # use there, not a use by another layer that shares it (a mask built once for every layer).
    stop = {x for x, role in inputs if role not in ("the added mask", "the mask condition")}
    region: set[fx.Node] = set()
    pending = [*m.internal, m.output]
    while pending:
        n = pending.pop()
        if n in region:
            continue
        region.add(n)
        if n not in stop:
            pending.extend(n.all_input_nodes)
    firsts: list[tuple[fx.Node, str, int]] = []
    for x, role in inputs:
        reads = [order[u] for u in x.users if u in region and _reads_values(u)]
        if reads and min(reads) < end:  # else read by P @ V itself
            firsts.append((x, role, min(reads)))
    if not firsts:
        return
    start = min(f for _, _, f in firsts)
    # every write in the window, and the tensor it writes (most windows have none: nothing more to do)
    written: dict[fx.Node, list[fx.Node]] = {}
    for w in gm.graph.nodes:
        if start <= order[w] < end and w.op in ("call_function", "call_method", "call_module"):
            for t in w.all_input_nodes:
                if writes(w, t, gm):
                    written.setdefault(t, []).append(w)
    if not written:
        return
    groups: dict[fx.Node, set[fx.Node]] = {}

    def group_of(n: fx.Node) -> set[fx.Node]:
        if n not in groups:
            g = alias_group(n, gm)
            for member in g:
                groups.setdefault(member, g)
        return groups[n]

    def rooted(g: set[fx.Node]) -> bool:
        """The memory may come from outside the graph: a graph input, module state (``get_attr``, or
        dynamo's ``L_self_...`` placeholders)."""
        return any(n.op in ("placeholder", "get_attr") for n in g)

    for x, role, first in firsts:
        name = f"`{role}`" if role in ("q", "k", "v") else role
        group = group_of(x)
        for g in group:
            for w in written.get(g, ()):
                if first <= order[w] < end:
                    via = "" if g is x else f" (through `{g.name}`, which shares its memory)"
                    raise NearMiss(f"{name} is written in place by {_write_spelling(w)}{_at(w)}{via} after the "
                                   "attention reads it and before `P @ V`; the fused kernel would read the new value")
    # Tensors that come from outside the graph may share memory at run time (the caller passed one tensor
    # and a view of it; a buffer is also an argument), which the graph cannot show: a write in the window to
    # one of them may change another input the site reads after the original did.
    for x, role, first in firsts:
        group = group_of(x)
        if not rooted(group):
            continue
        for t, ws in written.items():
            if t in group or not rooted(group_of(t)):
                continue
            for w in ws:
                if first <= order[w] < end:
                    name = f"`{role}`" if role in ("q", "k", "v") else role
                    raise NearMiss(f"`{t.name}` is written in place by {_write_spelling(w)}{_at(w)} after the "
                                   f"attention reads {name} and before `P @ V`; both come from outside the graph, "
                                   "so the written tensor may share memory with the attention's inputs at run time "
                                   "and the fused kernel would read the new value")


def _same_shape(a: Any, b: Any) -> bool:
    """Shapes provably equal (symbolic sizes compared without adding guards)."""
    sa, sb = shape_of(a), shape_of(b)
    return sa is not None and sb is not None and len(sa) == len(sb) and all(same(x, y) for x, y in zip(sa, sb))


def _t_shape(s: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    if s is None or len(s) < 2:
        return s
    return (*s[:-2], s[-1], s[-2])


def _score_floor(op: Op, node: fx.Node, chain: list[tuple[str, Any]]) -> tuple[str | None, fx.Node] | None:
    """``(mode, x)`` when ``node`` floors the scores ``x`` at a constant: ``torch.max(x, full((), finfo.min))``,
    ``maximum``, ``clamp(x, min=c)``, ``clamp_min`` (XGLM; OPT and BioGPT copies). None when ``node`` is no floor.

    Only the last step before the softmax is read (views and casts after it aside), at the scores' dtype
    minimum (``mode``: ``"maximum"`` or ``"clamp"``, whose gradients differ where ``x`` equals the minimum) or at
    ``-inf`` (``mode`` None: no step at all). Why the first is exact: it raises only ``-inf`` entries (a
    ``-inf`` mask, a score that overflowed next to the minimum) to the minimum. In a row that keeps any key
    those carry weight 0 either way; a row where every key is masked is uniform as written, which the site
    reproduces with its mask floored the same way on calls without gradients, and with the floor as spelled on
    the rows it computes as written with gradients (:class:`~attnopt.runtime.site.AttentionSite`). Other floors
    are refused with their value."""
    if op.kind == "floor":
        x, c = op.args
        mode = op.mode
        value = _fill_value(c)
    elif op.kind == "unary" and op.args[1] == "clamp" and op.args[3] is None and dtype_of(node) is not None \
            and dtype_of(node).is_floating_point and op.args[2] == torch.finfo(dtype_of(node)).min:
        x, mode, value = op.args[0], "clamp", op.args[2]  # (other clamps are score modifiers)
    else:
        return None
    dt = dtype_of(node)
    if not isinstance(x, fx.Node) or not _same_shape(x, node) or dtype_of(x) != dt or dt is None \
            or not dt.is_floating_point:
        raise NearMiss(f"the scores are floored by {op.spelling}{_at(node)} with another shape or dtype")
    if value is None:
        raise NearMiss(f"the scores are floored by {op.spelling}{_at(node)} at a value not known at capture")
    stored = _stored(value, dt)
    if stored == -math.inf:
        return None, x
    if stored != torch.finfo(dt).min:
        raise NearMiss(f"the scores are floored at {value:g} by {op.spelling}{_at(node)}: only a floor at the "
                       f"dtype's minimum ({torch.finfo(dt).min:g}) is read")
    if any(kind not in ("view", "cast") for kind, _ in chain):
        raise NearMiss(f"the scores are floored at the dtype's minimum by {op.spelling}{_at(node)} before other "
                       "steps; only a floor right before the softmax is read")
    return mode, x


def _step_back(op: Op, node: fx.Node, chain: list[tuple[str, Any]], record: SiteRecord) -> fx.Node | None:
    """One step from the softmax input towards the product; records the op in ``chain``."""
    k = op.kind
    if k == "scale":
        x, factor, how = op.args
        if not isinstance(x, fx.Node):
            return None
        chain.append(("scale", (factor, how)))
        record.spelling.append(op.spelling)
        return x
    if k in ("mul", "div"):
        # a per-head (per-batch) factor such as a learned temperature of shape [1, H, 1, 1]
        for x, factor in ((op.args[0], op.args[1]), (op.args[1], op.args[0]) if k == "mul" else (None, None)):
            if isinstance(x, fx.Node) and _per_row_block_factor(factor, node) and _same_shape(x, node):
                chain.append(("scale", (factor, k)))
                record.spelling.append(f"{op.spelling} per-head factor")
                return x
        return None
    if k in ("cast", "identity"):
        if k == "cast":
            chain.append(("cast", node))  # checked once the compute dtype is known (_check_casts)
        record.spelling.append(op.spelling)
        return op.args[0]
    if k == "masked_fill":
        x, cond, value = op.args
        v = _fill_value(value)
        if v is None or not isinstance(cond, fx.Node):
            raise NearMiss(f"the masked_fill value `{value}` is not a number known at capture{_why_not_fill(value)}")
        chain.append(("mask", Fill(cond, _stored(v, dtype_of(node)), dtype=dtype_of(node))))
        record.spelling.append(op.spelling)
        return x
    if k == "unary":
        x, name, *params = op.args
        if not isinstance(x, fx.Node):
            return None
        chain.append(("mod", (name, *params)))
        record.spelling.append(op.spelling)
        return x
    if k == "where":
        cond, a, b = op.args
        for s, fill, keep in ((a, b, True), (b, a, False)):
            # the scores' dtype is the result's: a 0-d fill tensor of another category would promote them
            if isinstance(s, fx.Node) and _same_shape(s, node) and dtype_of(s) == dtype_of(node) \
                    and _fill_value(fill) is not None:
                chain.append(("mask", Fill(cond, _stored(_fill_value(fill), dtype_of(node)), keep,  # type: ignore
                                           dtype_of(node))))
                record.spelling.append("where" if not isinstance(fill, fx.Node) else "where(0-d fill)")
                return s
        fill = b if isinstance(a, fx.Node) and _same_shape(a, node) else a
        raise NearMiss(f"torch.where between product and softmax does not fill with a constant{_why_not_fill(fill)}")
    if k == "sub" and isinstance(op.args[0], fx.Node) and _scale_value(op.args[1]) is not None \
            and not isinstance(op.args[1], fx.Node) and _same_shape(op.args[0], node):
        value = -float(op.args[1])
        if not math.isfinite(value):
            raise NearMiss(f"the scores are shifted by {value}")
        if value != 0.0:  # `s - 0` changes no score: no modifier (it would keep SDPA from serving the site)
            chain.append(("mod", ("add", value)))
        record.spelling.append(f"- {-value:g}")
        return op.args[0]
    if k == "sub" and isinstance(op.args[0], fx.Node) and isinstance(op.args[1], fx.Node):
        a, b = op.args
        if not _leads_to_product(a):
            if _leads_to_product(b):
                raise NearMiss("the scores are subtracted from another tensor (`b - s` turns them over)")
            raise NearMiss("a subtraction between product and softmax has no score operand")
        if not _same_shape(a, node):
            raise NearMiss(f"the subtracted tensor `{b.name}` broadcasts the scores to shape "
                           f"{list(shape_of(node) or ())}")
        dt = dtype_of(b)
        if dt is None or not dt.is_floating_point:
            # -b of an integer tensor wraps (-(-2**31) is -2**31, uint8 wraps at 256): left as written
            raise NearMiss(f"a {dt} tensor is subtracted from the scores (only floating masks are rewritten)")
        chain.append(("mask", Add(_as_added_negation(node, a, b), dtype=dtype_of(node))))
        record.spelling.append("- mask")
        return a
    if k == "add":
        a, b = op.args
        for s, c in ((a, b), (b, a)):
            if isinstance(s, fx.Node) and not is_zero_dim_tensor(s) and _scale_value(c) is not None \
                    and not isinstance(c, torch.SymFloat) and _same_shape(s, node):
                value = float(_scale_value(c))  # type: ignore[arg-type]
                if not math.isfinite(value):
                    raise NearMiss(f"the scores are shifted by {value}")
                if value != 0.0:  # `s + 0` (DeBERTa's empty bias) changes no score: no modifier
                    chain.append(("mod", ("add", value)))  # an elementwise step (exact; SDPA cannot take it)
                record.spelling.append(f"+ {value:g}")
                return s
        if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
            raise NearMiss("a constant is added to the scores")
        # The score operand has the result's full shape and leads back to a product.
        for s, m in ((a, b), (b, a)):
            if _same_shape(s, node) and _leads_to_product(s):
                chain.append(("mask", Add(m, dtype=dtype_of(node))))
                record.spelling.append("+ mask")
                return s
        raise NearMiss("an addition between product and softmax has no score operand")
    return None


def _as_added_negation(node: fx.Node, a: fx.Node, b: fx.Node) -> fx.Node:
    """Rewrites ``node`` (``a - b``, ``b`` a floating tensor) in place to ``a + neg(b)`` and returns the new
    ``neg(b)`` node, which the site then reads as an added mask (ALiBi's ``s - slopes * distance``,
    ``s - inf * triu(ones)``).

    The two are the same function bit for bit: IEEE 754 defines ``a - b`` as ``a + (-b)``, negation is exact
    (infinities, NaN and signed zeros included), type promotion sees the same dtypes (``neg`` keeps ``b``'s),
    and the gradients are the same (``-grad`` for ``b``). The graph computes the same values whether the site
    is then rewritten or refused, so nothing is undone on a refusal. Integer ``b`` is never rewritten: its
    negation wraps.
    """
    graph = node.graph
    aten = torch.ops.aten
    on_aten = node.op == "call_function" and isinstance(node.target, (torch._ops.OpOverload,
                                                                       torch._ops.OpOverloadPacket))
    meta: dict[str, Any] = {}
    try:  # the example values first: nothing is changed unless every one of them can be made
        for key in ("val", "example_value"):
            if isinstance(b.meta.get(key), torch.Tensor):
                meta[key] = torch.neg(b.meta[key])
    except Exception as e:  # noqa: BLE001 (a fake tensor of an unusual mode)
        raise NearMiss(f"a tensor is subtracted from the scores and its negation could not be traced ({e})") from e
    if not meta and "tensor_meta" in b.meta:
        meta["tensor_meta"] = b.meta["tensor_meta"]
    with graph.inserting_before(node):
        neg = graph.call_function(aten.neg.default if on_aten else torch.neg, (b,))
    neg.meta.update(meta)
    for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
        if key in node.meta:
            neg.meta[key] = node.meta[key]
    if node.op == "call_method":
        node.target, node.args, node.kwargs = "add", (a, neg), {}
    elif on_aten:
        node.target, node.args, node.kwargs = aten.add.Tensor, (a, neg), {}
    else:
        node.target, node.args, node.kwargs = operator.add, (a, neg), {}
    return neg


def _keep_blend(op: Op, node: fx.Node) -> tuple[fx.Node, fx.Node, float, tuple[fx.Node, ...]] | None:
    """``(scores, m, c, (scores * m, c * (1 - m), 1 - m))`` when the addition ``node`` is ``scores * m + c * (1 - m)``
    (either order of each operand; OpenAI-GPT's ``w * b + -1e4 * (1 - b)``) with a finite number ``c`` and
    no dtype promotion; None otherwise. Where ``m`` is 1 the sum is the score, where it is 0 it is ``c``:
    ``masked_fill(m == 0, c)``, with the same (zero) gradient at the filled positions, as long as ``m`` holds
    only 0 and 1 (the mask proof reads a buffer's values; the rewrite checks the factor on every call)."""
    for product, filler in ((op.args[0], op.args[1]), (op.args[1], op.args[0])):
        pop, fop = read(product), read(filler)
        if pop is None or fop is None or pop.kind != "mul" or fop.kind != "scale" or fop.args[2] != "mul":
            continue
        c = _scale_value(fop.args[1])
        sop = read(fop.args[0])
        if c is None or isinstance(c, torch.SymFloat) or not math.isfinite(c) or sop is None or sop.kind != "sub" \
                or isinstance(sop.args[0], fx.Node) or _scale_value(sop.args[0]) != 1.0:
            continue
        m = sop.args[1]
        for scores, factor in ((pop.args[0], pop.args[1]), (pop.args[1], pop.args[0])):
            if factor is m and isinstance(scores, fx.Node) and isinstance(m, fx.Node) and _same_shape(scores, node) \
                    and dtype_of(scores) == dtype_of(product) == dtype_of(filler) == dtype_of(node) \
                    and len(filler.users) == 1 and len(fop.args[0].users) == 1:
                return scores, m, float(c), (product, filler, fop.args[0])
    return None


def _fill_value(x: Any) -> float | None:
    """The value a ``masked_fill``/``where`` fill stands for: a number known at capture, or a 0-d tensor that
    provably holds one (``torch.full([], finfo.min)``, ``torch.tensor(-1e4)``, ``s.new_full((), -inf)``, not
    written in place, not requiring grad), as its own dtype stores it (it is converted to the scores' dtype
    like a Python number would be). None otherwise: a parameter or input (it may change), a run-time number."""
    value = _scale_value(x)
    if value is not None:
        return None if isinstance(value, torch.SymFloat) else value
    if not (isinstance(x, fx.Node) and is_zero_dim_tensor(x)):
        return None
    op = read(x)
    dt = dtype_of(x)
    if op is None or op.kind != "factory" or dt is None or dt.is_complex \
            or mutated(x) or getattr(meta_value(x), "requires_grad", False) or x.kwargs.get("requires_grad"):
        return None
    fill = op.args[0]
    if isinstance(fill, bool) or not isinstance(fill, (int, float)):
        return None
    try:
        return float(convert_scalar(fill, dt))
    except ValueError:
        return None


def _stored(value: float, dtype: torch.dtype | None) -> float:
    """``value`` as a tensor of floating ``dtype`` stores it, which is what the fill writes: ``-1e9`` is ``-inf``
    in float16, ``finfo(float32).min`` is ``-inf`` in bfloat16 (so they are ``-inf`` fills, not finite ones)."""
    if dtype is None or not dtype.is_floating_point:
        return value
    try:
        return float(convert_scalar(value, dtype))
    except ValueError:
        return value


def _why_not_fill(x: Any) -> str:
    """Why ``x`` is no constant fill, for a tensor (empty for other values)."""
    if not isinstance(x, fx.Node) or meta_value(x) is None or isinstance(meta_value(x), (int, float, bool)):
        return ""
    if isinstance(meta_value(x), (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return (f" (the fill `{x.name}` is a number read at run time: dynamo passes a float attribute such as "
                "`self.fill` as an input once it has seen two values of it, so it may change between calls)")
    if not is_zero_dim_tensor(x):
        return f" (the fill `{x.name}` is a tensor of shape {list(shape_of(x) or ())}, not a 0-d constant)"
    if x.op in ("placeholder", "get_attr"):
        return (f" (the fill `{x.name}` is a 0-d tensor from outside the graph, a parameter, buffer or input: "
                "it may change)")
    if mutated(x):
        return f" (the 0-d fill `{x.name}` is written in place)"
    if getattr(meta_value(x), "requires_grad", False) or x.kwargs.get("requires_grad"):
        return f" (the 0-d fill `{x.name}` requires grad)"
    return ""


def _per_row_block_factor(factor: Any, scores: fx.Node) -> bool:
    """``factor`` is a floating tensor constant over each (query, key) block of ``scores``.

    Its shape has 1 in the last two dims and, aligned right, 1 or the scores' size elsewhere,
    so ``scores * factor`` keeps the scores' shape and equals ``(q * factor) @ k^T``.
    """
    fs, ss = shape_of(factor), shape_of(scores)
    dt = dtype_of(factor)
    if not isinstance(factor, fx.Node) or fs is None or ss is None or len(fs) < 2 or len(fs) > len(ss):
        return False
    if dt is None or dt != dtype_of(scores) or not (same(fs[-1], 1) and same(fs[-2], 1)):
        return False  # (a factor of another dtype would promote the scores)
    return all(same(a, 1) or same(a, b) for a, b in zip(reversed(fs), reversed(ss)))


def _baddbmm_terms(op: Op, chain: list[tuple[str, Any]], record: SiteRecord) -> None:
    """``beta * input + alpha * (q @ kT)`` as chain entries: a scale ``alpha``, then the input as an added mask.

    ``beta=0`` ignores the input (an uninitialised ``torch.empty`` included, NaN too); ``beta=1``
    adds it, unless it is a tensor of zeros.
    """
    inp, _, _, beta, alpha = op.args
    beta_v = _scale_value(beta)
    if beta_v == 1.0:
        fop = read(inp) if isinstance(inp, fx.Node) else None
        if not (fop is not None and fop.kind == "factory" and fop.args[0] == 0 and not mutated(inp)):
            if not isinstance(inp, fx.Node):
                raise NearMiss(f"baddbmm adds the number {inp!r} to the scores")
            chain.append(("mask", Add(inp)))
            record.spelling.append("baddbmm(input=mask)")
        else:
            record.spelling.append("baddbmm(input=zeros)")
    elif beta_v == 0.0:
        record.spelling.append("baddbmm(beta=0)")
    else:
        raise NearMiss(f"baddbmm scales its input by beta={beta}; only beta=0 (input ignored) and beta=1 "
                       "(input added) are rewritten")
    if _scale_value(alpha) != 1.0:
        chain.append(("scale", (alpha, "mul")))


def _scaled_mask(term: Any, c: float, how: str, value: float) -> Any:
    """A mask term as seen after the scores are scaled by ``c`` (``how``/``value`` as written)."""
    if isinstance(term, Add):
        return replace(term, factor=term.factor * c)
    if term.value == -math.inf:
        return term
    dt = term.dtype or torch.float32
    t = torch.tensor(term.value, dtype=dt)
    scaled = (t * value if how == "mul" else t / value).item()
    if neg_large(term.value, dt) == "min" and c > 0 and scaled != -math.inf:
        # The minimum times c <= 1 still hides its keys (weight exp(min * c - max) = 0): keep it the
        # minimum, so rows with every key hidden stay recognisable (uniform, as written).
        return term
    return replace(term, value=scaled)


def _leads_to_product(node: fx.Node, depth: int = 12) -> bool:
    cur: Any = node
    for _ in range(depth):
        op = read(cur)
        if op is None:
            return False
        if op.kind in ("matmul", "baddbmm"):
            return True
        if op.kind in ("scale", "cast", "identity", "masked_fill", "unary", "view", "floor", "sub"):
            cur = op.args[0]  # (``s - b``: the scores are the first operand)
        elif op.kind == "where":
            cur = op.args[1] if isinstance(op.args[1], fx.Node) and _same_shape(op.args[1], cur) \
                else op.args[2]
        elif op.kind in ("add", "mul", "div"):
            # an added bias, a per-head factor (SwinV2's learned logit scale), a 0/1 keep-mask factor
            # (OpenAI-GPT's `w * b`): either operand of the result's shape may carry the scores
            return any(isinstance(x, fx.Node) and (op.kind == "add" or _same_shape(x, cur))
                       and _leads_to_product(x, depth - 1) for x in op.args[:2])
        else:
            return False
    return False


def _kv_source(gm: fx.GraphModule, node: fx.Node) -> tuple[fx.Node | None, str]:
    """The unrepeated key/value tensor behind ``node`` when query head ``h`` provably reads its head ``h // n``.

    That is the head mapping ``enable_gqa`` reproduces: ``repeat_kv`` (unsqueeze, expand, reshape),
    ``repeat_interleave(n, dim=1)``, and ``expand``/``broadcast_to`` of a single head. A tiled
    ``repeat(1, n, 1, 1)`` maps head ``h`` to ``h % Hkv`` and is not matched (the repeated
    tensor is passed as written).
    """
    src = _repeat_kv_source(gm, node)
    if src is not None:
        return src, "repeat_kv"
    out, op = shape_of(node), read(node, gm)
    if op is None or out is None or len(out) != 4 or len(node.users) != 1:
        return None, ""
    x = op.args[0]
    xs = shape_of(x)
    if xs is None or len(xs) != 4 or not (same(xs[0], out[0]) and same(xs[2], out[2]) and same(xs[3], out[3])):
        return None, ""
    if op.kind == "repeat_interleave" and op.args[2] == 1 and isinstance(op.args[1], int) \
            and same(xs[1] * op.args[1], out[1]):
        return x, "repeat_interleave"
    if op.kind == "view" and (node.target in ("expand", "broadcast_to", torch.broadcast_to,
                                              torch.ops.aten.expand.default)) and same(xs[1], 1):
        return x, str(getattr(node.target, "__name__", node.target))
    return None, ""


def _repeat_kv_source(gm: fx.GraphModule, node: fx.Node) -> fx.Node | None:
    """``x[:, :, None].expand(B, Hkv, n, T, D).reshape(B, Hkv * n, T, D)`` -> x, else None.

    Query head ``h`` then reads key/value head ``h // n``, which is what ``enable_gqa`` does.
    """
    out = shape_of(node)
    op = read(node, gm)
    if op is None or op.kind != "view" or out is None or len(out) != 4:
        return None
    expanded = op.args[0]
    es = shape_of(expanded)
    eop = read(expanded, gm)
    if es is None or len(es) != 5 or eop is None or eop.kind != "view" or len(expanded.users) != 1:
        return None
    if not (same(es[0], out[0]) and same(es[3], out[2]) and same(es[4], out[3])
            and same(es[1] * es[2], out[1])):
        return None
    if not (isinstance(expanded.target, str) and expanded.target == "expand"
            or expanded.target is torch.ops.aten.expand.default):
        return None
    inserted = eop.args[0]
    ins = shape_of(inserted)
    if ins is None or len(ins) != 5 or not same(ins[2], 1) or len(inserted.users) != 1:
        return None
    iop = read(inserted, gm)
    if iop is None or iop.kind not in ("view", "getitem"):
        return None
    src = iop.args[0]
    ss = shape_of(src)
    if ss is None or len(ss) != 4:
        return None
    if not (same(ss[0], ins[0]) and same(ss[1], ins[1]) and same(ss[2], ins[3]) and same(ss[3], ins[4])):
        return None
    if iop.kind == "getitem" and not _is_none_at(iop.args[1], 2):
        return None
    if iop.kind == "view" and not (inserted.target in ("unsqueeze", torch.unsqueeze, torch.ops.aten.unsqueeze.default)
                                   and _arg_dim(inserted) == 2):
        return None
    if not (same(es[1], ss[1])):
        return None
    return src


def _arg_dim(node: fx.Node) -> Any:
    d = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    return d + 5 if isinstance(d, int) and d < 0 else d


def _is_none_at(index: Any, pos: int) -> bool:
    if not isinstance(index, tuple):
        return False
    full = [e for e in index]
    if Ellipsis in full:
        i = full.index(Ellipsis)
        full = full[:i] + [slice(None)] * (5 - len(full)) + full[i + 1:]
    if len(full) < pos + 1 or full[pos] is not None:
        return False
    return all((e is None and i == pos) or (isinstance(e, slice) and e == slice(None))
               for i, e in enumerate(full))


def find_sites(gm: fx.GraphModule, concrete: dict[fx.Node, torch.Tensor] | None = None,
               start: int = 0) -> list[Match | SiteRecord]:
    """Every softmax in ``gm``, proven (Match) or not (SiteRecord with a reason)."""
    functionalize_inplace(gm)  # s.div_(c); s.softmax(-1) -> the softmax reads the div_ node
    out: list[Match | SiteRecord] = []
    for node in list(gm.graph.nodes):
        op = read(node, gm)
        if op is not None and op.kind == "softmax":
            out.append(match_site(gm, node, concrete or {}, start + len(out)))
    return out


__all__ = ["REFUSALS", "RULES", "Layout", "Match", "NearMiss", "SizeOf", "feeds_value_product", "find_sites",
           "fold_view", "match_site", "promoted_mask", "reads_only_shape", "relayout",
           "scores_from_activations"]
