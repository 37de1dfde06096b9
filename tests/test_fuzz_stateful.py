"""A stateful differential fuzzer: an optimized model against the model as written, across events.

The hypothesis ``RuleBasedStateMachine`` below draws one model from the grammar of ``fuzz_models.py``
(scale, mask, padding, fill, dropout, norm, projections) and a ``variant`` ("auto", "sdpa" or "math";
never "flex", whose compiled kernel is wrong upstream for some small shapes on this project's CPUs), then
runs a random sequence of rules on it. Every rule ends with a call of both models on the same inputs:

* ``call``: new shapes (batch, sequence length), maybe with another mask or padding pattern;
* ``new_mask`` / ``new_pad``: the next calls' mask / padding arguments get another pattern (causal,
  look-ahead ``tril(2)``, random, a band, a query row with no visible key, a batch entry all padding);
  the tensors are built afresh on every call, as a user's data loader does (drawn per sequence: wherever
  the allocator puts them, or every one at the previous one's address with the same version);
* ``write_buffer``: in-place writes (``fill_``, ``mul_``, ``copy_`` of another pattern, ``add_``) to the
  mask buffer, the bias buffer or parameter, or the 0-d scale buffer;
* ``reregister_buffer``: ``del m.bias; m.register_buffer("bias", ...)`` (and the same for ``scale``, or a new
  ``nn.Parameter`` for a bias parameter);
* ``load_state_dict``: the weights (and buffers) of another model of the same spec;
* ``deepcopy``: ``copy.deepcopy`` of the optimized model; the sequence continues on the copy, and the
  copy's ``_orig_mod`` becomes the model as written;
* ``train_eval``: ``opt.train(flag)``;
* ``set_dtype``: float32, float64 or bfloat16 (``model.to(dtype)``);
* ``sharpen``: the query/key weights scaled in place (logits of other ranges).

Each rule draws the mode of its call: ``no_grad``, ``inference`` (``torch.inference_mode``), ``grad``
(gradients of the input and every parameter), ``double`` (``autograd.grad(..., create_graph=True)``, then
the gradient of the gradients' squared norm) or ``autocast`` (forward and backward inside
``torch.autocast("cpu", torch.bfloat16)``; a float32 model only, else it runs as ``grad``).

Design: ``opt = attnopt.optimize(model)`` wraps the very module object ``ref`` is, so both always see the
same parameters and buffers and every event applies to both at once. The only state a forward mutates is
BatchNorm's running statistics in training mode; both calls then update the shared statistics, and a
training-mode forward does not read them, so the two outputs are still comparable. Gradients are taken
with ``torch.autograd.grad`` (never ``.backward``), so nothing accumulates into the shared ``.grad``.

The invariant, checked on every call:

* float32/float64: outputs equal within ``attnopt.passes.verify.tolerance(dtype)``, NaNs at the same
  places; with autograd, gradients w.r.t. the input and every parameter equal within the same relative
  tolerance (absolute part scaled by the gradient's magnitude, since a gradient is a sum over the batch);
  with ``double``, ``autograd.grad(..., create_graph=True)`` then the gradient of the gradients' squared
  norm, compared the same way.
* bfloat16, and float32 under autocast: the contract "no less accurate than the model as written
  against float64": with ``ref64`` a float64 copy of the model (same values) run on the same inputs,
  ``max|opt - ref64| <= max(2 * max|ref - ref64|, atol + rtol * max|ref64|)`` for the output and each
  gradient.
* Where the output as written has NaN rows (every key hidden with ``-inf``) their gradients are NaN as
  written and the README does not promise them: outputs are compared (NaN positions included), gradients
  are not.
* Under active dropout (training mode, p > 0) the outputs are random and attnopt's stream differs from
  the original's by design (README, "Dropout"): those calls are NOT compared for equality. They are
  checked for shape, dtype, NaN positions (dropout never moves a NaN row) and, with autograd, for
  running their backward (and double backward) at all.

Profiles (``tests/conftest.py``): ``ci`` (the default, and whenever ``CI`` is set): derandomized, a few
sequences of a few steps, bounded to about a minute on two cores; ``ATTNOPT_HYPOTHESIS=dev``: many more,
random, shrunk. One run per mask spelling; ``ATTNOPT_FUZZ_EXAMPLES`` (sequences per spelling) and
``ATTNOPT_FUZZ_STEPS`` override the counts. The figures (sequences,
steps, calls, per-rule counts) are printed at the end of the test and written to
``<pytest tmp dir>/fuzz_stats.json``.
"""

