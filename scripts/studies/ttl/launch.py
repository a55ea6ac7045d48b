"""The time-to-loss study's runs: one launch of ``train/main.py`` per run (in the network lab or on loopback), the
numbers of a finished run folder, and the CSV rows, appended as runs finish (the order and the plan:
``scripts/studies/ttl/plan.py``).

Why one launch per run (not ``train/sweep.py``): the load average is recorded before and after each run, and each
row's load is its own; so is the CPU time its processes used (``cpu_s`` in its launch.json: the launched
processes' user + system seconds, ``RUSAGE_CHILDREN``; runs launched before issue 53 lack it), and what every other
process on the machine used meanwhile, which two load samples at its start and end cannot show: work that came
and went in between. ``others_cpu_s`` (from 2026-12-05): the machine's busy seconds over the run
(``machine_cpu_s``), less the run's own, with ``cores``; an upper bound, since it holds the kernel's interrupt work
on idle cores and its threads' (in the lab mostly the run's own packets), of which ``irq_s`` is the interrupt part
(from 2026-12-05 23:09 UTC on; not all of it is outside the run's own seconds: ``machine_cpu_s``). ``others_procs_s``
and ``kthreads_s`` (from 2026-12-06 on): the other processes' seconds counted process by process, and the
kernel threads' (``other_processes_cpu_s``). The code that trains is a snapshot of one commit
(``code_snapshot``: ``git archive`` of cerar, train and configs), so the ``commit`` column names exactly
what ran, whatever else the checkout holds.
"""

from __future__ import annotations

import csv
import datetime
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

from scripts.studies.ttl import metric
from scripts.studies.ttl.rows import evaluations, group, read_metrics, read_rows, run_folder
from scripts.studies.ttl.settings import AGGREGATORS, COLUMNS, ROOT, SEQ_LEN, Setting


def loadavg() -> str:
    """The 1-, 5- and 15-minute load averages, as ``os.getloadavg`` gives them."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# --------------------------------------------------------------------------------------------- the code


def head_commit(checkout: Path = ROOT) -> str:
    return subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short=7", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip


def code_snapshot(commit: str, cache: Path) -> Path:
    """A folder holding cerar/, train/ and configs/ of ``commit`` (``git archive``), made once and reused: the runs
    train this code, not the checkout's working tree (which other engineers may be editing)."""
    folder = cache / commit
    if (folder / "train" / "main.py").is_file():
        return folder
    tmp = cache / f".{commit}.{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "cerar", "train", "configs"],
                             capture_output=True, check=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
    os.replace(tmp, folder)
    return folder


# --------------------------------------------------------------------------------------------- one run


def overrides(setting: Setting, name: str, seed: int, steps: int, eval_every: int, micro_batch: int,
              run_dir: Path, extra: list[str]) -> list[str]:  # fmt: skip
    """train/main.py's overrides for one run: the aggregator's, then what every run of the study shares."""
    return [
        *AGGREGATORS[name], f"model={setting.model}", f"seed={seed}", f"trainer.max_steps={steps}",
        f"trainer.eval_every={eval_every}", "trainer.log_every=1", f"trainer.micro_batch_size={micro_batch}",
        f"data.seq_len={SEQ_LEN[setting.model]}",
        "trainer.drift_every=0", "trainer.progress_bar=false", "checkpoint.every=0", "checkpoint.at_end=false",
        "resume=false", "wandb.mode=disabled", f"hydra.run.dir={run_dir}", *extra,
    ]  # fmt: skip


def machine_cpu_s(stat: Path = Path("/proc/stat")) -> tuple[float, float] | None:
    """CPU seconds the whole machine has used since boot, all cores together, as (busy, interrupts): busy is
    /proc/stat's user, nice, system, irq, softirq and steal (not idle, not iowait); interrupts its irq and softirq,
    the kernel's interrupt work: in the lab, mostly the ranks' own packets through the veth pairs and their tbf
    (about 2 s a minute in a two-tier pythia-14m run with nothing else running). Under tick accounting
    (CONFIG_TICK_CPU_ACCOUNTING without CONFIG_IRQ_TIME_ACCOUNTING, this machine's kernel) a tick that lands in an
    interrupt is charged to the interrupt column and to the task it interrupted (kernel/sched/cputime.c,
    ``account_system_time`` -> ``account_system_index_time``: ``p->stime += cputime`` and the cpustat field), so
    the part that interrupted the run is in the run's own seconds too, and the part that interrupted the idle task
    in no process's: the busy seconds less the run's bound other work from above, less the interrupts too from
    below. None where it cannot be read (not Linux)."""
    try:
        fields = stat.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq + steal) / tick, (irq + softirq) / tick


PF_KTHREAD = 0x00200000  # include/linux/sched.h: the task is a kernel thread (/proc/<pid>/stat's flags)


