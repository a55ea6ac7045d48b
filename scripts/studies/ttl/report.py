"""The time-to-loss study's report, rebuilt from the CSV, the retired rows and the run folders alone: per setting
the time to its target and where the time went (issue 53), the end state apart, the commits its rows come from,
aggregator=auto's run taken apart; then what the rows support as headlines, the paper's claims, and the closing
sections (``appendix``).

Every ratio is taken seed by seed against nccl's run of the same seed and setting, then averaged over the seeds
where both ran (the span of the seeds' ratios beside it). The metric's definitions are ``metric``'s; the report
states them once, in "How to read it". A headline needs ``HEADLINE_SEEDS`` seeds of the aggregator and of nccl.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path

from scripts.studies.ttl import appendix, metric
from scripts.studies.ttl.figures import figure
from scripts.studies.ttl.rows import (
    code_differs,
    evaluations,
    group,
    load_json,
    read_metrics,
    read_rows,
    run_folder,
    run_key,
    setting_of_row,
)
from scripts.studies.ttl.rows import number as _f
from scripts.studies.ttl.settings import (
    AGGREGATORS,
    RETIRED_COLUMNS,
    RETIRED_CSV,
    WARMUP_STEPS,
    Setting,
    parse_settings,
)

TARGET = 1.10
"""Issue 34: on the flat lab at tiny, auto reaches the target in at most 1.10x the time of the fastest fixed
aggregator that ends inside nccl's seed band."""
HEADLINE_SEEDS = 3
"""Issue 53: a figure is a headline only with at least this many seeds (of the aggregator and of nccl)."""
LOAD_MIX = 1.5
"""A run whose load (the mean of its 1-minute load at start and end) is more than this many times nccl's at the
same seed, or less than its inverse, has its wall ratio marked: the ratio mixes the aggregator with the load; a
setting whose loads span more than this factor says so."""
GAP_FRACTIONS = (0.25, 0.5, 0.75, 1.0)
"""Where the end-state table also gives the gap to nccl: at the evaluations at these fractions of the horizon."""


def _span(xs) -> str:
    """``a..b``, or ``a`` where every x is a."""
    return f"{min(xs)}" if min(xs) == max(xs) else f"{min(xs)}..{max(xs)}"


def _band(band: float | None, losses: list) -> str:
    """nccl's seed band in percent, or why there is none."""
    return f"{100 * band:.2f} %" if band is not None else "- (one seed)" if losses else "-"


def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def _ratio(a, b) -> float | None:
    a, b = _f(a), _f(b)
    return a / b if a is not None and b else None


def _load1(row: dict) -> float | None:
    """A row's 1-minute load at the run's start and end, averaged (None when not recorded)."""
    return _mean(_f(row[k].split()[0]) for k in ("load_before", "load_after") if row.get(k, "").strip())


def loads_vary(loads: list[float]) -> bool:
    """Whether a setting's 1-minute loads span more than ``LOAD_MIX`` (a load of 0.00 is a load: it makes any
    other one a span, issue 53)."""
    return bool(loads) and max(loads) > LOAD_MIX * min(loads)


# --------------------------------------------------------------------------------------------- the arithmetic


def _run(folder: Path | None, name: str, seed: str, window: range) -> dict:
    """What the report reads from one run folder: its evaluations, steady-state phases, CPU seconds, metrics."""
    if folder is None:
        return {"evaluations": [], "phases": None, "cpu": None, "others": None, "metrics": []}
    metrics = read_metrics(folder / f"{name}_s{seed}")
    launched = load_json(folder / f"{name}_s{seed}" / "launch.json")
    return {"evaluations": evaluations(metrics), "phases": metric.phases(metrics, window), "metrics": metrics,
            "cpu": _f(launched.get("cpu_s")), "others": others_share(launched)}  # fmt: skip


def others_share(launched: dict) -> tuple[float, bool] | None:
    """(the share of the machine's cores that other processes used during a run, whether an upper bound), over
    ``cores`` x the run's seconds: launch.json's ``others_procs_s`` where recorded (other processes counted one by
    one), else its ``others_cpu_s`` (the machine's busy seconds less the run's: an upper bound, holding the kernel's
    interrupt work on idle cores and its threads', in the lab mostly the run's own packets; ``launch.py``'s
    ``machine_cpu_s`` says why its ``irq_s`` cannot simply be taken off). None for the runs launched before
    ``others_cpu_s`` was recorded."""
    procs, others, cores, seconds = (_f(launched.get(k)) for k in ("others_procs_s", "others_cpu_s", "cores",
                                                                    "seconds"))  # fmt: skip
    if (procs is None and others is None) or not cores or not seconds:
        return None
    return (procs if procs is not None else others) / (cores * seconds), procs is None


