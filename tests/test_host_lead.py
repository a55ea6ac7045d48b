"""The README's "keeps the host at most 16 rounds ahead of the GPU", measured under NCCL's contract.

Under the stream-ordered contract (NCCL; emulated on gloo by ``tests.nccl_emulation``, whose
``EmulatedStream`` is the device queue) cerar's host enqueues rounds without waiting for them, and
bounds how far it runs ahead by polling one round every ``LOOK_BEHIND_POSTS`` (8) posts: at every
8th post it waits until the round posted 8 posts before has completed, so at most 2 x 8 = 16 posted
rounds have not yet started on the device. Counted here in the workers: the posts handed to the device
queue that it has not yet run (the host's lead, in rounds), and the queue's own ``max_backlog`` (every
submitted task not yet run, at most 17 rounds' tasks), against the bound, on a call of 32 rounds, twice
the bound, so that a host that never waited (measured: 32 rounds, about 128 tasks) exceeds it. The
code (N = 4, c = 30: L = 32 rounds of a short block) is chosen for its rounds, not its numbers.
"""

from __future__ import annotations

import threading

import torch

import cerar
from cerar.ring.rounds import pipeline_chunks
from cerar.ring.transport import LOOK_BEHIND_POSTS
from tests.distributed import run_workers

HOST_LEAD_ROUNDS = 16  # the README's figure


def _host_lead_worker(rank, N, c, d):
    from cerar.ring import transport

    queue = transport.transport_contract().device_queue  # the emulated CUDA stream
    lock, count = threading.Lock(), {"ahead": 0, "most_ahead": 0, "posts": 0, "tasks": 0}
    submit = queue.submit

    def counting_submit(fn, *args):
        with lock:
            count["tasks"] += 1
        if getattr(fn, "__name__", "") != "_post":
            return submit(fn, *args)

        def started(*a):
            with lock:
                count["ahead"] -= 1
            return fn(*a)

        with lock:
            count["posts"] += 1
            count["ahead"] += 1
            count["most_ahead"] = max(count["most_ahead"], count["ahead"])
        return submit(started, *args)

    queue.submit = counting_submit
    code = cerar.make_code(N, c, "perturbation", eps=0.5)
    tensor = torch.randn(d, generator=torch.Generator().manual_seed(rank))
    cerar.all_reduce(tensor, code, timeout=60)
    return dict(count), queue.max_backlog


def test_the_host_stays_at_most_16_rounds_ahead_of_the_device_under_nccls_contract():
    N, c = 4, 30
    d = c * 1000 + 5
    code = cerar.make_code(N, c, "perturbation", eps=0.5)
    posts = code.L * len(pipeline_chunks(code.m_for(d)))
    assert HOST_LEAD_ROUNDS == 2 * LOOK_BEHIND_POSTS and posts == 32 >= 2 * HOST_LEAD_ROUNDS
    results = run_workers(_host_lead_worker, N, args=(c, d), contract="nccl", timeout_s=300)
    for rank, (count, max_backlog) in enumerate(results):
        assert count["posts"] == posts, (rank, count)
        assert 1 <= count["most_ahead"] <= HOST_LEAD_ROUNDS, (rank, count)
        tasks_per_post = -(-count["tasks"] // count["posts"])
        assert max_backlog <= (HOST_LEAD_ROUNDS + 1) * tasks_per_post, (rank, count, max_backlog)
