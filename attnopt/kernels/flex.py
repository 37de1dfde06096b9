"""FlexAttention as a candidate: ``flex``, compiled ``torch.nn.attention.flex_attention``.

It serves the sites SDPA cannot: those with a score modifier (``AttentionSpec.score_mod``,
e.g. tanh soft-capping ``c * tanh(s / c)``), with FlexAttention's signature
``score_mod(score, b, h, q_idx, kv_idx)``. The call has SDPA's keyword interface:

* ``is_causal=True`` becomes a ``block_mask`` (``create_block_mask`` with ``q_idx >= kv_idx``,
  top-left like SDPA; with ``window=w`` also ``q_idx - kv_idx < w``, a sliding window), cached per
  ``(Tq, Tk, device, window)``, so fully masked blocks are skipped;
* any other ``attn_mask`` tensor is applied inside the score modifier after the site's own
  modifier (``where(mask, s, -inf)`` for a bool mask, ``s + mask`` for an additive one), which is
  the order ``reference_attention`` defines;
* ``enable_gqa`` is passed through; dropout is refused (FlexAttention has none).

The compiled kernel is made once (``torch.compile(flex_attention)``; dynamo caches one
specialisation per shape). Inside a graph being compiled (``optimize(compile=True)``) the
uncompiled function is called and Inductor fuses it. FlexAttention in this torch has no
backward on CPU: a CPU call that needs gradients runs :func:`attnopt.kernels.reference.reference_attention`,
the same function written out, so gradients stay exact (and slow).

Example::

    >>> cand = get_candidate("flex")
    >>> cand.supports(spec)             # None, or why not (dropout, torch too old, no compiler)
    >>> out = cand(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True, scale=0.125,
    ...            enable_gqa=False, score_mod=lambda s, b, h, i, j: 30 * torch.tanh(s / 30))
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..spec import AttentionSpec
from .bands import in_window
from .reference import reference_attention
from .registry import ScoreMod, register_candidate

try:  # torch >= 2.5
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:  # pragma: no cover - older torch
    create_block_mask = flex_attention = None  # type: ignore[assignment]


def _cpp_compiler() -> str | None:
    """The C++ compiler Inductor would use on CPU, or None."""
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _causal(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
    return q_idx >= kv_idx


def _window(width: int) -> Callable[..., torch.Tensor]:
    def sliding(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return in_window(q_idx, kv_idx, width)

    return sliding


@functools.lru_cache(maxsize=32)
def _causal_block_mask(tq: int, tk: int, device: str, window: int | None = None) -> Any:
    mask_mod = _causal if window is None else _window(window)
    return create_block_mask(mask_mod, B=None, H=None, Q_LEN=tq, KV_LEN=tk, device=device)


@functools.lru_cache(maxsize=1)
def _compiled() -> Callable[..., torch.Tensor]:
    return torch.compile(flex_attention, dynamic=False)


def clear_caches() -> None:
    """Forget the compiled kernel and the cached block masks."""
    _causal_block_mask.cache_clear()
    _compiled.cache_clear()


def _with_mask(score_mod: ScoreMod | None, mask: torch.Tensor, shape: tuple[int, int, int, int]) -> ScoreMod:
    """``score_mod`` followed by ``mask`` (bool keep-mask or additive), indexed per score."""
    full = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)).expand(shape)
    if mask.dtype == torch.bool:
        def mod(score, b, h, q_idx, kv_idx):
            s = score if score_mod is None else score_mod(score, b, h, q_idx, kv_idx)
            return torch.where(full[b, h, q_idx, kv_idx], s, -float("inf"))
    else:
        def mod(score, b, h, q_idx, kv_idx):
            s = score if score_mod is None else score_mod(score, b, h, q_idx, kv_idx)
            return s + full[b, h, q_idx, kv_idx]
    return mod


def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, attn_mask: torch.Tensor | None = None,
         dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
         score_mod: ScoreMod | None = None, window: int | None = None) -> torch.Tensor:
    """SDPA's interface on FlexAttention, plus ``score_mod`` and ``window`` (see the module docstring)."""
    if dropout_p > 0:
        raise ValueError("the flex candidate has no dropout; use the sdpa or math candidate for this site")
    if flex_attention is None:
        raise RuntimeError("FlexAttention needs torch >= 2.5")
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)) or (
        attn_mask is not None and attn_mask.requires_grad)
    if needs_grad and q.device.type == "cpu":  # no FlexAttention backward on CPU in this torch
        return reference_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                   enable_gqa=enable_gqa, score_mod=score_mod, window=window)
    if window is not None and not is_causal:
        raise ValueError("window= needs is_causal=True (a causal sliding window)")
    tq, tk = q.size(-2), k.size(-2)
    block_mask = _causal_block_mask(tq, tk, str(q.device), window) if is_causal else None
    mod = score_mod
    if attn_mask is not None:
        mod = _with_mask(score_mod, attn_mask, (q.size(0), q.size(1), tq, tk))
    fn = flex_attention if torch.compiler.is_compiling() else _compiled()
    return fn(q, k, v, score_mod=mod, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)


@dataclass(frozen=True)
class FlexCandidate:
    """The ``flex`` candidate: FlexAttention, compiled, with SDPA's keyword interface."""

    name: str = "flex"
    description: str = "torch.nn.attention.flex_attention, compiled (score_mod, causal/sliding-window block_mask)"
    costly: bool = True  # compiles per shape (seconds on CPU): tried where SDPA cannot serve, or for a window

    def supports(self, spec: AttentionSpec) -> str | None:
        if flex_attention is None:
            return "FlexAttention needs torch >= 2.5 (torch.nn.attention.flex_attention)"
        if spec.dropout_mode != "off":
            return "FlexAttention has no dropout on the probabilities"
        return None

    def available(self, device: torch.device | str) -> str | None:
        dev = torch.device(device).type
        if flex_attention is None:
            return "FlexAttention needs torch >= 2.5 (torch.nn.attention.flex_attention)"
        if dev == "cpu" and _cpp_compiler() is None:
            return "compiling FlexAttention on CPU needs a C++ compiler (set CXX or install g++)"
        if dev not in ("cpu", "cuda", "xpu"):
            return f"FlexAttention does not run on {dev}"
        return None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return flex(q, k, v, **kwargs)


register_candidate(FlexCandidate())

__all__ = ["FlexCandidate", "clear_caches", "flex"]
