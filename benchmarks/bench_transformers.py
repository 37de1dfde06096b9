"""Hugging Face transformers sweep: every model type, tiny and random, eager attention vs ``attnopt.optimize``.

    python benchmarks/bench_transformers.py                         # every model type (hours on 2 CPUs)
    python benchmarks/bench_transformers.py --only llama,gpt2,bert  # a few
    python benchmarks/bench_transformers.py --limit 20 --timeout 120 --jobs 2
    python benchmarks/bench_transformers.py --resume                # go on where an interrupted sweep stopped

The models are ``benchmarks/hf_zoo.py``'s: every model type of transformers' ``MODEL_MAPPING_NAMES`` (the
``*ForCausalLM`` class for decoder-only causal LMs, else the ``AutoModel`` class), built from the type's own
config class shrunk to 2 layers of width 32 (4 heads of 8), random weights, ``attn_implementation="eager"``,
every dropout probability 0; inputs B=2, T=8 (``--batch``, ``--seq``), images 32x32, features and audio sized
from the config. Each model type runs in a process of its own (forked from this one, after the imports) with a
time limit (``--timeout``), so a crash or a hang costs one row.

Per model type, first as written: does it build, which inputs does its forward take (tried in turn), how
many softmax calls does one eager forward make and how many of them feed a matmul/bmm/einsum (*attention
calls*, counted with a ``TorchFunctionMode``), and are two eager forwards in a row equal (a forward that
draws random numbers in eval mode, such as ViTMAE's masking, cannot be compared and is reported as
such). Types without attention calls run the first mode only (attnopt must not change them). Then in each
mode, after ``torch._dynamo.reset()``, ``attnopt.optimize(model)`` (``--variant``, default ``auto``) is
called once untimed (capture, proofs, tuning) and once under ``torch.profiler``, and compared with the
model as written on the same inputs:

* ``no_mask``: eval, ``torch.no_grad()``, the main input only (plus ``decoder_input_ids`` for enc-dec);
* ``right_pad`` / ``left_pad``: the same with an ``attention_mask`` that hides the last (first) third of
  the second sequence, where the forward takes one; left padding only for decoder-only causal LMs;
* ``train``: ``model.train()``, gradients on, with the right-padded mask where there is one; outputs, and
  the gradients of ``sum(out_i * c_i)`` (fixed random cotangents) with respect to every parameter and every
  floating input. Two eager training forwards must agree first (else ``random in training``).

Equal means ``|opt - eager| <= tol * (max|eager| + |eager|)`` per tensor (``--tol``, 1e-4, fp32), NaN where
eager has NaN; gradients use ``10 * tol`` and a scale of at least 1e-3 of the largest gradient, so gradients
that are zero up to rounding compare by the gradients' scale. Where that fails, the model runs once more in
float64: when eager fp32 is itself far from it (ill-conditioned models whose top-k query selection rounding
flips) and attnopt is no further than twice eager's distance plus ``tol``, the mode counts as equal and is
listed as ill-conditioned. In training, models that set ``requires_grad`` on an activation themselves
(wav2vec2's feature encoder) are compared on parameter gradients only. ``attnopt.explain(opt)`` gives the
sites found (M), rewritten (N), and the reason of every site left alone. The profile counts, per forward, the
``attnopt::<site>`` ranges and what ran in each: ``sdpa`` (``aten::scaled_dot_product_attention``), ``flex``
(a compiled region), ``tiled`` (``_TiledAttention``) or ``math`` (``aten::_softmax``: the plain computation).
``math`` in a site whose selector chose ``math`` for the call's shapes (at these tiny shapes the plain
computation is sometimes the fastest) counts as *served as chosen*; ``math`` anywhere else is the plain path
run behind explain()'s back. A mode is **fully rewritten** when every site is rewritten, outputs (and
gradients) are equal, and every eager attention call ran inside a site as chosen (fused: sdpa, flex or tiled;
or math where chosen), so a site that explain() calls rewritten but runs the plain path, or an attention call
that never reaches a site, shows.

The tuning cache is one directory for the whole sweep (``ATTNOPT_CACHE_DIR``, a fresh temporary one unless
set): configs are shrunk alike, so shapes repeat and most types tune nothing new. Results:
``benchmarks/results/transformers.json`` (every row, rewritten after each type) and ``transformers.md``.
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import math
import multiprocessing as mp
import os
import platform
import re
import shlex
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import hf_zoo
import torch
from bench_core import cpu_name, write_atomic
from tabulate import tabulate

import attnopt


def _scratch(prefix: str) -> str:
    """A temporary directory removed when the process exits."""
    import atexit
    import shutil

    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, True)
    return path


MODES = ("no_mask", "right_pad", "left_pad", "train")
PADDING = {"no_mask": None, "right_pad": "right", "left_pad": "left"}
#: what ran inside an ``attnopt::<site>`` range, by the first profiler event that names it
_RAN = (("sdpa", "scaled_dot_product"), ("flex", "Torch-Compiled Region"), ("flex", "CompiledFxGraph"),
        ("tiled", "_TiledAttention"), ("math", "aten::_softmax"))
FUSED = ("sdpa", "flex", "tiled")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="", help="comma-separated model types (default: every type)")
    p.add_argument("--limit", type=int, default=None, help="at most this many model types")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per model type")
    p.add_argument("--jobs", type=int, default=1, help="model types run at once")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads in each model's process")
    p.add_argument("--variant", default="auto", help="attnopt.optimize(variant=...)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=8)
    p.add_argument("--tol", type=float, default=1e-4, help="fp32 tolerance relative to each tensor's scale")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--resume", action="store_true", help="keep the rows of an existing transformers.json")
    p.add_argument("--report", action="store_true",
                   help="only write transformers.md again from an existing transformers.json (nothing runs)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results",
                   help="directory for transformers.json and transformers.md")
    return p.parse_args(argv)


def _error(e: BaseException) -> str:
    """``Type: message``, on one line (a validator's message is on its second)."""
    msg = f"{type(e).__name__}: {e}"
    lines = [ln.strip() for ln in msg.splitlines() if ln.strip()]
    return (" ".join(lines[:2]) if lines else type(e).__name__)[:400]


def _where(e: BaseException) -> dict[str, Any]:
    """The innermost frame of ``e``'s traceback, and the innermost one inside attnopt (if any)."""
    frames = traceback.extract_tb(e.__traceback__)
    ours = [f for f in frames if f"{os.sep}attnopt{os.sep}" in f.filename and "benchmarks" not in f.filename]
    fmt = lambda f: f"{Path(f.filename).name}:{f.lineno} in {f.name}"  # noqa: E731
    return {"frame": fmt(frames[-1]) if frames else "", "attnopt_frame": fmt(ours[-1]) if ours else None}


# ----------------------------------------------------------------------------- one forward (and backward)

def _leaves(inputs: dict[str, Any], train: bool) -> dict[str, Any]:
    """Fresh copies of ``inputs``; floating ones require grad in training."""
    return {k: v.detach().clone().requires_grad_(train and v.is_floating_point()) if isinstance(v, torch.Tensor)
            else v for k, v in inputs.items()}


def _forward(fn: Any, inputs: dict[str, Any], train: bool) -> list[torch.Tensor]:
    if train:
        return hf_zoo.output_tensors(fn(**inputs))
    with torch.no_grad():
        return hf_zoo.output_tensors(fn(**inputs))


def _backward(outs: list[torch.Tensor], inputs: dict[str, Any], params: list[torch.Tensor]) -> list[Any]:
    gen = torch.Generator().manual_seed(7)
    terms = [(o.double() * torch.randn(o.shape, generator=gen, dtype=torch.float64)).sum()
             for o in outs if o.requires_grad]
    leaves = params + [v for v in inputs.values() if isinstance(v, torch.Tensor) and v.requires_grad]
    if not terms:
        return [None] * len(leaves)
    return list(torch.autograd.grad(sum(terms), leaves, allow_unused=True))


def _run(fn: Any, inputs: dict[str, Any], train: bool, params: list[torch.Tensor], profile: bool = False,
         input_grads: bool = True) -> tuple[list[torch.Tensor], list[Any], Any]:
    inputs = _leaves(inputs, train and input_grads)
    events = None
    if profile:
        from torch.profiler import profile as profiler

        with profiler() as prof:
            outs = _forward(fn, inputs, train)
        events = prof.events()
    else:
        outs = _forward(fn, inputs, train)
    grads = _backward(outs, inputs, params) if train else []
    return [o.detach() for o in outs], grads, events


def _site_runs(events: Any) -> dict[str, Any]:
    """Per ``attnopt::<site>`` range of one forward: what ran in it (see ``_RAN``)."""
    ranges = [e for e in events if e.name.startswith("attnopt::")]
    runs: collections.Counter[str] = collections.Counter()
    per_site: dict[str, collections.Counter[str]] = {}
    by_thread: dict[Any, list[Any]] = collections.defaultdict(list)
    for e in events:
        by_thread[e.thread].append(e)
    for r in ranges:
        inside = [e.name for e in by_thread[r.thread] if e is not r and r.time_range.start <= e.time_range.start
                  and e.time_range.end <= r.time_range.end]
        kind = next((k for k, marker in _RAN if any(marker in n for n in inside)), "other")
        runs[kind] += 1
        per_site.setdefault(r.name[len("attnopt::"):], collections.Counter())[kind] += 1
    in_sites = {id(e) for r in ranges for e in by_thread[r.thread]
                if r.time_range.start <= e.time_range.start and e.time_range.end <= r.time_range.end}
    outside = sum(1 for e in events if e.name == "aten::_softmax" and id(e) not in in_sites)
    return {"site_calls": len(ranges), "ran": dict(runs), "fused": sum(runs[k] for k in FUSED),
            "per_site": {k: dict(v) for k, v in per_site.items()}, "softmax_outside_sites": outside}


# ----------------------------------------------------------------------------- comparing

def _scale(t: torch.Tensor) -> float:
    finite = t.double()[torch.isfinite(t)]
    return finite.abs().max().item() if finite.numel() else 0.0


def _compare(ref: list[torch.Tensor | None], got: list[torch.Tensor | None], tol: float, floor: float = 0.0,
             what: str = "output") -> tuple[float, float, list[str]]:
    """Max abs difference, max difference relative to the tensors' scales, and what differs."""
    worst_abs = worst_rel = 0.0
    bad = []
    if len(ref) != len(got):
        return math.inf, math.inf, [f"{len(got)} {what}s instead of {len(ref)}"]
    for i, (a, b) in enumerate(zip(got, ref)):
        if a is None and b is None:
            continue
        if a is None or b is None:
            if (b if a is None else a).abs().sum() > 0:  # type: ignore[union-attr]
                bad.append(f"{what} {i}: missing")
            continue
        if a.shape != b.shape:
            bad.append(f"{what} {i}: shape {tuple(a.shape)} instead of {tuple(b.shape)}")
            continue
        a64, b64 = a.double(), b.double()
        nan_ref, nan_got = torch.isnan(b64), torch.isnan(a64)
        if not torch.equal(nan_ref, nan_got):
            bad.append(f"{what} {i}: NaN at {int((nan_ref ^ nan_got).sum())} other position(s)")
            continue
        keep = ~nan_ref
        if not keep.any():
            continue
        scale = max(_scale(b), floor)
        diff = (a64[keep] - b64[keep]).abs()
        d = diff.max().item()
        limit = tol * (scale + b64[keep].abs())
        worst_abs = max(worst_abs, d)
        worst_rel = max(worst_rel, d / scale if scale > 0 else (0.0 if d == 0 else math.inf))
        if not bool((diff <= limit).all()):
            bad.append(f"{what} {i} {tuple(b.shape)}: differs by {d:.3g} (scale {scale:.3g})")
    return worst_abs, worst_rel, bad



def _float64_verdict(model: torch.nn.Module, inputs: dict[str, Any], train: bool, input_grads: bool,
                     ref: tuple[list, list, Any], got: tuple[list, list], tol: float) -> str:
    """Is attnopt (``got``) no further from the model in float64 than eager fp32 (``ref``) is?

    Distances are relative to each tensor's scale (gradients: at least 1e-3 of the largest), the largest
    over all tensors; attnopt may be twice as far as eager, plus ``tol``. Meant for ill-conditioned models,
    where eager fp32 itself is far from float64 (a top-k selection that rounding flips).
    """
    try:
        m64 = copy.deepcopy(model).double().train(train)
        in64 = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                for k, v in inputs.items()}
        torch.manual_seed(0)
        exact = _run(m64, in64, train, [p for p in m64.parameters() if p.requires_grad] if train else [],
                     input_grads=input_grads)
    except Exception as e:  # noqa: BLE001 - no float64 evaluation: the difference stands
        return f"no float64 evaluation ({_error(e)[:120]})"
    finally:
        model.train(train)
    floor = 1e-3 * max((_scale(g) for g in exact[1] if g is not None), default=0.0)
    mine = theirs = 0.0
    for group, lo in ((zip(got[0], ref[0], exact[0]), 0.0), (zip(got[1], ref[1], exact[1]), floor)):
        for a, b, e in group:
            if a is None or b is None or e is None or not a.shape == b.shape == e.shape:
                continue
            keep = torch.isfinite(e) & torch.isfinite(b) & torch.isfinite(a)
            scale = max(_scale(e), lo)
            if not keep.any() or scale == 0:
                continue
            e64 = e.double()[keep]
            mine = max(mine, (a.double()[keep] - e64).abs().max().item() / scale)
            theirs = max(theirs, (b.double()[keep] - e64).abs().max().item() / scale)
    if mine <= 2 * theirs + tol:
        return f"ill-conditioned: eager is {theirs:.3g} from float64, attnopt {mine:.3g} (of the scale)"
    return f"further from float64 than eager: {mine:.3g} vs {theirs:.3g} (of the scale)"


