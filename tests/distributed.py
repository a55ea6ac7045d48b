"""Run a function on N real processes joined in a gloo process group (no mocks).

    results = run_workers(worker_fn, world_size=4, args=(...))

``worker_fn(rank, world_size, *args)`` must be defined at module level (processes are spawned).
Each worker's return value comes back in rank order; an exception in a worker is re-raised in the
test with the worker's traceback. Workers that are still alive when the test gives up are killed.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import os
import socket
import traceback
from datetime import timedelta

_CONTEXT = mp.get_context("spawn")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerError(RuntimeError):
    pass


def _entry(fn, rank, world_size, port, args, results, group_timeout_s):
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


def run_workers(fn, world_size: int, args=(), timeout_s: float = 120, group_timeout_s: float = 60, expect=None):
    """Run ``fn`` on ``world_size`` processes and return their results in rank order.

    ``expect``: the ranks whose results the test waits for (default all); the others may die or
    hang on purpose and are killed once the expected ones have reported.
    """
    expect = set(range(world_size)) if expect is None else set(expect)
    port = free_port()
    results = _CONTEXT.Queue()
    processes = [
        _CONTEXT.Process(target=_entry, args=(fn, rank, world_size, port, args, results, group_timeout_s), daemon=True)
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
