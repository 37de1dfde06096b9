"""Measurements of one sweep point for ``attnopt profile``: time, attention time, peak memory, gaps.

Every variant at a point is a :class:`Runner`: ``run()`` is the timed call, ``setup()`` an
optional untimed preparation before each call (a decode step first needs its prefill). Each
``run`` synchronises the device itself, so a timer around it measures device work too.

* :func:`time_runners`: medians of alternating runs (``attnopt.selection.measure.time_alternating``
  when no runner needs a setup).
* :func:`profile_ranges`: a few calls under ``torch.profiler``, each inside an
  ``attnopt.profile::forward`` range; returns the time inside each ``attnopt::<site>`` range
  (CPU: the range's duration; CUDA: the time of the kernels launched inside it), the forward's
  duration in the same calls, and on CUDA the idle gaps between the forward's kernels.
* :func:`profile_memory`: one call under ``torch.profiler(profile_memory=True)``; the peak is
  the running sum of allocated minus freed bytes on the device, in time order (the definition
  of ``attnopt.selection.measure.peak_memory``), and the op that made the allocation reaching it is named
  with its input shapes, its module (its path in the model for models that run as written, else
  the profiler's ``<class>_<n>``) and its attention site. On CUDA the peak bytes are
  ``torch.cuda.max_memory_allocated`` above what was allocated before the call.
* :func:`bracket_sites`: the model as written, captured by dynamo with every attention site
  found by attnopt's matcher left as written but wrapped in an ``attnopt::<site>`` range. Eager
  attention is not a separate call, so this is how its time is measured: the ops of the
  captured graph from the site's score product to its ``P @ V`` product, in the order written.
  The capture also counts each site's FLOPs at run time: ``2 * B*H * (D + Dv)`` per score entry
  (both products), over the entries a proven causal mask keeps (all ``Tq * Tk`` otherwise).
* :func:`matmul_rate`: the device's achieved matmul FLOP/s (a square matmul), the roofline
  attention FLOP/s are compared with.
* :func:`make_train_runner`: one training step without the optimizer (forward, a scalar loss of
  the outputs, backward inside an ``attnopt.profile::backward`` range), its backward timed apart.

``bracket_sites`` also opens an ``attnopt.module::<path>`` range around the ops of every module
(from each node's ``nn_module_stack``), so that :mod:`attnopt.profiling.breakdown` can say which
modules the time goes to. Forward hooks cannot do it: a hook that opens a range breaks dynamo's
graph at every module (the sites would be split), and the profiler's ``with_modules`` covers
TorchScript only. Compiled variants run one captured graph whose module boundaries are gone.
"""

from __future__ import annotations

import os
import re
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.autograd import DeviceType

from ..pipeline.steps import find_in, matches
from ..selection.measure import time_alternating
from .breakdown import BACKWARD_RANGE, FORWARD_RANGE, MODULE_PREFIX, SITE_PREFIX, average, call_breakdown

_EVALUATE = "autograd::engine::evaluate_function: "

__all__ = ["Runner", "SiteCounter", "bracket_sites", "causal_entries", "is_oom", "make_runner", "make_train_runner",
           "matmul_rate", "profile_memory", "profile_ranges", "sync", "time_runners"]

MODULES_NOTE = ("a compiled variant runs dynamo's captured graph: its modules' boundaries are gone at run time "
                "(the model as written, eager, has them)")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def is_oom(e: BaseException) -> bool:
    """Whether ``e`` says the device (or host) ran out of memory."""
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


@dataclass
class Runner:
    """One variant at one point: ``setup()`` (untimed, may be None) then ``run()`` (timed)."""

    run: Callable[[], Any]
    setup: Callable[[], Any] | None = None
    backward_s: list[float] | None = None  # a training step's backward seconds, one per call

    def __call__(self) -> Any:
        if self.setup is not None:
            self.setup()
        return self.run()