from __future__ import annotations

import copy
import json
import math
import os
import time
import warnings
from collections import Counter

import pytest
import torch
import torch.nn as nn
from fuzz_models import (
    ARG_MASKS,
    BIAS_MASKS,
    BUFFER_MASKS,
    CASTS,
    FILLS,
    MASK_PATTERNS,
    MASKS,
    NORMS,
    PAD_PATTERNS,
    SCALES,
    TMAX,
    FuzzAttention,
    FuzzSpec,
    arg_from_keep,
    bias_pattern,
    buffer_from_keep,
    fill_value,
    mask_pattern,
    pad_pattern,
)
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import attnopt
from attnopt.kernels.reference import tolerance

DEV = os.environ.get("ATTNOPT_HYPOTHESIS") == "dev"
EXAMPLES = int(os.environ.get("ATTNOPT_FUZZ_EXAMPLES", 30 if DEV else 4))  # sequences per mask spelling
STEPS = int(os.environ.get("ATTNOPT_FUZZ_STEPS", 15 if DEV else 7))
VARIANTS = ("auto", "sdpa", "math")  # never "flex" (see the module docstring)
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
BATCHES = (1, 2, 3)
LENGTHS = (2, 3, 5, TMAX)

#: What ran, for the developer's report: sequences, steps, calls, and per-rule / per-axis counts.
STATS: Counter = Counter()


@st.composite
def fuzz_specs(draw: st.DrawFn, mask: str | None = None) -> FuzzSpec:
    fill = draw(st.sampled_from(FILLS))
    pads = ("none", "and") if fill == "-inf" else ("none", "and", "additive")  # (1 - keep) * -inf is NaN
    scale = draw(st.sampled_from(SCALES))
    mask = mask or draw(st.sampled_from(MASKS))
    pad = draw(st.sampled_from(pads))
    late = ["none"] + (["mask"] if mask in BUFFER_MASKS or mask in ("runtime_causal", "arg_keep", "arg_float01")
                       or pad == "and" else []) + (["bias"] if mask in BIAS_MASKS or mask == "arg_additive" else [])
    return FuzzSpec(
        H=draw(st.sampled_from([1, 2])), D=draw(st.sampled_from([4, 8])),
        proj=draw(st.sampled_from(["fused", "separate"])), scale=scale,
        custom_scale=scale != "size_pow" and draw(st.booleans()),
        mask=mask, pad=pad, fill=fill,
        dropout=draw(st.sampled_from([-1.0, 0.0, 0.25])), norm=draw(st.sampled_from(NORMS)),
        # the rarer axes: mostly "none", so that the common spellings are still rewritten most of the time
        cast=draw(st.sampled_from(CASTS)) if draw(st.integers(0, 3)) == 0 else "none",
        late_write=draw(st.sampled_from(late)) if draw(st.integers(0, 3)) == 0 else "none",
    )


def _build(spec: FuzzSpec, seed: int) -> FuzzAttention:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return FuzzAttention(spec)


def _nan_rows_as_written(out: torch.Tensor) -> bool:
    return bool(torch.isnan(out).any())


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    both = ~(torch.isnan(a) | torch.isnan(b))
    if not both.any():
        return 0.0
    return (a.double() - b.double()).abs()[both].max().item()


def assert_same(actual: torch.Tensor, expected: torch.Tensor, what: str, grad: bool = False) -> None:
    """float32/float64: ``actual`` equals ``expected`` within the dtype's tolerance, NaNs in the same places.

    A gradient's absolute tolerance is scaled by its largest magnitude (it sums over the batch and the
    sequence, so its rounding grows with it); outputs use the tolerance as it is.
    """
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    atol, rtol = tolerance(expected.dtype)
    if grad:
        finite = expected[torch.isfinite(expected)]
        atol *= max(1.0, finite.abs().max().item() if finite.numel() else 1.0)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, equal_nan=True,
                               msg=lambda m: f"{what}: {m}")


