"""Section "NCCL self-loop": what one GPU can prove about NCCL. A one-rank NCCL group can send to
itself: ``dist.isend`` allows dst == this rank, and a batch of a send to self and a receive from
self is matched inside one ``ncclGroupStart/End`` (NCCL copies it locally). Each case runs in a
process of its own (an abort or a SIGABRT stays there), on cuda:0, with the trainer's watchdog
setting (``train.distributed.configure_nccl_watchdog``: TORCH_NCCL_ASYNC_ERROR_HANDLING=3, torch's default).

Read against torch's ProcessGroupNCCL.cpp (``WorkNCCL::wait``, ``WorkNCCL::synchronizeStream``,
``WorkNCCL::handleException``, ``HeartbeatMonitor``) and distributed_c10d.py (``batch_isend_irecv``):

- one work: ``batch_isend_irecv`` on NCCL runs the batch inside ``_coalescing_manager`` and returns
  ``cm.works``: one work for the batch; the received values equal the sent ones;
- wait returns: ``WorkNCCL::wait()`` without a timeout only calls ``synchronize()`` (the current
  stream waits for the NCCL stream's end event) and returns; with the work queued behind a long
  kernel (``torch.cuda._sleep``), the host is back at once, the work still incomplete, and the
  values arrive once the kernel is done (the send reads what the stream wrote before it);
- wait(timeout): blocks the host, polling ``isCompleted()`` until ``checkTimeout`` (the work's age
  past the timeout), then ``abort()`` (the communicator) and ``handleException(TearDown)``, which
  rethrows on the calling thread: the call raises no sooner than the timeout (later if the abort waits
  for the kernel the work is held behind: a ``torch.cuda._sleep`` kernel cannot be aborted, an NCCL
  kernel can; the report says which) and the group is aborted: the next batch fails at once;
- rounds: CERAR's rounds over N logical workers (worker i's message is a self-send into worker
  i+1's receive buffer), through the protocol's own ``_Ring``, ``_Rounds`` and ``CodedRingRank``
  under the stream-ordered contract, held to the spec's protocol in float64
  (``tests/spec_reference.py``) within ``cerar.ring.precision.rounding_bound``; the host's polls counted
  (one per ``LOOK_BEHIND_POSTS`` posts after the first window, and one at the end) and its lead on
  the stream measured, with the GPU held behind a long kernel: it must be exactly ``lead_bound`` (2 x
  ``LOOK_BEHIND_POSTS``). A first, unjudged call warms what would hold the host outside the protocol (NCCL's
  connect at the first post, CUDA's lazy loading of the rounds' kernels; ``rounds`` says how each was seen);
- deadline: a round that never completes (queued behind a kernel that outlives every deadline;
  NCCL refuses a self-receive without its matching self-send in the same group: "Trying to recv
  to self without a matching send", ncclInvalidUsage, in its enqueue.cc; so a one-rank group has
  no peer that can fail to send), bounded by the protocol's deadline: CollectiveError,
  then the trainer's exit path ``train.distributed.exit_after_collective_failure``: exit status 3,
  one line; the abort's duration recorded;
- watchdog: the same round with no deadline of ours: torch's watchdog finds the work past the
  group's timeout (``WorkNCCL::checkTimeout`` sets the work's exception), signals its debug dump, sleeps 4 x
  ``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC`` (``Watchdog::runLoop``: ``sleep_for(heartbeatMonitor_->getDumpTimeout() *
  4)``) and, under mode 3, tears the process down from its own thread without aborting first (``SHOULD_CLEAN_UP``
  is false, ``handleException`` rethrows: SIGABRT, 134 in a shell). The round is held behind a kernel that ends
  a few seconds after the group's timeout (``WATCHDOG_HELD_S``), much sooner than the host's sleep
  (``HOST_SLEEP_S``): the work is late when the watchdog looks, and the SIGABRT (group timeout + 4 x the dump
  wait) cannot race the host's own return.

What one GPU cannot prove: anything between two GPUs (a peer that dies, NVLink or network
transfers, two ranks' deadlines racing). Expected time on one H200: about 2.5 minutes (six
processes of about 10 s start-up each; the watchdog case about 20 s)."""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch

