"""What a rewritten graph calls at run time: one :class:`AttentionSite` module per site.

The rewrite pass replaces a site's nodes with ``call_module(attnopt_siteN, (q, k, v, mask,
scale, dropout_p, *guarded_buffers))`` (``scale``/``dropout_p`` are None unless they are
run-time numbers). The module

* brings q, k, v to 4-D and v to q's dtype (the products' dtype as written),
* uses ``is_causal=True`` only when the mask was proven causal, the tensors that proof read
  still hold the proven pattern (:class:`BufferGuard`: pinned to the tensor *object* and its
  version counter, so a fresh mask passed on the next call is checked again), and the alignment
  matches SDPA's top-left causal mask (bottom-right masks only when ``Tq == Tk``); otherwise the
  mask tensor is passed. A proven sliding window adds ``window=w`` (see :mod:`attnopt.kernels.bands`),
* applies dropout exactly when the original would (``nn.Dropout`` replaced: in training mode),
* follows the mask values of each call for rows whose every key is hidden: NaN rows where every
  key was masked with ``-inf`` (the original's result) are restored; rows whose keys all hold a
  large negative fill (the dtype's minimum, ``-1e9``, ``-1e4``: at most ``-SATURATED``) run the
  computation as written (:meth:`AttentionSite._as_written`) whenever gradients or dropout are
  involved, because fused backwards rebuild the probabilities from a log-sum-exp that has lost
  ``log(Tk)`` next to such a fill, and because a dropped-out uniform row is random as written;
  rows filled with the dtype's minimum by ``masked_fill`` alone are the mean of v otherwise,
* runs the candidate inside a ``record_function("attnopt::<site>")`` range through the per-call
  dispatch it shares with the KV-cache site (:class:`~attnopt.runtime.dispatch.DispatchingSite`):
  the choice (fixed, or the selector's per shape key for ``candidate="auto"``), the check against
  the reference computation per shape key, the autograd wrapper for gradients, and the fallback
  to ``math`` when a candidate raises.

:class:`BoundedFillSite` is the site of a mask that fills a finite value (``masked_fill(m, -1e4)``):
it hands the candidate the dtype's minimum only on calls where the fill provably carries no weight
(:func:`fill_is_negligible`) and computes the fill as written otherwise.
"""

from __future__ import annotations

import math

import torch

from ..kernels.reference import reference_attention
from ..kernels.registry import ScoreMod
from ..spec import AttentionSpec
from .dispatch import DispatchingSite, candidate_layout, needs_grad
from .guards import BufferGuard, ConditionGuard, is_tracing

#: ``AttentionSite`` call arguments: (q, k, v, mask, scale, dropout_p, *guarded buffers).
GUARDED_ARGS_START = 6

#: A row of an additive mask whose every key is at most ``-SATURATED`` is "hidden by a large fill"
#: (``-1e4``, ``-1e9``, the dtype's minimum): as written it is (close to) uniform, and fused
#: backwards lose its ``1/Tk`` normalisation, so such calls run the computation as written.
SATURATED = 1e3


