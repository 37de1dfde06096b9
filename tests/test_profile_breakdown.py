"""``attnopt.profiling.breakdown``: self and total time per op and module, attention apart, backward tied by
sequence numbers; on a fixed event tree (the numbers are known) and on CUDA-style events (the backward on its own
thread, device times)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from attnopt.profiling.breakdown import (
    BACKWARD_RANGE,
    FORWARD_RANGE,
    MODULE_PREFIX,
    ROOT_MODULE,
    average,
    call_breakdown,
    is_op,
    top,
)

RANGES = (FORWARD_RANGE, BACKWARD_RANGE, "attnopt::", MODULE_PREFIX)


def _events(tree: tuple, thread: int = 1, parent: SimpleNamespace | None = None,
            out: list | None = None) -> list[SimpleNamespace]:
    """Profiler-like events from ``(name, start_us, end_us, seq, children)``; self = total - children's totals.

    Device times: a leaf op's kernels take its whole self time; ranges and wrappers launch nothing.
    """
    out = [] if out is None else out
    name, start, end, seq, children = tree
    e = SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), sequence_nr=seq, thread=thread,
                        cpu_parent=parent, cpu_children=[], cpu_time_total=end - start,
                        is_user_annotation=name.startswith(RANGES))
    out.append(e)
    for child in children:
        _events(child, thread, e, out)
        e.cpu_children.append(next(x for x in out if x.cpu_parent is e and x.name == child[0]
                                   and x.time_range.start == child[1]))
    e.self_cpu_time_total = e.cpu_time_total - sum(c.cpu_time_total for c in e.cpu_children)
    leaf_op = is_op(e) and not e.cpu_children
    e.self_device_time_total = e.self_cpu_time_total if leaf_op else 0.0
    e.device_time_total = e.self_device_time_total + sum(c.device_time_total for c in e.cpu_children)
    return out


SOFTMAX_BACKWARD = ("autograd::engine::evaluate_function: SoftmaxBackward0", 75, 90, 3, [
    ("SoftmaxBackward0", 76, 89, 3, [("aten::_softmax_backward_data", 77, 88, -1, [])])])
BACKWARD = [
    ("autograd::engine::evaluate_function: SumBackward0", 70, 75, 6, [("aten::ones", 71, 73, -1, [])]),
    SOFTMAX_BACKWARD,
    ("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", 90, 95, -1,
     [("aten::add_", 91, 94, -1, [])]),
]
FORWARD = [
    (MODULE_PREFIX + "h.0", 0, 60, -1, [
        ("aten::linear", 0, 10, 1, [("aten::addmm", 2, 9, 1, [])]),
        ("attnopt::site0", 10, 40, -1, [
            ("aten::bmm", 10, 20, 2, []),
            ("aten::_softmax", 22, 30, 3, []),
            (MODULE_PREFIX + "h.0.drop", 30, 35, -1, [("aten::dropout", 31, 34, 4, [])]),
        ]),
        ("aten::add", 45, 50, 5, []),
    ]),
    ("aten::sum", 60, 70, 6, []),
]


def _step(with_backward: bool = True) -> list[SimpleNamespace]:
    children = FORWARD + ([(BACKWARD_RANGE, 70, 100, -1, BACKWARD)] if with_backward else [])
    return _events((FORWARD_RANGE, 0, 100, -1, children))


def test_a_training_step_is_attributed_to_ops_sites_and_modules():
    b = call_breakdown(_step(), "cpu")
    assert b.total_s == pytest.approx(100e-6) and b.backward_s == pytest.approx(30e-6)
    # the site's forward (30 us) and, by sequence number 3, the softmax's backward (15 us)
    assert b.attention_s == pytest.approx(45e-6)
    ops = {k: [round(v[0] * 1e6, 6), round(v[1] * 1e6, 6), v[2]] for k, v in b.ops.items()}
    assert ops == {
        ("aten::linear", "forward", False): [3, 10, 1], ("aten::addmm", "forward", False): [7, 7, 1],
        ("aten::bmm", "forward", True): [10, 10, 1], ("aten::_softmax", "forward", True): [8, 8, 1],
        ("aten::dropout", "forward", True): [3, 3, 1], ("aten::add", "forward", False): [5, 5, 1],
        ("aten::sum", "forward", False): [10, 10, 1], ("aten::ones", "backward", False): [2, 2, 1],
        ("aten::_softmax_backward_data", "backward", True): [11, 11, 1],
        ("aten::add_", "backward", False): [3, 3, 1],
    }
    # self times add up to the call: the ops' and the time inside no op (ranges, autograd wrappers, Python)
    assert sum(v[0] for v in b.ops.values()) + (b.total_s - b.attention_ops_s - b.rest_ops_s) == pytest.approx(
        b.total_s)
    assert b.attention_ops_s == pytest.approx(32e-6)
    modules = {k: [round(v[0] * 1e6, 6), round(v[1] * 1e6, 6)] for k, v in b.modules.items()}
    # h.0: its forward (60) and its softmax's backward (15); its dropout submodule (5) is not its self time
    assert modules == {"h.0": [70, 75], "h.0.drop": [5, 5], ROOT_MODULE: [25, 100]}


def test_the_mean_of_calls_adds_up_and_top_sums_an_ops_parts():
    calls = [call_breakdown(_step(), "cpu"), call_breakdown(_step(with_backward=False), "cpu")]
    mean = average(calls)
    assert mean["calls"] == 2 and mean["backward_s"] is None  # only one call had a backward
    assert mean["attention_s"] + mean["rest_s"] == pytest.approx(mean["total_s"])
    parts = sum(r["self_s"] for r in mean["ops"]) + sum(mean["outside_ops_s"].values())
    assert parts == pytest.approx(mean["total_s"])
    assert [r["self_s"] for r in mean["ops"]] == sorted((r["self_s"] for r in mean["ops"]), reverse=True)
    assert sum(r["self_s"] for r in mean["modules"]) == pytest.approx(mean["total_s"])  # each event's self once
    assert top(mean["ops"], "self_s", n=2) == [("aten::bmm", pytest.approx(10e-6)), ("aten::sum", pytest.approx(10e-6))]
    # the whole call is not a module's total: the root is left out of the ranking by total
    assert top(mean["modules"], "total_s", key="path", n=1) == [("h.0", pytest.approx((75 + 60) / 2 * 1e-6))]


def test_without_module_ranges_modules_are_null_with_the_reason():
    events = _events((FORWARD_RANGE, 0, 50, -1, [("attnopt::site0", 0, 20, -1, [("aten::bmm", 0, 20, 1, [])]),
                                                 ("aten::addmm", 20, 50, 2, [])]))
    mean = average([call_breakdown(events, "cpu")], modules_note="compiled")
    assert mean["modules"] is None and mean["modules_note"] == "compiled"
    assert mean["attention_s"] == pytest.approx(20e-6) and mean["outside_ops_s"]["rest"] == pytest.approx(0)


def test_cuda_uses_device_times_and_finds_the_backward_on_the_engine_threads():
    forward = _events((FORWARD_RANGE, 0, 100, -1, FORWARD + [(BACKWARD_RANGE, 70, 100, -1, [])]))
    engine = []
    for tree in BACKWARD:  # the autograd engine runs CUDA work on its own device thread: roots there
        _events(tree, thread=2, out=engine)
    late = _events(("autograd::engine::evaluate_function: MulBackward0", 150, 160, 4, []), thread=2)
    # the profiler mirrors ranges on the device timeline and lists kernels as events of their own
    mirrored = [SimpleNamespace(name=n, device_type=DeviceType.CUDA, is_user_annotation=True)
                for n in (FORWARD_RANGE, BACKWARD_RANGE, "attnopt::site0")]
    kernel = SimpleNamespace(name="void gemm_kernel<float>(...)", device_type=DeviceType.CUDA)
    b = call_breakdown(forward + engine + late + mirrored + [kernel], "cuda")
    assert b.total_s == pytest.approx(100e-6)  # the call's wall time
    # kernels inside the site (bmm 10, softmax 8, dropout 3) and the softmax's backward kernel (11)
    assert b.attention_s == pytest.approx(32e-6)
    assert ("aten::_softmax_backward_data", "backward", True) in b.ops
    assert ("aten::linear", "forward", False) not in b.ops or b.ops["aten::linear", "forward", False][0] == 0
    assert all(k[0] != "MulBackward0" for k in b.ops)  # after the backward range: another call's


def test_one_forward_range_is_required():
    with pytest.raises(ValueError, match="expected one attnopt.profile::forward range"):
        call_breakdown(_events(("aten::add", 0, 1, -1, [])), "cpu")


@pytest.mark.parametrize(("name", "op"), [("aten::addmm", True), ("prims::add", True), ("mylib::fused", True),
                                          ("attnopt::site0", False), (MODULE_PREFIX + "h.0", False),
                                          ("autograd::engine::evaluate_function: MmBackward0", False),
                                          ("MmBackward0", False), ("Torch-Compiled Region: 0/0", False),
                                          ("torch::autograd::AccumulateGrad", False)])
def test_what_counts_as_an_op(name, op):
    assert is_op(SimpleNamespace(name=name, is_user_annotation=name.startswith(RANGES))) is op


def test_a_breakdown_that_cannot_be_read_leaves_the_times_and_says_why(monkeypatch):
    import torch

    import attnopt.profiling.measure as measure

    runner = measure.make_runner(torch.relu, (torch.randn(64),), {}, torch.device("cpu"))
    assert measure.profile_ranges(runner, torch.device("cpu"), calls=2).breakdown["calls"] == 2

    def unreadable(events, device):
        raise ValueError("expected one attnopt.profile::forward range in the profile, found 2")

    monkeypatch.setattr(measure, "call_breakdown", unreadable)
    with pytest.warns(UserWarning, match="no time breakdown for this point .ValueError: expected one"):
        times = measure.profile_ranges(runner, torch.device("cpu"), calls=2)
    assert times.breakdown is None and times.forward_s > 0
