"""Peer-suite benchmark: attnopt and Inductor's ``fuse_attention`` on the spellings of the peer's own tests.

    python benchmarks/bench_peer.py                       # every case (peer_spellings.cases()), ~6 min on 2 CPUs
    python benchmarks/bench_peer.py --no-inductor         # attnopt only (~1 min)
    python benchmarks/bench_peer.py --cases rewriter_18 rewriter_5_v1

The cases are ``benchmarks/peer_spellings.py``: every attention function of PyTorch's
``test/inductor/test_fused_attention.py`` that the peer expects to fuse (plus ``13_non_transpose_permute``),
per dtype the test uses, in ``eval`` (no input requires grad, ``training=False``) and, where the peer runs it,
``train`` (every floating input requires grad, ``training=True``); 84 in all. The peer's refused tests
(``PEER_REFUSED``) are run too and reported apart.

For every case, on CPU:

* **attnopt**: ``attnopt.optimize(model)`` (``--variant``, default ``auto``, with a fresh tuning cache) is
  called once (capture, proof, tuning), then the model as written and the optimized one are called on clones of
  the same inputs, each right after ``torch.manual_seed(1234)``: dropout cases are compared *seeded identically*
  (attnopt computes an active dropout as written, so the same seed draws the same mask; a case where that did
  not hold would show as unequal). In ``train`` the gradients of ``sum(out_i * c_i)`` (fixed random cotangents)
  with respect to every floating input are compared too. Tolerance: the exactness contract's
  (``attnopt.kernels.reference.tolerance``: fp32 1e-4, fp16 5e-3, atol = rtol), gradients 10x; a fp16 case
  outside it still passes when attnopt is no further from a float64 evaluation of the same function than the
  model as written is (the contract for half types). ``attnopt.explain`` gives the sites found, rewritten, and
  the reason and rule for every site left alone. A case counts as *rewritten* when every softmax of its graph is
  rewritten and outputs and gradients are equal.
* **Inductor**: ``torch.compile(model, fullgraph=True)`` (Inductor, this torch's defaults; ``freezing`` for
  ``rewriter_1_freezing``; dim 0 marked dynamic for the symbolic-scale tests, as the peer's dynamic suite does),
  one forward with the same inputs; *fused* when ``torch._dynamo.utils.counters["inductor"]["fuse_attention"]``
  is at least 1. A compile that fails is recorded as such.

Results: a table on stdout, ``benchmarks/results/peer.md`` and ``peer.json`` (every case, reason and the
command), written atomically.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from bench_core import cpu_name, write_atomic
from peer_spellings import PeerCase, cases, refused_cases
from tabulate import tabulate

import attnopt
from attnopt.kernels.reference import tolerance


def _scratch(prefix: str) -> str:
    """A temporary directory removed when the process exits."""
    import atexit
    import shutil

    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, True)
    return path


SEED = 1234


def _error(e: BaseException) -> str:
    """``Type: first line`` of an error, through Inductor's ``BackendCompilerFailed`` wrapper to its cause."""
    inner = getattr(e, "inner_exception", None) or e.__cause__
    msg = f"{type(e).__name__}: " + (f"{type(inner).__name__}: {inner}" if inner is not None else str(e))
    lines = [ln for ln in msg.splitlines() if ln.strip()]
    return (lines[0] if lines else type(e).__name__)[:300]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="*", default=None, help="run only cases whose name contains one of these")
    p.add_argument("--variant", default="auto", help="attnopt.optimize(variant=...)")
    p.add_argument("--no-inductor", action="store_true", help="skip the Inductor runs")
    p.add_argument("--no-refused", action="store_true", help="skip the peer's refused tests")
    p.add_argument("--no-export", action="store_true", help="skip attnopt.rewrite on the torch.export graphs")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results",
                   help="directory for peer.json and peer.md")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- running one side

def _fresh(inputs: tuple[Any, ...]) -> list[Any]:
    """Clones of ``inputs`` that are leaves again (requiring grad where the originals do)."""
    return [x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x for x in inputs]


def _mark(case: PeerCase, inputs: list[Any]) -> None:
    if case.spelling.dynamic:
        for x in inputs[:3]:
            torch._dynamo.mark_dynamic(x, 0)


