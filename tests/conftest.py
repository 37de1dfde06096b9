"""Shared test setup: hypothesis profiles, a fresh dynamo per test, a fixed torch seed per test.

Under pytest-xdist (``-n 2``, what CI runs) each worker runs torch on one thread and sends the property
tests' spelling combinations to the controller, which reports them.

Profiles: ``ci`` (deterministic, ~25 examples per property; the default and whenever ``CI`` is
set) and ``dev`` (more, random examples): ``ATTNOPT_HYPOTHESIS=dev pytest tests/test_properties.py``.
"""

from __future__ import annotations

import os
import sys
import zlib

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", derandomize=True, deadline=None, max_examples=25, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev", deadline=None, max_examples=200, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("dev" if os.environ.get("ATTNOPT_HYPOTHESIS") == "dev" else "ci")


@pytest.fixture(autouse=True)
def _fresh_dynamo_and_seed(request: pytest.FixtureRequest):
    """Dynamo stops capturing a forward after its recompile limit; every test starts from zero.

    The seed is derived from the test id, so a test's random tensors do not depend on which
    tests ran before it.
    """
    torch._dynamo.reset()
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _private_tuning_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    """Every test tunes into its own cache directory: no test sees another's timings or the user's cache."""
    monkeypatch.setenv("ATTNOPT_CACHE_DIR", str(tmp_path_factory.mktemp("attnopt-cache")))
    monkeypatch.delenv("ATTNOPT_VARIANT", raising=False)


def _exercised() -> dict[str, set] | None:
    mod = sys.modules.get("test_properties") or sys.modules.get("tests.test_properties")
    return getattr(mod, "EXERCISED", None)


#: Spelling combinations the pytest-xdist workers exercised (each worker sends its own at its end).
_FROM_WORKERS: dict[str, set] = {}


def pytest_configure(config: pytest.Config) -> None:
    """A pytest-xdist worker runs torch on one thread: the workers share the machine's cores."""
    if hasattr(config, "workerinput"):
        torch.set_num_threads(1)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """On a pytest-xdist worker: hand the property tests' combinations to the controller (as reprs)."""
    out = getattr(session.config, "workeroutput", None)
    exercised = _exercised()
    if out is not None and exercised:
        out["attnopt_exercised"] = {k: [[repr(x) for x in c] for c in v] for k, v in exercised.items()}


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:  # noqa: ARG001 - a pytest-xdist hook
    for name, combos in getattr(node, "workeroutput", {}).get("attnopt_exercised", {}).items():
        _FROM_WORKERS.setdefault(name, set()).update(tuple(c) for c in combos)


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # noqa: ARG001
    """Report how many distinct spelling combinations the property tests exercised."""
    exercised = _exercised()
    if exercised:
        exercised = {k: {tuple(repr(x) for x in c) for c in v} for k, v in exercised.items()}
    exercised = exercised or _FROM_WORKERS
    if exercised:
        terminalreporter.write_sep("-", "attnopt property tests")
        for name, combos in sorted(exercised.items()):
            terminalreporter.write_line(f"{name}: {len(combos)} distinct combinations of spelling axes")
        total = set().union(*exercised.values())
        terminalreporter.write_line(f"all property tests: {len(total)} distinct combinations")