def summarize(rows: list[dict], folder: Path | None = None, warmup: int = WARMUP_STEPS) -> dict:
    """One setting's arithmetic (module docstring, ``metric``) from its rows and, with ``folder`` (its run
    folders), the curves and phases: {"setting", "target", "band", "nccl_losses", "window", "aggregators": {name:
    {"seeds": [per seed], and the means}}}, the aggregators in the study's order."""
    setting = setting_of_row(rows[0])
    by = {(r["aggregator"], r["seed"]): r for r in rows}
    window = metric.steady_window(setting.steps, warmup)
    runs = {key: _run(folder, *key, window) for key in by}
    nccl = {seed: r for (name, seed), r in by.items() if name == "nccl"}
    losses = [_f(r["final_val_loss"]) for r in nccl.values() if _f(r["final_val_loss"]) is not None]
    band = (max(losses) - min(losses)) / statistics.fmean(losses) if len(losses) >= 2 else None
    goal = metric.target([runs[("nccl", seed)]["evaluations"] for seed in sorted(nccl, key=int)], setting.steps)
    evaluated = [s for s, _, _ in next((run["evaluations"] for run in runs.values() if run["evaluations"]), [])]
    gap_steps = {f: metric.target_step(evaluated, setting.steps, f) for f in GAP_FRACTIONS}
    order = list(AGGREGATORS)
    names = sorted(dict.fromkeys(r["aggregator"] for r in rows), key=lambda n: (order + [n]).index(n))
    out = {}
    for name in names:
        per_seed = []
        for seed in sorted((s for (n, s) in by if n == name), key=int):
            r, base = by[(name, seed)], nccl.get(seed)
            mine, theirs = runs[(name, seed)], runs.get(("nccl", seed))
            cross = metric.crossing(mine["evaluations"], goal[1]) if goal and mine["evaluations"] else None
            one = {"seed": seed, "row": r, "crossing": cross, "phases": mine["phases"], "metrics": mine["metrics"],
                   "others": mine["others"]}  # fmt: skip
            if base is not None:
                cross0 = metric.crossing(theirs["evaluations"], goal[1]) if goal and theirs["evaluations"] else None
                p, p0 = mine["phases"] or {}, theirs["phases"] or {}
                gaps = metric.paired_gaps(mine["evaluations"], theirs["evaluations"])
                one.update({
                    "wall": _ratio(r["wall_s"], base["wall_s"]),
                    "ttt": _ratio(cross.seconds, cross0.seconds) if cross and cross0 else None,
                    "stt": _ratio(cross.step, cross0.step) if cross and cross0 else None,
                    "steady": _ratio(p.get("step"), p0.get("step")),
                    "agg": _ratio(p.get("aggregate"), p0.get("aggregate")),
                    "compute": _ratio(p.get("compute"), p0.get("compute")),
                    "cpu": _ratio(mine["cpu"], theirs["cpu"]),
                    "load": _ratio(_load1(r), _load1(base)),
                    "gap": None if _ratio(r["final_val_loss"], base["final_val_loss"]) is None
                    else _ratio(r["final_val_loss"], base["final_val_loss"]) - 1,
                    "gaps": gaps,
                    "gap_at": {f: dict(gaps).get(s) for f, s in gap_steps.items()},
                })  # fmt: skip
            per_seed.append(one)
        out[name] = _aggregate(name, per_seed, band)
    return {"setting": setting, "target": goal, "band": band, "nccl_losses": losses, "window": window,
            "warmup": warmup, "gap_steps": gap_steps, "aggregators": out}  # fmt: skip


def _aggregate(name: str, per_seed: list[dict], band: float | None) -> dict:
    """One aggregator's seeds, summed up: the mean (and span) of each ratio over the seeds where it exists, the
    end state's mean gap and t interval, whether every seed ended within nccl's band."""
    paired = [s for s in per_seed if "wall" in s]
    gaps = [s["gap"] for s in paired if s["gap"] is not None]
    mean_gap, half = metric.t_interval(gaps) if gaps else (None, None)
    reached = bool(paired) and all(s["crossing"] is not None and s["ttt"] is not None for s in paired)
    out = {
        "seeds": per_seed, "n": len(per_seed), "gap": mean_gap, "gap_half": half, "gaps": gaps,
        "inside": None if band is None or not gaps or len(gaps) < len(paired) else all(g <= band + 1e-12 for g in gaps),
        "reached": reached, "never": [s["seed"] for s in per_seed if s["crossing"] is None],
        "loss": _mean(_f(s["row"]["final_val_loss"]) for s in per_seed),
        "chosen": "; ".join(dict.fromkeys(s["row"]["chosen"] for s in per_seed if s["row"]["chosen"])),
        "fallback": any(s["row"]["chosen"].startswith("fallback") for s in per_seed),
        "commits": sorted({s["row"]["commit"] for s in per_seed}),
        "gap_at": {f: _mean(s["gap_at"][f] for s in paired) for f in GAP_FRACTIONS} if paired else {},
    }  # fmt: skip
    for key in ("wall", "ttt", "stt", "steady", "agg", "compute", "cpu", "load"):
        values = [s[key] for s in paired if s.get(key) is not None]
        out[key] = statistics.fmean(values) if values and (key not in ("ttt", "stt") or reached) else None
        out[key + "_span"] = (min(values), max(values)) if len(values) >= 2 else None
    shares = [s["others"] for s in per_seed if s.get("others") is not None]  # a share, not a ratio to nccl's
    others = [share for share, _ in shares]
    out["others"], out["others_n"] = (statistics.fmean(others) if others else None), len(others)
    out["others_span"] = (min(others), max(others)) if len(others) >= 2 else None
    out["others_bound"] = any(bound for _, bound in shares)
    return out


