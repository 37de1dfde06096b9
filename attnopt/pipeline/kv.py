"""The KV-cache route: ``cached(model)`` builds a :class:`~attnopt.runtime.cached_lm.CachedLM`.

capture (``passes.kv_capture``) -> find sites -> keep the cacheable ones -> rewrite them to site
modules -> swap each for a :class:`~attnopt.runtime.kv_cache.KVCacheAttention` -> prove positions
-> copy the graph with positions read from an input (ragged batches) -> shift positions by the offset
-> compare with the model as written where export assumed sizes of at least 2 -> pin what the capture
read. See :mod:`attnopt.generation`
for why the result computes the same function.
"""

from __future__ import annotations

import contextlib
import operator
import re
from dataclasses import replace
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..env import AUTO, parse_bytes
from ..kernels.registry import get_candidate
from ..passes.canon import meta_value
from ..passes.fast_linear import use_fast_linear
from ..passes.find_sites import Match
from ..passes.kv_capture import (
    NoMaxLen,
    cache_bytes_per_token,
    capture_lm,
    config_max,
    forward_kwargs,
    logits_of,
    mask_check,
    not_cacheable,
    relative_key_term,
    resolve_max_len,
)
from ..passes.masks import Add, Fill
from ..passes.positions import PositionError, analyse_positions, index_positions, offset_positions
from ..passes.rewrite_sdpa import rewrite_sites, zero_hidden_rows
from ..runtime.cached_lm import CachedLM, watch_model
from ..runtime.kv_cache import KVCacheAttention, MaskCheck
from ..runtime.linear import undecided
from ..runtime.site import AttentionSite
from ..selection.selector import Selector
from ..spec import LEFT_ALONE
from .steps import find_in, matches, new_selector

aten = torch.ops.aten


def cached(model: nn.Module, max_len: int | None = None, *, variant: str = "sdpa", compile: bool = False,
           memory_budget: int | str | None = None) -> CachedLM:
    """Capture ``model`` (a causal LM, ``forward(idx) -> logits (B, T, vocab)``) and build its cached version.

    Args:
        model: returns logits for every position: a tensor, a tuple whose first item is the logits
            (nanoGPT's ``(logits, loss)``), or an object with ``.logits``. Dropout must be inactive.
            ``forward(idx)``, or ``forward(idx, attention_mask)`` with a required mask: it is captured
            with a mask of ones (a sequence alone has no padding; ragged batches are padded by the cache).
        max_len: positions the caches hold. Default: the model's maximum positions when they can be
            found (``config.block_size``/``max_position_embeddings``/..., position tables, length checks
            in ``forward``). A value beyond a position table or check of the model is refused.
        variant: the candidate that attends to the cache: ``"sdpa"`` (default), any registered
            candidate, or ``"auto"``: the selector times the legal candidates for the prefill and
            decode shapes (per power-of-two bucket of the cached length; the tuning cache on disk
            makes later runs free) and keeps the fastest.
        compile: hand the cached graph to Inductor (``torch.compile(..., dynamic=True)``): fused
            elementwise ops, fewer dispatches per step. Compiling takes tens of seconds on the first
            prefill and step; not with ``variant="auto"`` (the choice must be made before tracing).
        memory_budget: bytes (or ``"512MiB"``, ``"2GB"``) the K/V caches may take. The caches hold
            ``max_len`` positions per sequence; a prefill whose batch would exceed the budget raises
            ``ValueError`` saying the largest batch and ``max_len`` that fit, and so does this call when one
            sequence does not fit. ``describe()`` and ``sequences_that_fit()`` report it.

    Masks that only a run-time check can show causal (see :class:`MaskCheck`) are checked at each new
    ``(batch, length)`` by ``prefill``/``step``, which raise ``PositionError`` if one is not. ``prefill``
    and ``step`` raise ``ModelChangedError`` once a tensor of ``model`` the cached graph reads was
    replaced by another object or converted to another dtype or device, a buffer a causal proof read lost
    the proven pattern, or a plain attribute of a submodule (or its ``training`` flag, its children, its
    forward hooks) differs from the capture. Weights written in place are followed: before a ``prefill``
    they are used by it; after it, the next ``step`` recomputes the sequence with them (see
    :meth:`CachedLM.step`).

    Raises:
        PositionError: the model is not provably cacheable; the message names the op and line.
    """
    return build_cached(model, max_len, variant=variant, compile=compile, memory_budget=memory_budget)


