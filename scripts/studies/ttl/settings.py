"""The time-to-loss study's settings (issues 34, 53): the links, the models, the aggregators of each, the CSV's
columns, the plans the lead runs.

A *setting* is one (links, rate, hosts, ranks per host, model, horizon); its aggregators run interleaved, the order
rotated or shuffled by seed. The aggregator names are the CSV's ``aggregator`` column; ``AGGREGATORS`` gives each
one's ``train/main.py`` overrides (the config it runs), so a name means one configuration everywhere.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

COLUMNS = [
    "links", "rate_mbit", "hosts", "ranks_per_host", "model", "aggregator", "chosen", "seed", "steps", "wall_s",
    "steps_s", "aggregate_share", "bytes_per_step", "final_val_loss", "time_to_target_s", "load_before",
    "load_after", "commit",
]  # fmt: skip
"""The CSV's columns, exactly issue 34's, in its order. ``time_to_target_s`` is issue 53's: wall seconds to the
setting's target (``metric.target``: nccl's mean validation loss at half the horizon over its seeds), interpolated
between evaluations (``metric.crossing``); it moves when nccl gains a seed, so ``--retarget`` recomputes it from the
run folders and the study does after every setting."""

DEFAULT_CSV = ROOT / "reports" / "data" / "time_to_loss.csv"
DEFAULT_RUNS = ROOT / "reports" / "runs" / "time_to_loss"
DEFAULT_REPORT = ROOT / "reports" / "time_to_loss.md"
DEFAULT_FIGURES = ROOT / "reports" / "figures"
RETIRED_CSV = ROOT / "reports" / "data" / "time_to_loss_retired.csv"
RETIRED_COLUMNS = [*COLUMNS, "retired_in", "reason"]
"""Rows taken out of the CSV and rerun: the row as it was, where it was retired (the commit, or the UTC time the
study retired it) and why; the report discloses every one beside its setting."""
RETIRED_RUNS = ROOT / "reports" / "runs" / "time_to_loss_retired"
RATES_CSV = ROOT / "reports" / "data" / "time_to_loss_rates.csv"
RATE_COLUMNS = ["rate_mbit", "model", "hosts", "seed", "steps", "aggregate_share", "step_s", "aggregate_s",
                "load_before", "load_after", "commit"]  # fmt: skip

PAPER_SHARE = 0.36
"""nccl's aggregation share of a step in the paper's PCIe setting: -17 % training time from -47 % all-reduce time
(Pythia-1.4B, not overlapped) means the all-reduce was at least 0.17 / 0.47 = 36 % of the step
(reports/costmodel.md, "Side by side with the paper"). The lab's rate is chosen to give nccl about this share."""

AGGREGATORS: dict[str, list[str]] = {
    "nccl": ["aggregator=nccl"],
    "fp16": ["aggregator=fp16"],
    "bf16": ["aggregator=bf16"],
    "int8": ["aggregator=int8"],
    "cerar_c16": ["aggregator=cerar", "c=16"],  # the paper's setting
    "cerar_cauto": ["aggregator=cerar", "c=auto"],
    "cerar16_c5": ["aggregator=cerar", "c=5", "aggregator.transport=float16"],  # c = N + 1 at N = 4
    "cerar16_c8": ["aggregator=cerar", "c=8", "aggregator.transport=float16"],  # c = 2N at N = 4
    "auto": ["aggregator=auto"],
    "hier_ring": ["aggregator=hier_ring"],
    "hier_fp16": ["aggregator=hier_fp16"],
    "hier_int8": ["aggregator=hier_int8"],
    "hier_cerar_c16": ["aggregator=hier_cerar", "c=16"],  # c = 4n between n = 4 hosts, as the paper's c = 4N
    "hier_cerar16_c8": ["aggregator=hier_cerar", "c=8", "aggregator.transport=float16"],  # c = 2n, fp16 messages
    # issue 54: 4 bits (rotated, stochastic), without and with error feedback, every tensor's error logged
    "int4": ["aggregator=int4", "trainer.measure_error_every=10"],
    "int4_ef": ["aggregator=int4", "aggregator.error_feedback=true", "trainer.measure_error_every=1"],
    # issue 54 on two tiers: 8 bits inside each host, 4 between them (cerar.int4.two_tier), every tensor's error logged
    "hier_int4": ["aggregator=hier_int4", "trainer.measure_error_every=10"],
    # the same with exact float32 sums inside each host (the faster of the two in the 4x2 lab, docs/int4.md)
    "hier_int4_exact": ["aggregator=hier_int4", "aggregator.intra=exact", "trainer.measure_error_every=10"],
}