# ----------------------------------------------------------------------------- one model type, in its own process

def _records(report: Any) -> dict[str, Any]:
    sites = report.sites
    other = [r for r in report.records if r.decision == "not attention"]

    def row(r: Any) -> dict[str, Any]:
        return {"name": f"g{r.graph_id}.{r.name}", "where": f"{r.module_path} ({r.source})".strip(),
                "decision": r.decision, "rule": r.extra.get("rule"), "reason": r.reason}

    return {"graphs": report.graphs, "sites": len(sites), "rewritten": report.rewritten,
            "left_alone": [row(r) for r in sites if not r.rewritten],
            "not_attention": [row(r) for r in other],
            "specs": sorted({r.reason for r in sites if r.rewritten}),
            "rejected": {f"g{r.graph_id}.{r.name}": r.extra["rejected"] for r in sites if r.extra.get("rejected")},
            "choices": {f"g{r.graph_id}.{r.name}": {key: {"choice": e.choice, "why": e.decision,
                                                         "rejected": dict(e.rejected)}
                                                   for key, e in r.extra.get("tuning", {}).items()}
                        for r in sites if r.extra.get("tuning")},
            "failures": list(report.failures)}


def run_mode(model: torch.nn.Module, recipe: hf_zoo.Recipe, mode: str, expected: int, *, variant: str = "auto",
             batch: int = 2, seq: int = 8, tol: float = 1e-4) -> dict[str, Any]:
    """One mode of one model (see the module docstring): eager, then ``attnopt.optimize``, compared.

    ``expected``: the eager forward's attention calls. The row's ``full`` says the mode is fully rewritten.
    """
    train = mode == "train"
    padding = PADDING.get(mode, "right" if recipe.mask else None)
    inputs = hf_zoo.make_inputs(model, recipe, batch=batch, seq=seq, padding=padding)
    row: dict[str, Any] = {"padding": padding}
    start = time.perf_counter()
    model.train(train)
    params = [p for p in model.parameters() if p.requires_grad] if train else []
    grads_of_inputs = train
    try:
        torch.manual_seed(0)
        try:
            ref = _run(model, inputs, train, params)
        except RuntimeError:
            if not train:
                raise
            # some models set requires_grad on an activation themselves (wav2vec2's feature encoder),
            # which fails once the input requires grad: compare the parameters' gradients only
            grads_of_inputs = row["input_grads"] = False
            torch.manual_seed(0)
            ref = _run(model, inputs, train, params, input_grads=False)
        if train:
            again = _run(model, inputs, train, params, input_grads=grads_of_inputs)
            if _compare(ref[0], again[0], 0.0)[2] or _compare(ref[1], again[1], 0.0, what="gradient")[2]:
                return {**row, "status": "random in training", "s": time.perf_counter() - start}
    except Exception as e:  # noqa: BLE001 - the model itself fails in this mode: not attnopt's
        return {**row, "status": "eager failed", "error": _error(e), **_where(e), "s": time.perf_counter() - start}
    torch._dynamo.reset()
    caught: list[str] = []
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            opt = attnopt.optimize(model, variant=variant)
            t0 = time.perf_counter()
            torch.manual_seed(0)
            _run(opt, inputs, train, params, input_grads=grads_of_inputs)  # capture, proofs and tuning
            row["first_call_s"] = time.perf_counter() - t0
            torch.manual_seed(0)
            outs, grads, events = _run(opt, inputs, train, params, profile=True, input_grads=grads_of_inputs)
        caught = list(dict.fromkeys(str(w.message)[:300] for w in seen if "attnopt" in str(w.message)))[:10]
        report = attnopt.explain(opt)
    except Exception as e:  # noqa: BLE001 - attnopt failing on a model that runs as written is a result
        return {**row, "status": "attnopt error", "error": _error(e), **_where(e),
                "traceback": traceback.format_exc()[-3000:], "s": time.perf_counter() - start}
    finally:
        model.eval()
    row.update(_records(report))
    row.update(_site_runs(events))
    row["expected_calls"] = expected
    row["warnings"] = caught
    chosen: dict[str, set[str]] = collections.defaultdict(set)
    for name, keys in row["choices"].items():
        chosen[name.split(".", 1)[1]] |= {k["choice"] for k in keys.values()}
    # the plain computation where the selector chose it (fastest at these shapes) is what the site chose
    row["math_chosen"] = sum(c.get("math", 0) for site, c in row["per_site"].items() if "math" in chosen.get(site, ()))
    row["served"] = row["fused"] + row["math_chosen"]
    row["out_abs"], row["out_rel"], problems = _compare(ref[0], outs, tol)
    if train:
        floor = 1e-3 * max((_scale(g) for g in ref[1] if g is not None), default=0.0)
        row["grad_abs"], row["grad_rel"], gp = _compare(ref[1], grads, 10 * tol, floor, "gradient")
        problems += gp
    if problems:
        # an ill-conditioned model (top-k query selection, huge gradients) moves with any rounding: equal
        # when attnopt is no further from a float64 evaluation than the model as written is
        row["float64"] = _float64_verdict(model, inputs, train, grads_of_inputs, ref, (outs, grads), tol)
        if row["float64"].startswith("ill-conditioned"):
            problems = []
    row["equal"] = not problems
    if problems:
        row["problems"] = problems[:8]
    row["status"] = "ok"
    row["full"] = bool(row["sites"] and row["rewritten"] == row["sites"] and not row["failures"] and row["equal"]
                       and expected and row["served"] >= expected and row["served"] == row["site_calls"])
    row["s"] = time.perf_counter() - start
    return row


