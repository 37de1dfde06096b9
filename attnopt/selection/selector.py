"""The profile-guided selector: time every legal candidate for the real shapes, keep the fastest.

``variant="auto"`` rewrites each proven site to an :class:`~attnopt.runtime.site.AttentionSite`
whose candidate is chosen here, per *shape key*::

    (batch, q heads, kv heads, Tq bucket, Tk bucket, head dim, v head dim, dtype, device,
     mask kind, causal, score modifier, GQA, dropout active, gradients needed)

Tq and Tk are bucketed to the next power of two, so a model called with many lengths tunes
once per bucket and then dispatches with one dictionary lookup per call. Sites with the same
spec and shape key share one tuning.

Tuning one key (:meth:`Selector.tune`):

1. *Legal candidates*: every registered candidate whose ``supports(spec)`` and
   ``available(device)`` return None (the reasons of the others are kept for ``explain()``).
   Candidates marked ``costly`` (FlexAttention: it compiles for every shape, seconds on CPU)
   are tried only where no SDPA candidate serves, e.g. score modifiers. Of the default set, the
   restricted SDPA candidate whose backend plain ``sdpa`` picks for the call's inputs (PyTorch's own
   choice: ``sdpa_flash`` for most CPU calls) is the same kernel, so it is checked and timed once, as
   ``sdpa`` (:func:`attnopt.kernels.sdpa.same_kernel_as_sdpa`). Of the default set too, the candidates
   that write out the ``(B, H, Tq, Tk)`` scores (``math``, ``sdpa_math``) are not timed where one copy of
   them, at the bucket's longest lengths, is over ``max_scores`` (512 MiB: T=4096 at B=1 with 12 heads in
   float32) and a candidate that never holds them serves (``sdpa`` counts as holding them where its own
   choice is its math backend): every round would write and read that tensor (the reference check still
   computes it once). Where none of the others can serve (its check, or with dropout its warm-up,
   failed), they are checked and timed after all.
   With dropout and gradients only ``math`` and ``sdpa_math`` are raced: a site serves ``math`` in place
   of any other there (:mod:`attnopt.runtime.dispatch`).
2. *Inputs*: random q, k, v of the real shapes, dtypes and device (never zeros), and the
   site's real mask (its pattern is part of the function).
3. *Check*: each candidate's output (and, when gradients are needed, its q/k/v gradients)
   must match the reference computation within the dtype's tolerance before it may win;
   rows whose reference is NaN (every key masked) are skipped, since the site restores them.
   A candidate that raises or differs scores infinity and is recorded as rejected. (``math`` is the
   reference computation itself: the reference's run is its check.)
4. *Time*: the check was each candidate's warm-up (with dropout, one more call each, with it), then
   rounds that call every surviving candidate once, in an order shuffled every round (seeded), so
   none always runs after the same one, synchronising the device around each call (CUDA events
   on GPU), until the decision is made with confidence (:mod:`attnopt.selection.stats`): after
   each round from the eighth on, every candidate is compared with the leader (the lowest
   median) by its per-round paired ratios to it and their sign-test interval at ``confidence``
   (99% per look: the rule looks after every round and at several rivals, so each look is
   stricter than the 95% one wants overall). A candidate whose interval lies above 1 is *pruned*
   (clearly slower over several rounds, never on one). Before the eighth round, from the fifth (and
   not before each candidate has had as many rounds as there are candidates), one that
   ran more than ``gross`` (2x) slower than the leader in *every* round is pruned too: were it in truth no
   slower, that would happen with chance at most ``2**-5`` (3%) whatever the noise, and these looks are
   nested, so the bound holds for the race (a long shape's slow candidates, ``math`` at T=4096 with
   gradients, are timed five or six times, not eight). One whose interval lies within
   ``1 +- tie`` (3%) is a *tie* (either serves). The rounds stop when every rival of the leader
   is pruned or tied, or when the timed calls after the first eight rounds (which always run:
   slow candidates are pruned there) have used ``budget_s`` (2 s), or after ``max_rounds``
   (200); then the best median is chosen (``sdpa`` where it is not shown slower than any candidate:
   without evidence, what the model written with SDPA would run), but marked *provisional*: it serves this
   process and is timed again by the next process or the next :func:`attnopt.tune`. The rounds of one tuning
   stop, too, after the round in which their timed calls reach ``time_limit_s`` (30 s; the first eight rounds
   included) if the race has not decided: the choice is made the same way and is provisional, and the entry
   keeps every round's times (``TuningEntry.samples``), so the next tuning of the key continues those rounds
   where the same candidates pass their checks (a round pairs its candidates within itself, so rounds timed by
   another process pair as well; the continued rounds run in orders of their own, and count against
   ``budget_s``); :func:`attnopt.tune` sets no limit. The checks, the memory measurement and the confirming
   rounds below are not limited. A choice is never one
   that the rounds show clearly slower than another candidate that may serve. Because the race looks after
   every round, a verdict "faster than the runner-up" it ends on is checked once more on fresh rounds of the
   two alone (until half the budget is spent, at least 8): one look at ``confidence``, so two equal
   candidates stay "separated" about 1% of the time rather than the race's several percent; a verdict the
   fresh rounds do not confirm is provisional. Each entry
   keeps its noise: per-candidate median, interquartile range and rounds, each rival's ratio to
   the choice with its interval, and the load average.
5. *Memory*: with a ``memory_budget``, the peak tensor memory of one call
   (:func:`attnopt.selection.measure.peak_memory`) of every candidate still in the race after pruning (of all
   of them when the budget rules out any one of those: the candidates pruned against it are in again);
   candidates above the budget are rejected; if none fits, the one with the lowest peak is kept and a warning
   says so. Without a budget, the choice's alone, once it is made (for ``explain()``; on the CPU the meter is
   the profiler, and one such call of a long shape takes seconds).
6. *Keep* the fastest (provisional unless separated from every rival); store every timing in the
   :class:`~attnopt.selection.cache.TuningCache` (on disk, keyed by attnopt/torch version, device,
   threads and candidate set) so later processes skip tuning (a provisional entry is stored as
   such, and timed again where it is next met); under ``torch.distributed`` rank 0 tunes and broadcasts its choice
   (:func:`attnopt.selection.distributed.agree`) so every rank runs the same kernels.

Timer and memory meter are injectable (``Selector(timer=..., memory=...)``) so the policy is
tested deterministically; the budget counts the seconds the timer reports, so a fake timer's
seconds count as real ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import random
import re
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any

import torch

from ..env import parse_bytes
from ..kernels.reference import MATH, reference_attention, tolerance
from ..kernels.registry import TWICE_DIFFERENTIABLE, candidate_names, get_candidate
from ..kernels.sdpa import same_kernel_as_sdpa
from ..spec import AttentionSpec
from . import stats
from .cache import TuningCache, TuningEntry
from .distributed import agree

log = logging.getLogger(__name__)

#: ``timer(candidate_name, run) -> seconds`` for one call of ``run``.
Timer = Callable[[str, Callable[[], Any]], float]
#: ``memory(candidate_name, run) -> bytes`` of peak tensor memory during one call of ``run``.
MemoryMeter = Callable[[str, Callable[[], Any]], int]


#: ``Selector(max_scores=...)``'s default, in bytes
_MAX_SCORES = 512 * 2**20
#: the longest call a kept round may hold, in seconds: the rounds of a cut race read back from a file are continued
#: only when every time is in (0, this)
_LONGEST_CALL_S = 1e5


def length_bucket(n: int) -> int:
    """The power of two at or above ``n``: the lengths one shape key stands for."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


