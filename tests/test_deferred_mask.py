"""A causal mask proven on guarded buffers is built only on calls that need it (``rewrite_sdpa.defer_mask``).

nanoGPT's ``bias[:, :, :T, :T] == 0`` is replaced by ``is_causal=True`` on every call whose buffer still holds
the proven pattern; the slice, the comparison and the negation move into the site (``mask_fn``) and run only
when a guard fails. These tests pin that the mask is not computed per call, that a buffer written to another
pattern still gets its own mask (outputs and gradients as written), and that the mask stays in the graph where
deferring it could change what it reads.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from support import capture

import attnopt
from attnopt.runtime.site import AttentionSite

B, H, T, D = 2, 2, 6, 8


class Causal(nn.Module):
    """The nanoGPT spelling: a lower-triangular buffer, sliced to the call's length."""

    def __init__(self, n: int = 16):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(n, n)).view(1, 1, n, n))

    def forward(self, q, k, v):
        t = q.size(-2)
        s = (q @ k.transpose(-2, -1)) * D ** -0.5
        s = s.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        return F.softmax(s, dim=-1) @ v


class WriteBetween(Causal):
    """A write to a tensor between the mask and the attention: the mask is left where it was built."""

    def forward(self, q, k, v):
        t = q.size(-2)
        keep = self.bias[:, :, :t, :t] == 0
        q = q * 1.0
        q.mul_(1.0)
        s = (q @ k.transpose(-2, -1)) * D ** -0.5
        return F.softmax(s.masked_fill(keep, float("-inf")), dim=-1) @ v


def qkv(t: int = T, grad: bool = False) -> list[torch.Tensor]:
    return [torch.randn(B, H, t, D, requires_grad=grad) for _ in range(3)]


def rewritten(model: nn.Module) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule, list]:
    """``rewrite()`` of the graph dynamo captures for ``model(q, k, v)``, the graph and its inputs."""
    gm, example = capture(model, *qkv())
    return attnopt.rewrite(gm, example, variant="sdpa"), gm, example


def rewritten_site(model: nn.Module) -> AttentionSite:
    """The one site of :func:`rewritten`, after checking that graph against the captured one."""
    new, gm, example = rewritten(model)
    with torch.no_grad():
        torch.testing.assert_close(new(*example), gm(*example))
    (site,) = [m for m in new.modules() if isinstance(m, AttentionSite)]
    return site


def aten_ops(fn, *args) -> list[str]:
    with torch.no_grad(), torch.profiler.profile() as prof:
        fn(*args)
    return [e.name for e in prof.events()]


def test_the_guarded_mask_is_not_built_per_call() -> None:
    model = Causal().eval()
    assert hasattr(rewritten_site(model), "mask_fn"), "the mask was not deferred"
    opt = attnopt.optimize(model, variant="sdpa")
    x = qkv()
    with torch.no_grad():
        torch.testing.assert_close(opt(*x), model(*x))
    ops = aten_ops(opt, *x)
    assert "aten::scaled_dot_product_attention" in ops
    for op in ("aten::eq", "aten::logical_not", "aten::slice"):
        assert op not in ops, (op, ops)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_a_buffer_written_to_another_pattern_gets_its_own_mask(grad: bool) -> None:
    model = Causal().eval()
    opt = attnopt.optimize(model, variant="sdpa")
    with torch.set_grad_enabled(grad):
        opt(*qkv(grad=grad))  # the proof: causal (captured in this grad mode, so no recapture follows)
    model.bias[..., 0, 1:] = 1.0  # query 0 now sees every key; the others stay causal
    model.bias[..., 3, 2:] = 0.0  # query 3 sees keys 0 and 1 only
    for t in (T, T - 2):
        x = qkv(t, grad)
        y = [a.detach().clone().requires_grad_(grad) for a in x]
        with torch.set_grad_enabled(grad):
            want, got = model(*x), opt(*y)
        torch.testing.assert_close(got, want)
        if grad:
            want.square().sum().backward()
            got.square().sum().backward()
            for a, b in zip(x, y):
                torch.testing.assert_close(b.grad, a.grad)


def test_a_write_between_the_mask_and_the_site_keeps_the_mask_in_the_graph() -> None:
    model = WriteBetween().eval()
    assert not hasattr(rewritten_site(model), "mask_fn")
    opt = attnopt.optimize(model, variant="sdpa")
    x = qkv()
    with torch.no_grad():
        torch.testing.assert_close(opt(*x), model(*x))
    assert "aten::eq" in aten_ops(opt, *x)


def test_a_rewritten_graph_with_a_deferred_mask_copies_and_pickles() -> None:
    model = Causal().eval()
    new, gm, example = rewritten(model)
    (site,) = [m for m in new.modules() if isinstance(m, AttentionSite)]
    assert hasattr(site, "mask_fn")
    for other in (copy.deepcopy(new), pickle.loads(pickle.dumps(new))):
        with torch.no_grad():
            torch.testing.assert_close(other(*example), gm(*example))


def test_compiled_graphs_stay_exact_when_the_guarded_buffer_changes() -> None:
    """With ``compile=True`` the guarded buffer is checked at the compiled graph's boundary; a buffer that
    no longer holds the pattern runs the graph as written."""
    pytest.importorskip("torch._inductor")
    model = Causal().eval()
    opt = attnopt.optimize(model, variant="sdpa", compile=True)
    x = qkv()
    with torch.no_grad():
        torch.testing.assert_close(opt(*x), model(*x))
        model.bias[..., 0, 1:] = 1.0
        torch.testing.assert_close(opt(*x), model(*x))