def run_type(model_type: str, args: argparse.Namespace) -> dict[str, Any]:
    """Everything about one model type (see the module docstring); never raises."""
    start = time.perf_counter()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", module="transformers")
    row: dict[str, Any] = {"type": model_type}
    try:
        entry = hf_zoo.zoo_entry(model_type)
        row.update(model_class=entry.model_class, causal_lm=entry.causal_lm)
        model = hf_zoo.build(entry)
        row["params"] = sum(p.numel() for p in model.parameters())
    except Exception as e:  # noqa: BLE001
        return {**row, "status": "build failed", "error": _error(e), **_where(e), "s": time.perf_counter() - start}
    recipe, errors = hf_zoo.find_recipe(model, batch=args.batch, seq=args.seq)
    if recipe is None:
        return {**row, "status": "eager failed", "error": errors[0] if errors else "no input recipe",
                "errors": errors[-4:], "s": time.perf_counter() - start}
    row["inputs"] = {"main": recipe.main, "extra": list(recipe.extra), "mask": recipe.mask}
    inputs = hf_zoo.make_inputs(model, recipe, batch=args.batch, seq=args.seq)
    try:
        count = hf_zoo.count_attention(model, inputs)
        random = hf_zoo.forward_is_random(model, inputs)
    except Exception as e:  # noqa: BLE001
        return {**row, "status": "eager failed", "error": _error(e), **_where(e), "s": time.perf_counter() - start}
    row.update(softmax_calls=count.softmax, attention_calls=count.attention,
               probs_shapes=sorted({str(list(s)) for s in count.shapes}))
    if random:
        return {**row, "status": "random forward", "s": time.perf_counter() - start}
    row["status"] = "ok" if count.attention else "no softmax attention"
    modes = [m for m in args.modes.split(",") if _applies(m, entry, recipe)]
    if not count.attention:
        modes = modes[:1]
    row["modes"] = {}
    for mode in modes:
        row["modes"][mode] = run_mode(model, recipe, mode, count.attention, variant=args.variant, batch=args.batch,
                                      seq=args.seq, tol=args.tol)
    row["s"] = time.perf_counter() - start
    return row


