"""The time-to-loss study's plan: which runs, in which order, which rows are stale and rerun; ``--dry-run`` prints
it, ``run_study`` carries it out (one launch per run: ``scripts/studies/ttl/launch.py``).

The order (issue 53): seed by seed, every setting of the command, its aggregators interleaved, in an order that is
``rotated`` by the seed (issue 34's: each aggregator early under some seeds, late under others) or ``shuffled``
afresh for every (setting, seed) from a seeded generator (``--order-seed``: the same command, the same order), so
that a slow drift of the machine's load does not fall on the same aggregators seed after seed.

Stale rows (``--retire-stale``): a row whose commit's cerar/, train/ or configs/ differ from the commit the study
trains (``git diff``) is retired before its run is launched again: the row moves to
``reports/data/time_to_loss_retired.csv`` with where and why, its run folder to
``reports/runs/time_to_loss_retired/``, and the report discloses it; so a setting's rows come from one code.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from scripts.studies.ttl import launch as L  # noqa: N812
from scripts.studies.ttl.rows import code_differs, read_rows, run_key
from scripts.studies.ttl.settings import RETIRED_COLUMNS, Setting

ORDERS = ("rotated", "shuffled")


def order(names: list[str], setting: Setting, seed: int, how: str = "rotated", order_seed: int = 0) -> list[str]:
    """The aggregators of one (setting, seed) in launch order (module docstring)."""
    if how == "rotated":
        k = (seed - 1) % len(names)
        return names[k:] + names[:k]
    if how == "shuffled":
        out = list(names)
        random.Random(f"{order_seed}/{setting.key}/{seed}").shuffle(out)
        return out
    raise ValueError(f"unknown order {how!r}; choose from {list(ORDERS)}")


@dataclass
class Planned:
    """One run of the plan: ``action`` is ``run``, ``rerun`` (its stale row retired first), ``skip`` (a row of this
    code is there) or ``waits`` (finished, its row waits for nccl's run of the seed); ``why`` says why."""

    setting: Setting
    seed: int
    name: str
    action: str
    why: str = ""
    row: dict | None = None


def plan(args, settings: list[Setting]) -> list[Planned]:
    """Every (seed, setting, aggregator) of the command in launch order, each with what the study will do."""
    rows = {run_key(r): r for r in read_rows(args.csv)}
    commit = args.commit or (L.head_commit() if rows and args.retire_stale else None)
    compared: dict[str, bool | None] = {}
    out = []
    for seed in args.seeds:
        for setting in settings:
            # nccl always belongs: every ratio is against its run of the same seed, the target its mean
            names = [n for n in setting.aggregators if args.aggregators is None or n in args.aggregators or n == "nccl"]
            names += [n for n in args.aggregators or [] if n not in names]  # named outside the list (issue 54: int4)
            for name in order(names, setting, seed, args.order, args.order_seed):
                row = rows.get((*setting.row_key(), str(setting.steps), name, str(seed)))
                run_dir = args.runs / setting.key / f"{name}_s{seed}"
                if row is None:
                    waits = (run_dir / "summary.json").exists()
                    out.append(Planned(setting, seed, name, "waits" if waits else "run",
                                       "finished, its row waits for nccl's run of the seed" if waits else ""))
                    continue
                if not args.retire_stale:
                    out.append(Planned(setting, seed, name, "skip", f"a row of {row['commit']}", row))
                    continue
                if row["commit"] not in compared:
                    compared[row["commit"]] = code_differs(row["commit"], commit)
                differs = compared[row["commit"]]
                if differs:
                    why = f"code of {row['commit']} differs from {commit}'s in cerar/, train/ or configs/"
                    out.append(Planned(setting, seed, name, "rerun", why, row))
                else:
                    why = "cannot compare (a commit git lacks): kept" if differs is None else "the same code"
                    out.append(Planned(setting, seed, name, "skip", f"a row of {row['commit']}: {why}", row))
    return out


def estimate_hours(planned: list[Planned], rows: list[dict]) -> tuple[float, int]:
    """(hours, runs without an estimate) of the runs to launch: each at the mean wall seconds per step of the rows of
    the same place, model and aggregator (any horizon), times its horizon; on this 2-core machine at the loads those
    rows ran at."""
    per_step: dict[tuple, list[float]] = {}
    for r in rows:
        per_step.setdefault((*[r[k] for k in ("links", "rate_mbit", "model")], r["aggregator"]), []).append(
            float(r["wall_s"]) / int(r["steps"])
        )
    hours, unknown = 0.0, 0
    for p in planned:
        if p.action not in ("run", "rerun"):
            continue
        rate = "" if p.setting.rate_mbit is None else f"{p.setting.rate_mbit:g}"
        measured = per_step.get((p.setting.links, rate, p.setting.model, p.name))
        if measured:
            hours += sum(measured) / len(measured) * p.setting.steps / 3600
        else:
            unknown += 1
    return hours, unknown


def describe(planned: list[Planned], rows: list[dict]) -> str:
    """The plan as text: one line per run in launch order, then the counts and the time it would take."""
    lines = [f"{k + 1:4d}. seed {p.seed} {p.setting.key}: {p.name}: {p.action}" + (f" ({p.why})" if p.why else "")
             for k, p in enumerate(planned)]  # fmt: skip
    counts = {a: sum(p.action == a for p in planned) for a in ("run", "rerun", "skip", "waits")}
    hours, unknown = estimate_hours(planned, rows)
    lines.append(", ".join(f"{n} {a}" for a, n in counts.items()) + f"; about {hours:.1f} h of runs at the CSV's "
                 "per-step times" + (f", {unknown} without one" if unknown else ""))  # fmt: skip
    return "\n".join(lines)


def retire(args, p: Planned) -> None:
    """Take a stale row out of the CSV into the retired CSV (with where and why) and its run folder aside."""
    rows = read_rows(args.csv)
    keep = [r for r in rows if run_key(r) != run_key(p.row)]
    L.append(args.retired_csv, [{**p.row, "retired_in": L._now(), "reason": p.why}], RETIRED_COLUMNS)
    L.rewrite(args.csv, keep)
    folder = args.runs / p.setting.key / f"{p.name}_s{p.seed}"
    if folder.exists():
        aside = args.retired_runs / p.setting.key / f"{p.name}_s{p.seed}-{p.row['commit']}"
        aside.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(folder), str(aside))


