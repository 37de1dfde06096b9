"""The watch over Python state a capture made constant, beyond a module's own attributes.

``torch.export`` runs the model's Python once: every value forward reads becomes a constant of the cached
graph. A cached model must therefore notice when one of them changes: a class attribute (read as
``self.x`` or ``Block.x``), an attribute of a module of the user's (``knobs.SCALE``), a numpy scalar or array,
a field of a nested config, an object held in a tuple, a function or method forward calls (a monkey patch),
a ``functools.partial``'s arguments, a variable forward closes over, a slots dataclass's field, a ``torch.finfo``
held, a module imported inside a method, a library function patched (``F.hardtanh = ...``), a function's
``__code__`` or ``__defaults__`` replaced in place, and the global settings that decide the graph's dtypes
(autocast, the default dtype). Each case below changes one of them after the capture: the
cached model must raise :class:`ModelChangedError`, and ``attnopt.generate(model, ...)`` must build again and
give the tokens of the model as written.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import sys
import types

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import attnopt
from attnopt.generation import ModelChangedError, cached, generate_plain

V, C, H = 48, 32, 2

knobs = types.ModuleType("attnopt_test_knobs")  # a module of the user's, read by its global name
knobs.SCALE = 1.0
sys.modules[knobs.__name__] = knobs


knobs2 = types.ModuleType("attnopt_test_knobs2")  # a module of the user's, imported inside a method
knobs2.SCALE = 1.0
sys.modules[knobs2.__name__] = knobs2


def shift(x):  # a module-level function forward calls
    return x


def scaled(x, factor=1.0):  # its defaults replaced in place: the same function, another result
    return x * factor


@dataclasses.dataclass(slots=True)
class Slotted:  # a config without a ``__dict__``
    temp: float = 1.0


class SlotsBase:
    __slots__ = ("temp",)

    def __init__(self):
        self.temp = 1.0


class SlotsAndDict(SlotsBase):  # no ``__slots__`` of its own: a ``__dict__`` beside the base's slot
    pass


class Scaler:  # a callable object of the user's, not a module
    def __init__(self, s: float = 1.0):
        self.s = s

    def __call__(self, y):
        return y * self.s


def helper(y, opts={"s": 1.0}):  # noqa: B006 - a mutable default, changed in place by the test
    return y * opts["s"]


HELPER_SCALE = 1.0


def helper2(y):  # held in a dict, it reads a global forward does not name
    return y * HELPER_SCALE


pkg = types.ModuleType("attnopt_test_pkg")  # a package of the user's with a submodule
pkg.sub = types.ModuleType("attnopt_test_pkg.sub")
pkg.sub.SCALE = 1.0
sys.modules[pkg.__name__], sys.modules[pkg.sub.__name__] = pkg, pkg.sub


@dataclasses.dataclass
class Inner:
    temp: float = 1.0


@dataclasses.dataclass
class Biased:  # a config holding a tensor forward adds (a constant of the capture, shared with the model)
    bias: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(C))


@dataclasses.dataclass
class Outer:
    inner: Inner = dataclasses.field(default_factory=Inner)


def make_block(how: str):
    """The block class, defined in a function: its methods close over ``state`` (a closure variable)."""
    state = {"temp": 1.0}

    class Block(nn.Module):
        temperature = 1.0  # a class attribute

        def __init__(self):
            super().__init__()
            self.qkv, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
            self.np_temp = np.float32(1.0)
            self.np_table = np.ones(3, dtype=np.float32)
            self.cfg = Outer()
            self.ns = types.SimpleNamespace(inner=types.SimpleNamespace(temp=1.0))
            self.held = (1.0, Inner())
            self.act = functools.partial(F.leaky_relu, negative_slope=1.0)  # the identity, as held
            self.skip = {1}
            self.divisors = [1, 2, 3]
            self.bias_cfg = Biased()
            self.slotted = Slotted()
            self.slots_dict = SlotsAndDict()
            self.scaler = Scaler()
            self.fns = {"post": helper, "post2": helper2}
            self.lim = torch.finfo(torch.float32)

        def temp(self) -> float:
            if how in ("class", "subclass"):
                return self.temperature
            if how == "class_by_name":
                return Block.temperature
            if how == "module":
                return knobs.SCALE
            if how == "numpy":
                return float(self.np_temp)
            if how == "array":
                return float(self.np_table[1])
            if how == "nested_config":
                return self.cfg.inner.temp
            if how == "nested_namespace":
                return self.ns.inner.temp
            if how == "tuple":
                return self.held[1].temp
            if how == "closure":
                return state["temp"]
            if how == "literal":  # a name read by a literal: set on the class later, it shadows the default
                return getattr(self, "override", 1.0)
            if how == "set":
                return 1.0 if 2 not in self.skip else 0.05
            if how == "flat_list":
                return float(self.divisors[0])
            if how == "slots":
                return self.slotted.temp
            if how == "finfo":
                return 1.0 if self.lim.bits == 32 else 0.05
            if how == "import_inside":
                import attnopt_test_knobs2
                return attnopt_test_knobs2.SCALE
            if how == "slots_dict":
                return self.slots_dict.temp
            if how == "from_import_sub":
                from attnopt_test_pkg import sub
                return sub.SCALE
            if how == "static_code":
                return self.fixed()
            return 1.0

        @staticmethod
        def fixed() -> float:
            return 1.0

        if how == "library":  # (defined for this case only: `F` read here would pin the full path's too)
            def through_f(self, y):  # the identity here, as long as F.hardtanh is torch's
                return F.hardtanh(y, -1e4, 1e4)

        def full_path(self, y):  # the same, named in full (no `F` in this method)
            return torch.nn.functional.hardtanh(y, -1e4, 1e4)

        def scores(self, q, k):
            return q @ k.transpose(-2, -1) * (C // H) ** -0.5

        def forward(self, x):
            B, T, _ = x.shape
            q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in self.qkv(x).split(C, 2))
            s = self.scores(q, k) / self.temp()
            s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=x.device).tril() == 0, float("-inf"))
            y = (s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C)
            if how == "library":
                y = self.through_f(y)
            if how == "defaults":
                y = scaled(y)
            if how == "full_path":
                y = self.full_path(y)
            if how == "tensor_method":
                y = y.sigmoid() - 0.5
            if how == "callable_object":
                y = self.scaler(y)
            if how == "mutable_default":
                y = self.fns["post"](y)
            if how == "function_in_dict":
                y = self.fns["post2"](y)
            return self.proj(self.act(shift(y))) + self.bias_cfg.bias

    class Derived(Block):  # the layers' class: ``temperature`` and ``temp`` are its base's
        pass

    return Derived, state


class LM(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        torch.manual_seed(0)
        Block, self.state = make_block(how)
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(32, C)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(C, V)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def change(model: LM, how: str, monkeypatch) -> None:
    Derived = type(model.blocks[0])
    Block = Derived.__mro__[1]
    if how in ("class", "class_by_name"):
        monkeypatch.setattr(Block, "temperature", 0.05)
    elif how == "subclass":  # set on the layers' own class, shadowing its base's
        monkeypatch.setattr(Derived, "temperature", 0.05)
    elif how == "literal":
        monkeypatch.setattr(Block, "override", 0.05, raising=False)
    elif how == "instance_method":  # a method shadowed on the instance
        for b in model.blocks:
            b.temp = lambda: 0.05
    elif how == "set":
        for b in model.blocks:
            b.skip.add(2)
    elif how == "flat_list":
        for b in model.blocks:
            b.divisors[0] = 20
    elif how == "module":
        monkeypatch.setattr(knobs, "SCALE", 0.05)
    elif how == "numpy":
        for b in model.blocks:
            b.np_temp = np.float32(0.05)
    elif how == "array":
        for b in model.blocks:
            b.np_table[1] = 0.05  # in place
    elif how == "nested_config":
        for b in model.blocks:
            b.cfg.inner.temp = 0.05
    elif how == "nested_namespace":
        for b in model.blocks:
            b.ns.inner.temp = 0.05
    elif how == "tuple":
        for b in model.blocks:
            b.held[1].temp = 0.05
    elif how == "closure":
        model.state["temp"] = 0.05
    elif how == "function":
        monkeypatch.setitem(globals(), "shift", lambda y: y * 3.0)
    elif how == "method":
        monkeypatch.setattr(Block, "scores", lambda self, q, k: q @ k.transpose(-2, -1))
    elif how == "slots":
        for b in model.blocks:
            b.slotted.temp = 0.05
    elif how == "finfo":
        for b in model.blocks:
            b.lim = torch.finfo(torch.float16)
    elif how == "import_inside":
        monkeypatch.setattr(knobs2, "SCALE", 0.05)
    elif how == "library":
        monkeypatch.setattr(F, "hardtanh", lambda y, *args: y * 3.0)
    elif how == "defaults":
        monkeypatch.setattr(scaled, "__defaults__", (3.0,))
    elif how == "code":  # IPython's autoreload swaps a function's code in place
        monkeypatch.setattr(Block.scores, "__code__", (lambda self, q, k: q @ k.transpose(-2, -1)).__code__)
    elif how == "slots_dict":
        for b in model.blocks:
            b.slots_dict.temp = 0.05
    elif how == "from_import_sub":
        monkeypatch.setattr(pkg.sub, "SCALE", 0.05)
    elif how == "static_code":
        monkeypatch.setattr(Block.__dict__["fixed"].__func__, "__code__", (lambda: 0.05).__code__)
    elif how == "full_path":
        monkeypatch.setattr(torch.nn.functional, "hardtanh", lambda y, *args: y * 3.0)
    elif how == "tensor_method":
        sigmoid = torch.Tensor.sigmoid
        monkeypatch.setattr(torch.Tensor, "sigmoid", lambda t: sigmoid(t * 3.0), raising=False)
    elif how == "callable_object":
        for b in model.blocks:
            b.scaler.s = 3.0
    elif how == "mutable_default":
        monkeypatch.setitem(helper.__defaults__[0], "s", 3.0)
    elif how == "function_in_dict":  # a global the held function reads
        monkeypatch.setitem(globals(), "HELPER_SCALE", 3.0)
    elif how == "partial":
        for b in model.blocks:
            b.act.keywords["negative_slope"] = -3.0
    else:
        raise AssertionError(how)


CHANGES = ["class", "class_by_name", "subclass", "literal", "instance_method", "module", "numpy", "array",
           "nested_config", "nested_namespace", "tuple", "closure", "function", "method", "partial", "set", "flat_list",
           "slots", "finfo", "import_inside", "library", "defaults", "code", "slots_dict", "from_import_sub",
           "static_code", "full_path", "callable_object", "mutable_default", "function_in_dict"]


@pytest.mark.parametrize("how", CHANGES)
def test_python_state_a_capture_made_constant_is_watched(how, monkeypatch):
    model = LM(how).eval()
    idx = torch.randint(0, V, (1, 4), generator=torch.Generator().manual_seed(1))
    lm = cached(model)
    attnopt.generate(model, idx, 6)  # kept: the next call reuses it
    lm.prefill(idx)
    change(model, how, monkeypatch)
    want = generate_plain(model, idx, 6)
    with torch.no_grad():
        assert (model(idx) - lm.graph_module(idx, 0)).abs().max() > 1e-3, "the change must matter"
    with pytest.raises(ModelChangedError):
        lm.step(idx[:, -1:])
    with pytest.raises(ModelChangedError):
        lm.prefill(idx)
    assert torch.equal(attnopt.generate(model, idx, 6), want)  # built again


def test_the_same_values_set_again_keep_the_cache(monkeypatch):
    model = LM("class").eval()
    lm = cached(model)
    idx = torch.randint(0, V, (1, 4))
    lm.prefill(idx)
    monkeypatch.setattr(type(model.blocks[0]).__mro__[1], "temperature", 1.0)  # another float object, the same value
    for b in model.blocks:
        b.np_temp = np.float32(1.0)
        b.cfg = Outer()  # another config with the same fields
    with torch.no_grad():
        assert torch.allclose(lm.step(idx[:, -1:])[0, -1], model(torch.cat([idx, idx[:, -1:]], 1))[0, -1], atol=1e-5)


def test_a_call_under_other_autocast_or_default_dtype_is_refused_and_generate_keeps_one_per_setting():
    model = LM("none").eval()
    idx = torch.randint(0, V, (1, 4))
    lm = cached(model)
    lm.prefill(idx)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(ModelChangedError, match="autocast"):
            lm.step(idx[:, -1:])
        assert torch.equal(attnopt.generate(model, idx, 5), generate_plain(model, idx, 5))
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with pytest.raises(ModelChangedError, match="default dtype float64"):
            lm.prefill(idx)
    finally:
        torch.set_default_dtype(default)
    assert torch.equal(attnopt.generate(model, idx, 5), generate_plain(model, idx, 5))
    lm.prefill(idx)  # back under the settings it was built with


def test_a_cached_model_whose_model_was_deleted_says_so():
    model = LM("none").eval()
    lm = cached(model)
    idx = torch.randint(0, V, (1, 4))
    lm.prefill(idx)
    del model
    gc.collect()
    with pytest.raises(ModelChangedError, match="deleted"):
        lm.prefill(idx)


def test_a_tensor_a_config_holds_written_in_place_is_followed():
    """The graph reads the config's tensor itself: the cache recomputes its keys and values, as for weights."""
    model = LM("none").eval()
    lm = cached(model)
    idx = torch.randint(0, V, (1, 4))
    lm.prefill(idx)
    for b in model.blocks:
        b.bias_cfg.bias.add_(1.0)
    seq = torch.cat([idx, idx[:, -1:]], 1)
    with torch.no_grad():
        torch.testing.assert_close(lm.step(idx[:, -1:])[0, -1], model(seq)[0, -1], atol=1e-5, rtol=1e-5)


