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

#: Without gradients and dropout, scores larger than ``_CHUNK_FROM`` bytes are computed a block of query rows at a
#: time, each block's scores about ``_CHUNK_BYTES``: every row goes through the same operations as in one piece
#: (the softmax is per row; a matmul of fewer rows may round its last bit otherwise, as any kernel's blocking
#: does), the peak memory is one block's, and on the CPU the block's passes run in cache (at B=8, H=12, T=4096 in
#: float32, 6 GiB of scores: 24 s in one piece, 10 s in 32 MiB blocks on the project's host).
_CHUNK_FROM = 256 * 2**20
_CHUNK_BYTES = 32 * 2**20


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

    Where nothing needs a gradient, dropout is off, no ``score_mod`` is given and the scores would take more
    than 256 MiB, the rows are computed in blocks of queries (the same operations on each row; see
    ``_CHUNK_FROM``), in eager mode only.
    """
    tq, tk = q.size(-2), k.size(-2)
    scale = q.size(-1) ** -0.5 if scale is None else scale
    if enable_gqa and k.size(-3) != q.size(-3):
        rep = q.size(-3) // k.size(-3)
        k = k.repeat_interleave(rep, dim=-3)
        v = v.repeat_interleave(rep, dim=-3)
    if window is not None and not is_causal:
        raise ValueError("window= needs is_causal=True (a causal sliding window)")
    keep = None
    if is_causal:
        keep = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril() if window is None \
            else window_keep(tq, tk, window, q.device)
    rows = _rows_per_block(q, k, v, attn_mask, zero_probs, dropout_p, score_mod)
    if rows is None:
        return _attend(q, k, v, scale, keep, attn_mask, score_mod, score_floor, zero_probs, dropout_p)

    def block(t: torch.Tensor | None, start: int, stop: int) -> torch.Tensor | None:
        """The rows ``start:stop`` of a tensor broadcast against the scores (one that broadcasts its rows: all)."""
        if t is None or t.dim() < 2 or t.size(-2) != tq:
            return t
        return t[..., start:stop, :]

    # every block reads all of k and v: laid out once (a transposed head split would be copied by each block's matmul)
    k, v = k.contiguous(), v.contiguous()
    out = [_attend(q[..., i:i + rows, :], k, v, scale, block(keep, i, i + rows), block(attn_mask, i, i + rows),
                   None, score_floor, block(zero_probs, i, i + rows), 0.0) for i in range(0, tq, rows)]
    return torch.cat(out, dim=-2)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, keep: torch.Tensor | None,
            attn_mask: torch.Tensor | None, score_mod: ScoreMod | None, score_floor: str | None,
            zero_probs: torch.Tensor | None, dropout_p: float) -> torch.Tensor:
    """:func:`reference_attention` on q, k, v of equal heads, with the causal ``keep`` mask built."""
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, Tq, Tk)
    if score_mod is not None:
        b, h, qi, ki = (torch.arange(n, device=q.device) for n in scores.shape)
        scores = score_mod(scores, b[:, None, None, None], h[None, :, None, None], qi[None, None, :, None],
                           ki[None, None, None, :])
    if keep is not None:
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


def _rows_per_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
                    zero_probs: torch.Tensor | None, dropout_p: float, score_mod: ScoreMod | None) -> int | None:
    """Query rows per block for :func:`reference_attention`, or None to compute the scores in one piece: with
    gradients (autograd would keep every block's scores all the same), dropout (its draws would come in another
    order), a ``score_mod`` (it may hold tensors of the whole scores' shape), while traced or under a functorch
    transform, for tensor subclasses, nested or sparse tensors, masks whose rows match neither the queries nor one
    row (the computation in one piece raises), and for scores up to ``_CHUNK_FROM`` bytes."""
    if dropout_p > 0 or score_mod is not None or q.dim() < 2 or k.dim() < 2 or v.dim() < 2:
        return None
    tensors = [t for t in (q, k, v, attn_mask, zero_probs) if t is not None]
    if any(type(t) is not torch.Tensor or t.is_nested or t.layout != torch.strided for t in tensors):
        return None  # subclasses (fake, functional), nested or sparse tensors: no plain strided rows
    # (plain tensors hold plain sizes: a traced one, whose sizes may be symbolic, is a subclass (fake) here)
    # the product of the leading sizes bounds the broadcast one: most calls stop at this cheap test
    tq, tk = q.size(-2), k.size(-2)
    masks = [t for t in (attn_mask, zero_probs) if t is not None and t.dim() >= 2]
    itemsize = max(q.dtype.itemsize, k.dtype.itemsize)
    bound = tq * tk * itemsize
    for t in (q, k, v, *masks):
        rows_cols = t.size(-2) * t.size(-1)
        bound *= t.numel() // rows_cols if rows_cols else 1
    if bound <= _CHUNK_FROM:
        return None
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None
    if any(not isinstance(n, int) for t in tensors for n in t.shape):
        return None
    if any(t.size(-2) not in (tq, 1) for t in masks):
        return None  # rows that do not match the queries: the computation in one piece raises, as it should
    try:
        lead = 1
        for n in torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2], *(t.shape[:-2] for t in masks)):
            lead *= n
    except RuntimeError:
        return None  # shapes that do not broadcast: one piece raises
    size = lead * tk * itemsize
    if size * tq <= _CHUNK_FROM:
        return None
    rows = max(1, _CHUNK_BYTES // size)
    return rows if rows < tq else None


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