@dataclass(frozen=True)
class ShapeKey:
    """What the choice of a candidate may depend on (see the module docstring)."""

    batch: int
    heads: int
    kv_heads: int
    tq: int
    tk: int
    head_dim: int
    v_dim: int
    dtype: str
    device: str
    mask: str
    mask_layout: str  # which mask dims broadcast, e.g. "1,1,n,n" for a (T, T) mask lifted to 4-D
    causal: bool
    score_mod: str
    gqa: bool
    dropout: bool
    grad: bool
    window: int = 0  # a causal sliding window's width (0: none)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        heads = f"H={self.heads}" + (f"/{self.kv_heads}" if self.kv_heads != self.heads else "")
        kind = "bool" if self.mask == "bool" else "additive"
        flags = (("causal", self.causal), (f"window {self.window}", bool(self.window)),
                 (f"{kind} mask", self.mask != "none" and not self.causal),
                 ("dropout", self.dropout), ("grad", self.grad), (self.score_mod, bool(self.score_mod)))
        extra = [x for x, on in flags if on]
        return (f"B={self.batch} {heads} Tq<={self.tq} Tk<={self.tk} D={self.head_dim} "
                f"{self.dtype.replace('torch.', '')} {self.device}" + ("".join(f", {e}" for e in extra)))


def shape_key(spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
              mask: torch.Tensor | None, dropout: bool, grad: bool) -> ShapeKey:
    """The key of a call with 4-D ``q``, ``k``, ``v`` (as the site passes them to candidates)."""
    mask_kind = "none" if mask is None else ("bool" if mask.dtype == torch.bool else str(mask.dtype))
    layout = "" if mask is None else ",".join("1" if n == 1 else "n" for n in (1,) * (4 - mask.dim()) + mask.shape)
    return ShapeKey(int(q.size(0)), int(q.size(1)), int(k.size(1)), length_bucket(int(q.size(2))),
                    length_bucket(int(k.size(2))), int(q.size(3)), int(v.size(3)), str(q.dtype), q.device.type,
                    mask_kind, layout, causal, spec.score_mod or "", spec.gqa, dropout, grad,
                    (spec.window or 0) if causal else 0)


def default_timer(name: str, run: Callable[[], Any], device: torch.device | None = None) -> float:
    """Seconds for one ``run()``: CUDA events on ``device``'s stream, ``perf_counter`` otherwise."""
    if device is not None and device.type == "cuda":
        with torch.cuda.device(device):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            run()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


def default_memory(name: str, run: Callable[[], Any], device: torch.device | None = None) -> int:
    """Peak tensor bytes of one ``run()`` on ``device`` (CUDA: ``max_memory_allocated``; CPU: profiler)."""
    from .measure import peak_memory

    probe = torch.empty(0, device=device) if device is not None else None
    return peak_memory(lambda *_: run(), *((probe,) if probe is not None else ()), warmup=0)


