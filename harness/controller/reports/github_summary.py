"""A saved run report for GitHub: the job summary (Markdown) and annotations (workflow commands).

The summary: a heading with the target and the counts, every scenario's verdict in a table, and
for each failed scenario its findings as the terminal shows them, the command that runs it again
(its scenario JSON beside it) and the `shardcheck repro` line: the same lines the terminal and
the HTML page give (run_report's :func:`replay_command`, :func:`repro_line`), not a formatting of
their own. The annotations: an ``::error`` at each source line a failure names (a message, or a
finding's ``site``) in a file of the checkout, so that the pull request shows the finding on the
line that made it.
"""

from __future__ import annotations

import html
import os
import re
from pathlib import Path
from typing import Any

from shardcheck.harness.controller.reports.report_file import SavedReport
from shardcheck.harness.controller.reports.run_report import (SCENARIO_FILE, clip, one_line, render_failure,
                                                              replay_command, repro_line, scenario_count)
from shardcheck.harness.controller.reports.verdict import ERROR, FAIL, PASS, SKIP, TIMED_OUT, Verdict

# A summary is at most 1 MiB on GitHub: a suite of thousands of scenarios lists its failures and
# timeouts in full, the rest up to a bound, and details the first failures only.
MAX_ROWS = 200
MAX_FAILURES_DETAILED = 20
# GitHub shows at most 10 error annotations a step and 50 a job
MAX_ANNOTATIONS = 50
FINDING_CHARS = 160  # of the first finding in the table
ANNOTATION_CHARS = 1000

# a source location in a message or a site: `/abs/path/file.py:123` or `pkg/file.py:123`
_SOURCE = re.compile(r"((?:[\w.-]*/)*[\w.-]+\.py):(\d+)")


def summary_markdown(doc: dict[str, Any]) -> str:
    """The job summary of a run's JSON report ``doc`` (as ``shardcheck run --json-report`` writes
    it); BadInput (one line) when it is not one."""
    report = SavedReport.from_dict(doc)
    info, verdicts = report.info, report.verdicts
    target = info.target or {}
    name = f"{target.get('name', info.target_spec or '?')} {target.get('version', '')}".rstrip()
    counts = report.summary or _counts(verdicts)
    lines = [f"## shardcheck: `{_code(name)}` {_outcome(verdicts)}", ""]
    line = (f"{scenario_count(counts.get('total', len(verdicts)), report.planned)}: {counts.get(PASS, 0):,} passed, "
            f"{counts.get(FAIL, 0):,} failed, {counts.get(SKIP, 0):,} skipped")
    if counts.get(TIMED_OUT):
        line += f", {counts[TIMED_OUT]:,} timed out (the machine was too slow: no finding either way)"
    if counts.get(ERROR):
        line += f", {counts[ERROR]:,} shardcheck's own error{'s' if counts[ERROR] != 1 else ''} (no finding either way)"
    if "ranks" not in report.absent:
        line += f"; world: {info.ranks} ranks ({_cell(info.backend or '?')})"
    lines.append(line + ("" if report.complete else " **(incomplete: the run did not finish)**"))
    lines += ["", *_table(verdicts)]
    failed = [v for v in verdicts if v.status in (FAIL, ERROR)]  # the terminal details both
    for v in failed[:MAX_FAILURES_DETAILED]:
        lines += ["", *_failed_scenario(v, report)]
    if len(failed) > MAX_FAILURES_DETAILED:
        lines += ["", f"... {len(failed) - MAX_FAILURES_DETAILED} more failed scenarios: their findings are in the "
                      "JSON and HTML reports"]
    return "\n".join(lines) + "\n"


def _outcome(verdicts: list[Verdict]) -> str:
    """The run in a word or two, as its exit status says it (1, 2, 3, 5, 0)."""
    statuses = {v.status for v in verdicts}
    if FAIL in statuses:
        return "failed"
    if ERROR in statuses:
        return "stopped by shardcheck's own error"
    if TIMED_OUT in statuses:
        return "timed out"
    return "passed" if statuses - {SKIP} else "checked nothing"


def _counts(verdicts: list[Verdict]) -> dict[str, int]:
    """Status -> count, for a report that wrote no summary."""
    out: dict[str, int] = {"total": len(verdicts)}
    for v in verdicts:
        out[v.status] = out.get(v.status, 0) + 1
    return out


def _table(verdicts: list[Verdict]) -> list[str]:
    """The verdict table: an sp column only where some scenario is sequence parallel, as the
    terminal's; past MAX_ROWS, the scenarios that passed or were skipped are counted, not listed."""
    with_sp = any(v.scenario.sp > 1 for v in verdicts)
    heads = ["scenario", "layout", "tp", "cp", *(["sp"] if with_sp else []), "verdict", "first finding"]
    out = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    shown = verdicts if len(verdicts) <= MAX_ROWS else [v for v in verdicts if v.status not in (PASS, SKIP)]
    for v in shown:
        sc = v.scenario
        verdict = f"**{v.status.upper()}**" if v.status in (FAIL, ERROR) else v.status
        cells = [_cell(sc.name), sc.layout, str(sc.tp), str(sc.cp), *([str(sc.sp)] if with_sp else []), verdict,
                 _cell(clip(v.headline(), FINDING_CHARS))]
        out.append("| " + " | ".join(cells) + " |")
    if len(shown) < len(verdicts):
        out += ["", f"{len(verdicts) - len(shown):,} scenarios that passed or were skipped are not listed (the JSON "
                    "and HTML reports list every one)"]
    return out


