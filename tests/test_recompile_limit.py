"""Past dynamo's recompile limit a function runs as written for new guards: attnopt says so.

Dynamo keeps at most ``config.recompile_limit`` graphs per function; past it, calls whose guards no graph
holds (a new shape under ``dynamic=False``) run the function as written, without attnopt's rewrites. Such a
model is still correct but no longer faster, so ``explain()`` notes it and attnopt warns, saying what to do.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import attnopt


class Attention(nn.Module):  # a class of this file only: dynamo counts graphs per function (code object)
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.size(0), x.size(1), 3, 2, 8).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1) / 8 ** 0.5).softmax(-1)
        return (att @ v).transpose(1, 2).reshape(x.shape)


def test_the_recompile_limit_is_noted_and_warned():
    model = Attention().eval()
    opt = attnopt.optimize(model, variant="sdpa", dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=2), torch.no_grad():
        opt(torch.randn(1, 4, 16))
        opt(torch.randn(1, 5, 16))
        assert not attnopt.explain(opt).failures  # within the limit: nothing to say
        with pytest.warns(UserWarning, match=r"recompile_limit \(2\).*run the model as written.*dynamic=True"):
            x = torch.randn(1, 6, 16)
            torch.testing.assert_close(opt(x), model(x))  # as written: still the same function
    notes = attnopt.explain(opt).failures
    assert len(notes) == 1 and "recompile_limit" in notes[0]
    assert "recompile_limit (2)" in str(attnopt.explain(opt))
