"""Chaos run: a short training job under `torchrun --max-restarts=R+1` in which R faults hit random ranks at
random steps (SIGKILL: the rank dies; SIGSTOP: it stops answering, the others must fail within
`trainer.collective_timeout_s`, then the stopped process is killed as a dead node would be). Reports the
restarts, the steps lost to each fault (steps redone after the restart: the step reached when the fault hit
minus the checkpoint resumed from) and whether the final `param_sha256` equals a clean run's. The one spare restart
is for a start-up that a loaded machine makes miss a peer's deadline (`chaos_run`).

    .venv/bin/python scripts/checks/chaos.py --faults 3 --seed 1            # table on stdout
    .venv/bin/python scripts/checks/chaos.py --faults 3 --seed 1 --drift --report reports/reliability.md

`--drift` adds the replica-drift table of CERAR with c > N for trainer.resync_every in {0, 10, 50}.
Every worker's output is kept in <work>/*.log. A testing tool: small model, CPU, gloo.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- end of scripts/checks/chaos.py output; what follows is kept when the report is rebuilt -->"

JOB = [
    "model=tiny",
    "data.seq_len=32",
    "trainer.micro_batch_size=4",
    "trainer.eval_every=10",
    "trainer.eval_batches=2",
    "trainer.drift_every=0",
    "trainer.progress_bar=false",
    "wandb.mode=disabled",
]


@dataclass
class Fault:
    kind: str  # kill | stop
    step: int  # planned: signal once this step is logged
    rank: int
    hit_step: int = -1  # the last step logged when the signal was sent
    resumed_from: int = -1  # the newest checkpoint then: where the restart resumes
    detect_s: float | None = None  # stop: seconds until the first other rank exited with an error
    log_offset: int = 0  # the job log's length when the signal was sent: its restart's lines follow

    @property
    def steps_lost(self) -> int:
        return self.hit_step - self.resumed_from


@dataclass
class ChaosResult:
    faults: list[Fault]
    returncode: int
    restarts: int | None
    sha: str | None
    clean_sha: str | None
    final_step: int | None
    wall_s: float
    collective_errors: list[str] = field(default_factory=list)  # the lines that ended the faults' attempts
    startup_misses: int = 0  # attempts no fault ended that failed at start-up (`attempts`): the spare's use
    startup_errors: list[str] = field(default_factory=list)  # their lines
    unexplained: list[str] = field(default_factory=list)  # attempts no fault ended, failed after start-up

    @property
    def sha_equal(self) -> bool:
        return self.sha is not None and self.sha == self.clean_sha


AGENT_FAILED = re.compile(rb"^[^\n]*\] failed \(exitcode: (-?\d+)\) local_rank: \d+ \(pid: \d+\)[^\n]*\n?", re.M)
"""The agent's line for a failed attempt: torch's `SubprocessContext._poll` (torch/distributed/elastic/
multiprocessing/api.py) logs "failed (exitcode: ...)" once per failed attempt, for its first failure."""
ENDED = ("error: collective", "error: host watchdog")  # the poll's line, or the host watchdog's (train/watchdog.py)


def attempts(data: bytes) -> list[tuple[int, int, str]]:
    """The job log cut at the agent's failure lines: (start, end, text) of each failed attempt."""
    out, start = [], 0
    for match in AGENT_FAILED.finditer(data):
        out.append((start, match.end(), data[start : match.start()].decode(errors="replace")))
        start = match.end()
    return out


def error_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if any(words in line for words in ENDED)]


def failed_at_startup(text: str) -> bool:
    """An attempt that ended in its start-up: its error lines all name a start-up phase (`set_phase`'s names begin
    with "start-up"), or it printed none and rank 0 never reached its model line (the group's rendezvous raised)."""
    lines = error_lines(text)
    if lines:
        return all("(phase: start-up" in line for line in lines)
    return " parameters; " not in text  # train/run.py's "model <name>: <count> parameters; <N> ranks on ..."


def _env(cache: Path | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    if cache is not None:
        env["CERAR_PYTHIA_CACHE"] = str(cache)
    return env


def torchrun_cmd(nproc: int, max_restarts: int, overrides: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.5",
        str(ROOT / "train" / "main.py"),
        *overrides,
    ]


def _last_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    last = 0
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError, KeyError):
            last = max(last, json.loads(line)["step"])
    return last


