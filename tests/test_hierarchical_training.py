"""The trainer with the hierarchical aggregators (hier_cerar, hier_ring): their configuration checked before
any process group starts, real CPU training runs of model=tiny on 2 nodes x 2 ranks (emulated on one
torchrun with aggregator.local_size=2), and two torchrun agents joined by a c10d rendezvous, whose layout
comes from torchrun itself (LOCAL_WORLD_SIZE, GROUP_RANK).

The bounds on the logged aggregation error are derived from the step's own logged SGD noise: with
N ranks whose relative spread around the mean g_bar is noise (``noise/rel_std_mean``, the loop's estimate
sqrt(sum_r ||g_r - g_bar||^2 / (N (N-1))) / ||g_bar||), sum_r ||g_r|| <= N ||g_bar|| (1 + sqrt(N-1) noise);
a float32 sum of N terms errs by at most (N-1) u sum_r |g_r| (u = 2^-24), the exact hierarchy and the
loop's reference all-reduce alike; and CERAR's node 0 errs by at most eps ||the later nodes' sum|| (the
spec's "Why it works": (a^n - 1) times the wrapped nodes' sum, |a^n - 1| <= eps for the perturbation
construction), plus its rounding, ``cerar.ring.precision.rounding_bound`` times the norm of the rail's inputs.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cerar.ring.precision import rounding_bound
from tests import runs
from tests.distributed import c10d_rendezvous_options, held_store, run_script
from tests.runs import composed
from train.config import ConfigError, training_identity, validate

ROOT = Path(__file__).resolve().parents[1]
U = 2.0**-24

SMALL = [*runs.SMALL, "checkpoint.every=0", "trainer.drift_every=3"]  # the shared launches' size, plus drift


# --- configuration: refused before any process group --------------------------------------------------


@pytest.mark.quick
def test_the_hierarchical_choices_compose_and_validate(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    for name in ("hier_cerar", "hier_cerar_optimized", "hier_cerar_perturbation", "hier_ring"):
        cfg = composed(f"aggregator={name}", "c=8")
        validate(cfg, world_size=8)  # 4 nodes of 2: a code for n=4, c=8
        assert cfg.aggregator.kind == ("hier_ring" if name == "hier_ring" else "hier_cerar")
    assert composed("aggregator=hier_cerar").aggregator.construction == "optimized"
    validate(composed("aggregator=hier_cerar_vandermonde", "c=3"), world_size=6)  # 3 nodes, c=3
    # the hierarchical settings enter a run's identity only for the hierarchical aggregators
    assert "aggregator.local_size" in training_identity(composed("aggregator=hier_ring"), 4)
    assert "aggregator.local_size" not in training_identity(composed("aggregator=cerar", "c=4"), 4)


@pytest.mark.quick
@pytest.mark.parametrize(
    ("overrides", "environ", "world_size", "message"),
    [
        (["aggregator=hier_cerar"], {"LOCAL_WORLD_SIZE": "4"}, 6, "6 is not a multiple of LOCAL_WORLD_SIZE=4"),
        (["aggregator=hier_ring", "aggregator.local_size=4"], {}, 6, "6 is not a multiple of local_size=4"),
        (
            ["aggregator=hier_cerar_vandermonde", "c=16", "aggregator.local_size=2"],
            {},
            8,
            "aggregator=hier_cerar_vandermonde with n=4 nodes (4 nodes x 2 ranks), c=16: kappa_max=10000 is",
        ),
        (["aggregator=hier_cerar", "aggregator.construction=exact", "c=4"], {"LOCAL_WORLD_SIZE": "2"}, 6, "c <= N"),
        (["aggregator=hier_cerar", "c=auto"], {"LOCAL_WORLD_SIZE": "2"}, 6, "c=auto chooses a CERAR code"),
        (["aggregator=hier_ring", "aggregator.local_size=0"], {}, 4, "aggregator.local_size=0 must be >= 1"),
        (["aggregator=hier_cerar"], {}, 4, "aggregator=hier_cerar needs the node layout: launch with torchrun"),
    ],
)
def test_a_layout_or_code_that_cannot_work_stops_at_validation(monkeypatch, overrides, environ, world_size, message):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(composed(*overrides), world_size=world_size)


def test_the_entry_point_refuses_a_bad_layout_in_one_line_before_any_process_group(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env.update(WORLD_SIZE="6", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="4")
    args = ["aggregator=hier_cerar", f"hydra.run.dir={tmp_path}"]
    proc = run_script(ROOT / "train" / "main.py", args, env, ROOT, timeout_s=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "error: aggregator=hier_cerar: NodeLayout.from_env: the world size 6 is not a multiple" in proc.stderr
    assert "Traceback" not in proc.stderr


# --- training runs ------------------------------------------------------------------------------------


def torchrun(launcher: list[str], script: str, args: list[str], cache: Path, timeout: int):
    """Run `script` under torch.distributed.run with `launcher`'s options; returns the finished process."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(CERAR_PYTHIA_CACHE=str(cache), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher, str(ROOT / "train" / script), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def finished(proc: subprocess.Popen, timeout: int) -> tuple[str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    assert proc.returncode == 0, out[-3000:] + err[-6000:]
    return out, err


