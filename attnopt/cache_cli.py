"""``attnopt cache``: look at and manage the tuning cache (what each shape key chose, and why).

    $ attnopt cache list                    # one line per entry: shape key, choice, provisional?, age, setup
    $ attnopt cache show 2                  # entry 2 of the list (or an id prefix): timings, spread, why
    $ attnopt cache clear                   # remove every entry (asks nothing; prints what it removed)
    $ attnopt cache clear --match "D=32"    # only entries whose list line contains the text
    $ attnopt cache retune --provisional    # mark entries provisional: the next use times them again

ENTRY is a number from ``list`` or a prefix (4+ hex digits) of the id it shows. An entry made under
another setup (attnopt or torch version, device, threads: see ``list``'s setup column) is never
reused; ``clear --stale`` removes those. Exit status: 0 done, 1 an ENTRY matched nothing, 2 bad usage.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .selection.cache import CacheRecord, TuningCache, TuningEntry, environment
from .selection.selector import ShapeKey

__all__ = ["add_arguments", "main"]

_NO_MATCH, _BAD_USAGE = 1, 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", type=Path, default=None,
                        help="the cache directory (default: $ATTNOPT_CACHE_DIR or the user cache directory)")
    sub = parser.add_subparsers(dest="action", metavar="action", required=True)
    sub.add_parser("list", help="one line per entry: shape key, choice, provisional or not, age, setup")
    show = sub.add_parser("show", help="one entry in full: every candidate's timings with spread, and why")
    show.add_argument("entry", metavar="ENTRY", help="a number from `attnopt cache list`, or a prefix of its id")
    for name, help_text in (("clear", "remove entries (all, or those selected); asks nothing"),
                            ("retune", "mark entries provisional (all, or those selected): their next use "
                                       "times them again")):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("entries", metavar="ENTRY", nargs="*", help="numbers from `list` or id prefixes")
        p.add_argument("--match", metavar="TEXT", help="only entries whose `list` line contains TEXT")
        p.add_argument("--provisional", action="store_true", help="only provisional entries")
        p.add_argument("--stale", action="store_true", help="only entries made under another setup")


def main(args: argparse.Namespace) -> int:
    cache = TuningCache(args.dir)
    records = cache.records()
    if args.action == "list":
        return _list(cache, records)
    if args.action == "show":
        found = _select(records, [args.entry], cache)
        if isinstance(found, int):
            return found
        print(_show(cache, found[0], records.index(found[0]) + 1))
        return 0
    chosen = _select(records, args.entries, cache)
    if isinstance(chosen, int):
        return chosen
    lines = [_line(i, r) for i, r in enumerate(records, 1)]
    chosen = [r for r in chosen if (not args.match or args.match in lines[records.index(r)])
              and (not args.provisional or r.entry.provisional) and (not args.stale or _setup(r) != "this")]
    everything = not (args.entries or args.match or args.provisional or args.stale)
    if not chosen and not (args.action == "clear" and everything and cache.unreadable()):
        print(f"no entry matched in {cache.directory}; nothing {'removed' if args.action == 'clear' else 'marked'}")
        return 0
    if args.action == "clear":
        return _clear(cache, records, chosen, everything=everything)
    return _retune(cache, chosen)


# --------------------------------------------------------------------------------------------- helpers

def _summary(record: CacheRecord) -> str:
    """The shape key as ``explain()`` writes it (``B=1 H=8 Tq<=256 Tk<=256 D=32 float32 cpu, causal``)."""
    shape = dict(record.key.get("shape", {}))
    fields = {f.name for f in dataclasses.fields(ShapeKey)}
    try:
        text = ShapeKey(**{k: v for k, v in shape.items() if k in fields}).describe()
    except Exception:  # noqa: BLE001 - written by something other than the selector: show it as it is
        return " ".join(f"{k}={v}" for k, v in sorted(shape.items()))
    budget = shape.get("budget")
    return text + (f", budget {budget / 2**20:.0f} MiB" if isinstance(budget, (int, float)) else "")


def _setup(record: CacheRecord) -> str:
    """``this`` when the entry's environment is this process's, else what differs (it is never reused)."""
    theirs = record.key.get("environment", {})
    try:
        ours = environment(str(theirs.get("device_type", "cpu")))
    except Exception:  # noqa: BLE001 - e.g. a CUDA entry read on a machine without CUDA
        return f"other: no {theirs.get('device_type')} device here"
    diff = [f"{k} {theirs.get(k)} (here {ours.get(k)})" for k in sorted(set(ours) | set(theirs))
            if theirs.get(k) != ours.get(k)]
    return "this" if not diff else "other: " + ", ".join(diff)


def _age(entry: TuningEntry) -> str:
    try:
        then = datetime.datetime.fromisoformat(entry.created)
        seconds = (datetime.datetime.now(datetime.timezone.utc) - then).total_seconds()
    except (TypeError, ValueError):
        return "?"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{max(seconds, 0):.0f} s"


def _line(index: int, record: CacheRecord) -> str:
    """The text ``--match`` searches: what ``list`` shows of the entry."""
    e = record.entry
    return " ".join([str(index), record.id[:8], _summary(record), e.choice,
                     "provisional" if e.provisional else "final", _setup(record)])


def _select(records: list[CacheRecord], wanted: Sequence[str], cache: TuningCache) -> list[CacheRecord] | int:
    """The records ``wanted`` names (all when empty), or the exit status after saying what is wrong."""
    if not wanted:
        return list(records)
    out = []
    for text in wanted:
        if text.isdigit() and len(text) < 4:
            if not 1 <= int(text) <= len(records):
                have = f"entries 1-{len(records)}" if records else "no entries"
                print(f"attnopt cache: no entry {text}: {cache.directory} holds {have}; run `attnopt cache list`",
                      file=sys.stderr)
                return _NO_MATCH
            out.append(records[int(text) - 1])
            continue
        if len(text) < 4 or any(c not in "0123456789abcdef" for c in text.lower()):
            print(f"attnopt cache: {text!r} is neither an entry number from `attnopt cache list` nor an id prefix "
                  "of 4 or more hex digits", file=sys.stderr)
            return _BAD_USAGE
        hits = [r for r in records if r.id.startswith(text.lower())]
        if not hits:
            print(f"attnopt cache: no entry with an id starting {text!r} in {cache.directory}; "
                  "run `attnopt cache list`", file=sys.stderr)
            return _NO_MATCH
        if len(hits) > 1:
            print(f"attnopt cache: {text!r} starts {len(hits)} ids ({', '.join(r.id[:12] for r in hits)}); "
                  "give more digits", file=sys.stderr)
            return _BAD_USAGE
        out.append(hits[0])
    return list({r.id: r for r in out}.values())  # each once, in the order asked


def _table(rows: list[list[Any]], headers: list[str]) -> str:
    from tabulate import tabulate

    return tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True)


# --------------------------------------------------------------------------------------------- actions

def _list(cache: TuningCache, records: list[CacheRecord]) -> int:
    where = f"{cache.directory}" + ("" if cache.disk else " (ATTNOPT_CACHE is off: this process would not read it)")
    bad = cache.unreadable()
    note = (f"{bad} unreadable or left-over cache file(s) there (corrupt, edited by hand, another layout): "
            "`attnopt cache clear` removes them") if bad else ""
    if not records:
        print(f"no tuning entries in {where}" + (f"; {note}" if note else ""))
        return 0
    rows = [[i, r.id[:8], _summary(r), r.entry.choice, "provisional" if r.entry.provisional else "final",
             _age(r.entry), _setup(r)] for i, r in enumerate(records, 1)]
    if note:
        print(note)
    print(f"{len(records)} tuning entr{'y' if len(records) == 1 else 'ies'} in {where}")
    print(_table(rows, ["#", "id", "shape key", "chosen", "decision", "age", "setup"]))
    if any(row[-1] != "this" for row in rows):
        print("Entries of another setup than this process's (versions, device, torch threads: run this with the "
              "thread settings of your programs) are never reused by it; `attnopt cache clear --stale` removes them.")
    return 0


def _show(cache: TuningCache, record: CacheRecord, index: int) -> str:
    e = record.entry
    env = record.key.get("environment", {})
    level = f" at {e.confidence:.0%}" if e.confidence else ""
    load = f"; load {' -> '.join(f'{x:.2f}' for x in e.load)}" if e.load else ""
    lines = [
        f"entry {index} (id {record.id}) in {cache.directory}",
        f"shape key:   {_summary(record)}",
        f"spec:        {record.key.get('shape', {}).get('spec', '-')}",
        f"setup:       {', '.join(f'{k} {v}' for k, v in env.items())} ({_setup(record)})",
        f"chosen:      {e.choice}" + (" (provisional: timed again where next used)" if e.provisional else ""),
        f"why:         {e.decision or '-'}",
        f"tuned:       {e.created} ({_age(e)} ago) in {e.tuning_s:.2f} s{load}",
        "",
    ]
    names = sorted(set(e.timings_ms) | set(e.rejected) - {"*"},
                   key=lambda n: (e.timings_ms.get(n, float("inf")), n))
    rows = []
    for name in names:
        ms = e.timings_ms.get(name, float("inf"))
        timed = ms != float("inf")
        spread = e.spread_ms.get(name)
        ratio = e.ratios.get(name)
        if name == e.choice:
            status = "chosen"
        elif name in e.rejected:
            status = ("rejected: " if name in e.timings_ms else "not legal: ") + e.rejected[name]
        elif name in e.pruned:
            status = "pruned: " + e.pruned[name]
        else:
            status = ""
        mem = e.peak_bytes.get(name)
        rows.append([name, f"{ms:.4g}" if timed else "-", f"{spread[0]:.4g}-{spread[1]:.4g}" if spread else "-",
                     e.rounds.get(name, "-") if timed else "-",
                     f"x{ratio[0]:.3g} [{ratio[1]:.3g}, {ratio[2]:.3g}]" if ratio else "-",
                     f"{mem / 2**20:.3g}" if mem is not None else "-", status])
    lines.append(_table(rows, ["candidate", "median ms", "IQR ms", "rounds", f"ratio to chosen{level}",
                               "peak MiB", "status"]))
    return "\n".join(lines)


def _clear(cache: TuningCache, records: list[CacheRecord], chosen: list[CacheRecord], *, everything: bool) -> int:
    removed = [r for r in chosen if cache.remove(r.key)]
    others = cache.clear() if everything else 0  # unreadable cache files and left-over temporary ones
    print(f"removed {len(removed)} entr{'y' if len(removed) == 1 else 'ies'} from {cache.directory}"
          + (":" if removed else ""))
    for r in removed:
        print(f"  {records.index(r) + 1:>3}  {r.id[:8]}  {_summary(r)} -> {r.entry.choice}")
    if others:
        print(f"  and {others} unreadable or left-over cache file(s)")
    return 0


def _retune(cache: TuningCache, chosen: list[CacheRecord]) -> int:
    if not cache.disk:  # store() writes nothing then: saying "marked" would be untrue
        print(f"attnopt cache retune: error: ATTNOPT_CACHE is off, so entries in {cache.directory} cannot be "
              "rewritten; unset it (or set ATTNOPT_CACHE=1) to retune", file=sys.stderr)
        return 2
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    for r in chosen:
        why = f"marked for re-timing by `attnopt cache retune` on {now}; was: {r.entry.decision or r.entry.choice}"
        cache.store(r.key, dataclasses.replace(r.entry, provisional=True, decision=why, samples={}))
    print(f"marked {len(chosen)} entr{'y' if len(chosen) == 1 else 'ies'} provisional in {cache.directory}; "
          "each is timed again where it is next used (the next process or attnopt.tune):")
    for r in chosen:
        print(f"  {r.id[:8]}  {_summary(r)} -> {r.entry.choice}" + (" (was provisional)" if r.entry.provisional
                                                                     else ""))
    return 0
