"""Drop dead copies: pure reads of a tensor (``clone``, ``detach``, casts, views) whose result nobody uses.

Code that keeps the attention scores for later inspection (``qk_similarities = sim.clone()`` in
x-transformers' ``Attend``, ``pre = scores.detach()`` in debugging hooks) leaves, once the caller
discards that copy, a node with no users in the captured graph: dynamo does not remove it. As a
second reader of the scores it would block the site, although nothing ever sees its value.

This pass erases such nodes, repeatedly (a dead ``sim.clone().float()`` goes too), before the sites
are found. Only the ops in :data:`PURE_METHODS` and :data:`PURE_FUNCTIONS` are erased: each returns a
new tensor or a view and writes nothing, so erasing it changes no value the graph computes. FX's own
``eliminate_dead_code`` is not used: it treats every ``call_method`` as pure, in-place ones included.

Example: ``s = q @ k.transpose(-2, -1); c = s.clone(); p = s.softmax(-1); return p @ v`` loses ``c``,
and the softmax's scores then have one reader.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

#: Tensor methods that read their input and return a new tensor or a view of it, writing nothing.
PURE_METHODS = frozenset((
    "clone", "detach", "contiguous", "float", "half", "double", "bfloat16", "type", "type_as", "to",
    "view", "view_as", "reshape", "reshape_as", "transpose", "permute", "expand", "expand_as", "unsqueeze",
    "squeeze", "flatten", "unflatten", "t", "size", "dim",
))

#: Functions of the same kind.
PURE_FUNCTIONS = frozenset((
    torch.clone, torch.detach, torch.transpose, torch.permute, torch.reshape, torch.flatten, torch.unsqueeze,
    torch.squeeze, operator.getitem, torch.ops.aten.clone.default, torch.ops.aten.detach.default,
    torch.ops.aten.alias.default, torch.ops.aten.view.default, torch.ops.aten._to_copy.default,
))


def is_dead_copy(node: fx.Node) -> bool:
    """``node`` has no users and is one of the pure reads above."""
    if node.users or node.op not in ("call_method", "call_function"):
        return False
    if node.op == "call_method":
        return str(node.target) in PURE_METHODS
    try:
        return node.target in PURE_FUNCTIONS
    except TypeError:  # an unhashable target
        return False


def drop_dead_copies(gm: fx.GraphModule) -> int:
    """Erase every dead pure read in ``gm`` (to a fixed point); the number erased. Recompiles when any was."""
    erased = 0
    changed = True
    while changed:
        changed = False
        for node in reversed(list(gm.graph.nodes)):
            if is_dead_copy(node):
                gm.graph.erase_node(node)
                erased += 1
                changed = True
    if erased:
        gm.graph.lint()
        gm.recompile()
    return erased


__all__ = ["PURE_FUNCTIONS", "PURE_METHODS", "drop_dead_copies", "is_dead_copy"]
