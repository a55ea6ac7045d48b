"""Fixtures shared by the test modules."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One token cache (CERAR_PYTHIA_CACHE / data.cache_dir) for the whole session: the embedded corpus's
    BPE tokenizer is trained and its token arrays written once, not once per test module."""
    return tmp_path_factory.mktemp("token-cache")


@pytest.fixture(scope="session", autouse=True)
def cerar_code_cache(request, tmp_path_factory):
    """The suite's own optimized-code cache: tests must not read or write the user's ~/.cache/cerar.
    $CERAR_CACHE_DIR points at a directory of the pytest cache (a temporary one when the cache plugin is
    off), which spawned workers inherit."""
    cache = getattr(request.config, "cache", None)
    directory = cache.mkdir("cerar-codes") if cache is not None else tmp_path_factory.mktemp("cerar-codes")
    previous = os.environ.get("CERAR_CACHE_DIR")
    os.environ["CERAR_CACHE_DIR"] = str(directory)
    yield directory
    if previous is None:
        os.environ.pop("CERAR_CACHE_DIR", None)
    else:
        os.environ["CERAR_CACHE_DIR"] = previous


@pytest.fixture(scope="session")
def sweep(tmp_path_factory, cache_dir):
    """``sweep(N)``: the folder of the one train/sweep.py launch of N ranks that test_train_runs,
    test_fidelity_metrics and test_export read (tests/runs.py says what it trains). Launched on first use,
    once per session; a failed launch fails every test that asks for it, without launching again."""
    from tests.runs import launch_sweep

    launched: dict[int, Path | str] = {}

    def folder(N: int) -> Path:
        if N not in launched:
            try:
                launched[N] = launch_sweep(N, tmp_path_factory.mktemp(f"sweep-n{N}"), cache_dir)
            except (AssertionError, subprocess.TimeoutExpired) as error:
                launched[N] = f"the N={N} sweep launch failed: {error}"
        if isinstance(launched[N], str):
            pytest.fail(launched[N])
        return launched[N]

    return folder


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``-n``, ``--dist loadgroup``) a module's tests run on one worker, so its module
    fixtures (one launch read by many tests) run once; the tests reading the shared ``sweep`` launches run on
    one worker, so the session launches them once; and the network-lab tests, which create namespaces and
    shape links, never run beside each other."""
    for item in items:
        if "sweep" in getattr(item, "fixturenames", ()):
            group = "sweep"
        elif item.get_closest_marker("netlab"):
            group = "netlab"
        else:
            group = item.module.__name__ if item.module is not None else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
