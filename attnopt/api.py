"""Public entry points: ``optimize``, ``rewrite``, ``explain``."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from .backend import attnopt_backend
from .config import OptimizeConfig
from .pipeline import run_pipeline
from .report import Report

_REPORT_ATTR = "_attnopt_report"


def optimize(model: nn.Module, *, variant: str = "auto", compile: bool = False, verify: bool = False,
             dynamic: bool | None = None) -> nn.Module:
    """Return ``model`` with every provable attention site running through a faster candidate.

    The result is ``torch.compile(model, backend=<attnopt>)``: same call signature, same
    parameters, same outputs and gradients. Graphs are captured on the first call and again
    for new shapes (dynamo recompiles; with ``dynamic=None`` the second shape makes sizes
    symbolic). ``attnopt.explain(opt)`` shows what was found and decided.

    Args:
        model: the ``nn.Module`` to optimize; its code is not changed.
        variant: ``"auto"`` (SDPA wherever legal), ``"sdpa"``, ``"eager"`` (rewrite nothing),
            or a registered candidate name.
        compile: hand the rewritten graphs to Inductor (needs a C++ compiler on CPU).
        verify: on first inputs, run original and rewritten graphs and drop rewrites that
            differ beyond the dtype's tolerance (with a warning).
        dynamic: passed to ``torch.compile``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"attnopt.optimize expects a torch.nn.Module, got {type(model).__name__}; "
                        "wrap a function in an nn.Module or use attnopt.rewrite on a GraphModule")
    config = OptimizeConfig(variant=variant, compile=compile, verify=verify)
    report = Report()
    backend = functools.partial(attnopt_backend, config=config, report=report)
    opt = torch.compile(model, backend=backend, dynamic=dynamic)
    object.__setattr__(opt, _REPORT_ATTR, report)
    return opt


def rewrite(gm: fx.GraphModule, example_inputs: Sequence[Any] | None = None, *, variant: str = "auto",
            verify: bool = False) -> fx.GraphModule:
    """Rewrite the attention in a GraphModule you already have (symbolic_trace, torch.export).

    ``gm`` is not modified; a new GraphModule sharing its parameters is returned, with the
    report in ``new_gm.meta["attnopt_report"]``. Graphs without shape metadata (``symbolic_trace``)
    need ``example_inputs``; causal masks read from buffers are proven on their current values.
    """
    if isinstance(gm, torch.export.ExportedProgram):
        raise TypeError("pass exported_program.module() (a GraphModule), not the ExportedProgram")
    if not isinstance(gm, fx.GraphModule):
        raise TypeError(f"attnopt.rewrite expects a torch.fx.GraphModule, got {type(gm).__name__}; "
                        "for an nn.Module use attnopt.optimize(model)")
    if example_inputs is not None:
        example_inputs = tuple(example_inputs)
        n = sum(1 for node in gm.graph.nodes if node.op == "placeholder")
        if len(example_inputs) != n:
            raise TypeError(f"the GraphModule takes {n} input(s), got {len(example_inputs)} example input(s)")
    config = OptimizeConfig(variant=variant, verify=verify)
    new_gm, records = run_pipeline(gm, example_inputs, config)
    report = Report(records=records, graphs=1)
    new_gm.meta["attnopt_report"] = report
    return new_gm


def explain(model: nn.Module | fx.GraphModule, *args: Any, variant: str = "auto", **kwargs: Any) -> Report:
    """What attnopt finds and decides for ``model`` called with ``args``/``kwargs``.

    For a model returned by ``optimize`` called without inputs, the report of what it has
    captured so far. Otherwise the model is captured on the inputs (one forward run, no
    gradients) and the report is returned; nothing about ``model`` changes.
    """
    report = getattr(model, _REPORT_ATTR, None)
    if isinstance(report, Report):
        if args or kwargs:
            _check_call(model, args, kwargs)
            with torch.no_grad():
                model(*args, **kwargs)
        return report
    if isinstance(model, fx.GraphModule) and "attnopt_report" in model.meta:
        return model.meta["attnopt_report"]
    if not isinstance(model, nn.Module):
        raise TypeError(f"attnopt.explain expects a torch.nn.Module, got {type(model).__name__}")
    _check_call(model, args, kwargs)
    report = Report()
    config = OptimizeConfig(variant=variant)
    backend = functools.partial(attnopt_backend, config=config, report=report)
    with torch.no_grad():
        torch.compile(model, backend=backend)(*args, **kwargs)
    return report


def _check_call(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    fn = getattr(model, "_orig_mod", model).forward
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"these inputs do not match {type(getattr(model, '_orig_mod', model)).__name__}"
                        f".forward{sig}: {e}") from e


__all__ = ["optimize", "rewrite", "explain"]
