"""KV-cached generation for causal language models written without a cache.

``attnopt.generate(model, idx, max_new_tokens)`` gives the tokens the plain loop gives
(``generate_plain``: run the whole sequence, take the last logits, pick, append, repeat), but
runs each new token once. ``cached(model)`` builds the object it uses, for users who drive
decoding themselves::

    lm = attnopt.generation.cached(model)         # capture + proof; max_len from the model
    logits = lm.prefill(idx)                       # (B, T0, vocab), caches filled
    logits = lm.step(next_tokens)                  # (B, t, vocab) for positions T0 .. T0 + t - 1
    print(lm.describe())                           # sites, max_len, cache bytes

How the cached model is built, and why it computes the same function:

1. **Capture** ``forward(idx)`` with ``torch.export`` (batch and sequence dims dynamic), so every
   node carries symbolic shapes and the sequence length is one symbol ``T``. Parameters are the
   model's own tensors (shared, not copied).
2. **Keep the logits**: the graph returns only the logits (a tensor, the first item of a tuple such
   as nanoGPT's ``(logits, loss)``, or ``.logits``); everything else is dead code. Spellings export
   adds (``type_as``, ``.float()``, full slices, inactive dropout) are read back as casts and identities.
3. **Find sites** (``passes/find_sites.py``) and replace every proven *causal* site with a
   :class:`KVCacheAttention` module called as ``(q, k, v, scale, offset)``. A mask the symbolic proof
   cannot read but that is computed from sizes alone (Hugging Face builds its causal mask from
   position ids) gets a :class:`MaskCheck`: it is evaluated for every ``(batch, length)`` the cache
   serves and must be exactly causal there, else the call raises. Sites with another mask or active
   dropout stay as written, so step 4 refuses them.
4. **Prove positions** (``passes/positions.py``): every other op acts on each position alone, or
   reads positions only through ``arange(T)`` / ``table[:T]``; a view that folds batch and time into
   rows (``(B, T, C) -> (B*T, C)``, GPT-2's ``Conv1D``) is followed through row-wise ops until it is
   unfolded; otherwise :class:`~attnopt.passes.positions.PositionError` names the op and its source line.
5. **Shift positions**: the graph takes ``(tokens, offset)``; ``arange(T)`` becomes
   ``arange(offset, offset + t)`` and ``table[:T]`` becomes ``table[offset:offset + t]``.
6. **Pin what the capture read**: every ``prefill``/``step`` first checks that the model's tensors the
   graph reads are the same objects with the dtype and device of the capture, that the buffers a causal
   proof read (nanoGPT's ``tril``) still hold the proven pattern (object identity and version counter; the
   pattern read again when the version moved), and that the plain Python attributes of every submodule
   (numbers, flags, strings, dtypes, ``training``, ...), which the capture turned into constants, and the
   submodules themselves are unchanged. Otherwise it raises :class:`ModelChangedError` naming the tensor,
   module or attribute. In-place weight updates reach the cache: one before ``prefill`` is simply used; one
   after it (version counter or storage moved) makes the cached keys and values of the prefix stale, so the
   next ``step`` recomputes the whole sequence (the token history the :class:`CachedLM` keeps) with the new
   weights, as the model as written does, and continues from there.

Each site writes its new K and V into a cache preallocated to ``max_len`` positions (K and V are
computed per position, so the cached rows equal the full recompute's) and attends over
``cache[:offset + t]`` with the causal rule aligned bottom-right: no mask for one new token,
``is_causal`` for the prefill, an explicit lower-band mask for several new tokens after a prefix.
A site whose mask is a proven causal sliding window of ``w`` keys (``spec.window``, or a run-time mask
check that reads the window off the mask, as for Mistral) keeps a ring of ``w`` slots: keys further
back are overwritten, never attended, and a sequence's cache is bounded by the window.

Prompts of different lengths (a list of 1-D tensors, or left-padded ids with ``attention_mask``) run
as one batch whose rows are folded into the time axis of one sequence (``runtime.kv_cache.Rows``):
step 4's proof says that every time step outside the sites is computed from its own token and position
alone, so each slot gets its row's position (``passes.positions.index_positions``: ``arange(T)`` and
``table[:T]`` read a position vector), and each site unfolds the rows, keeps one cache row per sequence
and masks the keys of other positions (padding is never written nor attended). Each sequence gets the
logits it gets alone.
Attention runs through the candidate ``variant`` names (``sdpa`` by default; ``auto`` lets the
selector time the prefill and decode shapes); outputs match the model as written within the
dtype's tolerance, like every attnopt rewrite. Dropout must be inactive (``model.eval()``).
"""