FLAT = ["nccl", "fp16", "bf16", "int8", "cerar_c16", "cerar_cauto", "cerar16_c5", "cerar16_c8", "auto"]
"""Issue 34's list for one rank per host (the flat lab, loopback)."""
TWO_TIER = ["nccl", "hier_ring", "hier_fp16", "hier_int8", "hier_cerar_c16", "hier_cerar16_c8", "int8", "auto"]
"""Issue 34's list on 4 hosts x 2 ranks (nccl is the flat exact all-reduce every ratio is taken against)."""

MODELS = ["tiny", "pythia-14m", "pythia-31m"]
STEPS = {"tiny": 300, "pythia-14m": 300, "pythia-31m": 300}
"""The horizon per model: the same for every aggregator of a setting; at tiny nccl's validation loss has fallen from
9.0 to about 6 and flattens by then (docs/training.md's quick start: 300 steps)."""
EVAL_EVERY = {"tiny": 15, "pythia-14m": 15, "pythia-31m": 15}
WARMUP_STEPS = 100
"""aggregator=auto's and c=auto's exact warm-up (configs: aggregator.auto_warmup_steps; the study keeps it): the
steady state every aggregator of a setting is timed over starts after it (``metric.steady_window``)."""
RATE_MBIT = {"tiny": 200.0, "pythia-14m": 1000.0}
"""The lab's rate per model (``--calibrate``, reports/data/time_to_loss_rates.csv): where nccl's aggregation share
is closest to the paper's 0.36. pythia-31m has none yet: a lab setting of it needs ``--rate-mbit``."""
MICRO_BATCH = {"tiny": 8, "pythia-14m": 4, "pythia-31m": 4}
SEQ_LEN = {"tiny": 128, "pythia-14m": 64, "pythia-31m": 64}
"""Sequences per rank per step and their length, per model. The Pythia sizes take the fidelity study's shape
(run_fidelity.sh X: micro-batch 4 of 64 tokens): their 50,304-row output layer makes a step of tiny's shape
about 3x as long on this 2-core machine, and at this shape nccl's validation loss at pythia-14m falls from 10.8
to 6.3 over 300 steps and flattens (6.43, 6.36, 6.32 at steps 200, 250, 300)."""


@dataclasses.dataclass(frozen=True)
class Setting:
    """One place, model and horizon: ``links`` is ``lab`` (one rank per host), ``lab-4x2`` (two tiers) or
    ``loopback``; ``steps`` the horizon (None: the model's, ``STEPS``)."""

    links: str
    rate_mbit: float | None
    hosts: int
    ranks_per_host: int
    model: str
    steps: int | None = None

    def __post_init__(self) -> None:
        if self.steps is None:
            object.__setattr__(self, "steps", STEPS.get(self.model, 0))

    @property
    def ranks(self) -> int:
        return self.hosts * self.ranks_per_host

    @property
    def key(self) -> str:
        """The run folder's name: links, rate, model and a horizon other than the model's
        (``lab-200mbit-tiny``, ``lab-1000mbit-pythia-14m-1500steps``)."""
        rate = f"-{self.rate_mbit:g}mbit" if self.rate_mbit else ""
        horizon = f"-{self.steps}steps" if self.steps != STEPS.get(self.model) else ""
        return f"{self.links}{rate}-{self.model}{horizon}"

    @property
    def aggregators(self) -> list[str]:
        return TWO_TIER if self.links == "lab-4x2" else FLAT

    def row_key(self) -> tuple:
        """The CSV's identity of this setting's place and model (as strings, as a CSV row reads back); a row's
        ``steps`` is its horizon."""
        return (self.links, "" if self.rate_mbit is None else f"{self.rate_mbit:g}", str(self.hosts),
                str(self.ranks_per_host), self.model)  # fmt: skip

    def describe(self) -> str:
        horizon = f", {self.steps} steps" if self.steps != STEPS.get(self.model) else ""
        if self.links == "loopback":
            return f"loopback, {self.ranks} ranks (unshaped), {self.model}{horizon}"
        shape = f"{self.hosts} hosts" + (f" x {self.ranks_per_host} ranks" if self.ranks_per_host > 1 else "")
        return f"lab, {shape} at {self.rate_mbit:g} Mbit/s, {self.model}{horizon}"


