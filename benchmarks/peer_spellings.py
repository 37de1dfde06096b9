"""The attention spellings of PyTorch's ``test/inductor/test_fused_attention.py``, re-expressed as small cases.

Each ``_test_sdpa_rewriter_N`` (and the ``prev_N``, symbolic-scale and ``13_non_transpose_permute`` tests) of
the peer suite builds one attention function and checks that Inductor's ``fuse_attention`` patterns fire on
it. Here each of those functions is written again, in our own words but with the same ops in the same order
(the spelling is what is measured), as a :class:`Spelling`; :func:`cases` expands the spellings into the
:class:`PeerCase` list the benchmark (``benchmarks/bench_peer.py``) and the tests run: one case per spelling,
dtype the peer test uses and mode (``eval``: no input requires grad and a ``training`` argument is False;
``train``: every floating input requires grad and ``training`` is True, where the peer test runs it).
Batch-size repeats of one spelling and the ``checkpoint_wrapper`` repeats are not separate cases (the
checkpointed ones are a higher-order-op capture question, issue 14 item 1).

Shapes follow the peer (``[4, 2, 16, 32]`` by default: after a ``permute(0, 2, 1, 3)`` that is 16 heads over
2 tokens). ``PEER_REFUSED`` lists the tests the peer asserts *not* to fuse: some are exact attention all the
same (a tensor or symbolic scale, an integer mask), one is a true look-alike (the probabilities are returned).

Importing this module touches only torch (tests import it too).

Example::

    >>> [c.name for c in cases() if c.peer_test == "_test_sdpa_rewriter_1"]
    ['rewriter_1 fp32 eval', 'rewriter_1 fp32 train', 'rewriter_1 fp16 eval', 'rewriter_1 fp16 train']
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

aten = torch.ops.aten

DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
SHAPE = (4, 2, 16, 32)  # the peer's default q, k, v shape


class PeerAttention(nn.Module):
    """``fn(*inputs)`` as a module (the peer compiles plain functions; attnopt.optimize takes modules)."""

    def __init__(self, fn: Callable[..., Any]):
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


# ----------------------------------------------------------------------------- the spellings
# Inputs are (q, k, v[, masks][, training]); layouts as in the peer test. ``training`` is a Python bool
# (the peer passes it the same way: dynamo specialises on it).

def _r1(q, k, v):  # sdpa_rewriter_1: matmul, .div(sqrt(d)), .softmax, .matmul
    return torch.matmul(q, k.transpose(-2, -1)).div(math.sqrt(k.shape[-1])).softmax(dim=-1).matmul(v)


def _r2(q, k, v):  # sdpa_rewriter_2: .mul(1/sqrt(d))
    return torch.matmul(q, k.transpose(-2, -1)).mul(1.0 / math.sqrt(k.shape[-1])).softmax(dim=-1).matmul(v)


def _r3(q, k, v, training):  # sdpa_rewriter_3: F.dropout(..., p=0.4, training=training) on the probabilities
    probs = torch.matmul(q, k.transpose(-2, -1)).div(3.0).softmax(dim=-1)
    return F.dropout(probs, p=0.4, training=training, inplace=False).matmul(v)


def _r4(q, k, v, training):  # sdpa_rewriter_4: .mul(0.4), p=0.2
    probs = torch.matmul(q, k.transpose(-2, -1)).mul(0.4).softmax(dim=-1)
    return F.dropout(probs, p=0.2, inplace=False, training=training).matmul(v)


def _bool_tril_filled(q, k, rows: int, cols: int):
    """The peer's bool mask: ``ones(bool).tril()`` then ``masked_fill(~m, -inf)`` *on the bool tensor*
    (so every element is True); added to float scores it is 1 everywhere."""
    keep = torch.ones(rows, cols, dtype=torch.bool, device=q.device).tril(diagonal=0)
    return keep.masked_fill(torch.logical_not(keep), -float("inf"))


def _r5_v1(q, k, v):  # sdpa_rewriter_5 v1: a bool mask added inside softmax
    mask = _bool_tril_filled(q, k, q.size(-2), k.size(-2))
    return torch.softmax((q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))) + mask, dim=-1) @ v


def _r5_v2(q, k, v):  # sdpa_rewriter_5 v2: an all-False bool mask (zeros(bool).bool()) added
    mask = torch.zeros(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).bool()
    return torch.softmax((q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))) + mask, dim=-1) @ v


def _r5_v3(q, k, v):  # sdpa_rewriter_5 v3: the scale is 1 / (sqrt(d) + 0.1)
    mask = _bool_tril_filled(q, k, q.size(-2), k.size(-2))
    return torch.softmax((q @ k.transpose(-2, -1) / (math.sqrt(q.size(-1)) + 0.1)) + mask, dim=-1) @ v


def _r6(q, k, v, training, extra: float = 0.0):  # sdpa_rewriter_6 (v2: extra=0.1): bool mask + dropout(0.5)
    mask = _bool_tril_filled(q, k, q.size(-2), k.size(-2))
    probs = torch.softmax((q @ k.transpose(-2, -1) / (math.sqrt(q.size(-1)) + extra)) + mask, dim=-1)
    return F.dropout(probs, 0.5, training) @ v


def _r7(q, k, v, training, extra: float = 0.0):  # sdpa_rewriter_7: fp16, scores to fp32, tiny dropout, back
    qh, kh, vh = (t.permute(0, 2, 1, 3) for t in (q, k, v))
    s = (qh @ kh.transpose(-2, -1) / (math.sqrt(qh.size(-1)) + extra)).to(torch.float32)
    probs = torch.dropout(torch.softmax(s, dim=-1), 0.00000000001, training).to(torch.float16)
    return probs @ vh


def _r8(q, k, v, extra: float = 0.0):  # sdpa_rewriter_8: as 7 without dropout
    qh, kh, vh = (t.permute(0, 2, 1, 3) for t in (q, k, v))
    s = (qh @ kh.transpose(-2, -1) / (math.sqrt(qh.size(-1)) + extra)).to(torch.float32)
    return torch.softmax(s, dim=-1).to(torch.float16) @ vh


def _r9(q, k, v, training, extra: float = 0.0):  # sdpa_rewriter_9: as 7 with the scale on q
    qh, kh, vh = (t.permute(0, 2, 1, 3) for t in (q, k, v))
    qh = qh / (math.sqrt(qh.size(-1)) + extra)
    s = (qh @ kh.transpose(-2, -1)).to(torch.float32)
    probs = torch.dropout(torch.softmax(s, dim=-1), 0.00000000001, training).to(torch.float16)
    return probs @ vh


def _r10(q, k, v, extra: float = 0.0):  # sdpa_rewriter_10: as 9 without dropout
    qh, kh, vh = (t.permute(0, 2, 1, 3) for t in (q, k, v))
    qh = qh / (math.sqrt(qh.size(-1)) + extra)
    s = (qh @ kh.transpose(-2, -1)).to(torch.float32)
    return torch.softmax(s, dim=-1).to(torch.float16) @ vh


def _r11(q, k, v):  # sdpa_rewriter_11: [B, T, H, D] inputs, transpose(1, 2)
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    return torch.matmul(qh, kh.transpose(-2, -1)).div(math.sqrt(k.shape[-1])).softmax(dim=-1).matmul(vh)


def _r12(q, k, v, training):  # sdpa_rewriter_12: as 11 with dropout(0.4) on the probabilities
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    probs = torch.matmul(qh, kh.transpose(-2, -1)).div(math.sqrt(k.shape[-1])).softmax(dim=-1)
    return F.dropout(probs, p=0.4, training=training, inplace=False).matmul(vh)


def _prev13(q, k, v):  # sdpa_prev_13: .clone() of the probabilities
    return torch.matmul(q, k.transpose(-2, -1)).div(math.sqrt(k.shape[-1])).softmax(dim=-1).clone().matmul(v)


def _prev14(q, k, v):  # sdpa_prev_14: .mul(1/sqrt(d)) and .clone()
    s = torch.matmul(q, k.transpose(-2, -1)).mul(1.0 / math.sqrt(k.shape[-1]))
    return s.softmax(dim=-1).clone().matmul(v)


def _prev15(q, k, v):  # sdpa_prev_15: transpose(1, 2) layout and .clone()
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    return torch.matmul(qh, kh.transpose(-2, -1)).div(math.sqrt(k.shape[-1])).softmax(dim=-1).clone().matmul(vh)


def _r13(q, k, v, training):  # sdpa_rewriter_13: 3-D bmm, no scale, dropout(0.5)
    probs = torch.bmm(q, k.transpose(1, 2)).softmax(dim=-1)
    return torch.bmm(F.dropout(probs, p=0.5, training=training), v)


def _r13_permute(q, k, v, training):  # sdpa_rewriter_13_non_transpose_permute: k given as [T, B, D]
    probs = torch.bmm(q, k.permute(1, 2, 0)).softmax(dim=-1)
    return torch.bmm(F.dropout(probs, p=0.5, training=training), v)


def _r14(q, k, v):  # sdpa_rewriter_14: bool mask from query.size(1), permuted layout, .div(3.0) + mask
    mask = _bool_tril_filled(q, k, q.size(1), k.size(1))
    qh, kh, vh = (t.permute(0, 2, 1, 3) for t in (q, k, v))
    return (torch.matmul(qh, kh.transpose(-2, -1)).div(3.0) + mask).softmax(dim=-1).matmul(vh)


def _padding_like(q, kh, scores):
    """The peer's per-batch key mask: ``ones(B, Tk).tril() == 0`` viewed [B, 1, 1, Tk] and ``expand_as(scores)``."""
    b, tk = q.size(0), kh.size(-2)
    keep = torch.ones(b, tk, dtype=torch.bool, device=q.device).tril(diagonal=0)
    return (keep == 0).view((b, 1, 1, tk)).expand_as(scores)


