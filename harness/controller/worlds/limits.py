"""What a world may ask of this machine, checked before any world starts: how many ranks, how
much memory a scenario takes on each, and how long a timeout the store and the backend accept.

A world past these ends badly and late: ranks that outnumber the cores time out in megatron's
group creation (blamed on the target as a hang), ranks that outgrow the memory are killed by the
OOM killer (blamed on the target as a rank killed by SIGKILL, or the controller itself is
killed), and a timeout past what torch converts overflows after the world has started. Each is
refused here instead, with one line naming the figures. ``--allow-large-world`` lifts the rank
and memory bounds (they are estimates); the timeout bound is not an estimate and stays.

What the machine has is machine.py's; what a scenario takes, scenario_memory.py's; the checks
are here. No torch import, so the CLI refuses in milliseconds.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

from shardcheck.errors import BadInput
from shardcheck.harness.controller.worlds.machine import CONTROLLER_BYTES, RANK_BYTES, Machine
from shardcheck.harness.controller.worlds.rank_memory import size_text
from shardcheck.harness.controller.worlds.memory_estimate import DTYPE_BYTES, scenario_bytes, shape_key
from shardcheck.scenarios.scenario import Scenario

# multiprocessing's wait (poll) takes whole milliseconds in a C int: a wait past 2**31 - 1 ms
# (24.8 days) raises OverflowError (World.run has waited the timeout + 10 s in one call); TCPStore and gloo add the timeout to a steady-clock time in
# int64 nanoseconds, which overflows past about 9.2e9 s (seen: 1e10 s fails to connect, 1e13 s
# makes gloo refuse "Invalid timeout", past 8.64e13 s datetime.timedelta overflows). A week is
# far above any scenario's need and 3.5x inside the smallest of those.
MAX_TIMEOUT_S = 7 * 24 * 3600.0


OVERRIDE = "--allow-large-world"


def check_nproc(nproc: int | None, *, allow_large_world: bool = False, machine: Machine | None = None,
                what: str | None = None) -> None:
    """Refuse a world of ``nproc`` ranks past :attr:`Machine.max_ranks` (unless allowed).
    ``what`` names where the size came from when it was not --nproc."""
    if nproc is None or allow_large_world:
        return
    machine = machine or Machine.here()
    if nproc > machine.max_ranks:
        who = what or f"--nproc {nproc}"
        raise BadInput(f"{who} is more ranks than this machine can hold: at most {machine.max_ranks} "
                       f"({machine.figures()}) ({OVERRIDE} to start it anyway)")

# -- timeouts ------------------------------------------------------------------------------------
def check_timeout(seconds: float, option: str = "--timeout") -> float:
    """``seconds`` if a world can wait that long; BadInput for NaN, inf, <= 0, or past
    MAX_TIMEOUT_S (where torch's and the OS's conversions overflow, after the world started)."""
    if not math.isfinite(seconds) or not seconds > 0:
        raise BadInput(f"{option} must be a finite number of seconds > 0, got {seconds}")
    if seconds > MAX_TIMEOUT_S:
        raise BadInput(f"{option} {seconds:g} is more than the most a world can wait: "
                       f"{MAX_TIMEOUT_S:.0f} s (7 days)")
    return seconds


def timeout_seconds(text: str) -> float:
    """argparse ``type`` of every --timeout: a float within :func:`check_timeout`'s bounds (the
    error keeps argparse's words for what is not a number)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    try:
        return check_timeout(value, "")
    except BadInput as exc:
        raise argparse.ArgumentTypeError(str(exc).strip()) from None


# -- the checks the CLI makes --------------------------------------------------------------------
def _world_size(scenarios: Sequence[Scenario]) -> int:
    """runner.world_size_for: the smallest world every scenario fits in."""
    return math.lcm(*(s.ranks for s in scenarios)) if scenarios else 1


