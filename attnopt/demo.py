"""``attnopt demo``: optimize the built-in NanoGPT and show, measured, what changed.

    $ python -m attnopt demo --seq-len 1024 --layers 4

Builds :class:`attnopt.models.NanoGPT` in eval mode, runs ``attnopt.optimize`` on it, then
measures in this one process: medians of alternating runs of the model as written and the
optimized model (no_grad), the peak live tensor memory of one forward of each, and the largest
absolute difference of their logits. Prints a table of those numbers and ``attnopt.explain``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from typing import Any

import torch

__all__ = ["add_arguments", "check_options", "main", "run_demo"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``attnopt demo``."""
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (default 1024)")
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per batch (default 1)")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    parser.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    parser.add_argument("--embd", type=int, default=256, help="model width (default 256)")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs of each model (default 10)")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and tokens (default 0)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def check_options(*, seq_len: int, batch_size: int, layers: int, heads: int, embd: int, repeats: int) -> str | None:
    """What is wrong with these demo options, or None."""
    for name, value in (("seq-len", seq_len), ("batch-size", batch_size), ("layers", layers), ("heads", heads),
                        ("embd", embd), ("repeats", repeats)):
        if value < 1:
            return f"--{name} must be >= 1, got {value}"
    if embd % heads:
        return f"--embd ({embd}) must be divisible by --heads ({heads})"
    return None


def run_demo(seq_len: int = 1024, batch_size: int = 1, layers: int = 4, heads: int = 8, embd: int = 256,
             repeats: int = 10, seed: int = 0, progress: bool = True) -> dict[str, Any]:
    """Optimize a NanoGPT, measure it against the model as written, print the results; return them."""
    from tabulate import tabulate

    from .api import explain, optimize
    from .models import GPTConfig, NanoGPT
    from .selection.measure import peak_memory, time_alternating

    problem = check_options(seq_len=seq_len, batch_size=batch_size, layers=layers, heads=heads, embd=embd,
                            repeats=repeats)
    if problem:
        raise ValueError(problem)

    torch.manual_seed(seed)
    config = GPTConfig(block_size=seq_len, n_layer=layers, n_head=heads, n_embd=embd)
    model = NanoGPT(config).eval()
    idx = torch.randint(0, config.vocab_size, (batch_size, seq_len))
    print(f"NanoGPT: {layers} layers, {heads} heads, width {embd}, batch {batch_size} x {seq_len} tokens, "
          f"fp32, CPU, torch threads={torch.get_num_threads()}, torch {torch.__version__}", flush=True)

    opt = optimize(model)
    with torch.no_grad():
        before_out = model(idx)
        after_out = opt(idx)  # captures and rewrites the graph
    max_diff = (before_out - after_out).abs().max().item()
    del before_out, after_out

    times = time_alternating({"as written": model, "attnopt": opt}, (idx,), repeats=repeats, warmup=1,
                             progress="timing" if progress else False)
    mem_before = peak_memory(model, idx)
    mem_after = peak_memory(opt, idx)

    report = explain(opt)
    chosen = Counter(r.rewrite for r in report.records if r.rewritten)
    t0, t1 = times["as written"], times["attnopt"]
    rows = [
        ["attention sites found", len(report.sites)],
        ["rewritten", f"{report.rewritten} ({', '.join(f'{n} x{c}' for n, c in chosen.items()) or 'none'})"],
        ["time per forward, as written", f"{t0 * 1e3:.1f} ms"],
        ["time per forward, attnopt", f"{t1 * 1e3:.1f} ms  ({t0 / t1:.2f}x faster)"],
        ["peak tensor memory, as written", f"{mem_before / 2**20:.1f} MiB"],
        ["peak tensor memory, attnopt", f"{mem_after / 2**20:.1f} MiB  ({mem_before / max(mem_after, 1):.2f}x less)"],
        ["max abs difference of logits", f"{max_diff:.2e}"],
    ]
    print()
    print(tabulate(rows, tablefmt="simple"))
    print(f"\n(times: medians of {repeats} alternating runs, no_grad; memory: peak live tensor bytes of one "
          "forward from torch.profiler allocation records)")
    load, cpus = _load(), os.cpu_count() or 1
    if load is not None and load > 0.5 * cpus:
        hint = ", or OMP_NUM_THREADS=1" if torch.get_num_threads() > 1 else ""
        print(f"note: 1-min load average {load:.1f} on {cpus} CPUs: other processes share the CPUs, so times are "
              f"inflated and noisy (try --repeats 30{hint})")
    print()
    print(report)
    return {"sites": len(report.sites), "rewritten": report.rewritten, "rewrite": dict(chosen),
            "time_s": {"before": t0, "after": t1}, "peak_bytes": {"before": mem_before, "after": mem_after},
            "max_abs_diff": max_diff}


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # not available on this platform
        return None


def main(args: argparse.Namespace) -> int:
    """Entry point of ``attnopt demo`` once its arguments are parsed."""
    problem = check_options(seq_len=args.seq_len, batch_size=args.batch_size, layers=args.layers,
                            heads=args.heads, embd=args.embd, repeats=args.repeats)
    if problem:
        print(f"attnopt demo: error: {problem}", file=sys.stderr)
        return 2
    run_demo(seq_len=args.seq_len, batch_size=args.batch_size, layers=args.layers, heads=args.heads,
             embd=args.embd, repeats=args.repeats, seed=args.seed, progress=not args.no_progress)
    return 0