#: ``max_len_source`` of caches :func:`build_cached` sized for one call (``unbounded_len``).
SIZED_FOR_CALL = "sized for the prompt and new tokens: the model names no maximum length"


def build_cached(model: nn.Module, max_len: int | None = None, *, variant: str = "sdpa", compile: bool = False,
                 memory_budget: int | str | None = None, unbounded_len: int | None = None) -> CachedLM:
    """:func:`cached`; with ``unbounded_len``, the caches hold that many positions where the model names no maximum
    length and ``max_len`` is None (``generate`` passes the prompt and new tokens), instead of raising."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"attnopt.generation.cached expects a torch.nn.Module, got {type(model).__name__}")
    if max_len is not None and (not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 1):
        raise ValueError(f"max_len must be a positive int or None, got {max_len!r}")
    if variant != "auto":
        get_candidate(variant)  # a clear error for an unknown name
    elif compile:
        raise ValueError("compile=True needs a fixed candidate (e.g. variant='sdpa'): the selector times "
                         "candidates eagerly, which a compiled graph cannot do")
    if not isinstance(compile, bool):
        raise TypeError(f"compile must be True or False, got {compile!r}")
    budget = parse_bytes(memory_budget)  # a clear error for a bad value, before the capture
    selector = new_selector() if variant == AUTO else None
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if isinstance(implementation, str) and implementation != "eager":
        raise PositionError(
            f"{type(model).__name__} runs its attention through {implementation!r} (Hugging Face's "
            "attn_implementation), a fused kernel the KV cache cannot prove causal; load or build it with "
            "attn_implementation=\"eager\" (the hand-written attention attnopt rewrites), or use "
            "attnopt.optimize(model).generate(...) with Hugging Face's own cache")
    declared = config_max(model)
    example_len = 4 if declared is None else max(2, min(4, declared))
    gm, tokens, ep = capture_lm(model, example_len)       # 1. forward(idx) -> logits, dynamic batch and length
    _, found = find_in(gm, None)                           # 2. the sites, as for optimize()
    probe = _probe(model, declared)                        # 3. proven causal (or window) ones only, masks checked
    chosen, notes, checks = _cacheable(gm, matches(found), tokens, declared, probe)
    proofs = [(str(buf.target), cuts, values, m.record.name) for m in chosen
              for buf, (cuts, values) in zip(m.mask.guarded, m.mask.patterns) if buf.op == "get_attr"]
    if chosen:
        rewrite_sites(gm, chosen, "sdpa", {}, keep_sinks=True)  # 4. each to a site module ...
    relative = {m.record.name for m in chosen if m.relative_key_bias}
    offset, sites, site_nodes = _kv_sites(gm, tokens, variant, selector, checks, relative)  # 5. KV sites
    relaid_as_aten(gm, site_nodes)                         # (the layout changes the rewrite added, as ATen ops)
    try:
        plan = analyse_positions(gm, tokens, site_nodes, notes)  # 6. the rest is position-wise (else PositionError)
    except PositionError as e:
        raise _with_left_alone(e, found) from None
    rows = index_positions(gm, plan)                       # 7. a copy reading one position per time step (ragged)
    offset_positions(gm, plan, offset)                     # 8. positions start at the offset
    plan.bounds.extend(gm.meta.get("length_bounds", []))  # conditions on the length export recorded
    try:
        limit, source = resolve_max_len(max_len, declared, plan, ep, tokens)  # 9. how long the caches are
    except NoMaxLen:
        if unbounded_len is None:
            raise
        limit, source = unbounded_len, SIZED_FOR_CALL
    for s, node in zip(sites, site_nodes):
        s.max_len, s.bytes_per_token = limit, cache_bytes_per_token(node, tokens)
    lm = CachedLM(gm, sites, limit, source, plan, type(model).__name__, rows=rows)
    lm.mask_checks = [c for c in checks if c.site_name in {s.site_name for s in sites}]
    lm.memory_budget = budget
    if budget is not None and lm.bytes_per_sequence is not None and lm.bytes_per_sequence > budget:
        raise ValueError(f"one sequence of max_len={limit} needs {lm.bytes_per_sequence} B of K/V cache "
                         f"({lm.bytes_per_token} B per position), more than memory_budget={budget} B: pass "
                         f"max_len <= {lm.longest_that_fits(budget)} or a larger memory_budget")
    lm.run = local_attrs(gm)  # 11. the same graphs with every tensor they read one attribute lookup away
    lm.rows_module = None if rows is None else local_attrs(rows)
    for run in () if compile else (lm.run, lm.rows_module):  # ... whose linear layers take the faster kernel
        group = None if run is None else use_fast_linear(run, type(model).__name__)  # (Inductor picks its own)
        if group is not None and group not in lm.linear_groups:  # the ragged graph shares the plain one's
            lm.linear_groups.append(group)
    compare_small_sizes(lm, model, gm.meta.get("excluded_sizes", []))  # 12. batch 1, length 1, excluded sizes
    lm.watch = watch_model(model, gm, proofs, lm.mask_checks)  # 13. pin what the capture read (after 12's forwards)
    if compile:
        lm.run, lm.rows_module = _dynamic_batch(torch.compile(gm, dynamic=True), sites), rows
    return lm


#: Sizes the probe runs the model at, at most, for a size the export excluded (``size != n``).
_PROBE_LIMIT = 4096


def compare_small_sizes(lm: CachedLM, model: nn.Module, excluded: list[tuple[int, int]]) -> None:
    """Run the cached model and the model as written on random tokens where the capture has no proof, and raise
    :class:`PositionError` where their logits differ.

    ``torch.export`` traces with sizes of at least 2 and records no condition for a branch that such sizes
    decide (``if B > 1:``, ``if T == 1:``, ``x.squeeze(0)``), so the graph may not be the model's at batch 1,
    at length 1, or at a size it excluded (``size != n``: ``passes.kv_capture.shape_guards``). Those are the
    sizes compared: a prompt of one token at batch 1 and its next two steps, a prompt of two tokens at batch
    1, one token at batch 2, a ragged batch of prompts of one and two tokens (when the model serves ragged
    batches), and each excluded size at two values of the other size (a length at batch 1 and 2; a batch with a
    prompt of 1 token, and of 2 tokens and a step). A length excluded beyond ``_PROBE_LIMIT`` positions (and within
    ``max_len``) is refused: pass a ``max_len`` below it. The caches are left empty.
    """
    param = next(iter(model.parameters()), None)
    device = param.device if param is not None else torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    cases: list[tuple[int, int, int]] = [(1, 1, 2), (1, 2, 0), (2, 1, 0)]  # (batch, prompt, steps)
    for dim, n in excluded:
        if dim == 1 and 2 < n <= lm.max_len:
            if n > _PROBE_LIMIT:
                raise PositionError(f"{type(model).__name__}.forward takes another path at a length of {n} "
                                    f"(torch.export excluded it), which attnopt does not run at capture; pass "
                                    f"max_len={n - 1} or less")
            cases += [(1, n, 0), (2, n, 0)]  # a branch may read the batch too (``T == 7 and B > 1``)
        elif dim == 0 and n > 2:
            cases += [(n, 1, 0), (n, 2, 1)]  # ... or the length (``B == 3 and T > 1``)
    with torch.no_grad(), contextlib.ExitStack() as stack, undecided():  # no kernel timing at probe sizes
        for site in lm.sites:  # the reference computation: the probe compares paths, not kernels (tunes nothing)
            stack.enter_context(site.running("math"))
        def written(x: torch.Tensor) -> torch.Tensor:
            try:
                return logits_of(model(x, **forward_kwargs(model, x)))
            except Exception as e:  # the model as written cannot run there: nothing to compare the cache with
                lm.reset()
                raise PositionError(f"{type(model).__name__} as written raises {type(e).__name__}: {e} on "
                                    f"{x.size(1)} token(s) at batch {x.size(0)}, a size cached() compares the "
                                    "cached model with it at; the cache would serve that size anyway, so it is "
                                    "not built") from e

        vocab = min(written(torch.zeros(1, 1, dtype=torch.long, device=device)).size(-1), 1000)

        def agree(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
            if got.shape != want.shape or not _close(got, want):
                lm.reset()
                gap = (got.float() - want.float()).abs().max().item() if got.shape == want.shape else "n/a"
                raise PositionError(
                    f"the cached {type(model).__name__} differs from the model as written {what} (largest logit "
                    f"difference {gap}): its forward takes another path at that size than at the sizes torch.export "
                    "traced (a branch on the batch size or length, e.g. `if B > 1:`), so it is not cached")

        try:
            for b, t, steps in cases:
                if t + steps > lm.max_len:
                    continue
                x = torch.randint(0, vocab, (b, t + steps), generator=gen).to(device)
                agree(lm.prefill(x[:, :t]), written(x[:, :t]), f"on a prompt of {t} token(s) at batch {b}")
                for i in range(t, t + steps):
                    agree(lm.step(x[:, i:i + 1]), written(x[:, :i + 1])[:, -1:],
                          f"at step {i - t + 1} after a prompt of {t} token(s) at batch {b}")
            if lm.rows_module is not None and lm.max_len >= 3:
                x = torch.randint(0, vocab, (2, 3), generator=gen).to(device)
                mask = torch.ones(2, 2, dtype=torch.long, device=device)
                mask[0, 0] = 0  # prompts of 1 and 2 tokens, left-padded
                got = lm.prefill(x[:, :2], attention_mask=mask)
                agree(got[0, 1:], written(x[:1, 1:2])[0], "on a ragged batch (a prompt of 1 token)")
                agree(got[1], written(x[1:, :2])[0], "on a ragged batch (a prompt of 2 tokens)")
                step = lm.step(x[:, 2:3])
                agree(step[0], written(x[:1, 1:3])[0, -1:], "at a step of a ragged batch")
                agree(step[1], written(x[1:, :3])[0, -1:], "at a step of a ragged batch")
        finally:
            lm.reset()


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal within a tolerance far above the kernels' rounding (fused attention, another summation order) and
    far below a different path's change."""
    low = got.dtype in (torch.float16, torch.bfloat16) or want.dtype in (torch.float16, torch.bfloat16)
    tol = 5e-2 if low else 1e-3
    scale = max(1.0, want.float().abs().max().item())
    return bool(torch.allclose(got.float(), want.float(), rtol=tol, atol=tol * scale))


