"""A model with a user's ``torch.autograd.Function`` beside its attention (BLOOM's ``GeLUFunction``).

Dynamo captures such a Function as a higher-order op; run eagerly as captured, its backward runs with gradients
disabled, so a double backward would silently lose the second-order terms through it. attnopt marks the
Function's outputs: outputs and first-order gradients are exact and the attention is still rewritten, and a
backward with ``create_graph=True`` through the Function raises instead of returning wrong numbers.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import attnopt


class Gelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        cdf = 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))
        pdf = torch.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
        return g * (cdf + x * pdf)


class Block(nn.Module):
    def __init__(self, d: int = 16, h: int = 2):
        super().__init__()
        self.h = h
        self.qkv, self.up, self.down = nn.Linear(d, 3 * d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (y.view(b, t, self.h, c // self.h).transpose(1, 2) for y in self.qkv(x).split(c, 2))
        att = ((q @ k.transpose(-2, -1)) / math.sqrt(c // self.h)).softmax(-1)
        x = x + (att @ v).transpose(1, 2).reshape(b, t, c)
        return x + self.down(Gelu.apply(self.up(x)))


def test_outputs_and_gradients_exact_and_double_backward_refused():
    torch.manual_seed(0)
    model = Block()
    x = torch.randn(2, 6, 16, requires_grad=True)
    opt = attnopt.optimize(model)
    ref, got = model(x), opt(x)
    assert "1 of 1 attention site(s) rewritten" in str(attnopt.explain(opt))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
    params = list(model.parameters())
    want = torch.autograd.grad(ref.square().sum(), [x, *params])
    have = torch.autograd.grad(opt(x).square().sum(), [x, *params])
    for a, b in zip(have, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    with pytest.raises(RuntimeError, match="create_graph=True"):
        (gx,) = torch.autograd.grad(opt(x).square().sum(), x, create_graph=True)
        torch.autograd.grad(gx.square().sum(), params)
