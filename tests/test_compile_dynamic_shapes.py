"""``compile=True`` and shapes: a graph compiled for dynamic shapes serves every shape with no check inside it.

Every candidate is checked against the model as written the first time it serves a shape, on an eager call
before Inductor traces the graph. When dynamo compiles a graph again for dynamic shapes (the second shape
seen), its sizes are symbolic: no eager call can check it, and one check would speak for one shape only. So
such a graph may only trace candidates whose check at one shape speaks for every shape (SDPA, the math,
the tiled kernel); any other (FlexAttention, a candidate the user registered) is replaced there by
``sdpa``, with a warning. And the compiled graph is keyed, in Inductor's on-disk caches, by attnopt's own
source too, so a graph compiled by another attnopt is never served.
"""

from __future__ import annotations

import copy
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import attnopt
from attnopt.env import source_key
from attnopt.kernels import registry
from attnopt.kernels.registry import FunctionCandidate, checked_at_every_shape
from attnopt.runtime.site import AttentionSite


def sixteen_only(q, k, v, *, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, **_):
    """A kernel right at 16 queries only: what a kernel compiled per shape may be."""
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                         scale=scale, enable_gqa=enable_gqa)
    return out if q.shape[-2] == 16 else out * 1.5


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(32, 96)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, 4, 8).permute(2, 0, 3, 1, 4)
        return ((q @ k.transpose(-2, -1) * 0.35).softmax(-1) @ v).transpose(1, 2).reshape(B, T, 32)


def test_which_candidates_a_check_at_one_shape_speaks_for():
    assert all(checked_at_every_shape(n) for n in ("sdpa", "sdpa_math", "math", "tiled64"))
    assert not checked_at_every_shape("flex")
    assert not checked_at_every_shape("no such candidate")


def test_a_graph_for_dynamic_shapes_runs_no_candidate_checked_at_one_shape(monkeypatch):
    # traced here, not served from Inductor's on-disk caches (which would skip the trace that warns)
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)
    monkeypatch.setattr(torch._functorch.config, "enable_autograd_cache", False)
    monkeypatch.setitem(registry._REGISTRY, "sixteen_only",
                        FunctionCandidate("sixteen_only", sixteen_only, lambda spec: None))
    torch.manual_seed(0)
    model = Block().eval()
    opt = attnopt.optimize(copy.deepcopy(model), variant="sixteen_only", compile=True)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for b, t in [(2, 16), (3, 7), (2, 33)]:  # the second shape compiles the graph again, for dynamic shapes
            x = torch.randn(b, t, 32)
            torch.testing.assert_close(opt(x), model(x), atol=1e-5, rtol=1e-5)
    said = [str(w.message) for w in caught if "dynamic shapes" in str(w.message)]
    assert said and "'sdpa' runs there instead" in said[0]
    assert "compiled for dynamic shapes" in " ".join(str(attnopt.explain(opt)).split())


def test_the_compiled_graph_is_keyed_by_attnopt_s_source(monkeypatch):
    """Inductor's caches key the graph by its modules' state: every site carries attnopt's source digest."""
    import torch._inductor.compile_fx as inductor

    seen = []
    real = inductor.compile_fx
    monkeypatch.setattr(inductor, "compile_fx", lambda gm, inputs, **kw: seen.append(gm) or real(gm, inputs, **kw))
    opt = attnopt.optimize(Block().eval(), variant="sdpa", compile=True)
    with torch.no_grad():
        opt(torch.randn(1, 8, 32))
    sites = [m for gm in seen for m in gm.modules() if isinstance(m, AttentionSite)]
    assert sites and all(s.traced_by == source_key() for s in sites)
    assert source_key() in repr(sites[0].__getstate__())  # what the cache key pickles


def test_the_source_key_changes_with_attnopt(monkeypatch):
    import attnopt.env as env

    key = source_key()
    monkeypatch.setattr(env, "__version__", "0.0.0-other")
    assert env.source_key.__wrapped__() != key  # another attnopt: another key (computed again, not the cached one)
    monkeypatch.undo()
    assert env.source_key.__wrapped__() == key  # the same source: the same key in every process
