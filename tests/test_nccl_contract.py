"""NCCL's point-to-point contract, emulated on gloo, and the trainer's NCCL watchdog setting.

The emulation (``tests.distributed``, ``contract="nccl"``) is what lets the protocol and hook tests
catch NCCL-only defects on a CPU machine, so it is held here to the contract it claims to keep:
one work for a batch, a wait that does not block the host, completion visible only through
``is_completed()``, and the first batch on a group involving all of its ranks.
"""

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.distributed import WorkerError, run_workers
from train.config import ConfigError
from train.distributed import NCCL_ERROR_HANDLING_VARIABLE, configure_nccl_watchdog


def _late_sender_worker(rank, N, delay_s):
    """After a first exchange (the group's first batch, which every rank joins), rank 0 posts its
    batch at once; rank 1 only after delay_s."""
    peer = 1 - rank
    first = dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, torch.ones(1), peer), dist.P2POp(dist.irecv, torch.ones(1), peer)]
    )
    for work in first:
        work.wait()
    while not all(work.is_completed() for work in first):
        time.sleep(0.01)
    if rank == 1:
        time.sleep(delay_s)
    send, recv = torch.full((4,), float(rank + 1)), torch.zeros(4)
    start = time.monotonic()
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)])
    for work in works:
        work.wait(timedelta(seconds=0.5 * delay_s) if rank == 0 else None)
    waited = time.monotonic() - start
    completed_after_wait = all(work.is_completed() for work in works)
    while not all(work.is_completed() for work in works):
        time.sleep(0.01)
    return len(works), waited, completed_after_wait, recv[0].item()


def test_under_nccls_contract_a_batch_is_one_work_whose_wait_does_not_block_the_host():
    delay_s = 3.0
    (works, waited, completed, received), _ = run_workers(_late_sender_worker, 2, args=(delay_s,), contract="nccl")
    assert works == 1  # one work for the send and the receive
    assert waited < 0.5 * delay_s and not completed  # wait returned before the peer had even posted
    assert received == 2.0  # the data arrives; is_completed() is how the host learns it


def test_under_gloos_contract_a_batch_is_one_work_per_op_and_wait_blocks_up_to_its_timeout():
    delay_s = 3.0
    with pytest.raises(WorkerError, match="(?i)timed out|timeout"):  # rank 0's wait(1.5 s) gives up on gloo
        run_workers(_late_sender_worker, 2, args=(delay_s,), contract="gloo")


def _first_batch_without_rank_2_worker(rank, N):
    import tests.distributed

    tests.distributed.FIRST_BATCH_TIMEOUT_S = 3.0
    if rank == 2:
        time.sleep(6)  # never takes part in the group's first batch
        return "absent"
    peer = 1 - rank
    works = dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, torch.ones(2), peer), dist.P2POp(dist.irecv, torch.zeros(2), peer)]
    )
    return len(works)


def test_under_nccls_contract_the_first_batch_on_a_group_must_involve_all_of_its_ranks():
    with pytest.raises(WorkerError, match=r"first batch_isend_irecv on group .* ranks \[2\] never joined"):
        run_workers(_first_batch_without_rank_2_worker, 3, contract="nccl")
    assert run_workers(_first_batch_without_rank_2_worker, 3, contract="gloo") == [2, 2, "absent"]  # gloo allows it


def test_the_trainer_turns_nccls_watchdog_abort_on_and_refuses_to_run_with_it_off():
    environ = {}
    assert configure_nccl_watchdog(environ) == "1" and environ[NCCL_ERROR_HANDLING_VARIABLE] == "1"
    assert configure_nccl_watchdog({NCCL_ERROR_HANDLING_VARIABLE: "3"}) == "3"  # another abort mode is kept
    with pytest.raises(ConfigError, match=f"{NCCL_ERROR_HANDLING_VARIABLE}=0"):
        configure_nccl_watchdog({NCCL_ERROR_HANDLING_VARIABLE: "0"})
