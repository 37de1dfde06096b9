"""Per-call cost at a small shape: nanoGPT block (C=768, H=12), B=1, T=64, fp32, CPU, ``variant="sdpa"``.

    python benchmarks/bench_step_overhead.py --rounds 60 --threads 1

Times ``attnopt.optimize(block)`` against the same block hand-written with SDPA
(``attnopt.models.SDPACausalSelfAttention``, shared weights), alternating the two in one process:
a forward under ``no_grad`` and a training step (forward + backward). Prints medians and the ratio
``time(SDPA block) / time(attnopt)`` (> 1: attnopt is faster). At this size the attention itself is
cheap, so the ratio shows what a site adds per call (dynamo guards, the site's dispatch, and with
gradients its twice-differentiable wrapper).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

import attnopt
from attnopt.models import CausalSelfAttention, GPTConfig, SDPACausalSelfAttention


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=60, help="timed alternating rounds per mode")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--seq-len", type=int, default=64)
    args = p.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = GPTConfig(n_embd=768, n_head=12, block_size=max(256, args.seq_len), dropout=0.0)
    block = CausalSelfAttention(cfg).eval()
    sdpa = SDPACausalSelfAttention(cfg).eval()
    sdpa.load_state_dict(block.state_dict(), strict=False)
    opt = attnopt.optimize(block, variant="sdpa")
    x = torch.randn(1, args.seq_len, cfg.n_embd, requires_grad=True)

    def forward(m: torch.nn.Module) -> None:
        with torch.no_grad():
            m(x)

    def step(m: torch.nn.Module) -> None:
        m(x).sum().backward()

    for label, fn in (("forward (no_grad)", forward), ("training step", step)):
        for _ in range(5):
            fn(opt)
            fn(sdpa)
        a, b = [], []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            fn(opt)
            a.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            fn(sdpa)
            b.append(time.perf_counter() - t0)
        ma, mb = statistics.median(a) * 1e3, statistics.median(b) * 1e3
        print(f"{label}: attnopt {ma:.3f} ms, SDPA block {mb:.3f} ms, ratio {mb / ma:.3f}x")


if __name__ == "__main__":
    main()
