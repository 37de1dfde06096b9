"""The profile-guided selector, driven by an injected fake timer and memory meter (deterministic).

The real timer is exercised by the end-to-end tests (it must produce a legal choice and equal
outputs); which candidate is fastest on this machine is a benchmark question
(``benchmarks/bench_select.py``), never asserted here.
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch
import torch.nn as nn

import attnopt
from attnopt.env import parse_bytes
from attnopt.kernels import registry as cand_mod
from attnopt.kernels.reference import reference_attention
from attnopt.kernels.registry import FunctionCandidate
from attnopt.selection.cache import TuningCache
from attnopt.selection.selector import Call, Selector, shape_key
from attnopt.spec import AttentionSpec


class FakeClock:
    """Seconds per candidate name; counts calls so tests can tell a cache hit from a tuning."""

    def __init__(self, times: dict[str, float], peaks: dict[str, int] | None = None, default: float = 1.0):
        self.times, self.peaks, self.default = times, peaks or {}, default
        self.timed: list[str] = []
        self.measured: list[str] = []

    def timer(self, name, run):
        run()  # candidates really run: a raising one must raise here too
        self.timed.append(name)
        return self.times.get(name, self.default)

    def memory(self, name, run):
        run()
        self.measured.append(name)
        return self.peaks.get(name, 1000)


SPEC = AttentionSpec(scale=0.25, causal="top_left")
NAMES = ["math", "sdpa", "sdpa_flash", "sdpa_math"]


def _call(grad=False, b=2, h=4, t=16, d=8):
    q, k, v = (torch.randn(b, h, t, d) for _ in range(3))
    kwargs = dict(attn_mask=None, dropout_p=0.0, is_causal=True, scale=0.25, enable_gqa=False)
    return Call(q, k, v, kwargs, grad)


def _choose(selector, call=None, spec=SPEC):
    call = call or _call()
    key = shape_key(spec, call.q, call.k, call.v, causal=True, mask=None, dropout=False, grad=call.grad)
    return selector.choose(spec, key, call)


def _selector(clock, tmp_path, names=NAMES, **kw):
    kw.setdefault("time_limit_s", None)  # the fake clock's seconds are units of its own (a limit has its tests)
    return Selector(timer=clock.timer, memory=clock.memory, cache=TuningCache(tmp_path), candidates=names, **kw)


def test_picks_the_fastest_and_keeps_every_timing(tmp_path):
    clock = FakeClock({"math": 5.0, "sdpa": 3.0, "sdpa_flash": 1.0, "sdpa_math": 4.0})
    entry = _choose(_selector(clock, tmp_path), _call())
    assert entry.choice == "sdpa_flash" and not entry.provisional
    assert entry.timings_ms == {"math": 5000.0, "sdpa": 3000.0, "sdpa_flash": 1000.0, "sdpa_math": 4000.0}
    assert entry.ratios == {} and entry.spread_ms["sdpa_flash"] == (1000.0, 1000.0)  # 5 rounds: no 99% interval
    # every rival ran 3x or more slower in each of its first five rounds: pruned there, with no confirming rounds
    assert entry.decision == "faster than the runner-up sdpa, which ran more than 2x slower in each of its 5 rounds"
    assert entry.rounds == {"math": 5, "sdpa": 5, "sdpa_flash": 5, "sdpa_math": 5}
    assert entry.pruned["sdpa"] == ("slower than sdpa_flash by more than 2x in each of its 5 rounds (at least x3); "
                                    "not timed further")
    assert set(entry.peak_bytes) == {"sdpa_flash"}  # the others were pruned: clearly slower


def test_a_candidate_slower_but_not_grossly_is_timed_the_rounds_that_can_show_it(tmp_path):
    clock = FakeClock({"math": 5.0, "sdpa": 1.9, "sdpa_flash": 1.0, "sdpa_math": 4.0})
    entry = _choose(_selector(clock, tmp_path), _call())
    assert entry.rounds == {"math": 5, "sdpa": 8, "sdpa_flash": 8, "sdpa_math": 5}
    assert entry.pruned["sdpa"].startswith("slower than sdpa_flash by x1.9 [1.9, 1.9] over 8 rounds")
    # the verdict the race looked at many times is confirmed on fresh rounds of the two alone
    assert "faster than the runner-up sdpa: sdpa/sdpa_flash x1.9 [1.9, 1.9] at 99% over 8 rounds" in entry.decision
    assert "confirmed on 8 fresh rounds" in entry.decision and not entry.provisional
    # a grossly slower one has no interval at 99% (too few rounds): its reason gives the least ratio instead
    assert "math" not in entry.ratios and "(at least x5)" in entry.pruned["math"]


@pytest.mark.parametrize("gross, rounds", [(1.0, 5), (2.0, 4)])
def test_gross_pruning_needs_a_factor_and_five_rounds(gross, rounds):
    with pytest.raises(ValueError, match="at least 5"):
        Selector(cache=False, gross=gross, gross_rounds=rounds)


def test_a_candidate_that_is_grossly_slower_in_all_but_one_round_is_not_pruned_early(tmp_path):
    """One round where it kept up (the leader was the one slowed) keeps it in the race to the eighth round."""
    class Clock(FakeClock):
        def timer(self, name, run):
            self.timed.append(name)
            if name == "sdpa" and self.timed.count("sdpa") == 3:
                return 1.0  # its third round
            return self.times[name]

    clock = Clock({"sdpa": 3.0, "sdpa_flash": 1.0})
    entry = _choose(_selector(clock, tmp_path, names=["sdpa", "sdpa_flash"]), _call())
    assert entry.rounds["sdpa"] >= 8 and "more than 2x" not in entry.pruned.get("sdpa", "")
    assert entry.choice == "sdpa_flash"


def test_the_choice_changes_with_the_timer(tmp_path):
    clock = FakeClock({"math": 0.5, "sdpa": 3.0, "sdpa_flash": 1.0, "sdpa_math": 4.0})
    assert _choose(_selector(clock, tmp_path), _call()).choice == "math"


def test_slow_candidates_are_pruned_after_several_rounds_never_one(tmp_path):
    # Before issue 15 a candidate more than 2x the best after round one was never timed again.
    clock = FakeClock({"math": 10.0, "sdpa": 1.0, "sdpa_flash": 1.1, "sdpa_math": 1.5})
    entry = _choose(_selector(clock, tmp_path), _call())
    assert clock.timed.count("math") == 5  # ten times slower in each of five rounds: 2**-5 by chance at most
    assert clock.timed.count("sdpa_math") == 8  # 1.5x: 8 rounds, the fewest that can show it at 99%
    # the choice and its runner-up: 8 race rounds, then 8 fresh rounds of the two alone that confirm the verdict
    assert clock.timed.count("sdpa") == clock.timed.count("sdpa_flash") == 16
    assert entry.choice == "sdpa" and "confirmed on 8 fresh rounds (sdpa_flash/sdpa x1.1" in entry.decision
    assert entry.pruned["math"].startswith("slower than sdpa by more than 2x in each of its 5 rounds (at least x10)")
    from attnopt.selection.selector import format_timings

    assert "math 1e+04 ms (pruned: at least x10 in each of 5 rounds)" in format_timings(entry)
    assert entry.pruned["sdpa_math"].startswith("slower than sdpa by x1.5 [1.5, 1.5] over 8 rounds")
    assert entry.rounds == {"math": 5, "sdpa": 8, "sdpa_flash": 8, "sdpa_math": 8}


def test_memory_budget_is_honoured(tmp_path):
    clock = FakeClock({"math": 5.0, "sdpa": 3.0, "sdpa_flash": 1.0, "sdpa_math": 4.0},
                      peaks={"math": 10**6, "sdpa": 10**6, "sdpa_flash": 10**9, "sdpa_math": 10**6})
    entry = _choose(_selector(clock, tmp_path, memory_budget="100MB"), _call())
    assert entry.choice == "sdpa"
    assert "over the memory budget" in entry.rejected["sdpa_flash"]


def test_a_candidate_pruned_against_a_leader_over_the_budget_is_in_again(tmp_path):
    """sdpa is pruned as slower than sdpa_flash, which the budget then rejects; a noisy sdpa_math that stayed in
    the race must not win over sdpa: the pruned candidates are measured and compared again."""
    import random

    rng = random.Random(0)
    means = {"sdpa_flash": 1.0, "sdpa": 1.2, "sdpa_math": 1.3}
    sigma = {"sdpa_flash": 0.01, "sdpa": 0.01, "sdpa_math": 0.6}

    def timer(name, run):
        return means[name] * rng.lognormvariate(0, sigma[name])

    def memory(name, run):
        return {"sdpa_flash": 10**9}.get(name, 1000)

    sel = Selector(timer=timer, memory=memory, cache=TuningCache(tmp_path), candidates=list(means),
                   memory_budget="1MB", budget_s=5.0)
    entry = _choose(sel, _call())
    assert "over the memory budget" in entry.rejected["sdpa_flash"] and "sdpa" in entry.pruned
    assert entry.choice == "sdpa" and set(entry.peak_bytes) == set(means), entry.decision


def test_a_pruned_candidate_is_not_chosen_when_memory_is_not_measured(tmp_path):
    """Inside a profiler session memory is not measured; a candidate pruned as clearly slower, whose median is
    low only because its rounds ended early, before the machine got busy, is still not the choice."""
    import random

    rng, calls = random.Random(1), {"n": 0}
    means = {"sdpa": 1e-3, "sdpa_flash": 1e-3, "sdpa_math": 1.5e-3}

    def timer(name, run):
        calls["n"] += 1
        busy = 3.0 if calls["n"] > 30 else 1.0  # a background load starts after about ten rounds
        return means[name] * busy * rng.lognormvariate(0, 0.02 if name == "sdpa_math" else 0.3)

    sel = Selector(timer=timer, cache=TuningCache(tmp_path), candidates=list(means), budget_s=0.2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        entry = _choose(sel, _call())
    assert "sdpa_math" in entry.pruned and entry.choice != "sdpa_math", entry.decision


def test_nothing_fits_the_budget_keeps_the_smallest_with_a_warning(tmp_path):
    clock = FakeClock({"math": 5.0, "sdpa": 1.0}, peaks={"math": 3 * 10**6, "sdpa": 9 * 10**6})
    with pytest.warns(UserWarning, match="no candidate fits the memory budget"):
        entry = _choose(_selector(clock, tmp_path, names=["math", "sdpa"], memory_budget=1000), _call())
    assert entry.choice == "math"


def _register(monkeypatch, name, fn):
    monkeypatch.setitem(cand_mod._REGISTRY, name, FunctionCandidate(name, fn, lambda spec: None))


def test_a_wrong_candidate_never_wins_however_fast(tmp_path, monkeypatch):
    _register(monkeypatch, "wrong", lambda q, k, v, **kw: reference_attention(q, k, v, **kw) * 1.01)
    clock = FakeClock({"wrong": 0.001, "sdpa": 1.0, "math": 2.0})
    entry = _choose(_selector(clock, tmp_path, names=["wrong", "sdpa", "math"]), _call())
    assert entry.choice == "sdpa"
    assert "output differs" in entry.rejected["wrong"]
    assert entry.timings_ms["wrong"] == math.inf
    assert "wrong" not in clock.timed


class _BadGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return 2 * g


def test_a_wrong_gradient_is_rejected_when_gradients_are_needed(tmp_path, monkeypatch):
    _register(monkeypatch, "badgrad", lambda q, k, v, **kw: reference_attention(_BadGrad.apply(q), k, v, **kw))
    clock = FakeClock({"badgrad": 0.001, "sdpa": 1.0})
    assert _choose(_selector(clock, tmp_path, names=["badgrad", "sdpa"]), _call(grad=False)).choice == "badgrad"
    entry = _choose(_selector(clock, tmp_path / "g", names=["badgrad", "sdpa"]), _call(grad=True))
    assert entry.choice == "sdpa"
    assert "grad q differs" in entry.rejected["badgrad"]


def test_a_raising_candidate_scores_infinity(tmp_path, monkeypatch):
    def boom(q, k, v, **kw):
        raise RuntimeError("no kernel for this shape")

    _register(monkeypatch, "boom", boom)
    clock = FakeClock({"boom": 0.001, "sdpa": 1.0})
    entry = _choose(_selector(clock, tmp_path, names=["boom", "sdpa"]), _call())
    assert entry.choice == "sdpa"
    assert entry.timings_ms["boom"] == math.inf
    assert "no kernel for this shape" in entry.rejected["boom"]


def test_costly_candidates_are_tried_only_where_sdpa_cannot_serve(monkeypatch):
    monkeypatch.setitem(cand_mod._REGISTRY, "slowcompile",
                        FunctionCandidate("slowcompile", reference_attention, lambda spec: None, costly=True))
    plain, why = Selector(cache=False).legal(SPEC, "cpu")
    assert "slowcompile" not in plain and "compiles for every shape" in why["slowcompile"]
    modded = AttentionSpec(scale=0.25, causal="top_left", score_mod="softcap(30)")  # SDPA cannot apply it
    legal, why = Selector(cache=False).legal(modded, "cpu")
    assert "slowcompile" in legal and "sdpa" in why


def test_cache_hit_skips_tuning_and_a_new_candidate_set_retunes(tmp_path):
    clock = FakeClock({"math": 5.0, "sdpa": 1.0, "sdpa_flash": 2.0, "sdpa_math": 4.0})
    first = _choose(_selector(clock, tmp_path), _call())
    n = len(clock.timed)
    assert n > 0
    second = _choose(_selector(clock, tmp_path), _call())  # a new process would build a new Selector
    assert len(clock.timed) == n and second.choice == first.choice
    _choose(_selector(clock, tmp_path, names=["math", "sdpa"]), _call())
    assert len(clock.timed) > n


def test_shape_buckets_share_one_tuning(tmp_path):
    clock = FakeClock({"math": 5.0, "sdpa": 1.0, "sdpa_flash": 2.0, "sdpa_math": 4.0})
    sel = _selector(clock, tmp_path)
    _choose(sel, _call(t=20))
    n = len(clock.timed)
    _choose(sel, _call(t=31))  # same power-of-two bucket (32)
    assert len(clock.timed) == n
    _choose(sel, _call(t=33))  # next bucket
    assert len(clock.timed) > n


def test_parse_bytes():
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("2GB") == 2 * 10**9
    assert parse_bytes(1234) == 1234
    assert parse_bytes(None) is None
    for bad in ("lots", "12 parsecs", -5, 0):
        with pytest.raises(ValueError):
            parse_bytes(bad)
    with pytest.raises(TypeError):
        parse_bytes(1.5)  # type: ignore[arg-type]


class Attn(nn.Module):
    def __init__(self, d=32, h=4):
        super().__init__()
        self.h, self.qkv, self.proj = h, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.h, c // self.h).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // self.h))
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        y = att.softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


def test_optimize_auto_uses_the_selector_per_bucket_and_explains(tmp_path):
    model = Attn().eval()
    clock = FakeClock({"math": 5.0, "sdpa": 3.0, "sdpa_flash": 1.0, "sdpa_math": 4.0})
    opt = attnopt.optimize(model, selector=_selector(clock, tmp_path))
    with torch.no_grad():
        for t in (9, 12, 30):
            x = torch.randn(2, t, 32)
            torch.testing.assert_close(opt(x), model(x))
    report = attnopt.explain(opt)
    tuned = {key: e.choice for r in report.records for key, e in r.extra.get("tuning", {}).items()}
    assert len(tuned) == 2 and set(tuned.values()) == {"sdpa_flash"}  # buckets 16 (9, 12) and 32 (30)
    assert "selector choices" in str(report) and "sdpa_flash 1e+03 ms" in str(report)


def test_optimize_auto_with_real_timer_matches_with_gradients():
    model = Attn()
    opt = attnopt.optimize(model, memory_budget="1GiB")
    x = torch.randn(2, 10, 32, requires_grad=True)
    out = opt(x)
    out.sum().backward()
    g_opt = x.grad.clone()
    x.grad = None
    ref = model(x)
    ref.sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(g_opt, x.grad)
    entries = [e for r in attnopt.explain(opt).records for e in r.extra.get("tuning", {}).values()]
    assert entries and all(e.choice in attnopt.candidate_names() for e in entries)
    assert all(math.isfinite(e.timings_ms[e.choice]) for e in entries)


def test_environment_variable_overrides_the_variant(monkeypatch):
    monkeypatch.setenv("ATTNOPT_VARIANT", "math")
    opt = attnopt.optimize(Attn().eval())
    with torch.no_grad():
        opt(torch.randn(1, 6, 32))
    assert {r.rewrite for r in attnopt.explain(opt).records} == {"math"}
    monkeypatch.setenv("ATTNOPT_VARIANT", "AUTO")  # the message names the variable, not only the value
    with pytest.raises(ValueError, match="the environment variable ATTNOPT_VARIANT='AUTO' names no variant"):
        attnopt.optimize(Attn())


def test_memory_budget_needs_the_selector():
    with pytest.raises(ValueError, match="variant='auto'"):
        attnopt.optimize(Attn(), variant="sdpa", memory_budget="1GiB")


def test_tune_ahead_of_time_over_a_sweep(tmp_path):
    clock = FakeClock({"math": 5.0, "sdpa": 3.0, "sdpa_flash": 1.0, "sdpa_math": 4.0})
    opt = attnopt.tune(Attn().eval(), lambda b, t: (torch.randn(b, t, 32),), batch_sizes=[1, 2], seq_lens=[8, 40],
                       progress=False, selector=_selector(clock, tmp_path))
    keys = {key for r in attnopt.explain(opt).records for key in r.extra.get("tuning", {})}
    assert len(keys) == 4
    # The disk cache now answers a new model's selector without timing anything.
    clock2 = FakeClock({})
    opt2 = attnopt.optimize(Attn().eval(), selector=_selector(clock2, tmp_path))
    with torch.no_grad():
        opt2(torch.randn(2, 40, 32))
    assert clock2.timed == []
    with pytest.raises(ValueError, match="batch_sizes"):
        attnopt.tune(Attn(), lambda b, t: (torch.randn(b, t, 32),))


def _rank(rank: int, world: int, init: str, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ["ATTNOPT_CACHE_DIR"] = os.path.join(out_dir, f"cache{rank}")
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        fastest = "sdpa_math" if rank == 0 else "math"  # each rank's own timings disagree
        clock = FakeClock({n: (0.1 if n == fastest else 1.0) for n in NAMES})
        sel = Selector(timer=clock.timer, memory=clock.memory, candidates=NAMES)
        # Inside attnopt.tune: only rank 0 tunes (here the ranks even meet different shapes: no collective,
        # so nothing can hang), then share() hands every rank rank 0's choices.
        sel.collective = True
        during = _choose(sel, _call(t=16 if rank == 0 else 64)).choice
        timed_during = len(clock.timed)
        sel.collective = False
        sel.share()
        after = _choose(sel, _call(t=16)).choice  # rank 1 now has rank 0's entry for this key
        timed_after = len(clock.timed)
        local = _choose(sel, _call(t=128)).choice  # a shape first met in a forward: each rank decides
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
            f.write(f"{during} {timed_during} {after} {timed_after} {local}")
    finally:
        dist.destroy_process_group()


def test_under_torch_distributed_ranks_run_rank0s_tuned_choices_and_never_hang(tmp_path):
    import torch.multiprocessing as mp

    init = f"file://{tmp_path / 'store'}"
    mp.spawn(_rank, args=(2, init, str(tmp_path)), nprocs=2, join=True)
    r0 = (tmp_path / "rank0.txt").read_text().split()
    r1 = (tmp_path / "rank1.txt").read_text().split()
    assert r0[0] == "sdpa_math" and int(r0[1]) > 0  # rank 0 tuned
    assert r1[0] == "sdpa" and r1[1] == "0"  # rank 1 ran a provisional choice and timed nothing
    assert r0[2] == r1[2] == "sdpa_math" and r1[3] == "0"  # after share(): rank 0's choice, no tuning on rank 1
    assert (r0[4], r1[4]) == ("sdpa_math", "math")  # outside tune each rank chooses for itself


def _masked_call(mask, grad=True, b=2, h=2, t=6, d=8):
    q, k, v = (torch.randn(b, h, t, d) for _ in range(3))
    kwargs = dict(attn_mask=mask, dropout_p=0.0, is_causal=False, scale=0.3, enable_gqa=False)
    return Call(q, k, v, kwargs, grad)


def test_gradients_are_checked_even_where_rows_are_fully_masked(tmp_path, monkeypatch):
    _register(monkeypatch, "badk", lambda q, k, v, **kw: reference_attention(q, _BadGrad.apply(k), v, **kw))
    mask = torch.zeros(6, 6)
    mask[2] = float("-inf")  # one query row sees no key: NaN as written, restored by the site
    spec = AttentionSpec(scale=0.3, mask="additive", nan_rows=True)
    call = _masked_call(mask)
    key = shape_key(spec, call.q, call.k, call.v, causal=False, mask=mask, dropout=False, grad=True)
    clock = FakeClock({"badk": 0.001, "sdpa": 1.0})
    entry = _selector(clock, tmp_path, names=["badk", "sdpa"]).choose(spec, key, call)
    assert entry.choice == "sdpa" and "grad k differs" in entry.rejected["badk"]


def test_rows_the_site_replaces_with_the_mean_do_not_reject_fast_candidates(tmp_path):
    mask = torch.zeros(6, 6)
    mask[1] = torch.finfo(torch.float32).min  # min_rows="mean": the site returns mean(v) there
    spec = AttentionSpec(scale=0.3, mask="additive", min_rows="mean")
    call = _masked_call(mask)
    key = shape_key(spec, call.q, call.k, call.v, causal=False, mask=mask, dropout=False, grad=True)
    clock = FakeClock({"sdpa": 0.1, "math": 1.0})
    entry = _selector(clock, tmp_path, names=["sdpa", "math"]).choose(spec, key, call)
    assert entry.choice == "sdpa", entry.rejected


def test_the_mask_layout_is_part_of_the_key():
    spec = AttentionSpec(scale=0.3, mask="additive")
    q = k = v = torch.randn(2, 2, 6, 8)
    keys = {shape_key(spec, q, k, v, causal=False, mask=m, dropout=False, grad=False)
            for m in (torch.zeros(6, 6), torch.zeros(2, 1, 1, 6), torch.zeros(2, 1, 1, 6, dtype=torch.bfloat16))}
    assert len(keys) == 3


def test_a_failing_tuning_never_breaks_the_forward(monkeypatch):
    def broken(*a, **k):
        raise MemoryError("no room for the reference")

    monkeypatch.setattr(Selector, "choose", broken)
    model = Attn().eval()
    opt = attnopt.optimize(model)
    x = torch.randn(1, 7, 32)
    with pytest.warns(UserWarning, match="could not tune"):
        out = opt(x)
    torch.testing.assert_close(out, model(x))


def test_optimized_and_rewritten_models_can_be_deep_copied():
    import copy

    opt = attnopt.optimize(Attn().eval())
    with torch.no_grad():
        opt(torch.randn(1, 5, 32))
    copy.deepcopy(opt)
    x = torch.randn(1, 5, 32)
    gm = torch.export.export(Attn().eval(), (x,)).module()
    new = copy.deepcopy(attnopt.rewrite(gm, (x,)))
    torch.testing.assert_close(new(x), gm(x))


class Counting(Attn):
    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return super().forward(x)


def test_tuning_before_compiling_leaves_no_trace():
    model = Counting().eval()
    opt = attnopt.optimize(model, compile=True)
    state = torch.random.get_rng_state()
    with torch.no_grad():
        opt(torch.randn(1, 5, 32))
    assert model.calls.item() == 1  # the tuning run worked on copies
    entries = [e for r in attnopt.explain(opt).records for e in r.extra.get("tuning", {}).values()]
    assert entries  # and it did tune
    torch.random.set_rng_state(state)


def test_tune_for_training_tunes_the_gradient_key_and_leaves_grads_alone(tmp_path):
    clock = FakeClock({"math": 5.0, "sdpa": 3.0, "sdpa_flash": 1.0, "sdpa_math": 4.0})
    model = Attn()
    opt = attnopt.tune(model, [(torch.randn(2, 9, 32),)], grad=True, progress=False,
                       selector=_selector(clock, tmp_path))
    keys = [key for r in attnopt.explain(opt).records for key in r.extra.get("tuning", {})]
    assert keys and all(key.endswith(", grad") or ", grad," in key for key in keys)
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match="already optimized"):
        attnopt.tune(opt, [(torch.randn(2, 9, 32),)], variant="sdpa")


# ----------------------------------------------------------------------------- decisions under noise (issue 15)

class NoisyClock:
    """Seconds drawn around a true mean per candidate: log-normal noise, occasional load spikes, and a huge
    outlier on each candidate's first timed call where ``first`` says so. The true best is known."""

    def __init__(self, means: dict[str, float], *, sigma: float = 0.1, spikes: float = 0.05, spike: float = 4.0,
                 first: dict[str, float] | None = None, seed: int = 0):
        import random

        self.means, self.sigma, self.spikes, self.spike = means, sigma, spikes, spike
        self.first = dict(first or {})
        self.rng = random.Random(seed)
        self.timed: list[str] = []
        self.spent = 0.0

    def timer(self, name, run):  # candidates are not run: only the statistics are under test
        self.timed.append(name)
        t = self.means[name] * self.rng.lognormvariate(0.0, self.sigma)
        if self.rng.random() < self.spikes:
            t *= self.spike
        if self.timed.count(name) == 1:
            t *= self.first.get(name, 1.0)
        self.spent += t
        return t

    def memory(self, name, run):
        return 1000


