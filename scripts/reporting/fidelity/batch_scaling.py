"""The batch-scaling study (issue 19; scripts/studies/run_batch_scaling.sh): CERAR's error beside the SGD noise as
the batch grows, where the gap to nccl leaves its seed band, and the report's section and figure for it."""

from __future__ import annotations

import math
import re
import statistics
from pathlib import Path

from scripts.reporting.fidelity.runs import (
    PYTHIA_SEQ_LEN,
    PYTHIA_SEQUENCES,
    ROOT,
    _f,
    _mean_or_none,
    final,
    last_step,
    load_runs,
    median_of,
    paired_gap,
    separation_step,
)

# ------------------------------------------------------------- the batch-scaling study (issue 19)

# scripts/studies/run_batch_scaling.sh: every shape at STEPS=150, and the study's own shape at 300 (the horizon check)
BATCH_SCALING_DIR = ROOT / "reports" / "runs" / "batch-scaling-150"
BATCH_SCALING_HORIZON_DIR = ROOT / "reports" / "runs" / "batch-scaling-300"
_SHAPE = re.compile(r"^batch(?P<sequences>\d+)x(?P<seq_len>\d+)$")


def _shown(path: Path) -> str:
    """A folder as the report names it: relative to the repository when inside it."""
    path = Path(path).resolve()
    return f"{path.relative_to(ROOT)}/" if path.is_relative_to(ROOT) else f"{path}/"


def load_batch_scaling(root: Path) -> list[dict]:
    """One entry per batch shape, from folders ``batch<sequences>x<seq_len>`` under `root` holding run folders as
    `load_runs` reads them, in order of tokens per step. Each run's summary.json must say the same shape as its
    folder (global_batch_size, seq_len); a run that says otherwise stops the report, naming it. A run counts once
    it has finished (its summary.json is written at the end) at the shape's horizon (its summary's max_steps, else
    the furthest step any run of the shape reached); the others are listed under "short" (still running, or
    stopped), so a half-finished run never passes for a final loss."""
    shapes = []
    if not Path(root).is_dir():
        return shapes
    for folder in sorted(p for p in Path(root).iterdir() if p.is_dir()):
        match = _SHAPE.match(folder.name)
        settings = load_runs(folder) if match else {}
        if not settings:
            continue
        sequences, seq_len = int(match["sequences"]), int(match["seq_len"])
        runs = [run for group in settings.values() for run in group]
        for run in runs:
            said = (run["summary"].get("global_batch_size"), run["summary"].get("seq_len"))
            if said != (None, None) and said != (sequences, seq_len):
                raise ValueError(
                    f"{run['folder']}: its summary says {said[0]} sequences x {said[1]} tokens, "
                    f"its folder {sequences} x {seq_len}"
                )
        furthest = max(last_step(run) for run in runs)
        finished, short = {}, []
        for name, group in settings.items():
            for run in group:
                horizon = run["summary"].get("max_steps") or furthest
                if run["summary"] and last_step(run) >= horizon:
                    finished.setdefault(name, []).append(run)
                else:
                    short.append(f"{name}_s{run['seed']} (step {last_step(run)} of {horizon})")
        if finished:
            shapes.append(
                {"name": folder.name, "sequences": sequences, "seq_len": seq_len, "tokens": sequences * seq_len,
                 "settings": finished, "short": sorted(short)}
            )  # fmt: skip
    return sorted(shapes, key=lambda shape: (shape["tokens"], shape["sequences"]))


def noise_to_signal(noise: float | None) -> float | None:
    """r = sigma / ||mu|| from the logged noise nu = sigma / ||g_bar||: since E||g_bar||^2 = ||mu||^2 + sigma^2,
    nu^2 = r^2 / (1 + r^2). nu saturates near 1 while the noise dominates (r >> 1), so it is r, not nu, that
    falls as 1/sqrt(independent samples). None where nu >= 1 (the estimate says the noise is everything)."""
    if noise is None or not 0 < noise < 1:
        return None
    return noise / math.sqrt(1 - noise**2)


def noise_from_ratio(r: float) -> float:
    """nu = r / sqrt(1 + r^2): the noise the trainer would log at noise-to-signal ratio r."""
    return r / math.sqrt(1 + r * r)


