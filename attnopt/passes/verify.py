"""Check a rewritten graph against the original on real inputs, within the dtype's tolerance.

Matches nothing; runs both GraphModules on the same example inputs (no autograd, same RNG
state) and compares every tensor output. Emits a list of problems, empty when they agree.
The tolerance is the exactness contract's, :func:`attnopt.kernels.reference.tolerance` (``atol = rtol``:
fp64 1e-7, fp32 1e-4, bf16 2e-2, fp16 5e-3; other dtypes 1e-4). NaNs must sit at the same places;
integer and bool outputs must be equal.

Example::

    problems = compare_outputs(original, rewritten, example_inputs)
    # [] or ['output 0: max abs difference 0.31 exceeds tolerance (atol 0.0001, rtol 0.0001) or NaNs moved']
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from ..kernels.reference import tolerance


def compare_outputs(original: fx.GraphModule | Any, rewritten: fx.GraphModule | Any,
                    inputs: Sequence[Any]) -> list[str]:
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        state = torch.random.get_rng_state()
        expected = original(*inputs)
        torch.random.set_rng_state(state)
        actual = rewritten(*inputs)
    problems = []
    flat_e, _ = pytree.tree_flatten(expected)
    flat_a, _ = pytree.tree_flatten(actual)
    if len(flat_e) != len(flat_a):
        return [f"the rewritten graph returns {len(flat_a)} values, the original {len(flat_e)}"]
    for i, (e, a) in enumerate(zip(flat_e, flat_a)):
        if not isinstance(e, torch.Tensor):
            continue
        if not isinstance(a, torch.Tensor) or a.shape != e.shape or a.dtype != e.dtype:
            problems.append(f"output {i}: shape/dtype {tuple(getattr(a, 'shape', ()))}/{getattr(a, 'dtype', None)} "
                            f"instead of {tuple(e.shape)}/{e.dtype}")
            continue
        if not e.is_floating_point():
            if not torch.equal(e, a):
                problems.append(f"output {i}: values differ")
            continue
        atol, rtol = tolerance(e.dtype)
        if not torch.allclose(a.float(), e.float(), atol=atol, rtol=rtol, equal_nan=True):
            both = ~(torch.isnan(a) | torch.isnan(e))
            diff = (a.float() - e.float()).abs()[both].max().item() if both.any() else float("nan")
            problems.append(f"output {i}: max abs difference {diff:.3g} exceeds tolerance "
                            f"(atol {atol:g}, rtol {rtol:g}) or NaNs moved")
    return problems
