"""Fixtures shared by the test modules."""

from __future__ import annotations

import os
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