def _r15(q, k, v):  # sdpa_rewriter_15: masked_fill with a mask expanded to the scores' shape
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    scores = torch.matmul(qh, kh.transpose(-2, -1)) / 3.0
    scores = scores.masked_fill(_padding_like(qh, kh, scores), -float("inf"))
    return torch.matmul(F.softmax(scores, dim=-1), vh)


def _r16(q, k, v, training):  # sdpa_rewriter_16: as 14 with dropout(0.4) and .to(query.dtype)
    mask = _bool_tril_filled(q, k, q.size(1), k.size(1))
    qh, kh, vh = (t.permute(0, 2, 1, 3) for t in (q, k, v))
    probs = (torch.matmul(qh, kh.transpose(-2, -1)).div(3.0) + mask).softmax(dim=-1)
    return F.dropout(probs, p=0.4, training=training, inplace=False).to(dtype=q.dtype).matmul(vh)


def _r16_fp32_mask(q, k, v, training):  # sdpa_rewriter_16_fp32_mask: a random float mask drawn in forward
    mask = torch.randn(q.size(1), k.size(1), dtype=torch.float, device=q.device).tril(diagonal=0)
    qh, kh, vh = (t.permute(0, 2, 1, 3) for t in (q, k, v))
    probs = (torch.matmul(qh, kh.transpose(-2, -1)).div(3.0) + mask).softmax(dim=-1)
    return F.dropout(probs, p=0.4, training=training, inplace=False).to(dtype=q.dtype).matmul(vh)


