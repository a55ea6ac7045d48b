"""Run a function on N real processes joined in a gloo process group (no mocks).

    results = run_workers(worker_fn, world_size=4, args=(...))
    results = run_workers(worker_fn, world_size=4, contract="nccl")   # NCCL's contract, on gloo

``worker_fn(rank, world_size, *args)`` must be defined at module level (processes are spawned).
Each worker's return value comes back in rank order; an exception in a worker is re-raised in the
test with the worker's traceback. Workers that are still alive when the test gives up are killed.

``contract`` chooses what ``dist.batch_isend_irecv`` promises the code under test. The transport is
gloo's either way; only the contract around it changes:

- ``"gloo"``: gloo's own: one work per op, and ``Work.wait(timeout)`` blocks the host up to the timeout;
- ``"nccl"``: NCCL's, as ``torch/distributed/distributed_c10d.py`` and ``ProcessGroupNCCL`` keep it:
  ``batch_isend_irecv`` runs the batch in a coalescing manager and returns ONE work for the whole batch
  (``NcclContractWork``), completed off the calling thread as NCCL's stream would; its
  ``wait(timeout)`` returns at once and bounds nothing on the host (NCCL without blocking wait only
  makes the current stream wait); ``is_completed()`` tells when the data is there. The first batch
  on each group must involve every rank of the group (NCCL's
  first-call rule, held here to every group's first batch whatever came before): a rank whose peers
  do not all join within ``FIRST_BATCH_TIMEOUT_S`` raises.

In both contracts ``transport_log()`` records, per process, what was handed to ``batch_isend_irecv``:
bytes of the tensors given to isend and to irecv, and the groups used, for tests that compare a
count with a measurement.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import os
import socket
import threading
import traceback
from datetime import timedelta

_CONTEXT = mp.get_context("spawn")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerError(RuntimeError):
    pass


CONTRACTS = ("gloo", "nccl")
FIRST_BATCH_TIMEOUT_S = 30.0

_log = {"bytes_isend": 0, "bytes_irecv": 0, "batches": 0, "groups": set()}


def transport_log() -> dict:
    """What this process handed to ``batch_isend_irecv`` so far (see the module docstring)."""
    return {**_log, "groups": set(_log["groups"])}


class NcclContractWork:
    """One work for a whole batch, kept as NCCL keeps it. The batch's gloo works are driven to
    completion off the calling thread (NCCL's own stream), up to the group's timeout (NCCL's
    watchdog); ``is_completed()`` says whether they are done; ``wait(timeout)`` returns at once
    whatever the timeout (NCCL without blocking wait only makes the current stream wait), raising
    the batch's error if it already failed. On the CPU there is no stream to order: code may read
    the received data only once it has seen ``is_completed()``, the host-side discipline that
    NCCL's deadline needs too."""

    def __init__(self, works):
        self.works = list(works)
        self.error: BaseException | None = None
        self.done = threading.Event()
        threading.Thread(target=self._run, name="nccl-contract-stream", daemon=True).start()

    def _run(self) -> None:
        try:
            for work in self.works:
                work.wait()
        except BaseException as error:  # reported by wait(), as NCCL reports a failed work
            self.error = error
        finally:
            self.done.set()

    def is_completed(self) -> bool:
        return self.done.is_set()

    def wait(self, timeout=None) -> bool:  # noqa: ARG002  the timeout bounds nothing on the host under NCCL
        if self.error is not None:
            raise RuntimeError(f"NCCL contract: the batch failed: {self.error}") from self.error
        return True


def _install_contract(contract: str) -> None:
    """Wrap ``dist.batch_isend_irecv`` for this process: log what is handed to it and, under
    ``"nccl"``, return one NcclContractWork for the batch after the first-batch check."""
    import torch.distributed as dist

    original = dist.batch_isend_irecv
    first_batch_seen: set[str] = set()

    def check_first_batch(group) -> None:
        name = group.group_name
        if name in first_batch_seen:
            return
        first_batch_seen.add(name)
        store = dist.distributed_c10d._get_default_store()
        me, members = dist.get_rank(), dist.get_process_group_ranks(group)
        store.set(f"nccl-contract/first-batch/{name}/{me}", "joined")
        keys = [f"nccl-contract/first-batch/{name}/{r}" for r in members]
        try:
            store.wait(keys, timedelta(seconds=FIRST_BATCH_TIMEOUT_S))
        except Exception as error:
            absent = [r for r, key in zip(members, keys, strict=True) if not store.check([key])]
            raise RuntimeError(
                f"NCCL contract: the first batch_isend_irecv on group {name!r} must involve all of its ranks "
                f"{members}; ranks {absent} never joined ({error})"
            ) from error

    def batch_isend_irecv(p2p_op_list):
        group = p2p_op_list[0].group or dist.distributed_c10d._get_default_group()
        for op in p2p_op_list:
            key = "bytes_isend" if op.op is dist.isend else "bytes_irecv"
            _log[key] += op.tensor.numel() * op.tensor.element_size()
        _log["batches"] += 1
        _log["groups"].add(group.group_name)
        if contract == "nccl":
            check_first_batch(group)
            return [NcclContractWork(original(p2p_op_list))]
        return original(p2p_op_list)

    dist.batch_isend_irecv = batch_isend_irecv


def _entry(fn, rank, world_size, port, args, results, group_timeout_s, contract):
    import torch
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=group_timeout_s),
        )
        _install_contract(contract)
        value = fn(rank, world_size, *args)
        buffer = io.BytesIO()  # plain bytes: tensors must not travel as shared memory of a dying process
        torch.save(value, buffer)
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # report everything, including CollectiveError, to the test
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def run_workers(
    fn,
    world_size: int,
    args=(),
    timeout_s: float = 120,
    group_timeout_s: float = 60,
    expect=None,
    contract: str = "gloo",
):
    """Run ``fn`` on ``world_size`` processes and return their results in rank order.

    ``contract``: ``"gloo"`` or ``"nccl"``, what ``batch_isend_irecv`` promises (module docstring).

    ``expect``: the ranks whose results the test waits for (default all); the others may die or
    hang on purpose and are killed once the expected ones have reported.
    """
    if contract not in CONTRACTS:
        raise ValueError(f"contract must be one of {CONTRACTS}, got {contract!r}")
    expect = set(range(world_size)) if expect is None else set(expect)
    port = free_port()
    results = _CONTEXT.Queue()
    processes = [
        _CONTEXT.Process(
            target=_entry, args=(fn, rank, world_size, port, args, results, group_timeout_s, contract), daemon=True
        )
        for rank in range(world_size)
    ]
    for p in processes:
        p.start()
    collected: dict[int, tuple[str, object]] = {}
    try:
        import queue

        while not expect.issubset(collected):
            try:
                rank, status, value = results.get(timeout=timeout_s)
            except queue.Empty:
                missing = sorted(expect - set(collected))
                raise TimeoutError(f"ranks {missing} did not report within {timeout_s}s") from None
            collected[rank] = (status, value)
    finally:
        for p in processes:
            p.join(timeout=5 if expect == set(range(world_size)) else 0.1)
        for p in processes:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    errors = {r: v for r, (s, v) in collected.items() if s == "error"}
    if errors:
        raise WorkerError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
    import torch

    return [
        torch.load(io.BytesIO(collected[r][1]), weights_only=False) if r in collected else None
        for r in range(world_size)
    ]
