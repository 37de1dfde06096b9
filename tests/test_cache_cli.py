"""``attnopt cache list|show|clear|retune`` on a cache directory the test fills itself."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
import torch

from attnopt.__main__ import main
from attnopt.selection.cache import TuningCache, TuningEntry
from attnopt.selection.selector import Call, Selector, ShapeKey, shape_key
from attnopt.spec import AttentionSpec

SPEC = AttentionSpec(scale=0.25, causal="top_left")
NAMES = ["sdpa", "sdpa_flash"]


def _key(cache: TuningCache, t: int) -> tuple[dict, ShapeKey]:
    q = torch.randn(1, 8, t, 32)
    key = shape_key(SPEC, q, q, q, causal=True, mask=None, dropout=False, grad=False)
    return cache.key({**key.as_dict(), "spec": repr(SPEC), "budget": None}, NAMES, "cpu"), key


ENTRY = TuningEntry("sdpa", {"sdpa": 0.669, "sdpa_flash": 0.81, "tiled64": math.inf}, {"sdpa": 2**20},
                    {"tiled64": "output differs from the reference (max abs difference 0.1)"}, tuning_s=0.4,
                    decision="faster than the runner-up sdpa_flash: sdpa_flash/sdpa x1.21 [1.12, 1.3] at 99% over "
                             "14 rounds", rounds={"sdpa": 14, "sdpa_flash": 14},
                    ratios={"sdpa_flash": (1.21, 1.12, 1.3)},
                    spread_ms={"sdpa": (0.65, 0.70), "sdpa_flash": (0.79, 0.84)}, pruned={"sdpa_flash": "slower"},
                    confidence=0.99, load=(4.1, 3.9))


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> TuningCache:
    monkeypatch.delenv("ATTNOPT_CACHE", raising=False)
    monkeypatch.setenv("ATTNOPT_CACHE_DIR", str(tmp_path))
    c = TuningCache(tmp_path)
    k64, _ = _key(c, 64)
    k256, _ = _key(c, 256)
    c.store(k64, dataclasses.replace(ENTRY, created="2025-01-01T00:00:00+00:00"))
    c.store(k256, dataclasses.replace(ENTRY, choice="sdpa_flash", provisional=True, decision="provisional: not "
                                      "separated from sdpa", created="2025-01-02T00:00:00+00:00"))
    return c


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(["cache", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_list_shows_one_line_per_entry_oldest_first(cache, capsys):
    rc, out, _ = _run(capsys, "list")
    assert rc == 0 and out.startswith(f"2 tuning entries in {cache.directory}")
    lines = [line for line in out.splitlines() if re.match(r"\d+ +[0-9a-f]{8} ", line)]
    assert len(lines) == 2
    assert "B=1 H=8 Tq<=64 Tk<=64 D=32 float32 cpu, causal" in lines[0] and " sdpa " in lines[0]
    assert " final " in lines[0] and " d " in lines[0] and lines[0].rstrip().endswith("this")
    assert "Tq<=256" in lines[1] and "sdpa_flash" in lines[1] and "provisional" in lines[1]


def test_list_names_what_differs_for_an_entry_of_another_setup(cache, capsys, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 977)  # as if this process ran with other threads
    rc, out, _ = _run(capsys, "list")
    assert rc == 0 and "other: threads" in out and "(here 977)" in out and "clear --stale" in out


def test_list_of_an_empty_cache(tmp_path, capsys):
    rc, out, _ = _run(capsys, "--dir", str(tmp_path / "empty"), "list")
    assert rc == 0 and "no tuning entries" in out


def test_show_by_number_or_id_prefix_gives_timings_spread_and_why(cache, capsys):
    rc, out, _ = _run(capsys, "show", "1")
    assert rc == 0
    assert "why:         faster than the runner-up sdpa_flash" in out and "load 4.10 -> 3.90" in out
    row = next(line for line in out.splitlines() if line.startswith("sdpa_flash"))
    assert "0.81" in row and "0.79-0.84" in row and "x1.21 [1.12, 1.3]" in row and "pruned: slower" in row
    assert "rejected: output differs" in next(line for line in out.splitlines() if line.startswith("tiled64"))
    ident = cache.records()[0].id
    assert _run(capsys, "show", ident[:6])[1] == out


@pytest.mark.parametrize("entry, rc, says", [("9", 1, "no entry 9"), ("abcd" * 3, 1, "no entry with an id"),
                                             ("zz", 2, "neither an entry number")])
def test_show_says_what_to_do_when_nothing_matches(cache, capsys, entry, rc, says):
    got, out, err = _run(capsys, "show", entry)
    assert got == rc and says in err and out == ""
    if rc == 1:
        assert "attnopt cache list" in err


def test_bad_usage_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["cache", "explode"])
    assert e.value.code == 2


def test_clear_with_a_filter_removes_only_what_matches_and_says_so(cache, capsys):
    rc, out, _ = _run(capsys, "clear", "--match", "Tq<=256")
    assert rc == 0 and out.startswith("removed 1 entry") and "Tq<=256" in out
    assert [r.entry.choice for r in cache.records()] == ["sdpa"]
    rc, out, _ = _run(capsys, "clear", "--provisional")
    assert rc == 0 and "no entry matched" in out and len(cache.records()) == 1


def test_clear_everything_also_removes_unreadable_files(cache, capsys):
    (cache.directory / ("0" * 64 + ".json")).write_text("{broken")
    (cache.directory / "notes.txt").write_text("not ours")
    rc, out, _ = _run(capsys, "clear")
    assert rc == 0 and out.startswith("removed 2 entries") and "and 1 unreadable" in out
    assert [p.name for p in cache.directory.iterdir()] == ["notes.txt"]


def test_clear_stale_removes_the_entries_of_another_setup(cache, capsys):
    k, _ = _key(cache, 64)
    record = json.loads(cache.path_for(k).read_text())
    record["key"]["environment"]["torch"] = "2.0.0"
    other = {**record["key"]}
    cache.store(other, ENTRY)
    rc, out, _ = _run(capsys, "clear", "--stale")
    assert rc == 0 and out.startswith("removed 1 entry")
    assert len(cache.records()) == 2 and all(r.key["environment"]["torch"] == torch.__version__
                                             for r in cache.records())


def test_retune_marks_entries_provisional_and_their_next_use_times_them_again(cache, capsys):
    rc, out, _ = _run(capsys, "retune", "1")
    assert rc == 0 and out.startswith("marked 1 entry provisional")
    first = cache.records()[0].entry
    assert first.provisional and "attnopt cache retune" in first.decision and first.timings_ms == ENTRY.timings_ms
    timed = []

    def timer(name, run):
        timed.append(name)
        return {"sdpa": 2.0, "sdpa_flash": 1.0}[name]

    sel = Selector(timer=timer, memory=lambda name, run: 1, cache=TuningCache(cache.directory), candidates=NAMES)
    k, key = _key(cache, 64)
    q = torch.randn(1, 8, 64, 32)
    call = Call(q, q, q, dict(attn_mask=None, dropout_p=0.0, is_causal=True, scale=0.25, enable_gqa=False), False)
    entry = sel.choose(SPEC, key, call)
    assert timed and entry.choice == "sdpa_flash" and not entry.provisional
    assert not TuningCache(cache.directory).lookup(k).provisional


def test_retune_with_the_disk_layer_off_refuses_instead_of_claiming_success(cache, capsys, monkeypatch):
    monkeypatch.setenv("ATTNOPT_CACHE", "0")
    rc, out, err = _run(capsys, "retune", "1")
    assert rc == 2 and "ATTNOPT_CACHE is off" in err and "marked" not in out
    assert not TuningCache(cache.directory).records()[0].entry.provisional  # the file is unchanged


@pytest.mark.parametrize("edit", ["nan", "environment", "shape", "dtype", "threads"])
def test_hand_edited_files_are_unreadable_entries_that_list_names_and_clear_removes(cache, capsys, edit):
    """A key edited by hand (a NaN, a part of the wrong type, or any field: the file's name is then not its key's)
    is no entry: every action keeps working, ``list`` counts it, ``clear`` removes it and lookups tune again."""
    path = sorted(cache.directory.glob("*.json"))[0]
    record = json.loads(path.read_text())
    key = record["key"]
    if edit == "nan":
        key["shape"]["budget"] = float("nan")
    elif edit == "environment":
        key["environment"] = "cpu"
    elif edit == "shape":
        key["shape"] = "B=1"
    elif edit == "dtype":
        key["shape"]["dtype"] = 32
    else:
        key["environment"]["threads"] = "999"
    path.write_text(json.dumps(record))
    for action in (["list"], ["show", "1"], ["retune", "1"]):
        rc, out, err = _run(capsys, *action)
        assert rc == 0 and "Traceback" not in out + err
    rc, out, _ = _run(capsys, "list")
    assert out.startswith("1 unreadable or left-over cache file(s)")
    assert len(TuningCache(cache.directory).records()) == 1
    rc, out, _ = _run(capsys, "clear")
    assert rc == 0 and "and 1 unreadable or left-over cache file(s)" in out and not list(cache.directory.iterdir())


def test_clear_removes_unreadable_files_when_no_entry_is_readable(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("ATTNOPT_CACHE", raising=False)
    (tmp_path / ("0" * 64 + ".json")).write_text("{not json")
    rc = main(["cache", "--dir", str(tmp_path), "clear"])
    out = capsys.readouterr().out
    assert rc == 0 and "and 1 unreadable" in out and not list(tmp_path.iterdir())


def test_a_clear_elsewhere_does_not_turn_off_a_writer(tmp_path, monkeypatch):
    """``clear`` leaves young temporary files (another process's write in flight) alone, and a writer whose
    temporary file vanished writes again instead of giving up on the directory."""
    import os

    monkeypatch.delenv("ATTNOPT_CACHE", raising=False)
    writer = TuningCache(tmp_path)
    key, _ = _key(writer, 64)
    young = tmp_path / ".x.json.0123abcd.tmp"
    young.write_text("{}")
    assert TuningCache(tmp_path).clear() == 0 and young.exists()
    real_replace = os.replace
    calls = {"n": 0}

    def vanish(src, dst):  # the first replace finds its temporary file gone (removed by a clear elsewhere)
        calls["n"] += 1
        if calls["n"] == 1:
            os.unlink(src)
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", vanish)
    writer.store(key, ENTRY)
    assert writer._writable and TuningCache(tmp_path).lookup(key) is not None