def _dynamic_batch(compiled: Any, sites: list[KVCacheAttention]) -> Any:
    """``compiled(idx, offset)`` with the batch axis of the tokens and of every K/V cache marked dynamic: the
    caches are module attributes, which dynamo would otherwise take as static, fixing the batch size of the
    first graphs (the second batch size then compiles them again). Batches of 1 and one-token prompts still get
    their own graphs (dynamo specialises sizes 0 and 1)."""
    mark = torch._dynamo.maybe_mark_dynamic

    def run(idx: torch.Tensor, offset: Any) -> torch.Tensor:
        mark(idx, 0)
        for s in sites:
            for t in (s.k_cache, s.v_cache, s.b_cache):
                if t is not None:
                    mark(t, 0)
        return compiled(idx, offset)

    return run


def local_attrs(gm: fx.GraphModule) -> fx.GraphModule:
    """A GraphModule running ``gm``'s graph whose ``get_attr`` nodes read the same objects from its own instance
    ``__dict__``, and whose submodules (the KV-cache sites) are ``gm``'s own objects.

    FX code reads ``getattr(self.h, "0").attn.c_attn.weight`` through ``nn.Module.__getattr__`` at every level,
    about 350 Python lookups per decode step of a 6-layer GPT (~8% of its time on one thread). The objects are the
    same tensors, so in-place writes and ``.data =`` are seen as before; one replaced by another object is what
    :class:`~attnopt.runtime.cached_lm.Watch` refuses anyway (``ModelChangedError``) before the graph runs.
    """
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    root: dict[str, object] = {}
    local: dict[str, object] = {}
    for node in graph.nodes:
        if node.op == "get_attr":
            obj: object = gm
            for part in str(node.target).split("."):
                obj = getattr(obj, part)
            name = f"_attr{len(local)}"
            root[name] = local[name] = obj
            node.target = name
        elif node.op == "call_module":
            root[str(node.target)] = gm.get_submodule(str(node.target))
    new = fx.GraphModule(root, graph, class_name=type(gm).__name__)
    new.__dict__.update(local)  # found before nn.Module.__getattr__ is asked
    return new


