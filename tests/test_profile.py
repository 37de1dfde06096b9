"""``attnopt profile``: CLI smoke tests, the API on a user factory file, failing points, partial reports, bad input.

Sizes are tiny: the measured numbers are checked for consistency (counts, shapes, FLOPs, schema), not speed.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import textwrap
from pathlib import Path

import jsonschema
import pytest
import torch

from attnopt.__main__ import main
from attnopt.profiling.measure import causal_entries, is_oom
from attnopt.profiling.report import REPORT_SCHEMA, plot
from attnopt.profiling.run import profile

# the module, not the function the package exports under the same name
profile_module = importlib.import_module("attnopt.profiling.run")

# A tiny causal LM in a user's own file: one attention layer, width 16, 2 heads; `build_failing`'s model
# refuses sequences longer than 16 tokens, so one point of a sweep fails.
FACTORY = textwrap.dedent('''
    import math
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Tiny(nn.Module):
        def __init__(self, limit=None):
            super().__init__()
            self.limit = limit
            self.emb = nn.Embedding(32, 16)
            self.qkv = nn.Linear(16, 48)
            self.head = nn.Linear(16, 32)

        def forward(self, idx):
            B, T = idx.shape
            if self.limit is not None and T > self.limit:
                raise ValueError(f"Tiny takes at most {self.limit} tokens, got {T}")
            q, k, v = self.qkv(self.emb(idx)).split(16, dim=2)
            q, k, v = (t.view(B, T, 2, 8).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
            att = (q @ k.transpose(-2, -1)) / math.sqrt(8)
            causal = torch.ones(T, T, dtype=torch.bool, device=idx.device).tril()
            att = F.softmax(att.masked_fill(~causal, float("-inf")), dim=-1)
            y = (att @ v).transpose(1, 2).reshape(B, T, 16)
            return self.head(y)

    def tokens(batch_size, seq_len):
        return torch.randint(0, 32, (batch_size, seq_len))

    def build():
        return Tiny(), tokens

    def build_failing():
        return Tiny(limit=16), tokens

    def not_a_pair():
        return Tiny()

    class NoAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(32, 16)
            self.head = nn.Linear(16, 32)

        def forward(self, idx):
            return self.head(torch.relu(self.emb(idx)))

    def build_no_attention():
        return NoAttention(), tokens
''')

FAST = {"repeats": 1, "progress": False, "matmul_size": 64}


@pytest.fixture
def factory(tmp_path: Path) -> Path:
    path = tmp_path / "my_model.py"
    path.write_text(FACTORY)
    return path


def _read_report(folder: Path) -> dict:
    report = json.loads((folder / "report.json").read_text())
    jsonschema.validate(report, REPORT_SCHEMA)
    return report


def test_cli_nanogpt_writes_valid_report_plots_table_and_summary(tmp_path, capsys):
    out = tmp_path / "prof"
    rc = main(["profile", "nanogpt", "--seq-lens", "16", "--variants", "eager,sdpa",
               "--repeats", "1", "--matmul-size", "64", "--no-progress", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0
    report = _read_report(out)
    assert report["complete"] and report["spec"] == "nanogpt" and report["schema_version"] == 1
    records = {(r["phase"], r["variant"]): r for r in report["records"]}
    assert set(records) == {("prefill", "eager"), ("prefill", "sdpa")}
    assert all(r["status"] == "ok" and r["forward_s"] > 0 and r["peak_bytes"] > 0 for r in records.values())
    eager, sdpa = records["prefill", "eager"], records["prefill", "sdpa"]
    assert eager["attention_method"] == "captured_regions" and len(eager["sites"]) == 4  # one site per layer
    assert sdpa["attention_method"] == "site_ranges"
    assert {s["where"].split(" ")[0] for s in sdpa["sites"].values()} == {f"h.{i}.attn" for i in range(4)}
    assert 0 < eager["attention_share"] < 1 and eager["idle_gap_note"] == "n/a on CPU"
    from attnopt.models import GPTConfig, NanoGPT

    paths = {name for name, _ in NanoGPT(GPTConfig(n_layer=4)).named_modules()}
    assert eager["peak_op"]["module"] in paths  # the model as written: the module's path, e.g. h.0.mlp
    # the same function, equal FLOPs: 4 layers x 2 products x (1 x 4 heads x 136 causal score entries of 16 x 16)
    # x (32 + 32) head dims
    assert eager["attention_flops"] == sdpa["attention_flops"] == 4 * 2 * (4 * 136) * 64
    assert sdpa["speedup_vs_eager"] == pytest.approx(eager["forward_s"] / sdpa["forward_s"])
    # one sequence length (no curves over it), one batch size (no batch_size.png), no KV cache (no kv_cache.png)
    assert report["plots"] == [str(out / "breakdown.png")]
    assert (out / "breakdown.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| variant" in printed and "peak MiB" in printed  # the table
    assert "attention is" in printed and "than eager" in printed  # the summary in words
    assert report["summary"] and all(line in printed for line in report["summary"])


def test_api_on_a_user_file_factory(factory, tmp_path):
    from attnopt.selection.measure import peak_memory

    out = tmp_path / "prof"
    report = profile(f"{factory}:build", batch_sizes=(2,), seq_lens=(8, 16), variants=("eager", "math"),
                     trace=True, out=out, **FAST)
    assert report == _read_report(out)  # the API returns what report.json holds
    for name in ("time_vs_seq_len.png", "peak_memory_vs_seq_len.png", "attention_share.png", "breakdown.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and str(out / name) in report["plots"]
    assert [(r["seq_len"], r["variant"]) for r in report["records"]] == [
        (8, "eager"), (8, "math"), (16, "eager"), (16, "math")]
    for r in report["records"]:
        t = r["seq_len"]
        assert r["status"] == "ok"
        assert r["attention_flops"] == 2 * (2 * 2 * t * (t + 1) // 2) * (8 + 8)  # B=2, H=2, D=Dv=8, causal
        assert list(r["sites"]) == ["site0"] and r["attention_s"] > 0
        trace = json.loads(Path(r["trace"]).read_text())
        assert any(e.get("name") == "attnopt::site0" for e in trace["traceEvents"])
        assert r["roofline_ratio"] == pytest.approx(
            r["attention_flops"] / r["attention_s"] / report["environment"]["matmul"]["flops_per_s"])
    # the eager peak is the definition attnopt.selection.measure uses, on the model as written
    sys.path.insert(0, str(factory.parent))
    try:
        import my_model
    finally:
        sys.path.remove(str(factory.parent))
    model, _ = my_model.build()
    eager16 = report["records"][2]
    assert eager16["peak_bytes"] == peak_memory(model.eval(), torch.randint(0, 32, (2, 16)))
    assert eager16["peak_op"]["op"].startswith("aten::")


def test_a_failing_point_is_recorded_and_the_sweep_goes_on(factory, tmp_path):
    out = tmp_path / "prof"
    threads = torch.get_num_threads()
    report = profile(f"{factory}:build_failing", seq_lens=(24, 8), variants=("eager", "sdpa"), out=out, threads=1,
                     **FAST)
    assert report["environment"]["threads"] == 1 and torch.get_num_threads() == threads  # restored after the run
    assert _read_report(out)["complete"]
    status = {(r["seq_len"], r["variant"]): (r["status"], r["error"]) for r in report["records"]}
    for variant in ("eager", "sdpa"):
        assert status[8, variant] == ("ok", None)  # the point after the failing one is measured
        state, error = status[24, variant]
        assert state == "error" and "at most 16 tokens, got 24" in error
    assert any("failed" in line for line in report["summary"])


def test_interrupted_sweep_leaves_a_valid_partial_report(factory, tmp_path, monkeypatch):
    real_point = profile_module._Session.point
    calls = []

    def point_then_interrupt(self, phase, b, t):
        calls.append(t)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_point(self, phase, b, t)

    monkeypatch.setattr(profile_module._Session, "point", point_then_interrupt)
    out = tmp_path / "prof"
    with pytest.raises(KeyboardInterrupt):
        profile(f"{factory}:build", seq_lens=(8, 16), variants=("eager", "sdpa"), out=out, **FAST)
    report = _read_report(out)
    assert report["complete"] is False
    assert [(r["seq_len"], r["status"]) for r in report["records"]] == [(8, "ok"), (8, "ok")]
    assert not list(out.glob("*.tmp"))


def test_decode_falls_back_to_full_recompute_when_the_cache_refuses(factory, monkeypatch):
    import attnopt

    def refuse(model, max_len=None, variant="sdpa"):
        raise ValueError("cumsum over time at model.py:3")

    monkeypatch.setattr(profile_module, "_generation", lambda: (refuse, None))
    optimize = attnopt.optimize  # "auto" runs as "sdpa" here: the selector's tuning is not what this test checks
    monkeypatch.setattr(attnopt.api, "optimize", lambda model, variant: optimize(model, variant="sdpa"))
    report = profile(f"{factory}:build", seq_lens=(8,), phase="decode", **FAST)
    auto = report["records"][1]
    assert auto["variant"] == "auto" and auto["status"] == "ok"
    assert auto["decode_method"] == "full_recompute" and "refused" in auto["decode_note"]
    assert "cumsum over time" in auto["decode_note"]
    assert auto["attention_flops"] == 2 * (2 * 9 * 10 // 2) * 16  # a causal forward over T+1 = 9 tokens


def test_decode_with_a_cache_times_one_step_after_an_untimed_prefill(factory, monkeypatch):
    seen = []

    class FakeCache:  # full recompute behind the cached interface: checks the calls the profiler makes
        def __init__(self, model, max_len, variant):
            self.model, self.max_len, self.idx, self.variant = model, max_len, None, variant
            seen.append(("built", max_len, variant))

        def prefill(self, idx):
            seen.append(("prefill", idx.shape[1], self.variant))
            self.idx = idx
            return self.model(idx)

        def step(self, tokens):
            seen.append(("step", tokens.shape[1], self.variant))
            self.idx = torch.cat([self.idx, tokens], dim=1)
            assert self.idx.shape[1] <= self.max_len
            return self.model(self.idx)[:, -1:]

    monkeypatch.setattr(profile_module, "_generation", lambda: (FakeCache, None))
    report = profile(f"{factory}:build", seq_lens=(6, 8), phase="decode", variants=("eager", "auto", "sdpa"),
                     **FAST)
    # one cached model per variant for the whole sweep, sized for its longest context plus the new token
    assert sorted(x for x in seen if x[0] == "built") == [("built", 9, "auto"), ("built", 9, "sdpa")]
    seen[:] = [x for x in seen if x[0] != "built"]
    eager, auto, sdpa = report["records"][3:]
    assert eager["decode_method"] == "full_recompute" and "no KV cache" in eager["decode_note"]
    # every optimized variant decodes with the cache, attending with its own candidate
    assert sdpa["status"] == auto["status"] == "ok"
    assert sdpa["decode_method"] == auto["decode_method"] == "kv_cache"
    assert set(seen) == {(kind, n, v) for v in ("auto", "sdpa") for kind, n in
                         (("prefill", 6), ("prefill", 8), ("step", 1))}
    for v in ("auto", "sdpa"):  # every step comes after its own prefill
        assert seen.count(("prefill", 6, v)) + seen.count(("prefill", 8, v)) == seen.count(("step", 1, v))
    assert auto["attention_flops"] == 2 * (2 * 1 * 9) * 16  # one query row against T+1 keys, 2 heads


def test_decode_on_an_encoder_is_skipped_with_the_reason():
    report = profile("bert", seq_lens=(8,), phase="decode", **FAST)
    assert [r["status"] for r in report["records"]] == ["skipped", "skipped"]
    assert "causal language models" in report["records"][0]["error"]


def test_plots_are_skipped_with_one_message_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    record = profile_module._record("prefill", 1, 8, "eager", forward_s=0.1, peak_bytes=10)
    written, why = plot([record], tmp_path)
    assert written == [] and "matplotlib is not installed" in why
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(("spec", "message"), [
    ("nosuchmodel", "built-in example (nanogpt, bert)"),
    ("missing_file.py:build", "no such file"),
    ("{factory}:nothere", "has no callable 'nothere'"),
    ("{factory}:not_a_pair", "must return (model, make_inputs)"),
    ("no_such_package_xyz:build", "cannot import 'no_such_package_xyz'"),
])
def test_bad_spec_is_a_clear_error(spec, message, factory, tmp_path, capsys):
    rc = main(["profile", spec.format(factory=factory), "--out", str(tmp_path / "p"), "--no-progress",
               "--matmul-size", "8"])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("attnopt profile: error:") and message in err


@pytest.mark.parametrize(("flags", "message"), [
    (["--variants", "eager,bogus"], "unknown variant(s) ['bogus'] in --variants; accepted: auto, sdpa, eager"),
    (["--variants", "auto,auto"], "lists a variant twice"),
    (["--device", "tpu"], "--device must be cpu, cuda or cuda:N"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--threads", "0"], "--threads must be >= 1"),
])
def test_bad_flags_are_clear_errors(flags, message, capsys, tmp_path):
    rc = main(["profile", "nanogpt", "--out", str(tmp_path), *flags])
    assert rc == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "message"), [
    (["--seq-lens", "0,5"], "expected positive integers separated by commas"),
    (["--batch-sizes", "one"], "expected positive integers separated by commas"),
    (["--phase", "sideways"], "invalid choice"),
    ([], "required: --out"),
])
def test_bad_values_are_argparse_errors(flags, message, capsys, tmp_path):
    argv = ["profile", "nanogpt", *flags] + ([] if not flags else ["--out", str(tmp_path)])
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("tq", [1, 2, 5, 8])
@pytest.mark.parametrize("tk", [1, 5, 8])
def test_causal_entries_count_what_the_masks_keep(tq, tk):
    keep = torch.ones(tq, tk, dtype=torch.bool)
    assert causal_entries(tq, tk, "top_left") == int(keep.tril().sum())
    assert causal_entries(tq, tk, "bottom_right") == int(keep.tril(diagonal=tk - tq).sum())


def test_out_of_memory_is_told_apart_from_other_errors():
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_oom(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1099511627776 bytes"))
    assert is_oom(MemoryError())
    assert not is_oom(RuntimeError("shape mismatch"))
    assert not is_oom(ValueError("out of memory"))  # only the allocators' errors count


def test_cuda_ranges_read_kernel_time_and_idle_gaps_from_profiler_events():
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from attnopt.profiling.measure import FORWARD_RANGE, _read_ranges

    def kernel(start, end, annotation=False):
        return SimpleNamespace(device_type=DeviceType.CUDA, time_range=SimpleNamespace(start=start, end=end),
                               name="attnopt::site0" if annotation else "gemm", is_user_annotation=annotation)

    def cpu(name, cpu_us, device_us):
        return SimpleNamespace(device_type=DeviceType.CPU, name=name, cpu_time_total=cpu_us,
                               device_time_total=device_us)

    events = [cpu(FORWARD_RANGE, 60.0, 0.0), cpu("attnopt::site0", 9.0, 7.0), cpu("attnopt::site1", 4.0, 2.0),
              kernel(0, 10), kernel(15, 20), kernel(18, 30), kernel(40, 50), kernel(0, 50, annotation=True)]
    forward, sites, idle = _read_ranges(events, torch.device("cuda"))
    assert forward == pytest.approx(60e-6)
    assert sites == pytest.approx({"site0": 7e-6, "site1": 2e-6})  # kernel time inside the ranges on CUDA
    assert idle == pytest.approx(15e-6)  # 10..15 and 30..40; overlapping kernels and mirrored ranges fill nothing
    forward, sites, idle = _read_ranges(events[:3], torch.device("cpu"))
    assert sites == pytest.approx({"site0": 9e-6, "site1": 4e-6}) and idle is None


def test_a_model_without_attention_reports_attention_as_not_available(factory):
    report = profile(f"{factory}:build_no_attention", seq_lens=(8,), variants=("eager", "sdpa"), **FAST)
    for r in report["records"]:
        assert r["status"] == "ok" and r["forward_s"] > 0 and r["sites"] == {}
        assert r["attention_s"] is None and r["attention_share"] is None and r["attention_flops"] is None
        assert "no attention site ran" in r["attention_note"]
    assert "its attention time is n/a" in report["summary"][0]


def test_every_point_failing_exits_1_with_the_errors_in_full(factory, tmp_path, capsys):
    long_reason = "Tiny takes at most 16 tokens " + "and this explanation goes on for a while " * 8
    bad = factory.read_text().replace('f"Tiny takes at most {self.limit} tokens, got {T}"', repr(long_reason))
    factory.write_text(bad)
    rc = main(["profile", f"{factory}:build_failing", "--seq-lens", "24", "--variants", "eager,sdpa",
               "--repeats", "1", "--matmul-size", "64", "--out", str(tmp_path / "p"), "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 1 and "every measurement failed" in captured.err
    report = _read_report(tmp_path / "p")
    assert {r["status"] for r in report["records"]} == {"error"}
    assert all(r["error"] == f"ValueError: {long_reason.strip()}" for r in report["records"])  # not cut
    (line,) = [s for s in report["summary"] if "failed" in s]
    quoted = line.split("error (", 1)[1].rsplit(")", 1)[0]
    assert quoted.endswith(" ...") and len(quoted) <= 160
    assert long_reason.startswith(quoted[:-4].removeprefix("ValueError: "))  # cut between words


def test_one_point_ok_among_failures_exits_0(factory, tmp_path):
    rc = main(["profile", f"{factory}:build_failing", "--seq-lens", "24,8", "--variants", "eager",
               "--repeats", "1", "--matmul-size", "64", "--out", str(tmp_path / "p"), "--no-progress"])
    assert rc == 0


def test_report_json_gets_the_mode_the_plots_get(tmp_path):
    from attnopt.profiling.report import write_json

    old = os.umask(0o022)
    try:
        write_json(tmp_path / "report.json", {"a": 1})
        (tmp_path / "plot.png").write_bytes(b"")  # what matplotlib's savefig does: a plain open()
    finally:
        os.umask(old)
    mode = (tmp_path / "report.json").stat().st_mode & 0o777
    assert mode == (tmp_path / "plot.png").stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize(("speed", "words"), [(0.69, "1.45x slower"), (1.0, "1.00x faster"), (2.5, "2.50x faster")])
def test_summary_says_slower_with_the_inverse_ratio(speed, words):
    from attnopt.profiling.report import summarize

    eager = profile_module._record("prefill", 1, 8, "eager", forward_s=0.1, peak_bytes=100)
    other = profile_module._record("prefill", 1, 8, "sdpa", forward_s=0.1 / speed, peak_bytes=100,
                                   speedup_vs_eager=speed, peak_ratio_vs_eager=1.0)
    (line,) = [s for s in summarize([eager, other]) if s.startswith("prefill, B=1, T=8: sdpa")]
    assert f"is {words} than eager" in line
