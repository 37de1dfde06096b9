"""Route a cached LM's linear layers through :func:`attnopt.runtime.linear.linear` and ``addmm``.

The KV cache's graphs (``CachedLM.run`` and its ragged-batch ``rows_module``) run eagerly, and a decode step is
a pass over the model's weights: which kernel multiplies them sets the step's speed. This pass registers the
weights and biases of ``gm``'s linear layers as one group (:func:`attnopt.runtime.linear.register`) and makes
them call :func:`attnopt.runtime.linear.linear` (for ``aten.linear``) or :func:`attnopt.runtime.linear.addmm`
(for ``aten.addmm`` with a weight stored ``(in, out)``, GPT-2's ``Conv1D``) with the same arguments and the
group's number; those pick the op as written or oneDNN's inner product for the group by measurement and check
oneDNN's results first (see that module). Only layers whose weight and bias are the graph's own tensors
(``get_attr``) are routed, and an ``addmm`` only with its default ``beta``/``alpha`` and a 1-D bias. Nothing
else changes, and a graph handed to Inductor (``cached(..., compile=True)``) is not touched: Inductor picks
its own kernels there.

Example::

    before:  linear = torch.ops.aten.linear.default(x, _attr3, _attr4)
             addmm = torch.ops.aten.addmm.default(_attr9, view_1, _attr8)
    after:   linear = attnopt.runtime.linear.linear(x, _attr3, _attr4, 0)
             addmm = attnopt.runtime.linear.addmm(_attr9, view_1, _attr8, 0)
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..runtime.linear import addmm, linear, register

aten = torch.ops.aten


def _tensor(gm: fx.GraphModule, arg: object) -> torch.Tensor | None:
    if isinstance(arg, fx.Node) and arg.op == "get_attr":
        value = getattr(gm, str(arg.target), None)
        if isinstance(value, torch.Tensor):
            return value
    return None


def _layer(gm: fx.GraphModule, node: fx.Node) -> tuple[torch.Tensor, torch.Tensor | None, bool] | None:
    """``(weight, bias, in_out)`` of a linear layer node this pass routes, else None."""
    if node.op != "call_function" or node.kwargs:
        return None
    if node.target is aten.linear.default:
        bias_arg = node.args[2] if len(node.args) > 2 else None
        w, b = _tensor(gm, node.args[1]), _tensor(gm, bias_arg)
        if w is None or (bias_arg is not None and b is None):
            return None  # a weight computed in the graph: left to aten.linear
        return w, b, False
    if node.target is aten.addmm.default and len(node.args) == 3:  # beta = alpha = 1
        b, w = _tensor(gm, node.args[0]), _tensor(gm, node.args[2])
        if w is None or b is None or w.dim() != 2 or b.dim() != 1:
            return None
        return w, b, True
    return None


def use_fast_linear(gm: fx.GraphModule, name: str = "") -> int | None:
    """Point ``gm``'s linear layers at :mod:`attnopt.runtime.linear`; return their group's number (None where
    no node was routed)."""
    found = [(node, layer) for node in gm.graph.nodes if (layer := _layer(gm, node)) is not None]
    if not found:
        return None
    group = register([layer for _, layer in found], name)
    for node, (_, _, in_out) in found:
        if in_out:
            node.target, node.args = addmm, (*node.args, group)
        else:
            x, w = node.args[:2]
            node.target, node.args = linear, (x, w, node.args[2] if len(node.args) > 2 else None, group)
    gm.graph.lint()
    gm.recompile()
    return group
