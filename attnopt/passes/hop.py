"""Attention inside the bodies of higher-order ops: activation checkpointing and ``wrap``.

Matches ``call_function`` nodes whose target is a higher-order op (``torch.ops.higher_order.*``) with a
``get_attr`` of a GraphModule among its arguments, at any depth: dynamo captures
``torch.utils.checkpoint.checkpoint(fn, *args)`` (reentrant or not; also ``checkpoint_wrapper`` and
Hugging Face's gradient checkpointing) as ::

    wrap_body_0 = self.wrap_body_0
    tag_activation_checkpoint = torch.ops.higher_order.tag_activation_checkpoint(wrap_body_0, l_x_, l_w_, ...)
    x = tag_activation_checkpoint[0]

with the checkpointed code, attention included, in the submodule ``wrap_body_0``. :func:`bodies` lists
each body with the op that runs it and, for each of its placeholders, the node of the captured graph
passed there at every call (so the example values that prove a causal mask reach the body).
Sites are found and rewritten inside a body by the ordinary passes; the op call stays as it is, so
the body is still checkpointed: its activations are recomputed in the backward, attention included.
Bodies of other ops (``cond``, ``map``, ``autograd_function_apply``, ...) are searched too, and their
sites reported left alone with that reason.

Emits nothing new in the outer graph but a name: a body that now holds a site gets an attribute of
its own (:func:`rename_rewritten`: ``wrap_body_0`` -> ``wrap_body_0_rewritten``), and in the body
the ordinary site call::

    wrap_body_0_rewritten = self.wrap_body_0_rewritten
    tag_activation_checkpoint = torch.ops.higher_order.tag_activation_checkpoint(wrap_body_0_rewritten, l_x_, ...)
    # in the body:
    attnopt_wrap_body_0_site0 = self.attnopt_wrap_body_0_site0(q, k, v, mask, None, None, l_bias_)

Sites tune and check their candidate outside any checkpoint (:func:`attnopt.runtime.dispatch.apart`),
so the checkpoint's forward and its recomputation run the same operations; guards on module buffers
passed into a body are pinned like the outer graph's (:func:`settle`). A body's shapes follow what its
calls pass (:func:`shapes_from_calls`). Sites with dropout under checkpointing are left alone (the
recomputation would draw other masks; the backend sends such graphs to AOTAutograd as written).

Example::

    for body in bodies(gm):
        body.path, body.op, body.checkpointed   # ('wrap_body_0', 'tag_activation_checkpoint', True)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ..env import strict_guards
from ..runtime.guards import BufferGuard
from ..runtime.site import GUARDED_ARGS_START, AttentionSite
from ..spec import LEFT_ALONE, REWRITTEN, SiteRecord
from .canon import is_call_input, meta_value
from .find_sites import Match, place_of

#: Higher-order ops whose body attnopt rewrites, and how ``explain()`` names them. Both call their body
#: with the op's operands in order; checkpointing runs it under ``torch.utils.checkpoint``.
REWRITTEN_INSIDE = {"tag_activation_checkpoint": "activation checkpointing", "wrap": "wrap"}
_CHECKPOINTING = "tag_activation_checkpoint"


@dataclass
class Body:
    """One GraphModule that a higher-order op runs, and where it sits in the captured graph."""

    path: str  # attribute path from the captured graph: "wrap_body_0", "wrap_body_2.wrap_body_1"
    module: fx.GraphModule
    op: str  # the op's name: "tag_activation_checkpoint", "wrap", "cond", ...
    calls: list[fx.Node] = field(default_factory=list)  # the op's call nodes that run it (in its owner's graph)
    #: it runs under activation checkpointing (its own op's or an enclosing body's)
    checkpointed: bool = False
    #: the body that holds this one's op call (None: the captured graph does)
    parent: Body | None = None
    #: placeholder -> the captured graph's node passed to it at each call (None: computed in a body)
    sources: dict[fx.Node, list[fx.Node | None]] = field(default_factory=dict)

    @property
    def refusal(self) -> str | None:
        """Why attnopt does not rewrite inside this body (or one that holds it), or None."""
        if self.parent is not None and self.parent.refusal is not None:
            return self.parent.refusal
        if self.op not in REWRITTEN_INSIDE:
            return (f"attnopt rewrites attention inside {' and '.join(f'`{op}`' for op in REWRITTEN_INSIDE)} "
                    "bodies only")
        return _disagreement(self)

    @property
    def where(self) -> str:
        """``activation checkpointing (wrap_body_0)``: what ``explain()`` says about the body's sites."""
        return f"{REWRITTEN_INSIDE.get(self.op, f'a `{self.op}` body')} ({self.path})"


