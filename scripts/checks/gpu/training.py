"""Section "training": ``train/main.py`` at world size 1, per precision (bf16 and fp16 on CUDA,
fp32 on the CPU), deterministic kernels on CUDA: an uninterrupted run, and a run killed (SIGKILL)
after its first checkpoint and resumed, which must end with the same ``param_sha256`` (or, where a
kernel has no deterministic variant, the same validation loss within ``VAL_LOSS_TOLERANCE``). At
world size 1 the default ``nccl`` aggregator runs and no CERAR code does: this proves the trainer's
CUDA path and its resume, not CERAR (section "training with CERAR" does). On CUDA also bf16 with
``trainer.overlap=true``: DDP's start-up pass that settles its buckets (``Trainer.settle_ddp_buckets``) on the
device. Expected time on one H200: about 2 minutes (three runs of 100 steps per case, two of them side by side,
each with seconds of start-up; 80 s for the two cases of 2026-12-04)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from scripts.checks.gpu.cases import FAIL, PASS, ROOT, Case, Context, launched, scratch

SECTION = "training"
QUICK = False
EXPECTED_S = 180
PROVES = {
    "resume bf16": "training in bf16 at world size 1: an uninterrupted run and one killed after a checkpoint and "
    "resumed end alike",
    "resume fp16": "training in fp16 at world size 1: killed after a checkpoint and resumed, ends as the "
    "uninterrupted run",
    "resume fp32": "training in fp32 at world size 1 (the CPU): killed after a checkpoint and resumed, ends as the "
    "uninterrupted run",
    "resume bf16 overlap": "training in bf16 with trainer.overlap=true at world size 1: DDP's buckets settled before "
    "the first step on the device (Trainer.settle_ddp_buckets), killed after a checkpoint and resumed, ends as the "
    "uninterrupted run",
}
DETERMINISM_CALLBACK = '''
"""Written by scripts/checks/gpu/training.py: makes a training run's CUDA kernels deterministic (a Hydra callback)."""
from hydra.experimental.callback import Callback


class Deterministic(Callback):
    def on_job_start(self, config, **kwargs):
        import torch

        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.enable_flash_sdp(False)  # the math attention, whose backward has no atomics
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
            torch.backends.cuda.enable_cudnn_sdp(False)
