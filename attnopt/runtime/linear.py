"""Linear layers of the cached LM: ``F.linear`` (or ``addmm``) or oneDNN's inner product, whichever runs faster.

A decode step multiplies every weight matrix of the model by one row per sequence: it is a pass over the
weights, and the kernel that reads them sets its speed. ``F.linear`` on the CPU calls the BLAS torch was
built with (MKL), which on some CPUs runs these shapes far below the memory's speed and on one thread:
on an AMD EPYC (AVX-512), one row times a 6-layer GPT's 42 MB of fp32 weights takes 2.2-2.5 ms at 1 and at 2
threads, while oneDNN's inner product (``torch.ops.mkldnn._linear_pointwise``, the kernel Inductor's CPU
lowering calls) takes 1.9-2.2 and 1.4-1.5 ms, and a plain sum over the same weights 0.8-1.1 and 0.6-0.7 ms
(``benchmarks/bench_generate.py``'s weight passes).

Which is faster depends on where the weights come from: timed alone, one matrix stays in the cache and MKL's
GEMV wins on it; in a step, the model's weights stream from memory and oneDNN wins. So the decision is taken
for a *group*, the weights of one graph's linear layers (:func:`register`, by
:func:`attnopt.passes.fast_linear.use_fast_linear`, whose nodes then call :func:`linear`, or :func:`addmm` for
a weight stored ``(in, out)`` as GPT-2's ``Conv1D`` keeps it, with the group's number), by timing what a step
does: one pass over every weight of the group. The first call of each key
(rows as a power of two, threads, input dtype) decides, with inputs of that call's row count (a graph whose
layers are the very tensors of a live group, a cached model's ragged-batch graph, shares its decisions):

1. oneDNN's result for every weight of the group (checked once per group for one row and once for several)
   must lie within the rounding bound of a dot product of the weight's length against a float64 reference
   (``|y - ref| <= (K + 2) * u * (|x| @ |w|^T + |b|) + u_out * |ref|``, with ``u`` float32's unit roundoff, in
   which both accumulate, and ``u_out`` the result's): any summation order meets it, a wrong kernel does not;
2. both passes are timed in alternating rounds, and oneDNN is kept only when it is faster with 95% confidence
   (:func:`attnopt.selection.stats.compare`, a 5% tie band): where the two are alike, the op as written stays.
   Above 32 rows a product is bound by compute: one weight of each shape is timed for the rest, at 64 rows.

Anything else runs the op as written (``F.linear``, ``torch.addmm``), checked at every call: gradients needed
(oneDNN's op has no autograd formula), autocast (which casts ``F.linear``'s operands and not oneDNN's), a bias
that is not contiguous or not of the layer's output size (oneDNN reads it as if it were contiguous and
broadcasts nothing), oneDNN switched off (``torch.backends.mkldnn``), a CUDA input; and at the decision: dtypes
other than float32 and bfloat16, mixed dtypes, empty operands, a weight of the group freed, or oneDNN missing
or raising. The capture's probes run inside :func:`undecided`, which decides nothing, and so does a call
with fake or meta tensors (a trace). :func:`decisions` lists
every decision with its measured ratio and reason::

    >>> g = register([(w1, b1), (w2, None)])
    >>> y = linear(x, w1, b1, g)     # F.linear(x, w1, b1) within float rounding, by the faster kernel
    >>> decisions()[0]["kernel"]
    'onednn'
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from .guards import is_fake

__all__ = ["addmm", "clear", "decisions", "linear", "onednn_linear", "register", "undecided"]

_DTYPES = (torch.float32, torch.bfloat16)
#: Alternating rounds of the two passes (95% confidence needs 6 pairs at least).
_ROUNDS = 7
#: Rows of the inputs that check oneDNN's results (each weight once; the timing uses the call's row count).
_CHECK_ROWS = 8
#: Output features checked at a time (float64 copies of at most this many rows of a weight).
_CHECK_OUTPUTS = 1024
#: Above this many rows a product is bound by compute, not by reading the weights: the timing passes take one
#: weight of each shape instead of every weight of the group.
_STREAMING_ROWS = 32
#: Rows of the timing passes above :data:`_STREAMING_ROWS` (the ratio of two compute-bound kernels moves little
#: with more rows; a long prompt's first prefill would otherwise pay 16 passes at its full length).
_TIMING_ROWS = 64
_MISSING = object()
#: Inside :func:`undecided`: calls take F.linear and decide nothing (a probe's calls at sizes a model rarely runs).
_UNDECIDED = [0]
_onednn_op: Any = _MISSING


def onednn_linear() -> Any:
    """``torch.ops.mkldnn._linear_pointwise``, or None where this build has no oneDNN (looked up once, lazily:
    importing attnopt touches no op namespace)."""
    global _onednn_op
    if _onednn_op is _MISSING:
        op = None
        if torch.backends.mkldnn.is_available():
            try:
                op = torch.ops.mkldnn._linear_pointwise.default
            except (AttributeError, RuntimeError):
                op = None
        _onednn_op = op
    return _onednn_op


@dataclass(frozen=True)
class _Layer:
    """One linear layer of a group: its weight and bias, held weakly (a cached model must not keep its model's
    tensors alive), and whether the weight is stored ``(in, out)`` (``addmm(b, x, w)``, GPT-2's ``Conv1D``)."""

    weight: weakref.ref
    bias: weakref.ref | None
    in_out: bool


@dataclass
class _Group:
    """The linear layers of one graph (or of several graphs of the same tensors) and the decisions taken."""

    name: str
    layers: list[_Layer]
    choice: dict[tuple[Any, ...], bool] = field(default_factory=dict)
    by_shape: dict[tuple[Any, ...], bool] = field(default_factory=dict)  # the same, by the input's exact shape
    why: dict[tuple[Any, ...], dict[str, Any]] = field(default_factory=dict)
    checked: set[tuple[int, torch.dtype]] = field(default_factory=set)  # oneDNN's results checked: (rows 1|2+, dtype)


_GROUPS: dict[int, _Group] = {}
_NEXT = itertools.count()


def register(layers: list[tuple[torch.Tensor, torch.Tensor | None] | tuple[torch.Tensor, torch.Tensor | None, bool]],
             name: str = "") -> int:
    """The group of these ``(weight, bias)`` layers (``(weight, bias, True)`` for a weight stored ``(in, out)``,
    called through :func:`addmm`), held weakly; returns the number :func:`linear` and :func:`addmm` take. Layers
    of the very same tensors as a live group's (a cached model's plain and ragged-batch graphs, two cached models
    of one model) share its group and decisions. Groups whose tensors were freed are dropped here (a graph holds
    its tensors, so no live graph calls them)."""
    for i in [i for i, g in _GROUPS.items() if any(ly.weight() is None for ly in g.layers)]:
        del _GROUPS[i]
    wanted = [(w, b, bool(rest and rest[0])) for w, b, *rest in layers]
    for i, g in _GROUPS.items():
        if len(g.layers) == len(wanted) and all(
                ly.weight() is w and ly.in_out == t and (b is None if ly.bias is None else ly.bias() is b is not None)
                for ly, (w, b, t) in zip(g.layers, wanted)):
            return i
    i = next(_NEXT)
    _GROUPS[i] = _Group(name, [_Layer(weakref.ref(w), None if b is None else weakref.ref(b), t) for w, b, t in wanted])
    return i


def _chosen(x: torch.Tensor, group: int) -> bool:
    """Whether ``group`` takes oneDNN for an input like ``x`` (deciding now for a new key)."""
    g = _GROUPS.get(group)
    if g is None:  # dropped with its tensors (no graph of it can be running): nothing to decide for
        return False
    shape_key = (x.shape, torch.get_num_threads(), x.dtype, x.is_cpu)  # one lookup for a shape seen before
    use = g.by_shape.get(shape_key)
    if use is None:
        k = x.shape[-1] if x.dim() else 0
        key = ((x.numel() // k).bit_length() if k else 0, shape_key[1], x.dtype, x.device.type)
        use = g.choice.get(key)
        if use is None:
            if _UNDECIDED[0] or is_fake(x) or x.is_meta:  # a probe, or a trace: no values to time or check
                return False
            use = _decide(g, key, x)
        g.by_shape[shape_key] = use
    return use


def _as_written(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out: int) -> bool:
    """Calls oneDNN must not serve, whatever the group chose: gradients needed (no autograd formula), autocast
    (``aten.linear`` is on its lists, oneDNN's op is not: the layer would compute in another dtype), a bias that
    is not contiguous or not of the ``out`` features (oneDNN reads it as if it were contiguous, and broadcasts
    nothing: a ``.data =`` or ``load_state_dict`` after the decision), oneDNN switched off
    (``torch.backends.mkldnn.flags(enabled=False)``), or a CUDA input."""
    return (x.is_cuda or torch.is_autocast_enabled("cpu") or not _mkldnn_enabled()
            or (b is not None and (not b.is_contiguous() or b.shape[0] != out))
            or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad
                                             or (b is not None and b.requires_grad))))


_mkldnn_enabled = getattr(torch._C, "_get_mkldnn_enabled", lambda: torch.backends.mkldnn.enabled)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, group: int) -> torch.Tensor:
    """``F.linear(x, w, b)``, by oneDNN where ``group``'s pass runs faster that way (see the module)."""
    if _as_written(x, w, b, w.shape[0]):
        return F.linear(x, w, b)
    if _chosen(x, group):
        return _onednn_op(x, w, b, "none", [], "")
    return F.linear(x, w, b)


