"""``attnopt.optimize(hf_model).generate(...)``: generation runs the rewritten attention, the model stays as it was.

``torch.compile(model)`` returns an ``OptimizedModule`` that forwards ``generate`` to the model, whose
``generate`` then calls the model's own eager ``forward``. For a model with a ``generate`` method,
``optimize`` returns a shallow copy of the model whose ``forward`` is the compiled one. These tests run
tiny random Hugging Face GPT-2 and LLaMA models (2 layers, width 32, eager attention, nothing downloaded)
with ``variant="sdpa"`` and count, with the profiler, the ``attnopt::<site>`` ranges of the prefill
(all prompt positions as queries) and of each decode step (one query) and the SDPA call inside each; a
plain ``nn.Module`` still gets the ``OptimizedModule`` of before.
"""

from __future__ import annotations

import copy
import io
import pickle
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.eval_frame import OptimizedModule
from torch.profiler import profile

import attnopt

transformers = pytest.importorskip("transformers")

LAYERS, VOCAB, PROMPT, NEW = 2, 100, 6, 5


def _gpt2(dropout: float = 0.0) -> nn.Module:
    cfg = transformers.GPT2Config(n_layer=LAYERS, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64,
                                  attn_pdrop=0.0, resid_pdrop=dropout, embd_pdrop=dropout, bos_token_id=0,
                                  eos_token_id=0, pad_token_id=0, attn_implementation="eager")
    return transformers.GPT2LMHeadModel(cfg).eval()


def _llama() -> nn.Module:
    cfg = transformers.LlamaConfig(num_hidden_layers=LAYERS, hidden_size=32, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, vocab_size=VOCAB,
                                   max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                                   attn_implementation="eager")
    return transformers.LlamaForCausalLM(cfg).eval()


BUILDERS = pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama-gqa"])


def _prompts(padded: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    ids = torch.randint(1, VOCAB, (2, PROMPT))
    if not padded:
        return ids, None
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding, as for batched generation
    ids[1, :2] = 0
    return ids, mask


def _generate(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    kwargs = {} if mask is None else {"attention_mask": mask}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None, **kwargs)


def _site_queries(events: list) -> list[int]:
    """The query length of the SDPA call inside each ``attnopt::<site>`` range (0: the range ran no SDPA)."""
    out = []
    for r in (e for e in events if e.name.startswith("attnopt::")):
        inside = [e for e in events if e.name == "aten::scaled_dot_product_attention" and e.thread == r.thread
                  and r.time_range.start <= e.time_range.start and e.time_range.end <= r.time_range.end]
        out.append(inside[0].input_shapes[0][-2] if inside else 0)  # q: (B, H, Tq, D)
    return out


@BUILDERS
@pytest.mark.parametrize("padded", [False, True], ids=["no-mask", "left-padded"])
def test_generate_runs_the_rewritten_attention_and_gives_the_same_tokens(build: Callable[[], nn.Module],
                                                                         padded: bool) -> None:
    model = build()
    opt = attnopt.optimize(model, variant="sdpa")
    ids, mask = _prompts(padded)
    want = _generate(model, ids, mask)
    with profile(record_shapes=True) as prof:
        got = _generate(opt, ids, mask)
    assert torch.equal(got, want)
    queries = _site_queries(list(prof.events()))
    # one prefill (every prompt position a query) and NEW - 1 decode steps (one query), each layer an SDPA call
    assert queries.count(PROMPT) == LAYERS, queries
    assert queries.count(1) == LAYERS * (NEW - 1), queries
    assert len(queries) == LAYERS * NEW, queries
    report = attnopt.explain(opt)
    assert report.records and all(r.rewritten for r in report.records), str(report)
    assert len({r.module_path for r in report.records}) == LAYERS, str(report)


@BUILDERS
def test_forward_and_call_run_the_rewritten_attention(build: Callable[[], nn.Module]) -> None:
    model = build()
    opt = attnopt.optimize(model, variant="sdpa")
    ids, _ = _prompts(False)
    with torch.no_grad():
        want = model(ids).logits
        calls = []
        model.register_forward_pre_hook(lambda m, args: calls.append(m))  # after optimize: the copy shares it
        for call in (opt, opt.forward):
            with profile(record_shapes=True) as prof:
                got = call(ids).logits
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            assert _site_queries(list(prof.events())) == [PROMPT] * LAYERS
    assert calls == [opt]  # opt(...) runs the hooks once; forward(...) runs none, as for any module


@BUILDERS
def test_the_model_is_untouched_and_shares_its_state(build: Callable[[], nn.Module]) -> None:
    model = build()
    keys = list(model.state_dict())
    opt = attnopt.optimize(model, variant="sdpa")
    assert model.forward.__func__ is type(model).forward and "forward" not in vars(model)
    assert isinstance(opt, type(model)) and not isinstance(opt, OptimizedModule)
    assert opt._orig_mod is model and opt is not model
    assert list(opt.state_dict()) == list(model.state_dict()) == keys  # no "_orig_mod." prefix
    assert all(a is b for a, b in zip(opt.parameters(), model.parameters()))
    assert opt.config is model.config


def test_gradients_in_training_mode_equal_the_models() -> None:
    model = _gpt2()  # dropout 0: training mode is deterministic
    opt = attnopt.optimize(model, variant="sdpa").train()
    assert model.training and all(m.training for m in model.modules())
    ids = torch.randint(1, VOCAB, (2, PROMPT))
    params = [p for p in model.parameters() if p.requires_grad]
    results = []
    for fn in (opt, model):
        loss = fn(input_ids=ids, labels=ids).loss
        results.append((loss.detach(), torch.autograd.grad(loss, params)))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-5, rtol=1e-5)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    report = attnopt.explain(opt)
    assert report.records and all(r.rewritten for r in report.records), str(report)


