"""The vocabulary every layer speaks: what a site computes, what was decided about it, and why not.

A :class:`SiteRecord` is created by ``find_sites`` for every softmax in a captured graph and
filled in by later passes (``rewrite_sdpa`` sets the decision; ``verify`` may revoke it; the
selector adds the timings that chose its candidate). :class:`AttentionSpec` is the proven, frozen
description of the function a matched site computes, which every candidate implementation
receives. :class:`Refusal` is the one exception type for "attnopt cannot prove this": the matcher,
the mask planner and the position analysis raise it (or a subclass) with the reason that
``explain()`` shows; candidates say the same with the reason string their ``supports`` returns.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


class Refusal(Exception):
    """attnopt cannot prove what a rewrite needs; ``str(e)`` is the reason, worded for ``explain()``.

    ``decision`` is what the site's record says as a result (``LEFT_ALONE`` for a near miss,
    ``NOT_ATTENTION`` for a softmax that is no attention at all).
    """

    def __init__(self, reason: str = "", decision: str | None = None):
        super().__init__(reason)
        self.decision = LEFT_ALONE if decision is None else decision


class PositionError(Refusal, ValueError):
    """The graph cannot run on new tokens with a KV cache; the message names the op and line."""


#: Decisions a site can carry.
REWRITTEN = "rewritten"
LEFT_ALONE = "left alone"
NOT_ATTENTION = "not attention"


@dataclass(frozen=True)
class AttentionSpec:
    """The function a matched site computes: ``softmax(scale * q @ k^T + mask) @ v``.

    Attributes:
        scale: the factor on the scores as a Python float; ``1.0`` when the scale was written
            on ``q`` (then it stays there) or folded from a tensor into ``q``. With
            ``runtime_scale`` it is multiplied by numbers only known at run time (dynamo turns
            float module attributes into inputs), which the site receives as an argument.
        mask: ``"none"``, ``"bool"`` (True = attend) or ``"additive"`` (added to the scores).
        causal: ``None``, ``"top_left"`` or ``"bottom_right"``: the mask is proven to be exactly
            this causal pattern (so ``is_causal`` may replace it when the alignment allows).
        nan_rows: reproduce NaN for rows whose keys are all masked with ``-inf`` (the
            original's result), since SDPA returns zeros there.
        dropout_p: the dropout probability on the attention probabilities.
        dropout_mode: ``"off"``, ``"on"`` (always active), or ``"module"`` (active when the
            rewritten module is in training mode, like the ``nn.Dropout`` it replaces).
        runtime_dropout: the dropout probability is a run-time number passed to the site.
        min_rows: what to do with rows whose keys all carry the dtype's minimum (uniform
            attention as written): ``"none"`` (cannot occur), ``"mean"`` (every key filled by
            ``masked_fill``: the row is the mean of v and sends no gradient to q or k, as
            written) or ``"math"`` (an added mask: run the reference computation for calls
            that have such rows, since SDPA's fused backward loses the 1/Tk normalisation there).
        score_mod: description of an elementwise score modifier between the product and the
            softmax (e.g. tanh soft-capping), or None; the site module holds the callable
            (:class:`ElementwiseScoreMod`).
        fill_value: a finite fill such as ``masked_fill(m, -1e4)``: the mask reaches the candidate
            as the dtype's minimum, which equals the fill as written only when every kept score
            provably dwarfs it; the site checks that bound on every call and otherwise computes
            the fill as written (see ``runtime/site.BoundedFillSite``).
        window: with ``causal``, a sliding window: each query keeps only the ``window`` most recent
            keys (``0 <= q_idx - kv_idx < window`` in the causal alignment). Candidates that know
            windows (FlexAttention as a ``block_mask``, the tiled kernel) skip the rest; others get
            the band as a boolean mask.
        conditions: how many run-time mask terms the causal/window proof assumes (a padding mask that
            keeps every key, ``x.all()``, or hides none, ``not x.any()``); the site checks them on every
            call and passes the mask tensor when one fails.
        gqa: key/value heads are shared by groups of query heads (``repeat_kv`` proven), so
            ``k`` and ``v`` are passed unrepeated with ``enable_gqa=True``.
        ndim: rank of q/k/v as written (2, 3 or 4); candidates see 4-D tensors.
        compute_dtype: dtype the products were computed in.
        out_dtype: dtype of the site's output as written.
        sink: the scores carry an attention sink: one more logit column per query row (gpt-oss, learned
            per-head sinks), dropped from the probabilities after the softmax. The rewrite passes it as
            one more key whose value is zero (q, k and v widened in the graph; ``passes/rewrite_sdpa``), so
            the site sees plain attention with ``Tk + 1`` keys and its mask (never ``is_causal``).
        zero_rows: the probabilities are zeroed after the softmax where the scores were masked, so rows
            whose every key is hidden are zero (the rewrite zeroes them after the site).
        score_floor: ``"maximum"`` or ``"clamp"``: the scores are floored at the dtype's minimum right
            before the softmax (XGLM's ``torch.max(s, finfo.min)``; ``clamp(s, min=finfo.min)``), so a row
            whose every key is masked is uniform, ``-inf`` included. On calls without gradients the site
            floors its mask tensor the same way; with gradients it computes such rows as written, the floor
            as spelled (``maximum`` halves the gradient where the scores equal the minimum).
    """

    scale: float
    mask: str = "none"
    causal: str | None = None
    nan_rows: bool = False
    dropout_p: float = 0.0
    dropout_mode: str = "off"
    gqa: bool = False
    ndim: int = 4
    compute_dtype: torch.dtype | None = None
    out_dtype: torch.dtype | None = None
    runtime_scale: bool = False
    runtime_dropout: bool = False
    min_rows: str = "none"
    score_mod: str | None = None
    fill_value: float | None = None
    window: int | None = None
    conditions: int = 0
    sink: bool = False
    zero_rows: bool = False
    score_floor: str | None = None

    def __post_init__(self) -> None:
        if self.mask not in ("none", "bool", "additive"):
            raise ValueError(f"mask must be 'none', 'bool' or 'additive', got {self.mask!r}")
        if self.causal not in (None, "top_left", "bottom_right"):
            raise ValueError(f"causal must be None, 'top_left' or 'bottom_right', got {self.causal!r}")
        if self.min_rows not in ("none", "mean", "math"):
            raise ValueError(f"min_rows must be 'none', 'mean' or 'math', got {self.min_rows!r}")
        if self.score_floor not in (None, "maximum", "clamp"):
            raise ValueError(f"score_floor must be None, 'maximum' or 'clamp', got {self.score_floor!r}")
        if self.dropout_mode not in ("off", "on", "module"):
            raise ValueError(f"dropout_mode must be 'off', 'on' or 'module', got {self.dropout_mode!r}")
        if self.window is not None and (self.causal is None or not isinstance(self.window, int) or self.window < 1):
            raise ValueError(f"window must be a positive int on a causal site, got {self.window!r} "
                             f"(causal={self.causal!r})")
        if not (isinstance(self.scale, float) and math.isfinite(self.scale)):
            raise ValueError(f"scale must be a finite float, got {self.scale!r}")

    def describe(self) -> str:
        parts = [f"scale={self.scale:.6g}" + (" x run-time value" if self.runtime_scale else "")]
        if self.causal:
            parts.append(f"causal ({self.causal.replace('_', '-')})")
            if self.window is not None:
                parts.append(f"sliding window {self.window}")
            if self.conditions:
                terms = "a run-time mask term hides" if self.conditions == 1 \
                    else f"{self.conditions} run-time mask terms hide"
                parts.append(f"while {terms} no key (checked per call)")
        elif self.mask != "none" and self.fill_value is None:
            parts.append(f"{self.mask} mask")
        if self.fill_value is not None:
            parts.append(f"mask filled with {self.fill_value:g} (bounded)")
        if self.dropout_mode != "off":
            parts.append("dropout p=run-time value" if self.runtime_dropout else f"dropout p={self.dropout_p:g}")
        if self.gqa:
            parts.append("GQA")
        if self.score_mod:
            parts.append(f"score_mod {self.score_mod}")
        if self.sink:
            parts.append("attention sink (one more key)")
        if self.zero_rows:
            parts.append("rows with every key hidden are zero")
        if self.score_floor:
            parts.append("scores floored at the dtype's minimum")
        return ", ".join(parts)


_UNARY: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"tanh": torch.tanh, "sigmoid": torch.sigmoid}


def _number(x: Any) -> bool:
    return isinstance(x, float) and math.isfinite(x)


@dataclass(frozen=True)
class ElementwiseScoreMod:
    """A score modifier read from the graph: elementwise steps applied to the scaled score, in order.

    Steps are ``("tanh",)``, ``("sigmoid",)``, ``("mul", c)``, ``("add", c)`` or
    ``("clamp", lo, hi)`` (either bound may be None); called with FlexAttention's signature
    ``(score, b, h, q_idx, kv_idx)`` (the indices are unused: the function is elementwise).

    >>> ElementwiseScoreMod((("tanh",), ("mul", 30.0))).describe()
    '30*tanh(s)'
    """

    steps: tuple[tuple[Any, ...], ...]

    def __post_init__(self) -> None:
        for step in self.steps:
            ok = (step[0] in _UNARY and len(step) == 1) or (
                step[0] in ("mul", "add") and len(step) == 2 and _number(step[1])) or (
                step[0] == "clamp" and len(step) == 3 and all(b is None or _number(b) for b in step[1:])
                and step[1:] != (None, None))
            if not ok:
                raise ValueError(f"unknown score modifier step {step!r}; known: {sorted(_UNARY)}, ('mul', c), "
                                 "('add', c) and ('clamp', lo, hi)")

    def __call__(self, score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                 kv_idx: torch.Tensor) -> torch.Tensor:
        for step in self.steps:
            if step[0] == "mul":
                score = score * step[1]
            elif step[0] == "add":
                score = score + step[1]
            elif step[0] == "clamp":
                score = torch.clamp(score, step[1], step[2])
            else:
                score = _UNARY[step[0]](score)
        return score

    def describe(self) -> str:
        expr = "s"
        for step in self.steps:
            if step[0] == "mul":
                expr = f"{step[1]:g}*{expr}"
            elif step[0] == "add":
                expr = f"({expr} {'+' if step[1] >= 0 else '-'} {abs(step[1]):g})"
            elif step[0] == "clamp":
                expr = f"clamp({expr}, {step[1] if step[1] is None else f'{step[1]:g}'}, " \
                       f"{step[2] if step[2] is None else f'{step[2]:g}'})"
            else:
                expr = f"{step[0]}({expr})"
        return expr


@dataclass
class SiteRecord:
    """One softmax in a captured graph and everything attnopt decided about it."""

    name: str
    module_path: str = ""
    source: str = ""
    spelling: list[str] = field(default_factory=list)
    decision: str = NOT_ATTENTION
    reason: str = ""
    rewrite: str = ""
    spec: AttentionSpec | None = None
    graph_id: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def rewritten(self) -> bool:
        return self.decision == REWRITTEN

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "module_path": self.module_path,
            "source": self.source,
            "spelling": " ".join(self.spelling),
            "decision": self.decision,
            "rewrite": self.rewrite,
            "reason": self.reason,
            "spec": self.spec.describe() if self.spec else "",
        }
