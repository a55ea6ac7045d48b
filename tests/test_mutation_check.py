"""The mutation check's fault list stays current (scripts/checks/mutation.py, docs/testing.md): every fault's
original snippet occurs exactly once in its file, so a change to the code that moves a snippet fails here, in
the suite, not months later when someone runs the check; and a snippet that does not match is reported by name.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _mutation():
    spec = importlib.util.spec_from_file_location("mutation_check", ROOT / "scripts" / "checks" / "mutation.py")
    module = sys.modules.setdefault("mutation_check", importlib.util.module_from_spec(spec))
    spec.loader.exec_module(module)
    return module


@pytest.mark.quick
def test_every_faults_snippet_occurs_once_and_a_stale_one_is_named(tmp_path):
    mutation = _mutation()
    faults = mutation.load_faults()
    assert len(faults) >= 20 and mutation.check_snippets(faults, ROOT) == []
    table = {
        "rail-float16",
        "rounding-bound-x100",
        "default-budget-0.1",
        "choose-largest-c",
        "recheck-ignores-budget",
        "checkpoint-wait-a-year",
        "two-node-warning-never-said",
        "look-behind-poll-dropped",
    }  # fmt: skip  (issue 27's table)
    assert table <= {f.name for f in faults}
    stale = type(faults[0])(name="moved", file="cerar/ring/precision.py", original="no such line", replacement="x",
                            tests=("tests/test_precision.py",), why="a snippet the code no longer has")  # fmt: skip
    said = "moved: its original snippet occurs 0 times in cerar/ring/precision.py, not once"
    assert mutation.check_snippets([stale], ROOT) == [said]
