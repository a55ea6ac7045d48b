"""The GPU acceptance check runs end to end on the CPU (its dry run) and reports every check it makes."""

import subprocess
import sys

import pytest
import torch

import cerar
from scripts.checks.gpu_check import (
    MULTI_RANK_SECTIONS,
    judge_coded,
    judge_sum,
    multi_rank_verdicts,
    proved,
    resolve_device,
)


def gpu_check(tmp_path, *extra, timeout=1500):
    out = tmp_path / "gpu.md"
    run = subprocess.run(
        [
            sys.executable,
            "scripts/checks/gpu_check.py",
            "--device",
            "cpu",
            "--small",
            "--repeats",
            "1",
            "--out",
            str(out),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return run, out.read_text() if out.exists() else ""


def rows(report: str, first_cells: str) -> list[list[str]]:
    return [
        [cell.strip() for cell in line.split("|")[1:-1]] for line in report.splitlines() if line.startswith(first_cells)
    ]


def test_gpu_check_dry_run_on_the_cpu(tmp_path):
    run, report = gpu_check(tmp_path, "--skip", "training")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    verdicts = ("PASS", "FAIL", "NOT RUN", "MEASURED")
    summary = {row[0]: row[1] for row in rows(report, "| ") if len(row) == 2 and row[1] in verdicts}
    expected = {**dict.fromkeys(("oracle", "tf32", "protocol", "hook", "stall"), "PASS"), "throughput": "MEASURED"}
    assert summary == expected, summary
    oracle = {row[2]: row for row in rows(report, "| 4 |") if len(row) == 11}
    assert set(oracle) == {"exact", "vandermonde", "perturbation", "optimized"}  # every construction
    assert oracle["exact"][1] == "4" and "cannot be built at c=16" in oracle["exact"][10]
    for row in oracle.values():  # each judged by its own rounding bound, which the report states
        assert row[9] == "PASS" and float(row[7]) <= float(row[8]), row
    assert "Ran on 2 ranks, gloo, one per device" in report  # the protocol and hook between two real processes
    stall = rows(report, "| 0 |")  # rank 0 survived rank 1's SIGSTOP: it raised within the timeout plus slack
    assert stall and stall[-1][2].startswith("CollectiveError: cerar.all_reduce") and float(stall[-1][1]) < 2.0 + 5.0
    assert "Device copy bandwidth" in report and "not measured (a CPU has no streams)" in report


@pytest.mark.slow
def test_gpu_check_training_section_kills_and_resumes_to_the_same_parameters_on_the_cpu(tmp_path):
    run, report = gpu_check(tmp_path, "--skip", "throughput", "distributed", timeout=1200)
    training = rows(report, "| fp32 |")
    assert training and training[0][-1] == "PASS", report[-3000:]
    assert training[0][3] == training[0][4]  # param_sha256 of the uninterrupted and the killed + resumed run


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible: nothing to refuse")
def test_gpu_check_refuses_cuda_without_a_device():
    run = subprocess.run([sys.executable, "scripts/checks/gpu_check.py"], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "no CUDA device" in run.stderr


def test_cuda_resolves_to_the_current_device_with_its_index():
    """``torch.cuda.set_device(torch.device("cuda"))`` raises ValueError: the check must name an index."""
    assert resolve_device("cuda", 3) == torch.device("cuda", 3)
    assert resolve_device("cuda:1", 3) == torch.device("cuda", 1)
    assert resolve_device("cpu", None) == torch.device("cpu")
    with pytest.raises(ValueError, match="index"):
        resolve_device("cuda", None)


def test_a_coded_result_is_judged_against_the_exact_sum_within_the_codes_own_bound():
    """The exact-arithmetic results from the spec's reference pass; the exact sum (what a broken
    transport that skipped the code would give), and a result moved by ten times the rounding
    bound, fail; the exact ring's result is held to the rounding of a sum of N values."""
    from tests.spec_reference import spec_all_reduce, spec_matrices

    N, d = 3, 500
    code = cerar.make_code(N, 2 * N, "perturbation", eps=0.05)
    G = torch.randn(N, d, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    reference = torch.from_numpy(spec_all_reduce(G.numpy(), *spec_matrices(code.points, N)))
    judged = judge_coded(reference, G, code, torch.float32)
    assert judged["ok"] and judged["deviation"] <= 1e-9 and judged["truncation"] > 1e-3
    assert not judge_coded(G.sum(0).expand(N, -1), G, code, torch.float32)["ok"]
    direction = torch.randn(N, d, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    moved = reference + 10 * judged["bound"] * G.norm() * direction / direction.norm(dim=1, keepdim=True)
    assert not judge_coded(moved, G, code, torch.float32)["ok"]
    assert judge_coded(reference / N, G, code, torch.float32, scale=1 / N)["ok"]  # op="avg"
    assert judge_sum(G.float().sum(0).expand(N, -1), G, torch.float32)["ok"]
    assert not judge_sum(reference, G, torch.float32)["ok"]


def test_a_one_device_run_cannot_pass_a_section_that_needs_two_ranks():
    """One rank exchanges no message: whatever it ran, the multi-rank sections say NOT RUN, and the
    report lists what one device did prove and what it could not."""
    everything_passed = dict.fromkeys(MULTI_RANK_SECTIONS, True)
    assert multi_rank_verdicts(1, everything_passed) == dict.fromkeys(MULTI_RANK_SECTIONS, "NOT RUN")
    assert multi_rank_verdicts(1, None) == dict.fromkeys(MULTI_RANK_SECTIONS, "NOT RUN")
    assert multi_rank_verdicts(2, everything_passed) == dict.fromkeys(MULTI_RANK_SECTIONS, "PASS")
    assert multi_rank_verdicts(4, {"protocol": True, "hook": False}) == {
        "protocol": "PASS",
        "hook": "FAIL",
        "stall": "FAIL",  # a section with no judgement never passes
    }
    statuses = {"oracle": "PASS", "tf32": "PASS", "hook plumbing (N=1)": "PASS", "training bf16": "PASS"}
    statuses.update(multi_rank_verdicts(1, everything_passed))
    lines = proved(statuses, world=1, devices=1, backend="nccl")
    assert any("thread, stream and future" in line for line in lines)
    assert any(line.startswith("- NOT RUN (needs two devices; this machine has 1)") for line in lines)
    assert not any("PASS" in line and "between" in line for line in lines)
