"""The time-to-loss study's figures: validation loss against wall clock, one setting per figure, one colour per
aggregator (its later seeds dashed), the setting's target dotted (``metric``)."""

from __future__ import annotations

from pathlib import Path

from scripts.studies.ttl.rows import curve, read_metrics
from scripts.studies.ttl.settings import Setting


def figure(setting: Setting, summary: dict, runs: Path, path: Path) -> bool:
    """One setting's figure from its summary (``report.summarize``) and run folders; False when no run folder
    holds a curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    drawn = False
    colours = plt.get_cmap("tab10")
    for i, (name, agg) in enumerate(summary["aggregators"].items()):
        for j, one in enumerate(agg["seeds"]):
            points = curve(read_metrics(runs / setting.key / f"{name}_s{one['seed']}"))
            if not points:
                continue
            t, loss = zip(*points, strict=True)
            ax.plot(t, loss, color=colours(i % 10), linestyle="-" if j == 0 else "--", linewidth=1.2,
                    label=name if j == 0 else None)  # fmt: skip
            drawn = True
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
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
