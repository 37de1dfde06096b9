"""Coverage benchmark: sliding windows, soft-capped windows and Hugging Face LLaMA/Mistral/Gemma-2, eager vs attnopt.

    python benchmarks/bench_coverage.py --threads 1                  # T in {1024, 2048, 4096}, HF at T=1024
    python benchmarks/bench_coverage.py --seq-lens 1024 --sections window --repeats 5
    python benchmarks/bench_coverage.py --device cuda                # same on a GPU

Forward only, ``torch.no_grad()``, eval, fp32, B=1, CPU (or ``--device cuda``). Three sections:

* ``window``: one attention function, ``softmax(q @ k^T * scale masked by a causal window of width W
  built from arange index arithmetic) @ v`` (Mistral style), H=8, D=64, W=256. Variants: ``eager``
  (as written), ``attnopt`` (``attnopt.optimize``, default auto selection) and the forced candidates
  ``attnopt[sdpa]`` (the band passed as a bool mask), ``attnopt[tiled128]``, ``attnopt[flex]``
  (``attnopt.optimize(m, variant=...)``). Peak memory of one forward at the largest T, eager vs attnopt.
* ``softcap``: the same with Gemma-2's ``50 * tanh(s / 50)`` applied before the window mask;
  variants ``eager``, ``attnopt``, ``attnopt[flex]``, ``attnopt[tiled128]``, ``attnopt[math]``.
* ``hf``: ``LlamaForCausalLM``, ``MistralForCausalLM`` (sliding_window=256) and ``Gemma2ForCausalLM``
  (sliding_window=256, attn/final logit soft-capping 50/30), small configs with random weights, called
  with ``input_ids`` only. Variants: HF ``attn_implementation="eager"``, ``attnopt.optimize`` of that
  model, the peer HF ``attn_implementation="sdpa"`` model with the same weights (what Transformers
  does when it cannot build one, e.g. Gemma-2 with soft-capping, is recorded), and with
  ``--with-compile`` ``torch.compile`` of the eager model.

Every variant's output is compared with eager (max abs difference; logits for the HF models).
For every T, dynamo's caches are reset and every optimized variant is built afresh. The tuning cache
lives in a fresh temporary ``ATTNOPT_CACHE_DIR``, so ``attnopt`` (auto) tunes in its first call, which
is untimed (its duration is reported). Timings are medians of alternating runs in this one process
(``attnopt.selection.measure.time_alternating``); ratios are ``time(reference) / time(variant)`` (above 1: the
variant is faster). Results go to ``benchmarks/results/coverage.json`` and ``coverage.md``.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import logging
import os
import platform
import shlex
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from bench_core import cpu_name, fmt, ratio, write_atomic
from tabulate import tabulate

import attnopt
from attnopt.selection.measure import peak_memory, time_alternating


def _scratch(prefix: str) -> str:
    """A temporary directory removed when the process exits."""
    import atexit
    import shutil

    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, True)
    return path


SECTIONS = ("window", "softcap", "hf")
FORCED = {"window": ("sdpa", "tiled128", "flex"), "softcap": ("flex", "tiled128", "math")}
HF_MODELS = ("llama", "mistral", "gemma2")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096],
                   help="sequence lengths of the window and softcap sections")
    p.add_argument("--hf-seq-len", type=int, default=1024, help="sequence length of the Hugging Face models")
    p.add_argument("--window", type=int, default=256, help="sliding window width W (and HF sliding_window)")
    p.add_argument("--softcap", type=float, default=50.0, help="attention logit soft-cap")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=10, help="timed rounds per point at most")
    p.add_argument("--max-round-s", type=float, default=20.0,
                   help="cut the rounds at a point so that the timed ones take about this long in all (min 3)")
    p.add_argument("--with-compile", action="store_true", help="also time torch.compile of the HF eager models (slow)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results",
                   help="directory for coverage.json and coverage.md")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- the attention under test


class WindowAttention(nn.Module):
    """Causal sliding-window attention as written in model code: the band from arange index arithmetic.

    ``softcap`` adds Gemma-2's ``c * tanh(s / c)`` on the scaled scores before the mask.
    """

    def __init__(self, window: int, softcap: float | None = None):
        super().__init__()
        self.window = window
        self.softcap = softcap

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # (B, H, T, D) each
        t = q.size(-2)
        i = torch.arange(t, device=q.device)
        keep = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < self.window)  # (T, T)
        s = (q @ k.transpose(-2, -1)) * q.size(-1) ** -0.5  # (B, H, T, T)
        if self.softcap is not None:
            s = self.softcap * torch.tanh(s / self.softcap)
        return s.masked_fill(~keep, float("-inf")).softmax(dim=-1) @ v  # (B, H, T, D)


# ----------------------------------------------------------------------------- one measured point


def auto_choices(opt: nn.Module) -> list[str]:
    """The candidate the selector chose for every tuned site and shape of ``opt`` (in site order)."""
    return [e.choice for r in attnopt.explain(opt).records for e in r.extra.get("tuning", {}).values()]


def measure_point(fns: dict[str, Callable[..., torch.Tensor]], inputs: tuple[Any, ...], args: argparse.Namespace,
                  label: str, reference: str = "eager") -> dict[str, Any]:
    """First calls (untimed: capture, tuning, compilation), output check, then alternating medians.

    A variant that raises is recorded as failed and left out. One probe round sizes the number of
    timed rounds so that they take about ``--max-round-s``.
    """
    outs: dict[str, torch.Tensor] = {}
    failed: dict[str, str] = {}
    first_s: dict[str, float] = {}
    with torch.no_grad():
        for name, fn in fns.items():
            start = time.perf_counter()
            try:
                outs[name] = fn(*inputs)
            except Exception as e:  # noqa: BLE001 - a failing variant is a result, not a crash
                failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                print(f"  {label} {name}: FAILED ({failed[name]})", flush=True)
                continue
            first_s[name] = time.perf_counter() - start
            print(f"  {label} {name}: first call {first_s[name]:.1f} s", flush=True)
    ok = {n: f for n, f in fns.items() if n not in failed}
    probe = time_alternating(ok, inputs, repeats=1, warmup=0)
    repeats = max(3, min(args.repeats, int(args.max_round_s / max(sum(probe.values()), 1e-9))))
    times = time_alternating(ok, inputs, repeats=repeats, warmup=0, progress=label)
    ref = outs.get(reference)
    diffs = {n: (o - ref).abs().max().item() for n, o in outs.items() if n != reference and ref is not None}
    return {"repeats": repeats, "ms": {n: times[n] * 1e3 if n in times else None for n in fns},
            "first_call_s": first_s, "max_abs_diff_vs_eager": diffs, "failed": failed}


# ----------------------------------------------------------------------------- sections 1 and 2


def run_attention_section(section: str, args: argparse.Namespace) -> dict[str, Any]:
    softcap = args.softcap if section == "softcap" else None
    names = ["eager", "attnopt", *(f"attnopt[{c}]" for c in FORCED[section])]
    rows = []
    memory = None
    for t in args.seq_lens:
        torch.manual_seed(args.seed)
        q, k, v = (torch.randn(1, args.heads, t, args.head_dim, device=args.device) for _ in range(3))
        torch._dynamo.reset()
        module = WindowAttention(args.window, softcap).eval()
        fns: dict[str, Any] = {"eager": module, "attnopt": attnopt.optimize(copy.deepcopy(module))}
        for c in FORCED[section]:
            fns[f"attnopt[{c}]"] = attnopt.optimize(copy.deepcopy(module), variant=c)
        row = {"T": t, **measure_point(fns, (q, k, v), args, f"{section} T={t}")}
        if "attnopt" not in row["failed"]:
            row["auto_choice"] = auto_choices(fns["attnopt"])
            row["report"] = attnopt.explain(fns["attnopt"]).to_dict()
        for n in names:
            row.setdefault("eager_over", {})[n] = ratio(row["ms"]["eager"], row["ms"][n])
        rows.append(row)
        if section == "window" and t == max(args.seq_lens):
            print(f"  {section} T={t}: peak memory of one forward", flush=True)
            memory = {"T": t, "bytes": {n: peak_memory(fns[n], q, k, v) for n in ("eager", "attnopt")
                                        if n not in row["failed"]}}
    return {"variants": names, "window": args.window, "softcap": softcap, "rows": rows, "memory": memory}


# ----------------------------------------------------------------------------- section 3: Hugging Face


def hf_config(name: str, impl: str, args: argparse.Namespace) -> tuple[Any, type[nn.Module]]:
    """(config, model class): 2 layers, hidden 256, 8 heads over 4 kv heads of dim 32, vocab 1000."""
    import transformers

    common = {"num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 4,
              "head_dim": 32, "intermediate_size": 512, "vocab_size": 1000,
              "max_position_embeddings": max(4096, args.hf_seq_len), "bos_token_id": 0, "eos_token_id": 0,
              "pad_token_id": 0, "attn_implementation": impl}
    if name == "llama":
        return transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    if name == "mistral":
        return transformers.MistralConfig(**common, sliding_window=args.window), transformers.MistralForCausalLM
    return (transformers.Gemma2Config(**common, sliding_window=args.window, attn_logit_softcapping=args.softcap,
                                      final_logit_softcapping=30.0, query_pre_attn_scalar=32),
            transformers.Gemma2ForCausalLM)


class _Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage()[:300])


def capture_warnings(fn: Callable[[], Any]) -> tuple[Any, str | None, list[str]]:
    """``fn()`` with Python warnings and Transformers' logged warnings collected: (result, error, messages)."""
    handler = _Captured()
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    result, error = None, None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                result = fn()
            except Exception as e:  # noqa: BLE001 - what Transformers does here is the result
                error = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    finally:
        logger.removeHandler(handler)
    messages = handler.messages + [f"{w.category.__name__}: {str(w.message)[:300]}" for w in caught]
    return result, error, sorted(set(messages))


