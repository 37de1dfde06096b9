"""Key biases in the KV cache: a term per key added to the scores (ALiBi's ``slope * j``), kept with the keys.

``scores + bias + causal`` with ``bias`` shaped ``(..., 1, T)``, one value per key computed from that key's
position (and token) alone, is causal attention whose every key carries its own term. The cache writes the term
at the key's position, as it writes the key, and adds the cached terms to the scores at every call. Covered:

* the term subtracted (``s - b``, ``(q @ k^T - b) / sqrt(d)``);
* the term added before the mask, folded into it (``masked_fill(bias, ~tril, -inf)``, Falcon's), scaled after
  the sum (``(s + b) * f``), per head folded into the batch (``baddbmm(bias, q, k^T)``, BLOOM's);
* a term read from a key's own token (a learnt gate per key), in a sliding window, in ragged batches;
* Hugging Face BLOOM and Falcon with ALiBi;
* a term relative to the last key read from the end of a table built in forward, MPT's
  ``table[..., max(0, S - T):]`` with ``table = slope * arange(1 - S, 1)``: ``slope * (j - T + 1)`` is
  ``slope * j`` up to a constant per row, which softmax ignores, so the cache keeps ``slope * j``;
* refused: the same term computed from the length (``slope * (j - (T - 1))``), read from a buffer (it may
  change) or from a table that is not affine, a term per query and key (``slope * (j - i)``), a term per key
  that is not finite at a call.
"""

from __future__ import annotations

import contextlib
import math
import types

import pytest
import torch
import torch.nn as nn
from test_generation_spellings import V, assert_cached_exactly

import attnopt
from attnopt import generation
from attnopt.generation import PositionError, cached, generate, generate_plain
from attnopt.pipeline import kv

C, H = 16, 4
D = C // H


def slopes(h: int) -> torch.Tensor:
    return torch.tensor([2.0 ** (-8 * (i + 1) / h) for i in range(h)])


