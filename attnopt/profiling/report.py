"""What ``attnopt profile`` writes: ``report.json`` (schema below), the terminal table, plots, summary.

``report.json`` holds ``schema_version``, the SPEC and options, the environment (versions,
device, the measured matmul rate), ``complete`` (False while the sweep runs or after an
interruption), one record per sweep point and variant, the closing summary sentences and the
plots written. :data:`REPORT_SCHEMA` is its JSON Schema (draft 2020-12); ``docs/profile.md``
explains every field. It is rewritten atomically (temp file + ``os.replace``) after every
point, so an interrupted sweep leaves a valid partial report.

Plots need matplotlib (``pip install attnopt[plot]``); without it they are skipped with one
message. They are drawn on ``matplotlib.figure.Figure`` objects, never through pyplot, so the
caller's matplotlib backend is untouched.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import textwrap
from pathlib import Path
from typing import Any

__all__ = ["REPORT_SCHEMA", "SCHEMA_VERSION", "plot", "summarize", "table", "write_json"]

SCHEMA_VERSION = 1

_NUM = {"type": ["number", "null"]}
_STR = {"type": ["string", "null"]}

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
        "phase": {"enum": ["prefill", "decode"]},
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
                                   "alloc_bytes": {"type": ["integer", "null"]}, "module": _STR, "site": _STR}},
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
        "summary": {"type": "array", "items": {"type": "string"}},
        "plots": {"type": "array", "items": {"type": "string"}},
    },
}


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` atomically: a temp file in the same folder, then ``os.replace``.

    The file gets the mode ``open()`` would give it (``0o666`` less the umask), like the plots beside
    it; ``mkstemp`` alone would leave it readable by its owner only.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        if hasattr(os, "fchmod"):  # not on Windows, where modes are not Unix modes anyway
            os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, allow_nan=False)
            f.write("\n")
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
            f"sequence, {_mib(per * positions)} MiB per sequence of {positions} positions, "
            f"{_mib(r['kv_context_bytes'])} MiB for the batch")
    if kv_budget:
        line += (f"; in a KV budget of {_mib(kv_budget)} MiB, {kv_budget // (per * positions)} concurrent "
                 f"sequence(s) of {positions} positions fit")
    return [line + "."]


def _shorten(text: str, width: int = 160) -> str:
    """``text`` on one line, cut at a word boundary with an ellipsis when longer than ``width``."""
    return textwrap.shorten(" ".join(text.split()), width=width, placeholder=" ...")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.2f}"


def _mib(b: int | None) -> str:
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
    return p["op"].replace("aten::", "") + (f" @{where}" if where else "")


def table(records: list[dict[str, Any]]) -> str:
    """The terminal table: one row per record."""
    from tabulate import tabulate

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
            r["variant"], "ok", _ms(r["forward_s"]), _ms(r["attention_s"]),
            "-" if share is None else f"{100 * share:.0f}%", _mib(r["peak_bytes"]), _peak_op(r),
            "-" if flops is None else f"{flops / 1e9:.1f} ({100 * roof:.0f}%)",
            "n/a" if r["idle_gap_s"] is None else f"{100 * r['idle_gap_share']:.0f}%",
            "" if r["variant"] == "eager" else
            f"{_ratio(r['speedup_vs_eager'])} / {_ratio(r['peak_ratio_vs_eager'])}",
        ])
    return tabulate(rows, headers=["B", "T", "phase", "variant", "status", "time ms", "attn ms*", "attn %*",
                                   "peak MiB", "peak op", "attn GFLOP/s (roofline)", "idle gaps",
                                   "vs eager: speed / peak"], tablefmt="github")


def _where(r: dict[str, Any]) -> str:
    p = r["peak_op"] or {}
    if not p.get("op"):
        return ""
    shapes = " x ".join(str(s) for s in p["shapes"][:2])
    site = p.get("site")
    where = r["sites"].get(site, {}).get("where") if site else None
    place = f"in {site} ({where})" if where else (f"in {site}" if site else (f"in {p['module']}" if p["module"]
                                                                            else "outside attention"))
    return f" at {p['op']}{f' on {shapes}' if shapes else ''} {place}"


def _changed(r: dict[str, Any]) -> str:
    if r["decode_method"] == "kv_cache":
        return "KV-cached step"
    return f"{len(r['sites'])} site(s) rewritten" if r["sites"] else "no site rewritten"


def summarize(records: list[dict[str, Any]], kv_budget: int | None = None) -> list[str]:
    """The closing summary in words: the largest cost, the peak, and what attnopt changed, per phase."""
    lines = []
    for phase in ("prefill", "decode"):
        ok = [r for r in records if r["phase"] == phase and r["status"] == "ok"]
        if not ok:
            continue
        t, b = max((r["seq_len"], r["batch_size"]) for r in ok)
        at = {r["variant"]: r for r in ok if (r["seq_len"], r["batch_size"]) == (t, b)}
        base = at.get("eager") or next(iter(at.values()))
        point = f"{phase}, B={b}, T={t}"
        if base["decode_method"]:
            point += f" (one step by {base['decode_method'].replace('_', ' ')})"
        if base["attention_share"] is not None:
            lines.append(f"{point}: attention is {100 * base['attention_share']:.0f}% of the {base['variant']} "
                         f"forward ({_ms(base['attention_s'])} of {_ms(base['profiled_forward_s'])} ms in profiled "
                         f"calls, {len(base['sites'])} site(s)).")
        else:
            lines.append(f"{point}: the {base['variant']} forward takes {_ms(base['forward_s'])} ms; its attention "
                         f"time is n/a ({base['attention_note']}).")
        if base["peak_bytes"] is not None:
            lines.append(f"{point}: the {base['variant']} peak is {_mib(base['peak_bytes'])} MiB, "
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
                             f"({_mib(r['peak_bytes'])} MiB{_where(r)}).")
            else:
                lines.append(f"{point}: {name} takes {_ms(r['forward_s'])} ms, peak {_mib(r['peak_bytes'])} MiB.")
    lines += _kv_lines(records, kv_budget)
    failed = [r for r in records if r["status"] in ("oom", "error")]
    if failed:
        first = failed[0]
        lines.append(f"{len(failed)} measurement(s) failed, first: {first['variant']} at B={first['batch_size']}, "
                     f"T={first['seq_len']} {first['phase']}: {first['status']} ({_shorten(first['error'] or '')}); "
                     "report.json has the full message.")
    return lines


_PLOTS = (
    ("time_vs_seq_len.png", "forward_s", 1e3, "time per call (ms)", True),
    ("peak_memory_vs_seq_len.png", "peak_bytes", 2.0**-20, "peak tensor memory (MiB)", True),
    ("attention_share.png", "attention_share", 100.0, "attention share of the forward (%)", False),
)


def plot(records: list[dict[str, Any]], out: Path) -> tuple[list[str], str | None]:
    """Write the PNG plots under ``out``; return their paths, or none and why (no matplotlib, no data)."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import NullLocator
    except ImportError:
        return [], "plots skipped: matplotlib is not installed (pip install 'attnopt[plot]')"
    ok = [r for r in records if r["status"] == "ok"]
    if not ok:
        return [], "plots skipped: no measurement succeeded"
    phases = [p for p in ("prefill", "decode") if any(r["phase"] == p for r in ok)]
    variants = list(dict.fromkeys(r["variant"] for r in records))  # one colour per variant in every panel
    sizes = sorted({r["batch_size"] for r in records})  # one line style per batch size
    styles = ["-", "--", ":", "-."]
    written = []
    for filename, key, factor, label, log_y in _PLOTS:
        fig = Figure(figsize=(5.5 * len(phases), 4), layout="constrained")
        axes = fig.subplots(1, len(phases), squeeze=False)[0]
        for ax, phase in zip(axes, phases):
            lines = sorted({(variants.index(r["variant"]), r["batch_size"]) for r in ok if r["phase"] == phase})
            for i, b in lines:
                variant = variants[i]
                pts = sorted((r["seq_len"], r[key] * factor) for r in ok if r["phase"] == phase
                             and (r["variant"], r["batch_size"]) == (variant, b) and r[key] is not None)
                methods = sorted({r["decode_method"] for r in ok if r["phase"] == phase and r["decode_method"]
                                  and (r["variant"], r["batch_size"]) == (variant, b)})
                how = f" ({', '.join(m.replace('_', ' ') for m in methods)})" if methods else ""
                if pts:
                    ax.plot(*zip(*pts), marker="o", color=f"C{i}", linestyle=styles[sizes.index(b) % len(styles)],
                            label=f"{variant}{how}, B={b}")
            ax.set_xscale("log", base=2)
            ticks = sorted({r["seq_len"] for r in ok if r["phase"] == phase})
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.xaxis.set_minor_locator(NullLocator())
            if log_y and any(v > 0 for line in ax.get_lines() for v in line.get_ydata()):
                ax.set_yscale("log")
            elif not log_y:
                ax.set_ylim(0, 100)
            ax.set_xlabel("sequence length T" + (" (context of the step)" if phase == "decode" else ""))
            ax.set_ylabel(label)
            ax.set_title(phase)
            ax.grid(True, which="both", alpha=0.3)
            if ax.get_lines():
                ax.legend(fontsize="small")
        path = out / filename
        fig.savefig(path, dpi=80)
        written.append(str(path))
    return written, None


def finite(x: float | None) -> float | None:
    """``x``, or None when it is not a finite number (JSON has no inf/nan)."""
    return x if x is not None and math.isfinite(x) else None
