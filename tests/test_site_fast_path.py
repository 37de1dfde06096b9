"""The per-call fast path of a site (``runtime/dispatch.py``'s plans, ``runtime/site.py``'s forward).

After the first call of a signature (shapes, dtype, device, the mask's dtype and shape, causal, dropout,
gradients) a call costs one tuple and one lookup. These tests pin what must still happen: every new
signature goes through the selector and the per-key check, the value checks (buffer guards, rows
whose keys are all hidden) run on every call, the profiler still sees the site's range, and what a
compiled graph runs follows the most recent eager call.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import pytest
import torch

from attnopt.kernels import registry
from attnopt.kernels.reference import reference_attention
from attnopt.kernels.registry import FunctionCandidate
from attnopt.runtime import dispatch
from attnopt.runtime.guards import BufferGuard
from attnopt.runtime.site import AttentionSite
from attnopt.selection.cache import TuningEntry
from attnopt.spec import AttentionSpec

B, H, T, D = 2, 2, 6, 8
CAUSAL = AttentionSpec(scale=D**-0.5, causal="top_left")
ADDED = AttentionSpec(scale=D**-0.5, mask="additive", nan_rows=True, min_rows="math")


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """Every per-key reference check: (shape of q, dtype, grad)."""
    seen: list[tuple] = []
    orig = dispatch._compare_with_reference

    def spy(fn, spec, q, k, v, kwargs, grad):
        seen.append((tuple(q.shape), q.dtype, grad))
        return orig(fn, spec, q, k, v, kwargs, grad)

    monkeypatch.setattr(dispatch, "_compare_with_reference", spy)
    return seen


class Stub:
    def __init__(self, choice: str = "sdpa"):
        self.choice, self.asked = choice, []

    def register(self, site) -> None:
        pass

    def choose(self, spec, key, call) -> TuningEntry:
        self.asked.append(key)
        return TuningEntry(choice=self.choice, timings_ms={self.choice: 1.0})


def qkv(t: int = T, dtype: torch.dtype = torch.float32, grad: bool = False) -> list[torch.Tensor]:
    return [torch.randn(B, H, t, D, dtype=dtype, requires_grad=grad) for _ in range(3)]


def test_each_new_signature_is_planned_and_each_new_shape_key_checked(checks: list[tuple]) -> None:
    site = AttentionSite("s", CAUSAL, "sdpa")
    with torch.no_grad():
        site(*qkv())
        site(*qkv())  # the same signature: no new check
    assert checks == [((B, H, T, D), torch.float32, False)]
    with torch.no_grad():
        site(*qkv(t=20))  # another shape key
        site(*qkv(dtype=torch.float64))  # another dtype
    site(*qkv(grad=True)).sum().backward()  # gradients
    with torch.no_grad():
        site(*qkv())  # back to the first signature: nothing new
    assert checks[1:] == [((B, H, 20, D), torch.float32, False), ((B, H, T, D), torch.float64, False),
                          ((B, H, T, D), torch.float32, True)]
    assert len(site._plans) == 4


def test_a_new_mask_dtype_is_checked(checks: list[tuple]) -> None:
    site = AttentionSite("s", ADDED, "sdpa")
    q, k, v = qkv()
    with torch.no_grad():
        site(q, k, v, torch.zeros(T, T))
        site(q, k, v, torch.ones(T, T, dtype=torch.bool))  # another mask dtype: another key
        site(q, k, v, torch.zeros(B, 1, T, T))  # another mask shape: its own plan and key
        site(q, k, v, torch.zeros(T, T))
    assert len(checks) == 3 and len(site._plans) == 3


def test_the_selector_is_asked_once_per_key_and_again_after_forget(checks: list[tuple]) -> None:
    site = AttentionSite("s", CAUSAL, "auto")
    site.selector = stub = Stub()
    with torch.no_grad():
        for _ in range(3):
            site(*qkv())
        assert len(stub.asked) == 1
        site.forget_choices()
        site(*qkv())
    assert len(stub.asked) == 2 and len(checks) == 1  # the check is per (candidate, key): kept


def test_a_wrong_candidate_on_a_later_shape_is_caught(checks: list[tuple]) -> None:
    def wrong_when_long(q, k, v, **kw):
        out = reference_attention(q, k, v, **kw)
        return out + 1.0 if q.size(-2) > 16 else out

    registry.register_candidate(FunctionCandidate("wrong_when_long", wrong_when_long, lambda spec: None))
    try:
        site = AttentionSite("s", CAUSAL, "wrong_when_long")
        with torch.no_grad(), quiet():
            site(*qkv())  # checked at this shape: right
            for _ in range(2):
                q, k, v = qkv(t=40)
                out = site(q, k, v)
                torch.testing.assert_close(out, reference_attention(q, k, v, is_causal=True, scale=CAUSAL.scale))
        assert site.fallbacks == {"wrong_when_long does not match the reference for these shapes: sdpa": 2}
    finally:
        registry._REGISTRY.pop("wrong_when_long", None)


def test_a_candidate_that_raises_clears_the_plans_and_is_counted() -> None:
    calls = [0]

    def flaky(q, k, v, **kw):
        calls[0] += 1
        if calls[0] > 2:  # passes its check and one call, then raises
            raise RuntimeError("boom")
        return reference_attention(q, k, v, **kw)

    registry.register_candidate(FunctionCandidate("flaky", flaky, lambda spec: None))
    try:
        site = AttentionSite("s", CAUSAL, "flaky")
        q, k, v = qkv()
        want = reference_attention(q, k, v, is_causal=True, scale=CAUSAL.scale)
        with torch.no_grad(), quiet():
            for _ in range(4):
                torch.testing.assert_close(site(q, k, v), want)
        assert site._failed == {"flaky"}
        assert site.fallbacks == {"flaky raised at this site: math": 3}
    finally:
        registry._REGISTRY.pop("flaky", None)


def test_buffer_guards_are_checked_on_every_call() -> None:
    """The causal proof's buffer is written in place between calls of one signature: the mask is used then."""
    bias = torch.ones(T, T).tril()
    from attnopt.kernels.bands import band_pattern

    site = AttentionSite("s", AttentionSpec(scale=D**-0.5, mask="bool", causal="top_left"), "sdpa",
                         guards=[BufferGuard.of(bias, *band_pattern(bias))])
    q, k, v = qkv()
    with torch.no_grad(), quiet():
        for lookahead in (0, 2, 0):
            bias.copy_(torch.ones(T, T).tril(lookahead))
            out = site(q, k, v, bias.bool(), None, None, bias)
            torch.testing.assert_close(out, reference_attention(q, k, v, attn_mask=bias.bool(), scale=D**-0.5))


