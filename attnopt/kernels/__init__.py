"""The candidates: every implementation a site may run, behind one interface, and the exactness contract.

* ``registry``: the :class:`~attnopt.kernels.registry.Candidate` interface and the registry
  (``register_candidate``, ``get_candidate``, ``candidate_names``);
* ``reference``: the computation as written (the ``math`` candidate) and the tolerance every
  candidate must meet against it;
* ``bands``: bands and sliding windows as tensors;
* ``sdpa``, ``tiled``, ``flex``: the candidates, each registering itself on import.

Importing this package registers every candidate, so ``candidate_names()`` always lists them all.
Kernels must be exact: outputs and gradients equal to ``reference_attention`` within the dtype's
tolerance, on every input their ``supports`` accepts.
"""

from . import bands, flex, reference, registry, sdpa, tiled  # noqa: F401 - registration order: the import order

__all__ = ["bands", "flex", "reference", "registry", "sdpa", "tiled"]
