"""Which code a measurement ran: the commit of a git checkout and the files of its cerar/ that differ."""

from __future__ import annotations

import subprocess
from pathlib import Path


def checkout_state(checkout: Path, short: int = 7) -> tuple[str, list[str]] | None:
    """(abbreviated commit, cerar/ paths changed since it) of ``checkout``; None outside a git checkout."""
    try:
        commit = subprocess.run(["git", "-C", str(checkout), "rev-parse", f"--short={short}", "HEAD"],
                                capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
        status = subprocess.run(["git", "-C", str(checkout), "status", "--porcelain", "--", "cerar"],
                                capture_output=True, text=True, check=True).stdout.split("\n")  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit, sorted({line[3:] for line in status if line.strip()})
