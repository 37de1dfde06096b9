"""Per-call cost at small shapes: nanoGPT block (C=768, H=12), B=1, fp32, CPU, against the hand-written SDPA block.

    python benchmarks/bench_step_overhead.py --rounds 300 --threads 1            # T=64 and the decode shape T=1
    python benchmarks/bench_step_overhead.py --seq-lens 64 --modes forward --variant auto

Times ``attnopt.optimize(block)`` against the same block hand-written with SDPA
(``attnopt.models.SDPACausalSelfAttention``, sharing the very weight tensors) and against that block under
``torch.compile(backend="eager")`` (dynamo's own per-call cost with no rewrite: the floor for any
dynamo-based optimizer), alternating the three in one process: a forward under ``no_grad`` and a
training step (forward + backward). Prints medians and the ratio ``time(SDPA block) / time(attnopt)``
(> 1: attnopt is faster), each the median of the per-round ratios, in wall time and in this thread's CPU
time (which a loaded machine's descheduling does not inflate). At these sizes the attention itself is
cheap, so the ratio shows what a site adds per call. Wall time on a shared machine is noisy, so the
cost is also counted structurally, per forward: Python function calls (``cProfile``, builtins included)
and ATen operators (``torch.profiler``).
``attnopt - dynamo floor`` is what attnopt itself adds (the rewritten graph's extra ops and the site's
dispatch); ``dynamo floor - SDPA`` is dynamo's frame and guard evaluation.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

import attnopt
from attnopt.models import CausalSelfAttention, GPTConfig, SDPACausalSelfAttention
from attnopt.selection.measure import quiet_profiler, time_alternating

VARIANTS = ("attnopt", "sdpa", "dynamo floor")


def build(seq_len: int, variant: str, seed: int = 0) -> dict[str, torch.nn.Module]:
    """The three variants, in eval mode (dropout 0), sharing the very same weight tensors.

    Shared, not copied: at T=1 the block is two GEMVs that stream the weights, so separate copies of equal
    weights (placed apart in memory: other pages, huge or not) made the variants' GEMMs differ by up to 20% in
    alternating runs, more than any per-call cost this benchmark measures."""
    torch.manual_seed(seed)
    cfg = GPTConfig(n_embd=768, n_head=12, block_size=max(256, seq_len), dropout=0.0)
    block = CausalSelfAttention(cfg).eval()
    sdpa = SDPACausalSelfAttention(cfg).eval()
    floor = SDPACausalSelfAttention(cfg).eval()
    for other in (sdpa, floor):
        for layer in ("c_attn", "c_proj"):
            for name in ("weight", "bias"):
                setattr(getattr(other, layer), name, getattr(getattr(block, layer), name))
    return {"attnopt": attnopt.optimize(block, variant=variant), "sdpa": sdpa,
            "dynamo floor": torch.compile(floor, backend="eager")}


def calls(mode: str, x: torch.Tensor) -> Callable[[torch.nn.Module], Callable[[], None]]:
    def make(m: torch.nn.Module) -> Callable[[], None]:
        if mode == "forward":
            def forward() -> None:
                with torch.no_grad():
                    m(x)
            return forward

        def step() -> None:
            with torch.enable_grad():
                m(x).sum().backward()
        return step
    return make


def count(fn: Callable[[], None], n: int = 20) -> dict[str, Any]:
    """Python function calls and ATen operators per call of ``fn``."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    python_calls = sum(v[1] for v in pstats.Stats(prof).stats.values()) / n  # type: ignore[attr-defined]
    quiet_profiler()
    with torch.profiler.profile() as p:
        fn()
    ops = collections.Counter(e.name for e in p.events() if e.name.startswith("aten::"))
    return {"python_calls": round(python_calls), "aten_ops": sum(ops.values()), "ops": dict(ops)}


def thread_times(fns: dict[str, Callable[[], None]], rounds: int, calls_per_round: int) -> dict[str, list[float]]:
    """Seconds of this thread's CPU time per call, ``calls_per_round`` calls per sample, the functions in
    alternation: time the process spends descheduled on a loaded machine does not count."""
    samples: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(rounds):
        for n, f in fns.items():
            start = time.thread_time()
            for _ in range(calls_per_round):
                f()
            samples[n].append((time.thread_time() - start) / calls_per_round)
    return samples


