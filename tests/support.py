"""Helpers shared by the test modules."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F


def capture(model: nn.Module, *inputs) -> tuple[fx.GraphModule, list]:
    """The FX graph and example inputs dynamo hands a backend for ``model(*inputs)`` (one graph, no breaks)."""
    store: dict = {}

    def backend(gm, example_inputs):
        store["gm"], store["ex"] = gm, list(example_inputs)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend, fullgraph=True)(*inputs)
    return store["gm"], store["ex"]


class Fn(nn.Module):
    """Wraps ``fn(self, *inputs)`` as a module; keyword tensors become parameters, ``buffers=`` buffers."""

    def __init__(self, fn, buffers: dict | None = None, **params: torch.Tensor):
        super().__init__()
        self.fn = fn
        for name, p in params.items():
            self.register_parameter(name, nn.Parameter(p))
        for name, b in (buffers or {}).items():
            self.register_buffer(name, b)

    def forward(self, *args):
        return self.fn(self, *args)


def assert_param_grads_close(model: nn.Module, out: torch.Tensor, ref: torch.Tensor, *, atol: float = 1e-5,
                             rtol: float = 1e-4, reduction: str = "mean") -> None:
    """The gradients of ``out.square().mean()`` and ``ref.square().mean()`` (``.sum()`` with ``reduction="sum"``;
    the rewritten model's output and the model's own) with respect to every trainable parameter of ``model``
    agree; an unused parameter on both."""
    params = [p for p in model.parameters() if p.requires_grad]
    have = torch.autograd.grad(getattr(out.square(), reduction)(), params, allow_unused=True)
    want = torch.autograd.grad(getattr(ref.square(), reduction)(), params, allow_unused=True)
    for a, b in zip(have, want):
        assert (a is None) == (b is None)
        if b is not None:
            torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


def count_sdpa(monkeypatch) -> list[int]:
    """``[n]``: how many times ``F.scaled_dot_product_attention`` runs from now on (in this test)."""
    calls = [0]
    orig = F.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls[0] += 1
        return orig(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counted)
    return calls


def fallbacks(opt: nn.Module) -> dict[str, int]:
    """What ``explain()`` counts for the sites of ``opt`` (in every graph dynamo captured of it): the calls that
    ran as written, wholly or in part, per reason."""
    import attnopt

    counts: dict[str, int] = {}
    for r in attnopt.explain(opt):
        for why, n in r.extra.get("fallbacks", {}).items():
            counts[why] = counts.get(why, 0) + n
    return counts
