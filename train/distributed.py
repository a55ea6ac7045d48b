"""Process-group setup for torchrun (or a plain single process) and the small collectives the loop needs.

Backend: NCCL when the job runs on GPUs, gloo on CPU. A plain `python train/main.py` runs as a group of one.

The trainer's deadline (`trainer.collective_timeout_s`, T) bounds every host-blocking point of a step
(`bounded`): each collective is posted with ``async_op=True`` and the host waits for it as CERAR's rounds do
(`await_work`, under the backend's `cerar.ring.transport.transport_contract`). On gloo it blocks in
``Work.wait(timeout)``, which raises once T has passed since the post. On NCCL it polls ``Work.is_completed()``
until the work completes or T has passed, then calls ``Work.wait()``: the only bound the trainer has before
torch's: a collective's ``wait()`` (``WorkNCCL::wait`` -> ``synchronize()``)
only orders the current stream after the NCCL stream, so without the poll the host would block later,
in a ``.item()`` or ``torch.cuda.synchronize`` that nothing bounds, until torch's watchdog
(``ProcessGroupNCCL::Watchdog`` -> ``watchdogHandler`` -> ``WorkNCCL::checkTimeout``, timed from the
work's creation) fires at the group's timeout, signals its debug dump and sleeps 4 x
``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC`` (``Watchdog::runLoop``; a minute at the 15 s default), then aborts and
rethrows on its own thread: ``std::terminate``, SIGABRT,
exit status 134, no message of ours. NCCL groups are therefore created with the watchdog's timeout at
``WATCHDOG_FACTOR`` x T = 3T (`watchdog_timeout_s`): our deadline, T after the post, comes first, and the
host watchdog (`train.watchdog`: what the polling cannot see, a host held inside a call before any work
exists, 2T after the collective's entry) second. Torch's watchdog stays the backstop, with
``TORCH_NCCL_ASYNC_ERROR_HANDLING`` at torch's default 3 (tear down without the abort that may itself
block; 1 is kept if chosen, 0 and 2 are refused), and ``TORCH_NCCL_BLOCKING_WAIT`` set is refused
(`configure_nccl_watchdog`). Object collectives (``all_gather_object``: a size
exchange, then ``.item()``) run on a gloo group (`group_with_timeout`), where gloo's timeout bounds them.

The loop runs each collective inside `guarded(operation)`: before entering it a rank records in the
rendezvous store how many collectives it has entered; when one fails (a peer died, or stalled past the
timeout) the error becomes a `TrainCollectiveError` naming the operation, the step, and the ranks that never
reached it (gloo's own timeout message does not say which peer is missing).

After such a failure the process ends at once (`exit_after_collective_failure`): every process group is
aborted with torch's own abort, one line goes to stderr (written without blocking: `train.exit_path`), and the
exit status is 3, so torchrun restarts the job, within ``EXIT_WAIT_S`` whatever the abort or the write do (the
exit timer, armed first). No teardown runs: on NCCL, `destroy_process_group` can wait forever on kernels that still wait
for the missing peer, and NCCL's watchdog, on a communicator it finds stuck past the group's timeout,
would take the process down with SIGABRT before the message (CERAR's transport group has twice CERAR's
timeout, so CERAR reports first).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from cerar.ring.transport import transport_contract
from train import exit_path, watchdog
from train.config import ConfigError


@dataclass
class Launch:
    rank: int
    local_rank: int
    world_size: int


def launch_from_env() -> Launch:
    """Rank and world size as torchrun sets them (single process when absent)."""
    return Launch(
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("LOCAL_RANK", 0)),
        int(os.environ.get("WORLD_SIZE", 1)),
    )


def pick_device(cfg, launch: Launch) -> torch.device:
    want = cfg.trainer.device
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but no CUDA device is available")
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(launch.local_rank)
        return torch.device("cuda", launch.local_rank)
    return torch.device("cpu")


NCCL_ERROR_HANDLING_VARIABLE = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
NCCL_BLOCKING_WAIT_VARIABLES = ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT")
"""torch reads both names (``getCvarBool(TORCH_NCCL_BLOCKING_WAIT, false)`` in ``ProcessGroupNCCL``'s
constructor; the second is the deprecated spelling)."""

WATCHDOG_FACTOR = 3.0
"""NCCL groups' own timeout (torch's watchdog's) is this many times the trainer's deadline: past the poll (T) and
the host watchdog's collective deadline (2T, `train.watchdog.Deadlines`), each by T."""


