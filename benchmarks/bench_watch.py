"""Per-step cost of a cached model's watch (``CachedLM.watch.check()``, run before every prefill and step).

    python benchmarks/bench_watch.py              # median of 500 checks per model (20 for the large ones)

The watch checks that the Python state the capture made constant is unchanged (see the README's KV-cache
section). Its cost grows with what the model holds: plain attributes, configs, and lists or dicts compared by
value on every step. Models: the benchmark nanoGPT (6 layers, C=384), tiny Hugging Face GPT-2 and Llama
(4 layers, C=64, random weights, eager attention), and a 2-layer nanoGPT holding a vocabulary of ``--vocab``
entries as a list and a dict (``id_to_token``, ``token_to_id``), which forward never reads. Prints the median
microseconds per check and the model's own one-token forward for scale.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable

import torch
from tabulate import tabulate

from attnopt.generation import cached
from attnopt.models import GPTConfig, NanoGPT


def median_us(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def models(vocab: int) -> dict[str, torch.nn.Module]:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    out: dict[str, torch.nn.Module] = {
        "nanoGPT 6L C=384": NanoGPT(GPTConfig(n_layer=6, n_embd=384, n_head=6, block_size=320, vocab_size=65,
                                              dropout=0.0)),
        "HF GPT-2 4L C=64": GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=64, n_layer=4, n_head=4,
                                                       bos_token_id=0, eos_token_id=0,
                                                       attn_implementation="eager")),
        "HF Llama 4L C=64": LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                                         num_hidden_layers=4, num_attention_heads=4,
                                                         num_key_value_heads=2, attn_implementation="eager")),
    }
    held = NanoGPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=64, vocab_size=65, dropout=0.0))
    held.id_to_token = [f"tok{i}" for i in range(vocab)]
    held.token_to_id = {f"tok{i}": i for i in range(vocab)}
    out[f"nanoGPT 2L holding a {vocab}-entry vocabulary"] = held
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    rows = []
    for name, model in models(args.vocab).items():
        model.eval()
        lm = cached(model)
        idx = torch.randint(0, 65, (1, 8))
        lm.prefill(idx)
        big = "vocabulary" in name
        check = median_us(lm.watch.check, 20 if big else 500)
        with torch.no_grad():
            forward = median_us(lambda m=model, x=idx[:, :1]: m(x), 20 if big else 200)
        rows.append([name, f"{check:.0f}", f"{forward:.0f}", f"{check / forward:.2f}"])
    print(tabulate(rows, headers=["model", "watch.check() us", "one-token forward us", "check / forward"]))


if __name__ == "__main__":
    main()