@dataclass
class Call:
    """One call to tune for: the arguments the site passes to its candidate."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kwargs: dict[str, Any]
    grad: bool


class Selector:
    """Chooses a candidate per (spec, shape key) by measurement; shared by every site of a model.

    Args:
        timer, memory: ``timer(name, run) -> seconds`` and ``memory(name, run) -> bytes`` for one call
            (defaults: CUDA events or ``perf_counter``; the peak-memory meter).
        memory_budget: candidates whose peak exceeds it are not chosen (bytes or ``"512MiB"``).
        cache: a :class:`TuningCache`, ``True`` for the default one, ``False``/``None`` for none.
        candidates: the names to consider (default: every registered candidate).
        confidence: the level of each look's interval (0.99); ``tie``: the relative margin within
            which two candidates are equivalent (0.03).
        budget_s: seconds of timed calls per key after the first rounds before an undecided race
            stops and its choice is marked provisional (2.0); ``max_rounds``: the most rounds (200).
        gross, gross_rounds: a candidate more than ``gross`` times slower than the leader in each of its first
            ``gross_rounds`` rounds (2.0, 5) is timed no further (see the module docstring).
        progress: a counter of the timed calls for a tuning that runs over two seconds: None (on a terminal),
            True (always) or False (never).
        max_scores: of the default candidates, those that write out the (B, H, Tq, Tk) scores (``math``,
            ``sdpa_math``) are not timed where one copy of them would be larger ("512MiB"; None: always timed),
            as long as a candidate that never holds them serves.
        time_limit_s: seconds of timed calls one tuning may spend on its rounds (30.0; None: no limit). A race
            that has not decided when they are spent stops after its round; its choice is provisional, and the
            next tuning of the key (the next process, or :func:`attnopt.tune`, which sets no limit) continues
            its rounds instead of starting again.
    """

    def __init__(self, *, timer: Timer | None = None, memory: MemoryMeter | None = None,
                 memory_budget: int | str | None = None, cache: TuningCache | None | bool = True,
                 candidates: list[str] | None = None, confidence: float = 0.99, tie: float = 0.03,
                 budget_s: float = 2.0, max_rounds: int = 200, gross: float = 2.0, gross_rounds: int = 5,
                 progress: bool | None = None, max_scores: int | str | None = "512MiB",  # = _MAX_SCORES
                 time_limit_s: float | None = 30.0):
        if not 0.5 < confidence < 1:
            raise ValueError(f"confidence must be a level between 0.5 and 1 (e.g. 0.99), got {confidence!r}")
        if not 0 <= tie < 0.5:
            raise ValueError(f"tie must be a relative margin in [0, 0.5) (e.g. 0.03 for 3%), got {tie!r}")
        if not budget_s > 0:
            raise ValueError(f"budget_s must be seconds > 0 of timed calls per key (after the first rounds), "
                             f"got {budget_s!r}")
        if time_limit_s is not None and not time_limit_s > 0:
            raise ValueError(f"time_limit_s must be seconds > 0 of timed calls per tuning, or None for no limit, "
                             f"got {time_limit_s!r}")
        if max_rounds < stats.min_pairs(confidence):
            raise ValueError(f"max_rounds={max_rounds} is too few to decide anything at confidence {confidence}: "
                             f"give at least {stats.min_pairs(confidence)}")
        if not gross > 1 or gross_rounds < 5:
            raise ValueError(f"gross={gross!r} must be a factor > 1 and gross_rounds={gross_rounds!r} at least 5 "
                             "(fewer rounds of one sign show little: all of 4 happen 6% of the time by chance)")
        if candidates is not None:
            for name in candidates:
                get_candidate(name)  # a clear error now, not inside a forward
        self.timer = timer
        self.memory = memory
        self.memory_budget = parse_bytes(memory_budget)
        self.cache = TuningCache() if cache is True else (cache or None)
        self.only = list(candidates) if candidates is not None else None
        self.confidence = confidence
        self.tie = tie
        self.budget_s = budget_s
        self.max_rounds = max_rounds
        self.gross = gross
        self.gross_rounds = gross_rounds
        self.progress = progress
        self.max_scores = parse_bytes(max_scores, "max_scores")
        self.time_limit_s = time_limit_s
        self.entries: dict[tuple[AttentionSpec, ShapeKey], TuningEntry] = {}
        #: provisional entries forgotten by :meth:`retime_provisional` whose rounds the next tuning continues
        self._resume: dict[tuple[AttentionSpec, ShapeKey], TuningEntry] = {}
        #: True inside :func:`attnopt.tune`: only rank 0 tunes, then :meth:`share`
        self.collective = False
        #: :meth:`ahead_of_time` blocks under way (``attnopt.tune`` calls, perhaps in several threads), and the
        #: settings they change, as they were before the first of them
        self._ahead = 0
        self._before_ahead: tuple[Any, ...] = ()
        self._sites: weakref.WeakSet[Any] = weakref.WeakSet()
        self._lock = threading.Lock()

    def __deepcopy__(self, memo: dict[int, Any]) -> Selector:
        return self  # one selector per optimized model: copies of the model share its choices

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_lock", None)
        state.pop("_sites", None)
        if state.get("_ahead"):  # pickled inside attnopt.tune: the settings as they are outside it
            state["collective"], state["time_limit_s"], state["progress"] = state["_before_ahead"]
        state["_ahead"], state["_before_ahead"] = 0, ()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update({"gross": 2.0, "gross_rounds": 5, "progress": None, "max_scores": _MAX_SCORES,
                              "time_limit_s": 30.0, "_resume": {}, "_ahead": 0, "_before_ahead": (),
                              **state})  # older pickles lack these
        self._lock = threading.Lock()
        self._sites = weakref.WeakSet()

    # -- which candidates may serve a site -------------------------------------------------------

    def legal(self, spec: AttentionSpec, device: torch.device | str) -> tuple[list[str], dict[str, str]]:
        """Names of candidates that can serve ``spec`` on ``device``, and why the others cannot."""
        ok, why = [], {}
        for name in self.only if self.only is not None else candidate_names():
            cand = get_candidate(name)
            reason = cand.supports(spec)
            if reason is None and hasattr(cand, "available"):
                reason = cand.available(torch.device(device))
            if reason is None:
                ok.append(name)
            else:
                why[name] = reason
        # A costly candidate is worth its compile only where SDPA cannot serve, or serves a sliding
        # window as a dense mask (computing every block the window hides).
        if self.only is None and spec.window is None and any(n.startswith("sdpa") for n in ok):
            for n in [n for n in ok if getattr(get_candidate(n), "costly", False)]:
                ok.remove(n)
                why[n] = "compiles for every shape (seconds each); tried only where SDPA cannot serve (or a window)"
        return ok, why

    # -- choosing ----------------------------------------------------------------------------------

    def choose(self, spec: AttentionSpec, key: ShapeKey, call: Call) -> TuningEntry:
        """The entry (choice and timings) for ``key``, tuning on ``call`` on the first request."""
        with self._lock:
            entry = self.entries.get((spec, key))
            if entry is not None:
                return entry
            names, refused = self.legal(spec, call.q.device)
            prior = self._resume.pop((spec, key), None)
            entry = self._agreed(names, lambda: self._cached_or_tuned(spec, key, call, names, refused, prior))
            if "*" not in entry.rejected:  # a rank's stand-in until share() is not kept
                self.entries[(spec, key)] = entry
            return entry

    def _agreed(self, names: list[str], compute: Callable[[], TuningEntry]) -> TuningEntry:
        """Inside :func:`attnopt.tune` under torch.distributed, only rank 0 tunes; the other ranks run a
        provisional choice until :meth:`share` hands them rank 0's. No collective happens here: one
        inside a forward would hang as soon as ranks see different shapes or take different paths."""
        rank = _rank() if self.collective else None
        if not rank:
            return compute()
        why = f"provisional on rank {rank}: rank 0 tunes and shares its choice"
        return TuningEntry(choice=next((n for n in names if n != "math"), "math"), rejected={"*": why},
                           provisional=True, decision=why)

    def share(self) -> None:
        """Every rank takes rank 0's choices (one broadcast; all ranks must call it, as ``tune`` does).

        Sites that already chose for a key ask again on their next call, so every rank runs the
        same kernels for every key rank 0 tuned. Outside torch.distributed this does nothing.
        """
        if _rank() is None:
            return
        theirs = agree(lambda: dict(self.entries))
        with self._lock:
            self.entries.update(theirs)
        for site in list(self._sites):
            site.forget_choices()

    def slower_in_use(self, spec: AttentionSpec, key: ShapeKey, device: torch.device, entry: TuningEntry,
                      observed_ms: float, calls: int) -> TuningEntry:
        """``entry`` marked provisional because the sites' sampled calls ran it clearly slower than its tuning
        measured (another load, another setup than the tuning saw): it keeps serving this process, and the next
        process or :func:`attnopt.tune` times the candidates again. Stored so (in memory and on disk)."""
        recorded = entry.timings_ms.get(entry.choice, math.nan)
        why = (f"in use it ran {observed_ms / recorded:.2g}x slower than when tuned (median {observed_ms:.3g} ms "
               f"over {calls} sampled calls, against {recorded:.3g} ms): timed again by the next process or "
               "attnopt.tune")
        # (its rounds, if any, are not continued: they timed another setup than this one)
        marked = dataclasses.replace(entry, provisional=True, decision=f"{entry.decision}; {why}", samples={})
        log.info("%s: %s", key.describe(), why)
        with self._lock:
            if self.entries.get((spec, key)) is entry:
                self.entries[(spec, key)] = marked
        if self.cache is not None:
            self.cache.store(self._cache_key(spec, key, self.legal(spec, device)[0], device), marked)
        return marked

    def _cache_key(self, spec: AttentionSpec, key: ShapeKey, names: list[str], device: torch.device) -> dict:
        """The tuning cache's key of ``key``'s entry: the shape key, the spec, the budget, the candidate set."""
        assert self.cache is not None
        shape = {**key.as_dict(), "spec": repr(spec), "budget": self.memory_budget}
        if self.max_scores != _MAX_SCORES:  # (the default's entries keep the key they always had)
            shape["max_scores"] = self.max_scores
        return self.cache.key(shape, names, device)

    @contextlib.contextmanager
    def ahead_of_time(self, *, progress: bool = True) -> Iterator[None]:
        """The settings of :func:`attnopt.tune` inside the block: collective (rank 0 tunes), no time limit (every race
        runs to its end), no progress counters unless ``progress``. Blocks may overlap (one per thread): the settings
        come back as they were before the first one once the last one ends."""
        with self._lock:
            if self._ahead == 0:
                self._before_ahead = (self.collective, self.time_limit_s, self.progress)
            self._ahead += 1
            self.collective = True
            self.time_limit_s = None
            if not progress:
                self.progress = False
        try:
            yield
        finally:
            with self._lock:
                self._ahead -= 1
                if self._ahead == 0:
                    self.collective, self.time_limit_s, self.progress = self._before_ahead

    def retime_provisional(self) -> int:
        """Forget this process's provisional choices, so their keys are timed again on their next call;
        how many were forgotten. (Sites that ran one ask again; final choices are served from memory.)"""
        with self._lock:
            stale = [k for k, e in self.entries.items() if e.provisional]
            for k in stale:
                entry = self.entries.pop(k)
                if entry.samples:  # cut by the time limit: its next tuning continues these rounds
                    self._resume[k] = entry
        if stale:
            log.info("re-timing %d provisional choice(s) on their next call", len(stale))
            for site in list(self._sites):
                site.forget_choices()
        return len(stale)

    def register(self, site: Any) -> None:
        """Remember ``site`` (weakly) so :meth:`share` can make it choose again."""
        self._sites.add(site)

    def _cached_or_tuned(self, spec: AttentionSpec, key: ShapeKey, call: Call, names: list[str],
                         refused: Mapping[str, str], prior: TuningEntry | None = None) -> TuningEntry:
        if self.cache is None:
            return self.tune(spec, key, call, names, refused, prior=prior)
        cache_key = self._cache_key(spec, key, names, call.q.device)
        entry = self.cache.lookup(cache_key)
        if entry is not None and entry.provisional:
            log.info("timing %s again: its cached choice %s is provisional (%s)", key.describe(), entry.choice,
                     entry.decision)
            if entry.samples:
                prior = entry  # cut by the time limit: continue its rounds
        elif entry is not None and entry.choice in names:
            # A cached choice is checked again on this call's inputs (one run) before it is trusted.
            with torch.random.fork_rng(devices=[call.q.device] if call.q.device.type == "cuda" else []):
                runs = _Runs(call, spec)
                try:
                    problem = runs.check(entry.choice, runs.reference())
                except Exception as e:  # noqa: BLE001
                    problem = _raised(e)
            if problem is None:
                return entry
            log.info("cached choice %s failed its check (%s); tuning again", entry.choice, problem)
        entry = self.tune(spec, key, call, names, refused, prior=prior)
        self.cache.store(cache_key, entry)
        return entry

    def tune(self, spec: AttentionSpec, key: ShapeKey, call: Call, names: list[str],
             refused: Mapping[str, str] | None = None, *, prior: TuningEntry | None = None) -> TuningEntry:
        """Check, time and measure ``names`` on random inputs shaped like ``call``; keep the fastest.

        ``prior``: an entry of the same key whose race the time limit cut (``entry.samples``): its rounds are
        continued, where the same candidates race again (each is checked again on this call's inputs first).
        The global random state is left as it was (tuning draws from its own generator; dropout
        during timing runs inside ``fork_rng``), so seeded runs do not depend on cache hits.
        """
        device = call.q.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
                _progress(key, self.progress) as tick:
            return self._tune(spec, key, call, names, refused, tick, prior)

    def _tune(self, spec: AttentionSpec, key: ShapeKey, call: Call, names: list[str],
              refused: Mapping[str, str] | None, tick: Callable[[str], None] = lambda name: None,
              prior: TuningEntry | None = None) -> TuningEntry:
        start = time.perf_counter()
        device = call.q.device
        timed = self.timer or functools.partial(default_timer, device=device)

        def timer(name: str, run: Callable[[], Any]) -> float:
            seconds = timed(name, run)
            tick(name)
            return seconds

        memory = self.memory or functools.partial(default_memory, device=device)
        rejected = dict(refused or {})
        timings = {name: math.inf for name in names}
        peaks: dict[str, int] = {}
        runs = _Runs(call, spec)
        if runs.dropout and runs.call.grad and any(n in TWICE_DIFFERENTIABLE for n in names):
            for n in names:
                if n not in TWICE_DIFFERENTIABLE:
                    rejected[n] = ("with dropout and gradients a site serves math in its place (its dropout mask must "
                                   "be part of a graph autograd can differentiate again): not timed")
            names = [n for n in names if n in TWICE_DIFFERENTIABLE]
        full = list(names)
        names = self._without_large_scores(names, runs, rejected)
        expected = runs.reference()
        live: list[str] = []

        def admit(names_: list[str]) -> None:
            """Check ``names_`` (their twin of sdpa aside) and, with dropout, warm them up: the ones that pass join
            ``live``."""
            twin = self._twin_of_sdpa(names_, runs)
            if twin is not None:  # one kernel: checked and timed once, as sdpa (the restricted one adds a context)
                names_ = [n for n in names_ if n != twin]
                rejected[twin] = ("runs the same kernel as sdpa for these inputs (PyTorch's own backend choice): "
                                  "checked and timed once, as sdpa")
            passed = []
            for name in names_:
                if get_candidate(name) is MATH:  # (it takes a window itself, as the reference run did)
                    passed.append(name)  # the reference run was this very call: its check (and its warm-up)
                    continue
                try:
                    problem = runs.check(name, expected)
                except Exception as e:  # noqa: BLE001 - a raising candidate scores infinity
                    problem = _raised(e)
                if problem:
                    rejected[name] = problem
                else:
                    passed.append(name)
            for name in passed:
                if runs.dropout:  # one untimed warm-up each (the check ran without dropout)
                    try:
                        runs.runner(name)()
                    except Exception as e:  # noqa: BLE001 - e.g. no kernel once dropout is on
                        rejected[name] = _raised(e)
                        continue
                live.append(name)

        admit(names)
        kept_out = [n for n in full if n not in names]
        if kept_out and not live:  # none of the others can serve: the ones kept out for their scores are in again
            for n in kept_out:
                rejected.pop(n, None)
            admit(kept_out)
        # (without dropout the check was the very call the rounds time: it warmed every candidate up)
        load_before = _load()
        resumed = _resumable(prior, live)
        if prior is not None and resumed is None:
            log.info("%s: the rounds of the cut race are not continued (its candidates were %s, now %s)",
                     key.describe(), sorted(prior.samples), sorted(live))
        carried = max(map(len, resumed[0].values())) if resumed is not None else 0
        try:
            samples, pruned, cut = self._race(live, runs, timer, rejected, resumed)
        except Exception as e:  # noqa: BLE001 - rounds read back from a file that the race cannot use: start again
            if resumed is None:
                raise
            log.warning("%s: the rounds of the cut race could not be continued (%s); timing them again",
                        key.describe(), _raised(e))
            carried = 0
            samples, pruned, cut = self._race(live, runs, timer, rejected)
        live = [n for n in live if n in samples and n not in pruned]
        summary = {name: stats.quartiles(s) for name, s in samples.items()}
        for name, (_, median, _) in summary.items():
            timings[name] = median * 1e3

        def measure(names_: list[str]) -> None:
            for name in names_:
                try:
                    peaks[name] = _bytes(memory(name, runs.runner(name)))
                except Exception as e:  # noqa: BLE001
                    rejected[name] = f"peak memory could not be measured: {_raised(e)}"
                    timings[name] = math.inf

        # With a memory budget, memory is measured for the candidates still in the race, and the pruned ones when
        # the budget rules out every one of those; without one, for the choice alone (after it is made: one call,
        # which on the CPU runs under the profiler, three times as long as a timed one at long shapes).
        budgeted = self.memory_budget is not None
        measured = not (torch.autograd.profiler._is_profiler_enabled and self.memory is None
                        and device.type != "cuda")
        if not measured:  # a second profiler session would end the user's
            log.info("a profiler session is active: peak memory is not measured while tuning")
            if self.memory_budget is not None:
                warnings.warn("attnopt: tuning inside a torch.profiler session cannot measure memory; the memory "
                              "budget is not applied to this choice", stacklevel=2)
        elif budgeted:
            measure(live)
            if not all(peaks.get(n, math.inf) <= self.memory_budget
                                                          for n in live):
                # a candidate over the budget may be the one others were pruned against: those are in again
                measure([n for n in samples if n not in live])
        # (without a budget: the candidates still in the race; a pruned one keeps a low median from its early rounds)
        ok = [n for n in samples if math.isfinite(timings[n])
              and (n in peaks or not measured or (not budgeted and n in live))]
        budget = self.memory_budget if measured else None
        if budget is not None:
            fits = [n for n in ok if peaks.get(n, 0) <= budget]
            for n in ok:
                if n not in fits:
                    rejected[n] = f"peak {peaks[n] / 2**20:.1f} MiB is over the memory budget"
            if not fits and ok:
                lowest = min(ok, key=lambda n: peaks[n])
                warnings.warn(f"attnopt: no candidate fits the memory budget of {self.memory_budget / 2**20:.1f} MiB "
                              f"for {key.describe()}; using {lowest} (peak {peaks[lowest] / 2**20:.1f} MiB)",
                              stacklevel=2)
                fits = [lowest]
            ok = fits
        if not ok:
            choice = "math"
            unmeasured = any(why.startswith("peak memory could not be measured") for why in rejected.values())
            why = ("no candidate's peak memory could be measured for the memory budget" if unmeasured
                   else "no candidate passed its check")
            rejected["math"] = f"{why}; the reference computation runs"
            provisional, decision = False, f"{why}; the reference computation runs"
        else:
            # never one that is clearly slower than another that may serve (a candidate pruned early keeps a
            # low median from quiet first rounds; one pruned against a leader that the budget then rejected)
            def beaten(n: str) -> bool:
                return any(o != n and (stats.compare(samples[n], samples[o], confidence=self.confidence,
                                                     tie=self.tie).verdict == "slower"
                                       or self._grossly_slower(samples[n], samples[o])) for o in ok)

            pool = [n for n in ok if not beaten(n)] or ok
            choice = min(pool, key=lambda n: timings[n])
            rivals = [n for n in samples if math.isfinite(timings[n]) and n not in rejected]  # pruned ones too
            provisional, decision, confirm = self._verdict(choice, rivals, samples, pruned, budget is not None)
            served = ""
            if provisional and choice != "sdpa" and "sdpa" in pool and choice in samples and stats.compare(
                    samples["sdpa"], samples[choice], confidence=0.95, tie=self.tie).verdict != "slower":
                # Not separated, and sdpa not shown slower than the best median even at 95%: what the model written
                # with SDPA runs serves until a later timing shows another candidate faster (provisional all the same)
                choice = "sdpa"
                provisional, decision, confirm = self._verdict(choice, rivals, samples, pruned, budget is not None)
                served = "; sdpa serves, as no candidate was shown faster than it"
                decision += served
            if cut:
                provisional, decision = True, self._cut(choice, rivals, samples, served, carried)
            elif confirm:
                provisional, decision = self._confirm(choice, rivals, samples, runs, timer, decision)
        if measured and not budgeted and choice in samples:
            try:
                peaks[choice] = _bytes(memory(choice, runs.runner(choice)))
            except Exception as e:  # noqa: BLE001 - the figure is for explain(); the choice stands (it ran its rounds)
                log.info("%s: peak memory of %s could not be measured (%s)", key.describe(), choice, _raised(e))
        ratios = {}
        for name in samples:
            if name != choice and choice in samples:
                c = stats.compare(samples[name], samples[choice], confidence=self.confidence, tie=self.tie)
                if math.isfinite(c.hi):  # an interval exists (enough paired rounds)
                    ratios[name] = (c.ratio, c.lo, c.hi)
        entry = TuningEntry(choice=choice, timings_ms=timings, peak_bytes=peaks, rejected=rejected,
                            created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                            tuning_s=time.perf_counter() - start, provisional=provisional, decision=decision,
                            rounds={n: len(s) for n, s in samples.items()},
                            spread_ms={n: (q[0] * 1e3, q[2] * 1e3) for n, q in summary.items()},
                            ratios=ratios, pruned=pruned, confidence=self.confidence,
                            load=tuple(x for x in (load_before, _load()) if x is not None),
                            samples={n: tuple(t) for n, t in samples.items()} if cut else {})
        log.info("tuned %s: %s (%s)", key.describe(), choice, format_timings(entry))
        return entry

    def _without_large_scores(self, names: list[str], runs: _Runs, rejected: dict[str, str]) -> list[str]:
        """``names`` without the default candidates that write out the scores, where one copy of them is over
        ``max_scores`` and a candidate that never holds them serves (a 6 GiB tensor per call takes seconds to write
        and read, in every one of the rounds; the reference check still computes it once)."""
        if self.only is not None or self.max_scores is None:
            return names
        q, k = runs.q, runs.k
        # at the bucket's longest lengths: the entry serves every call of the bucket
        size = q.size(0) * q.size(1) * length_bucket(q.size(2)) * length_bucket(k.size(2)) * q.element_size()
        if size <= self.max_scores:
            return names
        large = [n for n in names if getattr(get_candidate(n), "materialises", False)]
        if "sdpa" in names and getattr(get_candidate(runs.sdpa_kernel or "sdpa"), "materialises", False):
            large.append("sdpa")  # SDPA's own choice is its math backend here (a mask with a gradient, dropout)
        if not large or len(large) == len(names):
            return names
        for n in large:
            rejected[n] = (f"would write out {size / 2**20:.0f} MiB of scores per call (over max_scores, "
                           f"{self.max_scores / 2**20:.0f} MiB): not timed, as candidates that never hold them serve")
        return [n for n in names if n not in large]

    def _twin_of_sdpa(self, names: list[str], runs: _Runs) -> str | None:
        """The restricted SDPA candidate (``sdpa_flash``, ``sdpa_math``, ...) that runs the very kernel plain
        ``sdpa`` picks for these inputs, when both are in the race of the default candidate set (a set the user
        named is timed as named)."""
        if self.only is not None or "sdpa" not in names:  # (with dropout and gradients sdpa is not raced)
            return None
        return runs.sdpa_kernel if runs.sdpa_kernel in names else None

    def _race(self, names: list[str], runs: _Runs, timer: Timer, rejected: dict[str, str],
              prior: tuple[dict[str, list[float]], dict[str, str]] | None = None,
              ) -> tuple[dict[str, list[float]], dict[str, str], bool]:
        """Time ``names`` in rounds of shuffled order until the leader is separated from (or tied with) every rival.

        Returns the seconds per round of each candidate that could be timed (a pruned one's list
        stops at its pruning), why each pruned candidate was dropped, and whether the time limit cut the race
        before it decided. Candidates that raise are added to ``rejected``. ``prior``: the samples and pruned
        candidates of a cut race of the same candidates, whose rounds this one continues (each round is paired
        within itself, so rounds timed by another process pair as well as this one's).
        """
        samples: dict[str, list[float]] = {name: [] for name in names}
        pruned: dict[str, str] = {}
        if prior is not None:
            samples = {name: list(prior[0][name]) for name in names}
            pruned = dict(prior[1])
        need = stats.min_pairs(self.confidence)
        # the budget is per key: the seconds of continued rounds after the first ``need`` count against it too
        spent = sum(sum(t[need:]) for t in samples.values())
        total = 0.0
        cut = False
        first = max((len(samples[n]) for n in samples if n not in pruned), default=0)
        # seeded (a tuning does not depend on the global random state), and by the rounds done: a continued race
        # does not replay the orders its first rounds ran in
        order = random.Random(len(names) + 1_000_003 * first)
        gross_from = max(self.gross_rounds, len(names))
        for round_ in range(first, self.max_rounds):
            racing = [n for n in samples if n not in pruned]
            turn = racing[:]
            order.shuffle(turn)  # a new order every round: no candidate always runs after the same one
            for name in turn:
                try:
                    seconds = float(timer(name, runs.runner(name)))
                except Exception as e:  # noqa: BLE001 - e.g. no kernel once dropout is on
                    rejected[name] = _raised(e)
                    del samples[name]
                    continue
                samples[name].append(seconds)
                total += seconds
                if round_ >= need:  # the first rounds always run: the budget is for the rounds after them
                    spent += seconds
            racing = [n for n in samples if n not in pruned]
            over = self.time_limit_s is not None and total >= self.time_limit_s
            if round_ + 1 < need:
                # never decide on fewer rounds than can show anything (8 at 99%), but stop timing a candidate
                # that ran more than ``gross`` times slower than the leader in each of its first rounds
                if round_ + 1 >= gross_from and len(racing) > 1:
                    self._prune_gross(racing, samples, pruned)
                    if sum(n not in pruned for n in samples) <= 1:
                        break
                if over and len(racing) > 1:
                    cut = True
                    break
                continue
            if len(racing) <= 1:
                break
            leader = min(racing, key=lambda n: stats.quartiles(samples[n])[1])
            settled = True
            for name in racing:
                if name == leader:
                    continue
                c = stats.compare(samples[name], samples[leader], confidence=self.confidence, tie=self.tie)
                if c.verdict == "slower":
                    pruned[name] = f"slower than {leader} by {c.describe()} over {c.n} rounds; not timed further"
                elif c.verdict != "tie":
                    settled = False
            if settled or spent >= self.budget_s:
                break
            if over:
                cut = True
                break
        return samples, pruned, cut

    def _prune_gross(self, racing: list[str], samples: Mapping[str, list[float]], pruned: dict[str, str]) -> None:
        """Prune each candidate slower than the leader (the lowest median) by more than ``gross`` in *every* paired
        round so far (at least ``gross_rounds``). Were it in truth no slower than the leader, each round would show
        it slower with chance at most 1/2, whatever the noise, so all of ``n`` rounds at most ``2**-n`` (3% for 5);
        the looks are nested (all of ``n + 1`` rounds implies all of ``n``), so that bound holds over the race.
        Load that slows one call twofold, in each of five rounds, and never its rival's call beside it, is
        rarer still."""
        leader = min(racing, key=lambda n: stats.quartiles(samples[n])[1])
        lead = samples[leader]
        for name in racing:
            times = samples[name]
            if name != leader and self._grossly_slower(times, lead):
                least = min(a / max(b, 1e-12) for a, b in zip(times, lead))
                pruned[name] = (f"slower than {leader} by more than {self.gross:g}x in each of its {len(times)} "
                                f"rounds (at least x{least:.3g}); not timed further")

    def _runner_up(self, choice: str, rivals: list[str], samples: Mapping[str, list[float]]) -> str | None:
        """The rival closest to ``choice`` by its paired ratio to it (the median of the per-round ratios: load that
        changes during the race moves both alike, where a median of a candidate pruned in quiet early rounds
        does not), of those not pruned as grossly slower than it; None when every rival was."""
        close = [n for n in rivals if n != choice and not self._grossly_slower(samples[n], samples[choice])]
        if not close:
            return None
        return min(close, key=lambda n: stats.compare(samples[n], samples[choice], confidence=self.confidence,
                                                      tie=self.tie).ratio)

    def _grossly_slower(self, x: list[float], y: list[float]) -> bool:
        """``x`` ran more than ``gross`` times ``y`` in every paired round, over at least ``gross_rounds``."""
        n = min(len(x), len(y))
        return n >= self.gross_rounds and all(a > self.gross * b for a, b in zip(x[:n], y[:n]))

    def _confirm(self, choice: str, rivals: list[str], samples: Mapping[str, list[float]], runs: _Runs, timer: Timer,
                 decision: str) -> tuple[bool, str]:
        """A final verdict checked once more on fresh rounds of the choice and its runner-up alone.

        The race looks at its comparisons after every round, so a verdict it ends on has had many chances to
        come out by luck (two equal candidates end "separated" in several percent of races). One comparison on
        rounds the race did not see is a single look: at ``confidence`` it is wrong that often at most. A
        verdict the fresh rounds do not confirm is provisional."""
        runner = self._runner_up(choice, rivals, samples)
        assert runner is not None  # a "faster than the runner-up" verdict names one
        fresh: dict[str, list[float]] = {choice: [], runner: []}
        need = stats.min_pairs(self.confidence)
        # rounds until half the budget of timed calls is spent (at least 8, at most max_rounds): a count fixed by
        # the time spent, never by the outcome, keeps it a single look
        rounds, spent = max(need, self.max_rounds), 0.0
        try:
            for round_ in range(rounds):
                if round_ >= need and spent >= self.budget_s / 2:
                    break
                for name in (choice, runner) if round_ % 2 == 0 else (runner, choice):
                    fresh[name].append(float(timer(name, runs.runner(name))))
                    spent += fresh[name][-1]
        except Exception as e:  # noqa: BLE001 - a candidate that raises now: not confirmed
            return True, f"provisional: {decision}; the confirming rounds raised ({_raised(e)})"
        c = stats.compare(fresh[runner], fresh[choice], confidence=self.confidence, tie=self.tie)
        if c.verdict == "slower":
            return False, f"{decision}; confirmed on {c.n} fresh rounds ({runner}/{choice} {c.describe()})"
        return True, (f"provisional: {decision}, but {c.n} fresh rounds of the two alone did not confirm it "
                      f"({runner}/{choice} {c.describe()}); timed again by the next process or attnopt.tune")

    def _cut(self, choice: str, rivals: list[str], samples: Mapping[str, list[float]], served: str,
             carried: int = 0) -> str:
        """Why the choice of a race the time limit cut is provisional (``served``: the clause saying ``sdpa`` serves
        an undecided race, or ""; ``carried``: the rounds continued from an earlier tuning)."""
        runner = self._runner_up(choice, rivals, samples)
        closest = ""
        if runner is not None:
            c = stats.compare(samples[runner], samples[choice], confidence=self.confidence, tie=self.tie)
            shown = f"{c.describe()} at {self.confidence:.0%}" if math.isfinite(c.hi) else f"x{c.ratio:.3g}"
            closest = f" ({runner}/{choice} {shown} over {c.n} rounds)"
        rounds = max(map(len, samples.values()))
        done = f"{rounds - carried} rounds (after {carried} of earlier tunings)" if carried else f"{rounds} rounds"
        return (f"provisional: the time limit ({self.time_limit_s:g} s of timed calls per tuning) was spent after "
                f"{done}, before the race could separate the candidates{closest}"
                f"{served}; the next tuning of this key continues its rounds (attnopt.tune runs them to the end)")

    def _verdict(self, choice: str, rivals: list[str], samples: Mapping[str, list[float]], pruned: Mapping[str, str],
                 budgeted: bool) -> tuple[bool, str, bool]:
        """Whether ``choice`` is provisional, the sentence that says why it won, and whether that verdict is to be
        confirmed on fresh rounds (:meth:`_confirm`: a "faster than" the race's many looks ended on). A rival counts
        as beaten when the rounds show it slower than ``choice`` or tied with it, or it was pruned as grossly slower
        (:meth:`_prune_gross`, whose bound holds over every look); one pruned against another leader (that the
        budget then rejected) and not shown slower than ``choice`` leaves the choice provisional."""
        level = f"{self.confidence:.0%}"
        prefix = "fastest within the memory budget: " if budgeted else ""
        rivals = sorted((n for n in rivals if n != choice), key=lambda n: stats.quartiles(samples[n])[1])
        if not rivals:
            return False, prefix + ("the only candidate left" if budgeted else "the only candidate that passed"), False
        verdicts = {}
        for name in rivals:
            c = stats.compare(samples[name], samples[choice], confidence=self.confidence, tie=self.tie)
            if c.verdict not in ("slower", "tie") and not self._grossly_slower(samples[name], samples[choice]):
                return True, (f"{prefix}provisional: not separated from {name} ({name}/{choice} {c.describe()} at "
                              f"{level} over {c.n} rounds, within a budget of {self.budget_s:g} s of timed calls); "
                              "timed again by the next process or attnopt.tune"), False
            verdicts[name] = c
        name = self._runner_up(choice, rivals, samples)
        if name is None:  # every rival grossly slower in each of its first rounds
            name = rivals[0]
            return False, (f"{prefix}faster than the runner-up {name}, which ran more than {self.gross:g}x slower in "
                           f"each of its {verdicts[name].n} rounds"), False
        c = verdicts[name]
        if c.verdict == "tie":
            return False, (f"{prefix}tied with {name} within {self.tie:.0%} ({name}/{choice} {c.describe()} at {level} "
                           f"over {c.n} rounds); either serves"), False
        return False, (f"{prefix}faster than the runner-up {name}: {name}/{choice} {c.describe()} at {level} "
                       f"over {c.n} rounds"), True


@contextlib.contextmanager
def _progress(key: ShapeKey, show: bool | None) -> Iterator[Callable[[str], None]]:
    """A tqdm counter of the timed calls of one tuning, shown once it has run for two seconds (a long shape's
    first call), on a terminal unless ``show`` says otherwise; ``tick(name)`` counts a call of ``name``."""
    if show is False:
        yield lambda name: None
        return
    from tqdm.auto import tqdm

    if sys.stderr is None:  # pythonw, some services: nowhere to show it
        yield lambda name: None
        return
    bar = tqdm(desc=f"attnopt: tuning {key.describe()}", unit=" calls", delay=2.0, leave=False,
               disable=None if show is None else False)
    broken = []

    def tick(name: str) -> None:
        if broken:
            return
        try:
            bar.set_postfix_str(name, refresh=False)
            bar.update(1)
        except Exception as e:  # noqa: BLE001 - a progress display never counts against a candidate
            broken.append(e)
            log.info("the tuning's progress counter failed (%r); tuning goes on without it", e)

    try:
        yield tick
    finally:
        try:
            bar.close()
        except Exception:  # noqa: BLE001 - as above
            pass


def _load() -> float | None:
    """The 1-minute load average, where the OS has one."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _bytes(peak: Any) -> int:
    """A memory meter's reading as a byte count; a reading that is not one (negative, NaN) raises."""
    n = float(peak)
    if not n >= 0 or math.isinf(n):
        raise ValueError(f"the memory meter read {peak!r}, not a byte count")
    return int(n)


def _resumable(prior: TuningEntry | None,
               live: list[str]) -> tuple[dict[str, list[float]], dict[str, str]] | None:
    """The rounds of ``prior`` (a race the time limit cut) to continue with ``live``, the candidates that passed
    their checks now: only where they are the very ones that raced (so every round pairs the same candidates), and
    the unpruned ones ran the same number of rounds; else None (the race starts again)."""
    if prior is None or not prior.samples or set(prior.samples) != set(live):
        return None
    pruned = {n: why for n, why in prior.pruned.items() if n in live}
    if len({len(t) for n, t in prior.samples.items() if n not in pruned}) != 1:
        return None
    # times a real timer gives (a file edited by hand, or a foreign one, may hold anything)
    if not all(t and all(0 < x < _LONGEST_CALL_S for x in t) for t in prior.samples.values()):
        return None
    return {n: list(t) for n, t in prior.samples.items()}, pruned


def _raised(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
    return f"raised {type(e).__name__}: {text}"


def _rank() -> int | None:
    """This process's rank in a torch.distributed run of more than one process, else None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank()
    return None


#: the reason :meth:`Selector._prune_gross` gives: its rounds and the least per-round ratio
_GROSS_REASON = re.compile(r"in each of its (\d+) rounds \(at least x([^)]+)\)")


def format_timings(entry: TuningEntry, limit: int = 8) -> str:
    """The measurements of one entry for explain(), fastest first::

        sdpa 0.293 ms* (IQR 0.278-0.376, 24 rounds, 0.105 MiB), sdpa_flash 0.319 ms (x1.08 [1.02, 1.1], pruned),
        math 0.761 ms (x1.91 [1.67, 2.22], pruned), tiled64: raised RuntimeError: ...

    ``*`` marks the choice, listed first, with the interquartile range of its times; each rival follows in
    the order of its per-round ratio to the choice (paired rounds: load that changes while tuning moves both
    alike, where the median of a candidate pruned in quiet early rounds looks faster than it is), with the
    interval, and whether it was pruned (clearly slower, no longer timed); peak memory follows in MiB where it
    was measured.
    """
    parts = []

    def order(kv: tuple[str, float]) -> tuple[int, float, float]:
        name, ms = kv
        return (0 if name == entry.choice else 1 if name in entry.ratios else 2,
                entry.ratios[name][0] if name in entry.ratios else 0.0, ms)

    for name, ms in sorted(entry.timings_ms.items(), key=order)[:limit]:
        if not math.isfinite(ms):
            continue
        notes = []
        if name == entry.choice and name in entry.spread_ms:
            q1, q3 = entry.spread_ms[name]
            notes.append(f"IQR {q1:.3g}-{q3:.3g}, {entry.rounds.get(name, 0)} rounds")
        elif name in entry.ratios:
            r, lo, hi = entry.ratios[name]
            notes.append(f"x{r:.3g} [{lo:.3g}, {hi:.3g}]")
        if name in entry.pruned:
            gross = _GROSS_REASON.search(entry.pruned[name])
            notes.append(f"pruned: at least x{gross[2]} in each of {gross[1]} rounds" if gross else "pruned")
        if name in entry.peak_bytes:
            notes.append(f"{entry.peak_bytes[name] / 2**20:.3g} MiB")
        parts.append(f"{name} {ms:.3g} ms" + ("*" if name == entry.choice else "")
                     + (f" ({', '.join(notes)})" if notes else ""))
    for name, why in entry.rejected.items():
        if name in entry.timings_ms:
            parts.append(f"{name}: {why}")
    return ", ".join(parts)


class _Runs:
    """Random inputs shaped (and strided) like one call, and closures that run a candidate on them.

    Rows the site overrides after its candidate (every key masked: restored to NaN, or to the
    mean of v for ``min_rows="mean"``) do not constrain the candidate: they are unmasked in the
    mask every run sees, and receive no gradient. Everything else must match, including the
    gradient of a mask that requires one (a learned bias).
    """

    def __init__(self, call: Call, spec: AttentionSpec):
        self.call = call
        gen = torch.Generator(device="cpu").manual_seed(0)

        def rand(t: torch.Tensor, grad: bool) -> torch.Tensor:
            x = torch.randn(t.shape, generator=gen, dtype=torch.float32).to(device=t.device, dtype=t.dtype)
            if not t.is_contiguous():  # e.g. a transposed view: keep its strides (when dense, as empty_like does)
                x = torch.empty_like(t, memory_format=torch.preserve_format).copy_(x)
            return x.requires_grad_(grad)

        self.q, self.k, self.v = (rand(t, call.grad) for t in (call.q, call.k, call.v))
        kwargs = dict(call.kwargs)
        mask = kwargs.get("attn_mask")
        self.dead: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None
        if isinstance(mask, torch.Tensor):
            mask = mask.detach()
            if mask.dtype == torch.bool:
                dead = ~mask.any(-1, keepdim=True)
                mask = mask | dead
            else:
                dead = torch.isneginf(mask).all(-1, keepdim=True)
                if spec.min_rows != "none":
                    dead = dead | (mask <= torch.finfo(mask.dtype).min / 2).all(-1, keepdim=True)
                mask = mask.masked_fill(dead, 0.0)
            self.dead = dead if bool(dead.any()) else None
            self.mask = mask.requires_grad_(call.grad and call.kwargs["attn_mask"].requires_grad)
            kwargs["attn_mask"] = self.mask
        self.kwargs = kwargs
        #: dropout is active in the timed calls (the check runs without it)
        self.dropout = float(kwargs.get("dropout_p") or 0.0) > 0

        self.grad_out: torch.Tensor | None = None
        self.gen = gen

    @functools.cached_property
    def sdpa_kernel(self) -> str | None:
        """The restricted SDPA candidate whose kernel plain ``sdpa`` picks for these inputs (None: not told)."""
        return same_kernel_as_sdpa(self.q, self.k, self.v, self.kwargs)

    def _inputs(self) -> tuple[torch.Tensor, ...]:
        extra = (self.mask,) if self.mask is not None and self.mask.requires_grad else ()
        return (self.q, self.k, self.v, *extra)

    def _grad_out(self, out: torch.Tensor) -> torch.Tensor:
        if self.grad_out is None:
            g = torch.randn(out.shape, generator=self.gen, dtype=torch.float32).to(out.device, out.dtype)
            if self.dead is not None:
                g = g.masked_fill(self.dead, 0.0)  # the site overrides these rows
            self.grad_out = g
        return self.grad_out

    def _forward(self, name: str, **override: Any) -> torch.Tensor:
        fn = reference_attention if name == "__reference__" else get_candidate(name)
        kwargs = {**self.kwargs, **override}
        return fn(self.q, self.k, self.v, **kwargs)

    def runner(self, name: str) -> Callable[[], Any]:
        call = self.call

        def run() -> Any:
            if not call.grad:
                with torch.no_grad():
                    return self._forward(name)
            with torch.enable_grad():
                out = self._forward(name)
                grads = torch.autograd.grad(out, self._inputs(), self._grad_out(out), allow_unused=True)
            return out, grads

        return run

    def _results(self, name: str) -> list[torch.Tensor | None]:
        # Correctness is checked without dropout: with it, outputs are random by design.
        with torch.enable_grad() if self.call.grad else torch.no_grad():
            out = self._forward(name, dropout_p=0.0)
            if not self.call.grad:
                return [out.detach()]
            grads = torch.autograd.grad(out, self._inputs(), self._grad_out(out), allow_unused=True)
        return [out.detach(), *grads]

    def reference(self) -> list[torch.Tensor | None]:
        return self._results("__reference__")

    def check(self, name: str, expected: list[torch.Tensor | None]) -> str | None:
        got = self._results(name)
        atol, rtol = tolerance(self.q.dtype)
        labels = ["output", "grad q", "grad k", "grad v", "grad mask"]
        for label, e, a in zip(labels, expected, got):
            if e is None:
                continue
            if a is None:
                if label == "output" or bool(e.any()):
                    return f"{label} is missing"
                continue
            if a.shape != e.shape:
                return f"{label} has shape {tuple(a.shape)}, the reference {tuple(e.shape)}"
            ef, af = e.float(), a.float()
            if self.dead is not None and label == "output":
                keep = ~self.dead.expand_as(e)
                ef, af = ef[keep], af[keep]
            if bool(torch.isnan(ef).any()) or bool(torch.isinf(ef).any()):
                return f"the reference {label} is not finite on these inputs; nothing could be checked"
            diff = (af - ef).abs()
            if not bool((diff <= atol + rtol * ef.abs()).all()):
                return f"{label} differs from the reference (max abs difference {diff.max().item():.3g})"
        return None