def watchdog_timeout_s(timeout_s: float) -> float:
    """The timeout the trainer gives its NCCL groups for a deadline of ``timeout_s``: torch's watchdog
    times a work from its creation, the trainer's deadline from the post (a few microseconds later),
    so the watchdog fires ``(WATCHDOG_FACTOR - 1) x timeout_s`` after our deadline at the earliest, and T after
    the host watchdog's deadline for a collective (2T from its entry)."""
    return WATCHDOG_FACTOR * float(timeout_s)


def group_timeout_s(device: torch.device, timeout_s: float) -> float:
    """The default group's own timeout for a trainer deadline of ``timeout_s``: torch's watchdog's on NCCL
    (`watchdog_timeout_s`), gloo's (the deadline itself) on the CPU."""
    return watchdog_timeout_s(timeout_s) if device.type == "cuda" else float(timeout_s)


NCCL_ERROR_HANDLING_ACCEPTED = {"1": "tear down after aborting", "3": "tear down without aborting"}
NCCL_ERROR_HANDLING_DEFAULT = "3"
"""torch's own default (``ProcessGroupNCCL``'s constructor: ``getCvarInt(TORCH_NCCL_ASYNC_ERROR_HANDLING, 3
/*SkipCleanUp*/)``)."""


def configure_nccl_watchdog(environ=None) -> str:
    """Make torch's NCCL watchdog end a stalled collective and nothing else: TORCH_NCCL_ASYNC_ERROR_HANDLING at
    torch's default 3 (``SkipCleanUp``: on a failed or timed-out work, ``Watchdog::runLoop`` calls
    ``work.handleException`` without ``work.abort()``/``abortComms()``, since ``SHOULD_CLEAN_UP`` is false for 3,
    and ``SHOULD_TEAR_DOWN`` rethrows: SIGABRT) unless 1 (``TearDown``: the same after ``ncclCommAbort`` on the
    watchdog's thread, an abort that may itself wait on a stuck kernel) was chosen. Refused in one line: 0
    (``NoHandling``: no tear-down, a stalled peer would hang the job) and 2 (``CleanUpOnly``: the communicator is
    aborted but nothing is rethrown, so an aborted work reads as completed and ``wait()`` returns with whatever
    the buffers hold). So is TORCH_NCCL_BLOCKING_WAIT (or NCCL_BLOCKING_WAIT) set to anything but 0: with it
    ``WorkNCCL::wait`` blocks the host on every ``wait()``, timeout or not, and ``ProcessGroupNCCL::workEnqueue``
    leaves the work off the watchdog's list, so every CERAR round would become a host round trip and the
    watchdog's backstop would be gone. Returns the error-handling mode."""
    environ = os.environ if environ is None else environ
    for name in NCCL_BLOCKING_WAIT_VARIABLES:
        value = environ.get(name, "").strip()
        if value and value.lower() not in ("0", "false", "n", "no"):
            raise ConfigError(
                f"{name}={value} makes every NCCL wait block the host and takes the works off torch's watchdog "
                f"(CERAR's rounds would each become a host round trip); unset it"
            )
    mode = environ.setdefault(NCCL_ERROR_HANDLING_VARIABLE, NCCL_ERROR_HANDLING_DEFAULT).strip()
    if mode not in NCCL_ERROR_HANDLING_ACCEPTED:
        why = {
            "0": "turns off the watchdog's tear-down, so a stalled peer would hang the job",
            "2": "aborts a stalled communicator without ending the process, so its works read as completed and "
            "wait() returns with whatever the buffers hold",
        }.get(mode, "is not one of torch's modes 0-3")
        raise ConfigError(
            f"{NCCL_ERROR_HANDLING_VARIABLE}={mode} {why}; unset it (torch's default 3, tear down) or set 1 or 3"
        )
    return mode


