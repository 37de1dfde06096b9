"""Candidate implementations of a proven attention site, behind one interface.

Every candidate is called like ``torch.nn.functional.scaled_dot_product_attention`` on 4-D
tensors (``q: (B, H, Tq, D)``, ``k: (B, Hkv, Tk, D)``, ``v: (B, Hkv, Tk, Dv)``) with the
scale always explicit, and says up front whether it can serve a site::

    >>> cand = get_candidate("sdpa")
    >>> cand.supports(spec)       # None, or the reason it cannot
    >>> out = cand(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True, scale=0.125)

Registered: ``sdpa`` (PyTorch's dispatcher picks the backend); ``sdpa_flash`` and
``sdpa_math`` (SDPA restricted to one backend with ``torch.nn.attention.sdpa_kernel``; on
CUDA also ``sdpa_efficient`` and ``sdpa_cudnn``); ``math`` (the computation as written
out, used to check the others and as the runtime fallback); and the kernels under
:mod:`attnopt.kernels` (the tiled kernel at several block sizes, FlexAttention). A
candidate that only runs on some devices names them in ``devices``; ``available(device)``
says why it cannot run elsewhere. The selector (:mod:`attnopt.selection.selector`) times the ones
that support a site and keeps the fastest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from ..spec import AttentionSpec
from .bands import window_as_mask

#: FlexAttention's score modifier signature: ``score_mod(score, b, h, q_idx, kv_idx) -> score``,
#: applied to the scaled score before the mask. Candidates only receive ``score_mod=`` when the
#: site has one (``spec.score_mod``), so SDPA-shaped functions need not accept it.
ScoreMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

#: A causal sliding window reaches candidates as ``window=w`` next to ``is_causal=True``: query
#: ``i`` keeps keys ``i - w < j <= i`` (top-left). Only sites with ``spec.window`` pass it. Candidates
#: registered with ``windowed=True`` skip the hidden blocks; the others receive the band as a
#: boolean ``attn_mask`` (``bands.window_keep``) and ``is_causal=False``, so SDPA serves it exactly.


class Candidate(Protocol):
    name: str

    def supports(self, spec: AttentionSpec) -> str | None: ...

    def available(self, device: torch.device) -> str | None: ...

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                 attn_mask: torch.Tensor | None, dropout_p: float, is_causal: bool, scale: float,
                 enable_gqa: bool, score_mod: ScoreMod | None = None, window: int | None = None) -> torch.Tensor: ...


@dataclass(frozen=True)
class FunctionCandidate:
    """A candidate made of a function with SDPA's signature and a support check."""

    name: str
    fn: Callable[..., torch.Tensor]
    check: Callable[[AttentionSpec], str | None]
    description: str = ""
    devices: tuple[str, ...] = ()  # device types it runs on; empty: any
    costly: bool = False  # compiles per shape (seconds): the selector tries it only where nothing cheaper serves
    #: writes out the (B, H, Tq, Tk) scores: the selector does not time it where those are large (``max_scores``)
    materialises: bool = False
    windowed: bool = False  # takes ``window=`` itself (else the window arrives as a bool mask)
    #: computes the same function at every shape by construction (no code generated or picked per shape), so a
    #: check at one shape speaks for a graph compiled for all shapes; see :func:`checked_at_every_shape`
    every_shape: bool = False

    def supports(self, spec: AttentionSpec) -> str | None:
        return self.check(spec)

    def available(self, device: torch.device) -> str | None:
        if self.devices and torch.device(device).type not in self.devices:
            return f"runs on {', '.join(self.devices)} only"
        return None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: object) -> torch.Tensor:
        if "window" in kwargs and not self.windowed:
            kwargs = window_as_mask(q, k, kwargs)
        return self.fn(q, k, v, **kwargs)


_REGISTRY: dict[str, Candidate] = {}

#: Candidates whose autograd graph is plain PyTorch, differentiable any number of times: with dropout and
#: gradients a site serves ``math`` for any other (the dropout mask must be part of a graph autograd can
#: differentiate again), so only these are raced for such calls.
TWICE_DIFFERENTIABLE = frozenset(("math", "sdpa_math"))


def register_candidate(candidate: Candidate) -> Candidate:
    """Add ``candidate`` to the registry under ``candidate.name`` (replacing any of that name)."""
    _REGISTRY[candidate.name] = candidate
    return candidate


def get_candidate(name: str) -> Candidate:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown candidate {name!r}; registered: {sorted(_REGISTRY)}") from None


def checked_at_every_shape(name: str) -> bool:
    """Whether a check of ``name`` at one shape speaks for every shape: attnopt's own kernels written in PyTorch
    ops and PyTorch's SDPA (which attnopt takes as the reference's equal), not FlexAttention (compiled per
    shape, wrong at some small shapes on some CPUs) nor a candidate registered by the user (unknown code).
    A graph compiled for dynamic shapes serves every shape with what it was traced with, and no check runs
    inside it, so only these may be traced into one."""
    return bool(getattr(_REGISTRY.get(name), "every_shape", False))


def candidate_names() -> list[str]:
    return sorted(_REGISTRY)