from __future__ import annotations

import math
import operator
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from .passes.kv_capture import forward_kwargs, logits_of
from .passes.positions import PositionError
from .pipeline.kv import SIZED_FOR_CALL, build_cached, cached
from .runtime.cached_lm import CachedLM, ModelChangedError, check_tokens, global_state, left_pad, padding_of
from .runtime.kv_cache import KVCacheAttention, MaskCheck

#: The cached model ``generate(model, ...)`` built for each module, per ``(max_len, variant, compile)``:
#: a second call reuses it (capture and proof take seconds). Weakly keyed: the cache dies with the module.
_REUSED: weakref.WeakKeyDictionary[nn.Module, dict[tuple[Any, ...], tuple[Any, CachedLM]]] = \
    weakref.WeakKeyDictionary()
#: Kept cached models a ``stream`` is decoding with now: a second stream on the same module gets its own.
_BUSY: weakref.WeakSet[CachedLM] = weakref.WeakSet()


def _code(model: nn.Module) -> tuple[Any, ...]:
    """What the capture ran: each submodule's class and forward function (a patched ``forward`` counts)."""
    out = []
    for m in model.modules():
        own = m.__dict__.get("forward")
        out.append((type(m), getattr(type(m), "forward", None), getattr(own, "__func__", own)))
    return tuple(out)


def _key(model: nn.Module, max_len: int | None, variant: str, compile: bool) -> tuple[Any, ...]:
    """What a kept cached model is kept under: the options, and the settings its capture baked in (autocast, the
    default dtype): a call under other settings gets (or builds) the one captured under those."""
    param = next(iter(model.parameters()), None)
    return max_len, variant, compile, global_state("cpu" if param is None else param.device.type)


def _reused(model: nn.Module, max_len: int | None, variant: str, compile: bool, needed: int = 0
            ) -> tuple[CachedLM, bool]:
    """The cached model of an earlier ``generate(model, ...)`` with these options if its code is the same, or
    a new one; and whether it was reused (then a :class:`ModelChangedError` at prefill means: build again).

    A model that names no maximum length (BLOOM: ALiBi has no position table) gets caches of ``needed`` positions
    (the prompt and the new tokens) rounded up to a power of two, at least 64; a later call that needs more
    builds it again, larger."""
    key, code = _key(model, max_len, variant, compile), _code(model)
    built = _REUSED.setdefault(model, {})
    if key in built and built[key][0] == code and not (built[key][1].max_len_source == SIZED_FOR_CALL and
                                                       needed > built[key][1].max_len):
        if built[key][1] not in _BUSY:
            return built[key][1], True
        # another stream decodes with the kept one (its caches hold that stream's sequences): a private one
        return _build(model, max_len, variant, compile, needed), False
    lm = _build(model, max_len, variant, compile, needed)
    built[key] = (code, lm)
    return lm, False


def _build(model: nn.Module, max_len: int | None, variant: str, compile: bool, needed: int) -> CachedLM:
    """``cached(model, ...)``; caches of ``needed`` positions rounded up to a power of two (at least 64) where the
    model names no maximum length."""
    sized = max(64, 1 << (needed - 1).bit_length()) if needed > 0 else None
    return build_cached(model, max_len, variant=variant, compile=compile, unbounded_len=sized)


# ----------------------------------------------------------------------------- decoding


#: One generator for the batch, or one per sequence (then each row samples as it would alone with its own).
GeneratorLike = torch.Generator | Sequence[torch.Generator] | None


def _check_sampling(max_new_tokens: Any, temperature: Any, top_k: Any, do_sample: Any, generator: Any,
                    batch: int) -> None:
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if not isinstance(temperature, (int, float)) or not temperature > 0 or not math.isfinite(temperature):
        raise ValueError(f"temperature must be a positive number, got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
    if not isinstance(do_sample, bool):
        raise TypeError(f"do_sample must be True or False, got {do_sample!r}")
    if isinstance(generator, (list, tuple)):
        if len(generator) != batch or not all(isinstance(g, torch.Generator) for g in generator):
            raise ValueError(f"generator= as a list needs one torch.Generator per sequence ({batch}), got "
                             f"{len(generator)} item(s)")
    elif generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, a list of one per sequence, or None, got "
                        f"{type(generator).__name__}")


