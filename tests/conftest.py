"""Fixtures shared by the test modules."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One token cache (CERAR_PYTHIA_CACHE / data.cache_dir) for the whole session: the embedded corpus's
    BPE tokenizer is trained and its token arrays written once, not once per test module."""
    return tmp_path_factory.mktemp("token-cache")
