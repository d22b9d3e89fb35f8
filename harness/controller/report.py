"""Two renderings of the same verdicts: a terminal (live progress line, summary table) and a
JSON report rewritten atomically after every verdict, so a run that is killed keeps what it found.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from typing import Any, TextIO

from shardcheck.harness.controller.verdict import FAIL, PASS, SKIP, RunInfo, Verdict
from shardcheck.scenarios.scenario import Scenario

MAX_FAILURES_SHOWN = 8
MAX_OUTPUT_SHOWN = 12  # distinct lines the ranks printed, shown under the table


def _counts(verdicts: list[Verdict]) -> dict[str, int]:
    return {k: sum(v.status == k for v in verdicts) for k in (PASS, FAIL, SKIP)} | {"total": len(verdicts)}


class JsonReport:
    def __init__(self, path: str, meta: dict[str, Any] | None = None) -> None:
        self.path = path
        self.verdicts: list[Verdict] = []
        self.order: dict[int, int] = {}
        self.doc: dict[str, Any] = {
            "shardcheck": _version(),
            "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "complete": False,
            **(meta or {}),
        }
        self._write()  # fail early (unwritable path) and leave a file even if nothing finishes

    def start(self, info: RunInfo, scenarios: list[Scenario]) -> None:
        self.doc.update(info.to_dict())
        self.doc["planned"] = len(scenarios)
        self.order = suite_order(scenarios)
        self._write()

    def add(self, verdict: Verdict) -> None:
        self.verdicts.append(verdict)
        self._write()

    def finish(self, info: RunInfo) -> None:
        self.doc.update(info.to_dict())
        self.doc["complete"] = len(self.verdicts) == self.doc.get("planned", len(self.verdicts))
        self._write()

    def order_of(self, v: Verdict) -> int:
        return self.order.get(id(v.scenario), len(self.order))

    def _write(self) -> None:
        self.doc["summary"] = _counts(self.verdicts)
        # in suite order all along, not in the order they ran (grouped by tp, cp)
        self.doc["scenarios"] = [v.to_dict() for v in sorted(self.verdicts, key=self.order_of)]
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.doc, f, indent=1, default=str)
        os.replace(tmp, self.path)


class TerminalReport:
    """A live progress line on a terminal (one line per scenario otherwise), then a table."""

    def __init__(self, out: TextIO = sys.stdout, err: TextIO = sys.stderr, quiet: bool = False) -> None:
        self.out, self.err, self.quiet = out, err, quiet
        self.live = err.isatty()
        self.verdicts: list[Verdict] = []
        self.total = 0
        self.order: dict[int, int] = {}
        self.t0 = time.perf_counter()

    def start(self, info: RunInfo, scenarios: list[Scenario]) -> None:
        self.total, self.t0 = len(scenarios), time.perf_counter()
        self.order = suite_order(scenarios)
        total = self.total
        t = info.target
        if not self.quiet:
            print(f"shardcheck: target {t.get('name', '?')} {t.get('version', '')}".rstrip()
                  + f", {total} scenarios, {info.ranks} ranks ({info.backend})", file=self.err)

    def add(self, verdict: Verdict) -> None:
        self.verdicts.append(verdict)
        if self.quiet:
            return
        c = _counts(self.verdicts)
        line = (f"[{len(self.verdicts):>{len(str(self.total))}}/{self.total}] {time.perf_counter() - self.t0:6.1f}s "
                f"{c[PASS]} passed {c[FAIL]} failed {c[SKIP]} skipped  {verdict.status:<4} {verdict.scenario.name}")
        show_progress(self.err, line, self.live)

    def finish(self, info: RunInfo) -> None:
        if self.live and not self.quiet:
            print(file=self.err)
        in_suite_order = sorted(self.verdicts, key=lambda v: self.order.get(id(v.scenario), 0))
        try:
            print(render_table(in_suite_order, info), file=self.out, flush=True)
        except BrokenPipeError:  # piped into head: the verdicts (and exit status) still stand
            os.dup2(os.open(os.devnull, os.O_WRONLY), self.out.fileno())


def suite_order(scenarios: list[Scenario]) -> dict[int, int]:
    """Each scenario object's place in the suite (objects, not names: two may share a name)."""
    return {id(sc): i for i, sc in enumerate(scenarios)}