def _r17(q, k, v, training):  # sdpa_rewriter_17: as 15 with dropout(0.4)
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    scores = torch.matmul(qh, kh.transpose(-2, -1)) / 3.0
    scores = scores.masked_fill(_padding_like(qh, kh, scores), -float("inf"))
    return torch.matmul(F.dropout(F.softmax(scores, dim=-1), p=0.4, training=training, inplace=False), vh)


def _r18(q, k, v, causal, extra: float = 0.0):  # sdpa_rewriter_18 (GPT-2): 0-d tensor scale, where(.., finfo.min)
    qh, kh, vh = (t.permute([0, 2, 1, 3]) for t in (q, k, v))
    s = torch.matmul(qh, kh.permute(0, 1, 3, 2))
    s = s.div(torch.full((), math.sqrt(vh.size(-1)) + extra, dtype=qh.dtype, device=qh.device))
    fill = torch.full((), torch.finfo(qh.dtype).min, dtype=qh.dtype, device=qh.device)
    s = torch.where(causal, s, fill)
    return F.dropout(s.softmax(dim=-1), 0.0).matmul(vh), kh.permute([0, 2, 1, 3]), vh.permute([0, 2, 1, 3])


def _r19(q, k, v, causal, bias, training, extra: float = 0.0):  # sdpa_rewriter_19: 18 plus an added float mask
    s = torch.matmul(q, k.permute(0, 1, 3, 2))
    s = s.div(torch.full((), math.sqrt(v.size(-1)) + extra, dtype=s.dtype, device=s.device))
    fill = torch.full((), torch.finfo(q.dtype).min, dtype=q.dtype, device=q.device)
    s = torch.where(causal, s, fill) + bias
    probs = s.softmax(dim=-1).type(v.dtype)
    return F.dropout(probs, p=0.4, training=training, inplace=False).matmul(v)


