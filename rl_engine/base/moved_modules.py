"""Old import paths of modules that moved into packages, kept for one release.

`import rl_engine.parity` (or `from rl_engine.sums import Sums`) still works: a finder on
`sys.meta_path` answers the old name with the module at its new path, the same object (so
its classes and functions are the new ones, `isinstance` holds across both names), and warns
once per name with a DeprecationWarning that says where it lives now. The package root keeps
only `__init__.py` and `cli.py`, so no old file stands there.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "rl_engine.canonical_sum": "rl_engine.exact.canonical_sum",
    "rl_engine.row_partial": "rl_engine.exact.row_partial",
    "rl_engine.sequence_gradients": "rl_engine.exact.sequence_gradients",
    "rl_engine.sums": "rl_engine.exact.records",
    "rl_engine.algorithms.sequence_sums": "rl_engine.exact.float_sums",
    "rl_engine.slab_arena": "rl_engine.base.slab_arena",
    "rl_engine.memory_pages": "rl_engine.base.memory_pages",
    "rl_engine.fields": "rl_engine.base.fields",
    "rl_engine.io": "rl_engine.base.io",
    "rl_engine.devices": "rl_engine.kernels.devices",
    "rl_engine.parity": "rl_engine.logprobs.parity",
    "rl_engine.packing": "rl_engine.logprobs.packing",
    "rl_engine.tasks": "rl_engine.data.tasks",
}
"""old dotted path -> new dotted path"""

REMOVAL = "the next release"


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def create_module(self, spec):
        warnings.warn(
            f"{self.old} moved to {self.new}; the old path is removed in {REMOVAL}: "
            f"import {self.new}",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(self.new)

    def exec_module(self, module) -> None:
        """The module at the new path is already executed."""


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the old paths of `MOVED` (and nothing else)."""

    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(fullname, new))


def install() -> None:
    """Put the finder on `sys.meta_path` once (idempotent: a reload does not stack finders)."""
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
