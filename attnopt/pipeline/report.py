"""The report ``explain()`` returns: one record per softmax found, rendered as a table."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..spec import REWRITTEN, SiteRecord


@dataclass
class Report:
    """Every site attnopt saw in the graphs it captured, with decisions and reasons.

    ``print(report)`` renders a table; ``report.records`` holds :class:`SiteRecord` objects;
    ``report.rewritten`` counts the sites that now run through a faster candidate;
    ``report.failures`` lists graphs that could not be processed at all (they run as written).
    """

    records: list[SiteRecord] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    graphs: int = 0

    def __iter__(self) -> Iterator[SiteRecord]:
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    @property
    def rewritten(self) -> int:
        return sum(r.decision == REWRITTEN for r in self.records)

    @property
    def sites(self) -> list[SiteRecord]:
        """Records of softmaxes that are attention (rewritten or near misses)."""
        return [r for r in self.records if r.decision != "not attention"]

    def to_dict(self) -> dict[str, Any]:
        return {"graphs": self.graphs, "rewritten": self.rewritten, "failures": list(self.failures),
                "records": [{**r.as_dict(), "tuning": {k: e.to_dict() for k, e in r.extra.get("tuning", {}).items()},
                             "fallbacks": dict(r.extra.get("fallbacks", {}))}
                            for r in self.records]}

    @property
    def falling_back(self) -> list[SiteRecord]:
        """Rewritten sites that ran some calls as written (or by a replacement) at run time: ``extra["fallbacks"]``
        counts those calls per reason."""
        return [r for r in self.records if r.decision == REWRITTEN and r.extra.get("fallbacks")]

    def table(self) -> str:
        from tabulate import tabulate

        rows = []
        for r in self.records:
            where = " ".join(x for x in (r.module_path, f"({r.source})" if r.source else "") if x)
            what = f"-> {r.rewrite}: {r.reason}" if r.decision == REWRITTEN else r.reason
            if r.decision == REWRITTEN and r.extra.get("traced_instead"):
                what += "; in graphs compiled for dynamic shapes (checked at one shape only): " + ", ".join(
                    f"{a} -> {b}" for a, b in r.extra["traced_instead"].items())
            if r.decision == REWRITTEN and r.extra.get("fallbacks"):
                what += "; at run time " + fallbacks_text(r.extra["fallbacks"])
            name = f"g{r.graph_id}.{r.name}" if self.graphs > 1 else r.name
            rows.append([name, where or "-", " ".join(r.spelling), r.decision, what])
        return tabulate(rows, headers=["site", "where", "spelling recognised", "decision", "details"],
                        tablefmt="simple", maxcolwidths=[None, 36, 40, None, 60])

    def tuning_table(self) -> str:
        """The selector's choices: per site and shape key, the chosen candidate, the timings with their
        spread, and why (a *provisional* choice was not separated from a rival and is timed again later)."""
        from tabulate import tabulate

        from ..selection.selector import format_timings

        rows = []
        for r in self.records:
            for key, entry in r.extra.get("tuning", {}).items():
                name = f"g{r.graph_id}.{r.name}" if self.graphs > 1 else r.name
                chosen = entry.choice + (" (provisional)" if entry.provisional else "")
                load = f" (load {entry.load[0]:.2g})" if entry.load else ""
                rows.append([name, key, chosen, format_timings(entry), (entry.decision or "-") + load])
        if not rows:
            return ""
        return tabulate(rows, headers=["site", "shape key", "chosen", "measured (median ms; * = chosen, its IQR; "
                                       "others: ratio to it [interval])", "why"],
                        tablefmt="simple", maxcolwidths=[None, 24, 14, 60, 48])

    def __str__(self) -> str:
        head = (f"attnopt: {self.rewritten} of {len(self.sites)} attention site(s) rewritten "
                f"in {self.graphs} captured graph(s)")
        back = self.falling_back
        if back:
            calls = sum(n for r in back for n in r.extra["fallbacks"].values())
            head += (f"; at run time {len(back)} of them ran {calls} call(s) as written (wholly or in part) or by "
                     "a replacement (see details)")
        lines = [head]
        if self.records:
            lines += ["", self.table()]
            tuned = self.tuning_table()
            if tuned:
                lines += ["", "selector choices:", tuned]
        elif not self.failures:
            lines.append("(no softmax found in the captured graphs)")
        for f in self.failures:
            lines.append(f"graph not rewritten: {f}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"Report(rewritten={self.rewritten}, sites={len(self.sites)}, graphs={self.graphs})"


def fallbacks_text(counts: dict[str, int]) -> str:
    """``{"rows ...: the call as written": 3}`` as ``"3 call(s): rows ...: the call as written"``, most first."""
    return "; ".join(f"{n} call(s): {why}" for why, n in sorted(counts.items(), key=lambda kv: -kv[1]))

