"""Two renderings of the same verdicts: a terminal (live progress line, summary table) and a
JSON report updated after every verdict and valid at every moment, so a run that is killed keeps
what it found.
"""

from __future__ import annotations

import bisect
import datetime
import json
import os
import re
import sys
import time
from typing import Any, TextIO

from shardcheck.harness.controller.reports import reach_report
from shardcheck.harness.controller.reports.report_file import GuardedWrites, remove_quietly, sweep_beside, temp_beside
from shardcheck.harness.controller.reports.verdict import ERROR, FAIL, PASS, SKIP, TIMED_OUT, RunInfo, Verdict
from shardcheck.scenarios.scenario import Scenario

MAX_FAILURES_SHOWN = 8
MAX_OUTPUT_SHOWN = 12  # distinct lines the ranks printed, shown under the table


# Control characters and the invisible ones that reorder or hide text (bidirectional overrides
# and isolates, zero-width marks): a scenario named "x\u202egnp.exe" must not read "xexe.png".
_HIDDEN = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2066-\u2069\ufeff]")


def visible(text: Any) -> str:
    """``text`` as a person is shown it: each hidden or reordering character as a ``\\uXXXX``
    escape (tab and newline kept), so what is read is what is there."""
    return _HIDDEN.sub(lambda m: f"\\u{ord(m.group()):04x}", str(text))


def one_line(text: Any) -> str:
    """``text`` as :func:`visible` shows it, its newlines and tabs escaped too (``\\n``, ``\\t``): a
    name in a table row or a progress line, which a newline would split."""
    return visible(text).replace("\r", "\\r").replace("\n", "\\n").replace("\t", "\\t")


def _counts(verdicts: list[Verdict]) -> dict[str, int]:
    counts = {k: 0 for k in (PASS, FAIL, SKIP)}
    for v in verdicts:
        counts[v.status] = counts.get(v.status, 0) + 1  # timed out: only where some did
    return counts | {"total": len(verdicts)}