from scripts.checks.gpu.cases import FAIL, PASS, Case, Context, Needs

SECTION = "NCCL self-loop"
QUICK = True
EXPECTED_S = 150
NEEDS = Needs(cuda=True, ranks=1)
TIMEOUT_S = 3.0  # the deadline of the deadline case
SLACK_S = 3.0  # beyond a timeout: the poll's pause, the post and building the message
GROUP_TIMEOUT_S = 5.0  # the watchdog case's group timeout
DUMP_WAIT_MS = 1_000  # TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC in the watchdog case (trunk's default: 15 s), slept 4 x
SLEEP_S = 2.0  # the kernel the work queues behind
HELD_S = 10 * SLEEP_S  # wait(timeout)'s: far past its timeout, so a wait that only returns when the work is done shows
WATCHDOG_WORDS = ("Watchdog caught collective operation timeout", "failure detected by watchdog")
FOREVER_S = 60.0  # a kernel that outlives every deadline here (and the watchdog's timeout and dump wait)
WATCHDOG_HELD_S = GROUP_TIMEOUT_S + 3.0  # the watchdog case's kernel: late at the group's timeout, then done
HOST_SLEEP_S = 120.0  # the watchdog case's host: far past the kernel and the SIGABRT (timeout + 4 x the dump wait)
HOLD_S = 1.0  # the rounds case's kernel the GPU is held behind while the host posts: far longer than posting takes
PROVES = {
    "one work": "a batch of a self-send and a self-receive on NCCL is one work, and moves the values",
    "wait returns": "Work.wait() without a timeout returns on the host while the work waits behind a long kernel, "
    "and orders the stream (the values arrive after it)",
    "wait(timeout) aborts": "Work.wait(timeout) blocks the host at least until the timeout, raises, and leaves "
    "the group aborted (the next batch fails at once)",
    "rounds": "CERAR's rounds over N logical workers on the self-loop through _Ring/_Rounds/CodedRingRank, held to "
    "the spec's protocol within the rounding bound; the host's polls and lead on the stream as the contract says",
    "deadline": "a round that never completes ends the process through the trainer's exit path: exit 3, one line",
    "watchdog": "left alone, the same round ends in torch's watchdog: SIGABRT after the group timeout and 4 x "
    "the dump wait",
}


def cases(ctx: Context) -> list[Case]:  # noqa: ARG001
    d = 2**20 + 3  # two pipeline chunks at c = 8 (m >= 2 x cerar.ring.rounds.PIPELINE_MIN_CHUNK)
    dump = {"TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": str(DUMP_WAIT_MS)}
    return [
        Case(SECTION, "one work", "selfloop:one_work", {}, 60, NEEDS),
        Case(SECTION, "wait returns", "selfloop:wait_returns", {}, 60, NEEDS),
        Case(
            SECTION,
            "wait(timeout) aborts",
            "selfloop:wait_timeout",
            {},
            60,
            NEEDS,
            expect_exit=None,
            judge="selfloop:judge_wait_timeout",
        ),
        Case(SECTION, "rounds", "selfloop:rounds", {"N": 4, "c": 8, "d": d}, 120, NEEDS),
        Case(
            SECTION, "deadline", "selfloop:deadline", {}, 90, NEEDS, expect_exit=None, judge="selfloop:judge_deadline"
        ),
        Case(
            SECTION,
            "watchdog",
            "selfloop:watchdog",
            {},
            GROUP_TIMEOUT_S + 4 * DUMP_WAIT_MS / 1000 + HOST_SLEEP_S + 30,
            NEEDS,
            expect_exit=None,
            judge="selfloop:judge_watchdog",
            env=dump,
        ),
    ]