def headline(summary: dict) -> tuple[str | None, str]:
    """(the aggregator the rows support taking, why): the one with the least time to the target among those with
    ``HEADLINE_SEEDS`` seeds or more that ended within nccl's band at every seed, nccl itself with as many; else
    None and what is missing. The others of those whose seeds' times to the target reach into its seeds' span are
    named as not separated from it: a mean ahead by less than the seeds spread is not a lead the rows show."""
    aggs = summary["aggregators"]
    n_nccl = aggs.get("nccl", {}).get("n", 0)
    if n_nccl < HEADLINE_SEEDS:
        return None, f"nccl {n_nccl} seed{'s' * (n_nccl != 1)}: not a headline"
    fits = {n: a for n, a in aggs.items() if a["n"] >= HEADLINE_SEEDS and a["inside"] and a["ttt"] is not None}
    few = sorted((n for n, a in aggs.items() if a["n"] < HEADLINE_SEEDS), key=lambda n: aggs[n]["n"])
    tail = "; " + ", ".join(f"{n} {aggs[n]['n']} seed{'s' * (aggs[n]['n'] != 1)}" for n in few) + (
        ": not headlines") if few else ""  # fmt: skip
    if not fits:
        return None, f"no aggregator with {HEADLINE_SEEDS} seeds ended within nccl's band and reached the target{tail}"
    best = min(fits, key=lambda n: fits[n]["ttt"])
    commits = sorted({s["row"]["commit"] for a in aggs.values() for s in a["seeds"]})
    mixed = any(code_differs(commits[0], c) for c in commits[1:])
    caveat = f"; **rows from {len(commits)} commits whose code differs**" if mixed else ""
    return best, f"{describe_time(fits[best])}; ends {_gap(fits[best])}{unseparated(fits, best)}{caveat}{tail}"


def unseparated(fits: dict, best: str) -> str:
    """'; the seeds do not separate it from ...' naming each other aggregator of ``fits`` whose seeds' times to the
    target (their span, or their mean with one value) overlap ``best``'s seeds' span; '' when none does."""
    spans = {n: a["ttt_span"] or (a["ttt"], a["ttt"]) for n, a in fits.items()}
    lo, hi = spans[best]
    overlap = [n for n, (a, b) in spans.items() if n != best and a <= hi and b >= lo]
    close = sorted(overlap, key=lambda n: fits[n]["ttt"])
    if not close:
        return ""
    names = ", ".join(f"{n} {_with_span(fits[n], 'ttt')}x" for n in close)
    return f"; its seeds ({lo:.3f}..{hi:.3f}) do not separate it from {names}"


def auto_verdict(summary: dict) -> str | None:
    """Issue 34's target on a setting, on the time to the target: auto's ratio over the fastest fixed aggregator's
    that ended within the band, seed by seed and on average, with the seed counts; not a headline below
    ``HEADLINE_SEEDS`` seeds of either."""
    aggs = summary["aggregators"]
    auto = aggs.get("auto")
    if auto is None:
        return None
    fixed = {n: a for n, a in aggs.items() if n != "auto" and a["inside"] and a["ttt"] is not None}
    if summary["band"] is None:
        return "not judged: nccl has one seed here (no band)"
    if not fixed:
        return "not judged: no fixed aggregator ended within nccl's band and reached the target"
    best = min(fixed, key=lambda n: fixed[n]["ttt"])
    if auto["ttt"] is None:
        return f"MISSED: auto did not reach the target at every seed (fastest fixed within the band: {best})"
    theirs = {s["seed"]: s["ttt"] for s in fixed[best]["seeds"]}
    per_seed = [f"{s['ttt'] / theirs[s['seed']]:.3f}" for s in auto["seeds"]
                if s.get("ttt") is not None and theirs.get(s["seed"])]  # fmt: skip
    ratio = auto["ttt"] / fixed[best]["ttt"]
    n = min(auto["n"], fixed[best]["n"], aggs["nccl"]["n"])
    verdict = (f"{'met' if ratio <= TARGET else 'MISSED'}: auto {auto['ttt']:.3f}x nccl's time to the target against "
               f"{best}'s {fixed[best]['ttt']:.3f}x: {ratio:.3f} (target <= {TARGET:.2f}); per seed "
               f"{', '.join(per_seed) or '-'}")  # fmt: skip
    if n < HEADLINE_SEEDS:
        verdict += f"; {n} seed{'s' * (n != 1)}: not a headline"
    if auto["fallback"]:
        verdict += "; auto's probe fell back (exact throughout): counts against it"
    return verdict


