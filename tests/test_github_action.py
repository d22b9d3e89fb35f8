"""The GitHub Action (action.yml, ci/action/) and the report side it calls (`shardcheck report
--github-summary --annotations`, harness/controller/reports/github_summary.py).

The action's check step, ci/action/check.sh, runs here as a runner runs it, with plain files for
GITHUB_STEP_SUMMARY and GITHUB_OUTPUT: once for a target that passes, once for a mutant that
fails, one small scenario each, in the background (tests/background.py). The summary and the
annotations are checked on the JSON reports those runs wrote: real reports, not documents made up
to agree with the code that reads them."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from conftest import cli_env
from shardcheck.harness.controller.reports.github_summary import _data, _property, annotations, summary_markdown
from shardcheck.harness.controller.reports.run_report import replay_command

ROOT = Path(__file__).resolve().parent.parent
ACTION = ROOT / "action.yml"
SCRIPTS = ROOT / "ci" / "action"
SCENARIO = "thd-tp2-chunks"  # the failing run's: two ranks, each finding the same line
PASSING = "thd-one-device-edges"  # the passing run's: one rank, the cheapest world
MUTANT = "builtin:inplace_temperature"  # divides the caller's logits by the temperature in place
# the line of targets/mutants.py the mutant's finding names
MUTANT_LINE = next(i for i, line in enumerate((ROOT / "targets" / "mutants.py").read_text().splitlines(), 1)
                   if "inputs.logits.div_(inputs.temperature)" in line)


@dataclass
class StepRun:
    """One run of the check step: its process, and the files a runner would have read after it."""

    proc: subprocess.CompletedProcess
    reports: Path
    summary: Path
    output: Path

    @property
    def doc(self) -> dict:
        return json.loads((self.reports / "shardcheck.json").read_text())

    def outputs(self) -> dict[str, str]:
        return dict(line.split("=", 1) for line in self.output.read_text().splitlines())


def _shardcheck() -> str:
    beside = Path(sys.executable).parent / "shardcheck"  # this venv's console script
    return str(beside) if beside.exists() else "shardcheck"


def _check_step(folder: Path, target: str, extra_args: str, **env: str) -> StepRun:
    """ci/action/check.sh in the repository root (the sites the ranks name are relative to it), as
    the action's step calls it: its inputs in the environment."""
    folder.mkdir()
    reports, summary, output = folder / "reports", folder / "summary.md", folder / "output"
    inputs = {"SHARDCHECK_ACTION_TARGET": target, "SHARDCHECK_ACTION_SUITE": "regressions",
              "SHARDCHECK_ACTION_BACKEND": "gloo", "SHARDCHECK_ACTION_SRC": "",  # builtin takes no checkout
              "SHARDCHECK_ACTION_OUTPUT": str(reports), "SHARDCHECK_ACTION_EXTRA_ARGS": extra_args,
              "SHARDCHECK_ACTION_SHARDCHECK": _shardcheck(),
              "GITHUB_STEP_SUMMARY": str(summary), "GITHUB_OUTPUT": str(output)}
    proc = subprocess.run(["bash", str(SCRIPTS / "check.sh")], cwd=ROOT, env=cli_env(**inputs, **env),
                          capture_output=True, text=True, timeout=240)
    return StepRun(proc, reports, summary, output)


def _both_steps(folder: Path) -> dict[str, StepRun]:
    # extra-args carries the scenario: quoted, as a workflow may write it
    return {"pass": _check_step(folder / "pass", "builtin", f"--scenario {PASSING} -q"),
            "fail": _check_step(folder / "fail", MUTANT, f"--scenario '{SCENARIO}' -q")}


BACKGROUND = {"action-check-step": (_both_steps, 2 * 240)}


@pytest.fixture
def steps(background) -> dict[str, StepRun]:
    return background("action-check-step")


# -- the report side: summary_markdown and annotations on the runs' JSON reports ---------------
@pytest.mark.background("action-check-step")
def test_the_summary_of_a_passing_run_is_its_table(steps):
    md = summary_markdown(steps["pass"].doc)
    assert md.startswith("## shardcheck: `builtin 0.1.0` passed\n")
    assert "1 scenarios: 1 passed, 0 failed, 0 skipped; world: 1 ranks (gloo)" in md
    assert "| scenario | layout | tp | cp | verdict | first finding |" in md  # no sp column: none is sequence parallel
    assert f"| {PASSING} | thd | 1 | 1 | pass | ok |" in md
    assert "FAILED" not in md and "shardcheck repro" not in md


