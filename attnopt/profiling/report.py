"""What ``attnopt profile`` writes: ``report.json`` (schema below), the terminal table, plots, summary.

``report.json`` holds ``schema_version``, the SPEC and options, the environment (versions,
device, the measured matmul rate), ``complete`` (False while the sweep runs or after an
interruption), one record per sweep point and variant, the closing summary sentences and the
plots written. :data:`REPORT_SCHEMA` is its JSON Schema (draft 2020-12); ``docs/profile.md``
explains every field. It is rewritten atomically (temp file + ``os.replace``) after every
point, so an interrupted sweep leaves a valid partial report.

The plots are :mod:`attnopt.profiling.plots` (``plot`` is re-exported here), the HTML page
:mod:`attnopt.profiling.html`.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import textwrap
from pathlib import Path
from typing import Any

from .breakdown import top
from .plots import plot

__all__ = ["BREAKDOWN_HEADERS", "REPORT_SCHEMA", "SCHEMA_VERSION", "TABLE_HEADERS", "breakdown_rows", "breakdown_table",
           "mib_text", "ms_text", "plot", "rate_text", "summarize", "table", "table_rows", "write_json"]

SCHEMA_VERSION = 1

_NUM = {"type": ["number", "null"]}
_STR = {"type": ["string", "null"]}
_SECONDS = {"type": "number", "minimum": 0}

_ROW = {"self_s": {"type": "number"}, "total_s": {"type": "number"}, "calls": {"type": "number", "minimum": 0}}
BREAKDOWN_SCHEMA: dict[str, Any] = {
    "type": ["object", "null"],
    "required": ["time", "calls", "total_s", "backward_s", "attention_s", "rest_s", "outside_ops_s", "ops",
                 "modules", "modules_note"],
    "additionalProperties": False,
    "properties": {
        "time": {"enum": ["cpu", "device"]},
        "calls": {"type": "integer", "minimum": 1},
        "total_s": _SECONDS,
        "backward_s": _NUM,
        "attention_s": {"type": "number"},
        "rest_s": {"type": "number"},
        "outside_ops_s": {"type": "object", "required": ["attention", "rest"], "additionalProperties": False,
                          "properties": {"attention": {"type": "number"}, "rest": {"type": "number"}}},
        "ops": {"type": "array", "items": {
            "type": "object", "required": ["name", "pass", "attention", "self_s", "total_s", "calls"],
            "additionalProperties": False,
            "properties": {"name": {"type": "string"}, "pass": {"enum": ["forward", "backward"]},
                           "attention": {"type": "boolean"}, **_ROW}}},
        "modules": {"type": ["array", "null"], "items": {
            "type": "object", "required": ["path", "self_s", "total_s", "calls"], "additionalProperties": False,
            "properties": {"path": {"type": "string"}, **_ROW}}},
        "modules_note": _STR,
    },
}

BATCH_SWEEP_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["phase", "seq_len", "variant", "batch_sizes", "tokens_per_s", "latency_s", "growth_per_doubling",
                 "spread", "sweet_spot", "still_growing", "first_failure", "first_over_budget", "threshold",
                 "candidates"],
    "additionalProperties": False,
    "properties": {
        "phase": {"enum": ["prefill", "decode", "train"]},
        "seq_len": {"type": "integer", "minimum": 1},
        "variant": {"type": "string"},
        "batch_sizes": {"type": "array", "items": {"type": "integer"}},
        "tokens_per_s": {"type": "array", "items": _NUM},
        "latency_s": {"type": "array", "items": _NUM},
        "growth_per_doubling": {"type": "array", "items": _NUM},
        "spread": {"type": "array", "items": _NUM},
        "sweet_spot": {"type": ["integer", "null"]},
        "still_growing": {"type": "boolean"},
        "first_failure": {"type": ["object", "null"], "required": ["batch_size", "status", "error"]},
        "first_over_budget": {"type": ["object", "null"], "required": ["batch_size", "memory_bytes", "budget"]},
        "threshold": {"type": "number", "exclusiveMinimum": 0},
        "candidates": {"type": "array", "items": {"type": "integer"}},
    },
}

RECORD_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["batch_size", "seq_len", "phase", "variant", "status", "error", "decode_method", "decode_note",
                 "forward_s", "profiled_forward_s", "attention_s", "attention_share", "attention_method",
                 "attention_note", "sites",
                 "peak_bytes", "peak_op", "attention_flops", "attention_flops_per_s", "roofline_ratio",
                 "idle_gap_s", "idle_gap_share", "idle_gap_note", "speedup_vs_eager", "peak_ratio_vs_eager",
                 "trace", "memory_timeline"],
    "additionalProperties": False,
    "properties": {
        "batch_size": {"type": "integer", "minimum": 1},
        "seq_len": {"type": "integer", "minimum": 1},
        "phase": {"enum": ["prefill", "decode", "train"]},
        "variant": {"type": "string"},
        "status": {"enum": ["ok", "oom", "error", "skipped"]},
        "error": _STR,
        "decode_method": {"enum": ["kv_cache", "full_recompute", None]},
        "decode_note": _STR,
        "forward_s": _NUM,
        "profiled_forward_s": _NUM,
        "attention_s": _NUM,
        "attention_share": _NUM,
        "attention_method": {"enum": ["site_ranges", "captured_regions", None]},
        "attention_note": _STR,
        "sites": {"type": "object", "additionalProperties": {
            "type": "object", "required": ["seconds", "where"], "additionalProperties": False,
            "properties": {"seconds": {"type": "number"}, "where": {"type": "string"}}}},
        "peak_bytes": {"type": ["integer", "null"]},
        "peak_op": {"type": ["object", "null"], "required": ["op", "shapes", "alloc_bytes", "module", "site"],
                    "additionalProperties": False,
                    "properties": {"op": _STR, "shapes": {"type": "array"},
                                   "alloc_bytes": {"type": ["integer", "null"]}, "module": _STR, "site": _STR,
                                   # a training step's backward: module and site are those of its forward op
                                   "backward": {"type": "boolean"}}},
        "attention_flops": _NUM,
        "attention_flops_per_s": _NUM,
        "roofline_ratio": _NUM,
        "idle_gap_s": _NUM,
        "idle_gap_share": _NUM,
        "idle_gap_note": _STR,
        "speedup_vs_eager": _NUM,
        "peak_ratio_vs_eager": _NUM,
        "trace": _STR,
        "memory_timeline": _STR,
        # first and third quartiles of the timed calls behind forward_s (reports before it lack the field)
        "forward_iqr_s": {"type": ["array", "null"], "items": {"type": "number"}, "minItems": 2, "maxItems": 2},
        # decode through a KV cache: cache bytes per position of one sequence, and for this point's batch and
        # context (T + 1 positions)
        "kv_bytes_per_token": {"type": ["integer", "null"]},
        "kv_context_bytes": {"type": ["integer", "null"]},
        # train: median seconds of the backward inside the timed steps (forward_s is the whole step)
        "backward_s": _NUM,
        # where the profiled calls' time goes (attnopt.profiling.breakdown); null when the variant failed
        "breakdown": BREAKDOWN_SCHEMA,
        # the point's memory timeline PNG (--memory-timeline)
        "memory_plot": _STR,
        # calls at this point that a rewritten site ran as written (or by a replacement): site -> reason -> calls
        "fallbacks": {"type": "object", "additionalProperties": {
            "type": "object", "additionalProperties": {"type": "integer", "minimum": 1}}},
    },
}

REPORT_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["schema_version", "command", "spec", "description", "options", "environment", "complete",
                 "records", "summary", "plots"],
    "additionalProperties": False,
    "properties": {
        "schema_version": {"const": SCHEMA_VERSION},
        "command": {"type": "string"},
        "spec": {"type": "string"},
        "description": {"type": "string"},
        "options": {"type": "object", "required": ["batch_sizes", "seq_lens", "phase", "variants", "dtype",
                                                   "device", "repeats", "trace"]},
        "environment": {"type": "object", "required": ["torch", "attnopt", "python", "device", "device_name",
                                                       "threads", "matmul"],
                        "properties": {"matmul": {"type": "object",
                                                  "required": ["size", "dtype", "seconds", "flops_per_s"]}}},
        "complete": {"type": "boolean"},
        "records": {"type": "array", "items": RECORD_SCHEMA},
        # per (phase, T, variant) swept over 2+ batch sizes: throughput, latency, the sweet spot
        "batch_sweeps": {"type": "array", "items": BATCH_SWEEP_SCHEMA},
        "summary": {"type": "array", "items": {"type": "string"}},
        "plots": {"type": "array", "items": {"type": "string"}},
        "html": _STR,
    },
}


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` as JSON, atomically (:func:`write_atomic`)."""
    write_atomic(path, json.dumps(data, indent=1, allow_nan=False) + "\n")


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically: a temp file in the same folder, then ``os.replace``.

    The file gets the mode ``open()`` would give it (``0o666`` less the umask), like the plots beside
    it; ``mkstemp`` alone would leave it readable by its owner only.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        if hasattr(os, "fchmod"):  # not on Windows, where modes are not Unix modes anyway
            os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _kv_lines(records: list[dict[str, Any]], kv_budget: int | None) -> list[str]:
    """What the KV cache costs at the longest decode point a cache served, and what fits in the budget."""
    served = [r for r in records if r["status"] == "ok" and r.get("kv_bytes_per_token")]
    if not served:
        return []
    r = max(served, key=lambda r: (r["seq_len"], r["batch_size"]))
    per, positions = r["kv_bytes_per_token"], r["seq_len"] + 1
    line = (f"decode, B={r['batch_size']}, T={r['seq_len']}: the KV cache holds {per} B per position per "
            f"sequence, {mib_text(per * positions)} MiB per sequence of {positions} positions, "
            f"{mib_text(r['kv_context_bytes'])} MiB for the batch")
    if kv_budget:
        line += (f"; in a KV budget of {mib_text(kv_budget)} MiB, {kv_budget // (per * positions)} concurrent "
                 f"sequence(s) of {positions} positions fit")
    return [line + "."]


