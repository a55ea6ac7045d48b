"""The GPU acceptance check runs end to end on the CPU (its dry run) and reports every check it makes."""

import subprocess
import sys

import pytest


def gpu_check(tmp_path, *extra, timeout=900):
    out = tmp_path / "gpu.md"
    run = subprocess.run(
        [
            sys.executable,
            "scripts/gpu_check.py",
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
    summary = {row[0]: row[1] for row in rows(report, "| ") if len(row) == 2 and row[1] in ("PASS", "FAIL")}
    assert summary == {"oracle": "PASS", "tf32": "PASS", "protocol": "PASS", "hook": "PASS"}, summary
    oracle = {row[2]: row for row in rows(report, "| 4 |") if len(row) == 9}
    assert set(oracle) == {"exact", "vandermonde", "perturbation", "optimized"}  # every construction
    assert oracle["exact"][1] == "4" and "cannot be built at c=16" in oracle["exact"][8]
    assert all(float(oracle[k][4]) < 1e-6 for k in ("perturbation", "optimized"))  # the CPU agrees with itself
    assert "Ran on 2 rank(s), gloo" in report  # the protocol and hook between two real processes
    assert "Device copy bandwidth" in report


@pytest.mark.slow
def test_gpu_check_training_section_kills_and_resumes_to_the_same_parameters_on_the_cpu(tmp_path):
    run, report = gpu_check(tmp_path, "--skip", "throughput", "distributed", timeout=1200)
    training = rows(report, "| fp32 |")
    assert training and training[0][-1] == "PASS", report[-3000:]
    assert training[0][3] == training[0][4]  # param_sha256 of the uninterrupted and the killed + resumed run


def test_gpu_check_refuses_cuda_without_a_device():
    import torch

    if torch.cuda.is_available():
        return
    run = subprocess.run([sys.executable, "scripts/gpu_check.py"], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "no CUDA device" in run.stderr