def _r20(q, k, v, training):  # sdpa_rewriter_20: as 17 with the scale on q
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    qh = qh / math.sqrt(qh.size(-1))
    scores = torch.matmul(qh, kh.transpose(-2, -1))
    scores = scores.masked_fill(_padding_like(qh, kh, scores), -float("inf"))
    return torch.matmul(F.dropout(F.softmax(scores, dim=-1), p=0.4, training=training, inplace=False), vh)


def _hf_scores(q, k, v, mask):  # the HF-style body of 21-27: scores += mask, .float().softmax().type(v.dtype)
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    scores = torch.matmul(qh, kh.permute(0, 1, 3, 2))
    scores += mask
    return scores.float().softmax(dim=-1).type(vh.dtype), kh, vh


def _r21(q, k, v, mask):  # sdpa_rewriter_21: an added [1, 1, 1, Tk] mask, in place
    probs, _, vh = _hf_scores(q, k, v, mask)
    return probs.matmul(vh)


def _r22(q, k, v, mask):  # sdpa_rewriter_22: as 21, also returning k and v
    probs, kh, vh = _hf_scores(q, k, v, mask)
    return probs.matmul(vh), kh, vh


def _r23(q, k, v):  # sdpa_rewriter_23: the mask is full((1, 1, 1, Tk), 0.0) built in forward
    probs, kh, vh = _hf_scores(q, k, v, torch.full((1, 1, 1, 2), 0.0, device=q.device))
    return probs.matmul(vh), kh, vh


def _r24(q, k, v, mask):  # sdpa_rewriter_24: 3-D bmm, the scores viewed 4-D for the mask and back
    b, h, t, d = q.size(0), q.size(1), q.size(2), q.size(3)
    q3, k3, v3 = q.view(b * h, t, d), k.reshape(b * h, t, d), v.reshape(b * h, t, d)
    s = torch.bmm(q3, k3.transpose(1, 2))
    s = (s.view(b, h, t, t) + mask).view(b * h, t, t)
    return torch.bmm(F.softmax(s, dim=-1), v3).view(b, h, t, d)


def _r25(q, k, v, mask, training):  # sdpa_rewriter_25: fp16, an fp16 mask, dropout(0.1)
    probs, _, vh = _hf_scores(q, k, v, mask)
    return F.dropout(probs, p=0.1, training=training).matmul(vh)


def _r26(q, k, v, mask, training):  # sdpa_rewriter_26: as 25, also returning k and v
    probs, kh, vh = _hf_scores(q, k, v, mask)
    return F.dropout(probs, p=0.1, training=training).matmul(vh), kh, vh


def _r27(q, k, v, training):  # sdpa_rewriter_27: as 26 with an fp16 zero mask built in forward
    probs, kh, vh = _hf_scores(q, k, v, torch.full((1, 1, 1, 2), 0.0, dtype=torch.half, device=q.device))
    return F.dropout(probs, p=0.1, training=training).matmul(vh), kh, vh