FOUR = {"sdpa_flash": 1.0e-3, "sdpa": 1.2e-3, "sdpa_math": 1.5e-3, "math": 2.0e-3}


@pytest.mark.parametrize("seed", range(8))
def test_a_huge_outlier_on_the_first_round_does_not_prune_the_true_best(tmp_path, seed):
    # The failure: the true best drew a 20x spike in round one and was pruned on that round.
    clock = NoisyClock(FOUR, first={"sdpa_flash": 20.0}, seed=seed)
    entry = _choose(_selector(clock, tmp_path), _call())
    assert entry.choice == "sdpa_flash" and not entry.provisional, entry.decision
    assert entry.decision.startswith("faster than the runner-up sdpa: sdpa/sdpa_flash x1.")
    assert all(entry.rounds[n] >= 8 for n in FOUR)  # nothing was decided on one round
    q1, q3 = entry.spread_ms["sdpa_flash"]
    assert q1 <= entry.timings_ms["sdpa_flash"] <= q3 and 0.8 < entry.timings_ms["sdpa_flash"] < 1.25


def test_a_near_tie_under_noise_comes_out_provisional(tmp_path):
    clock = NoisyClock({"sdpa": 1.0e-3, "sdpa_flash": 1.005e-3}, sigma=0.2, seed=3)
    sel = _selector(clock, tmp_path, names=["sdpa", "sdpa_flash"], budget_s=0.1)
    entry = _choose(sel, _call())
    assert entry.provisional and "provisional: not separated from" in entry.decision
    rounds = entry.rounds[entry.choice]
    assert 8 < rounds < 200 and clock.spent >= 0.1  # stopped by the budget of timed calls
    assert {"sdpa", "sdpa_flash"} == set(entry.ratios) | {entry.choice}
    assert sel.cache.records()[0].entry.provisional  # on disk as provisional: the next process times it again


