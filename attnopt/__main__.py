"""Command line: ``python -m attnopt <command>`` (also installed as ``attnopt``).

    $ attnopt demo                 # optimize the built-in NanoGPT, print measured speed/memory and explain()
    $ attnopt demo --seq-len 512 --layers 2
    $ attnopt profile nanogpt --seq-lens 128,512 --phase both --out prof/   # sweep: table, report.json, plots
    $ attnopt profile compare before/report.json after/report.json        # what changed; exit 1 on a regression

Each subcommand lives in its own module and contributes ``add_arguments(parser)`` and
``main(args) -> int``; add new ones to ``_COMMANDS``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help); modules are imported only when their command runs.
_COMMANDS = {
    "demo": ("attnopt.demo", "optimize the built-in NanoGPT and show measured speed, memory and explain()"),
    "profile": ("attnopt.profiling.cli", "time, memory and attention share of a model before and after attnopt, "
                "over batch sizes and sequence lengths"),
    "cache": ("attnopt.cache_cli", "list, show, clear or retune the tuning cache (what each shape key chose, and why)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnopt", description="Find hand-written attention in PyTorch models "
                                     "and rewrite it to exact, faster kernels.")
    sub = parser.add_subparsers(dest="command", metavar="command", required=True)
    for name, (module, help_text) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:2] == ["profile", "compare"]:  # `attnopt profile compare OLD NEW`: two reports, not a SPEC
        return int(importlib.import_module("attnopt.profiling.compare").main(argv[2:]))
    args = build_parser().parse_args(argv)
    module, _ = _COMMANDS[args.command]
    return int(importlib.import_module(module).main(args))


if __name__ == "__main__":
    raise SystemExit(main())
