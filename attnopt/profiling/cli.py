"""``attnopt profile SPEC ...``: the command line of the profiler (arguments, checks, exit status).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .report import breakdown_table, table
from .run import DTYPES, PHASES, check_options, phases_of, profile
from .spec import SpecError


# -- command line ----------------------------------------------------------------------------------------------
def _int_list(text: str) -> list[int]:
    problem = f"expected positive integers separated by commas (e.g. 1,8), got {text!r}"
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(problem) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(problem)
    return values


def _phase(text: str) -> str:
    try:
        phases_of(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(PHASES)}, or several "
                                         "separated by commas, e.g. prefill,train)") from None
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``attnopt profile``."""
    parser.add_argument("spec", metavar="SPEC",
                        help="a built-in example (nanogpt, bert), 'package.module:factory' or 'file.py:factory' "
                             "where factory() returns (model, make_inputs) and make_inputs(batch_size, seq_len) "
                             "returns the model's arguments")
    parser.add_argument("--batch-sizes", type=_int_list, default=[1], help="comma-separated (default 1)")
    parser.add_argument("--seq-lens", type=_int_list, default=[128, 512], help="comma-separated (default 128,512)")
    parser.add_argument("--phase", type=_phase, default="prefill",
                        help="prefill: a forward over T tokens; decode: one new token after T (causal LMs); train: "
                             "forward + backward; both: prefill,decode; all: the three (or a comma list)")
    parser.add_argument("--variants", default="eager,auto",
                        help="comma-separated: eager (as written), auto, sdpa or a registered candidate "
                             "(default eager,auto)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="default float32")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per variant and point (default 10)")
    parser.add_argument("--matmul-size", type=int, default=None,
                        help="side of the matmul that measures the device's rate (default 1024 CPU, 8192 CUDA)")
    parser.add_argument("--trace", action="store_true", help="write chrome traces per point under DIR/traces")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and inputs (default 0)")
    parser.add_argument("--kv-budget", default=None,
                        help="KV cache memory to plan for (bytes or e.g. 8GiB): decode says how many sequences fit")
    parser.add_argument("--memory-budget", default=None,
                        help="memory one call may use (bytes or e.g. 2GiB): the batch-size summary names the first "
                             "batch size above it")
    parser.add_argument("--sweet-spot-threshold", type=float, default=0.1,
                        help="throughput growth per doubling of the batch size below which it has stopped growing "
                             "(default 0.1: 10%%)")
    parser.add_argument("--memory-timeline", action="store_true",
                        help="write DIR/memory_<phase>_B<b>_T<t>.png: live tensor memory over one call, sites marked")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for torch (default: torch's); 1 keeps timings steadier on a shared machine")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument("--out", metavar="DIR", required=True, help="folder for report.json, plots and traces")


def main(args: argparse.Namespace) -> int:
    """Entry point of ``attnopt profile`` once its arguments are parsed."""
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    problem = check_options(batch_sizes=args.batch_sizes, seq_lens=args.seq_lens, phase=args.phase,
                            variants=variants, dtype=args.dtype, device=args.device, repeats=args.repeats,
                            matmul_size=args.matmul_size, threads=args.threads,
                            sweet_spot_threshold=args.sweet_spot_threshold)
    if problem:
        print(f"attnopt profile: error: {problem}", file=sys.stderr)
        return 2
    try:
        report = profile(args.spec, batch_sizes=args.batch_sizes, seq_lens=args.seq_lens, phase=args.phase,
                         variants=variants, dtype=args.dtype, device=args.device, repeats=args.repeats,
                         trace=args.trace, out=args.out, progress=not args.no_progress,
                         matmul_size=args.matmul_size, seed=args.seed, threads=args.threads,
                         kv_budget=args.kv_budget, memory_budget=args.memory_budget,
                         memory_timeline=args.memory_timeline, sweet_spot_threshold=args.sweet_spot_threshold)
    except (SpecError, ValueError, TypeError) as e:  # a bad SPEC, or a bad --kv-budget / --memory-budget
        print(f"attnopt profile: error: {e}", file=sys.stderr)
        return 2
    env = report["environment"]
    print(f"{report['description']}; {env['device']} ({env['device_name']}), {report['options']['dtype']}, "
          f"torch {env['torch']}, {env['threads']} threads; matmul {env['matmul']['size']}^3: "
          f"{env['matmul']['flops_per_s'] / 1e9:.1f} GFLOP/s; medians of {args.repeats} alternating runs"
          + ("" if "train" in phases_of(args.phase) else ", no_grad"))
    load, cpus = env["load_average"], env["cpu_count"] or 1
    if load is not None and load > 0.5 * cpus:
        print(f"note: 1-min load average {load:.1f} on {cpus} CPUs: other processes share the CPUs, so times are "
              f"inflated and noisy (try more --repeats)")
    print()
    print(table(report["records"]))
    print("* in profiled calls (profiling slows the forward too; the share compares times of the same calls)")
    breakdown = breakdown_table(report["records"])
    if breakdown:
        print()
        print("where the time goes (shares of the profiled call; modules of compiled variants are not visible):")
        print(breakdown)
    print()
    for line in report["summary"]:
        print(line)
    print(f"\nwrote {Path(args.out) / 'report.json'}, {report['html']}" + "".join(f", {p}" for p in report["plots"]))
    statuses = {r["status"] for r in report["records"]}
    if "ok" not in statuses and statuses & {"oom", "error"}:
        print("attnopt profile: error: every measurement failed (see the errors above and in report.json)",
              file=sys.stderr)
        return 1
    return 0
