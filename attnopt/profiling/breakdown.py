"""Where one profiled call's time goes: per op and per module, by self and total time, attention apart.

:func:`call_breakdown` reads the ``torch.profiler`` events of one call made inside an
``attnopt.profile::forward`` range (and, for a training step, an ``attnopt.profile::backward``
range nested in it) and attributes every event's *self* time to

* its **op** (an ``aten::``-style operator: a namespaced name that is not a ``record_function``
  range or an autograd-engine wrapper), keyed by ``(name, pass, attention)``;
* its **site**: inside an ``attnopt::<site>`` range, the call's attention, else the rest;
* its **modules**: the ``attnopt.module::<path>`` ranges around it (the profiler's own
  eager-mode module records, ``with_modules``, cover TorchScript only; :func:`~attnopt.profiling.measure.bracket_sites`
  opens these ranges in its capture of the model as written, from each node's ``nn_module_stack``).

Backward events have no ranges of their own: ``autograd::engine::evaluate_function: XBackward0``
carries the sequence number of the forward op that made its graph node, so its subtree takes
that op's site and modules. Self times add up: on CPU, the ops' self times plus the time inside
no op (Python, dispatch, the autograd engine) are the call's duration exactly; on CUDA the op
times are device (kernel) times and the time inside no op also holds the host's overhead and the
device's idle gaps.

    >>> b = call_breakdown(prof.events(), "cpu")              # one call
    >>> mean = average([b1, b2, b3])                           # the report's numbers (additive)
    >>> mean["attention_s"] + mean["rest_s"] == mean["total_s"]
    True
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch.autograd import DeviceType

__all__ = ["BACKWARD_RANGE", "FORWARD_RANGE", "MODULE_PREFIX", "ROOT_MODULE", "SITE_PREFIX", "average",
           "call_breakdown", "is_op", "top"]

FORWARD_RANGE = "attnopt.profile::forward"
BACKWARD_RANGE = "attnopt.profile::backward"
SITE_PREFIX = "attnopt::"
MODULE_PREFIX = "attnopt.module::"
ROOT_MODULE = "(the model)"
_EVALUATE = "autograd::engine::evaluate_function: "


def is_op(event: Any) -> bool:
    """An operator event (``aten::addmm``, ``prims::...``, a custom ``lib::op``), not a range or a wrapper."""
    name = event.name
    if getattr(event, "is_user_annotation", False) or "::" not in name or " " in name:
        return False
    return not name.startswith(("autograd::", "torch::", SITE_PREFIX, MODULE_PREFIX, "attnopt.profile::"))


@dataclass
class _Context:
    pass_: str  # "forward" | "backward"
    site: str | None
    modules: tuple[str, ...]  # outermost first
    ops: frozenset[str] = frozenset()  # op names already open above (their total is counted once)


@dataclass
class CallBreakdown:
    """One call's attribution, in seconds (see the module docstring)."""

    total_s: float
    backward_s: float | None
    ops: dict[tuple[str, str, bool], list[float]] = field(default_factory=dict)  # -> [self, total, count]
    modules: dict[str, list[float]] = field(default_factory=dict)  # path -> [self, total, count]
    attention_s: float = 0.0
    attention_ops_s: float = 0.0
    rest_ops_s: float = 0.0
    has_modules: bool = False