def processes(proc: Path = Path("/proc")) -> dict[tuple[int, int], tuple[int, float, float, bool]] | None:
    """Every process under ``proc`` as {(pid, start tick): (parent pid, its own CPU seconds, its waited-for
    children's CPU seconds, whether a kernel thread)}, from each /proc/<pid>/stat (proc(5): fields 4 ppid, 9 flags,
    14-17 utime, stime, cutime, cstime, 22 starttime, all threads of the process together; the command name, field
    2, may hold spaces and parentheses, so the fields are counted from its last ")"). The start tick tells a pid
    reused between two snapshots from the process that had it. None where ``proc`` cannot be read (not Linux)."""
    tick = os.sysconf("SC_CLK_TCK")
    try:
        entries = [e for e in proc.iterdir() if e.name.isdigit()]
    except OSError:
        return None
    out = {}
    for entry in entries:
        try:
            text = (entry / "stat").read_text()
        except OSError:  # it ended between the listing and the read
            continue
        field = text[text.rindex(")") + 2 :].split()  # field[k - 3] is proc(5)'s field k
        ppid, flags, start = int(field[1]), int(field[6]), int(field[19])
        utime, stime, cutime, cstime = (int(x) for x in field[11:15])
        out[(int(entry.name), start)] = (ppid, (utime + stime) / tick, (cutime + cstime) / tick,
                                         bool(flags & PF_KTHREAD))  # fmt: skip
    return out


def other_processes_cpu_s(before: dict, after: dict, run: int) -> tuple[float, float]:
    """(other processes, kernel threads): the CPU seconds the machine's processes used between two ``processes``
    snapshots, apart from the run's: ``run`` (the launcher, whose waited-for children are the run) and every process
    descended from it at ``after``. A process in both snapshots counts the growth of its own seconds and of its
    waited-for children's (a job its shell started and waited for between the two counts in the shell); one that
    began between them counts all of its own. Left out: init's (pid 1) children's seconds, since the orphans it
    reaps may be the run's (a compile worker whose trainer ended first), and a process that began and ended
    between the snapshots with no waiting parent in both: so a lower bound on other work, where the busy seconds
    less the run's (``machine_cpu_s``) are an upper one."""
    parent = {pid: ppid for (pid, _), (ppid, *_) in after.items()}

    def runs(pid: int) -> bool:
        seen = set()
        while pid > 1 and pid not in seen:
            if pid == run:
                return True
            seen.add(pid)
            pid = parent.get(pid, 0)
        return False

    procs = kthreads = 0.0
    for key, (_, own, kids, kthread) in after.items():
        if runs(key[0]):
            continue
        own0, kids0 = before[key][1:3] if key in before else (0.0, 0.0)
        grew = (own - own0) + (kids - kids0 if key[0] != 1 else 0.0)
        if kthread:
            kthreads += grew
        else:
            procs += grew
    return procs, kthreads


def children_cpu() -> float:
    """User + system CPU seconds of this process's children that have ended and been waited for (their own
    children's included): a run's, read before and after its launch."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def launch(setting: Setting, argv: list[str], code: Path, log_dir: Path, timeout: float, mtu: int, port: int):
    """Run ``train/main.py argv`` of the snapshot ``code`` on the setting's ranks; returns (ok, how it ended, the
    command shown). The lab is always torn down (netlab), a loopback launch is killed at ``timeout``."""
    env = {"OMP_NUM_THREADS": "1", "WANDB_SILENT": "true", "TOKENIZERS_PARALLELISM": "false"}
    main = str(code / "train" / "main.py")
    log_dir.mkdir(parents=True, exist_ok=True)
    if setting.links == "loopback":
        torchrun = str(Path(sys.executable).with_name("torchrun"))
        cmd = [torchrun, "--standalone", f"--nproc_per_node={setting.ranks}", main, *argv]
        with open(log_dir / "launch.log", "w") as log:
            try:
                proc = subprocess.run(cmd, cwd=code, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
                                      timeout=timeout, start_new_session=True)  # fmt: skip
                ok, how = proc.returncode == 0, f"rc={proc.returncode}"
            except subprocess.TimeoutExpired:
                ok, how = False, f"TIMEOUT after {timeout:.0f} s"
        return ok, how, shlex.join(["torchrun", *cmd[1:]])
    from scripts.lab import netlab

    with netlab.NetLab(hosts=setting.hosts, rate_mbit=setting.rate_mbit, master_port=port, mtu=mtu,
                       ranks_per_host=setting.ranks_per_host) as lab:  # fmt: skip
        res = lab.run([sys.executable, main, *argv], timeout=timeout, out_dir=log_dir, env=env)
    shape = f"{setting.hosts} hosts x {setting.ranks_per_host} ranks"
    return (
        res.ok,
        res.describe(),
        f"netlab({shape}, {setting.rate_mbit:g} Mbit/s, mtu {mtu}): " + shlex.join(["python", *[main, *argv]]),
    )


# --------------------------------------------------------------------------------------------- a run's numbers


def chosen(name: str, summary: dict) -> str:
    """What aggregator=auto or c=auto chose and at which step ('fp16 at step 100'; moves joined by ' -> '), or
    'fallback: nccl (...)' where auto's probe left it exact; empty for fixed aggregators."""
    auto = summary.get("auto")
    if auto is not None:
        if auto.get("fallback"):
            return f"fallback: nccl ({auto['fallback'].split('(', 1)[-1].split(';')[0][:120].rstrip(')')})"
        moves, last = [], None
        for d in auto.get("decisions") or []:
            if d.get("choice") != last:
                moves.append(f"{d['choice']} at step {d['step']}")
                last = d.get("choice")
        return " -> ".join(moves) or "nccl (no decision yet)"
    decisions = (summary.get("auto_c") or {}).get("decisions")
    if decisions is not None:
        moves, last = [], None
        for d in decisions:
            if d.get("c") != last:
                moves.append(f"c={d['c']} at step {d['step']}")
                last = d.get("c")
        return " -> ".join(moves) or "exact ring (no decision yet)"
    return ""