class JsonReport:
    """The JSON report, a valid document on disk at every moment (a run that is killed keeps
    what it found), its scenarios in suite order all along, not in the order they ran (grouped
    by tp, cp).

    The file is the document with ``scenarios`` first and every other key (the summary,
    ``complete``, the run info) in a small tail after the list. Each verdict is serialized once;
    a new one is written, in one write, from its place in suite order to the end of the file:
    for a verdict that belongs last, only itself and the tail, so such an update costs no more
    as the report grows. Entries and tail only grow; were an update ever shorter than what it
    overwrites, the bytes left over are blanked (whitespace after the document is still JSON).

    A write in place is atomic only while it is short: a process killed in the middle of a long
    one would leave part of it. An update that would move more than ``_IN_PLACE_MAX`` bytes of
    entries (a verdict placed before many others), start() and finish() replace the whole file
    instead, atomically (see :meth:`_replace`).
    """

    _HEAD = b'{\n "scenarios": ['
    _SEP = b",\n  "  # before every entry; the first one in the file is written without the comma
    _IN_PLACE_MAX = 64 * 1024  # bytes of entries after its place an update may move in place

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
        self.doc["summary"] = {PASS: 0, FAIL: 0, SKIP: 0, "total": 0}  # _counts(self.verdicts), kept up
        # the entries in the file, in suite order: each one's place in the suite and its bytes
        self._places: list[int] = []
        self._pieces: list[bytes] = []
        self._end = len(self._HEAD)  # where the last entry ends
        self._size = 0  # of the file
        self._fd: int | None = None  # the report
        self._spare: int | None = None  # its previous version, beside it (see _replace)
        # beside the report, unique to this run: two runs on one path never meet
        sweep_beside(path)  # a killed run's
        self._spare_name, self._old_name = temp_beside(path, "tmp"), temp_beside(path, "old")
        self.guard = GuardedWrites("the JSON report", path)  # a write that failed: later ones are not tried
        try:
            self._rewrite()  # fail early (unwritable path) and leave a file even if nothing finishes
        except BaseException:
            self._close()
            raise

    def start(self, info: RunInfo, scenarios: list[Scenario]) -> None:
        self.doc.update(info.to_dict())
        self.doc["planned"] = len(scenarios)
        self.order = suite_order(scenarios)
        self._rank()
        self._guarded(self._rewrite)

    def _guarded(self, write: Any, *args: Any) -> None:
        """A write into the file (GuardedWrites); after one fails the file is closed, the
        document stays whole in memory."""
        if not self.guard(write, *args):
            self._close()

    @property
    def failed(self) -> str | None:
        return self.guard.failed

    def add(self, verdict: Verdict) -> None:
        self.verdicts.append(verdict)
        summary = self.doc["summary"]
        summary[verdict.status] = summary.get(verdict.status, 0) + 1
        summary["total"] += 1
        self._guarded(self._place, verdict)

    def _place(self, verdict: Verdict) -> None:
        place = self.order_of(verdict)
        at = bisect.bisect_right(self._places, place)  # after those of its place that came before it
        self._places.insert(at, place)
        self._pieces.insert(at, self._SEP + _entry(verdict))
        after = self._pieces[at + 1:]
        moved = sum(map(len, after))
        if moved > self._IN_PLACE_MAX:
            self._rewrite()
            return
        # where its place begins in the file: at the end, or where the entry it goes before began
        start = len(self._HEAD) if at == 0 else self._end - moved
        entries = b"".join([self._pieces[at][1:] if at == 0 else self._pieces[at], *after])
        self._end = start + len(entries)
        data = entries + self._tail()
        if start + len(data) < self._size:  # shorter than before: blank the rest
            data += b" " * (self._size - start - len(data))
        if self._fd is None:  # an update after finish(): into the report as it is now
            self._fd = os.open(self.path, os.O_WRONLY)
        # one short write: a process killed between two updates leaves a valid file
        _write_all(self._fd, [data], start)
        self._size = max(self._size, start + len(data))

    def finish(self, info: RunInfo) -> None:
        self.doc.update(info.to_dict())
        self.doc["complete"] = len(self.verdicts) == self.doc.get("planned", len(self.verdicts))
        self._rank(reserialize=True)  # every verdict as it is now, not as it came (once a run)
        self._guarded(self._rewrite)
        self._close()

    def order_of(self, v: Verdict) -> int:
        return self.order.get(id(v.scenario), len(self.order))

    def _tail(self) -> bytes:
        """The list's end and every key but the scenarios: what every update rewrites."""
        parts = [b"\n ]" if self._pieces else b"]"]
        for key, value in self.doc.items():
            parts += [f",\n {json.dumps(key)}: ".encode(), _json(value, 1)]
        parts.append(b"\n}")
        return b"".join(parts)

    def _rank(self, reserialize: bool = False) -> None:
        """The entries in suite order, serialized anew when that order changed (start() after
        add()) or when asked."""
        ranked = sorted(self.verdicts, key=self.order_of)  # stable: in the order they came, per place
        places = [self.order_of(v) for v in ranked]
        if reserialize or places != self._places:
            self._pieces = [self._SEP + _entry(v) for v in ranked]
        self._places = places

    def _rewrite(self) -> None:
        """The whole file from the entries, atomically."""
        parts = [self._HEAD, *self._pieces, self._tail()]
        if self._pieces:
            parts[1] = parts[1][1:]  # the first entry without its comma
        size = sum(map(len, parts))
        self._replace(parts, size)
        self._end = size - len(parts[-1])
        self._size = size

    def _replace(self, parts: list[bytes], size: int) -> None:
        """``parts`` (``size`` bytes) as the whole report, atomically: written into a spare file
        beside it (``PATH.tmp``, removed by finish()), which then takes the report's name. The
        report's previous version is kept as the next spare, through a second link made before
        the rename, so that the next replacement overwrites its pages instead of freeing them and
        allocating new ones (at a few MB, most of the cost); without hard links it is let go."""
        spare, old_name = self._spare_name, self._old_name
        if self._spare is None:
            self._spare = os.open(spare, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        _write_all(self._spare, parts, 0)
        os.ftruncate(self._spare, size)
        previous, kept = self._fd, False
        if previous is not None:
            try:
                if os.path.lexists(old_name):  # left by a process killed here
                    os.unlink(old_name)
                os.link(self.path, old_name)
                kept = True
            except OSError:
                pass
        os.replace(spare, self.path)
        if kept:
            os.replace(old_name, spare)
        self._fd, self._spare = self._spare, previous if kept else None
        if previous is not None and not kept:
            os.close(previous)

    def _close(self) -> None:
        """Close the file and remove the spare and any half-made link beside it."""
        for fd in (self._fd, self._spare):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._fd = self._spare = None
        remove_quietly(self._spare_name)
        remove_quietly(self._old_name)

    def __del__(self) -> None:
        if hasattr(self, "_old_name"):
            self._close()


def _json(value: Any, depth: int) -> bytes:
    """``value`` as ``json.dump(..., indent=1)`` writes it ``depth`` levels down a document."""
    return json.dumps(value, indent=1, default=str).replace("\n", "\n" + " " * depth).encode()


def _entry(verdict: Verdict) -> bytes:
    """A verdict's entry in the report's scenario list."""
    return _json(verdict.to_dict(), 2)


def entry(verdict: Verdict) -> dict[str, Any]:
    """A verdict's entry as the JSON report holds it (plain data, read back from its bytes)."""
    return json.loads(_entry(verdict))


def _write_all(fd: int, parts: list[bytes], offset: int) -> None:
    """``parts``, one after the other, at ``offset``: gathered, not joined, into as few writes
    as the system takes (one for a part alone; a regular file takes a write whole, but should
    the count come back short, as when the disk fills up, the rest follows)."""
    if not hasattr(os, "pwritev"):
        parts = [b"".join(parts)]
    for i in range(0, len(parts), _IOV_MAX):
        chunk = parts[i:i + _IOV_MAX]
        total = sum(map(len, chunk))
        done = os.pwritev(fd, chunk, offset) if len(chunk) > 1 else os.pwrite(fd, chunk[0], offset)
        if done < total:
            rest = memoryview(b"".join(chunk))
            while done < total:
                done += os.pwrite(fd, rest[done:], offset + done)
        offset += total


try:
    _IOV_MAX = max(1, min(os.sysconf("SC_IOV_MAX"), 1024))  # buffers one pwritev takes
except (AttributeError, ValueError, OSError):
    _IOV_MAX = 16


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
        self.counts = {PASS: 0, FAIL: 0, SKIP: 0}
        self.order = suite_order(scenarios)
        total = self.total
        t = info.target
        if not self.quiet:
            print(f"shardcheck: target {t.get('name', '?')} {t.get('version', '')}".rstrip()
                  + f", {total:,} scenarios, {info.ranks} ranks ({info.backend})", file=self.err)
            if t.get("contract_notice"):
                print(f"shardcheck: notice: {t['contract_notice']}", file=self.err)

    def add(self, verdict: Verdict) -> None:
        self.verdicts.append(verdict)
        if self.quiet:
            return
        c = self.counts  # kept up, not counted again: a run of half a million scenarios
        c[verdict.status] = c.get(verdict.status, 0) + 1
        timed = (f" {c[TIMED_OUT]} timed out" if c.get(TIMED_OUT) else "") + (
            f" {c[ERROR]} error{'s' if c[ERROR] != 1 else ''}" if c.get(ERROR) else "")
        line = (f"[{len(self.verdicts):>{len(str(self.total))}}/{self.total}] {time.perf_counter() - self.t0:6.1f}s "
                f"{c[PASS]} passed {c[FAIL]} failed {c[SKIP]} skipped{timed}  {verdict.status:<4} "
                f"{one_line(verdict.scenario.name)}")
        show_progress(self.err, line, self.live)

    def world_starting(self, what: str, seconds: float) -> None:
        """While the world (re)starts: a live line with the time so far, or one line a start."""
        if self.quiet:
            return
        if self.live:
            show_progress(self.err, f"{what} ... {seconds:.0f}s", True)
        elif seconds == 0.0:  # the start itself, once
            print(f"shardcheck: {what} ...", file=self.err, flush=True)

    def finish(self, info: RunInfo) -> None:
        if self.live and not self.quiet:
            print(file=self.err)
        in_suite_order = sorted(self.verdicts, key=lambda v: self.order.get(id(v.scenario), 0))
        try:
            print(render_table(in_suite_order, info, self.total), file=self.out, flush=True)
        except BrokenPipeError:  # piped into head: the verdicts (and exit status) still stand
            os.dup2(os.open(os.devnull, os.O_WRONLY), self.out.fileno())


def suite_order(scenarios: list[Scenario]) -> dict[int, int]:
    """Each scenario object's place in the suite (objects, not names: two may share a name)."""
    return {id(sc): i for i, sc in enumerate(scenarios)}


def render_table(verdicts: list[Verdict], info: RunInfo, planned: int | None = None) -> str:
    """The table, each failure, and the summary (``planned``: how many were asked for, when the
    run may have stopped before giving each a verdict)."""
    # an sp column only where some scenario is sequence parallel (the DTensor family's layouts)
    with_sp = any(v.scenario.sp > 1 for v in verdicts)
    rows = [("scenario", "layout", "tp", "cp", *(("sp",) if with_sp else ()), "verdict", "time", "detail")]
    for v in verdicts:
        sc = v.scenario
        rows.append((one_line(sc.name), sc.layout, str(sc.tp), str(sc.cp), *((str(sc.sp),) if with_sp else ()),
                     v.status.upper() if v.status in (FAIL, ERROR) else v.status,
                     f"{v.seconds:.2f}s" if v.status != SKIP else "-", clip(v.headline(), 90)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths) + "  " + "-" * 6)
    for v in verdicts:
        if v.status in (FAIL, ERROR):
            lines.append("")
            lines.append(render_failure(v))
            repro = repro_line(info, v)
            if repro:
                lines.append("  as a script needing only torch: " + repro)
    c = _counts(verdicts)
    start = info.startup_seconds
    if info.world_events:
        lines += ["", "the world, between scenarios:"] + [f"  {e}" for e in info.world_events]
    printed = info.rank_output
    if printed:
        lines += ["", f"the ranks printed (each distinct line once, {len(printed)} in all):"]
        lines += [f"  [ranks {rank_list(o['ranks'])}] {clip(o['line'], 150)}" for o in printed[:MAX_OUTPUT_SHOWN]]
        if len(printed) > MAX_OUTPUT_SHOWN:
            lines.append(f"  ... {len(printed) - MAX_OUTPUT_SHOWN} more in the JSON report")
    lines.append("")
    lines.append(_target_line(info.target))
    if info.target.get("contract_notice"):
        lines.append(f"notice: {info.target['contract_notice']}")
    defined = definitions_line(info.target)
    if defined:
        lines.append(defined)
    laid = layout_line(verdicts)
    if laid:
        lines.append(laid)
    lines += reach_report.render(info.coverage)
    if not info.inplace:
        lines.append("not checked: whether the target leaves its inputs unchanged (--no-inplace)")
    if not info.mask_leak:
        lines.append("not checked: whether NaN at a training step's masked positions reaches anything (--no-mask-leak)")
    lines.append(
        f"{scenario_count(c['total'], planned)}: {c[PASS]:,} passed, {c[FAIL]:,} failed, {c[SKIP]:,} skipped"
        + (f", {c[TIMED_OUT]:,} timed out (the machine was too slow: no finding either way)" if c.get(TIMED_OUT) else "")
        + (f", {c[ERROR]:,} error{'s' if c.get(ERROR) != 1 else ''} (shardcheck's own: no finding either way)"
           if c.get(ERROR) else "")
        + " "
        f"in {info.wall_seconds:.1f}s"
        + (f" (world start-up {sum(start):.1f}s, {len(start)} start{'s' if len(start) != 1 else ''}, "
           f"{info.ranks} ranks)" if start else "")
    )
    return "\n".join(lines)


# the file a failed scenario is saved as to be run again (the HTML page and the GitHub summary
# show its JSON beside the command)
SCENARIO_FILE = "scenario.json"


def replay_command(target_spec: str) -> str:
    """The command that runs a failed scenario again, once saved as :data:`SCENARIO_FILE`."""
    return f"shardcheck run --target {target_spec} --scenario-file {SCENARIO_FILE}"


def repro_line(info: RunInfo, verdict: Verdict) -> str | None:
    """The `shardcheck repro` command that writes ``verdict``'s failure as a script needing only
    torch; None where the scenario did not fail, or the target or the failure cannot be written so."""
    if verdict.status != FAIL or not info.repro or _repro_refusal(verdict.scenario, verdict.kinds) is not None:
        return None
    return info.repro.format(scenario=shell_word(verdict.scenario.name))


def _repro_refusal(scenario: Scenario, kinds: list[str]) -> str | None:
    from shardcheck.harness.controller.commands.repro import kinds_refusal, scenario_refusal  # torch: only once shown

    return scenario_refusal(scenario) or kinds_refusal(kinds)


def scenario_count(done: int, planned: int | None) -> str:
    """'64 scenarios', or '12,781 of 509,018 scenarios' for a run that stopped before the end."""
    return f"{done:,} of {planned:,} scenarios" if planned and planned > done else f"{done:,} scenarios"


def definitions_line(target: dict[str, Any]) -> str | None:
    """Which definitions were checked where the target declares its own (the reference followed)."""
    defs = target.get("definitions") or {}
    return ("definitions checked (the target's, the reference followed): "
            + "; ".join(f"{k}: {v}" for k, v in defs.items())) if defs else None


def layout_line(verdicts: list[Verdict]) -> str | None:
    """Who laid out the rows of the scenarios that ran, and why not the framework where it has a
    data path that did not; None when the harness laid out every one and nothing else was meant."""
    by: dict[str, int] = {}
    why: dict[str, int] = {}
    for v in verdicts:
        if v.built_by is not None:
            by[v.built_by] = by.get(v.built_by, 0) + 1
        if v.layout_note and v.status != SKIP:
            why[v.layout_note] = why.get(v.layout_note, 0) + 1
    if not by or (set(by) == {"shardcheck"} and not why):
        return None
    text = "rows laid out by: " + "; ".join(f"{name} ({n} scenario{'s' if n != 1 else ''})" for name, n in by.items())
    if why:
        text += " - not by the framework: " + "; ".join(f"{w} ({n})" for w, n in why.items())
    return text


def render_failure(v: Verdict) -> str:
    """A failed scenario's findings, the first line naming the scenario and its layout."""
    head = "ERROR (shardcheck's own, not the target's)" if v.status == ERROR else "FAILED"
    lines = [f"{head} {one_line(v.scenario.name)}  ({one_line(v.scenario.summary())})"]
    for f in v.failures[:MAX_FAILURES_SHOWN]:
        phase = f" in {f.phase}" if f.phase else ""
        lines.append(f"  {f.kind}{phase} [ranks {rank_list(f.ranks)}]: {f.message}")
        for call in f.details.get("last_matched", []):
            lines.append(f"      last matched before it: {call}")
        if f.details.get("placement"):
            lines.append("      where: " + "; ".join(f"rank {r} {w}" for r, w in f.details["placement"].items()))
    if len(v.failures) > MAX_FAILURES_SHOWN:
        lines.append(f"  ... {len(v.failures) - MAX_FAILURES_SHOWN} more in the JSON report")
    return "\n".join(lines)


def _target_line(target: dict[str, Any]) -> str:
    """``target: NAME VERSION (key: value; ...)``: whatever the target's describe() says."""
    line = f"target: {target.get('name', '?')} {target.get('version', '')}".rstrip()
    rest = [f"{k.replace('_', ' ')}: {_plain(v)}" for k, v in target.items()
            if k not in ("name", "version", "definitions", "contract_notice") and v not in (None, "", [], {}, ())]
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


def shell_word(text: str) -> str:
    """``text`` as one word of a command line a user can paste."""
    import shlex

    return shlex.quote(text)


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

    def world_starting(self, what: str, seconds: float) -> None:
        for r in self.reporters:
            if hasattr(r, "world_starting"):
                r.world_starting(what, seconds)

    def finish(self, info: RunInfo) -> None:
        for r in self.reporters:
            r.finish(info)
