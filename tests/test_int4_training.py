"""aggregator=int4 and aggregator=hier_int4 in the trainer: one launch of 4 ranks (train/sweep.py, the runs of
tests/runs.py: model=tiny, 6 steps, every step's aggregate measured against an exact all-reduce of the same
gradients), the two-tier run on nodes of 2 ranks, and a two-tier run stopped after step 3 and resumed in its folder;
with error feedback also the 4-bit DDP hook (trainer.overlap=true), whole and stopped and resumed.

What the collective tests cannot see is held here: the aggregators are built from their configs, every step sends
the bytes of the formula (counted by the transport, recorded per step and per tier), the replicas stay identical
(the drift is 0 and every rank ends with the same parameters), the error is a 4-bit one (above the 8-bit format's
own bound for one rounding of the mean, below the whole gradient), each tensor has its figure, and a resumed run
continues the dither (the checkpointed count of quantized calls) to the same parameters, bit for bit.
"""

from __future__ import annotations

import math

import pytest

from tests.runs import MATRIX, read_run, torchrun

N = 4
HIER = "aggregator=hier_int4 aggregator.local_size=2"
FED = "aggregator.error_feedback=true aggregator.feedback_window=6"
PART = f"{HIER} {FED} checkpoint.every=3 checkpoint.keep=2"
OVERLAP = f"aggregator=int4 {FED} trainer.overlap=true"  # the 4-bit DDP hook, fed back per bucket


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache_dir):
    out = tmp_path_factory.mktemp("int4-runs")
    labels = [
        "int4: aggregator=int4 aggregator.feedback_window=6",  # a window without feedback, to compare
        f"int4_fed: aggregator=int4 {FED}",
        f"int8_fed: aggregator=int8 {FED}",
        "int4_fed_sparse: aggregator=int4 aggregator.error_feedback=true aggregator.feedback_window=2 "
        "trainer.measure_error_every=4",  # the window of steps 3-4 measured, whole; the others not at all
        f"hier_int4: {HIER}",
        f"hier_int4_fed: {HIER} {FED}",
        f"part_hier_int4_fed: {PART} trainer.stop_after_step=3",
        f"part_hier_int4_fed: {PART} resume=true",
        f"int4_fed_overlap: {OVERLAP}",
        f"part_int4_fed_overlap: {OVERLAP} checkpoint.every=3 checkpoint.keep=2 trainer.stop_after_step=3",
        f"part_int4_fed_overlap: {OVERLAP} checkpoint.every=3 checkpoint.keep=2 resume=true",
    ]
    torchrun(N, "sweep.py", [str(out), *labels, "--", *MATRIX], cache_dir, timeout=900)
    return out


@pytest.mark.timeout(900)
def test_int4_and_hier_int4_train_with_the_formula_bytes_and_identical_replicas(runs):
    from cerar.hierarchical import NodeLayout
    from cerar.int4.all_reduce import int4_bytes_sent
    from cerar.int4.two_tier import hierarchical_int4_bytes

    for label in ("int4", "hier_int4"):
        records, summary = read_run(runs / label)
        d = summary["parameters"]
        assert [r["step"] for r in records] == list(range(1, 7))
        assert records[-1]["train_loss"] < records[0]["train_loss"] - 0.1, label
        assert len(set(summary["param_sha256_per_rank"])) == 1, label  # every replica the same parameters
        assert max(r["drift/max_abs"] for r in records if "drift/max_abs" in r) == 0.0, label
        if label == "int4":
            assert {r["bytes_sent"] for r in records} == {int4_bytes_sent(d, N, 128)}
        else:
            tiers = hierarchical_int4_bytes(d, NodeLayout(nodes=2, local_size=2), 128, "int8", 128)
            assert {r["bytes_sent/intra_node"] for r in records} == {tiers["intra_node"]}
            assert {r["bytes_sent/inter_node"] for r in records} == {tiers["inter_node"]}
            assert {r["bytes_sent"] for r in records} == {sum(tiers.values())}
        # one 8-bit rounding of the mean errs by at most sqrt(B)/254 of it (a block's absmax is at most its norm):
        # a 4-bit aggregate, 18x coarser, lies above that, and below the gradient itself
        for r in records:
            assert math.sqrt(128) / 254 < r["agg/rel_error_max"] < 1.0, (label, r["step"], r["agg/rel_error_max"])
            assert r["agg/tensor_error_to_noise_max"] > 0 and r["agg/worst_tensor"]

