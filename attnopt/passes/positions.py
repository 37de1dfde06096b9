"""Position analysis: prove that a language model's graph can run on new tokens with a KV cache.

Matches an ATen graph captured with a symbolic sequence length ``T`` (``torch.export`` with a
dynamic dim) in which every causal self-attention site has already been replaced by a
``call_module`` site node ``(q, k, v, ...)``. It emits a :class:`PositionPlan`: the nodes that
read positions ``0..T-1`` (``arange(T)``, ``table[:T]``), which the cached model shifts by the
number of cached tokens, and the position tables that bound the usable length. Anything that
could make position ``i`` of the output depend on other positions, or on ``T`` itself, raises a
:class:`PositionError` that names the op and its source line.

Every node gets one :class:`Kind`, a forward dataflow in graph order:

* ``const``: parameters, buffers and what is computed from them alone, with no time axis (a constant
  expanded to ``T`` rows is a ``position`` value: its sum over time is ``T`` times the row);
* ``position``: values that depend on positions only (``arange(T)``, ``wpe(arange(T))``,
  rotary tables ``cos[:T]``, run-time causal masks), never on tokens;
* ``token``: values that depend on the tokens; each has exactly one *time axis* (the dim whose
  size is the symbol ``T``) and row ``i`` of it depends on tokens and positions at ``i`` only;
* ``shape``: symbolic integers (``sym_size``), allowed only as sizes.

Time axes are read from the symbolic shapes in ``node.meta["val"]``, never from names. The op
rules (a table, :data:`_RULES`) accept an op only when it acts on each time slice separately:
pointwise ops (``torch.Tag.pointwise``) whose broadcast keeps time axes aligned, layout ops,
reshapes that keep the elements before the time axis before it (a view that folds batch and time into
rows, ``(B, T, C) -> (B*T, C)`` as GPT-2's ``Conv1D`` does, is followed through row-wise ops, :func:`_folded`,
until a view unfolds it), products and norms that contract or reduce
other axes, ``embedding``/``index``/``index_select`` by position or token indices (the result takes
the index's kind and time axis, so a bag of all tokens reduced over time is refused), splits and
reductions over other axes. A rule that returns a weaker kind than one of the operands it reads
(an index it does not follow) is refused. The site nodes are the only sequence mixers allowed:
q, k and v carry their time axis at dim -2. Unknown ops on const values are fine (they cannot depend on positions);
unknown ops on anything else are refused, so a missing rule costs a refusal, never a wrong
cache. Example::

    plan = analyse_positions(gm, tokens, sites)      # nanoGPT
    plan.shifted    # [arange]                 -> arange(offset, offset + t)
    plan.bounds     # [("the position table read by aten.embedding at models.py:111", 256)]

and a causal convolution over time is refused with
``aten.conv1d at model.py:12 (mix.conv) is not known to act on each position separately``.
"""

from __future__ import annotations

import math
import operator
import os
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch.fx.operator_schemas import normalize_function

from ..spec import PositionError, Refusal
from .canon import meta_value, mutated, returns_fresh, shape_of
from .find_sites import place_of
from .masks import same

aten = torch.ops.aten

CONST, POSITION, TOKEN, SHAPE = "const", "position", "token", "shape"
_ORDER = {SHAPE: 0, CONST: 0, POSITION: 1, TOKEN: 2}
_FULL = 2**63 - 1  # the end ``x[a:]`` records


class _Refuse(Refusal):
    """An op the position analysis refuses; ``str(e)`` says why, the caller names the op and line."""


@dataclass(frozen=True)
class Refused:
    """A poisoned value: the first node that made the graph unsafe to cache, and why."""

    node: fx.Node
    reason: str


@dataclass
class PositionPlan:
    """What the cached model must change: the position readers to shift, and the length bounds."""

    seq: sympy.Expr
    shifted: list[fx.Node] = field(default_factory=list)  # arange(0, T) and x[..., 0:T] of const tables
    bounds: list[tuple[str, int]] = field(default_factory=list)  # (what, rows): positions must stay below rows
    kinds: dict[fx.Node, str] = field(default_factory=dict)

    @property
    def max_positions(self) -> int | None:
        return min((rows for _, rows in self.bounds), default=None)


# ----------------------------------------------------------------------------- helpers


def _expr(x: Any) -> Any:
    if isinstance(x, fx.Node):
        x = meta_value(x)
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return x.node.expr  # a SymFloat (``1.0 / T``, ``T ** 0.5``) or SymBool (``T > 3``) is the length too
    return x


def _involves(x: Any, seq: sympy.Expr) -> bool:
    e = _expr(x)
    return isinstance(e, sympy.Basic) and seq in e.free_symbols


def _computed_from_length(x: Any, seq: sympy.Expr) -> bool:
    """``x`` is a node with no recorded value (a number the rewrite computes, ``operator.truediv(0.35, T)``: a
    site's run-time scale) whose inputs, followed through such nodes, involve the length."""
    todo, seen = [x], set()
    while todo:
        n = todo.pop()
        if not isinstance(n, fx.Node) or n in seen:
            continue
        seen.add(n)
        if n is not x and _involves(n, seq):
            return True
        if meta_value(n) is None:
            todo.extend(n.all_input_nodes)
    return False


def _is_seq(x: Any, seq: sympy.Expr) -> bool:
    return _expr(x) == seq


def _flat(a: Any) -> list[Any]:
    if isinstance(a, (list, tuple)):
        return [y for x in a for y in _flat(x)]
    if isinstance(a, dict):
        return [y for x in a.values() for y in _flat(x)]
    return [a]


