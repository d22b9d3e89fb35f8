"""Every rank of a world far larger than the machine, in turn, in one process.

Each rank joins torch's fake process group (the ``fake`` backend over a ``FakeStore``: every
collective returns at once, moving no data) as that rank of a world of ``dp * tp * cp``; megatron-core
builds its groups for that world (``groups.configure``: ``initialize_model_parallel``, its rank
lists computed once per layout and only the rank's own groups created:
``groups.share_rank_lists``); the rank
runs the scenario exactly as a real rank does (``RankRunner``: its shard, the target, the
backward), its collectives recorded by the same interception point (``trace``). Once every rank
has run (in one process, or split over a few), :func:`judge` compares the traces of each group
(:mod:`symmetry`), as the lockstep would have while they ran: the first divergence is a
``collective_mismatch`` in the lockstep's words.

What this cannot check: values (a fake collective leaves its output as it was, so every value
after the first collective is meaningless; the reference is never consulted), and control flow
that depends on a value a collective brought (such a branch is taken on garbage here).

The process runs this loop (:func:`serve`) as a child of the controller, so a target that never
returns is ended at the controller's deadline, as a real rank is.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from shardcheck.harness import wire
from shardcheck.harness.wire import COLLECTIVE_MISMATCH, RANK_ERROR, Checks, Failure, RankResult

FAKE = "fake"


def run_ranks(runner: Any, scenario: dict[str, Any], target: str, seq: int, checks: Checks,
              ranks: list[int], starting: Any = None, share_rank_lists: bool = True,
              ) -> list[tuple[RankResult, dict[str, str]]]:
    """The scenario on each of ``ranks`` of its ``dp * tp * cp * sp`` world in turn: per rank, its result
    (with its whole trace) and what each group it called in is for ("tp", "cp", ...).
    ``starting(rank)`` is told as each begins (the controller's deadline follows it).
    ``share_rank_lists``: megatron's rank lists computed once for the layout, only the rank's own
    groups created (``groups.share_rank_lists``); off, every rank builds all of them, as a real
    rank does."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from shardcheck.harness.rank.plumbing import groups
    from shardcheck.harness.rank.plumbing import trace

    world = int(scenario.get("dp", 1)) * int(scenario["tp"]) * int(scenario.get("cp", 1)) * int(scenario.get("sp", 1))
    traced = dataclasses.replace(checks, trace_calls=True, reference=False)
    out = []
    groups.share_rank_lists(share_rank_lists)
    try:
        for rank in ranks:
            if starting is not None:
                starting(rank)
            dist.init_process_group(FAKE, store=FakeStore(), rank=rank, world_size=world)
            try:
                runner.rank = rank
                result = runner.run(scenario, target, seq, traced)
                labels = {name: groups.label(name) for name in {c["group"] for c in result.trace}}
            finally:
                groups.leave_world()  # the rank-list sharing and its lists stay for the next rank
                trace.reset()
                dist.destroy_process_group()
            out.append((result, labels))
    finally:
        groups.share_rank_lists(False)
    return out


def judge(results: list[RankResult], labels: dict[int, dict[str, str]], keep_traces: bool) -> list[RankResult]:
    """Every rank's result in, the first divergence (if any) attached to the result of the lowest
    rank it involves; the traces dropped unless asked for."""
    from shardcheck.harness.rank.checks import symmetry

    traces = {r.rank: symmetry.calls_from(r.trace) for r in results}
    # a rank that raised stops a real world there too (its peers wait for it): that is the finding
    if not any(f.kind == RANK_ERROR for r in results for f in r.failures):
        d = symmetry.first_divergence(traces, labels)
        if d is not None:
            details = {"at": time.time(), "group": d.group, "group_ranks": d.group_ranks, "label": d.label,
                       "call": d.call, "sides": d.sides, "last_matched": d.last_matched, "simulated": True}
            first = next(r for r in results if r.rank == d.ranks[0])
            first.failures.append(Failure(COLLECTIVE_MISMATCH, d.message, d.ranks, phase=d.phase, details=details))
    if not keep_traces:
        for r in results:
            r.trace = []
    return results


def serve(conn: Any) -> None:
    """The child's loop: ``run`` messages (with the ranks to run) in, their results and group
labels out, until ``stop`` or EOF."""
    import os

    from shardcheck.harness.rank.plumbing import trace
    from shardcheck.harness.rank.main import RankRunner

    trace.install()
    import torch

    # one simulation process per core: a second intra-op thread only takes a core from the other
    # (the same wall time a rank, twice the CPU time); values are not checked here
    torch.set_num_threads(1)
    runner = RankRunner(0, None, torch.device("cpu"))
    runner.trace_cap = None
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (imported once, at start)

    conn.send(("ready", None))  # the start-up is over: a scenario's deadline starts with it
    try:
        while True:
            try:
                name, kwargs = conn.recv()
            except (EOFError, OSError):
                break
            if name == wire.STOP:
                break
            wire.apply_settings(kwargs.get("settings", {}))
            checks = Checks.from_wire(kwargs["checks"])
            try:
                done = run_ranks(runner, kwargs["scenario"], kwargs["target"], kwargs["seq"], checks, kwargs["ranks"],
                                 starting=lambda rank: conn.send(("starting", rank)),
                                 share_rank_lists=kwargs.get("share_rank_lists", True))
                conn.send(("results", [(r.to_wire(), labels) for r, labels in done]))
            except BaseException as exc:  # noqa: BLE001  (the fake world itself failed: say so)
                conn.send(("fatal", wire.error_payload(exc)))
    finally:
        runner.close()
        os._exit(0)  # no atexit handlers of torch or megatron in a child that only simulated
