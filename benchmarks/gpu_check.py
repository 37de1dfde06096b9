"""GPU check: every candidate against the reference, the selector on the core block, memory and the profiler, once.

    python benchmarks/gpu_check.py --out benchmarks/results          # on a GPU: under 5 minutes, worst case
    python benchmarks/gpu_check.py --dry-run --out /tmp/gpu_check    # on CPU, tiny shapes, < 60 s (what CI runs)
    python benchmarks/gpu_check.py --sections selector --budget selector=200   # one section again

Written to run once on a lent GPU with a fixed time allowance, so every section has a time budget
(``--budget NAME=SECONDS``): between items a section stops when its budget is spent and records the items
it did not reach as ``skipped``; a hard alarm a little later (``SIGALRM``) stops a single call that runs on
(a compile, a hung kernel) and records the section as ``timeout`` with what it had measured so far. A
section that raises is recorded with its error and the next one runs. Sections, in order:

1. ``correctness``: every registered candidate (``attnopt.candidate_names()``) that supports the case's spec
   and is available on the device, against ``attnopt.kernels.reference.reference_attention`` in each dtype
   (float32, bfloat16, float16; the dry run: float32 and bfloat16), four cases: ``full`` (no mask),
   ``causal``, ``padding`` (a boolean key-padding mask, shape (B, 1, 1, Tk)) and ``gqa`` (causal, H/4 key/value
   heads; H/2 in the dry run). Compared: the no-grad output, the output with gradients on, and dq, dk, dv
   for one fixed upstream gradient. The rule is the one the sites apply before a candidate serves a shape key
   (``attnopt.runtime.dispatch._compare_with_reference``, private, so written out again here): within
   ``tolerance(dtype)`` of the reference in the same dtype, or else no further from a float64 evaluation of
   the same (rounded) inputs than that reference is, plus ``atol``. One difference: here the float64
   evaluation gets the same rounded upstream gradient as the others (the sites give it the unrounded
   draw), so a case at the edge of the rule can pass here and fail there, or the other way round. A
   candidate that raises on a case it says it supports is recorded as ``raised`` (sites then fall back to
   ``math``), or as ``unsupported`` where PyTorch has no kernel of its backend for the inputs ("No available
   kernel": CUDA's flash and cuDNN in float32, flash with a mask; the selector rejects it there too); one that
   computes a wrong answer as ``fail``, and the script exits 1. Candidates that compile per shape (``flex``) are
   checked last, causal cases first; in the dry run only on float32 causal. On a GPU one is started only where
   the section's budget leaves ``COSTLY_FIRST_S`` (45 s) for its compile (in the memory section too).
2. ``memory``: peak tensor memory of one call per candidate, forward (no grad) and forward + backward,
   with ``attnopt.selection.measure.peak_memory`` (``torch.cuda.max_memory_allocated`` above the memory
   allocated before the call on CUDA, profiler allocation records on CPU).
3. ``selector``: the nanoGPT block (``attnopt.models.CausalSelfAttention``, C=768, H=12, eval, no_grad) at
   B in {1, 8} x T in {512, 2048, 8192}, float32 then bfloat16: ``attnopt.optimize(block)`` tunes with a fresh
   tuning cache in its first (untimed) call, timing candidates with CUDA events; the choice per shape key
   comes from ``attnopt.explain(opt)`` (``record.extra["tuning"]``); then attnopt, the hand-written SDPA block
   (``attnopt.models.SDPACausalSelfAttention``, same weights) and the block as written (``eager``) are timed in
   alternation (``attnopt.selection.measure.time_alternating``, medians). ``eager`` is skipped where its
   (B, H, T, T) scores would not fit (``--max-scores-gib``).
4. ``profile``: ``attnopt.profile("nanogpt", batch_sizes=[1], seq_lens=[T], phase="prefill", trace=True)``
   into ``OUT/gpu_check_profile``: forward time, idle gaps between kernels (CUDA only), peak memory, and the
   chrome traces and memory timelines (CUDA only) it wrote.

Output: ``OUT/gpu_check.json`` (rewritten after every section, so a run killed from outside keeps what it had)
and ``OUT/gpu_check.md``. Exit status: 0; 1 when a correctness check failed; 3 when a section raised or
hit its hard time limit; 2 when ``--device cuda`` is asked for on a machine without CUDA.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from bench_core import cpu_name, ratio, write_atomic
from tabulate import tabulate

import attnopt
from attnopt.kernels.reference import reference_attention, tolerance
from attnopt.models import CausalSelfAttention, GPTConfig, SDPACausalSelfAttention
from attnopt.selection.measure import peak_memory, time_alternating
from attnopt.selection.selector import Selector
from attnopt.spec import AttentionSpec

SECTIONS = ("correctness", "memory", "selector", "profile")
CASES = ("full", "causal", "padding", "gqa")
TENSORS = ("out", "out_train", "dq", "dk", "dv")  # out: no-grad forward; out_train: the forward with grads on
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: seconds per section on a GPU; each hard limit adds ``grace``: 272 s in all at worst, plus start-up
GPU_BUDGETS = {"correctness": 60.0, "memory": 25.0, "selector": 100.0, "profile": 35.0}
BUDGET_SPENT = "section budget spent"
#: seconds a compile-per-shape candidate (``flex``) is expected to take on its first call on a GPU (a cold compile of
#: its forward and backward), before a section starts one
COSTLY_FIRST_S = 45.0
DRY_BUDGETS = {"correctness": 50.0, "memory": 20.0, "selector": 25.0, "profile": 25.0}


# ---------------------------------------------------------------------------------------------- the plan

@dataclass(frozen=True)
class Plan:
    """Everything one run measures; ``--dry-run`` shrinks it to tiny CPU shapes."""

    device: str
    dry_run: bool
    dtypes: tuple[str, ...]
    check_shape: tuple[int, int, int, int, int]  # (B, H, Hkv of the gqa case, T, D)
    memory_shape: tuple[int, int, int, int]  # (B, H, T, D), causal
    memory_dtype: str
    block_dtypes: tuple[str, ...]
    batch_sizes: tuple[int, ...]
    seq_lens: tuple[int, ...]
    n_embd: int
    n_head: int
    repeats: int
    warmup: int
    profile_seq_len: int
    profile_repeats: int
    max_scores_bytes: int
    budgets: dict[str, float] = field(default_factory=dict)
    sections: tuple[str, ...] = SECTIONS
    selector_budget_s: float | None = None  # None: the default Selector (what users get)
    costly_once: bool = False  # check compile-per-shape candidates on float32 'causal' only
    seed: int = 0


def cpu_runs(dtype: str) -> bool:
    """Whether this CPU build runs a matmul and a softmax in ``dtype`` (bfloat16: almost every build)."""
    try:
        x = torch.ones(2, 4, 4, dtype=DTYPES[dtype])
        torch.softmax(x @ x.transpose(-2, -1), -1)
    except RuntimeError:
        return False
    return True


def make_plan(args: argparse.Namespace, device: str) -> Plan:
    dry = args.dry_run
    budgets = {**(DRY_BUDGETS if dry else GPU_BUDGETS), **args.budgets}
    cuda = device.startswith("cuda")
    if cuda:
        total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    if dry:
        dtypes = ("float32", "bfloat16", "float16") if cuda else tuple(d for d in ("float32", "bfloat16")
                                                                       if cpu_runs(d))
        plan = Plan(device=device, dry_run=True, dtypes=dtypes, check_shape=(2, 4, 2, 80, 16),
                    memory_shape=(2, 4, 80, 16), memory_dtype="float32", block_dtypes=("float32",),
                    batch_sizes=(1,), seq_lens=(16, 32), n_embd=768, n_head=12, repeats=2, warmup=1,
                    profile_seq_len=32, profile_repeats=1, max_scores_bytes=1 << 30, budgets=budgets,
                    selector_budget_s=0.2, costly_once=not cuda)
    else:
        plan = Plan(device=device, dry_run=False, dtypes=("float32", "bfloat16", "float16"),
                    check_shape=(2, 8, 2, 320, 64), memory_shape=(1, 12, 4096, 64),
                    memory_dtype="bfloat16" if cuda else "float32",
                    block_dtypes=("float32", "bfloat16"), batch_sizes=(1, 8), seq_lens=(512, 2048, 8192),
                    n_embd=768, n_head=12, repeats=10, warmup=2, profile_seq_len=2048, profile_repeats=5,
                    max_scores_bytes=int(0.5 * total) if cuda else 8 << 30, budgets=budgets)
    over: dict[str, Any] = {"seed": args.seed, "sections": tuple(args.sections)}
    if args.max_scores_gib is not None:
        over["max_scores_bytes"] = int(args.max_scores_gib * 2**30)
    for name in ("repeats", "batch_sizes", "seq_lens", "block_dtypes"):
        value = getattr(args, name)
        if value:
            over[name] = tuple(value) if isinstance(value, list) else value
    return Plan(**{**asdict(plan), **over})


# ---------------------------------------------------------------------------------------------- budgets

class SectionTimeout(BaseException):
    """The section's hard limit passed. A BaseException, so that ``except Exception`` (which the selector and
    the sites use to score a failing candidate) does not swallow it."""


class Budget:
    """Seconds a section may spend; it checks :meth:`spent` between items and skips the rest once it is."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.start = time.perf_counter()

    def spent(self) -> bool:
        return not self.fits(0.0)

    def fits(self, expected_s: float) -> bool:
        """Whether an item expected to take ``expected_s`` seconds ends within the budget."""
        return time.perf_counter() - self.start + expected_s < self.seconds