def paired(samples: dict[str, list[float]], num: str, den: str) -> float:
    """Median over rounds of ``num / den`` within each round (drifts between rounds cancel)."""
    return statistics.median(a / b for a, b in zip(samples[num], samples[den]))


def measure(seq_len: int, modes: tuple[str, ...] = ("forward", "step"), rounds: int = 300,
            variant: str = "sdpa", warmup: int = 10) -> list[dict[str, Any]]:
    """One row per mode: median ms per variant (alternating runs, wall and thread CPU time), the ratios
    (medians of per-round ratios) and per-call counts."""
    warnings.simplefilter("ignore")
    models = build(seq_len, variant)
    rows = []
    for mode in modes:
        x = torch.randn(1, seq_len, 768, requires_grad=mode == "step")
        make = calls(mode, x)
        fns = {n: make(m) for n, m in models.items()}
        for f in fns.values():
            f()  # capture
        load = os.getloadavg()[0]
        wall: dict[str, list[float]] = {}
        time_alternating(fns, (), repeats=rounds, warmup=warmup, samples=wall)
        cpu = thread_times(fns, max(10, rounds // 10), 10)
        counts = {n: count(f) for n, f in fns.items()}
        ms = {n: statistics.median(t) * 1e3 for n, t in wall.items()}
        cpu_ms = {n: statistics.median(t) * 1e3 for n, t in cpu.items()}
        rows.append({
            "T": seq_len, "mode": mode, "variant": variant, "rounds": rounds, "ms": ms, "cpu_ms": cpu_ms,
            "attnopt_vs_sdpa": paired(wall, "sdpa", "attnopt"), "floor_vs_sdpa": paired(wall, "sdpa", "dynamo floor"),
            "attnopt_vs_sdpa_cpu": paired(cpu, "sdpa", "attnopt"),
            "floor_vs_sdpa_cpu": paired(cpu, "sdpa", "dynamo floor"),
            "loadavg_1min": [load, os.getloadavg()[0]],
            "python_calls": {n: c["python_calls"] for n, c in counts.items()},
            "aten_ops": {n: c["aten_ops"] for n, c in counts.items()},
            "extra_ops": {op: n - counts["dynamo floor"]["ops"].get(op, 0)
                          for op, n in counts["attnopt"]["ops"].items()
                          if n != counts["dynamo floor"]["ops"].get(op, 0)},
        })
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    from tabulate import tabulate

    table = []
    for r in rows:
        ms, pc, ops = r["ms"], r["python_calls"], r["aten_ops"]
        table.append([r["T"], r["mode"], f"{ms['attnopt']:.3f}", f"{ms['sdpa']:.3f}", f"{ms['dynamo floor']:.3f}",
                      f"{r['attnopt_vs_sdpa']:.3f}x", f"{r['floor_vs_sdpa']:.3f}x",
                      f"{r['attnopt_vs_sdpa_cpu']:.3f}x", f"{r['floor_vs_sdpa_cpu']:.3f}x",
                      f"{pc['attnopt']} / {pc['sdpa']} / {pc['dynamo floor']}",
                      f"{ops['attnopt']} / {ops['sdpa']} / {ops['dynamo floor']}",
                      " ".join(f"{op.removeprefix('aten::')}{n:+d}" for op, n in sorted(r["extra_ops"].items())),
                      f"{r['loadavg_1min'][0]:.1f}-{r['loadavg_1min'][1]:.1f}"])
    return tabulate(table, headers=["T", "mode", "attnopt ms", "SDPA ms", "dynamo floor ms", "attnopt vs SDPA",
                                    "floor vs SDPA", "attnopt vs SDPA (CPU time)", "floor vs SDPA (CPU time)",
                                    "Python calls (attnopt / SDPA / floor)",
                                    "ATen ops (attnopt / SDPA / floor)", "ATen ops attnopt adds to the floor",
                                    "load"], tablefmt="github")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=300, help="timed alternating rounds per mode")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[64, 1], help="T (1: the decode shape)")
    p.add_argument("--modes", nargs="+", default=["forward", "step"], choices=["forward", "step"])
    p.add_argument("--variant", default="sdpa", help="attnopt.optimize's variant")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [r for t in args.seq_lens for r in measure(t, tuple(args.modes), args.rounds, args.variant)]
    print(format_rows(rows))


if __name__ == "__main__":
    main()