def make_runner(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device,
                setup: Callable[[], Any] | None = None) -> Runner:
    """A runner calling ``fn(*args, **kwargs)`` and waiting for the device."""

    def run() -> Any:
        out = fn(*args, **kwargs)
        sync(device)
        return out

    return Runner(run, setup)


def make_train_runner(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device,
                      parameters: Sequence[torch.nn.Parameter]) -> Runner:
    """One training step of ``fn`` without the optimizer: forward, ``loss``, backward; the gradients are
    set to None before each call (untimed), so the step allocates them as a first step does.

    The loss is the mean of every floating output that needs a gradient (a tensor, or inside
    tuples, lists and dicts; ``float32``). The backward runs inside an ``attnopt.profile::backward``
    range and is timed apart, after a device synchronisation (``Runner.backward_s``).
    """
    backward: list[float] = []

    def setup() -> None:
        for p in parameters:
            p.grad = None

    def run() -> Any:
        with torch.enable_grad():
            loss = training_loss(fn(*args, **kwargs))
            sync(device)
            with torch.autograd.profiler.record_function(BACKWARD_RANGE):
                start = time.perf_counter()
                loss.backward()
                sync(device)
                backward.append(time.perf_counter() - start)
        return loss.detach()

    return Runner(run, setup, backward)


def training_loss(out: Any) -> torch.Tensor:
    """The mean of every floating tensor in ``out`` that needs a gradient, summed, in float32."""
    found: list[torch.Tensor] = []

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            if x.is_floating_point() and x.requires_grad:
                found.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (tuple, list)):
            for v in x:
                walk(v)

    walk(out)
    if not found:
        raise ValueError("--phase train: the model's outputs hold no floating tensor that needs a gradient, so "
                         "there is nothing to backpropagate (does the model have trainable parameters?)")
    return sum(t.float().mean() for t in found)  # type: ignore[return-value]


def time_runners(runners: dict[str, Runner], repeats: int,
                 samples: dict[str, list[float]] | None = None) -> dict[str, float]:
    """Median seconds of each runner's ``run``, alternating the runners in every round (no_grad).

    ``samples``, when given, receives every timed call's seconds per runner.
    """
    samples = {} if samples is None else samples
    if all(r.setup is None for r in runners.values()):
        return time_alternating({name: r.run for name, r in runners.items()}, (), repeats=repeats, warmup=0,
                                samples=samples)
    samples.update({name: [] for name in runners})
    with torch.no_grad():
        for _ in range(repeats):
            for name, r in runners.items():
                if r.setup is not None:
                    r.setup()
                start = time.perf_counter()
                r.run()
                samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in samples.items()}


