"""The selector's statistics: quartiles, the sign-test interval on paired ratios, and its verdicts."""

from __future__ import annotations

import math
import random

import pytest

from attnopt.selection.stats import _rank, compare, min_pairs, quartiles


def test_quartiles():
    assert quartiles([3.0]) == (3.0, 3.0, 3.0)
    assert quartiles([1.0, 2.0, 3.0, 4.0, 5.0]) == (2.0, 3.0, 4.0)
    with pytest.raises(ValueError):
        quartiles([])


@pytest.mark.parametrize("confidence, n", [(0.9, 5), (0.95, 6), (0.99, 8)])
def test_min_pairs_is_where_one_sign_everywhere_becomes_significant(confidence, n):
    assert min_pairs(confidence) == n
    assert _rank(n - 1, confidence) == 0 and _rank(n, confidence) == 1


@pytest.mark.parametrize("n, k", [(6, 1), (9, 2), (20, 6), (100, 40)])  # the sign test's 95% ranks (tables)
def test_interval_ranks_match_the_binomial_tables(n, k):
    assert _rank(n, 0.95) == k


def test_too_few_rounds_decide_nothing_however_clear():
    c = compare([2.0] * 5, [1.0] * 5, confidence=0.95, tie=0.03)
    assert c.verdict == "unresolved" and c.ratio == pytest.approx(2.0)
    assert c.lo == 0.0 and c.hi == math.inf


def test_verdicts():
    slow = compare([2.0] * 6, [1.0] * 6, confidence=0.95, tie=0.03)
    assert slow.verdict == "slower" and slow.describe() == "x2 [2, 2]"
    assert compare([1.0] * 6, [2.0] * 6, confidence=0.95, tie=0.03).verdict == "faster"
    assert compare([1.0] * 6, [1.01] * 6, confidence=0.95, tie=0.03).verdict == "tie"  # consistent, but within 3%
    assert compare([1.0] * 6, [1.01] * 6, confidence=0.95, tie=0.0).verdict == "faster"
    wide = compare([1.0, 1.2, 0.8, 1.1, 0.9, 1.0], [1.0] * 6, confidence=0.95, tie=0.03)
    assert wide.verdict == "unresolved"


def test_pairs_are_the_common_prefix():
    c = compare([2.0] * 10, [1.0] * 7, confidence=0.95, tie=0.03)
    assert c.n == 7


def test_one_huge_outlier_moves_the_interval_by_one_rank_only():
    rng = random.Random(0)
    fast = [rng.gauss(1.0, 0.02) for _ in range(20)]
    slow = [rng.gauss(1.3, 0.02) for _ in range(20)]
    fast[0] = 50.0  # the first round under a load spike
    c = compare(slow, fast, confidence=0.95, tie=0.03)
    assert c.verdict == "slower" and 1.2 < c.lo < c.ratio < c.hi < 1.4


def test_interval_covers_the_true_median_ratio_about_as_often_as_promised():
    rng = random.Random(1)
    misses = 0
    for _ in range(400):  # heavy-tailed, skewed noise: log-normal times with one-sided spikes
        a = [1.1 * rng.lognormvariate(0, 0.2) * (5 if rng.random() < 0.1 else 1) for _ in range(15)]
        b = [1.0 * rng.lognormvariate(0, 0.2) * (5 if rng.random() < 0.1 else 1) for _ in range(15)]
        c = compare(a, b, confidence=0.9, tie=0.03)
        misses += not c.lo <= 1.1 <= c.hi
    assert misses / 400 <= 0.1 + 0.03  # the sign test is conservative: at most 1 - confidence, plus sampling


def test_zero_times_do_not_break_the_ratio():
    assert compare([0.0] * 6, [0.0] * 6, confidence=0.95, tie=0.03).verdict == "tie"
