"""The cost model per chunk (cerar/planning/costmodel.py): a one-chunk call (d < 2^17 c) exposes every round's
addition and makes round 2's post wait for the rest of the encoding; on NVLink the transfers share
HBM with the arithmetic. Held to what the protocol's worker code dispatches between its posts
(counted by ``tests/test_costmodel.py``'s counter) and to a computation by hand."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

import cerar
import cerar.planning.costmodel as cm
from cerar.coding.matrices import device_matrices
from cerar.ddp import DDP_DEFAULT_BUCKET_CAP_MB, default_bucket_cap_mb
from cerar.ring.rounds import CodedRingRank, default_pipeline_chunks, pipeline_chunks
from tests.test_costmodel import ArithmeticCounter


@pytest.mark.parametrize("storage", cm.STORAGE_CHOICES)
@pytest.mark.parametrize("N, c", [(4, 16), (5, 3), (3, 7)])
def test_each_rounds_traffic_is_what_one_chunk_runs_between_its_posts(N, c, storage):
    """Per round, the traffic issued right after the post (beside the transfer) and after the arrival
    (before the next post), counted on the worker's own tensor operations, as ``all_reduce`` issues them."""
    m = 4096
    code = cerar.make_code(N, c, "exact") if c <= N else cerar.make_code(N, c, "perturbation", eps=0.3)
    flat = torch.randn(c * m, generator=torch.Generator().manual_seed(N + c))
    before = ArithmeticCounter(m)
    with before:
        rank = CodedRingRank(
            device_matrices(code, N - 1, torch.float32, torch.device("cpu")), flat, c, m, N, storage=storage
        )
    (worker,) = rank.workers
    in_flight, receive = [], []
    for t in range(1, code.L + 1):
        beside, after_arrival = ArithmeticCounter(m), ArithmeticCounter(m)
        with beside:
            worker.while_in_flight(t)
        received = worker.receive_buffer(t)
        received.copy_(worker.message(t))
        with after_arrival:
            worker.receive(t, received)
        in_flight.append(beside.moved // m)
        receive.append(after_arrival.moved // m)
    after = ArithmeticCounter(m)
    with after:
        rank.write_result(flat)
    model = cm.cerar_round_values(N, c, storage)
    assert model["before"] == before.moved // m and model["after"] == after.moved // m
    assert list(model["in_flight"]) == in_flight and list(model["receive"]) == receive
    assert in_flight[0] == 2 * c - 1  # what round 2's post waits for


@pytest.mark.quick
def test_a_one_chunk_call_priced_by_hand():
    """N = 4, c = 16, storage "messages", d = 16 x 4096 (m = 4096: one chunk), fp32. Before the first
    post x(1)'s encoding, 17 m values; after each of the 18 arrivals the round's one operation, 4 m in
    rounds 4..15 (y, u(t-3) and u(t+1) read, y written), 3 m in the other 6; after the last, the decoding,
    (c + L) m + c m = 50 m: 17 + 66 + 50 = 133 m in series with the transfers. Beside round 1's transfer
    the rest of the encoding, 31 m; beside the others nothing."""
    N, c, m = 4, 16, 4096
    d, mb = c * m, m * 4
    pcie = cm.LinkModel(10e-6, 25e9, 1.5e12, storage="messages")
    by_hand = 133 * mb / 1.5e12 + 18 * (10e-6 + mb / 25e9)  # every transfer longer than what runs beside it
    assert pcie.cerar_time_overlapped(d, N, c) == pytest.approx(by_hand, rel=1e-12)
    assert pcie.cerar_time_overlapped(d, N, c) > pcie.cerar_time_pipelined(d, N, c)  # the old best case
    # NVLink-like: no latency, 400 GB/s, the transfers' 2 m of HBM traffic beside the arithmetic: round 1
    # waits for the encoding (31 + 2 m), the other 17 for the link
    nvlink = cm.LinkModel(0.0, 400e9, 1.5e12, storage="messages", shares_memory=True)
    by_hand = 133 * mb / 1.5e12 + 33 * mb / 1.5e12 + 17 * mb / 400e9
    assert nvlink.cerar_time_overlapped(d, N, c) == pytest.approx(by_hand, rel=1e-12)


@pytest.mark.quick
def test_the_ring_on_a_link_that_shares_memory_moves_its_transfers_through_it():
    """N = 4, d = 4 x 2^20: 6 rounds of 2^20 values sent; the additions move 3 x 3 x 2^20 values.
    Sharing HBM adds the 2 x 6 x 2^20 values of the transfers to the memory side of the max."""
    d, values = 4 * 2**20, 2**20
    shared = cm.LinkModel(5e-6, 300e9, 1.5e12, shares_memory=True)
    memory = (9 * values + 12 * values) * 4 / 1.5e12
    assert shared.ring_time_overlapped(d, 4) == pytest.approx(6 * 5e-6 + max(6 * values * 4 / 300e9, memory))
    assert cm.SCENARIOS["nvlink"].shares_memory and not cm.SCENARIOS["pcie-node"].shares_memory


@pytest.mark.quick
def test_the_models_mirrors_of_torch_side_constants_agree():
    """The pure-numpy model copies the bucket sizes and the chunking rule: they must match the code's."""
    assert cm.DDP_FIRST_BUCKET_BYTES == dist._DEFAULT_FIRST_BUCKET_BYTES
    assert cm.DDP_DEFAULT_BUCKET_CAP_MB == DDP_DEFAULT_BUCKET_CAP_MB
    for N, c in ((4, 2), (4, 16), (8, 32), (64, 16)):
        assert cm.ddp_bucket_cap_mb(N, c) == default_bucket_cap_mb(N, c)
    for m in (1, 2**16, 2**17 - 1, 2**17, 2**20):
        assert cm.pipeline_chunk_count(m) == len(pipeline_chunks(m))
        assert cm.pipeline_chunk_count(m, cm.CUDA_PIPELINE_MAX_CHUNKS) == len(pipeline_chunks(m, 1))
    assert default_pipeline_chunks(torch.device("cuda")) == cm.CUDA_PIPELINE_MAX_CHUNKS
    assert default_pipeline_chunks(torch.device("cpu")) == cm.PIPELINE_MAX_CHUNKS
    assert cm.pipeline_chunk_count(cm.DDP_FIRST_BUCKET_BYTES // 4 // 4) == 1  # c = 4: DDP's first bucket, one chunk


@pytest.mark.quick
def test_an_eager_call_on_a_fast_link_is_bound_by_its_posts_so_cuda_sends_one_chunk():
    """Why ``CUDA_PIPELINE_MAX_CHUNKS`` is 1, priced: an H200-class node (NVLink 450 GB/s a direction, 4 TB/s of
    HBM copied, alpha 5 us). With a host that keeps ahead (a CUDA graph's replay) two chunks hide each round's
    product beside the other chunk's transfer, and win. An eager call's host posts each message (a
    ``batch_isend_irecv``, its ``wait()``, the round's launch): at 50 us a message, L x chunks x 50 us sets the
    time on NVLink, so twice the posts cost more than the exposed products, at 64 MiB and 256 MiB; on PCIe
    (25 GB/s) the link sets the time either way and one chunk loses at most 3 %."""
    nvlink = cm.LinkModel(5e-6, 450e9, 4.0e12, shares_memory=True)
    pcie = cm.LinkModel(10e-6, 25e9, 4.0e12)
    eager_nvlink = dataclasses.replace(nvlink, host_per_message=50e-6)
    eager_pcie = dataclasses.replace(pcie, host_per_message=50e-6)
    for N, c, mib in ((4, 16, 64), (8, 32, 256)):
        d = mib * 2**20 // 4
        assert nvlink.best_chunks(d, N, c) == 2  # replayed: the host costs nothing
        assert eager_nvlink.best_chunks(d, N, c) == cm.CUDA_PIPELINE_MAX_CHUNKS == 1
        L = c + N - 2
        assert eager_nvlink.cerar_time_chunks(d, N, c, 2) == pytest.approx(2 * L * 50e-6)  # the posts, by hand
        one, two = (eager_pcie.cerar_time_chunks(d, N, c, k) for k in (1, 2))
        assert one <= 1.03 * two
    # the host term bounds the time from below and changes nothing where the host keeps ahead
    d = 64 * 2**20 // 4
    assert eager_pcie.cerar_time_chunks(d, 4, 16, 1) == pcie.cerar_time_chunks(d, 4, 16, 1)
    assert nvlink.cerar_time_overlapped(d, 4, 16) == nvlink.cerar_time_chunks(d, 4, 16, cm.PIPELINE_MAX_CHUNKS)
