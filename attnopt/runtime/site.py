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
  large negative fill (the dtype's minimum, ``-1e9``, ``-1e4``: at most ``-SATURATED``) are computed
  as written (:meth:`AttentionSite._as_written`) whenever gradients or dropout are involved, because
  fused backwards rebuild the probabilities from a log-sum-exp that has lost ``log(Tk)`` next to such
  a fill, and because a dropped-out uniform row is random as written. With dropout the whole call
  runs as written; with gradients the candidate runs every row and the first queries up to the last
  such row run again as written, their rows taken where every key is hidden (a left-padded batch:
  :meth:`AttentionSite._hidden_rows_as_written`), or the whole call as written when those reach past
  half the queries. Rows filled with the dtype's minimum by ``masked_fill`` alone are the mean of v
  otherwise,
* builds a deferred mask (``mask_fn(*mask_inputs)``, see :func:`attnopt.passes.rewrite_sdpa.defer_mask`) only on
  calls that pass the mask tensor,
* runs the candidate through the per-call dispatch it shares with the KV-cache site
  (:class:`~attnopt.runtime.dispatch.DispatchingSite`): the choice (fixed, or the selector's per shape
  key for ``candidate="auto"``), the check against the reference computation per shape key, the
  autograd wrapper for gradients, and the fallback to ``math`` when a candidate raises; inside a
  ``record_function("attnopt::<site>")`` range while a profiler records (or a graph is traced),
* counts the calls that ran as written, wholly or in part, or by a replacement, per reason, in
  ``site.fallbacks`` (the record's ``extra["fallbacks"]``, which ``explain()`` shows).

:class:`BoundedFillSite` is the site of a mask that fills a finite value (``masked_fill(m, -1e4)``):
it hands the candidate the dtype's minimum only on calls where the fill provably carries no weight
(:func:`fill_is_negligible`) and computes the fill as written otherwise. :class:`MixedFillSite` does the
same per row for a finite fill next to added masks (a padding mask): the rows where the fill may carry
weight are computed as written.
"""

from __future__ import annotations

import math

import torch

from ..kernels.reference import reference_attention
from ..kernels.registry import ScoreMod
from ..spec import AttentionSpec
from .dispatch import DispatchingSite, candidate_layout, needs_grad
from .guards import BufferGuard, ConditionGuard, is_fake, is_tracing, profiler_records

#: ``AttentionSite`` call arguments: (q, k, v, mask, scale, dropout_p, *guarded buffers).
GUARDED_ARGS_START = 6

#: A row of an additive mask whose every key is at most ``-SATURATED`` is "hidden by a large fill"
#: (``-1e4``, ``-1e9``, the dtype's minimum): as written it is (close to) uniform, and fused
#: backwards lose its ``1/Tk`` normalisation, so with gradients such rows are computed as written.
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

    #: the site decides per row whether a finite fill may carry weight (:class:`MixedFillSite`)
    fill_rows = False
    #: the post-softmax zeroing of the call in progress (``forward(zero_rows=...)``), 4-D
    _zero_probs: torch.Tensor | None = None

    def _fill_rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: dict, filled: torch.Tensor,
                   grad: bool, tracing: bool, dropout_active: bool) -> torch.Tensor:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"{self.site_name}: {self.candidate}, {self.spec.describe()}"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                scale: float | None = None, dropout_p: float | None = None,
                *guarded: torch.Tensor, filled: torch.Tensor | None = None,
                scale_tensor: torch.Tensor | None = None, mask_inputs: tuple | None = None,
                zero_rows: torch.Tensor | None = None) -> torch.Tensor:
        if zero_rows is not None:
            # the probabilities are zeroed after the softmax where ``zero_rows`` holds (the rewrite zeroes the
            # rows it covers whole, ``zero_hidden_rows``): the rows this site computes as written zero them as
            # written too, so a row whose every key is hidden by -inf (NaN before the zeroing) passes no NaN to
            # v's gradient. Kept in ``__dict__`` for this call only (no ``Module.__setattr__`` per call).
            self.__dict__["_zero_probs"] = zero_rows if zero_rows.dim() >= 4 else \
                zero_rows.reshape((1,) * (4 - zero_rows.dim()) + tuple(zero_rows.shape))
            try:
                return self.forward(q, k, v, mask, scale, dropout_p, *guarded, filled=filled,
                                    scale_tensor=scale_tensor, mask_inputs=mask_inputs)
            finally:
                self.__dict__["_zero_probs"] = None
        spec = self.spec
        scale = spec.scale if scale is None else float(scale)
        p = spec.dropout_p if dropout_p is None else float(dropout_p)
        tracing = is_tracing(q)
        if scale_tensor is not None:
            # A 0-d tensor scale: folded into q where gradients must reach it, inside a compiled graph
            # and for float32/float64 q (one rounding, like the product's own); otherwise a half-type q is
            # not rounded again, and the kernel scales in its own precision, as the code as written does.
            if tracing or needs_grad(scale_tensor) or q.dtype in (torch.float32, torch.float64):
                q = q * scale_tensor
            else:
                scale = scale * float(scale_tensor)
        lead = 0
        if q.dim() != 4 or v.dtype != q.dtype:
            q, k, v, lead = candidate_layout(q, k, v)
        use_causal = False
        if spec.causal is not None:
            aligned = spec.causal == "top_left" or q.size(-2) == k.size(-2)
            # a top-left window keeps key i in row i only for rows i < Tk; later rows take the mask tensor
            whole = spec.window is None or q.size(-2) <= k.size(-2)
            use_causal = aligned and whole and self._guards_hold(guarded, tracing)
        if mask_inputs is not None and not use_causal:  # a deferred mask (passes/rewrite_sdpa.defer_mask)
            mask = self.mask_fn(*mask_inputs)
        # dropout with p = 0 draws nothing (F.dropout is then the identity, exactly)
        dropout_active = p > 0 and (spec.dropout_mode == "on" or (spec.dropout_mode == "module" and self.training))
        attn_mask = None if use_causal else mask
        zero = self._zero_probs
        if zero is not None and attn_mask is not None and attn_mask.dtype == torch.bool:
            # rows the zeroing covers whole are zero as written, and take no gradient (the bool mask has none):
            # the candidate sees every key there, so it never computes the NaN probabilities of a row without
            # keys (whose product with a zero output gradient is still NaN for v)
            attn_mask = mask = attn_mask | zero.all(-1, keepdim=True)
        kwargs = dict(attn_mask=attn_mask, is_causal=use_causal, scale=scale,
                      dropout_p=p if dropout_active else 0.0, enable_gqa=spec.gqa)
        if use_causal and spec.window is not None:
            kwargs["window"] = spec.window
        if self.score_mod is not None:
            kwargs["score_mod"] = self.score_mod
        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or (
            attn_mask is not None and attn_mask.requires_grad))  # needs_grad(q, k, v, attn_mask), inlined
        if spec.score_floor is not None and attn_mask is not None and not (grad or dropout_active):
            # values alone: -inf raised to the minimum, as the floor does. With gradients the mask stays as
            # written: the floor cuts a -inf key's gradient and halves (``maximum``) a tie's, which only the
            # hidden rows computed as written below reproduce.
            attn_mask = mask = floored_mask(attn_mask, q.dtype)
            kwargs["attn_mask"] = attn_mask
        if self.fill_rows and attn_mask is not None and filled is not None:  # MixedFillSite
            if tracing or profiler_records():
                with torch.autograd.profiler.record_function(f"attnopt::{self.site_name}"):
                    out = self._fill_rows(q, k, v, kwargs, filled, grad, tracing, dropout_active)
            else:
                out = self._fill_rows(q, k, v, kwargs, filled, grad, tracing, dropout_active)
            return self._finish(out, use_causal, mask, lead)
        in_graph = tracing and not self.tuning_run  # traced into a compiled graph: the mask's values are unknown
        min_rows = None
        as_written = False
        hidden: torch.Tensor | None = None
        hidden_rows = 0
        if spec.min_rows != "none" and attn_mask is not None and attn_mask.is_floating_point():
            if spec.min_rows == "mean":
                min_rows = mask.amax(-1, keepdim=True) <= torch.finfo(mask.dtype).min / 2  # every key: the minimum
                as_written = dropout_active and (in_graph or bool(min_rows.any()))
                if as_written and not in_graph:
                    self.count_fallback("rows with every key masked, with dropout: the call as written")
            elif grad or dropout_active:
                # Rows whose keys are all hidden by a large fill: computed as written when their
                # gradients or a dropout draw matter (see the module docstring). Inside a compiled
                # graph the mask's values are unknown, so there it is decided for every call alike.
                if in_graph:
                    as_written = True
                else:
                    hidden = mask.amax(-1, keepdim=True) <= -SATURATED  # (..., Tq, 1)
                    hidden_rows = _rows_up_to_last(hidden, q.size(-2))  # 1 + the last such query
                    if hidden_rows and (dropout_active or 2 * hidden_rows > q.size(-2)):
                        as_written = True
                        self.count_fallback("rows with every key hidden, with dropout: the call as written"
                                            if dropout_active else "rows with every key hidden, with gradients, "
                                            "past half the queries: the call as written")
        if tracing or profiler_records():
            with torch.autograd.profiler.record_function(f"attnopt::{self.site_name}"):
                out = self._run(q, k, v, kwargs, filled, grad, tracing, as_written, hidden, hidden_rows)
        elif as_written or hidden_rows:
            out = self._run(q, k, v, kwargs, filled, grad, tracing, as_written, hidden, hidden_rows)
        else:
            out = self.run_candidate(q, k, v, kwargs, grad=grad, tracing=False)
        if spec.min_rows == "mean" and min_rows is not None and not as_written:
            v_mean = v.mean(-2, keepdim=True)  # (B, Hkv, 1, Dv)
            if v_mean.size(-3) != out.size(-3):
                v_mean = v_mean.repeat_interleave(out.size(-3) // v_mean.size(-3), dim=-3)
            out = torch.where(min_rows, v_mean, out)
        return self._finish(out, use_causal, mask, lead)

    def _finish(self, out: torch.Tensor, use_causal: bool, mask: torch.Tensor | None, lead: int) -> torch.Tensor:
        """NaN rows restored where every key was masked with ``-inf``; the call's own layout and dtype."""
        spec = self.spec
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

    def _run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: dict, filled: torch.Tensor | None,
             grad: bool, tracing: bool, as_written: bool, hidden: torch.Tensor | None, rows: int) -> torch.Tensor:
        if as_written:
            return self._as_written(q, k, v, kwargs, filled)
        if rows:
            assert hidden is not None
            return self._hidden_rows_as_written(q, k, v, kwargs, filled, grad, tracing, hidden, rows)
        return self.run_candidate(q, k, v, kwargs, grad=grad, tracing=tracing)

    def _hidden_rows_as_written(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: dict,
                                filled: torch.Tensor | None, grad: bool, tracing: bool, hidden: torch.Tensor,
                                rows: int, served: torch.Tensor | None = None,
                                why: str = "rows with every key hidden, with gradients") -> torch.Tensor:
        """The call with gradients where some query rows below ``rows`` have every key hidden by a large
        fill (``hidden``, ``(..., Tq, 1)``; a left-padded batch): the candidate for every row, those rows as
        written.

        The candidate runs the whole call with the hidden rows' mask set to 0 (ordinary rows, whatever it
        does with a row of fills), and ``_as_written`` runs the first ``rows`` queries (the mask and
        ``filled`` cut along the query axis where they are not broadcast); ``torch.where`` takes the
        written rows where every key is hidden. Gradients are exact: the rows ``torch.where`` does not
        take receive a zero output gradient, and a zero output gradient contributes exactly zero to q, k,
        v and the mask in a backward that is finite on ordinary rows (the per-key check has run the
        candidate's backward on such rows) and in the written one. ``served``: the mask the candidate gets
        instead (:class:`MixedFillSite`: its fills dropped, those rows 0); ``why``: the fallback's reason.
        """
        mask = kwargs["attn_mask"]
        self.count_fallback(f"{why}: the candidate, and those rows as written")
        tq = q.size(-2)
        served = mask.masked_fill(hidden, 0.0) if served is None else served
        out = self.run_candidate(q, k, v, dict(kwargs, attn_mask=served), grad=grad, tracing=tracing)

        def head(t: torch.Tensor) -> torch.Tensor:  # the first ``rows`` queries of a mask-shaped tensor
            return t[..., :rows, :] if t.dim() >= 2 and t.size(-2) == tq else t

        if filled is not None and filled.dim() < 4:
            filled = filled.reshape((1,) * (4 - filled.dim()) + tuple(filled.shape))
        written = self._as_written(q[..., :rows, :], k, v, dict(kwargs, attn_mask=head(mask)),
                                   None if filled is None else head(filled))
        first = torch.where(head(hidden), written, out[..., :rows, :])
        return torch.cat([first, out[..., rows:, :]], dim=-2)

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
        if self.spec.score_floor is not None:  # floored after the mask, as spelled (spec.score_floor)
            kwargs = dict(kwargs, score_floor=self.spec.score_floor)
        zero = self._zero_probs
        if zero is not None:  # the first q.size(-2) queries (``_hidden_rows_as_written`` runs a head of them)
            tq = q.size(-2)
            kwargs = dict(kwargs, zero_probs=zero[..., :tq, :] if zero.size(-2) not in (1, tq) else zero)
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

    def _guards_hold(self, guarded: tuple[torch.Tensor, ...], tracing: bool) -> bool:
        if not self.guards:
            return True
        if not tracing:
            for t in guarded:
                if is_fake(t):
                    tracing = True
                    break
        if tracing:
            # buffers are checked at the compiled graph's boundary instead; run-time terms cannot be
            # checked there, so a compiled graph passes the mask tensor
            return not any(isinstance(g, ConditionGuard) for g in self.guards)
        for g, t in zip(self.guards, guarded):
            if not g.holds(t):
                return False
        return True


def _rows_up_to_last(rows: torch.Tensor, tq: int) -> int:
    """1 + the largest query index whose row is set in ``rows`` (``(..., Tq, 1)`` or broadcast), 0 if none."""
    if rows.dim() < 2 or rows.size(-2) != tq:  # one row for every query (a broadcast query axis)
        return tq if bool(rows.any()) else 0
    per_query = rows.reshape(-1, tq).any(0)  # (Tq,)
    return int((per_query * torch.arange(1, tq + 1, device=rows.device)).max())


class BoundedFillSite(AttentionSite):
    """A site whose mask fills a finite value ``f`` (``masked_fill(m, -1e4)``), exact on every call.

    The candidate receives the dtype's minimum at the masked positions. That equals the fill as
    written (within any dtype's tolerance) when every kept score ``s`` has ``Tk * exp(f - s) <
    2**-60``; by Cauchy-Schwarz ``|s| <= |scale| * max|q_i| * max|k_j|``, so the site checks
    ``f + |scale| * max|q_i| * max|k_j| + log(Tk) <= -42`` on each call (a norm of q and of k,
    no score matrix) and otherwise computes the fill as written. Rows with every key masked are
    the mean of v either way (``AttentionSpec.min_rows == "mean"``).
    """

    def run_candidate(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: dict, *,
                      grad: bool | None = None, tracing: bool | None = None) -> torch.Tensor:
        fill = self.spec.fill_value
        assert fill is not None
        if tracing is None:
            tracing = is_tracing(q)
        if not tracing and fill_is_negligible(q, k, kwargs["scale"], fill):
            return super().run_candidate(q, k, v, kwargs, grad=grad, tracing=tracing)
        if not tracing:
            self.count_fallback(f"a fill of {fill:g} that may carry weight on this call: the call as written")
        return _filled_as_written(q, k, v, fill, **kwargs)


class MixedFillSite(BoundedFillSite):
    """A site whose mask fills a finite value ``f`` and also adds masks: OpenAI-GPT's
    ``w * b + -1e4 * (1 - b)`` followed by ``+ attention_mask`` (0 or the dtype's minimum per key).

    The mask tensor holds the scores' mask as written (``f`` plus whatever is added after the fill)
    and ``filled`` (the fills' union) says where it replaces the score. The candidate receives the
    dtype's minimum at the filled keys. A row is served by the candidate when, as written, its
    filled keys provably carry less than ``2**-60`` of its weight: with ``F`` its largest mask value
    at a filled key, ``A`` its largest at any other key and ``|s| <= |scale| * max|q_i| * max|k_j|``
    (Cauchy-Schwarz, as in :func:`fill_is_negligible`),

        ``F - A + bound + log(Tk) <= -42``.

    Every other row is computed as written (:meth:`AttentionSite._as_written`: the filled keys take
    their mask value, the others add it): a left-padded query whose keys up to itself are all padded
    averages the later keys it filled with ``-1e4``, as written, not the padded ones. The candidate
    runs the whole call with those rows' mask set to 0 and ``torch.where`` takes the written rows, so
    gradients are exact for the same reason as in :meth:`AttentionSite._hidden_rows_as_written`. The
    whole call runs as written when such rows reach past half the queries, under dropout (the rows
    would come from two draws), and inside a compiled graph (where the mask's values are unknown).
    Without a mask tensor (a proven causal pattern) it is :class:`BoundedFillSite`.
    """

    fill_rows = True

    def run_candidate(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: dict, *,
                      grad: bool | None = None, tracing: bool | None = None) -> torch.Tensor:
        if kwargs.get("attn_mask") is None:  # a proven causal pattern: the call-wide bound of BoundedFillSite
            return super().run_candidate(q, k, v, kwargs, grad=grad, tracing=tracing)
        # rows :meth:`_fill_rows` hands the candidate hold the bound (with the added mask's values); the
        # call-wide check would read the added mask's minimum as fills and drop its other values
        return DispatchingSite.run_candidate(self, q, k, v, kwargs, grad=grad, tracing=tracing)

    def _fill_rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: dict, filled: torch.Tensor,
                   grad: bool, tracing: bool, dropout_active: bool) -> torch.Tensor:
        mask, filled = (t.reshape((1,) * max(0, 4 - t.dim()) + tuple(t.shape)) for t in (kwargs["attn_mask"], filled))
        kwargs = dict(kwargs, attn_mask=mask)
        if tracing and not self.tuning_run:
            return self._as_written(q, k, v, kwargs, filled)
        weighty = self.weighty_rows(q, k, mask, filled, kwargs["scale"], grad)  # (..., Tq, 1)
        rows = _rows_up_to_last(weighty, q.size(-2))
        minimum = torch.finfo(mask.dtype).min
        if not rows:
            return self.run_candidate(q, k, v, dict(kwargs, attn_mask=mask.masked_fill(filled, minimum)), grad=grad,
                                      tracing=tracing)
        fill = self.spec.fill_value
        if dropout_active or 2 * rows > q.size(-2):
            self.count_fallback(f"rows whose keys filled with {fill:g} may carry weight"
                                + (", with dropout" if dropout_active else ", past half the queries")
                                + ": the call as written")
            return self._as_written(q, k, v, kwargs, filled)
        served = mask.masked_fill(filled, minimum).masked_fill(weighty, 0.0)
        return self._hidden_rows_as_written(q, k, v, kwargs, filled, grad, tracing, weighty, rows, served,
                                            f"rows whose keys filled with {fill:g} may carry weight")

    def weighty_rows(self, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, filled: torch.Tensor,
                     scale: float, grad: bool = False) -> torch.Tensor:
        """``(..., Tq, 1)``: the rows whose filled keys may carry weight as written (see the class docstring);
        a NaN margin (a row of ``-inf`` only) counts as such a row. With gradients also the rows whose other
        keys are all hidden by a large value (``-SATURATED``), whose fused backward is not exact (see the
        module docstring)."""
        with torch.no_grad():
            bound = score_bound(q, k, scale)
            m = mask.detach().float()
            at_fill = m.masked_fill(~filled, -math.inf).amax(-1, keepdim=True)
            elsewhere = m.masked_fill(filled, -math.inf).amax(-1, keepdim=True)
            margin = at_fill - elsewhere + bound + math.log(max(k.size(-2), 1))
            weighty = ~(margin <= -42.0)
            return weighty | (elsewhere <= -SATURATED) if grad else weighty


def floored_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask of a site whose scores are floored at the dtype's minimum, for a call without
    gradients: ``-inf`` raised to the minimum, so a row whose every key is masked is uniform, as written
    (``s + min`` is ``min`` for any score below ``2**100`` in float32 and bfloat16)."""
    assert mask.is_floating_point(), "a floored site's mask is additive (find_sites refuses boolean ones)"
    return mask.clamp_min(torch.finfo(mask.dtype).min)


def score_bound(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """A 0-d bound on every ``|scale * q_i . k_j|`` (Cauchy-Schwarz on the largest norms), with 1% and 1.0 of slack
    for the scores' rounding."""
    with torch.no_grad():
        qn = torch.linalg.vector_norm(q.detach().float(), dim=-1).amax()
        kn = torch.linalg.vector_norm(k.detach().float(), dim=-1).amax()
    return abs(scale) * qn * kn * 1.01 + 1.0


def fill_is_negligible(q: torch.Tensor, k: torch.Tensor, scale: float, fill: float) -> bool:
    """True when masked keys filled with ``fill`` carry less than ``2**-60`` of any row's weight."""
    return fill + score_bound(q, k, scale).item() + math.log(max(k.size(-2), 1)) <= -42.0


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
