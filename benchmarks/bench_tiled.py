"""Tiled kernel benchmark: forward+backward time and peak memory of tiled64/128/256 vs math and SDPA.

    python benchmarks/bench_tiled.py --threads 1              # T in {1024, 4096}, about 4 minutes
    python benchmarks/bench_tiled.py --seq-lens 1024 --repeats 9

On a CPU shared with other jobs pass ``--threads 1``: with more intra-op threads than free cores, the
tiled kernel's many small ops stall at OpenMP barriers and its times scatter by 10x between rounds.

Inputs: q, k, v of shape (B=1, H=12, T, D=64), fp32, causal (``is_causal=True``, scale ``1/sqrt(D)``),
on CPU (or ``--device cuda``). One step is the forward and the backward to q, k and v with a fixed
upstream gradient (``torch.autograd.grad``). Variants are the registered candidates:

* ``math``      ``reference_attention``: the (B, H, T, T) scores and probabilities written out
* ``sdpa``      ``torch.nn.functional.scaled_dot_product_attention`` (PyTorch picks the backend)
* ``tiledN``    ``attnopt.kernels.tiled.tiled_attention`` with N x N blocks (plain PyTorch ops)

For every T the first step of each variant is untimed: it checks outputs and gradients against
``math`` and counts the block pairs the tiled variants compute. Then ``--repeats`` rounds each run
every variant once, in turn (``attnopt.selection.measure.time_alternating``); the tables show medians and the
ratios ``time(math) / time(variant)`` and ``time(sdpa) / time(variant)`` (above 1: the variant is
faster). Peak memory is the peak live tensor memory of one step (``attnopt.selection.measure.peak_memory``:
profiler allocation records on CPU), the gradients it returns included, q/k/v excluded.
Results go to ``benchmarks/results/tiled.md``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_core import cpu_name, write_atomic
from tabulate import tabulate

import attnopt
from attnopt.kernels.registry import get_candidate
from attnopt.kernels.tiled import count_blocks
from attnopt.selection.measure import peak_memory, time_alternating

VARIANTS = ("math", "sdpa", "tiled64", "tiled128", "tiled256")
MEMORY_TARGET = 0.1  # tiled / math peak memory at the longest T


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096], help="sequence lengths")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds per T (each runs every variant once)")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), help="registered candidate names")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "tiled.md",
                   help="markdown file to write")
    args = p.parse_args(argv)
    if "math" not in args.variants:
        p.error("--variants must include 'math' (the reference every other variant is compared with)")
    return args


def make_step(name: str, grad_out: torch.Tensor, scale: float) -> Callable[..., tuple[torch.Tensor, ...]]:
    """One forward+backward of candidate ``name``; returns (out, dq, dk, dv). Runs with grad on under no_grad."""
    cand = get_candidate(name)

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with torch.enable_grad():
            out = cand(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True, scale=scale, enable_gqa=False)
            return (out.detach(), *torch.autograd.grad(out, (q, k, v), grad_out))

    return step


def run_one_length(T: int, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    shape = (1, args.heads, T, args.head_dim)
    q, k, v = (torch.randn(shape, device=args.device, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(shape, device=args.device)
    steps = {n: make_step(n, grad_out, args.head_dim ** -0.5) for n in args.variants}
    row: dict[str, Any] = {"T": T, "max_abs_diff_vs_math": {}, "blocks": {}}
    ref = None
    for name in ("math", *[n for n in args.variants if n != "math"]):
        start = time.perf_counter()
        with count_blocks() as blocks:
            res = steps[name](q, k, v)
        print(f"  T={T} {name}: first step {time.perf_counter() - start:.1f} s", flush=True)
        if ref is None:
            ref = res
        else:
            row["max_abs_diff_vs_math"][name] = {part: (a - b).abs().max().item()
                                                 for part, a, b in zip(("out", "dq", "dk", "dv"), res, ref)}
        if blocks["forward"]:
            row["blocks"][name] = dict(blocks)
        del res
    del ref
    times = time_alternating(steps, (q, k, v), repeats=args.repeats, warmup=0, progress=f"T={T}")
    row["ms"] = {n: t * 1e3 for n, t in times.items()}
    row["peak_bytes"] = {}
    for name in args.variants:
        row["peak_bytes"][name] = peak_memory(steps[name], q, k, v, warmup=0)
        print(f"  T={T} {name}: peak {row['peak_bytes'][name] / 2**20:.1f} MiB", flush=True)
    return row


def block_total(T: int, name: str) -> int:
    n = int(name.removeprefix("tiled"))
    return (-(-T // n)) ** 2


def markdown(rows: list[dict[str, Any]], env: dict[str, Any], args: argparse.Namespace) -> str:
    time_rows, mem_rows, check_rows = [], [], []
    for r in rows:
        ms, peak = r["ms"], r["peak_bytes"]
        for n in args.variants:
            vs_sdpa = f"{ms['sdpa'] / ms[n]:.2f}x" if "sdpa" in ms else "n/a"
            time_rows.append([r["T"], n, f"{ms[n]:.1f}", f"{ms['math'] / ms[n]:.2f}x", vs_sdpa])
            mem_rows.append([r["T"], n, f"{peak[n] / 2**20:.1f}", f"{peak[n] / peak['math']:.3f}"])
            if n != "math":
                d = r["max_abs_diff_vs_math"][n]
                blocks, counted = r["blocks"].get(n), ""
                if blocks:
                    total = block_total(r["T"], n)
                    counted = f"fwd {blocks['forward']}/{total}, bwd {blocks['backward']}/{total}"
                check_rows.append([r["T"], n, *(f"{d[p]:.1e}" for p in ("out", "dq", "dk", "dv")), counted])
    longest = max(rows, key=lambda r: r["T"])
    target_rows = []
    for n in (x for x in args.variants if x.startswith("tiled")):
        ratio = longest["peak_bytes"][n] / longest["peak_bytes"]["math"]
        target_rows.append([f"{n} / math peak memory at T={longest['T']}", f"{ratio:.3f}", f"<= {MEMORY_TARGET}",
                            "met" if ratio <= MEMORY_TARGET else "MISSED"])
    parts = [
        "# attnopt tiled kernel benchmark\n", f"`{env['command']}`\n",
        f"torch {env['torch']}, attnopt {env['attnopt']}, {env['device']}, {env['threads']} threads, {env['cpu']}. "
        f"B=1, H={args.heads}, D={args.head_dim}, fp32, causal; one step = forward + backward to q, k, v. "
        f"Median of {args.repeats} alternating rounds after one untimed checking step per variant. "
        f"1-min load average {env['load_before']:.2f} before, {env['load_after']:.2f} after, on "
        f"{env['cpu_count']} CPUs (times scatter when it is high; memory figures do not). "
        f"Whole run {env['wall_s']:.0f} s.\n",
        "## Time per forward+backward step\n",
        tabulate(time_rows, headers=["T", "variant", "ms", "vs math", "vs SDPA"], tablefmt="github"),
        "\n`vs X` is time(X) / time(variant): above 1 means the variant is faster.\n",
        "## Peak live tensor memory of one step\n",
        tabulate(mem_rows, headers=["T", "variant", "MiB", "/ math"], tablefmt="github"), "",
        "## Targets\n",
        tabulate(target_rows, headers=["ratio", "measured", "target", ""], tablefmt="github"), "",
        "## Exactness and skipped blocks\n",
        tabulate(check_rows, headers=["T", "variant", "out", "dq", "dk", "dv",
                                      "block pairs computed / all"], tablefmt="github"),
        "\nMax abs difference from `math` of the output and each gradient. Causal masking hides the block "
        "pairs above the diagonal; the tiled kernel never computes them.\n",
    ]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    command = "python " + shlex.join(sys.argv if argv is None else [sys.argv[0], *argv])
    print(f"command: {command}", flush=True)
    load_before, start = os.getloadavg()[0], time.perf_counter()
    rows = [run_one_length(T, args) for T in args.seq_lens]
    env = {"command": command, "torch": torch.__version__, "attnopt": attnopt.__version__, "device": args.device,
           "threads": torch.get_num_threads(), "cpu": cpu_name(), "cpu_count": os.cpu_count(),
           "load_before": load_before, "load_after": os.getloadavg()[0], "wall_s": time.perf_counter() - start}
    md = markdown(rows, env, args)
    print()
    print(md)
    write_atomic(args.out, md)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
