"""The KV-cache site: causal self-attention over a preallocated cache, and the run-time mask check.

:class:`KVCacheAttention` writes the new keys and values at ``offset`` and attends over the cache
through the per-call dispatch every site kind shares (:class:`~attnopt.runtime.dispatch.DispatchingSite`):
the candidate chosen (and for ``"auto"`` tuned) per shape key, checked against the reference, with fallbacks.
:class:`MaskCheck` evaluates a mask built from sizes alone at each new ``(batch, length)``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from ..spec import AttentionSpec
from .dispatch import DispatchingSite, candidate_layout

aten = torch.ops.aten


class KVCacheAttention(DispatchingSite):
    """One causal self-attention site with its K/V cache: ``(q, k, v, scale, offset) -> out``.

    q: ``(..., t, D)`` for the ``t`` new positions ``offset .. offset + t - 1``; k, v: their keys and
    values (``(..., Hkv, t, D)``, unrepeated for GQA). The cache is allocated on the first call at
    offset 0 with ``max_len`` positions. ``candidate`` and ``selector`` are the dispatch's
    (:class:`~attnopt.runtime.dispatch.DispatchingSite`): a candidate's name, or ``"auto"`` with a selector.
    """

    def __init__(self, name: str, spec: AttentionSpec, max_len: int, where: str = "", candidate: str = "sdpa",
                 selector: Any = None):
        super().__init__(name, spec, candidate, where=where, selector=selector)
        self.max_len = max_len
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def extra_repr(self) -> str:
        return f"{self.site_name}: max_len={self.max_len}, {self.candidate}, {self.spec.describe()}"

    def reset(self) -> None:
        self.k_cache = self.v_cache = None

    @property
    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k_cache, self.v_cache) if t is not None)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None,
                offset: int) -> torch.Tensor:
        t = q.size(-2)
        end = offset + t
        if self.k_cache is None or offset == 0:
            self.k_cache = k.new_empty((*k.shape[:-2], self.max_len, k.size(-1)))
            self.v_cache = v.new_empty((*v.shape[:-2], self.max_len, v.size(-1)))
        assert self.v_cache is not None
        self.k_cache[..., offset:end, :] = k
        self.v_cache[..., offset:end, :] = v
        keys, values = self.k_cache[..., :end, :], self.v_cache[..., :end, :]
        q, keys, values, lead = candidate_layout(q, keys, values)
        mask = None
        if 1 < t < end:  # several new tokens after a prefix: query i sees keys <= offset + i
            mask = torch.ones(t, end, dtype=torch.bool, device=q.device).tril(diagonal=offset)
        kwargs = dict(attn_mask=mask, dropout_p=0.0, is_causal=t > 1 and t == end,
                      scale=self.spec.scale if scale is None else float(scale), enable_gqa=self.spec.gqa)
        with torch.autograd.profiler.record_function(f"attnopt::{self.site_name}"):
            out = self.run_candidate(q, keys, values, kwargs)  # chosen, checked per shape key, with fallbacks
        if lead:
            out = out.reshape(out.shape[lead:])
        if self.spec.out_dtype is not None and out.dtype != self.spec.out_dtype:
            out = out.to(self.spec.out_dtype)
        return out


class MaskCheck:
    """A site mask computed from sizes alone that the symbolic proof could not read (e.g. Hugging Face's
    masks, built from position ids with comparisons and a packed-sequence ``cumsum``).

    The mask's subgraph (token ids enter only through their sizes) is a function of the batch size
    and length alone. The cached model drops it and attends causally, which is exact exactly when
    that function gives the causal pattern (keep ``j <= i``; masked entries ``-inf`` or the dtype's
    minimum) at every length the cache serves: the cached model evaluates it for each new
    ``(batch, length)`` before running (one mask computation, as the model itself does per call).
    """

    def __init__(self, module: fx.GraphModule, additive: bool, keep_when_true: bool, site_name: str, where: str):
        self.module = module
        self.additive = additive  # an added mask (0 / -inf or the dtype's minimum), else a boolean one
        self.keep_when_true = keep_when_true
        self.site_name = site_name
        self.where = where
        self.checked: set[tuple[int, int]] = set()
        self.changed: str | None = None  # a model tensor it reads changed after cached() (see cached_lm.Watch)

    def holds(self, batch: int, length: int, device: torch.device) -> bool:
        """The mask for ``batch`` sequences of ``length`` tokens is exactly the causal pattern."""
        if (batch, length) in self.checked:
            return True
        with torch.no_grad():
            mask = self.module(torch.zeros(batch, length, dtype=torch.long, device=device))
        if mask.dim() < 2 or tuple(mask.shape[-2:]) != (length, length):
            return False
        lower = torch.ones(length, length, dtype=torch.bool, device=mask.device).tril().expand(mask.shape)
        if self.additive:
            masked = torch.isneginf(mask) | (mask <= torch.finfo(mask.dtype).min)
            ok = torch.equal(mask == 0, lower) and bool((masked | lower).all())
        else:
            keep = mask if self.keep_when_true else ~mask
            ok = torch.equal(keep, lower)
        if ok:
            self.checked.add((batch, length))
        return ok