@pytest.mark.background("action-check-step")
def test_the_summary_of_a_failing_run_says_how_to_replay_it(steps):
    run = steps["fail"]
    doc = run.doc
    md = summary_markdown(doc)
    assert md.startswith(f"## shardcheck: `{MUTANT} 0.1.0` failed\n")
    assert f"| {SCENARIO} | thd | 2 | 1 | **FAIL** | input_mutated: logits changed in forward: " in md
    section = md.split(f"### FAILED {SCENARIO}\n", 1)[1]
    # the findings as the terminal printed them
    assert f"  input_mutated in forward [ranks 0]: logits changed in forward" in section
    assert f"aten.div_.Tensor at targets/mutants.py:{MUTANT_LINE} in forward" in section
    # the replay line the HTML page gives, beside the scenario it replays
    assert f"```sh\n{replay_command(MUTANT)}\n```" in section
    assert replay_command(MUTANT) == f"shardcheck run --target {MUTANT} --scenario-file scenario.json"
    scenario = json.loads(section.split("```json\n", 1)[1].split("\n```", 1)[0])
    assert scenario == doc["scenarios"][0]["scenario"]
    # the repro line the terminal printed
    repro = f"shardcheck repro --report {run.reports / 'shardcheck.json'} --scenario {SCENARIO}"
    assert f"as a script needing only torch: {repro}\n" in run.proc.stdout
    assert f"```sh\n{repro}\n```" in section


@pytest.mark.background("action-check-step")
def test_annotations_name_the_line_of_the_checkout_that_wrote_into_the_logits(steps):
    doc = steps["fail"].doc
    [annotation] = annotations(doc, ROOT)  # two ranks' findings, one (file, line, kind)
    assert annotation.startswith(f"::error file=targets/mutants.py,line={MUTANT_LINE},title=shardcheck input_mutated::"
                                 f"{SCENARIO}: input_mutated in forward: logits changed in forward: ")
    # relative to the root given; a file outside it is dropped
    assert annotations(doc, ROOT / "targets")[0].startswith(f"::error file=mutants.py,line={MUTANT_LINE},")
    assert annotations(doc, ROOT / "tests") == []
    assert annotations(steps["pass"].doc, ROOT) == []


@pytest.mark.background("action-check-step")
def test_annotations_read_absolute_sites_once_each_and_stop_at_fifty(steps):
    doc = copy.deepcopy(steps["fail"].doc)
    failure = doc["scenarios"][0]["failures"][0]
    # the same line, absolute, is the same annotation; lines of a file outside the root are none
    failure["details"]["site"] = [f"{ROOT}/targets/mutants.py:{MUTANT_LINE} in forward", "/usr/lib/python3/os.py:7"]
    assert len(annotations(doc, ROOT)) == 1
    failure["details"]["site"] = [f"{ROOT}/targets/mutants.py:{n}" for n in range(1, 80)]
    out = annotations(doc, ROOT)
    assert len(out) == 50 and len(set(out)) == 50


def test_workflow_command_values_are_escaped_as_github_reads_them():
    assert _data("100% of\r\nrows: a,b") == "100%25 of%0D%0Arows: a,b"
    assert _property("shardcheck a:b,c%\n") == "shardcheck a%3Ab%2Cc%25%0A"


# -- shardcheck report: --html as before, --github-summary, --annotations -------------------------
@pytest.mark.background("action-check-step")
def test_the_report_command_appends_summaries_and_prints_annotations(steps, tmp_path, cli_in_process):
    saved = steps["fail"].reports / "shardcheck.json"
    summary = tmp_path / "summary.md"
    for _ in range(2):  # appended: each step of a job adds its part
        done = cli_in_process("report", str(saved), "--github-summary", str(summary), "--annotations", str(ROOT))
        assert done.returncode == 0, done.stderr
    assert summary.read_text() == 2 * summary_markdown(steps["fail"].doc)
    assert done.stdout.splitlines()[-1] == annotations(steps["fail"].doc, ROOT)[0]
    page = tmp_path / "page.html"
    done = cli_in_process("report", str(saved), "--html", str(page))
    assert (done.returncode, done.stdout) == (0, f"wrote {page}\n") and "FAILED" in page.read_text()


@pytest.mark.background("action-check-step")
def test_the_report_command_refuses_in_one_line(steps, tmp_path, cli_in_process):
    saved = str(steps["pass"].reports / "shardcheck.json")
    done = cli_in_process("report", saved)
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "--html FILE, --github-summary FILE or --annotations" in done.stderr
    done = cli_in_process("report", saved, "--annotations", str(tmp_path / "nowhere"))
    assert done.returncode == 2 and "--annotations" in done.stderr and "is not a folder" in done.stderr
    matrix = tmp_path / "matrix.json"  # an invariance report: a page, but no verdicts to summarise
    matrix.write_text(json.dumps({"matrix": {}, "axes": []}))
    done = cli_in_process("report", str(matrix), "--github-summary", str(tmp_path / "summary.md"))
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "--github-summary reads a run's report" in done.stderr
    assert not (tmp_path / "summary.md").exists()


# -- the action: its metadata, and its check step run as a script --------------------------------
def _action() -> dict:
    return yaml.safe_load(ACTION.read_text())


