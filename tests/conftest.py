"""Shared test fixtures."""

import os

import pytest

# --- cerar: the suite's own optimized-code cache -------------------------------------------------
# Tests must not read or write the user's ~/.cache/cerar: codes searched by the suite live in the
# pytest cache directory, which spawned worker processes inherit through the environment.


@pytest.fixture(scope="session", autouse=True)
def cerar_code_cache(request):
    """Point $CERAR_CACHE_DIR at a directory of the pytest cache for the whole session."""
    directory = request.config.cache.mkdir("cerar-codes")
    previous = os.environ.get("CERAR_CACHE_DIR")
    os.environ["CERAR_CACHE_DIR"] = str(directory)
    yield directory
    if previous is None:
        os.environ.pop("CERAR_CACHE_DIR", None)
    else:
        os.environ["CERAR_CACHE_DIR"] = previous
