"""The time-to-loss study's figures, one setting per figure, one colour per aggregator, the same in every figure
(``colour``; its later seeds dashed):
left, validation loss against wall clock, the setting's target dotted (``metric``); right, each run's gap to nccl's
loss at the same seed and step against the step (``metric.paired_gaps``), nccl's seed band at the end dotted: where
a gap grows over the horizon and where it settles."""

from __future__ import annotations

from pathlib import Path

from scripts.studies.ttl.rows import curve, read_metrics
from scripts.studies.ttl.settings import AGGREGATORS, Setting

_TAB10 = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]
_DARK2 = ["#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#e6ab02", "#a6761d", "#66a61e", "#666666"]
COLOURS = dict(zip(AGGREGATORS, _TAB10 + _DARK2, strict=True))
"""Each aggregator's colour, by its place in the study's catalogue (``settings.AGGREGATORS``): matplotlib's tab10 for
the first ten (the flat list, then ``hier_ring``), Dark2 for the rest, so that no two in the catalogue share one and
a reader can follow an aggregator from figure to figure (a colour by its place in one figure's legend shifted when
a setting lacked one)."""


def colour(name: str) -> str:
    """The colour of ``name`` in every figure; grey-black for a name outside the catalogue (a retired one)."""
    return COLOURS.get(name, "#333333")


def figure(setting: Setting, summary: dict, runs: Path, path: Path) -> bool:
    """One setting's figure from its summary (``report.summarize``) and run folders; False when no run folder
    holds a curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, right) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": (1.2, 1)})
    drawn = False
    for name, agg in summary["aggregators"].items():
        for j, one in enumerate(agg["seeds"]):
            style = {"color": colour(name), "linestyle": "-" if j == 0 else "--", "linewidth": 1.2}
            points = curve(read_metrics(runs / setting.key / f"{name}_s{one['seed']}"))
            if points:
                t, loss = zip(*points, strict=True)
                ax.plot(t, loss, label=name if j == 0 else None, **style)
                drawn = True
            if name != "nccl" and one.get("gaps"):
                steps, gaps = zip(*one["gaps"], strict=True)
                right.plot(steps, [100 * g for g in gaps], marker=".", markersize=3, **style)
    if not drawn:
        plt.close(fig)
        return False
    if any(len(agg["seeds"]) > 1 for agg in summary["aggregators"].values()):
        ax.plot([], [], color="black", linestyle="--", linewidth=1.2, label="(dashed: its later seeds)")
    if summary["target"] is not None:
        step, loss, n = summary["target"]
        ax.axhline(loss, color="grey", linestyle=":", linewidth=1,
                   label=f"target: nccl's mean at step {step} ({n} seed{'s' * (n > 1)})")  # fmt: skip
    ax.set_xlabel("wall clock, s (the loop, evaluations included)")
    ax.set_ylabel("validation loss")
    ax.set_title(f"{setting.describe()}: validation loss against wall clock")
    ax.set_ylim(top=min(ax.get_ylim()[1], max(summary["nccl_losses"] or [10]) + 2.5))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _gap_panel(right, setting, summary)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _gap_panel(ax, setting: Setting, summary: dict) -> None:
    """The right panel's frame: zero, nccl's seed band at the end (where it has two seeds or more), its limits set
    by the gaps after the horizon's first tenth (the first evaluations' gaps, where they are large, would flatten
    the rest)."""
    ax.axhline(0, color="black", linewidth=0.8)
    late = [100 * abs(g) for agg in summary["aggregators"].values() for one in agg["seeds"]
            for step, g in one.get("gaps") or [] if step >= setting.steps / 10]  # fmt: skip
    band = summary["band"]
    if band is not None:
        ax.axhline(100 * band, color="grey", linestyle=":", linewidth=1,
                   label=f"nccl's seed band at the end, {100 * band:.2f} % ({len(summary['nccl_losses'])} seeds)")
        ax.legend(fontsize=8)
    if late:
        top = 1.3 * max(late + [100 * band if band is not None else 0.0])
        ax.set_ylim(-top, top)
    ax.set_xlabel("step")
    ax.set_ylabel("gap to nccl's loss at the same seed and step, %")
    ax.set_title("the gap's course (paired by seed)", fontsize=10)
    ax.grid(alpha=0.3)