def auto_apart(summary: dict) -> str:
    """aggregator=auto's run taken apart (issue 53), seed by seed: its steady-state step, aggregation and
    forward+backward against the fixed aggregator it chose at the same seed (the same work once it has chosen),
    and its mean step over the run as steady + warm-up + checks + the rest (``metric.amortized``), against that
    aggregator's mean step."""
    aggs = summary["aggregators"]
    parts = []
    for one in (aggs.get("auto") or {}).get("seeds", []):
        choice = (final_choice(one) or "").replace("-", "_")
        fixed = next((s for s in aggs.get(choice, {}).get("seeds", []) if s["seed"] == one["seed"]), None)
        if not one["phases"] or fixed is None or not fixed["phases"]:
            continue
        mine, theirs = one["phases"], fixed["phases"]
        budget = metric.amortized(one["metrics"], mine["step"], summary["warmup"])
        fixed_mean = statistics.fmean(float(r["time/step"]) for r in fixed["metrics"] if "time/step" in r)
        parts.append(
            f"seed {one['seed']} (chose {choice}): steady step {mine['step'] / theirs['step']:.3f}x {choice}'s, "
            f"aggregation {mine['aggregate'] / theirs['aggregate']:.3f}x, forward+backward "
            f"{mine['compute'] / theirs['compute']:.3f}x; its mean step {_s(budget['total'])} s = steady "
            f"{_s(budget['steady'])} + warm-up {_s(budget['warmup'])} + checks {_s(budget['checks'])} + rest "
            f"{_s(budget['rest'])}, {budget['total'] / fixed_mean:.3f}x {choice}'s {_s(fixed_mean)} s"
        )
    if not parts:
        return ""
    return ("aggregator=auto taken apart (seconds per step over its run; warm-up: its exact steps to the first "
            "check above its steady step; checks: every check's seconds): " + "; ".join(parts) + ".")  # fmt: skip


def final_choice(one: dict) -> str | None:
    """The last choice auto's run made, from its row's ``chosen`` ('fp16 at step 100 -> ...')."""
    chosen = one["row"]["chosen"]
    if not chosen or chosen.startswith("fallback"):
        return None
    return chosen.split(" -> ")[-1].split(" at step ")[0]


# --------------------------------------------------------------------------------------------- the text


def _x(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.3f} %"


def _with_span(a: dict, key: str) -> str:
    """The mean, and the seeds' span where it is one (``0.906 (0.847..0.984)``)."""
    span = a.get(key + "_span")
    return _x(a[key]) + (f" ({span[0]:.3f}..{span[1]:.3f})" if span and _x(span[0]) != _x(span[1]) else "")


def others_column(a: dict) -> str:
    """Other work's mean CPU share during the aggregator's runs, its seeds' span, and how many seeds recorded it;
    "at most" where one of those seeds' shares is an upper bound (``others_share``)."""
    if a["others"] is None:
        return "-"
    span = a["others_span"]
    wide = span and round(100 * span[0]) != round(100 * span[1])
    spread = f" ({100 * span[0]:.0f}..{100 * span[1]:.0f} %)" if wide else ""
    bound = "at most " if a.get("others_bound") else ""
    return f"{bound}{100 * a['others']:.0f} %{spread} ({a['others_n']} seed{'s' * (a['others_n'] != 1)})"


def _s(x: float) -> str:
    """Seconds to 3 decimals, a rounded -0 as 0."""
    return f"{round(x, 3) + 0.0:.3f}"


def _gap(a: dict) -> str:
    """The end state: mean gap and its t interval (or the seed count that has none)."""
    if a["gap"] is None:
        return "-"
    if a["gap_half"] is None:
        return f"{_pct(a['gap'])} (1 seed: no interval)"
    lo, hi = a["gap"] - a["gap_half"], a["gap"] + a["gap_half"]
    return f"{_pct(a['gap'])} [{100 * lo:+.3f}, {100 * hi:+.3f}] %"


