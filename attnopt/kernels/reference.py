"""The exactness contract: the computation as written, and the tolerance every rewrite must meet.

:func:`reference_attention` is ``softmax(scale * q @ k^T + mask) @ v`` written out (registered as
the ``math`` candidate: the fallback of every site and what the others are checked against).
:func:`tolerance` is the ``(atol, rtol)`` per dtype that outputs and gradients of a rewrite must
meet against it; ``passes.verify``, the sites' per-shape checks and the selector's trials all use it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import kernels  # noqa: E402,F401 - registers the kernels' candidates (they import this module)
from .bands import window_keep
from .registry import FunctionCandidate, ScoreMod, register_candidate


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                        attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                        is_causal: bool = False, scale: float | None = None,
                        enable_gqa: bool = False, score_mod: ScoreMod | None = None,
                        window: int | None = None, score_floor: str | None = None,
                        zero_probs: torch.Tensor | None = None) -> torch.Tensor:
    """The plain computation SDPA documents, written out: the ``math`` candidate.

    ``score_mod`` (FlexAttention's signature) is applied to the scaled scores before the mask;
    ``window`` (with ``is_causal``) also hides keys ``window`` or more positions behind the query;
    ``score_floor`` (``"maximum"`` or ``"clamp"``, ``AttentionSpec.score_floor``) floors the masked scores at
    their dtype's minimum as XGLM spells it (``torch.maximum`` halves the gradient of a tie, ``clamp_min`` not);
    ``zero_probs`` (a bool tensor broadcast against the scores) zeroes the probabilities where it holds, after
    the softmax, as ``softmax(s.masked_fill(m, -inf)).masked_fill(m, 0)`` is written.
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
    if score_floor == "maximum":
        scores = torch.maximum(scores, scores.new_full((), torch.finfo(scores.dtype).min))
    elif score_floor is not None:
        scores = scores.clamp_min(torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1)
    if zero_probs is not None:
        probs = probs.masked_fill(zero_probs, 0.0)
    if dropout_p > 0:
        probs = F.dropout(probs, dropout_p, training=True)
    return probs @ v


#: the registered ``math`` candidate: the reference computation itself (the selector's reference run is its check)
MATH = register_candidate(FunctionCandidate("math", reference_attention, lambda spec: None,
                                     "softmax(scale * q @ k^T + mask) @ v written out", windowed=True,
                                     every_shape=True, materialises=True))


#: ``(atol, rtol)`` per output dtype. fp32 allows for a fused kernel's other summation order over long key
#: axes; bf16 and fp16 for the reference softmax itself rounding to the dtype. The sites' per-shape checks
#: hold half types to a stricter rule besides (no less accurate than the computation as written against
#: float64); see :mod:`attnopt.runtime.dispatch`.
TOLERANCES = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-4, 1e-4),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (5e-3, 5e-3),
}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) that a rewrite must meet for outputs of ``dtype``."""
    return TOLERANCES.get(dtype, (1e-4, 1e-4))
