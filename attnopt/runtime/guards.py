"""Guards that keep a proof true at run time.

:class:`BufferGuard` pins a tensor a causal or band proof read (the tensor object by weak
reference and its version counter; call inputs, inference tensors and strict mode are checked on
their values every call); :class:`ConditionGuard` checks a run-time condition (e.g. a padding mask
that hides no key) on each call.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

from ..env import strict_guards
from ..kernels.bands import is_band

#: Whether a profiler records (``torch.profiler``, ``emit_itt``): the sites open their ``attnopt::<site>`` range
#: only then, or while a graph is traced (a compiled graph keeps the range it was traced with).
profiler_records = torch._C._autograd._profiler_enabled


def is_fake(t: object) -> bool:
    """``t`` stands for a tensor while a graph is traced (a fake or functional tensor): it has no values."""
    return isinstance(t, (FakeTensor, FunctionalTensor))


def is_tracing(t: torch.Tensor) -> bool:
    return torch.compiler.is_compiling() or isinstance(t, (FakeTensor, FunctionalTensor))


@dataclass
class BufferGuard:
    """Checks that a tensor a causal proof read still holds the proven band pattern.

    The pattern is the tensor's own ``(cuts, values)`` (``kernels.bands.band_pattern``): lower-triangular
    for nanoGPT's ``tril(ones)``, a band for a sliding window. The cheap check is the tensor's
    *identity* (a weak reference to the object the pattern was last seen on) and its version
    counter (bumped by every in-place write). Addresses are not trusted: a fresh tensor always
    has version 0 and the allocator reuses freed memory. Any other object (a buffer deleted and
    registered again, a deep copy) or a moved version is checked again on its values (a few
    passes over it); if the pattern no longer holds, the site passes the mask tensor instead of
    ``is_causal``. With ``strict`` the values are checked on every call: always for a tensor that
    is a call input (a mask passed to ``forward``, which the caller may refill through numpy or
    DLPack without a version bump), for inference tensors (no version counter), and for every
    tensor with ``ATTNOPT_STRICT=1``.
    """

    cuts: tuple[Any, ...]
    values: tuple[Any, ...]
    strict: bool = False
    version: int = -1
    _ref: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, t: torch.Tensor | None, cuts: tuple[Any, ...], values: tuple[Any, ...],
           strict: bool | None = None) -> BufferGuard:
        g = cls(tuple(cuts), tuple(values), strict_guards() if strict is None else strict)
        if isinstance(t, torch.Tensor) and not is_tracing(t):
            g._pin(t)
        return g

    def _pin(self, t: torch.Tensor) -> None:
        if t.is_inference():  # inference tensors have no version counter: checked on every call
            self._ref = None
            return
        self._ref, self.version = weakref.ref(t), t._version

    def pinned_to(self, t: torch.Tensor) -> bool:
        """``t`` is the very object last checked, unchanged since (by its version counter)."""
        return self._ref is not None and not t.is_inference() and self._ref() is t and t._version == self.version

    def holds(self, t: torch.Tensor) -> bool:
        if t.requires_grad:
            return False  # is_causal would drop the gradient that reaches this tensor through the mask
        ref = self._ref
        if not self.strict and ref is not None and not t.is_inference() and ref() is t and t._version == self.version:
            return True  # self.pinned_to(t), inlined: checked on every call
        ok = is_band(t, self.cuts, self.values)
        if ok:
            self._pin(t)
        else:
            self._ref = None
            warnings.warn("attnopt: a mask tensor the causal proof read no longer holds the proven causal pattern; "
                          "the site passes the mask tensor to the candidate for this call", stacklevel=3)
        return ok

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_ref"] = None  # a weak reference neither pickles nor means anything in another process
        return state

    def __deepcopy__(self, memo: dict[int, Any]) -> BufferGuard:
        return BufferGuard(self.cuts, self.values, self.strict)  # the copy's tensors are other objects


@dataclass
class ConditionGuard:
    """A run-time mask term the causal proof assumed: all True (``band & x``) or all False (``band | x``).

    Typically a padding mask: Hugging Face ANDs ``attention_mask[b, kv_idx]`` into its causal mask,
    which is the causal pattern exactly when no key is padded. Checked on every call (one
    reduction over the term); when it fails the site passes the mask tensor, silently.
    """

    all_true: bool

    def holds(self, t: torch.Tensor) -> bool:
        return bool(t.all()) if self.all_true else not bool(t.any())