def _outputs(out: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _run(fn: Any, case: PeerCase, inputs: list[Any]) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """Outputs of ``fn(*inputs)`` seeded with ``SEED``, and in ``train`` the input gradients."""
    torch.manual_seed(SEED)
    grad_mode = torch.no_grad() if case.spelling.freezing else contextlib.nullcontext()
    with grad_mode:
        outs = _outputs(fn(*inputs))
    if not case.train:
        return [o.detach() for o in outs], []
    gen = torch.Generator().manual_seed(7)
    loss = sum((o.float() * torch.randn(o.shape, generator=gen)).sum() for o in outs if o.requires_grad)
    leaves = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [o.detach() for o in outs], list(grads)


def _close(a: torch.Tensor, b: torch.Tensor, factor: float = 1.0) -> bool:
    atol, rtol = tolerance(b.dtype)
    return a.shape == b.shape and torch.allclose(a.double(), b.double(), atol=atol * factor, rtol=rtol * factor,
                                                 equal_nan=True)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    d = (a.double() - b.double()).abs()
    d = d[~torch.isnan(d)]
    return d.max().item() if d.numel() else 0.0


def _float64_reference(case: PeerCase, inputs: tuple[Any, ...]) -> tuple[list[torch.Tensor], list[Any]] | None:
    """The same function in float64 (inputs upcast), where it runs (a hard-coded ``.to(float16)`` keeps half)."""
    module, _ = case.build()
    up = [x.detach().double().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) and x.is_floating_point()
          else x for x in inputs]
    try:
        return _run(module, case, up)
    except Exception:  # noqa: BLE001 - no float64 evaluation: the half-type rule cannot be applied
        return None


def _compare(case: PeerCase, inputs: tuple[Any, ...], ref: tuple[list, list], got: tuple[list, list]) -> str | None:
    """None when attnopt's outputs and gradients equal the model's as written (see the module docstring)."""
    (ro, rg), (go, gg) = ref, got
    if len(ro) != len(go):
        return f"{len(go)} outputs instead of {len(ro)}"
    pairs = [(f"output {i}", a, b, 1.0) for i, (a, b) in enumerate(zip(go, ro))]
    pairs += [(f"gradient {i}", a, b, 10.0) for i, (a, b) in enumerate(zip(gg, rg)) if a is not None or b is not None]
    bad = []
    for what, a, b, factor in pairs:
        if a is None or b is None:
            bad.append(f"{what}: missing")
        elif not _close(a, b, factor):
            bad.append((what, a, b))
    if not bad:
        return None
    if any(isinstance(x, str) for x in bad) or case.dtype not in (torch.float16, torch.bfloat16):
        return "; ".join(x if isinstance(x, str) else f"{x[0]} differs by {_max_diff(x[1], x[2]):.3g}" for x in bad)
    exact = _float64_reference(case, inputs)  # the half-type contract: no less accurate than as written
    if exact is None:
        return "; ".join(f"{w} differs by {_max_diff(a, b):.3g} (no float64 evaluation)" for w, a, b in bad)
    names = {f"output {i}": t for i, t in enumerate(exact[0])} | {f"gradient {i}": t for i, t in enumerate(exact[1])}
    worse = []
    for what, a, b, _ in bad:
        e = names.get(what)
        atol, _ = tolerance(b.dtype)
        if e is None or _max_diff(a, e) > _max_diff(b, e) + atol:
            worse.append(f"{what} differs by {_max_diff(a, b):.3g} and is further from float64")
    return "; ".join(worse) or None


def run_attnopt(case: PeerCase, variant: str) -> dict[str, Any]:
    module, inputs = case.build()
    torch._dynamo.reset()
    start = time.perf_counter()
    row: dict[str, Any] = {}
    try:
        ref = _run(module, case, _fresh(inputs))
        opt = attnopt.optimize(copy.deepcopy(module), variant=variant)
        warm = _fresh(inputs)
        _mark(case, warm)
        with torch.no_grad() if case.spelling.freezing else contextlib.nullcontext():
            opt(*warm)  # capture, proof and tuning (in the grad mode compared), outside the seeded comparison
        mine = _fresh(inputs)
        _mark(case, mine)
        got = _run(opt, case, mine)
        report = attnopt.explain(opt)
    except Exception as e:  # noqa: BLE001 - a failing case is a result
        return {"error": _error(e), "rewritten": 0, "sites": 0, "equal": False, "left_alone": [],
                "s": time.perf_counter() - start}
    records = list(report.records)
    row["sites"] = len(records)
    row["rewritten"] = sum(1 for r in records if r.decision == "rewritten")
    row["left_alone"] = [{"decision": r.decision, "rule": r.extra.get("rule"), "reason": r.reason,
                          "where": f"{r.module_path} {r.source}".strip()} for r in records if r.decision != "rewritten"]
    row["specs"] = sorted({r.reason for r in records if r.decision == "rewritten"})
    problem = _compare(case, inputs, ref, got)
    row["equal"] = problem is None
    if problem:
        row["problem"] = problem
    row["s"] = time.perf_counter() - start
    return row


