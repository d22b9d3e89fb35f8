"""megatron-core's ``parallel_state``, imported without the rest of megatron-core.

``import megatron.core.parallel_state`` first runs ``megatron/core/__init__.py``, which imports
tensor_parallel, transformer, fusions, dist_checkpointing and more: 2.1 s of the 3.1 s a fresh
process takes to import what a rank needs (``python -X importtime``), paid by every fork server,
spawned rank, simulation process and command-line run, for nothing the harness calls. The harness
needs only ``parallel_state`` (and what it imports itself).

:func:`load_parallel_state` puts the package ``megatron.core`` in ``sys.modules`` unexecuted and
imports ``parallel_state`` from the installed files as they are. The package's ``__init__`` runs,
unchanged and in full, the first time anyone asks ``megatron.core`` for a name that is not one of
its submodules (a target's ``from megatron.core import tensor_parallel``, ``ModelParallelConfig``):
code under test sees the megatron-core it would see anyway.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Any


class _InitOnFirstName(types.ModuleType):
    """``megatron.core`` before its ``__init__`` ran: asked for a name it lacks, it runs it."""

    def __getattr__(self, name: str) -> Any:
        if importlib.util.find_spec(f"{self.__name__}.{name}") is not None:
            return importlib.import_module(f"{self.__name__}.{name}")  # a submodule: as the import system would
        self.__class__ = types.ModuleType  # run once; from now on a plain module
        self.__spec__.loader.exec_module(self)
        return getattr(self, name)


def load_parallel_state() -> Any:
    """``megatron.core.parallel_state`` (ImportError where megatron-core is not installed)."""
    if "megatron.core.parallel_state" in sys.modules:
        return sys.modules["megatron.core.parallel_state"]
    if "megatron.core" not in sys.modules:
        spec = importlib.util.find_spec("megatron.core")
        if spec is None:
            raise ImportError("No module named 'megatron.core'")
        package = importlib.util.module_from_spec(spec)
        package.__class__ = _InitOnFirstName
        sys.modules["megatron.core"] = package
        setattr(sys.modules["megatron"], "core", package)
    return importlib.import_module("megatron.core.parallel_state")
