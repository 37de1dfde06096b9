"""``DIR/report.html``: the whole profile on one self-contained page, to open and share.

The page holds the summary in words, the results and breakdown tables, the batch-size sweet
spots, every plot (inline, as base64 PNG: the page needs no other file) and the environment.
``report.json`` stays the data; the page is rendered from it and written atomically beside it.

    >>> write_html(Path("prof/report.html"), report)     # report: what attnopt.profile returns
"""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..env import __version__
from .report import BREAKDOWN_HEADERS, TABLE_HEADERS, breakdown_rows, ms_text, rate_text, table_rows, write_atomic

__all__ = ["render_html", "write_html"]

_CSS = """
:root { color-scheme: light; --line: #d8dde3; --head: #f3f5f7; --muted: #5f6b76; --accent: #1f6feb; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif;
       margin: 0; color: #1d232a; background: #fff; }
header { padding: 20px 28px 14px; border-bottom: 1px solid var(--line); background: #fafbfc; }
header h1 { font-size: 20px; margin: 0 0 4px; }
header p { margin: 2px 0; color: var(--muted); }
main { padding: 8px 28px 40px; }
section { margin-top: 26px; }
summary h2 { display: inline; border: 0; }
summary { cursor: pointer; margin-bottom: 8px; border-bottom: 1px solid var(--line); padding-bottom: 4px; }
h2 { font-size: 16px; margin: 0 0 8px; padding-bottom: 4px; border-bottom: 1px solid var(--line); }
ul.summary { margin: 0 0 6px; padding-left: 20px; }
h3 { font-size: 13px; margin: 10px 0 2px; color: var(--muted); text-transform: uppercase; letter-spacing: .04em; }
ul.summary li { margin: 3px 0; }
.scroll { overflow-x: auto; border: 1px solid var(--line); border-radius: 6px; }
table { border-collapse: collapse; font-size: 12.5px; width: 100%; }
th, td { padding: 4px 7px; border-bottom: 1px solid var(--line); text-align: left; vertical-align: top; }
th { background: var(--head); position: sticky; top: 0; font-weight: 600; vertical-align: bottom; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.list { white-space: pre-line; min-width: 10em; }
tr:nth-child(even) td { background: #fbfcfd; }
tr.failed td { background: #fff4f4; }
td.status-ok { color: #1a7f37; }
td.status-oom, td.status-error { color: #cf222e; font-weight: 600; }
.note { color: var(--muted); font-size: 12.5px; margin: 6px 0 0; }
.plots { display: grid; grid-template-columns: repeat(auto-fill, minmax(520px, 1fr)); gap: 18px; }
figure { margin: 0; border: 1px solid var(--line); border-radius: 6px; padding: 8px; background: #fff; }
figure.wide { grid-column: 1 / -1; }
figure img { display: block; max-width: 100%; height: auto; margin: 0 auto; }
figcaption { color: var(--muted); font-size: 12px; margin-top: 6px; text-align: center; }
dl.env { display: grid; grid-template-columns: max-content 1fr; gap: 3px 16px; margin: 0; }
dl.env dt { color: var(--muted); }
dl.env dd { margin: 0; font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 12.5px; }
footer { color: var(--muted); font-size: 12px; padding: 0 28px 24px; }
"""

_WIDE = ("breakdown", "memory_", "batch_size")  # plots given the page's full width


def _cell(value: Any) -> str:
    text = "" if value is None else str(value)
    numeric = isinstance(value, (int, float)) or (text[:1].isdigit() or text[:1] == "-" and text[1:2].isdigit())
    return f'<td class="num">{html.escape(text)}</td>' if numeric else f"<td>{html.escape(text)}</td>"


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], row_classes: Sequence[str] = (),
           lists: Sequence[str] = ()) -> str:
    """An HTML table; the columns named in ``lists`` hold ``a, b, c`` lists, shown one item a line."""
    numeric = {h for j, h in enumerate(headers) if rows and all(_cell(r[j]).startswith('<td class="num"')
                                                                for r in rows if r[j] not in ("", None))}
    head = "".join(f'<th class="num">{html.escape(h)}</th>' if h in numeric else f"<th>{html.escape(h)}</th>"
                   for h in headers)
    body = []
    for i, row in enumerate(rows):
        cls = row_classes[i] if i < len(row_classes) and row_classes[i] else ""
        cells = []
        for h, v in zip(headers, row):
            if h == "status":
                cells.append(f'<td class="status-{html.escape(str(v))}">{html.escape(str(v))}</td>')
            elif h in lists:  # one item a line; long op names may break after their underscores
                items = html.escape(str(v).replace(", ", "\n")).replace("_", "_<wbr>")
                cells.append(f'<td class="list">{items}</td>')
            else:
                cells.append(_cell(v))
        body.append(f'<tr class="{cls}">' + "".join(cells) + "</tr>" if cls else "<tr>" + "".join(cells) + "</tr>")
    return f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table></div>'


def _sweep_rows(sweeps: Sequence[dict[str, Any]]) -> list[list[Any]]:
    rows = []
    for s in sweeps:
        per_b = ", ".join(f"B={b}: {rate_text(x)}" for b, x in zip(s["batch_sizes"], s["tokens_per_s"])
                          if x is not None)
        lat = ", ".join(f"B={b}: {ms_text(x)}" for b, x in zip(s["batch_sizes"], s["latency_s"]) if x is not None)
        spot = "-" if s["sweet_spot"] is None else f"B={s['sweet_spot']}" + (" (still growing)"
                                                                              if s["still_growing"] else "")
        f = s["first_failure"]
        fail = "-" if f is None else f"B={f['batch_size']} {f['status']}"
        over = "-" if s["first_over_budget"] is None else f"B={s['first_over_budget']['batch_size']}"
        rows.append([s["phase"], s["seq_len"], s["variant"], per_b, lat, spot, fail, over])
    return rows