def test_identical_candidates_on_a_quiet_machine_are_a_tie_not_provisional(tmp_path):
    clock = NoisyClock({"sdpa": 1.0e-3, "sdpa_flash": 1.0e-3}, sigma=0.01, spikes=0.0)
    entry = _choose(_selector(clock, tmp_path, names=["sdpa", "sdpa_flash"]), _call())
    assert not entry.provisional and entry.decision.startswith("tied with "), entry.decision


@pytest.mark.parametrize("budget, decided", [(0.2, 0), (2.0, 1)])
def test_a_final_choice_under_heavy_noise_is_never_the_slower_one(tmp_path, budget, decided):
    """6% apart under heavy noise: within 0.2 s of timed calls the fresh confirming rounds cannot separate them
    (every choice provisional, none wrong); within 2 s some are decided, and rightly."""
    wrong = final = 0
    for seed in range(30):
        clock = NoisyClock({"sdpa": 1.0e-3, "sdpa_math": 1.06e-3, "math": 1.5e-3}, sigma=0.15, spikes=0.1,
                           spike=6.0, first={"sdpa": 10.0}, seed=seed)
        sel = _selector(clock, tmp_path / f"{budget}-{seed}", names=["sdpa", "sdpa_math", "math"], budget_s=budget)
        entry = _choose(sel, _call())
        final += not entry.provisional
        wrong += not entry.provisional and entry.choice != "sdpa"
    assert wrong == 0
    assert final >= decided