class Bag:
    """An attribute bag whose ``__getattr__`` raises ``KeyError`` (not AttributeError) for a missing name."""

    def __init__(self):
        self.__dict__["_d"] = {"mult": 1.0}

    def __getattr__(self, name):
        return self.__dict__["_d"][name]


def test_odd_attribute_values_neither_crash_the_watch_nor_raise_when_unchanged():
    model = LM("none").eval()
    model.bag = Bag()
    model.nan = float("nan")
    lm = cached(model)
    idx = torch.randint(0, V, (1, 4))
    lm.prefill(idx)
    model.nan = float("nan")  # another NaN object: no change
    model.note = torch.zeros(1)  # an object under a name no code reads
    lm.step(idx[:, -1:])
    assert torch.equal(attnopt.generate(model, idx, 4), generate_plain(model, idx, 4))


def test_save_pretrained_keeps_the_cache(tmp_path):
    """``save_pretrained`` records ``architectures`` and the dtype's name in the config; no forward reads the first,
    and a dtype and its name are the same value: the cached model serves on, exactly."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=V, n_positions=32,
                                  attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(cfg).eval()
    model.config.dtype = torch.float32  # as from_pretrained sets it
    lm = cached(model)
    idx = torch.randint(1, V, (1, 4))
    lm.prefill(idx)
    model.save_pretrained(tmp_path)
    assert model.config.architectures == ["GPT2LMHeadModel"] and model.config.dtype == "float32"
    with torch.no_grad():
        torch.testing.assert_close(lm.step(idx[:, -1:])[0, -1], model(torch.cat([idx, idx[:, -1:]], 1)).logits[0, -1],
                                   atol=1e-5, rtol=1e-5)
    model.config.n_embd = 64  # a field a forward may read (plain): still a change
    with pytest.raises(ModelChangedError, match="n_embd"):
        lm.step(idx[:, -1:])


def test_a_tensor_method_patched_is_seen(monkeypatch):
    """``torch.Tensor.sigmoid`` replaced after the capture: the method forward calls on a tensor is not what the
    cached graph computes."""
    model = LM("tensor_method").eval()
    idx = torch.randint(0, V, (1, 4))
    lm = cached(model)
    lm.prefill(idx)
    change(model, "tensor_method", monkeypatch)
    with torch.no_grad():
        assert (model(idx) - lm.graph_module(idx, 0)).abs().max() > 1e-3, "the change must matter"
    with pytest.raises(ModelChangedError, match="torch.Tensor.sigmoid"):
        lm.step(idx[:, -1:])
