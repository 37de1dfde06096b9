"""Make sure every node carries a shape: the matcher proves conditions from ``node.meta``.

Graphs from dynamo (``example_value``) and ``torch.export`` (``val``) already carry fake
tensors, symbolic sizes included; nothing is done for them. A ``symbolic_trace`` graph has no
meta, so it is propagated here with fake copies of the example inputs
(``FakeTensorProp``), which costs no real compute.

Example::

    gm = torch.fx.symbolic_trace(block)
    ensure_shapes(gm, (torch.randn(2, 16, 64),))
    gm.graph.find_nodes(op="call_function", target=torch.matmul)[0].meta["val"].shape
    # torch.Size([2, 4, 16, 16])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from .canon import meta_value


def has_shapes(gm: fx.GraphModule) -> bool:
    nodes = [n for n in gm.graph.nodes if n.op not in ("output",)]
    return bool(nodes) and all(meta_value(n) is not None for n in nodes if n.op == "placeholder")


def ensure_shapes(gm: fx.GraphModule, example_inputs: Sequence[Any] | None) -> None:
    """Fill ``node.meta["val"]`` from ``example_inputs`` when the graph has no shapes yet."""
    if has_shapes(gm):
        return
    if example_inputs is None:
        raise ValueError(
            "this GraphModule carries no shape information (node.meta); pass example inputs: "
            "attnopt.rewrite(gm, example_inputs=(x,))")
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
    FakeTensorProp(gm, mode).propagate(*fakes)
