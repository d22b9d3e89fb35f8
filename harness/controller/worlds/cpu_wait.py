"""Whether a deadline was the machine's: how long a process waited for a CPU, and how long it ran.

Linux keeps, per thread, the time it spent running and the time it spent runnable but not
running (the first two fields of ``/proc/PID/task/TID/schedstat``, nanoseconds). A rank that sat
in a collective past its deadline did neither much. One that was ready to work while other
processes held the cores waited for much of the window and ran little: past STARVED waiting and
under BUSY running, the deadline was the machine's (the verdict is ``timeout``, not a finding of
the target). One that ran (a share of a CPU, however busy the machine: a loop in the target's
code gets its share like anything else) was busy in the code it was at when the deadline came:
the target's, whatever the load. On a system without schedstat nothing is known, and a missed
deadline stays the target's, as before.
"""

from __future__ import annotations

import os
import time
from collections import deque

STARVED = 0.25  # of a window spent waiting for a CPU: the machine, not the code, missed the deadline ...
# ... unless it ran this share of the window: a rank that spins gets a share of a CPU at any load
# (2 of 19 runnable processes on 2 cores: 10 %); one starved waits with next to none
BUSY = 0.05
_KEPT = 600  # samples kept per process (one a second or so: ten minutes)


def cpu_seconds(pid: int) -> tuple[float, float] | None:
    """(ran, waited): seconds ``pid``'s threads have spent running, and runnable but not running;
    None (not Linux, gone)."""
    ran = waited = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                fields = f.read().split()
            ran, waited = ran + int(fields[0]), waited + int(fields[1])
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return ran / 1e9, waited / 1e9



class CpuWait:
    """Samples of processes' CPU wait over time, to judge a window that ended in a deadline."""

    def __init__(self) -> None:
        self._samples: dict[int, deque[tuple[float, float, float]]] = {}

    def sample(self, pids: list[int]) -> None:
        now = time.monotonic()
        for pid in pids:
            times = cpu_seconds(pid)
            if times is not None:
                self._samples.setdefault(pid, deque(maxlen=_KEPT)).append((now, *times))

    def share(self, pid: int, window: float) -> tuple[float, float, float] | None:
        """(seconds run, seconds waited for a CPU, seconds observed) over about the last
        ``window`` seconds, sampled now; None when nothing is known."""
        self.sample([pid])
        samples = self._samples.get(pid)
        if not samples or len(samples) < 2:
            return None
        end_t, end_r, end_w = samples[-1]
        start_t, start_r, start_w = next((s for s in samples if s[0] >= end_t - window), samples[0])
        if end_t - start_t <= 0:
            return None
        return end_r - start_r, end_w - start_w, end_t - start_t

    def judge(self, pid: int, window: float) -> tuple[str | None, str | None]:
        """Whose ``pid``'s missed deadline was, from one look at its CPU time: (starved, busy).
        starved: why it was the machine's ("it waited 41.2s of the last 60.0s for a CPU ...");
        busy: what says it ran without reaching a call ("busy: it ran 3.1s ..."), the target's.
        Both None: it waited on something (a collective, a sleep), or nothing is known."""
        got = self.share(pid, window)
        if got is None:
            return None, None
        ran, waited, seen = got
        if ran >= BUSY * seen:
            return None, (f"busy: it ran {ran:.1f}s of the last {seen:.1f}s on a CPU (and waited {waited:.1f}s for "
                          "one) without reaching a call: the code it was at loops or works past the deadline, "
                          "whatever the load")
        if waited >= STARVED * seen:
            return (f"it waited {waited:.1f}s of the last {seen:.1f}s for a CPU and ran {ran:.1f}s (the machine is "
                    "busier than it has cores: not a finding of the target; give a longer --timeout or fewer "
                    "processes)"), None
        return None, None