def test_the_action_is_composite_and_writes_no_input_into_a_script():
    action = _action()
    inputs = action["inputs"]
    assert {"target", "suite", "scenario-file", "backend", "src", "python-version", "shardcheck-spec", "torch",
            "output", "extra-args"} <= set(inputs)
    assert inputs["target"]["required"] is True
    assert {k: inputs[k]["default"] for k in ("backend", "src", "python-version", "torch", "output")} == {
        "backend": "auto", "src": ".", "python-version": "3.11", "torch": "auto", "output": "shardcheck-reports"}
    runs = action["runs"]
    assert runs["using"] == "composite"
    steps = runs["steps"]
    assert steps[0]["uses"] == "actions/setup-python@v5"
    assert 'bash "$GITHUB_ACTION_PATH/ci/action/install.sh"' in steps[1]["run"]
    check = next(s for s in steps if s.get("id") == "check")
    assert 'bash "$GITHUB_ACTION_PATH/ci/action/check.sh" || status=$?' in check["run"]  # kept, not raised
    upload = next(s for s in steps if s.get("uses", "").startswith("actions/upload-artifact@"))
    assert upload["uses"] == "actions/upload-artifact@v4" and upload["if"] == "always()"
    assert upload["with"]["path"] == "${{ inputs.output }}"
    assert steps.index(check) < steps.index(upload) < len(steps) - 1
    assert "steps.check.outputs.exit-code" in steps[-1]["env"]["SHARDCHECK_ACTION_EXIT"]
    assert 'exit "$status"' in steps[-1]["run"]
    for step in steps:  # inputs through the environment: a pull request's text never becomes a script
        assert "${{" not in step.get("run", ""), step
    assert set(action["outputs"]) == {"verdict", "report-json", "report-html"}


def test_every_script_of_the_action_is_its_and_reads_what_it_sets():
    text = ACTION.read_text()
    scripts = sorted(p.name for p in SCRIPTS.iterdir())
    assert scripts == ["check.sh", "install.sh"]
    assert all(f"ci/action/{name}" in text for name in scripts)
    set_by_action = {k for s in _action()["runs"]["steps"] for k in (s.get("env") or {})}
    for name in scripts:
        read = set(re.findall(r"\$\{(SHARDCHECK_ACTION_[A-Z_]+)", (SCRIPTS / name).read_text()))
        local_only = {"SHARDCHECK_ACTION_SHARDCHECK", "SHARDCHECK_ACTION_PYTHON"}  # a test's, a runner's own python
        assert read - local_only <= set_by_action, (name, read - local_only - set_by_action)
    for output in ("verdict", "report-json", "report-html"):  # what the action's outputs read, check.sh writes
        assert f"steps.check.outputs.{output} }}" in text and f"echo \"{output}=" in (SCRIPTS / "check.sh").read_text()


@pytest.mark.background("action-check-step")
def test_the_check_step_on_a_passing_target(steps):
    run = steps["pass"]
    assert run.proc.returncode == 0, run.proc.stderr[-2000:]
    assert (run.reports / "shardcheck.json").is_file() and (run.reports / "shardcheck.html").is_file()
    assert f"| {PASSING} | thd | 1 | 1 | pass | ok |" in run.summary.read_text()
    assert run.outputs() == {"verdict": "pass", "report-json": str(run.reports / "shardcheck.json"),
                             "report-html": str(run.reports / "shardcheck.html")}
    assert "::error" not in run.proc.stdout


@pytest.mark.background("action-check-step")
def test_the_check_step_on_a_failing_mutant(steps):
    run = steps["fail"]
    assert run.proc.returncode == 1, run.proc.stderr[-2000:]
    summary = run.summary.read_text()
    assert f"### FAILED {SCENARIO}" in summary and "input_mutated in forward [ranks 0]" in summary
    assert replay_command(MUTANT) in summary
    assert f"shardcheck repro --report {run.reports / 'shardcheck.json'} --scenario {SCENARIO}" in summary
    assert f"::error file=targets/mutants.py,line={MUTANT_LINE},title=shardcheck input_mutated::" in run.proc.stdout
    assert run.outputs()["verdict"] == "fail"
    assert "FAILED" in (run.reports / "shardcheck.html").read_text()


def test_the_check_step_refuses_a_missing_target_in_one_line(tmp_path):
    summary, output = tmp_path / "summary.md", tmp_path / "output"
    env = cli_env(SHARDCHECK_ACTION_TARGET="", GITHUB_STEP_SUMMARY=str(summary), GITHUB_OUTPUT=str(output),
                  SHARDCHECK_ACTION_SHARDCHECK="false")  # never reached
    proc = subprocess.run(["bash", str(SCRIPTS / "check.sh")], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "target input is required" in proc.stderr
    assert "target input is required" in summary.read_text() and output.read_text() == "verdict=error\n"
    assert not (tmp_path / "shardcheck-reports").exists()


@pytest.mark.background("action-check-step")
def test_annotations_look_in_the_run_s_checkout_when_it_is_inside_this_folder(steps, tmp_path):
    from shardcheck.harness.controller.reports.github_summary import default_root

    doc = copy.deepcopy(steps["fail"].doc)
    assert doc["target_config"]["src"] is None and default_root(doc, str(ROOT)) == ROOT  # builtin: no checkout
    doc["target_config"]["src"] = str(ROOT / "targets")
    assert default_root(doc, str(ROOT)) == ROOT / "targets"
    assert default_root(doc, str(tmp_path)) == tmp_path.resolve()  # a checkout elsewhere: this folder
