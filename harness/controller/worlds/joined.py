"""A world someone else started: this process is one of its ranks (torchrun, or any launcher
that sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT).

Every rank runs the same controller code (pytest, as Megatron-LM's CI runs it under torchrun)
and calls :meth:`JoinedWorld.run` with the same scenarios in the same order. Each rank runs its
part in this process and the results are exchanged, so every rank returns the same list and
reaches the same verdict. It offers what :func:`shardcheck.harness.controller.commands.runner.run` needs of a world.

Unlike a spawned :class:`~shardcheck.harness.controller.worlds.spawned.SpawnedWorld`, a joined world cannot be restarted:
after a failure that left the backend's groups out of step (only possible without the lockstep
check, or when the backend itself failed) later scenarios report that instead of hanging.
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Any

from shardcheck.errors import WorldError
from shardcheck.harness.wire import Checks, RankResult

LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def launched_by_torchrun(environ: dict[str, str] | None = None) -> bool:
    """Whether this process is a rank of a world a launcher set up (torchrun sets all five)."""
    env = os.environ if environ is None else environ
    return all(k in env for k in LAUNCHER_ENV)


class JoinedWorld:
    def __init__(self, *, timeout: float = 60.0, lockstep: bool = True, backend: str = "auto") -> None:
        if not launched_by_torchrun():
            missing = [k for k in LAUNCHER_ENV if k not in os.environ]
            raise WorldError(f"not launched by torchrun: {', '.join(missing)} not set")
        self.rank = int(os.environ["RANK"])
        self.nproc = int(os.environ["WORLD_SIZE"])
        self.timeout = timeout
        self.lockstep = lockstep
        self.requested_backend = backend
        self.backend = "gloo"
        self.startup_seconds: list[float] = []
        self.events: list[str] = []  # as SpawnedWorld's; a joined world has none (it cannot restart)
        self.progress: Any = None  # as SpawnedWorld's; a joined world starts with its launcher
        self._runner: Any = None
        self._exchange: Any = None  # a gloo group of its own for the results
        self._store: Any = None
        self._owns_group = False
        self._out_of_step: str | None = None
        self._seq = 0
        # per global rank: where it runs ("node 1 local rank 0 on host"), from the launcher's
        # GROUP_RANK and LOCAL_RANK: a report across machines names the process to look at
        self.placement: dict[int, str] = {}

    def __enter__(self) -> JoinedWorld:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def ensure_ready(self) -> None:
        """Join on first need (a joined world cannot be restarted)."""
        if self._runner is None:
            self.start()

    def start(self) -> None:
        import torch.distributed as dist

        from shardcheck.backend import choose_backend, process_group_backend, rank_device
        from shardcheck.harness.rank.main import prepare

        t0 = time.perf_counter()
        timeout = datetime.timedelta(seconds=self.timeout)
        joining_existing = dist.is_initialized()  # the launcher's or the user's own group
        if joining_existing:
            self.backend = dist.get_backend()
        else:
            # one GPU per rank on this node, counted by the launcher's local world
            local = int(os.environ.get("LOCAL_WORLD_SIZE", self.nproc))
            self.backend, _ = choose_backend(self.requested_backend, local)
        device = rank_device(self.backend, self.rank)
        if not joining_existing:
            kwargs = {"device_id": device} if self.backend == "nccl" else {}
            dist.init_process_group(process_group_backend(self.backend), init_method="env://", timeout=timeout, **kwargs)
            self._owns_group = True
        self._exchange = dist.new_group(backend="gloo", timeout=timeout)
        # The lockstep check needs a store of its own: rank 0 serves one on a port the OS picks.
        host = os.environ["MASTER_ADDR"]
        port = [0]
        if self.rank == 0:
            self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
            port = [self._store.port]
        dist.broadcast_object_list(port, src=0, group=self._exchange)
        import socket

        here = (f"node {os.environ.get('GROUP_RANK', '0')} local rank {os.environ.get('LOCAL_RANK', '0')} "
                f"on {socket.gethostname()}")
        everyone: list[Any] = [None] * self.nproc
        dist.all_gather_object(everyone, here, group=self._exchange)
        self.placement = dict(enumerate(everyone))
        options = {"collective_timeout": self.timeout, "lockstep": self.lockstep}
        self._runner = prepare(self.rank, self.nproc, host, port[0], options, device)
        dist.barrier(group=self._exchange)
        self.startup_seconds.append(time.perf_counter() - t0)

    def close(self) -> None:
        import torch.distributed as dist

        if self._runner is not None:
            try:
                self._runner.close()
            except Exception:  # noqa: BLE001  (best effort on the way out)
                pass
        if self._owns_group and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001  (best effort on the way out)
                pass
        self._owns_group = False
        self._runner = self._exchange = self._store = None

    def run(self, scenario: dict[str, Any], target: str, checks: Checks = Checks()) -> list[RankResult]:
        """Run one scenario here and on every peer; every rank gets every rank's result."""
        import torch.distributed as dist

        if self._runner is None:
            self.start()
        self._seq += 1
        if self._out_of_step:
            mine = RankResult.error(self.rank, f"not run: the world is out of step since {self._out_of_step}",
                                    desync=False)
        else:
            mine = self._runner.run(scenario, target, self._seq, checks)
            mine.received_at = time.time()
        results: list[Any] = [None] * self.nproc
        try:
            dist.all_gather_object(results, mine.to_wire(), group=self._exchange)
        except Exception as exc:  # noqa: BLE001  (a peer is gone or stuck: bounded by the timeout)
            self._out_of_step = f"scenario {scenario.get('name')!r}"
            raise WorldError(f"rank {self.rank}: exchanging results failed: {type(exc).__name__}: {exc}") from None
        received = [RankResult.from_wire(r) for r in results]
        if any(r.desync for r in received) and not self._out_of_step:
            self._out_of_step = f"scenario {scenario.get('name')!r}"
        return received