def _applies(mode: str, entry: hf_zoo.ZooEntry, recipe: hf_zoo.Recipe) -> bool:
    if mode == "right_pad":
        return recipe.mask is not None
    if mode == "left_pad":
        return recipe.mask is not None and entry.causal_lm
    return mode in MODES


def _child(model_type: str, args: argparse.Namespace, path: str) -> None:
    try:
        row = run_type(model_type, args)
    except BaseException as e:  # noqa: BLE001 - write what happened; the parent reads it
        row = {"type": model_type, "status": "harness error", "error": _error(e),
               "traceback": traceback.format_exc()[-3000:]}
    Path(path).write_text(json.dumps(row, default=str))


# ----------------------------------------------------------------------------- the sweep

def sweep(types: list[str], args: argparse.Namespace, done: dict[str, dict[str, Any]],
          on_row: Any) -> dict[str, dict[str, Any]]:
    """Runs every type in ``types`` not in ``done``, ``args.jobs`` at a time, each in a forked process."""
    ctx = mp.get_context("fork")
    todo = [t for t in types if t not in done]
    running: dict[str, tuple[Any, str, float]] = {}
    tmp = _scratch(prefix="attnopt-hf-rows-")
    while todo or running:
        while todo and len(running) < args.jobs:
            t = todo.pop(0)
            path = os.path.join(tmp, re.sub(r"[^\w.-]", "_", t) + ".json")
            p = ctx.Process(target=_child, args=(t, args, path), daemon=True)
            p.start()
            running[t] = (p, path, time.perf_counter())
        time.sleep(0.2)
        for t, (p, path, began) in list(running.items()):
            late = time.perf_counter() - began > args.timeout
            if p.is_alive() and not late:
                continue
            if p.is_alive():
                p.kill()
                p.join()
                row = {"type": t, "status": "timeout", "error": f"no result after {args.timeout:.0f} s"}
            elif os.path.exists(path):
                row = json.loads(Path(path).read_text())
            else:
                row = {"type": t, "status": "crashed", "error": f"the process died with exit code {p.exitcode}"}
            row["wall_s"] = time.perf_counter() - began
            del running[t]
            done[t] = row
            on_row(t, row)
    return done


