"""The prepared GPU check runs end to end (on the CPU here) and reports every code it measures."""

import subprocess
import sys


def test_gpu_check_dry_run_on_the_cpu(tmp_path):
    out = tmp_path / "gpu.md"
    run = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--small", "--repeats", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    report = out.read_text()
    for construction in ("exact", "perturbation", "optimized"):
        assert f"| {construction} |" in report
    differences = [float(line.split("|")[5]) for line in report.splitlines() if line.startswith("| 4 | 16 |")][:2]
    assert all(difference < 1e-6 for difference in differences)  # the CPU agrees with itself


def test_gpu_check_refuses_cuda_without_a_device():
    import torch

    if torch.cuda.is_available():
        return
    run = subprocess.run([sys.executable, "scripts/gpu_check.py"], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "no CUDA device" in run.stderr
