"""Route a cached LM's ``aten.linear`` calls through :func:`attnopt.kernels.linear.linear`.

The KV cache's graphs (``CachedLM.run`` and its ragged-batch ``rows_module``) run eagerly, and a decode step is
a pass over the model's weights: which kernel multiplies them sets the step's speed. This pass registers the
weights and biases of ``gm``'s ``aten.linear.default`` nodes as one group
(:func:`attnopt.kernels.linear.register`) and makes those nodes call :func:`attnopt.kernels.linear.linear`
with the same arguments and the group's number; that function picks ``F.linear`` or oneDNN's inner product
for the group by measurement and checks oneDNN's results first (see that module). Only nodes whose weight and
bias are the graph's own tensors (``get_attr``) are routed. Nothing else changes, and a graph handed to
Inductor (``cached(..., compile=True)``) is not touched: Inductor picks its own kernels there.

Example::

    before:  linear = torch.ops.aten.linear.default(x, _attr3, _attr4)
    after:   linear = attnopt.kernels.linear.linear(x, _attr3, _attr4, 0)
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..kernels.linear import linear, register


def _tensor(gm: fx.GraphModule, arg: object) -> torch.Tensor | None:
    if isinstance(arg, fx.Node) and arg.op == "get_attr":
        value = getattr(gm, str(arg.target), None)
        if isinstance(value, torch.Tensor):
            return value
    return None


def use_fast_linear(gm: fx.GraphModule, name: str = "") -> int | None:
    """Point ``gm``'s ``aten.linear`` nodes at :func:`~attnopt.kernels.linear.linear`; return their group's
    number (None where no node was routed)."""
    nodes, pairs = [], []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten.linear.default or node.kwargs:
            continue
        bias_arg = node.args[2] if len(node.args) > 2 else None
        w, b = _tensor(gm, node.args[1]), _tensor(gm, bias_arg)
        if w is None or (bias_arg is not None and b is None):
            continue  # a weight computed in the graph: left to aten.linear
        nodes.append(node)
        pairs.append((w, b))
    if not nodes:
        return None
    group = register(pairs, name)
    for node in nodes:
        x, w = node.args[:2]
        node.target = linear
        node.args = (x, w, node.args[2] if len(node.args) > 2 else None, group)
    gm.graph.lint()
    gm.recompile()
    return group