def describe_time(a: dict) -> str:
    """An aggregator's headline figures with their seed count and phase ratios beside them."""
    return (f"time to the target {_with_span(a, 'ttt')}x nccl's ({a['n']} seeds; wall {_x(a['wall'])}x), steady "
            f"step {_x(a['steady'])}x, aggregation {_x(a['agg'])}x, forward+backward {_x(a['compute'])}x "
            "(the control)")  # fmt: skip


def commits_paragraph(summary: dict, retired: list[dict]) -> str:
    """Which commits the setting's rows come from, whether their code differs (``git diff`` of cerar/, train/,
    configs/), and every retired row of the setting beside the row that replaced it."""
    rows = [s["row"] for a in summary["aggregators"].values() for s in a["seeds"]]
    seeds_of: dict[str, dict[str, list[str]]] = {}  # commit -> aggregator -> its seeds there
    for r in rows:
        seeds_of.setdefault(r["commit"], {}).setdefault(r["aggregator"], []).append(f"s{r['seed']}")
    by_commit = {c: [f"{name} ({', '.join(seeds)})" for name, seeds in names.items()] for c, names in seeds_of.items()}
    commits = sorted(by_commit)
    if len(commits) == 1:
        text = f"Every row from commit {commits[0]}."
    else:
        differ = [code_differs(commits[0], c) for c in commits[1:]]
        state = ("their code differs (cerar/, train/ or configs/): **compare across commits with care**"
                 if any(differ) else "their cerar/, train/ and configs/ are identical: one code" if not
                 any(d is None for d in differ) else "git could not compare them all")  # fmt: skip
        text = (f"**Rows from {len(commits)} commits**, {state}: "
                + "; ".join(f"{c}: {', '.join(by_commit[c])}" for c in commits) + ".")  # fmt: skip
    mine = [r for r in retired if run_key(r)[:6] == run_key(rows[0])[:6]]
    if mine:
        now = {run_key(r): r for r in rows}
        each = []
        for r in mine:
            new = now.get(run_key(r))
            replaced = (f"by {new['commit']}'s ({float(new['wall_s']):.0f} s, load {new['load_before'].split()[0]} "
                        f"-> {new['load_after'].split()[0]})" if new else "not rerun")  # fmt: skip
            each.append(f"{r['aggregator']} s{r['seed']} of {r['commit']} ({float(r['wall_s']):.0f} s, load "
                        f"{r['load_before'].split()[0]} -> {r['load_after'].split()[0]}) "
                        f"retired {retired_when(r['retired_in'])}, replaced {replaced}")  # fmt: skip
        reasons = sorted({r["reason"] for r in mine})
        text += f" Retired rows ({len(mine)}): " + "; ".join(each) + ". Why: " + " / ".join(reasons)
        text += "" if text.endswith(".") else "."
    return text


def retired_when(retired_in: str) -> str:
    """'in <commit>' for a row retired by hand in a commit, 'at <time>' for the launcher's --retire-stale stamp."""
    return f"in {retired_in}" if re.fullmatch(r"[0-9a-f]{7,40}", retired_in) else f"at {retired_in}"


