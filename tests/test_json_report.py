"""The JSON report on disk: valid and in suite order after every verdict, the same document as a
full dump at the end, and an update that costs no more as the report grows."""

import json
import os
import random

import pytest

from shardcheck.harness.controller.reports.run_report import JsonReport, suite_order
from shardcheck.harness.controller.reports.verdict import FAIL, PASS, SKIP, Failure, RunInfo, Verdict
from shardcheck.scenarios import Sample, Scenario


def _info(wall: float = 0.0) -> RunInfo:
    info = RunInfo({"name": "t", "version": "1"}, "t", 4, "gloo", "test", True, startup_seconds=[1.5])
    info.wall_seconds = wall
    return info


def _suite(n: int) -> list[Scenario]:
    # two scenarios share a name: the report places scenario objects, not names
    return [Scenario("twin" if i in (3, 4) else f"s{i}", (Sample(5 + i % 3, 2),), vocab=4, tp=1 + i % 2, seed=i)
            for i in range(n)]


def _verdict(sc: Scenario, i: int) -> Verdict:
    """Every kind of content a verdict carries: failures with details (a set, text that is not
    ASCII), the largest errors, traces, a skip's reason."""
    if i % 5 == 1:
        return Verdict(sc, SKIP, reason=f"needs tp*cp={sc.ranks} ranks")
    if i % 5 == 2:
        details = {"at": 1.0 + i, "sides": {"0": {"op": "all_reduce"}}, "ranks_seen": {0, 1}, "note": "größer"}
        return Verdict(sc, FAIL, [Failure("value_mismatch", f"log_probs differ by {i}", [0, 1], sample=0, token=i,
                                          field="log_probs", details=details)], seconds=0.25 * i,
                       max_error={"log_probs": 0.5 * i}, traces={0: [{"op": "all_reduce", "number": 0}]})
    return Verdict(sc, PASS, seconds=0.01 * i, max_error={"log_probs": 1e-7 * i, "entropy": 0.0})


class FullDump:
    """What the report was before it was written incrementally: the whole document dumped anew
    after every verdict. The reference for what the document holds."""

    def __init__(self, path, meta, started_at):
        self.path, self.verdicts, self.order = path, [], {}
        self.doc = {"shardcheck": None, "started_at": started_at, "complete": False, **meta}

    def start(self, info, scenarios):
        self.doc.update(info.to_dict())
        self.doc["planned"] = len(scenarios)
        self.order = suite_order(scenarios)

    def add(self, verdict):
        self.verdicts.append(verdict)

    def finish(self, info):
        self.doc.update(info.to_dict())
        self.doc["complete"] = len(self.verdicts) == self.doc.get("planned", len(self.verdicts))
        self.doc["summary"] = {k: sum(v.status == k for v in self.verdicts) for k in (PASS, FAIL, SKIP)} | {
            "total": len(self.verdicts)}
        ranked = sorted(self.verdicts, key=lambda v: self.order.get(id(v.scenario), len(self.order)))
        self.doc["scenarios"] = [v.to_dict() for v in ranked]
        with open(self.path, "w") as f:
            json.dump(self.doc, f, indent=1, default=str)


def _names_and_seeds(doc):
    return [(s["name"], s["scenario"]["seed"]) for s in doc["scenarios"]]


def test_the_file_parses_after_every_verdict_and_lists_them_in_suite_order(tmp_path):
    suite = _suite(40)
    path = tmp_path / "r.json"
    report = JsonReport(str(path), {"suite": "mine"})
    assert json.loads(path.read_text())["scenarios"] == []
    report.start(_info(), suite)
    arrival = list(range(len(suite)))
    random.Random(7).shuffle(arrival)  # grouped by tp, cp and more: any order at all
    arrival = sorted(arrival[:20], key=lambda i: suite[i].tp) + arrival[20:]
    stranger = Scenario("not-in-the-suite", (Sample(5, 2),), vocab=4, seed=99)
    for k, i in enumerate(arrival):
        report.add(_verdict(suite[i], i))
        if k == 10:
            report.add(Verdict(stranger, PASS))  # placed after every scenario of the suite
        doc = json.loads(path.read_text())
        done = sorted(arrival[: k + 1])
        want = [(suite[j].name, suite[j].seed) for j in done] + ([("not-in-the-suite", 99)] if k >= 10 else [])
        assert _names_and_seeds(doc) == want
        statuses = [_verdict(suite[j], j).status for j in done] + ([PASS] if k >= 10 else [])
        assert doc["summary"] == {PASS: statuses.count(PASS), FAIL: statuses.count(FAIL),
                                  SKIP: statuses.count(SKIP), "total": len(statuses)}
        assert doc["complete"] is False and doc["planned"] == len(suite) and doc["suite"] == "mine"
    report.finish(_info(3.0))
    doc = json.loads(path.read_text())
    assert len(doc["scenarios"]) == len(suite) + 1 and doc["complete"] is False  # one was not planned


