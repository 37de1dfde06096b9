"""The KV-cache site: causal self-attention over a preallocated cache, and the run-time mask check.

:class:`KVCacheAttention` writes the new keys and values into its cache and attends over it through the
per-call dispatch every site kind shares (:class:`~attnopt.runtime.dispatch.DispatchingSite`): the
candidate chosen (and for ``"auto"`` tuned) per shape key, checked against the reference, with fallbacks.
A site whose attention is a proven causal sliding window of ``w`` keys keeps only the last ``w`` positions
(a ring buffer: position ``j`` lives in slot ``j % w``). :class:`Rows` describes a ragged batch, whose
sequences sit at different positions, folded into one time axis. :class:`MaskCheck` evaluates a mask built
from sizes alone at each new ``(batch, length)``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx as fx

from ..kernels.bands import band_pattern, window_keep
from ..spec import AttentionSpec, PositionError
from .dispatch import DispatchingSite, candidate_layout
from .guards import is_fake, profiler_records
from .sinks import sink_operands

aten = torch.ops.aten


class Rows:
    """A ragged batch's call: ``rows`` sequences of ``t`` slots each, folded into one time axis of ``rows * t``.

    Row ``b`` has ``start[b]`` positions cached before this call; its first ``pad[b]`` slots are padding
    (left padding of a prompt: never written to the cache, never attended), the others hold positions
    ``start[b] .. start[b] + t - pad[b] - 1``. A padding slot is given the row's first position (its result
    is not used; it attends to that key only, so it stays finite). The cached graph reads ``positions``
    (``(rows * t,)``, row-major) where the model reads ``arange(T)``, and every site receives this object.
    """

    def __init__(self, start: torch.Tensor, pad: torch.Tensor, t: int):
        self.start, self.pad, self.t = start, pad, t
        self.rows = start.numel()
        slot = torch.arange(t, device=start.device)
        self.real = slot[None, :] >= pad[:, None]  # (R, t)
        self.at = start[:, None] + (slot[None, :] - pad[:, None]).clamp(min=0)  # (R, t) the slots' positions
        self.end = start + t - pad  # (R,) positions cached after this call
        self.fresh = not bool(start.any())
        self.positions = self.at.reshape(-1)
        self._keep: dict[tuple[Any, ...], torch.Tensor] = {}  # the sites' masks, shared by sites alike

    def mask(self, key: tuple[Any, ...], build: Any) -> torch.Tensor:
        """The keep-mask ``build()`` gives, built once per call for every site with the same ``key``."""
        if key not in self._keep:
            self._keep[key] = build()
        return self._keep[key]


def _slot_positions(filled: torch.Tensor, size: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(R, size)`` positions held by slots ``0 .. size-1`` of ring caches with ``filled`` ``(R,)`` positions
    written (slot ``s`` holds the last ``j < filled`` with ``j % capacity == s``), and whether one is held."""
    s = torch.arange(size, device=filled.device)[None, :]
    last = filled[:, None] - 1
    return s + capacity * torch.div(last - s, capacity, rounding_mode="floor"), s <= last


def _window_keep(at: torch.Tensor, held: torch.Tensor, valid: torch.Tensor, window: int | None) -> torch.Tensor:
    """``(R, t, K)``: query at ``at`` ``(R, t)`` keeps key at ``held`` ``(R, K)`` (``valid``) iff causal, in window."""
    keep = valid[:, None, :] & (held[:, None, :] <= at[:, :, None])
    if window is not None:
        keep &= held[:, None, :] > at[:, :, None] - window
    return keep