def matmul_rate(device: torch.device, dtype: torch.dtype, size: int, repeats: int = 5) -> dict[str, Any]:
    """Achieved FLOP/s of a ``size x size`` matmul in ``dtype`` on ``device`` (median of ``repeats``)."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    runner = make_runner(torch.matmul, (a, b), {}, device)
    seconds = time_runners({"matmul": runner}, repeats)["matmul"]
    return {"size": size, "dtype": str(dtype).replace("torch.", ""), "seconds": seconds,
            "flops_per_s": 2.0 * size**3 / seconds}


@dataclass
class RangeTimes:
    """Medians over the profiled calls."""

    forward_s: float
    sites_s: dict[str, float]  # site name -> seconds per forward (summed over its calls in one forward)
    attention_s: float | None  # sum over sites; None when no site range ran
    idle_gap_s: float | None  # CUDA only: time between the forward's kernels with nothing running
    idle_gap_share: float | None
    profiler: Any = None  # the last torch.profiler.profile, for chrome traces
    breakdown: dict[str, Any] | None = None  # attnopt.profiling.breakdown.average of the calls


def _activities(device: torch.device) -> list[Any]:
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])


def profile_ranges(runner: Runner, device: torch.device, calls: int = 3) -> RangeTimes:
    """Time inside every ``attnopt::<site>`` range and the forward, over ``calls`` profiled calls."""
    from torch.profiler import profile

    forward, sites, attention, gaps, gap_share, parts = [], [], [], [], [], []
    prof = None
    with torch.no_grad():
        for _ in range(calls):
            if runner.setup is not None:
                runner.setup()
            sync(device)
            with profile(activities=_activities(device)) as prof:
                with torch.autograd.profiler.record_function(FORWARD_RANGE):
                    runner.run()  # synchronises inside the range, so it covers the device work
            events = prof.events()
            f, s, g = _read_ranges(events, device)
            if parts is not None:
                try:
                    parts.append(call_breakdown(events, device.type))
                except Exception as e:  # noqa: BLE001 - the times stand without it; say why it is missing
                    warnings.warn(f"attnopt profile: no time breakdown for this point ({type(e).__name__}: {e})",
                                  stacklevel=2)
                    parts = None
            forward.append(f)
            sites.append(s)
            if s:
                attention.append(sum(s.values()))
            if g is not None:
                gaps.append(g)
                gap_share.append(g / f if f > 0 else 0.0)
    names = sorted({n for s in sites for n in s})
    return RangeTimes(
        forward_s=statistics.median(forward),
        sites_s={n: statistics.median(s.get(n, 0.0) for s in sites) for n in names},
        attention_s=statistics.median(attention) if attention else None,
        idle_gap_s=statistics.median(gaps) if gaps else None,
        idle_gap_share=statistics.median(gap_share) if gap_share else None,
        profiler=prof,
        breakdown=average(parts, device.type, MODULES_NOTE) if parts else None,
    )


def _read_ranges(events: Any, device: torch.device) -> tuple[float, dict[str, float], float | None]:
    forward = 0.0
    sites: dict[str, float] = {}
    kernels: list[tuple[float, float]] = []
    for e in events:
        if e.device_type == DeviceType.CUDA:
            if not getattr(e, "is_user_annotation", False):  # ranges mirrored on the device span many kernels
                kernels.append((e.time_range.start, e.time_range.end))
        elif e.name == FORWARD_RANGE:
            forward += e.cpu_time_total * 1e-6
        elif e.name.startswith(SITE_PREFIX):
            us = e.device_time_total if device.type == "cuda" else e.cpu_time_total
            sites[e.name[len(SITE_PREFIX):]] = sites.get(e.name[len(SITE_PREFIX):], 0.0) + us * 1e-6
    if device.type != "cuda":
        return forward, sites, None
    kernels.sort()
    idle, busy_until = 0.0, None
    for start, end in kernels:
        if busy_until is not None and start > busy_until:
            idle += start - busy_until
        busy_until = end if busy_until is None else max(busy_until, end)
    return forward, sites, idle * 1e-6


@dataclass
class MemoryPeak:
    peak_bytes: int
    op: str | None = None  # the op whose allocation reached the peak
    shapes: list[Any] = field(default_factory=list)  # its input shapes
    alloc_bytes: int | None = None  # the size of that allocation
    module: str | None = None  # innermost module around it: its path, or the profiler's ``<class>_<n>``
    site: str | None = None  # the ``attnopt::<site>`` range around it, if any
    backward: bool = False  # in a training step's backward: module and site are its forward op's
    profiler: Any = None
    timeline: Timeline | None = None


@dataclass
class Timeline:
    """Live tensor bytes over one call, from the profiler's allocation records (ms from the call's start)."""

    t_ms: list[float]  # after each allocation or free, in time order
    live_bytes: list[int]
    call_ms: float  # the call's duration
    sites: list[tuple[str, float, float]]  # (site or module, start ms, end ms) of every attention mark
    backward: tuple[float, float] | None  # the backward range of a training step
    marks: str = "sites"  # "sites": attnopt::<site> ranges; "modules": calls of the modules that hold the sites


def profile_memory(runner: Runner, device: torch.device, model: torch.nn.Module | None = None,
                   wrappers: frozenset[str] = frozenset(), site_modules: frozenset[str] = frozenset()) -> MemoryPeak:
    """Peak tensor bytes of one ``run()`` above what was live before, and the op that reached it.

    With ``model`` (a module that runs as written, not a compiled one), the module around the
    op is named by its path in ``model`` (e.g. ``h.0.attn``): the profiler numbers the
    instances of a class in the order they are first called, which hooks record during the call.
    Without it, modules of the classes in ``wrappers`` (those that only run a compiled graph,
    e.g. ``OptimizedModule`` and the model's own class) are not named.

    The timeline marks the ``attnopt::<site>`` ranges; a model as written has none, so with
    ``model`` it marks the calls of the modules in ``site_modules`` (the paths that hold the sites).
    """
    import gc

    from torch.profiler import profile

    called: dict[str, list[str]] = {}  # class name -> module paths in the order of their first call
    hooks = []
    if model is not None:
        for path, module in model.named_modules():
            def first_call(m: torch.nn.Module, args: Any, path: str = path) -> None:
                paths = called.setdefault(type(m).__name__, [])
                if path not in paths:
                    paths.append(path)

            hooks.append(module.register_forward_pre_hook(first_call))
    try:
        with torch.no_grad():
            if runner.setup is not None:
                runner.setup()
            called.clear()
            gc.collect()
            sync(device)
            base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            with profile(activities=_activities(device), profile_memory=True, record_shapes=True,
                         with_stack=True) as prof:
                with torch.autograd.profiler.record_function(FORWARD_RANGE):
                    out = runner.run()
            del out
    finally:
        for h in hooks:
            h.remove()
    kind = DeviceType.CUDA if device.type == "cuda" else DeviceType.CPU
    events = list(prof.profiler.kineto_results.events())
    records = sorted((e for e in events if e.name() == "[memory]" and e.device_type() == kind),
                     key=lambda e: e.start_ns())
    if not records:
        raise RuntimeError("torch.profiler recorded no memory events; peak memory cannot be measured "
                           "(is profile_memory supported by this torch build?)")
    live = peak = 0
    at = None
    for e in records:
        live += e.nbytes()
        if live > peak:
            peak, at = live, e
    if device.type == "cuda":
        peak = int(torch.cuda.max_memory_allocated(device) - base)
    marks = None
    if model is not None and site_modules:
        marks = [(path, e.start_ns(), e.end_ns()) for e in events if e.name().startswith("nn.Module: ")
                 and (path := _module_path(e.name()[len("nn.Module: "):], called)) in site_modules]
    try:
        timeline = _timeline(events, records, marks)
    except Exception as e:  # noqa: BLE001 - the peak stands without it; say why it is missing
        warnings.warn(f"attnopt profile: no memory timeline for this point ({type(e).__name__}: {e})", stacklevel=2)
        timeline = None
    result = MemoryPeak(peak_bytes=int(peak), profiler=prof, timeline=timeline)
    if at is None:
        return result
    around = _around(events, at.start_ns(), at.start_thread_id())
    ops = [e for e in around if e.name().startswith("aten::")]
    if ops:
        outer = min(ops, key=lambda e: (e.start_ns(), -e.end_ns()))  # the op user code called
        result.op, result.shapes = outer.name(), [list(s) for s in outer.shapes() if s]
    result.alloc_bytes = int(at.nbytes())
    nodes = [e for e in around if e.name().startswith(_EVALUATE)]
    if nodes:  # in the backward: name the module and site of the forward op that made the graph node
        result.backward = True
        seq = max(nodes, key=lambda e: e.start_ns()).sequence_nr()
        starts = [e.start_ns() for e in events if e.name() == BACKWARD_RANGE] or [min(e.start_ns() for e in nodes)]
        made = [e for e in events if seq >= 0 and e.sequence_nr() == seq and e.name().startswith("aten::")
                and e.start_ns() < starts[0]]
        if not made:
            return result
        forward = max(made, key=lambda e: e.start_ns())
        around = _around(events, forward.start_ns(), forward.start_thread_id())
    modules = [e for e in around if e.name().startswith("nn.Module: ")]
    if model is None:  # a compiled or cached call: the wrappers around its graph say nothing about the op
        modules = [e for e in modules if e.name()[len("nn.Module: "):].rpartition("_")[0] not in wrappers]
    if modules:
        result.module = _module_path(max(modules, key=lambda e: e.start_ns()).name()[len("nn.Module: "):], called)
    sites = [e for e in around if e.name().startswith(SITE_PREFIX)]
    if sites:
        result.site = max(sites, key=lambda e: e.start_ns()).name()[len(SITE_PREFIX):]
    return result


def _around(events: list[Any], t: int, thread: int) -> list[Any]:
    """The events of ``thread`` open at time ``t`` (ns)."""
    return [e for e in events if e.name() != "[memory]" and e.start_thread_id() == thread
            and e.start_ns() <= t <= e.end_ns()]


def _timeline(events: list[Any], records: list[Any],
              module_marks: list[tuple[str, int, int]] | None = None) -> Timeline | None:
    events = [e for e in events if e.device_type() == DeviceType.CPU]  # host time; not the ranges mirrored on CUDA
    calls = [e for e in events if e.name() == FORWARD_RANGE]
    if not calls:
        return None
    t0, t1 = calls[0].start_ns(), calls[0].end_ns()

    def ms(ns: int) -> float:
        return (ns - t0) * 1e-6

    live, t_ms, values = 0, [0.0], [0]
    for e in records:
        live += e.nbytes()
        t_ms.append(ms(e.start_ns()))
        values.append(live)
    if module_marks is not None:
        sites = sorted(((path, ms(start), ms(end)) for path, start, end in module_marks), key=lambda m: m[1])
    else:
        sites = sorted(((e.name()[len(SITE_PREFIX):], ms(e.start_ns()), ms(e.end_ns())) for e in events
                        if e.name().startswith(SITE_PREFIX) and e.is_user_annotation()), key=lambda m: m[1])
    back = [(ms(e.start_ns()), ms(e.end_ns())) for e in events if e.name() == BACKWARD_RANGE]
    return Timeline(t_ms, values, ms(t1), sites, back[0] if back else None,
                    "sites" if module_marks is None else "modules")


def _module_path(profiler_name: str, called: dict[str, list[str]]) -> str:
    """``h.0.attn`` for the profiler's ``CausalSelfAttention_0`` when the call order is known, else the name."""
    cls, _, n = profiler_name.rpartition("_")
    paths = called.get(cls, [])
    if n.isdigit() and int(n) < len(paths):
        return paths[int(n)] or "(the model)"
    return profiler_name


@dataclass
class SiteCounter:
    """What :func:`bracket_sites` learnt: where each site is, FLOPs per site per call, capture failures.

    ``flops`` counts the useful work: score entries a proven causal mask removes are not counted
    (FlashAttention's convention), so kernels that skip them are not credited with more than 100%
    of the matmul rate. ``dense_flops`` counts every entry.
    """

    where: dict[str, str] = field(default_factory=dict)
    flops: dict[str, float] = field(default_factory=dict)
    dense_flops: dict[str, float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    counting: bool = False

    def note(self, name: str, causal: str | None, q: torch.Tensor, v: torch.Tensor) -> None:
        if not self.counting:
            return
        # q (..., Tq, D), v (..., Tk, Dv): B*H*Tq*Tk scores, each costing D + Dv multiply-adds in the two products
        tq, tk = q.shape[-2], v.shape[-2]
        per_entry = 2.0 * (q.numel() // (q.shape[-1] * tq)) * (q.shape[-1] + v.shape[-1])
        kept = tq * tk if causal is None else causal_entries(tq, tk, causal)
        self.flops[name] = self.flops.get(name, 0.0) + per_entry * kept
        self.dense_flops[name] = self.dense_flops.get(name, 0.0) + per_entry * tq * tk


def causal_entries(tq: int, tk: int, alignment: str) -> int:
    """Score entries a causal mask keeps: query i sees keys <= i (top-left) or <= i + tk - tq (bottom-right)."""
    shift = 0 if alignment == "top_left" else tk - tq
    # row i keeps min(tk, max(0, i + 1 + shift)) keys
    return sum(min(tk, max(0, i + 1 + shift)) for i in range(tq))


def bracket_sites(model: torch.nn.Module) -> tuple[Callable[..., Any], SiteCounter]:
    """``model`` as written, captured by dynamo, with an ``attnopt::<site>`` range around each site."""
    counter = SiteCounter()
    graphs = [0]

    def backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        graph_id = graphs[0]
        graphs[0] += 1
        try:
            _insert_ranges(gm, example_inputs, counter, graph_id)
        except Exception as e:  # noqa: BLE001 - the graph still runs as written, without ranges
            counter.failures.append(f"graph {graph_id}: {type(e).__name__}: {e}")
        return gm.forward

    return torch.compile(model, backend=backend), counter


def _insert_ranges(gm: fx.GraphModule, example_inputs: list[Any], counter: SiteCounter, graph_id: int) -> None:
    """An ``attnopt::<site>`` range around every site and an ``attnopt.module::<path>`` range around every module.

    Each op node runs inside the ranges of its stack: its modules (``nn_module_stack``, outermost
    first) with each site's range placed right under the modules that all the site's nodes share,
    so the ranges nest. Ranges open before the first node of a stack and close after its last.
    """
    _, found = find_in(gm, example_inputs)  # the optimize route's step: the same sites, named the same
    runs = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    order = {n: i for i, n in enumerate(runs)}
    position = {n: i for i, n in enumerate(gm.graph.nodes)}  # q and v may be graph inputs
    stacks = {n: _module_stack(n) for n in runs}
    for m in matches(found):
        name = m.record.name  # attnopt names sites the same way in every capture of a model
        counter.where[name] = " ".join(x for x in (m.record.module_path, f"({m.record.source})"
                                                   if m.record.source else "") if x)
        first = min((*m.internal, m.output), key=position.__getitem__)
        inside = runs[order[first]:order[m.output] + 1]  # from the score product to P @ V, as the code runs them
        shared = len(os.path.commonprefix([stacks[n] for n in inside]))
        for n in inside:
            stacks[n] = (*stacks[n][:shared], SITE_PREFIX + name, *stacks[n][shared:])
        # count FLOPs outside the range: before it when q and v exist there, else after it
        before = position[m.v] < position[first]
        where = gm.graph.inserting_before(first) if before else gm.graph.inserting_after(m.output)
        with where:
            gm.graph.call_function(counter.note, (name, m.spec.causal, m.q, m.v))
    open_: list[tuple[str, fx.Node]] = []  # (range name, handle) of the ranges open, outermost first
    last: fx.Node | None = None
    for n in [*runs, None]:
        want = stacks[n] if n is not None else ()
        keep = 0
        while keep < min(len(open_), len(want)) and open_[keep][0] == want[keep]:
            keep += 1
        anchor = last
        while len(open_) > keep:  # close after the last node that ran inside, innermost first
            with gm.graph.inserting_after(anchor):
                anchor = gm.graph.call_function(torch.ops.profiler._record_function_exit._RecordFunction,
                                                (open_.pop()[1],))
        for label in want[keep:]:
            with gm.graph.inserting_before(n):
                open_.append((label, gm.graph.call_function(torch.ops.profiler._record_function_enter_new.default,
                                                            (label, None))))
        last = n
    gm.graph.lint()
    gm.recompile()


def _module_stack(node: fx.Node) -> tuple[str, ...]:
    """``attnopt.module::<path>`` of the modules a node runs in, outermost first (``L['self'].h.0`` -> ``h.0``)."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = []
    for value in stack.values():
        path = value[0] if isinstance(value, tuple) else str(value)
        path = re.sub(r"^L\['[^']*'\]\.?", "", path)
        if path:
            paths.append(MODULE_PREFIX + path)
    return tuple(paths)
