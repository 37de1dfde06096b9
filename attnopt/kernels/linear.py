"""Linear layers of the cached LM: ``F.linear`` or oneDNN's inner product, whichever this machine runs faster.

A decode step multiplies every weight matrix of the model by one row per sequence: it is a pass over the
weights, and the kernel that reads them sets its speed. ``F.linear`` on the CPU calls the BLAS torch was
built with (MKL), which on some CPUs runs these shapes far below the memory's speed and on one thread:
on an AMD EPYC (AVX-512), one row times a 6-layer GPT's 42 MB of fp32 weights takes 2.3 ms at 1 and at 2
threads, while oneDNN's inner product (``torch.ops.mkldnn._linear_pointwise``, the kernel Inductor's CPU
lowering calls) takes 1.6 and 1.1 ms, and a plain sum over the same weights 0.8 and 0.6 ms.

Which is faster depends on where the weights come from: timed alone, one matrix stays in the cache and MKL's
GEMV wins on it; in a step, the model's weights stream from memory and oneDNN wins. So the decision is taken
for a *group*, the weights of one graph's linear layers (:func:`register`, by
:func:`attnopt.passes.fast_linear.use_fast_linear`, whose nodes then call :func:`linear` with the group's
number), by timing what a step does: one pass over every weight of the group. The first call of each key
(rows as a power of two, threads, input dtype) decides, with inputs of that call's row count:

1. oneDNN's result for every weight of the group must lie within the rounding bound of a dot product of the
   weight's length against a float64 reference (``|y - ref| <= (K + 2) * u * (|x| @ |w|^T + |b|) + u_out *
   |ref|``, with ``u`` float32's unit roundoff, in which both accumulate, and ``u_out`` the result's): any
   summation order meets it, a wrong kernel does not;
2. both passes are timed in alternating rounds, and oneDNN is kept only when it is faster with 95% confidence
   (:func:`attnopt.selection.stats.compare`, a 5% tie band): where the two are alike, ``F.linear`` stays.

Anything else runs ``F.linear``: gradients needed (oneDNN's op has no autograd formula), a device other than
the CPU, dtypes other than float32 and bfloat16, mixed dtypes, empty operands, a weight of the group freed, or
oneDNN missing or raising. :func:`decisions` lists every decision with its measured ratio and reason::

    >>> g = register([(w1, b1), (w2, None)])
    >>> y = linear(x, w1, b1, g)     # F.linear(x, w1, b1) within float rounding, by the faster kernel
    >>> decisions()[0]["kernel"]
    'onednn'
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["clear", "decisions", "linear", "onednn_linear", "register", "undecided"]

_DTYPES = (torch.float32, torch.bfloat16)
#: Alternating rounds of the two passes (95% confidence needs 6 pairs at least).
_ROUNDS = 7
#: Rows of the inputs that check oneDNN's results (each weight once; the timing uses the call's row count).
_CHECK_ROWS = 8
#: Above this many rows a product is bound by compute, not by reading the weights: the timing passes take one
#: weight of each shape instead of every weight of the group.
_STREAMING_ROWS = 32
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


@dataclass
class _Group:
    """The weights (and biases) of one graph's linear layers, held weakly, and the decisions taken for them."""

    name: str
    pairs: list[tuple[weakref.ref, weakref.ref | None]]
    choice: dict[tuple[Any, ...], bool] = field(default_factory=dict)
    by_shape: dict[tuple[Any, ...], bool] = field(default_factory=dict)  # the same, by the input's exact shape
    why: dict[tuple[Any, ...], dict[str, Any]] = field(default_factory=dict)


_GROUPS: list[_Group] = []


