"""attnopt: find hand-written attention in PyTorch models and run it through exact, faster kernels.

    >>> import attnopt
    >>> opt = attnopt.optimize(model)            # same signature, same outputs and gradients
    >>> print(attnopt.explain(opt))              # every site found, what was done, and why
    >>> attnopt.generate(lm, idx, 100)           # KV-cached generation for a causal LM written without a cache
    >>> attnopt.profile("nanogpt", seq_lens=[128, 512], out="prof")  # where time and memory go

Importing attnopt touches no device and compiles nothing.
"""

from __future__ import annotations

from .api import explain, optimize, rewrite, tune
from .backend import attnopt_backend, last_report
from .candidates import candidate_names, get_candidate, register_candidate
from .config import OptimizeConfig
from .generation import generate
from .kernels.tiled import tiled_attention
from .profile import profile
from .report import Report
from .selector import Selector
from .site import AttentionSpec, SiteRecord

__version__ = "0.1.0"

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