def _environment(report: dict[str, Any]) -> str:
    env, options = report["environment"], report["options"]
    matmul = env.get("matmul") or {}
    items = [
        ("spec", report["spec"]), ("model", report["description"]),
        ("device", f"{env['device']} ({env['device_name']})"), ("dtype", options.get("dtype")),
        ("torch", env["torch"]), ("attnopt", env["attnopt"]), ("python", env["python"]),
        ("platform", env.get("platform")), ("threads / CPUs", f"{env['threads']} / {env.get('cpu_count')}"),
        ("1-min load average", env.get("load_average")),
        ("matmul rate", f"{matmul.get('flops_per_s', 0) / 1e9:.1f} GFLOP/s ({matmul.get('size')}^3, "
                        f"{matmul.get('dtype')})" if matmul else None),
        ("sweep", f"batch sizes {options['batch_sizes']}, sequence lengths {options['seq_lens']}, phase "
                  f"{options['phase']}, variants {', '.join(options['variants'])}, {options['repeats']} repeats"),
        ("generation", env.get("generation")),
    ]
    return '<dl class="env">' + "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(str(v))}</dd>"
                                        for k, v in items if v is not None) + "</dl>"


def _figure(path: str) -> str:
    name = Path(path).name
    try:
        data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
    except OSError as e:
        return f'<figure><figcaption>{html.escape(name)}: not read ({html.escape(str(e))})</figcaption></figure>'
    wide = " wide" if name.startswith(_WIDE) else ""
    return (f'<figure class="{wide.strip()}"><img alt="{html.escape(name)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{html.escape(name)}</figcaption></figure>")


def render_html(report: dict[str, Any]) -> str:
    """The page of ``report`` (the content of ``report.json``), plots read from their paths."""
    records = report["records"]
    env = report["environment"]
    title = f"attnopt profile: {report['spec']}"
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>",
        f"<header><h1>{html.escape(title)}</h1><p>{html.escape(report['description'])}</p>",
        f"<p>{html.escape(env['device'])} ({html.escape(str(env['device_name']))}), "
        f"{html.escape(str(report['options'].get('dtype')))}, torch {html.escape(env['torch'])}, attnopt "
        f"{html.escape(env['attnopt'])}, {env['threads']} thread(s); medians of {report['options']['repeats']} "
        f"alternating runs" + ("" if report["complete"] else "; <strong>incomplete: the sweep was interrupted</strong>")
        + "</p></header><main>",
    ]
    if report["summary"]:
        groups: dict[str, list[str]] = {}  # the summary's lines by the phase they open with
        for line in report["summary"]:
            phase = line.split(",", 1)[0]
            groups.setdefault(phase if phase in ("prefill", "decode", "train") else "", []).append(line)
        parts.append('<section id="summary"><h2>Summary</h2>' + "".join(
            (f"<h3>{html.escape(phase)}</h3>" if phase else "") + '<ul class="summary">'
            + "".join(f"<li>{html.escape(line)}</li>" for line in lines) + "</ul>" for phase, lines in groups.items())
            + "</section>")
    classes = ["failed" if r["status"] in ("oom", "error") else "" for r in records]
    parts.append('<section id="results"><h2>Results</h2>' + _table(TABLE_HEADERS, table_rows(records), classes)
                 + '<p class="note">* in profiled calls (profiling slows the call too; the share compares times of '
                 "the same calls). Failed points carry their full error in report.json.</p></section>")
    rows = breakdown_rows(records, 5)
    if rows:
        lists = [h for h in BREAKDOWN_HEADERS if h.startswith("top ")]
        parts.append('<section id="breakdown"><h2>Where the time goes</h2>'
                     + _table(BREAKDOWN_HEADERS, rows, lists=lists)
                     + '<p class="note">Shares of the profiled call: ops by self time (inside the op, not its '
                     "callees) and by total time; modules by self time (outside their submodules) and by total "
                     "time. Compiled variants run one captured graph, so their modules are n/a. report.json holds "
                     "every op and module.</p></section>")
    if report.get("batch_sweeps"):
        parts.append('<section id="batch"><h2>Batch size</h2>'
                     + _table(["phase", "T", "variant", "tokens/s", "latency ms", "sweet spot", "first failure",
                               "first over budget"], _sweep_rows(report["batch_sweeps"]))
                     + f'<p class="note">Sweet spot: the smallest batch size no larger one beats by more than '
                     f"{100 * report['batch_sweeps'][0]['threshold']:g}% per doubling and beyond the noise "
                     "(see docs/profile.md).</p></section>")
    memory = [p for p in report["plots"] if Path(p).name.startswith("memory_")]
    others = [p for p in report["plots"] if p not in memory]
    if others:
        parts.append('<section id="plots"><h2>Plots</h2><div class="plots">'
                     + "".join(_figure(p) for p in others) + "</div></section>")
    if memory:
        figures = "".join(_figure(p) for p in memory)
        parts.append(f'<section id="memory"><details open><summary><h2>Memory timelines ({len(memory)})</h2>'
                     f'</summary><div class="plots">{figures}</div></details></section>')
    parts.append(f'<section id="environment"><h2>Environment</h2>{_environment(report)}</section>')
    parts.append(f"</main><footer>Written by attnopt {html.escape(__version__)} <code>attnopt profile</code>; "
                 "report.json beside this page holds every number.</footer></body></html>")
    return "\n".join(parts)


def write_html(path: Path, report: dict[str, Any]) -> None:
    """Write :func:`render_html` to ``path`` atomically, beside ``report.json``."""
    write_atomic(path, render_html(report))