def run_numbers(run_dir: Path) -> dict | None:
    """The CSV's numbers of one finished run folder (None while it has no summary.json): steps, wall_s (the loop,
    evaluations included), steps_s (the training steps alone: the sum of time/step), aggregate_share (mean over
    steps 2.. of time/aggregate / time/step; step 1 pays one-time costs), bytes_per_step (median of bytes_sent over
    steps 2..), final_val_loss, the evaluations and what auto chose."""
    path = run_dir / "summary.json"
    if not path.exists():
        return None
    summary = json.loads(path.read_text())
    metrics = read_metrics(run_dir)
    steady = [r for r in metrics if r.get("step", 0) > 1 and r.get("time/step")]
    return {
        "steps": summary.get("final_step"),
        "wall_s": summary.get("wall_seconds"),
        "steps_s": sum(float(r.get("time/step", 0.0)) for r in metrics),
        "aggregate_share": statistics.mean(float(r.get("time/aggregate", 0.0)) / float(r["time/step"]) for r in steady)
        if steady
        else None,  # fmt: skip
        "bytes_per_step": statistics.median(r.get("bytes_sent", 0) for r in steady) if steady else None,
        "final_val_loss": summary.get("final_val_loss"),
        "evaluations": evaluations(metrics),
        "summary": summary,
    }


# --------------------------------------------------------------------------------------------- the CSV


def append(csv_path: Path, rows: list[dict], columns: list[str] = COLUMNS) -> None:
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    new = not csv_path.exists() or csv_path.stat().st_size == 0
    with open(csv_path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="raise")
        if new:
            w.writeheader()
        w.writerows(rows)


