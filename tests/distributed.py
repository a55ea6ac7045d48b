"""Run a function on N real processes joined in a gloo process group (no mocks).

    results = run_workers(worker_fn, world_size=4, args=(...))
    results = run_workers(worker_fn, world_size=4, contract="nccl")   # NCCL's contract, on gloo

``worker_fn(rank, world_size, *args)`` must be defined at module level (it is pickled by name).
Workers are forked from a forkserver that has imported torch and cerar once per test session, so a
launch costs the fork and the group's set-up, not an interpreter and a torch import per rank (several
seconds each on a 2-core machine); each worker starts with the parent's environment as it is at the
call, as a spawned process would.
Each worker's return value comes back in rank order; an exception in a worker is re-raised in the
test with the worker's traceback. Workers that are still alive when the test gives up are killed.
The processes meet in a TCPStore that the parent creates on a port the kernel picks (so no two
tests can race for a port) and keeps until they have ended; ``shared_store()`` is that store in a
worker (for the test's own synchronisation), and a test may pass its own (``store=``) to read what
the workers wrote after they ended.

``contract`` chooses what the transport promises the code under test, ``"gloo"`` (gloo's own) or ``"nccl"``
(NCCL's, as torch implements it, emulated on gloo with its watchdog): ``tests/nccl_emulation.py``, which also
keeps ``transport_log()``, what each process handed to the transport and how it waited.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import os
import queue
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from tests.nccl_emulation import CONTRACTS, install, transport_timeout_s

_PRELOAD = (  # torch._dynamo: what building a DistributedDataParallel imports (seconds)
    ["torch", "torch.distributed", "torch._dynamo", "cerar", "tests.distributed", "tests.nccl_emulation"]
    + ["transformers"]
    + ["train.main", "train.run"]
    + ["scripts.checks.gpu.cases"]  # the GPU check's own cases, run by tests/test_gpu_check.py from this server too
)
_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(_PRELOAD)


def start_forkserver():
    """Start this process's forkserver, with the preload above, unless it runs; returns its context. A process
    has one forkserver, whatever context asks for it, and the preload is the one set when it starts: the GPU
    check's ``cases.context()`` sets a shorter one (torch and cerar), so where a GPU check case started it first,
    every later launch on that pytest worker imported transformers and train/ again in each rank, about 3 s of a
    core per process (the stall cases' fixture took 112-158 s instead of 35-54 s). Every launch here starts it
    through this call, the preload set again first; tests/test_gpu_check.py calls it before its cases run. Started
    on first use, not with each session: the preload's imports take about 8 s of a core, which a pytest run of unit
    tests alone (each fault of scripts/checks/mutation.py) would pay for nothing."""
    import multiprocessing.forkserver

    _CONTEXT.set_forkserver_preload(_PRELOAD)
    multiprocessing.forkserver.ensure_running()
    return _CONTEXT


def preloaded_here() -> list[str]:
    """Of the preload, the modules this process already has: in a worker at its entry, what its forkserver
    imported for it."""
    import sys

    return [name for name in _PRELOAD if name in sys.modules]


class WorkerError(RuntimeError):
    pass


@dataclass(frozen=True)
class ProcessExit:
    """What ``run_workers`` returns for a rank listed in ``exits``: the exit status it ended with."""

    code: int | None


_store = {"store": None}


def shared_store():
    """The TCPStore every worker of this ``run_workers`` call joined (the parent holds it)."""
    return _store["store"]


def stop_one_rank(rank: int, world_size: int, victim: int) -> None:
    """A peer that stalls mid-run: once every rank has reached this call, rank ``victim`` stops itself (SIGSTOP)
    and the others return, to make the call that finds it stalled."""
    import signal

    store = shared_store()
    store.set(f"ready/{rank}", "1")
    if rank == victim:
        store.wait([f"ready/{r}" for r in range(world_size)], timedelta(seconds=60))
        os.kill(os.getpid(), signal.SIGSTOP)
    store.wait([f"ready/{victim}"], timedelta(seconds=60))


def _take_environment(environ: dict) -> None:
    """The caller's environment as a fresh interpreter would start with it: the variables, and the thread count
    torch reads from OMP_NUM_THREADS when it starts (here torch started in the forkserver, before them; a
    different count sums in a different order, and runs would not be bit-identical to torchrun's)."""
    import torch

    os.environ.clear()
    os.environ.update(environ)
    if environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(environ["OMP_NUM_THREADS"]))


def _redirect_output(out_path: str, err_path: str) -> None:
    """This process's stdout and stderr (file descriptors 1 and 2) into the files its parent reads back."""
    os.dup2(os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND), 1)
    os.dup2(os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND), 2)


def _entry(fn, rank, world_size, port, args, results, group_timeout_s, contract, environ, out_path, err_path):
    import torch
    import torch.distributed as dist

    _take_environment(environ)  # the caller's environment now, not the forkserver's from when it started
    _redirect_output(out_path, err_path)
    try:
        _store["store"] = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore("run_workers/", _store["store"]),
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=transport_timeout_s(group_timeout_s) if contract == "nccl" else group_timeout_s),
        )
        install(contract, group_timeout_s, _store["store"])
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
        sys.stdout.flush()
        sys.stderr.flush()


