"""benchmarks/gpu_check.py keeps working without a GPU: its dry run, its acceptance rule and its time limits."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import attnopt
from attnopt.kernels.reference import reference_attention

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"


def _load_script():
    sys.path.insert(0, str(SCRIPT.parent))  # it imports bench_core, as when run as a script
    try:
        spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpu_check"] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(SCRIPT.parent))


gpu_check = _load_script()


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("gpu_check")
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out)], capture_output=True,
                          text=True, timeout=300, env=env)
    return proc, out


def test_dry_run_exits_0_and_writes_every_section(dry_run):
    proc, out = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "gpu_check.json").read_text())
    assert doc["dry_run"] is True and doc["exit_status"] == 0
    assert set(doc["sections"]) == set(gpu_check.SECTIONS)
    for name, sec in doc["sections"].items():
        assert sec["status"] == "ok", (name, sec.get("error"), sec.get("traceback"))
        assert sec["wall_s"] > 0
        assert f"[{name}] ok in" in proc.stdout  # one progress line per section
    env = doc["env"]
    assert env["torch"] == torch.__version__ and env["attnopt"] == attnopt.__version__
    assert {"cuda", "device_name", "command"} <= set(env)
    md = (out / "gpu_check.md").read_text()
    for title in ("Correctness", "Peak memory", "Selector", "Profiler"):
        assert title in md


def test_dry_run_checks_every_cpu_candidate_in_float32(dry_run):
    _, out = dry_run
    doc = json.loads((out / "gpu_check.json").read_text())
    results = doc["sections"]["correctness"]["results"]
    cpu = [n for n in attnopt.candidate_names() if attnopt.get_candidate(n).available(torch.device("cpu")) is None]
    assert {"math", "sdpa", "tiled64"} <= set(cpu)
    for name in cpu:
        rows = [r for r in results if r["candidate"] == name and r["dtype"] == "float32" and r["status"] != "skipped"]
        assert rows, f"{name} was not checked in float32"
        for r in rows:
            assert r["status"] == "pass" and r["pass"] is True, r
            assert set(r["errors"]) == set(gpu_check.TENSORS)
            assert r["max_err_vs_ref"] <= 1e-4
    costly = [n for n in cpu if getattr(attnopt.get_candidate(n), "costly", False)]
    cheap = [n for n in cpu if n not in costly]
    cases = {r["case"] for r in results if r["candidate"] in cheap and r["status"] == "pass"}
    assert cases == set(gpu_check.CASES)
    assert {r["dtype"] for r in results if r["status"] == "pass"} == {"float32", "bfloat16"}
    for name in ("sdpa_cudnn", "sdpa_efficient"):  # CUDA-only: recorded as such, not run
        assert {r["status"] for r in results if r["candidate"] == name} <= {"unavailable"}


def test_dry_run_figures(dry_run):
    _, out = dry_run
    secs = json.loads((out / "gpu_check.json").read_text())["sections"]
    memory = secs["memory"]["bytes"]
    assert memory["math"]["forward"] > memory["sdpa"]["forward"] > 0  # the plain path holds the scores
    assert memory["tiled64"]["forward_backward"] > 0
    points = secs["selector"]["points"]
    assert [(p["B"], p["T"]) for p in points] == [(1, 16), (1, 32)]
    for p in points:
        assert p["status"] == "ok" and p["rewritten"] == 1
        (chosen,) = p["chosen"].values()
        assert chosen in attnopt.candidate_names() and chosen in next(iter(p["tuning"].values()))["timings_ms"]
        assert all(p["ms"][n] > 0 for n in ("eager", "sdpa", "attnopt"))
        assert p["max_abs_diff_vs_eager"] < 1e-4
    prof = secs["profile"]
    assert {r["variant"] for r in prof["records"]} == {"eager", "auto"}
    assert all(r["status"] == "ok" and r["idle_gap_note"] == "n/a on CPU" for r in prof["records"])
    traces = [f for f in prof["files"] if f.startswith("gpu_check_profile/traces/")]
    assert len(traces) == 2 and all((out / f).is_file() for f in traces)


def _case(dtype: torch.dtype):
    plan = gpu_check.Plan(device="cpu", dry_run=True, dtypes=("float32",), check_shape=(2, 4, 2, 24, 8),
                          memory_shape=(1, 1, 1, 1), memory_dtype="float32", block_dtypes=(), batch_sizes=(),
                          seq_lens=(), n_embd=0, n_head=0, repeats=1, warmup=0, profile_seq_len=1,
                          profile_repeats=1, max_scores_bytes=0)
    return gpu_check.make_case(plan, "padding", dtype)


def test_the_rule_fails_a_wrong_kernel_and_passes_a_more_accurate_one():
    c = _case(torch.float32)
    assert gpu_check.check_candidate(reference_attention, c, torch.float32)["status"] == "pass"

    def off_by_a_little(q, k, v, **kw):
        return reference_attention(q, k, v, **kw) * 1.001

    row = gpu_check.check_candidate(off_by_a_little, c, torch.float32)
    assert row["status"] == "fail" and not row["errors"]["out"]["pass"] and "out:" in row["why"]

    def ignores_the_mask(q, k, v, **kw):
        return reference_attention(q, k, v, **dict(kw, attn_mask=None))

    assert gpu_check.check_candidate(ignores_the_mask, c, torch.float32)["status"] == "fail"

    def raises(q, k, v, **kw):
        raise RuntimeError("no kernel")

    assert gpu_check.check_candidate(raises, c, torch.float32) == {"status": "raised", "pass": None,
                                                                   "error": "RuntimeError: no kernel"}
    # bfloat16: rounded once from float64, at least as accurate as the bf16 reference
    h = _case(torch.bfloat16)
    exact, ref = h.ref64["out"], h.ref["out"]
    got = gpu_check.compare(exact.to(torch.bfloat16), ref, exact, torch.bfloat16)
    assert got["pass"] and got["max_err_vs_f64"] <= got["ref_max_err_vs_f64"]
    # beyond the tolerance of a (here: deliberately poor) reference, yet closer to float64: passes by the second rule
    got = gpu_check.compare(exact.to(torch.bfloat16), ref + 0.1, exact, torch.bfloat16)
    assert got["pass"] and got["rule"] == "no less accurate than the reference"
    # beyond the tolerance and further from float64 than the reference: fails
    got = gpu_check.compare(ref + 0.1, ref, exact, torch.bfloat16)
    assert not got["pass"] and "from float64" in got["why"]


def test_a_failing_or_slow_section_is_recorded_and_the_next_runs():
    doc = {"sections": {}}

    def broken(rec, budget):
        rec["line"] = "started"
        raise ValueError("bad")

    def slow(rec, budget):
        rec["done"] = 1
        time.sleep(30)  # the alarm interrupts it

    def polite(rec, budget):
        rec["items"] = []
        while not budget.spent():
            rec["items"].append(1)
            time.sleep(0.01)
        rec["skipped_for_budget"] = 1

    start = time.perf_counter()
    assert gpu_check.run_section("a", broken, 5, doc, device="cpu")["status"] == "error"
    assert gpu_check.run_section("b", slow, 0.1, doc, device="cpu", hard_s=0.5)["status"] == "timeout"
    assert gpu_check.run_section("c", polite, 0.2, doc, device="cpu")["status"] == "partial"
    assert time.perf_counter() - start < 25  # the 30 s sleep was cut short (loose: a loaded CI machine is slow)
    a, b, c = (doc["sections"][n] for n in "abc")
    assert a["error"] == "ValueError: bad" and "Traceback" in a["traceback"]
    assert b["done"] == 1 and "hard limit" in b["error"] and b["wall_s"] < 2
    assert c["items"] and math.isclose(c["budget_s"], 0.2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_asking_for_cuda_without_it_exits_2(capsys):
    assert gpu_check.main(["--device", "cuda", "--out", "/nonexistent"]) == 2
    assert gpu_check.main(["--out", "/nonexistent"]) == 2  # no --dry-run and no GPU: nothing sensible to run
    assert "needs CUDA" in capsys.readouterr().err