def _cacheable(gm: fx.GraphModule, found: list[Match], tokens: fx.Node, declared: int | None, probe: int
               ) -> tuple[list[Match], dict[fx.Node, str], list[MaskCheck]]:
    """The sites a cache may serve, a note per node of the others (for the position analysis), mask checks."""
    chosen, notes, checks = [], {}, []
    for m in found:
        if m.spec.sink:
            # the site's spec for the rewrite passes the mask as a tensor (the sink is one more key); the cache adds
            # the sink's key itself, so it reads the mask over the real keys as proven: causal, a window
            plan = m.mask
            m.spec = replace(m.spec, causal=plan.causal, window=plan.window, conditions=len(plan.conditions),
                             mask=plan.kind)
        why, check = _why_not(gm, m, tokens, declared, probe)
        as_found = (m.mask, m.spec)
        # not causal as a whole: causal once ALiBi's terms are apart?
        if why is not None and _set_key_bias_apart(m, gm, tokens, declared):
            why_apart, check = _why_not(gm, m, tokens, declared, probe)
            if why_apart is None:
                why = None
            else:  # the reason as the attention was written
                (m.mask, m.spec), m.key_bias, m.relative_key_bias = as_found, [], False
        if check is not None:
            checks.append(check)
        if why is None:
            chosen.append(m)
        else:
            where = " ".join(x for x in (m.record.module_path, m.record.source) if x)
            for n in m.internal:
                notes[n] = f"it belongs to the attention {m.record.name} ({where}), which {why}"
    return chosen, notes, checks