class AttentionSite(DispatchingSite):
    """Runs one rewritten attention site with a registered candidate."""

    def __init__(self, name: str, spec: AttentionSpec, candidate: str = "sdpa",
                 guards: list[BufferGuard] | None = None, where: str = "", score_mod: ScoreMod | None = None,
                 cut_fills: bool = False):
        super().__init__(name, spec, candidate, where=where)
        self.score_mod = score_mod
        self.guards = list(guards or [])
        #: the additive mask holds ``masked_fill`` values: as written those replace the score, so the
        #: score gets no gradient there (``_as_written`` reproduces that on rows it computes itself)
        self.cut_fills = cut_fills

    def extra_repr(self) -> str:
        return f"{self.site_name}: {self.candidate}, {self.spec.describe()}"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                scale: float | None = None, dropout_p: float | None = None,
                *guarded: torch.Tensor, filled: torch.Tensor | None = None,
                scale_tensor: torch.Tensor | None = None) -> torch.Tensor:
        spec = self.spec
        scale = spec.scale if scale is None else float(scale)
        p = spec.dropout_p if dropout_p is None else float(dropout_p)
        if scale_tensor is not None:
            # A 0-d tensor scale: folded into q where gradients must reach it, inside a compiled graph
            # and for float32/float64 q (one rounding, like the product's own); otherwise a half-type q is
            # not rounded again, and the kernel scales in its own precision, as the code as written does.
            if is_tracing(q) or needs_grad(scale_tensor) or q.dtype in (torch.float32, torch.float64):
                q = q * scale_tensor
            else:
                scale = scale * float(scale_tensor)
        q, k, v, lead = candidate_layout(q, k, v)
        use_causal = False
        if spec.causal is not None:
            aligned = spec.causal == "top_left" or q.size(-2) == k.size(-2)
            # a top-left window keeps key i in row i only for rows i < Tk; later rows take the mask tensor
            whole = spec.window is None or q.size(-2) <= k.size(-2)
            use_causal = aligned and whole and self._guards_hold(guarded)
        dropout_active = spec.dropout_mode == "on" or (spec.dropout_mode == "module" and self.training)
        kwargs = dict(attn_mask=None if use_causal else mask, is_causal=use_causal, scale=scale,
                      dropout_p=p if dropout_active else 0.0, enable_gqa=spec.gqa)
        if use_causal and spec.window is not None:
            kwargs["window"] = spec.window
        if self.score_mod is not None:
            kwargs["score_mod"] = self.score_mod
        tracing = is_tracing(q) and not self.tuning_run
        min_rows = None
        as_written = False
        if spec.min_rows != "none" and not use_causal and mask is not None and mask.is_floating_point():
            row_max = mask.amax(-1, keepdim=True)
            min_rows = row_max <= torch.finfo(mask.dtype).min / 2  # every key holds the dtype's minimum
            # Rows whose keys are all hidden by a large fill: computed as written when their
            # gradients or a dropout draw matter (see the module docstring). Inside a compiled
            # graph the mask's values are unknown, so there it is decided for every call alike.
            grad = needs_grad(q, k, v, mask)
            if spec.min_rows == "mean":
                as_written = dropout_active and (tracing or bool(min_rows.any()))
            elif tracing:
                as_written = grad or dropout_active
            else:
                as_written = (grad or dropout_active) and bool((row_max <= -SATURATED).any())
        with torch.autograd.profiler.record_function(f"attnopt::{self.site_name}"):
            if as_written:
                out = self._as_written(q, k, v, kwargs, filled)
            else:
                out = self.run_candidate(q, k, v, kwargs)
        if spec.min_rows == "mean" and min_rows is not None and not as_written:
            v_mean = v.mean(-2, keepdim=True)  # (B, Hkv, 1, Dv)
            if v_mean.size(-3) != out.size(-3):
                v_mean = v_mean.repeat_interleave(out.size(-3) // v_mean.size(-3), dim=-3)
            out = torch.where(min_rows, v_mean, out)
        if spec.nan_rows and not use_causal and mask is not None:
            if mask.dtype == torch.bool:
                dead = ~mask.any(-1, keepdim=True)
            else:
                dead = torch.isneginf(mask).all(-1, keepdim=True)
            out = out.masked_fill(dead, float("nan"))
        if lead:
            out = out.reshape(out.shape[lead:])
        if spec.out_dtype is not None and out.dtype != spec.out_dtype:
            out = out.to(spec.out_dtype)
        return out

    def _as_written(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: dict,
                    filled: torch.Tensor | None = None) -> torch.Tensor:
        """The reference computation with the mask applied as the code wrote it.

        An added mask is added; where a ``masked_fill`` replaced the score the score receives no
        gradient, as written: at ``filled`` (the fills' union, when the mask also adds terms) or, when
        the mask is made of fills only (``cut_fills``), wherever it holds a fill. Used for the calls
        whose rows every key is hidden by a large fill, where only this reproduces the original's
        gradients (and its dropout of a uniform row).
        """
        mask = kwargs.get("attn_mask")
        if not (self.cut_fills and isinstance(mask, torch.Tensor) and mask.is_floating_point()):
            return reference_attention(q, k, v, **kwargs)
        if filled is None:
            filled = mask <= torch.finfo(mask.dtype).min / 2
        elif filled.dim() < 4:
            filled = filled.reshape((1,) * (4 - filled.dim()) + tuple(filled.shape))
        inner = kwargs.get("score_mod")

        def fill_as_written(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor,
                            ki: torch.Tensor) -> torch.Tensor:
            if inner is not None:
                score = inner(score, b, h, qi, ki)
            return torch.where(filled, mask, score + mask)

        rest = {n: a for n, a in kwargs.items() if n not in ("attn_mask", "score_mod")}
        return reference_attention(q, k, v, attn_mask=None, score_mod=fill_as_written, **rest)

    def _guards_hold(self, guarded: tuple[torch.Tensor, ...]) -> bool:
        if not self.guards:
            return True
        if any(is_tracing(t) for t in guarded):
            # buffers are checked at the compiled graph's boundary instead; run-time terms cannot be
            # checked there, so a compiled graph passes the mask tensor
            return not any(isinstance(g, ConditionGuard) for g in self.guards)
        return all(g.holds(t) for g, t in zip(self.guards, guarded))


class BoundedFillSite(AttentionSite):
    """A site whose mask fills a finite value ``f`` (``masked_fill(m, -1e4)``), exact on every call.

    The candidate receives the dtype's minimum at the masked positions. That equals the fill as
    written (within any dtype's tolerance) when every kept score ``s`` has ``Tk * exp(f - s) <
    2**-60``; by Cauchy-Schwarz ``|s| <= |scale| * max|q_i| * max|k_j|``, so the site checks
    ``f + |scale| * max|q_i| * max|k_j| + log(Tk) <= -42`` on each call (a norm of q and of k,
    no score matrix) and otherwise computes the fill as written. Rows with every key masked are
    the mean of v either way (``AttentionSpec.min_rows == "mean"``).
    """

    def run_candidate(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: dict) -> torch.Tensor:
        fill = self.spec.fill_value
        assert fill is not None
        if not is_tracing(q) and fill_is_negligible(q, k, kwargs["scale"], fill):
            return super().run_candidate(q, k, v, kwargs)
        return _filled_as_written(q, k, v, fill, **kwargs)


def fill_is_negligible(q: torch.Tensor, k: torch.Tensor, scale: float, fill: float) -> bool:
    """True when masked keys filled with ``fill`` carry less than ``2**-60`` of any row's weight."""
    with torch.no_grad():
        qn = torch.linalg.vector_norm(q.detach().float(), dim=-1).amax().item()
        kn = torch.linalg.vector_norm(k.detach().float(), dim=-1).amax().item()
    bound = abs(scale) * qn * kn * 1.01 + 1.0  # 1% and 1.0 of slack for the scores' rounding
    return fill + bound + math.log(max(k.size(-2), 1)) <= -42.0


def _filled_as_written(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fill: float, *,
                       attn_mask: torch.Tensor | None, dropout_p: float, is_causal: bool, scale: float,
                       enable_gqa: bool, **_: object) -> torch.Tensor:
    """``softmax(scale * q @ k^T masked_fill(fill)) @ v``; masked where ``attn_mask`` holds the dtype's
    minimum, or above the diagonal for a proven top-left causal mask (``is_causal``)."""
    if is_causal:
        masked = ~torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
    else:
        assert attn_mask is not None
        masked = attn_mask <= torch.finfo(attn_mask.dtype).min / 2

    def mod(score, b, h, qi, ki):
        return score.masked_fill(masked, fill)

    return reference_attention(q, k, v, attn_mask=None, dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa,
                               score_mod=mod)
