"""Runs the suite starts in the background while other tests go on, one at a time.

Some tests spend their seconds in subprocesses the test process only waits for: a pytest session
as a framework team runs it, two torchrun agents, the command line waiting out a deadline. On 2
cores the suite's own process leaves much of the second core idle; these runs fill it.

- A test module lists its runs in ``BACKGROUND``: name -> (a function of a fresh folder that runs
  the subprocesses, each with its own timeout, and returns what the test checks; the longest the
  function can take). tests/conftest.py lists the runs tests of several modules share.
- A test marked ``@pytest.mark.background("name", ...)`` gets them with the ``background``
  fixture: ``background("name")``. Runs are queued in the order their tests were collected and
  started once collection ends, one at a time: the machine never carries more than one extra load.
- A test marked ``calm`` (it starves a rank of a CPU on purpose) runs with nothing in the
  background: the run going on finishes first, and none starts until the test ends. Calm tests
  run last (tests/conftest.py), when the queue has drained, so none waits on a run.
- A run not begun when its test asks is run there and then, in the test's own thread; so is every
  run under pytest-xdist (each worker would otherwise start every run).
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WAIT_MARGIN_S = 60.0  # beyond the longest subprocess timeout of a run: a run never waits longer
KILLED_WAIT_S = 10.0  # for a run whose processes were killed to see them gone


@dataclass
class Run:
    name: str
    work: Callable[[Path], Any]
    timeout: float
    folder: Path
    done: threading.Event = field(default_factory=threading.Event)
    value: Any = None
    error: BaseException | None = None

    def execute(self) -> None:
        try:
            self.folder.mkdir()
            self.value = self.work(self.folder)
        except BaseException as exc:  # noqa: BLE001  (handed to the test that asks)
            self.error = exc
        finally:
            self.done.set()


class Background:
    """The queue of runs and the one thread that works through it."""

    def __init__(self, enabled: bool, root: Path) -> None:
        self.enabled = enabled
        self.root = root  # a folder a run: removed with the session
        self.runs: dict[str, Run] = {}
        self._pending: list[Run] = []
        self._lock = threading.Condition()
        self._paused = False
        self._stopping = False
        self._running: Run | None = None
        self._thread: threading.Thread | None = None

    def add(self, name: str, work: Callable[[Path], Any], timeout: float) -> None:
        if name in self.runs:
            return
        run = self.runs[name] = Run(name, work, timeout, self.root / name)
        self._pending.append(run)

    def start(self) -> None:
        if self.enabled and self._pending and self._thread is None:
            self._thread = threading.Thread(target=self._work, name="shardcheck-tests-background", daemon=True)
            self._thread.start()

    def _work(self) -> None:
        while True:
            with self._lock:
                while self._paused and not self._stopping:
                    self._lock.wait()
                if self._stopping or not self._pending:
                    return
                run = self._running = self._pending.pop(0)
            run.execute()
            with self._lock:
                self._running = None
                self._lock.notify_all()

    def get(self, name: str) -> Any:
        """What run ``name`` returned (raising what it raised), waiting for it if it is going on."""
        run = self.runs[name]
        with self._lock:
            mine = run in self._pending  # not begun: this thread runs it
            if mine:
                self._pending.remove(run)
        if mine:
            run.execute()
        elif not run.done.wait(run.timeout + WAIT_MARGIN_S):
            raise TimeoutError(f"background run {name!r} still going after {run.timeout + WAIT_MARGIN_S:.0f} s")
        if run.error is not None:
            raise run.error
        return run.value

    def pause(self) -> None:
        """Nothing in the background from now on: wait for the run going on (bounded)."""
        with self._lock:
            self._paused = True
            running = self._running
        if running is not None:
            running.done.wait(running.timeout + WAIT_MARGIN_S)

    def resume(self) -> None:
        with self._lock:
            self._paused = False
            self._lock.notify_all()

    def close(self, kill: Callable[[], None] | None = None) -> None:
        """No further run starts; the folders go. A run still going (a session stopped early,
        Ctrl-C) has its processes ended by ``kill`` when given, else ends within its timeouts."""
        with self._lock:
            self._stopping = True
            self._pending.clear()
            running = self._running
            self._lock.notify_all()
        if running is not None:
            if kill is not None:
                kill()
            running.done.wait(KILLED_WAIT_S if kill is not None else running.timeout + WAIT_MARGIN_S)
        shutil.rmtree(self.root, ignore_errors=True)