def test_train_and_eval_switches_follow_the_module() -> None:
    spec = AttentionSpec(scale=D**-0.5, dropout_p=0.5, dropout_mode="module")
    site = AttentionSite("s", spec, "sdpa")
    q, k, v = qkv(grad=True)
    want = reference_attention(q, k, v, scale=spec.scale)
    for training in (False, True, False):
        site.train(training)
        out = site(q, k, v)
        if training:
            assert not torch.allclose(out, want)  # dropout draws, as written in training mode
            assert site.fallbacks == {"dropout with gradients: math": 1}
        else:
            torch.testing.assert_close(out, want)


def test_the_profiler_sees_the_site_range_and_no_range_is_opened_without_one(monkeypatch) -> None:
    site = AttentionSite("site7", CAUSAL, "sdpa")
    q, k, v = qkv()
    opened = []
    orig = torch.autograd.profiler.record_function

    def spy(name, *args):
        opened.append(name)
        return orig(name, *args)

    monkeypatch.setattr(torch.autograd.profiler, "record_function", spy)
    with torch.no_grad():
        site(q, k, v)
        site(q, k, v)
        assert opened == []
        with torch.profiler.profile() as prof:
            site(q, k, v)
    assert opened == ["attnopt::site7"]
    assert any(e.name == "attnopt::site7" for e in prof.events())


def test_a_traced_call_runs_what_the_most_recent_eager_call_of_its_key_ran() -> None:
    """``compile=True`` runs a tuning call eagerly right before tracing: the traced call follows it."""
    site = AttentionSite("s", CAUSAL, "auto")
    site.selector = Stub("sdpa")
    with torch.no_grad():
        site(*qkv())
    site._ran["sdpa"] = "math"  # as if this key's check had replaced it
    seen = []
    orig = registry.get_candidate

    def spy(name):
        seen.append(name)
        return orig(name)

    dispatch.get_candidate, saved = spy, dispatch.get_candidate
    try:
        with torch.no_grad():
            site.run_candidate(*qkv(), dict(attn_mask=None, is_causal=True, scale=CAUSAL.scale, dropout_p=0.0,
                                            enable_gqa=False), tracing=True)
    finally:
        dispatch.get_candidate = saved
    assert seen == ["math"]


def test_a_mask_that_requires_a_gradient_is_checked_apart() -> None:
    """A candidate checked on a call whose mask needs no gradient is checked again once the mask needs one."""
    def detached_mask(q, k, v, attn_mask=None, **kw):  # right outputs, no gradient for the mask
        return reference_attention(q, k, v, attn_mask=None if attn_mask is None else attn_mask.detach(), **kw)

    registry.register_candidate(FunctionCandidate("detached_mask", detached_mask, lambda spec: None))
    try:
        site = AttentionSite("s", ADDED, "detached_mask")
        q, k, v = qkv(grad=True)
        with quiet():
            site(q, k, v, torch.randn(T, T)).sum().backward()  # checked: outputs and q, k, v gradients right
            assert site.fallbacks == {}
            mask = torch.randn(T, T, requires_grad=True)
            out = site(q, k, v, mask)
        (out * out).sum().backward()
        want = torch.randn(T, T).copy_(mask.detach()).requires_grad_(True)
        ref = reference_attention(q.detach(), k.detach(), v.detach(), attn_mask=want, scale=ADDED.scale)
        (ref * ref).sum().backward()
        torch.testing.assert_close(mask.grad, want.grad)
        (reason,) = site.fallbacks
        assert reason.startswith("detached_mask does not match the reference for these shapes")
    finally:
        registry._REGISTRY.pop("detached_mask", None)


@pytest.mark.parametrize("candidate", ["sdpa", "sdpa_flash", "math"])
def test_a_site_that_ran_still_pickles_and_copies(candidate: str) -> None:
    """The plans are a cache of candidates (whose functions may be closures): left out of the pickle."""
    import copy
    import pickle

    site = AttentionSite("s", CAUSAL, candidate)
    q, k, v = qkv()
    with torch.no_grad():
        want = site(q, k, v)
        for again in (pickle.loads(pickle.dumps(site)), copy.deepcopy(site)):
            assert again._plans == {} and again._checked == site._checked
            torch.testing.assert_close(again(q, k, v), want)


def test_running_runs_its_candidate_for_shapes_planned_before() -> None:
    """``running("math")`` serves every call with math, also a call whose shapes the site planned before."""
    site = AttentionSite("s", CAUSAL, "sdpa")
    q, k, v = qkv()
    with torch.no_grad():
        site(q, k, v)
        with site.running("math"):
            site(q, k, v)
            assert site._ran == {"math": "math"}
        site(q, k, v)
    assert site._ran == {"sdpa": "sdpa"}
