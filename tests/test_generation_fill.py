"""Finite fills in the KV cache: masks that hide future keys with a number such as ``-1e4`` instead of ``-inf``.

As written, ``softmax(s.masked_fill(~causal, -1e4))`` over the whole sequence gives every future key the score
``-1e4``: causal attention only while every row's kept scores dwarf it. The cache attends to the kept keys, and
checks at every call that the fill carries less than ``2**-60`` of any new row's weight
(``fill + |scale| * max|q| * max|k| + log(max_len) <= -42``, :meth:`KVCacheAttention.check_fill`); a call past the
bound raises. Covered:

* ``masked_fill(~tril, -1e4)``, OpenAI-GPT's blend ``w * b + -1e4 * (1 - b)`` (both orders; export spells
  ``1 - b`` as ``aten.rsub``), ``where(tril, w, -1e4)``, a fill before the scale, a fill of ``-100``;
* Hugging Face OpenAI-GPT, batched, stepped and ragged;
* a call whose scores could reach the fill raises, where the model as written does let rows see future keys;
* refused: a fill with a term per key (ALiBi), a fill next to added mask terms.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_generation_spellings import Base, C, D, V, assert_cached_exactly

from attnopt.generation import PositionError, cached, generate, generate_plain


class Filled(Base):
    """One causal layer whose future keys get a finite ``fill``, spelled ``how``."""

    def __init__(self, how: str = "masked_fill", fill: float = -1e4):
        super().__init__()
        self.how, self.fill = how, fill
        self.register_buffer("keep01", self.bias.float())  # OpenAI-GPT's 0/1 float buffer

    def forward(self, idx):
        return self.block(self.embed(idx))

    def attend(self, q, k, v):
        T = q.size(-2)
        s = q @ k.transpose(-2, -1)
        keep, b = self.bias[:T, :T], self.keep01[:T, :T]
        f = self.fill
        if self.how == "masked_fill":
            att = (s / math.sqrt(D)).masked_fill(~keep, f)
        elif self.how == "blend":
            att = (s / math.sqrt(D)) * b + f * (1 - b)
        elif self.how == "blend_swapped":
            att = b * (s / math.sqrt(D)) + (1 - b) * f
        elif self.how == "where":
            att = torch.where(keep, s / math.sqrt(D), f)
        else:
            assert self.how == "fill_then_scale"
            att = s.masked_fill(~keep, f) / math.sqrt(D)
        return att.softmax(-1) @ v


@pytest.mark.parametrize("how,fill", [("masked_fill", -1e4), ("blend", -1e4), ("blend_swapped", -1e4),
                                      ("where", -1e4), ("fill_then_scale", -1e4), ("masked_fill", -100.0)])
def test_a_finite_fill_is_cached_exactly(how, fill):
    lm = assert_cached_exactly(Filled(how, fill).eval())
    expected = fill / math.sqrt(D) if how == "fill_then_scale" else fill
    assert [s.spec.fill_value for s in lm.sites] == [pytest.approx(expected)]
    assert "bounded" in lm.describe()


def test_scores_that_could_reach_the_fill_raise():
    """q = -g * k: its own key scores about ``-g * |k|^2``, below the fill. As written the prompt's
    rows then put their weight on the future keys (checked below against the same model masked with -inf);
    the cache, which cannot see future keys, raises instead of answering."""
    model = Filled().eval()
    lm = cached(model)
    idx = torch.randint(0, V, (1, 5))
    with torch.no_grad():
        lm.prefill(idx)  # within the bound: served
        w = model.qkv.weight
        w[:C] = -1e6 * w[C:2 * C]  # q = -1e6 k (the bias too)
        model.qkv.bias[:C] = -1e6 * model.qkv.bias[C:2 * C]
        as_written = model(idx)
        model.fill = float("-inf")
        causal = model(idx)
        model.fill = -1e4
    assert not torch.allclose(as_written[:, :-1], causal[:, :-1], atol=1e-3)  # the fill carries weight
    with pytest.raises(PositionError, match="fills its masked scores with -10000.*future keys"):
        lm.prefill(idx)


def test_the_bound_reads_every_key_since_the_sequence_began():
    """A large key written at the prompt raises at a later step whose own keys are small: the step's queries
    are checked against every cached key's norm, not only the new ones."""
    model = Filled().eval()
    lm = cached(model)
    with torch.no_grad():
        lm.prefill(torch.randint(0, V, (1, 4)))
        lm.step(torch.randint(0, V, (1, 1)))
        site = lm.sites[0]
        site.k_norm = site.k_norm * 1e4  # as if a key that large had been cached
        with pytest.raises(PositionError, match="-10000"):
            lm.step(torch.randint(0, V, (1, 1)))
        lm.prefill(torch.randint(0, V, (1, 4)))  # a new sequence forgets the old keys
        lm.step(torch.randint(0, V, (1, 1)))


