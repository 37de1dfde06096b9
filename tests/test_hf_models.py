"""Real model code: Hugging Face transformers models in eager attention, small configs, random weights."""

from __future__ import annotations

import pytest
import torch
import transformers  # part of the dev extra

import attnopt


def _gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32,
                                  bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    return transformers.GPT2LMHeadModel(cfg), {"input_ids": torch.randint(0, 64, (2, 12))}


def _llama():
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, vocab_size=64,
                                   bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    return transformers.LlamaForCausalLM(cfg), {"input_ids": torch.randint(0, 64, (2, 12))}


def _mistral():
    cfg = transformers.MistralConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                     num_key_value_heads=2, intermediate_size=64, vocab_size=64, sliding_window=4,
                                     bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    return transformers.MistralForCausalLM(cfg), {"input_ids": torch.randint(0, 64, (2, 12))}


def _gemma2():
    """Soft-capped attention logits; layers alternate a sliding window (4) and full causal attention."""
    cfg = transformers.Gemma2Config(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=8, intermediate_size=64, vocab_size=64,
                                    sliding_window=4, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                                    query_pre_attn_scalar=8, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                                    attn_implementation="eager")
    return transformers.Gemma2ForCausalLM(cfg), {"input_ids": torch.randint(0, 64, (2, 12))}


def _bert():
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                  intermediate_size=64, vocab_size=64, attn_implementation="eager")
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 7:] = 0  # padding in the second sequence
    return transformers.BertModel(cfg), {"input_ids": torch.randint(0, 64, (2, 12)), "attention_mask": mask}


def _main_output(out):
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("build", [_gpt2, _llama, _bert, _mistral, _gemma2],
                         ids=["gpt2", "llama-gqa", "bert", "mistral-window", "gemma2-softcap-window"])
def test_every_attention_layer_rewritten_outputs_and_grads_equal(build):
    torch.manual_seed(0)
    model, inputs = build()
    model.eval()
    opt = attnopt.optimize(model)
    ref = _main_output(model(**inputs))
    out = _main_output(opt(**inputs))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    report = attnopt.explain(opt)
    assert report.rewritten == 2, str(report)
    params = [p for p in model.parameters() if p.requires_grad]
    g_ref = torch.autograd.grad(ref.square().mean(), params, allow_unused=True)
    g_out = torch.autograd.grad(out.square().mean(), params, allow_unused=True)
    for a, b in zip(g_out, g_ref):
        if b is None:
            assert a is None
        else:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    specs = [r.spec for r in report.records]
    if build in (_llama, _mistral, _gemma2):
        assert all(s.gqa and s.causal == "top_left" for s in specs), str(report)  # the mask is proven causal
    if build is _mistral:
        assert [s.window for s in specs] == [4, 4], str(report)
    if build is _gemma2:
        assert [s.window for s in specs] == [4, None], str(report)  # sliding, then global
        assert all(s.score_mod == "50*tanh(s)" for s in specs), str(report)


@pytest.mark.parametrize("build", [_llama, _mistral], ids=["llama", "mistral-window"])
def test_padding_mask_input_keeps_the_causal_proof_checked_per_call(build):
    """``attention_mask`` as tokenizers return it: all ones -> causal SDPA; left padding -> the mask tensor."""
    torch.manual_seed(0)
    model, inputs = build()
    model.eval()
    ids = inputs["input_ids"]
    ones = torch.ones_like(ids)
    padded = ones.clone()
    padded[1, :3] = 0  # left padding, as for batched generation
    opt = attnopt.optimize(model, variant="sdpa")
    for mask in (ones, padded):
        with torch.no_grad():
            out = opt(input_ids=ids, attention_mask=mask).logits
            ref = model(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    report = attnopt.explain(opt)
    assert report.rewritten >= 2
    assert all(r.spec.causal == "top_left" and r.spec.conditions == 1 for r in report.records), str(report)