LINKS = ("lab", "lab-4x2", "loopback")


def setting_of(links: str, model: str, rate_mbit: float | None = None, steps: int | None = None) -> Setting:
    """The study's setting for a links kind and model (the lab at ``rate_mbit``, None: the model's ``RATE_MBIT``);
    a bad name, or a lab setting with no rate, raises ValueError naming it."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; the study runs {MODELS}")
    if links == "loopback":
        return Setting("loopback", None, 1, 4, model, steps)  # one machine of 4 ranks (torchrun --standalone)
    if links not in LINKS:
        raise ValueError(f"unknown links {links!r}; choose from {list(LINKS)}")
    rate = rate_mbit if rate_mbit is not None else RATE_MBIT.get(model)
    if rate is None:
        raise ValueError(f"{links}:{model}: no calibrated lab rate for {model} (RATE_MBIT); give --rate-mbit")
    return Setting(links, rate, 4, 2 if links == "lab-4x2" else 1, model, steps)


def parse_settings(text: str, rate_mbit: float | None = None, steps: int | None = None) -> list[Setting]:
    """``lab:tiny,loopback:pythia-14m`` or ``all`` (every links kind x every model), at ``rate_mbit`` in the lab
    (None: each model's ``RATE_MBIT``) and ``steps`` (None: each model's horizon)."""
    if text.strip() == "all":
        return [setting_of(links, model, rate_mbit, steps) for model in MODELS for links in LINKS]
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        links, sep, model = part.partition(":")
        if not sep:
            raise ValueError(f"setting {part!r} is not LINKS:MODEL (e.g. lab:tiny)")
        out.append(setting_of(links, model, rate_mbit, steps))
    return out


HEADLINE_SETTINGS = "lab:tiny,lab:pythia-14m,lab-4x2:tiny,lab-4x2:pythia-14m"
"""Issue 53's headline settings (the flat lab at tiny and pythia-14m, the two tiers at both), each at its model's
rate: every aggregator at three seeds or more, in a shuffled order, on one commit (``--retire-stale``)."""
HEADLINE_SEEDS = [1, 2, 3]
LONG_SETTING = "lab:pythia-14m"
LONG_STEPS = 1500
LONG_EVAL_EVERY = 75
"""Issue 53's longer horizon: 1,500 steps on the flat lab at pythia-14m (1000 Mbit/s), evaluated every 75 steps
(20 evaluations, as the 300-step runs' every 15), where CERAR over fp16 messages' gap to nccl grew over 300 steps
(seed 1: +0.08 % at step 75, +0.19-0.21 % at 150, +0.28-0.31 % at 300)."""
LONG_AGGREGATORS = ["nccl", "bf16", "cerar_c16", "cerar16_c8"]
"""nccl, the fastest 16-bit there (bf16: 0.69x nccl's time to the target, fp16 0.79x, one seed each: the headline
plan's seeds decide; ``--aggregators`` adds fp16), CERAR c=16 (the paper's) and CERAR over fp16 messages (c=8 = 2N:
+0.28 % at 300 steps)."""
