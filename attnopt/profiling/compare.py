"""``attnopt profile compare OLD.json NEW.json``: what changed between two profiles, and whether it regressed.

Re-profile after every hardware or library change, and compare. For every point (phase, batch
size, sequence length) and variant present in both reports:

* **time**: ``new / old`` of the median forward time, with a verdict that knows the noise: the
  change counts only beyond both the threshold (``--threshold``, default 5%) and the runs' own
  spread (half the relative interquartile range of each report's timed calls, added); otherwise
  it is "same". Reports written before the spread was recorded use the threshold alone;
* **memory**: ``new / old`` of the peak tensor bytes (deterministic: the memory threshold alone);
* a point that was measured before and fails now, or is missing from the new report, is a regression;
  one that failed before and is measured now an improvement.

The environment differences (torch, attnopt, device, threads, ...) are listed first: a change of
hardware or library is usually what the comparison is about. The exit status is 1 when anything
regressed beyond its threshold (so it can gate a CI job), 0 otherwise, 2 for unreadable input.

Example::

    $ attnopt profile compare before/report.json after/report.json
    environment: torch 2.12.0+cpu -> 2.13.0+cpu
    phase    B  T    variant  old ms  new ms  time         old MiB  new MiB  memory
    prefill  1  512  auto     12.10   10.30   0.85x better 40.0     40.0     same
    ...
    1 better, 0 worse, 3 same; no regression beyond 5% (time) / 5% (memory)
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Row", "compare_reports", "environment_changes", "main"]

#: Environment fields compared, in the order shown.
_ENV_FIELDS = ("torch", "attnopt", "python", "platform", "device", "device_name", "cpu_count", "threads")

BETTER, WORSE, SAME = "better", "worse", "same"


@dataclass
class Row:
    """One point and variant in both reports."""

    phase: str
    batch_size: int
    seq_len: int
    variant: str
    old_s: float | None
    new_s: float | None
    time_verdict: str  # better / worse / same / "failed now" / "missing now" / "fixed" / "n/a"
    old_bytes: int | None
    new_bytes: int | None
    memory_verdict: str
    noise: float | None = None  # the relative spread the time verdict allowed for

    @property
    def time_ratio(self) -> float | None:
        return None if not self.old_s or self.new_s is None else self.new_s / self.old_s

    @property
    def memory_ratio(self) -> float | None:
        return None if not self.old_bytes or self.new_bytes is None else self.new_bytes / self.old_bytes

    @property
    def regressed(self) -> bool:
        return WORSE in (self.time_verdict, self.memory_verdict) or self.time_verdict in ("failed now", "missing now")


def _spread(rec: dict[str, Any]) -> float | None:
    """Half the relative interquartile range of a record's timed calls, or None if not recorded."""
    iqr, med = rec.get("forward_iqr_s"), rec.get("forward_s")
    if not iqr or not med:
        return None
    return (iqr[1] - iqr[0]) / (2 * med)


def _ok(rec: dict[str, Any]) -> bool:
    """Measured: status ok (a record without a status, from an older writer, when it has a time)."""
    return rec.get("status", "ok" if rec.get("forward_s") is not None else "error") == "ok" \
        and rec.get("forward_s") is not None


def _verdict(ratio: float, allowed: float) -> str:
    if ratio > 1 + allowed:
        return WORSE
    if ratio < 1 / (1 + allowed):
        return BETTER
    return SAME


def compare_reports(old: dict[str, Any], new: dict[str, Any], threshold: float = 0.05,
                    memory_threshold: float = 0.05) -> list[Row]:
    """One :class:`Row` per (phase, batch size, sequence length, variant) found in both reports."""
    if threshold < 0 or memory_threshold < 0:
        raise ValueError("thresholds must be >= 0 (a fraction: 0.05 is 5%)")

    def key(r: dict[str, Any]) -> tuple[str, int, int, str]:
        return r["phase"], r["batch_size"], r["seq_len"], r["variant"]

    before = {key(r): r for r in old.get("records", [])}
    after = {key(r) for r in new.get("records", [])}
    rows = []
    for k, o in before.items():  # measured before, absent now: a sweep that lost a point or a variant
        if k not in after and _ok(o):
            rows.append(Row(*k, o["forward_s"], None, "missing now", o.get("peak_bytes"), None, "n/a"))
    for r in new.get("records", []):
        o = before.get(key(r))
        if o is None:
            continue
        ok_old, ok_new = _ok(o), _ok(r)
        noise = None
        if ok_old and ok_new and o["forward_s"] and r["forward_s"] is not None:
            spreads = [s for s in (_spread(o), _spread(r)) if s is not None]
            noise = sum(spreads) if len(spreads) == 2 else None
            time_verdict = _verdict(r["forward_s"] / o["forward_s"], max(threshold, noise or 0.0))
        elif ok_old and not ok_new:
            time_verdict = "failed now"
        elif ok_new and not ok_old:
            time_verdict = "fixed"
        else:
            time_verdict = "n/a"
        ob, nb = o.get("peak_bytes"), r.get("peak_bytes")
        memory_verdict = _verdict(nb / ob, memory_threshold) if ok_old and ok_new and ob and nb is not None else "n/a"
        rows.append(Row(*key(r), o["forward_s"] if ok_old else None, r["forward_s"] if ok_new else None,
                        time_verdict, ob, nb, memory_verdict, noise))
    return rows


