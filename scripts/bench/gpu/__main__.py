"""``python -m scripts.bench.gpu``: the GPU benchmark (``runner``)."""

import sys

from scripts.bench.gpu.runner import main

if __name__ == "__main__":
    sys.exit(main())
