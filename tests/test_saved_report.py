"""A saved JSON report read back (report_file.SavedReport, Verdict.from_dict, RunInfo.from_dict)
by every command that reads one: a report an older shardcheck wrote still reads, what it lacks
given its default; a document that is no shardcheck report is one line and exit 2."""

import json

import pytest

from shardcheck.harness.controller.reports.report_file import SavedReport

# A report as the first shardcheck wrote it (b0f451f): the run info was target, target_spec,
# ranks and backend; an entry had no layouts, traces or layout_built_by; a failure no phase; the
# scenario none of the fields added since (replay_keep, top_k, dp, ...).
FIRST_REPORT = {
    "shardcheck": "0.1.0", "started_at": "2026-12-02T15:40:36+00:00", "complete": True, "suite": "smoke",
    "target": {"name": "builtin:chunk_off_by_one", "version": "0.1.0"}, "target_spec": "builtin:chunk_off_by_one",
    "ranks": 4, "backend": "gloo", "planned": 2, "startup_seconds": [3.1], "wall_seconds": 4.2,
    "summary": {"pass": 1, "fail": 1, "skip": 0, "total": 2},
    "scenarios": [
        {"name": "thd-tp2cp1-basic", "layout": "thd", "tp": 2, "cp": 1, "verdict": "fail", "kinds": ["value_mismatch"],
         "reason": None, "seconds": 0.31, "max_error": {"log_probs": 0.7},
         "failures": [{"kind": "value_mismatch", "message": "log_probs of sample 0 token 2: got -1.2, want -0.5",
                       "ranks": [0, 1], "field": "log_probs", "sample": 0, "token": 2, "got": -1.2, "want": -0.5,
                       "details": {"count": 3}}],
         "scenario": {"name": "thd-tp2cp1-basic", "samples": [[23, 9], [14, 6]], "vocab": 64, "tp": 2, "cp": 1,
                      "layout": "thd", "with_entropy": True, "entropy_coef": 0.1, "log_probs_chunk_size": -1,
                      "temperature": 0.8, "dtype": "float32", "seed": 4, "description": ""}},
        {"name": "thd-tp1cp1-basic", "layout": "thd", "tp": 1, "cp": 1, "verdict": "pass", "kinds": [],
         "reason": None, "seconds": 0.1, "max_error": {"log_probs": 1e-7}, "failures": [],
         "scenario": {"name": "thd-tp1cp1-basic", "samples": [[9, 4]], "vocab": 32, "tp": 1, "cp": 1,
                      "layout": "thd", "with_entropy": True, "entropy_coef": 0.0, "log_probs_chunk_size": -1,
                      "temperature": 1.0, "dtype": "float32", "seed": 1, "description": ""}},
    ],
}


def test_the_first_reports_shape_reads_with_defaults_for_what_came_later():
    saved = SavedReport.from_dict(FIRST_REPORT)
    info = saved.info
    assert (info.target_spec, info.ranks, info.backend, info.startup_seconds) == ("builtin:chunk_off_by_one", 4, "gloo",
                                                                                  [3.1])
    # later fields: no lockstep then; input_mutated and mask_leak on, as a run without the flags has them
    assert (info.lockstep, info.inplace, info.mask_leak, info.repro, info.target_config, info.coverage) == (
        False, True, True, None, {}, None)
    failed, passed = saved.verdicts
    assert failed.status == "fail" and failed.kinds == ["value_mismatch"] and failed.failures[0].phase is None
    assert (failed.failures[0].sample, failed.failures[0].token, failed.failures[0].ranks) == (0, 2, [0, 1])
    assert failed.layouts == {} and failed.traces == {} and failed.built_by == "shardcheck"
    assert passed.status == "pass" and passed.scenario.samples[0].response == 4
    assert saved.summary == FIRST_REPORT["summary"] and saved.planned == 2 and saved.absent == ()


def test_the_page_and_a_repro_script_come_from_the_first_reports_shape(tmp_path, cli_in_process, monkeypatch):
    monkeypatch.chdir(tmp_path)
    old = tmp_path / "old.json"
    old.write_text(json.dumps(FIRST_REPORT))
    proc = cli_in_process("report", str(old), "--html", "old.html")
    assert proc.returncode == 0, proc.stderr
    page = (tmp_path / "old.html").read_text()
    assert "FAILED thd-tp2cp1-basic" in page and "value wrong at tokens 2" in page
    assert "shardcheck run --target builtin:chunk_off_by_one --scenario-file scenario.json" in page
    proc = cli_in_process("repro", "--report", str(old), "--scenario", "thd-tp2cp1-basic")
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "repro-thd-tp2cp1-basic.py").read_text()
    assert "Expected (shardcheck found): value_mismatch: log_probs of sample 0 token 2" in text


@pytest.mark.parametrize("doc, says", [
    ([1, 2], "not a shardcheck JSON report (not an object)"),
    ({"target": {}}, "not a shardcheck JSON report: no scenarios field"),
    ({"scenarios": [{"name": "x", "verdict": "pass"}]}, "not a shardcheck JSON report: scenario 0: the entry 'x' has "
                                                         "no scenario field"),
    ({"scenarios": [{**FIRST_REPORT["scenarios"][1], "verdict": "great"}]}, "has verdict 'great'"),
    ({"scenarios": [{**FIRST_REPORT["scenarios"][1], "failures": [{"message": "m"}]}]}, "a failure without a kind"),
    ({"scenarios": [{**FIRST_REPORT["scenarios"][1], "traces": {"zero": []}}]}, "scenario 0: invalid literal for int()"),
])
@pytest.mark.parametrize("command", ["report", "repro"])
def test_a_document_that_is_no_shardcheck_report_is_one_line_and_exit_2(tmp_path, cli_in_process, monkeypatch, doc,
                                                                        says, command):
    monkeypatch.chdir(tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    args = ["report", str(bad), "--html", "o.html"] if command == "report" else [
        "repro", "--report", str(bad), "--scenario", "x"]
    proc = cli_in_process(*args)
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json"]  # nothing written