def assert_no_less_accurate(actual: torch.Tensor, expected: torch.Tensor, ref64: torch.Tensor, what: str) -> None:
    """bf16 contract: the optimized result is no less accurate against float64 than the model as written."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert torch.equal(torch.isnan(actual), torch.isnan(expected)), f"{what}: NaNs moved"
    atol, rtol = tolerance(torch.bfloat16)
    finite = ref64[torch.isfinite(ref64)]
    floor = atol + rtol * (finite.abs().max().item() if finite.numel() else 0.0)
    err_opt, err_ref = _max_err(actual, ref64), _max_err(expected, ref64)
    assert err_opt <= max(2 * err_ref, floor), (
        f"{what}: max|opt - ref64| = {err_opt:.4g} > max(2 * max|ref - ref64| = {2 * err_ref:.4g}, "
        f"floor {floor:.4g})")


class AttnoptFuzzer(RuleBasedStateMachine):
    """One model, its optimized twin, and a random sequence of calls and events (see the module docstring)."""

    # ------------------------------------------------------------------ setup

    MASK: str | None = None  # the mask spelling of every sequence (one machine per spelling), or drawn

    @initialize(data=st.data(), variant=st.sampled_from(VARIANTS), seed=st.integers(0, 2**16),
                same_address=st.booleans(),
                B=st.sampled_from(BATCHES), T=st.sampled_from(LENGTHS),
                mode=st.sampled_from(["no_grad", "inference", "grad", "double", "autocast"]))
    def setup(self, data, variant: str, seed: int, same_address: bool, B: int, T: int, mode: str) -> None:
        spec = data.draw(fuzz_specs(self.MASK), label="spec")
        torch._dynamo.reset()
        torch.manual_seed(seed)
        STATS["sequences"] += 1
        STATS[f"variant={variant}"] += 1
        STATS[f"mask={spec.mask}"] += 1
        self.spec, self.variant, self.seed = spec, variant, seed
        self.model = _build(spec, seed).eval()
        self.opt = attnopt.optimize(self.model, variant=variant)
        self.dtype = torch.float32
        self.mask_kind = "causal"
        self.pad_kind = "all"
        self.same_address, self.pool = same_address, {}
        self.B, self.T = B, T
        self._check(mode)

    def teardown(self) -> None:
        torch._dynamo.reset()

    # ------------------------------------------------------------------ the check every rule ends with

    def _fresh(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as a new tensor object; with ``same_address``, one at the address (and with the version) the
        previous call's argument of this shape had: what the allocator does when a data loader rebuilds a
        mask per batch (the old tensor is freed, the new one lands on its memory with a fresh version)."""
        if not self.same_address:
            return t
        store = self.pool.setdefault((tuple(t.shape), t.dtype), torch.empty(t.shape, dtype=t.dtype).untyped_storage())
        fresh = torch.empty(0, dtype=t.dtype).set_(store, 0, t.shape)
        with torch.no_grad():
            fresh.copy_(t)
        return fresh

    def _inputs(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        s, B, T = self.spec, self.B, self.T
        x = torch.randn(B, T, s.C, dtype=self.dtype)
        mask = arg_from_keep(mask_pattern(self.mask_kind, T), s, self.dtype) if s.mask in ARG_MASKS else None
        pad = pad_pattern(self.pad_kind, B, T) if s.pad != "none" else None
        return x, None if mask is None else self._fresh(mask), None if pad is None else self._fresh(pad)

    def _run(self, fn, x: torch.Tensor, mask, pad, mode: str, params: list[torch.Tensor]):
        """``fn``'s output and, except under ``no_grad``/``inference``, its gradients w.r.t. ``x`` and ``params``
        (``double``: the gradients of the gradients' squared norm; ``autocast``: forward and backward inside
        ``torch.autocast("cpu", torch.bfloat16)``)."""
        if mode in ("no_grad", "inference"):
            with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
                return fn(x, mask, pad), []
        leaf = x.detach().clone().requires_grad_(True)
        with torch.autocast("cpu", torch.bfloat16, enabled=mode == "autocast"):
            out = fn(leaf, mask, pad)
            cot = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)  # the same on both sides
            wrt = [leaf, *params]
            gs = torch.autograd.grad((out * cot).sum(), wrt, allow_unused=True, create_graph=mode == "double")
        gs = [g if g is not None else torch.zeros_like(w) for g, w in zip(gs, wrt)]
        if mode == "double":
            penalty = [(g.float() ** 2).sum() for g in gs if g.requires_grad]
            ggs = torch.autograd.grad(sum(penalty), wrt, allow_unused=True) if penalty else [None] * len(wrt)
            gs = [g if g is not None else torch.zeros_like(w) for g, w in zip(ggs, wrt)]
        return out.detach(), [g.detach() for g in gs]

    def _check(self, mode: str) -> None:
        if mode == "autocast" and self.dtype != torch.float32:
            mode = "grad"  # CPU autocast lowers float32 only
        if self.spec.late_write == "mask" and mode not in ("no_grad", "inference"):
            mode = "no_grad"  # as written, backward raises: masked_fill saved the mask the forward then zeroes
        STATS["calls"] += 1
        STATS[f"mode={mode}"] += 1
        STATS[f"dtype={self.dtype}"] += 1
        names = [n for n, _ in self.model.named_parameters()]
        params = [p for _, p in self.model.named_parameters()]
        x, mask, pad = self._inputs()
        dropout_on = self.model.training and self.spec.has_dropout and self.spec.dropout > 0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out, grads = self._run(self.opt, x, mask, pad, mode, params)
            ref, ref_grads = self._run(self.model, x, mask, pad, mode, params)
        for w in caught:
            STATS[f"warning: {str(w.message)[:60]}"] += 1
        report = getattr(self.opt, "_attnopt_report", None)  # (explain(opt) without inputs reads it)
        if report is not None and report.rewritten:
            STATS["calls of a model whose report has a rewritten site (unknown after deepcopy)"] += 1
        what = (f"{self.spec} variant={self.variant} B={self.B} T={self.T} mode={mode} dtype={self.dtype} "
                f"train={self.model.training} mask={self.mask_kind if mask is not None else None} "
                f"pad={self.pad_kind if pad is not None else None}")
        if dropout_on:
            # Active dropout: outputs are random and attnopt's stream is not the original's (README, "Dropout").
            # No equality check here, only what holds whatever the stream: shape, dtype, NaN rows, a backward.
            STATS["calls under active dropout (not compared)"] += 1
            assert out.shape == ref.shape and out.dtype == ref.dtype, what
            assert torch.equal(torch.isnan(out), torch.isnan(ref)), f"{what}: NaN rows moved under dropout"
            assert [g.shape for g in grads] == [g.shape for g in ref_grads], what
            return
        nan_rows = _nan_rows_as_written(ref)
        if self.dtype == torch.bfloat16 or mode == "autocast":
            ref64_model = copy.deepcopy(self.model).double()
            p64 = [p for _, p in ref64_model.named_parameters()]
            m64 = mask.double() if mask is not None and mask.is_floating_point() else mask
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ref64, ref64_grads = self._run(ref64_model, x.double(), m64, pad,
                                               "grad" if mode == "autocast" else mode, p64)
            assert_no_less_accurate(out, ref, ref64, f"output; {what}")
            if not nan_rows:
                for n, a, b, c in zip(["input", *names], grads, ref_grads, ref64_grads):
                    assert_no_less_accurate(a, b, c, f"gradient of {n} ({mode}); {what}")
            STATS["bf16/autocast calls compared against float64"] += 1
            return
        assert_same(out, ref, f"output; {what}")
        if nan_rows:
            STATS["calls with NaN rows as written (grads not compared)"] += 1
            return
        for n, a, b in zip(["input", *names], grads, ref_grads):
            assert_same(a, b, f"gradient of {n} ({mode}); {what}", grad=True)
        STATS["calls compared"] += 1

    def _step(self, name: str, mode: str) -> None:
        STATS["steps"] += 1
        STATS[f"rule={name}"] += 1
        self._check(mode)

    # ------------------------------------------------------------------ rules

    MODES = st.sampled_from(["no_grad", "inference", "grad", "double", "autocast"])

    @rule(B=st.sampled_from(BATCHES), T=st.sampled_from(LENGTHS), mode=MODES,
          mask=st.none() | st.sampled_from(MASK_PATTERNS), pad=st.none() | st.sampled_from(PAD_PATTERNS))
    def call(self, B: int, T: int, mode: str, mask: str | None, pad: str | None) -> None:
        """A call with new shapes, and maybe another mask / padding pattern (where the model takes one)."""
        self.B, self.T = B, T
        self.mask_kind = mask or self.mask_kind
        self.pad_kind = pad or self.pad_kind
        self._step("call", mode)

    @precondition(lambda self: self.spec.mask in ARG_MASKS)
    @rule(kind=st.sampled_from(MASK_PATTERNS), mode=MODES)
    def new_mask(self, kind: str, mode: str) -> None:
        """The mask argument of the next calls holds another pattern (a fresh tensor every call)."""
        self.mask_kind = kind
        self._step("new_mask", mode)

    @precondition(lambda self: self.spec.pad != "none")
    @rule(kind=st.sampled_from(PAD_PATTERNS), mode=MODES)
    def new_pad(self, kind: str, mode: str) -> None:
        """The padding argument of the next calls holds another pattern."""
        self.pad_kind = kind
        self._step("new_pad", mode)

    def _writable(self) -> list[str]:
        s = self.spec
        return (["bias"] if s.mask in BUFFER_MASKS or s.mask in BIAS_MASKS else []) + \
            (["scale"] if s.scale == "buffer0d" else [])

    def _pattern_tensor(self, target: str, kind: str, like: torch.Tensor) -> torch.Tensor:
        """A new value for buffer ``target`` (``kind`` indexes the patterns), shaped and typed like ``like``."""
        s = self.spec
        if target == "scale":
            return torch.tensor((0.5, 2.0, -0.3, 1.0 / math.sqrt(s.D))[kind % 4], dtype=like.dtype)
        if s.mask in BUFFER_MASKS:
            keep = mask_pattern(MASK_PATTERNS[kind % len(MASK_PATTERNS)], TMAX)
            return buffer_from_keep(keep, s.mask).to(like.dtype)
        name = ("alibi", "random", "causal_fill")[kind % 3]
        return bias_pattern(name, TMAX, fill_value(s.fill, like.dtype)).to(like.dtype)

    @precondition(lambda self: bool(self._writable()))
    @rule(data=st.data(), op=st.sampled_from(["fill_", "mul_", "copy_", "add_"]), kind=st.integers(0, 6),
          mode=MODES)
    def write_buffer(self, data, op: str, kind: int, mode: str) -> None:
        """An in-place write to the mask buffer, the bias buffer/parameter, or the 0-d scale."""
        target = data.draw(st.sampled_from(self._writable()), label="target")
        t = getattr(self.model, target)
        with torch.no_grad():
            if op == "copy_":
                t.copy_(self._pattern_tensor(target, kind, t))
            elif t.dtype == torch.bool:  # fill_ True/False, or & with another pattern
                if op == "fill_":
                    t.fill_(bool(kind % 2))
                else:
                    t.logical_and_(self._pattern_tensor(target, kind, t))
            elif op == "fill_":
                t.fill_((1, 0, 2, 0.5)[kind % 4] if target == "bias" else (0.5, 0.0, 3.0, 0.2)[kind % 4])
            elif op == "mul_":
                t.mul_((0.5, 2, 0, -1)[kind % 4] if t.is_floating_point() else (2, 0, 1, 3)[kind % 4])
            else:
                t.add_((1, -1, 0.25, 2)[kind % 4] if t.is_floating_point() else (1, 0, 1, 0)[kind % 4])
        self._step("write_buffer", mode)

    @precondition(lambda self: bool(self._writable()))
    @rule(data=st.data(), kind=st.integers(0, 6), mode=MODES)
    def reregister_buffer(self, data, kind: int, mode: str) -> None:
        """``del m.bias; m.register_buffer("bias", ...)`` (a new ``nn.Parameter`` for a bias parameter)."""
        target = data.draw(st.sampled_from(self._writable()), label="target")
        old = getattr(self.model, target)
        new = self._pattern_tensor(target, kind, old)
        delattr(self.model, target)
        del old
        if isinstance(new, torch.Tensor) and target == "bias" and self.spec.mask == "bias_param":
            self.model.bias = nn.Parameter(new)
        else:
            self.model.register_buffer(target, new)
        self._step("reregister_buffer", mode)

    @rule(seed=st.integers(0, 2**16), kind=st.integers(0, 6), mode=MODES)
    def load_state_dict(self, seed: int, kind: int, mode: str) -> None:
        """The weights and buffers of another model of the same spec (its mask/bias buffer another pattern)."""
        other = _build(self.spec, seed)
        if self._writable():
            with torch.no_grad():
                for target in self._writable():
                    t = getattr(other, target)
                    t.copy_(self._pattern_tensor(target, kind, t))
        other.to(self.dtype)
        self.model.load_state_dict(other.state_dict())
        self._step("load_state_dict", mode)

    @rule(factor=st.sampled_from([0.5, 2.0, 4.0]), mode=MODES)
    def sharpen(self, factor: float, mode: str) -> None:
        """The query/key weights scaled in place: logits of another range (std ~4 and more after a few)."""
        with torch.no_grad():
            if self.spec.proj == "fused":
                self.model.qkv.weight[: 2 * self.spec.C].mul_(factor)
            else:
                self.model.q_proj.weight.mul_(factor)
                self.model.k_proj.weight.mul_(factor)
        self._step("sharpen", mode)

    @rule(mode=MODES)
    def deepcopy(self, mode: str) -> None:
        """``copy.deepcopy`` of the optimized model; continue on the copy."""
        self.opt = copy.deepcopy(self.opt)
        self.model = self.opt._orig_mod
        self._step("deepcopy", mode)

    @rule(training=st.booleans(), mode=MODES)
    def train_eval(self, training: bool, mode: str) -> None:
        self.opt.train(training)
        assert self.model.training == training
        self._step("train_eval", mode)

    @rule(dtype=st.sampled_from(sorted(DTYPES)), mode=MODES)
    def set_dtype(self, dtype: str, mode: str) -> None:
        self.dtype = DTYPES[dtype]
        self.model.to(self.dtype)
        self._step("set_dtype", mode)

    @invariant()
    def twin_wraps_the_model(self) -> None:
        if hasattr(self, "opt"):
            assert self.opt._orig_mod is self.model


