"""The controller side of the world: rank processes started once and reused scenario after
scenario, with every wait bounded.

The controller owns the rendezvous store (a TCPStore on a port the OS picks, so two runs never
race for a port) and one pipe per rank. A rank that dies, raises or hangs becomes a result with a
``rank_error``; after such a scenario the world is restarted before the next one, transparently.
On a hang the controller first asks every rank for its stack (faulthandler), then ends them.
Ranks fork from a server that imported torch and megatron-core once, so a (re)start costs a
fraction of a second after the first (see ``_start_context``).
"""

from __future__ import annotations

import atexit
import datetime
import multiprocessing as mp
import os
import signal
import tempfile
import time
from multiprocessing.connection import wait
from collections.abc import Callable
from typing import Any

from shardcheck.errors import WorldError
from shardcheck.harness import wire
from shardcheck.harness.controller.worlds import leftovers
from shardcheck.harness.controller.worlds import rank_memory as memory
from shardcheck.harness.controller.worlds.cpu_wait import CpuWait
from shardcheck.harness.rank.plumbing import board
from shardcheck.harness.rank.main import rank_main
from shardcheck.harness.wire import TIMEOUT, Checks, Failure, RankResult



STACK_WAIT_S = 0.3  # how long hung ranks are given to write their stacks


