"""What of a framework's own code a scenario ran on this rank (``shardcheck run --coverage``).

coverage.py measures only the target's ``framework_files`` (paths inside its checkout ``src``: the
framework's log-prob, data and loss modules), from the data path through the backward, and for a
target whose loss runs in a training step also megatron-core's schedule and DDP modules (named
``megatron-core/...``). The rank sends back, per file, the lines that ran, the file's statements
and its path; the controller (``harness/controller/reports/reach_report.py``) names the functions.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any


def framework_files(target: Any) -> dict[str, str]:
    """{path relative to the checkout: absolute path} of the target's framework files that exist."""
    src, files = target.src, target.framework_files
    if src is None or not files:
        return {}
    out = {}
    for rel in files:
        path = os.path.realpath(os.path.join(str(src), rel))
        if os.path.isfile(path):
            out[rel] = path
    return out


# what megatron-core runs of a training step around the target's loss (harness/rank/life/training_step.py)
STEP_FILES = ("megatron/core/pipeline_parallel/schedules.py", "megatron/core/distributed/distributed_data_parallel.py",
              "megatron/core/distributed/param_and_grad_buffer.py", "megatron/core/distributed/finalize_model_grads.py")


def step_files(target: Any) -> dict[str, str]:
    """{"megatron-core/<path>": absolute path} of megatron-core's schedule and DDP modules, for a
    target whose loss runs in a training step; {} for any other."""
    from shardcheck.targets.base import loss_form

    if loss_form(target) != "step":
        return {}
    import importlib.util

    spec = importlib.util.find_spec("megatron")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    out = {}
    for rel in STEP_FILES:
        for root in roots:
            path = os.path.realpath(os.path.join(os.path.dirname(root), rel))
            if os.path.isfile(path):
                out[f"megatron-core/{rel}"] = path
                break
    return out


@contextlib.contextmanager
def measured(target: Any, into: dict[str, Any]) -> Iterator[None]:
    """Run the block under coverage.py, restricted to the target's framework files (and, in a
    training step, megatron-core's schedule and DDP); ``into`` gets {relative path: {"executed":
    [...], "statements": [...], "path": the file}}."""
    files = framework_files(target)
    files = {**files, **step_files(target)} if files else files
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
            into[rel] = {"executed": executed, "statements": sorted(statements), "path": path}
