"""Optimize a nanoGPT-style model with attnopt's public API and compare it with the model as written.

    python examples/nanogpt_demo.py
"""

from __future__ import annotations

import torch

import attnopt
from attnopt.models import GPTConfig, NanoGPT
from attnopt.selection.measure import time_alternating


def main() -> None:
    torch.manual_seed(0)
    model = NanoGPT(GPTConfig(block_size=512, n_layer=2, n_head=8, n_embd=256)).eval()
    idx = torch.randint(0, model.config.vocab_size, (1, 512))

    opt = attnopt.optimize(model)  # same signature, same weights; the graph is captured on the first call

    with torch.no_grad():
        expected, got = model(idx), opt(idx)
        print(f"max abs difference of logits: {(expected - got).abs().max().item():.2e}")
        torch.testing.assert_close(got, expected)
    times = time_alternating({"as written": model, "attnopt": opt}, (idx,), repeats=5)
    print(f"as written: {times['as written'] * 1e3:.1f} ms   attnopt: {times['attnopt'] * 1e3:.1f} ms "
          "(medians of 5 alternating runs)")
    print(attnopt.explain(opt))


if __name__ == "__main__":
    main()