def one_rank_group(timeout_s: float = 60.0) -> torch.device:
    """A one-rank NCCL group on cuda:0, made as the trainer makes its groups (watchdog on)."""
    import torch.distributed as dist

    from train.distributed import configure_nccl_watchdog

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    os.environ.pop("TORCH_NCCL_BLOCKING_WAIT", None)  # would make every wait() block the host
    configure_nccl_watchdog()
    dist.init_process_group(
        "nccl", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=timeout_s), device_id=device
    )
    return device


def cycles_per_second() -> float:
    """``torch.cuda._sleep`` cycles per second on this GPU, measured with CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)  # loaded
    start.record()
    torch.cuda._sleep(50_000_000)
    end.record()
    end.synchronize()
    return 50_000_000 / (start.elapsed_time(end) / 1000)


def sleep(seconds: float, rate: float) -> None:
    """A kernel on the current stream that runs ``seconds``."""
    torch.cuda._sleep(int(seconds * rate))


def self_batch(send: torch.Tensor, recv: torch.Tensor) -> list:
    import torch.distributed as dist

    return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, 0), dist.P2POp(dist.irecv, recv, 0)])


def one_work(out: str) -> dict:  # noqa: ARG001
    device = one_rank_group()
    x = torch.arange(1, 1 + 2**20, dtype=torch.float32, device=device)
    y = torch.zeros_like(x)
    works = self_batch(x, y)
    for work in works:
        work.wait()
    moved = bool(torch.equal(x, y))  # the current stream waits for the work before the comparison
    ok = len(works) == 1 and moved
    return {"status": PASS if ok else FAIL, "works": len(works), "moved": moved,
            "reason": "" if ok else f"{len(works)} works, values moved: {moved}"}  # fmt: skip


def wait_returns(out: str) -> dict:  # noqa: ARG001
    device = one_rank_group()
    rate = cycles_per_second()
    x = torch.zeros(2**20, device=device)
    y = torch.zeros_like(x)
    self_batch(x, y)[0].wait()  # connected
    torch.cuda.synchronize()
    sleep(SLEEP_S, rate)
    x.fill_(7.0)  # after the kernel, on the stream: the send must read it
    works = self_batch(x, y)
    start = time.monotonic()
    works[0].wait()
    host_wait = time.monotonic() - start
    pending = not works[0].is_completed()
    torch.cuda.synchronize()
    total = time.monotonic() - start
    arrived = bool((y == 7.0).all())
    ok = len(works) == 1 and host_wait < SLEEP_S / 4 and pending and arrived
    return {
        "status": PASS if ok else FAIL,
        "host_wait_s": host_wait,
        "incomplete_after_wait": pending,
        "until_done_s": total,
        "kernel_s": SLEEP_S,
        "arrived": arrived,
        "reason": "" if ok else f"wait {host_wait:.3f} s, incomplete after it: {pending}, values arrived: {arrived}",
    }


def wait_timeout(out: str) -> dict:
    """``wait(timeout)`` on a work queued behind a long kernel must block about the timeout and raise;
    the next batch on the group must then fail (the communicator was aborted). What was seen is
    written to ``out`` as it is seen: after the abort torch's watchdog may end the process itself
    (SIGABRT after its dump wait), which ``judge_wait_timeout`` accepts and records."""
    device = one_rank_group()
    rate = cycles_per_second()
    x = torch.ones(2**20, device=device)
    y = torch.zeros_like(x)
    self_batch(x, y)[0].wait()
    torch.cuda.synchronize()
    sleep(HELD_S, rate)
    works = self_batch(x, y)
    timeout = 1.0
    seen = {"timeout_s": timeout, "held_s": HELD_S}
    start = time.monotonic()
    try:
        works[0].wait(timedelta(seconds=timeout))
        seen["raised"] = "returned"
    except Exception as error:
        seen["raised"] = f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
    seen["blocked_s"] = time.monotonic() - start
    Path(out).write_text(json.dumps(seen))
    start = time.monotonic()
    try:  # the group after the timed-out wait: aborted, so the next batch must fail
        self_batch(x, y)[0].wait(timedelta(seconds=5))
        seen["next_batch"] = "returned"
    except Exception as error:
        seen["next_batch"] = f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
    seen["next_batch_s"] = time.monotonic() - start
    Path(out).write_text(json.dumps(seen))
    return seen


def judge_wait_timeout(value, code, seconds, log, ended_at) -> tuple[str, str]:  # noqa: ARG001
    """PASS: the timed wait raised no sooner than its timeout, and no later than the held kernel's end (the
    abort may wait for a kernel it cannot stop; said in the reason), the next batch failed at once (an aborted
    communicator refuses work; a healthy one would have queued it behind the kernel, and a timed wait on it would
    have blocked its timeout), and the process ended cleanly or by torch's watchdog (SIGABRT) after the abort."""
    value = value or {}
    raised, blocked, following = value.get("raised"), value.get("blocked_s"), value.get("next_batch")
    timeout, held, next_s = value.get("timeout_s", 0.0), value.get("held_s", 0.0), value.get("next_batch_s")
    ok = (
        raised not in (None, "returned")
        and blocked is not None
        and timeout * 0.9 <= blocked <= held + SLACK_S
        and following not in (None, "returned")
        and next_s is not None
        and next_s < 1.0
        and code in (0, -6)
    )
    if blocked is None:
        blocked_text = "never returned"
    elif blocked <= timeout + SLACK_S:
        blocked_text = f"{blocked:.2f} s (raised at the timeout)"
    else:
        blocked_text = f"{blocked:.2f} s (the abort waited for the {held:g} s kernel the work was held behind)"
    next_text = "never" if next_s is None else f"after {next_s:.2f} s"
    return (PASS if ok else FAIL), (
        f"wait(timeout={timeout} s) blocked {blocked_text}: {raised}; next batch ({next_text}): {following}; "
        f"exit status {code}"
    )


