"""CERAR keeps its working storage between calls on CPU, so a call does not fault fresh pages in.

A call needs about (1 + (N+1)/c) d values of working storage; freshly mapped, that costs the
kernel's page faults and zeroing on every call. The story: a second call of the same size faults
(almost) no pages in, stale values left in the kept storage never reach a result, concurrent calls
never share a buffer, and the storage can be given back."""

import resource

import pytest
import torch

import cerar
from cerar.ring.precision import rounding_bound
from cerar.ring.workspace import WorkspacePool
from tests.distributed import run_workers

PAGE = resource.getpagesize()


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _reuse_worker(rank, N, c, d):
    from cerar.ring.workspace import POOL

    code = cerar.make_code(N, c, "optimized")
    G = torch.randn(N, d, generator=torch.Generator().manual_seed(3))
    POOL.give(torch.full((4 * d,), float("nan")))  # stale values, as an earlier call might leave them
    first = G[rank].clone()
    cerar.all_reduce(first, code)
    second = G[rank].clone()
    faults = _minor_faults()
    stats = cerar.all_reduce(second, code)
    faults = _minor_faults() - faults
    shorter = G[rank, : d // 3].clone()
    cerar.all_reduce(shorter, code)
    released = cerar.release_workspaces()
    third = G[rank].clone()
    fresh_faults = _minor_faults()
    cerar.all_reduce(third, code)  # after the release: the storage is mapped afresh
    fresh_faults = _minor_faults() - fresh_faults
    cerar.release_workspaces()
    return first, second, shorter, faults, fresh_faults, stats.peak_extra_bytes, released


def test_a_repeated_call_reuses_its_working_storage_and_never_reads_stale_values():
    N, c, d = 4, 16, 2**21  # 8 MiB per rank: m = 2^17, the chunked path every real gradient takes
    G = torch.randn(N, d, generator=torch.Generator().manual_seed(3))
    code = cerar.make_code(N, c, "optimized")
    oracle, oracle_short = cerar.simulate(G, code), cerar.simulate(G[:, : d // 3].contiguous(), code)
    for rank, result in enumerate(run_workers(_reuse_worker, N, args=(c, d), timeout_s=300)):
        first, second, shorter, faults, fresh_faults, working, released = result
        for got, want in ((first, oracle[rank]), (second, oracle[rank]), (shorter, oracle_short[rank])):
            assert torch.isfinite(got).all()  # no NaN from the poisoned storage
            # two float32 computations of the same code: each within its rounding bound of the exact arithmetic
            bound = 2 * rounding_bound(code, torch.float32) * float(G[:, : got.numel()].double().norm())
            assert float((got.double() - want.double()).norm()) <= bound
        working_pages = working // PAGE
        assert working_pages > 2000  # about 11 MB: (c + N + 1) m float32 values
        assert fresh_faults > working_pages // 2  # mapped afresh: a fault per page, measured
        assert faults < working_pages // 20  # kept: (almost) none
        assert released >= working  # the kept storage is what release_workspaces() frees


@pytest.mark.quick
def test_the_pool_hands_each_caller_its_own_buffer_and_keeps_the_largest():
    pool = WorkspacePool(keep=2)
    a, b = pool.take(100, torch.float32, "cpu"), pool.take(100, torch.float32, "cpu")
    assert a.data_ptr() != b.data_ptr()  # two calls in flight never share storage
    pool.give(a)
    pool.give(b)
    pool.give(torch.empty(10))
    assert pool.held_bytes() == 2 * 100 * 4  # the two largest are kept
    assert pool.take(50, torch.float32, "cpu").data_ptr() in (a.data_ptr(), b.data_ptr())  # reused
    assert pool.take(1000, torch.float32, "cpu").numel() == 1000  # none fits: a new one
    assert pool.take(50, torch.float64, "cpu").dtype == torch.float64  # kinds never mix
    meta = pool.take(10, torch.float32, "meta")
    pool.give(meta)  # not pooled: off the CPU the caching allocator keeps memory already
    assert pool.take(10, torch.float32, "meta") is not meta