class Alibi(nn.Module):
    """A GPT with ALiBi (no position table): ``how`` picks the spelling of the bias."""

    def __init__(self, how: str = "add", block_size: int = 24, window: int | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.how, self.window = how, window
        self.config = types.SimpleNamespace(block_size=block_size)  # nanoGPT's: no position table to read it from
        self.wte = nn.Embedding(V, C)
        self.qkv, self.proj, self.head = nn.Linear(C, 3 * C), nn.Linear(C, C), nn.Linear(C, V)
        self.gate = nn.Linear(C, H)
        self.register_buffer("slopes", slopes(H))
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size, dtype=torch.bool)))
        self.register_buffer("table", torch.arange(block_size, dtype=torch.float32))

    def forward(self, idx):
        B, T = idx.shape
        x = self.wte(idx)
        q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in self.qkv(x).split(C, 2))
        keep = self.bias[:T, :T]
        if self.window is not None:
            i = torch.arange(T, device=idx.device)
            keep = keep & (i[None, :] > i[:, None] - self.window)
        pos = torch.arange(T, device=idx.device, dtype=torch.float32)
        alibi = self.slopes[:, None, None] * pos  # (H, 1, T): one value per key
        s = (q @ k.transpose(-2, -1)) / math.sqrt(D)
        if self.how == "add":
            att = (s + alibi).masked_fill(~keep, float("-inf"))
        elif self.how == "sub":  # the term subtracted (a negative slope spelled as a minus)
            att = (s - (-alibi)).masked_fill(~keep, float("-inf"))
        elif self.how == "sub_scaled":  # subtracted, then the sum scaled
            att = ((q @ k.transpose(-2, -1) - alibi) / math.sqrt(D)).masked_fill(~keep, float("-inf"))
        elif self.how == "mask_first":
            att = s.masked_fill(~keep, float("-inf")) + alibi
        elif self.how == "folded":  # the term with the causal mask filled into it, then added
            att = s + torch.masked_fill(alibi, ~keep, torch.finfo(s.dtype).min)
        elif self.how == "scaled":  # (s + b) * f
            att = ((q @ k.transpose(-2, -1) + alibi) * (1 / math.sqrt(D))).masked_fill(~keep, float("-inf"))
        elif self.how == "table":  # a term read from a position table
            att = (s + self.slopes[:, None, None] * self.table[:T]).masked_fill(~keep, float("-inf"))
        elif self.how == "gate":  # a term from each key's own token
            g = torch.sigmoid(self.gate(x)).transpose(1, 2)[:, :, None, :]  # (B, H, 1, T)
            att = (s + g * alibi).masked_fill(~keep, float("-inf"))
        elif self.how == "from_end":  # MPT's: relative to the last key, changes with the length
            att = (s + self.slopes[:, None, None] * (pos - (T - 1))).masked_fill(~keep, float("-inf"))
        elif self.how == "end_bent":  # one steep row, and a row bent where only the steep row's size hides it
            S = self.config.block_size
            rel = torch.arange(1 - S, 1, device=idx.device).float()
            slopes = torch.where(torch.arange(H) == 0, 1e6, 0.5)
            i = torch.arange(S)
            bend = torch.where((torch.arange(H)[:, None] == 1) & (i % 2 == 0) & (i > 0) & (i < S - 4), 5.0, 0.0)
            term = (rel * slopes[:, None] + bend)[:, None, :][:, :, S - T:]
            att = (s + term).masked_fill(~keep, float("-inf"))
        elif self.how == "end_far_bend":  # a table twice the declared length, bent beyond what 24 keys read
            S = 2 * self.config.block_size
            slopes = 1.0 / torch.pow(2, torch.arange(1, H + 1, device=idx.device).float() * (8 / H))
            rel = torch.arange(1 - S, 1, device=idx.device).float()
            bend = torch.where(torch.arange(S, device=idx.device) < S // 2, 3.0, 0.0)
            att = (s + ((rel + bend) * slopes[:, None])[:, None, S - T:]).masked_fill(~keep, float("-inf"))
        elif self.how == "end_sub":  # MPT's table with the slopes' sign turned over, subtracted
            S = self.config.block_size
            slopes = 1.0 / torch.pow(2, torch.arange(1, H + 1, device=idx.device).float() * (8 / H))
            rel = torch.arange(1 - S, 1, dtype=torch.int32, device=idx.device)
            table = (rel.view(1, S) * -slopes[:, None])[:, None, :]
            att = (s - table[:, :, S - T:]).masked_fill(~keep, float("-inf"))
        elif self.how.startswith("end_"):  # MPT's: a table built in forward, read from its end (changes with T)
            S = self.config.block_size
            if self.how == "end_buffer":  # from a buffer, which may change: refused
                slopes = self.slopes
            else:
                slopes = 1.0 / torch.pow(2, torch.arange(1, H + 1, device=idx.device).float() * (8 / H))
            rel = torch.arange(1 - S, 1, dtype=torch.int32, device=idx.device)
            table = (rel.view(1, S) ** 2 * -0.01 if self.how == "end_square" else rel.view(1, S)) * slopes[:, None]
            table = table[:, None, :]  # (H, 1, S)
            if self.how == "end_max":  # MPT's spelling: max(0, size - length) on both axes
                term = table[:, max(0, table.size(1) - T):, max(0, S - T):]
            else:
                term = table[:, :, S - T:]
            att = (s + term).masked_fill(~keep, float("-inf"))
        elif self.how == "relative":  # per query and key: (T, T)
            rel = (pos[None, :] - pos[:, None]).clamp(max=0)
            att = (s + self.slopes[:, None, None] * rel).masked_fill(~keep, float("-inf"))
        else:
            raise ValueError(self.how)
        y = (att.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C)
        return self.head(x + self.proj(y))


class Bloomish(Alibi):
    """BLOOM's layout: heads folded into the batch, the term tiled per batch row, ``baddbmm(bias, q, k^T)``."""

    def forward(self, idx):
        B, T = idx.shape
        x = self.wte(idx)
        q, k, v = (t.view(B, T, H, D).transpose(1, 2).reshape(B * H, T, D) for t in self.qkv(x).split(C, 2))
        alibi = (self.slopes[:, None, None] * torch.arange(T, device=idx.device)).repeat(B, 1, 1)  # (B*H, 1, T)
        s = alibi.baddbmm(q, k.transpose(-1, -2), beta=1.0, alpha=1 / math.sqrt(D)).view(B, H, T, T)
        mask = torch.zeros(T, T).masked_fill(~self.bias[:T, :T], torch.finfo(torch.float32).min)
        p = torch.softmax(s + mask, dim=-1).view(B * H, T, T)
        y = torch.bmm(p, v).view(B, H, T, D).transpose(1, 2).reshape(B, T, C)
        return self.head(x + self.proj(y))


@pytest.mark.parametrize("how", ["add", "sub", "sub_scaled", "mask_first", "folded", "scaled", "table", "gate",
                                 "end_table", "end_max", "end_sub"])
def test_a_term_per_key_is_cached_exactly(how):
    lm = assert_cached_exactly(Alibi(how).eval())
    assert all(s.keeps_key_bias for s in lm.sites)
    assert "a term per key (ALiBi) kept with the keys" in lm.describe()


def test_the_term_matters():
    """The same model without its term gives other logits: the cache is not exact by leaving it out."""
    model = Alibi("add").eval()
    idx = torch.randint(0, V, (1, 12))
    with torch.no_grad():
        full = model(idx)
        model.slopes.zero_()
        assert not torch.allclose(full, model(idx), atol=1e-4)


def test_bloom_layout_heads_folded_into_the_batch():
    assert_cached_exactly(Bloomish().eval())


def test_a_term_per_key_in_a_sliding_window():
    """The ring cache keeps each key's term in its key's slot: past the window, on one step and on several."""
    model = Alibi("add", window=3).eval()
    lm = assert_cached_exactly(model)
    assert [s.window for s in lm.sites] == [3]
    idx = torch.randint(0, V, (2, 4))
    assert torch.equal(generate(lm, idx, 14), generate_plain(model, idx, 14))


def test_the_cache_counts_the_terms_bytes():
    lm = cached(Alibi("add").eval())
    # K and V: 2 * H * D float32 per position; the term: one float32 per head
    assert lm.bytes_per_token == (2 * H * D + H) * 4


@pytest.mark.parametrize("how,why", [
    ("from_end", "uses the sequence length"),
    ("end_buffer", "slices a table by a range computed from the sequence length"),
    ("end_square", "slices a table by a range computed from the sequence length"),
    ("end_bent", "slices a table by a range computed from the sequence length"),
    ("relative", "not proven to be causal"),
])
def test_terms_that_are_not_one_per_key_are_refused(how, why):
    with pytest.raises(PositionError, match=why):
        cached(Alibi(how).eval())


@pytest.mark.parametrize("value", [float("-inf"), torch.finfo(torch.float32).min, torch.finfo(torch.float32).max,
                                   float("nan")])
def test_a_term_not_finite_or_near_the_dtypes_range_raises_at_the_call(value):
    """A key hidden by ``-inf`` in its term could leave a row without keys (NaN as written); a finite term near
    the dtype's range could cancel the mask's minimum (``s + max + min``: a future key seen as written) or match
    it on every kept key. The call that writes such a term raises."""
    model = Alibi("table").eval()
    lm = cached(model)
    model.table[5] = value  # written in place: the cached graph reads the same table (and slopes, set to 1)
    model.slopes.fill_(1.0)
    idx = torch.randint(0, V, (1, 4))
    lm.prefill(idx)
    with pytest.raises(PositionError, match="not finite or not within"):
        lm.step(torch.randint(0, V, (1, 3)))


class TokenGated(Alibi):
    """The term of keys whose token is 7 is the dtype's minimum (on every kept key of a row of 7s, the scores
    as written are the minimum everywhere, future keys included: the row spreads over them)."""

    def forward(self, idx):
        B, T = idx.shape
        x = self.wte(idx)
        q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in self.qkv(x).split(C, 2))
        alibi = self.slopes[:, None, None] * torch.arange(T, device=idx.device, dtype=torch.float32)
        low = torch.finfo(torch.float32).min
        term = torch.where((idx == 7)[:, None, None, :], low, alibi)  # (B, H, 1, T)
        s = (q @ k.transpose(-2, -1)) / math.sqrt(D)
        att = s + torch.masked_fill(term, ~self.bias[:T, :T], low)
        y = (att.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C)
        return self.head(x + self.proj(y))


