"""Generation benchmark: KV-cached ``attnopt.generate`` vs the full-recompute loop, greedy, on a nanoGPT model.

    python benchmarks/bench_generate.py                       # prompt 64, 256 new tokens, 3 timed rounds
    python benchmarks/bench_generate.py --rounds 1 --new 64   # a quick look

Model: ``attnopt.models.NanoGPT(GPTConfig(n_layer=6, n_embd=384, n_head=6, block_size=320, vocab_size=65,
dropout=0.0))`` (nanoGPT's Shakespeare-character config with block_size raised to prompt + new tokens), B=1,
fp32, eval, CPU, random weights. Variants (same model, same prompt):

* ``plain``   ``attnopt.generation.generate_plain``: runs the whole sequence for every new token
* ``cached``  ``attnopt.generate`` with a ``CachedLM`` built once (capture time is reported separately)
* ``compiled`` the same with ``cached(model, compile=True)`` (Inductor; compile time reported separately)

Whole generations are timed in alternation (``attnopt.selection.measure.time_alternating``: plain, cached, plain,
cached, ...) after one untimed warm-up round each, and the medians are compared as ``time(plain) /
time(cached)``. Then one decode step is timed at several positions: the cached step (one token attending to
the cache; median over ``--rounds`` instrumented generations and a window of 9 steps around the position)
and, for contrast, the plain loop's step there (one forward over the whole sequence). Both variants must
produce the same tokens; the report says whether they did. Results go to ``benchmarks/results/generate.md``.

The recorded results use ``--threads 1``: the project's 2-core machine is shared, and with 2 threads under
load OpenMP barriers in the many small ops of a decode step stall (61 ms vs 18 ms per step in one such
measurement). A decode step reads every weight once (about 42 MB here), so it is bound by memory bandwidth
and slows down more than the compute-bound full recompute when other processes share the machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tabulate import tabulate

import attnopt
from attnopt.generation import cached, generate, generate_plain
from attnopt.models import GPTConfig, NanoGPT
from attnopt.selection.measure import time_alternating


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt", type=int, default=64, help="prompt length")
    p.add_argument("--new", type=int, default=256, help="tokens to generate")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (each runs both variants once)")
    p.add_argument("--positions", type=int, nargs="+", default=[80, 128, 192, 256, 316],
                   help="positions at which one decode step is timed")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "generate.md")
    return p.parse_args(argv)


def build(args: argparse.Namespace) -> tuple[NanoGPT, torch.Tensor]:
    torch.manual_seed(args.seed)
    cfg = GPTConfig(n_layer=6, n_embd=384, n_head=6, block_size=args.prompt + args.new, vocab_size=65, dropout=0.0)
    model = NanoGPT(cfg).eval()
    prompt = torch.randint(0, cfg.vocab_size, (1, args.prompt))
    return model, prompt


def cached_step_times(lm: attnopt.generation.CachedLM, prompt: torch.Tensor, new: int) -> list[float]:
    """Seconds of each decode step of one greedy generation, by position of the token fed."""
    times = []
    with torch.no_grad():
        logits = lm.prefill(prompt)
        for _ in range(new - 1):
            nxt = logits[:, -1, :].argmax(-1, keepdim=True)
            start = time.perf_counter()
            logits = lm.step(nxt)
            times.append(time.perf_counter() - start)
    return times


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    model, prompt = build(args)
    start = time.perf_counter()
    lm = cached(model)
    capture_s = time.perf_counter() - start
    start = time.perf_counter()
    lmc = cached(model, compile=True)
    first = generate(lmc, prompt, args.new)  # compiles on the first prefill and step
    compile_s = time.perf_counter() - start
    fns = {"plain": lambda: generate_plain(model, prompt, args.new),
           "cached": lambda: generate(lm, prompt, args.new),
           "compiled": lambda: generate(lmc, prompt, args.new)}
    reference = fns["plain"]()  # also the warm-up round
    same = torch.equal(reference, fns["cached"]()) and torch.equal(reference, first)
    medians = time_alternating(fns, (), repeats=args.rounds, warmup=0, progress="generate")
    steps = [cached_step_times(lm, prompt, args.new) for _ in range(args.rounds)]
    per_step = [statistics.median(s[i] for s in steps) for i in range(len(steps[0]))]
    rows = []
    for pos in args.positions:
        i = pos - args.prompt  # step i feeds the token at position prompt + i
        window = per_step[max(0, i - 4): i + 5]
        seq = torch.randint(0, 65, (1, pos + 1))
        plain = time_alternating({"plain": lambda s=seq: model(s)}, (), repeats=args.rounds, warmup=1)["plain"]
        rows.append({"position": pos, "cached_ms": 1e3 * statistics.median(window), "plain_ms": 1e3 * plain})
    return {"same_tokens": same, "capture_s": capture_s, "compile_s": compile_s, "medians": medians, "steps": rows,
            "bytes_per_token": lm.bytes_per_token, "cache_bytes": lm.cache_bytes, "max_len": lm.max_len,
            "sites": len(lm.sites), "load": (load_before, os.getloadavg()[0])}


def markdown(res: dict[str, Any], args: argparse.Namespace) -> str:
    med = res["medians"]
    total = [["plain (full recompute)", f"{med['plain']:.2f}", f"{1e3 * med['plain'] / args.new:.1f}", "1.00x"],
             ["attnopt.generate (KV cache)", f"{med['cached']:.2f}", f"{1e3 * med['cached'] / args.new:.1f}",
              f"{med['plain'] / med['cached']:.1f}x"],
             ["attnopt.generate incl. capture", f"{med['cached'] + res['capture_s']:.2f}", "",
              f"{med['plain'] / (med['cached'] + res['capture_s']):.1f}x"],
             ["attnopt.generate, compile=True", f"{med['compiled']:.2f}", f"{1e3 * med['compiled'] / args.new:.1f}",
              f"{med['plain'] / med['compiled']:.1f}x"],
             ["compile=True incl. capture and compilation", f"{med['compiled'] + res['compile_s']:.2f}", "",
              f"{med['plain'] / (med['compiled'] + res['compile_s']):.1f}x"]]
    steps = [[r["position"], f"{r['cached_ms']:.2f}", f"{r['plain_ms']:.1f}", f"{r['plain_ms'] / r['cached_ms']:.0f}x"]
             for r in res["steps"]]
    first, last = res["steps"][0]["cached_ms"], res["steps"][-1]["cached_ms"]
    mem = [["K/V cache per position (one sequence)", f"{res['bytes_per_token']} B"],
           ["cache allocated (batch 1, max_len {})".format(res["max_len"]), f"{res['cache_bytes'] / 2**20:.2f} MiB"]]
    env = (f"torch {torch.__version__}, attnopt {attnopt.__version__}, cpu, {torch.get_num_threads()} threads, "
           f"{platform.processor() or platform.machine()}, B=1, fp32, eval, greedy; prompt {args.prompt}, "
           f"{args.new} new tokens; median of {args.rounds} alternating rounds. 1-min load average "
           f"{res['load'][0]:.2f} before, {res['load'][1]:.2f} after, on {os.cpu_count()} CPUs.")
    return "\n\n".join([
        "# Generation: KV cache vs full recompute",
        f"`{shlex.join(['python', 'benchmarks/bench_generate.py', *sys.argv[1:]])}`",
        env,
        "nanoGPT (6 layers, C=384, H=6, vocab 65, block_size {}), {} attention sites cached. "
        "Same tokens from all: **{}**. Capture and proof (`attnopt.generation.cached`): {:.1f} s, once per model; "
        "with `compile=True`, capture plus Inductor compilation (first generation included): {:.1f} s."
        .format(args.prompt + args.new, res["sites"], "yes" if res["same_tokens"] else "NO", res["capture_s"],
                res["compile_s"]),
        "#### Whole generation\n\n" + tabulate(total, headers=["variant", "seconds", "ms per token",
                                                                "speed-up vs plain"], tablefmt="github"),
        "#### One decode step by position\n\n" + tabulate(
            steps, headers=["position", "cached step ms", "plain step ms", "plain / cached"], tablefmt="github")
        + f"\n\nCached step at position {res['steps'][-1]['position']} / at {res['steps'][0]['position']}: "
          f"{last / first:.2f}x.",
        "#### Cache memory\n\n" + tabulate(mem, headers=["", ""], tablefmt="github"),
    ]) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    res = run(args)
    text = markdown(res, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, args.out)
    print(text)


if __name__ == "__main__":
    main()