def setting_section(setting: Setting, srows: list[dict], runs: Path, figures: Path, retired: list[dict]):
    """One setting's part of the report: (lines, summary)."""
    folder = runs / setting.key
    summary = summarize(srows, folder)
    aggs = summary["aggregators"]
    band, goal, window = summary["band"], summary["target"], summary["window"]
    seeds = sorted({r["seed"] for r in srows}, key=int)
    lines = ["", f"## {setting.describe()}", ""]
    crossed = [s["crossing"].at for a in aggs.values() for s in a["seeds"] if s["crossing"] is not None]
    never = [f"{n} s{seed}" for n, a in aggs.items() for seed in a["never"]]
    target = ("no target (no nccl run)" if goal is None else
              f"target: nccl's mean validation loss at step {goal[0]} over its {goal[2]} seed{'s' * (goal[2] > 1)}, "
              f"{goal[1]:.4f}; " + (f"every run crosses it (at evaluations {_span(crossed)})"
                                    if not never else f"never crossed by {', '.join(never)}"))  # fmt: skip
    lines.append(f"Seed{'s' * (len(seeds) > 1)} {', '.join(seeds)}; {setting.steps} steps{appendix_shape(folder)}; "
                 f"{target}. nccl's final validation loss: "
                 f"{', '.join(f'{x:.4f}' for x in summary['nccl_losses']) or '-'}, its seed band "
                 f"{_band(band, summary['nccl_losses'])}. Steady state: steps {window.start}.."
                 f"{window.stop - 1}.")  # fmt: skip
    lines += ["", commits_paragraph(summary, retired)]
    lines += ["", "| aggregator | seeds | chose | wall / nccl | time to target / nccl | steps to target / nccl "
              "| steady step / nccl | aggregation / nccl | forward+backward / nccl (control) | CPU / nccl "
              "| load / nccl's | other work's CPU share (seeds) |", "|" + " --- |" * 12]  # fmt: skip
    for name, a in aggs.items():
        ttt = _with_span(a, "ttt") if a["reached"] else f"never at s{', s'.join(a['never'])}"
        lines.append(f"| {name} | {a['n']} | {a['chosen'] or '-'} | {_with_span(a, 'wall')} | {ttt} | "
                     f"{_x(a['stt'])} | {_x(a['steady'])} | {_x(a['agg'])} | {_x(a['compute'])} | {_x(a['cpu'])} | "
                     f"{_with_span(a, 'load')} | {others_column(a)} |")  # fmt: skip
    fractions = " / ".join(f"{summary['gap_steps'][f]}" for f in GAP_FRACTIONS)
    lines += ["", f"| aggregator | seeds | final val loss (mean) | gap to nccl, paired by seed: mean [95 % t "
              f"interval] | gap at steps {fractions} | within nccl's band at every seed |", "|" + " --- |" * 6]
    for name, a in aggs.items():
        at = " / ".join(_pct(a["gap_at"].get(f)) for f in GAP_FRACTIONS) if a["gap_at"] else "-"
        inside = {None: "-", True: "yes", False: "**no**"}[a["inside"]]
        lines.append(f"| {name} | {a['n']} | {_x(a['loss'], 4)} | {_gap(a)} | {at} | {inside} |")
    lines += ["", "The wall includes the evaluations. Once a run's replicas may differ (CERAR's codes; `c=auto` and "
              "`aggregator=auto` only once they choose one) each rank evaluates the whole validation set, N times "
              "the work of ranks that split it (docs/training.md, `eval/each_replica`): a coded run's wall ratio is "
              "above its steady-step ratio by that much."]  # fmt: skip
    loads = [_f(r[k].split()[0]) for r in srows for k in ("load_before", "load_after") if r[k].strip()]
    if loads_vary(loads):
        compute = [s["compute"] for a in aggs.values() for s in a["seeds"] if s.get("compute") is not None]
        lines += ["", f"The 1-minute load ran from {min(loads):.2f} to {max(loads):.2f} across these runs (2 cores, "
                  "shared; 4-8 of the ranks are the run's own): a wall ratio between runs at different loads mixes "
                  "the aggregator with the load."
                  + (f" forward+backward / nccl, the same work, shows how much: {min(compute):.3f}.."
                     f"{max(compute):.3f} across these runs." if compute else "")]  # fmt: skip
    verdict = auto_verdict(summary)
    if verdict:
        lines += ["", f"Issue 34's target for auto here: {verdict}." + probe_fits(folder, summary)]
    apart = auto_apart(summary)
    if apart:
        lines += ["", apart]
    name = f"time_to_loss_{setting.key}.png"
    if figure(setting, summary, runs, figures / name):
        alt = "validation loss against wall clock; each run's gap to nccl's loss against the step"
        lines += ["", f"![{alt}]({appendix.rel(figures / name).replace('reports/', '')})"]
    return lines, summary


def appendix_shape(folder: Path) -> str:
    """The shape the setting's runs trained at, as ", micro-batch M of S tokens per rank" (their summaries), or
    "" where no run has a summary."""
    shapes = set()
    for path in sorted(folder.glob("*/summary.json")):
        s = load_json(path)
        if "micro_batch_size" in s and "seq_len" in s:
            shapes.add((int(s["micro_batch_size"]), int(s["seq_len"])))
    return "".join(f", micro-batch {m} of {t} tokens per rank" for m, t in sorted(shapes))


def probe_fits(folder: Path, summary: dict) -> str:
    """What auto's link probe measured in each of the setting's auto runs (its summary.json): the fit per tier and
    the load the run started at, or its fallback."""
    parts = []
    for one in (summary["aggregators"].get("auto") or {}).get("seeds", []):
        auto = load_json(folder / f"auto_s{one['seed']}" / "summary.json").get("auto") or {}
        tiers = (auto.get("links") or {}).get("tiers") or {}
        fit = "; ".join(f"{tier} {8 * f['bandwidth_bytes_s'] / 1e6:.0f} Mbit/s, {f['rel_rmse']:.0%} RMS"
                        for tier, f in tiers.items())  # fmt: skip
        load = one["row"]["load_before"].split()[0] if one["row"]["load_before"] else "?"
        what = f"fell back ({auto['fallback']})" if auto.get("fallback") else f"fitted {fit or 'declared links'}"
        parts.append(f"seed {one['seed']}: {what} at load {load}")
    return " Auto's link probe, " + "; ".join(parts) + "." if parts else ""


