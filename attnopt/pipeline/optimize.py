"""The pipeline: one captured FX graph in, the same graph with attention rewritten out.

Both routes use it: the dynamo backend (``optimize``, ``torch.compile(backend="attnopt")``)
and ``rewrite(gm)`` for a GraphModule the user already has.
"""

from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from ..config import OptimizeConfig
from ..env import AUTO
from ..kernels.registry import get_candidate
from ..passes.canon import meta_value
from ..passes.find_sites import Match, find_sites
from ..passes.mha import drop_unused_mha_weights
from ..passes.rewrite_sdpa import rewrite_sites
from ..passes.shapes import ensure_shapes
from ..passes.verify import compare_outputs
from ..runtime.site import AttentionSite
from ..selection.selector import Selector
from ..spec import LEFT_ALONE, SiteRecord

log = logging.getLogger("attnopt")


def run_pipeline(gm: fx.GraphModule, example_inputs: Sequence[Any] | None, config: OptimizeConfig,
                 graph_id: int = 0, selector: Selector | None = None) -> tuple[fx.GraphModule, list[SiteRecord]]:
    """Rewrite the attention in a copy of ``gm``; return it with one record per softmax.

    With ``variant="auto"`` the sites ask ``selector`` (one per optimized model, so sites with
    the same shapes share a tuning) for their candidate at run time.
    """
    if config.candidate == AUTO and selector is None:
        selector = Selector(memory_budget=config.memory_budget)
    work = copy_graph(gm)                                   # capture: the caller's graph is never edited
    ensure_shapes(work, example_inputs)                # every node gets a (possibly symbolic) shape
    concrete = _bind(work, example_inputs)             # real buffer values, for causal-mask proofs
    found = find_sites(work, concrete)                 # canonicalise, match, prove: Match or near miss
    records = [f.record if isinstance(f, Match) else f for f in found]
    records += drop_unused_mha_weights(work, config.candidate is not None, len(records))  # MHA weights unread
    for r in records:
        r.graph_id = graph_id
    chosen = _choose([f for f in found if isinstance(f, Match)], config, selector)  # legal candidates per site
    if chosen:
        candidate = config.candidate
        assert candidate is not None
        rewrite_sites(work, chosen, candidate, concrete)  # replace each site with its site module
        _attach(work, chosen, selector)                   # "auto": sites ask the selector per shape key
        if config.verify and example_inputs is not None:  # drop rewrites whose outputs differ
            work = _verify(gm, work, example_inputs, chosen, config, graph_id, selector)
    for r in records:
        log.info("graph %d %s [%s %s] %s: %s", graph_id, r.name, r.module_path, r.source, r.decision,
                 r.reason or r.rewrite)
    return work, records


def copy_graph(gm: fx.GraphModule) -> fx.GraphModule:
    new = fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)
    new.meta = dict(getattr(gm, "meta", {}))
    new.training = gm.training  # only the copy's own flag: its submodules are gm's, in their own modes
    return new


def _bind(gm: fx.GraphModule, example_inputs: Sequence[Any] | None) -> dict[fx.Node, torch.Tensor]:
    if example_inputs is None:
        return {}
    from torch._subclasses.fake_tensor import FakeTensor

    out = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs):
        if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor) and not value.is_meta:
            out[node] = value
    return out


def _attach(gm: fx.GraphModule, chosen: list[Match], selector: Selector | None) -> None:
    records = {m.record.name: m.record for m in chosen}
    for mod in gm.modules():
        if isinstance(mod, AttentionSite):
            mod.selector = selector
            mod.record = records.get(mod.site_name)
            if selector is not None:
                selector.register(mod)


def _device_of(m: Match) -> torch.device:
    val = meta_value(m.q)
    return val.device if isinstance(val, torch.Tensor) else torch.device("cpu")


def _choose(matches: list[Match], config: OptimizeConfig, selector: Selector | None = None) -> list[Match]:
    name = config.candidate
    if name is None:
        for m in matches:
            m.record.decision = LEFT_ALONE
            m.record.reason = f"variant='eager': left as written ({m.spec.describe()})"
        return []
    if name == AUTO:
        assert selector is not None
        chosen = []
        for m in matches:
            legal, refused = selector.legal(m.spec, _device_of(m))
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
    for m in matches:
        why = cand.supports(m.spec)
        device = _device_of(m)
        if why is None and device is not None:
            why = cand.available(device)  # e.g. flex on a CPU without a C++ compiler
        if why is None:
            chosen.append(m)
        else:
            m.record.decision = LEFT_ALONE
            m.record.reason = f"{name} cannot serve this site: {why}"
    return chosen


def _verify(original: fx.GraphModule, rewritten: fx.GraphModule, inputs: Sequence[Any],
            chosen: list[Match], config: OptimizeConfig, graph_id: int,
            selector: Selector | None) -> fx.GraphModule:
    active = [m.record.name for m in chosen if m.spec.dropout_mode == "on"
              or (m.spec.dropout_mode == "module" and rewritten.training)]
    if active:
        warnings.warn(f"attnopt: verify skipped for graph {graph_id}: dropout is active at {', '.join(active)}, "
                      "so outputs are random; call model.eval() to verify", stacklevel=4)
        return rewritten
    problems = compare_outputs(original, rewritten, inputs)
    if not problems:
        for m in chosen:
            m.record.extra["verified"] = True
        return rewritten
    # Find the sites to blame one at a time, keep the rest.
    keep = []
    for m in chosen:
        trial = _rewrite_subset(original, inputs, config, {m.record.name}, selector)
        if compare_outputs(original, trial, inputs):
            m.record.decision = LEFT_ALONE
            m.record.rewrite = ""
            m.record.reason = f"verify: outputs differed beyond tolerance ({problems[0]}); left as written"
            warnings.warn(f"attnopt: dropped the rewrite of {m.record.name} ({m.record.module_path} "
                          f"{m.record.source}): {problems[0]}", stacklevel=4)
        else:
            m.record.extra["verified"] = True
            keep.append(m.record.name)
    return _rewrite_subset(original, inputs, config, set(keep), selector, chosen)


def _rewrite_subset(gm: fx.GraphModule, inputs: Sequence[Any], config: OptimizeConfig,
                    names: set[str], selector: Selector | None,
                    report_to: list[Match] | None = None) -> fx.GraphModule:
    work = copy_graph(gm)
    ensure_shapes(work, inputs)
    concrete = _bind(work, inputs)
    found = [f for f in find_sites(work, concrete) if isinstance(f, Match) and f.record.name in names]
    drop_unused_mha_weights(work, config.candidate is not None)
    if found:
        rewrite_sites(work, found, config.candidate or "sdpa", concrete)
        _attach(work, report_to or found, selector)
    return work