def _pass_on_output(outputs: list[tuple[str, str]]) -> None:
    """The workers' stdout and stderr, rank by rank, onto this process's (where a test's capfd reads them): a
    forked worker's own descriptors are the forkserver's, not the test's."""
    for out_path, err_path in outputs:
        for path, fd in ((out_path, 1), (err_path, 2)):
            with contextlib.suppress(FileNotFoundError):
                data = memoryview(Path(path).read_bytes())
                while data:
                    data = data[os.write(fd, data) :]


def run_workers(
    fn,
    world_size: int,
    args=(),
    timeout_s: float = 120,
    group_timeout_s: float = 60,
    expect=None,
    contract: str = "gloo",
    *,
    exits=(),
    store=None,
    stderr=None,
):
    """Run ``fn`` on ``world_size`` processes and return their results in rank order.

    ``contract``: ``"gloo"`` or ``"nccl"``, what the transport promises (module docstring).

    ``expect``: the ranks whose results the test waits for (default all but ``exits``); the others
    may die or hang on purpose and are killed once the expected ones have reported. ``exits``: ranks
    expected to end the process without reporting (``os._exit``); the call waits for them to end
    and returns a ``ProcessExit`` with the exit status in their place. ``store``: a master
    ``torch.distributed.TCPStore`` the workers join (default: a new one on a free port). ``stderr``: a dict that
    receives each rank's stderr (text), also when the call raises.
    """
    if contract not in CONTRACTS:
        raise ValueError(f"contract must be one of {CONTRACTS}, got {contract!r}")

    exits = set(exits)
    expect = set(range(world_size)) - exits if expect is None else set(expect)
    if store is None:
        store = held_store()
    context = start_forkserver()
    results = context.Queue()
    logs = tempfile.TemporaryDirectory(prefix="run-workers-")
    outputs = [(f"{logs.name}/{rank}.out", f"{logs.name}/{rank}.err") for rank in range(world_size)]
    environ = dict(os.environ)
    processes = [
        context.Process(
            target=_entry,
            args=(fn, rank, world_size, store.port, args, results, group_timeout_s, contract, environ, *outputs[rank]),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in processes:
        p.start()
    collected: dict[int, tuple[str, object]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while not expect.issubset(collected):
            try:
                rank, status, value = results.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                missing = sorted(expect - set(collected))
                raise TimeoutError(f"ranks {missing} did not report within {timeout_s}s") from None
            collected[rank] = (status, value)
        for rank in sorted(exits):
            processes[rank].join(timeout=max(0.0, deadline - time.monotonic()))
            if processes[rank].is_alive():
                raise TimeoutError(f"rank {rank} did not end within {timeout_s}s")
        with contextlib.suppress(queue.Empty):  # a rank that reported although it was to exit
            while True:
                rank, status, value = results.get(timeout=0.1)
                collected[rank] = (status, value)
    finally:
        for p in processes:
            p.join(timeout=5 if expect | exits == set(range(world_size)) else 0.1)
        for p in processes:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        _pass_on_output(outputs)
        if stderr is not None:
            for rank, (_, err_path) in enumerate(outputs):
                with contextlib.suppress(FileNotFoundError):
                    stderr[rank] = Path(err_path).read_text(errors="replace")
        logs.cleanup()
    errors = {r: v for r, (s, v) in collected.items() if s == "error"}
    if errors:
        raise WorkerError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
    import torch

    out = []
    for r in range(world_size):
        if r in collected:
            out.append(torch.load(io.BytesIO(collected[r][1]), weights_only=False))
        elif r in exits:
            out.append(ProcessExit(processes[r].exitcode))
        else:
            out.append(None)
    return out


# ------------------------------------------------------------------ scripts launched as torchrun launches them


def _script_entry(script: str, argv: list[str], environ: dict, cwd: str, out_path: str, err_path: str) -> None:
    """One rank of ``launch_script``: the script run as ``__main__`` with its arguments, in the environment
    torchrun gives a worker, its stdout and stderr in files (the exit status is the script's)."""
    import runpy

    _take_environment(environ)
    os.chdir(cwd)
    _redirect_output(out_path, err_path)
    sys.argv = [script, *argv]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _script_process(script, argv: list[str], environ: dict, cwd, out_path, err_path):
    """The forkserver's process (not yet started) that runs ``script`` as ``__main__`` in ``environ``
    (``_script_entry``), its stdout and stderr in those files: one rank of a launch, or a ScriptProcess."""
    return start_forkserver().Process(
        target=_script_entry, args=(str(script), list(argv), environ, str(cwd), str(out_path), str(err_path))
    )


def launch_script(
    script, argv: list[str], nproc: int, env: dict, cwd, timeout_s: float, rank_env: list[dict] | None = None
) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node=nproc script argv`` as the workers see it, without the agent:
    every rank gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, the agent's store
    at MASTER_ADDR:MASTER_PORT with TORCHELASTIC_USE_AGENT_STORE, restart count 0) and runs the script as
    ``__main__``, forked from the forkserver that has torch, transformers and train/ imported, so a launch does
    not pay an interpreter, an agent and a torch import per rank. The store is the parent's, on a port the
    kernel picks. As torchrun does, the first rank to fail ends the others, and the launch's status is 0 when
    every rank ended with 0 and 1 otherwise; ``rank_codes`` keeps each rank's. ``rank_env[r]``, if given, is
    added to rank r's environment (what differs between nodes: another build, another setting).

    What the agent itself does (restarts, rendezvous between nodes, its signal handling) is torchrun's to
    test: tests that exercise it launch ``python -m torch.distributed.run`` (tests/runs.py ``torchrun``)."""
    store = held_store()
    environs = [
        {
            **env,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "GROUP_RANK": "0",
            "ROLE_RANK": str(rank),
            "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc),
            "ROLE_WORLD_SIZE": str(nproc),
            "GROUP_WORLD_SIZE": "1",
            "ROLE_NAME": "default",
            **agent_store_environment(store),
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": "launch-script",
            **(rank_env[rank] if rank_env else {}),
        }  # fmt: skip
        for rank in range(nproc)
    ]
    return _run_forked(script, argv, environs, cwd, timeout_s)


def run_script(script, argv: list[str], env: dict, cwd, timeout_s: float) -> subprocess.CompletedProcess:
    """``python script argv`` in exactly the environment ``env``, as one process forked from the forkserver (torch,
    transformers and train/ already imported): what a test of the entry point's own behaviour (a refusal at start,
    a single-process run) needs, without an interpreter's start and its imports per call. Its ``returncode`` is the
    script's exit status (``sys.exit``'s code; 1 for an uncaught exception, whose traceback is on stderr)."""
    done = _run_forked(script, argv, [env], cwd, timeout_s)
    done.returncode = done.rank_codes[0]
    return done


class ScriptProcess:
    """``subprocess.Popen([python, script, *argv], env=env, cwd=cwd)`` as one process forked from the forkserver (the
    script run as ``__main__``): the calls a test makes of a Popen (``pid``, ``poll``, ``send_signal``, ``kill``,
    ``wait``, ``returncode``) and ``stderr()``, what it wrote there (kept in ``logs``, a folder of the test's)."""

    def __init__(self, script, argv: list[str], env: dict, cwd, logs: Path):
        logs.mkdir(parents=True, exist_ok=True)
        self._out, self._err = logs / "stdout", logs / "stderr"
        self._process = _script_process(script, argv, env, cwd, self._out, self._err)
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def send_signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def kill(self) -> None:
        self._process.kill()  # a no-op on a process that has ended
        self._process.join(timeout=10)

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(str(self.pid), timeout)
        return self._process.exitcode

    def stderr(self) -> str:
        return self._err.read_text(errors="replace") if self._err.exists() else ""


def _run_forked(script, argv: list[str], environs: list[dict], cwd, timeout_s: float) -> subprocess.CompletedProcess:
    """One process per environment in ``environs``, each running ``script`` as ``__main__``; the first to fail ends
    the others (as torchrun's agent does). Status 0 when every process ended with 0, else 1; ``rank_codes`` keeps
    each one's, and stdout and stderr are theirs in order."""
    with tempfile.TemporaryDirectory(prefix="launch-script-") as logs:
        processes = []
        for rank, environ in enumerate(environs):
            processes.append(_script_process(script, argv, environ, cwd, f"{logs}/{rank}.out", f"{logs}/{rank}.err"))
        for p in processes:
            p.start()
        deadline = time.monotonic() + timeout_s
        try:
            while any(p.is_alive() for p in processes):
                if any(p.exitcode not in (None, 0) for p in processes):
                    break  # a rank failed: torchrun's agent stops the others
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired([str(script), *argv], timeout_s)
                time.sleep(0.05)
        finally:
            for p in processes:
                if p.is_alive():
                    p.terminate()
            for p in processes:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
        codes = [p.exitcode for p in processes]
        read = [tuple(Path(f"{logs}/{r}.{kind}").read_text(errors="replace") for kind in ("out", "err"))
                for r in range(len(processes))]  # fmt: skip
    done = subprocess.CompletedProcess(
        [str(script), *argv],
        0 if all(code == 0 for code in codes) else 1,
        "".join(out for out, _ in read),
        "".join(err for _, err in read),
    )
    done.rank_codes = codes
    return done


def held_store():
    """A TCPStore server on a port the kernel picks, held by the test for as long as it keeps the object: the
    meeting point of processes the test launches itself (no bind-and-close race for a free port)."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))


def c10d_rendezvous_options(store) -> list[str]:
    """torchrun's options for agents meeting at the test's ``held_store()``: every agent a client of it."""
    return [
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{store.port}",
        "--rdzv-conf=is_host=false",
    ]


def agent_store_environment(store) -> dict[str, str]:
    """What torchrun tells its workers about its store, for workers a test starts itself around
    ``held_store()``: the trainer's process group meets there instead of on a port of its own."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