def register(pairs: list[tuple[torch.Tensor, torch.Tensor | None]], name: str = "") -> int:
    """A new group of ``(weight, bias)`` pairs (held weakly); returns the number :func:`linear` takes."""
    _GROUPS.append(_Group(name, [(weakref.ref(w), None if b is None else weakref.ref(b)) for w, b in pairs]))
    return len(_GROUPS) - 1


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, group: int) -> torch.Tensor:
    """``F.linear(x, w, b)``, by oneDNN where ``group``'s pass runs faster that way (see the module)."""
    if x.is_cuda or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad
                                                  or (b is not None and b.requires_grad))):
        return F.linear(x, w, b)
    g = _GROUPS[group]
    shape_key = (x.shape, torch.get_num_threads(), x.dtype, x.is_cpu)  # one lookup for a shape seen before
    use = g.by_shape.get(shape_key)
    if use is None:
        k = x.shape[-1] if x.dim() else 0
        key = ((x.numel() // k).bit_length() if k else 0, shape_key[1], x.dtype, x.device.type)
        use = g.choice.get(key)
        if use is None:
            if _UNDECIDED[0]:
                return F.linear(x, w, b)
            use = _decide(g, key, x)
        g.by_shape[shape_key] = use
    if use:
        return _onednn_op(x, w, b, "none", [], "")
    return F.linear(x, w, b)


def _unsupported(x: torch.Tensor, pairs: list[tuple[torch.Tensor, torch.Tensor | None]]) -> str | None:
    if onednn_linear() is None:
        return "this build of torch has no oneDNN"
    if x.device.type != "cpu":
        return f"on {x.device.type}, not the CPU"
    if x.dtype not in _DTYPES:
        return f"dtype {x.dtype}: oneDNN's inner product serves float32 and bfloat16"
    if x.dim() < 2 or x.numel() == 0:
        return "a 1-D or empty input"
    for w, b in pairs:
        if w.device != x.device or w.dtype != x.dtype or w.dim() != 2 or w.numel() == 0 or (
                b is not None and (b.device != x.device or b.dtype != x.dtype or b.dim() != 1)):
            return f"a weight {tuple(w.shape)} {w.dtype} on {w.device} (or its bias) unlike the input"
    return None


def _within_rounding(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    """``y`` is ``x @ w^T + b`` within the rounding of any summation order (see the module's step 1)."""
    xd, wd = x.double(), w.double()
    ref = F.linear(xd, wd, None if b is None else b.double())
    size = F.linear(xd.abs(), wd.abs(), None if b is None else b.double().abs())
    acc = torch.finfo(torch.float32).eps / 2  # float32 accumulation for both dtypes (bfloat16 too)
    out = torch.finfo(y.dtype).eps / 2  # the result rounded to its dtype
    bound = (w.size(1) + 2) * acc * size + out * ref.abs()
    return bool(((y.double() - ref).abs() <= bound).all())


def time_passes(fns: dict[str, Callable[[], None]], rounds: int) -> dict[str, list[float]]:
    """Seconds of each of ``fns`` per round, after one untimed call each, in alternating rounds (a test
    replaces this to decide from given times)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def _measure(pairs: list[tuple[torch.Tensor, torch.Tensor | None]], rows: int, dtype: torch.dtype,
             why: dict[str, Any]) -> tuple[bool, str]:
    from ..selection.stats import compare

    op = _onednn_op
    gen = torch.Generator().manual_seed(0)
    for w, b in pairs:
        probe = torch.randn(min(rows, _CHECK_ROWS), w.size(1), generator=gen).to(dtype)
        if not _within_rounding(op(probe, w, b, "none", [], ""), probe, w, b):
            return False, f"oneDNN's result for a weight {tuple(w.shape)} is outside the rounding bound"
    inputs = {k: torch.randn(rows, k, generator=gen).to(dtype) for k in {w.size(1) for w, _ in pairs}}
    if rows > _STREAMING_ROWS:  # compute-bound: one weight of each shape speaks for the others
        pairs = list({(tuple(w.shape), b is None): (w, b) for w, b in pairs}.values())

    def onednn() -> None:
        for w, b in pairs:
            op(inputs[w.size(1)], w, b, "none", [], "")

    def default() -> None:
        for w, b in pairs:
            F.linear(inputs[w.size(1)], w, b)

    times = time_passes({"onednn": onednn, "F.linear": default}, _ROUNDS)
    c = compare(times["onednn"], times["F.linear"], confidence=0.95, tie=0.05)
    why["onednn / F.linear"] = round(c.ratio, 3)
    use = c.verdict == "faster"
    return use, "faster with 95% confidence" if use else f"not faster with 95% confidence ({c.verdict})"


def _decide(g: _Group, key: tuple[Any, ...], x: torch.Tensor) -> bool:
    bucket, threads = key[0], key[1]
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    why: dict[str, Any] = {"group": g.name, "rows": f"{2 ** (bucket - 1)}-{2 ** bucket - 1}" if bucket else "0",
                           "dtype": str(x.dtype).replace("torch.", ""), "threads": threads}
    held = [(w(), None if b is None else b()) for w, b in g.pairs]
    pairs = [(w, b) for w, b in held if w is not None]
    use = False
    if len(pairs) < len(held) or any(b is None and ref is not None for (_, b), (_, ref) in zip(held, g.pairs)):
        reason = "a weight of the group was freed"
    else:
        reason = _unsupported(x, pairs)  # type: ignore[arg-type]
    if reason is None:
        try:
            with torch.no_grad():
                use, reason = _measure(pairs, rows, x.dtype, why)  # type: ignore[arg-type]
        except Exception as e:  # noqa: BLE001 - an upstream kernel that fails is not used, never fatal
            reason = f"oneDNN raised {type(e).__name__}: {e}"
    why.update(weights=len(pairs), kernel="onednn" if use else "F.linear", reason=reason)
    g.choice[key], g.why[key] = use, why
    return use


@contextlib.contextmanager
def undecided() -> Iterator[None]:
    """Calls of keys not decided yet take ``F.linear`` and decide nothing, while inside (the cached LM's capture
    probes, which run sizes a generation rarely meets)."""
    _UNDECIDED[0] += 1
    try:
        yield
    finally:
        _UNDECIDED[0] -= 1


def decisions(group: int | None = None) -> list[dict[str, Any]]:
    """Every decision taken in this process (or for ``group``): group, rows, dtype, threads, kernel, the measured
    ratio ``onednn / F.linear`` of one pass over the group's weights (below 1: oneDNN faster) and the reason."""
    groups = _GROUPS if group is None else [_GROUPS[group]]
    return [dict(v) for g in groups for v in g.why.values()]


def clear() -> None:
    """Forget every decision (the next call of each key measures again); groups stay registered."""
    for g in _GROUPS:
        g.choice.clear()
        g.by_shape.clear()
        g.why.clear()
