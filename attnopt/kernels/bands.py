"""Bands and windows as tensors: the mask maths shared by kernels, run-time guards and the mask planner.

A *band* is a 2-D mask that is piecewise constant in ``d = j - i`` (key index minus query index):
:func:`band_pattern` reads one off a concrete tensor (the cuts and the value between them),
:func:`is_band` checks a tensor against one. A causal sliding window keeps ``i - w < j <= i``
(:func:`in_window`); candidates that cannot skip its blocks receive it as a boolean keep-mask
(:func:`window_keep`, :func:`window_as_mask`).
"""

from __future__ import annotations

from typing import Any

import torch

from .. import kernels  # noqa: E402,F401 - registers the kernels' candidates (they import this module)


def in_window(q_idx: torch.Tensor, kv_idx: torch.Tensor, window: int) -> torch.Tensor:
    """The causal sliding window's rule on index tensors: ``0 <= q_idx - kv_idx < window``."""
    return (kv_idx <= q_idx) & (q_idx - kv_idx < window)


def window_keep(tq: int, tk: int, window: int, device: torch.device | str) -> torch.Tensor:
    """``(tq, tk)`` bool keep-mask of the top-left causal window (:func:`in_window`)."""
    return in_window(torch.arange(tq, device=device)[:, None], torch.arange(tk, device=device)[None, :], window)


def window_as_mask(q: torch.Tensor, k: torch.Tensor, kwargs: dict) -> dict:
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


def band_pattern(t: torch.Tensor, max_cuts: int = 4) -> tuple[tuple[int, ...], tuple[Any, ...]] | None:
    """``(cuts, values)`` when ``t``'s last two dims depend only on ``j - i`` (leading dims 1), else None."""
    if t.dim() < 2 or any(s != 1 for s in t.shape[:-2]):
        return None
    t2 = t.detach().reshape(t.shape[-2], t.shape[-1])
    n, m = t2.shape
    if n < 1 or m < 1:
        return None
    per_diag = torch.cat([t2[1:, 0].flip(0), t2[0, :]])  # d = -(n-1) .. m-1
    i = torch.arange(n, device=t2.device)[:, None]
    j = torch.arange(m, device=t2.device)[None, :]
    if not torch.equal(per_diag[j - i + n - 1], t2):
        return None
    change = (per_diag[1:] != per_diag[:-1]).nonzero().flatten().tolist()
    if len(change) > max_cuts:
        return None
    cuts = tuple(int(c) - (n - 1) for c in change)  # d <= cut keeps the value before the change
    values = tuple(per_diag[[0] + [c + 1 for c in change]].tolist())
    return cuts, values


def is_band(t: torch.Tensor, cuts: tuple[int, ...], values: tuple[Any, ...]) -> bool:
    """``t`` holds exactly the band ``(cuts, values)`` (see :func:`band_pattern`); a few passes over ``t``."""
    if t.dim() < 2 or any(s != 1 for s in t.shape[:-2]) or len(values) != len(cuts) + 1:
        return False
    t2 = t.detach().reshape(t.shape[-2], t.shape[-1])
    expected = torch.full(t2.shape, values[-1], dtype=t2.dtype, device=t2.device)
    if cuts:
        ones = torch.ones(t2.shape, dtype=torch.bool, device=t2.device)
        for c, v in zip(reversed(cuts), reversed(values[:-1])):  # d <= c holds v, below the next cut down
            expected = torch.where(ones.tril(c), torch.tensor(v, dtype=t2.dtype, device=t2.device), expected)
    return bool(torch.equal(t2, expected))