def paper_claims(cerar: list[tuple[Setting, dict]]) -> list[str]:
    """CERAR c=16 (the paper's setting) on every setting it ran, each figure with its seeds and phase ratios."""
    if not cerar:
        return ["CERAR c=16 not measured yet."]
    lines = ["CERAR c=16 (the paper's setting), measured on every setting it ran:", "",
             "| setting | seeds | wall / nccl | time to target / nccl | steady step / nccl | aggregation / nccl "
             "| forward+backward / nccl | gap to nccl [95 % t interval] |", "|" + " --- |" * 8]  # fmt: skip
    for setting, a in cerar:
        ttt = _x(a["ttt"]) if a["reached"] else "never"
        lines.append(f"| {setting.describe()} | {a['n']} | {_x(a['wall'])} | {ttt} | {_x(a['steady'])} | "
                     f"{_x(a['agg'])} | {_x(a['compute'])} | {_gap(a)} |")  # fmt: skip

    def claim(settings: list[tuple[Setting, dict]]) -> str:
        if not settings:
            return "not measured yet"
        parts = [f"{s.describe()}: time to target {_x(a['ttt'])}x nccl's, aggregation {_x(a['agg'])}x, "
                 f"forward+backward {_x(a['compute'])}x ({a['n']} seed{'s' * (a['n'] != 1)}"
                 + ("" if a["n"] >= HEADLINE_SEEDS else ": not a headline") + ")" for s, a in settings]
        return "; ".join(parts)

    slow = [(s, a) for s, a in cerar if s.links != "loopback"]
    fast = [(s, a) for s, a in cerar if s.links == "loopback"]
    models = {s.model: s.rate_mbit for s, _ in slow}
    lines += ["", "- *Faster on slow links* (the paper: about 17 % at identical loss): " + claim(slow) + ".",
              "- *Slower on fast links* (NVLink; here unshaped loopback): " + claim(fast) + ".",
              "- *The gap narrows with model size*: not measured: in the lab the model and the link rate change "
              "together (" + ", ".join(f"{m} at {r:g} Mbit/s" for m, r in models.items()) + ", each rate chosen for "
              "nccl's share), and on loopback CERAR c=16 has one seed per model."]  # fmt: skip
    return lines