def environment_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``"torch 2.12.0 -> 2.13.0"`` per environment field that differs."""
    eo, en = old.get("environment", {}), new.get("environment", {})
    out = [f"{f} {eo.get(f)} -> {en.get(f)}" for f in _ENV_FIELDS if eo.get(f) != en.get(f)]
    mo, mn = (eo.get("matmul") or {}).get("flops_per_s"), (en.get("matmul") or {}).get("flops_per_s")
    if mo and mn and abs(mn / mo - 1) > 0.1:
        out.append(f"matmul rate {mo / 1e9:.1f} -> {mn / 1e9:.1f} GFLOP/s")
    return out


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.2f}"


def _ratio_text(ratio: float | None, verdict: str) -> str:
    if ratio is None:
        return verdict
    return f"{ratio:.2f}x {verdict}"


def render(rows: list[Row], changes: list[str], threshold: float, memory_threshold: float) -> str:
    from tabulate import tabulate

    from .report import mib_text

    lines = [f"environment: {'; '.join(changes)}" if changes else "environment: the same"]
    if not rows:
        lines.append("no point and variant is in both reports")
    else:
        table = [[r.phase, r.batch_size, r.seq_len, r.variant,
                  _ms(r.old_s), _ms(r.new_s),
                  _ratio_text(r.time_ratio, r.time_verdict)
                  + ("" if r.noise is None or r.noise <= threshold else f" (noise {100 * r.noise:.0f}%)"),
                  mib_text(r.old_bytes), mib_text(r.new_bytes),
                  _ratio_text(r.memory_ratio, r.memory_verdict)] for r in rows]
        lines.append(tabulate(table, headers=["phase", "B", "T", "variant", "old ms", "new ms", "time",
                                              "old MiB", "new MiB", "memory"]))
    counts = {v: sum(r.time_verdict == v for r in rows) for v in (BETTER, WORSE, SAME)}
    worse = [r for r in rows if r.regressed]
    verdict = (f"{len(worse)} regression(s) beyond {100 * threshold:g}% (time) / {100 * memory_threshold:g}% "
               "(memory)" if worse else
               f"no regression beyond {100 * threshold:g}% (time) / {100 * memory_threshold:g}% (memory)")
    lines.append(f"{counts[BETTER]} better, {counts[WORSE]} worse, {counts[SAME]} same in time; {verdict}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("old", type=Path, help="the earlier report.json")
    parser.add_argument("new", type=Path, help="the later report.json")
    parser.add_argument("--threshold", type=float, default=0.05,
                        help="relative time change that counts, beyond the runs' own spread (default 0.05)")
    parser.add_argument("--memory-threshold", type=float, default=0.05,
                        help="relative peak-memory change that counts (default 0.05)")


def _load(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict) or "records" not in data:
        raise ValueError(f"{path} is not an attnopt profile report (no 'records'); write one with "
                         "`attnopt profile SPEC --out DIR`")
    return data


def main(argv: list[str] | None = None) -> int:
    """``attnopt profile compare OLD NEW``: 0 no regression, 1 a regression, 2 bad input."""
    parser = argparse.ArgumentParser(prog="attnopt profile compare",
                                     description="Compare two attnopt profile reports (report.json).")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        old, new = _load(args.old), _load(args.new)
        rows = compare_reports(old, new, args.threshold, args.memory_threshold)
    except (ValueError, KeyError, TypeError) as e:  # KeyError/TypeError: a record lacks phase, B, T or variant
        why = e if isinstance(e, ValueError) else f"a record lacks or mistypes a field ({type(e).__name__}: {e})"
        print(f"attnopt profile compare: error: {why}", file=sys.stderr)
        return 2
    print(render(rows, environment_changes(old, new), args.threshold, args.memory_threshold))
    return 1 if any(r.regressed for r in rows) else 0
