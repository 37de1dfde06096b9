"""The SDPA family of candidates: ``sdpa`` (PyTorch's dispatcher picks the backend) and SDPA
restricted to one backend with ``torch.nn.attention.sdpa_kernel`` (``sdpa_flash``, ``sdpa_math``; on
CUDA also ``sdpa_efficient`` and ``sdpa_cudnn``), registered on import.

:func:`same_kernel_as_sdpa` names the restricted candidate that plain ``sdpa`` itself runs on given
inputs (PyTorch's own backend choice, ``torch._fused_sdp_choice``): the selector does not time the two
apart there (they run one kernel; the restricted one only adds its context manager).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import kernels  # noqa: E402,F401 - registers the kernels' candidates (they import this module)
from ..spec import AttentionSpec
from .registry import FunctionCandidate, register_candidate


def _sdpa_supports(spec: AttentionSpec) -> str | None:
    if spec.score_mod is not None:
        return f"SDPA cannot apply a score modifier ({spec.score_mod})"
    if spec.gqa and not _HAS_GQA:
        return "enable_gqa needs torch >= 2.5"
    return None


_HAS_GQA = torch.__version__ >= "2.5"  # TorchVersion compares as a version


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, attn_mask: torch.Tensor | None,
          dropout_p: float, is_causal: bool, scale: float, enable_gqa: bool) -> torch.Tensor:
    if enable_gqa:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale)


register_candidate(FunctionCandidate("sdpa", _sdpa, _sdpa_supports,
                                     "torch.nn.functional.scaled_dot_product_attention", every_shape=True))


def _restricted(backend: SDPBackend) -> Callable[..., torch.Tensor]:
    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: object) -> torch.Tensor:
        with sdpa_kernel(backend):
            return _sdpa(q, k, v, **kwargs)  # type: ignore[arg-type]

    return fn


for _name, _backend, _devices in (("sdpa_flash", "FLASH_ATTENTION", ("cpu", "cuda")),
                                  ("sdpa_math", "MATH", ("cpu", "cuda")),
                                  ("sdpa_efficient", "EFFICIENT_ATTENTION", ("cuda",)),
                                  ("sdpa_cudnn", "CUDNN_ATTENTION", ("cuda",))):
    if hasattr(SDPBackend, _backend):
        register_candidate(FunctionCandidate(_name, _restricted(getattr(SDPBackend, _backend)), _sdpa_supports,
                                             f"SDPA restricted to its {_backend.lower()} backend", _devices,
                                             every_shape=True, materialises=_backend == "MATH"))


_BACKEND_CANDIDATE = {"FLASH_ATTENTION": "sdpa_flash", "MATH": "sdpa_math", "EFFICIENT_ATTENTION": "sdpa_efficient",
                      "CUDNN_ATTENTION": "sdpa_cudnn"}


def same_kernel_as_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: dict) -> str | None:
    """The restricted candidate (``sdpa_flash``, ``sdpa_math``, ...) whose backend plain SDPA picks for this call,
    or None where that cannot be told (a window, a score modifier, a torch without the choice function).

    ``kwargs`` are the candidates' keyword arguments (``attn_mask``, ``dropout_p``, ``is_causal``, ``scale``,
    ``enable_gqa``)."""
    choose = getattr(torch, "_fused_sdp_choice", None)
    if choose is None or "window" in kwargs or "score_mod" in kwargs:
        return None
    try:
        extra = {"enable_gqa": True} if kwargs.get("enable_gqa") else {}
        index = int(choose(q, k, v, kwargs.get("attn_mask"), float(kwargs.get("dropout_p", 0.0)),
                           bool(kwargs.get("is_causal", False)), scale=kwargs.get("scale"), **extra))
        backend = SDPBackend(index)
    except (RuntimeError, TypeError, ValueError):  # no usable backend, or another signature
        return None
    return _BACKEND_CANDIDATE.get(backend.name)