def test_equal_candidates_are_rarely_called_separated(tmp_path):
    """The race looks after every round, so two equal candidates end "separated" in several percent of races; the
    fresh rounds that must confirm such a verdict are one look at 99%: at most about 1 in 100 stays final."""
    separated = 0
    for seed in range(200):
        clock = NoisyClock({"sdpa": 1.0e-3, "sdpa_flash": 1.0e-3}, sigma=0.1, spikes=0.05, seed=seed)
        sel = Selector(timer=clock.timer, memory=clock.memory, cache=TuningCache(tmp_path / str(seed)),
                       candidates=["sdpa", "sdpa_flash"])
        entry = _choose(sel, _call())
        separated += not entry.provisional and "runner-up" in entry.decision
    assert separated <= 4


def test_a_changed_environment_key_is_not_reused(tmp_path, monkeypatch):
    clock = FakeClock({"math": 5.0, "sdpa": 1.0, "sdpa_flash": 2.0, "sdpa_math": 4.0})
    _choose(_selector(clock, tmp_path), _call())
    n = len(clock.timed)
    _choose(_selector(clock, tmp_path), _call())
    assert len(clock.timed) == n  # same environment: served from the disk cache
    monkeypatch.setattr(torch, "get_num_threads", lambda: 977)
    _choose(_selector(clock, tmp_path), _call())
    assert len(clock.timed) > n  # another thread count: timed again, never reused


def test_a_provisional_entry_is_timed_again_by_the_next_process_and_then_kept(tmp_path):
    names = ["sdpa", "sdpa_flash"]
    tie = NoisyClock({"sdpa": 1.0e-3, "sdpa_flash": 1.005e-3}, sigma=0.2, seed=3)
    assert _choose(_selector(tie, tmp_path, names=names, budget_s=0.1), _call()).provisional
    clear = FakeClock({"sdpa": 2.0, "sdpa_flash": 1.0})
    entry = _choose(_selector(clear, tmp_path, names=names), _call())  # a new process: a new Selector
    assert clear.timed and entry.choice == "sdpa_flash" and not entry.provisional
    again = FakeClock({})
    assert _choose(_selector(again, tmp_path, names=names), _call()).choice == "sdpa_flash"
    assert again.timed == []  # final now: served from the cache


def test_an_entry_from_the_old_file_format_is_read_as_provisional_and_timed_again(tmp_path):
    import json

    clock = FakeClock({"sdpa": 2.0, "sdpa_flash": 1.0})
    sel = _selector(clock, tmp_path, names=["sdpa", "sdpa_flash"])
    call = _call()
    key = shape_key(SPEC, call.q, call.k, call.v, causal=True, mask=None, dropout=False, grad=False)
    cache_key = sel.cache.key({**key.as_dict(), "spec": repr(SPEC), "budget": None}, ["sdpa", "sdpa_flash"], "cpu")
    old = {"choice": "sdpa", "timings_ms": {"sdpa": 1.0, "sdpa_flash": 2.0}, "peak_bytes": {}, "rejected": {},
           "created": "2024-01-01T00:00:00+00:00", "tuning_s": 0.1}  # what attnopt wrote before issue 15
    sel.cache.path_for(cache_key).write_text(json.dumps({"format": 1, "key": cache_key, "entry": old}))
    entry = sel.choose(SPEC, key, call)
    assert clock.timed and entry.choice == "sdpa_flash" and not entry.provisional
    assert json.loads(sel.cache.path_for(cache_key).read_text())["format"] == 3


def test_tune_times_again_the_provisional_choices_of_this_process(tmp_path):
    names = ["sdpa", "sdpa_flash"]
    clock = NoisyClock({"sdpa": 1.0e-3, "sdpa_flash": 1.005e-3}, sigma=0.2, seed=3)
    sel = _selector(clock, tmp_path, names=names, budget_s=0.1)
    opt = attnopt.optimize(Attn().eval(), selector=sel)
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        opt(x)
    entries = [e for r in attnopt.explain(opt).records for e in r.extra.get("tuning", {}).values()]
    assert [e.provisional for e in entries] == [True]
    text = str(attnopt.explain(opt))
    assert "(provisional)" in text and "not separated from" in text and "IQR" in text
    n = len(clock.timed)
    with torch.no_grad():
        opt(x)
    assert len(clock.timed) == n  # this process keeps using it
    clock.means = {"sdpa": 2.0e-3, "sdpa_flash": 1.0e-3}
    clock.sigma = 0.01
    attnopt.tune(opt, [(x,)], progress=False)
    assert len(clock.timed) > n
    entries = [e for r in attnopt.explain(opt).records for e in r.extra.get("tuning", {}).values()]
    assert [(e.choice, e.provisional) for e in entries] == [("sdpa_flash", False)]


# ----------------------------------------------------------------------------- staying right in use (issue 15)

def _observed_site(tmp_path, seconds):
    from attnopt.runtime.dispatch import DispatchingSite

    clock = FakeClock({"sdpa": seconds, "math": 10 * seconds})
    sel = _selector(clock, tmp_path, names=["sdpa", "math"])
    return DispatchingSite("s", SPEC, "auto", selector=sel), sel


def _calls(site, n, grad=False):
    q, k, v = (torch.randn(1, 2, 8, 8, requires_grad=grad) for _ in range(3))
    kw = dict(attn_mask=None, dropout_p=0.0, is_causal=True, scale=0.25, enable_gqa=False)
    for _ in range(n):
        site.run_candidate(q, k, v, kw)