def init_process_group(launch: Launch, device: torch.device, timeout_s: float) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    set_deadline(timeout_s)
    if backend == "nccl":
        configure_nccl_watchdog()  # read by ProcessGroupNCCL when it is created, so before init
        timeout_s = watchdog_timeout_s(timeout_s)  # the watchdog's, behind the trainer's deadline
    timeout = timedelta(seconds=timeout_s)
    if "MASTER_ADDR" in os.environ:
        store = None
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if restart is not None:
            # torchrun shares its rendezvous TCPStore with the workers without a per-attempt prefix, so after a
            # restart gloo can read a dead peer's address left by the previous attempt ("connectFullMesh failed:
            # Connection refused"). Keys of this attempt go under their own prefix.
            base, _, _ = next(dist.rendezvous("env://", launch.rank, launch.world_size, timeout=timeout))
            store = dist.PrefixStore(f"cerar_pythia/attempt_{restart}/", base)
        start = time.monotonic()
        try:
            dist.init_process_group(
                backend,
                store=store,
                rank=launch.rank,
                world_size=launch.world_size,
                timeout=timeout,
                device_id=device if device.type == "cuda" else None,
            )
        except (dist.DistStoreError, dist.DistNetworkError) as err:  # a peer never joined the rendezvous
            raise TrainCollectiveError(
                f"collective 'process group rendezvous' at step 0 (phase: start-up: process group) failed on rank "
                f"{launch.rank} after {time.monotonic() - start:.1f}s: the {launch.world_size} ranks must all reach it "
                f"within {timeout_s:g}s of each other (the group's timeout, from trainer.collective_timeout_s); "
                f"{type(err).__name__}: {first_line(err)}"
            ) from err
    else:  # a plain single process: a group of one with an in-memory store
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


_groups_with_timeout: dict[tuple[object, float], object] = {}


def group_with_timeout(timeout_s: float):
    """Every rank in a gloo group whose collectives wait up to ``timeout_s`` instead of the default group's
    timeout (for a wait known to be long: a checkpoint being written). Created on first use, once per
    default group and timeout: every rank must ask at the same point of the run."""
    key = (dist.group.WORLD, float(timeout_s))  # the group itself: a later default group never matches it
    if key not in _groups_with_timeout:
        _groups_with_timeout[key] = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    return _groups_with_timeout[key]