def _why_not(gm: fx.GraphModule, m: Match, tokens: fx.Node, declared: int | None, probe: int
             ) -> tuple[str | None, MaskCheck | None]:
    """Why the cache cannot serve ``m`` (None: it can), and the mask check that showed its mask causal."""
    if m.mask is not None and m.mask.bound_fill is not None and m.mask.fill_with_adds:
        return (f"fills masked scores with the finite value {m.mask.bound_fill:g} and adds other mask terms, whose "
                "sum the cache's per-call bound on the fill does not cover"), None
    why = not_cacheable(m.spec)
    if why is not None and m.spec.causal is None and m.spec.mask != "none":
        check = mask_check(gm, m, tokens, min(8, declared or 8), probe)  # causal? a window?
        if isinstance(check, MaskCheck):
            why = not_cacheable(m.spec, mask_checked=True)
            return why, check if why is None else None
        why = f"{why[:-1]}: {check})"
    return why, None


def _set_key_bias_apart(m: Match, gm: fx.GraphModule, tokens: fx.Node, declared: int | None) -> bool:
    """Move the added mask terms of one value per key (``[..., 1, Tk]``: ALiBi's ``slope * j``, BLOOM's and
    Falcon's) from ``m.mask`` to ``m.key_bias`` (True when there were any), for a mask not causal as a whole.

    ``scores + bias + causal`` with such a ``bias`` is causal attention whose every key carries its own term: the
    KV cache keeps the term with the key (written once at its position, like the key) and adds it to the scores
    over the cached keys. The other terms must still be causal on their own, which the mask check decides; the
    position proof then reads the bias as it reads k (one value per position, from that position alone), and
    refuses it otherwise. A term read from a constant table's end (MPT's ALiBi, relative to the last key, so it
    changes with the length) is the term per key ``slope * j`` up to a constant per row, which softmax ignores
    (:func:`~attnopt.passes.kv_capture.relative_key_term`)."""
    plan = m.mask
    if plan.kind != "additive" or plan.causal is not None or m.spec.sink or m.score_mod is not None \
            or plan.bound_fill is not None:  # (the fill's bound counts no key term)
        return False
    per_key, rest = [], []
    for t in plan.terms:
        hidden = _hidden_key_bias(t)
        relative = None if not isinstance(t, Add) or t.relayout else _relative_term(gm, t.mask, tokens, declared)
        if relative is not None:  # the same term up to a constant per row (MPT's): the keys' own part
            per_key.append(Add(relative, t.factor, t.dtype))
            m.relative_key_bias = True
        elif isinstance(t, Add) and _one_per_key(t.mask):
            per_key.append(t)
        elif hidden is not None:  # the term per key with the mask filled into it: both, apart
            per_key.append(hidden[0])
            rest.append(hidden[1])
        else:
            rest.append(t)
    if not per_key:
        return False
    m.key_bias = per_key
    m.mask = replace(plan, terms=rest, kind="additive" if rest else "none")
    m.spec = replace(m.spec, mask=m.mask.kind)
    return True


