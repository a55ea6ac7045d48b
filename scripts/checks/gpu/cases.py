"""One case of the GPU check in a process of its own, bounded by a deadline.

A case is a function ``scripts.checks.gpu.<module>:<function>(**kwargs) -> dict`` run in a child
process (forked from a forkserver that has imported torch and cerar, and has never touched CUDA),
with its stdout and stderr in a log file of its own. A hang, an abort or a crash stays in that
process: the parent waits up to the case's deadline, kills it (SIGKILL) if it is still there, and
records its exit status and seconds. The child writes what the function returns as JSON before it
exits; the parent judges it: by the ``status`` the function computed (PASS / FAIL / MEASURED), or,
for a case whose point is how the process ends (``expect_exit``), by its exit status first."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PASS, FAIL, NOT_RUN, MEASURED = "PASS", "FAIL", "NOT RUN", "MEASURED"


@dataclass(frozen=True)
class Needs:
    """What a case needs to prove anything: CUDA, and how many ranks (one per GPU; the CPU dry run
    stands ``DRY_RUN_RANKS`` gloo processes in for devices)."""

    cuda: bool = False
    ranks: int = 1


@dataclass(frozen=True)
class Case:
    section: str
    name: str
    target: str  # "module:function": a module of scripts.checks.gpu, or a dotted module name
    kwargs: dict = field(default_factory=dict)
    deadline_s: float = 120.0
    needs: Needs = Needs()
    expect_exit: int | None = 0
    """The exit status the case must end with (a negative number: killed by that signal, as
    ``multiprocessing`` reports it; -6 is SIGABRT, 134 in a shell); None: judged by ``judge``."""
    judge: str | None = None
    """"module:function"(value, exit, seconds, log, ended_at) -> (status, reason), where ended_at is
    ``time.monotonic()`` when the parent saw the process end; None: the value's own status."""
    env: dict = field(default_factory=dict)


@dataclass
class Result:
    case: Case
    status: str
    reason: str = ""
    exit: int | None = None
    seconds: float = 0.0
    value: dict | None = None
    log: str = ""


def _resolve(target: str):
    """``module:function``: a module of this package, or one named in full (a dotted name)."""
    module, function = target.split(":")
    name = module if "." in module else f"scripts.checks.gpu.{module}"
    __import__(name)
    return getattr(sys.modules[name], function)