def _check_fits(name: str, per_rank: int, ranks: int, machine: Machine, *, controller: int | None = None) -> None:
    """Refuse when ``ranks`` ranks of ``per_rank`` bytes do not fit in the memory past the
    controller's and every rank's own. ``controller``: invariance, the bytes its controller
    keeps of the variants' outputs (``per_rank`` is then the most over the variants)."""
    if machine.memory is None:
        return
    room = machine.memory - CONTROLLER_BYTES - ranks * RANK_BYTES
    need = per_rank * ranks + (controller or 0)
    if need > room:
        over = " over its invariance variants" if controller is not None else ""
        kept = f" and {size_text(controller)} the controller keeps of their gradients" if controller is not None else ""
        raise BadInput(
            f"scenario {name!r} needs about {size_text(per_rank)} a rank{over}: {size_text(per_rank * ranks)} for "
            f"{ranks} rank{'s' * (ranks != 1)}{kept}, more than the {size_text(max(room, 0))} available to them "
            f"({size_text(machine.memory)} free, less {size_text(CONTROLLER_BYTES)} for the controller and "
            f"{size_text(RANK_BYTES)} a rank) ({OVERRIDE} to run it anyway)")


def check_run(scenarios: Sequence[Scenario], nproc: int | None, *, allow_large_world: bool = False,
              machine: Machine | None = None) -> None:
    """What ``shardcheck run`` is about to start: a world of ``nproc`` ranks (default: the
    smallest every scenario fits in) within :attr:`Machine.max_ranks`, and every scenario it
    will run (tp * cp dividing the world) within the memory, on every rank (data-parallel
    replicas run it too)."""
    if allow_large_world:
        return
    machine = machine or Machine.here()
    size = nproc or _world_size(scenarios)
    check_nproc(size, machine=machine,
                what=None if nproc else f"these scenarios need a world of {size} ranks (the lcm of their tp*cp), which")
    estimates: dict[tuple, int] = {}  # by what sets them: a large file repeats few shapes
    for sc in scenarios:
        if size % sc.ranks == 0:
            key = shape_key(sc)
            if key not in estimates:
                estimates[key] = scenario_bytes(sc)
            _check_fits(sc.name, estimates[key], size, machine)


def check_invariance_world(scenarios: Sequence[Scenario], axes: Sequence[str], nproc: int | None, *,
                     allow_large_world: bool = False, machine: Machine | None = None) -> None:
    """What ``shardcheck invariance`` is about to start (``check_invariance``'s world: ``nproc``,
    default the smallest every base fits in, at least 4): the world within the cores and memory,
    and each base's variants along ``axes`` (tp = 1 holds the whole vocab on a rank, cp = 1 every
    row) within the memory. Variants run without the reference and send their outputs back; the
    controller keeps each variant's logit gradient, [total, vocab] per sample, for the rest of
    the run, so those add up over the bases."""
    if allow_large_world:
        return
    from shardcheck.harness.controller.commands.invariance import variants  # imports torch

    machine = machine or Machine.here()
    size = nproc or max(4, _world_size(scenarios))
    check_nproc(size, machine=machine,
                what=None if nproc else f"these scenarios need a world of {size} ranks (the lcm of their tp*cp), which")
    kept: dict[str, int] = {}  # scenario key -> bytes the controller keeps of its outputs
    for base in scenarios:
        per_rank, in_flight = 0, 0
        for axis in axes:
            for v in variants(axis, base, size):
                sc = v.scenario
                if sc is None:
                    continue
                per_rank = max(per_rank, scenario_bytes(sc, reference=False, outputs=True))
                grads = sum(s.total for s in sc.samples) * sc.vocab * DTYPE_BYTES[sc.dtype]
                kept[sc.key] = grads
                in_flight = max(in_flight, grads * (size // sc.ranks))  # every replica's gradient arrives
        _check_fits(base.name, per_rank, size, machine, controller=sum(kept.values()) + in_flight)