@pytest.mark.parametrize("arrival", ["suite order", "grouped by tp", "reversed"])
def test_the_final_document_is_what_a_full_dump_of_the_same_verdicts_gives(tmp_path, arrival):
    suite = _suite(30)
    order = {"suite order": list(range(30)), "grouped by tp": sorted(range(30), key=lambda i: suite[i].tp),
             "reversed": list(range(30))[::-1]}[arrival]
    path = tmp_path / "r.json"
    report = JsonReport(str(path), {"suite": "mine"})
    full = FullDump(str(tmp_path / "full.json"), {"suite": "mine"}, report.doc["started_at"])
    full.doc["shardcheck"] = report.doc["shardcheck"]
    for r in (report, full):
        r.start(_info(), suite)
    verdicts = [_verdict(suite[i], i) for i in order]
    for v in verdicts:
        report.add(v)
        full.add(v)
    # changed after it was reported: the final document has it as it is at the finish, as before
    verdicts[4].seconds = 123.0
    info = _info(9.5)
    info.rank_output = [{"line": "a warning", "ranks": [0, 1, 2, 3]}]
    for r in (report, full):
        r.finish(info)
    doc, want = json.loads(path.read_text()), json.loads((tmp_path / "full.json").read_text())
    assert doc == want
    assert list(doc)[0] == "scenarios"  # first: what follows it is the small part rewritten
    assert doc["complete"] is True
    # and the text itself is json.dump's, with the scenarios first
    assert path.read_text() == json.dumps(doc, indent=1, default=str)
    assert not (tmp_path / "r.json.tmp").exists()


def _written() -> int:
    """Bytes this process has handed to write() and pwrite() so far."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="counts bytes written through /proc/self/io")
def test_a_verdict_at_the_end_writes_as_much_after_1000_as_after_10(tmp_path):
    """One update writes the new entry and the small tail, not the report so far."""

    def one_update(n: int) -> int:
        suite = [Scenario(f"s{i:05d}", (Sample(5, 2),), vocab=4, seed=i) for i in range(n + 3)]
        report = JsonReport(str(tmp_path / f"r{n}.json"), {"suite": "mine"})
        report.start(_info(), suite)
        for sc in suite[:n]:
            report.add(Verdict(sc, PASS, seconds=0.5))
        costs = []
        for sc in suite[n:]:  # the least of three: nothing else this process writes meanwhile counts
            before = _written()
            report.add(Verdict(sc, PASS, seconds=0.5))
            costs.append(_written() - before)
        doc = json.loads((tmp_path / f"r{n}.json").read_text())
        assert len(doc["scenarios"]) == n + 3
        return min(costs)

    small, large = one_update(10), one_update(1000)
    assert large <= small + 64, (small, large)
    assert 0 < small < 4096, small  # a few hundred bytes each for the entry and the tail


def test_a_verdict_placed_before_many_others_replaces_the_file_whole(tmp_path):
    """Moving many entries in place is not atomic (a process killed in the middle of that write
    would leave half of it): such an update writes a new file and renames it over the report."""
    suite = [Scenario(f"s{i:04d}", (Sample(5, 2),), vocab=4, seed=i) for i in range(300)]
    path = tmp_path / "r.json"
    report = JsonReport(str(path))
    report.start(_info(), suite)
    for sc in suite[1:-1]:
        report.add(Verdict(sc, PASS))
    assert path.stat().st_size > 2 * JsonReport._IN_PLACE_MAX
    inode = path.stat().st_ino
    report.add(Verdict(suite[-1], PASS))  # last: written in place
    assert path.stat().st_ino == inode
    report.add(Verdict(suite[0], PASS))  # first: every entry moves
    assert path.stat().st_ino != inode
    assert [s["name"] for s in json.loads(path.read_text())["scenarios"]] == [sc.name for sc in suite]
    inode = path.stat().st_ino
    report.add(Verdict(Scenario("extra", (Sample(5, 2),), vocab=4), PASS))  # in place again
    assert path.stat().st_ino == inode and len(json.loads(path.read_text())["scenarios"]) == 301
    report.finish(_info())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]  # the spare beside it is gone


def test_a_written_report_reads_back_as_the_verdicts_and_info_that_wrote_it(tmp_path):
    """SavedReport.from_dict is the writer's inverse: every status, failures with details,
    traces, skips; what JSON itself changes (a set written as text) stays as the file has it."""
    from shardcheck.harness.controller.reports.report_file import read_report

    suite = _suite(10)
    path = tmp_path / "r.json"
    report = JsonReport(str(path), {"suite": "mine"})
    info = _info(wall=2.5)
    info.repro, info.target_config, info.coverage = "shardcheck repro {scenario}", {"src": "/x", "options": [["k", "v"]]}, {"files": {}}
    report.start(info, suite)
    for i, sc in enumerate(suite):
        report.add(_verdict(sc, i))
    report.finish(info)
    doc = json.loads(path.read_text())
    saved = read_report(str(path))
    assert saved.info == info and saved.absent == () and saved.complete and saved.planned == 10
    assert saved.summary == doc["summary"]
    assert [json.loads(json.dumps(v.to_dict())) for v in saved.verdicts] == doc["scenarios"]
    assert {v.status for v in saved.verdicts} == {PASS, FAIL, SKIP}
    failed = next(v for v in saved.verdicts if v.status == FAIL)
    assert failed.traces == {0: [{"op": "all_reduce", "number": 0}]} and failed.failures[0].token is not None
