"""What the controller can learn about a rank's memory from Linux: its resident size while it
lives, and whether the out-of-memory killer ran, so a rank killed by SIGKILL for memory is
reported as such and not as a mystery."""

from __future__ import annotations

import os


def rss_bytes(pid: int) -> int | None:
    """Resident set size of ``pid`` (None once it is gone; a zombie's reads 0)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") or None


def oom_kills() -> int | None:
    """How many processes the OOM killer has ended: in this cgroup (v2) if it says, else on the
    machine (/proc/vmstat); None where neither can be read."""
    for path in ("/sys/fs/cgroup/memory.events", "/proc/vmstat"):
        try:
            with open(path) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            continue
    return None


def size_text(n: float) -> str:
    """Bytes as people read them: 512 MiB, 7.6 GiB, 512000.0 GiB."""
    if n < 2**30:
        return f"{n / 2**20:.0f} MiB"
    return f"{n / 2**30:.1f} GiB"
