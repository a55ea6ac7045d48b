"""The suite's own processes compute on one thread each (tests/conftest.py): three pytest workers, their
forkservers and the ranks they launch share CI's 2 cores, and a pool of 2 threads per process spins on cores
the others need (docs/testing.md: 966 s of CPU in 8 min 18 s with pools of 2, 722 s in 6 min 31 s with one)."""

import os

import pytest


@pytest.mark.quick
def test_torch_and_blas_in_the_test_process_use_one_thread():
    import torch

    assert torch.get_num_threads() == 1
    assert os.environ["OPENBLAS_NUM_THREADS"] == os.environ["OMP_NUM_THREADS"] == "1"


def _preloaded(rank, world_size):  # noqa: ARG001  run_workers passes them
    from tests.distributed import preloaded_here

    return preloaded_here()


def test_every_launch_forks_from_the_tests_forkserver_even_after_the_gpu_checks_context():
    """A process has one forkserver, and its preload is the one set when it starts. The GPU check's
    ``cases.context()`` sets a shorter one (torch and cerar); every launch of the tests sets the tests' own again
    before it starts the server (tests/distributed.py ``start_forkserver``), so a rank launched after the GPU
    check's context still finds transformers and train/ imported (otherwise each rank imports them again: about
    3 s of a core). Where a GPU check case starts the server itself: tests/test_gpu_check.py."""
    from scripts.checks.gpu import cases
    from tests.distributed import _PRELOAD, run_workers

    cases.context()
    (modules,) = run_workers(_preloaded, 1)
    assert modules == _PRELOAD, sorted(set(_PRELOAD) - set(modules))


@pytest.mark.quick
def test_collecting_the_test_modules_imports_neither_transformers_nor_dynamo(request):
    """Every pytest process collects the test modules (each of the suite's workers, each run of the mutation check):
    a module that imports transformers' GPTNeoX (train.model) or torch._dynamo at its top costs every collection
    seconds of a core (tests/conftest.py ``IMPORTED_LATE``). Meaningful where the whole folder is collected (the
    suite, the quick tier)."""
    assert request.config.imported_at_collection == [], request.config.imported_at_collection
