"""CERAR's rounds in a few kernels, pinned on the CPU: the operations one rank dispatches, per round and per call,
counted by a TorchDispatchMode and held to counts derived here from the algorithm.

Every aten operation the protocol runs passes through torch's dispatcher whatever the tensor's device, so a
TorchDispatchMode sees on a CPU the operations a GPU launches a kernel for (a product, an addition, a copy, a
fill: one each); views and allocations launch none and are not counted. The transport's operations show up too
(``c10d.send``, ``c10d.recv_``), and a 16-bit wire's casts.

What one rank must do, per column chunk of its gradient (the spec's "protocol at worker i", decoded in W_i's form,
``cerar.ring.rounds``; R message rows, R = N with ``storage="spec"``, L with ``"messages"``):

- before round 1 is posted, x(1) = u(1) = A_i[0] G: one product;
- beside round 1's transfer, the rest of U_i = A_i G: one product (none when c = 1);
- after round t's message y(t) arrives, x(t+1) = y(t) + u(t+1) - u(t-N+1) in y's buffer: ONE operation where a
  row of U_i exists (a product [-1, 1] [u(t-N+1); u(t+1)] in rounds N..c-1, an addition or a subtraction in the
  others), none in rounds c..N-1;
- beside the round after a batch of messages is complete, one decoding product (a batch is R - 1 messages, or
  all L when R >= L), and after the last round one for each batch left;
- where c does not divide d: each product once more in the chunks that hold the partial last row's values, and
  that row zeroed and copied in before the rounds, and copied out after them.

Before this was pinned, the rounds N..c-1 formed the injection u(t+1) - u(t-N+1) in flight, a second operation
per round and chunk: N=4, c=16 made 38 operations per chunk where 26 do, and a GPU ran two chunks (113 kernels per
call with the stand-in's copies, 0.81 of 2.75 ms busy on an H200).
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import cerar
from cerar.coding.matrices import device_matrices
from cerar.planning import costmodel as cm
from cerar.ring.rounds import CodedRingRank, pipeline_chunks
from tests.distributed import run_workers

ALLOCATIONS = {"empty", "new_empty", "empty_like", "empty_strided", "new_empty_strided"}
HOST_READS = {"_local_scalar_dense"}  # .item(): the host waits for the device; counted apart


class OperationCounter(TorchDispatchMode):
    """The dispatched operations that run on the device, by name (not views, allocations or host reads), and
    the host reads (``.item()``) apart."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.host_reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in HOST_READS:
            self.host_reads += 1
        elif not func.is_view and name not in ALLOCATIONS:
            self.ops[f"{func.namespace}.{name}"] += 1
        return out

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    def arithmetic(self) -> int:
        """The operations that are not the transport's."""
        return sum(n for name, n in self.ops.items() if not name.startswith("c10d."))


# --- the algorithm's counts, derived from the spec's rounds ---------------------------------------------------


def message_rows(N: int, c: int, storage: str) -> int:
    L = c + N - 2
    return max(L if storage == "messages" else N, 2)


def batch_size(N: int, c: int, storage: str) -> int:
    """Messages per decoding product: all L when every message keeps its row, else R - 1 (row R receives)."""
    L, R = c + N - 2, message_rows(N, c, storage)
    return R if R >= L else R - 1


def decoding_rounds(N: int, c: int, storage: str) -> list[int]:
    """The rounds beside which a complete batch is decoded: 1 + k x batch, before round L."""
    L, batch = c + N - 2, batch_size(N, c, storage)
    return [1 + k * batch for k in range(1, L) if 1 + k * batch < L]


def round_operations(N: int, c: int, t: int) -> int:
    """What x(t+1) = y(t) + u(t+1) - u(t-N+1) takes: one operation if u(t+1) or u(t-N+1) is a row of U_i."""
    return int(t + 1 <= c or t - N + 1 >= 1)


