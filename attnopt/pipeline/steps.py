"""The steps every route shares, so that no route spells them again.

Each step is one named function over a captured graph; the routes in this package
(:mod:`~attnopt.pipeline.optimize`, :mod:`~attnopt.pipeline.kv`, the profiler's site brackets
in :mod:`attnopt.profiling.measure`) are short lists of them:

* :func:`copy_graph`: the caller's graph is never edited (nor the higher-order op bodies it runs);
* :func:`find_in`: dead copies are dropped (``passes/dead.py``: a discarded ``scores.clone()``), every
  node gets a shape, real example values are bound (never fake or meta tensors), then sites are found:
  a ``Match`` per proven site, a record per near miss;
* :func:`find_everywhere`: :func:`find_in` over the graph and every higher-order op body it runs
  (activation checkpointing, ``wrap``: ``passes/hop.py``), one :class:`Found` each;
* :func:`choose`: which proven sites a candidate may serve (the others are left alone, with why);
* :func:`attach`: the rewritten site modules get their selector and their record;
* :func:`new_selector`: the one place a :class:`~attnopt.selection.selector.Selector` is made.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from ..config import OptimizeConfig
from ..env import AUTO
from ..kernels.registry import get_candidate
from ..passes.canon import meta_value
from ..passes.dead import drop_dead_copies
from ..passes.find_sites import Match, find_sites
from ..passes.hop import Body, bodies, claim, direct_bodies, shapes_from_calls, values_of
from ..passes.shapes import ensure_shapes
from ..runtime.site import AttentionSite
from ..selection.selector import Selector
from ..spec import LEFT_ALONE, SiteRecord

_SHARED: dict[Any, Selector] = {}


def new_selector(memory_budget: int | None = None, *, shared: bool = False) -> Selector:
    """The selector of one optimized model or cached LM (sites with the same shapes share its tunings).

    ``shared=True``: one per memory budget for the whole process, for ``backend="attnopt"`` used by name.
    """
    if not shared:
        return Selector(memory_budget=memory_budget)
    if memory_budget not in _SHARED:
        _SHARED[memory_budget] = Selector(memory_budget=memory_budget)
    return _SHARED[memory_budget]


def copy_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A graph module with a copy of ``gm``'s graph and ``gm``'s own submodules and tensors.

    The bodies its higher-order ops run (``wrap_body_0`` of a checkpoint) are graphs too: they are
    copied the same way, so that rewriting inside them never edits ``gm``'s.
    """
    new = fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)
    new.meta = dict(getattr(gm, "meta", {}))
    new.training = gm.training  # only the copy's own flag: its submodules are gm's, in their own modes
    for name in direct_bodies(new):
        setattr(new, name, copy_graph(getattr(new, name)))
    return new


def bind(gm: fx.GraphModule, example_inputs: Sequence[Any] | None) -> dict[fx.Node, torch.Tensor]:
    """Placeholders -> the real example tensors (fake and meta tensors hold no values to prove from)."""
    if example_inputs is None:
        return {}
    from torch._subclasses.fake_tensor import FakeTensor

    out = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs):
        if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor) and not value.is_meta:
            out[node] = value
    return out


def find_in(gm: fx.GraphModule, example_inputs: Sequence[Any] | None
            ) -> tuple[dict[fx.Node, torch.Tensor], list[Match | SiteRecord]]:
    """Shapes, bound example values, then the sites of ``gm``: ``(concrete values, matches and near misses)``."""
    drop_dead_copies(gm)                 # a discarded copy of the scores is no second reader of them
    ensure_shapes(gm, example_inputs)   # every node gets a (possibly symbolic) shape
    concrete = bind(gm, example_inputs)  # real buffer and input values, for mask proofs
    return concrete, find_sites(gm, concrete)


@dataclass
class Found:
    """One graph a route rewrites: the captured graph, or a higher-order op body inside it (``body``)."""

    gm: fx.GraphModule
    concrete: dict[fx.Node, torch.Tensor]
    found: list[Match | SiteRecord]
    body: Body | None = None

    def records(self) -> Iterator[SiteRecord]:
        return (f.record if isinstance(f, Match) else f for f in self.found)


def find_everywhere(gm: fx.GraphModule, example_inputs: Sequence[Any] | None) -> list[Found]:
    """:func:`find_in` over ``gm`` and then over every higher-order op body it runs, at any depth.

    A body's placeholders are bound to the example values its calls pass (a causal buffer handed to
    a checkpointed block is proven inside it); its records are named after it (``wrap_body_0_site0``)
    and say where they are (``record.extra["inside"]``).
    """
    concrete, found = find_in(gm, example_inputs)
    out = [Found(gm, concrete, found)]
    for body in bodies(gm):  # outer bodies first: a body's shapes follow from those of the graph around it
        shapes_from_calls(body)
        inner, there = find_in(body.module, values_of(body, concrete))
        out.append(Found(body.module, inner, claim(body, there), body))
    return out


def matches(found: list[Match | SiteRecord]) -> list[Match]:
    return [f for f in found if isinstance(f, Match)]


def device_of(m: Match) -> torch.device:
    val = meta_value(m.q)
    return val.device if isinstance(val, torch.Tensor) else torch.device("cpu")


def choose(found: list[Match], config: OptimizeConfig, selector: Selector | None = None) -> list[Match]:
    """The sites a candidate will serve; every other one is marked left alone with the reason."""
    name = config.candidate
    if name is None:
        for m in found:
            m.record.decision = LEFT_ALONE
            m.record.reason = f"variant='eager': left as written ({m.spec.describe()})"
        return []
    if name == AUTO:
        assert selector is not None
        chosen = []
        for m in found:
            legal, refused = selector.legal(m.spec, device_of(m))
            faster = [c for c in legal if c != "math"]
            if faster:
                m.record.extra["candidates"] = legal
                chosen.append(m)
            else:
                m.record.decision = LEFT_ALONE
                m.record.reason = "no candidate faster than the original can serve this site: " + "; ".join(
                    f"{c}: {why}" for c, why in refused.items())
        return chosen
    cand = get_candidate(name)
    chosen = []
    for m in found:
        why = cand.supports(m.spec)
        if why is None:
            why = cand.available(device_of(m))  # e.g. flex on a CPU without a C++ compiler
        if why is None:
            chosen.append(m)
        else:
            m.record.decision = LEFT_ALONE
            m.record.reason = f"{name} cannot serve this site: {why}"
    return chosen


def attach(gm: fx.GraphModule, chosen: list[Match], selector: Selector | None) -> None:
    """Give each site module of ``gm`` its record (for explain) and selector (for ``auto``)."""
    records = {m.record.name: m.record for m in chosen}
    for mod in gm.modules():
        if isinstance(mod, AttentionSite):
            mod.selector = selector
            mod.record = records.get(mod.site_name)
            if selector is not None:
                selector.register(mod)
