"""agree(): one value for every rank, computed on rank 0 only; rank 0's failure reaches every rank.

Two gloo ranks on CPU run all scenarios in one spawn (starting processes is the slow part); each
test then checks what the ranks recorded.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from attnopt.selection.distributed import agree


def _record_call(calls: list[str], name: str, rank: int) -> None:
    calls.append(f"{name}@{rank}")


def _outcome(fn) -> dict:
    try:
        value = fn()
    except BaseException as e:
        return {"error": type(e).__name__, "message": str(e)}
    try:
        json.dumps(value)
    except TypeError:
        return {"value_repr": repr(value)}
    return {"value": value}


def _ranks(rank: int, store: str, out: str) -> None:
    """One rank of a two-rank gloo group; writes what it saw to ``out/rank<r>.json``."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))  # a broken agree fails, never hangs
    calls: list[str] = []
    seen: dict[str, dict] = {}

    def rank_dependent():
        _record_call(calls, "value", rank)
        return {"rank": rank, "choice": f"cand{rank}", "timings": [rank * 1.5, float("inf")]}

    def rank0_raises():
        _record_call(calls, "raises", rank)
        raise KeyError(f"no candidate fits on rank {rank}")

    def unpicklable():
        _record_call(calls, "unpicklable", rank)
        return lambda: rank

    seen["value"] = _outcome(lambda: agree(rank_dependent))
    seen["raises"] = _outcome(lambda: agree(rank0_raises))
    seen["unpicklable"] = _outcome(lambda: agree(unpicklable))
    seen["after_failures"] = _outcome(lambda: agree(lambda: f"still in step, from rank {rank}"))
    pair = dist.new_group([0, 1])
    seen["group"] = _outcome(lambda: agree(lambda: rank + 40, group=pair))
    alone = dist.new_group([1])  # rank 0 is not a member
    seen["alone"] = _outcome(lambda: agree(lambda: rank + 50, group=alone))
    dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps({"seen": seen, "calls": calls}))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("agree")
    mp.spawn(_ranks, args=(str(tmp / "store"), str(tmp)), nprocs=2, join=True)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


def test_every_rank_gets_rank0s_value_and_only_rank0_computes(ranks: list[dict]) -> None:
    expected = {"rank": 0, "choice": "cand0", "timings": [0.0, float("inf")]}
    assert [r["seen"]["value"] for r in ranks] == [{"value": expected}] * 2
    assert "value@0" in ranks[0]["calls"]
    assert not [c for c in ranks[1]["calls"] if c.endswith("@1")]  # rank 1 never computed anything


def test_rank0_error_reaches_the_other_rank_as_runtime_error(ranks: list[dict]) -> None:
    rank0, rank1 = ranks[0]["seen"]["raises"], ranks[1]["seen"]["raises"]
    assert rank0 == {"error": "KeyError", "message": "'no candidate fits on rank 0'"}
    assert rank1["error"] == "RuntimeError"
    assert "rank 0 failed" in rank1["message"] and "KeyError: 'no candidate fits on rank 0'" in rank1["message"]
    assert "rank0_raises" in rank1["message"]  # rank 0's traceback comes along


def test_unpicklable_result_fails_on_every_rank_without_a_hang(ranks: list[dict]) -> None:
    rank0, rank1 = ranks[0]["seen"]["unpicklable"], ranks[1]["seen"]["unpicklable"]
    assert "error" in rank0 and rank0["error"] != "RuntimeError"
    assert rank1["error"] == "RuntimeError" and rank0["error"] in rank1["message"]


def test_ranks_stay_in_step_after_failures_and_with_explicit_groups(ranks: list[dict]) -> None:
    assert [r["seen"]["after_failures"] for r in ranks] == [{"value": "still in step, from rank 0"}] * 2
    assert [r["seen"]["group"] for r in ranks] == [{"value": 40}] * 2


def test_group_membership(ranks: list[dict]) -> None:
    assert ranks[1]["seen"]["alone"] == {"value": 51}  # a group of one: just compute()
    assert ranks[0]["seen"]["alone"]["error"] == "ValueError"
    assert "not in the given process group" in ranks[0]["seen"]["alone"]["message"]


def test_outside_a_distributed_run_agree_just_computes() -> None:
    assert not dist.is_initialized()
    calls = []
    assert agree(lambda: calls.append("called") or 7) == 7
    assert calls == ["called"]
    with pytest.raises(KeyError, match="plain"):
        agree(lambda: {}["plain"])