def _relative_term(gm: fx.GraphModule, mask: fx.Node, tokens: fx.Node, declared: int | None) -> fx.Node | None:
    """:func:`~attnopt.passes.kv_capture.relative_key_term` of ``mask``, or of what ``mask`` negates (a table's end
    subtracted from the scores, ``s - table[..., S - T:]``, which the matcher reads as ``s + neg(...)``): then
    the negated term, ``-slope * j``, again the written term up to a constant per row."""
    negated = mask.op == "call_function" and mask.target is aten.neg.default and isinstance(mask.args[0], fx.Node)
    term = relative_key_term(gm, mask.args[0] if negated else mask, tokens, declared)
    if term is None or not negated:
        return term
    with gm.graph.inserting_after(term):
        neg = gm.graph.call_function(aten.neg.default, (term,))
    val = term.meta["val"]
    with getattr(val, "fake_mode", None) or contextlib.nullcontext():
        neg.meta["val"] = torch.neg(val)
    neg.meta.update({k: term.meta[k] for k in ("stack_trace", "nn_module_stack") if k in term.meta})
    return neg


def _hidden_key_bias(t: Any) -> tuple[Add, Fill] | None:
    """``t`` adds ``masked_fill(b, hide, -inf)`` (or the dtype's minimum) with ``b`` one value per key (Falcon's
    ALiBi folded into its causal mask): as the term ``b`` and the fill ``hide``. Both hide the same keys
    (``s + min`` and ``min`` weigh nothing next to a kept key) and add ``b`` to the others, while ``b`` is far
    from the dtype's range, which the cache checks at every call (``runtime.kv_cache._bounded_bias``)."""
    if not isinstance(t, Add) or t.relayout or t.mask.op != "call_function" \
            or t.mask.target is not aten.masked_fill.Scalar:
        return None
    bias, hide, value = t.mask.args[:3]
    if not isinstance(bias, fx.Node) or not _one_per_key(bias) or not isinstance(value, float) \
            or not (value == float("-inf") or value <= torch.finfo(meta_value(bias).dtype).min):
        return None
    return Add(bias, t.factor, t.dtype), Fill(hide, value, dtype=t.dtype)


def _one_per_key(node: fx.Node) -> bool:
    """``node`` is shaped ``[..., 1, Tk]`` with ``Tk`` the sequence length (not a number), a value per key."""
    val = meta_value(node)
    if not isinstance(val, torch.Tensor) or val.dim() < 2 or not val.is_floating_point():
        return False
    return statically_known_true(val.shape[-2] == 1) and isinstance(val.shape[-1], torch.SymInt)


