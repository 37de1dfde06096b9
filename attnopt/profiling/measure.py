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
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.autograd import DeviceType

from ..pipeline.steps import find_in, matches
from ..selection.measure import time_alternating

__all__ = ["Runner", "SiteCounter", "bracket_sites", "causal_entries", "is_oom", "make_runner", "matmul_rate",
           "profile_memory", "profile_ranges", "sync", "time_runners"]

FORWARD_RANGE = "attnopt.profile::forward"
SITE_PREFIX = "attnopt::"


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


def _activities(device: torch.device) -> list[Any]:
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])


def profile_ranges(runner: Runner, device: torch.device, calls: int = 3) -> RangeTimes:
    """Time inside every ``attnopt::<site>`` range and the forward, over ``calls`` profiled calls."""
    from torch.profiler import profile

    forward, sites, attention, gaps, gap_share = [], [], [], [], []
    prof = None
    with torch.no_grad():
        for _ in range(calls):
            if runner.setup is not None:
                runner.setup()
            sync(device)
            with profile(activities=_activities(device)) as prof:
                with torch.autograd.profiler.record_function(FORWARD_RANGE):
                    runner.run()  # synchronises inside the range, so it covers the device work
            f, s, g = _read_ranges(prof.events(), device)
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
    profiler: Any = None


def profile_memory(runner: Runner, device: torch.device, model: torch.nn.Module | None = None,
                   wrappers: frozenset[str] = frozenset()) -> MemoryPeak:
    """Peak tensor bytes of one ``run()`` above what was live before, and the op that reached it.

    With ``model`` (a module that runs as written, not a compiled one), the module around the
    op is named by its path in ``model`` (e.g. ``h.0.attn``): the profiler numbers the
    instances of a class in the order they are first called, which hooks record during the call.
    Without it, modules of the classes in ``wrappers`` (those that only run a compiled graph,
    e.g. ``OptimizedModule`` and the model's own class) are not named.
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
    result = MemoryPeak(peak_bytes=int(peak), profiler=prof)
    if at is None:
        return result
    t, thread = at.start_ns(), at.start_thread_id()
    around = [e for e in events if e.name() != "[memory]" and e.start_thread_id() == thread
              and e.start_ns() <= t <= e.end_ns()]
    ops = [e for e in around if e.name().startswith("aten::")]
    if ops:
        outer = min(ops, key=lambda e: (e.start_ns(), -e.end_ns()))  # the op user code called
        result.op, result.shapes = outer.name(), [list(s) for s in outer.shapes() if s]
    result.alloc_bytes = int(at.nbytes())
    modules = [e for e in around if e.name().startswith("nn.Module: ")]
    if model is None:  # a compiled or cached call: the wrappers around its graph say nothing about the op
        modules = [e for e in modules if e.name()[len("nn.Module: "):].rpartition("_")[0] not in wrappers]
    if modules:
        result.module = _module_path(max(modules, key=lambda e: e.start_ns()).name()[len("nn.Module: "):], called)
    sites = [e for e in around if e.name().startswith(SITE_PREFIX)]
    if sites:
        result.site = max(sites, key=lambda e: e.start_ns()).name()[len(SITE_PREFIX):]
    return result


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
    _, found = find_in(gm, example_inputs)  # the optimize route's step: the same sites, named the same
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for m in matches(found):
        name = m.record.name  # attnopt names sites the same way in every capture of a model
        counter.where[name] = " ".join(x for x in (m.record.module_path, f"({m.record.source})"
                                                   if m.record.source else "") if x)
        first = min((*m.internal, m.output), key=order.__getitem__)
        with gm.graph.inserting_before(first):
            handle = gm.graph.call_function(torch.ops.profiler._record_function_enter_new.default,
                                            (SITE_PREFIX + name, None))
        with gm.graph.inserting_after(m.output):
            done = gm.graph.call_function(torch.ops.profiler._record_function_exit._RecordFunction, (handle,))
        # count FLOPs outside the range: before it when q and v exist there, else after it
        where = gm.graph.inserting_before(handle) if order[m.v] < order[first] else gm.graph.inserting_after(done)
        with where:
            gm.graph.call_function(counter.note, (name, m.spec.causal, m.q, m.v))
    gm.graph.lint()
    gm.recompile()
