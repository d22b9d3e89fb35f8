"""The command line: listings, and bad input as one line with exit status 2 (no traceback)."""

import json
import subprocess
import sys

import pytest

from conftest import run_cli


def _one_line_error(proc: subprocess.CompletedProcess, fragment: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("shardcheck: error: ") and fragment in lines[0], lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout


def _file(tmp_path, content) -> str:
    p = tmp_path / "s.json"
    p.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(p)


def test_suites_and_targets_listings():
    proc = run_cli("suites")
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0
    assert any(ln.startswith("smoke") and "52 scenarios" in ln for ln in lines), proc.stdout
    assert any(ln.startswith("regressions") for ln in lines), proc.stdout
    proc = run_cli("targets")
    assert proc.returncode == 0 and proc.stdout.startswith("builtin")
    from shardcheck.targets.mutants import MUTANTS

    assert len(MUTANTS) >= 8
    for name in MUTANTS:  # every mutant listed, with its one-line documentation
        assert f"builtin:{name} " in proc.stdout


def test_console_script_and_module_agree():
    exe = __import__("shutil").which("shardcheck") or str(__import__("pathlib").Path(sys.executable).parent / "shardcheck")
    proc = subprocess.run([exe, "suites"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout == run_cli("suites").stdout


@pytest.mark.parametrize(
    "content,fragment",
    [
        ("{not json", "is not valid JSON"),
        ([{"name": "x", "samples": [[4, 5]], "vocab": 8}], "response length 5 > total length 4 - 1"),
        ([{"name": "x", "samples": [[8, 3]], "vocab": 10, "tp": 4}], "vocab 10 is not divisible by tp 4"),
        ([{"name": "x", "samples": "many", "vocab": 8}], "must be [total, response]"),
        ([{"name": "x", "samples": [[8, 3]], "vocab": 8, "colour": 1}], "unknown field(s) colour"),
        ([], "holds no scenario"),
    ],
    ids=["not-json", "response-too-long", "vocab-tp", "samples-type", "unknown-field", "empty"],
)
def test_bad_scenario_file(tmp_path, content, fragment):
    _one_line_error(run_cli("run", "--scenario-file", _file(tmp_path, content)), fragment)


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["run", "--target", "nosuch"], "unknown target 'nosuch'"),
        (["run", "--target", "no_such_module_xyz:make"], "cannot import 'no_such_module_xyz'"),
        (["run", "--target", "json:nothing_here"], "has no attribute 'nothing_here'"),
        (["run", "--target", "builtin:nope"], "target 'builtin' has no variant 'nope' (known: "),
        (["run", "--suite", "nope"], "unknown suite 'nope'"),
        (["run", "--scenario", "nope"], "unknown scenario(s) 'nope'"),
        (["run", "--nproc", "0"], "--nproc must be >= 1"),
        (["run", "--timeout", "abc"], "invalid float value"),
        (["run", "--json-report", "/nonexistent-dir/r.json"], "cannot write the JSON report"),
        (["run", "--backend", "mpi"], "invalid choice: 'mpi'"),
        (["fuzz", "--backend", "mpi"], "invalid choice: 'mpi'"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_options(args, fragment):
    _one_line_error(run_cli(*args), fragment)


@pytest.mark.parametrize("command", ["run", "fuzz"])
def test_nccl_without_cuda_is_one_line(command):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is present here: nccl may be had")
    _one_line_error(run_cli(command, "--backend", "nccl", "--nproc", "1"), "--backend nccl needs CUDA")


def test_missing_scenario_file():
    _one_line_error(run_cli("run", "--scenario-file", "/nonexistent/s.json"), "does not exist")