def run_export(case: PeerCase, variant: str) -> dict[str, Any]:
    """``attnopt.rewrite`` on the ATen graph ``torch.export.export(model).module()`` (static shapes),
    outputs and gradients compared with that graph as written, seeded like the attnopt run."""
    module, inputs = case.build()
    start = time.perf_counter()
    try:
        gm = torch.export.export(module, tuple(_fresh(inputs))).module()
        new = attnopt.rewrite(gm, tuple(_fresh(inputs)), variant=variant)
        ref = _run(gm, case, _fresh(inputs))
        got = _run(new, case, _fresh(inputs))
    except Exception as e:  # noqa: BLE001 - export or the rewrite failing is a result
        return {"error": _error(e), "rewritten": 0, "sites": 0, "equal": False, "s": time.perf_counter() - start}
    records = list(new.meta["attnopt_report"].records)
    problem = _compare(case, inputs, ref, got)
    row = {"sites": len(records), "rewritten": sum(1 for r in records if r.decision == "rewritten"),
           "equal": problem is None, "left_alone": [r.reason for r in records if r.decision != "rewritten"],
           "s": time.perf_counter() - start}
    if problem:
        row["problem"] = problem
    return row


def run_inductor(case: PeerCase) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    module, inputs = case.build()
    torch._dynamo.reset()
    counters.clear()
    start = time.perf_counter()
    args = _fresh(inputs)
    _mark(case, args)
    # no cached graphs: a cache hit skips the pattern passes, and with them the counter
    patch = torch._inductor.config.patch(freezing=case.spelling.freezing, fx_graph_cache=False,
                                         fx_graph_remote_cache=False)
    try:
        with patch, torch._functorch.config.patch(enable_autograd_cache=False):
            compiled = torch.compile(module, fullgraph=True)
            torch.manual_seed(SEED)
            grad_mode = torch.no_grad() if case.spelling.freezing else contextlib.nullcontext()
            with grad_mode:
                compiled(*args)  # the joint (train) or inference graph is compiled here, with the fusion passes
    except Exception as e:  # noqa: BLE001 - Inductor failing to compile here is a result
        return {"fused": False, "error": _error(e), "s": time.perf_counter() - start}
    return {"fused": counters["inductor"]["fuse_attention"] >= 1,
            "fuse_attention": counters["inductor"]["fuse_attention"], "s": time.perf_counter() - start}


# ----------------------------------------------------------------------------- the report

def case_ok(row: dict[str, Any], side: str = "attnopt") -> bool:
    a = row.get(side) or {}
    return a.get("sites", 0) > 0 and a.get("rewritten") == a.get("sites") and a.get("equal", False)


def _export_cell(row: dict[str, Any]) -> str:
    e = row.get("export")
    if e is None:
        return "-"
    if case_ok(row, "export"):
        return "yes"
    if "error" in e:
        return f"error: {e['error'][:80]}"
    return "; ".join(dict.fromkeys([*(str(x) for x in e.get("left_alone", [])), *(
        [f"NOT EQUAL: {e.get('problem')}"] if not e.get("equal", True) else [])])) or "no softmax found"


def _reason(row: dict[str, Any]) -> str:
    a = row["attnopt"]
    if "error" in a:
        return f"error: {a['error']}"
    parts = [f"[{x['rule']}] {x['reason']}" if x.get("rule") else str(x["reason"]) for x in a["left_alone"]]
    if not a.get("equal", True):
        parts.append(f"NOT EQUAL: {a.get('problem')}")
    if a.get("sites", 0) == 0:
        parts.append("no softmax found")
    return "; ".join(dict.fromkeys(parts))


def markdown(res: dict[str, Any]) -> str:
    env = res["env"]
    lines = ["# attnopt on the peer suite's spellings", "", f"`{env['command']}`", "",
             f"torch {env['torch']}, attnopt {env['attnopt']}, {env['cpu']}, {env['threads']} thread(s), "
             f"attnopt variant `{env['variant']}`. Cases: `benchmarks/peer_spellings.py` (PyTorch's "
             "`test/inductor/test_fused_attention.py`, each attention per dtype and eval/train). Total "
             f"{env['total_s']:.0f} s.", "", "**" + res["summary"]["line"] + "**", ""]
    head = ["case", "peer test", "attnopt", "sites", "Inductor", "attnopt: why not / what differs",
            "attnopt.rewrite on torch.export"]
    for title, key in (("Positive cases", "cases"), ("The peer's refused tests", "refused")):
        rows = res.get(key) or []
        if not rows:
            continue
        table = []
        for r in rows:
            a, i = r["attnopt"], r.get("inductor")
            table.append([r["name"], r["peer_test"].replace("_test_", ""),
                          "yes" if case_ok(r) else "no", f"{a.get('rewritten', 0)}/{a.get('sites', 0)}",
                          "-" if i is None else ("fused" if i["fused"] else ("error" if "error" in i else "no")),
                          _reason(r), _export_cell(r)])
        lines += [f"## {title}", "", tabulate(table, head, tablefmt="github"), ""]
    errors = [(r["name"], r["inductor"]["error"]) for r in res.get("cases", []) + res.get("refused", [])
              if r.get("inductor") and "error" in r["inductor"]]
    if errors:
        lines += ["## Inductor errors", "", *(f"- {n}: {e}" for n, e in errors), ""]
    return "\n".join(lines)


