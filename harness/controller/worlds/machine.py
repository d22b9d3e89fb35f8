"""What this machine has for a world: its usable cores and available memory (from /proc and
/sys, cgroup limits included), and the figures a world is sized by. No torch import: the CLI
refuses a world past them in milliseconds (limits.py).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from shardcheck.harness.controller.worlds.rank_memory import size_text

MiB = 1 << 20
GiB = 1 << 30

# Ranks fork from a server that imported torch and megatron-core once (world._start_context), so a
# rank's own memory is the pages it writes. Measured on a 4-rank gloo world (VmRSS, Pss and
# Private_* of /proc/PID/smaps_rollup): idle 288 MiB RSS, 68 MiB Pss, 16 MiB private; after the 52
# smoke scenarios 321 MiB RSS, 94 MiB Pss, 37 MiB private; from 2 to 16 ranks the world's total
# Pss grew by 20 MiB a rank idle, 26 MiB after three scenarios. 128 MiB a rank is 3.5x the largest
# private size seen: room for copy-on-write growth over a long run and for a target's own imports.
RANK_BYTES = 128 * MiB
# The controller (about 220 MiB RSS with torch imported) and the fork server (about 350 MiB RSS,
# much of it shared with the ranks): kept out of what the ranks may have.
CONTROLLER_BYTES = 512 * MiB
# Gloo worlds on 2 cores, the first five smoke scenarios on each (World(n).run): 16 ranks start in
# 4.3 s and take 0.75 s at worst a scenario, 32 start in 9.9 s and take 3.5 s, 64 start in 13.9 s
# and hang past the 60 s timeout in megatron's group creation. 8 a core stays well inside that.
RANKS_PER_CORE = 8

# -- the machine ---------------------------------------------------------------------------------
def usable_cores(root: str = "/sys/fs/cgroup") -> int:
    """The cores this process may run on: its CPU affinity, lowered by a cgroup v2 CPU quota
    (``cpu.max``: "quota period", or "max" for none), since ranks past those share them."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = _read(Path(root) / "cpu.max")
    if quota:
        parts = quota.split()
        if len(parts) == 2 and parts[0] != "max":
            try:
                cores = min(cores, max(1, math.ceil(int(parts[0]) / int(parts[1]))))
            except (ValueError, ZeroDivisionError):
                pass
    return max(1, cores)


def available_memory(meminfo: str = "/proc/meminfo", proc_cgroup: str = "/proc/self/cgroup",
                     root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes a new world may take: MemAvailable, or less where a cgroup's memory limit is nearer
    (the OOM killer acts on the cgroup, whatever the machine has free). None when nothing can be
    read (not Linux): the memory checks are then not made."""
    figures = [x for x in (_meminfo_available(meminfo), cgroup_headroom(proc_cgroup, root)) if x is not None]
    return min(figures) if figures else None


def _meminfo_available(path: str) -> int | None:
    text = _read(Path(path))
    for line in (text or "").splitlines():
        if line.startswith("MemAvailable:"):
            try:
                return int(line.split()[1]) * 1024
            except (IndexError, ValueError):
                return None
    return None


UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a number near 2**63


def cgroup_headroom(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """The least headroom (limit - usage + reclaimable page cache) over this process's memory
    cgroup and its ancestors, each of whose limits applies; None where no limit is set.

    cgroup v2: ``memory.max`` ("max": none), ``memory.current``, ``inactive_file`` of
    ``memory.stat``; the process's cgroup is the "0::PATH" line of /proc/self/cgroup (under a
    cgroup namespace PATH is "/", the root of the mount). cgroup v1: the ``memory`` controller's
    ``memory.limit_in_bytes``, ``memory.usage_in_bytes`` and ``total_inactive_file``."""
    paths = _cgroup_paths(proc_cgroup)
    found = []
    v2 = paths.get("")
    if v2 is not None:
        found += [_headroom(d, "memory.max", "memory.current", "inactive_file") for d in _ancestors(root, v2)]
    v1 = paths.get("memory")
    if v1 is not None:
        found += [_headroom(d, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
                  for d in _ancestors(os.path.join(root, "memory"), v1)]
    if v2 is None and v1 is None:  # no /proc/self/cgroup: the mount's root, as v2 would have it
        found.append(_headroom(Path(root), "memory.max", "memory.current", "inactive_file"))
    found = [x for x in found if x is not None]
    return min(found) if found else None


def _cgroup_paths(proc_cgroup: str) -> dict[str, str]:
    """Controller -> path from /proc/self/cgroup ("" is cgroup v2's unified hierarchy)."""
    out: dict[str, str] = {}
    for line in (_read(Path(proc_cgroup)) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            out[""] = path
        elif "memory" in controllers.split(","):
            out["memory"] = path
    return out


def _ancestors(root: str, path: str) -> list[Path]:
    """The cgroup's folder and its parents up to the mount's root, those that exist."""
    base = Path(root)
    here = base / path.strip("/")
    out = []
    while True:
        if here.is_dir():
            out.append(here)
        if here == base or base not in here.parents:
            break
        here = here.parent
    return out or ([base] if base.is_dir() else [])


def _headroom(folder: Path, limit_file: str, usage_file: str, inactive_key: str) -> int | None:
    limit_text = _read(folder / limit_file)
    if limit_text is None or limit_text.strip() == "max":
        return None
    try:
        limit = int(limit_text)
        usage = int(_read(folder / usage_file) or 0)
    except ValueError:
        return None
    if limit >= UNLIMITED:
        return None
    inactive = 0
    for line in (_read(folder / "memory.stat") or "").splitlines():
        key, _, value = line.partition(" ")
        if key == inactive_key:
            try:
                inactive = int(value)
            except ValueError:
                pass
    return max(0, limit - usage + inactive)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None

@dataclass(frozen=True)
class Machine:
    """What the bounds are made from (given in tests; read from /proc and /sys otherwise)."""

    cores: int
    memory: int | None  # bytes available; None: unknown, memory is not checked

    @classmethod
    def here(cls) -> Machine:
        return cls(usable_cores(), available_memory())

    @property
    def max_ranks(self) -> int:
        """The largest world this machine is trusted with: RANKS_PER_CORE a core, and as many
        ranks of RANK_BYTES as the memory past the controller's holds; at least 1."""
        by_cores = RANKS_PER_CORE * self.cores
        return max(1, min(by_cores, self.ranks_by_memory if self.memory is not None else by_cores))

    @property
    def ranks_by_memory(self) -> int:
        return max(0, ((self.memory or 0) - CONTROLLER_BYTES) // RANK_BYTES)

    def figures(self) -> str:
        text = f"{RANKS_PER_CORE} a core x {self.cores} core{'s' * (self.cores != 1)}"
        if self.memory is not None:
            text += (f"; {size_text(self.memory)} of memory available holds {self.ranks_by_memory} "
                     f"at {size_text(RANK_BYTES)} a rank")
        return text
