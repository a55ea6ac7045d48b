"""Fixtures shared by the test modules."""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
from pathlib import Path

# One compute thread per process, set before anything imports torch or numpy (they size their thread pools when
# they load): the suite runs three pytest workers, each with its forkserver and the ranks it launches, on the
# 2 cores CI has. With a pool of 2 threads per process, OpenMP's and OpenBLAS's threads spin-wait for work on cores
# that other processes need: the suite used 966 s of CPU in 8 min 18 s, and 722 s in 6 min 31 s with one thread
# (docs/testing.md, "The suite's time"). The ranks the tests launch already ran on one (torchrun's default too).
for _pool in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_pool] = "1"  # whatever the shell set: the suite's time is measured so

# Triton's interpreter for the hand-written kernels (tests/test_triton_kernels.py): Triton reads this when it is first
# imported (torch.compile may import it in any module), so it is set here, before any test module loads. It changes
# nothing else on a CPU: cerar.formats offers Triton's kernels on a CPU only when asked (fused.enable(triton=True)).
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402


@contextlib.contextmanager
def _environment_variable(name: str, value: str):
    """``os.environ[name] = value`` for the block (the processes started in it inherit it), then as it was."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


@pytest.fixture(scope="session")
def run_folder(tmp_path_factory) -> Path:
    """A folder that every pytest-xdist worker of this pytest run shares (the workers' own temporary
    folders are siblings under one per-run root); without xdist, the session's own."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    folder.mkdir(exist_ok=True)
    return folder


@pytest.fixture(scope="session")
def cache_dir(run_folder) -> Path:
    """One token cache (CERAR_PYTHIA_CACHE / data.cache_dir) for the whole pytest run, shared by its workers:
    the embedded corpus's BPE tokenizer is trained and its token arrays written once (train/data.py builds
    an entry under a file lock, so a worker asking while another builds waits for it). $CERAR_PYTHIA_TEST_TOKEN_CACHE
    names another folder to use instead, kept across pytest runs (scripts/checks/mutation.py: one build for all
    of its runs)."""
    kept = os.environ.get("CERAR_PYTHIA_TEST_TOKEN_CACHE")
    folder = Path(kept) if kept else run_folder / "token-cache"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="session", autouse=True)
def token_cache_for_every_launch(cache_dir):
    """$CERAR_PYTHIA_CACHE is the run's token cache for every process the suite starts, also those of scripts that
    launch training themselves (the GPU check, the benchmarks): none builds the tokenizer again (seconds each), and
    none reads or writes the user's ~/.cache/cerar-pythia. A test that needs another folder sets its own."""
    with _environment_variable("CERAR_PYTHIA_CACHE", str(cache_dir)):
        yield


@pytest.fixture(scope="session", autouse=True)
def eager_arithmetic():
    """The suite's runs use the eager arithmetic (CERAR_FUSED=0, inherited by spawned ranks): inductor's C++ build of
    the fused kernels takes minutes on a 2-core machine, per fresh cache. The fused kernels are held to the eager
    bytes by tests/test_int8_format.py (traced by dynamo, run by torch's operations), by
    ``cerar.formats.fused.enable``'s
    own check before it switches one on, and by scripts/bench/bench_arithmetic.py and the GPU check."""
    with _environment_variable("CERAR_FUSED", "0"):
        yield


@pytest.fixture(scope="session", autouse=True)
def cerar_code_cache(request, tmp_path_factory):
    """The suite's own optimized-code cache: tests must not read or write the user's ~/.cache/cerar.
    $CERAR_CACHE_DIR points at a directory of the pytest cache (a temporary one when the cache plugin is
    off), which spawned workers inherit."""
    cache = getattr(request.config, "cache", None)
    directory = cache.mkdir("cerar-codes") if cache is not None else tmp_path_factory.mktemp("cerar-codes")
    with _environment_variable("CERAR_CACHE_DIR", str(directory)):
        yield directory


