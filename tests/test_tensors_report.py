"""scripts/reporting/tensors_report.py turns the per-tensor study's run folders into its table and figure: each
aggregator's worst tensor (the median over steps of its error against its noise), how many tensors exceed the
budget, the whole gradient's figure beside it, and the final loss against nccl's seed band. The run folders are
written here with known numbers, so every figure the report prints is known in advance."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.reporting import tensors_report  # noqa: E402


def write_run(folder: Path, rho: dict[str, list[float]], whole: float, final: float) -> None:
    """A run measured at steps 50, 100, ... with the given per-tensor ratios, and val_loss at its end."""
    folder.mkdir(parents=True)
    steps = len(next(iter(rho.values())))
    records = []
    for k in range(steps):
        record = {"step": 50 * (k + 1), "agg/rel_error_max": whole * 0.5, "noise/rel_std_mean": 0.5}
        record.update({f"tensor/{name}": values[k] for name, values in rho.items()})
        if k == steps - 1:
            record["val_loss"] = final
        records.append(record)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "summary.json").write_text(json.dumps({"final_val_loss": final}))


def test_the_table_names_each_aggregators_worst_tensor_against_nccls_band(tmp_path):
    runs = tmp_path / "runs"
    write_run(runs / "after" / "nccl_s1", {"w": [0, 0, 0], "b": [0, 0, 0]}, 0.0, 4.00)
    write_run(runs / "after" / "nccl_s2", {"w": [0, 0, 0], "b": [0, 0, 0]}, 0.0, 4.02)
    write_run(runs / "before" / "fp16_s1", {"w": [1e-4, 3e-4, 2e-4], "b": [0.5, 0.02, 0.9]}, 1e-4, 4.10)
    write_run(runs / "after" / "fp16_s1", {"w": [1e-4, 3e-4, 2e-4], "b": [2e-3, 1e-3, 5e-3]}, 1e-4, 4.01)
    summary = tensors_report.summarise(runs)
    before, after = summary["before"]["fp16"], summary["after"]["fp16"]
    assert before["worst"] == "b" and before["rho"] == {"w": 2e-4, "b": 0.5}  # medians over the steps
    assert after["worst"] == "b" and after["rho"]["b"] == 2e-3 and before["whole"] == 1e-4
    summary["before"]["int8"] = {**before, "final": {1: 3.96}}
    text = tensors_report.report(summary, ["=== T start; load: 1 2 3"])
    assert "| before | int8 | 0.0001 | b | 0.5 | 1 of 2 | 3.9600 | -1.00 % |" in text  # below the band's bottom
    assert "4.0000 to 4.0200 over 2 seed(s)" in text
    assert "| before | fp16 | 0.0001 | b | 0.5 | 1 of 2 | 4.1000 | +1.99 % |" in text  # above the band's top
    assert "| after | nccl | 0 | - | 0 | 0 of 2 | 4.0000 | inside |" in text  # exact: no worst tensor
    assert "| after | fp16 | 0.0001 | b | 0.002 | 0 of 2 | 4.0100 | inside |" in text
    assert "=== T start; load: 1 2 3" in text
    assert tensors_report.figure(summary, tmp_path / "f.png").stat().st_size > 0