def _failed_scenario(v: Verdict, report: SavedReport) -> list[str]:
    """A failed scenario's findings as the terminal gives them, then how to run it again (not
    for shardcheck's own error: nothing of the target's to replay)."""
    out = [f"### {'FAILED' if v.status == FAIL else 'ERROR'} {_cell(v.scenario.name)}", "", *_fenced(render_failure(v))]
    if v.status == FAIL and report.info.target_spec:
        out += ["", f"To run it again, save the scenario as `{SCENARIO_FILE}`, then:", "",
                *_fenced(replay_command(report.info.target_spec), "sh"),
                "", f"<details><summary>{SCENARIO_FILE}</summary>", "", *_fenced(v.scenario.to_json(), "json"),
                "", "</details>"]
    repro = repro_line(report.info, v)
    if repro:
        out += ["", "As a script needing only torch and the code under test:", "", *_fenced(repro, "sh")]
    return out


def _fenced(text: str, language: str = "") -> list[str]:
    """``text`` as a fenced code block whose fence no run of backticks in it closes."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return [fence + language, text, fence]


def _cell(text: Any) -> str:
    """``text`` as one Markdown table cell: one line, HTML escaped, its pipes escaped."""
    return html.escape(one_line(text)).replace("|", "\\|")


def _code(text: str) -> str:
    """``text`` inside an inline code span (one line, no backtick to end it early)."""
    return one_line(text).replace("`", "'")


def annotations(doc: dict[str, Any], root: Path) -> list[str]:
    """GitHub workflow commands (``::error file=...,line=...,title=...::message``) for each
    source line a failure of ``doc`` names (in its message or its ``site``), once per (file, line,
    kind), at most MAX_ANNOTATIONS. Only files under ``root`` (the checkout) are kept, named
    relative to it: a location is read as the report wrote it, absolute, or relative to the
    folder it ran in (this one) or to the checkout."""
    report = SavedReport.from_dict(doc)
    root = root.resolve()
    seen: set[tuple[str, int, str]] = set()
    out: list[str] = []
    for v in report.verdicts:
        if v.status != FAIL:
            continue
        for f in v.failures:
            for path, line in _locations(f.message, f.details.get("site")):
                rel = _under(root, path)
                key = (rel or "", line, f.kind)
                if rel is None or key in seen:
                    continue
                seen.add(key)
                phase = f" in {f.phase}" if f.phase else ""
                message = clip(f"{v.scenario.name}: {f.kind}{phase}: {f.message}", ANNOTATION_CHARS)
                out.append(f"::error file={_property(rel)},line={line},title={_property('shardcheck ' + f.kind)}"
                           f"::{_data(message)}")
                if len(out) == MAX_ANNOTATIONS:
                    return out
    return out


def _locations(message: str, site: Any) -> list[tuple[str, int]]:
    """The (path, line) pairs named in a failure's message and its site (a string or a list)."""
    texts = [message, *([site] if isinstance(site, str) else site if isinstance(site, list) else [])]
    return [(m.group(1), int(m.group(2))) for text in texts if isinstance(text, str) for m in _SOURCE.finditer(text)]


def _under(root: Path, path: str) -> str | None:
    """``path``, a file under ``root``, relative to it; None for one outside it or not there."""
    given = Path(path)
    for candidate in [given] if given.is_absolute() else [Path.cwd() / given, root / given]:
        try:
            rel = candidate.resolve().relative_to(root)
        except (ValueError, OSError):
            continue
        if (root / rel).is_file():
            return rel.as_posix()
    return None


def _data(text: str) -> str:
    """A workflow command's message, escaped as GitHub reads it back."""
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _property(text: str) -> str:
    """A workflow command's property value: its message escaping, and ``:`` and ``,`` too."""
    return _data(text).replace(":", "%3A").replace(",", "%2C")


def default_root(doc: dict[str, Any], cwd: str | None = None) -> Path:
    """Where annotations are looked for when not told: the report's target checkout (its
    ``target_config.src``) when it is inside the working folder, else the working folder."""
    here = Path(cwd or os.getcwd()).resolve()
    config = doc.get("target_config") if isinstance(doc, dict) else None
    src = config.get("src") if isinstance(config, dict) else None
    if isinstance(src, str) and src:
        checkout = (here / src).resolve()
        if checkout.is_dir() and (checkout == here or here in checkout.parents):
            return checkout
    return here
