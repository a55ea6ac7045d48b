"""Running another checkout's code beside this one (the benchmarks' and studies' ``--code-dir``).

A checkout from before the library's rooms (issue 37) has the old module names (``cerar.rounds`` where this one has
``cerar.ring.rounds``): `library_module` imports whichever the checkout on ``sys.path`` has, so that before and after
run side by side."""

from __future__ import annotations

import importlib


def library_module(*names: str):
    """The first of the dotted module ``names`` that imports; ImportError naming all of them when none does."""
    for name in names:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError:
            continue
    raise ImportError(f"the imported checkout has none of {names}")