# ----------------------------------------------------------------------------- the report

def mode_ok(m: dict[str, Any] | None) -> bool:
    return bool(m and m.get("status") == "ok" and m.get("full"))


def _cell(m: dict[str, Any] | None) -> str:
    if m is None:
        return "-"
    status = m.get("status")
    if status != "ok":
        return {"eager failed": "eager fails", "random in training": "random"}.get(status, status.upper())
    if not m.get("equal"):
        return f"**NOT EQUAL** ({m.get('out_rel', 0):.1e})"
    if m.get("full"):
        return "yes"
    return f"{m['rewritten']}/{m['sites']}"


def _fused(row: dict[str, Any]) -> str:
    """Per mode, ``fused[+chosen m][+plain P]`` site calls, then ``of`` the eager attention calls."""
    cells, expected = [], 0
    for mode in MODES:
        m = row.get("modes", {}).get(mode)
        if not (m and m.get("status") == "ok"):
            cells.append("-")
            continue
        expected = m["expected_calls"]
        chosen = m.get("math_chosen", 0)
        plain = m.get("ran", {}).get("math", 0) - chosen
        other = m.get("ran", {}).get("other", 0)
        cells.append(f"{m['fused']}" + (f"+{chosen}m" if chosen else "") + (f"+{plain}P" if plain else "")
                     + (f"+{other}?" if other else ""))
    return " · ".join(cells) + f" of {expected}" if any(c != "-" for c in cells) else "-"