def selfloop_all_reduce(
    flats: list[torch.Tensor], code, timeout: float = 60.0, measure: dict | None = None, before_posts=None
) -> None:
    """CERAR's protocol in place on ``flats`` (N tensors on one GPU, one per logical worker), over
    the one-rank group's self-loop. Round t: worker i's message x_i(t) goes to worker i+1 as a
    self-send into its receive buffer, one ``_Ring.post`` (one batch, one work) per worker and
    chunk; every round's posts arrive (the stream waits for them) before any worker's receive of
    that round is issued, so no buffer is written while another worker still reads it. The rounds
    are issued, ordered and polled by ``cerar.ring.transport._Rounds`` under the stream-ordered contract,
    as ``all_reduce`` does; worker i plays ``device_matrices(code, i)``. ``measure``: filled with
    the posts, the protocol's polls (``_Rounds._await`` calls) and the host's lead before each post
    (posted works not yet complete, the new one included). ``before_posts``: called once the workers are built
    (their matrices' copies to the device synchronise the stream), just before the first post."""
    import cerar
    from cerar.coding.matrices import device_matrices
    from cerar.ring.rounds import CodedRingRank, PhaseTimer
    from cerar.ring.transport import STREAM_ORDERED, _Ring, _Rounds

    N, d, device = code.N, flats[0].numel(), flats[0].device
    c, m, L = code.c, code.m_for(d), code.L
    with torch.no_grad(), cerar.full_fp32_products(device):
        ranks = [CodedRingRank(device_matrices(code, i, torch.float32, device), flats[i], c, m, N) for i in range(N)]
        ring = _Ring.of(None, timeout, "cerar self-loop")
        if ring.contract != STREAM_ORDERED or ring.next_rank != 0 or ring.prev_rank != 0:
            raise RuntimeError(f"not a stream-ordered self-loop: {ring}")
        rounds = _Rounds(ring, PhaseTimer(device, enabled=False))
        measure = {} if measure is None else measure
        measure.update(polls=0, leads=[], posts=0)
        posted = []
        await_once = rounds._await

        def counted(*args):
            measure["polls"] += 1
            return await_once(*args)

        rounds._await = counted  # the protocol's own poll, counted

        def post(i, p, t):
            sender, receiver = ranks[i].workers[p], ranks[(i + 1) % N].workers[p]
            measure["leads"].append(1 + sum(not w.is_completed() for h in posted for w in h.result()))
            handle = rounds.post(sender.message(t), receiver.receive_buffer(t), f"round {t}/{L}")
            posted.append(handle)
            measure["posts"] += 1
            return handle

        chunks = len(ranks[0].workers)
        measure["chunks"] = chunks
        if before_posts is not None:
            before_posts()
        handles = [post(i, p, 1) for i in range(N) for p in range(chunks)]
        for rank in ranks:
            for worker in rank.workers:
                rounds.issue(worker.while_in_flight, 1)
        for t in range(1, L + 1):
            for handle in handles:
                rounds.arrive(handle, f"round {t}/{L}")
            for rank in ranks:
                for worker in rank.workers:
                    rounds.issue(worker.receive, t, worker.receive_buffer(t))
            if t < L:
                handles = [post(i, p, t + 1) for i in range(N) for p in range(chunks)]
                for rank in ranks:
                    for worker in rank.workers:
                        rounds.issue(worker.while_in_flight, t + 1)
        for i, rank in enumerate(ranks):
            rounds.issue(rank.write_result, flats[i], None)
        rounds.finish()


