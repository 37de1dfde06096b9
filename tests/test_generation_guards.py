"""What a cached step may not assume about the model's Python: the sizes it branches on, the length as a value.

A cached step runs the captured graph for one new token (and any batch) while the model as written sees the
whole sequence. ``torch.export`` traces with sizes of at least 2 and records a condition for a branch those
sizes do not decide (``if T % 2 == 0:``); a branch they do decide (``if B > 1:``) leaves none. So
``cached()`` refuses a recorded condition other than an upper bound on the length, follows an upper bound as
``max_len``, and compares the cached model with the model as written at batch 1, at length 1 and at sizes the
export excluded. The length used as a float or a bool (``1 / T``, ``T ** 0.5``, ``T > 3``) is refused like
the length as an int.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

import attnopt
from attnopt.generation import PositionError, cached, generate_plain

V, C = 50, 32


class LM(nn.Module):
    def __init__(self, how: str = "none"):
        super().__init__()
        torch.manual_seed(0)
        self.how = how
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(64, C)
        self.qkv, self.proj, self.head = nn.Linear(C, 3 * C), nn.Linear(C, C), nn.Linear(C, V)
        self.register_buffer("bias", torch.tril(torch.ones(64, 64)))

    def forward(self, idx):
        B, T = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        how = self.how
        if how == "recip":
            x = x * (1.0 / T)
        elif how == "pow":
            x = x * T**0.5
        elif how == "bool":
            x = x * (T > 3)
        elif how == "batch" and B > 1:
            x = x * 3
        elif how == "one" and T == 1:
            x = x * 3
        elif how == "parity" and T % 2 == 0:
            x = x * 3
        elif how == "long" and T > 6:
            x = x * 3
        q, k, v = (t.view(B, T, 2, C // 2).transpose(1, 2) for t in self.qkv(x).split(C, 2))
        att = (q @ k.transpose(-2, -1)) / 4.0
        att = att.masked_fill(self.bias[:T, :T] == 0, float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(B, T, C))
        return self.head(x) * 5


@pytest.mark.parametrize("how", ["recip", "pow", "bool"])
def test_the_length_as_a_float_or_bool_is_refused(how):
    with pytest.raises(PositionError, match="uses the sequence length"):
        cached(LM(how).eval())


@pytest.mark.parametrize("how, where", [("batch", "at batch 1"), ("one", "a prompt of 1 token")])
def test_a_branch_export_decides_by_assuming_sizes_of_two_is_caught_by_the_probe(how, where):
    model = LM(how).eval()
    with pytest.raises(PositionError, match=where):
        cached(model)
    idx = torch.randint(0, V, (1, 3))
    with pytest.raises(PositionError):
        attnopt.generate(model, idx, 4)


def test_a_condition_export_recorded_is_refused_with_it():
    with pytest.raises(PositionError, match=r"recorded the condition `\(L\['idx'\]\.size\(\)\[1\] % 2\) == 0`"):
        cached(LM("parity").eval())


def test_an_upper_bound_on_the_length_becomes_max_len_and_says_why():
    model = LM("long").eval()
    lm = cached(model)
    assert lm.max_len == 6 and "if T > n:" in lm.max_len_source
    idx = torch.randint(0, V, (1, 3))
    assert torch.equal(attnopt.generate(lm, idx, 4), generate_plain(model, idx, 4))
    with pytest.raises(ValueError, match=r"more than max_len=6 \(forward's code holds only up to 6 tokens"):
        attnopt.generate(lm, idx, 8)


def test_the_probe_leaves_the_cache_empty_and_the_choice_alone():
    model = LM().eval()
    lm = cached(model, variant="sdpa")
    assert lm.length == 0 and all(s.k_cache is None for s in lm.sites)
    assert all(s.candidate == "sdpa" for s in lm.sites)
    idx = torch.randint(0, V, (2, 4))
    assert torch.equal(attnopt.generate(lm, idx, 5), generate_plain(model, idx, 5))


def test_int32_prompts_in_a_ragged_batch():
    model = LM().eval()
    prompts = [torch.tensor([1, 2, 3], dtype=torch.int32), torch.tensor([4], dtype=torch.int32)]
    got = attnopt.generate(model, prompts, 4)
    want = [generate_plain(model, p[None].long(), 4)[0] for p in prompts]
    for a, b in zip(got, want):
        assert torch.equal(a.long(), b)


@pytest.mark.parametrize("eos", [torch.tensor(7), np.int64(7), [np.int64(7), 9], torch.tensor([7, 9])])
def test_eos_as_a_tensor_or_numpy_integer(eos):
    model = LM().eval()
    idx = torch.randint(0, V, (2, 3))
    assert torch.equal(attnopt.generate(model, idx, 6, eos_token_id=eos),
                       generate_plain(model, idx, 6, eos_token_id=[7] if np.ndim(eos) == 0 else [7, 9]))


def test_a_stop_callable_that_returns_none_says_so():
    model = LM().eval()
    with pytest.raises(TypeError, match="stop must return a bool"):
        attnopt.generate(model, torch.randint(0, V, (2, 3)), 4, stop=lambda ids: None, pad_token_id=0)


GAIN = 1.0
TABLE = {"mult": 1.0}


class Opts:  # a plain class of the user's
    def __init__(self):
        self.mult = 1.0


SETTINGS = Opts()
SIGN = 1.0  # read by a helper method, not by forward
BIAS = torch.zeros(V)  # a module-level tensor: rebinding the name gives forward another tensor


@__import__("dataclasses").dataclass(frozen=True)
class HeadConfig:
    mult: float = 1.0


class Stateful(LM):
    """Reads Python state the capture turns into constants: a dict entry, a namespace or plain object's field, a
    module global, an optional buffer."""

    def __init__(self, how: str):
        super().__init__()
        import types

        self.how2 = how
        self.opts = {"mult": 1.0}
        self.ns = types.SimpleNamespace(mult=1.0)
        self.obj = Opts()
        self.register_buffer("extra", None)
        self.head_cfg = HeadConfig()
        self.held = {"bias": torch.zeros(V)}
        self.act = torch.relu

    def post(self, out):
        return out * SIGN

    def forward(self, idx):
        how = self.how2
        mult = (self.opts["mult"] if how == "dict" else self.ns.mult if how == "ns" else self.obj.mult
                if how == "obj" else GAIN if how == "global" else TABLE["mult"] if how == "global_dict"
                else SETTINGS.mult if how == "global_ns" else self.head_cfg.mult if how == "config" else 1.0)
        out = super().forward(idx) * mult
        if self.extra is not None:
            out = out + self.extra
        if how == "method_global":
            out = self.post(out)
        elif how == "global_tensor":
            out = out + BIAS
        elif how == "dict_tensor":
            out = out + self.held["bias"]
        elif how == "function":
            out = self.act(out)
        return out


@pytest.mark.parametrize("how", ["dict", "ns", "obj", "global", "global_dict", "global_ns", "buffer", "hook", "config",
                                 "method_global", "global_tensor", "dict_tensor", "function"])
def test_python_state_changed_after_capture_is_seen(how, monkeypatch):
    from attnopt.generation import ModelChangedError

    model = Stateful(how).eval()
    handle = model.register_forward_hook(lambda m, a, out: out * 1.0) if how == "hook" else None
    lm = cached(model)
    idx = torch.randint(0, V, (1, 3))
    lm.prefill(idx)
    if how == "dict":
        model.opts["mult"] = 4.0
    elif how == "ns":
        model.ns.mult = 4.0
    elif how == "obj":
        model.obj.mult = 4.0
    elif how == "global":
        monkeypatch.setitem(globals(), "GAIN", 4.0)
    elif how == "global_dict":
        monkeypatch.setitem(TABLE, "mult", 4.0)  # the same dict, written in place
    elif how == "global_ns":
        monkeypatch.setattr(SETTINGS, "mult", 4.0)
    elif how == "buffer":
        model.extra = torch.ones(V)
    elif how == "config":  # another frozen config in its place
        model.head_cfg = __import__("dataclasses").replace(model.head_cfg, mult=-1.0)
    elif how == "method_global":
        monkeypatch.setitem(globals(), "SIGN", -1.0)
    elif how == "global_tensor":
        monkeypatch.setitem(globals(), "BIAS", torch.randn(V) * 10)
    elif how == "dict_tensor":
        model.held["bias"] = torch.randn(V) * 10
    elif how == "function":
        model.act = torch.neg
    else:
        handle.remove()
        model.register_forward_hook(lambda m, a, out: out * 2.0)  # the same count of hooks, another hook
    with pytest.raises(ModelChangedError):
        lm.step(idx[:, :1])
    assert torch.equal(attnopt.generate(model, idx, 4), generate_plain(model, idx, 4))  # built again


class Direct(LM):
    """Calls SDPA itself, or returns the last position only (Karpathy's nanoGPT without targets)."""

    def forward(self, idx):
        B, T = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        q, k, v = (t.view(B, T, 2, C // 2).transpose(1, 2) for t in self.qkv(x).split(C, 2))
        if self.how == "sdpa":
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = ((q @ k.transpose(-2, -1)) / 4.0).masked_fill(self.bias[:T, :T] == 0, float("-inf"))
            y = att.softmax(-1) @ v
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return self.head(x[:, [-1], :] if self.how == "last" else x)


@pytest.mark.parametrize("how, says", [
    ("sdpa", 'calls scaled_dot_product_attention itself.*attn_implementation="eager"'),
    ("last", r"indexes the sequence axis \(dim 1\) with a tensor, e.g. `x\[:, \[-1\]\]`"),
])
def test_refusals_that_say_what_to_do(how, says):
    with pytest.raises(PositionError, match=says):
        cached(Direct(how).eval())