def _reasons(row: dict[str, Any]) -> list[str]:
    """Why a type is not fully rewritten: explain()'s reasons, errors, differences, run-time misses."""
    out: list[str] = []
    for mode, m in row.get("modes", {}).items():
        if m.get("status") == "attnopt error":
            out.append(f"attnopt error ({mode}): {m['error']}")
            continue
        if m.get("status") != "ok":
            continue
        out += [f"[{x['rule']}] {x['reason']}" if x.get("rule") else x["reason"] for x in m.get("left_alone", [])]
        out += [f"graph not rewritten: {f}" for f in m.get("failures", [])]
        if not m.get("equal"):
            out.append(f"NOT EQUAL in {mode}: {'; '.join(m.get('problems', []))}")
        if m.get("equal") and m["rewritten"] == m["sites"] and not m.get("full"):
            if not m["sites"]:
                out.append("no attention site found (softmax not read as attention)"
                           + (f": {m['not_attention'][0]['reason']}" if m.get("not_attention") else ""))
            elif m["served"] < m["expected_calls"] or m["served"] != m["site_calls"]:
                ran = ", ".join(f"{k} {v}" for k, v in sorted(m.get("ran", {}).items()))
                out.append(f"{m['expected_calls']} attention call(s), {m['served']} ran what their site chose "
                           f"({mode}: {ran or 'no site ran'})")
    return list(dict.fromkeys(out))


def _short(reason: str) -> str:
    """A reason without its numbers, names and positions, for grouping."""
    reason = re.sub(r"\(.*?\)", "", reason)
    reason = re.sub(r"'[^']*'|\"[^\"]*\"|`[^`]*`", "'…'", reason)
    reason = re.sub(r"\b(g\d+\.)?site\d+\b|\b\d+(\.\d+)?(e-?\d+)?\b", "#", reason)
    return re.sub(r"\s+", " ", reason).strip()[:160]