def rewrite(csv_path: Path, rows: list[dict], columns: list[str] = COLUMNS) -> None:
    """The CSV with exactly ``rows`` (in their order), replaced in one rename."""
    tmp = csv_path.with_suffix(".csv.tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, csv_path)


def _num(x, digits: int = 6):
    """A CSV cell: empty for None, else rounded (an int at 0 digits)."""
    if x is None:
        return ""
    return int(round(float(x))) if digits == 0 else round(float(x), digits)


def make_row(setting: Setting, name: str, seed: int, numbers: dict, launch_record: dict) -> dict:
    """One CSV row: the run's numbers and the load and commit its launch recorded; time_to_target_s is left to
    ``retarget`` (the target is the setting's, from nccl's runs of every seed)."""
    links, rate, hosts, per_host, model = setting.row_key()
    return {
        "links": links, "rate_mbit": rate, "hosts": hosts, "ranks_per_host": per_host, "model": model,
        "aggregator": name, "chosen": chosen(name, numbers["summary"]), "seed": seed, "steps": numbers["steps"],
        "wall_s": _num(numbers["wall_s"], 3), "steps_s": _num(numbers["steps_s"], 3),
        "aggregate_share": _num(numbers["aggregate_share"], 4), "bytes_per_step": _num(numbers["bytes_per_step"], 0),
        "final_val_loss": _num(numbers["final_val_loss"], 6), "time_to_target_s": "",
        "load_before": launch_record.get("load_before", ""), "load_after": launch_record.get("load_after", ""),
        "commit": launch_record.get("commit", ""),
    }  # fmt: skip


def flush_rows(csv_path: Path, setting: Setting, folder: Path, seed: int, names: list[str], final: bool) -> int:
    """Append the rows of this seed's finished runs that the CSV lacks, once nccl's run of the seed has finished
    (every ratio is against it) or, with ``final``, whatever has finished; then recompute every row's
    time_to_target_s (``retarget``: nccl's new seed moves the setting's target). Returns how many rows."""
    if run_numbers(folder / f"nccl_s{seed}") is None and not final:
        return 0
    done = {(r["steps"], r["aggregator"], r["seed"]) for r in read_rows(csv_path)
            if tuple(r[k] for k in ("links", "rate_mbit", "hosts", "ranks_per_host", "model")) == setting.row_key()}
    rows = []
    for name in names:
        run_dir = folder / f"{name}_s{seed}"
        numbers = run_numbers(run_dir)
        if numbers is None or (str(numbers["steps"]), name, str(seed)) in done:
            continue
        record = json.loads((run_dir / "launch.json").read_text()) if (run_dir / "launch.json").exists() else {}
        rows.append(make_row(setting, name, seed, numbers, record))
    append(csv_path, rows)
    if rows:
        retarget(csv_path, folder.parent)
    return len(rows)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# --------------------------------------------------------------------------------------------- the lab's rate


def calibrate(args, rates: list[float], model: str, steps: int) -> list[dict]:
    """nccl's aggregation share of a step in the flat lab at each rate (short runs of ``steps`` steps, seed 1), one
    row per rate to ``RATES_CSV``: the evidence the study's rate is chosen from (``PAPER_SHARE``)."""
    from scripts.studies.ttl.settings import RATE_COLUMNS, RATES_CSV, setting_of

    commit = args.commit or head_commit()
    code = args.code_dir or code_snapshot(commit, args.code_cache)
    rows = []
    for k, rate in enumerate(rates):
        setting = setting_of("lab", model, rate)
        run_dir = args.runs / "rates" / f"{setting.key}"
        argv = overrides(setting, "nccl", 1, steps, steps, args.micro_batch_for(setting), run_dir, args.extra)
        before = loadavg()
        ok, how, _ = launch(setting, argv, code, run_dir / "logs", args.timeout, args.mtu, 29450 + k)
        after = loadavg()
        numbers = run_numbers(run_dir) if ok else None
        if numbers is None:
            print(f"time_to_loss: calibration at {rate:g} Mbit/s failed: {how}", file=sys.stderr)
            continue
        steady = [r for r in read_metrics(run_dir) if r.get("step", 0) > 1]
        row = {"rate_mbit": f"{rate:g}", "model": model, "hosts": setting.hosts, "seed": 1, "steps": numbers["steps"],
               "aggregate_share": _num(numbers["aggregate_share"], 4),
               "step_s": _num(statistics.mean(float(r["time/step"]) for r in steady), 4),
               "aggregate_s": _num(statistics.mean(float(r.get("time/aggregate", 0.0)) for r in steady), 4),
               "load_before": before, "load_after": after, "commit": commit}  # fmt: skip
        rows.append(row)
        from scripts.bench.csv_rows import append_rows

        append_rows(RATES_CSV, [row], RATE_COLUMNS)
        print(f"time_to_loss: {rate:g} Mbit/s, {model}: nccl's aggregation {row['aggregate_share']} of a step "
              f"({row['aggregate_s']} of {row['step_s']} s), load {before} -> {after}", flush=True)  # fmt: skip
    return rows


def crossings(rows: list[dict], runs: Path) -> dict[int, metric.Crossing | None]:
    """Each row's crossing of its setting's target (``metric``), by the row's position in ``rows``: the target is
    nccl's mean loss at half the horizon over nccl's rows of the setting; rows whose folder has no evaluations, or
    whose setting has no nccl run to set a target, are left out."""
    out: dict[int, metric.Crossing | None] = {}
    index = {id(r): k for k, r in enumerate(rows)}
    for setting, srows in group(rows).items():
        curves = {id(r): evaluations(read_metrics(run_folder(runs, r))) for r in srows}
        goal = metric.target([curves[id(r)] for r in srows if r["aggregator"] == "nccl"], setting.steps)
        for r in srows:
            if goal is not None and curves[id(r)]:
                out[index[id(r)]] = metric.crossing(curves[id(r)], goal[1])
    return out


def retarget(csv_path: Path, runs: Path) -> int:
    """Recompute every row's time_to_target_s from the run folders (``crossings``; never reached: empty), rewriting
    the CSV in place; rows whose folder is gone keep theirs. Returns how many cells changed."""
    rows = read_rows(csv_path)
    changed = 0
    for k, cross in crossings(rows, runs).items():
        value = str(_num(None if cross is None else cross.seconds, 3))
        if value != rows[k]["time_to_target_s"]:
            rows[k]["time_to_target_s"], changed = value, changed + 1
    if changed:
        rewrite(csv_path, rows)
    return changed