def spec_judged(results: torch.Tensor, G: torch.Tensor, code, scale: float = 1.0) -> dict:
    """``results`` [N, d] against the spec's protocol run literally in float64
    (``tests/spec_reference.py``) and against the exact sum plus the code's error
    (``judge.judge_coded``), both within ``cerar.ring.precision.rounding_bound`` relative to ||G||_F."""
    from scripts.checks.gpu.judge import judge_coded
    from tests.spec_reference import spec_all_reduce, spec_matrices

    G64 = G.double().cpu()
    reference = torch.from_numpy(spec_all_reduce(G64.numpy(), *spec_matrices(code.points, code.N))) * scale
    judged = judge_coded(results, G, code, torch.float32, scale)
    deviation = ((results.double().cpu() - reference).norm(dim=1) / (G64.norm() * scale)).max().item()
    return {**judged, "spec_deviation": deviation, "ok": judged["ok"] and deviation <= judged["bound"]}


def lead_bound(look_behind: int) -> int:
    """The most posts the host can be ahead of the GPU under ``cerar.ring.transport._Rounds``'s window: the lead
    before a post is that post plus the posted rounds not yet complete, and it is at most 2 x ``look_behind``
    (K), reached when the GPU is held and nothing but the protocol's own poll holds the host.

    From ``_Rounds.post``: the host polls at post p when p is a multiple of K and more than K rounds are
    outstanding; it pops the rounds before post p - K (they ran before it: one stream, in order) and waits for
    post p - K. So the first poll comes at post 2K and waits for post K (posts 1..K are all that the first
    window held, and no poll came before); after the poll at post jK, everything up to post (j-1)K has
    completed. Before post q, with jK the last poll before q (q - 1 = jK + r, 0 <= r < K), the rounds not yet
    complete are at most those after (j-1)K: q - 1 - (j-1)K = K + r <= 2K - 1, and the lead, the new post
    included, at most 2K; before the first poll (q <= 2K) at most q - 1 <= 2K - 1 rounds are outstanding.
    With the GPU held behind a long kernel from the first post on, none completes, so the host issues exactly
    2K posts before its first poll blocks, and the lead at post 2K is 2K. ``tests/test_gpu_check.py`` holds
    this to the rounds themselves on the CPU, under NCCL's contract as ``tests/nccl_emulation.py`` emulates it."""
    return 2 * look_behind


