"""The per-call dispatch every site kind shares: which candidate runs a call, checked against the reference.

:class:`DispatchingSite` is the base of :class:`~attnopt.runtime.site.AttentionSite` (a rewritten
site) and :class:`~attnopt.runtime.kv_cache.KVCacheAttention` (a site with its K/V cache). A site
brings its call to the candidates' layout (:func:`candidate_layout`) and its keyword arguments
(``attn_mask``, ``is_causal``, ``scale``, ``dropout_p``, ``enable_gqa``, ...), then calls
:meth:`DispatchingSite.run_candidate`, which, per call, in order:

1. **chooses** the candidate: the fixed one, or for ``candidate="auto"`` the selector's choice for
   the call's shape key (tuned on the first call in each bucket; a tuning that raises runs ``sdpa`` or
   ``math`` for that call, with a warning). The timings that chose it are kept in ``site.tuning`` and in
   the site's record for ``explain()``. While traced (``compile=True``) the choice of the site's most
   recent eager call;
2. runs ``math`` instead of a candidate that has raised at this site before;
3. inside a compiled graph, runs what the checked eager call of that candidate ran, and stops here;
4. runs ``math`` for calls with active dropout and gradients (its dropout mask lives in its own
   autograd graph, so any backward, double too, is exact);
5. **checks** the candidate against the reference computation on the call's own inputs the first
   time it serves a shape key (a candidate not checked at every shape, FlexAttention compiled per shape or
   one registered by the user: the first time it serves each exact shape) (outputs, and gradients when the
   call needs them; "no less accurate
   than the computation as written against float64" for half types): a candidate that fails is
   dropped for that key, with a warning naming it and an entry in the record, and ``sdpa`` (checked
   the same way) or ``math`` serves the key instead;
6. **runs** it: when gradients are needed, inside :func:`~attnopt.runtime.autograd.recomputable`
   (its backward is the candidate's own unless autograd asks for a graph of the backward, where the
   reference is recomputed differentiably) unless the candidate is differentiable twice itself;
   a candidate that raises is replaced by ``math`` for this call and every later one, with a warning;
7. **observes** the selector's choices in use: one call in ``_SAMPLE_EVERY`` of a choice run as chosen,
   without gradients on the CPU, is timed (:meth:`DispatchingSite._observe`); a choice whose sampled calls
   run clearly slower than its tuning measured is marked provisional (``Selector.slower_in_use``), so the
   next process or ``attnopt.tune`` times the candidates again.

Steps 1, 2, 4 and 5 depend on the call's signature alone (shapes with the lengths in the selector's
buckets, dtype, device, the mask's dtype, layout and whether it requires a gradient, causal, dropout,
gradients), so their outcome is kept per signature (a :class:`_Plan`): a later call with the same exact
shapes costs one tuple and one dictionary lookup, one with new shapes of a known signature (a decode step,
its cache one key longer) two of each, and every new signature goes through the selector and the per-key
check (checked apart when the mask requires a gradient: a check without it says nothing about that
gradient).

>>> import torch
>>> from attnopt.spec import AttentionSpec
>>> site = DispatchingSite("s", AttentionSpec(scale=0.5, causal="top_left"), "sdpa")
>>> q = torch.randn(1, 2, 4, 8)
>>> kw = dict(attn_mask=None, is_causal=True, scale=0.5, dropout_p=0.0, enable_gqa=False)
>>> out = site.run_candidate(q, q, q, kw)  # the first call of this shape key: sdpa is checked, then run
>>> from attnopt.kernels.reference import reference_attention
>>> torch.allclose(out, reference_attention(q, q, q, **kw))
True
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.nn as nn
from torch.utils._python_dispatch import _disable_current_modes

from ..env import AUTO
from ..kernels.reference import reference_attention, tolerance
from ..kernels.registry import TWICE_DIFFERENTIABLE, checked_at_every_shape, get_candidate
from ..selection.selector import Call, length_bucket, shape_key
from ..spec import AttentionSpec
from .autograd import recomputable
from .guards import is_tracing

log = logging.getLogger(__name__)

#: Entries a per-call table keeps before it starts again (e.g. one entry per decode length).
_TABLE_LIMIT = 4096

#: A site times one call in ``_SAMPLE_EVERY`` (a power of two) of a choice the selector made; once
#: ``_SAMPLES`` timed calls have a median ``_SLOWER`` times the tuning's (and ``_SLOWER_MS`` more), the choice
#: is marked provisional (:meth:`Selector.slower_in_use`).
_SAMPLE_EVERY = 64
_SAMPLES = 8
_SLOWER = 2.0
_SLOWER_MS = 0.1


def candidate_layout(q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """q, k, v as candidates take them (4-D, v in q's dtype) and how many leading dims were added."""
    lead = 4 - q.dim()
    if lead:
        q, k, v = (t.reshape((1,) * lead + t.shape) for t in (q, k, v))
    if v.dtype != q.dtype:
        v = v.to(q.dtype)
    return q, k, v, lead


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Gradients are being recorded and one of ``tensors`` requires them."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class _Plan(NamedTuple):
    """What every call of one signature runs, decided on its first call (steps 1-5)."""

    choice: str  # the fixed candidate or the selector's choice
    asked: str  # what runs unless its check replaced it: ``math`` for a candidate that raised here, or with dropout
    name: str  # what runs: ``asked``, or its replacement after the per-key check
    fn: Any  # the registered candidate ``name``
    wrapped: bool  # run inside ``recomputable`` (gradients, by a candidate not differentiable twice)
    fallback: str | None  # why ``name`` is not ``choice`` (counted per call in ``site.fallbacks``), or None
    key: Any = None  # the selector's shape key when its sampled calls are timed (see ``DispatchingSite._observe``)


def _signature(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, kwargs: dict,
               grad: bool) -> tuple:
    """The key of a call's :class:`_Plan`: what steps 1-5 read, the query and key lengths in the selector's buckets
    (:func:`~attnopt.selection.selector.shape_key`'s), so a decode step whose cache grows by one key per call
    finds its plan again instead of planning every call; the mask by dtype and which dims broadcast."""
    return (q.size(0), q.size(1), length_bucket(q.size(2)), q.size(3), k.size(0), k.size(1),
            length_bucket(k.size(2)), k.size(3), v.size(1), v.size(3), q.dtype, q.device,
            None if mask is None else (mask.dtype, tuple(n == 1 for n in mask.shape), mask.requires_grad),
            kwargs["is_causal"], kwargs["dropout_p"] > 0, grad)


class DispatchingSite(nn.Module):
    """A site that runs each call with its candidate, chosen and checked per shape key (see the module docstring).

    Args:
        name: the site's name (``attnopt_siteN``'s record name), used in warnings, logs and profiles.
        spec: what the site computes; the candidates and the reference are checked against it.
        candidate: a registered candidate's name, or ``"auto"`` (the ``selector`` chooses per shape key).
        where: the site's module path and source line, for messages.
        selector: the :class:`~attnopt.selection.selector.Selector` for ``"auto"``; the site registers with
            it (so :meth:`Selector.share` can make it choose again). It may also be set later, as
            ``optimize`` does (then whoever sets it registers the site).
    """

    def __init__(self, name: str, spec: AttentionSpec, candidate: str = "sdpa", *, where: str = "",
                 selector: Any = None):
        super().__init__()
        self.site_name = name
        self.spec = spec
        self.candidate = candidate
        self.where = where
        self.selector: Any = selector  # a Selector, for candidate="auto"
        self.record: Any = None  # the SiteRecord that explain() shows
        self.tuning: dict[Any, Any] = {}  # ShapeKey -> TuningEntry
        self.tuning_run = False  # the backend's eager run before Inductor traces (is_compiling() is True there)
        self._failed: set[str] = set()  # candidates that raised here; this site runs math instead of them
        self._checked: dict[tuple, str] = {}  # (candidate, ShapeKey) -> what runs: it, or its replacement
        self._checked_mask_grad: dict[tuple, str] = {}  # the same for calls whose mask requires a gradient
        #: call signature (:func:`_signature`) -> _Plan; cleared whenever what it caches may change (a candidate
        #: raised, the selector's choices were forgotten)
        self._plans: dict[tuple, _Plan] = {}
        self._by_shape: dict[tuple, _Plan] = {}  # the same plans by the calls' exact shapes (cleared with them)
        #: what the most recent eager call chose ("choice") and, per candidate, what its checked eager call
        #: ran: a traced call (compile=True) runs that (plain dicts: written on every call, cheaply)
        self._recent: dict[str, str] = {}
        self._ran: dict[str, str] = {}
        #: calls that ran as written or by a replacement, per reason (also the record's ``extra["fallbacks"]``)
        self.fallbacks: dict[str, int] = {}
        #: sampled call times (s) of the selector's choices per shape key (None: no longer observed), a call count
        self.observed: dict[Any, list[float] | None] = {}
        self._calls = [0]  # a list: counting through it costs no nn.Module.__setattr__ per call
        #: in graphs traced for dynamic shapes: candidate -> what runs there instead (see :meth:`_for_every_shape`)
        self.traced_instead: dict[str, str] = {}
        if candidate != AUTO:
            get_candidate(candidate)  # fail early on a bad name
        if selector is not None:
            selector.register(self)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__() if hasattr(super(), "__getstate__") else dict(self.__dict__)
        state = dict(state)
        state["_plans"] = {}  # a cache of what _checked, tuning and _failed decide; its candidates may not pickle
        state["_by_shape"] = {}
        return state

    def _for_every_shape(self, name: str) -> str:
        """What a graph traced for dynamic shapes runs instead of ``name``, which was checked at one shape only.

        A decision about the traced graph, not about calls (the graph then serves every call): kept in
        ``traced_instead`` and the record's ``extra["traced_instead"]`` for ``explain()``, and warned once."""
        instead = "sdpa" if get_candidate("sdpa").supports(self.spec) is None else "math"
        if self.traced_instead.get(name) != instead:
            warnings.warn(f"{self.site_name}: candidate {name!r} was checked against the model as written at one "
                          f"shape only, and a graph compiled for dynamic shapes serves every shape with no check "
                          f"inside it; {instead!r} runs there instead (pass dynamic=False to attnopt.optimize to "
                          f"compile, and check, each shape apart)", stacklevel=2)
            self.traced_instead[name] = instead
            if self.record is not None:
                self.record.extra["traced_instead"] = self.traced_instead
        return instead

    def _forget_plans(self) -> None:
        """Drop the plans (both tables): what they cache (a candidate, its check, the selector's choice) changed."""
        self._plans.clear()
        self._by_shape.clear()

    def count_fallback(self, reason: str) -> None:
        """One more call of this site ran as written (or by a replacement) for ``reason``; ``explain()`` shows it."""
        counts = self.fallbacks
        counts[reason] = counts.get(reason, 0) + 1
        if self.record is not None and self.record.extra.get("fallbacks") is not counts:
            self.record.extra["fallbacks"] = counts

    def forget_choices(self) -> None:
        """Ask the selector again on the next call (after it adopted another rank's choices)."""
        self.tuning.clear()
        self._forget_plans()
        if self.record is not None:
            self.record.extra.pop("tuning", None)

    @contextlib.contextmanager
    def running(self, candidate: str) -> Iterator[None]:
        """Every call runs ``candidate`` inside the block (no tuning, no choice kept); the site's own candidate
        and per-call plans are restored after it."""
        get_candidate(candidate)
        own = self.candidate
        self.candidate = candidate
        self._forget_plans()  # plans made for the site's own candidate, then for ``candidate``
        self._recent.clear()
        self._ran.clear()
        try:
            yield
        finally:
            self.candidate = own
            self._forget_plans()
            self._recent.clear()
            self._ran.clear()

    def run_candidate(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: dict, *,
                      grad: bool | None = None, tracing: bool | None = None) -> torch.Tensor:
        """The call's output from its candidate, chosen, checked and with fallbacks (steps 1-6 above).

        q, k, v: 4-D, as :func:`candidate_layout` gives them; ``kwargs``: the candidates' keyword arguments,
        at least ``attn_mask``, ``is_causal``, ``scale``, ``dropout_p`` and ``enable_gqa``. ``grad``
        (``needs_grad(q, k, v, kwargs["attn_mask"])``) and ``tracing`` (``is_tracing(q)``) may be passed by a
        caller that has them already.

        Everything steps 1-5 decide depends on the call's signature only (shapes, the lengths in the selector's
        buckets, dtype, device, the mask's dtype and layout, causal, dropout, gradients; :func:`_signature`):
        after the first call of a signature it is one tuple and one dictionary lookup (:class:`_Plan`), by the
        call's exact shapes first and by its signature for new shapes (a decode step's growing cache). The
        first call of each signature goes the whole way (the selector's table, the per-key check), so a new
        shape key, dtype, device, grad mode or mask dtype is always chosen and checked.
        """
        if tracing is None:
            tracing = is_tracing(q)
        if tracing and not self.tuning_run:
            # inside a compiled graph: what the checked eager run of this candidate ran
            name = self.candidate if self.candidate != AUTO else self._recent.get("choice", "math")
            if name in self._failed:
                name = "math"
            name = self._ran.get(name, name)
            if not checked_at_every_shape(name) and _symbolic(q, k, v):
                name = self._for_every_shape(name)
            return get_candidate(name)(q, k, v, **kwargs)
        mask = kwargs["attn_mask"]
        if grad is None:
            grad = needs_grad(q, k, v, mask)
        exact = (q.shape, k.shape, v.shape, q.dtype, q.device,
                 None if mask is None else (mask.dtype, mask.shape, mask.requires_grad),
                 kwargs["is_causal"], kwargs["dropout_p"] > 0, grad)
        plan = self._by_shape.get(exact)  # the same shapes again: one lookup (a fixed-shape model's every call)
        if plan is None:
            call = _signature(q, k, v, mask, kwargs, grad)
            plan = self._plans.get(call)
            kept = plan is not None
            if plan is None:
                plan, kept = self._plan(call, q, k, v, kwargs, grad)
            if kept:  # found by its shapes from now on
                if len(self._by_shape) > _TABLE_LIMIT:
                    self._by_shape.clear()
                self._by_shape[exact] = plan
        self._recent["choice"] = plan.choice
        self._ran[plan.asked] = plan.name
        if plan.fallback is not None:
            self.count_fallback(plan.fallback)
        try:
            if plan.wrapped:
                return recomputable(self, plan.fn, q, k, v, kwargs)
            if plan.key is not None:
                calls = self._calls
                calls[0] += 1
                if not calls[0] % _SAMPLE_EVERY:
                    return self._observe(plan, q, k, v, kwargs)
            return plan.fn(q, k, v, **kwargs)
        except Exception as e:  # noqa: BLE001 - never break the user's model; say what happened
            name = plan.name
            warnings.warn(f"attnopt: candidate {name!r} failed at {self.site_name} ({self.where}): "
                          f"{type(e).__name__}: {e}; running the reference computation instead", stacklevel=3)
            log.warning("site %s: candidate %s raised %r; falling back to math", self.site_name, name, e)
            self._failed.add(name)
            self._forget_plans()
            self.count_fallback(f"{name} raised at this site: math")
            return get_candidate("math")(q, k, v, **kwargs)

    def _observe(self, plan: _Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """One sampled call of a selector's choice, timed; a choice that runs clearly slower in use than its tuning
        measured is marked provisional, so the next process or ``attnopt.tune`` times the candidates again."""
        start = time.perf_counter()
        out = plan.fn(q, k, v, **kwargs)
        seconds = time.perf_counter() - start
        times = self.observed.setdefault(plan.key, [])
        entry = self.tuning.get(plan.key)
        if times is None or entry is None or entry.provisional or plan.name != entry.choice:
            return out
        times.append(seconds)
        if len(times) >= _SAMPLES:
            observed = sorted(times)[len(times) // 2] * 1e3
            recorded = entry.timings_ms.get(entry.choice, float("inf"))
            if observed > _SLOWER * recorded and observed - recorded > _SLOWER_MS:
                self.tuning[plan.key] = marked = self.selector.slower_in_use(self.spec, plan.key, q.device, entry,
                                                                             observed, len(times))
                if self.record is not None:
                    self.record.extra.setdefault("tuning", {})[plan.key.describe()] = marked
                self.observed[plan.key] = None
            elif len(times) >= 4 * _SAMPLES:
                del times[:_SAMPLES]  # the most recent calls: a slow-down is seen within a few samples
        return out

    def _plan(self, call: tuple, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: dict,
              grad: bool) -> tuple[_Plan, bool]:
        """Steps 1-5 for a call signature not seen since the plans were last cleared, and whether the plan holds for
        these exact shapes again (not when the choice was a stand-in for one call: a tuning that raised). It is kept
        for the whole signature only where what runs was checked for every shape of it (not FlexAttention, compiled
        and checked per exact shape)."""
        choice, keep, key = self._choice(q, k, v, kwargs, grad)
        name, why = choice, None
        if choice in self._failed:
            name, why = "math", f"{choice} raised at this site: math"
        elif grad and kwargs["dropout_p"] > 0 and name not in TWICE_DIFFERENTIABLE:
            # its dropout mask is part of its own graph, so any backward (double too) is exact
            name, why = "math", "dropout with gradients: math"
        served = self._served_by(name, q, k, v, kwargs, grad)
        if served in self._failed:  # the replacement of a rejected candidate raised here before
            served, why = "math", f"{served} raised at this site: math"
        elif served != name:
            why = f"{name} does not match the reference for these shapes: {served}"
        # the selector's choice, run as chosen, without gradients on the CPU (where a call's time is its wall
        # time, comparable with the tuning's): sampled calls are timed
        observed = key if (name == served == choice and not grad and q.device.type == "cpu") else None
        plan = _Plan(choice, name, served, get_candidate(served), grad and served not in TWICE_DIFFERENTIABLE, why,
                     observed)
        if keep and checked_at_every_shape(served):
            if len(self._plans) > _TABLE_LIMIT:
                self._forget_plans()
            self._plans[call] = plan
        return plan, keep

    # ------------------------------------------------------------------ 1. the choice

    def _choice(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: dict,
                grad: bool) -> tuple[str, bool, Any]:
        """The candidate chosen for this call, whether it holds for every call of its signature, and the
        selector's shape key when the selector chose it (else None)."""
        if self.candidate != AUTO:
            return self.candidate, True, None
        if self.selector is None:
            return self._recent.get("choice", "math"), False, None  # optimize() sets the selector later
        mask = kwargs["attn_mask"]
        key = shape_key(self.spec, q, k, v, causal=kwargs["is_causal"], mask=mask,
                        dropout=kwargs["dropout_p"] > 0, grad=grad)
        entry = self.tuning.get(key)
        if entry is None:
            try:
                with apart(q.device):  # the tuning's own calls are not the model's
                    entry = self.selector.choose(self.spec, key, Call(q, k, v, kwargs, grad))
            except Exception as e:  # noqa: BLE001 - tuning is an optimisation; never break the forward
                fallback = "sdpa" if get_candidate("sdpa").supports(self.spec) is None else "math"
                warnings.warn(f"attnopt: could not tune {self.site_name} ({self.where}) for {key.describe()}: "
                              f"{type(e).__name__}: {e}; running {fallback} for this call", stacklevel=5)
                self.count_fallback(f"the tuning raised: {fallback}")
                return fallback, False, None
            self.tuning[key] = entry
            if self.record is not None:
                self.record.extra.setdefault("tuning", {})[key.describe()] = entry
        return entry.choice, True, key

    # ------------------------------------------------------------------ 5. the per-key reference check

    def _served_by(self, name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: dict,
                   grad: bool) -> str:
        """``name``, or what replaces it, once it matched the reference for this call's shape key."""
        if name == "math":
            return name
        mask = kwargs["attn_mask"]
        key: tuple = (name, shape_key(self.spec, q, k, v, causal=kwargs["is_causal"], mask=mask,
                                      dropout=kwargs["dropout_p"] > 0, grad=grad))
        if not checked_at_every_shape(name):
            # compiled per exact shape (FlexAttention: wrong at some small shapes on some CPUs), or unknown code: a
            # check at one length of the bucket says nothing about the kernel another length compiles
            key += (q.shape, k.shape, v.shape, None if mask is None else mask.shape)
        # a check without the mask's gradient says nothing about it: calls that need it are checked apart
        checked = self._checked_mask_grad if grad and mask is not None and mask.requires_grad else self._checked
        served = checked.get(key)
        if served is None:
            if len(checked) > _TABLE_LIMIT:
                checked.clear()  # (checked again when met again)
            with apart(q.device):  # the check's own calls are not the model's
                served = checked[key] = self._check(name, q, k, v, kwargs, grad, key[1])
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


def _symbolic(*tensors: torch.Tensor) -> bool:
    """Some size of these (traced) tensors is symbolic: the graph serves every size it stands for."""
    return any(isinstance(n, torch.SymInt) for t in tensors for n in t.shape)


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


__all__ = ["apart", "DispatchingSite", "candidate_layout", "needs_grad"]


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


@contextlib.contextmanager
def apart(device: torch.device) -> Iterator[None]:
    """Work that is not the model's (a tuning, a reference check) apart from the model's own autograd state.

    Its saved tensors skip any enclosing saved-tensor hooks (activation checkpointing's: an
    ``autograd.grad`` under them would start the checkpoint's recomputation mid-forward, and the forward
    would save more than its recomputation), its operations skip the active dispatch modes (selective
    checkpointing's), and the random state is restored after it. So a checkpointed forward and its
    recomputation run the same operations, whether or not a site tuned or checked in between.
    """
    devices = [device] if device.type == "cuda" else []
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(_same, _same))
        except RuntimeError:  # hooks disabled (torch.func transforms): none are active to step around
            pass
        stack.enter_context(_disable_current_modes())
        stack.enter_context(torch.random.fork_rng(devices=devices))
        yield
