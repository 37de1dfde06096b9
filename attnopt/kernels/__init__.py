"""Attention kernels beyond SDPA, each registering its candidates on import.

Every module here builds candidates with :class:`attnopt.candidates.FunctionCandidate` and
calls :func:`attnopt.candidates.register_candidate`; :mod:`attnopt.candidates` imports this
package once its own names exist, so ``candidate_names()`` always lists every kernel.
Kernels must be exact: outputs and gradients equal to ``reference_attention`` within the
dtype's tolerance, on every input their ``supports`` accepts.
"""

from . import flex, tiled  # noqa: F401
