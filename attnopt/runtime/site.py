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
* checks every candidate it runs, chosen or forced, against the reference computation on the
  call's own inputs the first time it serves a shape key (outputs, and gradients when the call
  needs them; "no less accurate than the computation as written against float64" for half
  types); a candidate that fails is dropped for that key with a warning naming it,
* when gradients are needed, runs the candidate inside :class:`_Recomputable`, whose backward
  is the candidate's own unless autograd asks for a graph of the backward (``create_graph=True``:
  double backward, gradient penalties, ``hvp``), where it recomputes the reference computation
  differentiably; a candidate whose backward raises (e.g. under autocast) is replaced by that
  recomputation too, with a warning. Calls with active dropout and gradients run ``math``, whose
  dropout mask lives in its own autograd graph,
* calls the chosen candidate inside a ``record_function("attnopt::<site>")`` range, and
  falls back to the ``math`` candidate with a warning if the candidate raises.

With ``candidate="auto"`` the site asks its :class:`~attnopt.selection.selector.Selector` which
candidate to run for the call's shape key (tuned on the first call in each bucket, then one
dictionary lookup); the timings that chose it are kept in ``site.tuning`` and in the site's
record for ``explain()``. While being traced (``compile=True``) the site uses the choice of
its most recent eager call.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
import torch.nn as nn

from ..env import AUTO
from ..kernels.reference import reference_attention, tolerance
from ..kernels.registry import ScoreMod, get_candidate
from ..selection.selector import Call, shape_key
from ..spec import AttentionSpec
from .autograd import recomputable
from .guards import BufferGuard, ConditionGuard, is_tracing

log = logging.getLogger("attnopt")


#: ``AttentionSite`` call arguments: (q, k, v, mask, scale, dropout_p, *guarded buffers).
GUARDED_ARGS_START = 6

#: A row of an additive mask whose every key is at most ``-SATURATED`` is "hidden by a large fill"
#: (``-1e4``, ``-1e9``, the dtype's minimum): as written it is (close to) uniform, and fused
#: backwards lose its ``1/Tk`` normalisation, so such calls run the computation as written.
SATURATED = 1e3

#: Candidates whose autograd graph is plain PyTorch, differentiable any number of times.
_TWICE_DIFFERENTIABLE = frozenset(("math", "sdpa_math"))