@pytest.mark.timeout(900)
def test_error_feedback_trains_is_judged_over_windows_and_resumes_bit_for_bit(runs):
    """Fed back, int4, int8 and hier_int4 send the same bytes as without (the residuals never travel) and keep the
    replicas identical; the window of steps 1-6 is judged per tensor at step 6, and the worst tensor's error of the
    summed aggregates, against the summed noise, is below half the unfed int4 run's (the fed-back errors cancel to
    the last residual, the unfed ones add up: sqrt(6) one-step errors against about one). A hier_int4 run fed back,
    stopped after step 3 and resumed (every rank's residuals from the checkpoint) ends with the uninterrupted run's
    parameters, bit for bit; the window it resumed inside is not reported."""
    from cerar.int4.all_reduce import int4_bytes_sent

    windows = {}
    for label in ("int4", "int4_fed", "int8_fed", "hier_int4_fed"):
        records, summary = read_run(runs / label)
        assert len(set(summary["param_sha256_per_rank"])) == 1, label
        assert max(r["drift/max_abs"] for r in records if "drift/max_abs" in r) == 0.0, label
        judged = [r for r in records if "feedback/window_error_to_noise_max" in r]
        assert [r["step"] for r in judged] == [6], (label, [r["step"] for r in judged])
        r = judged[0]
        assert r["feedback/window_steps"] == 6 and r["feedback/window_worst_tensor"]
        per_tensor = [v for k, v in r.items() if k.startswith("window/")]
        assert len(per_tensor) == len([k for k in r if k.startswith("tensor/")]) > 1
        assert r["feedback/window_error_to_noise_max"] == max(per_tensor) > 0
        windows[label] = r["feedback/window_error_to_noise_max"]
    d = read_run(runs / "int4")[1]["parameters"]
    assert {r["bytes_sent"] for r in read_run(runs / "int4_fed")[0]} == {int4_bytes_sent(d, N, 128)}
    s = math.ceil(d / N)
    assert {r["bytes_sent"] for r in read_run(runs / "int8_fed")[0]} == {2 * (N - 1) * (s + 4 * math.ceil(s / 128))}
    assert windows["int4_fed"] < 0.5 * windows["int4"], windows
    resumed_records, resumed = read_run(runs / "part_hier_int4_fed")
    _, full = read_run(runs / "hier_int4_fed")
    assert resumed["resumed_from_step"] == 3 and resumed["param_sha256"] == full["param_sha256"]
    assert not any("feedback/window_error_to_noise_max" in r for r in resumed_records if r["step"] > 3)
    sparse, _ = read_run(runs / "int4_fed_sparse")  # measured every 4th window's steps only: 3 and 4 of 6
    assert [r["step"] for r in sparse if "agg/rel_error_max" in r] == [3, 4]
    judged = [r for r in sparse if "feedback/window_error_to_noise_max" in r]
    assert [(r["step"], r["feedback/window_steps"]) for r in judged] == [(4, 2)]


@pytest.mark.timeout(900)
def test_error_feedback_through_the_ddp_hook_keeps_each_buckets_residual_and_resumes_bit_for_bit(runs):
    """trainer.overlap=true, int4 fed back: the hook sends the formula's bytes for its buckets (the residuals never
    travel; at DDP's 25 MiB the tiny model is one bucket), the replicas stay identical, the checkpoint keeps each
    rank's residuals under DDP's bucket indices, and the run stopped after step 3 and resumed (the same buckets in
    every launch: Trainer.settle_ddp_buckets) ends with the uninterrupted run's parameters, bit for bit."""
    import torch

    from cerar.int4.all_reduce import int4_bytes_sent

    records, full = read_run(runs / "int4_fed_overlap")
    assert len(set(full["param_sha256_per_rank"])) == 1
    assert records[-1]["train_loss"] < records[0]["train_loss"] - 0.1
    assert {r["bytes_sent"] for r in records} == {int4_bytes_sent(full["parameters"], N, 128)}
    part_records, resumed = read_run(runs / "part_int4_fed_overlap")
    assert resumed["resumed_from_step"] == 3 and [r["step"] for r in part_records] == list(range(1, 7))
    assert resumed["param_sha256"] == full["param_sha256"]
    state = torch.load(runs / "part_int4_fed_overlap" / "checkpoints" / "step-00000003.pt", weights_only=False)
    for rank in state["ranks"]:
        buckets = rank["aggregator"]["error_feedback"]
        assert sorted(buckets) == [0], sorted(buckets)  # one bucket, by its index
        assert all(residuals["flat"].abs().max() > 0 for residuals in buckets.values())


