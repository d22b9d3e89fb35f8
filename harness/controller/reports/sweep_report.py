"""A sweep's timeline as the terminal, JSON and HTML show it (the data:
:mod:`.sweep_timeline`)."""

from __future__ import annotations

import html
import json
import shlex
from dataclasses import asdict, dataclass
from typing import Any

from shardcheck.harness.controller.reports.sweep_timeline import (CANNOT_RUN, FAIL, PASS, SKIP, Commit, Interval,
                                                                  SweepResult, signatures_of)


@dataclass(frozen=True)
class SweepContext:
    """What the commands a cell links to need: the target, its options, the suite or scenario
    file, and the repository the commits come from."""

    target: str
    target_opts: tuple[str, ...]
    repo: str
    suite: str | None
    scenario_file: str | None

    def _select(self, scenario: str) -> list[str]:
        chosen = ["--scenario-file", self.scenario_file] if self.scenario_file else ["--suite", self.suite or "smoke"]
        return [*chosen, "--scenario", scenario]

    def _opts(self) -> list[str]:
        return [a for opt in self.target_opts for a in ("--target-opt", opt)]

    def export_line(self, sha: str) -> str:
        folder = f"/tmp/shardcheck-{sha[:10]}"
        return (f"mkdir -p {folder} && git -C {shlex.quote(self.repo)} archive {sha} | tar -x -C {folder} && "
                f"echo {sha} > {folder}/.shardcheck-commit")

    def replay(self, sha: str, scenario: str) -> str:
        folder = f"/tmp/shardcheck-{sha[:10]}"
        run = shlex.join(["shardcheck", "run", "--target", self.target, *self._opts(), "--target-src", folder,
                          *self._select(scenario)])
        return f"{self.export_line(sha)} && {run}"

    def repro(self, sha: str, scenario: str) -> str:
        folder = f"/tmp/shardcheck-{sha[:10]}"
        return shlex.join(["shardcheck", "repro", "--target", self.target, *self._opts(), "--target-src", folder,
                           *self._select(scenario)])


def _when(commit: Commit) -> str:
    return commit.date[:10]


def interval_line(iv: Interval) -> str:
    start = f"{iv.first_bad.short} ({_when(iv.first_bad)})" + (" or earlier" if iv.before_unknown else "")
    state = iv.state
    if state == "open":
        end = f"still failing at {iv.last_bad.short} ({_when(iv.last_bad)}), the newest"
    elif state == "unresolved":
        end = (f"last failing at {iv.last_bad.short} ({_when(iv.last_bad)}); the scenario could not run on the "
               f"{len(iv.after)} commit(s) after it")
    else:
        assert iv.first_good is not None
        verb = "fixed at" if state == "fixed" else "gives way to another failure at"
        end = f"{verb} {iv.first_good.short} ({_when(iv.first_good)}) \"{iv.first_good.subject[:70]}\""
    unknown = f"; {len(iv.unknown)} commit(s) inside could not say" if iv.unknown else ""
    carried = f"; releases: {', '.join(iv.releases)}" if iv.releases else ""
    return f"  {iv.signature.label()}: from {start}, {end}{unknown}{carried}"


def terminal(result: SweepResult, intervals: list[Interval]) -> str:
    lines = []
    cannot = [c for c in result.commits
              if result.cells.get(c.sha) and all(cell.state == CANNOT_RUN for cell in result.cells[c.sha].values())]
    groups = {state: [iv for iv in intervals if iv.state == state]
              for state in ("open", "unresolved", "fixed", "changed")}
    head = (f"{len(result.commits)} commits x {len(result.scenarios)} scenarios "
            f"({result.ran} cells run, {len(result.commits) * len(result.scenarios) - result.ran} from the cache): "
            f"{len(intervals)} failure intervals, {len(groups['fixed'])} fixed, {len(groups['changed'])} giving way "
            f"to another failure, {len(groups['open'])} open, {len(groups['unresolved'])} unresolved")
    lines.append(head if not result.interrupted else f"interrupted after {len(result.cells)} commits: " + head)
    titles = {"open": "open (failing at the newest commit):", "unresolved": "unresolved (the scenario stopped running):",
              "fixed": "fixed:", "changed": "giving way to another failure:"}
    for state, group in groups.items():
        if group:
            lines.append(titles[state])
            lines.extend(interval_line(iv) for iv in group)
    if cannot:
        shown = ", ".join(f"{c.short}" for c in cannot[:8]) + (", ..." if len(cannot) > 8 else "")
        first = next(iter(result.cells[cannot[0].sha].values())).why
        lines.append(f"{len(cannot)} commit(s) could not run at all (never counted as passes): {shown}")
        lines.append(f"  e.g. {cannot[0].short}: {first[:200]}")
    return "\n".join(lines)