def _with_left_alone(e: PositionError, found: list[Any]) -> PositionError:
    """``e`` with the reason attnopt left an attention alone, when the op it names mixes positions in that
    attention's module (its scores ``q @ k^T``: an attention the site finder did not read)."""
    msg = str(e)
    if "belongs to the attention" in msg or not ("sequence axes" in msg or "contracts over the sequence" in msg):
        return e
    at = re.match(r"\S+ at \S+:\d+(?: \(([^)]*)\))?", msg)  # ``aten.matmul at model.py:12 (h.0.attn)``
    if at is None:
        return e
    for f in found:
        record = f.record if isinstance(f, Match) else f
        if record.decision == LEFT_ALONE and record.module_path == (at.group(1) or ""):
            where = " ".join(x for x in (record.module_path, record.source) if x)
            return PositionError(f"{msg}; it is part of the attention {record.name} ({where}), which attnopt left "
                                 f"alone: {record.reason}")
    return e


def _probe(model: nn.Module, declared: int | None) -> int:
    """The length at which a mask checked at run time is read for a sliding window: past the window the config
    names (``sliding_window``, up to 4096: a hint only, the mask decides), else 256 positions (within the
    model's limit)."""
    config = getattr(model, "config", getattr(model, "cfg", None))
    hint = getattr(config, "sliding_window", None)
    probe = hint + 1 if isinstance(hint, int) and not isinstance(hint, bool) and 0 < hint <= 4096 else 256
    return min(probe, declared) if declared else probe


#: The method calls ``rewrite_sites`` adds to bring a site's q, k, v to (B, H, T, D) and its output back
#: (``find_sites.relayout``), as the ATen ops the position analysis reads.
_RELAYOUT_OPS = {"unflatten": torch.ops.aten.unflatten.int, "flatten": torch.ops.aten.flatten.using_ints,
                 "size": torch.ops.aten.sym_size.int, "unsqueeze": torch.ops.aten.unsqueeze.default,
                 "expand": torch.ops.aten.expand.default, "transpose": torch.ops.aten.transpose.int,
                 "to": torch.ops.aten._to_copy.default, "mul": torch.ops.aten.mul.Tensor,
                 "add": torch.ops.aten.add.Tensor}


