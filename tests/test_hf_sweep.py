"""A fixed subset of the Hugging Face sweep (``benchmarks/bench_transformers.py``): every attention layer rewritten.

Each family is built by ``benchmarks/hf_zoo.py`` (its own config class shrunk to 2 layers of width 32,
random weights, eager attention) and run through ``bench_transformers.run_mode``, the sweep's own
comparison, with ``variant="sdpa"`` (no tuning): eval without a mask, eval with a padding mask (left
padding for causal LMs, right padding otherwise) and training with the right-padded mask, outputs and
gradients of every parameter and floating input against the model as written. A mode passes when every
site explain() reports is rewritten, outputs and gradients are equal, and every attention call of the
eager forward ran inside an ``attnopt::<site>`` range as SDPA (the profiler's record), so a site that is
reported rewritten but runs the plain path fails here too.

Families that the sweep does not find fully rewritten today are not in the subset (see
``benchmarks/results/transformers.md``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_transformers  # noqa: E402  (benchmarks/ is no package)
import hf_zoo  # noqa: E402

FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "phi", "opt", "falcon", "gpt_neo", "bloom", "bert", "roberta",
            "deberta-v2", "t5", "bart", "vit", "clip", "whisper")


@pytest.mark.parametrize("model_type", FAMILIES)
def test_every_attention_layer_rewritten_outputs_and_gradients_equal(model_type: str) -> None:
    entry = hf_zoo.zoo_entry(model_type)
    model = hf_zoo.build(entry)
    recipe, errors = hf_zoo.find_recipe(model)
    assert recipe is not None, errors
    count = hf_zoo.count_attention(model, hf_zoo.make_inputs(model, recipe))
    assert count.attention >= 2, f"{entry.model_class}: {count}"
    _check(bench_transformers.run_mode(model, recipe, "train", count.attention, variant="sdpa"), entry, count)


def _check(row: dict, entry: hf_zoo.ZooEntry, count: hf_zoo.AttentionCount) -> None:
    where = f"{entry.model_class} {row.get('padding') or 'no'} padding"
    assert row["status"] == "ok", f"{where}: {row.get('error')}\n{row.get('traceback', '')}"
    assert row["sites"] >= 1 and row["rewritten"] == row["sites"], f"{where}: {row['left_alone']}"
    assert not row["failures"], f"{where}: {row['failures']}"
    assert row["equal"], f"{where}: {row.get('problems')}"
    assert row["fused"] == count.attention == row["site_calls"], f"{where}: ran {row['per_site']}"
    assert row["full"], f"{where}: {row}"


class _Layer(torch.nn.Module):
    """One module per way a softmax appears: attention, attention with a sink column, and two softmaxes
    that are not attention (over the queries; over a projection of one activation)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 4)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        plain = (q @ k.transpose(-2, -1) * 0.3).softmax(-1) @ v
        scores = torch.cat([q @ k.transpose(-2, -1), torch.zeros(*q.shape[:-1], 1)], dim=-1)
        sink = torch.softmax(scores, dim=-1)[..., :-1] @ v
        over_queries = (q @ k.transpose(-2, -1)).softmax(-2) @ v  # GroupViT's assignment
        mixing = self.proj(q).softmax(-1) @ v[..., :4, :]  # hyper-connection weights: one activation, a parameter
        return plain + sink + over_queries + mixing


def test_the_sweep_counts_softmaxes_over_the_keys_of_two_activations_only() -> None:
    q, k, v = (torch.randn(2, 4, 8) for _ in range(3))
    count = hf_zoo.count_attention(_Layer(), {"q": q, "k": k, "v": v})
    assert count.softmax == 4
    assert count.attention == 2, count