@pytest.mark.quick
def test_the_int4_options_are_checked_before_start_and_kept_out_of_other_runs_identities():
    """aggregator.rotate needs a power-of-two block and aggregator.intra a known method (named, before any process
    group); error feedback is refused where it is not built (taken flat and with DDP hooks) and where its windows
    cannot be measured whole (a measure_error_every other than 0, 1 or a multiple of the window); the 4-bit fields
    enter the identity of the 4-bit runs only (older runs resume unchanged), intra only the two-tier one's,
    error_feedback only when on (its window never: it only observes); the trainer enables the 4-bit format's kernels
    (Triton, for GPUs), and the 8-bit format's too where hier_int4 rounds to 8 bits inside the nodes."""
    from tests.runs import composed
    from train.aggregation.build import fused_kernels
    from train.config import ConfigError, training_identity, validate

    with pytest.raises(ConfigError, match=r"aggregator.block=96 must be a power of two to be rotated"):
        validate(composed("aggregator=int4", "aggregator.block=96"), world_size=2)
    validate(composed("aggregator=int4", "aggregator.block=96", "aggregator.rotate=false"), world_size=2)
    with pytest.raises(ConfigError, match=r"aggregator.intra='int2' is not one of exact, int8"):
        validate(composed("aggregator=hier_int4", "aggregator.intra=int2", "aggregator.local_size=1"), world_size=2)
    flat, tiers = training_identity(composed("aggregator=int4"), 2), training_identity(composed(*HIER.split()), 4)
    assert flat["aggregator.rotate"] is True and "aggregator.intra" not in flat
    assert tiers["aggregator.intra"] == "int8" and tiers["aggregator.local_size"] == 2
    for other in ("aggregator=int8", "aggregator=ring", "aggregator=hier_int8"):
        assert not {"aggregator.rotate", "aggregator.intra"} & set(training_identity(composed(other), 2)), other
    with pytest.raises(ConfigError, match=r"aggregator.error_feedback=true is built for int8, hier_int8, int4"):
        validate(composed("aggregator=fp16", "aggregator.error_feedback=true"), world_size=2)
    for kind in ("int8", "int4", "hier_int8", "hier_int4"):  # flat or through their DDP hooks (residuals per bucket)
        overrides = [f"aggregator={kind}", "aggregator.error_feedback=true", "trainer.overlap=true"]
        validate(composed(*overrides, *(["aggregator.local_size=2"] if kind.startswith("hier") else [])), 4)
    with pytest.raises(ConfigError, match=r"trainer.measure_error_every=2: error feedback is judged over windows of "
                                          r"10 consecutive steps"):  # fmt: skip
        validate(composed("aggregator=int8", "aggregator.error_feedback=true", "trainer.measure_error_every=2"), 2)
    with pytest.raises(ConfigError, match=r"trainer.measure_error_every=15: .* windows of 6 consecutive steps"):
        validate(composed("aggregator=int8", "aggregator.feedback_window=6", "trainer.measure_error_every=15"), 2)
    validate(composed("aggregator=int8", "aggregator.error_feedback=true", "trainer.measure_error_every=100"), 2)
    validate(composed("aggregator=int4", "aggregator.feedback_window=6", "trainer.measure_error_every=12"), 2)
    fed = training_identity(composed("aggregator=int8", "aggregator.error_feedback=true"), 2)
    assert fed["aggregator.error_feedback"] is True and "aggregator.feedback_window" not in fed
    assert "aggregator.error_feedback" not in training_identity(composed("aggregator=int8"), 2)
    four = ("int4_quantize_stochastic", "int4_dequantize", "int4_dequantize_add")
    assert fused_kernels(composed("aggregator=int4").aggregator) == four
    assert fused_kernels(composed(*HIER.split()).aggregator) == ("quantize_stochastic", "dequantize",
                                                                 "dequantize_add", *four)  # fmt: skip
    assert fused_kernels(composed(*HIER.split(), "aggregator.intra=exact").aggregator) == four