def test_a_choice_that_runs_clearly_slower_in_use_is_marked_for_retiming(tmp_path, monkeypatch):
    """The tuning measured 0.1 us for sdpa; its sampled calls in use take far longer (another load, another
    setup): the choice keeps serving, marked provisional on disk, so the next process or tune times it again."""
    import attnopt.runtime.dispatch as dispatch

    monkeypatch.setattr(dispatch, "_SLOWER_MS", 0.0)
    site, sel = _observed_site(tmp_path, 1e-7)
    _calls(site, dispatch._SAMPLE_EVERY * dispatch._SAMPLES)
    (entry,) = site.tuning.values()
    assert entry.choice == "sdpa" and entry.provisional and "in use it ran" in entry.decision, entry.decision
    assert site.observed[next(iter(site.tuning))] is None  # observed no further
    (record,) = sel.cache.records()
    assert record.entry.provisional and "sampled calls" in record.entry.decision
    assert sel.retime_provisional() == 1  # attnopt.tune times it again


def test_a_choice_as_fast_in_use_as_tuned_stays_final(tmp_path, monkeypatch):
    import attnopt.runtime.dispatch as dispatch

    monkeypatch.setattr(dispatch, "_SLOWER_MS", 0.0)
    site, sel = _observed_site(tmp_path, 10.0)  # the tuning measured 10 s: every call in use is faster
    _calls(site, dispatch._SAMPLE_EVERY * dispatch._SAMPLES * 2)
    (entry,) = site.tuning.values()
    assert not entry.provisional and len(site.observed[next(iter(site.tuning))]) >= dispatch._SAMPLES
    assert not sel.cache.records()[0].entry.provisional


def test_explain_lists_rivals_by_their_ratio_to_the_choice_not_their_median():
    """A candidate pruned in quiet early rounds keeps a low median; its paired ratio says it is slower."""
    from attnopt.selection.cache import TuningEntry
    from attnopt.selection.selector import format_timings

    entry = TuningEntry("sdpa_flash", {"sdpa_flash": 2.18, "sdpa_math": 1.5, "sdpa": 2.5},
                        ratios={"sdpa_math": (1.32, 1.02, 2.06), "sdpa": (1.1, 1.0, 1.2)},
                        pruned={"sdpa_math": "slower"}, spread_ms={"sdpa_flash": (2.0, 2.3)},
                        rounds={"sdpa_flash": 20})
    text = format_timings(entry)
    assert text.index("sdpa_flash 2.18 ms*") < text.index("sdpa 2.5 ms") < text.index("sdpa_math 1.5 ms"), text


@pytest.mark.parametrize("backend, twin", [("FLASH_ATTENTION", "sdpa_flash"), ("MATH", "sdpa_math")])
def test_the_restricted_sdpa_that_runs_sdpas_own_kernel_is_not_timed_apart(tmp_path, monkeypatch, backend, twin):
    from torch.nn.attention import SDPBackend

    asked = []

    def choice(q, k, v, mask, dropout_p, is_causal, scale=None, enable_gqa=False):
        asked.append((tuple(q.shape), mask, dropout_p, is_causal, scale))
        return int(getattr(SDPBackend, backend).value)

    monkeypatch.setattr(torch, "_fused_sdp_choice", choice)
    clock = FakeClock({}, default=1.0)
    sel = Selector(timer=clock.timer, memory=clock.memory, cache=TuningCache(tmp_path))  # the default set
    entry = _choose(sel, _call())
    assert asked == [((2, 4, 16, 8), None, 0.0, True, 0.25)]  # asked on the tuning's inputs, as the site calls
    assert "runs the same kernel as sdpa" in entry.rejected[twin] and twin not in clock.timed
    assert "sdpa" in clock.timed and entry.timings_ms[twin] == math.inf
    other = {"sdpa_flash": "sdpa_math", "sdpa_math": "sdpa_flash"}[twin]
    assert other in clock.timed  # the other backend is a candidate of its own
    # a set of candidates the user named is timed as named
    clock = FakeClock({}, default=1.0)
    _choose(_selector(clock, tmp_path / "named", names=["sdpa", twin]), _call())
    assert twin in clock.timed


def test_without_dropout_the_check_is_the_warm_up(tmp_path, monkeypatch):
    runs = []

    def counted(q, k, v, **kw):
        runs.append(kw["dropout_p"])
        return reference_attention(q, k, v, **kw)

    _register(monkeypatch, "counted", counted)
    clock = FakeClock({"counted": 1.0, "sdpa": 3.0})
    entry = _choose(_selector(clock, tmp_path, names=["counted", "sdpa"]), _call())
    timed = clock.timed.count("counted")
    assert entry.choice == "counted" and len(runs) == 1 + timed + len(clock.measured)  # the check, rounds, memory
    runs.clear()
    clock = FakeClock({"counted": 1.0, "sdpa": 3.0})
    call = _call()
    call.kwargs["dropout_p"] = 0.1
    sel = _selector(clock, tmp_path / "dropout", names=["counted", "sdpa"])
    key = shape_key(SPEC, call.q, call.k, call.v, causal=True, mask=None, dropout=True, grad=False)
    sel.choose(SPEC, key, call)
    # with dropout the check (run without it) is not the timed call: one warm-up with dropout
    assert runs[0] == 0.0 and runs[1] == 0.1 and len(runs) == 2 + clock.timed.count("counted") + len(clock.measured)


@pytest.mark.parametrize("progress", [None, True, False])
def test_a_tuning_counts_its_timed_calls_on_a_progress_bar(tmp_path, monkeypatch, progress):
    import tqdm.auto

    bars = []

    class Bar:
        def __init__(self, **kw):
            self.kw, self.n, self.names, self.closed = kw, 0, [], False
            bars.append(self)

        def set_postfix_str(self, s, refresh=True):
            self.names.append(s)

        def update(self, n):
            self.n += n

        def close(self):
            self.closed = True

    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    clock = FakeClock({"sdpa": 1.0, "math": 3.0})
    _choose(_selector(clock, tmp_path, names=["sdpa", "math"], progress=progress), _call())
    if progress is False:
        assert bars == []
        return
    (bar,) = bars
    assert bar.n == len(clock.timed) and bar.names == clock.timed and bar.closed
    assert bar.kw["desc"] == "attnopt: tuning B=2 H=4 Tq<=16 Tk<=16 D=8 float32 cpu, causal"
    assert bar.kw["delay"] == 2.0 and bar.kw["disable"] is (None if progress is None else False)


def test_an_unseparated_race_serves_sdpa_unless_it_was_shown_slower(tmp_path):
    """Heavy noise, tiled64 25% slower in truth: where the race cannot separate them, sdpa serves (provisional)
    whichever median came out lower; a candidate shown faster than sdpa still wins."""
    chose = []
    for seed in range(12):
        clock = NoisyClock({"sdpa": 1.0e-3, "tiled64": 1.25e-3}, sigma=0.6, spikes=0.2, spike=4.0, seed=seed)
        sel = _selector(clock, tmp_path / str(seed), names=["tiled64", "sdpa"], budget_s=0.01)
        entry = _choose(sel, _call())
        chose.append(entry.choice)
        if entry.provisional:
            assert entry.choice == "sdpa", entry.decision
    assert chose.count("sdpa") == len(chose)
    clock = FakeClock({"sdpa": 1.2, "tiled64": 1.0})
    entry = _choose(_selector(clock, tmp_path / "faster", names=["tiled64", "sdpa"]), _call())
    assert entry.choice == "tiled64" and not entry.provisional, entry.decision


class _Rounds:
    """A timer of ``f(name, r)`` seconds, ``r`` being that candidate's call count."""

    def __init__(self, f):
        self.f, self.n = f, {}

    def __call__(self, name, run):
        r = self.n.get(name, 0)
        self.n[name] = r + 1
        return self.f(name, r)


def _busy_after_five(name, r):
    """The machine gets ten times busier after round five; sdpa is 2.5x sdpa_flash in every round."""
    load = 1.0 if r < 5 else 10.0
    base = {"sdpa_flash": 1e-3, "sdpa": 2.5e-3, "sdpa_math": 1e-3}[name]
    return base * load * ((0.9, 1.1)[r % 2] if name == "sdpa_math" else 1.0)


@pytest.mark.parametrize("path", ["profiler", "memory budget"])
def test_a_grossly_pruned_candidate_with_a_low_early_median_is_never_chosen(tmp_path, path):
    names = ["sdpa_flash", "sdpa", "sdpa_math"]
    if path == "profiler":  # memory is not measured: the pruned candidates are in the choice again
        sel = Selector(timer=_Rounds(_busy_after_five), cache=False, candidates=names, budget_s=0.5)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            entry = _choose(sel)
    else:  # the leader is over the budget: the pruned candidates are measured and in again
        sel = Selector(timer=_Rounds(_busy_after_five), memory=lambda n, run: {"sdpa_math": 10**9}.get(n, 1000),
                       memory_budget="1MB", cache=False, candidates=names, budget_s=0.5)
        entry = _choose(sel)
    assert "more than 2x" in entry.pruned["sdpa"] and entry.choice != "sdpa", entry.decision


