"""Public entry points: ``optimize``, ``rewrite``, ``explain``."""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from .config import OptimizeConfig
from .env import AUTO, variant_override
from .pipeline.backend import attnopt_backend
from .pipeline.optimize import run_pipeline
from .pipeline.report import Report
from .pipeline.rewritten import RewrittenGraphModule, SignatureGuard, SignaturePattern, plain_copy
from .pipeline.snapshot import model_kept
from .pipeline.steps import new_selector
from .selection.selector import Selector

log = logging.getLogger(__name__)

_REPORT_ATTR = "_attnopt_report"
_SELECTOR_ATTR = "_attnopt_selector"
#: The model as written, on the object ``optimize`` returns: ``OptimizedModule`` keeps it as a submodule,
#: the generating copy (:func:`_generating_copy`) as a plain attribute (not in ``state_dict``).
_ORIGINAL_ATTR = "_orig_mod"


class _RecompileLimitNotes(logging.Filter):
    """Dynamo's warning that a function hit its recompile limit, as a note in the report of each optimized model
    whose forward it is, and a warning from attnopt saying what that means here.

    Past the limit dynamo runs the existing graphs when their guards hold and the function as written when not:
    calls with a new shape (under ``dynamic=False``) or new guarded Python state then run without attnopt's
    rewrites, correct but not faster, which ``explain()`` would not show otherwise."""

    def __init__(self) -> None:
        super().__init__()
        #: dynamo's name for a function (``'forward' (file:line)``) -> the reports of models compiled from it
        self.watched: dict[str, list[weakref.ref[Report]]] = {}

    def watch(self, fn: Any, report: Report) -> None:
        code = getattr(getattr(fn, "__func__", fn), "__code__", None)
        if code is not None:
            where = f"'{code.co_name}' ({code.co_filename}:{code.co_firstlineno})"
            live = [r for r in self.watched.get(where, []) if r() is not None]  # reports of models still alive
            self.watched[where] = [*live, weakref.ref(report)]

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if isinstance(record.msg, str) and record.msg.startswith("torch._dynamo hit config.") and len(args) >= 3:
            limit_type, limit, where = args[:3]
            for ref in list(self.watched.get(str(where), ())):
                report = ref()
                if report is None:
                    continue
                note = (f"dynamo hit config.{limit_type} ({limit}) for {where}: calls that need a new graph now run "
                        f"the model as written, without attnopt's rewrites; pass dynamic=True to attnopt.optimize, "
                        f"or raise torch._dynamo.config.{limit_type}")
                if note not in report.failures:
                    report.failures.append(note)
                    warnings.warn(f"attnopt: {note}", stacklevel=2)
        return True


_RECOMPILE_NOTES = _RecompileLimitNotes()
logging.getLogger("torch._dynamo.convert_frame").addFilter(_RECOMPILE_NOTES)


