"""attnopt with ``compile=True`` against ``torch.compile`` of the hand-written SDPA block (issue 15, item 5).

    python benchmarks/bench_compiled.py                                  # T in {256, 1024}, eval and training
    python benchmarks/bench_compiled.py --seq-lens 256 1024 2048 --train-seq-lens 256 1024 2048 --repeats 20

The block is nanoGPT's causal self-attention (C=768, H=12, B=1, fp32; ``attnopt.models``). Variants, same
weights, built afresh for every T (so each compiles for that one static shape, in the untimed warm-up):

* ``sdpa_compile``     ``torch.compile(SDPACausalSelfAttention)``: the hand-written SDPA block through Inductor
* ``attnopt_compile``  ``attnopt.optimize(CausalSelfAttention, compile=True)``: the block as written, its
  attention rewritten, then Inductor
* ``compile``          ``torch.compile(CausalSelfAttention)``: the block as written through Inductor (for scale)

Inference runs under ``no_grad`` in eval mode; a training step is forward, ``.sum().backward()`` and the
gradients reset, in training mode (dropout 0). Times are medians of alternating runs in this one process; the
ratios are medians of per-round ratios, in wall time and in the process's CPU time (all threads). A ratio > 1
means attnopt is faster. Results go to ``benchmarks/results/compiled.json`` and ``compiled.md``.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
from pathlib import Path
from typing import Any

import torch
from bench_core import command_line, cpu_name, cpu_times, paired, train_step, write_results
from tabulate import tabulate

import attnopt
from attnopt.models import CausalSelfAttention, GPTConfig, SDPACausalSelfAttention
from attnopt.selection.measure import time_alternating

VARIANTS = ("sdpa_compile", "attnopt_compile", "compile")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-lens", type=int, nargs="*", default=[256, 1024], help="T of the inference timing")
    p.add_argument("--train-seq-lens", type=int, nargs="*", default=[256, 1024], help="T of the training step")
    p.add_argument("--repeats", type=int, default=15, help="timed alternating rounds per T (inference)")
    p.add_argument("--train-repeats", type=int, default=5, help="timed alternating rounds per T (training)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    return p.parse_args(argv)


def blocks(seed: int) -> dict[str, torch.nn.Module]:
    torch.manual_seed(seed)
    cfg = GPTConfig(n_embd=768, n_head=12, block_size=4096, dropout=0.0)
    written = CausalSelfAttention(cfg)
    sdpa = SDPACausalSelfAttention(cfg)
    sdpa.load_state_dict(written.state_dict())
    return {"sdpa_compile": sdpa, "attnopt_compile": copy.deepcopy(written), "compile": written}


def compiled(mods: dict[str, torch.nn.Module]) -> dict[str, Any]:
    torch._dynamo.reset()
    return {"sdpa_compile": torch.compile(mods["sdpa_compile"]),
            "attnopt_compile": attnopt.optimize(mods["attnopt_compile"], variant="sdpa", compile=True),
            "compile": torch.compile(mods["compile"])}


def _row(T: int, wall: dict[str, list[float]], cpu: dict[str, list[float]], diffs: dict[str, float],
         fns: dict[str, Any], load: tuple[float, float]) -> dict[str, Any]:
    report = attnopt.explain(fns["attnopt_compile"])
    return {"T": T, "ms": {n: statistics.median(wall[n]) * 1e3 for n in wall},
            "cpu_ms": {n: statistics.median(cpu[n]) * 1e3 for n in cpu},
            "attnopt_vs_sdpa_compile": paired(wall, "sdpa_compile", "attnopt_compile"),
            "attnopt_vs_sdpa_compile_cpu": paired(cpu, "sdpa_compile", "attnopt_compile"),
            "attnopt_vs_compile": paired(wall, "compile", "attnopt_compile"),
            "max_abs_diff_vs_sdpa": diffs, "rewritten": f"{report.rewritten} of {len(report.sites)}",
            "failures": list(report.failures), "loadavg_1min": list(load)}


def inference(args: argparse.Namespace, mods: dict[str, torch.nn.Module]) -> list[dict[str, Any]]:
    rows = []
    for m in mods.values():
        m.eval()
    for T in args.seq_lens:
        print(f"T={T}: inference (compiling)", flush=True)
        x = torch.randn(1, T, 768)
        fns = compiled(mods)
        with torch.no_grad():
            outs = {n: f(x) for n, f in fns.items()}
            diffs = {n: (o - outs["sdpa_compile"]).abs().max().item() for n, o in outs.items()}
            load0 = os.getloadavg()[0]
            wall: dict[str, list[float]] = {}
            time_alternating(fns, (x,), repeats=args.repeats, warmup=2, samples=wall, progress=f"eval T={T}")
            cpu = cpu_times(fns, x, args.repeats)
        rows.append(_row(T, wall, cpu, diffs, fns, (load0, os.getloadavg()[0])))
    return rows


def training(args: argparse.Namespace, mods: dict[str, torch.nn.Module]) -> list[dict[str, Any]]:
    rows = []
    for m in mods.values():
        m.train()
    try:
        for T in args.train_seq_lens:
            print(f"T={T}: training step (compiling)", flush=True)
            x = torch.randn(1, T, 768, requires_grad=True)
            fns = compiled(mods)
            grads = {}
            for n, f in fns.items():
                with torch.enable_grad():
                    f(x).sum().backward()
                grads[n] = mods[n].c_attn.weight.grad.clone()
                train_step(f, mods[n])(x)
            diffs = {n: (g - grads["sdpa_compile"]).abs().max().item() for n, g in grads.items()}
            steps = {n: train_step(f, mods[n]) for n, f in fns.items()}
            load0 = os.getloadavg()[0]
            wall: dict[str, list[float]] = {}
            time_alternating(steps, (x,), repeats=args.train_repeats, warmup=1, samples=wall, progress=f"train T={T}")
            cpu = cpu_times(steps, x, args.train_repeats)
            rows.append(_row(T, wall, cpu, diffs, fns, (load0, os.getloadavg()[0])))
    finally:
        for m in mods.values():
            m.eval()
    return rows


def markdown(res: dict[str, Any]) -> str:
    env = res["env"]
    parts = [f"# attnopt with compile=True vs torch.compile of the hand-written SDPA block\n\n`{env['command']}`\n",
             f"torch {env['torch']}, attnopt {env['attnopt']}, {env['threads']} threads, {env['cpu']}; nanoGPT's "
             "causal self-attention block (C=768, H=12), B=1, fp32. Medians of alternating runs in one process; "
             "ratios are medians of per-round ratios (> 1: attnopt is faster).\n"]
    for title, key in (("Inference (eval, no_grad)", "inference"), ("Training step (forward + backward)", "training")):
        rows = [[r["T"], *(f"{r['ms'].get(n, float('nan')):.2f}" for n in VARIANTS),
                 f"{r['attnopt_vs_sdpa_compile']:.3f}x", f"{r['attnopt_vs_sdpa_compile_cpu']:.3f}x",
                 f"{r['attnopt_vs_compile']:.2f}x", r["rewritten"],
                 f"{max(r['max_abs_diff_vs_sdpa'].values()):.1e}",
                 f"{r['loadavg_1min'][0]:.1f}-{r['loadavg_1min'][1]:.1f}"] for r in res[key]]
        if rows:
            parts += [f"## {title}\n", tabulate(rows, headers=["T", *(f"{n} ms" for n in VARIANTS),
                                                              "attnopt vs SDPA compiled", "(CPU time)",
                                                              "attnopt vs compile", "sites rewritten",
                                                              "max abs diff", "load"], tablefmt="github"), ""]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    command = command_line(argv)
    mods = blocks(args.seed)
    res: dict[str, Any] = {"inference": inference(args, mods), "training": training(args, mods)}
    res["env"] = {"command": command, "torch": torch.__version__, "attnopt": attnopt.__version__,
                  "threads": torch.get_num_threads(), "cpu": cpu_name(), "cpu_count": os.cpu_count()}
    write_results(args.out, "compiled", res, markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
