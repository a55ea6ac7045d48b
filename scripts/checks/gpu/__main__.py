"""``python -m scripts.checks.gpu``: the GPU check (``runner``)."""

import sys

from scripts.checks.gpu.runner import main

if __name__ == "__main__":
    sys.exit(main())