def test_hugging_face_openai_gpt():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.OpenAIGPTConfig(vocab_size=V, n_embd=C, n_layer=2, n_head=2, n_positions=24,
                                       attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.OpenAIGPTLMHeadModel(cfg).eval()
    lm = assert_cached_exactly(model)
    assert [s.spec.fill_value for s in lm.sites] == [-1e4, -1e4]
    idx = torch.randint(0, V, (2, 5))
    assert torch.equal(generate(model, idx, 9), generate_plain(model, idx, 9))  # the cache generate builds itself


class FilledAlibi(Filled):
    def attend(self, q, k, v):
        T = q.size(-2)
        alibi = 0.5 * torch.arange(T, device=q.device, dtype=torch.float32)  # (T,): a term per key
        att = ((q @ k.transpose(-2, -1)) / math.sqrt(D) + alibi).masked_fill(~self.bias[:T, :T], -1e4)
        return att.softmax(-1) @ v


class FilledAndPadded(Filled):
    """A fill, then an added padding term built from an all-ones mask (OpenAI-GPT with an ``attention_mask``)."""

    def forward(self, idx):
        x = self.embed(idx)
        q, k, v = self.heads(x)
        T = idx.size(1)
        pad = (1.0 - torch.ones_like(idx, dtype=torch.float32))[:, None, None, :] * -1e4
        att = ((q @ k.transpose(-2, -1)) / math.sqrt(D)).masked_fill(~self.bias[:T, :T], -1e4) + pad
        return self.head(x + self.merge(att.softmax(-1) @ v))


@pytest.mark.parametrize("model,why", [
    (FilledAlibi(), "finite value -10000"),
    (FilledAndPadded(), "adds other mask terms"),
])
def test_fills_the_bound_does_not_cover_are_refused(model, why):
    with pytest.raises(PositionError, match=why):
        cached(model.eval())


class FilledWindow(Filled):
    """A sliding window of 3 keys, the others filled with -1e4 (the mask check finds the window)."""

    def attend(self, q, k, v):
        T = q.size(-2)
        i = torch.arange(T, device=q.device)
        keep = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < 3)
        att = ((q @ k.transpose(-2, -1)) / math.sqrt(D)).masked_fill(~keep, -1e4)
        return att.softmax(-1) @ v


def test_a_finite_fill_in_a_sliding_window():
    lm = assert_cached_exactly(FilledWindow().eval())
    assert [s.capacity for s in lm.sites] == [3]


def test_a_half_type_product_that_could_overflow_raises():
    """float16, a fill near its range (-6e4) after the scale: the scaled bound holds, but ``q @ k^T`` as written
    overflows to -inf on the diagonal, so row 0 attends to its future keys. The unscaled product is bounded too."""
    model = Filled("masked_fill", -6e4).eval().half()
    lm = cached(model)
    torch.manual_seed(1)
    idx = torch.randint(0, V, (1, 4))
    with torch.no_grad():
        lm.prefill(idx)  # ordinary weights: within both bounds
        g = math.sqrt(4000.0)
        w, b = model.qkv.weight, model.qkv.bias
        w[C:2 * C] *= g
        b[C:2 * C] *= g
        w[:C], b[:C] = -w[C:2 * C], -b[C:2 * C]  # q = -k: raw diagonal score about -7e4
        q, k, _ = model.heads(model.embed(idx))
        assert bool(torch.isneginf(q @ k.transpose(-2, -1)).any())  # as written: a kept key at -inf
        with pytest.raises(PositionError, match="unscaled"):
            lm.prefill(idx)


def test_padding_slots_do_not_count_in_the_bound():
    """A padding id whose embedding is huge pads a ragged batch: its slots are never attended, so they neither
    raise nor stay in the key norm."""
    model = Filled().eval()
    lm = cached(model)
    with torch.no_grad():
        model.wte.weight[0] *= 1e4  # neither the prompts below nor the tokens generated hold token 0
        model.head.bias[0] = -1e9
    prompts = [torch.randint(1, V, (n,)) for n in (6, 2)]
    ids = torch.zeros(2, 6, dtype=torch.long)
    ids[0], ids[1, 4:] = prompts[0], prompts[1]
    mask = torch.tensor([[1] * 6, [0, 0, 0, 0, 1, 1]])
    out = generate(lm, ids, 5, attention_mask=mask)
    assert torch.equal(out[0], generate_plain(model, prompts[0][None], 5)[0])
    assert torch.equal(out[1, 4:], generate_plain(model, prompts[1][None], 5)[0])