def _settings() -> settings:
    # CI: derandomized and not shrunk (a shrink recompiles at every step and can take minutes); the failing
    # sequence is printed as it was found. dev: random, shrunk to a minimal sequence.
    phases = list(Phase) if DEV else [Phase.explicit, Phase.generate]
    return settings(
        max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None, derandomize=not DEV, print_blob=True,
        phases=phases,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )


#: Sequences and steps of every mask spelling's run, for the summary file.
TOTALS: Counter = Counter()


@pytest.mark.parametrize("mask", MASKS)
def test_stateful_differential_fuzzer(mask: str, tmp_path_factory: pytest.TempPathFactory,
                                      capsys: pytest.CaptureFixture) -> None:
    """One machine per mask spelling, so that every spelling runs in the bounded CI profile too."""
    STATS.clear()
    machine = type(f"AttnoptFuzzer_{mask}", (AttnoptFuzzer,), {"MASK": mask})
    start = time.perf_counter()
    try:
        with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=4096):
            run_state_machine_as_test(machine, settings=_settings())
    finally:
        STATS["seconds"] = round(time.perf_counter() - start, 1)
        TOTALS.update({k: v for k, v in STATS.items() if k in ("sequences", "steps", "calls", "seconds")})
        path = tmp_path_factory.getbasetemp() / "fuzz_stats.json"
        runs = json.loads(path.read_text()) if path.exists() else {}
        runs[mask] = dict(STATS)
        runs["total"] = dict(TOTALS)
        path.write_text(json.dumps(runs, indent=1, sort_keys=True))
        with capsys.disabled():
            print(f"\nattnopt stateful fuzzer, mask={mask}: {STATS['sequences']} sequences, {STATS['steps']} steps, "
                  f"{STATS['calls']} calls in {STATS['seconds']} s; so far {TOTALS['sequences']} sequences, "
                  f"{TOTALS['steps']} steps, {TOTALS['calls']} calls in {TOTALS['seconds']:.1f} s ({path})")
            if DEV or os.environ.get("ATTNOPT_FUZZ_VERBOSE"):
                for k in sorted(STATS):
                    print(f"  {k}: {STATS[k]}")
    assert STATS["sequences"] > 0 and STATS["steps"] > 0