'''
VAL_LOSS_TOLERANCE = 1e-3
"""Relative difference of the final validation loss allowed between the uninterrupted and the killed and
resumed run when their parameters are not bitwise equal (a kernel without a deterministic variant):
rounding differences grow to about 1e-4 over 200 steps of the tiny model (100 here); a resume that lost the
optimizer state, the data position or the RNG moves the loss by more."""


LAUNCH_TIMEOUT_S = 150.0  # one training launch's limit (killed with its process group past it)


def cases(ctx: Context) -> list[Case]:
    precisions = ("bf16", "fp16") if ctx.device == "cuda" else ("fp32",)
    out = [
        Case(
            SECTION,
            f"resume {p}",
            "training:resume",
            {"device": ctx.device, "precision": p, "small": ctx.small},
            3 * LAUNCH_TIMEOUT_S + 50,  # past its three launches' own limits: none is left running when it ends
        )
        for p in precisions
    ]
    if ctx.device == "cuda":  # the overlapped path's start-up pass on the device (on the CPU: tests/test_train_runs.py)
        args = {"device": ctx.device, "precision": "bf16", "small": ctx.small, "overlap": True}
        out.append(Case(SECTION, "resume bf16 overlap", "training:resume", args, 3 * LAUNCH_TIMEOUT_S + 50))
    return out


def _overrides(device: str, precision: str, steps: int) -> list[str]:
    return [
        "model=tiny",
        f"trainer.max_steps={steps}",
        f"trainer.eval_every={steps}",
        "trainer.micro_batch_size=4",
        "trainer.eval_batches=2",
        "data.seq_len=64",
        "trainer.progress_bar=false",
        "wandb.mode=disabled",
        f"trainer.device={device}",
        f"trainer.precision={precision}",
    ]


def python_path(*front, environ=None) -> str:
    """PYTHONPATH with ``front`` (and the repository's root) before what it already holds, which is kept:
    packages installed outside the interpreter's own site-packages (``pip install --target /tmp/site`` and
    ``PYTHONPATH=/tmp/site``, as on a device machine whose image lacks Hydra) must stay importable."""
    environ = os.environ if environ is None else environ
    kept = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    ahead = [str(p) for p in (*front, ROOT)]
    return os.pathsep.join(dict.fromkeys([*ahead, *kept]))


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=python_path())
    return env


def _launch(overrides: list[str], env: dict, nproc: int = 1) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return subprocess.Popen(
        [*command, "train/main.py", *overrides],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


KILL_WAIT_S = 30.0  # for a killed launch's output to end


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` now (Linux's /proc): a launch's agent, workers and their children."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):  # gone meanwhile
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def _kill(process: subprocess.Popen) -> str:
    """SIGKILL a launch and every process below it, and return its output so far. torchrun starts its workers in
    sessions of their own, which the launch's group kill misses: a worker left alive would keep running (on a
    GPU: holding it), and, holding the output pipe, make ``communicate`` wait for ever (a bench on 2 busy cores
    hung so, its worker orphaned in the rendezvous once the agent was gone)."""
    below = descendants(process.pid)  # before the agent dies: then its workers are re-parented
    with contextlib.suppress(OSError):
        os.killpg(process.pid, signal.SIGKILL)
    for pid in below:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    try:
        return process.communicate(timeout=KILL_WAIT_S)[0] or ""
    except subprocess.TimeoutExpired as error:  # a process outside the tree still holds the pipe
        output = error.output or ""
        return output.decode(errors="replace") if isinstance(output, bytes) else output


def _finish(process: subprocess.Popen, timeout_s: float) -> tuple[int, str]:
    """The launch's exit status and output; past ``timeout_s`` it is killed with everything below it (-9)."""
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return -9, _kill(process)
    return process.returncode, output


def resume(
    device: str, precision: str, small: bool, out: str, timeout_s: float = LAUNCH_TIMEOUT_S, overlap: bool = False
) -> dict:
    steps, every = (24, 4) if small else (100, 20)  # small: enough steps after the first checkpoint to kill mid-run
    overrides = [*_overrides(device, precision, steps), f"checkpoint.every={every}"]
    if overlap:  # DDP reduces in backward, its buckets settled before the first step of each launch
        overrides.append("trainer.overlap=true")
        precision_label = f"{precision}, overlap"
    else:
        precision_label = precision
    env = _env()
    workdir = scratch(out)
    if device == "cuda":  # deterministic kernels, so that a resumed run can end bit for bit where the other did
        (workdir / "gpu_check_determinism.py").write_text(DETERMINISM_CALLBACK)
        env.update(CUBLAS_WORKSPACE_CONFIG=":4096:8", PYTHONPATH=python_path(workdir))
        overrides.append("+hydra.callbacks.deterministic._target_=gpu_check_determinism.Deterministic")
    name = f"{precision}_overlap" if overlap else precision
    full_dir, killed_dir = workdir / f"full_{name}", workdir / f"killed_{name}"
    outputs: dict[str, str] = {}  # every launch's output tail: shown with a FAIL (report.failure)
    row = {"precision": precision_label, "steps": steps, "outputs": outputs}

    # the uninterrupted run and the one to be killed start together (independent runs of one seed: the device and the
    # host's cores are shared, the arithmetic is not), so the section costs two launches' time, not three
    uninterrupted = _launch([*overrides, f"hydra.run.dir={full_dir}"], env)
    process = _launch([*overrides, f"hydra.run.dir={killed_dir}"], env)
    # the checksum is written after the checkpoint's rename: once it exists the checkpoint is whole (a kill
    # between the two leaves one that resume rightly ignores, and the check would fail on a race of its own)
    first = killed_dir / "checkpoints" / f"step-{every:08d}.pt.sha256"
    deadline = time.monotonic() + timeout_s
    while not first.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    killed_at = None
    if process.poll() is None:
        # torchrun may start its worker in a session of its own: kill the worker by its pid file, then the agent
        with contextlib.suppress(OSError, ValueError):
            os.kill(int((killed_dir / "pids" / "rank0.pid").read_text()), signal.SIGKILL)
        launched(outputs, "the run killed after its first checkpoint", -9, _kill(process))
        killed_at = every
    else:
        launched(outputs, "the run to be killed (it ended first)", process.returncode, process.communicate()[0] or "")
    code, output = _finish(uninterrupted, timeout_s)
    launched(outputs, "the uninterrupted run", code, output)
    if code != 0:
        return {**row, "status": FAIL, "reason": f"uninterrupted run exited {code}"}
    full = json.loads((full_dir / "summary.json").read_text())
    if killed_at is None or (killed_dir / "summary.json").exists():
        return {**row, "status": FAIL, "reason": "the run ended before it could be killed after its first checkpoint"}
    code, output = _finish(_launch([*overrides, f"hydra.run.dir={killed_dir}"], env), timeout_s)
    launched(outputs, "the resumed run", code, output)
    if code != 0:
        return {**row, "status": FAIL, "reason": f"resumed run exited {code}"}
    resumed = json.loads((killed_dir / "summary.json").read_text())
    bitwise = resumed["param_sha256"] == full["param_sha256"]
    loss, resumed_loss = full.get("final_val_loss"), resumed.get("final_val_loss")
    close = loss is not None and resumed_loss is not None and abs(resumed_loss - loss) <= VAL_LOSS_TOLERANCE * abs(loss)
    ok = (bitwise or close) and resumed.get("resumed_from_step")
    return {
        **row,
        "resumed_from": resumed.get("resumed_from_step"),
        "full_sha": full["param_sha256"][:16],
        "resumed_sha": resumed["param_sha256"][:16],
        "val_loss": loss,
        "resumed_val_loss": resumed_loss,
        "bitwise": bitwise,
        "status": PASS if ok else FAIL,
        "reason": "" if ok else "the resumed run did not end where the uninterrupted one did",
    }


def report(results) -> list[str]:
    lines = []
    resumed = [r for r in results if r.case.name.startswith("resume") and r.value]
    if resumed:
        lines += [
            "| precision | steps | resumed from | param_sha256 uninterrupted | param_sha256 killed + resumed "
            "| bitwise | final val loss (resumed) | result |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in resumed:
            t = r.value
            lines.append(
                f"| {t['precision']} | {t.get('steps', '')} | {t.get('resumed_from', '')} | {t.get('full_sha', '')} "
                f"| {t.get('resumed_sha', '')} | {t.get('bitwise', '')} | {t.get('val_loss', '')} "
                f"({t.get('resumed_val_loss', '')}) | {t['status']} |"
            )
        lines.append("")
    return lines
