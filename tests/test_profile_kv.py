"""``attnopt profile --phase decode``: what the KV cache costs, and how many sequences fit a budget."""

from __future__ import annotations

import jsonschema

from attnopt.__main__ import main
from attnopt.profiling.report import REPORT_SCHEMA
from attnopt.profiling.run import profile


def test_decode_records_the_kv_cache_and_the_summary_says_what_fits():
    report = profile("nanogpt", seq_lens=(16,), phase="decode", variants=("eager", "sdpa"), repeats=1,
                     progress=False, matmul_size=64, kv_budget="1MiB")
    jsonschema.validate(report, REPORT_SCHEMA)
    by = {r["variant"]: r for r in report["records"]}
    assert by["eager"]["kv_bytes_per_token"] is None  # the model as written recomputes: no cache
    sdpa = by["sdpa"]
    assert sdpa["decode_method"] == "kv_cache"
    per = sdpa["kv_bytes_per_token"]
    assert per > 0 and sdpa["kv_context_bytes"] == per * 1 * 17  # B=1, T + 1 positions
    (line,) = [s for s in report["summary"] if "KV cache" in s]
    assert f"{per} B per position per sequence" in line
    assert f"{2**20 // (per * 17)} concurrent sequence(s) of 17 positions fit" in line
    assert report["options"]["kv_budget"] == 2**20


def test_a_bad_kv_budget_is_refused_before_anything_runs(capsys, tmp_path):
    assert main(["profile", "nanogpt", "--kv-budget", "lots", "--seq-lens", "16", "--no-progress",
                 "--out", str(tmp_path)]) == 2
    assert "cannot read kv_budget 'lots'" in capsys.readouterr().err
    assert not (tmp_path / "report.json").exists()