def test_a_term_from_a_token_at_the_dtypes_minimum_raises():
    with pytest.raises(PositionError, match="not finite or not within"):
        lm = cached(TokenGated().eval())  # the small-size probe may draw a 7 itself
        lm.prefill(torch.tensor([[7, 7, 7, 13, 9]]))


def _hf(name: str):
    transformers = pytest.importorskip("transformers")
    if name == "bloom":
        cfg = transformers.BloomConfig(vocab_size=V, hidden_size=C, n_layer=2, n_head=H,
                                       attn_implementation="eager")
        cls = transformers.BloomForCausalLM
    elif name.startswith("mpt"):  # ``mpt3``: 3 heads, slopes that are not powers of two
        heads = int(name[3:] or H)
        cfg = transformers.MptConfig(vocab_size=V, d_model=4 * heads, n_layers=2, n_heads=heads, max_seq_len=24,
                                     attn_implementation="eager")
        cls = transformers.MptForCausalLM
    else:
        cfg = transformers.FalconConfig(vocab_size=V, hidden_size=C, num_hidden_layers=2, num_attention_heads=H,
                                        alibi=True, multi_query=True, attn_implementation="eager",
                                        max_position_embeddings=24)
        cls = transformers.FalconForCausalLM
    torch.manual_seed(0)
    return cls(cfg).eval()