def grace(seconds: float) -> float:
    """How long past its budget a section may run before the hard alarm stops it (10 to 20 s)."""
    return min(20.0, max(10.0, 0.2 * seconds))


@contextmanager
def hard_limit(seconds: float, what: str) -> Iterator[None]:
    """Raise :class:`SectionTimeout` in the main thread after ``seconds`` (no-op elsewhere or without SIGALRM)."""
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def alarm(signum: int, frame: Any) -> None:
        raise SectionTimeout(f"{what} stopped by its hard limit after {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# ---------------------------------------------------------------------------------------------- helpers

def error_text(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}".rstrip(": ")


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


def release(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def plain(x: Any) -> Any:
    """JSON data: non-finite floats as strings, tuples as lists, tensors and dtypes as text."""
    if isinstance(x, float):
        return x if math.isfinite(x) else str(x)
    if isinstance(x, dict):
        return {str(k): plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    if x is None or isinstance(x, (bool, int, str)):
        return x
    return str(x)


def candidates() -> list[tuple[str, Any]]:
    """Registered candidates, the cheap ones first (a budget cut then only drops compile-per-shape ones)."""
    named = [(n, attnopt.get_candidate(n)) for n in attnopt.candidate_names()]
    return sorted(named, key=lambda nc: (bool(getattr(nc[1], "costly", False)), nc[0]))


# ---------------------------------------------------------------------------------------------- 1. correctness

@dataclass
class Case:
    """Inputs of one (case, dtype) check and the reference's results on them, in the dtype and in float64."""

    spec: AttentionSpec
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    grad_out: torch.Tensor
    kwargs: dict[str, Any]
    ref: dict[str, torch.Tensor]
    ref64: dict[str, torch.Tensor]


def scale_for(head_dim: int) -> float:
    """Not the default 1/sqrt(D), so a candidate that ignores ``scale=`` fails; the same in every section, so a
    compile-per-shape candidate (whose compiled code is specialised to the scale) compiles once per shape only."""
    return 0.8 / math.sqrt(head_dim)


def make_case(plan: Plan, case: str, dtype: torch.dtype) -> Case:
    b, h, hkv, t, d = plan.check_shape
    gen = torch.Generator().manual_seed(plan.seed + CASES.index(case))
    kv_heads = hkv if case == "gqa" else h

    def draw(*shape: int) -> torch.Tensor:  # drawn in float64 on CPU: the same numbers for every dtype, rounded
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(plan.device, dtype)

    q, k, v, g = draw(b, h, t, d), draw(b, kv_heads, t, d), draw(b, kv_heads, t, d), draw(b, h, t, d)
    mask = None
    if case == "padding":  # batch i hides its last i * T/4 keys; no row is fully masked
        lengths = torch.tensor([t - (i % 4) * (t // 4) for i in range(b)])
        mask = (torch.arange(t)[None, :] < lengths[:, None]).view(b, 1, 1, t).to(plan.device)
    causal = case in ("causal", "gqa")
    scale = scale_for(d)
    kwargs = dict(attn_mask=mask, dropout_p=0.0, is_causal=causal, scale=scale, enable_gqa=case == "gqa")
    spec = AttentionSpec(scale=scale, mask="bool" if mask is not None else "none",
                         causal="top_left" if causal else None, gqa=case == "gqa",
                         compute_dtype=dtype, out_dtype=dtype)
    ref = evaluate(reference_attention, q, k, v, g, kwargs)
    up = [x.double() for x in (q, k, v, g)]
    ref64 = evaluate(reference_attention, *up, kwargs)
    return Case(spec, q, k, v, g, kwargs, ref, ref64)


def evaluate(fn: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             grad_out: torch.Tensor, kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """``fn``'s no-grad output, its output with gradients on, and dq, dk, dv for ``grad_out``."""
    with torch.no_grad():
        out = fn(q, k, v, **kwargs)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    with torch.enable_grad():
        out_train = fn(*leaves, **kwargs)
        dq, dk, dv = torch.autograd.grad(out_train, leaves, grad_out.to(out_train.dtype))
    return {"out": out, "out_train": out_train.detach(), "dq": dq, "dk": dk, "dv": dv}


def compare(got: torch.Tensor, ref: torch.Tensor, ref64: torch.Tensor, dtype: torch.dtype) -> dict[str, Any]:
    """The sites' acceptance rule for one tensor, with the figures behind it.

    Pass when every element is within ``atol + rtol * |ref|`` of the reference in the same dtype; failing
    that (any dtype but float64), when the candidate's largest error against float64 is at most the
    reference's own plus ``atol`` ("no less accurate than the computation as written").
    """
    atol, rtol = tolerance(dtype)
    row: dict[str, Any] = {"dtype_out": str(got.dtype).replace("torch.", "")}
    if got.shape != ref.shape:
        return {**row, "pass": False, "why": f"shape {tuple(got.shape)}, the reference {tuple(ref.shape)}"}
    keep = torch.isfinite(ref)
    a, e, x = got.double()[keep], ref.double()[keep], ref64.double()[keep]
    if not bool(torch.isfinite(a).all()):
        return {**row, "pass": False, "why": "not finite where the reference is"}
    diff = (a - e).abs()
    row["max_err_vs_ref"] = diff.max().item() if diff.numel() else 0.0
    row["max_err_vs_f64"] = (a - x).abs().max().item() if diff.numel() else 0.0
    row["ref_max_err_vs_f64"] = (e - x).abs().max().item() if diff.numel() else 0.0
    if bool((diff <= atol + rtol * e.abs()).all()):
        return {**row, "pass": True, "rule": "tolerance"}
    if dtype != torch.float64 and row["max_err_vs_f64"] <= row["ref_max_err_vs_f64"] + atol:
        return {**row, "pass": True, "rule": "no less accurate than the reference"}
    return {**row, "pass": False, "why": f"differs from the reference by up to {row['max_err_vs_ref']:.3g} and is "
                                         f"{row['max_err_vs_f64']:.3g} from float64 (the reference: "
                                         f"{row['ref_max_err_vs_f64']:.3g})"}


def check_candidate(cand: Any, c: Case, dtype: torch.dtype) -> dict[str, Any]:
    try:
        got = evaluate(cand, c.q, c.k, c.v, c.grad_out, c.kwargs)
    except Exception as e:  # noqa: BLE001 - a candidate that raises is a result
        if "No available kernel" in str(e):  # the restricted backend has no kernel for these inputs (CUDA's flash
            # and cuDNN take no float32, flash no mask): not applicable, as the selector and the sites treat it
            return {"status": "unsupported", "pass": None, "reason": f"PyTorch has no kernel for it here: "
                                                                     f"{error_text(e)}"}
        return {"status": "raised", "pass": None, "error": error_text(e)}
    errors = {name: compare(got[name], c.ref[name], c.ref64[name], dtype) for name in TENSORS}
    ok = all(r["pass"] for r in errors.values())
    row: dict[str, Any] = {"status": "pass" if ok else "fail", "pass": ok}
    for figure in ("max_err_vs_ref", "max_err_vs_f64", "ref_max_err_vs_f64"):  # the largest over the five tensors
        row[figure] = max((r[figure] for r in errors.values() if figure in r), default=None)
    row["errors"] = errors
    if not ok:
        row["why"] = "; ".join(f"{n}: {r['why']}" for n, r in errors.items() if not r["pass"])
    return row


def check_order(plan: Plan) -> list[tuple[str, Any, str, str]]:
    """(candidate, its object, dtype, case) in the order they are checked: the cheap candidates first, then the
    compile-per-shape ones case by case across dtypes, so a budget cut drops their least telling cases."""
    items = []
    for name, cand in candidates():
        pairs = [(dt, case) for dt in plan.dtypes for case in CASES]
        if getattr(cand, "costly", False):
            pairs.sort(key=lambda p: (("causal", "gqa", "padding", "full").index(p[1]), plan.dtypes.index(p[0])))
        items += [(name, cand, dt, case) for dt, case in pairs]
    return items


def section_correctness(plan: Plan, rec: dict[str, Any], budget: Budget) -> None:
    rows: list[dict[str, Any]] = rec.setdefault("results", [])
    rec["shape"] = dict(zip(("B", "H", "Hkv_gqa", "T", "D"), plan.check_shape))
    rec["rule"] = ("within tolerance(dtype) of reference_attention in the same dtype, or no further from float64 "
                   "than that reference plus atol (the rule of attnopt.runtime.dispatch._compare_with_reference)")
    device = torch.device(plan.device)
    cases: dict[tuple[str, str], Case] = {}
    took: dict[str, float] = {}  # candidate -> its slowest check so far: the next one is not begun unless it fits
    try:
        for name, cand, dt_name, case in check_order(plan):
            row: dict[str, Any] = {"candidate": name, "dtype": dt_name, "case": case}
            rows.append(row)
            unavailable = cand.available(device)
            if unavailable:
                row.update(status="unavailable", reason=unavailable)
                continue
            if getattr(cand, "costly", False) and plan.costly_once and (dt_name, case) != ("float32", "causal"):
                row.update(status="skipped", reason="dry run: a compile-per-shape candidate is checked on float32 "
                                                    "causal only")
                continue
            first = COSTLY_FIRST_S if getattr(cand, "costly", False) and device.type == "cuda" else 0.0
            if not budget.fits(took.get(name, first)):
                row.update(status="skipped", reason=BUDGET_SPENT)
                continue
            key = (dt_name, case)
            if key not in cases:
                cases[key] = make_case(plan, case, DTYPES[dt_name])
            why_not = cand.supports(cases[key].spec)
            if why_not:
                row.update(status="unsupported", reason=why_not)
                continue
            start = time.perf_counter()
            row.update(check_candidate(cand, cases[key], DTYPES[dt_name]))
            row["seconds"] = time.perf_counter() - start
            took[name] = max(took.get(name, 0.0), row["seconds"])
    finally:  # also after a hard timeout: the rows so far are summarised
        counts = rec["counts"] = dict(Counter(row.get("status", "running") for row in rows))
        rec["failed"] = [f"{r['candidate']} {r['dtype']} {r['case']}: {r['why']}" for r in rows
                         if r.get("status") == "fail"]
        rec["skipped_for_budget"] = sum(r.get("reason") == BUDGET_SPENT for r in rows)
        rec["line"] = (f"{counts.get('pass', 0)} passed, {counts.get('fail', 0)} failed, "
                       f"{counts.get('raised', 0)} raised, "
                       f"{counts.get('unsupported', 0) + counts.get('unavailable', 0)} not applicable, "
                       f"{counts.get('skipped', 0)} skipped")


# ---------------------------------------------------------------------------------------------- 2. memory

def section_memory(plan: Plan, rec: dict[str, Any], budget: Budget) -> None:
    b, h, t, d = plan.memory_shape
    dtype = DTYPES[plan.memory_dtype]
    rec["shape"] = {"B": b, "H": h, "T": t, "D": d, "dtype": plan.memory_dtype, "causal": True}
    rec["method"] = ("torch.cuda.max_memory_allocated above the allocated memory before the call"
                     if plan.device.startswith("cuda") else "torch.profiler allocation records (CPU)")
    gen = torch.Generator().manual_seed(plan.seed)
    q, k, v, g = (torch.randn(b, h, t, d, generator=gen).to(plan.device, dtype) for _ in range(4))
    kw = dict(attn_mask=None, dropout_p=0.0, is_causal=True, scale=scale_for(d), enable_gqa=False)
    spec = AttentionSpec(scale=scale_for(d), causal="top_left", compute_dtype=dtype, out_dtype=dtype)
    rows: dict[str, dict[str, Any]] = rec.setdefault("bytes", {})
    try:
        for name, cand in candidates():
            why = cand.available(torch.device(plan.device)) or cand.supports(spec)
            if why:
                rows[name] = {"status": "not applicable", "reason": why}
                continue

            def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cand: Any = cand) -> torch.Tensor:
                return cand(q, k, v, **kw)

            def train(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, cand: Any = cand) -> Any:
                leaves = [x.detach().requires_grad_() for x in (q, k, v)]
                with torch.enable_grad():
                    return torch.autograd.grad(cand(*leaves, **kw), leaves, g)

            row = rows[name] = {"status": "ok"}
            # a compile-per-shape candidate compiles for each measurement: on a GPU that takes tens of seconds
            expected = COSTLY_FIRST_S if getattr(cand, "costly", False) and plan.device.startswith("cuda") else 0.0
            for label, fn, inputs in (("forward", forward, (q, k, v)), ("forward_backward", train, (q, k, v, g))):
                if not budget.fits(expected):  # checked before each measurement
                    row.update(status="skipped", reason=BUDGET_SPENT)
                    break
                try:
                    row[label] = peak_memory(fn, *inputs)
                except Exception as e:  # noqa: BLE001 - OOM or a raising candidate: recorded, the others go on
                    row.update({label: None, "status": "error", f"{label}_error": error_text(e)})
                    release(plan.device)
    finally:
        rec["skipped_for_budget"] = sum(r.get("reason") == BUDGET_SPENT for r in rows.values())
        measured = {n: r["forward"] for n, r in rows.items() if r.get("forward")}
        rec["line"] = f"{len(measured)} candidates measured at T={t}" + (
            f"; forward {min(measured.values()) / 2**20:.1f} to {max(measured.values()) / 2**20:.1f} MiB"
            if measured else "")


# ---------------------------------------------------------------------------------------------- 3. selector

def build_blocks(plan: Plan, dtype: torch.dtype) -> dict[str, torch.nn.Module]:
    """The block as written and the hand-written SDPA block, with the same weights."""
    torch.manual_seed(plan.seed)
    cfg = GPTConfig(n_embd=plan.n_embd, n_head=plan.n_head, block_size=max(plan.seq_lens), dropout=0.0)
    eager = CausalSelfAttention(cfg).to(plan.device, dtype).eval()
    sdpa = SDPACausalSelfAttention(cfg).to(plan.device, dtype).eval()
    sdpa.load_state_dict(eager.state_dict())
    return {"eager": eager, "sdpa": sdpa}


def selector_point(plan: Plan, blocks: dict[str, torch.nn.Module], row: dict[str, Any]) -> None:
    """Tune and time one (dtype, B, T) point into ``row`` (filled as it goes: a failure keeps what came before)."""
    dtype, b, t = DTYPES[row["dtype"]], row["B"], row["T"]
    torch._dynamo.reset()  # each point captures and tunes for its own static shape
    selector = Selector(budget_s=plan.selector_budget_s) if plan.selector_budget_s else None
    opt = attnopt.optimize(copy.deepcopy(blocks["eager"]), selector=selector)
    x = torch.randn(b, t, plan.n_embd, device=plan.device, dtype=dtype)
    fns: dict[str, Callable[..., Any]] = {"eager": blocks["eager"], "sdpa": blocks["sdpa"], "attnopt": opt}
    scores = b * plan.n_head * t * t * dtype.itemsize * 3  # the eager block holds about three (B, H, T, T) tensors
    if scores > plan.max_scores_bytes:
        del fns["eager"]
        row["eager_skipped"] = (f"its (B, H, T, T) scores need ~{scores / 2**30:.1f} GiB, over --max-scores-gib "
                                f"{plan.max_scores_bytes / 2**30:.1f}")
    with torch.no_grad():
        start = time.perf_counter()
        y = opt(x)  # capture, proof and tuning
        sync(plan.device)
        row["first_call_s"] = time.perf_counter() - start
        row["max_abs_diff_vs_sdpa"] = (y.double() - blocks["sdpa"](x).double()).abs().max().item()
        if "eager" in fns:
            row["max_abs_diff_vs_eager"] = (y.double() - blocks["eager"](x).double()).abs().max().item()
    del y
    report = attnopt.explain(opt)
    row["rewritten"] = report.rewritten
    tuning = {desc: entry for r in report.records for desc, entry in r.extra.get("tuning", {}).items()}
    row["chosen"] = {desc: e.choice for desc, e in tuning.items()}
    row["provisional"] = {desc: e.provisional for desc, e in tuning.items()}
    row["tuning"] = {desc: e.to_dict() for desc, e in tuning.items()}
    times = time_alternating(fns, (x,), repeats=plan.repeats, warmup=plan.warmup)
    row["ms"] = {n: times[n] * 1e3 if n in times else None for n in ("eager", "sdpa", "attnopt")}
    row["attnopt_vs_sdpa"] = ratio(row["ms"]["sdpa"], row["ms"]["attnopt"])
    row["attnopt_vs_eager"] = ratio(row["ms"]["eager"], row["ms"]["attnopt"])
    row["status"] = "ok"


def section_selector(plan: Plan, rec: dict[str, Any], budget: Budget) -> None:
    rec["block"] = {"n_embd": plan.n_embd, "n_head": plan.n_head, "eval": True, "no_grad": True}
    rec["timer"] = ("CUDA events (attnopt.selection.selector.default_timer)" if plan.device.startswith("cuda")
                    else "time.perf_counter")
    rec["repeats"], rec["warmup"] = plan.repeats, plan.warmup
    rows: list[dict[str, Any]] = rec.setdefault("points", [])
    try:
        for dt_name in plan.block_dtypes:
            blocks = build_blocks(plan, DTYPES[dt_name])
            for b in plan.batch_sizes:
                for t in plan.seq_lens:
                    row: dict[str, Any] = {"dtype": dt_name, "B": b, "T": t, "status": "running"}
                    rows.append(row)
                    if budget.spent():
                        row.update(status="skipped", error=BUDGET_SPENT)
                        continue
                    try:
                        selector_point(plan, blocks, row)
                    except Exception as e:  # noqa: BLE001 - OOM at one point: recorded, the next point runs
                        row.update(status="error", error=error_text(e))
                    finally:
                        torch._dynamo.reset()
                        release(plan.device)
                    chose = ", ".join(sorted(set(row.get("chosen", {}).values()))) or "-"
                    print(f"    {dt_name} B={b} T={t}: {row['status']}, chose {chose}, "
                          f"attnopt vs sdpa {show(row.get('attnopt_vs_sdpa'), 'x')}", flush=True)
            del blocks
            release(plan.device)
    finally:
        rec["skipped_for_budget"] = sum(r["status"] == "skipped" for r in rows)
        rec["line"] = f"{sum(r['status'] == 'ok' for r in rows)}/{len(rows)} points measured"


# ---------------------------------------------------------------------------------------------- 4. profile

def section_profile(plan: Plan, rec: dict[str, Any], budget: Budget, out_dir: Path) -> None:
    """One ``attnopt.profile`` call: a single call, so only the hard limit can stop it."""
    where = out_dir / "gpu_check_profile"
    start = time.time()
    rec["call"] = (f'attnopt.profile("nanogpt", batch_sizes=[1], seq_lens=[{plan.profile_seq_len}], '
                   f'phase="prefill", device="{plan.device}", out="{where}", trace=True, '
                   f"repeats={plan.profile_repeats})")
    try:
        report = attnopt.profile("nanogpt", batch_sizes=[1], seq_lens=[plan.profile_seq_len], phase="prefill",
                                 device=plan.device, out=where, trace=True, repeats=plan.profile_repeats,
                                 progress=False)
        keys = ("variant", "status", "error", "forward_s", "idle_gap_s", "idle_gap_share", "idle_gap_note",
                "peak_bytes", "attention_share", "speedup_vs_eager", "roofline_ratio", "trace", "memory_timeline")
        rec["records"] = [{k: r.get(k) for k in keys} for r in report["records"]]
        rec["summary"] = report.get("summary")
    finally:  # what it wrote, even when it failed part way (report.json is rewritten after every point)
        files = [p for p in sorted(where.rglob("*")) if p.is_file() and p.stat().st_mtime >= start - 1]
        rec["files"] = {str(p.relative_to(out_dir)): p.stat().st_size for p in files}
        gaps = [r for r in rec.get("records", []) if r["idle_gap_s"] is not None]
        rec["line"] = f"{len(files)} files written; idle gaps " + (
            ", ".join(f"{r['variant']} {r['idle_gap_s'] * 1e3:.3f} ms ({r['idle_gap_share']:.1%} of the forward)"
                      for r in gaps) if gaps else "n/a (CPU)")


# ---------------------------------------------------------------------------------------------- running it

def environment(plan: Plan, command: str) -> dict[str, Any]:
    dev = torch.device(plan.device)
    env: dict[str, Any] = {
        "command": command, "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "cuda": torch.version.cuda, "attnopt": attnopt.__version__,
        "python": platform.python_version(), "platform": platform.platform(), "device": plan.device,
        "cpu": cpu_name(), "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
        "candidates": attnopt.candidate_names(),
        "loadavg_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    try:
        env["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                                           cwd=Path(__file__).parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["git_commit"] = None
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        env.update(device_name=torch.cuda.get_device_name(dev), capability=f"{props.major}.{props.minor}",
                   gpu_memory_bytes=props.total_memory, cudnn=torch.backends.cudnn.version(),
                   allow_tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
                   allow_tf32_cudnn=torch.backends.cudnn.allow_tf32)
    else:
        env["device_name"] = env["cpu"]
    return env


def run_section(name: str, fn: Callable[[dict[str, Any], Budget], None], budget_s: float, doc: dict[str, Any], *,
                device: str, hard_s: float | None = None) -> dict[str, Any]:
    """Run ``fn(record, budget)`` as section ``name`` of ``doc``; whatever happens, record it and return.

    ``hard_s`` (default: the budget plus :func:`grace`) is when the alarm stops it.
    """
    rec: dict[str, Any] = {"status": "running", "budget_s": budget_s}
    doc["sections"][name] = rec
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with hard_limit(budget_s + grace(budget_s) if hard_s is None else hard_s, name):
                fn(rec, Budget(budget_s))
            rec["status"] = "partial" if rec.get("skipped_for_budget") else "ok"
        except SectionTimeout as e:
            rec.update(status="timeout", error=str(e))
        except Exception as e:  # noqa: BLE001 - one failing section must not stop the others
            rec.update(status="error", error=error_text(e), traceback=traceback.format_exc(limit=8))
    rec["wall_s"] = time.perf_counter() - start
    seen: dict[str, None] = {}
    for w in caught:
        if issubclass(w.category, (DeprecationWarning, FutureWarning)):
            continue  # torch's own notices, not findings
        seen.setdefault(f"{w.category.__name__}: {str(w.message)[:300]}")
    rec["warnings"] = list(seen)[:20]
    release(device)
    line = rec.get("line") or rec.get("error", "")
    print(f"[{name}] {rec['status']} in {rec['wall_s']:.1f} s (budget {budget_s:.0f} s): {line}", flush=True)
    return rec


def show(v: float | None, unit: str = "", digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}{unit}"


def correctness_table(results: list[dict[str, Any]]) -> str:
    """Cases passed of those run, per candidate and dtype, and for half types the worst accuracy against float64
    relative to the reference in the same dtype (x1.00: as accurate as the computation as written)."""
    ran: Counter = Counter()
    passed: Counter = Counter()
    worst: dict[tuple[str, str], float] = {}
    for r in results:
        key = (r["candidate"], r["dtype"])
        if r["status"] in ("pass", "fail", "raised"):
            ran[key] += 1
            passed[key] += r["status"] == "pass"
        for e in r.get("errors", {}).values() if r["dtype"] != "float32" else ():
            if e.get("ref_max_err_vs_f64"):
                worst[key] = max(worst.get(key, 0.0), e["max_err_vs_f64"] / e["ref_max_err_vs_f64"])
    names = list(dict.fromkeys(r["candidate"] for r in results))
    dtypes = list(dict.fromkeys(r["dtype"] for r in results))
    rows = [[n, *(f"{passed[n, d]}/{ran[n, d]}" + (f", x{worst[n, d]:.2f}" if (n, d) in worst else "")
                  if ran[n, d] else "n/a" for d in dtypes)] for n in names]
    return tabulate(rows, headers=["candidate", *dtypes], tablefmt="github")


def markdown(doc: dict[str, Any]) -> str:
    env, secs = doc["env"], doc["sections"]
    parts = [f"# attnopt GPU check{' (dry run)' if doc['dry_run'] else ''}\n", f"`{env['command']}`\n",
             f"attnopt {env['attnopt']} ({env.get('git_commit') or 'no git'}), torch {env['torch']} (CUDA "
             f"{env['cuda']}), {env['device_name']} ({env['device']}), {env['threads']} threads; "
             f"{doc['wall_s']:.0f} s in all; exit status {doc['exit_status']}.\n",
             tabulate([[n, s["status"], f"{s['wall_s']:.1f}", f"{s['budget_s']:.0f}", s.get("line") or s.get("error")]
                       for n, s in secs.items()], headers=["section", "status", "s", "budget s", ""],
                      tablefmt="github"), ""]
    c = secs.get("correctness", {})
    if c.get("results"):
        parts += [f"## Correctness against reference_attention (cases {', '.join(CASES)}; outputs and dq, dk, dv)\n",
                  "Cases passed of those run. Half types: `xN` is the largest error against float64 divided by the "
                  "reference's own in the same dtype (at most 1: no less accurate than the computation as written; "
                  "above 1 passes only within the dtype's tolerance of the reference).\n",
                  correctness_table(c["results"]), ""]
        odd = [f"- {r['candidate']} {r['dtype']} {r['case']}: {r['status']}: {r.get('why') or r.get('error')}"
               for r in c["results"] if r["status"] in ("fail", "raised")]
        parts += odd + ([""] if odd else [])
    m = secs.get("memory", {})
    if m.get("bytes"):
        def mib(x: int | None) -> str:
            return "-" if not x else f"{x / 2**20:.1f}"

        shape = ", ".join(f"{k}={v}" for k, v in m["shape"].items())
        parts += [f"## Peak memory of one call ({shape}; MiB)\n",
                  tabulate([[n, mib(r.get("forward")), mib(r.get("forward_backward")),
                             r.get("reason") or r.get("forward_error") or r.get("forward_backward_error") or ""]
                            for n, r in m["bytes"].items()], headers=["candidate", "forward", "fwd+bwd", ""],
                           tablefmt="github"), ""]
    s = secs.get("selector", {})
    if s.get("points"):
        rows = []
        for p in s["points"]:
            ms = p.get("ms") or {}
            chose = ", ".join(f"{v}{'?' if p['provisional'][k] else ''}" for k, v in p.get("chosen", {}).items())
            rows.append([p["dtype"], p["B"], p["T"], chose or p.get("error", ""), show(ms.get("eager")),
                         show(ms.get("sdpa")), show(ms.get("attnopt")), show(p.get("attnopt_vs_sdpa"), "x"),
                         show(p.get("attnopt_vs_eager"), "x"), show(p.get("first_call_s"), " s", 1)])
        parts += [f"## Selector on the nanoGPT block (medians of {s['repeats']} alternating runs; the selector's "
                  f"timer: {s['timer']}; `?`: a provisional choice)\n",
                  tabulate(rows, headers=["dtype", "B", "T", "chose", "eager ms", "sdpa ms", "attnopt ms",
                                          "vs sdpa", "vs eager", "first call"], tablefmt="github"), ""]
    p = secs.get("profile", {})
    if p.get("records"):
        rows = [[r["variant"], r["status"], show(r["forward_s"] and r["forward_s"] * 1e3),
                 show(r["idle_gap_s"] and r["idle_gap_s"] * 1e3, "", 3),
                 show(r["idle_gap_share"], "", 3) if r["idle_gap_share"] is not None else r["idle_gap_note"],
                 show(r["peak_bytes"] and r["peak_bytes"] / 2**20, "", 1)] for r in p["records"]]
        parts += [f"## Profiler (`{p['call']}`)\n",
                  tabulate(rows, headers=["variant", "status", "forward ms", "idle gap ms", "idle share", "peak MiB"],
                           tablefmt="github"), ""]
    if p.get("files"):
        parts += ["Files: " + ", ".join(f"`{f}`" for f in p["files"]), ""]
    return "\n".join(parts)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="tiny shapes, CPU unless --device says otherwise (CI)")
    p.add_argument("--device", default=None, help="cuda (the default where CUDA is available), cuda:N or cpu")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results",
                   help="folder for gpu_check.json, gpu_check.md and gpu_check_profile/")
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="which sections to run")
    p.add_argument("--budget", action="append", default=[], metavar="SECTION=SECONDS",
                   help=f"a section's time budget (GPU defaults {GPU_BUDGETS}; dry run {DRY_BUDGETS})")
    p.add_argument("--repeats", type=int, default=None, help="alternating timed rounds per selector point")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="selector points' batch sizes")
    p.add_argument("--seq-lens", type=int, nargs="+", default=None, help="selector points' sequence lengths")
    p.add_argument("--block-dtypes", nargs="+", choices=list(DTYPES), default=None, help="selector block dtypes")
    p.add_argument("--max-scores-gib", type=float, default=None,
                   help="skip eager where its (B, H, T, T) scores would exceed this (default: half the GPU's memory)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.budgets = {}
    for item in args.budget:
        name, eq, seconds = item.partition("=")
        try:
            args.budgets[name] = float(seconds)
        except ValueError:
            eq = ""
        if not eq or name not in SECTIONS or args.budgets[name] <= 0:
            p.error(f"--budget {item!r}: give SECTION=SECONDS (seconds > 0) with SECTION one of {', '.join(SECTIONS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu" if args.dry_run else None)
    if device is None or (device.startswith("cuda") and not torch.cuda.is_available()):
        print(f"gpu_check: {'--device ' + device if device else 'this check'} needs CUDA, but "
              f"torch.cuda.is_available() is False (torch {torch.__version__}, built with CUDA "
              f"{torch.version.cuda}). Run it on a machine with a GPU, or pass --dry-run to check the script on CPU.",
              file=sys.stderr)
        return 2
    plan = make_plan(args, device)
    command = "python " + shlex.join(sys.argv if argv is None else [sys.argv[0], *argv])
    print(f"gpu_check: {command}\n  device {device}, dry run {plan.dry_run}, sections {' '.join(plan.sections)}",
          flush=True)
    cache_dir = tempfile.mkdtemp(prefix="attnopt-gpu-check-")
    saved = os.environ.get("ATTNOPT_CACHE_DIR")
    os.environ["ATTNOPT_CACHE_DIR"] = cache_dir  # a fresh tuning cache: every choice is made in this run
    json_path, md_path = args.out / "gpu_check.json", args.out / "gpu_check.md"
    start = time.perf_counter()
    doc: dict[str, Any] = {"dry_run": plan.dry_run, "exit_status": None, "wall_s": None,
                           "env": environment(plan, command), "plan": plain(asdict(plan)), "sections": {}}
    steps: dict[str, Callable[[dict[str, Any], Budget], None]] = {
        "correctness": lambda rec, b: section_correctness(plan, rec, b),
        "memory": lambda rec, b: section_memory(plan, rec, b),
        "selector": lambda rec, b: section_selector(plan, rec, b),
        "profile": lambda rec, b: section_profile(plan, rec, b, args.out),
    }
    try:
        for name in SECTIONS:
            if name in plan.sections:
                run_section(name, steps[name], plan.budgets[name], doc, device=plan.device)
                doc["wall_s"] = time.perf_counter() - start
                write_atomic(json_path, json.dumps(plain(doc), indent=1, allow_nan=False) + "\n")
    finally:
        if saved is None:
            os.environ.pop("ATTNOPT_CACHE_DIR", None)
        else:
            os.environ["ATTNOPT_CACHE_DIR"] = saved
        shutil.rmtree(cache_dir, ignore_errors=True)
    secs = doc["sections"]
    failed = bool(secs.get("correctness", {}).get("counts", {}).get("fail"))
    broken = [n for n, s in secs.items() if s["status"] in ("error", "timeout")]
    doc["exit_status"] = 1 if failed else 3 if broken else 0
    doc["wall_s"] = time.perf_counter() - start
    write_atomic(json_path, json.dumps(plain(doc), indent=1, allow_nan=False) + "\n")
    write_atomic(md_path, markdown(doc))
    print(f"gpu_check: {doc['wall_s']:.1f} s; wrote {json_path} and {md_path}; exit status {doc['exit_status']}"
          + (" (a correctness check failed)" if failed else f" (sections {', '.join(broken)} broke)" if broken else ""))
    return doc["exit_status"]


if __name__ == "__main__":
    raise SystemExit(main())
