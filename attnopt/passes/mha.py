"""``nn.MultiheadAttention`` whose weights nobody reads: the same call with ``need_weights=False``.

Matches ``F.multi_head_attention_forward(..., need_weights=True)`` call nodes (dynamo keeps
``nn.MultiheadAttention`` as one such call, sequence-first: ``[L, B, E]``, or ``[L, E]``
unbatched) whose every user reads only ``[0]``. Emits the same call with ``need_weights=False``
(PyTorch then computes the output with SDPA instead of materialising the probabilities) and,
when the call has a mask, one :func:`restore_nan_rows` node after it: as written, a query row
whose keys are all masked (``-inf``) in some head is a softmax of all ``-inf``, NaN, and the
output projection spreads that NaN over the whole output row; SDPA returns a number there.

Example (``key_padding_mask`` given, weights discarded)::

    out = F.multi_head_attention_forward(q, q, q, 8, 2, ..., key_padding_mask=mask, need_weights=True)
    y = out[0]
    # becomes
    out = F.multi_head_attention_forward(q, q, q, 8, 2, ..., key_padding_mask=mask, need_weights=False)
    y = restore_nan_rows(out[0], mask, None, 2, 0)

Calls stay as written (with a reason in ``explain()``) when the rewrite would not be exact:

* dropout is active (training mode, ``p > 0``): SDPA draws it from another random stream;
* gradients are needed and a float mask may fill every key of a row with a large finite
  negative (``finfo.min`` padding, ``-1e4``): as written that row is uniform attention, and
  SDPA's fused backward, which rescales by a log-sum-exp that the fill swamps, returns other
  gradients there. Masks whose values are read from the graph (bool masks, ``-inf`` fills,
  ``triu(full(-inf))``) are proven free of such rows.

An ``is_causal=True`` hint is dropped: with the weights computed the call applies
``attn_mask`` as given, and so does the rewritten call.
"""

from __future__ import annotations

import inspect
import itertools
import math
import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..spec import LEFT_ALONE, REWRITTEN, SiteRecord
from .canon import dtype_of, meta_value, mutated, read
from .find_sites import place_of

_SIGNATURE = inspect.signature(F.multi_head_attention_forward)

#: A query row whose keys all carry a finite mask value at most this low is "swamped": its
#: log-sum-exp loses the row's scores (``ulp(64)`` is 7.6e-6 in fp32), so SDPA's backward
#: differs from the call as written. Masks that may hold such values need ``torch.no_grad()``.
SWAMPING_FILL = -64.0


