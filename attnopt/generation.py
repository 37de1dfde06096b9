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
   reads positions only through ``arange(T)`` / ``table[:T]``; otherwise
   :class:`~attnopt.passes.positions.PositionError` names the op and its source line.
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
Attention runs through the candidate ``variant`` names (``sdpa`` by default; ``auto`` lets the
selector time the prefill and decode shapes); outputs match the model as written within the
dtype's tolerance, like every attnopt rewrite. Dropout must be inactive (``model.eval()``).
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from .passes.kv_capture import logits_of
from .passes.positions import PositionError
from .pipeline.kv import cached
from .runtime.cached_lm import CachedLM, ModelChangedError, check_tokens
from .runtime.kv_cache import KVCacheAttention, MaskCheck

aten = torch.ops.aten


#: The cached model ``generate(model, ...)`` built for each module, per ``(max_len, variant, compile)``:
#: a second call reuses it (capture and proof take seconds). Weakly keyed: the cache dies with the module.
_REUSED: weakref.WeakKeyDictionary[nn.Module, dict[tuple[Any, ...], tuple[Any, CachedLM]]] = \
    weakref.WeakKeyDictionary()


def _code(model: nn.Module) -> tuple[Any, ...]:
    """What the capture ran: each submodule's class and forward function (a patched ``forward`` counts)."""
    out = []
    for m in model.modules():
        own = m.__dict__.get("forward")
        out.append((type(m), getattr(type(m), "forward", None), getattr(own, "__func__", own)))
    return tuple(out)


def _reused(model: nn.Module, max_len: int | None, variant: str, compile: bool) -> tuple[CachedLM, bool]:
    """The cached model of an earlier ``generate(model, ...)`` with these options if its code is the same, or
    a new one; and whether it was reused (then a :class:`ModelChangedError` at prefill means: build again)."""
    key, code = (max_len, variant, compile), _code(model)
    built = _REUSED.setdefault(model, {})
    if key in built and built[key][0] == code:
        return built[key][1], True
    lm = cached(model, max_len=max_len, variant=variant, compile=compile)
    built[key] = (code, lm)
    return lm, False


# ----------------------------------------------------------------------------- decoding


def _check_sampling(max_new_tokens: Any, temperature: Any, top_k: Any, do_sample: Any, generator: Any) -> None:
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if not isinstance(temperature, (int, float)) or not temperature > 0 or not math.isfinite(temperature):
        raise ValueError(f"temperature must be a positive number, got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
    if not isinstance(do_sample, bool):
        raise TypeError(f"do_sample must be True or False, got {do_sample!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")


def _next_token(logits: torch.Tensor, temperature: float, top_k: int | None, do_sample: bool,
                generator: torch.Generator | None) -> torch.Tensor:
    """Pick one token per row from the last position's logits ``(B, vocab)``: argmax, or a sample."""
    if not do_sample:
        return torch.argmax(logits, dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        logits = logits.masked_fill(logits < v[:, [-1]], float("-inf"))
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)


def _check_total(idx: torch.Tensor, max_new_tokens: int, max_len: int | None) -> None:
    needed = idx.size(1) + max_new_tokens - 1  # the last new token is never fed back
    if max_len is not None and max_new_tokens > 0 and needed > max_len:
        raise ValueError(f"a prompt of {idx.size(1)} tokens plus {max_new_tokens} new ones needs {needed} positions, "
                         f"more than max_len={max_len}; generate fewer tokens or shorten the prompt")


def generate_plain(model: nn.Module, idx: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
                   top_k: int | None = None, do_sample: bool = False, generator: torch.Generator | None = None,
                   max_len: int | None = None) -> torch.Tensor:
    """The full-recompute loop: run the whole sequence for every new token. Returns ``(B, T0 + max_new_tokens)``.

    The reference :func:`generate` is checked against; it picks tokens with the same ops in the same
    order, so a generator seeded alike gives the same samples.
    """
    check_tokens(idx, "idx")
    _check_sampling(max_new_tokens, temperature, top_k, do_sample, generator)
    _check_total(idx, max_new_tokens, max_len)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = logits_of(model(idx))
            nxt = _next_token(logits[:, -1, :], temperature, top_k, do_sample, generator)
            idx = torch.cat((idx, nxt), dim=1)
    return idx


def generate(model: nn.Module | CachedLM, idx: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int | None = None, do_sample: bool = False, generator: torch.Generator | None = None,
             max_len: int | None = None, variant: str = "sdpa", compile: bool = False) -> torch.Tensor:
    """Generate ``max_new_tokens`` tokens after ``idx`` ``(B, T0)`` with a KV cache; returns ``(B, T0 + N)``.

    Same tokens as :func:`generate_plain` (greedy: argmax of the last logits; ``do_sample=True``: scale by
    ``temperature``, keep the ``top_k`` largest, sample with ``generator``). ``model`` is a causal LM
    (see :func:`cached`) or a :class:`CachedLM` built before (capture takes seconds; reuse it).
    ``variant`` and ``compile`` are passed to :func:`cached` when ``model`` is a module. The cached model
    is built once per module and options and reused by later calls (it holds the module weakly); it is
    built again when a submodule's class or ``forward`` changed, or when the model changed in a way
    :class:`ModelChangedError` describes (a tensor replaced or converted, a proven mask buffer
    rewritten, a plain attribute, ``training`` flag, child or hook changed).

    Raises:
        PositionError: the model cannot be cached exactly (the message names the op and line).
        ModelChangedError: ``model`` is a :class:`CachedLM` whose model changed since it was built (see
            :func:`cached`).
        ValueError: bad arguments, or the prompt plus new tokens exceed ``max_len``.
    """
    check_tokens(idx, "idx")
    _check_sampling(max_new_tokens, temperature, top_k, do_sample, generator)
    if isinstance(model, CachedLM):
        if max_len is not None and max_len != model.max_len:
            raise ValueError(f"max_len={max_len} differs from the CachedLM's max_len={model.max_len}; "
                             "build another with attnopt.generation.cached(model, max_len=...)")
        lm, reused = model, False
    else:
        lm, reused = _reused(model, max_len, variant, compile)
    _check_total(idx, max_new_tokens, lm.max_len)
    if max_new_tokens == 0:
        return idx
    out = [idx]
    try:
        try:
            logits = lm.prefill(idx)
        except ModelChangedError:
            if not reused:
                raise
            _REUSED[model].pop((max_len, variant, compile), None)  # the model changed since: capture it again
            lm, _ = _reused(model, max_len, variant, compile)
            logits = lm.prefill(idx)
        for i in range(max_new_tokens):
            nxt = _next_token(logits[:, -1, :], temperature, top_k, do_sample, generator)
            out.append(nxt)
            if i + 1 < max_new_tokens:
                logits = lm.step(nxt)
    finally:
        if not isinstance(model, CachedLM):
            lm.reset()  # a kept cached model holds no K/V memory between calls
    return torch.cat(out, dim=1)


__all__ = ["CachedLM", "KVCacheAttention", "MaskCheck", "ModelChangedError", "PositionError", "cached", "generate",
           "generate_plain"]
