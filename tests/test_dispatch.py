"""The per-call dispatch both site kinds share (``runtime/dispatch.py``): choice, per-key check, fallbacks.

A rewritten site (:class:`AttentionSite`) and a KV-cache site (:class:`KVCacheAttention`) run each call
through the same :class:`DispatchingSite`: the same causal call reaches both with the same candidate
arguments, so each test runs on both kinds and expects the same verdicts. A wrong candidate is caught
by the reference check and replaced, a candidate that raises is replaced by ``math``, the selector is
asked once per shape key and again after ``forget_choices()``, and generation with a wrong or an
``"auto"`` variant gives the model's own tokens.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator

import pytest
import torch

from attnopt.generation import cached, generate, generate_plain
from attnopt.kernels import registry
from attnopt.kernels.reference import reference_attention
from attnopt.kernels.registry import FunctionCandidate
from attnopt.models import GPTConfig, NanoGPT
from attnopt.runtime.dispatch import DispatchingSite
from attnopt.runtime.kv_cache import KVCacheAttention
from attnopt.runtime.site import AttentionSite
from attnopt.selection.cache import TuningEntry
from attnopt.spec import AttentionSpec

B, H, T, D = 2, 2, 6, 8
SPEC = AttentionSpec(scale=D**-0.5, causal="top_left")
KINDS = ["rewritten site", "KV-cache site"]
VOCAB = 64


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@contextlib.contextmanager
def no_warnings() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


@pytest.fixture
def register() -> Iterator[Callable[[str, Callable[..., torch.Tensor]], str]]:
    """Register test candidates (SDPA's support check) and remove them afterwards."""
    names: list[str] = []

    def add(name: str, fn: Callable[..., torch.Tensor]) -> str:
        registry.register_candidate(FunctionCandidate(name, fn, registry.get_candidate("sdpa").supports,
                                                      "a test kernel"))
        names.append(name)
        return name

    yield add
    for name in names:
        registry._REGISTRY.pop(name, None)


@pytest.fixture
def wrong(register: Callable[[str, Callable[..., torch.Tensor]], str]) -> str:
    def off_by_half(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: object) -> torch.Tensor:
        return reference_attention(q, k, v, **kwargs) + 0.5

    return register("wrong_for_dispatch_test", off_by_half)


class StubSelector:
    """Chooses ``choice`` for every key; keeps the keys it was asked for and the sites registered with it."""

    def __init__(self, choice: str):
        self.choice = choice
        self.asked: list[object] = []
        self.sites: list[DispatchingSite] = []

    def register(self, site: DispatchingSite) -> None:
        self.sites.append(site)

    def choose(self, spec: AttentionSpec, key: object, call: object) -> TuningEntry:
        self.asked.append(key)
        return TuningEntry(choice=self.choice, timings_ms={self.choice: 1.0})


def make_site(kind: str, candidate: str, selector: StubSelector | None = None) -> DispatchingSite:
    if kind == "rewritten site":
        site = AttentionSite("s0", SPEC, candidate, where="test:1")
        if selector is not None:  # as optimize's attach step does
            site.selector = selector
            selector.register(site)
        return site
    return KVCacheAttention("s0", SPEC, max_len=16, where="test:1", candidate=candidate, selector=selector)


def run(site: DispatchingSite, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One causal call over all T positions: a prefill for the KV-cache site."""
    if isinstance(site, KVCacheAttention):
        return site(q, k, v, None, 0)
    return site(q, k, v)


def qkv() -> list[torch.Tensor]:
    return [torch.randn(B, H, T, D) for _ in range(3)]


def expected(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return reference_attention(q, k, v, is_causal=True, scale=SPEC.scale)


def _nanogpt() -> NanoGPT:
    torch.manual_seed(0)
    return NanoGPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, block_size=24)).eval()


# ----------------------------------------------------------------------------- the per-key reference check


@pytest.mark.parametrize("kind", KINDS)
def test_a_wrong_candidate_is_caught_and_replaced_by_sdpa_once_per_shape_key(kind: str, wrong: str) -> None:
    site = make_site(kind, wrong)
    q, k, v = qkv()
    with torch.no_grad():
        with pytest.warns(UserWarning, match=f"{wrong}.*does not match the reference.*running sdpa instead"):
            out = run(site, q, k, v)
        torch.testing.assert_close(out, expected(q, k, v))
        with no_warnings():  # decided once for the shape key
            torch.testing.assert_close(run(site, q, k, v), out)
    assert [key[0] for key in site._checked] == [wrong]
    assert list(site._checked.values()) == ["sdpa"]


def test_both_site_kinds_reach_the_same_verdict_for_the_same_call(wrong: str) -> None:
    sites = [make_site(kind, wrong) for kind in KINDS]
    q, k, v = qkv()
    with quiet(), torch.no_grad():
        outs = [run(s, q, k, v) for s in sites]
    torch.testing.assert_close(outs[0], outs[1])
    assert sites[0]._checked == sites[1]._checked  # the same (candidate, shape key) -> the same replacement


@pytest.mark.parametrize("kind", KINDS)
def test_a_candidate_that_raises_after_its_check_is_replaced_by_math_for_good(kind: str, register) -> None:
    calls: list[int] = []

    def flaky(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        if len(calls) > 1:  # the check's run passes; the call itself fails
            raise RuntimeError("kernel launch failed")
        return reference_attention(q, k, v, **kwargs)

    name = register("flaky_for_dispatch_test", flaky)
    site = make_site(kind, name)
    q, k, v = qkv()
    with torch.no_grad():
        with pytest.warns(UserWarning, match=f"{name}.*failed at s0 \\(test:1\\).*kernel launch failed"):
            out = run(site, q, k, v)
        torch.testing.assert_close(out, expected(q, k, v))
        assert site._failed == {name} and len(calls) == 2
        with no_warnings():
            torch.testing.assert_close(run(site, q, k, v), out)
    assert len(calls) == 2  # math ran, not the candidate


# ----------------------------------------------------------------------------- the choice (candidate="auto")


@pytest.mark.parametrize("kind", KINDS)
def test_auto_asks_the_selector_once_per_key_checks_its_choice_and_asks_again_after_forget(kind: str,
                                                                                           wrong: str) -> None:
    selector = StubSelector(wrong)  # a selector that picks a wrong kernel: the check still catches it
    site = make_site(kind, "auto", selector)
    assert selector.sites == [site]  # registered: Selector.share() can make it choose again
    q, k, v = qkv()
    with torch.no_grad():
        with pytest.warns(UserWarning, match=f"{wrong}.*does not match the reference"):
            out = run(site, q, k, v)
        torch.testing.assert_close(out, expected(q, k, v))
        run(site, q, k, v)
        assert len(selector.asked) == 1 and list(site.tuning) == selector.asked
        site.forget_choices()
        assert site.tuning == {}
        with no_warnings():  # asked again; the check's verdict for the key stands
            torch.testing.assert_close(run(site, q, k, v), out)
    assert len(selector.asked) == 2 and list(site.tuning) == selector.asked[1:]


# ----------------------------------------------------------------------------- generation through cached()


def test_generation_with_a_wrong_variant_gives_the_models_tokens(wrong: str) -> None:
    model = _nanogpt()
    idx = torch.randint(0, VOCAB, (2, 5))
    lm = cached(model, variant=wrong)
    with pytest.warns(UserWarning, match=f"{wrong}.*does not match the reference"):
        got = generate(lm, idx, 6)
    assert torch.equal(got, generate_plain(model, idx, 6))
    for site in lm.sites:
        assert set(site._checked.values()) == {"sdpa"}
        # the prefill (5 -> bucket 8) and the steps; a registered candidate is checked at each exact shape it serves
        assert {key[1].tq for key in site._checked} == {8, 1}


def test_auto_variant_records_tunings_on_the_kv_cache_sites(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("ATTNOPT_CACHE_DIR", str(tmp_path))
    model = _nanogpt()
    idx = torch.randint(0, VOCAB, (2, 5))
    lm = cached(model, variant="auto")
    plain = generate_plain(model, idx, 6)
    assert torch.equal(generate(lm, idx, 6), plain)
    assert len({id(s.selector) for s in lm.sites}) == 1 and lm.sites[0].selector is not None
    for site in lm.sites:
        assert "auto" in site.extra_repr()
        assert {key.tq for key in site.tuning} == {8, 1}
        assert all(e.choice in e.timings_ms for e in site.tuning.values())
    tuned = len(lm.sites[0].selector.entries)
    for site in lm.sites:
        site.forget_choices()
    assert all(site.tuning == {} for site in lm.sites)
    assert torch.equal(generate(lm, idx, 6), plain)
    assert all({key.tq for key in site.tuning} == {8, 1} for site in lm.sites)  # asked again
    assert len(lm.sites[0].selector.entries) == tuned  # the selector's own entries answered: no new tuning


def test_a_first_call_with_saved_tensor_hooks_disabled_still_runs():
    """``torch.func`` transforms disable saved-tensor hooks; the first call's reference check must not
    push hooks then (it raised out of the model)."""
    from attnopt.kernels.reference import reference_attention
    from attnopt.runtime.site import AttentionSite
    from attnopt.spec import AttentionSpec

    site = AttentionSite("s", AttentionSpec(scale=0.5, causal="top_left"), "sdpa")
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    with torch.autograd.graph.disable_saved_tensors_hooks("as torch.func transforms do"):
        out = site(q, q, q)
    torch.testing.assert_close(out, reference_attention(q, q, q, is_causal=True, scale=0.5))


@pytest.mark.parametrize(("value", "on"), [("", False), ("0", False), ("off", False), ("No", False),
                                           ("1", True), ("on", True), ("TRUE", True)])
def test_attnopt_strict_reads_on_and_off_like_every_flag(monkeypatch, value, on):
    from attnopt.env import strict_guards

    monkeypatch.setenv("ATTNOPT_STRICT", value)
    assert strict_guards() is on


def test_an_unreadable_flag_says_what_it_accepts(monkeypatch):
    from attnopt.env import strict_guards

    monkeypatch.setenv("ATTNOPT_STRICT", "maybe")
    with pytest.raises(ValueError, match="ATTNOPT_STRICT='maybe' is not understood"):
        strict_guards()


@pytest.mark.parametrize("every_shape", [False, True])
def test_a_candidate_compiled_per_shape_is_checked_at_each_exact_shape(monkeypatch, every_shape):
    # like compiled FlexAttention on some CPUs: right at T=16, wrong at T=13, one length bucket (9..16)
    def per_shape(q, k, v, **kw):
        out = reference_attention(q, k, v, **kw)
        return out + 1.0 if q.size(-2) == 13 else out

    monkeypatch.setitem(registry._REGISTRY, "per_shape",
                        FunctionCandidate("per_shape", per_shape, lambda spec: None, every_shape=every_shape))
    site = DispatchingSite("s", AttentionSpec(scale=0.5, causal="top_left"), "per_shape")
    kw = dict(attn_mask=None, is_causal=True, scale=0.5, dropout_p=0.0, enable_gqa=False)
    for t in (16, 13, 13):
        q = torch.randn(1, 2, t, 8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = site.run_candidate(q, q, q, dict(kw))
        if every_shape and t == 13:  # declared checked at every shape: the check at T=16 speaks for T=13
            assert not torch.allclose(out, reference_attention(q, q, q, **kw))
        else:
            torch.testing.assert_close(out, reference_attention(q, q, q, **kw))