def addmm(b: torch.Tensor, x: torch.Tensor, w: torch.Tensor, group: int) -> torch.Tensor:
    """``torch.addmm(b, x, w)`` (``b + x @ w``, ``w`` stored ``(in, out)``), by oneDNN on ``w.t()`` where ``group``'s
    pass runs faster that way (see the module)."""
    if _as_written(x, w, b, w.shape[-1]):
        return torch.addmm(b, x, w)
    if _chosen(x, group):
        return _onednn_op(x, w.t(), b, "none", [], "")
    return torch.addmm(b, x, w)


def _as_linear(w: torch.Tensor, in_out: bool) -> torch.Tensor:
    """The weight as ``F.linear`` takes it, ``(out, in)``: a view."""
    return w.t() if in_out else w


def _unsupported(x: torch.Tensor, layers: list[tuple[torch.Tensor, torch.Tensor | None, bool]]) -> str | None:
    if onednn_linear() is None:
        return "this build of torch has no oneDNN"
    if x.device.type != "cpu":
        return f"on {x.device.type}, not the CPU"
    if x.dtype not in _DTYPES:
        return f"dtype {x.dtype}: oneDNN's inner product serves float32 and bfloat16"
    if x.dim() < 2 or x.numel() == 0:
        return "a 1-D or empty input"
    if torch.is_autocast_enabled("cpu"):
        return "under autocast, which casts F.linear's operands and not oneDNN's"
    if not _mkldnn_enabled():
        return "oneDNN is switched off (torch.backends.mkldnn.enabled)"
    for w, b, in_out in layers:
        if w.device != x.device or w.dtype != x.dtype or w.dim() != 2 or w.numel() == 0 or (
                b is not None and (b.device != x.device or b.dtype != x.dtype or b.dim() != 1
                                   or not b.is_contiguous() or b.shape[0] != w.shape[1 if in_out else 0])):
            return f"a weight {tuple(w.shape)} {w.dtype} on {w.device} (or its bias) unlike the input"
    return None