def _shorten(text: str, width: int = 160) -> str:
    """``text`` on one line, cut at a word boundary with an ellipsis when longer than ``width``."""
    return textwrap.shorten(" ".join(text.split()), width=width, placeholder=" ...")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def ms_text(s: float | None) -> str:
    """Seconds as milliseconds with two decimals, ``-`` for None."""
    return "-" if s is None else f"{s * 1e3:.2f}"


def mib_text(b: int | None) -> str:
    """Bytes as MiB: one decimal from 1 MiB, two significant digits below, ``-`` for None."""
    if b is None:
        return "-"
    mib = b / 2**20
    return f"{mib:.1f}" if mib >= 1 or mib == 0 else f"{mib:.2g}"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _peak_op(r: dict[str, Any]) -> str:
    p = r.get("peak_op") or {}
    if not p.get("op"):
        return "-"
    where = p.get("site") or p.get("module")
    return (p["op"].replace("aten::", "") + (f" @{where}" if where else "")
            + (" (backward)" if p.get("backward") else ""))


TABLE_HEADERS = ["B", "T", "phase", "variant", "status", "time ms", "attn ms*", "attn %*", "peak MiB", "peak op",
                 "attn GFLOP/s (roofline)", "idle gaps", "vs eager: speed / peak"]
BREAKDOWN_HEADERS = ["B", "T", "phase", "variant", "attn / rest / outside ops", "top ops (self)", "top ops (total)",
                     "top modules (self)", "top modules (total)"]


