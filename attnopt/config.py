"""Options for ``optimize``/``rewrite``, validated once in a frozen dataclass."""

from __future__ import annotations

from dataclasses import dataclass

from .env import EAGER, VARIANTS, parse_bytes
from .kernels.registry import candidate_names


def accepted_variants() -> list[str]:
    """Every value ``variant=`` accepts: ``auto``, ``sdpa``, ``eager`` and each registered candidate."""
    return list(VARIANTS) + [c for c in candidate_names() if c not in VARIANTS]


@dataclass(frozen=True)
class OptimizeConfig:
    """How attnopt treats the sites it proves.

    Attributes:
        variant: ``"auto"`` (the profile-guided selector: every legal candidate is timed on
            the device for the real shapes and the fastest within ``memory_budget`` is kept),
            ``"sdpa"`` (force SDPA), ``"eager"`` (rewrite nothing: an A/B baseline), or the
            name of any registered candidate (``attnopt.candidate_names()``).
        compile: hand the rewritten graph to Inductor instead of running it eagerly.
        verify: run original and rewritten graph on the first inputs and drop any rewrite
            whose outputs differ beyond the dtype's tolerance.
        memory_budget: bytes (or a string such as ``"512MiB"``) that one attention call may
            allocate at its peak; the selector rejects candidates above it.
    """

    variant: str = "auto"
    compile: bool = False
    verify: bool = False
    memory_budget: int | str | None = None

    def __post_init__(self) -> None:
        accepted = accepted_variants()
        if not isinstance(self.variant, str) or self.variant not in accepted:
            raise ValueError(f"unknown variant {self.variant!r}; accepted values: {', '.join(map(repr, accepted))}")
        for name in ("compile", "verify"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        object.__setattr__(self, "memory_budget", parse_bytes(self.memory_budget))
        if self.memory_budget is not None and self.variant != "auto":
            raise ValueError(f"memory_budget is honoured by the selector only; use variant='auto' "
                             f"(got variant={self.variant!r})")

    @property
    def candidate(self) -> str | None:
        """Candidate every provable site gets, or None to rewrite nothing."""
        if self.variant == EAGER:
            return None
        return self.variant