def run_study(args, settings: list[Setting]) -> int:
    """Carry out the plan: launch every run it says to, retiring stale rows first; rows are appended as soon as
    nccl's run of the same seed has finished, the rest at the (seed, setting)'s end."""
    commit = args.commit or L.head_commit()
    planned = plan(args, settings)
    code = None  # made at the first launch: a study whose runs are all rows already launches nothing
    failures = 0
    for k, p in enumerate(planned):
        folder = args.runs / p.setting.key
        names = [q.name for q in planned if (q.setting, q.seed) == (p.setting, p.seed)]
        if p.action in ("run", "rerun"):
            if code is None:
                problem = lab_problem(settings)
                if problem:
                    print(f"time_to_loss: {problem}", file=sys.stderr)
                    return 2
                code = args.code_dir or L.code_snapshot(commit, args.code_cache)
            if p.action == "rerun":
                retire(args, p)
            failures += not launch_one(args, p, code, commit, k)
            L.flush_rows(args.csv, p.setting, folder, p.seed, names, final=False)
        if k + 1 == len(planned) or (planned[k + 1].setting, planned[k + 1].seed) != (p.setting, p.seed):
            L.flush_rows(args.csv, p.setting, folder, p.seed, names, final=True)
    return 1 if failures else 0


def launch_one(args, p: Planned, code: Path, commit: str, k: int) -> bool:
    """One run: its launch, recorded in its folder's launch.json (commit, loads before and after, CPU seconds of
    its processes and of every other process meanwhile, how it ended)."""
    folder = args.runs / p.setting.key
    run_dir = folder / f"{p.name}_s{p.seed}"
    argv = L.overrides(p.setting, p.name, p.seed, p.setting.steps, args.eval_for(p.setting),
                       args.micro_batch_for(p.setting), run_dir, args.extra)  # fmt: skip
    record = {"commit": commit, "load_before": L.loadavg(), "started": L._now()}
    t0, cpu0, machine0, procs0 = time.monotonic(), L.children_cpu(), L.machine_cpu_s(), L.processes()
    ok, how, shown = L.launch(p.setting, argv, code, folder / "logs" / f"{p.name}_s{p.seed}", args.timeout,
                              args.mtu, 29500 + (os.getpid() + k) % 400)  # fmt: skip
    record.update(load_after=L.loadavg(), seconds=round(time.monotonic() - t0, 1),
                  cpu_s=round(L.children_cpu() - cpu0, 1), ended=how, ok=ok,
                  command=shown.replace(str(code) + "/", ""))  # fmt: skip
    machine, procs = L.machine_cpu_s(), L.processes()
    # the rest of the machine's busy seconds (other work, at most), the kernel's interrupts apart; then the other
    # processes' seconds counted one by one (other work, at least) and the kernel threads'
    if machine0 is not None and machine is not None:
        busy, interrupts = (after - before for before, after in zip(machine0, machine, strict=True))
        record.update(others_cpu_s=round(max(0.0, busy - record["cpu_s"]), 1), irq_s=round(interrupts, 1),
                      cores=os.cpu_count())  # fmt: skip
    if procs0 is not None and procs is not None:
        others, kthreads = L.other_processes_cpu_s(procs0, procs, os.getpid())
        record.update(others_procs_s=round(others, 1), kthreads_s=round(kthreads, 1))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "launch.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"time_to_loss: {p.setting.key} {p.name} seed {p.seed}: {how} in {record['seconds']} s "
          f"({record['cpu_s']} s CPU; the rest of the machine {record.get('others_cpu_s', '?')} s, of them "
          f"interrupts {record.get('irq_s', '?')} s; other processes {record.get('others_procs_s', '?')} s, "
          f"kernel threads {record.get('kthreads_s', '?')} s), load {record['load_before']} -> "
          f"{record['load_after']}",
          flush=True)  # fmt: skip
    return ok


def lab_problem(settings: list[Setting]) -> str | None:
    """Why the lab cannot run here (not root, no ip or tc), when a setting needs it; else None."""
    if all(s.links == "loopback" for s in settings):
        return None
    from scripts.lab import netlab

    return netlab.requirements_problem()