def test_the_runner_up_is_the_closest_rival_by_paired_ratio_not_a_grossly_pruned_one(tmp_path):
    def f(name, r):
        load = 1.0 if r < 5 else 10.0
        if name == "sdpa_flash":
            return 1e-3 * load
        if name == "sdpa":
            return 2.5e-3 * load  # pruned at round five: its median stays low
        return 1e-3 * load * (0.9 if r % 4 == 3 else 1.5)  # sdpa_math, the real runner-up

    sel = Selector(timer=_Rounds(f), memory=lambda n, run: 1000, cache=False,
                   candidates=["sdpa_flash", "sdpa", "sdpa_math"], budget_s=100)
    entry = _choose(sel)
    assert entry.choice == "sdpa_flash" and "runner-up sdpa_math" in entry.decision, entry.decision
    assert "confirmed on" in entry.decision or entry.provisional  # the race's verdict, checked on fresh rounds


def test_a_progress_display_that_fails_never_counts_against_a_candidate(tmp_path, monkeypatch):
    import sys
    import time as time_

    def timer(name, run):
        time_.sleep(0.25)  # past the counter's two-second delay
        return {"sdpa": 1e-3, "math": 3e-3}[name]

    sel = Selector(timer=timer, memory=lambda n, run: 1000, cache=False, candidates=["sdpa", "math"])
    monkeypatch.setattr(sys, "stderr", None)  # pythonw, services: nowhere to write
    entry = _choose(sel)
    assert entry.choice == "sdpa" and not any("raised" in why for why in entry.rejected.values()), entry.rejected

    import tqdm.auto

    class Broken:
        def __init__(self, **kw):
            pass

        def set_postfix_str(self, *a, **kw):
            raise OSError("stream closed")

        def close(self):
            raise OSError("stream closed")

    monkeypatch.setattr(sys, "stderr", sys.__stderr__)
    monkeypatch.setattr(tqdm.auto, "tqdm", Broken)
    sel = Selector(timer=FakeClock({"sdpa": 1.0, "math": 3.0}).timer, memory=lambda n, run: 1000, cache=False,
                   candidates=["sdpa", "math"], progress=True)
    entry = _choose(sel)
    assert entry.choice == "sdpa" and not entry.rejected


def test_a_slow_down_that_follows_one_candidate_does_not_prune_another_grossly():
    """Each call after tiled256 runs 3x slower (its caches left cold): in a fixed rotation of six candidates the
    true best, always right after it, was more than 2x slower in each of five rounds and pruned."""
    speed = {"math": 1.5e-3, "sdpa": 1.0e-3, "sdpa_math": 1.3e-3, "tiled128": 1.4e-3, "tiled256": 1.4e-3,
             "tiled64": 0.8e-3}
    prev = {"n": None}

    def timer(name, run):
        s = speed[name] * (3.0 if prev["n"] == "tiled256" else 1.0)
        prev["n"] = name
        return s

    entry = _choose(Selector(timer=timer, memory=lambda n, run: 1000, cache=False, candidates=list(speed)))
    assert "tiled64" not in entry.pruned and entry.choice == "tiled64", entry.decision


def test_with_dropout_and_gradients_the_restricted_math_kernel_is_a_candidate_of_its_own(tmp_path, monkeypatch):
    from torch.nn.attention import SDPBackend

    monkeypatch.setattr(torch, "_fused_sdp_choice", lambda *a, **kw: int(SDPBackend.MATH.value))
    clock = FakeClock({}, default=1.0)
    call = _call(grad=True)
    call.kwargs["dropout_p"] = 0.1
    key = shape_key(SPEC, call.q, call.k, call.v, causal=True, mask=None, dropout=True, grad=True)
    entry = Selector(timer=clock.timer, memory=clock.memory, cache=TuningCache(tmp_path)).choose(SPEC, key, call)
    assert "sdpa_math" in clock.timed and "same kernel" not in entry.rejected.get("sdpa_math", "")


def test_tune_without_progress_hides_the_tunings_counters_too(tmp_path, monkeypatch):
    import tqdm.auto

    made = []
    real = tqdm.auto.tqdm
    monkeypatch.setattr(tqdm.auto, "tqdm", lambda *a, **kw: made.append(kw.get("desc")) or real(*a, **kw))
    from attnopt.models import CausalSelfAttention, GPTConfig

    block = CausalSelfAttention(GPTConfig(n_embd=32, n_head=2, block_size=16, dropout=0.0)).eval()
    sel = Selector(timer=FakeClock({}, default=1.0).timer, memory=lambda n, run: 1000, cache=TuningCache(tmp_path))
    opt = attnopt.optimize(block, selector=sel)
    attnopt.tune(opt, [(torch.randn(1, 8, 32),)], progress=False)
    assert not any(d and d.startswith("attnopt: tuning") for d in made) and sel.progress is None


def test_math_is_the_reference_so_the_reference_run_is_its_check(tmp_path, monkeypatch):
    from attnopt.selection import selector as sel_mod

    checked = []
    real = sel_mod._Runs.check
    monkeypatch.setattr(sel_mod._Runs, "check", lambda self, name, expected: checked.append(name) or real(
        self, name, expected))
    clock = FakeClock({"math": 2.0, "sdpa": 1.0})
    entry = _choose(_selector(clock, tmp_path, names=["math", "sdpa"]), _call(grad=True))
    assert checked == ["sdpa"] and "math" in clock.timed and "math" not in entry.rejected
    # a math registered by the user is not the reference: it is checked
    _register(monkeypatch, "math", lambda q, k, v, **kw: reference_attention(q, k, v, **kw) * 1.01)
    checked.clear()
    entry = _choose(_selector(FakeClock({"math": 0.5, "sdpa": 1.0}), tmp_path / "user", names=["math", "sdpa"]),
                    _call())
    assert "math" in checked and entry.choice == "sdpa" and "differs" in entry.rejected["math"]


def test_candidates_that_write_out_large_scores_are_not_timed_where_others_serve(tmp_path):
    call = _call()  # scores (2, 4, 16, 16) in float32: 8 KiB per copy
    clock = FakeClock({}, default=1.0)
    sel = Selector(timer=clock.timer, memory=clock.memory, cache=TuningCache(tmp_path), max_scores=4096)
    entry = _choose(sel, call)
    for name in ("math", "sdpa_math"):
        assert name not in clock.timed and "would write out 0 MiB of scores per call" in entry.rejected[name]
    assert "sdpa" in clock.timed and any(n.startswith("tiled") for n in clock.timed)
    # the scores within the limit, no limit, or a candidate set the user named: timed
    for kw in ({"max_scores": 8192}, {"max_scores": None}):
        clock = FakeClock({}, default=1.0)
        _choose(Selector(timer=clock.timer, memory=clock.memory, cache=False, **kw), call)
        assert {"math", "sdpa_math"} <= set(clock.timed), kw
    clock = FakeClock({}, default=1.0)
    _choose(Selector(timer=clock.timer, memory=clock.memory, cache=False, max_scores=4096,
                     candidates=["math", "sdpa"]), call)
    assert "math" in clock.timed


def test_where_only_candidates_that_write_out_scores_serve_they_are_timed(monkeypatch):
    # a score modifier: SDPA cannot serve; were the tiled kernels unavailable, math must still be timed
    clock = FakeClock({}, default=1.0)
    sel = Selector(timer=clock.timer, memory=clock.memory, cache=False, max_scores=1)
    monkeypatch.setattr(sel, "legal", lambda spec, device: (["math", "sdpa_math"], {}))
    entry = _choose(sel)
    assert {"math", "sdpa_math"} <= set(clock.timed) and entry.choice in ("math", "sdpa_math")


def test_where_no_other_candidate_passes_the_large_score_ones_are_checked_and_timed_after_all(monkeypatch):
    _register(monkeypatch, "wrong", lambda q, k, v, **kw: reference_attention(q, k, v, **kw) * 1.01)
    clock = FakeClock({"sdpa_math": 0.5, "math": 1.0, "wrong": 0.1})
    sel = Selector(timer=clock.timer, memory=clock.memory, cache=False, max_scores=1)
    monkeypatch.setattr(sel, "legal", lambda spec, device: (["math", "sdpa_math", "wrong"], {}))
    entry = _choose(sel)
    assert entry.choice == "sdpa_math" and {"math", "sdpa_math"} <= set(clock.timed), entry.decision
    assert set(entry.rejected) == {"wrong"} and "differs" in entry.rejected["wrong"]


def test_sdpa_on_its_math_backend_counts_as_writing_out_the_scores(monkeypatch):
    from torch.nn.attention import SDPBackend

    monkeypatch.setattr(torch, "_fused_sdp_choice", lambda *a, **kw: int(SDPBackend.MATH.value))
    clock = FakeClock({}, default=1.0)
    entry = _choose(Selector(timer=clock.timer, memory=clock.memory, cache=False, max_scores=1))
    assert not {"sdpa", "math", "sdpa_math"} & set(clock.timed) and "would write out" in entry.rejected["sdpa"]
    assert entry.choice in ("sdpa_flash", "tiled64", "tiled128", "tiled256")