def write_report(csv_path: Path, runs: Path, path: Path, figures_dir: Path, retired_csv: Path = RETIRED_CSV) -> str:
    """Rebuild the report and its figures from ``csv_path``, ``retired_csv`` and the run folders under ``runs``;
    returns the text."""
    rows = read_rows(csv_path)
    retired = read_rows(retired_csv, RETIRED_COLUMNS)
    settings = group(rows)
    planned = parse_settings("all", 1.0)
    measured_kinds = {(s.links, s.model) for s in settings}
    missing = [f"{s.links}:{s.model}" for s in planned if (s.links, s.model) not in measured_kinds]
    commits = sorted({r["commit"] for r in rows})
    lines = [
        "# Time to nccl's loss: every aggregator, slow and fast links (issues 34, 53)",
        "",
        f"Generated by `.venv/bin/python scripts/studies/time_to_loss.py --report` from `{appendix.rel(csv_path)}` "
        f"({len(rows)} runs, code of {len(commits)} commit{'s' * (len(commits) != 1)}; {len(retired)} retired rows "
        f"in `{appendix.rel(retired_csv)}`) and the run folders under `{appendix.rel(runs)}`. Each run: one "
        "`train/main.py` launch, the setting's aggregators one after another, the order rotated or shuffled by "
        "seed, the load average (1/5/15 min) recorded before and after each. The definitions: "
        "`scripts/studies/ttl/metric.py`, `report.py`.",
        "",
        "## How to read it (issue 53)",
        "",
        f"- **Time to target.** A setting's target is nccl's mean validation loss, over its seeds there, at its "
        f"first evaluation at or after {metric.FRACTION:.0%} of the horizon (step 150 of a 300-step run). A run's "
        "time to it is the wall time (`time/wall`: evaluations and auto's checks included) at which its validation "
        "loss first reaches it, linear in step and in time between the two evaluations around the crossing (the first "
        "evaluation at or below the target and the one before it); its steps to the target likewise. The ratio is "
        "to nccl's own time to the target at the same seed. The target at nccl's final loss (issue 34's, with its "
        "1e-6 gate) is gone: every run reached that one, if at all, at its last evaluation.",
        f"- **The end state**, judged apart: each seed's gap of the final validation loss to nccl's at the same "
        f"seed, L / L_nccl - 1 (paired: the seed fixes the initial weights and the batches); their mean with a "
        f"two-sided {metric.LEVEL:.0%} Student t interval on n - 1 degrees of freedom (none for one seed); "
        "*within nccl's band* when every seed's gap is at most nccl's seed band, (max - min) / mean of its final "
        "losses over two seeds or more. The gap at each quarter of the horizon shows whether it grows.",
        f"- **Where the time went**, over the steady state (after auto's {WARMUP_STEPS}-step exact warm-up, "
        "before the last step; a step holding a check left out): the step, the aggregation phase, and "
        "forward+backward, the same work for every aggregator of a setting, so that its ratio to nccl's is the "
        "contention the run met, not its aggregator. CPU: the run's processes' user + system seconds "
        f"(launch.json's `cpu_s`, recorded from issue 53 on: {cpu_recorded(rows, runs)} of these {len(rows)} runs "
        "have it). Load: the run's "
        "mean 1-minute load, start and end, over nccl's at the same seed. Other work's CPU share: what every "
        "other process on the machine used while the run ran, over its cores x its seconds; recorded from "
        "2026-12-05 on (the seeds that have it in brackets), it shows work that came and went between the two "
        "load samples. From 2026-12-06 on it is counted process by process (the runs whose launch.json has "
        "`others_procs_s`: every process not the run's, its own and its waited-for children's seconds, from "
        "/proc/<pid>/stat; kernel threads apart). Before, it is the machine's busy seconds from /proc/stat less "
        "the run's own (`others_cpu_s`): **at most**, since that holds the kernel's interrupt work on idle cores "
        "and its threads' too, in the lab mostly the run's own packets (interrupts alone about 2 s a minute in a "
        "two-tier run at pythia-14m; `irq_s` from 2026-12-05 23:09 UTC on). The interrupts cannot simply be taken "
        "off: this machine's kernel charges an interrupted tick to the interrupt column and to the task it "
        "interrupted (kernel/sched/cputime.c, `account_system_index_time`), so some are in the run's own seconds "
        "too. Brackets: the seeds' span.",
        f"- **Headlines** need {HEADLINE_SEEDS} seeds of the aggregator and of nccl; a figure with fewer says "
        "\"n seeds: not a headline\". A setting whose rows come from more than one commit says so, whether their "
        "code differs, and every retired (replaced) row.",
    ]  # fmt: skip
    if missing:
        lines += ["", f"**Status: a pilot.** Measured: {'; '.join(s.describe() for s in settings) or 'nothing yet'}. "
                  f"Still to run: {', '.join(missing)}; on the measured settings, every aggregator of issue 34's "
                  "list not in the tables below, and the seeds that make a headline. Issue 53's plans, one command "
                  "each (root for the lab; `--dry-run` lists the runs and their hours): `sudo nohup .venv/bin/python "
                  "scripts/studies/time_to_loss.py --plan headline > /tmp/ttl-headline.log 2>&1 &` (the flat lab at "
                  "tiny and pythia-14m, the two tiers at both: seeds 1-3 of every aggregator, shuffled, stale rows "
                  "retired and rerun at one commit) and `... --plan long` (the flat lab at pythia-14m to 1,500 "
                  "steps: nccl, bf16, CERAR c=16, CERAR c=8 over fp16 messages, seeds 1-3); with `--commit C` a plan "
                  "trains C's code (a snapshot), so that one continued after the code has moved keeps the commit of "
                  "the rows already there."
                  + appendix.unmeasured_cost(rows, missing)]  # fmt: skip
    heads, cerar = [], []
    for setting, srows in settings.items():
        section, summary = setting_section(setting, srows, runs, figures_dir, retired)
        lines += section
        heads.append((setting, *headline(summary)))
        if "cerar_c16" in summary["aggregators"]:
            cerar.append((setting, summary["aggregators"]["cerar_c16"]))
    lines += ["", "## What the rows support", ""]
    for setting, best, why in heads:
        lines.append(f"- {setting.describe()}: **{best or 'no headline'}**: {why}.")
    lines += ["", "## The paper's claims", "", *paper_claims(cerar)]
    lines += appendix.rates_section(rows)
    lines += appendix.probe_section()
    lines += ["", "## Rebuilding", "", "    .venv/bin/python scripts/studies/time_to_loss.py --report", ""]
    text = "\n".join(lines)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return text


def cpu_recorded(rows: list[dict], runs: Path) -> int:
    """How many of the rows' runs recorded their CPU seconds (launch.json's ``cpu_s``)."""
    return sum("cpu_s" in load_json(run_folder(runs, r) / "launch.json") for r in rows)


def figures(csv_path: Path, runs: Path, out: Path) -> list[Path]:
    """Every setting's figure (``time_to_loss_<setting>.png``) from the CSV and run folders: what
    ``scripts/reporting/make_figures.py`` rebuilds, the same files ``write_report`` links."""
    written = []
    for setting, srows in group(read_rows(csv_path)).items():
        path = out / f"time_to_loss_{setting.key}.png"
        if figure(setting, summarize(srows, runs / setting.key), runs, path):
            written.append(path)
    return written