def check_same_config(config_hash: str, code_hash: str, device: torch.device) -> None:
    """Every rank must run the same resolved config and the same code (cerar protocol, package version,
    sources): one all-gather of both hashes; a mismatch stops all ranks with one clear error."""
    mine = torch.tensor(list(bytes.fromhex(config_hash + code_hash)), dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    bounded("start-up config/code hash exchange", lambda: dist.all_gather(gathered, mine, async_op=True))
    half = len(mine) // 2
    config_differs = [r for r, g in enumerate(gathered) if not torch.equal(g[:half], gathered[0][:half])]
    code_differs = [r for r, g in enumerate(gathered) if not torch.equal(g[half:], gathered[0][half:])]
    if config_differs:
        raise ConfigError(
            f"ranks {config_differs} were launched with a config different from rank 0's "
            "(compare the overrides given to each node)"
        )
    if code_differs:
        raise ConfigError(
            f"ranks {code_differs} run code different from rank 0's (cerar protocol or package version, or the "
            "sources of cerar/ and train/); install the same version on every node"
        )


def first_line(err: BaseException) -> str:
    """An error's first line (at most 300 characters; its type's name if it has no text): what a one-line
    ``error:`` message quotes of the exception behind it."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:300]


class TrainCollectiveError(RuntimeError):
    """A collective of the loop failed or timed out; the message names the operation, step and missing ranks."""


_progress = {"entered": 0, "step": 0, "phase": "start-up"}
_HEARTBEAT = "cerar_pythia/entered/"


def set_step(step: int) -> None:
    """The step the loop is working on, for error messages and the heartbeat."""
    _progress["step"] = step


def set_phase(phase: str) -> None:
    """The phase the host is in (train/loop.py's PhaseTimer, train/run.py's start-up), for error messages and
    the host watchdog, which watches it with the phase's deadline (`train.watchdog.Deadlines`)."""
    _progress["phase"] = phase
    watchdog.enter_phase(phase)


def current_step() -> int:
    """The step the loop is working on (0 at start-up)."""
    return _progress["step"]


def deadline_s() -> float:
    """The trainer's deadline for one collective (`set_deadline`)."""
    return _deadline["timeout_s"]


def _store():
    try:
        return dist.distributed_c10d._get_default_store()  # the rendezvous store (torchrun's agent hosts it)
    except Exception:
        return None


def _beat(operation: str) -> None:
    _progress["entered"] += 1
    if dist.get_world_size() < 2 or (store := _store()) is None:
        return
    with contextlib.suppress(Exception):
        store.set(f"{_HEARTBEAT}{dist.get_rank()}", f"{_progress['entered']} {_progress['step']} {operation}")


def missing_ranks() -> str:
    """Which ranks have not entered the collective this rank is stuck in, read from the heartbeat keys."""
    store, me, n = _store(), dist.get_rank(), dist.get_world_size()
    if store is None:
        return "ranks involved: all"
    behind = []
    with contextlib.suppress(Exception):
        store.set_timeout(timedelta(seconds=5))
        for r in range(n):
            if r != me and store.check([f"{_HEARTBEAT}{r}"]):
                entered, step, op = store.get(f"{_HEARTBEAT}{r}").decode().split(" ", 2)
                if int(entered) < _progress["entered"]:
                    behind.append(f"rank {r} (last entered {op!r} at step {step})")
    if behind:
        return "peer(s) that never joined: " + ", ".join(behind)
    others = [r for r in range(n) if r != me]
    names = f"rank {others[0]}" if len(others) == 1 else "ranks " + ", ".join(map(str, others))
    return f"no peer was behind; one died or stalled inside it: {names}"


@contextlib.contextmanager
def guarded(operation: str, poll_timeout_s: float | None = None):
    """Run one collective; turn any failure into a TrainCollectiveError that names operation, step and peers.
    The host watchdog watches it from before the heartbeat's ``store.set`` with the poll's timeout
    (``poll_timeout_s``, default T) + T: what holds the host inside the call (a connect, a split, a host read, a
    dead store host) ends the process T after the poll would have."""
    if not dist.is_initialized() or dist.get_world_size() < 2:
        yield
        return
    watchdog.enter_collective(operation, poll_timeout_s)
    _beat(operation)
    start = time.monotonic()
    try:
        yield
    except TrainCollectiveError:
        raise
    except Exception as err:
        raise TrainCollectiveError(
            f"collective {operation!r} at step {_progress['step']} (phase: {_progress['phase']}) failed on rank "
            f"{dist.get_rank()} after "
            f"{time.monotonic() - start:.1f}s: {missing_ranks()}; {type(err).__name__}: {first_line(err)}"
        ) from err
    finally:
        watchdog.resume_phase()


@contextlib.contextmanager
def each_new_group_guarded(operation: str):
    """`guarded` for a stretch of code that makes subgroups (``build_aggregator``; a DDP hook's state, made by
    ``register_hook``; cerar's and torch's ``dist.new_group`` calls inside them): each ``new_group`` is a
    collective of its own on NCCL (``ncclCommSplit`` over every rank of the parent group, no work), so each is
    given the host watchdog's collective deadline afresh (2T), named ``<operation>: new_group <k>``, and a
    heartbeat of its own (every rank makes the same ``new_group`` calls in the same order), so that the line names
    the peer that never reached the k-th split; the stretch as a whole may make as many as it needs.
    ``dist.new_group`` is wrapped for the stretch only and restored after it."""
    with guarded(operation):
        original = dist.new_group
        made = [0]

        def new_group(*args, **kwargs):
            made[0] += 1
            name = f"{operation}: new_group {made[0]}"
            watchdog.enter_collective(name)
            _beat(name)
            return original(*args, **kwargs)

        dist.new_group = new_group
        try:
            yield
        finally:
            dist.new_group = original


ABORT_WAIT_S = 10.0
"""How long the failure path lets torch's abort run before it exits anyway (an abort is not expected
to block, but nothing on the way out may hang)."""
EXIT_WAIT_S = ABORT_WAIT_S + 10.0
"""The way out's whole bound, kept by the exit timer armed as it starts: the abort (``ABORT_WAIT_S``), Python's
buffers flushed (``exit_path.FLUSH_WAIT_S``), the line (``exit_path.LINE_WAIT_S``), with room to spare."""


def abort_process_groups() -> None:
    """Abort every process group of this process (CERAR's transport group and DDP's included) with
    torch's own abort: ``torch.distributed.distributed_c10d._abort_process_group`` (torch >= 2.3;
    with no group it aborts all of them, NCCL's inside one ncclGroupStart/End so that their aborts
    cannot deadlock each other), else each group's ``ProcessGroup.abort()``. On NCCL this cancels
    kernels that wait for a dead peer; on gloo it releases the groups."""
    if not dist.is_available() or not dist.is_initialized():
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None:
        abort(None)
        return
    for group in list(dist.distributed_c10d._world.pg_map):
        with contextlib.suppress(Exception):
            group.abort()


def exit_after_collective_failure(error: BaseException, code: int = 3) -> None:
    """End this process after a collective failed: arm the exit timer (``EXIT_WAIT_S``: from here the process
    ends whatever follows does), abort the process groups (``abort_process_groups``, given ``ABORT_WAIT_S`` at
    most), flush Python's stdout and stderr (bounded), write ``error: <message>`` as one line on stderr without
    blocking (`train.exit_path.write_line`: a closed or full pipe costs at most its bound, never the exit) and
    ``os._exit(code)``: no teardown, no atexit handler, nothing that could wait on a dead peer."""
    exit_path.arm(code, EXIT_WAIT_S)
    watchdog.leaving(EXIT_WAIT_S)  # no second line from the watchdog; the sidecar knows the bound
    aborting = threading.Thread(target=_abort_quietly, name="abort-process-groups", daemon=True)
    aborting.start()
    aborting.join(ABORT_WAIT_S)
    message = " ".join(str(error).split()) or type(error).__name__
    exit_path.flush_streams()
    exit_path.write_line(f"error: {message}")
    os._exit(code)


def _abort_quietly() -> None:
    with contextlib.suppress(Exception):
        abort_process_groups()


_deadline = {"timeout_s": 300.0}
_FIRST_POLL_PAUSE, _LAST_POLL_PAUSE = 20e-6, 2e-4  # s between polls, doubling (cerar.ring.transport's): <= 0.2 ms late


def set_deadline(timeout_s: float) -> None:
    """The trainer's deadline for one collective (``trainer.collective_timeout_s``), used by `bounded`."""
    _deadline["timeout_s"] = float(timeout_s)


def await_work(work, timeout_s: float | None = None) -> None:
    """Return once ``work`` has completed, within ``timeout_s`` (default: the trainer's deadline) of this call;
    on expiry raise TimeoutError, and a failed work's error as the work raises it. The wait follows the contract
    of the default group's backend (`cerar.ring.transport.transport_contract`, as CERAR's rounds do):

    - host-waited (gloo): ``Work.wait(timeout)`` with the time left, which blocks the host without spinning
      and raises on expiry (``c10d::Work::wait``: "Operation timed out!");
    - stream-ordered (NCCL): ``wait()`` only orders the stream, and ``wait(timeout)`` would abort the
      communicator on expiry (module docstring), so the host polls ``work.is_completed()`` every 20 us
      doubling to 0.2 ms (at most 0.2 ms late) until it completes or the deadline passes, then ``wait()``.

    Either way the host never blocks past the deadline on the work, so a stalled peer cannot hold it. Polling on
    gloo cost a waiting rank about 11 % of a core (10k wake-ups and 0.34 s of CPU in 3 s), taken from the peers
    it waits for wherever ranks share cores."""
    timeout_s = _deadline["timeout_s"] if timeout_s is None else float(timeout_s)
    deadline = time.monotonic() + timeout_s
    expired = f"did not complete within {timeout_s:g}s (trainer.collective_timeout_s)"
    if not transport_contract().stream_ordered:
        try:
            work.wait(timedelta(seconds=timeout_s))
        except RuntimeError:
            if time.monotonic() >= deadline:  # gloo's expiry (a failed work raises before its deadline)
                raise TimeoutError(expired) from None
            raise
        return
    pause = _FIRST_POLL_PAUSE
    while not work.is_completed():
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(expired)
        time.sleep(min(pause, left))
        pause = min(2 * pause, _LAST_POLL_PAUSE)
    work.wait()


def bounded(operation: str, post, timeout_s: float | None = None):
    """Run one collective under the trainer's deadline: ``post()`` issues it with ``async_op=True`` and
    returns its Work (or a list of Works), which `await_work` polls; a failure or an expired deadline
    becomes a TrainCollectiveError naming the operation, the step and the peers (`guarded`). Returns
    what ``post`` returned."""
    with guarded(operation, timeout_s):
        works = post()
        for work in works if isinstance(works, list | tuple) else [works]:
            if work is not None:
                await_work(work, timeout_s)
    return works


def all_reduce_mean(values: list[float], device: torch.device, operation: str = "all_reduce mean") -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    bounded(operation, lambda: dist.all_reduce(t, async_op=True))
    return (t / dist.get_world_size()).tolist()


watchdog.RUN.update(  # what the host watchdog asks of the run (train/watchdog.py: it never imports this module)
    abort_wait_s=ABORT_WAIT_S,
    exit_s=EXIT_WAIT_S,
    step=lambda: current_step(),
    peers=lambda: missing_ranks(),
    fail=lambda error, code: exit_after_collective_failure(error, code=code),
)
