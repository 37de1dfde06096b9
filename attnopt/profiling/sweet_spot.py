"""The batch-size sweet spot: where throughput stops growing, what fails first, what exceeds a budget.

For one phase, sequence length and variant, over the swept batch sizes ``b_1 < b_2 < ...``:

* **throughput** ``tokens_per_s(b) = tokens(b) / seconds(b)``: ``b * T`` tokens per call for prefill
  and a training step, ``b`` (one new token per sequence) for a decode step; latency is ``seconds(b)``;
* **the candidates** are the measured batch sizes below the first that fails (``oom``/``error``)
  and not above the memory budget;
* ``b_j`` **beats** ``b_i`` (``j > i``) when ``tokens_per_s(b_j) / tokens_per_s(b_i)`` exceeds both
  ``(1 + threshold) ** log2(b_j / b_i)`` (``threshold`` per doubling, default 10%) and
  ``1 + noise``, where ``noise`` is the two points' relative spread added (half the interquartile
  range of each one's timed calls over its median; 0 where not recorded);
* **the sweet spot** is the smallest candidate that no larger candidate beats: past it, throughput
  grows by less than the threshold per doubling, or by less than the noise. When that is the
  largest candidate and it beats the one before it, throughput was **still growing** at the end
  of the sweep (the sweep says to try larger batch sizes); with one candidate there is no verdict.

    >>> s = sweet_spot([BatchPoint(1, 0.010), BatchPoint(2, 0.011), BatchPoint(4, 0.021)], tokens=lambda b: b * 128)
    >>> s.sweet_spot, s.still_growing
    (2, False)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BatchPoint", "SweetSpot", "batch_sweeps", "sweet_spot"]


@dataclass(frozen=True)
class BatchPoint:
    """One batch size's measurement: median seconds per call (None when it failed) and its quartiles."""

    batch_size: int
    seconds: float | None
    iqr: tuple[float, float] | None = None
    status: str = "ok"  # "ok" | "oom" | "error" | "skipped"
    memory_bytes: int | None = None
    error: str | None = None


@dataclass
class SweetSpot:
    """What :func:`sweet_spot` found; ``None`` where a number does not exist."""

    batch_sizes: list[int]
    tokens_per_s: list[float | None]
    latency_s: list[float | None]
    growth_per_doubling: list[float | None]  # from each candidate to the next (None for the last and failures)
    spread: list[float | None]  # half the relative interquartile range of each point's timed calls
    sweet_spot: int | None
    still_growing: bool
    first_failure: dict[str, Any] | None  # {batch_size, status, error}
    first_over_budget: dict[str, Any] | None  # {batch_size, memory_bytes, budget}
    threshold: float
    candidates: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _spread(p: BatchPoint) -> float:
    if p.iqr is None or not p.seconds:
        return 0.0
    return (p.iqr[1] - p.iqr[0]) / (2 * p.seconds)


def sweet_spot(points: Sequence[BatchPoint], tokens: Callable[[int], float], threshold: float = 0.1,
               memory_budget: int | None = None) -> SweetSpot:
    """The sweet spot of ``points`` (one phase, sequence length and variant); see the module docstring."""
    if threshold <= 0:
        raise ValueError(f"threshold must be > 0 (a fraction per doubling: 0.1 is 10%), got {threshold}")
    pts = sorted(points, key=lambda p: p.batch_size)
    failure = next((p for p in pts if p.status in ("oom", "error")), None)
    over = next((p for p in pts if memory_budget is not None and p.status == "ok" and p.memory_bytes is not None
                 and p.memory_bytes > memory_budget), None)
    ok = [p for p in pts if p.status == "ok" and p.seconds]
    thr = {p.batch_size: tokens(p.batch_size) / p.seconds for p in ok}
    candidates = [p for p in ok if (failure is None or p.batch_size < failure.batch_size)
                  and (over is None or p.batch_size < over.batch_size)]

    def beats(j: BatchPoint, i: BatchPoint) -> bool:
        need = max((1 + threshold) ** math.log2(j.batch_size / i.batch_size), 1 + _spread(i) + _spread(j))
        return thr[j.batch_size] / thr[i.batch_size] > need

    spot = next((i for n, i in enumerate(candidates) if not any(beats(j, i) for j in candidates[n + 1:])), None)
    growth: dict[int, float] = {}
    for i, j in zip(candidates, candidates[1:]):
        doublings = math.log2(j.batch_size / i.batch_size)
        growth[i.batch_size] = (thr[j.batch_size] / thr[i.batch_size]) ** (1 / doublings) - 1
    still = (spot is not None and len(candidates) > 1 and spot is candidates[-1]
             and beats(candidates[-1], candidates[-2]))
    return SweetSpot(
        batch_sizes=[p.batch_size for p in pts],
        tokens_per_s=[thr.get(p.batch_size) for p in pts],
        latency_s=[p.seconds if p.status == "ok" else None for p in pts],
        growth_per_doubling=[growth.get(p.batch_size) for p in pts],
        spread=[_spread(p) if p.iqr is not None and p.status == "ok" else None for p in pts],
        sweet_spot=spot.batch_size if spot is not None and len(candidates) > 1 else None,
        still_growing=still,
        first_failure=None if failure is None else {"batch_size": failure.batch_size, "status": failure.status,
                                                    "error": failure.error},
        first_over_budget=None if over is None else {"batch_size": over.batch_size,
                                                     "memory_bytes": over.memory_bytes, "budget": memory_budget},
        threshold=threshold,
        candidates=[p.batch_size for p in candidates],
    )


def tokens_per_call(phase: str, seq_len: int) -> Callable[[int], float]:
    """Tokens one call handles at batch size ``b``: ``b * T`` (prefill, train) or ``b`` (a decode step)."""
    return (lambda b: float(b)) if phase == "decode" else (lambda b: float(b * seq_len))


def point_memory(rec: dict[str, Any]) -> int | None:
    """What a call needs beyond the weights: its peak tensor bytes, plus the KV cache when decoding from one."""
    if rec.get("peak_bytes") is None:
        return None
    return rec["peak_bytes"] + (rec.get("kv_context_bytes") or 0)


def batch_sweeps(records: Sequence[dict[str, Any]], threshold: float = 0.1,
                 memory_budget: int | None = None) -> list[dict[str, Any]]:
    """One sweet-spot analysis per (phase, sequence length, variant) swept over two or more batch sizes."""
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for r in records:
        if r["status"] != "skipped":
            groups.setdefault((r["phase"], r["seq_len"], r["variant"]), []).append(r)
    out = []
    for (phase, t, variant), recs in groups.items():
        if len({r["batch_size"] for r in recs}) < 2:
            continue
        points = [BatchPoint(r["batch_size"], r["forward_s"] if r["status"] == "ok" else None,
                             tuple(r["forward_iqr_s"]) if r.get("forward_iqr_s") else None, r["status"],
                             point_memory(r), r.get("error")) for r in recs]
        result = sweet_spot(points, tokens_per_call(phase, t), threshold, memory_budget)
        out.append({"phase": phase, "seq_len": t, "variant": variant, **result.as_dict()})
    return out
