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
