"""The model grammar of the stateful differential fuzzer (tests/test_fuzz_stateful.py).

A :class:`FuzzSpec` names one choice on every axis the fuzzer varies; :class:`FuzzAttention` is an
``nn.Module`` whose ``forward(x, mask=None, pad=None)`` is written in exactly those spellings, the way a
user writes attention by hand (no attnopt helper in it):

* q/k/v projections: one fused ``Linear`` split in three, or three ``Linear``s;
* the scale: a Python float, ``k.size(-1) ** -0.5``, or a 0-d buffer tensor;
* the mask: none; a causal ``tril`` buffer (float ``== 0``, bool ``~``, uint8 ``.bool()``); a causal mask
  built at run time; a mask passed as a ``forward`` argument (bool keep-mask, float 0/1 ``== 0``, additive
  float); an additive bias buffer or parameter;
* a padding mask argument ``pad`` (B, T), True = key kept: none, ANDed into the keep-mask, or added as
  ``(1 - pad) * fill``;
* the fill: ``-inf``, ``torch.finfo(dtype).min`` or ``-1e9``;
* optional ``nn.Dropout`` on the probabilities; optional LayerNorm before / after, BatchNorm before;
* a dtype round trip on the logits (``.double()``, bf16, fp16, int8 fake-quant) and an in-place write after
  the scores read a tensor (the mask zeroed after ``masked_fill``, a cloned bias halved after the add).

:func:`mask_pattern` and :func:`pad_pattern` build the tensors the fuzzer writes into buffers or passes as
arguments; every pattern is a keep-mask (True = visible).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

#: Buffers are this long; the fuzzer's sequence lengths are at most this.
TMAX = 8

BUFFER_MASKS = ("tril_float", "tril_bool", "tril_uint8", "tril_float_long")
ARG_MASKS = ("arg_keep", "arg_float01", "arg_additive")
BIAS_MASKS = ("bias_buffer", "bias_param")
MASKS = ("none", *BUFFER_MASKS, "runtime_causal", *ARG_MASKS, *BIAS_MASKS)
SCALES = ("float", "size_pow", "buffer0d")
FILLS = ("-inf", "finfo_min", "-1e9")
PADS = ("none", "and", "additive")
NORMS = ("none", "ln_pre", "bn_pre", "ln_post")
#: A dtype round trip on the logits (after the scale, before the mask): value-preserving or lossy.
CASTS = ("none", "float64_roundtrip", "bf16_roundtrip", "fp16_roundtrip", "int8_fakequant")
#: An in-place write, inside the forward, to a tensor the scores read, after they read it and before ``P @ V``:
#: the keep/hidden mask zeroed after ``masked_fill``, or an additive bias halved after it was added.
LATE_WRITES = ("none", "mask", "bias")

#: Keep-patterns of a (T, T) mask (True = the key is visible to the query).
MASK_PATTERNS = ("causal", "lookahead2", "all", "random", "row_hidden", "tril_neg1", "band2")
#: Keep-patterns of a (B, T) padding mask.
PAD_PATTERNS = ("all", "random", "entry_all_padded", "tail_padded")


@dataclass(frozen=True)
class FuzzSpec:
    H: int
    D: int
    proj: str  # "fused" | "separate"
    scale: str  # SCALES
    custom_scale: bool  # 0.37 instead of 1/sqrt(D) ("float" and "buffer0d")
    mask: str  # MASKS
    pad: str  # PADS
    fill: str  # FILLS
    dropout: float  # < 0: no dropout module; else nn.Dropout(p)
    norm: str  # NORMS
    cast: str = "none"  # CASTS
    late_write: str = "none"  # LATE_WRITES

    @property
    def C(self) -> int:
        return self.H * self.D

    @property
    def has_dropout(self) -> bool:
        return self.dropout >= 0


def mask_pattern(name: str, T: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """A (T, T) bool keep-mask."""
    ones = torch.ones(T, T, dtype=torch.bool)
    if name == "causal":
        return ones.tril()
    if name == "lookahead2":
        return ones.tril(2)
    if name == "all":
        return ones
    if name == "random":
        return (torch.rand(T, T, generator=generator) < 0.6) | torch.eye(T, dtype=torch.bool)
    if name == "row_hidden":  # causal, and query 1 sees no key at all
        keep = ones.tril()
        keep[min(1, T - 1)] = False
        return keep
    if name == "tril_neg1":  # strictly causal: query 0 sees no key
        return ones.tril(-1)
    if name == "band2":  # causal sliding window of width 2
        return ones.tril() & ones.triu(-1)
    raise ValueError(name)


def pad_pattern(name: str, B: int, T: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """A (B, T) bool keep-mask over keys."""
    keep = torch.ones(B, T, dtype=torch.bool)
    if name == "random":
        keep = torch.rand(B, T, generator=generator) < 0.7
        keep[:, 0] = True
    elif name == "entry_all_padded":
        keep[0] = False
    elif name == "tail_padded":
        keep[-1, T // 2:] = False
    elif name != "all":
        raise ValueError(name)
    return keep


def bias_pattern(name: str, n: int, fill: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """An (n, n) additive float bias: relative-position (ALiBi-like), random, or a causal mask of ``fill``."""
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    if name == "alibi":
        return -0.25 * (i - j).abs().float()
    if name == "random":
        return torch.randn(n, n, generator=generator)
    if name == "causal_fill":
        return torch.zeros(n, n).masked_fill(j > i, fill)
    raise ValueError(name)


def buffer_from_keep(keep: torch.Tensor, mask: str) -> torch.Tensor:
    """The buffer of a ``BUFFER_MASKS`` spelling holding ``keep``."""
    if mask in ("tril_float", "tril_float_long"):
        return keep.float()
    if mask == "tril_bool":
        return keep.clone()
    return keep.to(torch.uint8)


def arg_from_keep(keep: torch.Tensor, spec: FuzzSpec, dtype: torch.dtype) -> torch.Tensor:
    """The ``mask`` argument of an ``ARG_MASKS`` spelling holding ``keep``."""
    if spec.mask == "arg_keep":
        return keep
    if spec.mask == "arg_float01":
        return keep.to(dtype)
    return torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, fill_value(spec.fill, dtype))


def fill_value(fill: str, dtype: torch.dtype) -> float:
    if fill == "-inf":
        return float("-inf")
    if fill == "finfo_min":
        return torch.finfo(dtype).min
    return -1e9


class FuzzAttention(nn.Module):
    """Causal/padded/biased self-attention written in the spellings ``spec`` names."""

    def __init__(self, spec: FuzzSpec):
        super().__init__()
        self.spec = spec
        c, n = spec.C, TMAX
        if spec.proj == "fused":
            self.qkv = nn.Linear(c, 3 * c)
        else:
            self.q_proj, self.k_proj, self.v_proj = nn.Linear(c, c), nn.Linear(c, c), nn.Linear(c, c)
        self.o_proj = nn.Linear(c, c)
        self.scale_float = 0.37 if spec.custom_scale else 1.0 / math.sqrt(spec.D)
        if spec.scale == "buffer0d":
            self.register_buffer("scale", torch.tensor(self.scale_float))
        if spec.mask in BUFFER_MASKS:
            self.register_buffer("bias", buffer_from_keep(mask_pattern("causal", n), spec.mask))
        elif spec.mask == "bias_buffer":
            self.register_buffer("bias", bias_pattern("alibi", n, 0.0))
        elif spec.mask == "bias_param":
            self.bias = nn.Parameter(bias_pattern("alibi", n, 0.0))
        if spec.has_dropout:
            self.attn_dropout = nn.Dropout(spec.dropout)
        if spec.norm in ("ln_pre", "ln_post"):
            self.norm = nn.LayerNorm(c)
        elif spec.norm == "bn_pre":
            self.norm = nn.BatchNorm1d(c)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None,
                pad: torch.Tensor | None = None) -> torch.Tensor:
        s = self.spec
        B, T, C = x.shape
        if s.norm == "ln_pre":
            x = self.norm(x)
        elif s.norm == "bn_pre":
            x = self.norm(x.transpose(1, 2)).transpose(1, 2)
        if s.proj == "fused":
            q, k, v = self.qkv(x).split(C, dim=2)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(B, T, s.H, s.D).transpose(1, 2)
        k = k.view(B, T, s.H, s.D).transpose(1, 2)
        v = v.view(B, T, s.H, s.D).transpose(1, 2)
        att = q @ k.transpose(-2, -1)
        if s.scale == "float":
            att = att * self.scale_float
        elif s.scale == "size_pow":
            att = att * k.size(-1) ** -0.5
        else:
            att = att * self.scale
        if s.cast == "float64_roundtrip":
            att = att.double().to(q.dtype)
        elif s.cast == "bf16_roundtrip":
            att = att.to(torch.bfloat16).to(q.dtype)
        elif s.cast == "fp16_roundtrip":
            att = att.half().to(q.dtype)
        elif s.cast == "int8_fakequant":
            att = att.to(torch.int8).to(q.dtype)
        if s.fill == "-inf":
            fill = float("-inf")
        elif s.fill == "finfo_min":
            fill = torch.finfo(att.dtype).min
        else:
            fill = -1e9
        hidden = None  # True where the key is hidden
        if s.mask == "tril_float":
            hidden = self.bias[:T, :T] == 0
        elif s.mask == "tril_bool":
            hidden = ~self.bias[:T, :T]
        elif s.mask == "tril_uint8":
            hidden = ~self.bias[:T, :T].bool()
        elif s.mask == "tril_float_long":
            hidden = self.bias[:T, :T].long() == 0
        elif s.mask == "runtime_causal":
            hidden = ~torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        elif s.mask == "arg_keep":
            hidden = ~mask
        elif s.mask == "arg_float01":
            hidden = mask == 0
        elif s.mask == "arg_additive" or s.mask in BIAS_MASKS:
            b = mask if s.mask == "arg_additive" else self.bias[:T, :T]
            if s.late_write == "bias":
                b = b.clone()
            att = att + b
            if s.late_write == "bias":
                b.mul_(0.5)
        if s.pad == "and":
            keep = pad[:, None, None, :] if hidden is None else ~hidden & pad[:, None, None, :]
            hidden = ~keep
        if hidden is not None:
            att = att.masked_fill(hidden, fill)
            if s.late_write == "mask":
                hidden.zero_()
        if s.pad == "additive":
                att = att + (1.0 - pad[:, None, None, :].to(att.dtype)) * fill
        p = F.softmax(att, dim=-1)
        if s.has_dropout:
            p = self.attn_dropout(p)
        y = (p @ v).transpose(1, 2).contiguous().view(B, T, C)
        out = self.o_proj(y)
        if s.norm == "ln_post":
            out = self.norm(out)
        return out
