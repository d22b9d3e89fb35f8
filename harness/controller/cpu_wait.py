"""Whether a deadline was the machine's: how long a process waited for a CPU.

Linux keeps, per thread, the time it spent runnable but not running (the second field of
``/proc/PID/task/TID/schedstat``, nanoseconds). A rank that spun or sat in a collective past its
deadline waited for a CPU hardly at all; one that was ready to work while other processes held
the cores waited for much of it. So when a rank misses a deadline, the share of the last window
it spent waiting for a CPU says whose the deadline was: past STARVED, the machine's (the verdict
is ``timeout``, not a finding of the target). On a system without schedstat nothing is known,
and a missed deadline stays the target's, as before.
"""

from __future__ import annotations

import os
import time
from collections import deque

STARVED = 0.25  # of a window spent waiting for a CPU: the machine, not the code, missed the deadline
_KEPT = 600  # samples kept per process (one a second or so: ten minutes)


def cpu_wait_seconds(pid: int) -> float | None:
    """Seconds ``pid``'s threads have spent runnable and not running, or None (not Linux, gone)."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return total / 1e9


class CpuWait:
    """Samples of processes' CPU wait over time, to judge a window that ended in a deadline."""

    def __init__(self) -> None:
        self._samples: dict[int, deque[tuple[float, float]]] = {}

    def sample(self, pids: list[int]) -> None:
        now = time.monotonic()
        for pid in pids:
            waited = cpu_wait_seconds(pid)
            if waited is not None:
                self._samples.setdefault(pid, deque(maxlen=_KEPT)).append((now, waited))

    def share(self, pid: int, window: float) -> tuple[float, float] | None:
        """(seconds waited for a CPU, seconds observed) over about the last ``window`` seconds,
        sampled now; None when nothing is known."""
        self.sample([pid])
        samples = self._samples.get(pid)
        if not samples or len(samples) < 2:
            return None
        end_t, end_w = samples[-1]
        start_t, start_w = next(((t, w) for t, w in samples if t >= end_t - window), samples[0])
        if end_t - start_t <= 0:
            return None
        return end_w - start_w, end_t - start_t

    def starved(self, pid: int, window: float) -> str | None:
        """Why ``pid`` missed a deadline because of the machine ("it waited 41.2s of the last
        60.0s for a CPU ..."), or None: it had the CPU it asked for."""
        got = self.share(pid, window)
        if got is None:
            return None
        waited, seen = got
        if waited < STARVED * seen:
            return None
        return (f"it waited {waited:.1f}s of the last {seen:.1f}s for a CPU (the machine is busier than it has "
                "cores: not a finding of the target; give a longer --timeout or fewer processes)")
