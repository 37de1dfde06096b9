"""Hugging Face causal LMs in eager attention: GPT-2 (its Conv1D folds batch and time into rows), LLaMA and
Mistral (a sliding-window mask read at run time), from tiny configs with random weights.

Exact against the plain loop, and against HF's own ``generate`` (its cache, positions from the attention mask
for left-padded batches). Folds that are not position-wise are refused, naming the op.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from attnopt.generation import PositionError, cached, generate, generate_plain, left_pad
from attnopt.models import GPTConfig

transformers = pytest.importorskip("transformers")

VOCAB = 64


def _alone(model, prompts, n, **kw):
    return [generate_plain(model, p[None], n, **kw)[0] for p in prompts]


def _hf_model(name: str):
    torch.manual_seed(0)
    if name == "gpt2":  # Conv1D: (B, T, C) viewed (B*T, C) around addmm
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=32,
                                      attn_implementation="eager")
        return transformers.GPT2LMHeadModel(cfg).eval()
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=32,
                                   attn_implementation="eager")
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def hf(request):
    model = _hf_model(request.param)
    return model, cached(model)


def test_hf_model_equals_the_plain_loop_and_hf_generate(hf):
    """HF builds its causal mask from position ids (comparisons and a packed-sequence cumsum): not proven
    symbolically, so it is checked causal at every length the cache serves."""
    model, c = hf
    assert len(c.sites) == 2 and c.max_len == 32 and len(c.mask_checks) == 2
    assert "mask checked causal" in c.describe()
    idx = torch.randint(1, VOCAB, (2, 5))
    torch.testing.assert_close(c.prefill(idx), model(idx).logits, atol=1e-5, rtol=1e-5)
    new = torch.randint(1, VOCAB, (2, 3))
    torch.testing.assert_close(c.step(new), model(torch.cat((idx, new), 1)).logits[:, 5:], atol=1e-5, rtol=1e-5)
    assert torch.equal(generate(c, idx, 12), generate_plain(model, idx, 12))
    kw = dict(do_sample=True, top_k=10)
    assert torch.equal(generate(c, idx, 12, generator=torch.Generator().manual_seed(1), **kw),
                       generate_plain(model, idx, 12, generator=torch.Generator().manual_seed(1), **kw))
    # HF's own loop with its cache gives the same tokens
    hf_tokens = model.generate(idx, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(generate(c, idx, 12), hf_tokens)


def test_hf_ragged_prompts_match_alone_and_hf_generate(hf):
    """Each prompt as alone (the mask checked at every row's own length), and as HF's generate gives them for
    left-padded ids (it takes positions from the attention mask)."""
    model, c = hf
    prompts = [torch.randint(1, VOCAB, (n,)) for n in (8, 1, 3)]
    assert all(torch.equal(g, r) for g, r in zip(generate(c, prompts, 10), _alone(model, prompts, 10)))
    ids, mask = left_pad(prompts)
    hf_tokens = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
                               eos_token_id=None)
    assert torch.equal(generate(c, ids, 10, attention_mask=mask), hf_tokens)


def test_mistral_sliding_window_is_read_off_its_mask():
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                     intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=40,
                                     sliding_window=5, attn_implementation="eager")
    model = transformers.MistralForCausalLM(cfg).eval()
    c = cached(model)
    assert [s.capacity for s in c.sites] == [5] and "a causal window of 5" in c.describe()
    idx = torch.randint(0, VOCAB, (2, 9))  # longer than the window
    assert torch.equal(generate(c, idx, 25), generate_plain(model, idx, 25))
    assert c.cache_bytes == 2 * 5 * c.bytes_per_token  # 34 positions seen, 5 kept
    prompts = [torch.randint(0, VOCAB, (n,)) for n in (9, 1, 4)]
    assert all(torch.equal(g, r) for g, r in zip(generate(c, prompts, 12), _alone(model, prompts, 12)))


def _family(name: str):
    """Families whose spellings the position proof learnt from (``tests/test_generation_spellings.py`` has each
    small): OPT counts positions from ones, GPT-J interleaves rotary tables with ``repeat_interleave``, Falcon
    picks its key and value heads by a fixed index, GPT-Neo fills with ``torch.tensor(finfo.min)`` and has a
    local layer, XGLM folds heads into the batch, floors its scores and checks ``2 + T <= n``, Gemma 2 soft-caps
    its scores, Mixtral and DeepSeek V3 route tokens to experts and dispatch them sorted by expert
    (``tests/test_generation_moe.py``), GraniteMoe takes ``use_cache`` only through ``**kwargs``."""
    t = transformers
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, attn_implementation="eager")
    if name == "opt":
        return t.OPTForCausalLM(t.OPTConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, ffn_dim=64,
                                            max_position_embeddings=32, word_embed_proj_dim=32, **common))
    if name == "gptj":
        return t.GPTJForCausalLM(t.GPTJConfig(n_layer=2, n_embd=32, n_head=4, rotary_dim=4, n_positions=32, **common))
    if name == "falcon":
        return t.FalconForCausalLM(t.FalconConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                                  max_position_embeddings=32, **common))
    if name == "gpt_neo":
        return t.GPTNeoForCausalLM(t.GPTNeoConfig(num_layers=2, hidden_size=32, num_heads=4, window_size=4,
                                                  attention_types=[[["global", "local"], 1]],
                                                  max_position_embeddings=32, **common))
    if name == "gemma2":  # a soft-cap 50*tanh(s/50) on the scores, sliding-window layers
        return t.Gemma2ForCausalLM(t.Gemma2Config(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                                  num_key_value_heads=2, head_dim=8, intermediate_size=64,
                                                  max_position_embeddings=32, sliding_window=4, **common))
    if name == "mixtral":  # a sparse mixture of experts: softmax-topk router on (B*T, C), grouped_mm dispatch
        return t.MixtralForCausalLM(t.MixtralConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                                    num_key_value_heads=2, intermediate_size=64, num_local_experts=4,
                                                    num_experts_per_tok=2, max_position_embeddings=32, **common))
    if name == "deepseek_v3":  # sigmoid router choosing groups of experts (a mask written by scatter_), MLA
        return t.DeepseekV3ForCausalLM(t.DeepseekV3Config(
            num_hidden_layers=2, first_k_dense_replace=1, hidden_size=32, num_attention_heads=4,
            num_key_value_heads=4, intermediate_size=64, moe_intermediate_size=16, n_routed_experts=4, n_group=2,
            topk_group=1, num_experts_per_tok=2, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
            qk_nope_head_dim=4, v_head_dim=8, max_position_embeddings=32, **common))
    if name == "granitemoe":  # forward takes use_cache only through **kwargs (read from the config)
        return t.GraniteMoeForCausalLM(t.GraniteMoeConfig(
            num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
            num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32, **common))
    return t.XGLMForCausalLM(t.XGLMConfig(num_layers=2, d_model=32, attention_heads=4, ffn_dim=64,
                                          max_position_embeddings=32, **common))


def test_gpt2_with_upcast_attention_and_layer_scaling():
    """``reorder_and_upcast_attn``: ``baddbmm`` on heads folded into the batch with k given transposed, the
    scores in float32; ``scale_attn_by_inverse_layer_idx``: a scale per layer."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=32,
                                  reorder_and_upcast_attn=True, scale_attn_by_inverse_layer_idx=True,
                                  attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(cfg).eval()
    idx = torch.randint(1, VOCAB, (2, 5))
    assert torch.equal(generate(model, idx, 10), generate_plain(model, idx, 10))


def test_a_fused_attn_implementation_is_refused_saying_what_to_do():
    cfg = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                                   vocab_size=VOCAB, max_position_embeddings=32, attn_implementation="sdpa")
    with pytest.raises(PositionError, match=r"through 'sdpa' .*attn_implementation=\"eager\""):
        cached(transformers.LlamaForCausalLM(cfg).eval())


