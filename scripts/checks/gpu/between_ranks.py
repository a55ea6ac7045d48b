"""Section "between ranks": the protocol, the DDP hook and a stalled peer, one rank per device on
NCCL (the CPU dry run: two gloo processes), TF32 switched on.

- protocol: ``cerar.all_reduce`` and ``cerar.ring_all_reduce``, every rank's result within the
  rounding bound of the exact sum plus the code's error, bytes as the rate table; median times per
  call against torch's all_reduce (measured);
- hook: DDP with the CERAR hook (its own thread, stream and group), every bucket judged;
- stall: the last rank stops (SIGSTOP) between two calls; every other rank's next call, inside the
  trainer's ``train.distributed.guarded``, must raise within the timeout plus ``STALL_SLACK_S`` and
  leave through the trainer's real exit path, ``train.distributed.exit_after_collective_failure``
  (torch's abort of every group, one ``error:`` line on stderr, exit status 3): the verdict holds
  the exit status, the line and the seconds, and records how long the abort took.

Needs two devices: with one, NOT RUN (a one-rank group exchanges no message; the self-loop
section proves what one GPU can). Expected time on 2-8 H200s: about 60 s."""

from __future__ import annotations

import io
import os
import queue
import signal
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch

import cerar
from scripts.checks.gpu.cases import FAIL, PASS, TAIL_CHARS, Case, Context, Needs
from scripts.checks.gpu.judge import judge_coded, judge_sum, synchronize

SECTION = "between ranks"
QUICK = False
EXPECTED_S = 60
PROTOCOL_CASES = [("exact", 1), ("perturbation", 2)]
"""(construction, c as a multiple of N) for N ranks: the exact code (c = N), and c = 2N with
eps = 0.05, where kappa is about 100, so the rounding bound (about 1e-5) has teeth."""
HOOK_CASE = ("perturbation", 2)
STALL_TIMEOUT_S = {"cuda": 5.0, "cpu": 2.0}
STALL_SLACK_S = 5.0
"""What a survivor may take beyond the timeout to raise: the rounds before the stall, enqueueing a
look-behind window, the poll's pause, and building the message (measured: well under a second)."""
EXIT_WAIT_S = 20.0
"""How long a survivor may take from its error to its exit: ``ABORT_WAIT_S`` (10 s) at most for
torch's abort, then one line and ``os._exit``."""

PROVES = {
    "protocol, hook, stall": "between ranks, one per device (NCCL; the dry run: gloo): cerar.all_reduce and "
    "ring_all_reduce and the DDP hook within the rounding bound of the exact sum plus the code's error "
    "(bytes as the rate table); a rank stopped (SIGSTOP): every other rank raised within the timeout plus "
    "the slack and ended through the trainer's exit path (exit status 3, one line)",
}


def cases(ctx: Context) -> list[Case]:
    options = {
        "stall": True,
        "stall_timeout_s": STALL_TIMEOUT_S[ctx.device],
        "timing_d": 2**16 if ctx.small else 2**24,
        "repeats": 1 if ctx.small else ctx.repeats,
    }
    kwargs = {"device": ctx.device, "world": ctx.world, "d": 1000 if ctx.small else 2**20 + 3, "options": options}
    return [Case(SECTION, "protocol, hook, stall", "between_ranks:run", kwargs, 600, Needs(ranks=2))]


def _gradients(N: int, d: int, seed: int) -> torch.Tensor:
    return torch.randn(N, d, generator=torch.Generator().manual_seed(seed))


def _code(N: int, construction: str, multiple: int) -> cerar.Code:
    return cerar.make_code(N, multiple * N, construction, eps=0.05 if construction == "perturbation" else None)


class _Captured:
    def __init__(self, state):
        self.state, self.inputs, self.results = state, [], []


def _capturing_hook(captured, bucket):
    from cerar.ddp import cerar_hook

    captured.inputs.append(bucket.buffer().detach().cpu().clone())

    def keep(future):
        captured.results.append(future.value().detach().cpu().clone())
        return future.value()

    return cerar_hook(captured.state, bucket).then(keep)