def optimize(model: nn.Module, *, variant: str = "auto", compile: bool = False, verify: bool = False,
             dynamic: bool | None = None, memory_budget: int | str | None = None,
             selector: Selector | None = None) -> nn.Module:
    """Return ``model`` with every provable attention site running through a faster candidate.

    The result is ``torch.compile(model, backend=<attnopt>)``: same call signature, same
    parameters, same outputs and gradients. Graphs are captured on the first call and again
    for new shapes (dynamo recompiles; with ``dynamic=None`` the second shape makes sizes
    symbolic). ``attnopt.explain(opt)`` shows what was found and decided.

    Args:
        model: the ``nn.Module`` to optimize; its code is not changed.
        variant: ``"auto"`` (time every legal candidate on this device for the real shapes and
            keep the fastest; see :mod:`attnopt.selection.selector`), ``"sdpa"``, ``"eager"`` (rewrite
            nothing), or a registered candidate name (``attnopt.candidate_names()``). The
            environment variable ``ATTNOPT_VARIANT`` overrides it.
        compile: hand the rewritten graphs to Inductor (needs a C++ compiler on CPU).
        verify: on first inputs, run original and rewritten graphs and drop rewrites that
            differ beyond the dtype's tolerance (with a warning).
        dynamic: passed to ``torch.compile``.
        memory_budget: peak bytes one attention call may allocate (int, or e.g. ``"512MiB"``);
            with ``variant="auto"`` candidates above it are not chosen.
        selector: a :class:`~attnopt.selection.selector.Selector` to use (e.g. with another cache or
            timer); by default one per optimized model, with the on-disk tuning cache.

    A model with a ``generate`` method (Hugging Face's ``GenerationMixin``) gets a shallow copy of itself
    instead, whose ``forward`` is ``torch.compile(model.forward, backend=<attnopt>)``: ``generate``
    calls ``forward``, so ``opt.generate(...)`` runs the rewritten attention too (an ``OptimizedModule``
    would forward ``generate`` to the model, which runs its own eager ``forward``). The copy is an
    instance of the model's class and one module with it: parameters, buffers, submodules and hooks
    are shared, ``state_dict()`` has the model's keys (no ``_orig_mod.`` prefix), ``opt._orig_mod`` is
    the model, ``opt.train()``/``opt.eval()`` set the model's mode as well, and its forward always runs
    with the model's own flags and attributes. ``copy.deepcopy(opt)`` and unpickling optimize a copy
    of the model again, with the same options (and selector) and an empty report.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"attnopt.optimize expects a torch.nn.Module, got {type(model).__name__}; "
                        "wrap a function in an nn.Module or use attnopt.rewrite on a GraphModule")
    asked, given = variant, selector  # what a deep copy or an unpickled copy is optimized with again
    variant = _variant_from_env(variant)
    if memory_budget is not None and variant != "auto" and variant_override():
        raise ValueError(f"memory_budget needs variant='auto', but ATTNOPT_VARIANT={variant!r} is set in the "
                         "environment; unset it or drop memory_budget")
    config = OptimizeConfig(variant=variant, compile=compile, verify=verify, memory_budget=memory_budget)
    if selector is not None and config.memory_budget is not None:
        raise ValueError("pass memory_budget to the Selector you give, not to optimize()")
    if selector is not None and config.candidate != AUTO:
        log.warning("variant=%r: the selector passed to optimize() is not used", variant)
    if config.candidate == AUTO and selector is None:
        selector = new_selector(config.memory_budget)
    report = Report()
    backend = functools.partial(attnopt_backend, config=config, report=report, selector=selector)
    if callable(getattr(type(model), "generate", None)):
        options = dict(variant=asked, compile=compile, verify=verify, dynamic=dynamic,
                       memory_budget=memory_budget, selector=given)
        opt = _generating_copy(model, torch.compile(model.forward, backend=backend, dynamic=dynamic), options)
    else:
        opt = torch.compile(model, backend=backend, dynamic=dynamic)
    _RECOMPILE_NOTES.watch(type(model).forward, report)
    object.__setattr__(opt, _REPORT_ATTR, report)
    object.__setattr__(opt, _SELECTOR_ATTR, selector)
    return opt


def _generating_copy(model: nn.Module, forward: Callable[..., Any], options: dict[str, Any]) -> nn.Module:
    """A shallow copy of ``model`` that runs ``forward`` (``model.forward`` compiled) for calls and ``generate``.

    The copy's ``__dict__`` holds the same objects as the model's: the same ``_parameters``,
    ``_buffers``, ``_modules`` and hook dictionaries, so a submodule, buffer or hook added through
    either is seen by both, and ``state_dict()`` keys are the model's. ``forward`` is bound to the
    model, so it reads the model's ``training`` flag and attributes; ``train(mode)`` (and ``eval()``,
    which calls it) is set on the copy to change the model's mode along with the copy's own flag.
    ``copy.deepcopy`` and ``pickle`` would keep ``forward`` bound to the original model (a function is
    copied by reference), so both optimize the copied model again instead (:func:`_reoptimize`).
    """
    opt = type(model).__new__(type(model))
    opt.__dict__.update(vars(model))
    state = opt.__dict__
    state.pop("_compiled_call_impl", None)  # model.compile(): it would call the model's own forward
    state["forward"] = forward
    state[_ORIGINAL_ATTR] = model
    state["train"] = functools.partial(_train_together, opt)
    state["__deepcopy__"] = functools.partial(_deepcopy_generating, model, options)
    state["__reduce_ex__"] = functools.partial(_reduce_generating, model, options)
    return opt


def _train_together(opt: nn.Module, mode: bool = True) -> nn.Module:
    """``opt.train(mode)`` of a generating copy: the model (its class's ``train``, children shared), then the copy."""
    if not isinstance(mode, bool):
        raise ValueError("training mode is expected to be boolean")
    opt.__dict__[_ORIGINAL_ATTR].train(mode)
    opt.training = mode
    return opt


def _deepcopy_generating(model: nn.Module, options: dict[str, Any], memo: dict[int, Any]) -> nn.Module:
    """``copy.deepcopy(opt)``: a deep copy of the model, optimized with the same options (the same selector)."""
    return _reoptimize(copy.deepcopy(model, memo), options)


def _reduce_generating(model: nn.Module, options: dict[str, Any], protocol: int) -> tuple[Any, ...]:
    """``pickle``/``copy.copy`` of a generating copy: the model and the options, optimized again when loaded."""
    if options["selector"] is not None:
        raise TypeError("a model optimized with selector=... cannot be pickled or copy.copy'd (a Selector holds "
                        "locks): pickle opt._orig_mod, the model as written, and call attnopt.optimize on it after "
                        "loading; copy.deepcopy(opt) keeps the selector")
    return _reoptimize, (model, options)


def _reoptimize(model: nn.Module, options: dict[str, Any]) -> nn.Module:
    """``optimize(model, **options)``: how a deep-copied or unpickled generating copy is made again."""
    return optimize(model, **options)


def _variant_from_env(variant: str) -> str:
    env = variant_override()
    if env and env != variant:
        from .config import accepted_variants

        accepted = accepted_variants()
        if env not in accepted:
            raise ValueError(f"the environment variable ATTNOPT_VARIANT={env!r} names no variant; accepted values: "
                             f"{', '.join(map(repr, accepted))} (names are lowercase), or unset it")
        log.info("ATTNOPT_VARIANT=%s overrides variant=%r", env, variant)
        return env
    return variant


def tune(model: nn.Module, inputs: Sequence[Any] | Callable[[int, int], Sequence[Any]], *,
         batch_sizes: Sequence[int] | None = None, seq_lens: Sequence[int] | None = None, grad: bool = False,
         progress: bool = True, **optimize_kwargs: Any) -> nn.Module:
    """Tune ahead of time: run ``model`` on every input (or sweep point) so each site chooses per shape.

    ``inputs`` is either a list of argument tuples, or ``make_inputs(batch_size, seq_len)`` with
    ``batch_sizes`` and ``seq_lens`` giving the sweep. ``model`` may be a model returned by
    :func:`optimize` (it is tuned in place) or a plain module (it is optimized first with
    ``optimize_kwargs``). The timings go to the tuning cache on disk, so later processes on
    the same machine start tuned. ``grad=True`` tunes the forward+backward shapes of training.
    Provisional choices are timed again, and races run to their end here: the selector's ``time_limit_s``,
    which bounds a tuning inside a forward, does not apply (a race it cut continues from its rounds).
    Returns the optimized model. A tqdm bar shows progress.

    Under ``torch.distributed`` call it with the same sweep on every rank: rank 0 tunes each
    point and broadcasts its choice, so every rank runs the same kernels. (Shapes first met in a
    forward are chosen by each rank for itself: a collective there could hang.)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"attnopt.tune expects a torch.nn.Module, got {type(model).__name__}")
    if callable(inputs):
        if not batch_sizes or not seq_lens:
            raise ValueError("with make_inputs(batch_size, seq_len), give batch_sizes=[...] and seq_lens=[...]")
        make = inputs
        points = [(b, t) for b in batch_sizes for t in seq_lens]
        calls: list[Any] = [functools.partial(make, b, t) for b, t in points]
        labels = [f"B={b} T={t}" for b, t in points]
    else:
        if batch_sizes or seq_lens:
            raise ValueError("batch_sizes/seq_lens go with a make_inputs(batch_size, seq_len) function, "
                             "not with a list of inputs")
        seq = list(inputs)
        if not seq:
            raise ValueError("attnopt.tune needs at least one input")
        calls = [(lambda a=a: a if isinstance(a, (tuple, list)) else (a,)) for a in seq]
        labels = [f"input {i}" for i in range(len(seq))]
    optimized = isinstance(getattr(model, _REPORT_ATTR, None), Report)
    if optimized and optimize_kwargs:
        raise ValueError(f"model is already optimized; {sorted(optimize_kwargs)} apply to attnopt.optimize, "
                         "pass them there or pass the plain model to tune")
    opt = model if optimized else optimize(model, **optimize_kwargs)
    from tqdm.auto import tqdm

    selector = getattr(opt, _SELECTOR_ATTR, None)
    if selector is None:
        _sweep(opt, labels, calls, grad, progress, tqdm)
        return opt
    selector.retime_provisional()  # a new tune is the moment to decide the provisional choices
    with selector.ahead_of_time(progress=progress):
        _sweep(opt, labels, calls, grad, progress, tqdm)
    selector.share()
    return opt


def _sweep(opt: nn.Module, labels: list[str], calls: list[Any], grad: bool, progress: bool, tqdm: Any) -> None:
    for label, make_args in tqdm(list(zip(labels, calls)), desc="attnopt tune", unit="point", disable=not progress):
        args = tuple(make_args())
        log.info("tuning %s", label)
        # With grad=True the forward runs with autograd on, so the sites see (and the selector times,
        # forward and backward, on its own inputs) the training key; no backward touches .grad here.
        with torch.enable_grad() if grad else torch.no_grad():
            opt(*args)


def rewrite(gm: fx.GraphModule, example_inputs: Sequence[Any] | None = None, *, variant: str = "auto",
            verify: bool = False) -> fx.GraphModule:
    """Rewrite the attention in a GraphModule you already have (symbolic_trace, torch.export).

    ``gm`` is not modified; a new GraphModule sharing its parameters is returned, with the
    report in ``new_gm.meta["attnopt_report"]``. Graphs without shape metadata (``symbolic_trace``)
    need ``example_inputs``; causal masks read from buffers are proven on their current values.

    The proof reads the shapes it was given (a ``symbolic_trace`` graph's sizes come from
    ``example_inputs``: ``k.size(-1) ** -0.5`` is a number there), so the returned module runs the
    rewritten graph only for inputs with the signature the proof saw: tensor shapes, dtypes and
    devices, and the values of non-tensor inputs. A graph whose shapes are symbolic (``torch.export``
    with dynamic dims) serves every size its shape environment allows, provided the proof added no
    guard to it. Any other signature is proven again on its own inputs (kept for up to
    ``MAX_SIGNATURES`` signatures, each added to the report) and beyond that runs as written.
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
    config = OptimizeConfig(variant=_variant_from_env(variant), verify=verify)
    selector = new_selector(config.memory_budget) if config.candidate == AUTO else None
    original = plain_copy(gm)  # the graph as written, for other signatures (shares gm's parameters)
    pattern = SignaturePattern.before_proof(gm, example_inputs)
    new_gm, records = run_pipeline(gm, example_inputs, config, selector=selector)
    pattern.after_proof()
    report = Report(records=records, graphs=1)
    new_gm.meta["attnopt_report"] = report
    guarded = RewrittenGraphModule(new_gm, new_gm.graph, class_name=type(new_gm).__name__)
    guarded.meta = new_gm.meta
    guarded.training = new_gm.training
    guarded.__dict__["_attnopt_guard"] = SignatureGuard(
        original=original, delegate=gm if isinstance(gm, RewrittenGraphModule) else None,
        config=config, selector=selector, report=report, pattern=pattern)
    return guarded


def explain(model: nn.Module | fx.GraphModule, *args: Any, variant: str = "auto", **kwargs: Any) -> Report:
    """What attnopt finds and decides for ``model`` called with ``args``/``kwargs``.

    For a model returned by ``optimize`` called without inputs, the report of what it has
    captured so far. Otherwise the model is captured on the inputs (one forward run, no
    gradients) and the report is returned; nothing about ``model`` changes: its parameters and
    buffers (the same tensor objects, their values and ``requires_grad``), its attributes and
    training flags, tensors it holds as plain attributes (a KV cache) or inside lists, tuples, dicts,
    sets and plain objects (their contents too, restored in place), and the random number
    generators' states (torch's, Python's, numpy's) are restored after the forward, also when it
    raises. Above a memory budget, tensors are not copied; a write to one is then reported.
    """
    report = getattr(model, _REPORT_ATTR, None)
    if isinstance(report, Report):
        if args or kwargs:
            _check_call(model, args, kwargs)
            with model_kept(getattr(model, "_orig_mod", model), args, kwargs), torch.no_grad():
                model(*args, **kwargs)
        return report
    if isinstance(model, fx.GraphModule) and "attnopt_report" in model.meta:
        return model.meta["attnopt_report"]
    if not isinstance(model, nn.Module):
        raise TypeError(f"attnopt.explain expects a torch.nn.Module, got {type(model).__name__}")
    _check_call(model, args, kwargs)
    report = Report()
    config = OptimizeConfig(variant=_variant_from_env(variant))
    backend = functools.partial(attnopt_backend, config=config, report=report)
    with model_kept(model, args, kwargs), torch.no_grad():
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


__all__ = ["optimize", "rewrite", "explain", "tune"]
