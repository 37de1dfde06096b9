"""The reference computation in blocks of query rows (no gradients, no dropout, large scores) equals it in one piece.

The threshold is lowered so small shapes take the blocked path; hypothesis draws the masks (bool or float, per row
or broadcast over rows, with fully masked rows), causal and windowed alignments, GQA, cross-attention lengths,
score floors and zeroed probabilities.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import attnopt.kernels.reference as ref
from attnopt.kernels.reference import reference_attention


def _one_piece(monkeypatch, **kw):
    monkeypatch.setattr(ref, "_CHUNK_FROM", 1 << 62)
    try:
        return reference_attention(**kw)
    finally:
        monkeypatch.undo()


def _blocked(monkeypatch, **kw):
    calls = []
    attend = ref._attend

    def counting(*a, **k):
        calls.append(a[0].size(-2))
        return attend(*a, **k)

    monkeypatch.setattr(ref, "_CHUNK_FROM", 0)
    monkeypatch.setattr(ref, "_CHUNK_BYTES", 1)  # one row per block
    monkeypatch.setattr(ref, "_attend", counting)
    try:
        return reference_attention(**kw), calls
    finally:
        monkeypatch.undo()


@given(b=st.integers(1, 2), h=st.sampled_from([1, 2, 4]), kv=st.sampled_from([1, 2]), tq=st.integers(2, 9),
       tk=st.integers(1, 9), mask=st.sampled_from(["none", "bool_rows", "bool_keys", "float_rows", "float_keys", "2d"]),
       causal=st.booleans(), window=st.sampled_from([None, 1, 3]), floor=st.sampled_from([None, "maximum", "clamp"]),
       zero=st.booleans(), split=st.booleans(), seed=st.integers(0, 2**16))
def test_blocks_equal_one_piece(b, h, kv, tq, tk, mask, causal, window, floor, zero, split, seed):
    monkeypatch = pytest.MonkeyPatch()
    gen = torch.Generator().manual_seed(seed)
    hk = h // kv if h % kv == 0 else h
    q = torch.randn(b, h, tq, 8, generator=gen)
    k, v = torch.randn(b, hk, tk, 8, generator=gen), torch.randn(b, hk, tk, 8, generator=gen)
    if split:  # heads split from (B, T, H, D) by a transpose, as models lay them out
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    m = None
    if mask.startswith("bool"):
        m = torch.rand(b, 1, tq if mask == "bool_rows" else 1, tk, generator=gen) > 0.3
    elif mask.startswith("float"):
        m = torch.randn(b, 1, tq if mask == "float_rows" else 1, tk, generator=gen)
        m = m.masked_fill(torch.rand(m.shape, generator=gen) < 0.3, float("-inf"))
    elif mask == "2d":
        m = torch.randn(tq, tk, generator=gen)
    kw = dict(q=q, k=k, v=v, attn_mask=m, is_causal=causal, scale=0.3, enable_gqa=hk != h,
              window=window if causal else None, score_floor=floor,
              zero_probs=(torch.rand(b, 1, tq, tk, generator=gen) < 0.2) if zero else None)
    with torch.no_grad():
        whole = _one_piece(monkeypatch, **kw)
        blocks, calls = _blocked(monkeypatch, **kw)
    assert calls == [1] * tq  # one block per query row
    assert whole.shape == blocks.shape and whole.dtype == blocks.dtype
    assert torch.equal(whole.isnan(), blocks.isnan())  # rows with every key masked: NaN in both
    torch.testing.assert_close(blocks, whole, equal_nan=True, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("case", ["grad", "dropout", "score_mod", "small", "subclass", "compiling"])
def test_one_piece_where_blocks_would_change_something(case, monkeypatch):
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    kw: dict = dict(is_causal=True)
    if case == "grad":
        q.requires_grad_()
    elif case == "dropout":
        kw["dropout_p"] = 0.5  # its draws would come in another order
    elif case == "score_mod":
        kw["score_mod"] = lambda s, b, h, qi, ki: s + qi - ki  # it may hold tensors of the whole scores' shape
    elif case == "subclass":
        q = torch.nn.Parameter(q)
    elif case == "compiling":  # traced, the shapes may be symbolic and the loop would unroll
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    calls = []
    attend = ref._attend
    monkeypatch.setattr(ref, "_attend", lambda *a, **k_: (calls.append(1), attend(*a, **k_))[1])
    monkeypatch.setattr(ref, "_CHUNK_BYTES", 1)
    monkeypatch.setattr(ref, "_CHUNK_FROM", 10**9 if case == "small" else 0)
    with torch.no_grad() if case not in ("grad", "subclass") else torch.enable_grad():
        reference_attention(q, k, v, **kw)
    assert calls == [1]


def test_inputs_blocks_would_read_otherwise_stay_in_one_piece(monkeypatch):
    monkeypatch.setattr(ref, "_CHUNK_FROM", 0)
    monkeypatch.setattr(ref, "_CHUNK_BYTES", 1)
    q, k = torch.randn(2, 3, 6, 4), torch.randn(2, 3, 6, 4)
    with torch.no_grad():
        # a 1-D v: the product gives (..., Tq), whose rows blocks would join along the heads
        assert reference_attention(q, k, torch.randn(6)).shape == (2, 3, 6)
        # mask rows that match neither the queries nor one row: an error, as in one piece (not broadcast per block)
        with pytest.raises(RuntimeError, match="must match"):
            reference_attention(torch.randn(2, 3, 5, 4), torch.randn(2, 3, 7, 4), torch.randn(2, 3, 7, 4),
                                attn_mask=torch.randn(3, 7))
        # nested and sparse tensors hold no strided rows
        nested = torch.nested.nested_tensor([torch.randn(2, 5, 4), torch.randn(3, 5, 4)])
        assert reference_attention(nested, nested, nested).is_nested
        sparse_k = torch.randn(6, 4).to_sparse()
        assert reference_attention(torch.randn(6, 4), sparse_k, torch.randn(6, 4)).shape == (6, 4)