def render_table(verdicts: list[Verdict], info: RunInfo) -> str:
    rows = [("scenario", "layout", "tp", "cp", "verdict", "time", "detail")]
    for v in verdicts:
        sc = v.scenario
        rows.append((sc.name, sc.layout, str(sc.tp), str(sc.cp), v.status.upper() if v.status == FAIL else v.status,
                     f"{v.seconds:.2f}s" if v.status != SKIP else "-", clip(v.headline(), 90)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths) + "  " + "-" * 6)
    for v in verdicts:
        if v.status == FAIL:
            lines.append("")
            lines.append(render_failure(v))
    c = _counts(verdicts)
    start = info.startup_seconds
    printed = info.rank_output
    if printed:
        lines += ["", f"the ranks printed (each distinct line once, {len(printed)} in all):"]
        lines += [f"  [ranks {rank_list(o['ranks'])}] {clip(o['line'], 150)}" for o in printed[:MAX_OUTPUT_SHOWN]]
        if len(printed) > MAX_OUTPUT_SHOWN:
            lines.append(f"  ... {len(printed) - MAX_OUTPUT_SHOWN} more in the JSON report")
    lines.append("")
    lines.append(_target_line(info.target))
    lines.append(
        f"{c['total']} scenarios: {c[PASS]} passed, {c[FAIL]} failed, {c[SKIP]} skipped "
        f"in {info.wall_seconds:.1f}s"
        + (f" (world start-up {sum(start):.1f}s, {len(start)} start{'s' if len(start) != 1 else ''}, "
           f"{info.ranks} ranks)" if start else "")
    )
    return "\n".join(lines)


def render_failure(v: Verdict) -> str:
    """A failed scenario's findings, the first line naming the scenario and its layout."""
    lines = [f"FAILED {v.scenario.name}  ({v.scenario.summary()})"]
    for f in v.failures[:MAX_FAILURES_SHOWN]:
        phase = f" in {f.phase}" if f.phase else ""
        lines.append(f"  {f.kind}{phase} [ranks {rank_list(f.ranks)}]: {f.message}")
        for call in f.details.get("last_matched", []):
            lines.append(f"      last matched before it: {call}")
    if len(v.failures) > MAX_FAILURES_SHOWN:
        lines.append(f"  ... {len(v.failures) - MAX_FAILURES_SHOWN} more in the JSON report")
    return "\n".join(lines)


def _target_line(target: dict[str, Any]) -> str:
    """``target: NAME VERSION (key: value; ...)``: whatever the target's describe() says."""
    line = f"target: {target.get('name', '?')} {target.get('version', '')}".rstrip()
    rest = [f"{k.replace('_', ' ')}: {_plain(v)}" for k, v in target.items()
            if k not in ("name", "version") and v not in (None, "", [], {}, ())]
    return line + (f" ({'; '.join(rest)})" if rest else "")


def _plain(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, dict):
        return ", ".join(f"{k.replace('_', ' ')} {_plain(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple, set)):
        return ", ".join(_plain(v) for v in value)
    return str(value)


class SilentReport:
    """A reporter that shows nothing: for callers that read the verdicts themselves."""

    def start(self, info: RunInfo, scenarios: list[Scenario]) -> None:
        pass

    def add(self, verdict: Verdict) -> None:
        pass

    def finish(self, info: RunInfo) -> None:
        pass


def show_progress(err: TextIO, line: str, live: bool) -> None:
    """A progress line: rewritten in place on a terminal, one line each otherwise."""
    if live:
        print("\r\033[K" + line[:terminal_width() - 1], end="", file=err, flush=True)
    else:
        print(line, file=err, flush=True)


def rank_list(ranks: list[int]) -> str:
    """Ranks as a report writes them: 0,1,3."""
    return ",".join(map(str, ranks))


def clip(text: str, n: int) -> str:
    """One line of at most n characters (whitespace folded) for a table or summary."""
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."


def terminal_width() -> int:
    """Columns of the terminal stderr is on (120 when it is not one), for live progress lines."""
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns
    except OSError:
        return 120


def _version() -> str:
    from shardcheck import __version__

    return __version__


class Reporters:
    """Fans every event out to several reporters."""

    def __init__(self, *reporters: Any) -> None:
        self.reporters = [r for r in reporters if r is not None]

    def start(self, info: RunInfo, scenarios: list[Scenario]) -> None:
        for r in self.reporters:
            r.start(info, scenarios)

    def add(self, verdict: Verdict) -> None:
        for r in self.reporters:
            r.add(verdict)

    def finish(self, info: RunInfo) -> None:
        for r in self.reporters:
            r.finish(info)