def expected_per_call(N: int, c: int, d: int, storage: str, chunks: int) -> int:
    """One rank's operations for one call (the rounds' transport excluded)."""
    m, L = -(-d // c), c + N - 2
    whole = min(c, d // m)
    rest = d - whole * m  # values of the partial row
    products = (2 if c > 1 else 1) + -(-L // batch_size(N, c, storage))  # encoding, then one per batch
    rounds = sum(round_operations(N, c, t) for t in range(1, L + 1))
    total = 0
    for a, _ in pipeline_chunks(m, chunks):
        total += products * (2 if rest > a else 1) + rounds
    return total + (whole < c) + 2 * (rest > 0)  # the tail zeroed; the partial row copied in and out


@pytest.mark.quick
def test_the_counts_the_issue_states():
    """N=4, c=16, one chunk (CUDA's): 2 encoding products, 18 rounds' one operation, 6 decoding products ("spec")
    or 1 ("messages"); N=8, c=32: 38 rounds. Before: 12 (N=4) and 24 (N=8) more, the injections."""
    assert expected_per_call(4, 16, 16 * 2**20, "spec", 1) == 2 + 18 + 6 == 26
    assert expected_per_call(4, 16, 16 * 2**20, "messages", 1) == 21
    assert expected_per_call(8, 32, 64 * 2**20, "spec", 1) == 2 + 38 + 6 == 46
    assert cm.cerar_operations(4, 16, "spec")["total"] == 26
    assert cm.cerar_operations(8, 32, "messages", chunks=2)["total"] == 2 * 41


# --- one rank's worker code, counted round by round ---------------------------------------------------------


def one_rank(N: int, c: int, d: int, storage: str, chunks: int | None = None, seed: int = 0):
    """One rank's CodedRingRank (worker N-1's matrices) on a seeded gradient, and its code."""
    code = cerar.make_code(N, c, "exact") if c <= N else cerar.make_code(N, c, "perturbation", eps=0.3)
    flat = torch.randn(d, generator=torch.Generator().manual_seed(seed))
    matrices = device_matrices(code, N - 1, torch.float32, torch.device("cpu"))
    return code, flat, lambda: CodedRingRank(matrices, flat, c, code.m_for(d), N, storage=storage, chunks=chunks)


CASES = [(4, 16), (8, 32), (5, 3), (3, 7), (2, 4), (4, 1)]


@pytest.mark.quick
@pytest.mark.parametrize("storage", ["spec", "messages"])
@pytest.mark.parametrize("N, c", CASES)
def test_each_round_is_one_operation_per_chunk(N, c, storage):
    """Round by round, what the worker issues beside the transfer (``while_in_flight``) and after the message
    arrives (``receive``), against the algorithm: nothing per round in flight but the encoding's second product
    in round 1 and a batch's decoding product, and one operation on arrival."""
    m = 4096  # one chunk
    code, _, build = one_rank(N, c, c * m, storage)
    rank = build()
    (worker,) = rank.workers
    decoded_beside = decoding_rounds(N, c, storage)
    for t in range(1, code.L + 1):
        beside, arrival = OperationCounter(), OperationCounter()
        with beside:
            worker.while_in_flight(t)
        y = worker.receive_buffer(t)
        y.copy_(worker.message(t))  # the transfer's stand-in, not counted
        with arrival:
            worker.receive(t, y)
        expected_beside = int(t == 1 and c > 1) + int(t in decoded_beside)
        assert beside.total == expected_beside, (t, dict(beside.ops))
        assert arrival.total == round_operations(N, c, t), (t, dict(arrival.ops))
        if N <= t <= c - 1:  # both rows: the injection rides on the one product
            assert arrival.ops == {"aten.addmm_": 1}, (t, dict(arrival.ops))
        assert beside.host_reads == arrival.host_reads == 0


@pytest.mark.quick
@pytest.mark.parametrize("storage", ["spec", "messages"])
@pytest.mark.parametrize(
    "N, c, d, chunks",
    [
        (4, 16, 16 * 4096, 1),  # one chunk, c divides d
        (4, 16, 16 * 2 * 2**16, 2),  # two chunks
        (3, 7, 7 * 2 * 2**16 + 5, 2),  # two chunks, the partial row in the first
        (3, 7, 7 * 2 * 2**16 - 3, 2),  # two chunks, the partial row reaching into the second
        (5, 3, 3 * 4096 - 1, 1),  # c < N: rounds c..N-1 have no row
        (4, 1, 777, 1),  # c = 1: x(1) is all of U_i
        (4, 16, 37, 1),  # d < c... m = 3, rows past the end
    ],
)
def test_one_call_dispatches_what_the_algorithm_needs_and_no_more(N, c, d, chunks, storage):
    """A whole call of one rank (the transfers replaced by copies into the receive buffers, counted apart):
    the encoding, one operation per round and chunk, the decoding products, the partial row's copies."""
    code, flat, build = one_rank(N, c, d, storage, chunks)
    counter = OperationCounter()
    with counter:
        rank = build()
        for t in range(1, code.L + 1):
            for worker in rank.workers:
                worker.while_in_flight(t)
                y = worker.receive_buffer(t)
                y.copy_(worker.message(t))  # the transfer's stand-in: one copy each
                worker.receive(t, y)
        rank.write_result(flat)
    transfers = code.L * len(rank.workers)
    assert counter.total == expected_per_call(N, c, d, storage, chunks) + transfers, dict(counter.ops)
    assert counter.host_reads == 0


# --- the distributed call: the arithmetic, one post per round and chunk, and a 16-bit wire's casts ---------------


def _counted_call_worker(rank, N, c, d):
    from cerar.formats.wire import Wire

    code = cerar.make_code(N, c, "perturbation", eps=0.9)  # admissible on float16
    tensor = torch.randn(d, generator=torch.Generator().manual_seed(rank))
    cerar.all_reduce(tensor, code)  # the agreement check, once per group and length
    cerar.all_reduce(tensor, code, transport="float16")
    counted = {}
    for transport in ("float32", "float16"):
        with OperationCounter() as counter:
            cerar.all_reduce(tensor, code, transport=transport)
        counted[transport] = (dict(counter.ops), counter.arithmetic(), counter.host_reads)
    wire, block = Wire("float16"), torch.randn(code.m_for(d))
    with OperationCounter() as per_message:  # one message's encoding and decoding, on their own
        message = wire.empty(block.numel(), block)
        wire.encode(block, message)
        wire.decode(message, torch.empty_like(block))
    return counted, (per_message.arithmetic(), per_message.host_reads)


def test_a_distributed_call_adds_one_send_and_one_receive_per_round_and_a_16_bit_wire_its_casts():
    """cerar.all_reduce between 3 processes (gloo): the arithmetic is the worker's count (nothing per round
    beside it), the transport one send and one receive per round and chunk, and float16 messages add exactly
    one encoding and one decoding per message (the wire's own operations, counted on one message) and
    nothing else per round."""
    N, c, d = 3, 5, 5 * 4096 + 2  # one chunk, a partial row
    for counted, (per_message, per_message_reads) in run_workers(_counted_call_worker, N, args=(c, d)):
        ops32, arithmetic32, reads32 = counted["float32"]
        ops16, arithmetic16, reads16 = counted["float16"]
        L = c + N - 2
        assert arithmetic32 == expected_per_call(N, c, d, "spec", 1), ops32
        assert ops32["c10d.send"] == ops32["c10d.recv_"] == L and reads32 == 0
        assert ops16["c10d.send"] == ops16["c10d.recv_"] == L
        assert arithmetic16 - arithmetic32 == L * per_message, (ops16, per_message)
        assert reads16 == L * per_message_reads  # on a CPU the wire reads each scale on the host
