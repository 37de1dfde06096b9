"""Decisions from noisy timings: medians, quartiles and a distribution-free interval on paired ratios.

The selector times candidates in alternating rounds, so round ``r`` gives one time per candidate
under the same conditions. Comparing candidate ``x`` with candidate ``y`` uses the per-round
ratios ``x[r] / y[r]`` (on a log scale): pairing cancels what a round shares (load, clock speed,
a cold cache), and the interval is the sign test's, the order statistics of the ratios around
their median. It assumes nothing about the shape of the noise (load spikes are one-sided and
heavy-tailed), and one huge outlier moves it by one rank at most::

    >>> fast = [9.0, 1.02, 0.99, 1.01, 1.00, 1.00, 1.01, 0.98, 1.00, 1.03]  # ms per round; a spike first
    >>> slow = [1.21, 1.20, 1.25, 1.19, 1.22, 1.24, 1.20, 1.18, 1.23, 1.21]
    >>> c = compare(slow, fast, confidence=0.95, tie=0.03)
    >>> c.verdict, f"{c.ratio:.2f}"
    ('slower', '1.20')
    >>> compare(fast, fast, confidence=0.95, tie=0.03).verdict
    'tie'

A verdict needs at least :func:`min_pairs` rounds (6 at 95%, 8 at 99%: below that even that many
ratios of one sign are not significant), so nothing is ever decided on one round.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Comparison", "compare", "min_pairs", "quartiles"]

#: Times below this (seconds or ms alike) are treated as this, so a ratio is always defined.
_TINY = 1e-12


def quartiles(xs: Sequence[float]) -> tuple[float, float, float]:
    """``(q1, median, q3)`` of ``xs`` (inclusive method; one value gives that value three times)."""
    if not xs:
        raise ValueError("quartiles of no values")
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q1, med, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, med, q3


def min_pairs(confidence: float) -> int:
    """The fewest paired rounds whose interval at ``confidence`` can exclude a ratio of 1."""
    return 1 + math.ceil(math.log2(1 / (1 - confidence)) - 1e-12)


@functools.lru_cache(maxsize=512)
def _rank(n: int, confidence: float) -> int:
    """The largest ``k`` with ``2 P(Binomial(n, 1/2) <= k - 1) <= 1 - confidence`` (0: no interval).

    ``[d_(k), d_(n+1-k)]`` (1-based order statistics) then covers the median of the ``d`` with
    probability at least ``confidence``, whatever their distribution.
    """
    alpha, total, below, k = 1 - confidence, 2**n, 0, 0
    while k < (n + 1) // 2:
        below += math.comb(n, k)  # P(B <= k) * 2**n
        if 2 * below > alpha * total:
            break
        k += 1
    return k


@dataclass(frozen=True)
class Comparison:
    """How ``x`` compares with ``y`` over ``n`` paired rounds.

    Attributes:
        ratio: the median of the per-round ratios ``x / y`` (above 1: ``x`` is slower).
        lo, hi: the interval on that median at the confidence asked for (0 and inf below
            :func:`min_pairs` rounds).
        n: paired rounds used.
        verdict: ``"tie"`` (the interval lies within ``1 +- tie``, so either serves), else
            ``"slower"`` (``lo > 1``), ``"faster"`` (``hi < 1``) or ``"unresolved"``.
    """

    ratio: float
    lo: float
    hi: float
    n: int
    verdict: str

    def describe(self) -> str:
        """``x1.18 [1.10, 1.25]``."""
        return f"x{self.ratio:.3g} [{self.lo:.3g}, {self.hi:.3g}]"


def compare(x: Sequence[float], y: Sequence[float], *, confidence: float, tie: float) -> Comparison:
    """Compare the times ``x`` with ``y``, paired by round (the common prefix of the two)."""
    n = min(len(x), len(y))
    if n == 0:
        raise ValueError("compare needs at least one paired round")
    d = sorted(math.log(max(a, _TINY) / max(b, _TINY)) for a, b in zip(x[:n], y[:n]))
    mid = statistics.median(d)
    k = _rank(n, confidence)
    lo, hi = (d[k - 1], d[n - k]) if k else (-math.inf, math.inf)
    band = math.log1p(tie)
    if -band <= lo and hi <= band:
        verdict = "tie"  # equivalent for the purpose, even where one is consistently a little faster
    elif lo > 0:
        verdict = "slower"
    elif hi < 0:
        verdict = "faster"
    else:
        verdict = "unresolved"
    return Comparison(math.exp(mid), math.exp(lo), math.exp(hi), n, verdict)