def _c_path(run: dict) -> str | None:
    """c=auto's codes in the order it used them, from its decisions ("16>12": chose 16, moved to 12)."""
    path = []
    for decision in (run["summary"].get("auto_c") or {}).get("decisions", []):
        if not path or path[-1] != decision["c"]:
            path.append(decision["c"])
    return ">".join(str(c) for c in path) or None


def batch_scaling_rows(shapes: list[dict]) -> list[dict]:
    """One row per shape and setting: gaps to nccl (same seed) beside nccl's seed band, error and noise."""
    rows = []
    for shape in shapes:
        settings = shape["settings"]
        nccl = settings.get("nccl", [])
        nccl_finals = {r["seed"]: final(r, "val_loss") for r in nccl}
        band = 100 * (max(nccl_finals.values()) / min(nccl_finals.values()) - 1) if len(nccl_finals) > 1 else None
        steps = max(last_step(r) for runs in settings.values() for r in runs)
        noise = _mean_or_none([median_of(r, "noise/rel_std_mean", after=steps // 10) for r in nccl])
        for name, runs in sorted(settings.items(), key=lambda kv: (kv[0] != "nccl", kv[0])):
            gap = paired_gap(runs, nccl) if name != "nccl" else None
            error = _mean_or_none([median_of(r, "agg/rel_error_max", after=steps // 10) for r in runs])
            chosen = [r["summary"].get("c_chosen") for r in runs]
            paths = [p for p in (_c_path(r) for r in runs) if p]
            rows.append({
                "shape": shape["name"], "sequences": shape["sequences"], "seq_len": shape["seq_len"],
                "tokens_per_step": shape["tokens"], "setting": name, "seeds": ",".join(str(r["seed"]) for r in runs),
                "steps": min(last_step(r) for r in runs), "shape_steps": steps,
                "val_loss": statistics.mean(final(r, "val_loss") for r in runs),
                "paired_gap_pct": gap, "nccl_band_pct": band,
                "inside_band": None if gap is None or band is None else abs(gap) <= band,
                "separates_at": separation_step(runs, nccl) if nccl and name != "nccl" else None,
                "rel_error_median": error, "noise_median": noise, "noise_to_signal": noise_to_signal(noise),
                "error_over_noise": error / noise if error is not None and noise else None,
                "c_chosen": ",".join(str(c) for c in chosen) if any(c is not None for c in chosen) else None,
                "c_path": ",".join(paths) or None,
            })  # fmt: skip
    return rows


def noise_exponent(points: list[tuple[float, float]]) -> float | None:
    """The least-squares slope of log r against log x: r ~ x^-slope (0.5 when x counts independent samples)."""
    points = [(x, r) for x, r in points if r]
    if len({x for x, _ in points}) < 2:
        return None
    xs, ys = [math.log(x) for x, _ in points], [math.log(r) for _, r in points]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = -sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return round(slope, 12) + 0.0  # no -0.00 from rounding


def noise_unit(rows: list[dict]) -> dict | None:
    """How the noise-to-signal ratio r falls with sequences per step (at the smallest shape's sequence length) and
    with sequence length (at its number of sequences), and r projected to Pythia's 1024 x 2048 from the shape where
    r is smallest (best determined: nu is furthest from its saturation at 1)."""
    by_shape = {(r["sequences"], r["seq_len"]): r["noise_to_signal"] for r in rows if r["setting"] == "nccl"}
    if not by_shape:
        return None
    base = min(by_shape, key=lambda k: (k[0] * k[1], k[0]))
    sequences_slope = noise_exponent([(s, r) for (s, t), r in by_shape.items() if t == base[1]])
    length_slope = noise_exponent([(t, r) for (s, t), r in by_shape.items() if s == base[0]])
    unit = {"base": base, "sequences_exponent": sequences_slope, "seq_len_exponent": length_slope,
            "reference": None, "r_reference": None, "r_pythia": None}  # fmt: skip
    measured = {k: r for k, r in by_shape.items() if r}
    if measured and sequences_slope is not None and length_slope is not None:
        (sequences, seq_len), r = min(measured.items(), key=lambda kv: kv[1])
        unit.update(reference=(sequences, seq_len), r_reference=r)
        unit["r_pythia"] = ratio_at(unit, PYTHIA_SEQUENCES, PYTHIA_SEQ_LEN)
    return unit


def ratio_at(unit: dict, sequences: float, seq_len: float) -> float:
    """r at `sequences` x `seq_len`, from the reference shape's r and the fitted exponents."""
    ref_sequences, ref_seq_len = unit["reference"]
    a, b = unit["sequences_exponent"], unit["seq_len_exponent"]
    return unit["r_reference"] * (sequences / ref_sequences) ** -a * (seq_len / ref_seq_len) ** -b


def sequences_where_error_equals_noise(error: float, unit: dict, seq_len: int = PYTHIA_SEQ_LEN) -> float | None:
    """Sequences of `seq_len` tokens per step at which the logged noise falls to `error`, with the measured unit
    (r ~ sequences^-a x seq_len^-b); None when the noise does not fall with sequences (a <= 0) or error >= 1."""
    a = unit["sequences_exponent"]
    if unit.get("r_reference") is None or not a or a <= 0 or not 0 < error < 1:
        return None
    target = error / math.sqrt(1 - error**2)  # the r at which nu = error
    return unit["reference"][0] * (ratio_at(unit, unit["reference"][0], seq_len) / target) ** (1 / a)


def tokens_was_the_unit(unit: dict | None) -> bool | None:
    """Whether the data back the per-token rule (noise falls with sequence length as with sequences: b nearer
    0.5 than 0); None until the sequence length has been varied."""
    if not unit or unit["seq_len_exponent"] is None:
        return None
    return abs(unit["seq_len_exponent"] - 0.5) < abs(unit["seq_len_exponent"])


def band_exit(rows: list[dict], setting: str) -> dict | None:
    """Where `setting`'s same-seed gap is inside and outside nccl's seed band, and which unit of the batch
    separates the two: "sequences" when every shape outside has more sequences per step than every shape
    inside, "tokens" when the same holds for tokens per step. None when no shape has both the run and nccl's
    two seeds."""
    judged = [r for r in rows if r["setting"] == setting and r["inside_band"] is not None]
    if not judged:
        return None
    inside = [r for r in judged if r["inside_band"]]
    outside = [r for r in judged if not r["inside_band"]]
    units = []
    if outside and inside:
        for unit, key in (("sequences", "sequences"), ("tokens", "tokens_per_step")):
            if max(r[key] for r in inside) < min(r[key] for r in outside):
                units.append(unit)
    return {"inside": inside, "outside": outside, "units": units}


def _shape_of(r: dict) -> str:
    return f"{r['sequences']} x {r['seq_len']}"


def _gaps(rows: list[dict]) -> str:
    return ", ".join(
        f"{_shape_of(r)} {r['paired_gap_pct']:+.2f} % vs band {r['nccl_band_pct']:.2f} %"
        for r in sorted(rows, key=lambda r: (r["tokens_per_step"], r["sequences"]))
    )


def gap_statement(rows: list[dict], setting: str, pythia_noise: float | None) -> str:
    """Where `setting`'s same-seed gap leaves nccl's seed band, in which unit of the batch, and where Pythia's
    1024 x 2048 falls against it (by the unit, and by error/noise at the projected noise)."""
    found = band_exit(rows, setting)
    if found is None:
        return f"`{setting}`: no shape has both its run and nccl's two seeds yet."
    inside, outside, units = found["inside"], found["outside"], found["units"]
    pythia_tokens = PYTHIA_SEQUENCES * PYTHIA_SEQ_LEN
    if not outside:
        top = max(inside, key=lambda r: (r["tokens_per_step"], r["sequences"]))
        text = (
            f"`{setting}`'s same-seed gap stays inside nccl's seed band at every shape judged, up to "
            f"{top['tokens_per_step']:,} tokens per step and {max(r['sequences'] for r in inside)} sequences "
            f"({_gaps(inside)}): it leaves the band at none of them, in either unit."
        )
    elif not inside:
        text = f"`{setting}`'s same-seed gap is outside nccl's seed band at every shape judged ({_gaps(outside)})."
    else:
        first = min(outside, key=lambda r: (r["tokens_per_step"], r["sequences"]))
        seen = f"(outside: {_gaps(outside)}; inside: {_gaps(inside)})"
        if units == ["sequences", "tokens"]:
            text = (
                f"`{setting}`'s same-seed gap leaves nccl's seed band at {_shape_of(first)} "
                f"({first['tokens_per_step']:,} tokens, {first['sequences']} sequences per step) {seen}; the shapes "
                "measured do not tell whether sequences or tokens per step set it."
            )
        elif units == ["sequences"]:
            least = min(r["sequences"] for r in outside)
            text = (
                f"`{setting}`'s same-seed gap leaves nccl's seed band from {least} sequences per step, whatever "
                f"their length {seen}: its unit is sequences, not tokens (Pythia: {PYTHIA_SEQUENCES} sequences "
                f"per step, {'past' if least <= PYTHIA_SEQUENCES else 'below'} that)."
            )
        elif units == ["tokens"]:
            least = min(r["tokens_per_step"] for r in outside)
            text = (
                f"`{setting}`'s same-seed gap leaves nccl's seed band from {least:,} tokens per step, whether "
                f"added as sequences or as length {seen}: its unit is tokens (Pythia: {pythia_tokens:,} tokens per "
                f"step, {'past' if least <= pythia_tokens else 'below'} that)."
            )
        else:
            text = (
                f"`{setting}`'s same-seed gap is outside nccl's seed band at some shapes and inside at others "
                f"{seen}, and neither tokens nor sequences per step separate the two: no threshold is measured."
            )
    error = next((r["rel_error_median"] for r in reversed(rows) if r["setting"] == setting), None)
    if pythia_noise and error:
        ratio = error / pythia_noise
        ratio_out = min((r["error_over_noise"] for r in outside if r["error_over_noise"]), default=None)
        ratio_in = max((r["error_over_noise"] for r in inside if r["error_over_noise"]), default=None)
        text += f" At Pythia's {PYTHIA_SEQUENCES} x {PYTHIA_SEQ_LEN} its error/noise projects to {ratio:.3g}"
        if ratio_out is not None and ratio >= ratio_out:
            text += f", at or above the {ratio_out:.3g} at which its gap was outside the band here: expect it outside."
        elif ratio_in is not None and ratio <= ratio_in:
            text += f", at or below the {ratio_in:.3g} at which its gap stayed inside here: expect it inside."
        elif ratio_in is not None and ratio_out is not None:
            text += f", between the ratios measured inside (up to {ratio_in:.3g}) and outside (from {ratio_out:.3g})."
        elif ratio_in is not None:
            text += f", above every ratio measured here (all inside, up to {ratio_in:.3g}): these runs do not tell."
        else:
            text += f", below every ratio measured here (all outside, from {ratio_out:.3g}): these runs do not tell."
    return text


def auto_candidates(run: dict) -> dict | None:
    """c=auto's evidence from a run's summary: its error budget, the bytes per step of every candidate and each
    candidate's most recently measured worst-rank error."""
    auto = run["summary"].get("auto_c")
    if not auto or not auto.get("decisions"):
        return None
    errors = {}
    for decision in auto["decisions"]:
        errors.update({int(c): e for c, e in decision.get("errors", {}).items()})
    return {"budget": auto["error_budget"], "bytes": {int(c): b for c, b in auto["bytes_per_step"].items()},
            "errors": errors}  # fmt: skip


def auto_statement(rows: list[dict], shapes: list[dict], setting: str, pythia_noise: float | None) -> str:
    """Whether c=auto ends inside nccl's seed band at every shape, the c it used there, and what it would choose at
    Pythia's projected noise from the errors it measured at the largest batch."""
    mine = [r for r in rows if r["setting"] == setting]
    judged = [r for r in mine if r["inside_band"] is not None]
    used = ", ".join(f"{_shape_of(r)} c={r['c_path'] or r['c_chosen'] or '?'}" for r in mine)
    if not judged:
        text = f"c=auto (`{setting}`): no shape has both its run and nccl's two seeds yet (it used {used})."
    else:
        outside = [r for r in judged if not r["inside_band"]]
        where = "at every shape judged" if len(judged) == len(mine) else f"at the {len(judged)} shapes judged so far"
        text = (
            f"c=auto (`{setting}`) ends inside nccl's seed band {where} ({_gaps(judged)})"
            if not outside
            else f"c=auto (`{setting}`) ends outside nccl's seed band at {_gaps(outside)}"
        )
        text += f"; the c it used (a>b: chose a, then moved to b): {used}."
    evidence = None
    for shape in reversed(shapes):  # the largest batch with c=auto's evidence
        evidence = next((auto_candidates(r) for r in shape["settings"].get(setting, []) if auto_candidates(r)), None)
        if evidence:
            break
    if pythia_noise and evidence:
        allowed = evidence["budget"] * pythia_noise
        fitting = [c for c, e in evidence["errors"].items() if e <= allowed and c in evidence["bytes"]]
        listed = ", ".join(f"c={c} {e:.2g}" for c, e in sorted(evidence["errors"].items()))
        choice = (
            f"it would choose c={min(fitting, key=lambda c: evidence['bytes'][c])}"
            if fitting
            else "no candidate fits, and it would keep the exact ring"
        )
        text += (
            f" At Pythia's projected noise {pythia_noise:.3g} its budget ({evidence['budget']:g} x noise = "
            f"{allowed:.3g}) against the errors it measured at {shape['sequences']} x {shape['seq_len']} ({listed}): "
            f"{choice}."
        )
    return text


def _judged_table(rows: list[dict], settings: list[str]) -> list[str]:
    """One line per shape: steps, nccl's band and noise, and every setting's gap (error/noise), in or out."""
    cell = {(r["shape"], r["shape_steps"], r["setting"]): r for r in rows}
    shapes = list(
        dict.fromkeys((r["shape"], r["sequences"], r["seq_len"], r["tokens_per_step"], r["shape_steps"]) for r in rows)
    )
    out = [
        "| shape (sequences x tokens) | tokens per step | steps | nccl band | noise | noise/signal r | "
        + " | ".join(f"{s}: gap (error/noise)" for s in settings)
        + " |",
        "| --- | --- | --- | --- | --- | --- |" + " --- |" * len(settings),
    ]
    for name, sequences, seq_len, tokens, steps in shapes:
        nccl = cell.get((name, steps, "nccl"), {})
        cells = []
        for s in settings:
            r = cell.get((name, steps, s))
            if r is None:
                cells.append("-")
                continue
            gap = "-" if r["paired_gap_pct"] is None else f"{r['paired_gap_pct']:+.2f} %"
            mark = "" if r["inside_band"] is None else (" in" if r["inside_band"] else " **out**")
            ratio = "" if r["error_over_noise"] is None else f" ({r['error_over_noise']:.3g})"
            chosen = f" c={r['c_chosen']}" if r["c_chosen"] and s.endswith("auto") else ""
            cells.append(f"{gap}{mark}{ratio}{chosen}")
        band = nccl.get("nccl_band_pct")
        out.append(
            f"| {sequences} x {seq_len} | {tokens:,} | {steps} | "
            f"{'-' if band is None else f'{band:.2f} %'} | {_f(nccl.get('noise_median'), '.3g')} | "
            f"{_f(nccl.get('noise_to_signal'), '.3g')} | " + " | ".join(cells) + " |"
        )
    return out


def render_batch_scaling(
    rows: list[dict],
    shapes: list[dict] | None = None,
    horizon_rows: list[dict] | None = None,
    runs_dir: Path = BATCH_SCALING_DIR,
    horizon_dir: Path = BATCH_SCALING_HORIZON_DIR,
) -> list[str]:
    """The section of the report: gap against batch with nccl's seed band, error/noise, the noise's unit, the answer
    to issue 19 (where c=16's gap leaves the band, with and without resync; c=auto; Pythia's batch) and the
    horizon check against the longer run of the study's shape."""
    if not rows:
        return []
    shapes = shapes or []
    settings = sorted({r["setting"] for r in rows} - {"nccl"})
    steps = sorted({r["steps"] for r in rows})
    out = [
        "",
        "## Does the gap grow with the batch? (issue 19)",
        "",
        f"Generated from `{_shown(runs_dir)}` (`scripts/studies/run_batch_scaling.sh`): the study's setup at larger "
        "global batches, sequences and sequence length varied separately, every shape "
        f"{' or '.join(str(s) for s in steps)} steps. "
        "Gap: the final validation loss against nccl's at the same seed. Band: nccl's two seeds' spread; a gap is "
        "inside it when its size is at most the band's; a shape is judged once nccl's two seeds and the setting's "
        "run have finished there. Error/noise: the worst rank's aggregation error over the "
        "gradient noise, medians after the first tenth of the steps.",
        "",
        *_judged_table(rows, settings),
    ]
    short = [f"{shape['sequences']} x {shape['seq_len']}: {', '.join(shape['short'])}" for shape in shapes
             if shape["short"]]  # fmt: skip
    if short:
        out += ["", "Not counted yet (no summary.json at the horizon: still running, or stopped): " + "; ".join(short)]
    unit = noise_unit(rows)
    a, b = (unit["sequences_exponent"], unit["seq_len_exponent"]) if unit else (None, None)
    pythia_noise = None
    if a is not None or b is not None:  # two shapes along an axis at least
        r_pythia = unit["r_pythia"]
        out += [
            "",
            "The logged noise nu = sigma/||g_bar|| saturates near 1 while the noise dominates (E||g_bar||^2 = "
            "||mu||^2 + sigma^2), so the table also gives r = sigma/||mu|| = nu/sqrt(1 - nu^2), which falls as "
            "1/sqrt(n) with n independent samples per step. Fitted r ~ sequences^-a x seq_len^-b: "
            f"a = {_f(a, '.2f')} (sequences varied at {unit['base'][1]} tokens), b = {_f(b, '.2f')} (sequence length "
            f"varied at {unit['base'][0]} sequences); a = b = 0.5 would make tokens the unit, a = 0.5, b = 0 "
            "sequences.",
        ]
        if r_pythia is not None:
            pythia_noise = noise_from_ratio(r_pythia)
            errors = {}
            for r in rows:  # each setting's error at its largest batch
                if r["rel_error_median"] and r["setting"] != "nccl":
                    errors[r["setting"]] = r["rel_error_median"]
            out += [
                "",
                f"Projected with these exponents from {unit['reference'][0]} x {unit['reference'][1]} (r = "
                f"{unit['r_reference']:.3g}) to Pythia's {PYTHIA_SEQUENCES} x {PYTHIA_SEQ_LEN}: r = {r_pythia:.3g}, "
                f"logged noise {pythia_noise:.3g}; "
                + "; ".join(
                    f"{s}: error {e:.3g}, error/noise {e / pythia_noise:.3g}" for s, e in sorted(errors.items())
                )
                + " (one small model on one corpus: the noise level is model- and data-dependent).",
            ]
    fixed = [s for s in settings if not s.endswith("auto")]
    out += ["", "What this answers:", ""]
    out += [f"- {gap_statement(rows, s, pythia_noise)}" for s in fixed]
    out += [f"- {auto_statement(rows, shapes, s, pythia_noise)}" for s in settings if s.endswith("auto")]
    if pythia_noise is None:
        out.append(
            "- Pythia's batch: not projected yet; that needs nccl's noise at shapes that vary the number of "
            "sequences and the sequence length."
        )
    out += horizon_check(rows, horizon_rows or [], horizon_dir)
    return out


def horizon_check(rows: list[dict], horizon_rows: list[dict], horizon_dir: Path) -> list[str]:
    """The gap and band of every shape the longer run measured, beside this study's at the same shape: whether the
    shorter horizon changes the picture."""
    shapes = {r["shape"] for r in horizon_rows}
    if not shapes:
        return []
    here = [r for r in rows if r["shape"] in shapes]
    settings = sorted({r["setting"] for r in horizon_rows + here} - {"nccl"})
    out = [
        "",
        "### Horizon check: the same shape run longer",
        "",
        f"`{_shown(horizon_dir)}` ran {', '.join(sorted(shapes))} for {max(r['steps'] for r in horizon_rows)} steps "
        "(the learning-rate schedule spans each run's own steps). The long-horizon study measured that the gap grows "
        "with steps at this batch; the lines below put the two horizons side by side.",
        "",
        *_judged_table(sorted(here + horizon_rows, key=lambda r: (r["shape"], r["shape_steps"])), settings),
        "",
    ]
    for setting in settings:
        pairs = [
            (h, next((r for r in here if r["shape"] == h["shape"] and r["setting"] == setting), None))
            for h in horizon_rows
            if h["setting"] == setting and h["inside_band"] is not None
        ]
        for longer, shorter in pairs:
            said = f"- `{setting}` at {_shape_of(longer)}: {longer['paired_gap_pct']:+.2f} % against a band of "
            said += f"{longer['nccl_band_pct']:.2f} % at {longer['steps']} steps"
            if shorter is not None and shorter["inside_band"] is not None:
                same = "the same verdict" if shorter["inside_band"] == longer["inside_band"] else "a different verdict"
                said += (
                    f", {shorter['paired_gap_pct']:+.2f} % against {shorter['nccl_band_pct']:.2f} % at "
                    f"{shorter['steps']} steps: {same} ({'inside' if longer['inside_band'] else 'outside'} at "
                    f"{longer['steps']})."
                )
            else:
                said += f" ({'inside' if longer['inside_band'] else 'outside'}); not judged yet at the shorter horizon."
            out.append(said)
    return out