def summarise(rows: list[dict[str, Any]], modes: list[str]) -> dict[str, Any]:
    with_attention = [r for r in rows if r.get("status") == "ok"]
    status = collections.Counter(r.get("status") for r in rows)
    per_mode = {}
    for mode in modes:
        ran = [r for r in with_attention if r.get("modes", {}).get(mode, {}).get("status") == "ok"]
        full = [r["type"] for r in ran if mode_ok(r["modes"][mode])]
        per_mode[mode] = {"full": len(full), "compared": len(ran),
                          "pct": 100.0 * len(full) / len(ran) if ran else 0.0}
    every = [r["type"] for r in with_attention
             if r.get("modes") and all(mode_ok(m) or m.get("status") in ("eager failed", "random in training")
                                       for m in r["modes"].values())
             and any(mode_ok(m) for m in r["modes"].values())]
    wrong = sorted({f"{r['type']} ({mode})" for r in rows for mode, m in r.get("modes", {}).items()
                    if m.get("status") == "ok" and not m.get("equal")})
    errors = sorted({f"{r['type']} ({mode})" for r in rows for mode, m in r.get("modes", {}).items()
                     if m.get("status") == "attnopt error"})
    silent = sorted({f"{r['type']} ({mode})" for r in rows for mode, m in r.get("modes", {}).items()
                     if m.get("status") == "ok" and m["sites"] and m["rewritten"] == m["sites"] and m.get("equal")
                     and (m["served"] < m["expected_calls"] or m["served"] != m["site_calls"])})
    ill = sorted({f"{r['type']} ({mode})" for r in rows for mode, m in r.get("modes", {}).items()
                  if str(m.get("float64", "")).startswith("ill-conditioned")})
    reasons: collections.Counter[str] = collections.Counter()
    for r in with_attention:
        if r["type"] not in every:
            for x in {_short(x) for x in _reasons(r)}:
                reasons[x] += 1
    line = (f"{len(every)} of {len(with_attention)} model types with softmax attention fully rewritten "
            f"({100.0 * len(every) / len(with_attention) if with_attention else 0:.0f}%) in every mode they run")
    return {"status": dict(status), "with_attention": len(with_attention), "fully_rewritten": len(every),
            "fully_rewritten_types": every, "per_mode": per_mode, "wrong": wrong, "attnopt_errors": errors,
            "not_fused_at_run_time": silent, "ill_conditioned": ill, "reasons": dict(reasons.most_common()),
            "line": line}


def markdown(res: dict[str, Any]) -> str:
    env, summary, rows = res["env"], res["summary"], res["rows"]
    lines = ["# attnopt on Hugging Face transformers' model types", "", f"`{env['command']}`", "",
             f"transformers {env['transformers']}, torch {env['torch']}, attnopt {env['attnopt']} "
             f"({env.get('git', '?')}), {env['cpu']}, {env['threads']} thread(s) per model, {env['jobs']} at a "
             f"time, variant `{env['variant']}`, B={env['batch']}, T={env['seq']}, tolerance {env['tol']:g}. "
             f"{len(rows)} model types in {env['total_s'] / 60:.0f} min.", "",
             f"**{summary['line']}.**", ""]
    mode_rows = [[mode, f"{v['full']} of {v['compared']}", f"{v['pct']:.0f}%"]
                 for mode, v in summary["per_mode"].items()]
    lines += [tabulate(mode_rows, ["mode", "fully rewritten (of the types compared in it)", "%"],
                       tablefmt="github"), ""]
    lines += ["Wrong outputs or gradients (attnopt differs from eager): "
              + (", ".join(summary["wrong"]) if summary["wrong"] else "**0**") + ".", "",
              "Errors inside attnopt: " + (", ".join(summary["attnopt_errors"]) or "none") + ".", "",
              "Ill-conditioned (eager fp32 itself far from float64; attnopt no further from it than eager, so "
              "counted equal): " + (", ".join(summary.get("ill_conditioned", [])) or "none") + ".", "",
              "Every site rewritten and outputs equal, but an attention call did not run what its site chose "
              "(the plain path, or no site at all): "
              + (", ".join(summary["not_fused_at_run_time"]) or "none") + ".", "",
              "Model types by outcome: " + ", ".join(f"{k} {v}" for k, v in sorted(summary["status"].items(),
                                                                                  key=lambda kv: -kv[1])) + ".", ""]
    if summary["reasons"]:
        lines += ["## Why types with attention are not fully rewritten (types per reason)", "",
                  tabulate([[n, r] for r, n in summary["reasons"].items()], ["types", "reason"], tablefmt="github"), ""]
    table = []
    for r in sorted((r for r in rows if r.get("status") == "ok"), key=lambda r: r["type"]):
        ms = r.get("modes", {})
        first = next(iter(ms.values()), {})
        table.append([r["type"], r.get("model_class", ""), f"{r.get('attention_calls', 0)}",
                      f"{first.get('rewritten', 0)}/{first.get('sites', 0)}" if first.get("status") == "ok" else "-",
                      *(_cell(ms.get(m)) for m in MODES), _fused(r),
                      "; ".join(x[:160] for x in _reasons(r)).replace("|", "/")])
    lines += ["## Model types with softmax attention", "",
              "`attention`: softmax calls feeding a product in one eager forward; `rewritten`: sites rewritten / "
              "found by attnopt (no_mask); per mode `yes` = fully rewritten, `N/M` = sites rewritten/found with "
              "outputs equal; `fused calls`: per mode (no_mask · right_pad · left_pad · train) the site calls that "
              "ran SDPA, FlexAttention or the tiled kernel, `+Nm` those that ran the plain computation because the "
              "selector chose it at these shapes, `+NP` the plain computation where it was not chosen, then `of` "
              "the eager forward's attention calls.", "",
              tabulate(table, ["type", "class", "attention", "rewritten", *MODES, "fused calls", "reasons"],
                       tablefmt="github"), ""]
    other = [[r["type"], r.get("model_class", ""), r.get("status"),
              re.sub(r"^Recipe\(.*?\): ", "", r.get("error") or "").replace("|", "/")[:200]]
             for r in sorted(rows, key=lambda r: r["type"]) if r.get("status") != "ok"]
    if other:
        lines += ["## Other model types (not counted)", "",
                  "`no softmax attention`: no softmax feeding a product in the eager forward (attnopt's output "
                  "checked in no_mask); `random forward`: two eager forwards differ; `build failed` / "
                  "`eager failed`: the tiny config or the dummy inputs do not fit the model (not attnopt's).", "",
                  tabulate(other, ["type", "class", "outcome", "error"], tablefmt="github"), ""]
    return "\n".join(lines)


