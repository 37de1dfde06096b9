"""attnopt: find hand-written attention in PyTorch models and run it through exact, faster kernels.

    >>> import attnopt
    >>> opt = attnopt.optimize(model)            # same signature, same outputs and gradients
    >>> print(attnopt.explain(opt))              # every site found, what was done, and why
    >>> attnopt.generate(lm, idx, 100)           # KV-cached generation for a causal LM written without a cache
    >>> attnopt.profile("nanogpt", seq_lens=[128, 512], out="prof")  # where time and memory go

Importing attnopt touches no device and compiles nothing.
"""

from __future__ import annotations

import logging

from .api import explain, optimize, rewrite, tune
from .config import OptimizeConfig
from .env import __version__
from .generation import generate
from .kernels.registry import candidate_names, get_candidate, register_candidate
from .kernels.tiled import tiled_attention
from .pipeline.backend import attnopt_backend, last_report
from .pipeline.report import Report
from .profiling.run import profile
from .selection.selector import Selector
from .spec import AttentionSpec, SiteRecord

# Every module logs to ``attnopt.<module>``; nothing is printed unless the application configures logging.
logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "AttentionSpec",
    "OptimizeConfig",
    "Report",
    "Selector",
    "SiteRecord",
    "__version__",
    "attnopt_backend",
    "candidate_names",
    "explain",
    "generate",
    "get_candidate",
    "last_report",
    "optimize",
    "profile",
    "register_candidate",
    "rewrite",
    "tiled_attention",
    "tune",
]