@pytest.mark.parametrize("name", ["bloom", "falcon", "mpt", "mpt3"])
def test_hugging_face_alibi_models(name):
    model = _hf(name)
    with pytest.raises(ValueError, match="max_len") if name == "bloom" else contextlib.nullcontext():
        cached(model)  # BLOOM names no maximum length: ALiBi has no position table
    # MPT's export records its length check ``size - max(0, size - T) != size``: 23 positions, found alone
    lm = assert_cached_exactly(model, max_len=None if name.startswith("mpt") else 24)
    assert all(s.keeps_key_bias for s in lm.sites)
    assert all(s.relative_key_bias == name.startswith("mpt") for s in lm.sites)


def test_bloom_in_bfloat16_keeps_its_terms_in_bfloat16():
    """BLOOM casts its ALiBi term to the model's dtype: the cache keeps it in that dtype, and the cached logits
    agree with the model's within bfloat16's tolerance."""
    model = _hf("bloom").to(torch.bfloat16)
    lm = cached(model, max_len=24)
    idx = torch.randint(0, V, (2, 6))
    with torch.no_grad():
        full = model(idx).logits
        got = torch.cat((lm.prefill(idx[:, :4]), lm.step(idx[:, 4:])), 1)
    assert all(s.b_cache is not None and s.b_cache.dtype == torch.bfloat16 for s in lm.sites)
    torch.testing.assert_close(got, full, atol=5e-2, rtol=5e-2)


def test_generate_sizes_the_cache_of_a_model_with_no_maximum_length(monkeypatch):
    """``generate(model, ...)`` on a model that names no maximum length (BLOOM) sizes the caches for the prompt
    and the new tokens (a power of two, at least 64) in its one capture, and builds them again, larger, for a
    longer call."""
    captures = []
    capture = kv.capture_lm
    monkeypatch.setattr(kv, "capture_lm", lambda *a: captures.append(1) or capture(*a))
    model = _hf("bloom")
    idx = torch.randint(0, V, (2, 5))
    assert torch.equal(attnopt.generate(model, idx, 9), generate_plain(model, idx, 9))
    assert len(captures) == 1
    first = generation._REUSED[model][generation._key(model, None, "sdpa", False)][1]
    assert first.max_len == 64 and "names no maximum length" in first.max_len_source
    assert torch.equal(attnopt.generate(model, idx, 4), generate_plain(model, idx, 4))
    assert generation._REUSED[model][generation._key(model, None, "sdpa", False)][1] is first  # reused
    long = torch.randint(0, V, (1, 70))
    assert torch.equal(attnopt.generate(model, long, 3), generate_plain(model, long, 3))
    assert generation._REUSED[model][generation._key(model, None, "sdpa", False)][1].max_len == 128
    assert len(captures) == 2


def test_a_term_relative_to_the_last_key_keeps_its_precision_at_long_lengths():
    """At 600 positions ``slope * j`` reaches ``slope * 600``, where float32 rounds it; the model as written adds
    ``slope * (j - T + 1)``, small on the recent keys. The cache keeps the term in float64 and adds it less its
    largest, so it is as close to a float64 copy of the model as the model itself."""
    import copy

    model = Alibi("end_max", block_size=640).eval()
    with torch.no_grad():
        model.proj.weight.mul_(20)  # attention matters to the logits
        model.qkv.weight.mul_(3)
    exact = copy.deepcopy(model).double()
    lm = cached(model)
    assert all(s.relative_key_bias for s in lm.sites)
    idx = torch.randint(0, V, (1, 604))
    with torch.no_grad():
        got = torch.cat((lm.prefill(idx[:, :600]), lm.step(idx[:, 600:602]), lm.step(idx[:, 602:])), 1).double()
        written, want = model(idx).double(), exact(idx)
    tail = slice(590, None)
    assert (got - want)[:, tail].abs().max() <= 2 * (written - want)[:, tail].abs().max() + 1e-6


def test_a_table_bent_where_a_longer_max_len_would_read_is_refused():
    """``max_len`` may exceed the declared length up to the table's size: the whole table must be affine, not
    only the entries the declared length reads (a 36-token call reads the bend)."""
    with pytest.raises(PositionError, match="slices a table by a range computed from the sequence length"):
        cached(Alibi("end_far_bend").eval(), max_len=40)