def read_run(run_dir: Path) -> tuple[list[dict], dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return records, json.loads((run_dir / "summary.json").read_text())


def tier_bytes(d: int, nodes: int, G: int, c: int | None) -> tuple[int, int]:
    """Bytes one rank sends per step inside its node and on its rail, float32: reduce-scatter and all-gather of
    G shards of s = ceil(d/G) values; on the rail CERAR's c + n - 2 rounds of ceil(s/c) values, or the exact
    ring's 2 (n - 1) rounds of ceil(s/n)."""
    s = math.ceil(d / G)
    inter = (c + nodes - 2) * math.ceil(s / c) if c is not None else 2 * (nodes - 1) * math.ceil(s / nodes)
    return 2 * (G - 1) * s * 4, inter * 4


def exact_bound(N: int, noise: float) -> float:
    """Relative gap allowed between two float32 sums of the same N gradients (module docstring)."""
    return 2 * ((N - 1) * (1 + math.sqrt(N - 1) * noise) + 2) * U


def check_trains(records: list[dict], summary: dict, steps: int) -> None:
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert records[-1]["train_loss"] < records[0]["train_loss"] - 0.1, [r["train_loss"] for r in records]
    assert summary["final_step"] == steps and math.isfinite(summary["final_val_loss"])


def tiny_tensors() -> int:
    """How many parameter tensors the runs' model (model=tiny) has."""
    from tests.runs import composed
    from train.model import build_model

    return sum(p.requires_grad for p in build_model(composed("model=tiny").model).parameters())


def check_tiers(records, summary, nodes: int, G: int, c: int | None, flat: bool) -> None:
    """Bytes per tier in every step's record (the same W&B fields as bytes_sent), equal to the formulas in
    flat mode (one call on the whole gradient) and adding up to bytes_sent in hook mode (one call per bucket)."""
    intra, inter = tier_bytes(summary["parameters"], nodes, G, c)
    if c is not None:  # CERAR equilibrates (aggregator.equilibrate, on by default): one ring all-reduce of the
        # tensors' float64 sums of squares over all N ranks agrees the scales, counted between the nodes
        inter += 2 * (nodes * G - 1) * tiny_tensors() * 8 // (nodes * G)
    for r in records:
        assert r["bytes_sent/intra_node"] + r["bytes_sent/inter_node"] == r["bytes_sent"] > 0
        if flat:
            assert (r["bytes_sent/intra_node"], r["bytes_sent/inter_node"]) == (intra, inter), r
    assert (summary["nodes"], summary["local_size"]) == (nodes, G)


def replicas_per_node(summary: dict, G: int) -> list[str]:
    """The parameter fingerprint of each node, after checking that every rank of a node holds the same."""
    shas = summary["param_sha256_per_rank"]
    nodes = [shas[k : k + G] for k in range(0, len(shas), G)]
    assert all(len(set(node)) == 1 for node in nodes), shas
    return [node[0] for node in nodes]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_nodes_of_two_ranks_train_with_both_hierarchical_aggregators(tmp_path, cache_dir):
    """One launch of 4 ranks (as torchrun starts them), two nodes of two (aggregator.local_size=2): hierarchical
    CERAR coded on the two nodes (perturbation c=4), as the library chooses there (the exact ring between the nodes),
    the exact hierarchy, and both as DDP hooks (the coded one with resync)."""
    c, two_by_two = 4, "aggregator.local_size=2"
    coded = f"aggregator=hier_cerar_perturbation c={c} aggregator.coded_on_two_nodes=true {two_by_two}"
    settings = {
        "coded": f"{coded} trainer.measure_error_every=3",
        "as_chosen": f"aggregator=hier_cerar c={c} {two_by_two} trainer.measure_error_every=3",
        "exact": f"aggregator=hier_ring {two_by_two} trainer.measure_error_every=3",
        "coded_hook": f"{coded} trainer.overlap=true trainer.resync_every=3",
        "exact_hook": f"aggregator=hier_ring {two_by_two} trainer.overlap=true",
    }
    proc = runs.torchrun(4, "sweep.py", [str(tmp_path), *(f"{lb}: {o}" for lb, o in settings.items()), "--", *SMALL],
                         cache_dir, timeout=850)  # fmt: skip
    out, err = proc.stdout, proc.stderr
    N, G, nodes = 4, 2, 2
    from cerar import make_code

    code = make_code(nodes, c, "perturbation")
    for label in settings:
        records, summary = read_run(tmp_path / label)
        check_trains(records, summary, 6)
        flat = "overlap" not in settings[label]
        coded_run = label.startswith("coded")
        check_tiers(records, summary, nodes, G, c if coded_run else None, flat)
        assert summary["method_between_nodes"] == ("cerar" if coded_run else "exact ring"), label
        drift = [r["drift/max_abs"] for r in records if "drift/max_abs" in r]
        assert drift and (max(drift) > 0 if coded_run else max(drift) == 0), (label, drift)
        per_node = replicas_per_node(summary, G)
        if label == "coded":  # node 0 approximates, node 1 (rank N-1, the reference replica) is exact
            assert per_node[0] != per_node[1]
            assert summary["c_chosen"] == c and summary["construction"] == "perturbation"
        else:  # exact, or resynchronised from rank N-1 at the last step
            assert len(set(per_node)) == 1, label
        for r in records:
            if "agg/rel_error_max" not in r:
                continue
            noise, error = r["noise/rel_std_mean"], r["agg/rel_error_max"]
            if coded_run:
                rounding = rounding_bound(code, torch.float32)  # relative to the rail's inputs, <= sum_r ||g_r||
                allowed = (code.eps + rounding) * (1 + math.sqrt(N - 1) * noise) + exact_bound(N, noise)
                assert 0 < error <= allowed, (label, r["step"], error, allowed)
            else:
                assert error <= exact_bound(N, noise), (label, r["step"], error, exact_bound(N, noise))
    assert "on 2 nodes: CERAR would send as many bytes between the nodes as the exact ring" in out + err


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_torchrun_agents_with_a_c10d_rendezvous_train_with_hierarchical_cerar(tmp_path, cache_dir):
    """torchrun --nnodes=2 --nproc_per_node=2 --rdzv-backend=c10d, two agents on this machine: the layout is
    torchrun's (LOCAL_WORLD_SIZE=2, placement checked against GROUP_RANK), CERAR coded between the nodes
    (aggregator.coded_on_two_nodes). Each agent and rank is an interpreter of its own (about 5 s of imports
    each): a third node would add three, and the codes for n = 3 and 4 nodes are held to the spec in
    tests/test_hierarchical.py."""
    c, nodes, G = 4, 2, 2
    run_dir, store = tmp_path / "run", held_store()  # the rendezvous, held here: every agent is its client
    launcher = [
        f"--nnodes={nodes}",
        f"--nproc_per_node={G}",
        *c10d_rendezvous_options(store),
        f"--rdzv-id=hier-{os.getpid()}",
    ]
    coded = ["aggregator=hier_cerar_perturbation", f"c={c}", "aggregator.coded_on_two_nodes=true"]
    args = [*coded, *SMALL, "trainer.max_steps=3", f"hydra.run.dir={run_dir}"]
    agents = [torchrun(launcher, "main.py", args, cache_dir, timeout=850) for _ in range(nodes)]
    outputs = [finished(agent, 850) for agent in agents]
    records, summary = read_run(run_dir)
    check_trains(records, summary, 3)
    assert summary["world_size"] == nodes * G and summary["method_between_nodes"] == "cerar"
    check_tiers(records, summary, nodes, G, c, flat=True)
    per_node = replicas_per_node(summary, G)
    assert per_node[0] != per_node[-1]  # approximate between nodes; every rank of a node the same
    assert sum("done: 3 steps" in out for out, _ in outputs) == 1  # rank 0's last line, on one agent