def bodies(gm: fx.GraphModule) -> list[Body]:
    """Every higher-order op body ``gm`` runs, outer bodies before the bodies they hold, each once."""
    out: list[Body] = []
    _collect(gm, "", {}, None, out)
    return out


def direct_bodies(gm: fx.GraphModule) -> list[str]:
    """The attribute names of the bodies ``gm``'s own graph passes to higher-order ops."""
    return sorted({str(arg.target) for node in gm.graph.nodes if _is_hop(node)
                   for arg in node.args if _body_attr(gm, arg) is not None})


def _is_hop(node: fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator)


def _body_attr(gm: fx.GraphModule, arg: Any) -> fx.GraphModule | None:
    if not (isinstance(arg, fx.Node) and arg.op == "get_attr"):
        return None
    sub = getattr(gm, str(arg.target), None)
    return sub if isinstance(sub, fx.GraphModule) else None


def _collect(gm: fx.GraphModule, prefix: str, outer: dict[fx.Node, list[fx.Node | None]],
             parent: Body | None, out: list[Body]) -> None:
    """Add ``gm``'s bodies to ``out``; ``outer`` maps ``gm``'s placeholders to the captured graph's nodes."""
    mine: dict[str, Body] = {}
    for node in gm.graph.nodes:
        if not _is_hop(node):
            continue
        op = node.target.name()  # type: ignore[union-attr]
        for arg in node.args:
            sub = _body_attr(gm, arg)
            if sub is None:
                continue
            body = mine.get(str(arg.target))
            if body is None:
                checkpointed = op == _CHECKPOINTING or (parent is not None and parent.checkpointed)
                body = mine[str(arg.target)] = Body(f"{prefix}{arg.target}", sub, op, checkpointed=checkpointed,
                                                    parent=parent)
            body.calls.append(node)
            placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
            passed = operands(body, node) or [None] * len(placeholders)  # not passed in order: nothing known
            for p, a in zip(placeholders, passed):
                if not isinstance(a, fx.Node):
                    here: list[fx.Node | None] = [None]
                elif not prefix:
                    here = [a]  # a node of the captured graph itself
                elif a.op == "placeholder":
                    here = outer.get(a, [None])
                else:
                    here = [None]
                body.sources.setdefault(p, []).extend(here)
    for body in mine.values():
        out.append(body)
        _collect(body.module, f"{body.path}.", body.sources, body, out)


def operands(body: Body, call: fx.Node) -> list[Any] | None:
    """What ``call`` passes to ``body``'s placeholders, in order; None when it does not pass them so."""
    placeholders = [n for n in body.module.graph.nodes if n.op == "placeholder"]
    if body.op not in REWRITTEN_INSIDE or not call.args or call.args[0].target != _attr_of(body):
        return None
    passed = list(call.args[1:])
    return passed if len(passed) == len(placeholders) else None


def _attr_of(body: Body) -> str:
    return body.path.rsplit(".", 1)[-1]


def _describe(value: Any) -> str:
    """A tensor's shape, dtype and device as text (SymInts by name: comparing them adds no guard)."""
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {value.dtype} {value.device}"
    return repr(value)


def _disagreement(body: Body) -> str | None:
    passed = [operands(body, c) for c in body.calls]
    if any(p is None for p in passed):
        return f"its `{body.op}` call does not pass the body's inputs in order"
    seen = {tuple(_describe(meta_value(a)) for a in p) for p in passed}  # type: ignore[union-attr]
    if len(seen) > 1:
        return f"its {len(body.calls)} calls pass tensors of different shapes, dtypes or devices"
    return None


def shapes_from_calls(body: Body) -> bool:
    """Make ``body``'s shapes those of what its calls pass, when they are not; True when they changed.

    A captured body carries the shapes it was traced with. When the graph around it is propagated
    again for other inputs (``rewrite()`` proving a new input signature), its op calls pass other
    shapes; the body's own are then propagated again from those (``FakeTensorProp``).
    """
    passed = operands(body, body.calls[0])
    placeholders = [n for n in body.module.graph.nodes if n.op == "placeholder"]
    if passed is None:
        return False
    values = [meta_value(a) for a in passed]
    if all(_describe(meta_value(p)) == _describe(v) for p, v in zip(placeholders, values)):
        return False
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = next((v.fake_mode for v in values if isinstance(v, FakeTensor)), None)
    mode = mode or FakeTensorMode(allow_non_fake_inputs=True)
    for node in body.module.graph.nodes:
        for key in ("val", "example_value", "tensor_meta"):
            node.meta.pop(key, None)
    FakeTensorProp(body.module, mode).propagate_dont_convert_inputs(
        *(mode.from_tensor(v) if isinstance(v, torch.Tensor) and not isinstance(v, FakeTensor) else v
          for v in values))
    return True