def _within_rounding(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    """``y`` is ``x @ w^T + b`` within the rounding of any summation order (see the module's step 1), checked
    :data:`_CHECK_OUTPUTS` output features at a time (a float64 copy of a whole vocabulary's head would take
    16 bytes per weight)."""
    acc = torch.finfo(torch.float32).eps / 2  # float32 accumulation for both dtypes (bfloat16 too)
    out = torch.finfo(y.dtype).eps / 2  # the result rounded to its dtype
    xd = x.double()
    for start in range(0, w.size(0), _CHECK_OUTPUTS):
        wd = w[start:start + _CHECK_OUTPUTS].double()
        bd = None if b is None else b[start:start + _CHECK_OUTPUTS].double()
        ref = F.linear(xd, wd, bd)
        size = F.linear(xd.abs(), wd.abs(), None if bd is None else bd.abs())
        bound = (w.size(1) + 2) * acc * size + out * ref.abs()
        if not bool(((y[..., start:start + _CHECK_OUTPUTS].double() - ref).abs() <= bound).all()):
            return False
    return True


def time_passes(fns: dict[str, Callable[[], None]], rounds: int) -> dict[str, list[float]]:
    """Seconds of each of ``fns`` per round, after one untimed call each, in alternating rounds
    (:func:`attnopt.selection.measure.time_alternating`; a test replaces this to decide from given times)."""
    from ..selection.measure import time_alternating

    times: dict[str, list[float]] = {}
    time_alternating(fns, (), repeats=rounds, warmup=1, samples=times)
    return times


def _measure(layers: list[tuple[torch.Tensor, torch.Tensor | None, bool]], rows: int, dtype: torch.dtype,
             why: dict[str, Any], checked: set[tuple[int, torch.dtype]]) -> tuple[bool, str]:
    from ..selection.stats import compare

    op = _onednn_op
    gen = torch.Generator().manual_seed(0)
    probe_rows = min(rows, _CHECK_ROWS)
    if (min(probe_rows, 2), dtype) not in checked:  # one row (a GEMV) and several: each checked once per group
        for w, b, in_out in layers:
            wl = _as_linear(w, in_out)
            probe = torch.randn(probe_rows, wl.size(1), generator=gen).to(dtype)
            if not _within_rounding(op(probe, wl, b, "none", [], ""), probe, wl, b):
                return False, f"oneDNN's result for a weight {tuple(w.shape)} is outside the rounding bound"
        checked.add((min(probe_rows, 2), dtype))
    if rows > _STREAMING_ROWS:  # compute-bound: one weight of each shape speaks for the others, at fewer rows
        layers = list({(tuple(w.shape), b is None, t): (w, b, t) for w, b, t in layers}.values())
        rows = min(rows, _TIMING_ROWS)
    work = [(_as_linear(w, t), w, b, t) for w, b, t in layers]
    inputs = {k: torch.randn(rows, k, generator=gen).to(dtype) for k in {wl.size(1) for wl, *_ in work}}

    def onednn() -> None:
        for wl, _, b, _ in work:
            op(inputs[wl.size(1)], wl, b, "none", [], "")

    def default() -> None:  # each layer's op as written
        for wl, w, b, in_out in work:
            if in_out:
                torch.addmm(b, inputs[wl.size(1)], w)  # type: ignore[arg-type]
            else:
                F.linear(inputs[wl.size(1)], w, b)

    times = time_passes({"onednn": onednn, "as written": default}, _ROUNDS)
    c = compare(times["onednn"], times["as written"], confidence=0.95, tie=0.05)
    why["onednn / as written"] = round(c.ratio, 3)
    use = c.verdict == "faster"
    return use, "faster with 95% confidence" if use else f"not faster with 95% confidence ({c.verdict})"


def _decide(g: _Group, key: tuple[Any, ...], x: torch.Tensor) -> bool:
    bucket, threads = key[0], key[1]
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    why: dict[str, Any] = {"group": g.name, "rows": f"{2 ** (bucket - 1)}-{2 ** bucket - 1}" if bucket else "0",
                           "dtype": str(x.dtype).replace("torch.", ""), "threads": threads}
    layers = [(ly.weight(), None if ly.bias is None else ly.bias(), ly.in_out) for ly in g.layers]
    use = False
    if any(w is None or (b is None and ly.bias is not None) for (w, b, _), ly in zip(layers, g.layers)):
        reason = "a weight of the group was freed"
    else:
        reason = _unsupported(x, layers)  # type: ignore[arg-type]
    if reason is None:
        try:
            with torch.no_grad():
                use, reason = _measure(layers, rows, x.dtype, why, g.checked)  # type: ignore[arg-type]
        except Exception as e:  # noqa: BLE001 - an upstream kernel that fails is not used, never fatal
            reason = f"oneDNN raised {type(e).__name__}: {e}"
    why.update(weights=len(layers), kernel="onednn" if use else "as written", reason=reason)
    g.choice[key], g.why[key] = use, why
    return use


@contextlib.contextmanager
def undecided() -> Iterator[None]:
    """Calls of keys not decided yet run the op as written and decide nothing, while inside (the cached LM's capture
    probes, which run sizes a generation rarely meets)."""
    _UNDECIDED[0] += 1
    try:
        yield
    finally:
        _UNDECIDED[0] -= 1


def decisions(group: int | None = None) -> list[dict[str, Any]]:
    """Every decision taken in this process (or for ``group``): group, rows, dtype, threads, kernel, the measured
    ratio ``onednn / as written`` of one pass over the group's weights (below 1: oneDNN faster) and the reason."""
    groups = list(_GROUPS.values()) if group is None else [_GROUPS[group]] if group in _GROUPS else []
    return [dict(v) for g in groups for v in g.why.values()]


def clear() -> None:
    """Forget every decision (the next call of each key measures again); groups stay registered."""
    for g in _GROUPS.values():
        g.choice.clear()
        g.by_shape.clear()
        g.why.clear()
        g.checked.clear()