def test_with_dropout_and_gradients_only_what_a_site_serves_as_chosen_is_raced():
    clock = FakeClock({}, default=1.0)
    call = _call(grad=True)
    call.kwargs["dropout_p"] = 0.1
    key = shape_key(SPEC, call.q, call.k, call.v, causal=True, mask=None, dropout=True, grad=True)
    entry = Selector(timer=clock.timer, memory=clock.memory, cache=False, max_scores=1).choose(SPEC, key, call)
    assert set(clock.timed) == {"math", "sdpa_math"} and entry.choice in ("math", "sdpa_math")
    assert "serves math in its place" in entry.rejected["sdpa"]


def test_the_score_size_is_the_length_buckets(tmp_path):
    # T=9 lies in the bucket up to 16, whose scores (2, 4, 16, 16) in float32 are 8 KiB: over a 4 KiB limit
    clock = FakeClock({"math": 0.1}, default=1.0)
    entry = _choose(Selector(timer=clock.timer, memory=clock.memory, cache=False, max_scores=4096), _call(t=9))
    assert "math" not in clock.timed and entry.choice != "math"


def test_bad_max_scores_errors_name_the_option():
    with pytest.raises(ValueError, match="max_scores"):
        Selector(cache=False, max_scores=0)
    with pytest.raises(TypeError, match="max_scores"):
        Selector(cache=False, max_scores=1.5e9)


def test_only_the_registered_math_is_taken_for_the_reference(monkeypatch):
    class Rounded(FunctionCandidate):
        def __call__(self, q, k, v, **kw):  # the reference's function, computed in bfloat16
            return reference_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), **kw).float()

    monkeypatch.setitem(cand_mod._REGISTRY, "math_bf16", Rounded("math_bf16", reference_attention, lambda spec: None))
    clock = FakeClock({"math_bf16": 0.1, "sdpa": 1.0})
    entry = _choose(Selector(timer=clock.timer, memory=clock.memory, cache=False, candidates=["math_bf16", "sdpa"]))
    assert entry.choice == "sdpa" and "differs" in entry.rejected["math_bf16"]


@pytest.mark.parametrize("shuffle", [False, True])
def test_time_alternating_calls_each_once_per_round_in_a_fixed_or_shuffled_order(shuffle):
    from attnopt.selection.measure import time_alternating

    calls = []
    fns = {n: (lambda n=n: calls.append(n)) for n in "abcd"}
    samples: dict[str, list[float]] = {}
    time_alternating(fns, (), repeats=12, warmup=0, samples=samples, shuffle=shuffle)
    rounds = [tuple(calls[i:i + 4]) for i in range(0, 48, 4)]
    assert all(sorted(r) == list("abcd") for r in rounds) and all(len(s) == 12 for s in samples.values())
    assert (len(set(rounds)) > 1) == shuffle  # shuffled rounds differ; a fixed order never does
    # after which function each one ran varies once shuffled
    assert (len({r[r.index("b") - 1] for r in rounds if r.index("b")}) > 1) == shuffle


def test_kept_out_large_score_candidates_come_back_when_the_rest_fail_their_dropout_warm_up(monkeypatch):
    """Dropout without gradients, large scores: the one streaming candidate passes its check (run without dropout)
    but cannot run with dropout; the kept-out ones are checked, warmed up and timed after all, sdpa_math as sdpa's
    twin (SDPA's own choice with dropout here is its math backend)."""
    from torch.nn.attention import SDPBackend

    def dropless(q, k, v, **kw):
        if kw["dropout_p"] > 0:
            raise RuntimeError("no kernel with dropout")
        return reference_attention(q, k, v, **kw)

    _register(monkeypatch, "dropless", dropless)
    monkeypatch.setattr(torch, "_fused_sdp_choice", lambda *a, **kw: int(SDPBackend.MATH.value))
    clock = FakeClock({"sdpa": 1.0, "math": 2.0}, default=1.5)
    sel = Selector(timer=clock.timer, memory=clock.memory, cache=False, max_scores=1)
    monkeypatch.setattr(sel, "legal", lambda spec, device: (["dropless", "math", "sdpa", "sdpa_math"], {}))
    call = _call()
    call.kwargs["dropout_p"] = 0.1
    key = shape_key(SPEC, call.q, call.k, call.v, causal=True, mask=None, dropout=True, grad=False)
    entry = sel.choose(SPEC, key, call)
    assert entry.choice == "sdpa" and {"sdpa", "math"} <= set(clock.timed), entry.decision
    assert "sdpa_math" not in clock.timed and "same kernel as sdpa" in entry.rejected["sdpa_math"]
    assert "no kernel with dropout" in entry.rejected["dropless"]
    assert not any("would write out" in why for why in entry.rejected.values())


# -- the time limit of one tuning (a long shape's first call) ------------------------------------------

_LIMITED = {"sdpa": 1.0, "tiled64": 1.3, "sdpa_math": 1.35}  # a round: 3.65 s; 8 s of timed calls: 3 rounds


def _limited(clock, cache, **kw):
    return Selector(timer=clock.timer, memory=clock.memory, cache=cache, candidates=list(_LIMITED), time_limit_s=8,
                    **kw)


def test_the_time_limit_cuts_an_undecided_race_and_the_next_tuning_continues_its_rounds(tmp_path):
    clock = FakeClock(_LIMITED)
    first = _choose(_limited(clock, TuningCache(tmp_path)))
    assert first.provisional and first.choice == "sdpa"
    assert first.rounds == {n: 3 for n in _LIMITED} and {n: len(t) for n, t in first.samples.items()} == first.rounds
    assert "time limit (8 s" in first.decision and "continues its rounds" in first.decision
    assert "tiled64/sdpa x1.3 over 3 rounds" in first.decision  # the closest rival, no interval from 3 rounds
    # the next process (a new selector on the same disk cache) continues those rounds: it times 3 more, not 8
    clock.timed.clear()
    second = _choose(_limited(clock, TuningCache(tmp_path)))
    assert second.provisional and second.rounds == {n: 6 for n in _LIMITED}
    assert "spent after 3 rounds (after 3 of earlier tunings)" in second.decision
    assert second.samples["sdpa"][:3] == first.samples["sdpa"]  # the first process's rounds, then its own
    assert clock.timed.count("tiled64") == 3
    # and the third decides: 8 rounds separate them at 99%, then the verdict is confirmed on fresh rounds
    third = _choose(_limited(clock, TuningCache(tmp_path)))
    assert not third.provisional and third.choice == "sdpa" and third.rounds == {n: 8 for n in _LIMITED}
    assert third.samples == {} and "confirmed" in third.decision
    clock.timed.clear()
    assert _choose(_limited(clock, TuningCache(tmp_path))) == third and clock.timed == []  # final: from the cache


def test_without_a_time_limit_a_race_runs_to_its_end(tmp_path):
    clock = FakeClock(_LIMITED)
    sel = _limited(clock, TuningCache(tmp_path))
    sel.time_limit_s = None
    entry = _choose(sel)
    assert not entry.provisional and entry.rounds == {n: 8 for n in _LIMITED} and entry.samples == {}


def test_a_cut_race_starts_again_when_its_candidates_changed(tmp_path):
    clock = FakeClock(_LIMITED)
    first = _choose(_limited(clock, TuningCache(tmp_path)))
    sel = _limited(clock, TuningCache(tmp_path))
    # the same key, one candidate fewer: its rounds would pair other candidates, so the race starts again
    call = _call()
    key = shape_key(SPEC, call.q, call.k, call.v, causal=True, mask=None, dropout=False, grad=False)
    entry = sel.tune(SPEC, key, call, ["sdpa", "tiled64"], prior=first)
    assert entry.rounds == {"sdpa": 4, "tiled64": 4}  # 2.3 s a round: 8 s in four rounds, none carried over


def test_without_a_disk_cache_retiming_continues_the_cut_rounds(tmp_path):
    clock = FakeClock(_LIMITED)
    sel = _limited(clock, None)
    assert _choose(sel).rounds["sdpa"] == 3
    assert _choose(sel).rounds["sdpa"] == 3  # this process keeps its provisional choice
    assert sel.retime_provisional() == 1
    assert _choose(sel).rounds["sdpa"] == 6