def _r28(qkv, training):  # sdpa_rewriter_28: one [B, 3, H, D, T] tensor, permute + unbind, .mul(0.2)
    q, k, v = qkv.permute(1, 0, 2, 4, 3).unbind(0)
    probs = torch.matmul(q, k.transpose(-2, -1)).mul(0.2).softmax(dim=-1)
    return F.dropout(probs, p=0.1, training=training).matmul(v)


def _r29(q, k, v, with_mask: bool = True):  # sdpa_rewriter_29/30: aten.mul.Scalar on q and k^T, aten._safe_softmax
    qh, kh, vh = (t.permute(0, 2, 1, 3) for t in (q, k, v))
    scale = 1.0 / q.size(-1) ** 0.5
    s = aten.mul.Scalar(qh, scale) @ aten.mul.Scalar(kh.transpose(-2, -1), scale)
    if with_mask:
        s = s + torch.zeros(1, 1, q.size(1), k.size(1), device=q.device, dtype=q.dtype)
    return aten._safe_softmax(s, -1) @ vh


def _symint_scale(q, k, v):  # pattern_fuses_with_symint_scale: / (B // 2) under dynamic B, bool mask added
    scale = q.size(0) // 2
    mask = _bool_tril_filled(q, k, q.size(-2), k.size(-2))
    return torch.softmax(q @ k.transpose(-2, -1) / scale + mask, dim=-1) @ v


def _symint_scale_div(q, k, v):  # pattern_fuses_with_symint_scale_div: .div(B // 2)
    return torch.matmul(q, k.transpose(-2, -1)).div(q.size(0) // 2).softmax(dim=-1).matmul(v)


# the peer's refused tests

def _reuse(q, k, v):  # pattern_fails_with_reuse: the probabilities are returned (a true look-alike)
    probs = torch.matmul(q, k.transpose(-2, -1)).div(math.sqrt(k.shape[-1])).softmax(dim=-1)
    return probs.matmul(v), probs


def _tensor_factor(q, k, v, factor, inverse: bool):  # pattern_fails_with_tensor_factor: a per-head [H, 1, 1] factor
    factor = factor.detach()
    s = torch.matmul(q, k.transpose(-2, -1))
    s = s.div(factor) if inverse else s.mul(factor)
    return s.softmax(dim=-1).matmul(v)


def _tensor_scale(q, k, v, mask, scale):  # pattern_fails_with_tensor_scale: a 0-d tensor input as the scale
    scale = scale.detach()
    return torch.softmax(q @ k.transpose(-2, -1) / scale + mask, dim=-1) @ v


def _symfloat_scale(q, k, v, mask):  # pattern_fails_with_symfloat_scale: / B ** 0.5 under dynamic B
    return torch.softmax(q @ k.transpose(-2, -1) / q.size(0) ** 0.5 + mask, dim=-1) @ v


def _unsupported_mask(q, k, v, mask):  # pattern_fails_with_unsupported_mask: an int tensor or a float added
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)) + mask, dim=-1) @ v


# ----------------------------------------------------------------------------- inputs

def _randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype)


def _qkv(dtype: torch.dtype, shape: tuple[int, ...] = SHAPE) -> tuple[torch.Tensor, ...]:
    return tuple(_randn(*shape, dtype=dtype) for _ in range(3))


