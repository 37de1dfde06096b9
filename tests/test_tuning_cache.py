"""Tuning cache: hits and misses, a full key, files that are corrupt or foreign, concurrent writers, settings."""

from __future__ import annotations

import dataclasses
import json
import math
import multiprocessing
import sys
import warnings
from pathlib import Path

import pytest
import torch

import attnopt
from attnopt.selection.cache import TuningCache, TuningEntry, default_cache_dir, environment

SHAPE = {"B": 2, "H": 4, "Tq": 16, "Tk": 16, "D": 8, "dtype": torch.float32, "mask": "causal"}
CANDIDATES = ["sdpa", "math"]
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _cache_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests see only the settings they set themselves."""
    monkeypatch.delenv("ATTNOPT_CACHE", raising=False)
    monkeypatch.delenv("ATTNOPT_CACHE_DIR", raising=False)


def entry(choice: str = "sdpa", fast: float = 1.5) -> TuningEntry:
    return TuningEntry(choice, {"sdpa": fast, "math": 4.0, "flex": math.inf}, {"sdpa": 1024, "math": 4096},
                       {"flex": "cannot apply a bool mask"}, tuning_s=0.25, decision="faster than the runner-up math",
                       rounds={"sdpa": 12, "math": 8}, spread_ms={"sdpa": (1.4, 1.6), "math": (3.9, 4.2)},
                       ratios={"math": (2.7, 2.5, 2.9)}, pruned={"math": "slower than sdpa"}, confidence=0.99,
                       load=(1.5, 1.75), created="2026-12-01T12:00:00+00:00")  # fixed: entries compare equal


def test_miss_then_hit_in_this_and_a_fresh_process_view(tmp_path: Path) -> None:
    cache = TuningCache(tmp_path)
    key = cache.key(SHAPE, CANDIDATES, CPU)
    assert cache.lookup(key) is None
    stored = entry()
    cache.store(key, stored)
    assert cache.lookup(key) == stored
    fresh = TuningCache(tmp_path)  # empty memory layer: reads the file
    found = fresh.lookup(key)
    assert found == stored
    assert found.timings_ms["flex"] == math.inf and found.rejected == {"flex": "cannot apply a bool mask"}
    assert json.loads(cache.path_for(key).read_text())["key"] == key


def test_memory_layer_reads_each_file_once_and_does_not_remember_misses(tmp_path: Path) -> None:
    writer, reader = TuningCache(tmp_path), TuningCache(tmp_path)
    key = writer.key(SHAPE, CANDIDATES, CPU)
    assert reader.lookup(key) is None
    writer.store(key, entry())  # another process's store is found: the miss was not remembered
    assert reader.lookup(key) == entry()
    writer.path_for(key).unlink()
    assert reader.lookup(key) == entry()  # served from memory, the disk is not read again
    assert TuningCache(tmp_path).lookup(key) is None


def test_key_is_plain_json_and_ignores_candidate_order(tmp_path: Path) -> None:
    cache = TuningCache(tmp_path)
    key = cache.key(SHAPE, ["math", "sdpa", "math"], "cpu")
    assert key == cache.key(SHAPE, ["sdpa", "math"], CPU)
    assert key["candidates"] == ["math", "sdpa"]
    assert key["shape"]["dtype"] == "torch.float32"
    assert key["environment"] == environment(CPU)
    assert json.loads(json.dumps(key)) == key


def _other_shape(mp: pytest.MonkeyPatch) -> tuple[dict, list[str]]:
    return {**SHAPE, "Tk": 32}, CANDIDATES


def _other_candidates(mp: pytest.MonkeyPatch) -> tuple[dict, list[str]]:
    return SHAPE, [*CANDIDATES, "flex"]


def _other_attnopt(mp: pytest.MonkeyPatch) -> tuple[dict, list[str]]:
    mp.setattr(attnopt.env, "__version__", "999.0.0")  # the one source of the version
    return SHAPE, CANDIDATES


def _other_torch(mp: pytest.MonkeyPatch) -> tuple[dict, list[str]]:
    mp.setattr(torch, "__version__", "999.0.0+cpu")
    return SHAPE, CANDIDATES


def _other_thread_count(mp: pytest.MonkeyPatch) -> tuple[dict, list[str]]:
    mp.setattr(torch, "get_num_threads", lambda: 977)
    return SHAPE, CANDIDATES


@pytest.mark.parametrize("change", [_other_shape, _other_candidates, _other_attnopt, _other_torch, _other_thread_count],
                         ids=["shape", "candidates", "attnopt-version", "torch-version", "cpu-threads"])
def test_any_changed_key_part_is_a_miss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change) -> None:
    cache = TuningCache(tmp_path)
    old = cache.key(SHAPE, CANDIDATES, CPU)
    cache.store(old, entry())
    new = cache.key(*change(monkeypatch), CPU)
    assert new != old and cache.path_for(new) != cache.path_for(old)
    assert cache.lookup(new) is None
    assert TuningCache(tmp_path).lookup(new) is None
    assert cache.lookup(old) == entry()  # the old entry is still there for the old setup


def _write_corrupt(path: Path, record: dict) -> None:
    path.write_text(json.dumps(record)[:40])


def _write_empty(path: Path, record: dict) -> None:
    path.write_text("")


def _write_bad_entry(path: Path, record: dict) -> None:
    record["entry"]["timings_ms"]["sdpa"] = "fast"
    path.write_text(json.dumps(record))


def _write_binary(path: Path, record: dict) -> None:
    path.write_bytes(b"\xff\xfe\x00garbage")


@pytest.mark.parametrize("damage", [_write_corrupt, _write_empty, _write_bad_entry, _write_binary],
                         ids=["truncated", "empty", "bad-entry", "not-utf8"])
def test_corrupt_file_warns_is_a_miss_and_is_overwritten(tmp_path: Path, damage) -> None:
    cache = TuningCache(tmp_path)
    key = cache.key(SHAPE, CANDIDATES, CPU)
    cache.store(key, entry())
    path = cache.path_for(key)
    damage(path, json.loads(path.read_text()))
    fresh = TuningCache(tmp_path)
    with pytest.warns(UserWarning, match=path.name):
        assert fresh.lookup(key) is None
    fresh.store(key, entry("math"))
    assert json.loads(path.read_text())["entry"]["choice"] == "math"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert TuningCache(tmp_path).lookup(key) == entry("math")


@pytest.mark.parametrize("foreign", ["other-key", "older-attnopt", "older-torch", "other-format", "not-a-record"])
def test_foreign_file_under_the_key_name_is_a_silent_miss(tmp_path: Path, foreign: str) -> None:
    cache = TuningCache(tmp_path)
    key = cache.key(SHAPE, CANDIDATES, CPU)
    other = cache.key({**SHAPE, "B": 3}, CANDIDATES, CPU)
    cache.store(other, entry())
    record = json.loads(cache.path_for(other).read_text())
    if foreign == "older-attnopt":
        record["key"] = {**key, "environment": {**key["environment"], "attnopt": "0.0.1"}}
    elif foreign == "older-torch":
        record["key"] = {**key, "environment": {**key["environment"], "torch": "2.5.0"}}
    elif foreign == "other-format":
        record = {**record, "key": key, "format": 0}
    elif foreign == "not-a-record":
        record = ["a", "list", "of", "words"]
    cache.path_for(key).write_text(json.dumps(record))  # valid JSON that does not answer `key`
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert TuningCache(tmp_path).lookup(key) is None
    cache.store(key, entry("math"))
    assert TuningCache(tmp_path).lookup(key) == entry("math")


def _store_many(directory: str, worker: int, rounds: int, start, out: str) -> None:
    """Worker process: store shared and own keys while reading them back through fresh caches."""
    warnings.simplefilter("error")  # a partial file would surface as a warning on read
    problems = []
    start.wait()
    timings = {f"cand{i}": float(worker * 1000 + i) for i in range(60)}  # a few KB per file
    for i in range(rounds):
        for shape in ({"shared": i % 4}, {"worker": worker, "i": i % 4}):
            key = TuningCache(directory).key(shape, sorted(timings), "cpu")
            TuningCache(directory).store(key, TuningEntry(f"cand{worker}", timings))
            try:
                got = TuningCache(directory).lookup(key)
            except Warning as w:
                problems.append(f"round {i}: {w}")
            else:
                if got is None or got.choice not in ("cand0", "cand1") or len(got.timings_ms) != 60:
                    problems.append(f"round {i}: read back {got!r}")
    Path(out).write_text(json.dumps(problems))


def test_two_processes_storing_at_once_leave_only_valid_files(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(2)
    outs = [tmp_path / f"worker{w}.json" for w in range(2)]
    cache_dir = tmp_path / "cache"
    procs = [ctx.Process(target=_store_many, args=(str(cache_dir), w, 100, start, str(outs[w]))) for w in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert [json.loads(o.read_text()) for o in outs] == [[], []]
    files = sorted(cache_dir.iterdir())
    assert len(files) == 4 + 2 * 4  # 4 shared keys, 4 per worker; no temporary files left
    for path in files:
        record = json.loads(path.read_text())  # strict JSON, complete
        assert record["entry"]["choice"] in ("cand0", "cand1")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert TuningCache(cache_dir).lookup(record["key"]) is not None


def test_attnopt_cache_dir_is_honoured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNOPT_CACHE_DIR", str(tmp_path / "here"))
    assert default_cache_dir() == tmp_path / "here"
    cache = TuningCache()
    key = cache.key(SHAPE, CANDIDATES, CPU)
    cache.store(key, entry())
    assert cache.path_for(key).parent == tmp_path / "here"
    assert [p.name for p in (tmp_path / "here").iterdir()] == [cache.path_for(key).name]


@pytest.mark.parametrize("platform_name, env, expected", [
    ("linux", {"XDG_CACHE_HOME": "/xdg"}, "/xdg/attnopt"),
    ("linux", {}, "~/.cache/attnopt"),
    ("darwin", {}, "~/Library/Caches/attnopt"),
    ("win32", {"LOCALAPPDATA": "/appdata"}, "/appdata/attnopt/Cache"),
])
def test_user_cache_dir_per_platform(monkeypatch: pytest.MonkeyPatch, platform_name, env, expected) -> None:
    monkeypatch.setitem(sys.modules, "platformdirs", None)  # the built-in rule, even if platformdirs is installed
    monkeypatch.setattr(sys, "platform", platform_name)
    for name in ("XDG_CACHE_HOME", "LOCALAPPDATA"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert default_cache_dir() == Path(expected).expanduser()


def test_unwritable_directory_warns_once_and_keeps_results_in_memory(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    cache = TuningCache(tmp_path / "a-file" / "cache")  # cannot be created, even by root
    key = cache.key(SHAPE, CANDIDATES, CPU)
    with pytest.warns(UserWarning, match="ATTNOPT_CACHE_DIR"):
        cache.store(key, entry())
    other = cache.key({**SHAPE, "B": 9}, CANDIDATES, CPU)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache.store(other, entry("math"))
        assert cache.lookup(key) == entry() and cache.lookup(other) == entry("math")


@pytest.mark.parametrize("value", ["0", "off", "OFF"])
def test_attnopt_cache_off_keeps_the_disk_untouched(tmp_path: Path, monkeypatch, value: str) -> None:
    monkeypatch.setenv("ATTNOPT_CACHE", value)
    cache = TuningCache(tmp_path)
    key = cache.key(SHAPE, CANDIDATES, CPU)
    cache.store(key, entry())
    assert cache.lookup(key) == entry()
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv("ATTNOPT_CACHE", "1")
    TuningCache(tmp_path).store(key, entry("math"))
    monkeypatch.setenv("ATTNOPT_CACHE", value)
    assert TuningCache(tmp_path).lookup(key) is None  # the file is not read either


def test_attnopt_cache_rejects_unknown_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNOPT_CACHE", "maybe")
    with pytest.raises(ValueError, match="ATTNOPT_CACHE='maybe'.*'0'/'off'"):
        TuningCache()


def test_clear_forgets_memory_and_own_files_only(tmp_path: Path) -> None:
    cache = TuningCache(tmp_path)
    key = cache.key(SHAPE, CANDIDATES, CPU)
    cache.store(key, entry())
    (tmp_path / "notes.json").write_text("{}")
    cache.clear()
    assert cache.lookup(key) is None
    assert [p.name for p in tmp_path.iterdir()] == ["notes.json"]


def test_entry_round_trip_is_strict_json() -> None:
    e = entry()
    text = e.to_json()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert TuningEntry.from_json(text) == e
    assert TuningEntry.from_json(text).timings_ms["flex"] == math.inf
    assert TuningEntry("sdpa").created.endswith("+00:00")


@pytest.mark.parametrize("kwargs, match", [
    ({"choice": ""}, "choice"),
    ({"choice": "sdpa", "spread_ms": {"sdpa": (1.0,)}}, "spread_ms"),
    ({"choice": "sdpa", "ratios": {"math": (1.0, 0.9, math.inf)}}, "ratios"),
    ({"choice": "sdpa", "rounds": {"sdpa": -1}}, "rounds"),
    ({"choice": "sdpa", "pruned": {"math": None}}, "pruned"),
    ({"choice": "sdpa", "provisional": "yes"}, "provisional"),
    ({"choice": "sdpa", "confidence": 1.5}, "confidence"),
    ({"choice": "sdpa", "load": (math.nan,)}, "load"),
    ({"choice": "sdpa", "timings_ms": {"sdpa": math.nan}}, "timings_ms"),
    ({"choice": "sdpa", "timings_ms": {"sdpa": -1.0}}, "timings_ms"),
    ({"choice": "sdpa", "peak_bytes": {"sdpa": 1.5}}, "peak_bytes"),
    ({"choice": "sdpa", "rejected": {"math": 3}}, "rejected"),
    ({"choice": "sdpa", "tuning_s": math.nan}, "tuning_s"),
])
def test_entry_rejects_malformed_fields(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TuningEntry(**kwargs)


def test_entry_from_json_names_unknown_fields() -> None:
    with pytest.raises(ValueError, match="speed"):
        TuningEntry.from_json('{"choice": "sdpa", "speed": 1}')


@pytest.mark.parametrize("shape, candidates, error, match", [
    ({"T": torch.tensor(3)}, CANDIDATES, TypeError, r"shape_key\['T'\] is a Tensor"),
    ({1: 2}, CANDIDATES, TypeError, "non-string key 1"),
    ({"scale": math.nan}, CANDIDATES, ValueError, "finite"),
    (SHAPE, [], ValueError, "candidates is empty"),
    (SHAPE, "sdpa", TypeError, "sequence of candidate names"),
])
def test_key_rejects_what_json_cannot_hold_exactly(tmp_path: Path, shape, candidates, error, match) -> None:
    with pytest.raises(error, match=match):
        TuningCache(tmp_path).key(shape, candidates, CPU)


def test_environment_describes_this_cpu_setup() -> None:
    env = environment(CPU)
    assert env["attnopt"] == attnopt.__version__ and env["torch"] == torch.__version__
    assert env["device_type"] == "cpu" and env["device_name"]
    assert env["threads"] == str(torch.get_num_threads())
    assert all(isinstance(v, str) for v in env.values())


def test_a_file_of_the_format_before_confidence_statistics_reads_as_provisional(tmp_path: Path) -> None:
    cache = TuningCache(tmp_path)
    key = cache.key(SHAPE, CANDIDATES, CPU)
    old = {"choice": "sdpa", "timings_ms": {"sdpa": 1.0, "math": None}, "peak_bytes": {"sdpa": 10}, "rejected": {},
           "created": "2024-01-01T00:00:00+00:00", "tuning_s": 0.5}  # what attnopt wrote before issue 15
    cache.path_for(key).write_text(json.dumps({"format": 1, "key": key, "entry": old}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found = TuningCache(tmp_path).lookup(key)
    assert found.choice == "sdpa" and found.provisional and "older attnopt" in found.decision
    assert found.timings_ms["math"] == math.inf
    [record] = TuningCache(tmp_path).records()
    assert record.entry == found and record.key == key and record.id == cache.path_for(key).stem


def test_a_file_of_the_format_before_kept_rounds_reads_as_it_is(tmp_path: Path) -> None:
    cache = TuningCache(tmp_path)
    key = cache.key(SHAPE, CANDIDATES, CPU)
    entry = TuningEntry(choice="sdpa", timings_ms={"sdpa": 1.0}, decision="faster than the runner-up")
    data = entry.to_dict()
    del data["samples"]  # format 2: no kept rounds
    cache.path_for(key).write_text(json.dumps({"format": 2, "key": key, "entry": data}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert TuningCache(tmp_path).lookup(key) == entry  # final, as stored
    cache.store(key, entry)
    assert json.loads(cache.path_for(key).read_text())["format"] == 3  # what an older attnopt sees as a miss


def test_provisional_entries_round_trip_as_provisional(tmp_path: Path) -> None:
    cache = TuningCache(tmp_path)
    key = cache.key(SHAPE, CANDIDATES, CPU)
    cache.store(key, dataclasses.replace(entry(), provisional=True))
    got = TuningCache(tmp_path).lookup(key)
    assert got.provisional and got == dataclasses.replace(entry(), provisional=True)
    assert got.spread_ms["sdpa"] == (1.4, 1.6) and got.load == (1.5, 1.75)


def test_records_list_every_readable_entry_oldest_first_and_remove_forgets_one(tmp_path: Path) -> None:
    cache = TuningCache(tmp_path)
    keys = [cache.key({**SHAPE, "B": b}, CANDIDATES, CPU) for b in (1, 2, 3)]
    for i, key in enumerate(keys):
        cache.store(key, dataclasses.replace(entry(), created=f"2025-01-0{3 - i}T00:00:00+00:00"))
    (tmp_path / ("0" * 64 + ".json")).write_text("{broken")  # skipped silently
    (tmp_path / "notes.txt").write_text("not ours")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        records = TuningCache(tmp_path).records()
    assert [r.key for r in records] == keys[::-1]
    assert cache.remove(keys[0]) and not cache.remove(keys[0])
    assert cache.lookup(keys[0]) is None and len(TuningCache(tmp_path).records()) == 2
    assert TuningCache(tmp_path / "none").records() == []
