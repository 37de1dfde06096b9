"""What ``attnopt profile`` measures: a SPEC resolved to a model and its input factory.

A SPEC is one of

* a built-in example name (:data:`BUILTINS`): ``nanogpt`` (causal LM, ``forward(idx)``) or
  ``bert`` (encoder, ``forward(input_ids, attention_mask)``), sized so that every swept
  sequence length fits;
* ``package.module:factory`` (imported) or ``path/to/file.py:factory`` (loaded from the file),
  where ``factory()`` returns ``(model, make_inputs)`` and ``make_inputs(batch_size, seq_len)``
  returns the call's arguments: a tuple or list (positional), a dict (keyword) or a single value.

    >>> target = resolve("nanogpt", max_seq_len=512)
    >>> args, kwargs = target.inputs(2, 128, dtype=torch.float32, device=torch.device("cpu"))
    >>> target.model(*args, **kwargs).shape
    torch.Size([2, 128, 512])

Floating-point inputs are cast to the profiled dtype, every tensor moves to the device;
integer inputs (token ids, masks) keep their dtype.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

__all__ = ["BUILTINS", "SpecError", "Target", "resolve"]


class SpecError(ValueError):
    """A SPEC that names no model; the message says what is accepted."""


@dataclass
class Target:
    """A resolved SPEC: the model, its input factory and what kind of model it is."""

    spec: str
    model: nn.Module
    make_inputs: Callable[[int, int], Any]
    causal_lm: bool | None  # None: not known (a user factory); decode is tried when inputs are one token tensor
    description: str

    def inputs(self, batch_size: int, seq_len: int, *, dtype: torch.dtype,
               device: torch.device) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``make_inputs(batch_size, seq_len)`` as ``(args, kwargs)`` on ``device`` in ``dtype``."""
        raw = self.make_inputs(batch_size, seq_len)
        if isinstance(raw, dict):
            args, kwargs = (), dict(raw)
        elif isinstance(raw, (tuple, list)):
            args, kwargs = tuple(raw), {}
        else:
            args, kwargs = (raw,), {}

        def move(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return x.to(device=device, dtype=dtype if x.is_floating_point() else x.dtype)
            return x

        return tuple(move(a) for a in args), {k: move(v) for k, v in kwargs.items()}


def _nanogpt(max_seq_len: int) -> tuple[nn.Module, Callable[[int, int], Any]]:
    from ..models import GPTConfig, NanoGPT

    config = GPTConfig(block_size=max_seq_len, n_layer=4, n_head=4, n_embd=128)
    model = NanoGPT(config)

    def make_inputs(batch_size: int, seq_len: int) -> torch.Tensor:
        return torch.randint(0, config.vocab_size, (batch_size, seq_len))

    return model, make_inputs


def _bert(max_seq_len: int) -> tuple[nn.Module, Callable[[int, int], Any]]:
    from ..models import BertConfig, BertEncoder

    config = BertConfig(max_position=max_seq_len, n_layer=4, n_head=4, n_embd=128)
    model = BertEncoder(config)

    def make_inputs(batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, config.vocab_size, (batch_size, seq_len))
        mask = torch.ones(batch_size, seq_len, dtype=torch.long)
        mask[1::2, seq_len - seq_len // 4:] = 0  # every other sequence ends with a quarter of padding
        return ids, mask

    return model, make_inputs


#: name -> (factory(max_seq_len), causal LM?, description)
BUILTINS: dict[str, tuple[Callable[[int], tuple[nn.Module, Callable[[int, int], Any]]], bool, str]] = {
    "nanogpt": (_nanogpt, True, "NanoGPT (4 layers, 4 heads, width 128; causal LM)"),
    "bert": (_bert, False, "BertEncoder (4 layers, 4 heads, width 128; encoder with padding mask)"),
}

_ACCEPTED = (f"a built-in example ({', '.join(BUILTINS)}), 'package.module:factory' or 'path/to/file.py:factory' "
             "where factory() returns (model, make_inputs)")


def resolve(spec: str, *, max_seq_len: int = 2048) -> Target:
    """The model and input factory a SPEC names (see the module docstring); raises :class:`SpecError`."""
    if not isinstance(spec, str) or not spec:
        raise SpecError(f"SPEC must be {_ACCEPTED}; got {spec!r}")
    if spec in BUILTINS:
        factory, causal, description = BUILTINS[spec]
        model, make_inputs = factory(max_seq_len)
        return Target(spec, model, make_inputs, causal, description)
    if ":" not in spec:
        raise SpecError(f"unknown SPEC {spec!r}; expected {_ACCEPTED}")
    where, _, name = spec.rpartition(":")
    if not where or not name.isidentifier():
        raise SpecError(f"SPEC {spec!r} is not 'module:factory' or 'file.py:factory'; expected {_ACCEPTED}")
    module = _load_file(spec, where) if where.endswith(".py") else _import(spec, where)
    factory = getattr(module, name, None)
    if not callable(factory):
        raise SpecError(f"SPEC {spec!r}: {where} has no callable {name!r}")
    try:
        made = factory()
    except Exception as e:
        raise SpecError(f"SPEC {spec!r}: {name}() raised {type(e).__name__}: {e}") from e
    if not (isinstance(made, (tuple, list)) and len(made) == 2 and isinstance(made[0], nn.Module)
            and callable(made[1])):
        raise SpecError(f"SPEC {spec!r}: {name}() must return (model, make_inputs) with an nn.Module and a "
                        f"callable make_inputs(batch_size, seq_len); got {type(made).__name__}")
    model, make_inputs = made
    return Target(spec, model, make_inputs, None, f"{type(model).__name__} from {spec}")


def _load_file(spec: str, where: str) -> Any:
    path = Path(where)
    if not path.is_file():
        raise SpecError(f"SPEC {spec!r}: no such file {where!r}")
    name = f"attnopt_profile_target_{abs(hash(str(path.resolve())))}"
    loader = importlib.util.spec_from_file_location(name, path)
    if loader is None or loader.loader is None:
        raise SpecError(f"SPEC {spec!r}: cannot load {where!r} as a Python file")
    module = importlib.util.module_from_spec(loader)
    sys.modules[name] = module  # dataclasses and pickling look their module up here
    try:
        loader.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise SpecError(f"SPEC {spec!r}: running {where} raised {type(e).__name__}: {e}") from e
    return module


def _import(spec: str, where: str) -> Any:
    try:
        return importlib.import_module(where)
    except ImportError as e:
        raise SpecError(f"SPEC {spec!r}: cannot import {where!r} ({e}); expected {_ACCEPTED}") from e
