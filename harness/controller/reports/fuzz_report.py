"""What ``shardcheck fuzz`` shows: a progress line per scenario run (live on a terminal) and a
summary: how many ran, the failure found, its minimal scenario, the file written, the replay."""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Sequence
from typing import TextIO

from shardcheck.harness.controller.commands.fuzz import Event, FuzzResult
from shardcheck.harness.controller.reports.run_report import MAX_FAILURES_SHOWN, clip, rank_list, show_progress
from shardcheck.scenarios.scenario import Scenario


class Progress:
    def __init__(self, err: TextIO = sys.stderr, quiet: bool = False) -> None:
        self.err, self.quiet = err, quiet
        self.live = err.isatty()
        self.runs = 0
        self.failed = False
        # the latest failing scenario: each one the shrink finds is smaller than the one before
        self.failing: Scenario | None = None
        self.shrunk = False

    def __call__(self, event: Event) -> None:
        self.runs = event.number
        if event.verdict.status == "fail":
            self.failed, self.failing = True, event.verdict.scenario
            self.shrunk = self.shrunk or event.shrinking
        if self.quiet:
            return
        stage = "shrink" if event.shrinking else "search"
        v = event.verdict
        line = f"[{event.number:>4}] {event.elapsed:6.1f}s {stage} {v.status:<4} {v.scenario.summary()}"
        show_progress(self.err, line, self.live)

    def close(self) -> None:
        if self.live and not self.quiet and self.runs:
            print(file=self.err)


def _n(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def header(target: str, seed: int, nproc: int, pairs: list[tuple[int, int]], layouts: list[str]) -> str:
    grid = " ".join(f"{t}x{c}" for t, c in pairs)
    return (f"shardcheck fuzz: target {target}, seed {seed}, {_n(nproc, 'rank')}, tp x cp {grid}, "
            f"layouts {','.join(layouts)}")


def replay_command(target: str, path: str, target_args: Sequence[str] = (), command: str = "run") -> str:
    """The command that runs the written scenario again, with the target's own options
    (``target_args``: its sources and ``--target-opt``s, as given)."""
    return shlex.join(["shardcheck", command, "--target", target, "--scenario-file", path, *target_args])


def write_minimal(result: FuzzResult, out: str, command: str, target_args: Sequence[str] = ()
                  ) -> tuple[Scenario | None, str | None, str | None]:
    """The search's minimal failing scenario written to ``out``: (the scenario, where it went, the
    ``shardcheck COMMAND`` that runs it again), all None when nothing failed."""
    from shardcheck.errors import BadInput
    from shardcheck.scenarios import write_scenario_file

    minimal = result.minimal_scenario()
    if minimal is None:
        return None, None, None
    try:
        write_scenario_file(out, minimal)
    except OSError as exc:
        raise BadInput(f"cannot write --out {out!r}: {exc.strerror}") from None
    replay = replay_command(result.target, out, target_args, command)
    return minimal, out, replay


def write_unshrunk(progress: Progress, out: str, target: str, target_args: Sequence[str] = ()) -> str:
    """On an interrupted search: the latest failing scenario it saw written to ``out``, and the
    words that say so; "" when it saw none (or ``out`` cannot be written: said instead)."""
    from shardcheck.scenarios import write_scenario_file

    if progress.failing is None:
        return ""
    try:
        write_scenario_file(out, progress.failing)
    except OSError as exc:
        return f"; a failure was seen, but --out {out!r} cannot be written ({exc.strerror})"
    how = "partly shrunk" if progress.shrunk else "not shrunk"
    return (f"; the failing scenario seen last ({how}) is in {out}: "
            f"{replay_command(target, out, target_args)}")


def repro_offer(target: str, minimal: Scenario | None, path: str | None, target_args: Sequence[str] = ()) -> str | None:
    """The `shardcheck repro` command for the written minimal scenario, where one can be written."""
    from shardcheck.harness.controller.commands import repro
    from shardcheck.targets import resolve

    if minimal is None or path is None or repro.refusal(resolve(target), minimal) is not None:
        return None
    return shlex.join(["shardcheck", "repro", "--target", target, "--scenario-file", path, *target_args,
                       "--scenario", minimal.name])


def summary(result: FuzzResult, written: str | None, replay: str | None, minimal: Scenario | None,
            repro: str | None = None) -> str:
    lines = []
    rate = 60 * result.runs / result.scenario_seconds if result.scenario_seconds > 0 else 0.0
    start = sum(result.startup_seconds)
    timing = (f"{_n(result.runs, 'scenario')} run in {result.scenario_seconds:.1f}s ({rate:.0f} scenarios/min"
              + (f"; world start-up {start:.1f}s, not counted" if result.startup_seconds else "") + ")")
    c = result.counts
    if result.failure is None or minimal is None:
        lines.append(f"no failure found in {_n(result.searched, 'scenario')} ({c['pass']} passed, {c['skip']} skipped)")
        lines.append(timing)
        return "\n".join(lines)
    v = result.failure
    shrunk = f"shrunk in {_n(result.shrink_runs, 'more run')}" + (
        " (shrink budget spent: the smallest failure so far)" if result.shrink_budget_spent else "")
    lines.append(f"FAILURE found after {_n(result.searched, 'scenario')}; {shrunk}")
    if result.flaky:
        lines.append("  (hypothesis saw the minimal scenario pass when it replayed it: the failure may be flaky)")
    lines.append(f"minimal failing scenario: {minimal.summary()}  [{', '.join(v.kinds)}]")
    for f in v.failures[:MAX_FAILURES_SHOWN]:
        phase = f" in {f.phase}" if f.phase else ""
        lines.append(f"  {f.kind}{phase} [ranks {rank_list(f.ranks)}]: {clip(f.message, 400)}")
    if len(v.failures) > MAX_FAILURES_SHOWN:
        lines.append(f"  ... {len(v.failures) - MAX_FAILURES_SHOWN} more")
    data = minimal.to_dict()
    data.pop("description")
    lines.append("  " + json.dumps(data, sort_keys=True))
    if result.first_failure is not None and result.first_failure.scenario.key != v.scenario.key:
        lines.append(f"first found as: {result.first_failure.scenario.summary()}")
    if written:
        lines.append(f"written to {written}")
        lines.append(f"replay: {replay}")
        if repro:
            lines.append(f"as a script needing only torch: {repro}")
    lines.append(timing)
    return "\n".join(lines)
