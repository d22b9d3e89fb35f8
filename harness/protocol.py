"""The channel between the controller and the ranks: ``(name, kwargs)`` messages of plain data.

Controller -> rank:
    run   scenario (dict), target (spec str), seq (int), trace_calls (bool), inplace (bool: check
          the inputs stay unchanged), outputs (bool: send the target's outputs back), reference (bool:
          compare with the float64 reference), explain (bool: find the call site of the first in-place
          write into an input)                                      run one scenario
    stop                                                   leave the loop and exit
Rank -> controller (the controller adds who sent it on arrival):
    ready   pid, seconds                                   joined the world, waiting for work
    result  seq, failures (list of dicts), max_error, seconds, target (dict), notes (peers'
            stops), desync (groups may be out of step), calls (count), trace (call records),
            outputs (the target's outputs and logit gradient, when asked for; else None)
    fatal   error (dict)                                   cannot go on; the rank exits
"""

from __future__ import annotations

import traceback
from typing import Any

RUN, STOP = "run", "stop"
READY, RESULT, FATAL = "ready", "result", "fatal"


def message(name: str, **kwargs: Any) -> tuple[str, dict[str, Any]]:
    return name, kwargs


def error_payload(exc: BaseException, skip_prefixes: tuple[str, ...] = ()) -> dict[str, Any]:
    """An exception as plain data: type, message, where it was raised, and the traceback."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = None
    for fr in reversed(frames):
        if not any(fr.filename.startswith(p) for p in skip_prefixes):
            where = f"{fr.filename}:{fr.lineno} in {fr.name}"
            break
    if where is None and frames:
        where = f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}"
    return {
        "type": type(exc).__name__,
        "message": str(exc).strip().splitlines()[0][:500] if str(exc).strip() else "",
        "where": where,
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-8000:],
    }