def _newest_checkpoint(run_dir: Path) -> int:
    steps = [int(p.name[5:13]) for p in (run_dir / "checkpoints").glob("step-*.pt.sha256")]
    return max(steps, default=0)


def _pids(run_dir: Path, nproc: int) -> dict[int, int] | None:
    pids = {}
    for r in range(nproc):
        try:
            pids[r] = int((run_dir / "pids" / f"rank{r}.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
    return pids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):  # a zombie or a stopped process is not "alive and answering"
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    return True


def run_job(run_dir: Path, nproc: int, overrides: list[str], cache: Path | None, log: Path, max_restarts: int = 0):
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        return subprocess.Popen(
            torchrun_cmd(nproc, max_restarts, [*overrides, f"hydra.run.dir={run_dir}"]),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=_env(cache),
            cwd=ROOT,
            start_new_session=True,  # one process group: the finally below can end everything it started
        )


def _end(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        proc.wait(10)


def clean_run(work: Path, nproc: int, overrides: list[str], cache: Path | None, timeout_s: float = 600) -> dict:
    run_dir = work / "clean"
    proc = run_job(run_dir, nproc, overrides, cache, work / "clean.log")
    try:
        proc.wait(timeout_s)
    finally:
        _end(proc)
    if proc.returncode != 0:
        raise RuntimeError(f"the clean run failed (exit {proc.returncode}); see {work / 'clean.log'}")
    return json.loads((run_dir / "summary.json").read_text())


def plan_faults(rng: random.Random, count: int, max_steps: int, nproc: int, kinds: list[str]) -> list[Fault]:
    """`count` faults at distinct random steps at least 3 apart, each on a random rank."""
    candidates = list(range(3, max_steps - 1))
    for _ in range(1000):
        steps = sorted(rng.sample(candidates, count))
        if all(b - a >= 3 for a, b in zip(steps, steps[1:], strict=False)):
            break
    else:
        raise ValueError(f"cannot place {count} faults 3 steps apart in {max_steps} steps")
    return [Fault(rng.choice(kinds), s, rng.randrange(nproc)) for s in steps]


def chaos_run(
    work: Path,
    nproc: int,
    overrides: list[str],
    faults: list[Fault],
    cache: Path | None,
    clean_sha: str | None,
    timeout_s: float = 900,
    spare_restarts: int = 1,
) -> ChaosResult:
    """Run the job with max_restarts=len(faults) + spare_restarts, delivering each fault once its step is logged.

    The spare is for a restart no fault caused: at a short collective timeout T, a rank that builds its data and
    model more than 2T after its peer on a loaded machine is ended at start-up by the peer's deadline, as the
    trainer promises, and torchrun starts the group again. `ChaosResult.restarts` counts every restart; the log, cut
    into attempts at the agent's failure lines (`attempts`), says which a fault ended (`collective_errors`: their
    lines), which failed at start-up (`startup_misses`) and which neither (`unexplained`: a fault of the trainer)."""
    run_dir, log = work / "chaos", work / "chaos.log"
    start = time.monotonic()
    proc = run_job(run_dir, nproc, overrides, cache, log, max_restarts=len(faults) + spare_restarts)
    try:
        stale_step, seen = -1, set()  # stale_step: last step of the previous attempt (still in metrics.jsonl)
        for fault in faults:
            fault.step = max(fault.step, stale_step + 1)
            while True:
                if proc.poll() is not None or time.monotonic() - start > timeout_s:
                    raise RuntimeError(f"the job ended or hung before the fault at step {fault.step}; see {log}")
                pids = _pids(run_dir, nproc)
                fresh = pids is not None and not (set(pids.values()) & seen) and all(map(_alive, pids.values()))
                if fresh and _last_step(run_dir) >= fault.step:
                    break
                time.sleep(0.02)
            victim = pids[fault.rank]
            os.kill(victim, signal.SIGKILL if fault.kind == "kill" else signal.SIGSTOP)
            hit = time.monotonic()
            fault.hit_step, fault.resumed_from = _last_step(run_dir), _newest_checkpoint(run_dir)
            fault.log_offset = log.stat().st_size if log.exists() else 0
            seen |= set(pids.values())
            if fault.kind == "stop":
                others = [p for r, p in pids.items() if r != fault.rank]
                while all(map(_alive, others)) and time.monotonic() - hit < timeout_s:
                    time.sleep(0.05)
                fault.detect_s = time.monotonic() - hit
                os.kill(victim, signal.SIGKILL)  # the stalled node is reaped (torchrun would, after its grace)
            while any(map(_alive, pids.values())) and time.monotonic() - hit < timeout_s:
                time.sleep(0.05)  # the old attempt is gone: the steps in metrics.jsonl are final until the resume
            stale_step = _last_step(run_dir)
        proc.wait(max(1.0, timeout_s - (time.monotonic() - start)))
    finally:
        _end(proc)
        for pid in (_pids(run_dir, nproc) or {}).values():  # nothing left behind, not even a stopped rank
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    data = log.read_bytes()
    errors, startup_errors, unexplained, misses = [], [], [], 0
    for begin, end, text in attempts(data):  # each failed attempt: ended by a fault, or a start-up miss, or neither
        if any(begin <= f.log_offset < end for f in faults):
            errors += error_lines(text)
        elif failed_at_startup(text):
            misses += 1
            startup_errors += error_lines(text)
        else:
            unexplained += error_lines(text) or [text.strip().splitlines()[-1][:400] if text.strip() else "(no output)"]
    for fault in faults:  # the checkpoint the restart after each fault actually loaded: the first resume after it
        after = data[fault.log_offset :].decode(errors="replace")
        resumed = re.search(r"resumed from \S+ \(step (\d+)\)", after)
        if resumed:
            fault.resumed_from = int(resumed.group(1))
    return ChaosResult(
        faults=faults,
        returncode=proc.returncode,
        restarts=summary.get("restarts"),
        sha=summary.get("param_sha256"),
        clean_sha=clean_sha,
        final_step=summary.get("final_step"),
        wall_s=time.monotonic() - start,
        collective_errors=errors,
        startup_misses=misses,
        startup_errors=startup_errors,
        unexplained=unexplained,
    )


def drift_table(work: Path, nproc: int, c: int, steps: int, cache: Path | None) -> list[dict]:
    """CERAR with c > N: drift/max_abs every 5 steps without resync and with resync every 10 and 50 steps."""
    out = work / "drift"
    runs = [f"resync{k}: aggregator=cerar c={c} trainer.resync_every={k}" for k in (0, 10, 50)]
    common = [*JOB, f"trainer.max_steps={steps}", "trainer.drift_every=5", "checkpoint.every=0", "trainer.eval_every=0"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    with open(work / "drift.log", "w") as log:
        subprocess.run(
            [*cmd, str(ROOT / "train" / "sweep.py"), str(out), *runs, "--", *common],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_env(cache),
            cwd=ROOT,
            check=True,
            timeout=1200,
        )
    rows = []
    for k in (0, 10, 50):
        records = [json.loads(line) for line in (out / f"resync{k}" / "metrics.jsonl").read_text().splitlines()]
        drift = [r["drift/max_abs"] for r in records if "drift/max_abs" in r]
        summary = json.loads((out / f"resync{k}" / "summary.json").read_text())
        rows.append(
            {
                "resync_every": k,
                "drift_max": max(drift),
                "drift_mean": sum(drift) / len(drift),
                "drift_final": drift[-1],
                "ranks_equal_at_end": len(set(summary["param_sha256_per_rank"])) == 1,
                "final_val_loss": summary["final_val_loss"],
            }
        )
    return rows


def render(args, result: ChaosResult, drift: list[dict] | None) -> str:
    lines = [
        "# Reliability: chaos runs and replica drift",
        "",
        "Produced by `scripts/checks/chaos.py` (CPU, gloo, torchrun; model=tiny). Command:",
        "",
        "```",
        f".venv/bin/python scripts/checks/chaos.py --faults {args.faults} --seed {args.seed} --nproc {args.nproc} "
        f"--steps {args.steps} --checkpoint-every {args.checkpoint_every} --timeout {args.timeout:g}"
        + (f" --drift --drift-c {args.drift_c} --drift-steps {args.drift_steps}" if drift is not None else "")
        + " --report reports/reliability.md",
        "```",
        "",
        f"## Chaos: {len(result.faults)} faults, `aggregator=ring` (exact), N={args.nproc}, {args.steps} steps, "
        f"`checkpoint.every={args.checkpoint_every}`, `trainer.collective_timeout_s={args.timeout:g}`",
        "",
        "| # | fault | rank | step when hit | resumed from checkpoint | steps lost | another rank failed after |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for i, f in enumerate(result.faults, 1):
        detect = f"{f.detect_s:.1f} s" if f.detect_s is not None else "- (death seen at once)"
        kind = "SIGKILL" if f.kind == "kill" else "SIGSTOP"
        lines.append(f"| {i} | {kind} | {f.rank} | {f.hit_step} | {f.resumed_from} | {f.steps_lost} | {detect} |")
    lost = sum(f.steps_lost for f in result.faults)
    lines += [
        "",
        f"- exit status {result.returncode}; restarts (torchrun, from summary.json): {result.restarts}; "
        f"final step {result.final_step}; steps lost in all: {lost}; wall {result.wall_s:.0f} s; restarts no fault "
        f"caused: {result.startup_misses} at start-up, {len(result.unexplained)} after it",
        f"- final `param_sha256` {result.sha}",
        f"- clean run's            {result.clean_sha}",
        f"- **equal: {'yes' if result.sha_equal else 'NO'}**",
        f"- collective errors reported by the surviving ranks ({len(result.collective_errors)}), e.g.:",
    ]
    lines += [f"  - `{e[:400]}`" for e in result.collective_errors[:4]]
    if drift is not None:
        lines += [
            "",
            f"## Replica drift: `aggregator=cerar c={args.drift_c}`, N={args.nproc} (c > N), {args.drift_steps} steps",
            "",
            "`drift/max_abs` = max over ranks of max |theta_rank - theta_0|, measured every 5 steps (after any resync "
            "of that step).",
            "",
            "| trainer.resync_every | max drift | mean drift | drift at the end | all ranks' param_sha256 equal at the "
            "end | final val loss |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for row in drift:
            k = row["resync_every"]
            lines.append(
                f"| {k if k else '0 (off)'} | {row['drift_max']:.3g} | {row['drift_mean']:.3g} | "
                f"{row['drift_final']:.3g} | {'yes' if row['ranks_equal_at_end'] else 'no'} | "
                f"{row['final_val_loss']:.4f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--faults", type=int, default=3, help="R: faults delivered (torchrun gets R + 1 restarts: one spare)"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=10.0, help="trainer.collective_timeout_s")
    parser.add_argument("--kinds", default="kill,stop", help="fault kinds to draw from")
    parser.add_argument("--aggregator", default="ring", help="an exact one: ring or nccl")
    parser.add_argument("--work", type=Path, default=None, help="working folder (default: a temporary one)")
    parser.add_argument("--cache", type=Path, default=None, help="token cache (default: data.cache_dir)")
    parser.add_argument("--drift", action="store_true", help="also measure CERAR drift vs trainer.resync_every")
    parser.add_argument("--drift-c", type=int, default=4)
    parser.add_argument("--drift-steps", type=int, default=150)
    parser.add_argument("--report", type=Path, default=None, help="write the Markdown report here")
    args = parser.parse_args(argv)

    work = args.work or Path(tempfile.mkdtemp(prefix="chaos-"))
    overrides = [
        *JOB,
        f"aggregator={args.aggregator}",
        f"trainer.max_steps={args.steps}",
        f"checkpoint.every={args.checkpoint_every}",
        f"trainer.collective_timeout_s={args.timeout}",
    ]
    faults = plan_faults(random.Random(args.seed), args.faults, args.steps, args.nproc, args.kinds.split(","))
    print(f"work folder {work}; faults planned: {[asdict(f) for f in faults]}", flush=True)
    clean = clean_run(work, args.nproc, overrides, args.cache)
    result = chaos_run(work, args.nproc, overrides, faults, args.cache, clean["param_sha256"])
    drift = drift_table(work, args.nproc, args.drift_c, args.drift_steps, args.cache) if args.drift else None
    text = render(args, result, drift)
    print(text)
    if args.report is not None:  # keep the hand-written part of an existing report (after the marker)
        old = args.report.read_text() if args.report.exists() else ""
        kept = old[old.index(MARKER) :] if MARKER in old else MARKER + "\n"
        args.report.write_text(text + "\n" + kept)
    return 0 if result.sha_equal and result.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
