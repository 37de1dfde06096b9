"""Ragged batches: prompts of different lengths in one batch get the tokens each gets alone.

A list of 1-D prompts, or left-padded ids with an ``attention_mask``; each sequence starts at position 0 and
its padding is never attended (``runtime.kv_cache.Rows``: the rows folded into the time axis, a key mask per
row). Checked against the plain loop run on each prompt alone, greedy and with one seeded generator per row.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from llama_style import LlamaConfig, LlamaStyle

from attnopt.generation import cached, generate, generate_plain, left_pad, stream
from attnopt.models import GPTConfig, NanoGPT

VOCAB = 24  # few tokens, so that greedy decoding meets a chosen end token soon
LENGTHS = (5, 1, 9, 3)


@pytest.fixture(scope="module")
def nano():
    torch.manual_seed(0)
    model = NanoGPT(GPTConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, block_size=32)).eval()
    return model, cached(model)


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    model = LlamaStyle(LlamaConfig(vocab_size=VOCAB, n_layers=1, max_seq_len=32)).eval()  # GQA, rotary tables
    return model, cached(model)


@pytest.fixture(params=["nanogpt", "llama-gqa"])
def lm(request, nano, llama):
    return nano if request.param == "nanogpt" else llama


def _prompts(lengths=LENGTHS, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


def _alone(model, prompts, n, **kw) -> list[torch.Tensor]:
    return [generate_plain(model, p[None], n, **kw)[0] for p in prompts]


def _same(got, ref) -> bool:
    return len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref))


def test_prefill_and_steps_give_each_row_its_own_logits(lm):
    model, c = lm
    prompts = _prompts()
    ids, mask = left_pad(prompts)
    logits = c.prefill(ids, mask)
    for p, row in zip(prompts, logits):
        torch.testing.assert_close(row[-1], model(p[None])[0, -1], atol=1e-5, rtol=1e-5)
    assert c.lengths.tolist() == list(LENGTHS) and c.length == 9
    seqs = list(prompts)
    for t in (1, 3, 1, 2):  # one token per row, several (a mask per row within the call), one again
        new = torch.randint(0, VOCAB, (len(prompts), t))
        out = c.step(new)
        for b in range(len(prompts)):
            seqs[b] = torch.cat((seqs[b], new[b]))
            torch.testing.assert_close(out[b], model(seqs[b][None])[0, -t:], atol=1e-5, rtol=1e-5)


def test_greedy_tokens_equal_each_prompt_alone(lm):
    model, c = lm
    prompts = _prompts(seed=1)
    ref = _alone(model, prompts, 12)
    assert _same(generate(c, prompts, 12), ref)
    assert _same(generate_plain(model, prompts, 12), ref)  # the plain loop on the batch runs each row alone
    # the same batch as left-padded ids and a mask: the padding stays in the result
    ids, mask = left_pad(prompts, pad_id=7)
    out = generate(c, ids, 12, attention_mask=mask)
    assert out.shape == (4, ids.size(1) + 12) and torch.equal(out[:, :ids.size(1)], ids)
    for b, r in enumerate(ref):
        assert torch.equal(out[b, ids.size(1) - len(prompts[b]):], r)
    assert torch.equal(out, generate_plain(model, ids, 12, attention_mask=mask))


def test_seeded_sampling_with_a_generator_per_row_equals_each_prompt_alone(lm):
    """Row b draws from generator b exactly as it does alone; one generator for the batch draws the rows in
    turn, as the plain loop on the same batch does."""
    model, c = lm
    prompts = _prompts(seed=2)
    kw = dict(do_sample=True, temperature=1.2, top_k=8)
    gens = [torch.Generator().manual_seed(10 + b) for b in range(4)]
    got = generate(c, prompts, 10, generator=gens, **kw)
    ref = [generate_plain(model, p[None], 10, generator=torch.Generator().manual_seed(10 + b), **kw)[0]
           for b, p in enumerate(prompts)]
    assert _same(got, ref)
    one = generate(c, prompts, 10, generator=torch.Generator().manual_seed(3), **kw)
    assert _same(one, generate_plain(model, prompts, 10, generator=torch.Generator().manual_seed(3), **kw))
    assert not _same(got, one)  # the draws do depend on the generators


def test_rows_finish_independently_at_their_end_token(nano):
    model, c = nano
    prompts = _prompts(seed=3)
    free = _alone(model, prompts, 12)
    eos = int(free[0][len(prompts[0])])  # row 0 produces it as its very first token
    got = generate(c, prompts, 12, eos_token_id=eos)
    ref = _alone(model, prompts, 12, eos_token_id=eos)
    assert _same(got, ref)
    assert got[0].numel() == len(prompts[0]) + 1 and int(got[0][-1]) == eos  # cut right after its end token
    assert max(g.numel() - len(p) for g, p in zip(got, prompts)) > 1  # while others went on
    ids, mask = left_pad(prompts)
    padded = generate(c, ids, 12, attention_mask=mask, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(padded, generate_plain(model, ids, 12, attention_mask=mask, eos_token_id=eos, pad_token_id=0))
    assert (padded[0, ids.size(1) + 1:] == 0).all()


def test_a_row_of_one_token_among_long_ones_and_other_lengths_later(nano):
    model, c = nano
    for lengths in ((1, 20), (7, 7, 2), (3,), (4, 4)):  # the same cached model, new lengths every call
        prompts = _prompts(lengths, seed=sum(lengths))
        assert _same(generate(c, prompts, 6), _alone(model, prompts, 6)), lengths
    assert c.cache_bytes == 2 * 32 * c.bytes_per_token  # the last batch: 2 rows of max_len positions


def test_stream_and_a_module_give_the_same_tokens(nano):
    model, c = nano
    prompts = _prompts(seed=4)
    ids, mask = left_pad(prompts)
    parts = list(stream(c, prompts, 5))
    assert all(p.shape == (4, 1) for p in parts)
    assert torch.equal(torch.cat([ids, *parts], 1), generate(c, ids, 5, attention_mask=mask))


def test_max_len_counts_the_longest_row(nano):
    _, c = nano
    prompts = _prompts((30, 2))
    with pytest.raises(ValueError, match="a prompt of 30 tokens plus 4 new ones needs 33 positions, more than "
                                         "max_len=32"):
        generate(c, prompts, 4)
    assert [g.numel() for g in generate(c, prompts, 3)] == [33, 5]  # 32 positions fed: the limit exactly
    ids, mask = left_pad(prompts)
    c.prefill(ids, mask)
    c.step(torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="33 positions exceed max_len=32"):
        c.step(torch.zeros(2, 1, dtype=torch.long))


def test_weights_written_after_a_ragged_prefill_are_followed(nano):
    model, c = nano
    prompts = _prompts((6, 2, 4), seed=5)
    ids, mask = left_pad(prompts)
    c.prefill(ids, mask)
    new = torch.randint(0, VOCAB, (3, 2))
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)  # the cached keys are of the old weights... (lm_head: not of K/V)
        model.h[0].attn.c_attn.weight.add_(0.05)  # ...these are: the step recomputes every row from 0
    try:
        out = c.step(new)
        for b, p in enumerate(prompts):
            torch.testing.assert_close(out[b], model(torch.cat((p, new[b]))[None])[0, -2:], atol=1e-5, rtol=1e-5)
        more = torch.randint(0, VOCAB, (3, 1))
        out = c.step(more)  # and goes on from the refilled caches
        for b, p in enumerate(prompts):
            seq = torch.cat((p, new[b], more[b]))[None]
            torch.testing.assert_close(out[b], model(seq)[0, -1:], atol=1e-5, rtol=1e-5)
    finally:
        with torch.no_grad():
            model.h[0].attn.c_attn.weight.sub_(0.05)
            model.lm_head.weight.div_(1.5)


@pytest.mark.parametrize(("mask", "message"), [
    (torch.tensor([[1, 1, 0], [1, 1, 1]]), r"row\(s\) \[0\] are not left-padded"),
    (torch.tensor([[0, 1, 0], [1, 1, 1]]), r"row\(s\) \[0\] are not left-padded"),
    (torch.tensor([[1, 0, 1], [1, 1, 1]]), r"row\(s\) \[0\] are not left-padded"),
    (torch.tensor([[0, 0, 0], [1, 1, 1]]), r"row\(s\) \[0\] hold no token"),
    (torch.tensor([[0, 2, 1], [1, 1, 1]]), "0 \\(padding\\) and 1 \\(token\\) only"),
    (torch.ones(2, 4, dtype=torch.long), r"attention_mask must be a \(batch, length\) = \(2, 3\)"),
    (torch.ones(2, 3), r"tensor of 0/1 \(or bool\)"),
], ids=["right-padded", "padded-both-sides", "hole", "empty-row", "not-binary", "wrong-shape", "float"])
def test_masks_that_are_not_left_padding_say_what_to_do(nano, mask, message):
    _, c = nano
    with pytest.raises(ValueError, match=message):
        generate(c, torch.zeros(2, 3, dtype=torch.long), 2, attention_mask=mask)


def test_bad_prompt_lists_say_what_to_do(nano):
    _, c = nano
    with pytest.raises(ValueError, match="prompt 1 must be a 1-D tensor of at least one token id"):
        generate(c, [torch.zeros(3, dtype=torch.long), torch.zeros(0, dtype=torch.long)], 2)
    with pytest.raises(ValueError, match="prompts given as a list need none"):
        generate(c, [torch.zeros(3, dtype=torch.long)], 2, attention_mask=torch.ones(1, 3))
    with pytest.raises(ValueError, match="one torch.Generator per sequence \\(2\\)"):
        generate(c, _prompts((2, 3)), 2, do_sample=True, generator=[torch.Generator()])
    # a bool mask of ones is a plain batch
    ids = torch.randint(0, VOCAB, (2, 3))
    assert torch.equal(generate(c, ids, 3, attention_mask=torch.ones(2, 3, dtype=torch.bool)), generate(c, ids, 3))


class PaddedGPT(NanoGPT):
    """nanoGPT whose forward requires a padding mask (1 = token), added in every attention next to the causal one."""

    def forward(self, idx, attention_mask):
        b, t = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        pad = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        for block in self.h:
            a = block.attn
            q, k, v = (y.view(b, t, a.n_head, -1).transpose(1, 2) for y in a.c_attn(block.ln_1(x)).split(a.n_embd, 2))
            att = (q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))).masked_fill(a.bias[:, :, :t, :t] == 0, -math.inf)
            x = x + a.c_proj((F.softmax(att + pad, dim=-1) @ v).transpose(1, 2).reshape(b, t, -1))
            x = x + block.mlp(block.ln_2(x))
        return self.lm_head(self.ln_f(x))


def test_a_model_whose_forward_requires_an_attention_mask():
    """Captured with a mask of ones (one sequence alone has no padding), checked causal with it at every length;
    the plain loop passes ones too, and a ragged batch's padding is the cache's own key mask."""
    torch.manual_seed(0)
    model = PaddedGPT(GPTConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, block_size=24)).eval()
    c = cached(model)
    assert "mask checked causal" in c.describe() and "h.0.attn.bias" in c.describe()
    idx = torch.randint(0, VOCAB, (2, 5))
    assert torch.equal(generate(c, idx, 10), generate_plain(model, idx, 10))
    prompts = _prompts((7, 1, 3), seed=6)
    assert _same(generate(c, prompts, 8), _alone(model, prompts, 8))
    row = torch.cat((prompts[1], torch.zeros(3, dtype=torch.long)))[None]  # the model's own padding, on the right
    torch.testing.assert_close(c.prefill(prompts[1][None])[0, -1],
                               model(row, torch.tensor([[1, 0, 0, 0]]))[0, 0], atol=1e-5, rtol=1e-5)
