"""Rewrite proven sites: replace ``softmax(scale * q @ k^T + mask) @ v`` with one site module.

Matches: the :class:`~attnopt.passes.find_sites.Match` objects that ``find_sites`` proved.
Emits, before the site's ``P @ V`` node::

    q1   = q * t            # only for per-head factor tensors, folded into q (keeps gradients to t)
    k    = kT.transpose(-2, -1)   # only when the product read a pre-transposed K
    mask = ~cond  /  where(cond, -inf, 0.0) + m ...   # the masks, combined for SDPA (bool/int added: m.to(dtype))
    s    = 0.125 * attr_scale        # only for run-time numbers (float module attributes)
    out  = attnopt_site0(q1, k, v, mask, s, dropout_p, *guarded_buffers, scale_tensor=t0)  # t0: 0-d scales

A mask that a causal proof with buffer guards replaces on every call where the guards hold (nanoGPT's
``bias[:, :, :T, :T] == 0``) is not built per call: the nodes that compute it only for the site move into the
site as ``mask_fn`` (a small GraphModule), the call passes their inputs (``mask_inputs=``), and the site builds
the mask only on a call that needs it (:func:`defer_mask`).

then redirects the users of ``P @ V`` to ``out``, hands readers of a removed node's dtype or shape alone
(``x.type_as(s)``, ``mask.expand_as(s)``) q or a one-element stand-in of that shape, and removes the dead
scores, probabilities and transposes. The ``AttentionSite`` module is added to the GraphModule, so ``gm.code``
shows the call and ``print(gm)`` shows its spec. Ends with ``graph.lint()`` and ``recompile()``.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from ..runtime.guards import BufferGuard, ConditionGuard
from ..runtime.sinks import sink_operands
from ..runtime.site import AttentionSite, BoundedFillSite, MixedFillSite
from ..spec import REWRITTEN
from .canon import attr_value, dtype_of, is_call_input, is_zero_dim_tensor, meta_value, shape_of, writes
from .find_sites import Match, SizeOf, reads_only_dtype, reads_only_shape
from .masks import Add, Fill


def _relaid(graph: fx.Graph, x: fx.Node, steps: tuple[tuple[str, tuple[Any, ...]], ...]) -> fx.Node:
    """``x`` brought to the site's layout by ``steps`` (``find_sites.relayout``: ``unflatten(0, (B, H))``, ...);
    a :class:`SizeOf` argument is read from its tensor at run time."""
    def value(a: Any) -> Any:
        if isinstance(a, SizeOf):
            return graph.call_method("size", (a.node, a.dim))
        return tuple(value(e) for e in a) if isinstance(a, tuple) else a

    for name, args in steps:
        x = graph.call_method(name, (x, *(value(a) for a in args)))
    return x


def _cond(graph: fx.Graph, t: Fill) -> fx.Node:
    """A fill's condition in the site's layout, as a bool tensor (a 0/1 factor through :func:`binary_keep`)."""
    cond = _relaid(graph, t.cond, t.relayout)
    return graph.call_function(binary_keep, (cond,)) if t.binary else cond


def binary_keep(factor: torch.Tensor) -> torch.Tensor:
    """``factor == 1`` for a 0/1 keep factor (``w * factor + c * (1 - factor)``), checked on every call.

    The blend is a mask only while ``factor`` holds nothing but 0 and 1; a factor that holds another
    value (a buffer written since the capture) would make the rewrite compute something else, so
    that call raises instead of returning a wrong result.
    """
    keep = factor == 1
    binary = (keep | (factor == 0)).all()
    if torch.compiler.is_compiling():  # in a compiled graph (compile=True): no data-dependent branch
        torch._assert_async(binary, "attnopt: the keep factor of a rewritten `w * m + c * (1 - m)` mask is not 0/1")
        return keep
    if not bool(binary):
        raise ValueError("attnopt: the keep factor `m` of a rewritten `w * m + c * (1 - m)` mask holds values other "
                         "than 0 and 1, so the rewrite no longer computes what the code does; call "
                         "attnopt.optimize(model) again on the model as it is now, or keep `m` a 0/1 tensor")
    return keep


def zero_hidden_rows(out: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """``out`` with zeros in the rows where ``hidden`` (the scores' fill condition, ``[..., Tq, Tk]``) holds for
    every key: ``softmax(s.masked_fill(m, -inf)).masked_fill(m, 0) @ v`` as written."""
    return out.masked_fill(hidden.all(-1, keepdim=True), 0.0)


def nan_dead_rows(out: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``out`` with NaN in the rows whose every key ``mask`` hides (a bool keep-mask, or an additive one that is
    ``-inf`` there): ``softmax(s) @ v * sigmoid(logsumexp(s) - sink)`` is ``NaN * 0`` in such rows as written,
    where the sink as one more key gives zero."""
    dead = ~mask.any(-1, keepdim=True) if mask.dtype == torch.bool else torch.isneginf(mask).all(-1, keepdim=True)
    return out.masked_fill(dead, float("nan"))


def _emit_mask(graph: fx.Graph, m: Match) -> fx.Node | None:
    plan = m.mask
    if plan.kind == "none":
        return None
    if plan.causal == "top_left" and not plan.guarded and not plan.conditions and plan.window is None:
        return None  # structurally causal: is_causal=True always holds, no tensor needed
    mask: fx.Node | None = None
    if plan.kind == "bool":
        for t in plan.terms:
            cond = _cond(graph, t)
            keep = cond if t.keep_when_true else graph.call_function(torch.logical_not, (cond,))
            mask = keep if mask is None else graph.call_function(torch.logical_and, (mask, keep))
        return mask
    dtype = m.spec.compute_dtype
    for t in plan.terms:
        if isinstance(t, Add):
            added = _added(graph, t)
            added = added if t.factor == 1.0 else graph.call_function(scaled_mask, (added, t.factor))
            mask = added if mask is None else graph.call_function(operator.add, (mask, added))
        elif isinstance(t, Fill):
            keep = t.keep_when_true
            cond = _cond(graph, t)
            filled_when = cond if not keep else graph.call_function(torch.logical_not, (cond,))
            # a bounded finite fill alone reaches the candidate as the dtype's minimum (BoundedFillSite); next
            # to added masks as written, with ``filled`` beside it (MixedFillSite)
            value = torch.finfo(dtype).min if plan.bound_fill is not None and not plan.fill_with_adds else t.value
            if mask is None:
                mask = graph.call_function(_filled, (filled_when, value, dtype))
            else:
                mask = graph.call_function(torch.where, (filled_when, value, mask))
    return mask


def _added(graph: fx.Graph, t: Add) -> fx.Node:
    """An added term in the site's layout and, for a bool or integer mask, in the sum's dtype (as type promotion
    adds it), before its factor."""
    added = _relaid(graph, t.mask, t.relayout)
    md = dtype_of(t.mask)
    if md is not None and not md.is_floating_point and t.dtype is not None:
        added = graph.call_method("to", (added, t.dtype))
    return added


def _emit_key_bias(graph: fx.Graph, m: Match) -> fx.Node:
    """The sum of ``m.key_bias`` (added terms of one value per key, ``[..., 1, Tk]``) in the site's layout, as
    method calls (``unflatten``, ``to``, ``mul``) that the KV cache's position proof reads as ATen ops. A factor
    scales the term as written: ``(s + b) * f`` adds ``b * f``."""
    out: fx.Node | None = None
    for t in m.key_bias:
        added = _added(graph, t)
        if t.factor != 1.0:
            added = graph.call_method("mul", (added, t.factor))
        out = added if out is None else graph.call_method("add", (out, added))
    assert out is not None
    return out


def _emit_filled(graph: fx.Graph, m: Match) -> fx.Node | None:
    """Where a ``masked_fill`` replaced the score, for additive masks that also add terms.

    As written, a filled score gets no gradient while an added one does; on a row whose every key is
    hidden (the one case where that shows) the site computes the mask as written and needs to know
    which positions were filled. A fill replaces the score whatever is added after it, so this is
    the union of the fill conditions. None when the mask has no fill or nothing added.
    """
    plan = m.mask
    fills = [t for t in plan.terms if isinstance(t, Fill)]
    if plan.kind != "additive" or not fills or len(fills) == len(plan.terms):
        return None
    out: fx.Node | None = None
    for t in fills:
        cond = _cond(graph, t)
        cond = cond if not t.keep_when_true else graph.call_function(torch.logical_not, (cond,))
        out = cond if out is None else graph.call_function(torch.logical_or, (out, cond))
    return out


def scaled_mask(mask: torch.Tensor, factor: float) -> torch.Tensor:
    """``mask * factor`` for ``(scores + mask) * factor``, with the dtype's minimum (a masked key) kept in value.

    The site recognises rows whose keys all hold the minimum by that value; the gradient is
    ``factor`` everywhere, as written (rows with every key masked do send one to the mask). A factor
    above 1 takes the minimum to ``-inf``, exactly as the code as written does, so it is not kept.
    """
    scaled = mask * factor
    if factor > 1.0:
        return scaled  # the minimum overflows to -inf, as it does in ``(scores + mask) * factor``
    at_min = mask == torch.finfo(mask.dtype).min
    return scaled + torch.where(at_min, mask - scaled, torch.zeros((), dtype=mask.dtype, device=mask.device)).detach()


def _filled(cond: torch.Tensor, value: float, dtype: torch.dtype) -> torch.Tensor:
    """An additive mask: ``value`` where ``cond``, 0 elsewhere, in the scores' dtype."""
    return torch.where(cond, torch.tensor(value, dtype=dtype, device=cond.device),
                       torch.tensor(0.0, dtype=dtype, device=cond.device))


def rewrite_sites(gm: fx.GraphModule, matches: list[Match], candidate: str = "sdpa",
                  concrete: dict[fx.Node, torch.Tensor] | None = None, keep_sinks: bool = False) -> fx.GraphModule:
    """Replace every match in ``gm`` (in place) with an :class:`AttentionSite` call.

    An attention sink becomes one more key of q, k and v widened in the graph (:func:`sink_operands`), unless
    ``keep_sinks``: then the site call gets the sink's logits as ``sink=`` (and ``sink_lse=``), for the KV cache,
    which adds the sink's key to the cached ones itself."""
    graph = gm.graph
    concrete = concrete or {}
    for m in matches:
        with graph.inserting_before(m.output):
            q: fx.Node = m.q
            scale_tensor: fx.Node | None = None  # 0-d tensor factors, multiplied together
            for factor, how in m.scale_tensors:
                if is_zero_dim_tensor(factor):  # the site applies it (see AttentionSite.forward)
                    if scale_tensor is None:
                        scale_tensor = factor if how == "mul" else graph.call_function(operator.truediv, (1.0, factor))
                    else:
                        scale_tensor = graph.call_function(operator.mul if how == "mul" else operator.truediv,
                                                           (scale_tensor, factor))
                else:  # a per-head factor: folded into q, so gradients still reach it
                    q = graph.call_function(operator.mul if how == "mul" else operator.truediv, (q, factor))
            k = m.k if m.k is not None else graph.call_method("transpose", (m.k_t, -2, -1))
            q, k = _relaid(graph, q, m.q_relayout), _relaid(graph, k, m.k_relayout)  # to the site's layout
            mask = _emit_mask(graph, m)
            v = graph.call_method("transpose", (m.v, -2, -1)) if m.v_transposed else m.v
            v = _relaid(graph, v, m.v_relayout)
            guards = []
            guard_nodes: list[fx.Node] = []
            if mask is not None:
                for buf, (cuts, values) in zip(m.mask.guarded, m.mask.patterns):
                    t = concrete.get(buf)
                    if t is None and buf.op == "get_attr":
                        t = attr_value(gm, str(buf.target))
                    # a proof about a call input is never carried to the next call: checked on each
                    guards.append(BufferGuard.of(t, cuts, values, strict=True if is_call_input(buf) else None))
                    guard_nodes.append(buf)
                for node, all_true in m.mask.conditions:
                    guards.append(ConditionGuard(all_true))
                    guard_nodes.append(node)
            scale: Any = None
            if m.scale_nodes:
                scale = m.spec.scale
                for factor, how in m.scale_nodes:
                    scale = graph.call_function(operator.mul if how == "mul" else operator.truediv, (scale, factor))
            dead: fx.Node | None = None
            kept_sink: dict[str, Any] = {}
            if m.sink is not None and keep_sinks:
                sink = graph.call_method("unsqueeze", (m.sink, -1)) if m.sink_unsqueeze else m.sink
                kept_sink = {"sink": sink, "sink_lse": m.sink_lse}
            elif m.sink is not None:  # one more key: the sink's logit in every row, a zero value
                if scale_tensor is not None:  # folded into q here, so that the sink's column is not scaled
                    q, scale_tensor = graph.call_function(operator.mul, (q, scale_tensor)), None
                structural = m.mask.causal == "top_left" and mask is None
                sink = graph.call_method("unsqueeze", (m.sink, -1)) if m.sink_unsqueeze else m.sink
                dead = mask if m.sink_nan_rows else None  # the mask over the real keys, before the sink's
                widened = graph.call_function(sink_operands, (q, k, v, sink, m.spec.scale if scale is None
                                                              else scale, mask, structural, m.sink_lse))
                q, k, v, mask = (graph.call_function(operator.getitem, (widened, i)) for i in range(4))
                scale = 1.0  # q comes back scaled
            name = f"attnopt_{m.record.name}"
            while hasattr(gm, name):
                name += "_"
            where = f"{m.record.module_path} {m.record.source}".strip()
            site_cls = AttentionSite if m.mask.bound_fill is None else \
                MixedFillSite if m.mask.fill_with_adds else BoundedFillSite
            cut_fills = m.mask.kind == "additive" and any(isinstance(t, Fill) for t in m.mask.terms)
            site = site_cls(m.record.name, m.spec, candidate, guards, where, score_mod=m.score_mod,
                            cut_fills=cut_fills)
            filled = _emit_filled(graph, m) if mask is not None else None
            gm.add_submodule(name, site.train(gm.training))
            extra = {"filled": filled} if filled is not None else {}
            extra.update(kept_sink)
            if m.key_bias:
                extra["key_bias"] = _emit_key_bias(graph, m)
            if scale_tensor is not None:
                extra["scale_tensor"] = scale_tensor
            if m.zero_rows is not None:
                extra["zero_rows"] = m.zero_rows
            new = call = graph.call_module(name, (q, k, v, mask, scale, m.dropout_p, *guard_nodes), extra)
            if dead is not None:  # `NaN * sigmoid(-inf)` rows, as written
                new = graph.call_function(nan_dead_rows, (new, dead))
            if m.zero_rows is not None:  # probabilities zeroed where the scores were hidden: such rows are zero
                new = graph.call_function(zero_hidden_rows, (new, m.zero_rows))
            if m.v_transposed:
                new = graph.call_method("transpose", (new, -2, -1))
            new = _relaid(graph, new, m.out_relayout)  # back to the layout of P @ V as written
        for key in ("val", "example_value", "tensor_meta", "stack_trace", "nn_module_stack"):
            if key in m.output.meta:
                new.meta[key] = m.output.meta[key]
        m.output.replace_all_uses_with(new)
        _detach_metadata_users(m)
        _erase_unused(gm, m.internal, set(m.internal))
        if mask is not None and guards and m.sink is None:
            defer_mask(gm, call, site)
        m.record.decision = REWRITTEN
        m.record.rewrite = candidate
        m.record.spec = m.spec
        m.record.reason = m.spec.describe()
    graph.lint()
    gm.recompile()
    return gm


_PURE_MODULES = (torch.nn.Softmax, torch.nn.Dropout)


def defer_mask(gm: fx.GraphModule, call: fx.Node, site: AttentionSite) -> bool:
    """Move the computation of ``call``'s mask into ``site`` when a causal proof makes it unneeded.

    For a site whose causal pattern is proven on guarded buffers only (no run-time mask term), the mask
    tensor is read only on calls where a guard fails or the alignment needs it; building it every call
    (a slice, ``== 0``, ``logical_not`` over ``Tq x Tk``) is the largest per-call cost the rewrite adds.
    The nodes that compute the mask for this site alone (every user is another such node or the site's
    mask argument; calls of functions and methods that write nothing) become ``site.mask_fn``, and the call
    passes their inputs as ``mask_inputs``. Nothing in the graph between the first such node and the site
    may write any tensor (else the mask, built later, could read a new value). Returns whether it moved.
    """
    if site.spec.causal is None or any(isinstance(g, ConditionGuard) for g in site.guards):
        return False
    mask = call.args[3]
    if not isinstance(mask, fx.Node) or list(mask.users) != [call] or call.args.count(mask) != 1 \
            or mask in call.kwargs.values():
        return False
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    moved: set[fx.Node] = set()

    def movable(n: fx.Node) -> bool:
        if n.op not in ("call_function", "call_method") or n.is_impure() or n.kwargs.get("out") is not None:
            return False
        if n.op == "call_method" and str(n.target).endswith("_"):
            return False
        if any(writes(n, t, gm) for t in n.all_input_nodes):
            return False
        return all(u in moved or (u is call and n is mask) for u in n.users)

    # the mask's ancestors, latest first, so that every user of a node is decided before it
    pending = [mask]
    seen: set[fx.Node] = set()
    while pending:
        n = pending.pop()
        if n in seen:
            continue
        seen.add(n)
        pending.extend(n.all_input_nodes)
    for n in sorted(seen, key=order.__getitem__, reverse=True):
        if movable(n):
            moved.add(n)
    if mask not in moved:
        return False
    body = sorted(moved, key=order.__getitem__)
    start, end = order[body[0]], order[call]
    for w in gm.graph.nodes:
        if start <= order[w] < end and w not in moved and w.op in ("call_function", "call_method", "call_module") \
                and any(writes(w, t, gm) for t in w.all_input_nodes):
            return False
    leaves = list(dict.fromkeys(i for n in body for i in n.all_input_nodes if i not in moved))
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for leaf in leaves:
        env[leaf] = sub.placeholder(leaf.name)
        env[leaf].meta.update({k: v for k, v in leaf.meta.items() if k in ("val", "example_value", "tensor_meta")})
    for n in body:
        env[n] = sub.node_copy(n, lambda x: env[x])
    sub.output(env[mask])
    site.mask_fn = fx.GraphModule(torch.nn.Module(), sub, class_name="DeferredMask")
    call.args = (*call.args[:3], None, *call.args[4:])
    call.kwargs = {**call.kwargs, "mask_inputs": tuple(leaves)}
    for n in reversed(body):
        gm.graph.erase_node(n)
    return True


def _detach_metadata_users(m: Match) -> None:
    """Point ``s.new_full(...)``/``x.type_as(s)`` at q when they read a replaced node only for its dtype,
    and ``torch.ones_like(s, ...)``-style factories at a stand-in of ``s``'s shape, dtype and device
    (``q.new_empty(shape, dtype=...)``: allocated, never computed), when that shape is a constant.

    Otherwise a mask built with ``scores.new_full`` or ``torch.ones_like(scores)`` would keep the
    ``q @ k^T`` product alive.
    """
    from .find_sites import reads_only_like

    internal = set(m.internal)
    for node in m.internal:
        shaped = [u for u in node.users if u not in internal and reads_only_shape(u, node)]
        if shaped and dtype_of(node) is not None and _device(node) == _device(m.q):
            stand_in = _shape_stand_in(node, m)
            for user in shaped:
                user.replace_input_with(node, stand_in)
        likes = [u for u in node.users if u not in internal and reads_only_like(u, node)]
        shape = _dense_static_shape(node)
        if likes and shape is not None and _device(node) == _device(m.q) and dtype_of(node) is not None:
            for user in likes:
                with node.graph.inserting_before(user):
                    stand_in = node.graph.call_method("new_empty", (m.q, shape), {"dtype": dtype_of(node)})
                for key in ("val", "example_value", "tensor_meta"):
                    if key in node.meta:
                        stand_in.meta[key] = node.meta[key]
                user.replace_input_with(node, stand_in)
        if dtype_of(node) != dtype_of(m.q) or _device(node) != _device(m.q):
            continue
        for user in list(node.users):
            if user not in internal and reads_only_dtype(user, node) and not reads_only_like(user, node):
                user.replace_input_with(node, m.q)


def _shape_stand_in(node: fx.Node, m: Match) -> fx.Node:
    """A tensor with ``node``'s shape, dtype and device that holds one element: ``q.new_empty(()).expand(shape)``,
    for readers of the shape alone (``mask.expand_as(scores)``). The shape is the static one, or (proven by
    find_sites' rule *q, k, v shapes line up*) q's leading dims by Tk, read from q and k at run time."""
    graph = node.graph
    shape: Any = shape_of(node)
    first = next(n for n in graph.nodes if n in node.users)
    with graph.inserting_before(first):
        if not all(type(d) is int for d in shape):
            keys = m.k if m.k is not None else m.k_t
            tk = graph.call_method("size", (keys, -2 if m.k is not None else -1))
            shape = [graph.call_method("size", (m.q, i)) for i in range(len(shape) - 1)] + [tk]
        one = graph.call_method("new_empty", (m.q, ()), {"dtype": dtype_of(node)})
        stand_in = graph.call_method("expand", (one, *shape))
    for key in ("val", "example_value", "tensor_meta"):
        if key in node.meta:
            stand_in.meta[key] = node.meta[key]
    return stand_in


def _dense_static_shape(node: fx.Node) -> tuple[int, ...] | None:
    """``node``'s shape when every size is a constant and the tensor is contiguous (so a fresh tensor of that
    shape has its strides too, and ``rand_like`` draws the same numbers for each element), else None."""
    value = meta_value(node)
    shape, stride = getattr(value, "shape", None), getattr(value, "stride", None)
    if shape is None or stride is None or not all(type(d) is int for d in shape):
        return None
    stride = stride() if callable(stride) else stride
    expected, acc = [], 1
    for d in reversed(shape):
        expected.append(acc)
        acc *= max(d, 1)
    expected.reverse()
    if any(d != 1 and st != e for d, st, e in zip(shape, stride, expected)):
        return None
    return tuple(shape)


def _device(node: fx.Node) -> object:
    return getattr(meta_value(node), "device", None)


def _erase_unused(gm: fx.GraphModule, nodes: list[fx.Node], site_nodes: set[fx.Node] = frozenset()) -> None:
    """Erase ``nodes`` and then whatever fed only them (transposes, repeat_kv, mask pieces).

    Placeholders, attributes, in-place methods (except those the site itself proved to act
    only on its own scores, ``site_nodes``) and calls of modules other than
    ``nn.Softmax``/``nn.Dropout`` are never erased.
    """
    graph = gm.graph
    pending = list(nodes)
    erased: set[fx.Node] = set()
    while pending:
        node = pending.pop()
        if node in erased or node.users or node.op in ("placeholder", "get_attr", "output"):
            continue
        if node.op == "call_module" and not isinstance(gm.get_submodule(str(node.target)), _PURE_MODULES):
            continue
        if node not in site_nodes and (node.op == "call_method" and str(node.target).endswith("_")
                                       or node.is_impure()):
            continue
        inputs = list(node.all_input_nodes)
        graph.erase_node(node)
        erased.add(node)
        pending.extend(inputs)






