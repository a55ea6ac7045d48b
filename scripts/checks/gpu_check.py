"""The one-command GPU acceptance check (the package ``scripts/checks/gpu/``; docs/gpus.md).

    python scripts/checks/gpu_check.py --quick     # one GPU, under 5 minutes
    python scripts/checks/gpu_check.py             # every section, one rank per GPU; under 10 minutes
    python scripts/checks/gpu_check.py --device cpu --small --out /tmp/gpu.md   # its dry run on the CPU

Also ``python -m scripts.checks.gpu_check`` and ``python -m scripts.checks.gpu``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.checks.gpu.runner import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
