"""What is refused before any world starts (shardcheck/preflight.py): plugin checks that do not
import, and an output that would land on an input or on another output. Each is one line, exit 2,
and the file named stays as it was."""

import json

import pytest


def _refused(result, fragment):
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardcheck: error: ") and fragment in lines[0], result.stderr
    assert "Traceback" not in result.stdout + result.stderr


SCENARIO = [{"name": "a", "samples": [[20, 5]], "vocab": 16}]


def test_a_report_on_the_scenario_file_is_refused_and_the_file_kept(cli_in_process, tmp_path):
    scenarios = tmp_path / "s.json"
    scenarios.write_text(json.dumps(SCENARIO))
    before = scenarios.read_bytes()
    _refused(cli_in_process("run", "--scenario-file", str(scenarios), "--json-report", str(scenarios)),
             "the command would overwrite what it reads")
    _refused(cli_in_process("run", "--scenario-file", str(scenarios), "--html-report", str(tmp_path / "." / "s.json")),
             "--html-report")
    assert scenarios.read_bytes() == before


def test_a_link_to_an_input_is_the_input(cli_in_process, tmp_path):
    scenarios = tmp_path / "s.json"
    scenarios.write_text(json.dumps(SCENARIO))
    (tmp_path / "link.json").symlink_to(scenarios)
    _refused(cli_in_process("run", "--scenario-file", str(scenarios), "--json-report", str(tmp_path / "link.json")),
             "is the --scenario-file")
    assert json.loads(scenarios.read_text()) == SCENARIO


def test_the_default_out_of_simulate_is_an_output_too(cli_in_process, tmp_path, monkeypatch):
    """simulate writes its minimal failing scenario to .shardcheck/simulate-failure.json unless told
    otherwise: handed that very file as its scenarios, it would overwrite them."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".shardcheck").mkdir()
    scenarios = tmp_path / ".shardcheck" / "simulate-failure.json"
    scenarios.write_text(json.dumps(SCENARIO))
    _refused(cli_in_process("simulate", "--scenario-file", ".shardcheck/simulate-failure.json"),
             "--out (default) '.shardcheck/simulate-failure.json' is the --scenario-file")
    assert json.loads(scenarios.read_text()) == SCENARIO


def test_two_outputs_on_one_file_are_refused(cli_in_process, tmp_path):
    same = str(tmp_path / "x")
    _refused(cli_in_process("run", "--json-report", same, "--html-report", same), "are one file")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("command", [["report", "{f}", "--html", "{f}"],
                                     ["repro", "--report", "{f}", "--scenario", "a", "--out", "{f}"]],
                         ids=["report", "repro"])
def test_a_page_or_a_script_over_the_report_it_reads_is_refused(cli_in_process, tmp_path, command):
    report = tmp_path / "r.json"
    report.write_text("{}")
    _refused(cli_in_process(*[c.format(f=report) for c in command]), "the command would overwrite what it reads")
    assert report.read_text() == "{}"


@pytest.mark.parametrize("spec, fragment", [
    ("no_such_module:X", "SHARDCHECK_CHECKS='no_such_module:X': cannot import a check: ModuleNotFoundError"),
    ("json:dumps", "SHARDCHECK_CHECKS: 'json:dumps' is not a shardcheck Check"),
])
@pytest.mark.parametrize("command", ["run", "fuzz", "invariance", "simulate"])
def test_a_plugin_check_that_cannot_be_had_is_one_line_before_any_world(cli_in_process, monkeypatch, spec, fragment,
                                                                         command):
    monkeypatch.setenv("SHARDCHECK_CHECKS", spec)
    _refused(cli_in_process(command), fragment)