def build_hf(name: str, args: argparse.Namespace) -> tuple[dict[str, nn.Module], dict[str, Any]]:
    """The eager model, and the peer SDPA model with the same weights when Transformers builds one."""
    config, model_cls = hf_config(name, "eager", args)
    torch.manual_seed(args.seed)
    eager = model_cls(config).to(args.device).eval()
    models = {"eager": eager}

    def peer() -> nn.Module:
        m = model_cls(hf_config(name, "sdpa", args)[0]).to(args.device).eval()
        m.load_state_dict(eager.state_dict())
        return m

    sdpa, error, messages = capture_warnings(peer)
    note = {"hf_sdpa_build_error": error, "hf_sdpa_build_warnings": messages}
    if sdpa is not None:
        note["hf_sdpa_attn_implementation"] = sdpa.config._attn_implementation
        models["hf_sdpa"] = sdpa
    return models, note


def run_hf_section(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    t = args.hf_seq_len
    for name in HF_MODELS:
        models, note = build_hf(name, args)
        torch._dynamo.reset()
        eager = models["eager"]
        variants: dict[str, nn.Module] = {"eager": eager, "attnopt": attnopt.optimize(eager)}
        if "hf_sdpa" in models:
            variants["hf_sdpa"] = models["hf_sdpa"]
        if args.with_compile:
            variants["compile"] = torch.compile(copy.deepcopy(eager))  # own instance: dynamo caches do not mix
        fns = {n: (lambda ids, m=m: m(input_ids=ids).logits) for n, m in variants.items()}
        ids = torch.randint(0, 1000, (1, t), device=args.device)
        row, error, messages = capture_warnings(functools.partial(measure_point, fns, (ids,), args, f"hf {name} T={t}"))
        if error is not None:
            raise RuntimeError(f"hf {name}: {error}")
        note["run_warnings"] = messages
        row = {"model": name, "T": t, **row, **note}
        if "attnopt" not in row["failed"]:
            report = attnopt.explain(variants["attnopt"])
            row["auto_choice"] = auto_choices(variants["attnopt"])
            row["rewritten"] = report.rewritten
            row["sites"] = len(report.sites)
            row["specs"] = [r.spec.describe() if r.spec else "" for r in report.records]
        row["eager_over"] = {n: ratio(row["ms"]["eager"], row["ms"][n]) for n in variants}
        row["hf_sdpa_over"] = {n: ratio(row["ms"].get("hf_sdpa"), row["ms"][n]) for n in variants}
        rows.append(row)
    return {"rows": rows}


# ----------------------------------------------------------------------------- report


def choice_text(choices: list[str] | None) -> str:
    if not choices:
        return "-"
    return ", ".join(f"{c} x{choices.count(c)}" if choices.count(c) > 1 else c for c in dict.fromkeys(choices))


def attention_markdown(section: str, res: dict[str, Any]) -> str:
    names = res["variants"]
    rows, drows = [], []
    for r in res["rows"]:
        rows.append([r["T"], fmt(r["ms"]["eager"], " ms", 1),
                     *(f"{fmt(r['eager_over'][n], 'x')} ({fmt(r['ms'][n], ' ms', 1)})" for n in names[1:]),
                     choice_text(r.get("auto_choice")), r["repeats"]])
        d = r["max_abs_diff_vs_eager"]
        drows.append([r["T"], *(f"{d[n]:.1e}" if n in d else "failed" for n in names[1:]),
                      fmt(r["first_call_s"].get("attnopt"), " s", 1)])
    cap = res["softcap"]
    title = f"Soft-cap {cap:g}*tanh(s/{cap:g}) + window" if cap is not None else "Sliding window"
    parts = [f"## {title} (W={res['window']}): eager time / variant time (median ms)\n",
             tabulate(rows, headers=["T", "eager", *names[1:], "auto chose", "rounds"], tablefmt="github"), "",
             "Max abs difference of the output vs eager, and attnopt's first call (capture + tuning, untimed):\n",
             tabulate(drows, headers=["T", *names[1:], "attnopt first call"], tablefmt="github"), ""]
    if res["memory"]:
        mem = res["memory"]
        mrows = [[mem["T"], n, f"{b / 2**20:.1f}"] for n, b in mem["bytes"].items()]
        parts += ["Peak live tensor memory of one forward:\n",
                  tabulate(mrows, headers=["T", "variant", "MiB"], tablefmt="github"), ""]
    return "\n".join(parts)


def hf_markdown(res: dict[str, Any]) -> str:
    rows, notes = [], []
    for r in res["rows"]:
        d = r["max_abs_diff_vs_eager"]
        for n in r["ms"]:
            rows.append([r["model"], n, fmt(r["ms"][n], "", 1), fmt(r["eager_over"][n], "x"),
                         fmt(r["hf_sdpa_over"][n], "x") if "hf_sdpa" in r["ms"] else "n/a",
                         f"{d[n]:.1e}" if n in d else ("-" if n == "eager" else "failed"),
                         choice_text(r.get("auto_choice")) if n == "attnopt" else ""])
        if r["hf_sdpa_build_error"]:
            first_sentence = r["hf_sdpa_build_error"].split(". ")[0]  # the whole message is in the JSON
            notes.append(f"- {r['model']}: `attn_implementation=\"sdpa\"` raised `{first_sentence}.`")
        for m in r["hf_sdpa_build_warnings"]:
            notes.append(f"- {r['model']}: building the SDPA model warned: {m}")
        if "attnopt" in r["ms"] and "rewritten" in r:
            notes.append(f"- {r['model']}: attnopt rewrote {r['rewritten']} of {r['sites']} attention sites "
                         f"({'; '.join(r['specs'])})")
        for m in r["run_warnings"]:
            notes.append(f"- {r['model']}: warning while running: {m}")
        for n, why in r["failed"].items():
            notes.append(f"- {r['model']} {n}: failed: {why}")
    t = res["rows"][0]["T"] if res["rows"] else ""
    table = tabulate(rows, headers=["model", "variant", "ms", "vs eager", "vs HF sdpa", "logits max abs diff",
                                    "auto chose"], tablefmt="github")
    return "\n".join([f"## Hugging Face models (T={t}, input_ids only)\n",
                      "Ratios are time(reference) / time(variant): above 1 means the variant is faster.\n",
                      table, "", *notes, ""])


def markdown(res: dict[str, Any], args: argparse.Namespace) -> str:
    env = res["env"]
    parts = [f"# attnopt coverage benchmark\n\n`{env['command']}`\n",
             f"torch {env['torch']}, transformers {env['transformers']}, attnopt {env['attnopt']}, {env['device']}, "
             f"{env['threads']} threads, {env['cpu']}, B=1, fp32, eval, no_grad; medians of up to {args.repeats} "
             f"alternating rounds per point (fewer where a round is slow; see 'rounds'). 1-min load average "
             f"{env['loadavg_1min']['before']:.2f} before, {env['loadavg_1min']['after']:.2f} after, on "
             f"{env['cpu_count']} CPUs (other processes share the CPUs when it is high). "
             f"Total {env['total_s']:.0f} s.\n"]
    for section in ("window", "softcap"):
        if section in res:
            parts.append(attention_markdown(section, res[section]))
    if "hf" in res:
        parts.append(hf_markdown(res["hf"]))
    failures = [f"- {s} T={r['T']} {n}: {why}" for s in ("window", "softcap") if s in res
                for r in res[s]["rows"] for n, why in r["failed"].items()]
    if failures:
        parts += ["## Failed variants\n", *failures, ""]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python " + shlex.join(sys.argv if argv is None else [sys.argv[0], *argv])
    print(f"command: {command}", flush=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    # Several optimized copies of one module share forward's code object; dynamo's default limit of 8
    # entries per code object would silently run the rest as written.
    torch._dynamo.config.recompile_limit = 64
    os.environ["ATTNOPT_CACHE_DIR"] = _scratch(prefix="attnopt-coverage-")  # no stale choices
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    res: dict[str, Any] = {}
    for section in args.sections:
        print(f"section {section}", flush=True)
        res[section] = run_hf_section(args) if section == "hf" else run_attention_section(section, args)
    import transformers

    res["env"] = {"command": command, "torch": torch.__version__, "transformers": transformers.__version__,
                  "attnopt": attnopt.__version__, "device": args.device, "threads": torch.get_num_threads(),
                  "cpu": cpu_name(), "python": platform.python_version(), "repeats": args.repeats,
                  "max_round_s": args.max_round_s, "window": args.window, "softcap": args.softcap,
                  "heads": args.heads, "head_dim": args.head_dim, "cpu_count": os.cpu_count(),
                  "loadavg_1min": {"before": load_before, "after": os.getloadavg()[0]},
                  "total_s": time.perf_counter() - start}
    md = markdown(res, args)
    print()
    print(md)
    write_atomic(args.out / "coverage.json", json.dumps(res, indent=2, default=str) + "\n")
    write_atomic(args.out / "coverage.md", md)
    print(f"wrote {args.out / 'coverage.json'} and {args.out / 'coverage.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