def call_breakdown(events: Iterable[Any], device: str) -> CallBreakdown:
    """The breakdown of the one call inside the ``attnopt.profile::forward`` range of ``events``.

    ``events`` are ``torch.profiler`` ``FunctionEvent`` objects (``prof.events()``) or anything
    with their fields; ``device`` is ``"cpu"`` (op times are CPU times) or ``"cuda"`` (device times).
    """
    events = [e for e in events if not _on_device(e)]  # kernels, and ranges mirrored on the device, are not walked
    calls = [e for e in events if e.name == FORWARD_RANGE]
    if len(calls) != 1:
        raise ValueError(f"expected one {FORWARD_RANGE} range in the profile, found {len(calls)}")
    call = calls[0]
    cuda = device == "cuda"

    def self_time(e: Any) -> float:
        return (e.self_device_time_total if cuda else e.self_cpu_time_total) * 1e-6

    def total_time(e: Any) -> float:
        return (e.device_time_total if cuda else e.cpu_time_total) * 1e-6

    backs = [e for e in events if e.name == BACKWARD_RANGE]
    back = backs[0] if backs else None
    result = CallBreakdown(total_s=call.cpu_time_total * 1e-6,
                           backward_s=None if back is None else back.cpu_time_total * 1e-6)
    made_by: dict[int, tuple[float, str | None, tuple[str, ...]]] = {}  # sequence nr -> the forward op's labels

    def visit(root: Any, ctx: _Context) -> None:
        stack = [(root, ctx)]
        while stack:
            e, c = stack.pop()
            if e is back and c.pass_ == "forward":
                continue  # walked as the backward pass, after the forward
            name = e.name
            if name.startswith(SITE_PREFIX) and getattr(e, "is_user_annotation", True):
                c = _Context(c.pass_, name[len(SITE_PREFIX):], c.modules, c.ops)
            elif name.startswith(MODULE_PREFIX):
                c = _Context(c.pass_, c.site, (*c.modules, name[len(MODULE_PREFIX):]), c.ops)
                result.has_modules = True
                _add(result.modules, c.modules[-1], 0.0, 0.0, 1.0)
            elif name.startswith(_EVALUATE) and c.pass_ == "backward" and e.sequence_nr >= 0:
                _, site, modules = made_by.get(e.sequence_nr, (0.0, None, ()))
                c = _Context(c.pass_, site, modules, c.ops)
            s = self_time(e)
            op = is_op(e)
            if op:
                outer = name not in c.ops
                _add(result.ops, (name, c.pass_, c.site is not None), s, total_time(e) if outer else 0.0,
                     1.0 if outer else 0.0)
                if c.pass_ == "forward" and e.sequence_nr >= 0:  # the latest op with the number made the node
                    start = e.time_range.start
                    if start >= made_by.get(e.sequence_nr, (-1.0,))[0]:
                        made_by[e.sequence_nr] = (start, c.site, c.modules)
                if c.site is not None:
                    result.attention_ops_s += s
                else:
                    result.rest_ops_s += s
                c = _Context(c.pass_, c.site, c.modules, c.ops | {name})
            if c.site is not None:
                result.attention_s += s
            for i, path in enumerate(c.modules):  # total: every module around it; self: the innermost
                _add(result.modules, path, s if i == len(c.modules) - 1 else 0.0, s, 0.0)
            if not c.modules:
                _add(result.modules, ROOT_MODULE, s, 0.0, 0.0)
            # children in reverse so that they are visited in time order (sequence numbers need it)
            stack.extend((child, c) for child in reversed(e.cpu_children))

    visit(call, _Context("forward", None, ()))
    if back is not None:
        visit(back, _Context("backward", None, ()))
        # CUDA runs the backward on the autograd engine's device threads: their evaluate_function roots
        start, end = back.time_range.start, back.time_range.end
        for e in events:
            if (e.name.startswith(_EVALUATE) and e.cpu_parent is None and e.thread != back.thread
                    and start <= e.time_range.start <= end):
                visit(e, _Context("backward", None, ()))
    result.modules[ROOT_MODULE] = [result.modules.get(ROOT_MODULE, [0.0])[0], result.total_s, 1.0]
    return result


def _on_device(event: Any) -> bool:
    """A device-side event (a kernel, a copy, a range mirrored on the CUDA timeline)."""
    return getattr(event, "device_type", DeviceType.CPU) == DeviceType.CUDA


def _add(table: dict[Any, list[float]], key: Any, self_s: float, total_s: float, count: float) -> None:
    row = table.setdefault(key, [0.0, 0.0, 0.0])
    row[0] += self_s
    row[1] += total_s
    row[2] += count


def average(calls: Sequence[CallBreakdown], time_kind: str = "cpu",
            modules_note: str | None = None) -> dict[str, Any]:
    """The mean of several calls' breakdowns, as ``report.json`` holds it (means add up; medians would not)."""
    n = len(calls)
    if not n:
        raise ValueError("average() needs at least one call")

    def mean(values: Iterable[float]) -> float:
        return sum(values) / n

    total = mean(c.total_s for c in calls)
    attention = mean(c.attention_s for c in calls)
    backward = [c.backward_s for c in calls if c.backward_s is not None]
    ops: dict[tuple[str, str, bool], list[float]] = {}
    for c in calls:
        for key, row in c.ops.items():
            _add(ops, key, *row)
    op_rows = sorted(({"name": k[0], "pass": k[1], "attention": k[2], "self_s": r[0] / n, "total_s": r[1] / n,
                       "calls": r[2] / n} for k, r in ops.items()), key=lambda r: (-r["self_s"], r["name"]))
    has_modules = all(c.has_modules for c in calls)
    module_rows = None
    if has_modules:
        modules: dict[str, list[float]] = {}
        for c in calls:
            for key, row in c.modules.items():
                _add(modules, key, *row)
        module_rows = sorted(({"path": k, "self_s": r[0] / n, "total_s": r[1] / n, "calls": r[2] / n}
                              for k, r in modules.items()), key=lambda r: (-r["total_s"], r["path"]))
    attention_ops = mean(c.attention_ops_s for c in calls)
    rest_ops = mean(c.rest_ops_s for c in calls)
    return {
        "time": "device" if time_kind == "cuda" else "cpu",
        "calls": n,
        "total_s": total,
        "backward_s": sum(backward) / len(backward) if len(backward) == n else None,
        "attention_s": attention,
        "rest_s": total - attention,
        "outside_ops_s": {"attention": attention - attention_ops, "rest": total - attention - rest_ops},
        "ops": op_rows,
        "modules": module_rows,
        "modules_note": None if has_modules else modules_note,
    }


def top(rows: Sequence[dict[str, Any]] | None, by: str, key: str = "name", n: int = 3) -> list[tuple[str, float]]:
    """The ``n`` largest ``(name, seconds)`` of breakdown rows by ``by`` (``self_s`` or ``total_s``),
    summed over the rows that share ``key`` (an op's forward, backward and attention parts)."""
    summed: dict[str, float] = {}
    for r in rows or ():
        if r[key] == ROOT_MODULE and by == "total_s":
            continue  # the whole call: every module's total is inside it
        summed[r[key]] = summed.get(r[key], 0.0) + r[by]
    return sorted(summed.items(), key=lambda kv: (-kv[1], kv[0]))[:n]