class SpawnedWorld:
    def __init__(self, nproc: int, *, timeout: float = 60.0, start_timeout: float = 180.0,
                 lockstep: bool = True, backend: str = "gloo", fork_server: bool = True) -> None:
        if nproc < 1:
            raise ValueError(f"a world needs at least one rank, got {nproc}")
        self.nproc = nproc
        self.backend = backend
        self.timeout = timeout
        self.start_timeout = start_timeout
        self.lockstep = lockstep
        self.fork_server = fork_server  # False: every rank is spawned afresh (see _start_context)
        self.generation = 0
        self.startup_seconds: list[float] = []  # wall time of each (re)start
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._store: Any = None
        self._board: board.Board | None = None  # the lockstep's shared board (see rank/board.py)
        self._dir: tempfile.TemporaryDirectory | None = None
        self._healthy = False
        self._seq = 0
        self._output: dict[str, set[int]] = {}
        self._output_read: dict[tuple[int, int], int] = {}
        self._rss: dict[int, int] = {}  # each rank's resident size when last seen
        self._cpu_wait = CpuWait()  # how long each rank waited for a CPU: whose a missed deadline is
        self._oom_kills: int | None = None
        # what happened to the world outside any scenario (a rank that died while idle), in words
        self.events: list[str] = []
        # told ("starting 4 ranks", seconds so far) about once a second while the world starts
        self.progress: Callable[[str, float], None] | None = None

    # -- lifecycle --------------------------------------------------------------------------
    def __enter__(self) -> SpawnedWorld:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def started(self) -> bool:
        return bool(self._procs)

    def start(self) -> None:
        import torch.distributed as dist

        t0 = time.perf_counter()
        self.generation += 1
        self._say_starting(None)
        leftovers.sweep()  # the folders of runs killed before they could clean up
        self._dir = tempfile.TemporaryDirectory(prefix=f"shardcheck-world-{os.getpid()}-")
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=self.start_timeout))
        env = _rank_environment()
        self._board = None
        if self.lockstep and board.supported():  # the ranks' lockstep then speaks through it
            self._board = board.Board.create(os.path.join(self._dir.name, "board"), self.nproc)
        ctx = _start_context(self.backend, env, self.fork_server)
        atexit.register(self.close)
        for rank in range(self.nproc):
            parent, child = ctx.Pipe(duplex=True)
            options = {
                "collective_timeout": self.timeout,
                "start_timeout": self.start_timeout,
                "traceback_file": self._traceback_file(rank),
                "output_file": self._output_file(rank),
                "lockstep": self.lockstep,
                "board": self._board.path if self._board is not None else None,
                "backend": self.backend,
                "environment": env,
                "controller_pid": os.getpid(),
            }
            p = ctx.Process(target=rank_main, args=(rank, self.nproc, self._store.port, child, options),
                            name=f"shardcheck-rank{rank}", daemon=True)
            p.start()
            child.close()
            self._procs.append(p)
            self._conns.append(parent)
        self._oom_kills = memory.oom_kills()
        self._rss = {}
        try:
            self._await_ready(t0 + self.start_timeout)
        except BaseException:
            self.close()
            raise
        self._healthy = True
        self.startup_seconds.append(time.perf_counter() - t0)

    def _say_starting(self, t0: float | None) -> None:
        """Tell ``progress``: 0.0 s exactly when a start begins, the time so far after that."""
        if self.progress is not None:
            what = "restarting" if self.generation > 1 else "starting"
            self.progress(f"{what} {self.nproc} ranks", 0.0 if t0 is None else time.perf_counter() - t0)

    def _await_ready(self, deadline: float) -> None:
        waiting = set(range(self.nproc))
        while waiting:
            left = deadline - time.perf_counter()
            if left <= 0:
                raise WorldError(f"ranks {sorted(waiting)} did not join the world within {self.start_timeout:.0f}s")
            self._say_starting(deadline - self.start_timeout)
            ready = wait([self._conns[r] for r in waiting] + [self._procs[r].sentinel for r in waiting],
                         timeout=min(left, 1.0))
            for r in list(waiting):
                if self._conns[r] in ready:
                    try:
                        name, kwargs = self._conns[r].recv()
                    except (EOFError, OSError):
                        name, kwargs = wire.FATAL, {"error": {"type": "EOFError", "message": "pipe closed"}}
                    if name == wire.READY:
                        waiting.discard(r)
                    elif name == wire.FATAL:
                        e = kwargs["error"]
                        raise WorldError(f"rank {r} failed to start: {e['type']}: {e['message']}")
                elif self._procs[r].sentinel in ready:
                    self._procs[r].join(timeout=1.0)
                    raise WorldError(f"rank {r} exited while starting ({_exit_text(self._procs[r].exitcode)})")

    def close(self) -> None:
        """End every rank (politely, then by force) and release the store; idempotent."""
        for conn in self._conns:
            try:
                conn.send(wire.message(wire.STOP))
            except (OSError, ValueError):
                pass
        deadline = time.perf_counter() + 5.0
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.perf_counter()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        self._store = None  # the last reference: the server socket closes
        self._board = None
        if self._dir is not None:
            self._collect_output()
            self._dir.cleanup()
            self._dir = None
        self._healthy = False
        atexit.unregister(self.close)

    def restart(self) -> None:
        self.close()
        self.start()

    # -- work -------------------------------------------------------------------------------
    def ensure_ready(self) -> None:
        """Start the world, or restart it when the last scenario left it unusable or a rank died
        while it was idle (named in ``events``); a no-op for a healthy world."""
        for r, p in enumerate(self._procs if self._healthy else []):
            if not p.is_alive():
                self._died_idle(r)
        if not self._healthy:
            if self.started:
                self.close()
            self.start()

    def run(self, scenario: dict[str, Any], target: str, checks: Checks = Checks()) -> list[RankResult]:
        """Run one scenario on every rank, with ``checks``; one result per rank, always, within
        the timeout. A rank that raised, died or hung comes back as a result holding a
        ``rank_error``."""
        self.ensure_ready()
        self._seq += 1
        seq = self._seq
        if not self._send_run(seq, scenario, target, checks):
            # a rank died after ensure_ready looked, before it got the scenario: nobody has run it
            self.ensure_ready()
            self._send_run(seq, scenario, target, checks)
        results: dict[int, RankResult] = {}
        died: list[int] = []
        limit = self.timeout + min(10.0, max(2.0, self.timeout))  # ranks time out first, by themselves
        # The deadline follows progress: a result, a key set in the store (a status, a call
        # announced over the store) or a call announced on the board starts it again. Ranks still
        # working through calls are not hung.
        t_start = time.perf_counter()
        self._cpu_wait.sample([p.pid for p in self._procs])  # the window's start: a busy controller polls seldom
        deadline, keys = t_start + limit, wire.progress(self._store, self._board)
        while len(results) < self.nproc:
            pending = [r for r in range(self.nproc) if r not in results]
            now_keys = wire.progress(self._store, self._board)
            if now_keys != keys:
                keys, deadline = now_keys, time.perf_counter() + limit
            left = deadline - time.perf_counter()
            if left <= 0:
                if died:
                    why = f"stopped after rank {died[0]} died: no result within {limit:.0f}s"
                else:
                    why = f"hung: no result and no call anywhere within {limit:.0f}s"
                # a hang is the cause, the peers' timeouts its consequence; after a death, the death
                self._end_hung(pending, results, why, blamed=not died, window=limit)
                break
            waited = self._waited_for(pending, results)
            if waited is not None:  # every other rank gave up waiting for these: no need to wait on
                self._end_stragglers(pending, results, waited)
                break
            ready = wait([self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending],
                         timeout=min(left, 1.0))
            if not ready:  # idle: look at the ranks (after a message, its handling comes first)
                self._sample_memory(pending)
                self._cpu_wait.sample([self._procs[r].pid for r in pending])
            for r in pending:
                dead = self._procs[r].sentinel in ready
                if self._conns[r] in ready:
                    try:
                        name, kwargs = self._conns[r].recv()
                        getattr(self, "_on_" + name)(r, seq, kwargs, results)
                        deadline = time.perf_counter() + limit
                        continue
                    except (EOFError, OSError):  # the pipe closed: the rank is gone
                        dead = True
                if dead and r not in results:
                    self._procs[r].join(timeout=1.0)
                    why = f"rank {r} died ({self._death_text(r)})"
                    results[r] = RankResult.error(r, why, desync=True)
                    died.append(r)
                    self._say_died(seq, r, why)
        if any(res.desync for res in results.values()):
            self._healthy = False  # the backend's groups may be out of step: restart before the next one
        return [results[r] for r in range(self.nproc)]

    def _send_run(self, seq: int, scenario: dict[str, Any], target: str, checks: Checks) -> bool:
        from shardcheck.run_config import effective

        # the run's configuration goes with the scenario: a world started before it changed (a
        # pytest session's, bisect's next commit) runs what the controller means now
        config = effective(target).to_wire()
        for r, conn in enumerate(self._conns):
            try:
                conn.send(wire.message(wire.RUN, scenario=scenario, target=target, seq=seq,
                                       checks=checks.to_wire(), config=config, settings=wire.user_settings()))
            except OSError:  # BrokenPipe: the rank is gone
                self._died_idle(r)
                return False
        return True

    def _died_idle(self, rank: int) -> None:
        self._procs[rank].join(timeout=1.0)
        self.events.append(f"rank {rank} died between scenarios ({self._death_text(rank)}); the world restarted")
        self._healthy = False

    def _waited_for(self, pending: list[int], results: dict[int, RankResult]) -> list[Failure] | None:
        """The answered ranks' reports of waiting in vain, when every rank still pending is one a
        peer waited for (the others answered: finished, as data-parallel replicas do, or waiting)."""
        if not pending or not results:
            return None
        waits = [f for res in results.values() for f in res.failures if "waited_for" in f.details]
        named = {r for f in waits for r in f.details.get("waited_for_ranks", [])}
        return waits if waits and set(pending) <= named else None

    def _end_stragglers(self, pending: list[int], results: dict[int, RankResult], waits: list[Failure]) -> None:
        peers = sorted({r for f in waits for r in f.ranks})
        waited = waits[0].details["waited_for"]
        self._end(pending, results,
                  lambda r, where: f"rank {r} hung: it did not arrive where ranks {peers} {waited}; rank {r} was at {where}",
                  blamed=True, window=self.timeout)

    def _kill(self, ranks: list[int]) -> None:
        """End ranks that will not answer a polite stop (busy, or stuck in a collective)."""
        for r in ranks:
            if self._procs[r].is_alive():
                self._procs[r].kill()

    def _sample_memory(self, ranks: list[int]) -> None:
        for r in ranks:
            rss = memory.rss_bytes(self._procs[r].pid)
            if rss is not None:
                self._rss[r] = rss

    def _death_text(self, rank: int) -> str:
        """How a rank ended, with what points at the out-of-memory killer when it was SIGKILL."""
        code = self._procs[rank].exitcode
        text = _exit_text(code)
        if code == -signal.SIGKILL:
            kills = memory.oom_kills()
            if kills is not None and self._oom_kills is not None and kills > self._oom_kills:
                text += ", by the out-of-memory killer"
                self._oom_kills = kills
            if rank in self._rss:
                text += f"; it held {memory.size_text(self._rss[rank])} when last seen"
        return text

    def _say_died(self, seq: int, rank: int, why: str) -> None:
        """Tell the dead rank's peers (waiting in lockstep) at once, instead of by timeout."""
        import json

        from shardcheck.harness.wire import status_key

        try:
            self._store.set(status_key(seq, rank), json.dumps({"state": "died", "reason": why}))
        except Exception:  # noqa: BLE001  (best effort: peers still stop at their timeout)
            pass

    def _on_result(self, rank: int, seq: int, kwargs: dict[str, Any], results: dict[int, Any]) -> None:
        """Emitted when a rank has finished a scenario."""
        result = RankResult.from_wire(kwargs)
        if result.seq == seq:
            result.received_at = time.time()
            results[rank] = result

    def _on_fatal(self, rank: int, seq: int, kwargs: dict[str, Any], results: dict[int, Any]) -> None:
        """Emitted when a rank cannot go on."""
        e = kwargs["error"]
        results[rank] = RankResult.error(rank, f"rank {rank} failed: {e['type']}: {e['message']}", desync=True)

    def _on_ready(self, rank: int, seq: int, kwargs: dict[str, Any], results: dict[int, Any]) -> None:
        """Emitted once per start; late ones are harmless."""

    def _end_hung(self, pending: list[int], results: dict[int, Any], why: str, *, blamed: bool,
                  window: float) -> None:
        self._end(pending, results, lambda r, where: f"rank {r} {why}; it was at {where}", blamed=blamed,
                  window=window)

    def _end(self, pending: list[int], results: dict[int, Any], say: Callable[[int, str], str], *,
             blamed: bool, window: float) -> None:
        """End ranks that gave no result, each with ``say(rank, where it was)``; the world is
        closed (it restarts before the next scenario). ``blamed``: they are the cause (the rank
        that did not come heads the verdict). A rank that waited for a CPU through much of the
        last ``window`` seconds missed its deadline because of the machine: a ``timeout``."""
        judged = {r: self._cpu_wait.judge(self._procs[r].pid, window) for r in pending}  # (starved, busy)
        stacks = self._stacks(pending)
        self._kill(pending)
        for r in pending:
            starved, busy = judged[r]
            details = {"stack": stacks.get(r, "")} | ({"blamed": True} if blamed else {})
            said = say(r, stacks.get(r) or "no stack available") + (f"; {busy}" if busy else "")
            if starved:
                results[r] = RankResult.error(r, f"{said}; {starved}", desync=True, details=details,
                                              kind=TIMEOUT)
            else:
                results[r] = RankResult.error(r, said, desync=True, details=details)
        self._healthy = False
        self.close()

    def _stacks(self, ranks: list[int]) -> dict[int, str]:
        """Ask hung ranks where they are (faulthandler on SIGUSR1), the innermost shardcheck or
        user frame first."""
        def size(r: int) -> int:
            try:
                return os.path.getsize(self._traceback_file(r))
            except OSError:
                return 0

        before, asked = {r: size(r) for r in ranks}, []
        for r in ranks:
            if self._procs[r].is_alive():
                try:
                    os.kill(self._procs[r].pid, signal.SIGUSR1)
                    asked.append(r)
                except ProcessLookupError:
                    pass
        # each writes its stack from the signal handler: done when every file grew and stopped
        # growing, or after STACK_WAIT_S (a rank that cannot run its handler says nothing)
        deadline, last = time.perf_counter() + STACK_WAIT_S, None
        while asked and time.perf_counter() < deadline:
            time.sleep(0.01)
            now = {r: size(r) for r in asked}
            if now == last and all(now[r] > before[r] for r in asked):
                break
            last = now
        out = {}
        for r in ranks:
            try:
                with open(self._traceback_file(r)) as f:
                    text = f.read()
            except OSError:
                continue
            out[r] = _innermost_frame(text)
        return out

    def rank_output(self) -> list[tuple[str, list[int]]]:
        """What the ranks printed (import-time warnings, a target's prints), each distinct line
        once with the ranks that printed it, in the order first seen; kept across restarts."""
        self._collect_output()
        return [(line, sorted(ranks)) for line, ranks in self._output.items()]

    def _collect_output(self) -> None:
        for rank in range(self.nproc if self._dir is not None else 0):
            try:
                with open(self._output_file(rank), errors="replace") as f:
                    f.seek(self._output_read.get((self.generation, rank), 0))
                    text = f.read()
                    self._output_read[(self.generation, rank)] = f.tell()
            except OSError:
                continue
            for line in text.splitlines():
                if line.strip():
                    self._output.setdefault(line.rstrip(), set()).add(rank)

    def _output_file(self, rank: int) -> str:
        # a rank's stdout and stderr: kept out of the terminal, where they would land between
        # the progress lines (see rank_output)
        return os.path.join(self._dir.name, f"output-{rank}.txt")

    def _traceback_file(self, rank: int) -> str:
        assert self._dir is not None
        return os.path.join(self._dir.name, f"rank{rank}.stack")


