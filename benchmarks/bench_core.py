"""Core benchmark: a nanoGPT causal self-attention block, eager vs torch.compile vs hand-written SDPA vs attnopt.

    python benchmarks/bench_core.py                       # T in {256, 1024}, memory at T=4096
    python benchmarks/bench_core.py --seq-lens 256 512 1024 2048 --repeats 30

Block: ``attnopt.models.CausalSelfAttention(GPTConfig(n_embd=768, n_head=12, block_size=4096,
dropout=0.0))``, B=1, fp32, eval, no_grad, on CPU (or ``--device cuda``). Variants share weights:

* ``eager``    the block as written (materialised (B, H, T, T) scores, tril-buffer mask)
* ``compile``  ``torch.compile(block)`` with the default (Inductor) backend
* ``sdpa``     ``attnopt.models.SDPACausalSelfAttention`` (the same block hand-written with SDPA)
* ``attnopt``  ``attnopt.optimize(block)``

For every T, dynamo's caches are reset and both compiled variants are built afresh, so each is
specialised to that one static shape; compilation happens in the untimed warm-up. Timings are
medians of alternating runs in this one process. Memory is the peak live tensor memory of one
forward at ``--mem-seq-len`` (profiler allocation records on CPU, ``max_memory_allocated`` on CUDA).

A training step (``--train-seq-lens``; forward, ``.sum().backward()`` and the parameters' gradients
set to None, the blocks in training mode with dropout 0, x requiring grad) is timed the same way,
in wall time and in the process's CPU time (all threads: what the step costs the machine, which a
loaded machine's descheduling does not inflate); its ratios are medians of the per-round ratios.
Results go to ``benchmarks/results/core.json`` and ``core.md``.

    python benchmarks/bench_core.py --seq-lens 256 1024 --train-seq-lens 256 1024 2048 4096 --train-repeats 5
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tabulate import tabulate

import attnopt
from attnopt.models import CausalSelfAttention, GPTConfig, SDPACausalSelfAttention
from attnopt.selection.measure import peak_memory, time_alternating

VARIANTS = ("eager", "compile", "sdpa", "attnopt")
MEM_VARIANTS = ("eager", "sdpa", "attnopt")
TARGETS = {"attnopt_vs_sdpa_speed": (">=", 0.95), "attnopt_vs_compile_speed": (">=", 1.4),
           "attnopt_vs_sdpa_memory": ("<=", 1.2)}
#: Training-step targets (issue 15 item 4): against hand-written SDPA at every T, against torch.compile from T=1024.
TRAIN_TARGETS = {"attnopt_vs_sdpa": (0.97, 0), "attnopt_vs_compile": (1.4, 1024)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[256, 1024], help="sequence lengths to time")
    p.add_argument("--mem-seq-len", type=int, default=4096, help="sequence length of the memory measurement")
    p.add_argument("--repeats", type=int, default=20, help="timed rounds per T (each times every variant once)")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds per T (compilation happens here)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target-seq-len", type=int, default=1024, help="T at which the speed targets are checked")
    p.add_argument("--train-seq-lens", type=int, nargs="*", default=[256, 1024],
                   help="sequence lengths of the training-step timing (none: skip it)")
    p.add_argument("--train-repeats", type=int, default=5, help="timed rounds per T of the training step")
    p.add_argument("--train-variants", nargs="+", default=list(VARIANTS), choices=VARIANTS,
                   help="variants of the training-step timing (eager is slow and large at long T)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results",
                   help="directory for core.json and core.md")
    return p.parse_args(argv)


def build_blocks(device: str, seed: int) -> dict[str, torch.nn.Module]:
    """One block per variant, all with the same weights (separate instances, so dynamo caches do not mix)."""
    torch.manual_seed(seed)
    cfg = GPTConfig(n_embd=768, n_head=12, block_size=4096, dropout=0.0)
    eager = CausalSelfAttention(cfg).to(device).eval()
    sdpa = SDPACausalSelfAttention(cfg).to(device).eval()
    sdpa.load_state_dict(eager.state_dict())
    return {"eager": eager, "compile": copy.deepcopy(eager), "sdpa": sdpa, "attnopt": copy.deepcopy(eager)}


def make_fns(blocks: dict[str, torch.nn.Module]) -> dict[str, Callable[..., Any]]:
    """Fresh callables: compiled variants rebuilt so they specialise to the next shape only."""
    torch._dynamo.reset()
    return {"eager": blocks["eager"], "compile": torch.compile(blocks["compile"]), "sdpa": blocks["sdpa"],
            "attnopt": attnopt.optimize(blocks["attnopt"])}


def first_call(fns: dict[str, Callable[..., Any]], x: torch.Tensor) -> tuple[dict[str, Any], dict[str, str]]:
    """Call every variant once (compiling); outputs by name, and the variants that failed with why."""
    outs, failed = {}, {}
    with torch.no_grad():
        for name, fn in fns.items():
            start = time.perf_counter()
            try:
                outs[name] = fn(x)
            except Exception as e:  # noqa: BLE001 - a failing variant is a result, not a crash
                failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                print(f"  {name}: FAILED ({failed[name]})", flush=True)
                continue
            print(f"  {name}: first call {time.perf_counter() - start:.1f} s", flush=True)
    return outs, failed


def ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or den is None or den == 0 else num / den


def fmt(v: float | None, unit: str = "", digits: int = 2) -> str:
    return "failed" if v is None else f"{v:.{digits}f}{unit}"


def train_step(fn: Callable[..., Any], block: torch.nn.Module) -> Callable[[torch.Tensor], None]:
    """One training step of ``fn`` (``block``'s compiled or optimized form): forward, backward, gradients reset."""
    params = list(block.parameters())

    def step(x: torch.Tensor) -> None:
        with torch.enable_grad():
            fn(x).sum().backward()
        for p in params:
            p.grad = None
        x.grad = None

    return step


def cpu_times(fns: dict[str, Callable[..., Any]], x: torch.Tensor, repeats: int) -> dict[str, list[float]]:
    """The process's CPU seconds (every thread) per call, the functions in alternation."""
    samples: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(repeats):
        for n, f in fns.items():
            start = time.process_time()
            f(x)
            samples[n].append(time.process_time() - start)
    return samples


def paired(samples: dict[str, list[float]], num: str, den: str) -> float | None:
    """Median over rounds of ``num / den`` within each round (drifts between rounds cancel)."""
    if num not in samples or den not in samples:
        return None
    return statistics.median(a / b for a, b in zip(samples[num], samples[den]))


def run_training(args: argparse.Namespace, blocks: dict[str, torch.nn.Module]) -> list[dict[str, Any]]:
    rows = []
    for block in blocks.values():
        block.train()  # dropout 0: training mode changes nothing but the mode
    try:
        for T in args.train_seq_lens:
            print(f"T={T}: training step (compiling and checking gradients)", flush=True)
            x = torch.randn(1, T, 768, device=args.device, requires_grad=True)
            fns = make_fns(blocks)
            steps, failed, grads = {}, {}, {}
            for name in args.train_variants:
                step = train_step(fns[name], blocks[name])
                start = time.perf_counter()
                try:
                    with torch.enable_grad():
                        fns[name](x).sum().backward()
                    grads[name] = blocks[name].c_attn.weight.grad.clone()
                    step(x)
                except Exception as e:  # noqa: BLE001 - a failing variant is a result, not a crash
                    failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                    print(f"  {name}: FAILED ({failed[name]})", flush=True)
                    continue
                print(f"  {name}: first steps {time.perf_counter() - start:.1f} s", flush=True)
                steps[name] = step
            load = os.getloadavg()[0]
            wall: dict[str, list[float]] = {}
            time_alternating(steps, (x,), repeats=args.train_repeats, warmup=1, samples=wall,
                             progress=f"train T={T}")
            cpu = cpu_times(steps, x, args.train_repeats)
            ref = grads.get("eager", grads.get("sdpa"))
            rows.append({
                "T": T, "ms": {n: statistics.median(wall[n]) * 1e3 if n in wall else None for n in VARIANTS},
                "cpu_ms": {n: statistics.median(cpu[n]) * 1e3 if n in cpu else None for n in VARIANTS},
                "attnopt_vs_sdpa": paired(wall, "sdpa", "attnopt"),
                "attnopt_vs_compile": paired(wall, "compile", "attnopt"),
                "attnopt_vs_eager": paired(wall, "eager", "attnopt"),
                "attnopt_vs_sdpa_cpu": paired(cpu, "sdpa", "attnopt"),
                "attnopt_vs_compile_cpu": paired(cpu, "compile", "attnopt"),
                "max_abs_grad_diff": {n: (g - ref).abs().max().item() for n, g in grads.items() if ref is not None},
                "loadavg_1min": [load, os.getloadavg()[0]], "failed": failed,
            })
            if "attnopt" in steps:
                rows[-1]["attnopt_fallbacks"] = {r.name: dict(r.extra.get("fallbacks", {}))
                                                 for r in attnopt.explain(fns["attnopt"]).records}
    finally:
        for block in blocks.values():
            block.eval()
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    blocks = build_blocks(args.device, args.seed)
    timing_rows: list[dict[str, Any]] = []
    for T in args.seq_lens:
        print(f"T={T}: compiling and checking outputs", flush=True)
        x = torch.randn(1, T, 768, device=args.device)
        fns = make_fns(blocks)
        outs, failed = first_call(fns, x)
        ok = {n: f for n, f in fns.items() if n not in failed}
        times = time_alternating(ok, (x,), repeats=args.repeats, warmup=args.warmup, progress=f"T={T}")
        ref = outs["eager"]
        diffs = {n: (outs[n] - ref).abs().max().item() for n in outs if n != "eager"}
        timing_rows.append({"T": T, "ms": {n: times[n] * 1e3 if n in times else None for n in VARIANTS},
                            "max_abs_diff_vs_eager": diffs, "failed": failed})
        if "attnopt" not in failed:
            report = attnopt.explain(fns["attnopt"])
            timing_rows[-1]["attnopt_rewritten"] = report.rewritten
            timing_rows[-1]["attnopt_sites"] = len(report.sites)
    print(f"T={args.mem_seq_len}: peak memory of one forward", flush=True)
    x = torch.randn(1, args.mem_seq_len, 768, device=args.device)
    fns = make_fns(blocks)
    memory = {n: peak_memory(fns[n], x) for n in MEM_VARIANTS}
    training = run_training(args, blocks) if args.train_seq_lens else []
    return {"timing": timing_rows, "memory": {"T": args.mem_seq_len, "bytes": memory}, "training": training}


def summarise(res: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for row in res["timing"]:
        ms = row["ms"]
        row["attnopt_vs_sdpa_speed"] = ratio(ms["sdpa"], ms["attnopt"])
        row["attnopt_vs_compile_speed"] = ratio(ms["compile"], ms["attnopt"])
        row["attnopt_vs_eager_speed"] = ratio(ms["eager"], ms["attnopt"])
    mem = res["memory"]["bytes"]
    res["memory"]["attnopt_vs_sdpa_memory"] = ratio(mem["attnopt"], mem["sdpa"])
    at = next((r for r in res["timing"] if r["T"] == args.target_seq_len), None)
    values = {"attnopt_vs_sdpa_memory": res["memory"]["attnopt_vs_sdpa_memory"]}
    if at is not None:
        values["attnopt_vs_sdpa_speed"] = at["attnopt_vs_sdpa_speed"]
        values["attnopt_vs_compile_speed"] = at["attnopt_vs_compile_speed"]
    for key, (op, target) in TARGETS.items():
        v = values.get(key)
        met = None if v is None else (v >= target if op == ">=" else v <= target)
        summary[key] = {"value": v, "target": f"{op} {target}", "met": met}
    for key, (target, from_t) in TRAIN_TARGETS.items():
        for row in res.get("training", []):
            v = row.get(key)
            if row["T"] >= from_t and v is not None:
                summary[f"train_{key}_T{row['T']}"] = {"value": v, "target": f">= {target}", "met": v >= target}
    return summary


def markdown(res: dict[str, Any], summary: dict[str, Any], args: argparse.Namespace) -> str:
    rows = []
    for r in res["timing"]:
        ms, d = r["ms"], r["max_abs_diff_vs_eager"]
        rows.append([r["T"], fmt(ms["eager"]), fmt(ms["compile"]), fmt(ms["sdpa"]), fmt(ms["attnopt"]),
                     fmt(r["attnopt_vs_sdpa_speed"], "x"), fmt(r["attnopt_vs_compile_speed"], "x"),
                     fmt(r["attnopt_vs_eager_speed"], "x"),
                     " ".join(f"{n}={d[n]:.1e}" for n in ("compile", "sdpa", "attnopt") if n in d)])
    timing = tabulate(rows, headers=["T", "eager ms", "compile ms", "SDPA ms", "attnopt ms", "attnopt vs SDPA",
                                     "attnopt vs compile", "attnopt vs eager", "max abs diff vs eager"],
                      tablefmt="github")
    mem = res["memory"]
    mrows = [[mem["T"], n, f"{mem['bytes'][n] / 2**20:.1f}"] for n in MEM_VARIANTS]
    memory = tabulate(mrows, headers=["T", "variant", "peak live tensor MiB"], tablefmt="github")
    train = ""
    if res.get("training"):
        rows = []
        for r in res["training"]:
            ms = r["ms"]
            rows.append([r["T"], *(fmt(ms[n]) if n in args.train_variants else "not run" for n in VARIANTS),
                         fmt(r["attnopt_vs_sdpa"], "x", 3),
                         fmt(r["attnopt_vs_compile"], "x", 3),
                         fmt(r["attnopt_vs_eager"], "x", 2) if "eager" in args.train_variants else "not run",
                         fmt(r["attnopt_vs_sdpa_cpu"], "x", 3), fmt(r["attnopt_vs_compile_cpu"], "x", 3),
                         f"{r['loadavg_1min'][0]:.1f}-{r['loadavg_1min'][1]:.1f}",
                         " ".join(f"{n}={d:.1e}" for n, d in r["max_abs_grad_diff"].items() if d)])
        train = tabulate(rows, headers=["T", *(f"{n} ms" for n in VARIANTS), "attnopt vs SDPA", "attnopt vs compile",
                                        "attnopt vs eager", "vs SDPA (CPU time)", "vs compile (CPU time)", "load",
                                        "max abs diff of c_attn.weight.grad"], tablefmt="github")
    trows = [[k, fmt(v["value"], "x", 3), v["target"], {True: "met", False: "MISSED", None: "n/a"}[v["met"]]]
             for k, v in summary.items()]
    targets = tabulate(trows, headers=["ratio", "measured", "target", ""], tablefmt="github")
    failures = [f"- T={r['T']} {n}: {why}" for r in res["timing"] + res.get("training", [])
                for n, why in r["failed"].items()]
    env = res["env"]
    parts = [f"# attnopt core benchmark\n\n`{env['command']}`\n",
             f"torch {env['torch']}, attnopt {env['attnopt']}, {env['device']}, {env['threads']} threads, "
             f"{env['cpu']}, B=1, fp32, eval, no_grad; median of {args.repeats} alternating runs "
             f"after {args.warmup} warm-up rounds. 1-min load average {env['loadavg_1min']['before']:.2f} "
             f"before, {env['loadavg_1min']['after']:.2f} after, on {env['cpu_count']} CPUs (other processes "
             "share the CPUs when it is high).\n",
             "## Time per forward\n", timing, "", "## Peak memory of one forward\n", memory, ""]
    if train:
        parts += [f"## Time per training step (forward + backward; median of {args.train_repeats} alternating "
                  "runs; ratios: medians of the per-round ratios, > 1 means attnopt is faster)\n", train, ""]
    parts += [f"## Targets (speed at T={args.target_seq_len}, training steps at their T; ratio > 1 means attnopt is "
              "faster)\n", targets, ""]
    if failures:
        parts += ["## Failed variants\n", *failures, ""]
    return "\n".join(parts)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def command_line(argv: list[str] | None) -> str:
    """The command that ran this benchmark, printed first and kept with its results."""
    command = "python " + shlex.join(sys.argv if argv is None else [sys.argv[0], *argv])
    print(f"command: {command}", flush=True)
    return command


def write_results(out: Path, stem: str, res: dict[str, Any], md: str) -> None:
    """Print the markdown and write ``<stem>.json`` and ``<stem>.md`` under ``out``."""
    print()
    print(md)
    write_atomic(out / f"{stem}.json", json.dumps(res, indent=2) + "\n")
    write_atomic(out / f"{stem}.md", md)
    print(f"wrote {out / f'{stem}.json'} and {out / f'{stem}.md'}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = command_line(argv)
    load_before = os.getloadavg()[0]
    res = run(args)
    res["env"] = {"command": command, "torch": torch.__version__, "attnopt": attnopt.__version__,
                  "device": args.device, "threads": torch.get_num_threads(),
                  "cpu": cpu_name(), "python": platform.python_version(),
                  "repeats": args.repeats, "warmup": args.warmup,
                  "cpu_count": os.cpu_count(), "loadavg_1min": {"before": load_before, "after": os.getloadavg()[0]}}
    summary = summarise(res, args)
    res["targets"] = summary
    write_results(args.out, "core", res, markdown(res, summary, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
