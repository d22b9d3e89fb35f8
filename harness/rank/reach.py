"""What of a framework's own code a scenario ran on this rank (``shardcheck run --coverage``).

coverage.py measures only the target's ``framework_files`` (paths inside its checkout ``src``: the
framework's log-prob, data and loss modules), from the data path through the backward. The rank
sends back, per file, the lines that ran and the file's statements; the controller
(``harness/controller/reach_report.py``) names the functions.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any


def framework_files(target: Any) -> dict[str, str]:
    """{path relative to the checkout: absolute path} of the target's framework files that exist."""
    src = getattr(target, "src", None)
    files = getattr(target, "framework_files", ())
    if src is None or not files:
        return {}
    out = {}
    for rel in files:
        path = os.path.realpath(os.path.join(str(src), rel))
        if os.path.isfile(path):
            out[rel] = path
    return out


@contextlib.contextmanager
def measured(target: Any, into: dict[str, Any]) -> Iterator[None]:
    """Run the block under coverage.py, restricted to the target's framework files; ``into``
    gets {relative path: {"executed": [...], "statements": [...]}}."""
    files = framework_files(target)
    if not files:
        yield
        return
    import coverage

    cov = coverage.Coverage(data_file=None, include=list(files.values()), branch=False, config_file=False)
    cov.start()
    try:
        yield
    finally:
        cov.stop()
        data = cov.get_data()
        for rel, path in files.items():
            executed = sorted(data.lines(path) or [])
            try:
                statements = cov.analysis2(path)[1]
            except Exception:  # noqa: BLE001  (a file coverage cannot parse: its lines still count)
                statements = []
            into[rel] = {"executed": executed, "statements": sorted(statements)}