@pytest.mark.parametrize("name", ["opt", "gptj", "falcon", "gpt_neo", "xglm", "gemma2", "mixtral", "deepseek_v3",
                                  "granitemoe"])
def test_more_families_equal_the_plain_loop_batched_and_ragged(name):
    model = _family(name).eval()
    flags = [getattr(model.config, "use_cache", None)]
    c = cached(model)
    assert [getattr(model.config, "use_cache", None)] == flags  # a flag set for the capture is put back
    assert c.max_len == 32
    idx = torch.randint(1, VOCAB, (2, 5))
    assert torch.equal(generate(c, idx, 10), generate_plain(model, idx, 10))
    prompts = [torch.randint(1, VOCAB, (n,)) for n in (7, 1, 3)]  # past GPT-Neo's local window of 4
    assert all(torch.equal(g, r) for g, r in zip(generate(c, prompts, 8), _alone(model, prompts, 8)))


class Folded(nn.Module):
    """Embeddings viewed ``(B*T, C)``, one op there, viewed back: the op decides whether positions stay apart."""

    def __init__(self, op: str):
        super().__init__()
        self.config = GPTConfig(block_size=16, vocab_size=VOCAB, n_embd=16)
        self.wte = nn.Embedding(VOCAB, 16)
        self.proj = nn.Linear(16, 16)
        self.head = nn.Linear(16, VOCAB)
        self.op = op

    def forward(self, idx):
        x = self.wte(idx)
        b, t, c = x.shape
        rows = x.reshape(b * t, c)
        if self.op == "softmax-over-rows":
            rows = rows.softmax(dim=0)  # mixes every position of every sequence
        elif self.op == "time-major":
            rows = rows + x.transpose(0, 1).reshape(t * b, c)  # row b*T + t meets row t*B + b
        return self.head(self.proj(rows).view(b, t, c))


@pytest.mark.parametrize(("op", "why"), [
    ("softmax-over-rows", "aten.softmax at test_generation_hf.py:.*batch and sequence axes are folded into one"),
    ("time-major", "aten.add at test_generation_hf.py:.*batch and sequence axes are folded into one"),
], ids=["softmax-over-rows", "time-major"])
def test_folds_that_mix_positions_are_refused(op, why):
    with pytest.raises(PositionError, match=why):
        cached(Folded(op).eval())