def table(records: list[dict[str, Any]]) -> str:
    """The terminal table: one row per record."""
    from tabulate import tabulate

    return tabulate(table_rows(records), headers=TABLE_HEADERS, tablefmt="github")


def table_rows(records: list[dict[str, Any]]) -> list[list[Any]]:
    """The cells of :func:`table` (the HTML page shows the same)."""
    rows = []
    for r in records:
        share = r["attention_share"]
        flops = r["attention_flops_per_s"]
        roof = r["roofline_ratio"]
        if r["status"] != "ok":
            rows.append([r["batch_size"], r["seq_len"], r["phase"], r["variant"], r["status"],
                         (r["error"] or "")[:60], "", "", "", "", "", "", ""])
            continue
        rows.append([
            r["batch_size"], r["seq_len"], r["phase"] + (f" ({r['decode_method']})" if r["decode_method"] else ""),
            r["variant"], "ok", ms_text(r["forward_s"]), ms_text(r["attention_s"]),
            "-" if share is None else f"{100 * share:.0f}%", mib_text(r["peak_bytes"]), _peak_op(r),
            "-" if flops is None else f"{flops / 1e9:.1f} ({100 * roof:.0f}%)",
            "n/a" if r["idle_gap_s"] is None else f"{100 * r['idle_gap_share']:.0f}%",
            "" if r["variant"] == "eager" else
            f"{_ratio(r['speedup_vs_eager'])} / {_ratio(r['peak_ratio_vs_eager'])}",
        ])
    return rows


