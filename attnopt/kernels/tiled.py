"""Tiled (FlashAttention-style) attention in plain PyTorch: exact, with O(T x block) memory.

    >>> out = tiled_attention(q, k, v, is_causal=True, scale=0.125, block_q=64, block_k=64)
    >>> out.sum().backward()          # recomputes each block; never holds a (Tq, Tk) matrix

Same function as ``torch.nn.functional.scaled_dot_product_attention`` (and ``reference_attention``)
on 4-D tensors ``q: (B, H, Tq, D)``, ``k: (B, Hkv, Tk, D)``, ``v: (B, Hkv, Tk, Dv)``, computed block by
block so that memory grows with ``T x block`` instead of ``Tq x Tk``, in the forward and the backward.

Design
------
* **Blocks.** Queries are cut into blocks of ``block_q`` rows, keys into blocks of ``block_k``
  (the last block of each may be shorter). For one query block, :func:`_key_blocks` lists the key
  blocks the causal mask and the sliding ``window`` leave at least one visible pair in; the others
  are never computed, forward or backward. Only blocks cut by the causal/window edge build a
  (block_q, block_k) position mask.
* **One block's scores** (:func:`_block_scores`) are computed in ``reference_attention``'s order:
  ``(scale * q) @ k^T`` (the scale on the query block, once per block; equal to ``(q @ k^T) * scale``
  up to rounding) -> ``score_mod(score, b, h, q_idx, kv_idx)`` (with the
  block's own index tensors, broadcastable to ``(B, H, bq, bk)``) -> causal/window ``-inf`` -> the
  user's mask (bool: ``-inf`` where False; float: added). The user's mask is normalised to a 4-D
  view and sliced per block only along the dimensions it really has, so a broadcast mask is never
  expanded to ``(B, H, Tq, Tk)``.
* **Forward** (FlashAttention's online softmax): per query block keep the running row max ``m``,
  the running denominator ``l`` and the accumulator ``acc``; each key block rescales them by
  ``exp(m_old - m_new)``. The output is ``acc / l``; the per-row max ``m`` and ``1 / l`` are saved
  (not the log-sum-exp ``m + log l``: next to a large finite fill such as ``-1e9`` on a row with every
  key masked, ``m + log l`` rounds back to ``m`` and the recomputed probabilities would be 1, not 1/Tk).
* **Backward** (FlashAttention-2): a ``torch.autograd.Function`` saves only q, k, v, the mask, the
  output and the row statistics; each block's probabilities are recomputed as ``P = exp(S - m) / l``;
  ``dV += P^T dO``, ``dP = dO V^T``, ``dS = P * (dP - rowsum(dO * O))``, ``dQ += scale * dS' K``,
  ``dK += dS'^T (scale * Q)``, where ``dS' = dS`` (or, with a ``score_mod``, autograd of the
  recomputed block from the scaled product to the final scores, weighted by ``dS``). An additive mask
  that requires grad receives ``dS`` summed over the dimensions it broadcasts along.
* **GQA** without repeating K/V: query heads are viewed as ``(Hkv, G)`` groups (query head ``h``
  uses kv head ``h // G``, as SDPA does) and a query block becomes ``(B * Hkv, G * bq, D)``, so every
  product is a plain ``bmm`` against the unrepeated ``(B * Hkv, bk, D)`` K/V block; accumulators are
  updated in place with ``baddbmm_``.
* **Dtypes.** Half and bfloat16 blocks are upcast to float32 for all arithmetic (fp32 accumulation);
  float32 and float64 compute in their own dtype (float64 for ``gradcheck``). The output has q's dtype.
* **Rows whose keys are all masked** return zeros (as SDPA's fused CPU kernels do) and send zero
  gradient to q, k, v and the mask, never NaN: their row max is stored as ``+inf`` so their
  recomputed probabilities are 0. The plain computation gives NaN there; a caller that must
  reproduce NaN rows restores them itself (attnopt's ``AttentionSite`` does).
* **Not supported:** dropout (``dropout_p > 0`` raises ``ValueError``); a ``score_mod`` that closes
  over tensors requiring grad (they would get no gradient, so it raises ``ValueError``); double
  backward (attnopt's sites recompute differentiably when ``create_graph`` is on, see
  :mod:`attnopt.runtime`).
* **Autocast** is switched off inside the forward and the backward: the kernel chooses its own
  compute dtype (fp32 for half types), so a backward run under ``torch.autocast`` works.
* **Observability:** :func:`count_blocks` counts the (query block, key block) pairs computed
  forward and backward, e.g. to confirm that masked blocks are skipped.

Registered candidates: ``tiled64``, ``tiled128``, ``tiled256`` (``block_q = block_k = N``); they
serve every site without dropout, score modifiers included.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from ..spec import AttentionSpec
from .registry import FunctionCandidate, ScoreMod, register_candidate

__all__ = ["count_blocks", "tiled_attention"]

_NEG_INF = float("-inf")
_ACTIVE_COUNTERS: list[Counter[str]] = []


@contextmanager
def count_blocks() -> Iterator[Counter[str]]:
    """Count the (query block, key block) pairs the tiled kernel computes inside the ``with`` block.

        >>> with count_blocks() as n:
        ...     tiled_attention(q, k, v, is_causal=True, block_q=4, block_k=4).sum().backward()
        >>> n["forward"], n["backward"]
    """
    counter: Counter[str] = Counter()
    _ACTIVE_COUNTERS.append(counter)
    try:
        yield counter
    finally:
        _ACTIVE_COUNTERS.remove(counter)


def _count(direction: str) -> None:
    for counter in _ACTIVE_COUNTERS:
        counter[direction] += 1


@dataclass(frozen=True)
class _Plan:
    """Shape facts and options shared by the forward and the backward of one call."""

    B: int
    H: int
    Hkv: int
    Tq: int
    Tk: int
    D: int
    Dv: int
    block_q: int
    block_k: int
    causal: bool
    window: int | None
    scale: float
    score_mod: ScoreMod | None
    compute_dtype: torch.dtype

    @property
    def group(self) -> int:
        return self.H // self.Hkv


def _key_blocks(plan: _Plan, q0: int, q1: int) -> Iterator[tuple[int, int]]:
    """Key blocks ``[k0, k1)`` holding at least one pair that causal/window leave visible for rows ``[q0, q1)``."""
    lo, hi = 0, plan.Tk
    if plan.causal:
        hi = min(hi, q1)  # row q1 - 1 sees keys <= q1 - 1
    if plan.window is not None:
        lo = max(lo, q0 - plan.window + 1)  # row q0 sees keys >= q0 - window + 1
    start = (lo // plan.block_k) * plan.block_k  # stay on the block grid
    for k0 in range(start, hi, plan.block_k):
        yield k0, min(k0 + plan.block_k, plan.Tk)


def _position_keep(plan: _Plan, q0: int, q1: int, k0: int, k1: int, device: torch.device) -> torch.Tensor | None:
    """(bq, bk) bool keep-mask of the causal/window edge inside one block, or None if all of it is visible."""
    cut_causal = plan.causal and k1 - 1 > q0
    cut_window = plan.window is not None and k0 < q1 - plan.window
    if not (cut_causal or cut_window):
        return None
    qi = torch.arange(q0, q1, device=device)[:, None]
    kj = torch.arange(k0, k1, device=device)[None, :]
    keep = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool, device=device)
    if cut_causal:
        keep &= kj <= qi
    if cut_window:
        keep &= qi - kj < plan.window
    return keep


def _mask_block(mask4: torch.Tensor, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
    """The slice of a 4-D mask view that one block uses, keeping its broadcast (size-1) dims whole."""
    rows = slice(q0, q1) if mask4.size(2) != 1 else slice(None)
    cols = slice(k0, k1) if mask4.size(3) != 1 else slice(None)
    return mask4[:, :, rows, cols]


def _flat(plan: _Plan, t: torch.Tensor) -> torch.Tensor:
    """K or V (B, Hkv, Tk, X) as (B * Hkv, Tk, X): a view whenever the strides allow."""
    return t.reshape(plan.B * plan.Hkv, t.size(2), t.size(3))


def _rows(plan: _Plan, t: torch.Tensor, q0: int, q1: int) -> torch.Tensor:
    """Rows [q0, q1) of a (B, H, Tq, X) tensor as (B * Hkv, G * n, X) in the compute dtype (head h = hkv * G + g)."""
    blk = t[:, :, q0:q1].to(plan.compute_dtype)
    return blk.reshape(plan.B * plan.Hkv, plan.group * (q1 - q0), t.size(3))


def _block_scores(plan: _Plan, raw: torch.Tensor, mask4: torch.Tensor | None, q0: int, q1: int, k0: int,
                  k1: int) -> torch.Tensor:
    """Final (B, H, bq, bk) scores of one block from ``raw = (scale * q) @ k^T`` of shape (B * Hkv, G * bq, bk)."""
    s = raw.view(plan.B, plan.H, q1 - q0, k1 - k0)
    if plan.score_mod is not None:
        dev = raw.device
        b = torch.arange(plan.B, device=dev)[:, None, None, None]
        h = torch.arange(plan.H, device=dev)[None, :, None, None]
        qi = torch.arange(q0, q1, device=dev)[None, None, :, None]
        kj = torch.arange(k0, k1, device=dev)[None, None, None, :]
        modded = plan.score_mod(s, b, h, qi, kj)
        if not isinstance(modded, torch.Tensor) or modded.shape != s.shape:
            got = tuple(modded.shape) if isinstance(modded, torch.Tensor) else type(modded).__name__
            raise ValueError(f"score_mod must return a tensor shaped like its score argument {tuple(s.shape)}, "
                             f"got {got}; write it elementwise (FlexAttention's score_mod contract)")
        s = modded.to(plan.compute_dtype)
    keep = _position_keep(plan, q0, q1, k0, k1, raw.device)
    if keep is not None:
        s = s.masked_fill(~keep, _NEG_INF)
    if mask4 is not None:
        m = _mask_block(mask4, q0, q1, k0, k1)
        s = s.masked_fill(~m, _NEG_INF) if m.dtype == torch.bool else s + m.to(plan.compute_dtype)
    return s


def _forward(plan: _Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             mask4: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, BK, cd = plan.B, plan.H, plan.B * plan.Hkv, plan.compute_dtype
    k3, v3 = _flat(plan, k), _flat(plan, v)  # (B*Hkv, Tk, D), (B*Hkv, Tk, Dv)
    out = torch.empty(B, H, plan.Tq, plan.Dv, dtype=q.dtype, device=q.device)
    stats = torch.empty(B, H, plan.Tq, 2, dtype=cd, device=q.device)  # per row: max m, 1 / l
    for q0 in range(0, plan.Tq, plan.block_q):
        q1 = min(q0 + plan.block_q, plan.Tq)
        n = q1 - q0
        qs = _rows(plan, q, q0, q1) * plan.scale  # (B*Hkv, G*n, D)
        m = torch.full((B, H, n, 1), _NEG_INF, dtype=cd, device=q.device)  # running row max
        m_safe = torch.zeros_like(m)  # m with -inf (nothing visible yet) replaced by 0
        denom = torch.zeros_like(m)  # running sum of exp(s - m)
        acc = torch.zeros(BK, plan.group * n, plan.Dv, dtype=cd, device=q.device)  # running sum of exp(s - m) @ v
        for k0, k1 in _key_blocks(plan, q0, q1):
            _count("forward")
            s = _block_scores(plan, torch.bmm(qs, k3[:, k0:k1].to(cd).transpose(1, 2)), mask4, q0, q1, k0, k1)
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            m_new_safe = m_new.masked_fill(m_new == _NEG_INF, 0.0)
            p = (s - m_new_safe).exp_()  # (B, H, n, bk); 0 where s = -inf
            alpha = torch.exp(m - m_new_safe)  # rescales the old sums; 0 while m = -inf
            denom = denom * alpha + p.sum(-1, keepdim=True)
            acc.mul_(alpha.view(BK, -1, 1)).baddbmm_(p.view(BK, -1, k1 - k0), v3[:, k0:k1].to(cd))
            m, m_safe = m_new, m_new_safe
        live = denom > 0
        o = torch.where(live, acc.view(B, H, n, plan.Dv) / denom.clamp_min(torch.finfo(cd).tiny), 0.0)
        out[:, :, q0:q1] = o.to(out.dtype)
        stats[:, :, q0:q1, :1] = torch.where(live, m_safe, math.inf)  # +inf: P = 0 in backward
        stats[:, :, q0:q1, 1:] = torch.where(live, 1.0 / denom.clamp_min(torch.finfo(cd).tiny), 0.0)
    return out, stats


def _backward(plan: _Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask4: torch.Tensor | None,
              out: torch.Tensor, stats: torch.Tensor, dout: torch.Tensor,
              mask_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    B, H, BK, cd = plan.B, plan.H, plan.B * plan.Hkv, plan.compute_dtype
    k3, v3 = _flat(plan, k), _flat(plan, v)
    dq = torch.empty(B, H, plan.Tq, plan.D, dtype=cd, device=q.device)
    dk3 = torch.zeros(BK, plan.Tk, plan.D, dtype=cd, device=q.device)
    dv3 = torch.zeros(BK, plan.Tk, plan.Dv, dtype=cd, device=q.device)
    dmask4 = torch.zeros(mask4.shape, dtype=cd, device=q.device) if mask_grad and mask4 is not None else None
    for q0 in range(0, plan.Tq, plan.block_q):
        q1 = min(q0 + plan.block_q, plan.Tq)
        n = q1 - q0
        qs = _rows(plan, q, q0, q1) * plan.scale  # (B*Hkv, G*n, D)
        do = _rows(plan, dout, q0, q1)  # (B*Hkv, G*n, Dv)
        delta = (dout[:, :, q0:q1].to(cd) * out[:, :, q0:q1].to(cd)).sum(-1, keepdim=True)  # (B, H, n, 1)
        m_blk, inv_l = stats[:, :, q0:q1, :1], stats[:, :, q0:q1, 1:]
        dqs = torch.zeros_like(qs)  # gradient of the scaled scores times k, summed over key blocks
        for k0, k1 in _key_blocks(plan, q0, q1):
            _count("backward")
            kb, vb = k3[:, k0:k1].to(cd), v3[:, k0:k1].to(cd)
            raw = torch.bmm(qs, kb.transpose(1, 2))  # (B*Hkv, G*n, bk): scaled scores before score_mod and masks
            if plan.score_mod is not None:
                with torch.enable_grad():
                    raw.requires_grad_(True)
                    s_graph = _block_scores(plan, raw, mask4, q0, q1, k0, k1)
                s = s_graph.detach()
            else:
                s = _block_scores(plan, raw, mask4, q0, q1, k0, k1)
            p = (s - m_blk).exp_().mul_(inv_l)  # (B, H, n, bk); 0 on masked pairs and dead rows
            p3 = p.view(BK, -1, k1 - k0)
            dv3[:, k0:k1].baddbmm_(p3.transpose(1, 2), do)
            ds = torch.bmm(do, vb.transpose(1, 2)).view_as(p).sub_(delta).mul_(p)  # d final scores
            if dmask4 is not None:
                _add_mask_grad(dmask4, ds, q0, q1, k0, k1)
            if plan.score_mod is not None:
                (ds3,) = torch.autograd.grad(s_graph, raw, ds)  # (B*Hkv, G*n, bk)
            else:
                ds3 = ds.view(BK, -1, k1 - k0)
            dqs.baddbmm_(ds3, kb)
            dk3[:, k0:k1].baddbmm_(ds3.transpose(1, 2), qs)
        dq[:, :, q0:q1] = (dqs * plan.scale).view(B, H, n, plan.D)
    return dq, dk3.view(k.shape), dv3.view(v.shape), dmask4


def _add_mask_grad(dmask4: torch.Tensor, ds: torch.Tensor, q0: int, q1: int, k0: int, k1: int) -> None:
    """Accumulate one block's score gradient into an additive mask's gradient, summed over broadcast dims."""
    dims = tuple(i for i in range(4) if dmask4.size(i) == 1 and ds.size(i) != 1)
    _mask_block(dmask4, q0, q1, k0, k1).add_(ds.sum(dims, keepdim=True) if dims else ds)


class _TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                plan: _Plan) -> torch.Tensor:
        with torch.autocast(q.device.type, enabled=False):  # the kernel picks its own compute dtype
            out, stats = _forward(plan, q, k, v, _as_4d(mask))
        ctx.save_for_backward(q, k, v, mask, out, stats)
        ctx.plan = plan
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, mask, out, stats = ctx.saved_tensors
        mask_grad = mask is not None and mask.is_floating_point() and ctx.needs_input_grad[3]
        with torch.autocast(q.device.type, enabled=False):  # as in forward (a backward under autocast)
            dq, dk, dv, dmask4 = _backward(ctx.plan, q, k, v, _as_4d(mask), out, stats, dout.to(out.dtype),
                                           mask_grad)
        dmask = None if dmask4 is None else dmask4.view(mask.shape).to(mask.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dmask, None


def _as_4d(mask: torch.Tensor | None) -> torch.Tensor | None:
    return None if mask is None else mask.view((1,) * (4 - mask.dim()) + tuple(mask.shape))


def tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, attn_mask: torch.Tensor | None = None,
                    dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                    enable_gqa: bool = False, score_mod: ScoreMod | None = None, block_q: int = 64,
                    block_k: int = 64, window: int | None = None) -> torch.Tensor:
    """Attention with SDPA's meaning, computed in (block_q x block_k) tiles with the online softmax.

    Args:
        q, k, v: ``(B, H, Tq, D)``, ``(B, Hkv, Tk, D)``, ``(B, Hkv, Tk, Dv)``, one floating dtype.
        attn_mask: bool (True = attend) or additive float mask broadcastable to ``(B, H, Tq, Tk)``;
            a float mask that requires grad receives its gradient (in its own shape).
        dropout_p: must be 0 (the tiled kernel has no dropout).
        is_causal: SDPA's top-left causal mask (query i sees keys ``j <= i``).
        scale: factor on ``q @ k^T``; default ``D ** -0.5``.
        enable_gqa: ``H`` may be a multiple of ``Hkv``; query head h uses kv head ``h // (H // Hkv)``.
        score_mod: FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx)``, applied to the scaled
            score before the masks, as ``reference_attention`` does.
        block_q, block_k: tile sizes (need not divide the sequence lengths).
        window: if set, additionally hide keys more than ``window - 1`` positions behind the query
            (``q_idx - kv_idx >= window``); with ``is_causal`` this is the usual sliding window.

    Returns:
        ``(B, H, Tq, Dv)`` in q's dtype. Rows whose keys are all masked are zeros (gradient zero).
    """
    plan = _validate(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, score_mod, block_q, block_k,
                     window)
    if score_mod is not None and torch.is_grad_enabled():
        _refuse_grad_captures(score_mod, plan, q.device)
    return _TiledAttention.apply(q, k, v, attn_mask, plan)


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, dropout_p: float,
              is_causal: bool, scale: float | None, enable_gqa: bool, score_mod: ScoreMod | None, block_q: int,
              block_k: int, window: int | None) -> _Plan:
    if dropout_p > 0:
        raise ValueError(f"the tiled kernel has no dropout (dropout_p={dropout_p}); pass dropout_p=0.0 or use the "
                         "'sdpa' or 'math' candidate")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"tiled_attention expects 4-D (B, H, T, D) tensors; {name} is {shape}. "
                             "Add the missing leading dims with unsqueeze/reshape first")
    if not q.is_floating_point() or q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"q, k and v must share one floating dtype; got {q.dtype}, {k.dtype}, {v.dtype} "
                         "(cast them with .to(q.dtype))")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device; got {q.device}, {k.device}, {v.device}")
    B, H, Tq, D = q.shape
    _, Hkv, Tk, Dv = v.shape
    if k.size(0) != B or v.size(0) != B or k.size(1) != Hkv or k.size(2) != Tk or k.size(3) != D:
        raise ValueError(f"shapes do not fit attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}; "
                         "expected q (B, H, Tq, D), k (B, Hkv, Tk, D), v (B, Hkv, Tk, Dv)")
    if Hkv != H and not (enable_gqa and Hkv > 0 and H % Hkv == 0):
        hint = "pass enable_gqa=True" if not enable_gqa else "Hkv must divide H"
        raise ValueError(f"q has {H} heads but k/v have {Hkv}; {hint}")
    for name, n in (("block_q", block_q), ("block_k", block_k)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{name} must be a positive int, got {n!r}")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f"window must be None or a positive int (keys at most window - 1 behind), got {window!r}")
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise ValueError(f"attn_mask must be bool (True = attend) or floating (added), got {attn_mask.dtype}")
        target = (B, H, Tq, Tk)
        try:
            fits = attn_mask.dim() <= 4 and torch.broadcast_shapes(attn_mask.shape, target) == target
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to (B, H, Tq, Tk) = "
                             f"{target}")
        if attn_mask.device != q.device:
            raise ValueError(f"attn_mask is on {attn_mask.device} but q on {q.device}; move it with .to(q.device)")
    if score_mod is not None and not callable(score_mod):
        raise ValueError(f"score_mod must be callable as score_mod(score, b, h, q_idx, kv_idx), got {score_mod!r}")
    cd = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    return _Plan(B=B, H=H, Hkv=Hkv, Tq=Tq, Tk=Tk, D=D, Dv=Dv, block_q=block_q, block_k=block_k, causal=bool(is_causal),
                 window=window, scale=float(D ** -0.5 if scale is None else scale), score_mod=score_mod,
                 compute_dtype=cd)


def _refuse_grad_captures(score_mod: ScoreMod, plan: _Plan, device: torch.device) -> None:
    """Raise if ``score_mod`` reads tensors that require grad: the kernel's backward could not reach them."""
    probe = torch.zeros(1, 1, 1, 1, dtype=plan.compute_dtype, device=device, requires_grad=True)
    idx = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    with torch.enable_grad():
        res = score_mod(probe, idx, idx, idx, idx)
    seen: set[Any] = set()
    stack = [getattr(res, "grad_fn", None)]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        leaf = getattr(fn, "variable", None)
        if leaf is not None and leaf is not probe:
            raise ValueError(f"score_mod reads a tensor that requires grad (shape {tuple(leaf.shape)}); the tiled "
                             "kernel cannot send it a gradient. Detach it, or use the 'math' candidate")
        stack.extend(nxt for nxt, _ in fn.next_functions)


def _no_dropout(spec: AttentionSpec) -> str | None:
    return "the tiled kernel has no dropout" if spec.dropout_mode != "off" else None


for _n in (64, 128, 256):
    register_candidate(FunctionCandidate(f"tiled{_n}", partial(tiled_attention, block_q=_n, block_k=_n), _no_dropout,
                                         f"blockwise online-softmax attention in plain PyTorch, {_n}x{_n} tiles",
                                         windowed=True, every_shape=True))
del _n
