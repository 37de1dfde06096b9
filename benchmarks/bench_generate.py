"""Generation benchmark: KV-cached ``attnopt.generate`` vs the full-recompute loop, greedy; a ragged batch vs HF.

    python benchmarks/bench_generate.py --threads 1 2         # prompt 64, 256 new tokens, 3 timed rounds
    python benchmarks/bench_generate.py --rounds 1 --new 64   # a quick look
    python benchmarks/bench_generate.py --skip-ragged --compiled

**Single sequence.** Model: ``attnopt.models.NanoGPT(GPTConfig(n_layer=6, n_embd=384, n_head=6, block_size=320,
vocab_size=65, dropout=0.0))`` (nanoGPT's Shakespeare-character config with block_size raised to prompt + new
tokens), B=1, fp32, eval, CPU, random weights. Variants (same model, same prompt):

* ``plain``     ``attnopt.generation.generate_plain``: runs the whole sequence for every new token
* ``generate``  ``attnopt.generate(model, ...)``, the plain call on the module: the first call captures and
  proves the model (timed alone, reported separately); later calls reuse that capture. This is the figure the
  issue's target is about
* ``cached``    ``attnopt.generate(lm, ...)`` with a ``CachedLM`` built by ``attnopt.generation.cached(model)``
* ``compiled``  (``--compiled``) the same with ``cached(model, compile=True)`` (Inductor; compile time apart)

Whole generations are timed in alternation (``attnopt.selection.measure.time_alternating``: plain, generate,
cached, plain, ...) after one untimed warm-up round each, and the medians are compared as ``time(plain) /
time(variant)``. Then one decode step is timed at several positions: the cached step (one token attending to
the cache; median over ``--rounds`` instrumented generations and a window of 9 steps around the position)
and, for contrast, the plain loop's step there (one forward over the whole sequence). The step is also given
as a multiple of one pass over the weights (``weight_read_s``: one row times every weight matrix, by the faster
of ``F.linear`` and oneDNN, the two kernels the cached model chooses between; a ``sum`` over the same weights is
reported beside it as the memory's own speed), with the cached model's kernel decisions
(``attnopt.runtime.linear``).

**Ragged batch.** ``--batch`` (8) prompts of different lengths (evenly from ``--ragged-min`` to the prompt
length) generate ``--ragged-new`` tokens each on a Hugging Face ``GPT2LMHeadModel`` of the same size (6 layers,
C=384, H=6, vocab 65, eager attention, random weights), timed in alternation: ``attnopt.generate(model, prompts,
n)`` (the batch at once, second call), the same prompts one by one through ``attnopt.generate``, HF's
``model.generate(ids, attention_mask=..., max_new_tokens=n)`` (left-padded, its own KV cache), and the plain
loop (every row recomputed alone for every token). Throughput is new tokens per second over the batch.

Every variant must produce the same tokens; the report says whether they did. Results go to
``benchmarks/results/generate.md``.

The project's 2-core machine is shared: the report gives the load average before and after. With 2 threads
under load, OpenMP barriers in the many small ops of a decode step stall; a decode step reads every weight
once (about 42 MB here), so it is bound by memory bandwidth and slows down more than the compute-bound full
recompute when other processes share the machine.
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
from attnopt.generation import cached, generate, generate_plain, left_pad
from attnopt.models import GPTConfig, NanoGPT
from attnopt.runtime.linear import decisions as linear_decisions
from attnopt.runtime.linear import onednn_linear
from attnopt.selection.measure import time_alternating

VOCAB = 65


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt", type=int, default=64, help="prompt length (the longest prompt of the ragged batch)")
    p.add_argument("--new", type=int, default=256, help="tokens to generate")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (each runs every variant once)")
    p.add_argument("--positions", type=int, nargs="+", default=[80, 128, 192, 256, 316],
                   help="positions at which one decode step is timed")
    p.add_argument("--threads", type=int, nargs="+", default=None,
                   help="torch.set_num_threads for each run of the single sequence (default: torch's choice); the "
                        "ragged batch runs at the first")
    p.add_argument("--compiled", action="store_true", help="also time cached(model, compile=True)")
    p.add_argument("--batch", type=int, default=8, help="prompts in the ragged batch")
    p.add_argument("--ragged-min", type=int, default=8, help="the shortest prompt of the ragged batch")
    p.add_argument("--ragged-new", type=int, default=64, help="tokens each prompt of the ragged batch generates")
    p.add_argument("--skip-single", action="store_true", help="only the ragged batch")
    p.add_argument("--skip-ragged", action="store_true", help="only the single sequence")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "generate.md")
    return p.parse_args(argv)


def build(args: argparse.Namespace) -> tuple[NanoGPT, torch.Tensor]:
    torch.manual_seed(args.seed)
    cfg = GPTConfig(n_layer=6, n_embd=384, n_head=6, block_size=args.prompt + args.new, vocab_size=VOCAB, dropout=0.0)
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


def weight_read_s(model: torch.nn.Module, repeats: int) -> dict[str, float]:
    """Seconds of one pass that reads every weight matrix a decode step multiplies by once, each tensor once even
    when tied: with a one-row ``F.linear`` per matrix, with oneDNN's inner product (the other kernel the cached
    step may take, ``attnopt.runtime.linear``), and as a plain ``sum`` of each matrix (the memory's own speed,
    no product). The floor of a step bound by memory is the faster GEMV pass (``floor``)."""
    mats = list({id(m.weight): m.weight for m in model.modules()
                 if isinstance(m, torch.nn.Linear)}.values())
    rows = {w.shape[1]: torch.randn(1, w.shape[1], dtype=w.dtype) for w in mats}
    fns = {"F.linear": lambda: [torch.nn.functional.linear(rows[w.shape[1]], w) for w in mats],
           "sum": lambda: [w.sum() for w in mats]}
    op = onednn_linear()
    if op is not None:
        fns["onednn"] = lambda: [op(rows[w.shape[1]], w, None, "none", [], "") for w in mats]
    with torch.no_grad():
        times = time_alternating(fns, (), repeats=repeats, warmup=3)
    times["floor"] = min(t for name, t in times.items() if name != "sum")
    return times


def single(args: argparse.Namespace) -> dict[str, Any]:
    model, prompt = build(args)
    start = time.perf_counter()
    first = generate(model, prompt, args.new)  # captures and proves, then generates
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    lm = cached(model)
    capture_s = time.perf_counter() - start
    fns = {"plain": lambda: generate_plain(model, prompt, args.new),
           "generate": lambda: generate(model, prompt, args.new),
           "cached": lambda: generate(lm, prompt, args.new)}
    compile_s = None
    if args.compiled:
        start = time.perf_counter()
        lmc = cached(model, compile=True)
        compiled_first = generate(lmc, prompt, args.new)  # compiles on the first prefill and step
        compile_s = time.perf_counter() - start
        fns["compiled"] = lambda: generate(lmc, prompt, args.new)
    reference = fns["plain"]()  # also the warm-up round
    same = all(torch.equal(reference, fn()) for name, fn in fns.items() if name != "plain") \
        and torch.equal(reference, first) and (not args.compiled or torch.equal(reference, compiled_first))
    medians = time_alternating(fns, (), repeats=args.rounds, warmup=0, progress="generate")
    steps, steps_c = [], []
    for _ in range(args.rounds):  # eager and (with --compiled) compiled generations, alternating
        steps.append(cached_step_times(lm, prompt, args.new))
        if args.compiled:
            steps_c.append(cached_step_times(lmc, prompt, args.new))
    per_step = [statistics.median(s[i] for s in steps) for i in range(len(steps[0]))]
    per_step_c = [statistics.median(s[i] for s in steps_c) for i in range(len(steps_c[0]))] if steps_c else None
    rows = []
    for pos in args.positions:
        i = pos - args.prompt  # step i feeds the token at position prompt + i
        if not 0 <= i < len(per_step):
            continue
        window = per_step[max(0, i - 4): i + 5]
        seq = torch.randint(0, VOCAB, (1, pos + 1))
        plain = time_alternating({"plain": lambda s=seq: model(s)}, (), repeats=args.rounds, warmup=1)["plain"]
        row = {"position": pos, "cached_ms": 1e3 * statistics.median(window), "plain_ms": 1e3 * plain}
        if per_step_c is not None:
            row["compiled_ms"] = 1e3 * statistics.median(per_step_c[max(0, i - 4): i + 5])
        rows.append(row)
    lm.prefill(prompt)
    weights = weight_read_s(model, max(20, 4 * args.rounds))
    one = prompt[:, :1]
    with torch.no_grad():  # the model's own forward on one token, no history: the per-op floor of any step
        one_token = time_alternating({"one": lambda: model(one)}, (), repeats=max(20, 4 * args.rounds),
                                     warmup=3)["one"]
    return {"weight_read_ms": 1e3 * weights["floor"], "weight_passes_ms": {k: 1e3 * v for k, v in weights.items()},
            "one_token_ms": 1e3 * one_token, "same_tokens": same,
            "first_s": first_s, "capture_s": capture_s,
            "compile_s": compile_s, "medians": medians, "steps": rows, "bytes_per_token": lm.bytes_per_token,
            "cache_bytes": lm.cache_bytes, "max_len": lm.max_len, "sites": len(lm.sites),
            "linear": [d for g in lm.linear_groups for d in linear_decisions(g)]}


def hf_gpt2(args: argparse.Namespace) -> Any:
    import transformers

    torch.manual_seed(args.seed)
    cfg = transformers.GPT2Config(n_layer=6, n_embd=384, n_head=6, vocab_size=VOCAB,
                                  n_positions=args.prompt + args.ragged_new, bos_token_id=0, eos_token_id=0,
                                  pad_token_id=0, attn_implementation="eager")
    return transformers.GPT2LMHeadModel(cfg).eval()


def ragged(args: argparse.Namespace) -> dict[str, Any]:
    model = hf_gpt2(args)
    n, b = args.ragged_new, args.batch
    lengths = [round(args.ragged_min + (args.prompt - args.ragged_min) * i / max(1, b - 1)) for i in range(b)]
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(1, VOCAB, (t,), generator=g) for t in lengths]
    ids, mask = left_pad(prompts)
    start = time.perf_counter()
    batched = generate(model, prompts, n)  # the first call: capture and proof
    first_s = time.perf_counter() - start

    def hf() -> torch.Tensor:
        return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0,
                              eos_token_id=None)

    fns = {"plain": lambda: generate_plain(model, prompts, n),
           "batched": lambda: generate(model, prompts, n),
           "one_by_one": lambda: [generate(model, p[None], n)[0] for p in prompts],
           "hf": hf}
    out = {name: fn() for name, fn in fns.items()}  # also the warm-up round
    rows = [torch.cat((ids[i, :ids.size(1) - len(p)], r)) for i, (p, r) in enumerate(zip(prompts,
                                                                                          out["one_by_one"]))]
    same = {"batch vs one by one": all(torch.equal(x, y) for x, y in zip(batched, out["one_by_one"])),
            "batch vs plain loop": all(torch.equal(x, y) for x, y in zip(out["batched"], out["plain"])),
            "HF generate vs one by one": torch.equal(out["hf"], torch.stack(rows))}
    medians = time_alternating(fns, (), repeats=args.rounds, warmup=0, progress="ragged")
    return {"lengths": lengths, "first_s": first_s, "medians": medians, "same": same, "new": n,
            "threads": torch.get_num_threads()}


def markdown(res: dict[str, Any], args: argparse.Namespace) -> str:
    env = (f"torch {torch.__version__}, attnopt {attnopt.__version__}, cpu, "
           f"{platform.processor() or platform.machine()}, fp32, eval, greedy; median of {args.rounds} alternating "
           f"rounds. 1-min load average {res['load'][0]:.2f} before, {res['load'][1]:.2f} after, on "
           f"{os.cpu_count()} CPUs (a shared machine: other processes ran during the measurement).")
    parts = ["# Generation: KV cache vs full recompute",
             f"`{shlex.join(['python', 'benchmarks/bench_generate.py', *sys.argv[1:]])}`", env]
    for threads, single_res in res.get("single", []):
        parts += _single_md(single_res, args, threads)
    if "ragged" in res:
        parts += _ragged_md(res["ragged"], args)
    return "\n\n".join(parts) + "\n"


def _single_md(res: dict[str, Any], args: argparse.Namespace, threads: int) -> list[str]:
    med = res["medians"]
    total = [["plain (full recompute)", f"{med['plain']:.2f}", f"{1e3 * med['plain'] / args.new:.1f}", "1.00x"],
             ["attnopt.generate(model, ...), first call (capture + proof + generation)", f"{res['first_s']:.2f}", "",
              f"{med['plain'] / res['first_s']:.1f}x"],
             ["**attnopt.generate(model, ...), later calls**", f"{med['generate']:.2f}",
              f"{1e3 * med['generate'] / args.new:.1f}", f"**{med['plain'] / med['generate']:.1f}x**"],
             ["attnopt.generate(lm, ...) with lm = cached(model)", f"{med['cached']:.2f}",
              f"{1e3 * med['cached'] / args.new:.1f}", f"{med['plain'] / med['cached']:.1f}x"]]
    if "compiled" in med:
        total += [["attnopt.generate(lm, ...), compile=True", f"{med['compiled']:.2f}",
                   f"{1e3 * med['compiled'] / args.new:.1f}", f"{med['plain'] / med['compiled']:.1f}x"],
                  ["compile=True incl. capture and compilation", f"{med['compiled'] + res['compile_s']:.2f}", "",
                   f"{med['plain'] / (med['compiled'] + res['compile_s']):.1f}x"]]
    compiled = bool(res["steps"]) and "compiled_ms" in res["steps"][0]
    steps = [[r["position"], f"{r['cached_ms']:.2f}", *([f"{r['compiled_ms']:.2f}"] if compiled else []),
              f"{r['plain_ms']:.1f}", f"{r['plain_ms'] / r['cached_ms']:.0f}x"] for r in res["steps"]]
    mem = [["K/V cache per position (one sequence)", f"{res['bytes_per_token']} B"],
           ["cache allocated (batch 1, max_len {})".format(res["max_len"]), f"{res['cache_bytes'] / 2**20:.2f} MiB"]]
    out = [
        f"## One sequence: nanoGPT, {threads} thread(s)",
        "nanoGPT (6 layers, C=384, H=6, vocab 65, block_size {}), B=1, prompt {}, {} new tokens, {} attention sites "
        "cached. Same tokens from all: **{}**. Capture and proof (`attnopt.generation.cached`): {:.1f} s, once per "
        "model (the first `generate(model, ...)` call pays it; later calls reuse it).".format(
            args.prompt + args.new, args.prompt, args.new, res["sites"], "yes" if res["same_tokens"] else "NO",
            res["capture_s"]),
        "#### Whole generation\n\n" + tabulate(total, headers=["variant", "seconds", "ms per token",
                                                                "speed-up vs plain"], tablefmt="github"),
    ]
    if steps:
        first, last = res["steps"][0]["cached_ms"], res["steps"][-1]["cached_ms"]
        out.append("#### One decode step by position\n\n" + tabulate(
            steps, headers=["position", "cached step ms", *(["compile=True step ms"] if compiled else []),
                            "plain step ms", "plain / cached"], tablefmt="github")
            + f"\n\nCached step at position {res['steps'][-1]['position']} / at {res['steps'][0]['position']}: "
              f"{last / first:.2f}x.")
    if steps and res.get("weight_read_ms"):
        mid = statistics.median(r["cached_ms"] for r in res["steps"])
        passes = res.get("weight_passes_ms", {})
        how = ", ".join(f"{k} {v:.2f} ms" for k, v in passes.items() if k != "floor")
        out.append(f"Reading every weight matrix once (one row times each matrix, by the faster of `F.linear` and "
                   f"oneDNN: {res['weight_read_ms']:.2f} ms; passes: {how}) is the floor of a decode step bound by "
                   f"memory (`sum` reads the weights without a product: the memory's own speed): the cached "
                   f"step (median over the positions above, {mid:.2f} ms) is "
                   f"**{mid / res['weight_read_ms']:.2f}x** it (target <= 1.5x)" + (
                       "; with `compile=True` the step is **{:.2f}x** it.".format(
                           statistics.median(r["compiled_ms"] for r in res["steps"]) / res["weight_read_ms"])
                       if compiled else ".") + (
                       " The model's own forward on one token, without any cache or history, takes "
                       f"{res['one_token_ms']:.2f} ms ({res['one_token_ms'] / res['weight_read_ms']:.2f}x the weight "
                       f"read): the cached step is {mid / res['one_token_ms']:.2f}x that."
                       if res.get("one_token_ms") else ""))
    if res.get("linear"):
        out.append("#### Linear layers of the cached model (`attnopt.runtime.linear`: one pass over the weights timed "
                   "with each kernel)\n\n" + tabulate(
                       [[d["group"], d["rows"], d["threads"], d["kernel"], d.get("onednn / as written", "-"),
                         d["reason"]] for d in res["linear"]],
                       headers=["graph", "rows", "threads", "kernel", "onednn / as written", "why"], tablefmt="github"))
    out.append("#### Cache memory\n\n" + tabulate(mem, headers=["", ""], tablefmt="github"))
    return out


def _ragged_md(res: dict[str, Any], args: argparse.Namespace) -> list[str]:
    med, total = res["medians"], args.batch * res["new"]
    names = [("plain", "plain loop (each row recomputed alone per token)"),
             ("hf", "HF `model.generate(ids, attention_mask=...)` (its KV cache)"),
             ("one_by_one", f"attnopt.generate, the {args.batch} prompts one by one"),
             ("batched", "**attnopt.generate(model, prompts, n), the batch at once**")]
    rows = [[label, f"{med[k]:.2f}", f"{total / med[k]:.0f}", f"{med['plain'] / med[k]:.1f}x",
             f"{med['hf'] / med[k]:.2f}x"] for k, label in names]
    same = ", ".join(f"{k}: **{'yes' if v else 'NO'}**" for k, v in res["same"].items())
    return [
        f"## A ragged batch: HF GPT-2, {res['threads']} thread(s)",
        f"Hugging Face `GPT2LMHeadModel` (6 layers, C=384, H=6, vocab 65, eager attention, random weights), "
        f"{args.batch} prompts of {', '.join(map(str, res['lengths']))} tokens, {res['new']} new tokens each "
        f"({total} in all). Same tokens: {same}. The first `attnopt.generate(model, prompts, n)` call (capture, "
        f"proof and generation): {res['first_s']:.1f} s.",
        tabulate(rows, headers=["variant", "seconds", "new tokens / s", "speed-up vs plain", "speed-up vs HF"],
                 tablefmt="github"),
    ]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    res: dict[str, Any] = {"single": []}
    load_before = os.getloadavg()[0]
    for threads in args.threads or [torch.get_num_threads()]:
        torch.set_num_threads(threads)
        if not args.skip_single:
            res["single"].append((threads, single(args)))
    torch.set_num_threads((args.threads or [torch.get_num_threads()])[0])
    if not args.skip_ragged:
        res["ragged"] = ragged(args)
    res["load"] = (load_before, os.getloadavg()[0])
    text = markdown(res, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, args.out)
    print(text)


if __name__ == "__main__":
    main()
