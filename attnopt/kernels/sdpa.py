"""The SDPA family of candidates: ``sdpa`` (PyTorch's dispatcher picks the backend) and SDPA
restricted to one backend with ``torch.nn.attention.sdpa_kernel`` (``sdpa_flash``, ``sdpa_math``; on
CUDA also ``sdpa_efficient`` and ``sdpa_cudnn``), registered on import.
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
                                             every_shape=True))
