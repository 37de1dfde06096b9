"""Backward passes the candidates cannot give: double backward and a backward that raises.

:class:`_Recomputable` runs a candidate with its own backward unless autograd asks for a graph of
the backward (``create_graph=True``), where it recomputes the reference differentiably;
:class:`_TwiceDifferentiable` does the same for the SDPA family, whose outputs it clones.
:func:`recomputable` picks between them for a site; the per-call dispatch
(:mod:`attnopt.runtime.dispatch`) calls it when gradients are needed.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ..kernels.reference import reference_attention


class _Recomputable(torch.autograd.Function):
    """A candidate's forward with a backward that works wherever autograd's does.

    The forward runs the candidate under autograd on detached inputs and keeps its graph. The
    backward is that graph's (the candidate's own fused backward) unless autograd records the
    backward itself (``create_graph=True``): then the reference computation is recomputed
    differentiably from the saved inputs, so gradients of gradients are exact. A backward that
    raises (e.g. a kernel under ``torch.autocast``) is recomputed the same way, with a warning.
    """

    @staticmethod
    def forward(ctx: Any, site: Any, fn: Any, kwargs: dict, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        inner = [t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) and t.is_floating_point()
                 else t for t in (q, k, v, mask)]
        with torch.enable_grad():
            out = fn(*inner[:3], **dict(kwargs, attn_mask=inner[3]))
        ctx.site, ctx.kwargs, ctx.inner, ctx.out = site, kwargs, inner, out
        ctx.save_for_backward(q, k, v, mask)
        return out.detach()

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        need = ctx.needs_input_grad[3:7]
        grads: list[torch.Tensor | None] = [None] * 4
        create_graph = torch.is_grad_enabled()  # autograd records this backward (double backward)
        if not create_graph:  # an ordinary backward: the candidate's own
            targets = [i for i in range(4) if need[i] and ctx.inner[i] is not None and ctx.inner[i].requires_grad]
            try:
                got = torch.autograd.grad(ctx.out, [ctx.inner[i] for i in targets], grad_out, retain_graph=True,
                                          allow_unused=True)
                for i, g in zip(targets, got):
                    grads[i] = g
                return (None, None, None, *grads)
            except Exception as e:  # noqa: BLE001 - never break the user's backward; recompute it instead
                warnings.warn(f"attnopt: the backward of the candidate at {ctx.site.site_name} ({ctx.site.where}) "
                              f"failed ({type(e).__name__}: {e}); recomputing it with the reference computation",
                              stacklevel=2)
        saved = ctx.saved_tensors
        with torch.enable_grad():
            if create_graph:
                inputs = list(saved)
            else:
                inputs = [t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor)
                          and t.is_floating_point() else t for t in saved]
            targets = [i for i in range(4) if need[i] and isinstance(inputs[i], torch.Tensor)
                       and inputs[i].requires_grad]
            with torch.autocast(grad_out.device.type, enabled=False):
                out = reference_attention(*inputs[:3], **dict(ctx.kwargs, attn_mask=inputs[3]))
            got = torch.autograd.grad(out, [inputs[i] for i in targets], grad_out.to(out.dtype),
                                      create_graph=create_graph, allow_unused=True)
        for i, g in zip(targets, got):
            grads[i] = None if g is None else g.to(saved[i].dtype)
        return (None, None, None, *grads)


class _TwiceDifferentiable(torch.autograd.Function):
    """Identity on a candidate's output ``out = fn(q, k, v, mask)`` that makes its backward differentiable.

    For candidates whose backward is PyTorch's own (the SDPA family): an ordinary backward passes the
    gradient through to the candidate's fused backward (no second autograd pass, one extra node);
    when autograd records the backward (``create_graph=True``) it sends nothing to the candidate and
    returns the reference computation's gradients for q, k, v and the mask, computed differentiably.
    """

    @staticmethod
    def forward(ctx: Any, kwargs: dict, out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        ctx.kwargs = kwargs
        ctx.save_for_backward(q, k, v, mask)
        return out.clone()  # a new tensor: the caller may write it in place

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        if not torch.is_grad_enabled():
            return None, grad_out, None, None, None, None
        saved = ctx.saved_tensors
        need = ctx.needs_input_grad[2:6]
        targets = [i for i in range(4) if need[i]]
        with torch.autocast(grad_out.device.type, enabled=False):
            out = reference_attention(*saved[:3], **dict(ctx.kwargs, attn_mask=saved[3]))
        got = torch.autograd.grad(out, [saved[i] for i in targets], grad_out.to(out.dtype), create_graph=True,
                                  allow_unused=True)
        grads: list[torch.Tensor | None] = [None] * 4
        for i, g in zip(targets, got):
            grads[i] = None if g is None else g.to(saved[i].dtype)
        return (None, None, *grads)


#: Candidates whose backward is PyTorch's own autograd (it works under autocast and checkpointing):
#: their output only needs the cheap :class:`_TwiceDifferentiable` node.
_NATIVE_BACKWARD = frozenset(("sdpa", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn"))


def recomputable(site: Any, fn: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  kwargs: dict) -> torch.Tensor:
    """``fn(q, k, v, **kwargs)`` with a backward that works for double backward and where ``fn``'s own raises.

    ``site`` (any object with ``site_name`` and ``where``) names the site in the warning of a failed backward.
    """
    if torch._C._are_functorch_transforms_active():
        return fn(q, k, v, **kwargs)  # functorch transforms differentiate the candidate's own graph
    rest = {n: a for n, a in kwargs.items() if n != "attn_mask"}
    if getattr(fn, "name", None) in _NATIVE_BACKWARD:
        return _TwiceDifferentiable.apply(rest, fn(q, k, v, **kwargs), q, k, v, kwargs["attn_mask"])
    return _Recomputable.apply(site, fn, rest, q, k, v, kwargs["attn_mask"])
