"""The PNG plots of ``attnopt profile``: curves over the sweep, the time breakdown, batch size, KV cache, memory.

* :func:`plot`: ``time_vs_seq_len.png``, ``peak_memory_vs_seq_len.png``, ``attention_share.png``
  (one line per variant and batch size, one panel per phase; with two or more sequence lengths),
  ``breakdown.png`` (one row per
  point, a stacked bar per variant: its ops' self times, attention hatched, then the rest),
  ``batch_size.png`` (throughput and latency against batch size, the sweet spot starred) when
  two or more batch sizes were swept, ``kv_cache.png`` (cache bytes against context length per
  batch size, with the budget) when a decode point ran from a KV cache;
* :func:`memory_timeline_plot`: ``memory_<phase>_B<b>_T<t>.png``, live tensor memory over one
  call per variant with the attention sites (and a training step's backward) shaded.

Everything is drawn on ``matplotlib.figure.Figure`` objects, never through pyplot, so the
caller's matplotlib backend is untouched. Without matplotlib the plots are skipped with one message.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .breakdown import top

__all__ = ["memory_timeline_plot", "plot"]

PHASE_ORDER = ("prefill", "decode", "train")
_DPI = 80
_CURVES = (
    ("time_vs_seq_len.png", "forward_s", 1e3, "time per call (ms)", True),
    ("peak_memory_vs_seq_len.png", "peak_bytes", 2.0**-20, "peak tensor memory (MiB)", True),
    ("attention_share.png", "attention_share", 100.0, "attention share of the call (%)", False),
)
_TOP_OPS = 9  # ops with their own colour in breakdown.png (tab10 less its grey); the others are "other ops"
_COLOURS = ["C0", "C1", "C2", "C3", "C4", "C5", "C6", "C8", "C9"]


def _label(phase: str) -> str:
    return {"train": "train (forward + backward)", "decode": "decode (one step)"}.get(phase, phase)


def plot(records: list[dict[str, Any]], out: Path, sweeps: Sequence[dict[str, Any]] = (),
         kv_budget: int | None = None) -> tuple[list[str], str | None]:
    """Write the PNG plots under ``out``; return their paths, or none and why (no matplotlib, no data)."""
    try:
        from matplotlib.figure import Figure  # noqa: F401
    except ImportError:
        return [], "plots skipped: matplotlib is not installed (pip install 'attnopt[plot]')"
    ok = [r for r in records if r["status"] == "ok"]
    if not ok:
        return [], "plots skipped: no measurement succeeded"
    out.mkdir(parents=True, exist_ok=True)
    # curves over the sequence length need two of them; batch_size.png draws a single length's points
    written = _curves(records, ok, out) if len({r["seq_len"] for r in ok}) > 1 else []
    for path in (_breakdown(ok, out / "breakdown.png"), _batch(records, sweeps, out / "batch_size.png"),
                 _kv(ok, out / "kv_cache.png", kv_budget)):
        if path is not None:
            written.append(path)
    return written, None


def _curves(records: list[dict[str, Any]], ok: list[dict[str, Any]], out: Path) -> list[str]:
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullLocator

    phases = [p for p in PHASE_ORDER if any(r["phase"] == p for r in ok)]
    variants = list(dict.fromkeys(r["variant"] for r in records))  # one colour per variant in every panel
    sizes = sorted({r["batch_size"] for r in records})  # one line style per batch size
    styles = ["-", "--", ":", "-."]
    written = []
    for filename, key, factor, label, log_y in _CURVES:
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
            ax.set_title(_label(phase))
            ax.grid(True, which="both", alpha=0.3)
            if ax.get_lines():
                ax.legend(fontsize="small")
        path = out / filename
        fig.savefig(path, dpi=_DPI)
        written.append(str(path))
    return written


def _segments(bd: dict[str, Any], named: list[str]) -> list[tuple[str, bool, float]]:
    """(op or group, in attention?, seconds) of one breakdown, attention first; they add up to its total."""
    parts: list[tuple[str, bool, float]] = []
    for attention in (True, False):
        by: dict[str, float] = {}
        for op in bd["ops"]:
            if op["attention"] is attention:
                name = op["name"] if op["name"] in named else "other ops"
                by[name] = by.get(name, 0.0) + op["self_s"]
        parts += [(n, attention, by[n]) for n in [*named, "other ops"] if by.get(n)]
        outside = bd["outside_ops_s"]["attention" if attention else "rest"]
        if outside > 0:
            parts.append(("outside ops", attention, outside))
    return parts


def _breakdown(ok: list[dict[str, Any]], path: Path) -> str | None:
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    recs = [r for r in ok if r.get("breakdown")]
    if not recs:
        return None
    points = list(dict.fromkeys((r["phase"], r["batch_size"], r["seq_len"]) for r in recs))
    variants = list(dict.fromkeys(r["variant"] for r in recs))
    # every bar's two largest ops, then the ops that take the most of their bars, each bar weighing alike (a long
    # point does not crowd out the rest)
    weight: dict[str, float] = {}
    firsts: list[str] = []
    for r in recs:
        bd = r["breakdown"]
        ranked = top(bd["ops"], "self_s", n=len(bd["ops"]))
        firsts += [name for name, _ in ranked[:2] if name not in firsts]
        for name, s in ranked:
            weight[name] = weight.get(name, 0.0) + s / bd["total_s"]
    by_weight = sorted(weight, key=lambda n: -weight[n])
    named = sorted(firsts, key=by_weight.index)[:_TOP_OPS]
    named = sorted(named + [n for n in by_weight if n not in named][:_TOP_OPS - len(named)], key=by_weight.index)
    colours = {n: _COLOURS[i] for i, n in enumerate(named)} | {"other ops": "#9e9e9e", "outside ops": "#dcdcdc"}
    fig = Figure(figsize=(10, 0.9 + sum(0.35 * len([r for r in recs if (r["phase"], r["batch_size"], r["seq_len"])
                                                   == p]) + 0.55 for p in points)), layout="constrained")
    heights = [len([r for r in recs if (r["phase"], r["batch_size"], r["seq_len"]) == p]) + 0.6 for p in points]
    axes = fig.subplots(len(points), 1, squeeze=False, gridspec_kw={"height_ratios": heights})[:, 0]
    for ax, (phase, b, t) in zip(axes, points):
        here = sorted((r for r in recs if (r["phase"], r["batch_size"], r["seq_len"]) == (phase, b, t)),
                      key=lambda r: variants.index(r["variant"]))
        for y, r in enumerate(here):
            bd = r["breakdown"]
            left = 0.0
            for name, attention, s in _segments(bd, named):
                ax.barh(y, s * 1e3, left=left, color=colours[name], hatch="////" if attention else None,
                        edgecolor="white" if attention else colours[name], linewidth=0)
                left += s * 1e3
            if bd["attention_s"] > 0:
                ax.plot([bd["attention_s"] * 1e3] * 2, [y - 0.4, y + 0.4], color="black", linewidth=1.2)
            share = 100 * bd["attention_s"] / bd["total_s"]
            ax.text(left, y, f"  {bd['total_s'] * 1e3:.2f} ms, attention {share:.0f}%",
                    va="center", fontsize="small")
        ax.set_yticks(range(len(here)), [r["variant"] for r in here])
        ax.invert_yaxis()
        ax.set_ylim(len(here) - 0.4, -0.6)
        ax.set_title(f"{_label(phase)}, B={b}, T={t}", fontsize="medium", loc="left")
        ax.set_xlim(0, max(r["breakdown"]["total_s"] for r in here) * 1e3 * 1.35)
        ax.grid(True, axis="x", alpha=0.3)
    axes[-1].set_xlabel("ms per call in profiled calls (each op's self time; attention hatched, left of the "
                        "black line)")
    handles = [Patch(facecolor=colours[n], label=n.replace("aten::", "")) for n in [*named, "other ops"]]
    handles += [Patch(facecolor=colours["outside ops"], label="outside ops (Python, dispatch, framework)"),
                Patch(facecolor="#777777", hatch="////", edgecolor="white", label="inside attention sites")]
    fig.legend(handles=handles, loc="outside right upper", fontsize="small")
    fig.savefig(path, dpi=_DPI)
    return str(path)


def _batch(records: list[dict[str, Any]], sweeps: Sequence[dict[str, Any]], path: Path) -> str | None:
    from matplotlib.figure import Figure

    if not sweeps:
        return None
    phases = [p for p in PHASE_ORDER if any(s["phase"] == p for s in sweeps)]
    variants = list(dict.fromkeys(r["variant"] for r in records))
    lengths = sorted({s["seq_len"] for s in sweeps})
    styles = ["-", "--", ":", "-."]
    fig = Figure(figsize=(11, 3.8 * len(phases)), layout="constrained")
    axes = fig.subplots(len(phases), 2, squeeze=False)
    for (ax_thr, ax_lat), phase in zip(axes, phases):
        for s in (s for s in sweeps if s["phase"] == phase):
            colour = f"C{variants.index(s['variant'])}"
            style = styles[lengths.index(s["seq_len"]) % len(styles)]
            label = f"{s['variant']}, T={s['seq_len']}"
            thr = [(b, x) for b, x in zip(s["batch_sizes"], s["tokens_per_s"]) if x is not None]
            lat = [(b, x * 1e3) for b, x in zip(s["batch_sizes"], s["latency_s"]) if x is not None]
            if thr:
                ax_thr.plot(*zip(*thr), marker="o", color=colour, linestyle=style, label=label)
                ax_lat.plot(*zip(*lat), marker="o", color=colour, linestyle=style, label=label)
            if s["sweet_spot"] is not None:
                x = dict(thr)[s["sweet_spot"]]
                ax_thr.plot([s["sweet_spot"]], [x], marker="*", markersize=16, color=colour, markeredgecolor="black",
                            linestyle="none")
            for key, what in (("first_failure", None), ("first_over_budget", "over budget")):
                if s[key] is not None:
                    b = s[key]["batch_size"]
                    text = what or s[key]["status"]
                    for ax in (ax_thr, ax_lat):
                        ax.axvline(b, color=colour, linestyle=":", alpha=0.8)
                        ax.annotate(f"{s['variant']}: B={b} {text}", (b, 0.03), xycoords=("data", "axes fraction"),
                                    rotation=90, va="bottom", ha="center", fontsize="x-small", color=colour,
                                    bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "edgecolor": "none",
                                          "alpha": 0.85})
        sizes = sorted({b for s in sweeps if s["phase"] == phase for b in s["batch_sizes"]})
        for ax, ylabel in ((ax_thr, "throughput (tokens/s)"), (ax_lat, "latency per call (ms)")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(sizes, [str(b) for b in sizes])
            ax.minorticks_off()
            ax.margins(x=0.08)
            if ax.get_lines():
                ax.set_yscale("log")
                _readable_log_axis(ax)
            ax.set_xlabel("batch size B")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
        ax_thr.set_title(f"{_label(phase)}: throughput (star: sweet spot)", fontsize="medium")
        ax_lat.set_title(f"{_label(phase)}: latency", fontsize="medium")
        if ax_thr.get_lines():
            ax_thr.legend(fontsize="small")
    fig.savefig(path, dpi=_DPI)
    return str(path)


def _short(v: float) -> str:
    """12k, 1.5M, 20, 0.5: a tick label."""
    for scale, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= scale:
            return f"{v / scale:g}{unit}"
    return f"{v:g}"


def _readable_log_axis(ax: Any) -> None:
    """Plain tick labels on a log y axis (12k, not 1.2x10^4); minor ones too when it spans under two decades."""
    import math

    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _short(v)))
    lo, hi = ax.get_ylim()
    if lo > 0 and math.log10(hi / lo) < 2:
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: _short(v) if f"{v:.1e}"[0] in "235" else ""))
    else:
        ax.yaxis.set_minor_formatter(NullFormatter())


def _kv(ok: list[dict[str, Any]], path: Path, budget: int | None) -> str | None:
    import numpy as np
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    served = [r for r in ok if r.get("kv_bytes_per_token")]
    if not served:
        return None
    per_of: dict[int, list[str]] = {}  # bytes per position -> the variants whose cache holds that many
    for r in served:
        names = per_of.setdefault(r["kv_bytes_per_token"], [])
        if r["variant"] not in names:
            names.append(r["variant"])
    sizes = sorted({r["batch_size"] for r in ok})
    longest = max(r["seq_len"] + 1 for r in served)
    reach = longest
    if budget:  # far enough to show where the smallest batch fills the budget, within 64x the sweep
        reach = max(longest, min(64 * longest, budget // (min(per_of) * sizes[0]) * 2))
    x = np.unique(np.geomspace(1, reach, 200).round())
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    styles = ["-", "--", ":", "-."]
    for k, (per, names) in enumerate(sorted(per_of.items())):
        for i, b in enumerate(sizes):
            ax.plot(x, per * b * x / 2**20, color=f"C{i}", linestyle=styles[k % len(styles)],
                    label=f"B={b} ({per} B per position; {', '.join(names)})")
            if budget and budget // (per * b) >= 1:
                fit = budget // (per * b)
                ax.plot([fit], [per * b * fit / 2**20], marker="|", markersize=14, color=f"C{i}")
    measured = [(r["seq_len"] + 1, r["kv_context_bytes"] / 2**20, sizes.index(r["batch_size"])) for r in served
                if r.get("kv_context_bytes")]
    for pos, mib, i in measured:
        ax.plot([pos], [mib], marker="o", color=f"C{i}", markeredgecolor="black", linestyle="none")
    if budget:
        ax.axhline(budget / 2**20, color="black", linestyle="--", linewidth=1)
        ax.annotate(f"KV budget {budget / 2**20:.4g} MiB", (x[0], budget / 2**20), va="bottom", fontsize="small")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.0f}"))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _short(v)))
    ax.set_xlabel("context length (positions)")
    ax.set_ylabel("KV cache (MiB)")
    ax.set_title("KV cache: bytes per position x batch size x context length\n(dots: the sweep's decode points"
                 + ("; bars: the longest context that fits the budget)" if budget else ")"), fontsize="medium")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=_DPI)
    return str(path)


def memory_timeline_plot(timelines: dict[str, Any], path: Path, title: str) -> str | None:
    """Live tensor memory over one call per variant (rows), attention sites shaded; None without matplotlib."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        return None
    if not timelines:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(10, 0.6 + 2.1 * len(timelines)), layout="constrained")
    axes = fig.subplots(len(timelines), 1, squeeze=False)[:, 0]
    for ax, (variant, tl) in zip(axes, timelines.items()):
        mib = [b / 2**20 for b in tl.live_bytes]
        for _, start, end in tl.sites:
            ax.axvspan(start, end, color="C3", alpha=0.25, linewidth=0)
        if tl.backward is not None:
            ax.axvspan(*tl.backward, color="C2", alpha=0.12, linewidth=0)
        ax.step(tl.t_ms, mib, where="post", color="C0", linewidth=1.2)
        peak = max(range(len(mib)), key=mib.__getitem__)
        end = max(tl.call_ms, tl.t_ms[-1])
        ax.plot([tl.t_ms[peak]], [mib[peak]], marker="o", color="black")
        right = tl.t_ms[peak] > 0.7 * end  # near the right edge the label goes to the left of the point
        ax.annotate(f" peak {mib[peak]:.3g} MiB ", (tl.t_ms[peak], mib[peak]), va="bottom", fontsize="small",
                    ha="right" if right else "left")
        ax.set_xlim(0, end)
        ax.set_ylim(0, max(mib) * 1.2 or 1)
        ax.set_ylabel("live MiB")
        what = ("attention site(s)" if tl.marks == "sites" else
                "module(s) holding attention sites (the model as written has no site ranges)")
        ax.set_title(f"{variant}: {len({s[0] for s in tl.sites})} {what}, {len(tl.sites)} call(s) shaded",
                     fontsize="medium", loc="left")
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("ms from the start of the call (profiled with profile_memory: slower than unprofiled)")
    kinds = {tl.marks for tl in timelines.values()}
    handles = [Patch(facecolor="C3", alpha=0.25, label=" / ".join(
        k for k in ("attnopt::<site> ranges" if "sites" in kinds else "",
                    "modules holding the sites" if "modules" in kinds else "") if k))]
    if any(tl.backward is not None for tl in timelines.values()):
        handles.append(Patch(facecolor="C2", alpha=0.12, label="backward"))
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize="small")
    fig.suptitle(f"{title}: live tensor memory over one call (allocated minus freed since its start)",
                 fontsize="medium")
    fig.savefig(path, dpi=_DPI)
    return str(path)
