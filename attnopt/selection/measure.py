"""Honest measurements for the demo and benchmarks: alternating timings and peak live tensor memory.

    >>> from attnopt.selection.measure import time_alternating, peak_memory
    >>> times = time_alternating({"eager": model, "attnopt": opt}, (x,), repeats=20)  # median seconds
    >>> peak_memory(opt, x)                     # bytes allocated above the baseline during one call

Timing alternates the candidates inside each repeat (``a b c a b c ...``) so that drift in clock
speed, caches or background load hits all of them alike, and reports medians. Peak memory on
CPU is read from ``torch.profiler``'s allocation records (``profile_memory=True``): the running
sum of allocated minus freed bytes, in time order, over one call; on CUDA it is
``torch.cuda.max_memory_allocated`` above the memory allocated before the call. Both count tensor
memory only (the caching allocator's reserved-but-free blocks and the Python heap are not counted).

This module imports ``tqdm`` lazily, only when a progress bar is asked for.
"""

from __future__ import annotations

import gc
import os
import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

__all__ = ["peak_memory", "quiet_profiler", "time_alternating"]


def _sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_of(inputs: Sequence[Any]) -> torch.device | None:
    for x in inputs:
        if isinstance(x, torch.Tensor):
            return x.device
    return None


def time_alternating(fns: Mapping[str, Callable[..., Any]], inputs: Sequence[Any], repeats: int = 10, *,
                     warmup: int = 2, progress: bool | str = False,
                     samples: dict[str, list[float]] | None = None, shuffle: bool = False) -> dict[str, float]:
    """Median wall-clock seconds of ``fn(*inputs)`` for each of ``fns``, timed in alternation.

    Each function is first called ``warmup`` times (compilation, allocator and thread pool
    warm-up happen there, untimed); then ``repeats`` rounds each call every function once, in
    order, and time it. Runs under ``torch.no_grad()``. ``progress`` shows a tqdm bar (a string
    is its label). ``samples``, when given, receives every timed call's seconds per function.
    ``shuffle`` draws each round's order afresh (seeded): in a fixed order each function always runs
    right after the same one, whose effects (a cache it filled or emptied) it then always pays.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if not fns:
        raise ValueError("time_alternating needs at least one function")
    device = _device_of(inputs)
    samples = {} if samples is None else samples
    samples.update({name: [] for name in fns})
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=warmup * len(fns) + repeats, desc=progress if isinstance(progress, str) else "timing",
                   unit="step", leave=False)
    with torch.no_grad():
        for _ in range(warmup):
            for fn in fns.values():
                fn(*inputs)
                _sync(device)
                if bar is not None:
                    bar.update(1)
        rng = random.Random(0)
        for _ in range(repeats):
            for name in rng.sample(list(fns), len(fns)) if shuffle else fns:
                fn = fns[name]
                _sync(device)
                start = time.perf_counter()
                fn(*inputs)
                _sync(device)
                samples[name].append(time.perf_counter() - start)
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    return {name: statistics.median(s) for name, s in samples.items()}


def peak_memory(fn: Callable[..., Any], *inputs: Any, warmup: int = 1) -> int:
    """Peak bytes of tensor memory allocated during one ``fn(*inputs)`` beyond what was live before.

    The output of the call counts (it is alive at the end); the inputs, parameters and anything
    allocated before the call do not. ``warmup`` untimed calls come first so that one-time work
    (dynamo capture, compilation, lazy initialisation) is not measured.
    """
    device = _device_of(inputs)
    with torch.no_grad():
        for _ in range(warmup):
            fn(*inputs)
        gc.collect()
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            out = fn(*inputs)
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device) - base
            del out
            return int(peak)
        return _cpu_peak(fn, inputs)


def quiet_profiler() -> None:
    """Silence the two log lines the profiler library prints to stderr per session (unless the user set
    ``KINETO_LOG_LEVEL`` themselves): the selector and the profiler run many short sessions."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")


def _cpu_peak(fn: Callable[..., Any], inputs: Sequence[Any]) -> int:
    from torch.profiler import ProfilerActivity, profile

    quiet_profiler()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn(*inputs)
    del out
    records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    if not records:
        raise RuntimeError("torch.profiler recorded no memory events; peak memory cannot be measured "
                           "(is profile_memory supported by this torch build?)")
    records.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in records:
        if e.device_type() != torch.autograd.DeviceType.CPU:
            continue
        live += e.nbytes()
        peak = max(peak, live)
    return peak