def summarise(rows: list[dict[str, Any]], inductor: bool, export: bool) -> dict[str, Any]:
    m = len(rows)
    n = sum(case_ok(r) for r in rows)
    e = sum(case_ok(r, "export") for r in rows) if export else None
    wrong = sum(1 for r in rows if r["attnopt"].get("rewritten", 0) and not r["attnopt"].get("equal", True))
    k = sum(1 for r in rows if r.get("inductor", {}).get("fused")) if inductor else None
    line = f"attnopt {n}/{m} rewritten with outputs and gradients equal"
    line += f", Inductor {k}/{m} fused" if inductor else ", Inductor not run"
    if wrong:
        line += f" ({wrong} rewritten case(s) NOT equal)"
    if export:
        line += f"; attnopt.rewrite on the torch.export graphs {e}/{m}"
    return {"attnopt": n, "inductor": k, "export": e, "total": m, "wrong": wrong, "line": line}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python " + shlex.join(sys.argv if argv is None else [sys.argv[0], *argv])
    print(f"command: {command}", flush=True)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("ATTNOPT_CACHE_DIR", _scratch(prefix="attnopt-peer-"))
    start = time.perf_counter()
    groups = {"cases": cases(), "refused": [] if args.no_refused else refused_cases()}
    res: dict[str, Any] = {}
    for key, group in groups.items():
        rows = []
        for case in group:
            if args.cases and not any(s in case.name for s in args.cases):
                continue
            row = {"name": case.name, "peer_test": case.peer_test, "dtype": str(case.dtype).replace("torch.", ""),
                   "mode": "train" if case.train else "eval", "dropout": case.dropout,
                   "peer_positive": case.spelling.peer_positive, "must_refuse": case.spelling.must_refuse,
                   "attnopt": run_attnopt(case, args.variant)}
            if not args.no_export:
                row["export"] = run_export(case, args.variant)
            if not args.no_inductor:
                row["inductor"] = run_inductor(case)
            rows.append(row)
            ind = row.get("inductor")
            print(f"{case.name:45s} attnopt {'yes' if case_ok(row) else 'no ':3s} "
                  f"export {'-' if 'export' not in row else 'yes' if case_ok(row, 'export') else 'no '} "
                  f"{row['attnopt'].get('rewritten', 0)}/{row['attnopt'].get('sites', 0)}"
                  f"{'' if ind is None else ('  inductor fused' if ind['fused'] else '  inductor no')}"
                  f"  {'' if case_ok(row) else _reason(row)[:160]}", flush=True)
        res[key] = rows
    res["summary"] = summarise(res["cases"], not args.no_inductor, not args.no_export)
    refused = res.get("refused") or []
    if refused:
        look = [r for r in refused if r["must_refuse"]]
        res["summary"]["refused_line"] = (
            f"peer-refused tests: attnopt rewrites {sum(case_ok(r) for r in refused if not r['must_refuse'])}/"
            f"{sum(1 for r in refused if not r['must_refuse'])} exact ones and leaves "
            f"{sum(1 for r in look if r['attnopt'].get('rewritten', 0) == 0)}/{len(look)} look-alikes alone")
    res["env"] = {"command": command, "torch": torch.__version__, "attnopt": attnopt.__version__,
                  "variant": args.variant, "threads": torch.get_num_threads(), "cpu": cpu_name(),
                  "python": platform.python_version(), "total_s": time.perf_counter() - start}
    md = markdown(res)
    if refused:
        md = md.replace("**\n", "**\n\n" + res["summary"]["refused_line"] + "\n", 1)
    print()
    print(md)
    write_atomic(args.out / "peer.json", json.dumps(res, indent=2, default=str) + "\n")
    write_atomic(args.out / "peer.md", md)
    print(f"wrote {args.out / 'peer.json'} and {args.out / 'peer.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