def _child(target: str, kwargs: dict, out: str, log: str, env: dict) -> None:
    """The case's process: its output in ``log``, its value in ``out`` (JSON), exit 0; an exception:
    its traceback in the log, exit 1. A case that ends the process itself (os._exit, a signal) writes
    what it wants judged into ``out`` first."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(env)
    try:
        value = _resolve(target)(**kwargs, out=out)
        Path(out).write_text(json.dumps(value, default=str))
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no teardown of process groups a case may have left stuck


def scratch(out: str) -> Path:
    """A case's own folder for what its runs write: beside its result ``out``, inside the check's temporary folder
    (runner.main), so it goes when the check ends, whatever the case's end."""
    folder = Path(out).with_suffix("")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def context():
    """The processes' context: a forkserver that has imported torch and cerar (cheap forks, no CUDA
    state inherited; CUDA may not be used across a plain fork)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "cerar", "scripts.checks.gpu.cases"])
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    # torch.cuda.is_available() counts devices through the CUDA runtime, which initialises the driver and
    # so spoils later forks; through NVML it does not (torch.cuda._device_count_nvml)
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    return ctx


def start_ranks(target, world: int, args: tuple):
    """Start ``world`` rank processes of a case, ``target(rank, world, port, *args, results)``, forked
    from the case's own process (cheap: torch is imported; safe: the case process has not touched
    CUDA and has no thread yet when it forks). They meet in a TCPStore the case process makes after
    the forks, on a port the kernel picks, and report on ``results``. Returns (processes, results,
    store)."""
    import torch.distributed as dist

    ctx = mp.get_context("fork")
    results, ports = ctx.Queue(), ctx.Queue()
    processes = [
        ctx.Process(target=_rank_main, args=(target, r, world, ports, results, args), daemon=True) for r in range(world)
    ]
    for p in processes:
        p.start()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    for _ in range(world):
        ports.put(store.port)
    return processes, results, store


def _rank_main(target, rank: int, world: int, ports, results, args: tuple) -> None:
    target(rank, world, ports.get(timeout=120), *args, results)


def run_case(case: Case, workdir: Path) -> Result:
    """Run ``case`` in a process of its own, bounded by its deadline; the verdict with its exit
    status and seconds."""
    stem = f"{case.section}-{case.name}".replace(" ", "_").replace("/", "_")
    out, log = workdir / f"{stem}.json", workdir / f"{stem}.log"
    process = context().Process(target=_child, args=(case.target, case.kwargs, str(out), str(log), case.env))
    start = time.monotonic()
    process.start()
    process.join(case.deadline_s)
    ended_at = time.monotonic()
    seconds = ended_at - start
    killed = process.is_alive()
    if killed:
        os.kill(process.pid, signal.SIGKILL)
        process.join(10)
    code = process.exitcode
    text = log.read_text(errors="replace") if log.exists() else ""
    value, unreadable = _read_value(out)
    result = Result(case, FAIL, exit=code, seconds=seconds, value=value, log=text[-4000:])
    if killed:
        result.reason = f"still running at its deadline ({case.deadline_s:g} s): killed"
    elif unreadable:
        result.reason = f"its result could not be read ({unreadable}); exit status {code}"
    elif case.judge is not None:
        try:
            result.status, result.reason = _resolve(case.judge)(value, code, seconds, text, ended_at)
        except Exception as error:  # a judge's fault is this case's FAIL, not the end of the report
            result.reason = f"the judge raised {type(error).__name__}: {error}"
    elif code != case.expect_exit:
        result.reason = f"exit status {code}, expected {case.expect_exit}"
    elif value is None:
        result.reason = "the case wrote no result"
    else:
        result.status, result.reason = value.get("status", FAIL), value.get("reason", "")
    if result.status == FAIL and not str(result.reason).strip():
        result.reason = reasonless(value, code)
    return result


def reasonless(value: dict | None, code: int | None) -> str:
    """The reason given to a FAIL whose case or judge gave none: a fault of the check itself, said as such, with
    what the case did return, so that no FAIL in a report is ever without one."""
    keys = ", ".join(sorted(value)) if value else "nothing"
    return f"the case gave FAIL without a reason (a fault in the check): exit status {code}, it returned {keys}"


TAIL_CHARS = 2000
"""How much of a launched run's output (its stdout and stderr, the end) a case keeps for the report."""


def launched(outputs: dict, label: str, code: int | None, output: str) -> dict:
    """Keep a launched run's output tail under ``label`` in ``outputs`` (a case's value's "outputs": the report
    shows them with a FAIL) and print it into the case's own log, so that a run's words are never lost."""
    tail = output[-TAIL_CHARS:]
    outputs[f"{label} (exit status {code})"] = tail
    print(f"--- {label}: exit status {code}; the last {len(tail)} characters of its output:\n{tail}", flush=True)
    return outputs


def _read_value(out: Path) -> tuple[dict | None, str]:
    """The case's JSON value (None when it wrote none) and, when the file cannot be parsed (a process killed
    while writing it), why."""
    if not out.exists():
        return None, ""
    try:
        return json.loads(out.read_text()), ""
    except ValueError as error:
        return None, f"{type(error).__name__}: {error}"


def not_run(case: Case, reason: str) -> Result:
    return Result(case, NOT_RUN, reason)


def exit_text(code: int | None) -> str:
    """An exit status as a shell would print it: -6 (killed by SIGABRT) is 134."""
    if code is None:
        return ""
    if code < 0:
        return f"{128 - code} ({signal.Signals(-code).name})"
    return str(code)


DRY_RUN_RANKS = 2
"""Processes that stand in for devices in the CPU dry run (gloo)."""


@dataclass(frozen=True)
class Context:
    """What the run has and asks: ``device`` "cuda" or "cpu"; ``devices``: GPUs (the dry run:
    ``DRY_RUN_RANKS``); ``ranks``: the most ranks a multi-rank case may use (``--ranks``)."""

    device: str
    devices: int
    ranks: int
    small: bool
    repeats: int
    quick: bool

    @property
    def world(self) -> int:
        return min(self.ranks, self.devices)
