"""The HTML report: built from the JSON report's data (``--html-report`` and ``shardcheck report``
give the same page), self-contained, with the lanes of a hang and the layout map. Read here as
text (what a person sees in it); a browser test is future work (issue 16)."""

import html
import json
import re

import pytest

from conftest import run_on_world
from shardcheck.harness.controller.reports.html_report import render
from shardcheck.scenarios import get_suite

HANG = [s for s in get_suite("regressions") if s.name == "ag-empty-local-slices"]


def _text(page: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", re.sub(r"<style>.*?</style>", "", page, flags=re.S)))


@pytest.fixture(scope="module")
def hang_report(world, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("html")
    return run_on_world(world, HANG, "builtin:skip_empty_rank", tmp / "r.json", "regressions").report


def test_a_hang_shows_both_lanes_and_a_strip_per_rank(hang_report):
    page = render(hang_report)
    text = _text(page)
    assert "FAILED ag-empty-local-slices" in text and "collective_mismatch" in text
    lanes = page.split("<table class=lanes>")[1].split("</table>")[0]
    divergent = re.search(r"<tr class=divergent>(.*?)</tr>", lanes, re.S).group(1)
    assert "finished the scenario after 0 calls here" in divergent and "all_reduce(SUM, float32[5])" in divergent
    assert divergent.count("<td") == 3  # the call number and one cell per rank of the group
    layout = page.split("Layout map")[1]
    assert layout.count("<div class=strip>") == 2  # tp 1 x cp 2: one strip per rank
    assert "rank 0 (tp 0, cp 0)" in text and "holds no row scoring a response token" in text
    assert "returns no response token (its share is empty)" in text
    assert '"name": "ag-empty-local-slices"' in html.unescape(page)  # the scenario, to replay
    assert "shardcheck run --target builtin:skip_empty_rank --scenario-file scenario.json" in text
    assert "<script src" not in page and "http" not in page.split("</style>")[1]  # nothing fetched at view time


def test_the_command_renders_a_saved_report_as_the_run_did(hang_report, tmp_path, cli_in_process):
    saved = tmp_path / "r.json"
    saved.write_text(json.dumps(hang_report))
    out = tmp_path / "out.html"
    proc = cli_in_process("report", str(saved), "--html", str(out))
    assert proc.returncode == 0, proc.stderr
    assert out.read_text() == render(hang_report)


def test_a_real_report_reads_back_as_it_was_written(hang_report):
    """Verdict.from_dict and RunInfo.from_dict on a run's report (a hang: traces, the lanes'
    details): written again, each gives the same JSON."""
    from shardcheck.harness.controller.reports.report_file import SavedReport

    saved = SavedReport.from_dict(hang_report)
    assert [json.loads(json.dumps(v.to_dict(), default=str)) for v in saved.verdicts] == hang_report["scenarios"]
    info = json.loads(json.dumps(saved.info.to_dict(), default=str))
    assert info == {k: hang_report[k] for k in info} and info["target_spec"] == "builtin:skip_empty_rank"
    [v] = saved.verdicts
    assert v.status == "fail" and v.failures[0].kind == "collective_mismatch" and set(v.traces) == {0, 1, 2, 3}


def test_an_older_or_partial_report_renders_what_it_can(hang_report, tmp_path, cli_in_process):
    old = {k: v for k, v in hang_report.items() if k not in ("target", "summary")}
    text = _text(render(old))
    assert "this report has no target, summary field" in text and "FAILED ag-empty-local-slices" in text
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"target": {}}))
    proc = cli_in_process("report", str(bad), "--html", str(tmp_path / "o.html"))
    assert proc.returncode == 2 and "not a shardcheck JSON report: no scenarios field" in proc.stderr


@pytest.mark.parametrize("args, fragment", [
    (["run", "--html-report", "/no/such/folder/r.html"], "cannot write the HTML report '/no/such/folder/r.html'"),
    (["report", "/no/such.json", "--html", "x.html"], "JSON report '/no/such.json' does not exist"),
])
def test_bad_paths_are_one_line_exit_2_before_any_world(cli_in_process, args, fragment):
    proc = cli_in_process(*args)
    assert proc.returncode == 2 and fragment in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.world
def test_the_error_map_marks_the_failing_token(world, tmp_path):
    """plants:CorruptValue moves one log-prob (sample 1, token 3): that cell alone is marked."""
    from shardcheck.scenarios import Sample, Scenario

    sc = Scenario("corrupt", (Sample(12, 6), Sample(10, 7)), vocab=16, tp=2, seed=3)
    report = run_on_world(world, [sc], "plants:CorruptValue", tmp_path / "r.json", "x").report
    page = render(report)
    errors = page.split("Error map")[1].split("Layout map")[0]
    assert "sample 1 (7 response tokens): value wrong at tokens 3" in _text(errors)
    strips = re.findall(r"<div class='strip errors'>(.*?)</div>", errors, re.S)
    assert [s.count("tok val") + s.count("tok both") for s in strips] == [0, 1]
    assert "title='token 3: val'" in strips[1] or "title='token 3: both'" in strips[1]


@pytest.mark.world
def test_an_invariance_report_shows_its_matrix(world, tmp_path, cli_in_process):
    """builtin:packing_dependent breaks the packing axis only: that row is marked, the message
    listed; the saved JSON renders the same page through ``shardcheck report``."""
    from shardcheck.harness.controller.commands.invariance import check_invariance

    sc = [s for s in get_suite("regressions") if s.name == "thd-tp2-chunks"]
    result = check_invariance(sc, "builtin:packing_dependent", axes=["rerun", "packing"], world=world)
    doc = json.loads(json.dumps({"shardcheck_command": "invariance", **result.to_dict()}, default=str))
    text = _text(render(doc))
    assert "packing (violated)" in text and "rerun bitwise" in text and "Violations (" in text
    assert "packing: log_probs of sample 0 (thd-tp2-chunks) differs" in text
    saved = tmp_path / "inv.json"
    saved.write_text(json.dumps(doc))
    proc = cli_in_process("report", str(saved), "--html", str(tmp_path / "inv.html"))
    assert proc.returncode == 0 and (tmp_path / "inv.html").read_text() == render(doc)


@pytest.mark.world
def test_a_search_draws_its_minimal_failure(world2):
    from shardcheck.harness.controller.commands import fuzz
    from shardcheck.harness.controller.reports.html_report import fuzz_page

    result = fuzz.fuzz("builtin:skip_empty_rank", max_examples=40, seed=2, tp=(1,), cp=(2,), layouts=["allgather"],
                       world=world2, database=None)
    assert result.failure is not None
    page = fuzz_page(result)
    assert "FAILED fuzz-minimal" in _text(page) and "<table class=lanes>" in page


@pytest.mark.world
def test_a_rank_that_raised_ends_its_lane_and_its_peer_is_seen_waiting(world, tmp_path):
    sc = [s for s in get_suite("regressions") if s.name == "ag-entropy-grad"]
    report = run_on_world(world, sc, "plants:RaiseOnCpRank1", tmp_path / "r.json", "x").report
    page = render(report)
    lanes = page.split("Lanes: group [0, 2], where rank 2 ended")[1].split("</table>")[0]
    end = re.search(r"<tr class=divergent><td>end(.*?)</tr>", lanes, re.S).group(1)
    assert "waits in call 0 for a peer that ended" in end
    assert "raised RuntimeError: planted failure on cp rank 1 at tests/plants.py:" in html.unescape(end)