def _tril(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril(diagonal=0)


@dataclass(frozen=True)
class Spelling:
    """One peer test's attention function: how to build its inputs, and where the peer runs it."""

    name: str
    peer_test: str
    fn: Callable[..., Any]
    inputs: Callable[[torch.dtype], tuple[Any, ...]]  # tensors and masks (not the training flag)
    dtypes: tuple[str, ...] = ("fp32",)
    train: bool = True  # the peer also runs it with gradients (check_train)
    dropout: bool = False  # a ``training`` flag follows the inputs
    dynamic: bool = False  # dim 0 of q, k, v marked dynamic (the peer's dynamic-shape tests)
    peer_positive: bool = True  # the peer expects its patterns to fuse it
    must_refuse: bool = False  # a look-alike: nobody may rewrite it
    freezing: bool = False  # the peer runs it under inductor's ``freezing`` (and ``no_grad``)
    notes: str = ""


def _partial(fn: Callable[..., Any], **kw: Any) -> Callable[..., Any]:
    def bound(*args: Any) -> Any:
        return fn(*args, **kw)

    bound.__name__ = fn.__name__
    return bound


SPELLINGS: tuple[Spelling, ...] = (
    Spelling("rewriter_1", "_test_sdpa_rewriter_1", _r1, _qkv, ("fp32", "fp16")),
    Spelling("rewriter_1_freezing", "_test_sdpa_rewriter_1_freezing", _r1, _qkv, ("fp16",), train=False,
             freezing=True),
    Spelling("rewriter_2", "_test_sdpa_rewriter_2", _r2, _qkv),
    Spelling("rewriter_3", "_test_sdpa_rewriter_3", _r3, _qkv, dropout=True),
    Spelling("rewriter_4", "_test_sdpa_rewriter_4", _r4, _qkv, dropout=True),
    Spelling("rewriter_5_v1", "_test_sdpa_rewriter_5", _r5_v1, _qkv),
    Spelling("rewriter_5_v2", "_test_sdpa_rewriter_5", _r5_v2, _qkv),
    Spelling("rewriter_5_v3", "_test_sdpa_rewriter_5", _r5_v3, _qkv),
    Spelling("rewriter_6", "_test_sdpa_rewriter_6", _r6, _qkv, dropout=True),
    Spelling("rewriter_6_v2", "_test_sdpa_rewriter_6", _partial(_r6, extra=0.1), _qkv, dropout=True),
    Spelling("rewriter_7", "_test_sdpa_rewriter_7", _r7, lambda dt: _qkv(dt, (2, 8, 4, 16)), ("fp16",),
             dropout=True),
    Spelling("rewriter_7_v2", "_test_sdpa_rewriter_7", _partial(_r7, extra=0.1), lambda dt: _qkv(dt, (2, 8, 4, 16)),
             ("fp16",), dropout=True),
    Spelling("rewriter_8", "_test_sdpa_rewriter_8", _r8, lambda dt: _qkv(dt, (2, 8, 4, 16)), ("fp16",)),
    Spelling("rewriter_8_v2", "_test_sdpa_rewriter_8", _partial(_r8, extra=0.1), lambda dt: _qkv(dt, (2, 8, 4, 16)),
             ("fp16",)),
    Spelling("rewriter_9", "_test_sdpa_rewriter_9", _r9, lambda dt: _qkv(dt, (2, 8, 4, 16)), ("fp16",),
             dropout=True),
    Spelling("rewriter_9_v2", "_test_sdpa_rewriter_9", _partial(_r9, extra=0.1), lambda dt: _qkv(dt, (2, 8, 4, 16)),
             ("fp16",), dropout=True),
    Spelling("rewriter_10", "_test_sdpa_rewriter_10", _r10, lambda dt: _qkv(dt, (2, 8, 4, 16)), ("fp16",)),
    Spelling("rewriter_10_v2", "_test_sdpa_rewriter_10", _partial(_r10, extra=0.1),
             lambda dt: _qkv(dt, (2, 8, 4, 16)), ("fp16",)),
    Spelling("rewriter_11", "_test_sdpa_rewriter_11", _r11, _qkv),
    Spelling("rewriter_12", "_test_sdpa_rewriter_12", _r12, _qkv, dropout=True),
    Spelling("prev_13", "_test_sdpa_prev_13", _prev13, _qkv, train=False),
    Spelling("prev_14", "_test_sdpa_prev_14", _prev14, _qkv, train=False),
    Spelling("prev_15", "_test_sdpa_prev_15", _prev15, _qkv, train=False),
    Spelling("rewriter_13", "_test_sdpa_rewriter_13", _r13, lambda dt: _qkv(dt, (4, 8, 16)), ("fp32", "fp16"),
             train=False, dropout=True, notes="fp32 on CPU, fp16 on GPU in the peer"),
    Spelling("rewriter_13_non_transpose_permute", "_test_sdpa_rewriter_13_non_transpose_permute", _r13_permute,
             lambda dt: (_randn(8, 3, 4, dtype=dt), _randn(3, 8, 4, dtype=dt), _randn(8, 3, 4, dtype=dt)),
             train=False, dropout=True, peer_positive=False,
             notes="the peer asserts that it does not fuse; exact attention all the same"),
    Spelling("rewriter_14", "_test_sdpa_rewriter_14", _r14, _qkv),
    Spelling("rewriter_15", "_test_sdpa_rewriter_15", _r15, _qkv, train=False),
    Spelling("rewriter_16", "_test_sdpa_rewriter_16", _r16, _qkv, dropout=True),
    Spelling("rewriter_16_fp32_mask", "_test_sdpa_rewriter_16_fp32_mask", _r16_fp32_mask, _qkv, dropout=True),
    Spelling("rewriter_17", "_test_sdpa_rewriter_17", _r17, _qkv, train=False, dropout=True),
    Spelling("rewriter_18", "_test_sdpa_rewriter_18", _r18, lambda dt: (*_qkv(dt), _tril(2)), train=False),
    Spelling("rewriter_18_v2", "_test_sdpa_rewriter_18", _partial(_r18, extra=0.1),
             lambda dt: (*_qkv(dt), _tril(2)), train=False),
    Spelling("rewriter_19", "_test_sdpa_rewriter_19", _r19, lambda dt: (*_qkv(dt), _tril(16), _randn(16, 16)),
             train=False, dropout=True),
    Spelling("rewriter_19_v2", "_test_sdpa_rewriter_19", _partial(_r19, extra=0.1),
             lambda dt: (*_qkv(dt), _tril(16), _randn(16, 16)), train=False, dropout=True),
    Spelling("rewriter_20", "_test_sdpa_rewriter_20", _r20, _qkv, train=False, dropout=True),
    Spelling("rewriter_21", "_test_sdpa_rewriter_21", _r21, lambda dt: (*_qkv(dt), _randn(1, 1, 1, 2)),
             train=False),
    Spelling("rewriter_22", "_test_sdpa_rewriter_22", _r22, lambda dt: (*_qkv(dt), _randn(1, 1, 2, 2)),
             train=False),
    Spelling("rewriter_23", "_test_sdpa_rewriter_23", _r23, _qkv, train=False),
    Spelling("rewriter_24", "_test_sdpa_rewriter_24", _r24, lambda dt: (*_qkv(dt), _randn(1, 1, 16, 16)),
             train=False),
    Spelling("rewriter_25", "_test_sdpa_rewriter_25", _r25,
             lambda dt: (*_qkv(dt), _randn(1, 1, 1, 2, dtype=dt)), ("fp16",), dropout=True),
    Spelling("rewriter_26", "_test_sdpa_rewriter_26", _r26,
             lambda dt: (*_qkv(dt), _randn(1, 1, 1, 2, dtype=dt)), ("fp16",), dropout=True),
    Spelling("rewriter_27", "_test_sdpa_rewriter_27", _r27, _qkv, ("fp16",), dropout=True),
    Spelling("rewriter_28", "_test_sdpa_rewriter_28", _r28, lambda dt: (_randn(2, 3, 4, 16, 8, dtype=dt),),
             ("fp16",), dropout=True),
    Spelling("rewriter_29", "_test_sdpa_rewriter_29", _r29, lambda dt: _qkv(dt, (2, 8, 4, 16)), ("fp16", "fp32")),
    Spelling("rewriter_30", "_test_sdpa_rewriter_30", _partial(_r29, with_mask=False),
             lambda dt: _qkv(dt, (2, 8, 4, 16)), ("fp16", "fp32")),
    Spelling("symint_scale", "_test_pattern_fuses_with_symint_scale", _symint_scale,
             lambda dt: _qkv(dt, (8, 4, 4, 4)), dynamic=True),
    Spelling("symint_scale_div", "_test_pattern_fuses_with_symint_scale_div", _symint_scale_div,
             lambda dt: _qkv(dt, (8, 4, 4, 4)), dynamic=True),
)

#: The peer's tests that assert no fusion. All but ``reuse`` are exact attention (attnopt may rewrite them).
PEER_REFUSED: tuple[Spelling, ...] = (
    Spelling("fails_with_reuse", "_test_pattern_fails_with_reuse", _reuse, lambda dt: _qkv(dt, (2, 4, 8, 16)),
             train=False, peer_positive=False, must_refuse=True, notes="the probabilities are returned"),
    Spelling("fails_with_tensor_factor_div", "_test_pattern_fails_with_tensor_factor",
             _partial(_tensor_factor, inverse=True),
             lambda dt: (*_qkv(dt, (2, 4, 4, 4)), _randn(4, 1, 1)), peer_positive=False),
    Spelling("fails_with_tensor_factor_mul", "_test_pattern_fails_with_tensor_factor",
             _partial(_tensor_factor, inverse=False),
             lambda dt: (*_qkv(dt, (2, 4, 4, 4)), _randn(4, 1, 1)), peer_positive=False),
    Spelling("fails_with_tensor_scale", "_test_pattern_fails_with_tensor_scale", _tensor_scale,
             lambda dt: (*_qkv(dt, (2, 4, 4, 4)), _randn(1, 1, 4, 4), torch.tensor(0.5)), peer_positive=False),
    Spelling("fails_with_symfloat_scale", "_test_pattern_fails_with_symfloat_scale", _symfloat_scale,
             lambda dt: (*_qkv(dt, (8, 4, 4, 4)), _randn(1, 1, 4, 4)), dynamic=True, peer_positive=False),
    Spelling("fails_with_int_mask", "_test_pattern_fails_with_unsupported_mask", _unsupported_mask,
             lambda dt: (*_qkv(dt, (2, 4, 4, 4)), _randn(2, 4, 4, 4).to(torch.int)), train=False,
             peer_positive=False),
    Spelling("fails_with_float_added", "_test_pattern_fails_with_unsupported_mask", _unsupported_mask,
             lambda dt: (*_qkv(dt, (2, 4, 4, 4)), 2.0), train=False, peer_positive=False),
)


@dataclass(frozen=True)
class PeerCase:
    """One (spelling, dtype, mode) of the peer suite: what the benchmark runs and the tests check."""

    name: str
    spelling: Spelling
    dtype: torch.dtype
    train: bool
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def peer_test(self) -> str:
        return self.spelling.peer_test

    @property
    def dropout(self) -> bool:
        return self.spelling.dropout

    def build(self, seed: int = 0) -> tuple[nn.Module, tuple[Any, ...]]:
        """(module, example inputs): fresh tensors from ``seed``; in ``train`` every floating tensor requires grad
        and the ``training`` flag is True."""
        gen_state = torch.random.get_rng_state()
        try:
            torch.manual_seed(seed)
            inputs = list(self.spelling.inputs(self.dtype))
        finally:
            torch.random.set_rng_state(gen_state)
        if self.train:
            inputs = [x.requires_grad_(True) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                      for x in inputs]
        if self.spelling.dropout:
            inputs.append(self.train)
        module = PeerAttention(self.spelling.fn)
        module.train(self.train)
        return module, tuple(inputs)


def _expand(spellings: tuple[Spelling, ...]) -> list[PeerCase]:
    out = []
    for s in spellings:
        for dt in s.dtypes:
            for train in (False, True) if s.train else (False,):
                out.append(PeerCase(f"{s.name} {dt} {'train' if train else 'eval'}", s, DTYPES[dt], train))
    return out


def cases() -> list[PeerCase]:
    """Every positive case of the peer suite (the tests that expect a fusion, and 13_non_transpose_permute)."""
    return _expand(SPELLINGS)


def refused_cases() -> list[PeerCase]:
    """The peer's own refused tests, as cases (reported apart from the positive total)."""
    return _expand(PEER_REFUSED)


__all__ = ["PEER_REFUSED", "SPELLINGS", "PeerAttention", "PeerCase", "Spelling", "cases", "refused_cases"]
