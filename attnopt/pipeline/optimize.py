"""The optimize route: one captured FX graph in, the same graph with its attention rewritten out.

Both capture routes use it: the dynamo backend (``optimize``, ``torch.compile(backend="attnopt")``)
and ``rewrite(gm)`` for a GraphModule the user already has. Its steps, in order (each is a pass or
a step of :mod:`attnopt.pipeline.steps`):

1. copy the graph (the caller's is never edited, nor the higher-order op bodies it runs);
2. find sites: shapes, example values bound, canonicalise, match, prove (``passes/find_sites.py``),
   in the graph and in every body of activation checkpointing or ``wrap`` it runs (``passes/hop.py``);
3. drop the weights of ``nn.MultiheadAttention`` modules whose every use was rewritten (``passes/mha.py``);
4. choose the sites a candidate may serve;
5. rewrite each chosen site to a site module in the graph that holds it (``passes/rewrite_sdpa.py``);
   the higher-order op calls stay, so a checkpointed body is still recomputed in the backward, and
   its sites take their checkpointed form (``passes/hop.py``: they tune and check outside the checkpoint);
6. attach the selector and records to the site modules;
7. verify (``verify=True``): run both graphs on the example inputs and drop the rewrites that differ,
   bisecting site by site with the same steps (``passes/verify.py``).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from typing import Any

import torch.fx as fx

from ..config import OptimizeConfig
from ..env import AUTO
from ..passes.find_sites import Match
from ..passes.hop import note_inside, rename_rewritten, settle
from ..passes.mha import drop_unused_mha_weights
from ..passes.rewrite_sdpa import rewrite_sites
from ..passes.verify import compare_outputs
from ..selection.selector import Selector
from ..spec import LEFT_ALONE, SiteRecord
from .steps import Found, attach, choose, copy_graph, find_everywhere, matches, new_selector

log = logging.getLogger(__name__)


def run_pipeline(gm: fx.GraphModule, example_inputs: Sequence[Any] | None, config: OptimizeConfig,
                 graph_id: int = 0, selector: Selector | None = None) -> tuple[fx.GraphModule, list[SiteRecord]]:
    """Rewrite the attention in a copy of ``gm``; return it with one record per softmax.

    With ``variant="auto"`` the sites ask ``selector`` (one per optimized model, so sites with
    the same shapes share a tuning) for their candidate at run time.
    """
    if config.candidate == AUTO and selector is None:
        selector = new_selector(config.memory_budget)
    work = copy_graph(gm)                                # 1. the caller's graph is never edited
    graphs = find_everywhere(work, example_inputs)       # 2. a Match per proven site, a record per near miss
    records = [r for g in graphs for r in g.records()]
    records += drop_unused_mha_weights(work, config.candidate is not None, len(records))  # 3. MHA weights unread
    for r in records:
        r.graph_id = graph_id
    chosen = choose([m for g in graphs for m in matches(g.found)], config, selector)  # 4. legal candidates
    if chosen:
        candidate = config.candidate
        assert candidate is not None
        _rewrite(graphs, chosen, candidate)               # 5. replace each site with its site module
        attach(work, chosen, selector)                    # 6. "auto": sites ask the selector per shape key
        if config.verify and example_inputs is not None:  # 7. drop rewrites whose outputs differ
            work = _verify(gm, work, example_inputs, chosen, config, graph_id, selector)
    for g in graphs[1:]:
        for r in g.records():
            note_inside(r)  # "...; inside activation checkpointing (wrap_body_0), still checkpointed"
    for r in records:
        log.info("graph %d %s [%s %s] %s: %s", graph_id, r.name, r.module_path, r.source, r.decision,
                 r.reason or r.rewrite)
    return work, records


def rewrite_subset(gm: fx.GraphModule, inputs: Sequence[Any] | None, config: OptimizeConfig,
                   names: set[str], selector: Selector | None,
                   report_to: list[Match] | None = None) -> fx.GraphModule:
    """Steps 1-6 for the sites named ``names`` only (the verify bisection, ``rewrite()``'s re-proofs)."""
    work = copy_graph(gm)
    graphs = find_everywhere(work, inputs)
    chosen = [m for g in graphs for m in matches(g.found) if m.record.name in names]
    drop_unused_mha_weights(work, config.candidate is not None)
    if chosen:
        _rewrite(graphs, chosen, config.candidate or "sdpa")
        attach(work, report_to or chosen, selector)
    return work


def _rewrite(graphs: list[Found], chosen: list[Match], candidate: str) -> None:
    """Step 5 in each graph that holds chosen sites: the captured graph and the bodies it runs."""
    keep = {id(m) for m in chosen}
    for g in graphs:
        mine = [m for m in matches(g.found) if id(m) in keep]
        if mine:
            rewrite_sites(g.gm, mine, candidate, g.concrete)
        if g.body is not None:
            settle(g.body)  # checkpointed sites; guards on module buffers pinned
    rename_rewritten(graphs[0].gm)  # wrap_body_0 -> wrap_body_0_rewritten: never taken for the body as written


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
        trial = rewrite_subset(original, inputs, config, {m.record.name}, selector)
        if compare_outputs(original, trial, inputs):
            m.record.decision = LEFT_ALONE
            m.record.rewrite = ""
            m.record.reason = f"verify: outputs differed beyond tolerance ({problems[0]}); left as written"
            warnings.warn(f"attnopt: dropped the rewrite of {m.record.name} ({m.record.module_path} "
                          f"{m.record.source}): {problems[0]}", stacklevel=4)
        else:
            m.record.extra["verified"] = True
            keep.append(m.record.name)
    return rewrite_subset(original, inputs, config, set(keep), selector, chosen)
