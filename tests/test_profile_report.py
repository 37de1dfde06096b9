"""One real sweep (a tiny causal LM, training steps at B 1 and 2) checked for the breakdown, the training step, the
memory timelines, the batch-size sweeps, the plots and ``report.html`` (rendered in headless Chromium when installed).

The numbers are checked for consistency (parts adding up to wholes, real aten ops, real module paths, backward
inside the step), not speed.
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import torch

from attnopt.__main__ import main
from attnopt.profiling.breakdown import ROOT_MODULE
from attnopt.profiling.report import REPORT_SCHEMA, plot
from attnopt.profiling.run import _record, profile
from tests.test_profile import FACTORY

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> tuple[dict, Path, torch.nn.Module]:
    folder = tmp_path_factory.mktemp("sweep")
    (folder / "tiny_lm.py").write_text(FACTORY)
    out = folder / "prof"
    report = profile(f"{folder / 'tiny_lm.py'}:build", batch_sizes=(1, 2), seq_lens=(8,), phase="train",
                     variants=("eager", "sdpa"), repeats=2, progress=False, matmul_size=64, out=out,
                     memory_timeline=True, memory_budget=10**9)
    sys.path.insert(0, str(folder))
    try:
        import tiny_lm
    finally:
        sys.path.remove(str(folder))
    return report, out, tiny_lm.build()[0]


def _by(report: dict) -> dict:
    return {(r["phase"], r["batch_size"], r["variant"]): r for r in report["records"]}


def test_the_report_validates_and_every_point_has_a_breakdown_that_adds_up(sweep):
    report, out, model = sweep
    assert json.loads((out / "report.json").read_text()) == report
    jsonschema.validate(report, REPORT_SCHEMA)
    assert len(report["records"]) == 4 and all(r["status"] == "ok" for r in report["records"])
    paths = {name for name, _ in model.named_modules()} | {ROOT_MODULE}
    for r in report["records"]:
        bd = r["breakdown"]
        assert bd["calls"] == 3 and bd["time"] == "cpu"
        assert bd["attention_s"] > 0 and bd["rest_s"] > 0
        assert bd["attention_s"] + bd["rest_s"] == pytest.approx(bd["total_s"])
        parts = sum(op["self_s"] for op in bd["ops"]) + sum(bd["outside_ops_s"].values())
        assert parts == pytest.approx(bd["total_s"], rel=1e-6)
        assert all(op["self_s"] <= op["total_s"] + 1e-9 for op in bd["ops"])
        for op in bd["ops"][:5]:  # the largest are real aten operators
            namespace, _, name = op["name"].partition("::")
            assert namespace == "aten" and hasattr(torch.ops.aten, name), op["name"]
        attention = {op["name"] for op in bd["ops"] if op["attention"] and op["pass"] == "forward"}
        if r["variant"] == "eager":  # the captured region: the products and the softmax as written
            assert {"aten::matmul", "aten::_softmax"} <= attention or {"aten::bmm", "aten::_softmax"} <= attention
            assert {m["path"] for m in bd["modules"]} <= paths
            assert sum(m["self_s"] for m in bd["modules"]) == pytest.approx(bd["total_s"], rel=1e-6)
            assert bd["modules"][0]["path"] == ROOT_MODULE and bd["modules"][0]["total_s"] == bd["total_s"]
        else:  # the rewritten site runs SDPA; a compiled variant's modules are not visible
            assert "aten::scaled_dot_product_attention" in attention
            assert bd["modules"] is None and "compiled" in bd["modules_note"]
    assert "h.0" not in paths  # the tiny LM has no blocks: the module names above are its own
    eager = _by(report)["train", 2, "eager"]["breakdown"]
    assert {m["path"] for m in eager["modules"]} >= {"emb", "qkv", "head"}


def test_train_runs_forward_and_backward_and_reports_the_backward(sweep):
    from attnopt.selection.measure import peak_memory

    report, _, model = sweep
    by = _by(report)
    paths = {name for name, _ in model.named_modules()}
    for b in (1, 2):
        inference_peak = peak_memory(model.eval(), torch.randint(0, 32, (b, 8)))
        for v in ("eager", "sdpa"):
            train = by["train", b, v]
            assert train["phase"] == "train" and 0 < train["backward_s"] < train["forward_s"]
            bd = train["breakdown"]
            assert 0 < bd["backward_s"] < bd["total_s"]
            backward = {op["name"] for op in bd["ops"] if op["pass"] == "backward"}
            assert "aten::mm" in backward or "aten::addmm" in backward
            # the attention's own backward is tied to its sites by autograd's sequence numbers
            assert any(op["attention"] for op in bd["ops"] if op["pass"] == "backward")
            # the forward's two products over the causal entries (B x 2 heads x 36 of 8 x 8, head dims 8 + 8),
            # and the backward's four (dV, dP, dQ, dK)
            assert train["attention_flops"] == 3 * 2 * (b * 2 * 36) * 16
            assert train["peak_bytes"] > inference_peak  # saved activations and gradients
            peak = train["peak_op"]
            if v == "eager" and peak["backward"]:  # named by the forward op that made the graph node
                assert peak["module"] in paths, peak
    eager_backward = {op["name"] for op in by["train", 2, "eager"]["breakdown"]["ops"]
                      if op["pass"] == "backward" and op["attention"]}
    assert "aten::_softmax_backward_data" in eager_backward
    assert any(line.startswith("train, B=2, T=8: the eager backward takes") for line in report["summary"])


def test_memory_timelines_batch_sweeps_and_plots_are_written(sweep):
    report, out, _ = sweep
    names = {Path(p).name for p in report["plots"]}
    assert {"breakdown.png", "batch_size.png", "memory_train_B1_T8.png", "memory_train_B2_T8.png"} <= names
    assert "kv_cache.png" not in names  # no decode point
    for p in report["plots"]:
        assert Path(p).read_bytes()[:8] == PNG
    assert all(r["memory_plot"] == str(out / f"memory_{r['phase']}_B{r['batch_size']}_T8.png")
               for r in report["records"])
    sweeps = {(s["phase"], s["variant"]) for s in report["batch_sweeps"]}
    assert sweeps == {("train", v) for v in ("eager", "sdpa")}
    for s in report["batch_sweeps"]:
        assert s["batch_sizes"] == [1, 2] and s["first_failure"] is None and s["first_over_budget"] is None
        assert s["tokens_per_s"] == [pytest.approx(b * 8 / lat) for b, lat in zip((1, 2), s["latency_s"])]
    assert sum("throughput" in line for line in report["summary"]) == 2


def test_the_kv_cache_plot_draws_the_decode_points_and_the_budget(tmp_path):
    records = [_record("decode", b, t, "auto", forward_s=0.01, peak_bytes=100, decode_method="kv_cache",
                       kv_bytes_per_token=4096, kv_context_bytes=4096 * b * (t + 1)) for b in (1, 4) for t in (64,)]
    written, why = plot(records, tmp_path, kv_budget=2**20)
    # one sequence length (no curves over it), no breakdowns in these records (no breakdown.png)
    assert why is None and written == [str(tmp_path / "kv_cache.png")]
    assert (tmp_path / "kv_cache.png").read_bytes()[:8] == PNG


def test_the_html_report_holds_the_tables_the_summary_and_every_plot_inline(sweep):
    report, out, _ = sweep
    page = (out / "report.html").read_text()
    assert report["html"] == str(out / "report.html")
    assert page.startswith("<!DOCTYPE html>") and "src=\"data:image/png;base64," in page
    assert page.count("<img ") == len(report["plots"])
    assert 'src="' + str(out) not in page and "file://" not in page  # self-contained: nothing to fetch
    for line in report["summary"]:
        assert html.escape(line) in page
    results = page.split('id="results"')[1].split("</table>")[0]
    assert results.count("<tr>") + results.count('<tr class=') == len(report["records"]) + 1  # + the header


def _chromium() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


@pytest.mark.skipif(_chromium() is None, reason="no chromium on PATH (apt-get install chromium) to render the page")
def test_the_html_report_renders_in_headless_chromium(sweep, tmp_path):
    from PIL import Image

    report, out, _ = sweep
    # the page as it is, plus a probe that counts the images the browser decoded once it has loaded
    probe = tmp_path / "probe.html"
    probe.write_text((out / "report.html").read_text().replace(
        "</body>", "<script>window.addEventListener('load', () => { document.body.dataset.decoded = "
        "[...document.images].filter(i => i.complete && i.naturalWidth > 0).length; "
        "document.body.dataset.rows = document.querySelectorAll('#results tbody tr').length; });</script></body>"))
    flags = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             "--virtual-time-budget=5000"]
    dom = subprocess.run([*flags, "--dump-dom", probe.as_uri()], capture_output=True, text=True, timeout=120).stdout
    body = re.search(r"<body[^>]*>", dom).group(0)
    assert f'data-decoded="{len(report["plots"])}"' in body, body
    assert f'data-rows="{len(report["records"])}"' in body, body
    shot = tmp_path / "page.png"
    subprocess.run([*flags, f"--screenshot={shot}", "--window-size=1280,1600", (out / "report.html").as_uri()],
                   capture_output=True, timeout=120, check=True)
    image = Image.open(shot).convert("L")
    assert image.size == (1280, 1600)
    lo, hi = image.getextrema()
    assert hi - lo > 100 and len(image.getcolors(256)) > 16  # text, tables and plots, not a blank page


def test_the_cli_passes_the_new_options_and_prints_the_breakdown_table(sweep, tmp_path, capsys, monkeypatch):
    import attnopt.profiling.cli as cli

    report, _, _ = sweep
    seen = {}
    monkeypatch.setattr(cli, "profile", lambda spec, **kw: seen.update(kw) or report)
    rc = main(["profile", "nanogpt", "--seq-lens", "8", "--phase", "prefill,train", "--memory-timeline",
               "--memory-budget", "2GiB", "--sweet-spot-threshold", "0.2", "--no-progress", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert rc == 0 and seen["phase"] == "prefill,train" and seen["memory_timeline"] is True
    assert seen["memory_budget"] == "2GiB" and seen["sweet_spot_threshold"] == 0.2
    assert "top ops (self)" in printed and "top modules (total)" in printed and "| train " in printed
    assert "no_grad" not in printed.splitlines()[0] and report["html"] in printed
    assert main(["profile", "nanogpt", "--sweet-spot-threshold", "0", "--out", str(tmp_path)]) == 2
    assert "--sweet-spot-threshold must be > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["profile", "nanogpt", "--phase", "prefill,sideways", "--out", str(tmp_path)])
    assert "invalid choice: 'prefill,sideways'" in capsys.readouterr().err


def test_memory_timelines_need_a_folder():
    with pytest.raises(ValueError, match="memory_timeline=True writes PNGs under out"):
        profile("nanogpt", memory_timeline=True, progress=False)


def test_run_time_fallbacks_of_each_point_are_recorded_and_summarised(monkeypatch):
    from types import SimpleNamespace

    import attnopt.api
    import attnopt.profiling.run as run
    from attnopt.profiling.report import summarize

    why = "rows with every key hidden: the call as written"
    counts: dict = {}  # the runtime's counter, over the model's life
    record = SimpleNamespace(name="g0.site0", module_path="", source="", rewritten=True, extra={"fallbacks": counts})
    monkeypatch.setattr(attnopt.api, "explain", lambda model: SimpleNamespace(records=[record]))
    session = run._Session.__new__(run._Session)  # only what _new_fallbacks reads
    session.models, session.fallbacks_seen = {"sdpa": object()}, {}
    seen = []
    for calls in (0, 3, 9, 9):  # the counter after each point
        counts[why] = calls
        seen.append(session._new_fallbacks("sdpa"))
    assert seen == [{}, {"g0.site0": {why: 3}}, {"g0.site0": {why: 6}}, {}]  # each point's own calls
    records = [_record("prefill", 1, t, "sdpa", forward_s=0.01, fallbacks=f) for t, f in ((8, seen[1]), (16, seen[2]))]
    jsonschema.validate(records[0], REPORT_SCHEMA["properties"]["records"]["items"])
    (line,) = [s for s in summarize(records) if "ran as written at run time" in s]
    assert line.startswith("9 call(s) of rewritten sites ran as written at run time")
    assert f"first: sdpa at B=1, T=8 prefill, g0.site0: 3 call(s): {why}" in line


def test_the_memory_timeline_names_an_indexed_cuda_device(tmp_path, monkeypatch):
    # torch keeps the timeline's allocations whose device equals the one named: "cuda" equals none of "cuda:0"'s
    from attnopt.profiling.run import _memory_timeline

    asked = []

    class Prof:
        def export_memory_timeline(self, path, device):
            asked.append(device)

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert _memory_timeline(Prof(), tmp_path / "t", torch.device("cuda")) is not None
    assert _memory_timeline(Prof(), tmp_path / "t", torch.device("cuda", 1)) is not None
    assert _memory_timeline(Prof(), tmp_path / "t", torch.device("cpu")) is not None
    assert asked == ["cuda:0", "cuda:1", "cpu"]
