"""What ``shardcheck invariance`` shows: a live progress line, the matrix (one row per axis, one
column per quantity), the contract and its violations; and the JSON report, rewritten after
every base scenario so a stopped run keeps what it found."""

from __future__ import annotations

import datetime
import json
import sys
import time
from typing import Any, TextIO

from shardcheck.harness.controller.commands.invariance import QUANTITIES, InvarianceResult
from shardcheck.harness.controller.reports.run_report import clip, show_progress
from shardcheck.harness.controller.reports.report_file import replace_with

MAX_VIOLATIONS_SHOWN = 12


class InvarianceProgress:
    """One line per variant run (a live line on a terminal)."""

    def __init__(self, err: TextIO | None = None, quiet: bool = False) -> None:
        self.err = err or sys.stderr
        self.quiet, self.live = quiet, self.err.isatty()
        self.runs, self.t0 = 0, time.perf_counter()

    def __call__(self, entry: dict[str, Any]) -> None:
        self.runs += 1
        if not self.quiet:
            show_progress(self.err, f"[{self.runs}] {time.perf_counter() - self.t0:6.1f}s {entry['verdict']:<4} "
                          f"{entry['scenario']['name']}", self.live)

    def close(self) -> None:
        if self.live and not self.quiet and self.runs:
            print(file=self.err)


def render(result: InvarianceResult) -> str:
    t = result.target
    lines = [f"invariance of target {t.get('name', '?')} {t.get('version', '')}".rstrip()
             + f" ({len(result.info.bases)} base scenarios, {len(result.runs)} runs, "
             f"{result.info.ranks} ranks{'' if result.info.lockstep else ', lockstep off (--no-lockstep)'})", ""]
    rows = [("axis", "expected", *QUANTITIES, "time")]
    for axis in result.axes:
        cells = result.matrix[axis]
        expect = result.contract.get(axis)
        rows.append((axis, str(expect) if expect else "-", *(cells[q].text() for q in QUANTITIES),
                     f"{result.axis_seconds.get(axis, 0.0):.1f}s"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for k, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    skipped = {axis: sorted({s for q in QUANTITIES for s in result.matrix[axis][q].skipped}) for axis in result.axes}
    notes = [f"  {axis}: {clip(s[0], 110)}" + (f" (+{len(s) - 1} more)" if len(s) > 1 else "")
             for axis, s in skipped.items() if s]
    if notes:
        lines += ["", "not compared:"] + notes
    failed_runs = [r for r in result.runs if r["verdict"] == "fail"]
    if failed_runs:
        lines += ["", f"{len(failed_runs)} variant run(s) failed their own check (see `shardcheck run`), e.g.:",
                  f"  {failed_runs[0]['scenario']['name']}: {clip(failed_runs[0].get('headline', ''), 110)}"]
    lines.append("")
    if result.violations:
        lines.append(f"{len(result.violations)} invariance violation(s):")
        for f in result.violations[:MAX_VIOLATIONS_SHOWN]:
            lines.append(f"  {f.message}")
        if len(result.violations) > MAX_VIOLATIONS_SHOWN:
            lines.append(f"  ... {len(result.violations) - MAX_VIOLATIONS_SHOWN} more in the JSON report")
    elif any(a in result.axes for a in result.contract):
        # an axis whose every pair was refused or skipped compared nothing: not kept, unchecked
        checked = {a for a in result.axes if any(result.matrix[a][q].compared for q in QUANTITIES)}
        kept = [f"{a}={e}" for a, e in result.contract.items() if a in checked]
        unchecked = [a for a in result.contract if a in result.axes and a not in checked]
        lines.append("contract kept: " + (", ".join(kept) or "nothing compared")
                     + (f"; not checked (no pair compared): {', '.join(unchecked)}" if unchecked else ""))
    elif result.contract:
        lines.append(f"no contract declared for the axes run ({', '.join(result.axes)}): differences are shown, "
                     "not judged (--expect AXIS=BOUND to give one)")
    else:
        lines.append("no contract declared or given (--expect): differences are shown, not judged")
    return "\n".join(lines)


class InvarianceJson:
    """The JSON report of an invariance run, rewritten atomically."""

    def __init__(self, path: str, meta: dict[str, Any]) -> None:
        self.path = path
        self.meta = {"shardcheck_command": "invariance",
                     "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                     **meta}
        self.write(None)  # fail early on an unwritable path

    def write(self, result: InvarianceResult | None) -> None:
        doc = dict(self.meta) | (result.to_dict() if result is not None else {"complete": False})
        replace_with(self.path, json.dumps(doc, indent=1, default=str).encode())