class KVCacheAttention(DispatchingSite):
    """One causal self-attention site with its K/V cache: ``(q, k, v, scale, offset) -> out``.

    q: ``(..., t, D)`` for the ``t`` new positions ``offset .. offset + t - 1``; k, v: their keys and
    values (``(..., Hkv, t, D)``, unrepeated for GQA). The cache is allocated on the first call at
    offset 0 with ``capacity`` positions: ``max_len``, or the window for a sliding-window site (then
    the keys more than ``window - 1`` positions back are overwritten, never attended). ``offset`` may
    be a :class:`Rows` instead (a ragged batch folded into the time axis). ``candidate`` and ``selector``
    are the dispatch's (:class:`~attnopt.runtime.dispatch.DispatchingSite`): a candidate's name, or
    ``"auto"`` with a selector.
    """

    def __init__(self, name: str, spec: AttentionSpec, max_len: int, where: str = "", candidate: str = "sdpa",
                 selector: Any = None):
        super().__init__(name, spec, candidate, where=where, selector=selector)
        self.max_len = max_len
        self.window = spec.window
        self.bytes_per_token: int | None = None  # K and V bytes per position of one sequence (set by cached())
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        #: a term per key added to the scores (ALiBi), ``(..., capacity)`` with q's dims before ``t``: kept with
        #: the keys, at the same slots (see :meth:`forward`)
        self.b_cache: torch.Tensor | None = None
        self.keeps_key_bias = False  # the graph passes ``key_bias`` (set by ``cached()``)
        #: the key terms stand for a term relative to the last key (MPT's ``slope * (j - T + 1)``, passed as
        #: ``slope * j`` in float64): each call adds them less their largest, in the scores' dtype, so the recent
        #: keys' terms are small, as written, and no precision is lost to ``slope * j`` at long lengths
        self.relative_key_bias = False
        self.score_mod: Any = None  # an elementwise score modifier (``spec.ElementwiseScoreMod``): reads no index
        #: the sink is read as ``sigmoid(logsumexp(s) - sink)`` (Granite-SWA): ``+inf`` as the largest finite logit
        self.sink_lse = False
        #: with a finite fill (``spec.fill_value``): the largest key norm since the sequence began, 0-d float32
        #: (see :meth:`check_fill`)
        self.k_norm: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        """Positions the cache holds per sequence: ``max_len``, or at most the window."""
        return self.max_len if self.window is None else min(self.window, self.max_len)

    def extra_repr(self) -> str:
        extra = (", key terms relative to the last key" if self.relative_key_bias else
                 ", key terms" if self.keeps_key_bias else "")
        return f"{self.site_name}: capacity={self.capacity}, {self.candidate}, {self.spec.describe()}{extra}"

    def reset(self) -> None:
        self.k_cache = self.v_cache = self.b_cache = self.k_norm = None

    @property
    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k_cache, self.v_cache, self.b_cache) if t is not None)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None,
                offset: int | Rows, sink: torch.Tensor | None = None, key_bias: torch.Tensor | None = None
                ) -> torch.Tensor:
        """``sink``: an attention sink's logits, ``(..., t, 1)`` broadcast to q's rows (gpt-oss): one more key per
        row whose score is the sink and whose value is zero, added to the cached keys at every call.

        ``key_bias``: a term per new key, ``(..., 1, t)`` broadcast to q's dims before ``t`` (ALiBi's ``slope * j``),
        added to every score of that key. It is kept with the key and added over the cached keys at every call.
        It must be finite and within a quarter of its dtype's range (:func:`_bounded_bias`): a key hidden by
        ``-inf`` there could leave a row with no key (NaN as written), and a term near the dtype's minimum or
        maximum could cancel or match the model's mask fill; such a call raises ``PositionError``
        (``RuntimeError`` from the compiled graph's assert with ``compile=True``)."""
        kwargs = dict(dropout_p=0.0, scale=self.spec.scale if scale is None else float(scale),
                      enable_gqa=self.spec.gqa)
        if sink is not None:
            kwargs["sink"] = sink.expand(*q.shape[:-1], 1)
        if key_bias is not None:
            kwargs["key_bias"] = _bounded_bias(key_bias, self.site_name).expand(*q.shape[:-2], 1, q.size(-2))
        if self.spec.fill_value is not None:
            self.check_fill(q, k, kwargs["scale"], offset)
        if isinstance(offset, Rows):
            out = self._rows(q, k, v, offset, kwargs)
        elif self.window is None:
            out = self._prefix(q, k, v, offset, kwargs)
        else:
            out = self._ring(q, k, v, offset, kwargs)
        if self.spec.out_dtype is not None and out.dtype != self.spec.out_dtype:
            out = out.to(self.spec.out_dtype)
        return out

    def check_fill(self, q: torch.Tensor, k: torch.Tensor, scale: float, offset: int | Rows) -> None:
        """Raise unless the model's finite fill ``f`` (``masked_fill(~causal, -1e4)``, OpenAI-GPT's
        ``w * b + -1e4 * (1 - b)``) provably carries no weight, as written, in the rows of this call.

        As written, the whole sequence (at most ``max_len`` positions) is attended at once, and every future key
        (and every key outside a window) gets the score ``f`` exactly, whatever the key; the cache attends to the
        kept keys only. A row ``i`` agrees within ``2**-60`` of its weight when
        ``f + |scale| * |q_i| * max_j |k_j| + log(max_len) <= -42`` over its kept keys ``j``: by Cauchy-Schwarz its
        largest kept score is at least ``-|scale| * |q_i| * max_j |k_j|``, and the at most ``max_len`` filled keys
        weigh ``exp(f - s)`` each against it (a sink only adds weight elsewhere). So a row's bound needs only its
        own query and the keys up to it, all known when the cache computes it: the site keeps the largest key
        norm since the sequence began (``k_norm``, padding slots of a ragged batch left out) and checks the new
        queries against it. The product ``|q| * |k|`` must also stay within half the dtype's range, scaled or not:
        as written ``q @ k^T`` may be taken before the scale, and in a half type a score that overflows to
        ``-inf`` hides a kept key (a row left with its future keys only). Past the bound the model
        as written lets a query see future keys, which no cache can compute: the call raises ``PositionError``
        (``RuntimeError`` from the compiled graph's assert with ``compile=True``)."""
        assert self.spec.fill_value is not None
        # at most as negative as the scores' dtype stores it (-1e4 is -9984 in bfloat16): rounding moves it by at
        # most one unit of its precision (plain arithmetic, which a compiled step traces without a graph break)
        fill = self.spec.fill_value * (1 - torch.finfo(q.dtype).eps)
        fresh = offset.fresh if isinstance(offset, Rows) else offset == 0
        with torch.no_grad():
            wide = torch.promote_types(q.dtype, torch.float32)  # half types accumulate in float32, no copy
            qn, kn = (torch.linalg.vector_norm(x.detach(), dim=-1, dtype=wide).float() for x in (q, k))
            if isinstance(offset, Rows):  # padding slots: never attended, their results unused
                real = offset.real.reshape(-1)
                qn, kn = qn[..., real], kn[..., real]
            qn, kn = qn.amax(), kn.amax()
            self.k_norm = kn if fresh or self.k_norm is None else torch.maximum(self.k_norm, kn)
            product = qn * self.k_norm * 1.01
            margin = fill + abs(scale) * product + 1.0 + math.log(max(self.max_len, 1))
            # as written, ``q @ k^T`` may be taken before the scale: in a half type it can overflow to -inf (a
            # kept key hidden) while the scaled bound holds
            fits = product * max(1.0, abs(scale)) <= torch.finfo(q.dtype).max / 2
            ok = (margin <= -42.0) & fits
        if torch.compiler.is_compiling():
            torch._assert_async(ok, f"the fill of {self.site_name} may carry weight")
        elif not bool(ok):
            raise PositionError(
                f"{self.site_name} fills its masked scores with {self.spec.fill_value:g}, and at this call its "
                "scores may reach "
                f"{abs(scale) * float(qn * self.k_norm):.4g} in size (|scale| * max|q| * max|k|; unscaled "
                f"{float(qn * self.k_norm):.4g}, in {q.dtype}): the model as written may then give future keys "
                "weight, which a KV cache cannot compute. Generate by full "
                "recompute (the model's forward on the whole sequence) for inputs like these, or mask with -inf "
                "or the dtype's minimum")

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                causal: bool, kwargs: dict) -> torch.Tensor:
        kwargs = dict(kwargs)
        sink = kwargs.pop("sink", None)
        bias = kwargs.pop("key_bias", None)
        if bias is not None:  # the keys' own terms (..., K), over the kept keys only
            assert bias.dim() == q.dim() - 1, "key_bias reaches _attend as the cached keys' terms (..., K)"
            if self.relative_key_bias:  # a constant per row (any is exact): the largest, the last key's for slope > 0
                # bounded again in the scores' dtype, where it is added (the float64 term's bound says nothing there)
                bias = _bounded_bias((bias - bias.amax(-1, keepdim=True)).to(q.dtype), self.site_name)
            mask, causal = _biased(bias, mask, causal, q.size(-2)), False
        q, keys, values, lead = candidate_layout(q, keys, values)
        if mask is not None:
            mask = mask.reshape((1,) * max(0, 4 - mask.dim()) + mask.shape)
        if sink is not None:  # one more key, the sink's logit in every row and a zero value (as the rewrite does)
            sink = sink.reshape(*q.shape[:-1], 1)
            q, keys, values, mask = sink_operands(q, keys, values, sink, kwargs["scale"], mask, causal, self.sink_lse)
            causal, kwargs["scale"] = False, 1.0
        kwargs = dict(kwargs, attn_mask=mask, is_causal=causal)
        if self.score_mod is not None:
            kwargs["score_mod"] = self.score_mod
        # the site's range, only while a profiler records or a graph is traced by make_fx. Dynamo (``cached(...,
        # compile=True)``) drops such a range with a warning, and is asked first: it cannot trace the profiler
        # query, and a graph break there would split the compiled step at every site.
        if not torch.compiler.is_compiling() and (is_fake(q) or profiler_records()):
            with torch.autograd.profiler.record_function(f"attnopt::{self.site_name}"):
                out = self.run_candidate(q, keys, values, kwargs)
        else:
            out = self.run_candidate(q, keys, values, kwargs)
        return out.reshape(out.shape[lead:]) if lead else out

    def _allocate(self, k: torch.Tensor, v: torch.Tensor, lead: tuple[int, ...], zeros: bool,
                  bias: torch.Tensor | None = None) -> None:
        """The K/V caches; with ``bias`` (the keys' terms, ``(..., 1, t)``), its cache ``(..., capacity)``."""
        new = torch.zeros if zeros else torch.empty
        self.k_cache = new((*lead, self.capacity, k.size(-1)), dtype=k.dtype, device=k.device)
        self.v_cache = new((*lead, self.capacity, v.size(-1)), dtype=v.dtype, device=v.device)
        self.b_cache = None if bias is None else \
            new((*bias.shape[:-2], self.capacity), dtype=bias.dtype, device=bias.device)

    def _prefix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int, kwargs: dict) -> torch.Tensor:
        """Every position kept: write at ``offset``, attend over ``cache[:offset + t]`` aligned bottom-right."""
        t = q.size(-2)
        end = offset + t
        if self.k_cache is None or offset == 0:
            self._allocate(k, v, k.shape[:-2], zeros=False, bias=kwargs.get("key_bias"))
        assert self.k_cache is not None and self.v_cache is not None
        self.k_cache[..., offset:end, :] = k
        self.v_cache[..., offset:end, :] = v
        if "key_bias" in kwargs:
            b = self._bias_cache()
            b[..., offset:end] = kwargs["key_bias"][..., 0, :]
            kwargs = dict(kwargs, key_bias=b[..., :end])
        mask = None
        if 1 < t < end:  # several new tokens after a prefix: query i sees keys <= offset + i
            mask = torch.ones(t, end, dtype=torch.bool, device=q.device).tril(diagonal=offset)
        causal = False
        if t > 1 and t == end:  # a branch, so a plain bool while traced with dynamic shapes (SDPA takes no SymBool)
            causal = True
        return self._attend(q, self.k_cache[..., :end, :], self.v_cache[..., :end, :], mask, causal, kwargs)

    def _ring(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int, kwargs: dict) -> torch.Tensor:
        """A sliding window of ``w`` keys over a ring of ``capacity`` slots (position ``j`` in slot ``j % cap``)."""
        t, cap, w = q.size(-2), self.capacity, self.window
        assert w is not None
        end = offset + t
        if self.k_cache is None or offset == 0:
            self._allocate(k, v, k.shape[:-2], zeros=True, bias=kwargs.get("key_bias"))
        assert self.k_cache is not None and self.v_cache is not None
        new_bias = kwargs["key_bias"][..., 0, :] if "key_bias" in kwargs else None
        if t == 1 and offset > 0:
            # the slot written held position offset - capacity, outside the window (capacity >= w or = max_len)
            self.k_cache[..., offset % cap, :] = k[..., 0, :]
            self.v_cache[..., offset % cap, :] = v[..., 0, :]
            n = min(end, cap)  # every held slot is in the window: no mask, order is irrelevant to attention
            if new_bias is not None:
                self._bias_cache()[..., offset % cap] = new_bias[..., 0]
                kwargs = dict(kwargs, key_bias=self._bias_cache()[..., :n])
            return self._attend(q, self.k_cache[..., :n, :], self.v_cache[..., :n, :], None, False, kwargs)
        at = torch.arange(offset, end, device=q.device)[None, :]
        if offset == 0:  # the prompt attends to its own keys
            keys, values = k, v
            mask = None if t <= w else window_keep(t, t, w, q.device)
            if new_bias is not None:
                kwargs = dict(kwargs, key_bias=new_bias)
        else:  # several tokens after a prefix: the ring's keys, then the new ones (written after attending)
            held, valid = _slot_positions(torch.tensor([offset], device=q.device), cap, cap)
            keys, values = torch.cat((self.k_cache, k), dim=-2), torch.cat((self.v_cache, v), dim=-2)
            mask = _window_keep(at, torch.cat((held, at), 1), torch.cat((valid, torch.ones_like(at, dtype=torch.bool)),
                                                                         1), w)[0]
            if new_bias is not None:
                kwargs = dict(kwargs, key_bias=torch.cat((self._bias_cache(), new_bias), dim=-1))
        causal = False
        if t > 1 and mask is None:  # a branch: a plain bool while traced with dynamic shapes
            causal = True
        out = self._attend(q, keys, values, mask, causal, kwargs)
        first = max(offset, end - cap)  # only the last ``capacity`` new positions stay
        slots = torch.arange(first, end, device=q.device) % cap
        self.k_cache[..., slots, :] = k[..., first - offset:, :]
        self.v_cache[..., slots, :] = v[..., first - offset:, :]
        if new_bias is not None:
            self._bias_cache()[..., slots] = new_bias[..., first - offset:]
        return out

    def _rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: Rows, kwargs: dict) -> torch.Tensor:
        """A ragged batch: the folded time axis ``(..., R * t, D)`` as ``(R, ..., t, D)``, a key mask per row."""
        r, t, cap, w = rows.rows, rows.t, self.capacity, self.window
        q, k, v = (x.unflatten(-2, (r, t)).movedim(-3, 0) for x in (q, k, v))  # (R, ..., t, D)
        if "sink" in kwargs:  # the sink's logits, one per query row: laid out as q
            kwargs = dict(kwargs, sink=kwargs["sink"].unflatten(-2, (r, t)).movedim(-3, 0))
        bias = None  # the keys' terms, (R, H, t): the slots' dims before t flattened, as q's below
        if "key_bias" in kwargs:
            bias = kwargs["key_bias"][..., 0, :].unflatten(-1, (r, t)).movedim(-2, 0)
            bias = bias.reshape(r, -1, t)
        if self.k_cache is None or rows.fresh:
            # unwritten slots hold zeros: masked, never NaN
            self._allocate(k, v, k.shape[:-2], zeros=True, bias=None if bias is None else bias[..., None, :])
        assert self.k_cache is not None and self.v_cache is not None
        b, i = rows.real.nonzero(as_tuple=True)
        if w is None or t == 1:  # writing first overwrites no key this call attends (capacity >= w)
            self._write(k, v, rows, b, i, bias)
            n = min(cap, int(rows.end.max()))
            keys, values = self.k_cache[..., :n, :], self.v_cache[..., :n, :]
            mask = rows.mask(("after", cap, w), lambda: _window_keep(rows.at, *_slot_positions(rows.end, n, cap), w))
            if bias is not None:
                kwargs = dict(kwargs, key_bias=self._bias_cache()[..., :n])
        else:  # a window and several tokens: attend to the ring and the new keys, then write
            if rows.fresh:
                keys, values, kv_rows = k, v, (rows.at, rows.real)
            else:
                keys, values = torch.cat((self.k_cache, k), dim=-2), torch.cat((self.v_cache, v), dim=-2)
                held, valid = _slot_positions(rows.start, cap, cap)
                kv_rows = (torch.cat((held, rows.at), 1), torch.cat((valid, rows.real), 1))
            mask = rows.mask(("before", cap, w), lambda: _window_keep(rows.at, *kv_rows, w))
            if bias is not None:
                kwargs = dict(kwargs, key_bias=bias if rows.fresh else torch.cat((self._bias_cache(), bias), dim=-1))
        shape = q.shape
        if q.dim() > 4:  # (R, 1, H, t, D): the dims before the heads into the rows
            q, keys, values = (x.reshape(-1, *x.shape[-3:]) for x in (q, keys, values))
            if "sink" in kwargs:
                kwargs = dict(kwargs, sink=kwargs["sink"].reshape(-1, *kwargs["sink"].shape[-3:]))
        mask = mask[:, None].repeat_interleave(q.size(0) // r, dim=0) if q.dim() == 4 else mask
        out = self._attend(q, keys, values, mask, False, kwargs)
        out = out.reshape(*shape[:-1], out.size(-1))
        if w is not None and t > 1:
            stay = rows.at[b, i] >= (rows.end[b] - cap)  # only the last ``capacity`` positions of a row stay
            self._write(k, v, rows, b[stay], i[stay], bias)
        return out.movedim(0, -3).flatten(-3, -2)  # (..., R * t, D)

    def _write(self, k: torch.Tensor, v: torch.Tensor, rows: Rows, b: torch.Tensor, i: torch.Tensor,
               bias: torch.Tensor | None = None) -> None:
        """Slots ``i`` of rows ``b`` (``k``, ``v``: ``(R, ..., t, D)``; ``bias``: ``(R, H, t)``) into their rows'
        cache slots."""
        assert self.k_cache is not None and self.v_cache is not None
        slot = rows.at[b, i] % self.capacity
        self.k_cache[b, ..., slot, :] = k[b, ..., i, :]
        self.v_cache[b, ..., slot, :] = v[b, ..., i, :]
        if bias is not None:
            self._bias_cache()[b, :, slot] = bias[b, :, i]

    def _bias_cache(self) -> torch.Tensor:
        assert self.b_cache is not None, "the key-bias cache is allocated with the K/V caches"
        return self.b_cache


def _bounded_bias(bias: torch.Tensor, site: str) -> torch.Tensor:
    """``bias`` when every term is within a quarter of its dtype's largest value (ALiBi's are small), else the call
    raises. The model hides future keys by adding ``-inf`` or the dtype's minimum; a term near that size could
    cancel it (``s + max + min`` is ``s``: a future key seen) or match it on every kept key (a row as written
    spread over future keys too), which the cache, attending to the kept keys only, would not compute. Within
    the bound a hidden key stays hidden and a kept row keeps its keys, as written."""
    bound = torch.finfo(bias.dtype).max / 4
    if torch.compiler.is_compiling():  # an assert in the compiled graph: a RuntimeError when it fails
        torch._assert_async((bias.abs() <= bound).all(), f"a key bias of {site} is not within +-{bound:g}")
    elif not bool((bias.abs() <= bound).all()):
        raise PositionError(f"the term {site} adds per key (its key bias, e.g. ALiBi) is not finite or not within "
                            f"+-{bound:g} (a quarter of its dtype's range) at this call: a term that large could "
                            "cancel the mask's -inf or minimum, which the model as written would then read and the "
                            "cache would not; the cache serves key terms within that bound only")
    return bias


def _biased(bias: torch.Tensor, keep: torch.Tensor | None, causal: bool, t: int) -> torch.Tensor:
    """The additive mask ``(..., t, K)`` that adds each key's term ``bias`` ``(..., K)`` to the kept keys: those of
    the bool ``keep`` (broadcast to ``(..., t, K)``), of the causal pattern (``causal``: ``t == K``), or all."""
    scores = bias[..., None, :]
    if causal:
        keep = torch.ones(t, bias.size(-1), dtype=torch.bool, device=bias.device).tril(bias.size(-1) - t)
    if keep is None:
        return scores
    return scores.masked_fill(~keep, float("-inf"))


class MaskCheck:
    """Site mask terms computed from sizes alone that the symbolic proof could not read (e.g. Hugging Face's
    masks, built from position ids with comparisons and a packed-sequence ``cumsum``; a padding mask of ones).

    The terms' subgraph (token ids enter only through their sizes; model buffers may be read) is a function of
    the batch size and length alone. The cached model drops it and attends causally (within ``window`` keys
    when one was found), which is exact exactly when the terms together give that pattern (keep
    ``i - window < j <= i``; added terms hold 0 or ``-inf``/the dtype's minimum, filled terms are boolean) at
    every length the cache serves: the cached model evaluates them for each new ``(batch, length)`` before
    running (one mask computation, as the model itself does per call).

    ``kinds``: per term, ``(additive, keep_when_true)``: an added mask, or a boolean condition of
    ``masked_fill`` (``keep_when_true`` for ``where(cond, scores, fill)``).
    """

    def __init__(self, module: fx.GraphModule, kinds: list[tuple[bool, bool]], site_name: str, where: str,
                 window: int | None = None):
        self.module = module
        self.kinds = kinds
        self.site_name = site_name
        self.where = where
        self.window = window
        self.probe = 0  # the length at which the window was looked for when the cached model was built
        self.checked: set[tuple[int, int]] = set()
        self.changed: str | None = None  # a model tensor it reads changed after cached() (see cached_lm.Watch)

    def keep(self, batch: int, length: int, device: torch.device) -> torch.Tensor | None:
        """The terms for ``batch`` sequences of ``length`` tokens as one keep pattern ``(..., length, length)``,
        or None when one is not a mask (an added value other than 0 and ``-inf``, a condition that is not bool)."""
        with torch.no_grad():
            out = self.module(torch.zeros(batch, length, dtype=torch.long, device=device))
        keep = None
        for mask, (additive, keep_when_true) in zip(out, self.kinds):
            if additive and mask.is_floating_point():
                masked = torch.isneginf(mask) | (mask <= torch.finfo(mask.dtype).min)
                if not bool(((mask == 0) | masked).all()):
                    return None
                k = mask == 0
            elif not additive and mask.dtype == torch.bool:
                k = mask if keep_when_true else ~mask
            else:
                return None
            keep = k if keep is None else keep & k
        if keep is None or keep.dim() < 2 or tuple(keep.shape[-2:]) != (length, length):
            return None
        return keep

    def holds(self, batch: int, length: int, device: torch.device) -> bool:
        """The mask for ``batch`` sequences of ``length`` tokens is exactly the causal (window) pattern."""
        if (batch, length) in self.checked:
            return True
        keep = self.keep(batch, length, device)
        if keep is None:
            return False
        window = length if self.window is None else self.window
        ok = torch.equal(keep, window_keep(length, length, window, keep.device).expand(keep.shape))
        if ok:
            self.checked.add((batch, length))
        return ok

    def find_window(self, length: int, device: torch.device) -> int | None:
        """The width of the causal window the mask keeps at ``length`` (None: none narrower than the length)."""
        keep = self.keep(1, length, device)
        if keep is None or any(s != 1 for s in keep.shape[:-2]):
            return None
        found = band_pattern(keep)
        if found is None or found[1] != (False, True, False) or found[0][1] != 0:
            return None
        width = found[0][1] - found[0][0]
        return width if 1 <= width < length else None