def candidate_layout(q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """q, k, v as candidates take them (4-D, v in q's dtype) and how many leading dims were added."""
    lead = 4 - q.dim()
    if lead:
        q, k, v = (t.reshape((1,) * lead + t.shape) for t in (q, k, v))
    if v.dtype != q.dtype:
        v = v.to(q.dtype)
    return q, k, v, lead


class AttentionSite(nn.Module):
    """Runs one rewritten attention site with a registered candidate."""

    def __init__(self, name: str, spec: AttentionSpec, candidate: str = "sdpa",
                 guards: list[BufferGuard] | None = None, where: str = "", score_mod: ScoreMod | None = None,
                 cut_fills: bool = False):
        super().__init__()
        self.score_mod = score_mod
        self.site_name = name
        self.spec = spec
        self.candidate = candidate
        self.guards = list(guards or [])
        self.where = where
        #: the additive mask holds ``masked_fill`` values: as written those replace the score, so the
        #: score gets no gradient there (``_as_written`` reproduces that on rows it computes itself)
        self.cut_fills = cut_fills
        self._failed: set[str] = set()  # candidates that raised here; this site runs math instead of them
        self.selector: Any = None  # a Selector, for candidate="auto"
        self.record: Any = None  # the SiteRecord that explain() shows
        self.tuning: dict[Any, Any] = {}  # ShapeKey -> TuningEntry
        self._by_call: dict[tuple, str] = {}  # exact call signature -> choice (the per-call fast path)
        self._last: str | None = None
        self._checked: dict[tuple, str] = {}  # (candidate, ShapeKey) -> what runs: it, or its replacement
        self._served: dict[tuple, str] = {}  # exact call signature -> what runs (the per-call fast path)
        self._ran: dict[str, str] = {}  # candidate -> what its last checked eager call ran (used while tracing)
        self.tuning_run = False  # the backend's eager run before Inductor traces (is_compiling() is True there)
        if candidate != AUTO:
            get_candidate(candidate)  # fail early on a bad name

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
            if is_tracing(q) or _needs_grad(scale_tensor) or q.dtype in (torch.float32, torch.float64):
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
            grad = _needs_grad(q, k, v, mask)
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
                out = self._call(q, k, v, kwargs)
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

    def forget_choices(self) -> None:
        """Ask the selector again on the next call (after it adopted another rank's choices)."""
        self.tuning.clear()
        self._by_call.clear()
        if self.record is not None:
            self.record.extra.pop("tuning", None)

    def _choice(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: dict) -> str:
        if self.candidate != AUTO:
            return self.candidate
        if self.selector is None or (is_tracing(q) and not self.tuning_run):
            return self._last or "math"
        mask = kwargs["attn_mask"]
        grad = _needs_grad(q, k, v, mask)
        fast = (q.shape, k.shape, v.shape, q.dtype, q.device, None if mask is None else mask.dtype,
                kwargs["is_causal"], kwargs["dropout_p"] > 0, grad)
        choice = self._by_call.get(fast)
        if choice is None:
            key = shape_key(self.spec, q, k, v, causal=kwargs["is_causal"], mask=mask,
                            dropout=kwargs["dropout_p"] > 0, grad=grad)
            entry = self.tuning.get(key)
            if entry is None:
                try:
                    entry = self.selector.choose(self.spec, key, Call(q, k, v, kwargs, grad))
                except Exception as e:  # noqa: BLE001 - tuning is an optimisation; never break the forward
                    fallback = "sdpa" if get_candidate("sdpa").supports(self.spec) is None else "math"
                    warnings.warn(f"attnopt: could not tune {self.site_name} ({self.where}) for {key.describe()}: "
                                  f"{type(e).__name__}: {e}; running {fallback} for this call", stacklevel=4)
                    return fallback
                self.tuning[key] = entry
                if self.record is not None:
                    self.record.extra.setdefault("tuning", {})[key.describe()] = entry
            if len(self._by_call) > 4096:  # e.g. one entry per decode length: keep the table small
                self._by_call.clear()
            choice = self._by_call[fast] = entry.choice
        self._last = choice
        return choice

    def _call(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: dict) -> torch.Tensor:
        name = self._choice(q, k, v, kwargs)
        if name in self._failed:
            name = "math"
        if is_tracing(q) and not self.tuning_run:
            # inside a compiled graph: what the checked eager run of this candidate ran
            return get_candidate(self._ran.get(name, name))(q, k, v, **kwargs)
        grad = _needs_grad(q, k, v, kwargs["attn_mask"])
        if grad and kwargs["dropout_p"] > 0 and name not in _TWICE_DIFFERENTIABLE:
            name = "math"  # its dropout mask is part of its own graph, so any backward (double too) is exact
        name = self._served_by(name, q, k, v, kwargs, grad)
        fn = get_candidate(name)
        try:
            if grad and name not in _TWICE_DIFFERENTIABLE:
                return recomputable(self, fn, q, k, v, kwargs)
            return fn(q, k, v, **kwargs)
        except Exception as e:  # noqa: BLE001 - never break the user's model; say what happened
            warnings.warn(f"attnopt: candidate {name!r} failed at {self.site_name} ({self.where}): "
                          f"{type(e).__name__}: {e}; running the reference computation instead", stacklevel=3)
            log.warning("site %s: candidate %s raised %r; falling back to math", self.site_name, name, e)
            self._failed.add(name)
            return get_candidate("math")(q, k, v, **kwargs)

    # ------------------------------------------------------------------ the per-key reference check

    def _served_by(self, name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: dict,
                   grad: bool) -> str:
        """``name``, or what replaces it, once it matched the reference for this call's shape key."""
        if name == "math":
            return name
        mask = kwargs["attn_mask"]
        fast = (name, q.shape, k.shape, v.shape, q.dtype, q.device,
                None if mask is None else (mask.dtype, mask.shape), kwargs["is_causal"], grad)
        served = self._served.get(fast)
        if served is None:
            key = (name, shape_key(self.spec, q, k, v, causal=kwargs["is_causal"], mask=mask,
                                   dropout=kwargs["dropout_p"] > 0, grad=grad))
            served = self._checked.get(key)
            if served is None:
                served = self._checked[key] = self._check(name, q, k, v, kwargs, grad, key[1])
            if len(self._served) > 4096:
                self._served.clear()
            self._served[fast] = served
        self._ran[name] = served
        return served

    def _check(self, name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: dict,
               grad: bool, key: Any) -> str:
        try:
            problem = _compare_with_reference(get_candidate(name), self.spec, q, k, v, kwargs, grad)
        except Exception as e:  # noqa: BLE001 - a candidate that cannot run here is not run
            problem = f"it raised {type(e).__name__}: {e}"
        if problem is None:
            return name
        fallback = "sdpa" if name != "sdpa" and get_candidate("sdpa").supports(self.spec) is None else "math"
        warnings.warn(f"attnopt: candidate {name!r} does not match the reference computation at {self.site_name} "
                      f"({self.where}) for {key.describe()}: {problem}; dropped for these shapes, running "
                      f"{fallback} instead", stacklevel=5)
        log.warning("site %s: candidate %s rejected for %s: %s", self.site_name, name, key.describe(), problem)
        if self.record is not None:
            self.record.extra.setdefault("rejected", {})[f"{name} ({key.describe()})"] = problem
        if fallback == "math":
            return "math"
        return self._check(fallback, q, k, v, kwargs, grad, key)


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _compare_with_reference(fn: Any, spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            kwargs: dict, grad: bool) -> str | None:
    """Why ``fn`` does not compute the reference on these inputs (outputs, and gradients with ``grad``), or None.

    Dropout is off for the check (its draws are random by design). Rows the site overrides (every
    key masked: NaN rows, mean-of-v rows) and rows that are not finite as written are not compared.
    The contract is the dtype's tolerance against the reference in the inputs' dtype, or, failing
    that, an error against a float64 evaluation no larger than the reference's own (plus the
    dtype's tolerance): never less accurate than the computation as written.
    """
    kwargs = dict(kwargs, dropout_p=0.0)
    mask = kwargs.get("attn_mask")
    skip = None
    if isinstance(mask, torch.Tensor) and mask.is_floating_point() and spec.min_rows == "mean":
        skip = mask.amax(-1, keepdim=True) <= torch.finfo(mask.dtype).min / 2
    gen = torch.Generator(device="cpu").manual_seed(0)  # never the user's random stream

    def run(f: Any, dtype: torch.dtype | None) -> list[torch.Tensor | None]:
        def prep(t: torch.Tensor | None, diff: bool) -> torch.Tensor | None:
            if not isinstance(t, torch.Tensor):
                return t
            t = t.detach()
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            return t.requires_grad_(diff and grad and t.is_floating_point())

        qq, kk, vv = (prep(t, True) for t in (q, k, v))
        mm = prep(mask, mask is not None and mask.requires_grad)
        kw = dict(kwargs, attn_mask=mm)
        with torch.enable_grad() if grad else torch.no_grad():
            out = f(qq, kk, vv, **kw)
            if not grad:
                return [out.detach()]
            targets = [t for t in (qq, kk, vv, mm) if isinstance(t, torch.Tensor) and t.requires_grad]
            g = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out.device, out.dtype)
            gen.manual_seed(0)
            if skip is not None:
                g = g.masked_fill(skip, 0.0)
            grads = torch.autograd.grad(out, targets, g, allow_unused=True)
        return [out.detach(), *grads]

    got = run(fn, None)
    ref = run(reference_attention, None)
    atol, rtol = tolerance(q.dtype)
    labels = ["output", "gradient of q", "gradient of k", "gradient of v", "gradient of the mask"]
    ref64: list[torch.Tensor | None] | None = None
    for i, (label, a, e) in enumerate(zip(labels, got, ref)):
        if e is None or a is None:
            if (a is None) != (e is None) and bool((a if e is None else e).abs().sum() > 0):  # type: ignore
                return f"the {label} is missing"
            continue
        if a.shape != e.shape:
            return f"the {label} has shape {tuple(a.shape)}, the reference {tuple(e.shape)}"
        keep = torch.isfinite(e)
        if i == 0 and skip is not None:
            keep = keep & ~skip.expand_as(e)
        af, ef = a.double()[keep], e.double()[keep]
        if not bool(torch.isfinite(af).all()):
            return f"the {label} is not finite where the reference is"
        diff = (af - ef).abs()
        if bool((diff <= atol + rtol * ef.abs()).all()):
            continue
        if q.dtype != torch.float64:  # no less accurate than as written, against float64
            if ref64 is None:
                ref64 = run(reference_attention, torch.float64)
            e64 = ref64[i]
            if e64 is not None:
                x = e64[keep]
                if (af - x).abs().max() <= (ef - x).abs().max() + atol:
                    continue
        return f"the {label} differs from the reference by up to {diff.max().item():.3g}"
    return None