def _where(r: dict[str, Any]) -> str:
    p = r["peak_op"] or {}
    if not p.get("op"):
        return ""
    shapes = " x ".join(str(s) for s in p["shapes"][:2])
    site = p.get("site")
    where = r["sites"].get(site, {}).get("where") if site else None
    place = f"{site} ({where})" if where else (site or p["module"])
    if p.get("backward"):
        place = f"in the backward of {place}" if place else "in the backward"
    else:
        place = f"in {place}" if place else "outside attention"
    return f" at {p['op']}{f' on {shapes}' if shapes else ''} {place}"


def _changed(r: dict[str, Any]) -> str:
    if r["decode_method"] == "kv_cache":
        return "KV-cached step"
    return f"{len(r['sites'])} site(s) rewritten" if r["sites"] else "no site rewritten"


def summarize(records: list[dict[str, Any]], kv_budget: int | None = None,
              sweeps: list[dict[str, Any]] | tuple[()] = (), memory_budget: int | None = None) -> list[str]:
    """The closing summary in words, per phase: the largest cost, the peak, what attnopt changed, where the
    time goes, and over batch sizes the sweet spot; then the KV cache and the failures."""
    lines = []
    for phase in ("prefill", "decode", "train"):
        ok = [r for r in records if r["phase"] == phase and r["status"] == "ok"]
        if not ok:
            continue
        t, b = max((r["seq_len"], r["batch_size"]) for r in ok)
        at = {r["variant"]: r for r in ok if (r["seq_len"], r["batch_size"]) == (t, b)}
        base = at.get("eager") or next(iter(at.values()))
        point = f"{phase}, B={b}, T={t}"
        if base["decode_method"]:
            point += f" (one step by {base['decode_method'].replace('_', ' ')})"
        call = "training step (forward + backward)" if phase == "train" else "forward"
        if base["attention_share"] is not None:
            lines.append(f"{point}: attention is {100 * base['attention_share']:.0f}% of the {base['variant']} "
                         f"{call} ({ms_text(base['attention_s'])} of {ms_text(base['profiled_forward_s'])} ms in "
                         f"profiled calls, {len(base['sites'])} site(s)).")
        else:
            lines.append(f"{point}: the {base['variant']} {call} takes {ms_text(base['forward_s'])} ms; its attention "
                         f"time is n/a ({base['attention_note']}).")
        if base.get("backward_s") is not None:
            lines.append(f"{point}: the {base['variant']} backward takes {ms_text(base['backward_s'])} of "
                         f"{ms_text(base['forward_s'])} ms per step "
                         f"({100 * base['backward_s'] / base['forward_s']:.0f}%).")
        if base["peak_bytes"] is not None:
            lines.append(f"{point}: the {base['variant']} peak is {mib_text(base['peak_bytes'])} MiB, "
                         f"reached{_where(base)}.")
        for name, r in at.items():
            if r is base:
                continue
            if r["speedup_vs_eager"] is not None:
                speed, peak = r["speedup_vs_eager"], r["peak_ratio_vs_eager"]
                peak_text = ("n/a" if peak is None else
                             f"{peak:.1f}x lower" if peak >= 1 else f"{1 / peak:.1f}x higher")
                speed_text = f"{speed:.2f}x faster" if speed >= 1 else f"{1 / speed:.2f}x slower"
                lines.append(f"{point}: {name} ({_changed(r)}) is {speed_text} than eager, peak {peak_text} "
                             f"({mib_text(r['peak_bytes'])} MiB{_where(r)}).")
            else:
                lines.append(f"{point}: {name} takes {ms_text(r['forward_s'])} ms, "
                             f"peak {mib_text(r['peak_bytes'])} MiB.")
        lines += [f"{point}: {name}'s time goes to {text}." for name, r in at.items() if (text := _goes_to(r))]
        longest = max((s["seq_len"] for s in sweeps if s["phase"] == phase), default=None)
        lines += [_sweep_line(s, memory_budget) for s in sweeps if (s["phase"], s["seq_len"]) == (phase, longest)]
    lines += _kv_lines(records, kv_budget)
    fell = [r for r in records if r.get("fallbacks")]
    if fell:
        calls = sum(n for r in fell for counts in r["fallbacks"].values() for n in counts.values())
        first = fell[0]
        site, counts = next(iter(first["fallbacks"].items()))
        why, n = max(counts.items(), key=lambda kv: kv[1])
        lines.append(f"{calls} call(s) of rewritten sites ran as written at run time (their times include those "
                     f"calls), at {len(fell)} point(s) and variant(s); first: {first['variant']} at "
                     f"B={first['batch_size']}, T={first['seq_len']} {first['phase']}, {site}: {n} call(s): "
                     f"{_shorten(why, 100)}; report.json has them all.")
    failed = [r for r in records if r["status"] in ("oom", "error")]
    if failed:
        first = failed[0]
        lines.append(f"{len(failed)} measurement(s) failed, first: {first['variant']} at B={first['batch_size']}, "
                     f"T={first['seq_len']} {first['phase']}: {first['status']} ({_shorten(first['error'] or '')}); "
                     "report.json has the full message.")
    return lines


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "-"