@contextlib.contextmanager
def held_exclusively(lock_file: Path):
    """Hold an advisory lock on ``lock_file`` against the other workers of the run."""
    with open(lock_file, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def sweep(run_folder, cache_dir):
    """``sweep(N)``: the folder of the one train/sweep.py launch of N ranks that test_train_runs,
    test_fidelity_metrics and test_export read (tests/runs.py says what it trains). Launched on first use,
    once per pytest run: the first worker to ask launches it while the others wait on its lock. A failed
    launch fails every test that asks for it, on every worker, without launching again."""
    from tests.runs import launch_sweep

    def folder(N: int) -> Path:
        out, failure = run_folder / f"sweep-n{N}", run_folder / f"sweep-n{N}.failed"
        with held_exclusively(run_folder / f"sweep-n{N}.lock"):
            if not (out / "launched").exists() and not failure.exists():
                out.mkdir(exist_ok=True)
                try:
                    launch_sweep(N, out, cache_dir)
                    (out / "launched").touch()
                except (AssertionError, subprocess.TimeoutExpired) as error:
                    failure.write_text(f"the N={N} sweep launch failed: {error}")
        if failure.exists():
            pytest.fail(failure.read_text())
        return out

    return folder


@pytest.fixture(autouse=True)
def one_network_lab_at_a_time(request, run_folder):
    """The network-lab tests (marked ``netlab``) create namespaces and shape links, and some measure rates:
    they never run beside each other, on any worker."""
    if request.node.get_closest_marker("netlab") is None:
        yield
        return
    with held_exclusively(run_folder / "netlab.lock"):
        yield


HEAVIEST_MODULES = (
    "test_reliability",
    "test_train_runs",
    "test_gpu_check",
    "test_bench_two_tier",
    "test_auto_aggregator",
    "test_auto_c",
    "test_hierarchical_training",
    "test_netlab",
)
"""The modules that take longest (per-module sums of ``pytest --durations=0`` on a fresh clone of 10dc426, three
workers, 2026-12-04: 65-250 s each), heaviest first; test_protocol (33 s there) left the list, test_auto_aggregator
(76 s) and test_auto_c (74 s) joined it. Each module is one unit of work for pytest-xdist (``--dist loadfile
--no-loadscope-reorder``, pyproject.toml), handed out in collection order: starting these first and ending on the
many short modules lets the three workers finish together (within 20 s of each other on 2026-12-03,
docs/testing.md). Not listed on purpose: test_stall_phases (55 s, its cases wait out deadlines): started among the
heavy modules it took 295 s and the suite 9 min 6 s (2026-12-04); it goes last (``LAST_MODULES``)."""


LAST_MODULES = ("test_stall_phases",)
"""Handed out last: test_stall_phases's 29 launches each wait out a 3 s deadline, and their time depends on the
load beside them. At the end of the suite, with the other workers on their last short modules, its fixture took
39-63 s; started beside time_to_loss's torchrun launches and train_units (2026-12-04, twice), 168 s and 196 s,
and the suite 8 min 50 s and 8 min 53 s against 6 min 26 s."""


IMPORTED_LATE = ("transformers", "torch._dynamo")
"""Modules the test modules import inside the tests that need them, never at collection: each pytest process (every
xdist worker, every run of the mutation check) collects them, and importing these took about 6 s of a core per
collection (17.3 -> 10.4 s with test_compiled_step's and test_fused_formats' imports moved into their tests,
2026-12-04). tests/test_suite_threads.py holds it."""


def pytest_collection_finish(session):
    """Record which of ``IMPORTED_LATE`` the collection imported (read by tests/test_suite_threads.py)."""
    session.config.imported_at_collection = [name for name in IMPORTED_LATE if name in sys.modules]


def pytest_collection_modifyitems(config, items):
    """Run the heaviest modules first (``HEAVIEST_MODULES``) and ``LAST_MODULES`` last; the rest keep their order."""
    rank = {name: position for position, name in enumerate(HEAVIEST_MODULES)}
    rank.update({name: len(HEAVIEST_MODULES) + 1 + position for position, name in enumerate(LAST_MODULES)})

    def module_rank(item) -> int:
        return rank.get(item.path.stem, len(HEAVIEST_MODULES))

    items.sort(key=module_rank)  # stable: every module's own order is kept
