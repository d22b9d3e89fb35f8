"""The command line: listings, and bad input as one line with exit status 2 (no traceback).

Bad input is refused before any world starts, so those cases call ``main`` in this process
(``cli_in_process``: a subprocess would cost an interpreter and a torch import each); the real
entry points, the console script and ``python -m shardcheck``, are run once as processes."""

import json
import subprocess
import sys

import pytest

from conftest import MainResult, run_cli


def _one_line_error(proc: MainResult | subprocess.CompletedProcess, fragment: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("shardcheck: error: ") and fragment in lines[0], lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout


def _file(tmp_path, content) -> str:
    p = tmp_path / "s.json"
    p.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(p)


def test_suites_and_targets_listings(cli_in_process):
    proc = cli_in_process("suites")
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0
    assert any(ln.startswith("smoke") and "68 scenarios" in ln for ln in lines), proc.stdout
    assert any(ln.startswith("regressions") for ln in lines), proc.stdout
    proc = cli_in_process("targets")
    assert proc.returncode == 0 and any(ln.startswith("builtin ") for ln in proc.stdout.splitlines()), proc.stdout
    from shardcheck.targets.mutants import MUTANTS

    assert len(MUTANTS) >= 8
    for name in MUTANTS:  # every mutant listed, with its one-line documentation
        assert f"builtin:{name} " in proc.stdout


def _entry_points(folder):
    """The real entry points as processes, in the background: the console script, and one bad
    input through ``python -m shardcheck``."""
    exe = __import__("shutil").which("shardcheck") or str(__import__("pathlib").Path(sys.executable).parent / "shardcheck")
    return subprocess.run([exe, "suites"], capture_output=True, text=True, timeout=120), run_cli("frobnicate", timeout=120)


BACKGROUND = {"entry-points": (_entry_points, 240)}


@pytest.mark.background("entry-points")
def test_console_script_and_module_agree(cli_in_process, background):
    """The real entry points, as processes: the console script says what ``main`` says, and one
    bad input through ``python -m shardcheck`` itself is one line and its exit status, as a shell
    sees them."""
    script, bad = background("entry-points")
    assert script.returncode == 0 and script.stdout == cli_in_process("suites").stdout
    _one_line_error(bad, "invalid choice")


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
def test_bad_scenario_file(tmp_path, cli_in_process, content, fragment):
    _one_line_error(cli_in_process("run", "--scenario-file", _file(tmp_path, content)), fragment)


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
def test_bad_options(cli_in_process, args, fragment):
    _one_line_error(cli_in_process(*args), fragment)


@pytest.mark.parametrize("command", ["run", "fuzz"])
def test_nccl_without_cuda_is_one_line(cli_in_process, command):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is present here: nccl may be had")
    _one_line_error(cli_in_process(command, "--backend", "nccl", "--nproc", "1"), "--backend nccl needs CUDA")


def test_missing_scenario_file(cli_in_process):
    _one_line_error(cli_in_process("run", "--scenario-file", "/nonexistent/s.json"), "does not exist")


def test_version_names_shardcheck_and_its_target_contract(capsys):
    """``shardcheck --version``: the package's version and the Target contract's (docs/targets.md,
    "The contract"), as --help exits: at once, status 0."""
    import shardcheck
    from shardcheck.cli import main
    from shardcheck.targets.base import CONTRACT_VERSION

    with pytest.raises(SystemExit) as stopped:
        main(["--version"])
    assert stopped.value.code == 0
    assert capsys.readouterr().out == f"shardcheck {shardcheck.__version__} (Target contract {CONTRACT_VERSION})\n"
    from importlib.metadata import version

    assert version("shardcheck") == shardcheck.__version__  # written once: pyproject.toml reads it
