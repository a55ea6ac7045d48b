"""The time-to-loss study's settings (issue 34): the links, the models, the aggregators of each, the CSV's columns.

A *setting* is one (links, rate, hosts, ranks per host, model); its aggregators run interleaved, the order
rotated by seed. The aggregator names are the CSV's ``aggregator`` column; ``AGGREGATORS`` gives each one's
``train/main.py`` overrides (the config it runs), so a name means one configuration everywhere.
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
"""The CSV's columns, exactly issue 34's, in its order."""

DEFAULT_CSV = ROOT / "reports" / "data" / "time_to_loss.csv"
DEFAULT_RUNS = ROOT / "reports" / "runs" / "time_to_loss"
DEFAULT_REPORT = ROOT / "reports" / "time_to_loss.md"
DEFAULT_FIGURES = ROOT / "reports" / "figures"
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
MICRO_BATCH = {"tiny": 8, "pythia-14m": 4, "pythia-31m": 4}
SEQ_LEN = {"tiny": 128, "pythia-14m": 64, "pythia-31m": 64}
"""Sequences per rank per step and their length, per model. The Pythia sizes take the fidelity study's shape
(run_fidelity.sh X: micro-batch 4 of 64 tokens): their 50,304-row output layer makes a step of tiny's shape
about 3x as long on this 2-core machine, and at this shape nccl's validation loss at pythia-14m falls from 10.8
to 6.3 over 300 steps and flattens (6.43, 6.36, 6.32 at steps 200, 250, 300)."""


@dataclasses.dataclass(frozen=True)
class Setting:
    """One place and model: ``links`` is ``lab`` (one rank per host), ``lab-4x2`` (two tiers) or ``loopback``."""

    links: str
    rate_mbit: float | None
    hosts: int
    ranks_per_host: int
    model: str

    @property
    def ranks(self) -> int:
        return self.hosts * self.ranks_per_host

    @property
    def key(self) -> str:
        """The run folder's name: links, rate and model (``lab-100mbit-tiny``)."""
        rate = f"-{self.rate_mbit:g}mbit" if self.rate_mbit else ""
        return f"{self.links}{rate}-{self.model}"

    @property
    def aggregators(self) -> list[str]:
        return TWO_TIER if self.links == "lab-4x2" else FLAT

    def row_key(self) -> tuple:
        """The CSV's identity of this setting (as strings, as a CSV row reads back)."""
        return (self.links, "" if self.rate_mbit is None else f"{self.rate_mbit:g}", str(self.hosts),
                str(self.ranks_per_host), self.model)  # fmt: skip

    def describe(self) -> str:
        if self.links == "loopback":
            return f"loopback, {self.ranks} ranks (unshaped), {self.model}"
        shape = f"{self.hosts} hosts" + (f" x {self.ranks_per_host} ranks" if self.ranks_per_host > 1 else "")
        return f"lab, {shape} at {self.rate_mbit:g} Mbit/s, {self.model}"


LINKS = ("lab", "lab-4x2", "loopback")


def setting_of(links: str, model: str, rate_mbit: float) -> Setting:
    """The study's setting for a links kind and model; a bad name raises ValueError naming it."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; the study runs {MODELS}")
    if links == "lab":
        return Setting("lab", rate_mbit, 4, 1, model)
    if links == "lab-4x2":
        return Setting("lab-4x2", rate_mbit, 4, 2, model)
    if links == "loopback":
        return Setting("loopback", None, 1, 4, model)  # one machine of 4 ranks (torchrun --standalone)
    raise ValueError(f"unknown links {links!r}; choose from {list(LINKS)}")


def parse_settings(text: str, rate_mbit: float) -> list[Setting]:
    """``lab:tiny,loopback:pythia-14m`` or ``all`` (every links kind x every model)."""
    if text.strip() == "all":
        return [setting_of(links, model, rate_mbit) for model in MODELS for links in LINKS]
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        links, sep, model = part.partition(":")
        if not sep:
            raise ValueError(f"setting {part!r} is not LINKS:MODEL (e.g. lab:tiny)")
        out.append(setting_of(links, model, rate_mbit))
    return out
