"""The batch-size sweet spot (``attnopt.profiling.sweet_spot``) on fixed measurements: where throughput stops
growing, noise, failures, the memory budget; and its sentence in the summary."""

from __future__ import annotations

import pytest

from attnopt.profiling.report import summarize
from attnopt.profiling.run import _record
from attnopt.profiling.sweet_spot import BatchPoint, batch_sweeps, sweet_spot

T = 128


def tokens(b: int) -> float:
    return b * T


def _points(seconds: dict[int, float], spread: float = 0.0) -> list[BatchPoint]:
    """Points with the given median seconds, each with a relative spread (half IQR / median) of ``spread``."""
    return [BatchPoint(b, s, (s * (1 - spread), s * (1 + spread)) if spread else None) for b, s in seconds.items()]


def test_throughput_that_saturates_has_its_sweet_spot_at_the_knee():
    # tokens/s: 12.8k, 25.6k, 46.5k, 51.2k, 52.5k: +82% per doubling to 4, then +10% and +2.5%
    s = sweet_spot(_points({1: 0.010, 2: 0.010, 4: 0.011, 8: 0.020, 16: 0.039}), tokens)
    assert s.sweet_spot == 4 and not s.still_growing
    assert s.growth_per_doubling[2] == pytest.approx(0.011 * 2 / 0.020 - 1)  # 4 -> 8
    assert s.tokens_per_s[2] == pytest.approx(4 * T / 0.011) and s.latency_s[2] == 0.011
    assert s.first_failure is None and s.first_over_budget is None


def test_a_lower_threshold_moves_the_sweet_spot_out():
    points = _points({1: 0.010, 2: 0.010, 4: 0.011, 8: 0.020, 16: 0.039})
    assert sweet_spot(points, tokens, threshold=0.05).sweet_spot == 8  # 4 -> 8 gains +10% > 5%
    with pytest.raises(ValueError, match="threshold must be > 0"):
        sweet_spot(points, tokens, threshold=0)


def test_growth_within_the_noise_does_not_count():
    points = {1: 0.010, 2: 0.010 * 2 / 1.3}  # +30% per doubling
    assert sweet_spot(_points(points), tokens).sweet_spot == 2  # beyond 10%: B=2 is better
    noisy = sweet_spot(_points(points, spread=0.2), tokens)  # the two runs' spread: 40% > 30%
    assert noisy.sweet_spot == 1 and noisy.spread == [pytest.approx(0.2), pytest.approx(0.2)]


def test_still_growing_at_the_largest_batch_size():
    s = sweet_spot(_points({1: 0.010, 2: 0.011, 4: 0.012}), tokens)
    assert s.sweet_spot == 4 and s.still_growing


def test_a_dip_does_not_hide_later_growth():
    # B=4 is slower than B=2 (a noisy run), but B=8 beats every smaller batch size
    s = sweet_spot(_points({1: 0.010, 2: 0.0105, 4: 0.027, 8: 0.020}), tokens)
    assert s.sweet_spot == 8 and s.still_growing


def test_the_first_failure_and_the_first_over_budget_bound_the_candidates():
    points = [BatchPoint(1, 0.010, memory_bytes=100), BatchPoint(2, 0.011, memory_bytes=200),
              BatchPoint(4, 0.012, memory_bytes=400), BatchPoint(8, None, status="oom",
                                                              error="RuntimeError: out of memory"),
              BatchPoint(16, 0.05, memory_bytes=1600)]
    s = sweet_spot(points, tokens)
    assert s.first_failure == {"batch_size": 8, "status": "oom", "error": "RuntimeError: out of memory"}
    assert s.candidates == [1, 2, 4] and s.sweet_spot == 4 and s.still_growing  # B=16 is past the failure
    assert s.tokens_per_s[3] is None and s.latency_s[3] is None
    budget = sweet_spot(points, tokens, memory_budget=300)
    assert budget.first_over_budget == {"batch_size": 4, "memory_bytes": 400, "budget": 300}
    assert budget.candidates == [1, 2] and budget.sweet_spot == 2


def test_one_candidate_gives_no_verdict():
    s = sweet_spot([BatchPoint(1, 0.01), BatchPoint(2, None, status="error", error="ValueError: no")], tokens)
    assert s.sweet_spot is None and not s.still_growing and s.first_failure["batch_size"] == 2


def test_records_become_sweeps_and_the_summary_says_it_in_words():
    # decode: one new token per sequence, so tokens per call = B
    times = {1: 0.010, 2: 0.010, 4: 0.0105, 8: 0.0205}
    records = [_record("decode", b, 64, "auto", forward_s=s, peak_bytes=1000 * b, kv_context_bytes=24 * b)
               for b, s in times.items()]
    records.append(_record("decode", 16, 64, "auto", status="oom", error="RuntimeError: CUDA out of memory."))
    records.append(_record("decode", 1, 32, "auto", forward_s=0.01, peak_bytes=10))  # one batch size: no sweep
    (sweep,) = batch_sweeps(records, memory_budget=3000)
    assert (sweep["phase"], sweep["seq_len"], sweep["variant"]) == ("decode", 64, "auto")
    assert sweep["tokens_per_s"][:2] == [pytest.approx(100.0), pytest.approx(200.0)]
    assert sweep["first_over_budget"] == {"batch_size": 4, "memory_bytes": 4096, "budget": 3000}  # peak + KV cache
    assert sweep["sweet_spot"] == 2 and sweep["still_growing"]
    (line,) = [s for s in summarize(records, sweeps=[sweep], memory_budget=3000) if "throughput" in s]
    assert line.startswith("decode, T=64, auto: throughput still grows at B=2, the largest batch size that runs "
                           "within the budget (200 tokens/s")
    assert "B=16 is the first to fail (oom: RuntimeError: CUDA out of memory.)" in line
    assert "B=4 is the first above the memory budget" in line
    (sweep,) = batch_sweeps(records)
    (line,) = [s for s in summarize(records, sweeps=[sweep]) if "throughput" in s]
    assert "stops growing at B=4 (381 tokens/s, 10.50 ms per call)" in line and "(B=8: +2% per doubling)" in line


def test_growth_to_the_end_of_the_sweep_says_to_try_larger_batch_sizes():
    records = [_record("prefill", b, T, "sdpa", forward_s=s, peak_bytes=10) for b, s in ((1, 0.010), (2, 0.011))]
    (line,) = [s for s in summarize(records, sweeps=batch_sweeps(records)) if "throughput" in s]
    assert line == ("prefill, T=128, sdpa: throughput still grows at the largest batch size, B=2 (23.3k tokens/s, "
                    "11.00 ms per call; +82% per doubling from B=1): try larger batch sizes.")
