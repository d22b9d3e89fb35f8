"""The HTML report: one self-contained page (styles inline, no script needed to read it) built
from the JSON report's document, so ``--html-report`` and ``shardcheck report r.json --html``
give the same page from the same data.

The page: the target and the world; every scenario's verdict in a table; for each failing
scenario, its findings, the *lanes* of each collective mismatch (every rank of the divergent
group side by side, call by call, the divergent call marked on each lane, a rank that issued no
such call shown ending there), the *layout map* (per rank of the layout, the rows it holds:
samples in turn, prompt, response and padding rows told apart in text as well as in colour,
ranks with no response token said so), the *error map* (per sample, which response tokens have
a wrong value or gradient) and the scenario as JSON, to replay.
"""

from __future__ import annotations

import html
import shlex
from typing import Any

from shardcheck.harness.controller.reports.run_report import (SCENARIO_FILE, replay_command, scenario_count,
                                                              visible)
from shardcheck.harness.controller.reports.report_file import GuardedWrites, SavedReport, check_report_path, replace_with
from shardcheck.harness.controller.reports.verdict import FAIL, Verdict
from shardcheck.harness.wire import Failure
from shardcheck.scenarios.scenario import Scenario

_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#111}
table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px;text-align:left;vertical-align:top}
tr.fail td{background:#fde8e8}tr.skip td{color:#666}
.lanes td{font:12px monospace;max-width:28em}.lanes tr.divergent td{background:#ffd27a;font-weight:bold}
.lanes td.ended{color:#a00;font-style:italic}
.strip{display:flex;height:18px;margin:2px 0;border:1px solid #888;max-width:60em}
.seg{height:100%;min-width:1px}.prompt{opacity:.35}.response{opacity:1}.last{opacity:.6}
.pad{background:repeating-linear-gradient(45deg,#bbb 0 3px,#fff 3px 6px)!important}
.s0{background:#1f77b4}.s1{background:#ff7f0e}.s2{background:#2ca02c}.s3{background:#d62728}
.s4{background:#9467bd}.s5{background:#8c564b}.s6{background:#e377c2}.s7{background:#17becf}
.tok{flex:1;height:100%;border-right:1px solid #fff}.tok.ok{background:#cfe8cf}.tok.val{background:#d62728}
.tok.grad{background:#ff9f1a}.tok.both{background:#5a0000}
pre{background:#f4f4f4;padding:.5em;overflow-x:auto}.muted{color:#666}
"""


def render(doc: dict[str, Any]) -> str:
    """The page for a JSON report's document (a partial one too: what is missing is named); an
    invariance report (``shardcheck invariance --json-report``) gives its matrix."""
    if isinstance(doc, dict) and "matrix" in doc and "scenarios" not in doc:
        return _invariance(doc)
    return render_report(SavedReport.from_dict(doc))


def render_report(report: SavedReport) -> str:
    """The page for a run's report, read back (:meth:`SavedReport.from_dict`)."""
    out = ["<!doctype html><html lang=en><head><meta charset=utf-8><title>shardcheck report</title>",
           f"<style>{_STYLE}</style></head><body>", "<h1>shardcheck report</h1>"]
    out += _summary(report)
    for verdict in report.verdicts:
        if verdict.status == FAIL:
            out += _scenario(verdict, report.info.target_spec, bool(report.info.repro))
    out.append("</body></html>")
    return "\n".join(out)


def _e(value: Any) -> str:
    return html.escape(visible(value))


def _reach(coverage: dict[str, Any] | None) -> list[str]:
    """--coverage: per framework file, its line coverage, the functions that ran and those that did not."""
    if not coverage or not coverage.get("files"):
        return []
    out = ["<h2>Framework code reached</h2><table class=reach><tr><th>file<th>lines run<th>functions run"
           "<th>functions not reached</tr>"]
    for rel, f in coverage["files"].items():
        names = lambda key: ", ".join(_e(n.split(":", 1)[1]) for n in f[key]) or "-"  # noqa: E731
        out.append(f"<tr><td>{_e(rel)}<td>{f['percent']}% of {f['statements']}<td>{names('functions')}"
                   f"<td class=muted>{names('not_reached')}</tr>")
    out.append("</table>")
    return out


def _summary(report: SavedReport) -> list[str]:
    info = report.info
    target = info.target or {}
    lines = [f"<p>target: <b>{_e(target.get('name', info.target_spec or '?'))}</b> "
             f"{_e(target.get('version', ''))}"]
    if "ranks" not in report.absent:
        lines[-1] += f"; world: {_e(info.ranks)} ranks ({_e(info.backend or '?')})"
    summary = report.summary
    if summary:
        lines.append(f"<p>{scenario_count(summary.get('total', 0), report.planned)}: {summary.get('pass', 0)} passed, "
                     f"{summary.get('fail', 0)} failed, {summary.get('skip', 0)} skipped"
                     + (f", {summary['timeout']} timed out (the machine was too slow: no finding either way)"
                        if summary.get("timeout") else "")
                     + (f", {summary['error']} error{'s' if summary['error'] != 1 else ''} (shardcheck's own: "
                        "no finding either way)"
                        if summary.get("error") else "")
                     + ("" if report.complete else " <b>(incomplete: the run did not finish)</b>") + "</p>")
    defined = target.get("definitions") or {}
    if defined:
        lines.append("<p>definitions checked (the target's, the reference followed): "
                     + "; ".join(f"{_e(k)}: {_e(v)}" for k, v in defined.items()) + "</p>")
    laid: dict[str, int] = {}
    for v in report.verdicts:
        if v.built_by:
            laid[v.built_by] = laid.get(v.built_by, 0) + 1
    if laid and set(laid) != {"shardcheck"}:
        lines.append("<p>rows laid out by: " + "; ".join(f"{_e(k)} ({n})" for k, n in laid.items()) + "</p>")
    lines += _reach(info.coverage)
    if report.absent:
        lines.append(f"<p class=muted>this report has no {', '.join(report.absent)} field (an older shardcheck, or a "
                     "run that stopped early): shown without it</p>")
    kinds = sorted({k for v in report.verdicts for k in v.kinds})
    lines.append("<h2>Scenarios</h2><form id=filter class=muted>show: "
                 + "".join(f"<label><input type=checkbox name=verdict value={v} checked> {v}</label> "
                           for v in ("pass", "fail", "skip", "timeout"))
                 + "<label>kind <select name=kind><option value=''>any</option>"
                 + "".join(f"<option>{_e(k)}</option>" for k in kinds) + "</select></label></form>")
    with_sp = any(v.scenario.sp > 1 for v in report.verdicts)  # an sp column only where one is sequence parallel
    lines.append("<table id=scenarios><tr><th>scenario<th>layout<th>tp<th>cp" + ("<th>sp" if with_sp else "")
                 + "<th>verdict<th>kinds<th>detail</tr>")
    for v in report.verdicts:
        sc, verdict = v.scenario, v.status
        detail = v.reason or "; ".join(f.message[:160] for f in v.failures[:1])
        name = _e(sc.name)
        link = f"<a href='#sc-{name}'>{name}</a>" if verdict == FAIL else name
        lines.append(f"<tr class={_e(verdict)} data-kinds='{_e(' '.join(v.kinds))}'><td>{link}"
                     f"<td>{_e(sc.layout)}<td>{_e(sc.tp)}<td>{_e(sc.cp)}" + (f"<td>{_e(sc.sp)}" if with_sp else "") +
                     f"<td>{_e(verdict.upper() if verdict == FAIL else verdict)}<td>{_e(', '.join(v.kinds))}"
                     f"<td>{_e(detail)}</tr>")
    lines.append("</table>")
    lines.append(f"<script>{_FILTER}</script>")
    return lines


# The table's filter: the only script in the page (the page reads the same without it).
_FILTER = """
(function(){var f=document.getElementById('filter');function apply(){
var on={};f.querySelectorAll('input[name=verdict]').forEach(function(c){on[c.value]=c.checked;});
var k=f.querySelector('select[name=kind]').value;
document.querySelectorAll('#scenarios tr[data-kinds]').forEach(function(r){
var v=r.className;var ok=(on[v]!==false)&&(!k||(' '+r.dataset.kinds+' ').indexOf(' '+k+' ')>=0);
r.style.display=ok?'':'none';});}
/* a link may preset it: page.html#verdict=fail or #kind=collective_mismatch */
location.hash.slice(1).split('&').forEach(function(kv){var p=kv.split('=');
if(p[0]==='verdict'){f.querySelectorAll('input[name=verdict]').forEach(function(c){c.checked=c.value===p[1];});}
if(p[0]==='kind'){f.querySelector('select[name=kind]').value=decodeURIComponent(p[1]||'');}});
f.addEventListener('change',apply);apply();})();
"""


def _invariance(doc: dict[str, Any]) -> str:
    """The matrix: an axis a row, a field a column, each cell the result against the contract."""
    target = doc.get("target") or {}
    out = ["<!doctype html><html lang=en><head><meta charset=utf-8><title>shardcheck invariance</title>",
           f"<style>{_STYLE}</style></head><body>", "<h1>shardcheck invariance</h1>",
           f"<p>target: <b>{_e(target.get('name', doc.get('target_spec', '?')))}</b> {_e(target.get('version', ''))};"
           f" {_e(doc.get('bases_done', '?'))} of {_e(len(doc.get('bases') or []))} base scenarios"
           + ("" if doc.get("complete") else " <b>(incomplete)</b>") + "</p>"]
    violated = {v.get("details", {}).get("axis") for v in doc.get("violations") or []}
    fields = ("log_probs", "entropy", "grad")
    out.append("<table id=matrix><tr><th>axis<th>contract" + "".join(f"<th>{f}" for f in fields) + "</tr>")
    for axis in doc.get("axes") or list(doc["matrix"]):
        row = doc["matrix"].get(axis) or {}
        mark = " class=fail" if axis in violated else ""
        cells = "".join(f"<td>{_e((row.get(f) or {}).get('result', '-'))}" for f in fields)
        contract = (doc.get("contract") or {}).get(axis, "none")
        out.append(f"<tr{mark}><td>{_e(axis)}{' (violated)' if axis in violated else ''}<td>{_e(contract)}{cells}</tr>")
    out.append("</table>")
    violations = doc.get("violations") or []
    out.append(f"<h2>Violations ({len(violations)})</h2><ul>" if violations else "<h2>No violations</h2><ul>")
    out += [f"<li>{_e(v.get('message'))}" for v in violations]
    out.append("</ul></body></html>")
    return "\n".join(out)


def _scenario(verdict: Verdict, target_spec: str | None, repro: bool = False) -> list[str]:
    """A failed scenario's section; ``repro``: its target can be written as a standalone script."""
    scenario = verdict.scenario
    name = _e(scenario.name)
    out = [f"<section id='sc-{name}'><h2>FAILED {name}</h2><ul>"]
    for f in verdict.failures:
        phase = f" in {f.phase}" if f.phase else ""
        ranks = ",".join(map(str, f.ranks))
        out.append(f"<li><b>{_e(f.kind)}</b>{_e(phase)} [ranks {_e(ranks)}]: {_e(f.message)}")
    out.append("</ul>")
    for f in verdict.failures:
        if f.details.get("group_ranks"):  # a finding about one group's calls: its lanes
            out += _lanes(f, verdict.traces)
    out += _crash_lanes(verdict)
    out += _error_map(verdict)
    out += _layout_map(scenario, verdict.layouts)
    out.append("<h3>Scenario</h3><pre class=scenario>" + _e(scenario.to_json()) + "</pre>")
    if target_spec:
        out.append(f"<p>To run it again, save it as <code>{SCENARIO_FILE}</code>, then:</p><pre class=replay>"
                   f"{_e(replay_command(target_spec))}</pre>")
        if repro and _scriptable(scenario, verdict.kinds):
            out.append(f"<p>As a script that needs only torch and the code under test:</p><pre class=replay>"
                       f"shardcheck repro --target {_e(target_spec)} --scenario-file {SCENARIO_FILE} "
                       f"--scenario {_e(shlex.quote(scenario.name))}</pre>")
    out.append("</section>")
    return out


def _scriptable(scenario: Scenario, kinds: list[str]) -> bool:
    from shardcheck.harness.controller.commands.repro import kinds_refusal, scenario_refusal

    return scenario_refusal(scenario) is None and kinds_refusal(kinds) is None


def _lanes(failure: Failure, traces: dict[int, list[dict[str, Any]]]) -> list[str]:
    """One lane (column) per rank of the divergent group, calls aligned by their number in it."""
    d = failure.details
    group = list(d["group_ranks"])
    divergent = int(d.get("call", -1))
    sides = d.get("sides") or {}
    lanes: dict[int, dict[int, dict[str, Any]]] = {}
    for r in group:
        calls = [c for c in traces.get(r, []) if list(c.get("ranks") or []) == group]
        lanes[r] = {int(c["number"]): c for c in calls}
        side = sides.get(str(r))
        if side and "op" in side and divergent not in lanes[r]:
            lanes[r][divergent] = side
    numbers = sorted({n for lane in lanes.values() for n in lane if n <= divergent} | {divergent})
    label = d.get("label") or "group"
    out = [f"<h3>Lanes: {_e(label)} group {_e(group)}, call {divergent} diverges</h3>",
           "<table class=lanes><tr><th>call" + "".join(f"<th>rank {r}" for r in group) + "</tr>"]
    for n in numbers:
        mark = " class=divergent" if n == divergent else ""
        cells = []
        for r in group:
            c = lanes[r].get(n)
            side = sides.get(str(r)) or {}
            if c is not None:
                cells.append(f"<td>{_e(_call_text(c))}" + (" &larr; diverges" if n == divergent else ""))
            elif n == divergent and "finished_after" in side:
                cells.append(f"<td class=ended>finished the scenario after {side['finished_after']} calls here "
                             "(issues no such call)")
            else:
                cells.append("<td class=muted>(not in the trace kept)")
        out.append(f"<tr{mark}><td>{n}{' (divergent)' if n == divergent else ''}" + "".join(cells) + "</tr>")
    out.append("</table>")
    return out


def _error_map(verdict: Verdict) -> list[str]:
    """Per sample, a cell per response token: wrong value, wrong gradient, both, or right."""
    samples = verdict.scenario.samples
    values: dict[int, set[int]] = {}
    grads: dict[int, set[int]] = {}
    other_rows: dict[int, int] = {}  # sample -> rows outside the response with a wrong gradient
    for f in verdict.failures:
        d = f.details
        if f.kind == "value_mismatch" and f.field in ("log_probs", "entropy"):
            pairs = ([(f.sample, f.token)] if f.token is not None else []) + [tuple(t) for t in d.get("tokens", [])]
            for sample, token in pairs:
                values.setdefault(sample, set()).add(token)
        if f.kind == "grad_mismatch":
            rows = ([(f.sample, f.position)] if f.sample is not None and f.position is not None
                    else []) + [tuple(r) for r in d.get("rows", [])]
            for sample, pos in rows:
                total, response = samples[sample].total, samples[sample].response
                token = pos - (total - response - 1)
                if 0 <= token < response:
                    grads.setdefault(sample, set()).add(token)
                else:
                    other_rows[sample] = other_rows.get(sample, 0) + 1
    if not (values or grads or other_rows):
        return []
    out = ["<h3>Error map (a cell per response token: red wrong value, orange wrong gradient, dark both)</h3>"]
    for i, sample in enumerate(samples):
        response = sample.response
        v, g = values.get(i, set()), grads.get(i, set())
        cells = []
        for j in range(response):
            cls = "both" if j in v and j in g else "val" if j in v else "grad" if j in g else "ok"
            cells.append(f"<span class='tok {cls}' title='token {j}: {cls}'></span>")
        words = [f"value wrong at tokens {_spans(v)}" if v else "", f"gradient wrong at tokens {_spans(g)}" if g else "",
                 f"gradient wrong on {other_rows[i]} prompt or padding rows" if other_rows.get(i) else ""]
        text = "; ".join(w for w in words if w) or "right"
        out.append(f"<div>sample {i} ({response} response tokens): {_e(text)}<div class='strip errors'>"
                   f"{''.join(cells)}</div></div>")
    return out


def _spans(tokens: set[int]) -> str:
    """1, 2, 3, 7 -> 1-3, 7"""
    out, run = [], []
    for t in sorted(tokens):
        if run and t == run[-1] + 1:
            run.append(t)
        else:
            if run:
                out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = [t]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)


def _crash_lanes(verdict: Verdict) -> list[str]:
    """For ranks that raised or died: the lanes of every group they belong to, each member's calls
    as kept, and how each lane ends (the raise or the death, or a peer left waiting)."""
    ended: dict[int, str] = {}
    for f in verdict.failures:
        if f.kind != "rank_error":
            continue
        d = f.details
        text = (f"raised {d['type']}: {d.get('message', '')}" + (f" at {d['where']}" if d.get("where") else "")
                if d.get("type") else (f.message or "")[:200])
        for r in f.ranks:
            ended.setdefault(int(r), text)
    traces = verdict.traces
    groups = {tuple(c.get("ranks") or []) for calls in traces.values() for c in calls}
    groups = {g for g in groups if len(g) > 1 and set(g) & set(ended)}
    out: list[str] = []
    for group in sorted(groups):
        lanes = {r: {int(c["number"]): c for c in traces.get(r, []) if tuple(c.get("ranks") or []) == group}
                 for r in group}
        numbers = sorted({n for lane in lanes.values() for n in lane})
        out += [f"<h3>Lanes: group {_e(list(group))}, where rank {_e(', '.join(str(r) for r in group if r in ended))} "
                "ended</h3>", "<table class=lanes><tr><th>call" + "".join(f"<th>rank {r}" for r in group) + "</tr>"]
        for n in numbers:
            cells = "".join(f"<td>{_e(_call_text(lanes[r][n]))}" if n in lanes[r] else "<td class=muted>"
                            for r in group)
            out.append(f"<tr><td>{n}{cells}</tr>")
        last = []
        for r in group:
            if r in ended:
                last.append(f"<td class=ended>{_e(ended[r])}")
            elif lanes[r]:
                last.append(f"<td class=ended>waits in call {max(lanes[r])} for a peer that ended")
            else:
                last.append("<td class=muted>(no call kept)")
        out.append("<tr class=divergent><td>end" + "".join(last) + "</tr></table>")
    return out


def _call_text(c: dict[str, Any]) -> str:
    shape = ",".join("x".join(map(str, s)) for s in c.get("shapes") or []) or "-"
    red = f"{c['reduce_op']}, " if c.get("reduce_op") else ""
    return f"{c.get('op')}({red}{c.get('dtype')}[{shape}]) {c.get('phase')} at {c.get('site')}"


def _layout_map(sc: Scenario, built: dict[int, dict[str, Any]]) -> list[str]:
    """Per rank of the layout (tp rank, cp rank): its rows, sample after sample; the rows the
    framework's data path built when it built them (``built``: world rank -> the rank's payload)."""
    from shardcheck.scenarios.layout import Piece, RankLayout, rank_layout

    by = next(iter(built.values()))["built_by"] if built else "shardcheck"
    seq = f"sp {sc.sp}" if sc.sp > 1 else f"cp {sc.cp}"
    out = [f"<h3>Layout map: {_e(sc.layout)}, tp {sc.tp} x {seq}, rows laid out by {_e(by)} (one strip per "
           "rank; colour: sample; faint: prompt rows, solid: rows scoring a response token, hatched: padding)</h3>"
           "<div class=layout>"]
    for cp_rank in range(sc.seq):
        for tp_rank in range(sc.tp):
            lay = rank_layout(sc, tp_rank, cp_rank)
            rank = cp_rank * sc.tp + tp_rank
            if rank in built:
                pieces = tuple(Piece(*p) for p in built[rank]["pieces"])
                lay = RankLayout(sc, tp_rank, cp_rank, pieces, tuple(built[rank]["shape"]), lay.columns,
                                 lay.share, by)
            segs, words, kinds = [], [], set()
            for p in lay.pieces:
                for cls, a, b in _runs(sc, p.stream, p.start, p.stop):
                    kinds.add(cls)
                    color = f"s{p.stream % 8}" if p.stream < len(sc.samples) else ""
                    what = f"sample {p.stream}" if p.stream < len(sc.samples) else "padding"
                    span = f"rows {a}-{b - 1}" if p.stream < len(sc.samples) else f"{b - a} rows"
                    segs.append(f"<span class='seg {color} {cls}' style='flex:{b - a}' "
                                f"title='{what} {span}: {cls}'></span>")
                    words.append(f"{what} {span}" + ("" if what == "padding" else f" {cls}"))
            empty = "" if "response" in kinds else " <b>holds no row scoring a response token</b>"
            if not any(lay.share):
                empty += " <b>returns no response token (its share is empty)</b>"
            out.append(f"<div>rank {rank} (tp {tp_rank}, cp {cp_rank}), {lay.num_rows} rows, columns "
                       f"{lay.columns[0]}-{lay.columns[1] - 1}{empty}<div class=strip>{''.join(segs)}</div>"
                       f"<span class=muted>{_e('; '.join(words))}</span></div>")
    out.append("</div>")
    return out


def _runs(sc: Any, stream: int, start: int, stop: int) -> list[tuple[str, int, int]]:
    """Consecutive positions of one piece, by kind: prompt, response (scores a response token),
    last (the sample's last row, which scores nothing), pad."""
    def kind(pos: int) -> str:
        if stream >= len(sc.samples) or pos >= sc.samples[stream].total:
            return "pad"
        s = sc.samples[stream]
        if pos == s.total - 1:
            return "last"
        return "response" if pos >= s.prompt - 1 else "prompt"

    runs: list[tuple[str, int, int]] = []
    for pos in range(start, stop):
        k = kind(pos)
        if runs and runs[-1][0] == k:
            runs[-1] = (k, runs[-1][1], pos + 1)
        else:
            runs.append((k, pos, pos + 1))
    return runs


def write(path: str, page: str) -> None:
    """Atomically: a reader sees the old page or the new one, never half of one."""
    replace_with(path, page.encode("utf-8"))


def check_writable(path: str) -> None:
    """One line, before any world starts, when the page could not be written."""
    check_report_path(path, "--html-report", "the HTML report")


def write_verdicts(path: str, doc: dict[str, Any], verdicts: list[Any], order: Any) -> None:
    """The page for ``doc`` (a report's run info) with ``verdicts`` as its scenarios, sorted by
    ``order`` (suite order), in the JSON report's form."""
    from shardcheck.harness.controller.reports.run_report import entry

    write(path, render({**doc, "scenarios": [entry(v) for v in sorted(verdicts, key=order)]}))


class HtmlReport:
    """A reporter that rewrites the page after every scenario, from the same document the JSON
    report writes (the JSON reporter it follows). A write that fails is kept as ``failed`` (one
    line) and the page is not written again; the run goes on."""

    def __init__(self, path: str, json_report: Any) -> None:
        check_writable(path)
        self.path, self.json_report = path, json_report
        self.guard = GuardedWrites("the HTML report", path)

    @property
    def failed(self) -> str | None:
        return self.guard.failed

    def _write(self) -> None:
        self.guard(write_verdicts, self.path, self.json_report.doc, self.json_report.verdicts,
                   self.json_report.order_of)

    def start(self, info: Any, scenarios: list) -> None:
        self._write()

    def add(self, verdict: Any) -> None:
        self._write()

    def finish(self, info: Any) -> None:
        self._write()


def fuzz_page(result: Any) -> str:
    """A search's page: what it ran, and its minimal failing scenario drawn as a run's would be."""
    import dataclasses

    from shardcheck.harness.controller.reports.run_report import entry

    failure = result.failure
    if failure is not None:  # named as the scenario file the search writes
        failure = dataclasses.replace(failure, scenario=result.minimal_scenario())
    doc: dict[str, Any] = {"target_spec": result.target, "target": {"name": result.target},
                           "summary": {"total": result.runs, "pass": result.counts.get("pass", 0),
                                       "fail": result.counts.get("fail", 0), "skip": result.counts.get("skip", 0)},
                           "scenarios": [entry(failure)] if failure is not None else []}
    return render(doc)


class SessionHtmlReport:
    """One page for every scenario a pytest session checks (``--shardcheck-html-report``): each
    check is a run of its own, the page gathers their verdicts in the order they came. A write
    that fails is kept as ``failed`` (one line, said when the session ends) and not tried again."""

    def __init__(self, path: str) -> None:
        check_writable(path)
        self.path = path
        self.guard = GuardedWrites("the HTML report", path)
        self.doc: dict[str, Any] = {"suite": "pytest session", "complete": False}
        self.verdicts: list[Any] = []

    def start(self, info: Any, scenarios: list) -> None:
        self.doc.update(info.to_dict())

    def add(self, verdict: Any) -> None:
        self.verdicts.append(verdict)
        self._write()

    def finish(self, info: Any) -> None:
        self.doc.update(info.to_dict())
        self._write()

    def close(self) -> None:
        self.doc["complete"] = True
        self._write()

    def _write(self) -> None:
        statuses = [v.status for v in self.verdicts]
        self.doc["summary"] = {k: statuses.count(k) for k in ("pass", "fail", "skip")} | (
            {"timeout": statuses.count("timeout")} if "timeout" in statuses else {}) | {"total": len(statuses)}
        self.guard(write_verdicts, self.path, self.doc, self.verdicts, lambda v: 0)  # in the order they came

    @property
    def failed(self) -> str | None:
        return self.guard.failed