def relaid_as_aten(gm: fx.GraphModule, site_nodes: list[fx.Node]) -> None:
    """Replace the layout method calls the rewrite added (XGLM's heads folded into the batch, ``(B*H, T, D)``,
    unflattened to ``(B, H, T, D)`` for the site) by ATen ops with symbolic shapes in ``node.meta``, and give each
    site node the shape of its output ``(B, H, T, Dv)``, so the position analysis reads them as it reads the
    captured graph. Calls of other methods are left, and the analysis refuses them."""
    graph = gm.graph
    vals = [n.meta["val"] for n in graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    fake_mode = torch._guards.detect_fake_mode(vals)
    if fake_mode is None:
        return

    def val(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return a.meta.get("val")
        return type(a)(val(x) for x in a) if isinstance(a, (tuple, list)) else a

    sites = set(site_nodes)
    with fake_mode:
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target in (operator.mul, operator.truediv):
                _tensor_arithmetic(graph, node, val)  # scale factors the rewrite folded into q
            elif node.op == "call_method" and node.target in _RELAYOUT_OPS:
                args = val(node.args)
                if any(a is None for a in _flat_args(args)):
                    continue
                if node.target == "to" and not (len(args) == 2 and isinstance(args[1], torch.dtype)
                                                and not node.kwargs):
                    continue  # only ``x.to(dtype)``, which the rewrite adds
                node.meta["val"] = getattr(args[0], str(node.target))(*args[1:])
                if node.target == "to":
                    node.args, node.kwargs = (node.args[0],), {"dtype": node.args[1]}
                node.target, node.op = _RELAYOUT_OPS[str(node.target)], "call_function"
            elif node in sites and not isinstance(node.meta.get("val"), torch.Tensor):
                q, v = val(node.args[0]), val(node.args[2])
                if isinstance(q, torch.Tensor) and isinstance(v, torch.Tensor) and q.dim() == 4:
                    node.meta["val"] = q.new_empty([*q.shape[:-1], v.shape[-1]])
    graph.lint()
    gm.recompile()


def _tensor_arithmetic(graph: fx.Graph, node: fx.Node, val: Any) -> None:
    """``operator.mul``/``truediv`` on a tensor (a per-head factor or ``1 / temperature`` the rewrite folds into q)
    as ``aten.mul``/``aten.div`` (``number / t`` as ``reciprocal(t) * number``), with fake-tensor meta."""
    a, b = node.args
    va, vb = val(a), val(b)
    aten = torch.ops.aten
    if isinstance(va, torch.Tensor):
        node.target = aten.mul.Tensor if node.target is operator.mul else aten.div.Tensor
    elif isinstance(vb, torch.Tensor) and node.target is operator.mul:
        node.target, node.args = aten.mul.Tensor, (b, a)
    elif isinstance(vb, torch.Tensor) and isinstance(a, (int, float)):
        with graph.inserting_before(node):
            inv = graph.call_function(aten.reciprocal.default, (b,))
        inv.meta["val"] = torch.reciprocal(vb)
        node.target, node.args = aten.mul.Tensor, (inv, a)
    else:
        return  # sizes and numbers: the position analysis reads them as such
    node.meta["val"] = node.target(*val(node.args))


def _flat_args(a: Any) -> list[Any]:
    return [y for x in a for y in _flat_args(x)] if isinstance(a, (tuple, list)) else [a]


def _kv_sites(gm: fx.GraphModule, tokens: fx.Node, variant: str, selector: Selector | None, checks: list[MaskCheck],
              relative: set[str] = frozenset()) -> tuple[fx.Node, list[KVCacheAttention], list[fx.Node]]:
    """Add the ``offset`` input and replace every site module by a KV-cache site called ``(q, k, v, scale, offset)``;
    a site whose mask check found a sliding window keeps that window. A 0-d scale tensor (a learnt temperature)
    is folded into q; an attention sink's logits are passed as ``sink=``, the cache adds its key."""
    windows = {c.site_name: c.window for c in checks}
    graph = gm.graph
    with graph.inserting_after(tokens):
        offset = graph.placeholder("offset")
    sites, site_nodes = [], []
    for node in list(graph.nodes):
        if node.op != "call_module" or not isinstance(gm.get_submodule(str(node.target)), AttentionSite):
            continue
        old: AttentionSite = gm.get_submodule(str(node.target))  # type: ignore[assignment]
        q, k, v, _mask, scale = node.args[:5]
        scale_tensor, sink = node.kwargs.get("scale_tensor"), node.kwargs.get("sink")
        key_bias = node.kwargs.get("key_bias")
        if scale_tensor is not None:  # multiplies the scores: folded into q (``mul``, made ATen by relaid_as_aten)
            with graph.inserting_before(node):
                q = graph.call_method("mul", (q, scale_tensor))
        # an elementwise score modifier (Gemma 2's soft-cap ``50*tanh(s/50)``) reads no position: the cache applies it
        # to the cached scores as written; a fixed candidate that cannot apply it (SDPA) gives way to ``math``
        fixed = variant if old.score_mod is None or variant == AUTO or get_candidate(variant).supports(old.spec) \
            is None else "math"
        site = KVCacheAttention(old.site_name, old.spec, 1, old.where, candidate=fixed, selector=selector)
        site.score_mod = old.score_mod
        site.window = windows.get(old.site_name, site.window)
        site.sink_lse = bool(node.kwargs.get("sink_lse", False))
        site.keeps_key_bias = key_bias is not None
        site.relative_key_bias = old.site_name in relative
        name = f"attnopt_kv_{old.site_name}"
        gm.add_submodule(name, site)
        with graph.inserting_before(node):
            extra = {} if sink is None else {"sink": sink}
            if key_bias is not None:
                extra["key_bias"] = key_bias
            new = graph.call_module(name, (q, k, v, scale, offset), extra)
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        if old.spec.causal is not None:
            # the probabilities zeroed where the scores were hidden (``masked_fill(m, 0)`` after the softmax): only
            # rows with every key hidden, and a causal mask keeps each query's own key, so there are none
            for user in list(new.users):
                if user.op == "call_function" and user.target is zero_hidden_rows and user.args[0] is new:
                    user.replace_all_uses_with(new)
                    graph.erase_node(user)
        sites.append(site)
        site_nodes.append(new)
    graph.eliminate_dead_code()
    gm.delete_all_unused_submodules()
    return offset, sites, site_nodes
