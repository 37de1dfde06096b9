"""``attnopt profile compare``: verdicts that know the noise, environment differences, exit status."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema

from attnopt.__main__ import main
from attnopt.profiling.compare import compare_reports, environment_changes
from attnopt.profiling.report import REPORT_SCHEMA
from attnopt.profiling.run import _record, profile


def _report(records: list[dict], **env) -> dict:
    environment = {"torch": "2.13.0+cpu", "attnopt": "0.1.0", "python": "3.11", "platform": "linux",
                   "device": "cpu", "device_name": "cpu", "cpu_count": 2, "threads": 1,
                   "matmul": {"size": 64, "dtype": "float32", "seconds": 1.0, "flops_per_s": 1e10}}
    environment.update(env)
    return {"records": records, "environment": environment}


def _rec(variant: str, ms: float, iqr: float | None = None, peak: int = 1 << 20, status: str = "ok",
         t: int = 64) -> dict:
    s = ms / 1e3
    rec = _record("prefill", 1, t, variant, forward_s=s if status == "ok" else None, peak_bytes=peak,
                  status=status, forward_iqr_s=None if iqr is None else [s * (1 - iqr), s * (1 + iqr)])
    if status != "ok":
        rec["error"] = "RuntimeError: out of memory"
    return rec


def _verdicts(old: list[dict], new: list[dict], **kw) -> dict[str, tuple[str, str]]:
    return {r.variant: (r.time_verdict, r.memory_verdict) for r in compare_reports(_report(old), _report(new), **kw)}


def test_time_verdicts_beyond_the_threshold():
    old = [_rec("a", 10, 0.01), _rec("b", 10, 0.01), _rec("c", 10, 0.01)]
    new = [_rec("a", 8, 0.01), _rec("b", 12, 0.01), _rec("c", 10.3, 0.01)]
    assert _verdicts(old, new) == {"a": ("better", "same"), "b": ("worse", "same"), "c": ("same", "same")}


def test_a_change_inside_the_runs_own_spread_is_the_same():
    old, new = [_rec("a", 10, 0.2)], [_rec("a", 11.5, 0.2)]  # +15%, but each run's quartiles span +-20%
    assert _verdicts(old, new) == {"a": ("same", "same")}
    old, new = [_rec("a", 10, 0.01)], [_rec("a", 11.5, 0.01)]  # the same change on quiet runs
    assert _verdicts(old, new) == {"a": ("worse", "same")}


def test_reports_without_the_spread_use_the_threshold_alone():
    old, new = [_rec("a", 10)], [_rec("a", 10.8)]
    assert _verdicts(old, new) == {"a": ("worse", "same")}
    assert _verdicts(old, new, threshold=0.1) == {"a": ("same", "same")}


def test_memory_and_failures():
    old = [_rec("a", 10, 0.01, peak=100 << 20), _rec("b", 10, 0.01), _rec("c", 10, status="oom")]
    new = [_rec("a", 10, 0.01, peak=120 << 20), _rec("b", 10, status="oom"), _rec("c", 10, 0.01)]
    assert _verdicts(old, new) == {"a": ("same", "worse"), "b": ("failed now", "n/a"), "c": ("fixed", "n/a")}


def test_a_point_missing_from_the_new_report_is_a_regression_and_a_new_one_is_not_compared():
    rows = compare_reports(_report([_rec("a", 10, t=64)]), _report([_rec("a", 10, t=128)]))
    assert [(r.seq_len, r.time_verdict, r.regressed) for r in rows] == [(64, "missing now", True)]
    assert compare_reports(_report([_rec("a", 10, status="oom")]), _report([])) == []  # it failed before too


def test_records_from_an_older_writer_without_a_status_are_read():
    old, new = _rec("a", 10), _rec("a", 13)
    del old["status"], old["forward_iqr_s"]
    assert _verdicts([old], [new]) == {"a": ("worse", "same")}


def test_environment_changes_are_named():
    old, new = _report([]), _report([], torch="2.14.0+cpu", threads=2)
    new["environment"]["matmul"]["flops_per_s"] = 2e10
    assert environment_changes(old, new) == ["torch 2.13.0+cpu -> 2.14.0+cpu", "threads 1 -> 2",
                                             "matmul rate 10.0 -> 20.0 GFLOP/s"]
    assert environment_changes(old, copy.deepcopy(old)) == []


def _write(path: Path, report: dict) -> Path:
    path.write_text(json.dumps(report))
    return path


def test_cli_exit_status_gates_a_regression(tmp_path, capsys):
    old = _write(tmp_path / "old.json", _report([_rec("auto", 10, 0.01), _rec("eager", 20, 0.01)]))
    same = _write(tmp_path / "same.json", _report([_rec("auto", 10.1, 0.01), _rec("eager", 19.9, 0.01)]))
    slower = _write(tmp_path / "slow.json", _report([_rec("auto", 13, 0.01), _rec("eager", 20, 0.01)],
                                                    torch="2.14.0+cpu"))
    assert main(["profile", "compare", str(old), str(same)]) == 0
    out = capsys.readouterr().out
    assert "environment: the same" in out and "no regression beyond 5% (time)" in out
    assert main(["profile", "compare", str(old), str(slower)]) == 1
    out = capsys.readouterr().out
    assert "torch 2.13.0+cpu -> 2.14.0+cpu" in out and "1.30x worse" in out and "1 regression(s)" in out
    assert main(["profile", "compare", str(old), str(slower), "--threshold", "0.5"]) == 0


def test_cli_refuses_what_is_not_a_report(tmp_path, capsys):
    broken = _write(tmp_path / "broken.json", {"records": [{"variant": "a"}]})  # no phase, B, T
    assert main(["profile", "compare", str(broken), str(broken)]) == 2
    assert "a record lacks or mistypes a field" in capsys.readouterr().err
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    assert main(["profile", "compare", str(bad), str(bad)]) == 2
    assert "not an attnopt profile report" in capsys.readouterr().err
    assert main(["profile", "compare", str(tmp_path / "missing.json"), str(bad)]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_a_real_profile_records_the_spread_and_compares_with_itself(tmp_path):
    report = profile("nanogpt", seq_lens=(16,), variants=("eager", "sdpa"), repeats=3, progress=False,
                     matmul_size=64, out=tmp_path / "p")
    jsonschema.validate(report, REPORT_SCHEMA)
    for r in report["records"]:
        q1, q3 = r["forward_iqr_s"]
        assert q1 <= r["forward_s"] <= q3
    rows = compare_reports(report, report)
    assert {r.time_verdict for r in rows} == {"same"} and {r.memory_verdict for r in rows} == {"same"}