def mha_arguments(node: fx.Node) -> dict[str, Any]:
    """Every argument of an ``F.multi_head_attention_forward`` call node by name, defaults filled in."""
    bound = _SIGNATURE.bind(*node.args, **node.kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def unused_mha_weights(gm: fx.GraphModule) -> list[fx.Node]:
    """``F.multi_head_attention_forward(..., need_weights=True)`` calls whose weights nobody reads.

    Dynamo does not trace into ``nn.MultiheadAttention``: its graph holds one call whose
    output is ``(attn_output, attn_weights)``. With ``need_weights=True`` that call computes
    the probabilities explicitly (``baddbmm``, softmax, ``bmm``); when every user reads only
    ``[0]``, ``need_weights=False`` computes the output through SDPA.
    """
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not F.multi_head_attention_forward:
            continue
        try:
            need_weights = mha_arguments(node)["need_weights"]
        except TypeError:  # not a call PyTorch would accept: leave it to raise as written
            continue
        if need_weights is not True:
            continue
        if node.users and all(u.op == "call_function" and u.target is operator.getitem and u.args[1] == 0
                              for u in node.users):
            found.append(node)
    return found


def drop_unused_mha_weights(gm: fx.GraphModule, enabled: bool = True, start: int = 0) -> list[SiteRecord]:
    """Rewrite every call :func:`unused_mha_weights` finds that can be made exact; one record per call.

    ``enabled=False`` (``variant="eager"``) only reports the calls.
    """
    records = []
    changed = False
    for i, node in enumerate(unused_mha_weights(gm)):
        args = mha_arguments(node)
        path, source = place_of(node)
        rec = SiteRecord(name=f"site{start + i}", module_path=path, source=source, spelling=_spelling(args))
        why = "variant='eager': left as written" if not enabled else why_left_alone(gm, node, args)
        if why is not None:
            rec.decision, rec.reason = LEFT_ALONE, why
        else:
            rec.decision, rec.rewrite, rec.reason = REWRITTEN, *_rewrite(gm, node, args)
            changed = True
        records.append(rec)
    if changed:
        gm.graph.lint()
        gm.recompile()
    return records


def why_left_alone(gm: fx.GraphModule, node: fx.Node, args: dict[str, Any]) -> str | None:
    """Why ``need_weights=False`` would not compute exactly what ``node`` computes, or None."""
    p, training = args["dropout_p"], args["training"]
    if training is not False and not (isinstance(p, (int, float)) and p == 0):
        shown = f"{p:g}" if isinstance(p, (int, float)) else "a run-time value"
        return (f"nn.MultiheadAttention with dropout p={shown} in training mode: need_weights=False would "
                "draw the dropout inside SDPA from another random stream, so outputs would differ from the "
                "call as written; it is rewritten in eval mode (model.eval()) or with dropout=0")
    if not isinstance(args["add_zero_attn"], bool) or not isinstance(args["num_heads"], int):
        return "nn.MultiheadAttention with add_zero_attn or num_heads known only at run time"
    masks = [(name, args[name]) for name in ("key_padding_mask", "attn_mask") if args[name] is not None]
    if not masks or not _needs_grad(node):
        return None
    values = [mask_values(m, gm) for _, m in masks]
    if any(v is None for v in values):
        unread = " and ".join(name for (name, _), v in zip(masks, values) if v is None)
        return (f"nn.MultiheadAttention with a float {unread} whose values attnopt cannot read, and gradients "
                "are needed: if every key of a row carries a large finite negative (finfo.min or -1e4 padding), "
                "SDPA's backward differs from the call as written there; pass a bool mask or fill with -inf, "
                "or run without gradients (torch.no_grad())")
    merged = {sum(c) for c in itertools.product(*values)}  # type: ignore[arg-type]
    swamped = sorted(v for v in merged if math.isfinite(v) and v <= SWAMPING_FILL)
    if swamped:
        return (f"nn.MultiheadAttention with a mask filled with {swamped[0]:g} and gradients needed: a row whose "
                "keys all carry it is uniform attention as written, where SDPA's backward gives other gradients; "
                "fill with -inf (or pass a bool mask), or run without gradients (torch.no_grad())")
    return None


def _rewrite(gm: fx.GraphModule, node: fx.Node, args: dict[str, Any]) -> tuple[str, str]:
    """Switch ``node`` to ``need_weights=False`` (hint dropped, NaN rows restored); (rewrite, reason)."""
    _set_argument(node, "need_weights", False)
    rewrite = ["need_weights=False"]
    reason = "the attention weights are discarded by the caller; PyTorch computes the output with SDPA"
    if args["is_causal"] is True:
        _set_argument(node, "is_causal", False)
        rewrite.append("is_causal hint dropped")
        reason += "; attn_mask applied as given (the call as written ignores the is_causal hint)"
    kpm, attn_mask = args["key_padding_mask"], args["attn_mask"]
    if kpm is None and attn_mask is None:
        return ", ".join(rewrite), reason
    extra_keys = int(args["bias_k"] is not None) + int(args["add_zero_attn"])
    graph = gm.graph
    first, *others = list(node.users)
    for other in others:  # one [0] read
        other.replace_all_uses_with(first)
        graph.erase_node(other)
    with graph.inserting_after(first):
        fixed = graph.call_function(restore_nan_rows, (first, kpm, attn_mask, args["num_heads"], extra_keys))
    fixed.meta = dict(first.meta)
    first.replace_all_uses_with(fixed, delete_user_cb=lambda user: user is not fixed)
    rewrite.append("NaN rows restored")
    reason += "; query rows whose keys are all masked are set to NaN, as the call computes them"
    return ", ".join(rewrite), reason


def restore_nan_rows(out: torch.Tensor, key_padding_mask: torch.Tensor | None, attn_mask: torch.Tensor | None,
                     num_heads: int, extra_keys: int = 0) -> torch.Tensor:
    """``out`` with NaN in every row ``F.multi_head_attention_forward(need_weights=True)`` returns as NaN.

    ``out`` is the call's output, ``(L, B, E)`` or ``(L, E)`` unbatched; the masks are the call's
    arguments; ``extra_keys`` counts the always-visible key columns that ``bias_k`` and
    ``add_zero_attn`` append.

    >>> out = torch.zeros(3, 2, 4)                              # (L, B, E)
    >>> pad = torch.tensor([[False, False, True], [True, True, True]])
    >>> restore_nan_rows(out, pad, None, num_heads=2).isnan().all(-1)
    tensor([[False,  True],
            [False,  True],
            [False,  True]])
    """
    dead = dead_rows(key_padding_mask, attn_mask, num_heads, out.dtype, extra_keys)  # (B or 1, L or 1)
    dead = dead.transpose(0, 1)  # (L or 1, B or 1): the call's sequence-first layout
    if out.dim() == 3:
        dead = dead.unsqueeze(-1)  # against (L, B, E); unbatched (L, 1) against (L, E) as it is
    return out.masked_fill(dead, float("nan"))


def dead_rows(key_padding_mask: torch.Tensor | None, attn_mask: torch.Tensor | None, num_heads: int,
              dtype: torch.dtype, extra_keys: int = 0) -> torch.Tensor:
    """``(B or 1, L or 1)`` bool: query rows whose softmax is NaN in some head as the call computes it.

    Merges the masks as ``F.multi_head_attention_forward`` does (bool masks become ``-inf``
    fills in ``dtype``, the query's; float masks are added as they are, so two finite fills can
    overflow to ``-inf``) and marks a row dead when no key is above ``-inf``, or when a key
    holds ``+inf`` or NaN (``inf - inf`` in the softmax).
    """
    merged = None
    if attn_mask is not None:
        m = _canonical(attn_mask, dtype)
        m = m[None, None] if m.dim() == 2 else m.view(-1, num_heads, *m.shape[-2:])  # (1 or B, 1 or H, L, S)
        merged = F.pad(m, (0, extra_keys)) if extra_keys else m
    if key_padding_mask is not None:
        kpm = _canonical(key_padding_mask, dtype)
        kpm = kpm.view(-1, 1, 1, kpm.shape[-1])  # (B, 1, 1, S); unbatched (1, 1, 1, S)
        kpm = F.pad(kpm, (0, extra_keys)) if extra_keys else kpm
        merged = kpm if merged is None else merged + kpm
    if merged is None:
        raise ValueError("restore_nan_rows needs a key_padding_mask or an attn_mask")
    no_key = ~(merged > float("-inf")).any(-1)
    poisoned = ~(merged < float("inf")).all(-1)
    return (no_key | poisoned).any(1)  # any head: the output projection mixes the heads


def _canonical(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``F._canonical_mask``: a bool mask (True = masked) as a ``-inf`` fill in ``dtype``."""
    if mask.is_floating_point():
        return mask
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))


# ----------------------------------------------------------------------------- mask values


def mask_values(mask: Any, root: torch.nn.Module | None = None) -> frozenset[float] | None:
    """The values a mask argument can hold once PyTorch canonicalises it, or None when unknown.

    A bool mask holds ``{0, -inf}``; a float mask what the graph that builds it can produce
    (``zeros_like(m).masked_fill_(b, -inf)``, ``triu(full(-inf), 1)``, ``where``, sums, casts,
    views). Inputs, parameters and buffers are unknown: their values change between calls.

    >>> mask_values(None)
    frozenset({0.0})
    """
    if mask is None:
        return frozenset((0.0,))
    if isinstance(mask, fx.Node) and dtype_of(mask) is torch.bool:
        return frozenset((0.0, float("-inf")))
    return _values(mask, root, 16)


_LIKE = {torch.zeros_like: 0.0, torch.ones_like: 1.0}


def _values(x: Any, root: torch.nn.Module | None, depth: int,
            written_by: fx.Node | None = None) -> frozenset[float] | None:
    if isinstance(x, (int, float)):
        return frozenset((float(x),))
    if not isinstance(x, fx.Node) or depth < 0:
        return None
    if written_by is not None:
        if set(x.users) != {written_by}:  # read elsewhere too, before or after the write
            return None
    elif mutated(x):
        return None
    if dtype_of(x) is torch.bool:
        return frozenset((0.0, 1.0))
    if x.op == "call_function" and x.target in _LIKE:
        return frozenset((_LIKE[x.target],))
    if x.op == "call_function" and x.target is torch.full_like:
        fill = x.args[1] if len(x.args) > 1 else x.kwargs.get("fill_value")
        return _values(fill, root, depth - 1) if isinstance(fill, (int, float)) else None
    op = read(x, root)
    if op is None:
        return None
    inplace = x if x.op == "call_method" and str(x.target).endswith("_") else None
    if op.kind == "masked_fill":
        return _union(_values(op.args[0], root, depth - 1, inplace), _values(op.args[2], root, depth - 1))
    if op.kind == "where":
        return _union(_values(op.args[1], root, depth - 1), _values(op.args[2], root, depth - 1))
    if op.kind == "factory":
        return None if op.args[0] is None else _values(op.args[0], root, depth - 1)
    if op.kind == "add" and inplace is None:
        a, b = _values(op.args[0], root, depth - 1), _values(op.args[1], root, depth - 1)
        return None if a is None or b is None else frozenset(u + v for u in a for v in b)
    if op.kind in ("tril", "triu") and inplace is None:
        return _union(_values(op.args[0], root, depth - 1), frozenset((0.0,)))
    if op.kind in ("cast", "identity", "view", "getitem", "transpose", "permute"):
        return _values(op.args[0], root, depth - 1)
    return None


def _union(a: frozenset[float] | None, b: frozenset[float] | None) -> frozenset[float] | None:
    return None if a is None or b is None else a | b


# ----------------------------------------------------------------------------- small helpers


def _needs_grad(node: fx.Node) -> bool:
    """The call's output may need gradients (True when the graph does not say)."""
    value = meta_value(node)
    out = value[0] if isinstance(value, (tuple, list)) and value else value
    return bool(getattr(out, "requires_grad", True))


def _set_argument(node: fx.Node, name: str, value: Any) -> None:
    index = list(_SIGNATURE.parameters).index(name)
    if index < len(node.args):
        node.update_arg(index, value)
    else:
        node.update_kwarg(name, value)


def _spelling(args: dict[str, Any]) -> list[str]:
    spelling = ["nn.MultiheadAttention(need_weights=True)", "[0]"]
    spelling += [name for name in ("key_padding_mask", "attn_mask") if args[name] is not None]
    if args["is_causal"] is True:
        spelling.append("is_causal=True")
    return spelling


__all__ = ["SWAMPING_FILL", "dead_rows", "drop_unused_mha_weights", "mask_values", "mha_arguments",
           "restore_nan_rows", "unused_mha_weights", "why_left_alone"]