def _rank_environment() -> dict[str, str]:
    """The controller's environment as a rank should see it, read at each start (a forked rank
    would otherwise have the fork server's, frozen when it started)."""
    env = dict(os.environ)
    # torch reads it when it loads: a lockstep wait slice that times out is routine, not a warning
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


# Read by torch, its thread pools or its backends when they load, which a forked rank does not
# do again: a rank forks only from a server that loaded them with the same values.
_LOAD_TIME_PREFIXES = ("TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "GLOO_", "NCCL_", "CUDA_")
# Torch sets this one in the controller itself (to its default) and reads it whenever it is used.
_READ_WHEN_USED = frozenset({"TORCHINDUCTOR_CACHE_DIR"})
_server_settings: dict[str, str] | None = None  # those values, as the fork server loaded torch


def _load_time_settings(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_LOAD_TIME_PREFIXES) and k not in _READ_WHEN_USED}


def _start_context(backend: str, env: dict[str, str], fork_server: bool) -> Any:
    """How rank processes start. On CPU (gloo) they fork from a server that has imported torch and
    megatron-core once (``rank/preload.py``); with nccl they are spawned afresh, because a process
    that may have touched CUDA must not be forked, and so they are when the settings torch reads
    as it loads have changed since the server loaded it."""
    global _server_settings
    settings = _load_time_settings(env)
    if (not fork_server or backend != "gloo" or "forkserver" not in mp.get_all_start_methods()
            or _server_settings not in (None, settings)):
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    from multiprocessing import forkserver

    leftovers.multiprocessing_folder()  # where the server listens: named after this run

    # Both only matter when the server starts (once per controller process).
    ctx.set_forkserver_preload(["shardcheck.harness.rank.plumbing.preload"])
    saved = dict(os.environ)
    os.environ.update({k: v for k, v in env.items() if k not in saved})
    try:
        forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    _server_settings = settings
    return ctx


def _innermost_frame(faulthandler_text: str) -> str:
    # faulthandler prints the most recent call first: 'File "x.py", line 12 in fn'. The main
    # thread's block comes last; prefer its innermost frame outside torch itself.
    blocks = faulthandler_text.strip().split("\n\n")
    frames = [ln.strip() for ln in blocks[-1].splitlines() if ln.strip().startswith("File ")]
    outside = [f for f in frames if "/torch/" not in f]
    if outside:
        inner = f" (inside {frames[0]})" if frames and frames[0] != outside[0] else ""
        return outside[0] + inner
    return frames[0] if frames else faulthandler_text.strip()[:200]


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"