def _held_call(G: torch.Tensor, code, device, rate: float) -> tuple[dict, dict]:
    """One ``selfloop_all_reduce`` of G's rows, the GPU held behind a ``HOLD_S`` kernel queued just before the
    first post; what it measured (posts, polls, leads) and its result judged against the spec's protocol."""
    flats = [G[i].clone().to(device) for i in range(G.shape[0])]
    measure: dict = {}  # the hold after the workers' matrices reach the device: those copies wait for the stream
    selfloop_all_reduce(flats, code, measure=measure, before_posts=lambda: sleep(HOLD_S, rate))
    torch.cuda.synchronize()
    return measure, spec_judged(torch.stack([f.cpu() for f in flats]), G, code)


def held_at(leads: list[int]) -> int | None:
    """The first post before which the host had been held (its lead did not grow by the post it adds), or None."""
    return next((q + 1 for q in range(1, len(leads)) if leads[q] < leads[q - 1] + 1), None)


def rounds(N: int, c: int, d: int, out: str) -> dict:  # noqa: ARG001
    """``selfloop_all_reduce`` twice, each with the GPU held behind a ``HOLD_S`` kernel while the host posts.

    The first call on a fresh communicator is measured, not judged: its first post held the host until the
    kernel had drained on an H200 (lead 1: ../shared/device-runs/h200-2026-12-04/selfloop-rounds-lead-cold.txt).
    torch makes no communicator there: a post inside ``batch_isend_irecv``'s coalescing manager selects the
    device's communicator (``ProcessGroupNCCL::pointToPoint``: ``batchP2P`` ->
    ``getKeyFromDevice``), which ``init_process_group(device_id=...)`` made eagerly, so ``getNCCLComm`` returns it
    cached; the hold is NCCL's connect of the peer inside ``ncclGroupEnd`` (``taskAppend`` ->
    ``ncclGroupCommPreconnect``, at the first send or receive to a peer). One self-batch waited for before the
    hold still left the lead at 8 (``selfloop-rounds-lead-warm.txt``): one round's posts, then the host was
    held at round 1's arithmetic, the first launch of its kernels: CUDA loads a module lazily, at a kernel's
    first launch, which "might require context synchronization" (the CUDA Programming Guide, Lazy Loading,
    Potential Hazards). Measured on the H200 (reports/logs/gpu_selfloop_lead.log): after a self-batch and one
    call of the arithmetic alone the lead is 16; after a self-batch and a matmul (cuBLAS's handle made) still
    8; the same under ``CUDA_MODULE_LOADING=EAGER`` 16. So the first call is the warm-up: it connects the peer,
    loads every kernel the rounds use and fills the caching allocator with the call's sizes (on the H200 the
    next held call's lead was 16, twice). The second call is judged: its result within the rounding bound of the spec's
    protocol, its polls (one per ``LOOK_BEHIND_POSTS`` posts after the first window, one at the end) and its
    largest lead exactly ``lead_bound(LOOK_BEHIND_POSTS)``: never more (the contract's bound), and reached
    (nothing outside the protocol's poll holds the host)."""
    import cerar
    from cerar.ring.transport import LOOK_BEHIND_POSTS

    device = one_rank_group()
    rate = cycles_per_second()
    code = cerar.make_code(N, c, "perturbation", eps=0.05)
    G = torch.randn(N, d, generator=torch.Generator().manual_seed(26))
    cold, cold_judged = _held_call(G, code, device, rate)
    warm, judged = _held_call(G, code, device, rate)
    posts, lead, bound = warm["posts"], max(warm["leads"]), lead_bound(LOOK_BEHIND_POSTS)
    expected_polls = max(posts // LOOK_BEHIND_POSTS - 1, 0) + 1  # one per window after the first, one at the end
    numbers_ok = judged["ok"] and cold_judged["ok"]
    ok = numbers_ok and warm["polls"] == expected_polls and lead == bound and posts > bound
    held = held_at(warm["leads"][:bound])
    why = []
    if not numbers_ok:
        why.append(
            f"deviation from the spec {judged['spec_deviation']:.2e} (first call {cold_judged['spec_deviation']:.2e}; "
            f"bound {judged['bound']:.2e})"
        )
    if warm["polls"] != expected_polls:
        why.append(f"polls {warm['polls']} (expected {expected_polls})")
    if lead > bound:
        why.append(f"lead {lead}: more than the contract's bound 2 x {LOOK_BEHIND_POSTS} = {bound}")
    elif lead < bound:
        where = f"before post {held}" if held else "after its first poll"
        why.append(
            f"lead {lead}, not the contract's {bound}: the host was held {where}, by something outside the "
            "protocol's poll (a synchronising call, a lazy module load, an allocation)"
        )
    if posts <= bound:
        why.append(f"only {posts} posts: the bound {bound} cannot be reached")
    return {
        "status": PASS if ok else FAIL,
        "N": N,
        "c": c,
        "d": d,
        "kappa": code.kappa,
        "chunks": warm["chunks"],
        "posts": posts,
        "polls": warm["polls"],
        "expected_polls": expected_polls,
        "max_lead": lead,
        "lead_bound": bound,
        "leads": warm["leads"][: bound + 4],
        "held_before_post": held,
        "cold_max_lead": max(cold["leads"]),
        "cold_held_before_post": held_at(cold["leads"][:bound]),
        "look_behind": LOOK_BEHIND_POSTS,
        "spec_deviation": judged["spec_deviation"],
        "error": judged["error"],
        "bound": judged["bound"],
        "reason": "; ".join(why),
    }


def _never_completing_round(timeout_s: float, held_s: float = FOREVER_S):
    """A one-rank group and a self-loop round queued behind a kernel of ``held_s`` (default: one that outlives
    every deadline)."""
    device = one_rank_group(timeout_s)
    rate = cycles_per_second()
    x = torch.ones(2**20, device=device)
    y = torch.zeros_like(x)
    self_batch(x, y)[0].wait()
    torch.cuda.synchronize()
    sleep(held_s, rate)
    return self_batch(x, y)


def deadline(out: str) -> dict:
    """The round bounded by the protocol's deadline (``_Ring.await_works`` under the stream-ordered
    contract); its CollectiveError goes through the trainer's exit path, which exits 3."""
    from cerar.ring.transport import _Ring
    from train.distributed import exit_after_collective_failure

    works = _never_completing_round(60.0)
    ring = _Ring.of(None, TIMEOUT_S, "cerar self-loop")
    start = time.monotonic()
    try:
        ring.await_works(works, "self-loop round: receive and send", ring.peers)
    except Exception as error:
        raised = {"raised_after_s": time.monotonic() - start, "raised_at": time.monotonic()}
        Path(out).write_text(json.dumps({**raised, "error": type(error).__name__}))
        exit_after_collective_failure(error)
    return {"raised_after_s": None}


def judge_deadline(value, code, seconds, log, ended_at) -> tuple[str, str]:  # noqa: ARG001
    """PASS: CollectiveError within the timeout plus the slack, exit status 3, one ``error:`` line."""
    lines = [line for line in log.splitlines() if line.startswith("error: ")]
    if not value or value.get("raised_after_s") is None:
        return FAIL, f"no CollectiveError (exit status {code})"
    raised = value["raised_after_s"]
    abort_s = ended_at - value["raised_at"]
    ok = code == 3 and value["error"] == "CollectiveError" and TIMEOUT_S <= raised <= TIMEOUT_S + SLACK_S and lines
    return (PASS if ok else FAIL), (
        f"raised after {raised:.2f} s (timeout {TIMEOUT_S:g} s), exit status {code}, error to exit {abort_s:.2f} s; "
        + (lines[-1][:200] if lines else "no error: line")
    )


def watchdog(out: str) -> dict:  # noqa: ARG001
    """The round with no deadline of ours: the host waits (as a host blocked in a device
    synchronize or a ``.item()`` would), torch's watchdog must end the process."""
    works = _never_completing_round(GROUP_TIMEOUT_S, WATCHDOG_HELD_S)  # noqa: F841 (alive while the watchdog times it)
    start = time.monotonic()
    time.sleep(HOST_SLEEP_S)  # the host blocked; only the watchdog's SIGABRT ends this sooner
    return {"status": FAIL, "reason": f"still alive after {time.monotonic() - start:.0f} s"}


def judge_watchdog(value, code, seconds, log, ended_at) -> tuple[str, str]:  # noqa: ARG001
    """PASS: the process ended by SIGABRT (multiprocessing's -6; 134 in a shell), no sooner than the
    group's timeout, and torch's watchdog said why (``WorkNCCL::checkTimeout``'s "Watchdog caught collective
    operation timeout", or ``Watchdog::runLoop``'s "failure detected by watchdog"), so that another abort does
    not pass; the seconds are the whole process (start-up, about 10 s, included)."""
    said = any(words in log for words in WATCHDOG_WORDS)
    ok = code == -6 and seconds >= GROUP_TIMEOUT_S and said
    return (PASS if ok else FAIL), (
        f"exit status {code} after {seconds:.1f} s (group timeout {GROUP_TIMEOUT_S:g} s, 4 x the dump wait "
        f"{DUMP_WAIT_MS / 1000:g} s, process start-up included); the watchdog's words "
        + ("in the log" if said else "NOT in the log")
    )


def report(results) -> list[str]:
    lines = []
    for r in results:
        v = r.value or {}
        if r.case.name == "wait returns" and "host_wait_s" in v:
            lines.append(
                f"- wait returns: `wait()` returned after {v['host_wait_s'] * 1e3:.2f} ms behind a "
                f"{v['kernel_s']:g} s kernel (work incomplete after it: {v['incomplete_after_wait']}); done after "
                f"{v['until_done_s']:.2f} s; "
                f"values arrived: {v['arrived']}."
            )
        if r.case.name == "wait(timeout) aborts" and r.status != "NOT RUN":
            lines.append(f"- wait(timeout): {r.reason}.")
        if r.case.name == "rounds" and "posts" in v:
            cold_held = v["cold_held_before_post"]
            lines.append(
                f"- rounds: N={v['N']} logical workers, c={v['c']} perturbation (kappa {v['kappa']:.3g}), d={v['d']} "
                f"in {v['chunks']} chunk(s): deviation from the spec's protocol {v['spec_deviation']:.2e} (bound "
                f"{v['bound']:.2e}), error against the exact sum {v['error']:.2e}; {v['posts']} posts, {v['polls']} "
                f"polls (expected {v['expected_polls']}), the host's largest lead {v['max_lead']} posts (the "
                f"contract's bound 2 x {v['look_behind']} = {v['lead_bound']}, reached when the GPU is held: "
                f"`lead_bound`); leads at posts 1..{len(v['leads'])}: {v['leads']}. The first call on the fresh "
                f"communicator (the warm-up, not judged): largest lead {v['cold_max_lead']}"
                + (f", the host held before post {cold_held}." if cold_held else ".")
            )
        if r.case.name in ("deadline", "watchdog") and r.status != "NOT RUN":
            tail = [line for line in r.log.splitlines() if line.strip()][-6:]
            lines += [f"- {r.case.name}: {r.reason}; the process's last lines:", "", "```", *tail, "```", ""]
    return lines + [""]
