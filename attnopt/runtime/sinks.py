"""An attention sink as one more key: what the rewritten graph and the KV cache run for a sink site.

A sink (gpt-oss's learned per-head logits, ``softmax(cat([s, sink], -1))[..., :-1] @ v``) adds one column to
every row's softmax and drops it after: the same as one more key whose score is the sink's logit and whose
value is zero. :func:`sink_operands` builds that key on q, k, v and the mask, so any candidate runs it as
plain attention over ``Tk + 1`` keys: the rewrite calls it in the graph (``passes/rewrite_sdpa``), the KV
cache on its cached keys at every call (``runtime/kv_cache``).
"""

from __future__ import annotations

import torch


def sink_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: torch.Tensor, scale: float,
                  mask: torch.Tensor | None = None, causal: bool = False, posinf_as_max: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """q, k, v and the mask with one more key whose score is the sink's logit in every row and whose value is zero,
    for a site that runs with ``scale=1`` (q comes back scaled).

    ``softmax([s, sink]) @ [v; 0]`` is the sink attention as written (the sink's probability multiplies
    the zero value: dropping its column after the softmax). q is multiplied by the scale here (exact in half
    types, where the scale is a power of two; one rounding in float32), and the head dim of q and k is
    widened to the next multiple of 8 (fused kernels want one), by zeros except one column: q's holds its
    row's sink, k's is 1 at the new key and 0 at the others. So every real score is unchanged, the new
    key's is the sink itself (never divided, so never overflowing), and gradients reach q, k, v and the sink
    through autograd. A row whose sink is ``-inf`` would turn its real scores into ``-inf * 0 = NaN``: there
    the column holds 0 and the mask hides the new key instead (its weight is 0 either way). The mask keeps
    the new key in every other row (``causal``: the top-left causal mask, built here, since ``is_causal``
    would hide the new last key from all rows but the last).

    >>> q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    >>> sink = torch.randn(1, 2, 3, 1)
    >>> qa, ka, va, mask = sink_operands(q, k, v, sink, 0.5)
    >>> s = torch.cat([q @ k.transpose(-2, -1) * 0.5, sink], -1)
    >>> torch.allclose(torch.softmax(s, -1)[..., :-1] @ v, torch.softmax(qa @ ka.transpose(-2, -1), -1) @ va)
    True
    """
    d = q.size(-1)
    pad = 8 - d % 8  # at least one column, for the sink
    column = sink.expand(*q.shape[:-1], 1)
    if posinf_as_max:
        # a sink read as ``sigmoid(logsumexp(s) - sink)``: ``+inf`` gives the row 0 as written (and no gradient),
        # which the largest finite logit gives too; ``+inf`` itself would make the real scores ``inf * 0 = NaN``
        column = torch.where(torch.isposinf(column), torch.finfo(column.dtype).max, column)
    hide = torch.isneginf(column)
    hiding = torch.compiler.is_compiling() or bool(hide.any())  # (a compiled graph cannot branch on values)
    if hiding:
        column = column.masked_fill(hide, 0.0)
    qa = torch.cat([q * scale, column, q.new_zeros(*q.shape[:-1], pad - 1)], -1)
    ka = torch.cat([k, k.new_zeros(*k.shape[:-1], pad)], -1)
    key = k.new_zeros(*k.shape[:-2], 1, d + pad)
    key[..., d] = 1.0
    ka = torch.cat([ka, key], -2)
    va = torch.cat([v, v.new_zeros(*v.shape[:-2], 1, v.size(-1))], -2)
    return qa, ka, va, _sink_mask(mask, q, k, causal, hide if hiding else None)


def _sink_mask(mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, causal: bool,
               hide: torch.Tensor | None) -> torch.Tensor | None:
    """The mask over the real keys and the sink's: kept in every row, or hidden where ``hide`` (``[..., Tq, 1]``)."""
    if mask is None:
        if not causal and hide is None:
            return None
        mask = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device)
        if causal:
            mask = mask.tril()
    lead = mask.shape[:-1] if hide is None else torch.broadcast_shapes(mask.shape[:-1], hide.shape[:-1])
    mask = mask.expand(*lead, k.size(-2))
    if mask.dtype == torch.bool:
        extra = torch.ones(lead + (1,), dtype=torch.bool, device=mask.device) if hide is None else \
            (~hide).expand(*lead, 1)
    else:
        extra = torch.zeros(lead + (1,), dtype=mask.dtype, device=mask.device) if hide is None else \
            torch.zeros((), dtype=mask.dtype, device=mask.device).masked_fill(hide, float("-inf")).expand(*lead, 1)
    return torch.cat([mask, extra], -1)


