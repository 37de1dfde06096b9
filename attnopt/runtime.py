"""What a rewritten graph calls at run time: one :class:`AttentionSite` module per site.

The rewrite pass replaces a site's nodes with ``call_module(attnopt_siteN, (q, k, v, mask,
scale, dropout_p, *guarded_buffers))`` (``scale``/``dropout_p`` are None unless they are
run-time numbers). The module

* brings q, k, v to 4-D and v to q's dtype (the products' dtype as written),
* uses ``is_causal=True`` only when the mask was proven causal, the buffers that proof read
  are unchanged (:class:`BufferGuard`), and the alignment matches SDPA's top-left causal
  mask (bottom-right masks only when ``Tq == Tk``); otherwise the mask tensor is passed.
  A proven sliding window adds ``window=w`` (see :mod:`attnopt.candidates`),
* applies dropout exactly when the original would (``nn.Dropout`` replaced: in training mode),
* restores NaN rows where every key was masked with ``-inf`` (the original's result), and rows where every key holds the
  dtype's minimum (uniform attention as written; see ``AttentionSpec.min_rows``),
* calls the chosen candidate inside a ``record_function("attnopt::<site>")`` range, and
  falls back to the ``math`` candidate with a warning if the candidate raises.

With ``candidate="auto"`` the site asks its :class:`~attnopt.selector.Selector` which
candidate to run for the call's shape key (tuned on the first call in each bucket, then one
dictionary lookup); the timings that chose it are kept in ``site.tuning`` and in the site's
record for ``explain()``. While being traced (``compile=True``) the site uses the choice of
its most recent eager call.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

from .candidates import ScoreMod, get_candidate
from .selector import Call, shape_key
from .site import AttentionSpec

log = logging.getLogger("attnopt")

#: The candidate name that makes a site ask its selector.
AUTO = "auto"

#: ``AttentionSite`` call arguments: (q, k, v, mask, scale, dropout_p, *guarded buffers).
GUARDED_ARGS_START = 6


def _tracing(t: torch.Tensor) -> bool:
    return torch.compiler.is_compiling() or isinstance(t, (FakeTensor, FunctionalTensor))


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


def candidate_layout(q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """q, k, v as candidates take them (4-D, v in q's dtype) and how many leading dims were added."""
    lead = 4 - q.dim()
    if lead:
        q, k, v = (t.reshape((1,) * lead + t.shape) for t in (q, k, v))
    if v.dtype != q.dtype:
        v = v.to(q.dtype)
    return q, k, v, lead


@dataclass
class BufferGuard:
    """Checks that a buffer a causal proof read still holds the proven band pattern.

    The pattern is the buffer's own ``(cuts, values)`` (see :func:`attnopt.passes.masks.band_pattern`):
    lower-triangular for nanoGPT's ``tril(ones)``, a band for a sliding window. The cheap check
    is the tensor's storage pointer and version counter (bumped by every in-place write). When
    either moved, the pattern is checked again on the new values once; if it no longer holds,
    the site passes the mask tensor instead of ``is_causal``.
    """

    data_ptr: int
    version: int
    cuts: tuple[Any, ...]
    values: tuple[Any, ...]

    @classmethod
    def of(cls, t: torch.Tensor, cuts: tuple[Any, ...], values: tuple[Any, ...]) -> BufferGuard:
        return cls(t.data_ptr(), t._version, tuple(cuts), tuple(values))

    def holds(self, t: torch.Tensor) -> bool:
        if t.requires_grad:
            return False  # is_causal would drop the gradient that reaches this tensor through the mask
        if t.data_ptr() == self.data_ptr and t._version == self.version:
            return True
        ok = is_band(t, self.cuts, self.values)
        if ok:
            self.data_ptr, self.version = t.data_ptr(), t._version
        else:
            warnings.warn("attnopt: a causal mask buffer changed and no longer holds the proven causal pattern; "
                          "the site now passes the mask tensor to SDPA", stacklevel=3)
        return ok


@dataclass
class ConditionGuard:
    """A run-time mask term the causal proof assumed: all True (``band & x``) or all False (``band | x``).

    Typically a padding mask: Hugging Face ANDs ``attention_mask[b, kv_idx]`` into its causal mask,
    which is the causal pattern exactly when no key is padded. Checked on every call (one
    reduction over the term); when it fails the site passes the mask tensor, silently.
    """

    all_true: bool

    def holds(self, t: torch.Tensor) -> bool:
        return bool(t.all()) if self.all_true else not bool(t.any())


class AttentionSite(nn.Module):
    """Runs one rewritten attention site with a registered candidate."""

    def __init__(self, name: str, spec: AttentionSpec, candidate: str = "sdpa",
                 guards: list[BufferGuard] | None = None, where: str = "", score_mod: ScoreMod | None = None):
        super().__init__()
        self.score_mod = score_mod
        self.site_name = name
        self.spec = spec
        self.candidate = candidate
        self.guards = list(guards or [])
        self.where = where
        self._failed: set[str] = set()  # candidates that raised here; this site runs math instead of them
        self.selector: Any = None  # a Selector, for candidate="auto"
        self.record: Any = None  # the SiteRecord that explain() shows
        self.tuning: dict[Any, Any] = {}  # ShapeKey -> TuningEntry
        self._by_call: dict[tuple, str] = {}  # exact call signature -> choice (the per-call fast path)
        self._last: str | None = None
        self.tuning_run = False  # the backend's eager run before Inductor traces (is_compiling() is True there)
        if candidate != AUTO:
            get_candidate(candidate)  # fail early on a bad name

    def extra_repr(self) -> str:
        return f"{self.site_name}: {self.candidate}, {self.spec.describe()}"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                scale: float | None = None, dropout_p: float | None = None,
                *guarded: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        scale = spec.scale if scale is None else float(scale)
        p = spec.dropout_p if dropout_p is None else float(dropout_p)
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
        min_rows = None
        if spec.min_rows != "none" and not use_causal and mask is not None:
            min_rows = (mask <= torch.finfo(mask.dtype).min / 2).all(-1, keepdim=True)
        with torch.autograd.profiler.record_function(f"attnopt::{self.site_name}"):
            if spec.min_rows == "math" and min_rows is not None and bool(min_rows.any()):
                out = get_candidate("math")(q, k, v, **kwargs)
            else:
                out = self._call(q, k, v, kwargs)
        if spec.min_rows == "mean" and min_rows is not None:
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

    def _guards_hold(self, guarded: tuple[torch.Tensor, ...]) -> bool:
        if not self.guards:
            return True
        if any(_tracing(t) for t in guarded):
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
        if self.selector is None or (_tracing(q) and not self.tuning_run):
            return self._last or "math"
        mask = kwargs["attn_mask"]
        grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, mask))
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
        fn = get_candidate(name)
        if _tracing(q):
            return fn(q, k, v, **kwargs)
        try:
            return fn(q, k, v, **kwargs)
        except Exception as e:  # noqa: BLE001 - never break the user's model; say what happened
            warnings.warn(f"attnopt: candidate {name!r} failed at {self.site_name} ({self.where}): "
                          f"{type(e).__name__}: {e}; running the reference computation instead", stacklevel=3)
            log.warning("site %s: candidate %s raised %r; falling back to math", self.site_name, name, e)
            self._failed.add(name)
            return get_candidate("math")(q, k, v, **kwargs)