def document(result: SweepResult, intervals: list[Interval], context: SweepContext) -> dict[str, Any]:
    """The JSON: every commit, every cell, every interval (with the releases carrying it)."""
    return {
        "kind": "shardcheck sweep",
        "target": context.target, "target_opts": list(context.target_opts), "repo": context.repo,
        "suite": context.suite, "scenario_file": context.scenario_file,
        "interrupted": result.interrupted, "cells_run": result.ran,
        "scenarios": result.scenarios,
        "commits": [asdict(c) | {"cells": {n: cell.to_dict() for n, cell in result.cells.get(c.sha, {}).items()}}
                    for c in result.commits],
        "intervals": [iv.to_dict() for iv in intervals],
    }


_CSS = """body{font:13px sans-serif;margin:1em}table{border-collapse:collapse}td,th{border:1px solid #ddd;
padding:2px 4px}th.c{writing-mode:vertical-rl;font-weight:normal;font-family:monospace}td.pass{background:#c8e6c9}
td.fail{background:#ef9a9a}td.skip{background:#eee}td.cannot{background:#ffe082}td a{display:block;min-width:10px;
text-decoration:none;color:inherit}code{font-size:12px}.sig{max-width:40em}"""


def page(result: SweepResult, intervals: list[Interval], context: SweepContext) -> str:
    """Commits along the top, failure signatures (then the scenarios that never failed) down the
    side; each cell says pass / fail / skip / cannot run and links to its replay and repro lines."""
    e = html.escape
    sigs = sorted({iv.signature for iv in intervals}, key=lambda s: (s.scenario, s.kind, s.message))
    failing = {s.scenario for s in sigs}
    rows: list[tuple[str, Any]] = [(s.label(), s) for s in sigs]
    rows += [(f"{name}: never failed", name) for name in result.scenarios if name not in failing]
    out = ["<!doctype html><meta charset=utf-8><title>shardcheck sweep</title>", f"<style>{_CSS}</style>",
           f"<h1>shardcheck sweep: {e(context.target)}</h1>",
           f"<p>{e(context.repo)}: {len(result.commits)} commits, {len(result.scenarios)} scenarios, "
           f"{len(intervals)} failure intervals</p>", "<table><tr><th></th>"]
    for c in result.commits:
        tag = f" [{', '.join(c.tags)}]" if c.tags else ""
        out.append(f"<th class=c title=\"{e(c.sha)} {e(c.date)} {e(c.subject)}\">{e(c.short)} {e(_when(c))}{e(tag)}</th>")
    out.append("</tr>")
    details = []
    for label, row in rows:
        out.append(f"<tr><td class=sig>{e(label)}</td>")
        name = row.scenario if not isinstance(row, str) else row
        for c in result.commits:
            cell = result.cells.get(c.sha, {}).get(name)
            if cell is None:
                out.append("<td></td>")
                continue
            if cell.state == FAIL:
                state = "fail" if isinstance(row, str) or row in signatures_of(cell, name) else "pass"
            else:
                state = {PASS: "pass", SKIP: "skip", CANNOT_RUN: "cannot"}[cell.state]
            # a passing cell links to its commit's lines (the scenario named in them); the others
            # to their own, with what was found (a page of every cell's lines would be megabytes)
            anchor = f"{c.sha[:10]}-{name}" if cell.state != PASS else f"c-{c.sha[:10]}"
            title = cell.why or state
            out.append(f"<td class={state} title=\"{e(c.short)} {e(name)}: {e(title)}\"><a href=\"#{e(anchor)}\">"
                       f"&nbsp;</a></td>")
            details.append((anchor, c, name, cell))
        out.append("</tr>")
    out.append("</table><h2>Intervals</h2><ul>")
    for iv in intervals:
        out.append(f"<li>{e(interval_line(iv).strip())}</li>")
    out.append("</ul><h2>Cells</h2>")
    seen = set()
    for anchor, c, name, cell in details:
        if anchor in seen:
            continue
        seen.add(anchor)
        if cell.state == PASS:
            out.append(f"<div id=\"{e(anchor)}\"><h3>{e(c.short)} {e(_when(c))} {e(c.subject)}</h3>"
                       f"<p>replay a scenario: <code>{e(context.replay(c.sha, 'SCENARIO'))}</code></p>"
                       f"<p>as a script: <code>{e(context.export_line(c.sha))} && "
                       f"{e(context.repro(c.sha, 'SCENARIO'))}</code></p></div>")
            continue
        what = cell.state + (f": {cell.why}" if cell.why else "")
        fails = "".join(f"<li>{e(k)}{' in ' + e(p) if p else ''}: {e(m)}</li>" for k, p, m in cell.failures)
        out.append(f"<div id=\"{e(anchor)}\"><h3>{e(c.short)} {e(_when(c))} {e(name)}</h3><p>{e(what)}</p>"
                   f"<ul>{fails}</ul><p>replay: <code>{e(context.replay(c.sha, name))}</code></p>"
                   f"<p>as a script: <code>{e(context.export_line(c.sha))} && {e(context.repro(c.sha, name))}</code>"
                   f"</p></div>")
    return "\n".join(out) + "\n"


def dumps(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=1) + "\n"