def values_of(body: Body, concrete: dict[fx.Node, torch.Tensor]) -> list[torch.Tensor | None]:
    """The real example value of each of ``body``'s placeholders, where every call passes the same one."""
    out: list[torch.Tensor | None] = []
    for p in (n for n in body.module.graph.nodes if n.op == "placeholder"):
        values = [concrete.get(s) if s is not None else None for s in body.sources.get(p, [None])]
        first = values[0]
        same = first is not None and all(
            v is not None and (v is first or (v.shape == first.shape and v.dtype == first.dtype
                                              and v.device == first.device and torch.equal(v, first)))
            for v in values)
        out.append(first if same else None)
    return out


def claim(body: Body, found: list[Match | SiteRecord]) -> list[Match | SiteRecord]:
    """``body``'s matches and near misses, named after the body and marked with where they are.

    Sites in bodies attnopt does not rewrite inside, and sites with dropout under activation
    checkpointing (whose recomputation in the backward would draw other masks), are left alone.
    """
    prefix = body.path.replace(".", "_")
    out: list[Match | SiteRecord] = []
    for f in found:
        record = f.record if isinstance(f, Match) else f
        record.name = f"{prefix}_{record.name}"
        record.extra["inside"] = body.where
        if not record.module_path:
            record.module_path = place_of(body.calls[0])[0]
        why = None
        refusal = body.refusal
        if isinstance(f, Match) and refusal is not None:
            why = f"inside {body.where}: {refusal}"
        elif isinstance(f, Match) and body.checkpointed and f.spec.dropout_mode != "off":
            why = (f"dropout inside {body.where}: the checkpoint's recomputation in the backward would draw "
                   "other dropout masks than the forward; left as written")
        if why is not None:
            record.decision = LEFT_ALONE
            record.reason = why
            out.append(record)
        else:
            out.append(f)
    return out


def note_inside(record: SiteRecord) -> None:
    """Say in ``record``'s reason that its site is inside a body (once)."""
    where = record.extra.get("inside")
    if where and where not in record.reason:
        checkpointed = str(where).startswith(REWRITTEN_INSIDE[_CHECKPOINTING])
        still = ", still checkpointed" if checkpointed and record.decision == REWRITTEN else ""
        record.reason = f"{record.reason}; inside {where}{still}" if record.reason else f"inside {where}{still}"


def rename_rewritten(gm: fx.GraphModule) -> list[str]:
    """Give each body of ``gm``'s own graph that now holds a site an attribute name of its own; the new names.

    ``wrap_body_0`` becomes ``wrap_body_0_rewritten``: what follows a graph as written by attribute
    name (``rewrite()``'s dispatch by input signature keeps the graph as written in step with the
    rewritten one) must not take the rewritten body for the body as written, nor the other way round.
    """
    renamed = []
    for name in direct_bodies(gm):
        body = getattr(gm, name)
        if not any(isinstance(m, AttentionSite) for m in body.modules()):
            continue
        new = f"{name}_rewritten"
        while hasattr(gm, new):
            new += "_"
        gm.add_submodule(new, body)
        for node in gm.graph.nodes:
            if node.op == "get_attr" and node.target == name:
                node.target = new
        delattr(gm, name)
        renamed.append(new)
    if renamed:
        gm.graph.lint()
        gm.recompile()
    return renamed


# ----------------------------------------------------------------------------- the sites of checkpointed bodies


def settle(body: Body) -> int:
    """After the rewrite: give ``body``'s sites what running inside it needs; how many sites it has.

    A guard on a tensor that is module state at every call (a causal ``bias`` buffer) is pinned to
    the tensor object and its version, as in the outer graph, instead of re-read on every call. (Sites
    under activation checkpointing need nothing more: every site tunes and checks its candidate outside
    any checkpoint, see :func:`attnopt.runtime.dispatch.apart`.)
    """
    gm = body.module
    count = 0
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        site = gm.get_submodule(str(node.target))
        if not isinstance(site, AttentionSite):
            continue
        count += 1
        for g, arg in zip(site.guards, node.args[GUARDED_ARGS_START:]):
            roots = body.sources.get(arg, [None]) if isinstance(arg, fx.Node) else [None]
            if isinstance(g, BufferGuard) and all(r is not None and not is_call_input(r) for r in roots):
                g.strict = strict_guards()
    return count


__all__ = ["REWRITTEN_INSIDE", "Body", "bodies", "claim", "direct_bodies", "note_inside", "operands",
           "rename_rewritten", "settle", "shapes_from_calls", "values_of"]
