"""KV-cached generation over every Hugging Face causal LM type: which ones ``attnopt.generate`` serves, and exactly.

    python benchmarks/bench_generate_zoo.py                       # every decoder-only causal LM type (~40 min)
    python benchmarks/bench_generate_zoo.py --only gpt2,opt,falcon
    python benchmarks/bench_generate_zoo.py --jobs 2 --timeout 240

The models are ``benchmarks/hf_zoo.py``'s (tiny configs, random weights, eager attention, eval mode), the
decoder-only causal LM types only. Each type runs in a forked process with a time limit. Per type:

* ``attnopt.generation.cached(model)``: the capture and proofs (with ``max_len=64`` where the model names no
  maximum length and the call asks for one: BLOOM's ALiBi has no position table); a refusal (``PositionError``
  and the like) is a row with its reason: attnopt declined to cache it, which is correct behaviour, not a failure;
* greedy tokens of ``attnopt.generate(lm, ids, 8)`` for a batch of 2 prompts of 5 tokens against
  ``generate_plain`` (the full-recompute loop of the model as written), and a ragged batch of prompts of 6, 1
  and 3 tokens against each prompt generated alone.

Tokens that differ are a *mismatch*: a wrong cache, unless the logits agree and the models' logits have a
near tie there, which the row says (the cached model's logits on the plain loop's sequence are compared with the
model's own, relative to their scale). Writes ``benchmarks/results/generate_zoo.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_zoo  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _logit_gap(lm: Any, model: torch.nn.Module, seq: torch.Tensor) -> float:
    """Largest difference between the cached model's prefill logits and the model's own, over their scale."""
    from attnopt.passes.kv_capture import forward_kwargs, logits_of

    with torch.no_grad():
        got = lm.prefill(seq)
        want = logits_of(model(seq, **forward_kwargs(model, seq)))
    lm.reset()
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6))


def run_type(model_type: str) -> dict[str, Any]:
    """One row: how ``attnopt.generate`` does on ``model_type``."""
    from attnopt.generation import cached, generate, generate_plain
    from attnopt.passes.kv_capture import NoMaxLen

    warnings.filterwarnings("ignore")
    row: dict[str, Any] = {"type": model_type}
    entry = hf_zoo.zoo_entry(model_type)
    try:
        model = hf_zoo.build(entry)
    except Exception as e:  # noqa: BLE001 - a type the zoo cannot build is a row, not a crash
        return {**row, "status": "not built", "detail": f"{type(e).__name__}: {e}"[:300]}
    row["class"] = type(model).__name__
    gen = torch.Generator().manual_seed(0)
    ids = hf_zoo._ids(model.config, 2, 11, gen)
    start = time.perf_counter()
    try:
        try:
            lm = cached(model)
        except NoMaxLen:  # no maximum length to be found (ALiBi, BLOOM): given, as the message asks
            lm = cached(model, max_len=hf_zoo.POSITIONS)
            row["max_len_given"] = True
    except Exception as e:  # noqa: BLE001 - a refusal names its reason
        return {**row, "status": "refused", "detail": f"{type(e).__name__}: {e}"[:400],
                "capture_s": round(time.perf_counter() - start, 1)}
    row["capture_s"] = round(time.perf_counter() - start, 1)
    row["max_len"] = lm.max_len
    try:
        want = generate_plain(model, ids[:, :5], 8)
        got = generate(lm, ids[:, :5], 8)
        prompts = [ids[0, :6], ids[1, :1], ids[1, 1:4]]
        alone = [generate_plain(model, p[None], 6)[0] for p in prompts]
        ragged = generate(lm, prompts, 6)
    except Exception as e:  # noqa: BLE001 - a crash after a successful capture is a bug: reported as such
        return {**row, "status": "error", "detail": f"{type(e).__name__}: {e}"[:400],
                "trace": traceback.format_exc()[-1500:]}
    same = torch.equal(got, want)
    same_ragged = all(torch.equal(a, b) for a, b in zip(ragged, alone))
    row["gap"] = _logit_gap(lm, model, want)
    if same and same_ragged:
        row["status"] = "exact"
    else:
        row["status"] = "near tie" if row["gap"] < 1e-4 else "MISMATCH"
        row["detail"] = f"batch tokens equal: {same}, ragged equal to alone: {same_ragged}"
    return row


def _child(model_type: str, queue: Any) -> None:
    torch.set_num_threads(1)
    try:
        queue.put(run_type(model_type))
    except BaseException as e:  # noqa: BLE001 - the parent records it
        queue.put({"type": model_type, "status": "error", "detail": f"{type(e).__name__}: {e}"[:400]})


def sweep(types: list[str], jobs: int, timeout: float) -> list[dict[str, Any]]:
    ctx = mp.get_context("fork")
    rows: list[dict[str, Any]] = []
    todo = list(types)
    running: list[tuple[str, Any, Any, float]] = []
    while todo or running:
        while todo and len(running) < jobs:
            t = todo.pop(0)
            q = ctx.Queue()
            p = ctx.Process(target=_child, args=(t, q), daemon=True)
            p.start()
            running.append((t, p, q, time.perf_counter()))
        for item in list(running):
            t, p, q, began = item
            row = None
            try:
                row = q.get(timeout=0.2)
            except Exception:  # noqa: BLE001 - queue.Empty: not done yet
                if p.is_alive() and time.perf_counter() - began <= timeout:
                    continue
                if p.is_alive():
                    p.kill()
                row = {"type": t, "status": "timeout" if time.perf_counter() - began > timeout else "error",
                       "detail": f"no result after {time.perf_counter() - began:.0f} s"}
            p.join(5)
            running.remove(item)
            rows.append(row)
            print(f"{len(rows):4d}/{len(types)} {t:28s} {row['status']:9s} {str(row.get('detail', ''))[:110]}",
                  flush=True)
    return rows


def report(rows: list[dict[str, Any]], wall: float) -> str:
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    lines = [f"# attnopt.generate over Hugging Face causal LM types ({len(rows)} types, {wall / 60:.0f} min)", "",
             "`python benchmarks/bench_generate_zoo.py` (tiny configs, random weights, eager attention; greedy "
             "tokens against the full-recompute loop, ragged prompts against each prompt alone).", "",
             ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())), ""]
    table = [[r["type"], r.get("class", ""), r["status"],
              f"{r.get('max_len', '')}{' (given)' * r.get('max_len_given', False)}", r.get("capture_s", ""),
              "" if r.get("gap") is None else f"{r['gap']:.1e}", str(r.get("detail", ""))[:160]]
             for r in sorted(rows, key=lambda r: (r["status"] != "exact", r["status"], r["type"]))]
    lines.append(tabulate(table, headers=["type", "class", "status", "max_len", "capture s", "logit gap", "detail"],
                          tablefmt="github"))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="", help="comma-separated model types (default: every causal LM type)")
    p.add_argument("--jobs", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per model type")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.only:
        types = [t.strip() for t in args.only.split(",") if t.strip()]
    else:
        types = [t for t in hf_zoo.model_types() if hf_zoo.zoo_entry(t).causal_lm]
    start = time.perf_counter()
    rows = sweep(types, args.jobs, args.timeout)
    wall = time.perf_counter() - start
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.only:
        (args.out / "generate_zoo.json").write_text(json.dumps({"wall_s": wall, "rows": rows}, indent=1))
        (args.out / "generate_zoo.md").write_text(report(rows, wall))
    print(report(rows, wall))
    return 1 if any(r["status"] in ("MISMATCH", "error") for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