def _git() -> str:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python " + shlex.join(sys.argv if argv is None else [sys.argv[0], *argv])
    print(f"command: {command}", flush=True)
    os.environ.setdefault("ATTNOPT_CACHE_DIR", _scratch(prefix="attnopt-hf-cache-"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs and weights are built here; nothing is downloaded
    import transformers

    transformers.logging.set_verbosity_error()
    types = hf_zoo.model_types()
    if args.only:
        wanted = [t.strip() for t in args.only.split(",") if t.strip()]
        unknown = [t for t in wanted if t not in types]
        if unknown:
            raise SystemExit(f"unknown model type(s) {unknown}; see hf_zoo.model_types()")
        types = wanted
    if args.limit is not None:
        types = types[:args.limit]
    json_path, md_path = args.out / "transformers.json", args.out / "transformers.md"
    if args.report:
        res = json.loads(json_path.read_text())
        res["summary"] = summarise(res["rows"], [m for m in res["env"].get("modes", ",".join(MODES)).split(",") if m])
        write_atomic(json_path, json.dumps(res, indent=1, default=str) + "\n")
        write_atomic(md_path, markdown(res))
        print(f"wrote {md_path} from {json_path}")
        return 0
    done: dict[str, dict[str, Any]] = {}
    if args.resume and json_path.exists():
        done = {r["type"]: r for r in json.loads(json_path.read_text())["rows"] if r["type"] in types}
        print(f"resuming: {len(done)} model types already done", flush=True)
    start = time.perf_counter() - sum(r.get("wall_s", 0.0) for r in done.values()) / max(args.jobs, 1)
    env = {"command": command, "transformers": transformers.__version__, "torch": torch.__version__,
           "attnopt": attnopt.__version__, "attnopt_path": str(Path(attnopt.__file__).parent), "git": _git(),
           "cpu": cpu_name(), "cpu_count": os.cpu_count(),
           "python": platform.python_version(), "threads": args.threads, "jobs": args.jobs,
           "variant": args.variant, "batch": args.batch, "seq": args.seq, "tol": args.tol,
           "timeout_s": args.timeout, "modes": args.modes, "loadavg_1min_before": os.getloadavg()[0]}
    modes = [m for m in args.modes.split(",") if m]

    def result() -> dict[str, Any]:
        rows = [done[t] for t in types if t in done]
        env["total_s"] = time.perf_counter() - start
        return {"env": env, "summary": summarise(rows, modes), "rows": rows}

    def on_row(t: str, row: dict[str, Any]) -> None:
        ms = row.get("modes", {})
        print(f"[{len(done)}/{len(types)}] {t:32s} {row.get('status', '?'):22s} "
              + " ".join(f"{m}={_cell(v)}" for m, v in ms.items())
              + (f"  {row.get('error', '')[:120]}" if row.get("error") else "")
              + f"  {row.get('wall_s', 0):.0f}s", flush=True)
        write_atomic(json_path, json.dumps(result(), indent=1, default=str) + "\n")

    sweep(types, args, done, on_row)
    res = result()
    res["env"]["loadavg_1min_after"] = os.getloadavg()[0]
    md = markdown(res)
    write_atomic(json_path, json.dumps(res, indent=1, default=str) + "\n")
    write_atomic(md_path, md)
    print()
    print("**" + res["summary"]["line"] + "**")
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