def _tops(bd: dict[str, Any], rows: str, by: str, n: int = 3) -> str:
    """``addmm 31%, bmm 12%, ...``: the largest rows of a breakdown as shares of the call."""
    key = "name" if rows == "ops" else "path"
    found = top(bd[rows], by, key, n)
    return ", ".join(f"{name.replace('aten::', '')} {_pct(s, bd['total_s'])}" for name, s in found) or "-"


def _goes_to(r: dict[str, Any]) -> str | None:
    bd = r.get("breakdown")
    if not bd or not bd["ops"]:
        return None
    outside = sum(bd["outside_ops_s"].values())
    text = f"{_tops(bd, 'ops', 'self_s')} (ops' self time), {_pct(outside, bd['total_s'])} outside ops"
    if bd["modules"]:
        text += f"; by module (total): {_tops(bd, 'modules', 'total_s')}"
    return text


def breakdown_table(records: list[dict[str, Any]], n: int = 3) -> str:
    """Where each record's time goes: the top ``n`` ops and modules by self and by total time (shares of the call)."""
    from tabulate import tabulate

    rows = breakdown_rows(records, n)
    return tabulate(rows, headers=BREAKDOWN_HEADERS, tablefmt="github") if rows else ""


def breakdown_rows(records: list[dict[str, Any]], n: int = 3) -> list[list[Any]]:
    """The cells of :func:`breakdown_table`."""
    rows = []
    for r in records:
        bd = r.get("breakdown")
        if r["status"] != "ok" or not bd:
            continue
        outside = sum(bd["outside_ops_s"].values())
        modules = bd["modules"] is not None
        rows.append([r["batch_size"], r["seq_len"], r["phase"], r["variant"],
                     f"{_pct(bd['attention_s'], bd['total_s'])} / {_pct(bd['rest_s'], bd['total_s'])} / "
                     f"{_pct(outside, bd['total_s'])}",
                     _tops(bd, "ops", "self_s", n), _tops(bd, "ops", "total_s", n),
                     _tops(bd, "modules", "self_s", n) if modules else "n/a (compiled)",
                     _tops(bd, "modules", "total_s", n) if modules else "n/a (compiled)"])
    return rows


