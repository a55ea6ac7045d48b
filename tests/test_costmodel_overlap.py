"""The overlapped cost model's exposed arithmetic is what one rank's rounds really do outside the
transfers: counted on the tensor operations the protocol's own worker code dispatches before its
first message can leave and after its last message has arrived (``tests/test_costmodel.py``'s counter)."""

import dataclasses

import pytest
import torch

import cerar
import cerar.planning.costmodel as cm
from cerar.coding.matrices import device_matrices
from cerar.ring.rounds import CodedRingRank, pipeline_chunks
from tests.test_costmodel import ArithmeticCounter


@pytest.mark.parametrize("storage", cm.STORAGE_CHOICES)
@pytest.mark.parametrize("N, c", [(2, 4), (3, 7), (4, 16), (5, 3), (8, 32)])
def test_the_exposed_arithmetic_is_what_runs_before_the_first_send_and_after_the_last_receive(N, c, storage):
    m = 4096  # one chunk, longer than any code matrix
    d = c * m
    assert len(pipeline_chunks(m)) == 1
    code = cerar.make_code(N, c, "exact") if c <= N else cerar.make_code(N, c, "perturbation", eps=0.3)
    flat = torch.randn(d, generator=torch.Generator().manual_seed(N * c))
    matrices = device_matrices(code, N - 1, torch.float32, torch.device("cpu"))
    before, hidden, after = ArithmeticCounter(m), ArithmeticCounter(m), ArithmeticCounter(m)
    with before:  # x(1) must exist before round 1's message can be posted
        rank = CodedRingRank(matrices, flat, c, m, N, storage=storage)
    (worker,) = rank.workers
    for t in range(1, code.L + 1):
        with hidden:  # beside round t's transfer (and, with two chunks, beside the other chunk's)
            worker.while_in_flight(t)
        received = worker.receive_buffer(t)
        received.copy_(worker.message(t))  # the transfer's stand-in: not arithmetic
        with after if t == code.L else hidden:
            worker.receive(t, received)
    with after:
        rank.write_result(flat)
    expected = cm.cerar_arithmetic(d, N, c, storage)["values_moved"]
    assert before.moved + hidden.moved + after.moved == expected  # the three windows cover the whole count
    assert before.moved + after.moved == cm.cerar_exposed_values(d, N, c, storage)


def test_overlap_never_costs_and_hides_at_most_the_shorter_side():
    """Overlapped time lies between max(link time, arithmetic time) and their sum, for both algorithms."""
    d = cm.PYTHIA_PARAMS["410m"]
    for key, link in cm.SCENARIOS.items():
        for storage in cm.STORAGE_CHOICES:
            lk = dataclasses.replace(link, storage=storage)
            for N, c in ((4, 16), (8, 32), (8, 8)):
                rounds, sent, moved = cm.features("cerar", d, N, c, 4, storage)
                comm, arith = lk.alpha * rounds + sent / lk.bandwidth, moved / lk.memory_bandwidth
                overlapped = lk.cerar_time_overlapped(d, N, c)
                assert max(comm, arith) <= overlapped * (1 + 1e-12) and overlapped <= lk.cerar_time(d, N, c), key
            rounds, sent, moved = cm.features("ring", d, 8, None, 4)
            comm, arith = lk.alpha * rounds + sent / lk.bandwidth, moved / lk.memory_bandwidth
            assert lk.ring_time_overlapped(d, 8) == pytest.approx(max(comm, arith))