def _name(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return f"aten.{t.__name__.split('.')[0]}"
    return getattr(t, "__name__", str(t))


def describe(node: fx.Node) -> str:
    """``aten.cumsum at model.py:12 (h.0.mix)``: the op and the user code that produced it.

    The line is the innermost frame of the node's ``stack_trace`` outside PyTorch itself (an
    ``nn.Conv1d`` is named where the model calls it, not inside ``torch/nn``).
    """
    path, source = place_of(node)
    for fname, lineno in reversed(_TRACE_LINE.findall(node.meta.get("stack_trace") or "")):
        if not os.path.abspath(fname).startswith(_TORCH_DIR):
            source = f"{os.path.basename(fname)}:{lineno}"
            break
    at = f" at {source}" if source else ""
    return f"{_name(node)}{at}" + (f" ({path})" if path else "")


_TRACE_LINE = re.compile(r'File "([^"]+)", line (\d+)')
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


class _Analysis:
    def __init__(self, gm: fx.GraphModule, tokens: fx.Node, sites: Collection[fx.Node],
                 notes: Mapping[fx.Node, str] | None = None):
        shape = shape_of(tokens)
        if shape is None or len(shape) != 2 or not isinstance(shape[1], torch.SymInt):
            raise PositionError(
                "the captured graph has no symbolic sequence length (the tokens' dim 1 was specialised to "
                f"{shape[1] if shape else '?'}); the model must accept any length up to its maximum")
        self.gm = gm
        self.seq = shape[1].node.expr
        self.sites = set(sites)
        self.notes = dict(notes or {})
        self.plan = PositionPlan(self.seq)
        self.kinds: dict[fx.Node, str | Refused] = {tokens: TOKEN}
        #: token values whose time axis is folded with others into one axis: (axis, a, c), its size a * T * c
        self.folds: dict[fx.Node, tuple[int, sympy.Expr, sympy.Expr]] = {}
        #: values of a mixture of experts' dispatch: rows in the order a sort chose, and what else it uses
        self.sorted: dict[fx.Node, _Sorted] = {}
        self.sort_info: dict[fx.Node, _SortInfo] = {}

    # -- per-node facts
    def axes(self, x: Any) -> tuple[int, ...]:
        s = shape_of(x)
        return tuple(i for i, d in enumerate(s) if _is_seq(d, self.seq)) if s is not None else ()

    def stretched(self, x: Any) -> bool:
        """``x`` has an axis whose size is computed from the sequence length but is not it (``B * T``)."""
        return any(_involves(d, self.seq) and not _is_seq(d, self.seq) for d in shape_of(x) or ())

    def kind(self, x: Any) -> str:
        if isinstance(x, fx.Node):
            k = self.kinds[x]
            assert isinstance(k, str)
            return k
        if isinstance(x, torch.Tensor):
            return CONST
        return SHAPE

    def sized(self, sizes: Any, what: str) -> None:
        """Sizes may name the sequence length only as exactly ``T`` (a whole time axis)."""
        for s in _flat(sizes):
            if _involves(s, self.seq) and not _is_seq(s, self.seq):
                raise _Refuse(f"{what} has a size computed from the sequence length ({_expr(s)}), so it would "
                              "differ between the full sequence and the new tokens")

    def no_length(self, values: Any) -> None:
        for s in _flat(values):
            if _involves(s, self.seq) or _computed_from_length(s, self.seq):
                shown = _expr(s) if _involves(s, self.seq) else f"in `{s.name}`"
                raise _Refuse(f"uses the sequence length ({shown}) as a value, so its result depends on how "
                              "many tokens are processed at once")

    # -- the walk
    def run(self) -> PositionPlan:
        for node in self.gm.graph.nodes:
            if node in self.kinds:
                continue
            self.kinds[node] = kind = self.visit(node)
            if isinstance(kind, Refused) and _writes_in_place(node):
                # a write is read through the tensor it writes, not through its own node (often unused):
                # a refused value written in place reaches the output unseen, so it refuses the graph here
                note = self.notes.get(kind.node)
                raise PositionError(f"{describe(kind.node)} {kind.reason}" + (f"; {note}" if note else ""))
            if _writes_in_place(node):
                self.written(node)
        self.plan.kinds = {n: k for n, k in self.kinds.items() if isinstance(k, str)}
        return self.plan

    def visit(self, node: fx.Node) -> str | Refused:
        if node.op == "placeholder":
            return SHAPE if not isinstance(meta_value(node), torch.Tensor) else CONST
        if node.op == "get_attr":
            return CONST
        if node.op == "output":
            return self.output(node)
        for inp in node.all_input_nodes:
            k = self.kinds[inp]
            if isinstance(k, Refused):
                return k
        try:
            if node.op == "call_module" and node in self.sites:
                kind = self.site(node)
            elif node.op == "call_function":
                kind = self.function(node)
            else:
                raise _Refuse("is not known to act on each position separately")
            if kind == CONST and isinstance(meta_value(node), torch.Tensor) and self.axes(node):
                kind = POSITION  # a time axis is T rows, however they are filled: never free of the length
            if node in self.sorted:
                return kind  # rows of a dispatch: their own rules keep them apart from the positions
            if node not in self.folds and isinstance(meta_value(node), torch.Tensor) and self.stretched(node):
                raise _Refuse("has an axis whose size is computed from the sequence length "
                              f"({list(shape_of(node) or [])}), which attnopt does not follow here")
            if kind == TOKEN and isinstance(meta_value(node), torch.Tensor) and node not in self.folds \
                    and len(self.axes(node)) != 1:
                n = len(self.axes(node))
                raise _Refuse("mixes positions: its result has " + ("no sequence axis left" if n == 0 else
                                                                     f"{n} sequence axes"))
            return kind
        except _Refuse as e:
            return Refused(node, str(e))

    def output(self, node: fx.Node) -> str:
        outs = _flat(node.args)
        for o in outs:
            if isinstance(o, fx.Node) and isinstance(self.kinds[o], Refused):
                r = self.kinds[o]
                assert isinstance(r, Refused)
                note = self.notes.get(r.node)
                raise PositionError(f"{describe(r.node)} {r.reason}" + (f"; {note}" if note else ""))
        for o in outs:
            if isinstance(o, fx.Node) and (self.kinds[o] != TOKEN or self.axes(o) != (1,)):
                raise PositionError(f"the model's output `{o.name}` with shape {list(shape_of(o) or [])} is not "
                                    "one row per position (B, T, ...) computed from the tokens")
        return TOKEN

    def site(self, node: fx.Node) -> str:
        q, k, v = node.args[:3]
        self.no_length(node.args[3:])
        for name, x in (("q", q), ("k", k), ("v", v)):
            s = shape_of(x)
            if s is None or self.axes(x) != (len(s) - 2,):
                raise _Refuse(f"attention {name} has no sequence axis at dim -2 (shape {list(s or [])}), so it is "
                              "not self-attention over the sequence")
        read = [q, k, v]
        sink = node.kwargs.get("sink")
        if isinstance(sink, fx.Node):  # an attention sink's logits: one per query row, at q's rows or broadcast
            s = shape_of(sink)
            if s is None or self.axes(sink) not in ((), (len(s) - 2,)) or self.stretched(sink) or sink in self.folds:
                raise _Refuse(f"has attention-sink logits of shape {list(s or [])} that are not one per query row")
            read.append(sink)
        bias = node.kwargs.get("key_bias")
        if isinstance(bias, fx.Node):  # a term per key (ALiBi): one per position along its last axis, as k's keys
            s = shape_of(bias)
            if s is None or len(s) < 2 or s[-2] != 1 or self.axes(bias) != (len(s) - 1,) or self.stretched(bias) \
                    or bias in self.folds or len(shape_of(q) or ()) != 4:
                raise _Refuse(f"adds a term of shape {list(s or [])} to the scores that is not one value per key "
                              "computed from that key's position alone (the cache keeps such a term, ALiBi's, with "
                              "the key)")
            read.append(bias)
        return max((self.kind(x) for x in read), key=_ORDER.__getitem__)

    def function(self, node: fx.Node) -> str:
        target = node.target
        inputs = node.all_input_nodes
        if not isinstance(target, torch._ops.OpOverload):
            if all(self.kind(i) == SHAPE for i in inputs) and not isinstance(meta_value(node), torch.Tensor):
                return SHAPE  # arithmetic on sizes: operator.mul(s0, 4), sym_float, ...
            if target is operator.getitem:
                self.item(node)
                return self.kind(node.args[0])
            raise _Refuse("is not known to act on each position separately")
        if "scaled_dot_product" in target.overloadpacket.__name__:
            raise _Refuse("calls scaled_dot_product_attention itself: the cache serves the hand-written attention "
                          "attnopt rewrites (a Hugging Face model: load it with attn_implementation=\"eager\"; "
                          "or use the model's own cache with attnopt.optimize(model))")
        if torch.Tag.nondeterministic_seeded in target.tags and not _is_inactive_dropout(node):
            raise _Refuse("is random (dropout active? call model.eval() before generating)")
        tensor_kinds = [self.kind(i) for i in inputs if self.kind(i) != SHAPE]
        if all(k == CONST for k in tensor_kinds) and not self.axes(node) and not any(self.axes(i) for i in inputs) \
                and not any(_involves(a, self.seq) for a in _flat(node.args) + _flat(node.kwargs)):
            return CONST  # computed from parameters and buffers alone, with no sequence axis
        packet = target.overloadpacket
        if packet in _METADATA:
            return SHAPE  # sizes and checks on them, never tensor values
        if packet is aten.squeeze:
            self.squeezed(node)
        written = _written_view(node)
        if written is not None and not _private_view(node, written):
            fresh = self.filled_slice(node, written)
            if fresh is not None:
                return fresh
            # the tensor it views is read elsewhere through its own node, which this write does not reach
            raise _Refuse(f"writes in place into a view of another tensor (`{written.name}`), which the position "
                          "proof does not follow")
        rule = _pointwise if _is_pointwise(target) else _RULES.get(packet)
        if packet not in _RESHAPES and any(i in self.folds for i in inputs):
            rule = _folded  # batch and time folded into one axis: only row-wise ops
        if any(i in self.sorted for i in inputs):
            if _is_grouped_mm(target):
                return _dispatch_grouped(self, node, _DISPATCH_REFUSAL)
            rule = _dispatch  # rows sorted by a key: only what the dispatch's own rules follow
        if rule is None:
            raise _Refuse("is not known to act on each position separately")
        kw = normalize_function(target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
        if kw is None:
            raise _Refuse("has arguments attnopt cannot read")
        kind = rule(self, node, kw.kwargs)
        # A rule names the operands whose values it reads; one that returns less than an operand's kind has
        # dropped that operand (an index, a start) unless the op reads only its shape or dtype.
        read = [x for name, x in kw.kwargs.items() if name not in _SHAPE_ONLY.get(packet, ())]
        weakest = self.strongest(read)
        if _ORDER[kind] < _ORDER[weakest]:
            raise _Refuse(f"reads a {weakest}-valued operand that attnopt's rule for it does not follow")
        return kind

    def written(self, node: fx.Node) -> None:
        """An in-place write is read through the tensor it writes: that tensor's later readers (in graph order,
        which is the walk's) see what the write made of it, ``zeros_like(x).scatter_(1, idx, 1)`` a token value
        (DeepSeek's group mask). A view of it taken before the write would be read under its old kind: refused."""
        written = _written_args(node)
        base = written[0] if len(written) == 1 else None
        if base is None or not isinstance(self.kinds.get(base), str) or _written_view(node) is not None:
            return  # writes into views: refused or followed by filled_slice
        kind = self.kinds[node]
        assert isinstance(kind, str)
        before = (self.kinds[base], self.folds.get(base), self.sorted.get(base))
        after = (max((before[0], kind), key=_ORDER.__getitem__), self.folds.get(node), self.sorted.get(node))
        if before == after:
            return
        order = self._order()
        if any(order[u] < order[node] and _returns_alias(u) for u in base.users):
            raise PositionError(f"{describe(node)} writes in place into a tensor that a view taken before it reads "
                                "(`" + base.name + "`); the position proof does not follow such a view")
        self.kinds[base] = after[0]
        for facts, fact in ((self.folds, after[1]), (self.sorted, after[2])):
            if fact is None:
                facts.pop(base, None)  # type: ignore[attr-defined]
            else:
                facts[base] = fact  # type: ignore[index]

    def squeezed(self, node: fx.Node) -> None:
        """``squeeze`` drops an axis only where it has size 1: an axis whose size is symbolic (the batch, the
        sequence, rows folded from them) was kept where export traced it (sizes of at least 2), yet goes at
        batch 1 or with one new token, and the ops after it then act on other axes."""
        x = node.args[0]
        shape = shape_of(x) or ()
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", node.kwargs.get("dims"))
        if dims is None:
            dims = list(range(len(shape)))
        dims = dims if isinstance(dims, (list, tuple)) else [dims]
        for d in dims:
            size = shape[_dim(d, len(shape))] if shape else 1
            if not isinstance(size, int):
                what = "the sequence axis" if _is_seq(size, self.seq) else "an axis whose size is not fixed"
                raise _Refuse(f"squeezes {what} ({_expr(size)}), which has size 1 at batch 1 or with one new token "
                              "and would go there; squeeze only axes of a fixed size 1 (x.squeeze(-1))")

    def item(self, node: fx.Node) -> None:
        """``getitem`` of a tuple (``topk``, ``chunk``, ``sort``): each item keeps the fold or the dispatch role."""
        src, i = node.args[0], node.args[1]
        if src in self.folds and isinstance(meta_value(node), torch.Tensor):
            self.folds[node] = self.folds[src]  # type: ignore[index]
        r = self.sorted.get(src)  # type: ignore[arg-type]
        if r is None:
            return
        if r.role == "sort":
            self.sorted[node] = _Sorted(r.sort, "keys" if i == 0 else "index")
        elif r.role == "sort_of_index":
            if i != 1:
                raise _Refuse("reads the sorted permutation of a mixture of experts' dispatch")
            self.sorted[node] = _Sorted(r.sort, "inverse")
        else:
            self.sorted[node] = r

    def filled_slice(self, node: fx.Node, view: fx.Node) -> str | None:
        """``out[..., :a].copy_(x)`` into a tensor made empty in forward (``new_empty``, ``zeros``: DeepSeek's and
        MiniCPM3's keys put together from two parts): the slices cut other axes than time, so ``x``'s time slice
        ``i`` lands in ``out``'s time slice ``i``, and ``out`` (read through its own node after the writes) takes
        the strongest kind written into it. The kind of the copy, or None for any other write into a view."""
        if node.target is not aten.copy_.default or len(node.args) < 2 or not isinstance(node.args[1], fx.Node):
            return None
        src, base = node.args[1], view
        while base.op == "call_function" and base.target is aten.slice.Tensor:
            kw = normalize_function(base.target, base.args, base.kwargs, normalize_to_only_use_kwargs=True)
            x = kw.kwargs["input"] if kw is not None else None
            if not isinstance(x, fx.Node) or _dim(kw.kwargs.get("dim", 0), len(shape_of(x) or ())) in self.axes(x):
                return None  # a slice of the time axis: positions move
            base = x
        if base is view or base.op != "call_function" or base.target not in _FRESH or mutated(src) \
                or src in self.folds or base in self.folds or self.stretched(src):
            return None
        # a view of it taken before this write and read after would read the write under its old kind: every
        # earlier user must be a slice only written into (the write chains themselves)
        order = self._order()
        if any(order[u] < order[node] and not _only_written(u) for u in base.users):
            return None
        out, rank = self.axes(view), len(shape_of(view) or ())
        shift = rank - len(shape_of(src) or ())
        if self.axes(view) != self.axes(base) or any(i + shift not in out for i in self.axes(src)):
            return None  # the written value's time axis must land on the view's, and the view's on the tensor's
        kind = max((self.kind(base), self.kind(src)), key=_ORDER.__getitem__)
        self.kinds[base] = kind  # its readers (after this write) read what was written
        return kind

    def _order(self) -> dict[fx.Node, int]:
        if not hasattr(self, "_positions_in_graph"):
            self._positions_in_graph = {n: i for i, n in enumerate(self.gm.graph.nodes)}
        return self._positions_in_graph

    def strongest(self, xs: Any) -> str:
        kinds = [self.kind(x) for x in _flat(xs) if isinstance(x, fx.Node) and self.kind(x) != SHAPE]
        return max(kinds, key=_ORDER.__getitem__, default=CONST)


#: Tensors made in forward whose values only later writes give: slices written into them are followed.
_FRESH = {aten.empty.memory_format, aten.new_empty.default, aten.zeros.default, aten.new_zeros.default,
          aten.empty_like.default, aten.zeros_like.default}


def _only_written(node: fx.Node) -> bool:
    """``node`` is a slice whose users (through further slices) only ``copy_`` into it."""
    if node.op != "call_function" or node.target is not aten.slice.Tensor:
        return False
    # a copy_'s own result aliases what it wrote into: read later, it would read the write under an old kind
    return all(u.target is aten.copy_.default and u.args[0] is node and not u.users or _only_written(u)
               for u in node.users)


def _writes_in_place(node: fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
        and node.target._schema.is_mutable


def _written_args(node: fx.Node) -> list[fx.Node]:
    """The nodes an in-place ATen op writes: its ``Tensor(a!)`` arguments, ``out=`` included."""
    schema = node.target._schema  # type: ignore[union-attr]
    given = [*zip(schema.arguments, node.args),
             *((a, node.kwargs[a.name]) for a in schema.arguments if a.name in node.kwargs)]
    return [y for arg, value in given if arg.alias_info is not None and arg.alias_info.is_write
            for y in _flat(value) if isinstance(y, fx.Node)]


def _returns_alias(node: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" \
        and isinstance(node.target, torch._ops.OpOverload) \
        and any(r.alias_info is not None for r in node.target._schema.returns)


def _private_view(node: fx.Node, view: fx.Node) -> bool:
    """``node`` writes into ``view``, a view that nothing else reads, of a tensor made in forward that nothing
    else reads either (``out = bmm(w, x).squeeze(-1); out.add_(bias)``: HF's batched experts): the write is seen
    only through ``node`` itself, so it is read as the op it computes, out of place."""
    if set(view.users) != {node}:
        return False
    cur = view
    while _returns_alias(cur):
        cur = cur.args[0]
        if not isinstance(cur, fx.Node) or len(cur.users) != 1:
            return False
    # a view whose schema does not say so (einsum, ``_unsafe_view``) would carry the write to its input
    return cur.op == "call_function" and returns_fresh(cur.target) and not cur.target._schema.is_mutable


def _written_view(node: fx.Node) -> fx.Node | None:
    """The argument an in-place ATen op writes when it is a view of another tensor (``x[:, :].mul_(m)``)."""
    schema = node.target._schema  # type: ignore[union-attr]
    if not schema.is_mutable:
        return None
    given = [*zip(schema.arguments, node.args),
             *((a, node.kwargs[a.name]) for a in schema.arguments if a.name in node.kwargs)]  # ``out=`` included
    for arg, value in given:
        if arg.alias_info is not None and arg.alias_info.is_write and _returns_alias(value):
            return value
    return None


def _is_inactive_dropout(node: fx.Node) -> bool:
    if node.target is not aten.dropout.default:
        return False
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p")
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train")
    return train is False or p == 0


#: elementwise ops that PyTorch does not tag ``pointwise``: ``a | b`` of masks (Gemma 4), ``torch.polar`` of
#: rotary angles (DeepSeek V2)
_UNTAGGED_POINTWISE = {aten.__or__, aten.__and__, aten.polar}
#: ``torch.where(m, scalar, x)`` (Gemma 4's padding of placeholder ids); not ``where(m)``, which is ``nonzero``
_SCALAR_WHERE = {aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar}


def _is_pointwise(target: Any) -> bool:
    return torch.Tag.pointwise in target.tags or target.overloadpacket in _UNTAGGED_POINTWISE \
        or target in _SCALAR_WHERE


def _dim(d: Any, nd: int) -> int:
    if not isinstance(d, int):
        raise _Refuse(f"has a dimension {d!r} that is not a number known at capture")
    return d + nd if d < 0 else d


# ----------------------------------------------------------------------------- rules


def _pointwise(a: _Analysis, node: fx.Node, kw: dict[str, Any]) -> str:
    """Elementwise ops: every input's time axis lands, right-aligned, on a time axis of the result."""
    out = a.axes(node)
    rank = len(shape_of(node) or ())
    tensors = [x for x in _flat(kw) if isinstance(x, fx.Node) and a.kind(x) != SHAPE]
    a.no_length([x for x in _flat(kw) if not (isinstance(x, fx.Node) and a.kind(x) != SHAPE)])
    for x in tensors:
        shift = rank - len(shape_of(x) or ())
        if any(i + shift not in out for i in a.axes(x)):
            raise _Refuse("broadcasts a sequence axis onto another axis")
    return a.strongest(tensors)


def _same_layout(a: _Analysis, node: fx.Node, kw: dict[str, Any]) -> str:
    """Data movement that keeps every element's position: transpose, permute, casts, copies."""
    x = kw.get("self", kw.get("input"))
    a.no_length({k: v for k, v in kw.items() if k not in ("self", "input", "size")})
    a.sized(kw.get("size", ()), "the expanded tensor")
    src = a.axes(x)
    if len(a.axes(node)) < len(src):
        raise _Refuse("drops or merges a sequence axis")
    if len(a.axes(node)) > len(src) and a.kind(x) == TOKEN:
        raise _Refuse("repeats a token tensor along the sequence")
    return a.kind(x)


def _repeat(a: _Analysis, node: fx.Node, kw: dict[str, Any]) -> str:
    """``x.repeat(*counts)`` tiles whole copies of ``x`` (leading counts add dims): a count of 1 on each time
    axis keeps every time slice where it was (BLOOM's ALiBi table repeated per batch row)."""
    x, counts = kw["input"], list(kw["repeats"])
    a.no_length(counts)
    lead = len(counts) - len(shape_of(x) or ())
    if any(counts[lead + i] != 1 for i in a.axes(x)):
        raise _Refuse("repeats along the sequence axis")
    return a.kind(x)


def _repeat_interleave(a: _Analysis, node: fx.Node, kw: dict[str, Any]) -> str:
    """``x.repeat_interleave(r, dim)`` repeats each element along ``dim`` in place: position-wise when ``dim``
    is not a time axis and the counts are fixed (rotary tables interleaved per pair: GPT-J, CodeGen, Cohere)."""
    x = kw.get("input")
    if x is None:  # repeat_interleave(counts): indices built from counts computed from the sequence
        raise _Refuse("builds indices from repeat counts computed from the sequence")
    counts = kw["repeats"]
    if isinstance(counts, fx.Node) and a.kind(counts) != CONST:
        raise _Refuse("repeats by counts computed from the sequence")
    a.no_length([counts, kw.get("output_size")])
    if kw.get("dim") is None:
        if a.axes(x) or a.stretched(x):
            raise _Refuse("repeats the elements of a flattened tensor that has a sequence axis")
        return a.kind(x)
    if _dim(kw["dim"], len(shape_of(x) or ())) in a.axes(x):
        raise _Refuse(f"repeats along the sequence axis (dim {kw['dim']})")
    return a.kind(x)


#: ops that make a tensor of ones (``full`` with a fill of 1), and the casts and copies that keep it ones
_ONES = {aten.ones.default, aten.ones_like.default, aten.new_ones.default}
_FULLS = {aten.full.default, aten.full_like.default, aten.new_full.default}
_KEEPS_ONES = {aten._to_copy.default, aten.to.dtype, aten.clone.default, aten.contiguous.default,
               aten.alias.default, aten.lift_fresh_copy.default, aten.detach.default}


def _all_ones(x: Any) -> bool:
    """``x`` is made by ``ones`` (or ``full(..., 1)``) and only cast or copied since: every value is 1."""
    chain = []
    while isinstance(x, fx.Node) and x.op == "call_function" and x.target in _KEEPS_ONES:
        chain.append(x)
        x = x.args[0]
    chain.append(x)
    if not isinstance(x, fx.Node) or x.op != "call_function" or any(mutated(n) for n in chain):
        return False  # written in place (through a view: ``m[:, :] *= keep``) after it was made
    if x.target in _ONES:
        return True
    if x.target in _FULLS:
        kw = normalize_function(x.target, x.args, x.kwargs, normalize_to_only_use_kwargs=True)
        return kw is not None and kw.kwargs.get("fill_value") in (1, True)
    return False


def _cumsum(a: _Analysis, node: fx.Node, kw: dict[str, Any]) -> str:
    """``cumsum`` over another axis acts per position; over the time axis of a tensor of ones it counts the
    positions: ``ones(B, T).cumsum(1)`` is ``arange(T) + 1`` in every row (OPT's positions from an all-ones
    ``attention_mask``), which the cached model shifts as it shifts ``arange`` (:func:`offset_positions`).
    In a float type the count is exact up to ``2 ** significand bits`` positions, a bound on ``max_len``."""
    x = kw["input"]
    nd = len(shape_of(x) or ())
    if _dim(kw["dim"], nd) not in a.axes(x) or not _all_ones(x):
        return _along("dim")(a, node, kw)
    out = meta_value(node)
    if out.is_floating_point():
        exact = 2 ** (1 - int(math.log2(torch.finfo(out.dtype).eps)))  # 2 ** significand bits
        a.plan.bounds.append((f"the count of positions by {describe(node)} in {out.dtype} (exact up to {exact})",
                              exact))
    a.plan.shifted.append(node)
    return POSITION


def _dropout(a: _Analysis, node: fx.Node, kw: dict[str, Any]) -> str:
    if not _is_inactive_dropout(node):
        raise _Refuse("is active dropout (the model is in training mode); call model.eval() before generating")
    return a.kind(kw["input"])


def _prod(xs: Any) -> Any:
    return math.prod(xs, start=1)


def _whole(e: Any) -> bool:
    """``e`` is a product of positive integers and size symbols: a whole number of rows for every size."""
    e = sympy.sympify(e)
    if e.is_Integer:
        return int(e) >= 1
    return all((b.is_Symbol or b.is_Integer and int(b) >= 1) and x.is_Integer and int(x) >= 1
               for b, x in e.as_powers_dict().items())


def _reshape(a: _Analysis, node: fx.Node, kw: dict[str, Any]) -> str:
    """view/reshape keep each time slice when the elements before the time axis stay before it.

    The input's time axis ``i`` (size ``a * T * c`` when folded, else ``T``) splits the flat index into
    ``outer = prod(sizes[:i]) * a`` rows of ``T * inner``; the output keeps the positions when its one axis
    ``j`` that involves ``T`` has size ``a' * T * c'`` with ``prod(sizes[:j]) * a' == outer`` (``a'``, ``c'`` whole
    numbers free of ``T``): ``(B, T, C) -> (B*T, C)`` folds batch and time into rows (``a' = B``), the reverse
    view unfolds them; ``(B, T, C) -> (B, T*C)`` or ``(T, B)`` orders are refused.
    """
    x = kw.get("self", kw.get("input"))
    folding = a.kind(x) == TOKEN
    sizes = kw.get("size", kw.get("shape", ()))
    if not folding:
        a.sized(sizes, "the reshaped tensor")
    a.no_length({k: v for k, v in kw.items() if k not in ("self", "input", "size", "shape")})
    s_in, s_out = shape_of(x) or (), shape_of(node) or ()
    if x in a.folds:
        i, fa, _ = a.folds[x]
    elif len(a.axes(x)) == 1:
        (i,), fa = a.axes(x), sympy.Integer(1)
    else:
        src, dst = a.axes(x), a.axes(node)
        if len(src) != len(dst) or a.stretched(node):
            raise _Refuse("merges the sequence axis with another axis (reshape)")
        for i, j in zip(src, dst):
            if not same(_prod(s_in[:i]), _prod(s_out[:j])):
                raise _Refuse("moves data across positions (reshape changes the sizes before the sequence axis)")
        return a.kind(x)
    js = [j for j, d in enumerate(s_out) if _involves(d, a.seq)]
    if len(js) != 1:
        raise _Refuse("merges the sequence axis with another axis (reshape)")
    j = js[0]
    seq = a.seq
    outer = sympy.sympify(_expr(_prod(s_in[:i]))) * fa
    fa_out = sympy.simplify(outer / sympy.sympify(_expr(_prod(s_out[:j]))))
    fc_out = sympy.simplify(sympy.sympify(_expr(s_out[j])) / (fa_out * seq))
    if seq in fa_out.free_symbols or seq in fc_out.free_symbols or not (_whole(fa_out) and _whole(fc_out)):
        raise _Refuse("moves data across positions (reshape changes the sizes before the sequence axis)")
    if not folding and (fa_out != 1 or fc_out != 1):
        raise _Refuse("merges the sequence axis with another axis (reshape)")
    if fa_out != 1 or fc_out != 1:
        a.folds[node] = (j, fa_out, fc_out)
    return a.kind(x)


#: view-like ops: :func:`_reshape` follows folded time axes through them.
_RESHAPES = {aten.view, aten.reshape, aten._unsafe_view, aten.flatten, aten.unflatten, aten.view_as}

#: ops that act on each row of their first operand alone, along which a folded time axis may stay.
_ROW_WISE_PRODUCTS = {aten.addmm: ("mat1", "mat2", "self"), aten.mm: ("self", "mat2", None),
                      aten.linear: ("input", "weight", "bias")}
_SAME_ROWS = {aten.clone, aten.contiguous, aten.alias, aten.detach, aten._to_copy, aten.to, aten.lift_fresh_copy}


def _view_as(a: _Analysis, node: fx.Node, kw: dict[str, Any]) -> str:
    """``x.view_as(y)``: a view to ``y``'s shape (which it reads, not ``y``'s values)."""
    return _reshape(a, node, {"self": kw.get("self", kw.get("input")), "size": list(shape_of(kw["other"]) or ())})


def _folded(a: _Analysis, node: fx.Node, kw: dict[str, Any]) -> str:
    """An op on a token value whose time axis is folded with the batch (``(B*T, C)``): row-wise ops keep the
    fold (pointwise ops whose inputs fold alike or carry no time axis, ``addmm``/``mm``/``linear`` contracting
    another axis with constant weights, copies and casts, layer/RMS norms over other axes); others are refused."""
    target = node.target
    packet = target.overloadpacket  # type: ignore[union-attr]
    nd = len(shape_of(node) or ())
    refuse = _Refuse("acts on a tensor whose batch and sequence axes are folded into one (a reshape such as "
                     "(B, T, C) -> (B*T, C)); attnopt follows such a tensor only through row-wise ops (pointwise, "
                     "addmm/mm/linear, layer norm, casts) and a reshape that unfolds it")
    tensors = [x for x in _flat(kw) if isinstance(x, fx.Node) and a.kind(x) != SHAPE]
    a.no_length([x for x in _flat(kw) if not (isinstance(x, fx.Node) and a.kind(x) != SHAPE)])
    if _is_pointwise(target):
        folds = set()
        for x in tensors:
            if x in a.folds:
                i, fa, fc = a.folds[x]
                folds.add((i + nd - len(shape_of(x) or ()), fa, fc))
            elif a.axes(x) or a.stretched(x):
                raise refuse
        if len(folds) != 1:
            raise refuse
        a.folds[node] = folds.pop()
        return a.strongest(tensors)
    if packet in (aten.index, aten.embedding):
        # a table read by each row's own index, ``W[expert_ids]``: the rows keep the index's fold (batched_mm
        # experts pick each (token, slot) pair's expert weights so)
        table, idx = (kw["weight"], kw["indices"]) if packet is aten.embedding else (kw["input"], kw["indices"])
        if packet is aten.index:
            if len(idx) != 1 or not isinstance(idx[0], fx.Node):
                raise refuse
            idx = idx[0]
        if idx not in a.folds or a.kind(table) != CONST or a.stretched(table) or a.axes(table):
            raise refuse
        a.folds[node] = a.folds[idx]
        return a.kind(idx)
    if packet is aten.bmm:  # a product per row of a folded batch axis (batched_mm experts: weights per row)
        x, w = kw.get("self", kw.get("input")), kw["mat2"]
        if x not in a.folds or a.folds.get(w) != a.folds[x] or a.folds[x][0] != 0:
            raise refuse
        a.folds[node] = a.folds[x]
        return a.strongest([x, w])
    if packet is aten.repeat_interleave and kw.get("self", kw.get("input")) in a.folds:
        x, r = kw.get("self", kw.get("input")), kw.get("repeats")
        if not isinstance(r, int) or r < 1 or kw.get("dim") is None:
            raise refuse
        i, fa, fc = a.folds[x]
        # along the folded axis each row is repeated in place: row (b, t, c) becomes rows (b, t, c * r + j)
        a.folds[node] = (i, fa, fc * r) if _dim(kw["dim"], len(shape_of(x) or ())) == i else (i, fa, fc)
        return a.kind(x)
    if packet in _ROW_WISE_PRODUCTS:
        rows, weight, bias = (kw.get(n) if n else None for n in _ROW_WISE_PRODUCTS[packet])
        ok = rows in a.folds and a.folds[rows][0] < len(shape_of(rows) or ()) - 1 and a.kind(weight) == CONST \
            and (not isinstance(bias, fx.Node) or a.kind(bias) == CONST)
        if not ok:
            raise refuse
        a.folds[node] = a.folds[rows]
        return TOKEN
    if packet in (aten.cat, aten.concat):
        # rows joined along another axis (PhiMoE's router: ``concat((weights, weights_top2), -1)``): every
        # operand folded alike, so row r of the result is row r of each operand
        parts = kw.get("tensors")
        if not isinstance(parts, (list, tuple)) or not parts:
            raise refuse
        folds = {a.folds.get(t) for t in parts}
        if None in folds or len(folds) != 1 or any(len(shape_of(t) or ()) != nd for t in parts):
            raise refuse
        fold = folds.pop()
        if _dim(kw.get("dim", 0), nd) == fold[0]:
            raise _Refuse("joins tensors along the axis in which batch and sequence axes are folded into one (a "
                          "reshape such as (B, T, C) -> (B*T, C)), so it mixes positions")
        a.folds[node] = fold
        return a.strongest(list(parts))
    x = kw.get("self", kw.get("input"))
    if x not in a.folds:
        raise refuse
    if packet in (aten.sort, aten.argsort) and len(shape_of(x) or ()) == 1:
        return _start_sort(a, node, kw)  # the rows ordered by a key: a mixture of experts' dispatch
    if packet in (aten.zeros_like, aten.ones_like, aten.full_like, aten.empty_like):
        # a fill shaped like folded rows: never a constant (its sum counts the rows), a value per position
        a.no_length({k: v for k, v in kw.items() if k not in ("self", "input")})
        a.folds[node] = a.folds[x]
        return POSITION
    if packet in _FOLDED_ALONG:
        return _folded_along(a, node, kw, x, refuse)
    if packet in _SAME_ROWS and len(shape_of(node) or ()) == len(shape_of(x) or ()):
        a.no_length({k: v for k, v in kw.items() if k not in ("self", "input")})
    elif packet in (aten.layer_norm, aten.rms_norm) and a.folds[x][0] < nd - len(kw["normalized_shape"]):
        for p in ("weight", "bias"):
            if isinstance(kw.get(p), fx.Node) and a.kind(kw[p]) != CONST:
                raise refuse
    else:
        raise refuse
    a.folds[node] = a.folds[x]
    return TOKEN


#: ops on a folded tensor that act along other axes than the folded one, or only move axes: ``names`` are the
#: arguments naming the dims they act along (``None``: they only move or add axes), ``default_all`` when no dim
#: given means all of them (a full reduction, which the fold's axis refuses).
_FOLDED_ALONG: dict[Any, tuple[tuple[str, ...] | None, bool]] = {
    **{op: (None, False) for op in (aten.unsqueeze, aten.squeeze, aten.transpose, aten.permute, aten.t,
                                    aten.expand, aten.movedim, aten.swapaxes)},
    **{op: (("dim",), False) for op in (
        aten.split, aten.split_with_sizes, aten.chunk, aten.unbind, aten.select, aten.narrow, aten.slice,
        aten.softmax, aten._softmax, aten.log_softmax, aten._log_softmax, aten.topk, aten.sort, aten.argsort,
        aten.cumsum, aten.cumprod, aten.logsumexp, aten.gather, aten.scatter, aten.scatter_)},
    **{op: (("dim",), True) for op in (
        aten.sum, aten.mean, aten.amax, aten.amin, aten.var, aten.std, aten.prod, aten.any, aten.all, aten.norm,
        aten.linalg_vector_norm, aten.max, aten.min, aten.argmax, aten.argmin)},
}


def _folded_along(a: _Analysis, node: fx.Node, kw: dict[str, Any], x: fx.Node, refuse: _Refuse) -> str:
    """Row-wise ops on a folded tensor (``(B*T, E)`` router logits): softmax, topk, sums and the like along the
    other axes, and layout ops that move the folded axis without mixing its rows (Mixtral's router)."""
    packet = node.target.overloadpacket  # type: ignore[union-attr]
    names, default_all = _FOLDED_ALONG[packet]
    i, fa, fc = a.folds[x]
    nd = len(shape_of(x) or ())
    if names is not None:
        dims: list[Any] = []
        for n in names:
            d = kw.get(n)
            dims.extend(d if isinstance(d, (list, tuple)) else [] if d is None else [d])
        if not dims and default_all or any(_dim(d, nd) == i for d in dims):
            raise _Refuse("works along the axis in which batch and sequence axes are folded into one (a reshape "
                          "such as (B, T, C) -> (B*T, C)), so it mixes positions")
    for name, v in kw.items():
        if name in ("self", "input"):
            continue
        for t in _flat(v):
            if isinstance(t, fx.Node) and a.kind(t) != SHAPE:
                if packet in (aten.gather, aten.scatter, aten.scatter_) and name in ("index", "src") \
                        and len(shape_of(t) or ()) == nd and a.folds.get(t) == (i, fa, fc):
                    continue  # each row's own entries (``scores.gather(1, topk_idx)``, ``mask.scatter_(1, idx, 1)``)
                raise refuse
    a.no_length({k: v for k, v in kw.items() if k not in ("self", "input", "index", "src")
                 and not (k == "size" and packet is aten.expand)})  # expand: its size is checked below
    first = meta_value(node)
    first = first[0] if isinstance(first, (list, tuple)) else first
    size = sympy.sympify(_expr((shape_of(x) or ())[i]))
    js = [j for j, d in enumerate(first.shape) if _involves(d, a.seq)]
    if len(js) != 1 or not same(sympy.sympify(_expr(first.shape[js[0]])), size):
        raise refuse
    a.folds[node] = (js[0], fa, fc)
    return a.strongest([x, kw.get("index"), kw.get("src")])


# --------------------------------------------------------------- rows sorted by a key (mixture of experts)
#
# A mixture of experts' dispatch (Hugging Face's ``grouped_mm`` experts) sorts the (token, slot) pairs by
# expert, runs one product per expert on contiguous rows and puts the rows back::
#
#     ids, perm = torch.sort(top_k_index.reshape(-1))          # perm: sorted row -> flat row
#     x = hidden[perm // k]                                    # row r is the token of flat row perm[r]
#     offs = torch.cumsum(torch.histc(ids.float(), E, 0, E - 1), 0)
#     y = grouped_mm(x, W, offs) * weights.reshape(-1)[perm]   # rows offs[e-1]:offs[e] times W[e]
#     inv = torch.empty_like(perm); inv[perm] = torch.arange(perm.size(0))
#     out = y[inv].view(-1, k, C).sum(1)                       # back in token order
#
# The sort mixes rows, but row r of every sorted value is flat row ``perm[r]``: ops that act on each row alone
# keep that, ``grouped_mm`` too when its offsets count the sort's own keys (ascending integers in ``[0, E)``,
# so row r lies in group ``ids[r]`` and is multiplied by the weight of its own key), and indexing by the inverse
# permutation gives each flat row its own result. So the whole dispatch acts on each row alone. Values of the
# dispatch carry a :class:`_Sorted` role; any other use of them is refused.


@dataclass(frozen=True)
class _Sorted:
    """How a value of a dispatch relates to the permutation ``perm`` that ``sort`` chose.

    ``role``: ``"sort"`` (the sort's result tuple), ``"index"`` (``perm // div``), ``"rows"`` (row r is computed
    from flat row ``perm[r]`` alone), ``"keys"`` (the sorted keys: rows, ascending), ``"counts"`` (a histogram
    of the keys, ``bins`` long), ``"offsets"`` (its cumulative sum), ``"fresh"`` (a new tensor shaped like a
    sorted value, to be written), ``"inverse"`` (``perm``'s inverse), ``"iota"`` (``arange(n)``, no sort).
    """

    sort: fx.Node | None
    role: str
    div: int = 1
    bins: int = 0
    n: Any = None  # iota: its length


@dataclass(frozen=True)
class _SortInfo:
    fold: tuple[int, sympy.Expr, sympy.Expr]  # the sorted 1-D tensor's fold: its rows are the flat rows
    keys: fx.Node  # the tensor sorted
    bound: int | None  # the keys are integers in [0, bound), or None if unknown
    ascending: bool


#: single-input ops that keep every value (layout changes, copies): walked back by :func:`_unwritten`
_KEEPS_VALUES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.clone.default,
                 aten.contiguous.default, aten.alias.default, aten.detach.default, aten._to_copy.default,
                 aten.to.dtype, aten.flatten.using_ints, aten.lift_fresh_copy.default}


def _unwritten(x: Any) -> bool:
    """Neither ``x`` nor what it was copied or viewed from (back through :data:`_KEEPS_VALUES`) is written in
    place anywhere in the graph, through any alias or ``out=``: the values a rule read from how they were made
    are the values there."""
    while isinstance(x, fx.Node):
        if mutated(x):
            return False
        if x.op == "call_function" and x.target in _KEEPS_VALUES:
            x = x.args[0]
            continue
        return True  # made here (a tuple's item: only writes into that item count, not into its siblings)
    return True


def _int_bound(x: Any) -> int | None:
    """``x`` holds integers in ``[0, n)``: the indices of ``topk``/``sort``/``argmax``/``max(dim)`` along an axis of
    ``n``, through reshapes, copies, exact casts and concatenations, none of them written in place. None when
    attnopt cannot tell."""
    if not _unwritten(x):
        return None
    while isinstance(x, fx.Node) and x.op == "call_function":
        if x.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.clone.default,
                        aten.contiguous.default, aten.alias.default, aten.flatten.using_ints):
            x = x.args[0]
            continue
        if x.target in (aten.cat.default, aten.concat.default) and isinstance(x.args[0], (list, tuple)) \
                and x.args[0]:
            # indices joined (PhiMoE's two picks, ``concat((argmax, argmax_top2), -1)``): the widest bound
            bounds = [_int_bound(t) for t in x.args[0]]
            return None if any(b is None for b in bounds) else max(bounds)  # type: ignore[type-var]
        if x.target is operator.getitem and isinstance(x.args[0], fx.Node) and x.args[1] == 1 \
                and x.args[0].op == "call_function" and x.args[0].target in (aten.topk.default, aten.sort.default,
                                                                             aten.sort.stable, aten.max.dim,
                                                                             aten.min.dim):
            src = x.args[0]
            kw = normalize_function(src.target, src.args, src.kwargs, normalize_to_only_use_kwargs=True)
            if kw is None:
                return None
            shape = shape_of(kw.kwargs.get("self", kw.kwargs.get("input"))) or ()
            size = shape[_dim(kw.kwargs.get("dim", -1), len(shape))]
            return size if isinstance(size, int) else None
        if x.target in (aten.argmax.default, aten.argsort.default, aten.argsort.stable):
            kw = normalize_function(x.target, x.args, x.kwargs, normalize_to_only_use_kwargs=True)
            shape = shape_of(kw.kwargs.get("self", kw.kwargs.get("input"))) if kw is not None else None
            if kw is None or shape is None or kw.kwargs.get("dim") is None and x.target is aten.argmax.default:
                return None
            size = shape[_dim(kw.kwargs.get("dim", -1), len(shape))]
            return size if isinstance(size, int) else None
        return None
    return None


def _exact_cast(x: fx.Node, bound: int | None) -> bool:
    """Integers below ``bound`` survive ``x``'s dtype exactly."""
    val = meta_value(x)
    if bound is None or not isinstance(val, torch.Tensor):
        return False
    if val.dtype.is_floating_point:
        return bound <= 2 ** (1 - int(math.log2(torch.finfo(val.dtype).eps)))  # 2 ** significand bits
    return val.dtype != torch.bool and bound - 1 <= torch.iinfo(val.dtype).max


def _start_sort(a: _Analysis, node: fx.Node, kw: dict[str, Any]) -> str:
    """``sort``/``argsort`` of a 1-D folded tensor along its rows: the start of a dispatch."""
    x = kw.get("self", kw.get("input"))
    if _dim(kw.get("dim", -1), 1) != a.folds[x][0]:
        raise _Refuse("sorts a folded tensor along another axis")
    a.sort_info[node] = _SortInfo(a.folds[x], x, _int_bound(x), not kw.get("descending", False))
    a.sorted[node] = _Sorted(node, "sort" if node.target.overloadpacket is aten.sort else "index")  # type: ignore
    return a.kind(x)


def _rows_of(a: _Analysis, xs: list[fx.Node]) -> fx.Node:
    """The one sort whose rows all of ``xs`` are (role rows or keys)."""
    sorts = {a.sorted[x].sort for x in xs if x in a.sorted}
    if len(sorts) != 1 or any(x in a.sorted and a.sorted[x].role not in ("rows", "keys") for x in xs):
        raise _Refuse("mixes values of a mixture of experts' dispatch in a way attnopt does not follow")
    return sorts.pop()  # type: ignore[return-value]


def _dispatch(a: _Analysis, node: fx.Node, kw: dict[str, Any]) -> str:
    """An op that reads a value of a dispatch (:class:`_Sorted`): the roles it keeps, or a refusal."""
    target = node.target
    packet = target.overloadpacket  # type: ignore[union-attr]
    refuse = _Refuse("acts on the rows of a mixture of experts' dispatch (sorted by expert) in a way attnopt "
                     "does not follow: it follows ops on each row alone, grouped_mm by the sort's own counts "
                     "and indexing by the inverse permutation")
    role = {x: a.sorted[x] for x in _flat(kw) if isinstance(x, fx.Node) and x in a.sorted}
    tensors = [x for x in _flat(kw) if isinstance(x, fx.Node) and a.kind(x) != SHAPE]
    sizes = ("size", "shape") if packet in _ROW_MOVES else ()  # checked against the rows by _row_axis_kept
    a.no_length([x for k, v in kw.items() if k not in sizes for x in _flat(v)
                 if not (isinstance(x, fx.Node) and a.kind(x) != SHAPE)])
    if _writes_in_place(node) and any(w in a.sorted and a.sorted[w].role not in ("rows", "fresh")
                                       for w in _written_args(node)):
        raise _Refuse("writes in place into the sorted keys or the permutation of a mixture of experts' dispatch")
    strongest = a.strongest(tensors)
    x = kw.get("self", kw.get("input"))
    if packet in (aten.floor_divide, aten.div) and x in role and role[x].role == "index" \
            and (packet is aten.floor_divide or kw.get("rounding_mode") == "floor") \
            and isinstance(kw.get("other"), int) and kw["other"] >= 1:
        a.sorted[node] = _Sorted(role[x].sort, "index", role[x].div * kw["other"])
        return strongest
    if packet is aten.index:
        return _dispatch_index(a, node, kw, refuse)
    if packet in (aten.index_put, aten.index_put_):
        return _dispatch_put(a, node, kw, refuse)
    if packet in (aten.empty_like, aten.zeros_like, aten.new_empty, aten.new_zeros) and x in role:
        a.sorted[node] = _Sorted(role[x].sort, "fresh")
        return strongest
    if packet in (aten.argsort, aten.sort) and x in role and role[x].role == "index" and role[x].div == 1 \
            and not kw.get("descending", False) and _unwritten(x):
        # the argsort of a permutation is its inverse
        if packet is aten.sort:
            a.sorted[node] = _Sorted(role[x].sort, "sort_of_index")
        else:
            a.sorted[node] = _Sorted(role[x].sort, "inverse")
        return strongest
    if packet is aten.histc:
        return _dispatch_counts(a, node, kw, refuse)
    if packet is aten.cumsum and x in role and role[x].role == "counts" and _dim(kw["dim"], 1) == 0:
        a.sorted[node] = _Sorted(role[x].sort, "offsets", bins=role[x].bins)
        return strongest
    # ops on each row alone: the sort's rows stay its rows (keys stay keys through exact casts and copies)
    s = _rows_of(a, [t for t in tensors if t in role])
    rank = len(shape_of(node) or ())
    pointwise = _is_pointwise(target)
    for t in tensors:
        if t in role:
            if len(shape_of(t) or ()) != rank and not (packet in _ROW_LAYOUT and t is x):
                raise refuse  # a row axis that broadcasts elsewhere
        elif a.kind(t) != CONST or a.stretched(t) or a.axes(t):
            raise refuse
        elif pointwise and len(shape_of(t) or ()) == rank and (shape_of(t) or (1,))[0] != 1:
            raise refuse  # a constant with its own rows would pair them with the sorted ones
    if pointwise or packet in (aten.mm, aten.linear, aten.addmm) and _row_product(a, kw):
        pass
    elif packet in _ROW_LAYOUT and x in role:
        _row_axis_kept(a, node, kw, x, refuse)
    else:
        raise refuse
    keys = packet in _KEY_CASTS and x in role and role[x].role == "keys" \
        and _exact_cast(node, a.sort_info[s].bound)
    a.sorted[node] = _Sorted(s, "keys" if keys else "rows")
    return strongest


_DISPATCH_REFUSAL = _Refuse("acts on the rows of a mixture of experts' dispatch (sorted by expert) in a way attnopt "
                            "does not follow")


def _is_grouped_mm(target: Any) -> bool:
    schema = getattr(target, "_schema", None)
    return target is aten._grouped_mm.default or schema is not None \
        and schema.name == "transformers::grouped_mm_fallback"


#: ops that keep each row of their first operand alone when they leave its first axis where it is
_ROW_LAYOUT = {aten.unsqueeze, aten.squeeze, aten.view, aten.reshape, aten._unsafe_view, aten.split,
               aten.split_with_sizes, aten.chunk, aten.unbind, aten.select, aten.narrow, aten.slice, aten.softmax,
               aten._softmax, aten.log_softmax, aten._log_softmax, aten.sum, aten.mean, aten.amax, aten.amin,
               aten.clone, aten.contiguous, aten.alias, aten.detach, aten._to_copy, aten.to, aten.layer_norm,
               aten.rms_norm, aten.expand, aten.lift_fresh_copy}
#: of those, ops whose dims name the output's axes (a new one, a dropped one), not axes they act along
_ROW_MOVES = {aten.unsqueeze, aten.squeeze, aten.view, aten.reshape, aten._unsafe_view, aten.expand}
_KEY_CASTS = {aten.clone, aten.contiguous, aten.alias, aten.detach, aten._to_copy, aten.to, aten.view,
              aten.reshape, aten._unsafe_view}


def _row_product(a: _Analysis, kw: dict[str, Any]) -> bool:
    """``mm``/``linear``/``addmm`` of sorted rows with constant weights: each row times the same matrix."""
    rows = kw.get("mat1", kw.get("self", kw.get("input")))
    if kw.get("mat1") is not None:
        others = [kw.get("mat2"), kw.get("self")]
    else:
        others = [kw.get("mat2", kw.get("weight")), kw.get("bias")]
    return rows in a.sorted and all(not isinstance(o, fx.Node) or a.kind(o) == CONST for o in others) \
        and len(shape_of(rows) or ()) == 2


def _row_axis_kept(a: _Analysis, node: fx.Node, kw: dict[str, Any], x: fx.Node, refuse: _Refuse) -> None:
    """A layout or reduction op keeps the sorted rows at axis 0, untouched and unmixed."""
    nd = len(shape_of(x) or ())
    dims: list[Any] = []
    for n in ("dim", "dims"):
        d = kw.get(n)
        dims.extend(d if isinstance(d, (list, tuple)) else [] if d is None else [d])
    packet = node.target.overloadpacket  # type: ignore[union-attr]
    if packet in (aten.layer_norm, aten.rms_norm):
        if len(kw["normalized_shape"]) >= nd:
            raise refuse
        for p in ("weight", "bias"):
            if isinstance(kw.get(p), fx.Node) and a.kind(kw[p]) != CONST:
                raise refuse
    elif packet in (aten.sum, aten.mean, aten.amax, aten.amin) and not dims \
            or packet not in _ROW_MOVES and any(_dim(d, nd) == 0 for d in dims):
        raise refuse
    out = meta_value(node)
    for o in out if isinstance(out, (list, tuple)) else [out]:
        if not isinstance(o, torch.Tensor) or o.dim() == 0 or not same(
                sympy.sympify(_expr(o.shape[0])), sympy.sympify(_expr((shape_of(x) or ())[0]))):
            raise refuse


def _dispatch_index(a: _Analysis, node: fx.Node, kw: dict[str, Any], refuse: _Refuse) -> str:
    """``x[perm // k]`` (the flat rows' tokens in sorted order), ``w[perm]``, ``table[keys]`` (each row's own
    expert's entry), ``y[inverse]`` (back in flat order)."""
    x, indices = kw["input"], kw["indices"]
    if len(indices) != 1 or not isinstance(indices[0], fx.Node) or indices[0] not in a.sorted:
        raise refuse
    idx = indices[0]
    r = a.sorted[idx]
    s = r.sort
    if r.role == "index" and x in a.folds and a.folds[x][0] == 0 and _unwritten(idx):
        info = a.sort_info[s]  # type: ignore[index]
        _, fa, fc = a.folds[x]
        if info.fold[0] != 0 or not same(info.fold[1], fa) or not same(info.fold[2], fc * r.div):
            raise _Refuse("gathers rows of a mixture of experts' dispatch from a tensor that is not folded like "
                          "the sorted one (its rows are not the tokens of the sorted rows)")
        own = r.div == 1 and x is info.keys and _unwritten(x)  # ``ids = idx[idx.argsort()]``: the sorted keys
        a.sorted[node] = _Sorted(s, "keys" if own else "rows")
        return TOKEN
    if r.role == "keys" and a.kind(x) == CONST and not a.stretched(x) and not a.axes(x) and _unwritten(idx):
        a.sorted[node] = _Sorted(s, "rows")  # each row's own expert's bias or scale
        return TOKEN
    if r.role == "inverse" and x in a.sorted and a.sorted[x].sort is s and a.sorted[x].role in ("rows", "keys") \
            and _unwritten(idx):
        a.folds[node] = a.sort_info[s].fold  # type: ignore[index]
        return TOKEN
    raise refuse


def _dispatch_put(a: _Analysis, node: fx.Node, kw: dict[str, Any], refuse: _Refuse) -> str:
    """``inv[perm] = arange(n)``: the inverse permutation; ``out[perm] = y``: the sorted rows back in order."""
    base, indices, values = kw["input"], kw["indices"], kw["values"]
    if kw.get("accumulate") or base not in a.sorted or a.sorted[base].role != "fresh" or len(indices) != 1 \
            or not isinstance(indices[0], fx.Node) or indices[0] not in a.sorted or not isinstance(values, fx.Node):
        raise refuse
    perm, s = indices[0], a.sorted[base].sort
    if a.sorted[perm] != _Sorted(s, "index") or not _unwritten(perm):
        raise refuse
    rows = (shape_of(perm) or ())[0]
    if values in a.sorted and a.sorted[values].role == "iota" and len(shape_of(base) or ()) == 1 \
            and same(sympy.sympify(_expr(a.sorted[values].n)), sympy.sympify(_expr(rows))):
        done: _Sorted | None = _Sorted(s, "inverse")
    elif values in a.sorted and a.sorted[values].sort is s and a.sorted[values].role in ("rows", "keys") \
            and len(shape_of(values) or ()) == len(shape_of(base) or ()):
        done = None  # the rows back in flat order
    else:
        raise refuse
    order = a._order()
    if any(order[u] < order[node] for u in base.users if u is not node):
        raise refuse  # read before it was written
    for n in (node, base) if node.target.overloadpacket is aten.index_put_ else (node,):  # type: ignore
        if done is None:
            a.sorted.pop(n, None)
            a.folds[n] = a.sort_info[s].fold  # type: ignore[index]
        else:
            a.sorted[n] = done
    return TOKEN


def _dispatch_counts(a: _Analysis, node: fx.Node, kw: dict[str, Any], refuse: _Refuse) -> str:
    """``histc(keys, bins=E, min=0, max=E-1)`` of integer keys in ``[0, E)``: bin e counts the rows of key e."""
    x = kw["input"]
    r = a.sorted.get(x)
    if r is None or r.role != "keys" or r.sort is None or not _unwritten(x):
        raise refuse
    info = a.sort_info[r.sort]
    bins, lo, hi = kw.get("bins", 100), kw.get("min", 0), kw.get("max", 0)
    dtype = getattr(meta_value(x), "dtype", None)
    # bin e of ``[0, E-1]`` is ``floor(v * E / (E - 1))``: exact for whole v below E in float32 and wider only
    wide = dtype in (torch.float32, torch.float64) or dtype is not None and not dtype.is_floating_point
    if not info.ascending or info.bound is None or not isinstance(bins, int) or lo != 0 or hi != bins - 1 \
            or info.bound > bins or not wide or bins > 4096:
        raise _Refuse("counts the keys of a mixture of experts' dispatch in bins that attnopt cannot match to the "
                      "keys (it follows histc(keys, E, 0, E - 1) of ascending expert indices below E)")
    a.sorted[node] = _Sorted(r.sort, "counts", bins=bins)
    return TOKEN


def _dispatch_grouped(a: _Analysis, node: fx.Node, refuse: _Refuse) -> str:
    """``grouped_mm(x, W, offs)``: rows ``offs[e-1]:offs[e]`` of ``x`` times ``W[e]``. With ``offs`` the
    cumulative counts of the sort's own ascending keys, row r is multiplied by the weight of its own key."""
    args = list(node.args)
    x, w = args[0], args[1]
    offs = args[2] if len(args) > 2 else node.kwargs.get("offs")
    bias = args[3] if len(args) > 3 else node.kwargs.get("bias")
    if not isinstance(x, fx.Node) or x not in a.sorted or a.sorted[x].role not in ("rows", "keys") \
            or len(shape_of(x) or ()) != 2:
        raise refuse
    s = a.sorted[x].sort
    r = a.sorted.get(offs) if isinstance(offs, fx.Node) else None
    shape_w = shape_of(w) or ()
    if r is None or r.sort is not s or r.role != "offsets" or not _unwritten(offs) or not isinstance(w, fx.Node) \
            or a.kind(w) != CONST or len(shape_w) != 3 or shape_w[0] != r.bins \
            or isinstance(bias, fx.Node) and a.kind(bias) != CONST:
        raise refuse
    a.sorted[node] = _Sorted(s, "rows")
    return TOKEN


def _along(*names: str, default_all: bool = False):
    """Ops over one or more named dims (softmax, split, sum, ...): those dims must not be time axes."""

    def rule(a: _Analysis, node: fx.Node, kw: dict[str, Any]) -> str:
        x = kw.get("self", kw.get("input", kw.get("tensors")))
        first = _flat(x)[0]
        nd = len(shape_of(first) or ())
        dims: list[Any] = []
        for n in names:
            d = kw.get(n)
            dims.extend(d if isinstance(d, (list, tuple)) else [] if d is None else [d])
        if not dims and default_all:
            dims = list(range(nd))
        axes = set().union(*(a.axes(t) for t in _flat(x) if isinstance(t, fx.Node)))
        hit = [d for d in dims if _dim(d, nd) in axes]
        if hit:
            raise _Refuse(f"works along the sequence axis (dim {hit[0]})")
        a.no_length({k: v for k, v in kw.items() if k not in ("self", "input", "tensors")})
        return a.strongest(x)

    return rule


def _norm(a: _Analysis, node: fx.Node, kw: dict[str, Any]) -> str:
    """layer_norm / rms_norm normalise the last ``len(normalized_shape)`` dims."""
    x = kw["input"]
    nd = len(shape_of(x) or ())
    if any(i >= nd - len(kw["normalized_shape"]) for i in a.axes(x)):
        raise _Refuse("normalises over the sequence axis")
    for p in ("weight", "bias"):
        if isinstance(kw.get(p), fx.Node) and a.kind(kw[p]) != CONST:
            raise _Refuse(f"has a {p} computed from the sequence")
    return a.kind(x)


def _product(a: _Analysis, node: fx.Node, kw: dict[str, Any]) -> str:
    """``a @ b`` contracts a's last and b's second-to-last dim: neither may be a time axis."""
    x = kw.get("self", kw.get("input"))
    w = kw.get("mat2", kw.get("other", kw.get("weight")))
    linear = node.target.overloadpacket is aten.linear  # type: ignore[union-attr]
    nx, nw = len(shape_of(x) or ()), len(shape_of(w) or ())
    if nx < 2 and a.axes(x) or nw < 2 and a.axes(w):
        raise _Refuse("contracts over the sequence axis")
    if nx - 1 in a.axes(x) or (nw - (1 if linear else 2)) in a.axes(w):
        raise _Refuse("contracts over the sequence axis (a product across positions: attention that is not "
                      "a proven causal site?)")
    if linear and (a.kind(w) != CONST or isinstance(kw.get("bias"), fx.Node) and a.kind(kw["bias"]) != CONST):
        raise _Refuse("has weights computed from the sequence")
    return a.strongest([x, w, kw.get("bias")])


def _lookup(a: _Analysis, node: fx.Node, kw: dict[str, Any]) -> str:
    """``embedding(table, idx)`` / ``table[idx]``: one row per index; a position index reads row i."""
    if node.target.overloadpacket is aten.embedding:  # type: ignore[union-attr]
        table, idx = kw["weight"], kw["indices"]
    else:
        table, indices = kw["input"], kw["indices"]
        if len(indices) != 1 or not isinstance(indices[0], fx.Node):
            tensors = [i for i, x in enumerate(indices) if isinstance(x, fx.Node)]
            if len(tensors) == 1 and tensors[0] in a.axes(table):  # ``x[:, [-1], :]``: nanoGPT's inference path
                raise _Refuse(f"indexes the sequence axis (dim {tensors[0]}) with a tensor, e.g. `x[:, [-1]]` for "
                              "the last position only; the cache needs forward to return logits for every position "
                              "(nanoGPT: the path taken with targets)")
            if len(tensors) == 1 and _fixed_index(a, indices[tensors[0]]) and not a.stretched(table):
                # ``x[..., [-2], :]`` with a fixed integer index on another axis (Falcon's key and value heads):
                # every time slice of the result is picked from the same time slice of ``x``
                return a.kind(table)
            raise _Refuse(f"indexes {len(tensors)} axes with index tensors (dims {tensors}); attnopt follows "
                          "one index tensor on the first axis")
        idx = indices[0]
    if a.kind(table) != CONST:
        raise _Refuse("gathers from a tensor computed from the sequence")
    kind = a.kind(idx)
    if kind == POSITION:
        a.plan.bounds.append((f"the position table read by {describe(node)}", int((shape_of(table) or (0,))[0])))
    return kind


def _fixed_index(a: _Analysis, idx: fx.Node) -> bool:
    """An integer index tensor computed from parameters and buffers alone (no time axis, no sequence length)."""
    val = meta_value(idx)
    return a.kind(idx) == CONST and isinstance(val, torch.Tensor) and not val.is_floating_point() \
        and val.dtype != torch.bool and not a.axes(idx) and not a.stretched(idx)


def _index_select(a: _Analysis, node: fx.Node, kw: dict[str, Any]) -> str:
    """``index_select(x, d, index)``: a fixed index picks along another axis; a token or position index
    (one per time step) makes dim ``d`` of the result its time axis, so the result takes the index's kind."""
    x, index = kw.get("self", kw.get("input")), kw["index"]
    d = _dim(kw["dim"], len(shape_of(x) or ()))
    if d in a.axes(x):
        raise _Refuse(f"selects along the sequence axis (dim {kw['dim']})")
    kind = a.kind(index)
    if kind == CONST:
        return a.kind(x)
    if a.kind(x) != CONST:
        raise _Refuse("gathers from a tensor computed from the sequence")
    if kind == POSITION:
        a.plan.bounds.append((f"the position table read by {describe(node)}", int((shape_of(x) or ())[d])))
    return kind


def _arange(a: _Analysis, node: fx.Node, kw: dict[str, Any]) -> str:
    start, end, step = kw.get("start", 0), kw.get("end"), kw.get("step", 1)
    a.no_length([kw.get("dtype"), kw.get("device")])
    if start in (0, None) and _is_seq(end, a.seq) and step in (1, None):
        a.plan.shifted.append(node)
        return POSITION
    if start in (0, None) and step in (1, None) and _involves(end, a.seq) and _whole(_expr(end) / a.seq):
        a.sorted[node] = _Sorted(None, "iota", n=end)  # row numbers of a dispatch's flat rows (its inverse)
        return POSITION
    raise _Refuse(f"counts over a range computed from the sequence length ({_expr(start)}, {_expr(end)}, "
                  f"{_expr(step)}); only arange(T) is understood")


def _slice(a: _Analysis, node: fx.Node, kw: dict[str, Any]) -> str:
    x, start, end, step = kw["input"], kw.get("start"), kw.get("end"), kw.get("step", 1)
    nd = len(shape_of(x) or ())
    d = _dim(kw.get("dim", 0), nd)
    full_len = (shape_of(x) or ())[d]
    if d in a.axes(x):  # slicing the sequence itself: only the whole of it keeps positions
        if start in (0, None) and step == 1 and (_is_seq(end, a.seq) or end == _FULL):
            return a.kind(x)
        raise _Refuse("slices the sequence axis (e.g. keeps only the last positions)")
    if not (_involves(start, a.seq) or _involves(end, a.seq)):
        a.no_length([step])
        return a.kind(x)
    if a.kind(x) == TOKEN:
        raise _Refuse("slices a token tensor by the sequence length")
    if start in (0, None) and _is_seq(end, a.seq) and step == 1:  # table[:T] is table[arange(T)]
        a.plan.shifted.append(node)
        if isinstance(full_len, int):
            a.plan.bounds.append((f"the position table sliced by {describe(node)}", full_len))
        return POSITION
    raise _Refuse(f"slices a table by a range computed from the sequence length ({_expr(start)}:{_expr(end)})")


def _factory(a: _Analysis, node: fx.Node, kw: dict[str, Any]) -> str:
    """ones/zeros/full/empty (and ``new_*``/``*_like``): sizes may be T; the values are the same everywhere."""
    a.sized(kw.get("size", ()), "the created tensor")
    a.no_length({k: v for k, v in kw.items() if k not in ("size", "self", "input")})
    return POSITION if a.axes(node) else CONST


def _cat(a: _Analysis, node: fx.Node, kw: dict[str, Any]) -> str:
    tensors = kw["tensors"]
    out = a.axes(node)
    for t in tensors:
        if len(shape_of(t) or ()) == len(shape_of(node) or ()) and a.axes(t) != out:
            raise _Refuse("concatenates tensors whose sequence axes do not line up")
    return _along("dim")(a, node, kw)


def _stack(a: _Analysis, node: fx.Node, kw: dict[str, Any]) -> str:
    axes = {a.axes(t) for t in kw["tensors"]}
    if len(axes) != 1:
        raise _Refuse("stacks tensors whose sequence axes do not line up")
    return a.strongest(kw["tensors"])


_P = aten
#: Ops that read only sizes or check them; they return no tensor values.
_METADATA = {_P.sym_size, _P.sym_numel, _P.sym_stride, _P.sym_storage_offset, _P._assert_scalar,
             _P.sym_constrain_range, _P.sym_constrain_range_for_size, _P._assert_tensor_metadata}
#: Operands whose values an op does not read (only their shape, dtype or device).
_SHAPE_ONLY: dict[Any, tuple[str, ...]] = {
    _P.expand_as: ("other",), _P.type_as: ("other",), _P.view_as: ("other",),
    **{op: ("self", "input") for op in (_P.new_ones, _P.new_zeros, _P.new_full, _P.new_empty, _P.ones_like,
                                        _P.zeros_like, _P.full_like, _P.empty_like)},
}
_RULES: dict[Any, Any] = {
    **{op: _same_layout for op in (
        _P.transpose, _P.permute, _P.unsqueeze, _P.squeeze, _P.t, _P.alias, _P.clone, _P.contiguous,
        _P.detach, _P._to_copy, _P.to, _P.type_as, _P.lift_fresh_copy, _P.view_as_complex, _P.view_as_real,
        _P.expand, _P.expand_as, _P.broadcast_to, _P.real, _P.imag, _P.resolve_conj, _P.movedim, _P.swapaxes)},
    _P.dropout: _dropout,
    **{op: _reshape for op in (_P.view, _P.reshape, _P._unsafe_view, _P.flatten, _P.unflatten)},
    _P.view_as: _view_as,
    **{op: _along("dim") for op in (
        _P.split, _P.split_with_sizes, _P.chunk, _P.unbind, _P.select, _P.narrow, _P.softmax, _P._softmax,
        _P.log_softmax, _P._log_softmax, _P.cumprod, _P.topk, _P.sort,
        _P.logsumexp)},
    **{op: _along("dim", default_all=True) for op in (
        _P.sum, _P.mean, _P.amax, _P.amin, _P.var, _P.std, _P.prod, _P.any, _P.all, _P.norm,
        _P.linalg_vector_norm, _P.max, _P.min, _P.argmax, _P.argmin)},
    **{op: _along("dims", default_all=True) for op in (_P.flip, _P.roll)},  # roll without dims: flattened
    _P.layer_norm: _norm, _P.native_layer_norm: _norm, _P.rms_norm: _norm,
    _P.matmul: _product, _P.mm: _product, _P.bmm: _product, _P.linear: _product,
    _P.embedding: _lookup, _P.index: _lookup, _P.index_select: _index_select,
    _P.arange: _arange,
    _P.slice: _slice,
    **{op: _factory for op in (
        _P.ones, _P.zeros, _P.full, _P.empty, _P.new_ones, _P.new_zeros, _P.new_full, _P.new_empty,
        _P.ones_like, _P.zeros_like, _P.full_like, _P.empty_like, _P.scalar_tensor)},
    _P.cat: _cat, _P.stack: _stack,
    _P.repeat: _repeat, _P.repeat_interleave: _repeat_interleave, _P.cumsum: _cumsum,
}


def analyse_positions(gm: fx.GraphModule, tokens: fx.Node, sites: Collection[fx.Node],
                      notes: Mapping[fx.Node, str] | None = None) -> PositionPlan:
    """Prove that ``gm``'s output at position ``i`` depends on positions ``<= i`` only through ``sites``.

    Args:
        gm: an ATen graph with a symbolic sequence length (``torch.export`` with a dynamic dim),
            whose outputs are the rows to keep (e.g. only the logits).
        tokens: the placeholder holding the token ids, ``(B, T)``.
        sites: ``call_module`` nodes ``(q, k, v, ...)`` that attend causally over the sequence.
        notes: words added to a refusal at these nodes (e.g. "part of an attention that is not causal").

    Raises:
        PositionError: an op mixes positions or reads the sequence length; the message names it.
    """
    return _Analysis(gm, tokens, sites, notes).run()


def offset_positions(gm: fx.GraphModule, plan: PositionPlan, offset: fx.Node) -> fx.GraphModule:
    """Shift every position reader of ``plan`` by ``offset``: ``arange(T)`` -> ``arange(offset, offset + t)``,
    ``table[:T]`` -> ``table[offset:offset + t]``, a count of ones ``x.cumsum(d)`` -> ``x.cumsum(d) + offset * x``.
    Ends with ``lint()`` and ``recompile()``."""
    graph = gm.graph
    for node in plan.shifted:
        kw = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
        assert kw is not None
        kwargs = dict(kw.kwargs)
        if node.target.overloadpacket is aten.cumsum:  # type: ignore[union-attr]
            # a count of ones from 1: each row counts on from the offset, ``cumsum(x) + offset * x``
            dtype = meta_value(node).dtype
            users = list(node.users)
            with graph.inserting_after(node):
                ones = graph.call_function(aten._to_copy.default, (kwargs["input"],), {"dtype": dtype})
            with graph.inserting_after(ones):
                more = graph.call_function(aten.mul.Tensor, (ones, offset))
            with graph.inserting_after(more):
                shifted = graph.call_function(aten.add.Tensor, (node, more))
            for user in users:
                user.replace_input_with(node, shifted)
            continue
        with graph.inserting_before(node):
            end = graph.call_function(operator.add, (offset, kwargs["end"]))
        if node.target.overloadpacket is aten.slice:  # type: ignore[union-attr]
            node.args, node.kwargs = (kwargs["input"], kwargs["dim"], offset, end, kwargs["step"]), {}
        else:
            kwargs.pop("step", None)
            kwargs.update(start=offset, end=end)
            node.target, node.args, node.kwargs = aten.arange.start, (), kwargs
    graph.lint()
    gm.recompile()
    return gm


def index_positions(gm: fx.GraphModule, plan: PositionPlan) -> fx.GraphModule:
    """A copy of ``gm`` (sharing its modules and tensors) whose position readers read a last input ``positions``.

    ``positions`` holds one position per time step (``(T,)`` long): ``arange(T)`` becomes ``positions`` (in
    arange's dtype), ``table[:T]`` along dim ``d`` becomes ``table.index_select(d, positions)``, a count of
    ones ``x.cumsum(d)`` becomes ``x * (positions + 1)`` along ``d``. Call it before
    :func:`offset_positions` (``plan`` names ``gm``'s nodes). The proof that every time step is computed from its
    own token and position alone (outside the sites) holds for any positions, so a ragged batch can run with
    its rows folded into the time axis, each slot carrying its row's position. Ends with ``lint()``.
    """
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, env))
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    with graph.inserting_after(last):
        positions = graph.placeholder("positions")
    for old in plan.shifted:
        node = env[old]
        kw = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
        assert kw is not None
        kwargs = dict(kw.kwargs)
        if node.target.overloadpacket is aten.slice:  # type: ignore[union-attr]
            node.target, node.args, node.kwargs = aten.index_select.default, (kwargs["input"], kwargs["dim"],
                                                                                positions), {}
        elif node.target.overloadpacket is aten.cumsum:  # type: ignore[union-attr]
            # ones counted along dim d: ``x * (positions + 1)``, the positions laid along d
            x, val = kwargs["input"], meta_value(old)
            d = _dim(kwargs["dim"], val.dim())
            with graph.inserting_before(node):
                count = graph.call_function(aten.add.Tensor, (positions, 1))
                count = graph.call_function(aten._to_copy.default, (count,), {"dtype": val.dtype})
                count = graph.call_function(aten.view.default, (count, [-1] + [1] * (val.dim() - 1 - d)))
                ones = graph.call_function(aten._to_copy.default, (x,), {"dtype": val.dtype})
            node.target, node.args, node.kwargs = aten.mul.Tensor, (ones, count), {}
        else:
            node.target, node.args = aten._to_copy.default, (positions,)
            node.kwargs = {"dtype": meta_value(old).dtype, "device": meta_value(old).device}
    graph.lint()
    return fx.GraphModule(gm, graph, class_name=f"{type(gm).__name__}Rows")


__all__ = ["PositionError", "PositionPlan", "analyse_positions", "describe", "index_positions", "offset_positions"]