def _next_token(logits: torch.Tensor, temperature: float, top_k: int | None, do_sample: bool,
                generator: GeneratorLike) -> torch.Tensor:
    """Pick one token per row from the last position's logits ``(B, vocab)``: argmax, or a sample."""
    if not do_sample:
        return torch.argmax(logits, dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        logits = logits.masked_fill(logits < v[:, [-1]], float("-inf"))
    probs = F.softmax(logits, dim=-1)
    if isinstance(generator, (list, tuple)):  # row b draws from its own generator, as it would alone
        return torch.cat([torch.multinomial(probs[b:b + 1], num_samples=1, generator=g)
                          for b, g in enumerate(generator)])
    return torch.multinomial(probs, num_samples=1, generator=generator)


class _Batch:
    """The prompts of one call: left-padded ids ``(B, T)``, the padding per row (None when every prompt has
    ``T`` tokens), and whether they came as a list (then the result is a list, each row its own length)."""

    def __init__(self, idx: Any, attention_mask: torch.Tensor | None):
        self.listed = isinstance(idx, (list, tuple))
        if self.listed:
            if attention_mask is not None:
                raise ValueError("attention_mask= goes with left-padded ids (batch, length); prompts given as a "
                                 "list need none")
            self.ids, mask = left_pad(idx)
        else:
            check_tokens(idx, "idx")
            self.ids, mask = idx, attention_mask
        self.pad = None if mask is None else padding_of(mask, self.ids)
        self.mask = None if self.pad is None else mask  # what CachedLM.prefill takes
        self.longest = self.ids.size(1) - (0 if self.pad is None else int(self.pad.min()))

    def rows(self, seq: torch.Tensor) -> list[torch.Tensor]:
        """Each sequence of the padded ``seq`` ``(B, T + n)`` without its padding."""
        assert self.pad is not None
        return [seq[b, p:] for b, p in enumerate(self.pad.tolist())]

    def result(self, new: list[torch.Tensor], stopping: _Stopping) -> torch.Tensor | list[torch.Tensor]:
        out = torch.cat([self.ids, *new], dim=1)
        if not self.listed:
            return out
        t, pad = self.ids.size(1), [0] * out.size(0) if self.pad is None else self.pad.tolist()
        return [out[b, pad[b]:t + n] for b, n in enumerate(stopping.kept(len(new)))]


def _check_total(longest: int, max_new_tokens: int, max_len: int | None, source: str | None = None) -> None:
    needed = longest + max_new_tokens - 1  # the last new token is never fed back
    if max_len is not None and max_new_tokens > 0 and needed > max_len:
        why = f" ({source})" if source else ""
        raise ValueError(f"a prompt of {longest} tokens plus {max_new_tokens} new ones needs {needed} positions, "
                         f"more than max_len={max_len}{why}; generate fewer tokens or shorten the prompt")


#: ``stop(ids)``: ids ``(B, T)`` so far, the new token last; True (all) or a ``(B,)`` bool tensor (per sequence).
StopFn = Callable[[torch.Tensor], Any]


class _Stopping:
    """Which sequences of a batch have finished: after an end token, or when ``stop`` says so.

    A finished sequence keeps its last token (the end token itself) and gets ``pad_token_id`` from then
    on; it still runs through the model with the others, so a batch stays one batch. Generation ends
    when every sequence has finished. ``trimmed``: the caller cuts each sequence after its end (prompts
    given as a list), so the padding token may default to 0.
    """

    def __init__(self, eos_token_id: int | Sequence[int] | None, stop: StopFn | None, pad_token_id: int | None,
                 idx: torch.Tensor, trimmed: bool = False):
        ends = _token_ids(eos_token_id)
        if any(not isinstance(e, int) or isinstance(e, bool) or e < 0 for e in ends):
            raise ValueError(f"eos_token_id must be a token id >= 0 or a list of them, got {eos_token_id!r}")
        if stop is not None and not callable(stop):
            raise TypeError(f"stop must be a callable (ids (B, T) -> bool or a (B,) bool tensor), got {stop!r}")
        if pad_token_id is not None and (not isinstance(pad_token_id, int) or isinstance(pad_token_id, bool)
                                         or pad_token_id < 0):
            raise ValueError(f"pad_token_id must be a token id >= 0 or None, got {pad_token_id!r}")
        self.active = bool(ends) or stop is not None
        self.pad = pad_token_id if pad_token_id is not None else (ends[0] if ends else 0 if trimmed else None)
        if self.active and self.pad is None and idx.size(0) > 1:
            raise ValueError("a batch that stops per sequence needs a token for the sequences that finished "
                             "first: pass pad_token_id= (or eos_token_id=, which is used for it)")
        self.ends = torch.tensor(ends, dtype=idx.dtype, device=idx.device) if ends else None
        self.stop = stop
        self.done = torch.zeros(idx.size(0), 1, dtype=torch.bool, device=idx.device)
        self.steps = torch.zeros(idx.size(0), 1, dtype=torch.long, device=idx.device)  # new tokens until done

    def fits(self, vocab: int) -> None:
        """The padding token is fed back to the model for finished rows: it must be one of its tokens."""
        if self.active and self.pad is not None and self.pad >= vocab:
            raise ValueError(f"pad_token_id={self.pad} is not a token of the model's vocabulary of {vocab} (the "
                             "padding token is fed back for the sequences that finished); pass a pad_token_id "
                             f"below {vocab}")

    def kept(self, n: int) -> list[int]:
        """How many of the ``n`` new tokens each sequence produced before it finished (its end token included)."""
        return self.steps.flatten().tolist() if self.active else [n] * self.done.size(0)

    def after(self, nxt: torch.Tensor, seq: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """``nxt`` ``(B, 1)`` with finished rows padded, and whether every row has now finished."""
        if not self.active:
            return nxt, False
        self.steps += ~self.done
        if self.pad is not None:
            nxt = torch.where(self.done, torch.full_like(nxt, self.pad), nxt)
        newly = torch.zeros_like(self.done)
        if self.ends is not None:
            newly |= torch.isin(nxt, self.ends)
        if self.stop is not None:
            said = self.stop(torch.cat((seq, nxt), dim=1))
            if said is None:
                raise TypeError(f"stop must return a bool or a ({nxt.size(0)},) bool tensor, got {said!r}")
            said = torch.as_tensor(said, dtype=torch.bool, device=nxt.device)
            if said.dim() == 0:
                said = said.expand(nxt.size(0))
            if tuple(said.shape) not in ((nxt.size(0),), (nxt.size(0), 1)):
                raise ValueError(f"stop must return a bool or a ({nxt.size(0)},) bool tensor, got shape "
                                 f"{tuple(said.shape)}")
            newly |= said.reshape(-1, 1)
        self.done |= newly
        return nxt, bool(self.done.all())


def _token_ids(value: Any) -> list[Any]:
    """``eos_token_id`` as a list: an int, a 0-d tensor or NumPy integer, or a sequence (or 1-D tensor) of them."""
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [int(x) for x in value.flatten().tolist()] if not value.is_floating_point() else [value]
    if hasattr(value, "__index__") and not isinstance(value, bool):
        return [operator.index(value)]
    if isinstance(value, (list, tuple, set)):
        return [operator.index(v) if hasattr(v, "__index__") and not isinstance(v, bool) else v for v in value]
    return [value]


def _decode(first: Callable[[torch.Tensor], torch.Tensor], step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
            idx: torch.Tensor, max_new_tokens: int, pick: Callable[[torch.Tensor], torch.Tensor],
            stopping: _Stopping) -> Iterator[torch.Tensor]:
    """The decoding loop every entry point shares: logits of the prompt, then pick, stop, feed back."""
    logits, seq = first(idx), idx
    stopping.fits(logits.size(-1))
    for i in range(max_new_tokens):
        nxt, finished = stopping.after(pick(logits[:, -1, :]), seq)
        seq = torch.cat((seq, nxt), dim=1)
        yield nxt
        if finished or i + 1 == max_new_tokens:
            return
        logits = step(nxt, seq)


def _picker(temperature: float, top_k: int | None, do_sample: bool,
            generator: GeneratorLike) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda logits: _next_token(logits, temperature, top_k, do_sample, generator)


Prompts = torch.Tensor | Sequence[torch.Tensor]


def generate_plain(model: nn.Module, idx: Prompts, max_new_tokens: int, *, temperature: float = 1.0,
                   top_k: int | None = None, do_sample: bool = False, generator: GeneratorLike = None,
                   max_len: int | None = None, eos_token_id: int | Sequence[int] | None = None,
                   stop: StopFn | None = None, pad_token_id: int | None = None,
                   attention_mask: torch.Tensor | None = None) -> torch.Tensor | list[torch.Tensor]:
    """The full-recompute loop: run the whole sequence for every new token. Returns ``(B, T0 + N)``.

    The reference :func:`generate` is checked against; it picks tokens with the same ops in the same
    order, so a generator seeded alike gives the same samples, and it stops the same way. Prompts of
    different lengths (a list, or left-padded ids with ``attention_mask``) run each sequence alone, without
    its padding, for every token; the picks are made for the batch at once, as :func:`generate` makes them.
    """
    batch = _Batch(idx, attention_mask)
    ids = batch.ids
    _check_sampling(max_new_tokens, temperature, top_k, do_sample, generator, ids.size(0))
    _check_total(batch.longest, max_new_tokens, max_len)
    stopping = _Stopping(eos_token_id, stop, pad_token_id, ids, trimmed=batch.listed)

    def run(seq: torch.Tensor) -> torch.Tensor:
        return logits_of(model(seq, **forward_kwargs(model, seq)))  # a required attention_mask: all ones

    def alone(seq: torch.Tensor) -> torch.Tensor:
        if batch.pad is None:
            return run(seq)
        return torch.cat([run(row[None])[:, -1:] for row in batch.rows(seq)])

    with torch.no_grad():
        new = list(_decode(alone, lambda _, seq: alone(seq), ids, max_new_tokens,
                           _picker(temperature, top_k, do_sample, generator), stopping))
    return batch.result(new, stopping)


def stream(model: nn.Module | CachedLM, idx: Prompts, max_new_tokens: int, *, temperature: float = 1.0,
           top_k: int | None = None, do_sample: bool = False, generator: GeneratorLike = None,
           max_len: int | None = None, variant: str = "sdpa", compile: bool = False,
           eos_token_id: int | Sequence[int] | None = None, stop: StopFn | None = None,
           pad_token_id: int | None = None, attention_mask: torch.Tensor | None = None) -> Iterator[torch.Tensor]:
    """Yield the new tokens ``(B, 1)`` of :func:`generate` one position at a time, as they are produced.

    ``torch.cat([idx, *stream(model, idx, n)], dim=1)`` equals ``generate(model, idx, n)`` for a tensor ``idx``;
    the arguments are :func:`generate`'s. Closing the iterator early (``break``) frees the cache like a
    finished run.
    """
    batch = _Batch(idx, attention_mask)
    stopping = _Stopping(eos_token_id, stop, pad_token_id, batch.ids, trimmed=batch.listed)
    return _stream(model, batch, max_new_tokens, stopping, temperature=temperature, top_k=top_k, do_sample=do_sample,
                   generator=generator, max_len=max_len, variant=variant, compile=compile)


def _stream(model: nn.Module | CachedLM, batch: _Batch, max_new_tokens: int, stopping: _Stopping, *,
            temperature: float, top_k: int | None, do_sample: bool, generator: GeneratorLike, max_len: int | None,
            variant: str, compile: bool) -> Iterator[torch.Tensor]:
    """The cached decoding loop of :func:`stream`. A generator: the cached model is chosen at the first ``next``
    (so that a stream started before another one's first token still gets its own kept cached model)."""
    _check_sampling(max_new_tokens, temperature, top_k, do_sample, generator, batch.ids.size(0))
    if isinstance(model, CachedLM):
        if max_len is not None and max_len != model.max_len:
            raise ValueError(f"max_len={max_len} differs from the CachedLM's max_len={model.max_len}; "
                             "build another with attnopt.generation.cached(model, max_len=...)")
        lm, reused = model, False
    else:
        lm, reused = _reused(model, max_len, variant, compile, batch.longest + max_new_tokens)
    _check_total(batch.longest, max_new_tokens, lm.max_len, lm.max_len_source)
    if max_new_tokens == 0:
        return
    pick = _picker(temperature, top_k, do_sample, generator)
    key = None if isinstance(model, CachedLM) else _key(model, max_len, variant, compile)
    epoch = -1  # the cached model's epoch after this stream's prefill

    def first(x: torch.Tensor) -> torch.Tensor:
        nonlocal lm, epoch
        try:
            logits = lm.prefill(x, batch.mask)
        except ModelChangedError:
            if not reused:
                raise
            _REUSED[model].pop(key, None)  # the model changed since: capture it again
            _BUSY.discard(lm)
            lm, _ = _reused(model, max_len, variant, compile, batch.longest + max_new_tokens)  # type: ignore[arg-type]
            _BUSY.add(lm)
            logits = lm.prefill(x, batch.mask)
        epoch = lm.epoch
        return logits

    def step(nxt: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        if lm.epoch != epoch:
            raise RuntimeError("another prefill or reset ran on this CachedLM while this stream was decoding with "
                               "it, so its caches hold other sequences; give each concurrent stream its own "
                               "attnopt.generation.cached(model), or pass the module (each stream then gets one)")
        return lm.step(nxt)

    _BUSY.add(lm)
    try:
        yield from _decode(first, step, batch.ids, max_new_tokens, pick, stopping)
    finally:
        _BUSY.discard(lm)
        if not isinstance(model, CachedLM) and lm.epoch == epoch:
            lm.reset()  # a kept cached model holds no K/V memory between calls


def generate(model: nn.Module | CachedLM, idx: Prompts, max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int | None = None, do_sample: bool = False, generator: GeneratorLike = None,
             max_len: int | None = None, variant: str = "sdpa", compile: bool = False,
             eos_token_id: int | Sequence[int] | None = None, stop: StopFn | None = None,
             pad_token_id: int | None = None,
             attention_mask: torch.Tensor | None = None) -> torch.Tensor | list[torch.Tensor]:
    """Generate up to ``max_new_tokens`` tokens after ``idx`` ``(B, T0)`` with a KV cache; returns ``(B, T0 + N)``.

    Same tokens as :func:`generate_plain` (greedy: argmax of the last logits; ``do_sample=True``: scale by
    ``temperature``, keep the ``top_k`` largest, sample with ``generator``). ``model`` is a causal LM
    (see :func:`cached`) or a :class:`CachedLM` built before.
    ``variant`` and ``compile`` are passed to :func:`cached` when ``model`` is a module. The cached model
    is built once per module and options and reused by later calls (it holds the module weakly); it is
    built again when a submodule's class or ``forward`` changed, or when the model changed in a way
    :class:`ModelChangedError` describes (a tensor replaced or converted, a proven mask buffer
    rewritten, a plain attribute, ``training`` flag, child or hook changed).

    Prompts of different lengths: ``idx`` a list of 1-D tensors (the result is then a list: each prompt
    followed by its own new tokens, cut after its end token), or left-padded ids ``(B, T0)`` with
    ``attention_mask`` (1 = token, 0 = padding; the result keeps the padding, ``(B, T0 + N)``). Each sequence
    gets the tokens it gets alone: its positions start at 0 and its padding is never attended. With
    ``do_sample=True``, pass ``generator=[g0, g1, ...]`` (one per sequence) for each sequence to draw what it
    draws alone with its generator; one generator for the batch draws the rows in turn from one stream, as
    :func:`generate_plain` on the same batch does.

    Stopping: a sequence finishes after it produced one of ``eos_token_id`` (an id or a list), or when
    ``stop(ids)`` (ids ``(B, T)`` so far, padding included, the new token last) returns True, or True in its
    row of a ``(B,)`` bool tensor. A finished sequence is filled with ``pad_token_id`` (default: the first end
    token) while the others go on; generation ends when all have finished, so ``N`` may be smaller
    than ``max_new_tokens``. :func:`stream` yields the tokens as they are produced.

    Raises:
        PositionError: the model cannot be cached exactly (the message names the op and line).
        ModelChangedError: ``model`` is a :class:`CachedLM` whose model changed since it was built (see
            :func:`cached`).
        ValueError: bad arguments (an attention mask that is not left padding, a sequence without tokens), or
            the prompt plus new tokens exceed ``max_len``.
    """
    batch = _Batch(idx, attention_mask)
    stopping = _Stopping(eos_token_id, stop, pad_token_id, batch.ids, trimmed=batch.listed)
    new = list(_stream(model, batch, max_new_tokens, stopping, temperature=temperature, top_k=top_k,
                       do_sample=do_sample, generator=generator, max_len=max_len, variant=variant, compile=compile))
    return batch.result(new, stopping)


__all__ = ["CachedLM", "KVCacheAttention", "MaskCheck", "ModelChangedError", "PositionError", "StopFn", "cached",
           "generate", "generate_plain", "left_pad", "stream"]