def _timings(device: torch.device, world: int, d: int, repeats: int) -> dict:
    """Median seconds per call of CERAR (c = 2N), the exact ring and torch's all_reduce on d values,
    and CERAR's ``seconds_comm`` (on CUDA: the time the compute stream waited for transfers) and
    encode + decode seconds."""
    import torch.distributed as dist

    code = _code(world, *HOOK_CASE)
    tensor = torch.randn(d, device=device)
    samples: dict[str, list[float]] = {"cerar": [], "ring": [], "torch": [], "cerar_comm": [], "cerar_arith": []}
    for _ in range(repeats + 1):  # the first call of each is a warm-up
        for name, call in (
            ("cerar", lambda: cerar.all_reduce(tensor, code, op="avg", timeout=60)),
            ("ring", lambda: cerar.ring_all_reduce(tensor, op="avg", timeout=60)),
            ("torch", lambda: dist.all_reduce(tensor)),
        ):
            dist.barrier()
            synchronize(device)
            start = time.perf_counter()
            stats = call()
            synchronize(device)
            samples[name].append(time.perf_counter() - start)
            if name == "cerar":
                samples["cerar_comm"].append(stats.seconds_comm)
                samples["cerar_arith"].append(stats.seconds_encode + stats.seconds_decode)
    return {name: sorted(values[1:])[len(values[1:]) // 2] for name, values in samples.items()}


def _rank(rank: int, world: int, port: int, backend: str, d: int, options: dict, logdir: str, results) -> None:
    """One rank: on CUDA its own device, cuda:<rank>; its stderr in ``logdir/rank<r>.err``. Reports
    ("ok", results), then takes part in the stall (``_stall``)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

    from cerar.ddp import CerarHookState

    fd = os.open(Path(logdir) / f"rank{rank}.err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    try:
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
            from train.distributed import configure_nccl_watchdog

            configure_nccl_watchdog()  # as the trainer: before the groups are made
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
        dist.init_process_group(
            backend,
            store=dist.PrefixStore("gpu-check/", store),
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=120),
            device_id=device if device.type == "cuda" else None,
        )
        torch.set_float32_matmul_precision("high")  # TF32 on: CERAR's products must not use it
        out = {"protocol": [], "hook": None, "timings": None}
        for k, (construction, multiple) in enumerate(PROTOCOL_CASES):
            code = _code(world, construction, multiple)
            G = _gradients(world, d, seed=k)
            mine = G[rank].clone().to(device)
            stats = cerar.all_reduce(mine, code, timeout=60)
            ring = G[rank].clone().to(device)
            ring_stats = cerar.ring_all_reduce(ring, timeout=60)
            out["protocol"].append((mine.cpu(), int(stats.bytes_sent), ring.cpu(), int(ring_stats.bytes_sent)))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1)).to(device)
        ddp = DDP(model, device_ids=[rank] if device.type == "cuda" else None, bucket_cap_mb=0.05)
        hook_code = _code(world, *HOOK_CASE)
        captured = _Captured(
            CerarHookState(c=hook_code.c, construction=hook_code.construction, eps=hook_code.eps, timeout=60)
        )
        ddp.register_comm_hook(captured, _capturing_hook)
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(rank)).to(device)
        for _ in range(3):
            ddp.zero_grad()
            ddp(x).square().mean().backward()
        synchronize(device)
        out["hook"] = (captured.inputs, captured.results)
        if options["timing_d"]:
            out["timings"] = _timings(device, world, options["timing_d"], options["repeats"])
        buffer = io.BytesIO()  # plain bytes: tensors must not travel as shared memory of an exiting process
        torch.save(out, buffer)
        results.put((rank, "ok", buffer.getvalue()))
        if options["stall"]:
            _stall(rank, world, device, store, options["stall_timeout_s"], results)
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    results.close()
    results.join_thread()
    os._exit(1)  # not reached by a survivor of the stall, which leaves through exit_after_collective_failure


def _stall(rank: int, world: int, device: torch.device, store, timeout_s: float, results) -> None:
    """The last rank stops (SIGSTOP) between two calls; every other rank's next call, inside the
    trainer's ``guarded``, must raise within the timeout plus ``STALL_SLACK_S``. Survivors report
    (message, seconds, the monotonic clock at the error), then leave as the trainer does:
    ``exit_after_collective_failure`` (abort every group, one line, exit 3)."""
    from train.distributed import exit_after_collective_failure, guarded

    victim = world - 1
    code = _code(world, *HOOK_CASE)
    tensor = torch.ones(2**20 + 3, device=device)
    with guarded("cerar.all_reduce before the stall"):  # connected, agreed and in every rank's heartbeat
        cerar.all_reduce(tensor, code, timeout=timeout_s)
    synchronize(device)
    store.set(f"stall/ready/{rank}", "1")
    if rank == victim:
        store.wait([f"stall/ready/{r}" for r in range(world)], timedelta(seconds=60))
        # This rank's results, sent by the queue's feeder thread, must be in the pipe before it stops: a message
        # cut off by SIGSTOP would hold the parent in mid-read, and the queue's lock from the other ranks, forever.
        results.close()
        results.join_thread()
        os.kill(os.getpid(), signal.SIGSTOP)
    store.wait([f"stall/ready/{victim}"], timedelta(seconds=60))
    start = time.monotonic()
    try:
        with guarded("cerar.all_reduce (gpu check stall)"):
            cerar.all_reduce(tensor, code, timeout=timeout_s)
            synchronize(device)
    except Exception as error:  # the trainer's path: TrainCollectiveError from guarded
        results.put((rank, "stall", (f"{type(error).__name__}: {error}", time.monotonic() - start, time.monotonic())))
        results.close()
        results.join_thread()  # the report is in the pipe before the exit path's os._exit
        exit_after_collective_failure(error)
    results.put((rank, "stall", ("no error", time.monotonic() - start, time.monotonic())))


def run_processes(world: int, backend: str, d: int, options: dict, timeout_s: float, logdir: Path) -> dict:
    """Run ``_rank`` on ``world`` processes; {rank: {"ok": value, "stall": value, "exit": (status,
    monotonic time seen), "stderr": text}} or {rank: {"error": text}} (``cases.start_ranks``)."""
    from scripts.checks.gpu.cases import start_ranks

    processes, results, store = start_ranks(_rank, world, (backend, d, options, str(logdir)))  # store: held
    wanted = {(r, "ok") for r in range(world)} | (
        {(r, "stall") for r in range(world - 1)} if options["stall"] else set()
    )
    collected: dict[int, dict] = {r: {} for r in range(world)}
    deadline = time.monotonic() + timeout_s
    try:
        while wanted and time.monotonic() < deadline:
            try:
                rank, status, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                break
            if status == "ok":
                value = torch.load(io.BytesIO(value), weights_only=False)
            collected[rank][status] = value
            wanted.discard((rank, status))
            if status == "error":
                break
        survivors = processes[:-1] if options["stall"] else processes
        end = time.monotonic() + EXIT_WAIT_S
        while any(p.exitcode is None for p in survivors) and time.monotonic() < end:
            for r, p in enumerate(survivors):
                if p.exitcode is not None and "exit" not in collected[r]:
                    collected[r]["exit"] = (p.exitcode, time.monotonic())
            time.sleep(0.01)
        for r, p in enumerate(survivors):
            if p.exitcode is not None and "exit" not in collected[r]:
                collected[r]["exit"] = (p.exitcode, time.monotonic())
    finally:
        for p in processes:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)
    for r in range(world):
        err = logdir / f"rank{r}.err"
        collected[r]["stderr"] = err.read_text(errors="replace") if err.exists() else ""
    for rank, status in sorted(wanted):
        collected[rank].setdefault("error", f"rank {rank} did not report {status!r} within {timeout_s:g}s")
    return collected


def judge_processes(collected: dict, world: int, d: int) -> tuple[list[dict], dict]:
    """Each rank's protocol and ring results, and each hook bucket, held to the exact sum of the
    ranks' inputs within a bound derived from the code (``judge_coded``, ``judge_sum``)."""
    protocol = []
    for k, (construction, multiple) in enumerate(PROTOCOL_CASES):
        code = _code(world, construction, multiple)
        G = _gradients(world, d, seed=k)
        per_rank = [collected[r]["ok"]["protocol"][k] for r in range(world)]
        coded = judge_coded(torch.stack([p[0] for p in per_rank]), G, code, torch.float32)
        ring = judge_sum(torch.stack([p[2] for p in per_rank]), G, torch.float32)
        bytes_ok = all(
            sent == code.L * code.m_for(d) * 4 and ring_sent == 2 * (world - 1) * -(-d // world) * 4
            for _, sent, _, ring_sent in per_rank
        )
        protocol.append(
            {
                "c": code.c,
                "construction": construction,
                "kappa": code.kappa,
                **coded,
                "ring": ring["deviation"],
                "ring_bound": ring["bound"],
                "bytes": bytes_ok,
                "status": PASS if coded["ok"] and ring["ok"] and bytes_ok else FAIL,
            }
        )
    inputs = [collected[r]["ok"]["hook"][0] for r in range(world)]
    outputs = [collected[r]["ok"]["hook"][1] for r in range(world)]
    code = _code(world, *HOOK_CASE)
    buckets = len(inputs[0])
    judged = [
        judge_coded(
            torch.stack([outputs[r][k] for r in range(world)]),
            torch.stack([inputs[r][k] for r in range(world)]),
            code,
            torch.float32,
            scale=1.0 / world,
        )
        for k in range(buckets)
    ]
    hook = {
        "buckets": buckets,
        "c": code.c,
        "kappa": code.kappa,
        "error": max((j["error"] for j in judged), default=float("nan")),
        "deviation": max((j["deviation"] for j in judged), default=float("nan")),
        "bound": cerar.ring.precision.rounding_bound(code, torch.float32),
        "status": PASS if buckets and all(j["ok"] for j in judged) else FAIL,
    }
    return protocol, hook


def error_line(stderr: str) -> str:
    """The exit path's one line (``error: ...``), the last such line of a rank's stderr."""
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    return lines[-1] if lines else ""


def judge_stall(collected: dict, world: int, timeout_s: float) -> dict:
    """PASS when every survivor raised within the timeout plus ``STALL_SLACK_S``, then ended with exit
    status 3 and one ``error:`` line naming the collective (the trainer's exit path); the abort's
    duration (the error to the exit, as seen by this process's 10 ms polling) is recorded."""
    rows = []
    for r in range(world - 1):
        message, seconds, raised_at = collected[r].get("stall", ("did not report", float("nan"), float("nan")))
        status, exited_at = collected[r].get("exit", (None, float("nan")))
        line = error_line(collected[r].get("stderr", ""))
        ok = (
            message.startswith("TrainCollectiveError")
            and "CollectiveError" in line
            and "gpu check stall" in line
            and seconds <= timeout_s + STALL_SLACK_S
            and status == 3
        )
        rows.append(
            {"rank": r, "seconds": seconds, "exit": status, "abort_s": exited_at - raised_at, "line": line, "ok": ok}
        )
    return {
        "victim": world - 1,
        "timeout": timeout_s,
        "rows": rows,
        "status": PASS if all(x["ok"] for x in rows) else FAIL,
    }


def run(device: str, world: int, d: int, options: dict, out: str) -> dict:
    """The section on ``world`` ranks, one per device; judged here, from what the ranks returned."""
    backend = "nccl" if device == "cuda" else "gloo"
    logdir = Path(out).with_suffix(".ranks")
    logdir.mkdir(exist_ok=True)
    collected = run_processes(world, backend, d, options, 500, logdir)
    errors = {r: v["error"] for r, v in collected.items() if "error" in v}
    result = {"world": world, "backend": backend, "errors": {str(k): v[-2000:] for k, v in errors.items()}}
    # the rank processes' stderr (their own words: tracebacks, the exit path's line), shown with a FAIL
    result["outputs"] = {f"rank {r}'s stderr": v["stderr"][-TAIL_CHARS:] for r, v in collected.items() if v["stderr"]}
    if any("ok" not in collected[r] for r in range(world)):
        return {**result, "status": FAIL, "reason": "a rank failed before the judged calls ended"}
    protocol, hook = judge_processes(collected, world, d)
    result.update(protocol=protocol, hook=hook, timings=collected[0]["ok"]["timings"])
    result["stall"] = judge_stall(collected, world, options["stall_timeout_s"])
    verdicts = {
        "protocol": all(r["status"] == PASS for r in protocol),
        "hook": hook["status"] == PASS,
        "stall": result["stall"]["status"] == PASS,
    }
    failed = [name for name, ok in verdicts.items() if not ok]
    return {**result, "status": FAIL if failed else PASS, "reason": f"failed: {', '.join(failed)}" if failed else ""}


def report(results) -> list[str]:
    lines = []
    for r in results:
        v = r.value or {}
        for rank, text in sorted(v.get("errors", {}).items()):
            lines += [f"rank {rank} failed:", "", "```", text, "```", ""]
        if "protocol" not in v:
            continue
        lines += [
            f"Ran on {v['world']} ranks, {v['backend']}, one per device. Every rank's result against the exact sum of "
            "the ranks' inputs: CERAR's error, and its deviation from the code's exact-arithmetic result relative to "
            "||G||_F within kappa * 2^-24 * (sqrt(c + L) + N); the exact ring's deviation within the rounding of a "
            "sum of N values, ((N-1) sqrt(N) + 1) 2^-24.",
            "",
            "| c | construction | kappa | worst error vs exact sum | rounding deviation | bound "
            "| exact ring's deviation | bound | bytes as the rate table | result |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            *[
                f"| {p['c']} | {p['construction']} | {p['kappa']:.3g} | {p['error']:.2e} | {p['deviation']:.2e} "
                f"| {p['bound']:.2e} | {p['ring']:.2e} | {p['ring_bound']:.2e} | {p['bytes']} | {p['status']} |"
                for p in v["protocol"]
            ],
            "",
            f"Hook (c={v['hook']['c']} perturbation, kappa {v['hook']['kappa']:.3g}): {v['hook']['buckets']} buckets, "
            f"worst error against the exact average {v['hook']['error']:.2e}, worst rounding deviation "
            f"{v['hook']['deviation']:.2e} (bound {v['hook']['bound']:.2e}): {v['hook']['status']}.",
        ]
        t = v.get("timings")
        if t:
            lines += [
                "",
                "Median seconds per call (op=avg); CERAR's comm is the time its compute waited for transfers:",
                "",
                "| cerar (c=2N) | of which comm | of which encode + decode | cerar.ring_all_reduce "
                "| torch all_reduce |",
                "| --- | --- | --- | --- | --- |",
                f"| {t['cerar']:.4f} | {t['cerar_comm']:.4f} | {t['cerar_arith']:.4f} | {t['ring']:.4f} "
                f"| {t['torch']:.4f} |",
            ]
        s = v["stall"]
        lines += [
            "",
            f"Stall: rank {s['victim']} stopped (SIGSTOP) between two calls; timeout {s['timeout']:g} s. Every other "
            f"rank's call, inside `train.distributed.guarded`, must raise within the timeout plus {STALL_SLACK_S:g} s "
            "and leave through `train.distributed.exit_after_collective_failure`: exit status 3 and one `error:` "
            f"line: {s['status']}.",
            "",
            "| rank | seconds to raise | exit status | error to exit (s) | the line on stderr |",
            "| --- | --- | --- | --- | --- |",
            *[
                f"| {x['rank']} | {x['seconds']:.2f} | {x['exit']} | {x['abort_s']:.2f} | {x['line'][:300]} |"
                for x in s["rows"]
            ],
            "",
        ]
    return lines