def _sweep_line(s: dict[str, Any], memory_budget: int | None) -> str:
    """The sweet spot of one (phase, T, variant) in words."""
    point = f"{s['phase']}, T={s['seq_len']}, {s['variant']}"
    by = dict(zip(s["batch_sizes"], zip(s["tokens_per_s"], s["latency_s"], s["growth_per_doubling"], s["spread"])))
    x = 100 * s["threshold"]
    spot = s["sweet_spot"]
    if spot is None:
        text = (f"{point}: no batch-size sweet spot ({len(s['candidates'])} batch size(s) measured below the first "
                f"failure and within the budget; it needs two)")
    elif s["still_growing"]:
        before = s["candidates"][-2]
        bound = spot < max(s["batch_sizes"])  # the larger ones failed or exceed the budget
        text = (f"{point}: throughput still grows at "
                + (f"B={spot}, the largest batch size that runs within the budget" if bound else
                   f"the largest batch size, B={spot}")
                + f" ({rate_text(by[spot][0])} tokens/s, {ms_text(by[spot][1])} ms per call; "
                f"{_growth(by[before][2])} per doubling from B={before})"
                + ("" if bound else ": try larger batch sizes"))
    else:
        after = s["candidates"][s["candidates"].index(spot) + 1]
        spreads = [by[b][3] for b in (spot, after)]
        noise = "" if None in spreads else f", the two runs' spread {100 * sum(spreads):.0f}%"
        text = (f"{point}: throughput stops growing at B={spot} ({rate_text(by[spot][0])} tokens/s, "
                f"{ms_text(by[spot][1])} ms per call): no larger batch size gains more than {x:g}% per doubling "
                f"beyond the noise (B={after}: {_growth(by[spot][2])} per doubling{noise})")
    if s["first_failure"] is not None:
        f = s["first_failure"]
        text += f"; B={f['batch_size']} is the first to fail ({f['status']}: {_shorten(f['error'] or '', 80)})"
    if s["first_over_budget"] is not None:
        o = s["first_over_budget"]
        text += (f"; B={o['batch_size']} is the first above the memory budget ({mib_text(o['memory_bytes'])} of "
                 f"{mib_text(o['budget'])} MiB)")
    elif memory_budget is not None and s["first_failure"] is None:
        text += f"; every batch size fits the memory budget of {mib_text(memory_budget)} MiB"
    return text + "."


def _growth(g: float) -> str:
    """``+12%``, ``-3%``, ``+0%`` (never ``-0%``)."""
    return f"{round(100 * g) + 0:+d}%"


def rate_text(x: float | None) -> str:
    """``12.3k``, ``1.5M``: a rate with three significant digits, ``-`` for None."""
    if x is None:
        return "-"
    for scale, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if x >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def finite(x: float | None) -> float | None:
    """``x``, or None when it is not a finite number (JSON has no inf/nan)."""
    return x if x is not None and math.isfinite(x) else None