def test_train_and_eval_set_the_models_mode_and_forward_follows_the_model() -> None:
    """``opt.train()``/``opt.eval()`` set the model's flags (the copy's own too); ``model.eval()`` is followed."""
    model = _gpt2(dropout=0.5).train()
    opt = attnopt.optimize(model, variant="sdpa")
    ids = torch.randint(1, VOCAB, (2, PROMPT))
    assert opt.eval() is opt and not opt.training
    assert not any(m.training for m in model.modules())
    with torch.no_grad():
        torch.testing.assert_close(opt(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)
    opt.train()
    assert opt.training and all(m.training for m in model.modules())
    with torch.no_grad():
        a, b = opt(ids).logits, opt(ids).logits
    assert not torch.equal(a, b)  # dropout 0.5 is active
    model.eval()  # through the model: the copy's forward runs with the model's flags
    with torch.no_grad():
        torch.testing.assert_close(opt(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="boolean"):
        opt.train("yes")


def test_deepcopy_and_pickle_optimize_a_copy_of_the_model() -> None:
    model = _gpt2()
    opt = attnopt.optimize(model, variant="sdpa")
    ids = torch.randint(1, VOCAB, (2, PROMPT))
    with torch.no_grad():
        want = model(ids).logits
    for twin in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert isinstance(twin, type(model)) and twin._orig_mod is not model
        assert all(a is not b for a, b in zip(twin.parameters(), model.parameters()))
        with torch.no_grad():
            torch.testing.assert_close(twin(ids).logits, want, atol=1e-5, rtol=1e-5)
            next(twin.parameters()).add_(1.0)  # the copy's own weights: the model's are not changed
            torch.testing.assert_close(model(ids).logits, want)
        report = attnopt.explain(twin)
        assert report.records and all(r.rewritten for r in report.records), str(report)
    assert not attnopt.explain(opt).records  # the copies captured their own graphs, not opt's


def test_pickling_with_a_selector_of_ones_own_says_what_to_do() -> None:
    from attnopt.pipeline.steps import new_selector

    opt = attnopt.optimize(_gpt2(), selector=new_selector(None))
    with pytest.raises(TypeError, match="pickle opt._orig_mod"):
        pickle.dumps(opt)


class _Attention(nn.Module):
    """A hand-written attention without ``generate``."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.softmax(q @ k.transpose(-2, -1) * q.size(-1) ** -0.5, dim=-1) @ v


def test_a_model_without_generate_gets_an_optimized_module() -> None:
    model = _Attention()
    opt = attnopt.optimize(model, variant="sdpa")
    assert isinstance(opt, OptimizedModule) and opt._orig_mod is model
    assert "forward" not in vars(model)
    q, k, v = torch.randn(3, 1, 2, 8, 4).unbind(0)
    torch.testing.assert_close(opt(q, k, v), model(q, k, v))
    assert attnopt.explain(opt).rewritten == 1


@pytest.mark.parametrize("variant", ["auto", "sdpa"])
def test_an_optimized_plain_module_pickles_and_runs(variant: str) -> None:
    """``torch.save(opt)`` of a module without ``generate``: the selector and its tuning cache hold locks."""
    opt = attnopt.optimize(_Attention(), variant=variant)
    q = torch.randn(1, 2, 8, 4)
    want = _Attention()(q, q, q)
    torch.testing.assert_close(opt(q, q, q), want)
    buffer = io.BytesIO()
    torch.save(opt, buffer)
    buffer.seek(0)
    for twin in (pickle.loads(pickle.dumps(opt)), torch.load(buffer, weights_only=False)):
        torch.testing.assert_close(twin(q, q, q), want)
