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
says why it cannot run elsewhere. The selector (:mod:`attnopt.selector`) times the ones
that support a site and keeps the fastest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .site import AttentionSpec

#: FlexAttention's score modifier signature: ``score_mod(score, b, h, q_idx, kv_idx) -> score``,
#: applied to the scaled score before the mask. Candidates only receive ``score_mod=`` when the
#: site has one (``spec.score_mod``), so SDPA-shaped functions need not accept it.
ScoreMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

#: A causal sliding window reaches candidates as ``window=w`` next to ``is_causal=True``: query
#: ``i`` keeps keys ``i - w < j <= i`` (top-left). Only sites with ``spec.window`` pass it. Candidates
#: registered with ``windowed=True`` skip the hidden blocks; the others receive the band as a
#: boolean ``attn_mask`` (:func:`window_keep`) and ``is_causal=False``, so SDPA serves it exactly.


def in_window(q_idx: torch.Tensor, kv_idx: torch.Tensor, window: int) -> torch.Tensor:
    """The causal sliding window's rule on index tensors: ``0 <= q_idx - kv_idx < window``."""
    return (kv_idx <= q_idx) & (q_idx - kv_idx < window)


def window_keep(tq: int, tk: int, window: int, device: torch.device | str) -> torch.Tensor:
    """``(tq, tk)`` bool keep-mask of the top-left causal window (:func:`in_window`)."""
    return in_window(torch.arange(tq, device=device)[:, None], torch.arange(tk, device=device)[None, :], window)


def _window_as_mask(q: torch.Tensor, k: torch.Tensor, kwargs: dict) -> dict:
    """``kwargs`` with ``window=`` turned into SDPA's terms (a bool mask, ``is_causal=False``)."""
    kwargs = dict(kwargs)
    window = kwargs.pop("window", None)
    if window is None:
        return kwargs
    if not kwargs.get("is_causal"):
        raise ValueError("window= needs is_causal=True (a causal sliding window)")
    keep = window_keep(q.size(-2), k.size(-2), int(window), q.device)
    mask = kwargs.get("attn_mask")
    if mask is None:
        kwargs["attn_mask"] = keep
    elif mask.dtype == torch.bool:
        kwargs["attn_mask"] = mask & keep
    else:
        kwargs["attn_mask"] = mask.masked_fill(~keep, float("-inf"))
    kwargs["is_causal"] = False
    return kwargs


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
    windowed: bool = False  # takes ``window=`` itself (else the window arrives as a bool mask)

    def supports(self, spec: AttentionSpec) -> str | None:
        return self.check(spec)

    def available(self, device: torch.device) -> str | None:
        if self.devices and torch.device(device).type not in self.devices:
            return f"runs on {', '.join(self.devices)} only"
        return None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: object) -> torch.Tensor:
        if "window" in kwargs and not self.windowed:
            kwargs = _window_as_mask(q, k, kwargs)
        return self.fn(q, k, v, **kwargs)


_REGISTRY: dict[str, Candidate] = {}


def register_candidate(candidate: Candidate) -> Candidate:
    """Add ``candidate`` to the registry under ``candidate.name`` (replacing any of that name)."""
    _REGISTRY[candidate.name] = candidate
    return candidate


def get_candidate(name: str) -> Candidate:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown candidate {name!r}; registered: {sorted(_REGISTRY)}") from None


def candidate_names() -> list[str]:
    return sorted(_REGISTRY)


def _sdpa_supports(spec: AttentionSpec) -> str | None:
    if spec.score_mod is not None:
        return f"SDPA cannot apply a score modifier ({spec.score_mod})"
    if spec.gqa and not _HAS_GQA:
        return "enable_gqa needs torch >= 2.5"
    return None


_HAS_GQA = torch.__version__ >= "2.5"  # TorchVersion compares as a version


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, attn_mask: torch.Tensor | None,
          dropout_p: float, is_causal: bool, scale: float, enable_gqa: bool) -> torch.Tensor:
    if enable_gqa:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                        attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                        is_causal: bool = False, scale: float | None = None,
                        enable_gqa: bool = False, score_mod: ScoreMod | None = None,
                        window: int | None = None) -> torch.Tensor:
    """The plain computation SDPA documents, written out: the ``math`` candidate.

    ``score_mod`` (FlexAttention's signature) is applied to the scaled scores before the mask;
    ``window`` (with ``is_causal``) also hides keys ``window`` or more positions behind the query.
    """
    tq, tk = q.size(-2), k.size(-2)
    scale = q.size(-1) ** -0.5 if scale is None else scale
    if enable_gqa and k.size(-3) != q.size(-3):
        rep = q.size(-3) // k.size(-3)
        k = k.repeat_interleave(rep, dim=-3)
        v = v.repeat_interleave(rep, dim=-3)
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, Tq, Tk)
    if score_mod is not None:
        b, h, qi, ki = (torch.arange(n, device=q.device) for n in scores.shape)
        scores = score_mod(scores, b[:, None, None, None], h[None, :, None, None], qi[None, None, :, None],
                           ki[None, None, None, :])
    if window is not None and not is_causal:
        raise ValueError("window= needs is_causal=True (a causal sliding window)")
    if is_causal:
        keep = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril() if window is None \
            else window_keep(tq, tk, window, q.device)
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0:
        probs = F.dropout(probs, dropout_p, training=True)
    return probs @ v


register_candidate(FunctionCandidate("sdpa", _sdpa, _sdpa_supports,
                                     "torch.nn.functional.scaled_dot_product_attention"))
def _restricted(backend: SDPBackend) -> Callable[..., torch.Tensor]:
    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: object) -> torch.Tensor:
        with sdpa_kernel(backend):
            return _sdpa(q, k, v, **kwargs)  # type: ignore[arg-type]

    return fn


for _name, _backend, _devices in (("sdpa_flash", "FLASH_ATTENTION", ("cpu", "cuda")),
                                  ("sdpa_math", "MATH", ("cpu", "cuda")),
                                  ("sdpa_efficient", "EFFICIENT_ATTENTION", ("cuda",)),
                                  ("sdpa_cudnn", "CUDNN_ATTENTION", ("cuda",))):
    if hasattr(SDPBackend, _backend):
        register_candidate(FunctionCandidate(_name, _restricted(getattr(SDPBackend, _backend)), _sdpa_supports,
                                             f"SDPA restricted to its {_backend.lower()} backend", _devices))

register_candidate(FunctionCandidate("math", reference_attention, lambda spec: None,
                                     "softmax(scale * q @ k^T + mask) @ v written out", windowed=True))

from . import kernels  # noqa: E402,F401 - registers the kernels' candidates (they import this module)