def test_attnopt_tune_runs_a_cut_race_to_its_end(tmp_path):
    clock = FakeClock(_LIMITED)
    sel = _limited(clock, TuningCache(tmp_path))
    opt = attnopt.optimize(Attn().eval(), selector=sel)
    with torch.no_grad():
        opt(torch.randn(1, 8, 32))
    (entry,) = [e for r in attnopt.explain(opt).records for e in r.extra["tuning"].values()]
    assert entry.provisional and entry.rounds["sdpa"] == 3
    clock.timed.clear()
    attnopt.tune(opt, [(torch.randn(1, 8, 32),)], progress=False)
    (entry,) = [e for r in attnopt.explain(opt).records for e in r.extra["tuning"].values()]
    assert not entry.provisional and entry.samples == {} and entry.rounds == {n: 8 for n in _LIMITED}
    # past the limit (5 rounds: 18 s of timed calls), going on from the cut race's 3 rounds rather than from 0;
    # sdpa_math is not the runner-up, so no confirming round times it
    assert clock.timed.count("sdpa_math") == 5
    assert sel.time_limit_s == 8  # restored after the sweep


def test_a_choice_marked_slower_in_use_does_not_continue_old_rounds(tmp_path):
    clock = FakeClock(_LIMITED)
    sel = _limited(clock, TuningCache(tmp_path))
    entry = _choose(sel)
    call = _call()
    key = shape_key(SPEC, call.q, call.k, call.v, causal=True, mask=None, dropout=False, grad=False)
    marked = sel.slower_in_use(SPEC, key, call.q.device, entry, observed_ms=5000.0, calls=8)
    assert marked.provisional and marked.samples == {}


def test_the_time_limit_is_validated_and_samples_round_trip():
    with pytest.raises(ValueError, match="time_limit_s"):
        Selector(time_limit_s=0)
    assert Selector(time_limit_s=None).time_limit_s is None
    from attnopt.selection.cache import TuningEntry

    entry = TuningEntry(choice="sdpa", provisional=True, samples={"sdpa": [0.5, 0.25], "math": (1.0,)})
    assert TuningEntry.from_json(entry.to_json()) == entry and entry.samples["sdpa"] == (0.5, 0.25)
    assert TuningEntry.from_json(TuningEntry(choice="sdpa").to_json()).samples == {}
    with pytest.raises(ValueError, match="samples"):
        TuningEntry(choice="sdpa", samples={"sdpa": [-1.0]})


def test_an_entry_pickled_before_samples_existed_loads_with_none(tmp_path):
    import pickle

    from attnopt.selection.cache import TuningEntry

    entry = TuningEntry(choice="sdpa", provisional=True)
    del entry.__dict__["samples"]  # what an older attnopt pickled
    back = pickle.loads(pickle.dumps(entry))
    assert back.samples == {} and TuningEntry.from_json(back.to_json()) == back
    sel = _limited(FakeClock(_LIMITED), None)
    sel.entries[("spec", "key")] = back
    sel = pickle.loads(pickle.dumps(sel))
    assert sel.retime_provisional() == 1


class _Swinging:
    """Each candidate alternates between two times, out of step with the others: never separated, never tied."""

    def __init__(self):
        self.calls: dict[str, int] = {}
        self.timed: list[str] = []

    def timer(self, name, run):
        run()
        n = self.calls[name] = self.calls.get(name, 0) + 1
        self.timed.append(name)
        return 1.0 if (n + (name == "sdpa")) % 2 else 1.3

    def memory(self, name, run):
        return 1000


def test_continued_rounds_run_in_new_orders_and_count_against_the_budget(tmp_path):
    clock = _Swinging()
    orders, entries = [], []
    for _ in range(12):
        sel = Selector(timer=clock.timer, memory=clock.memory, cache=TuningCache(tmp_path),
                       candidates=["sdpa", "tiled64"], time_limit_s=2.0, budget_s=3.0)
        clock.timed.clear()
        entries.append(_choose(sel))
        orders.append(tuple(clock.timed[-2:]))  # the last round's order
        if not entries[-1].samples:
            break
    assert len(set(orders[:4])) == 2  # a continued race does not replay its first rounds' order every time
    # the budget of 3 s after the first 8 rounds holds across tunings: the race ends, provisional, and is not
    # continued again (before, each tuning's budget started at zero and the race ran on to max_rounds)
    last = entries[-1]
    assert last.provisional and last.samples == {} and "not separated" in last.decision
    assert 8 <= last.rounds["sdpa"] <= 12


def test_kept_rounds_that_no_timer_gives_are_not_continued(tmp_path):
    clock = FakeClock(_LIMITED)
    first = _choose(_limited(clock, TuningCache(tmp_path)))
    call = _call()
    key = shape_key(SPEC, call.q, call.k, call.v, causal=True, mask=None, dropout=False, grad=False)
    for bad in ({**first.samples, "sdpa": (1e306, 1.0, 1.0)}, {**first.samples, "tiled64": ()}):
        prior = dataclasses.replace(first, samples=bad)
        entry = _limited(clock, None).tune(SPEC, key, call, list(_LIMITED), prior=prior)
        assert entry.rounds == {n: 3 for n in _LIMITED}  # started again, without raising


def test_without_a_memory_budget_only_the_choice_has_its_memory_measured(tmp_path):
    times = {"sdpa": 1.0, "sdpa_flash": 1.0, "sdpa_math": 1.01, "math": 1.02}  # close: nothing pruned
    clock = FakeClock(times, peaks={"sdpa": 10, "sdpa_flash": 20, "sdpa_math": 30, "math": 40})
    entry = _choose(_selector(clock, tmp_path / "a"))
    assert clock.measured == [entry.choice] and entry.peak_bytes == {entry.choice: clock.peaks[entry.choice]}
    clock = FakeClock(times, peaks={"sdpa": 10, "sdpa_flash": 20, "sdpa_math": 30, "math": 40})
    entry = _choose(_selector(clock, tmp_path / "b", memory_budget="1MB"))
    assert sorted(clock.measured) == sorted(times) and entry.peak_bytes == clock.peaks


class _LeaderFailsLater(FakeClock):
    """sdpa_flash leads and prunes sdpa_math (x1.5), then raises from its ninth call; math swings around them."""

    def timer(self, name, run):
        run()
        self.timed.append(name)
        n = self.timed.count(name)
        if name == "sdpa_flash":
            if n > 8:
                raise RuntimeError("the leader fails in round 9")
            return 1.0
        if name == "sdpa_math":
            return 1.5
        if name == "math":
            return (0.9 if n % 2 else 1.6) if n <= 8 else 3.0
        return 5.0  # sdpa


def test_without_a_memory_budget_a_pruned_candidate_is_not_served_on_its_early_median(tmp_path):
    clock = _LeaderFailsLater({})
    entry = _choose(_selector(clock, tmp_path))
    assert "sdpa_math" in entry.pruned and entry.choice == "math"  # the survivor, not the pruned one


def test_a_memory_reading_that_is_not_a_byte_count_never_reaches_the_forward(tmp_path):
    clock = FakeClock({"sdpa": 1.0, "sdpa_flash": 2.0, "sdpa_math": 3.0, "math": 4.0})
    clock.memory = lambda name, run: -5
    entry = _choose(_selector(clock, tmp_path / "a"))
    assert entry.choice == "sdpa" and entry.peak_bytes == {}
    entry = _choose(_selector(clock, tmp_path / "b", memory_budget="1MB"))  # every reading fails: math runs
    assert entry.choice == "math" and entry.peak_bytes == {}
    assert all("could not be measured" in entry.rejected[n] for n in ("sdpa", "sdpa_flash", "sdpa_math"))
    assert entry.decision.startswith("no candidate's peak memory could be measured")  # every check passed


def test_overlapping_tunes_ahead_of_time_restore_the_settings_once_the_last_ends():
    sel = Selector(cache=False, time_limit_s=12.0, progress=None)
    first, second = sel.ahead_of_time(), sel.ahead_of_time(progress=False)
    first.__enter__()
    assert sel.collective and sel.time_limit_s is None and sel.progress is None
    second.__enter__()  # (attnopt.tune in another thread)
    assert sel.progress is False
    first.__exit__(None, None, None)  # the first ends while the second still sweeps: still no limit
    assert sel.collective and sel.time_limit_s is None
    second.__exit__(None, None, None)
    assert (sel.collective, sel.time_limit_s, sel.progress) == (False, 12.0, None)
    with pytest.raises(RuntimeError), sel.ahead_of_time():
        raise RuntimeError("a sweep that raises")
    assert (sel.collective, sel.time_limit_s, sel.progress) == (False, 12.0, None)


def test_a_selector_pickled_inside_a_tune_ahead_of_time_keeps_the_settings_outside_it():
    import pickle

    sel = Selector(cache=False, time_limit_s=12.0)
    with sel.ahead_of_time(progress=False):
        back = pickle.loads(pickle.dumps(sel))
    assert (back.collective, back.time_limit_s, back.progress, back._ahead) == (False, 12.0, None, 0)
