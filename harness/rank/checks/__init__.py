"""How checks register, and the order the built-in ones are called in at each point of a life
(see :mod:`shardcheck.harness.rank.pipeline`).

Every check registers in the ``shardcheck.checks`` entry-point group, shardcheck's own too
(pyproject.toml): a plugin's package declares ``NAME = "module:Class"`` there and is run once it
is installed. The built-ins are called first, in :data:`BUILT_IN`'s order, then the plugins',
by name; ``SHARDCHECK_CHECKS`` (``module:Class``, comma-separated) adds checks after those, for
a test or a check not packaged (the way plugins registered before the group existed).
"""

from __future__ import annotations

from typing import Any

# GROUP and BUILT_IN (the built-ins' entry-point names, in the order they are called) are the
# pipeline's, which loads the group; named here too for callers of earlier versions
from shardcheck.harness.rank.pipeline import BUILT_IN, GROUP  # noqa: E402,F401


def __getattr__(name: str) -> Any:
    # CHECKS, the built-in classes in their order, for callers that name them first
    # (pipeline_for adds every registered check itself). Loaded through the group on first use;
    # () where they cannot be loaded: pipeline_for then reports why, as the check that failed.
    if name == "CHECKS":
        from shardcheck.harness.rank.pipeline import BadCheck, registered_checks

        try:
            return registered_checks()[:len(BUILT_IN)]
        except BadCheck:
            return ()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
