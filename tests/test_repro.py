"""`shardcheck repro`: a failure as a script that runs with torch alone.

Each failure kind is planted by one of the builtin's mutants; the script written from it runs in
a virtualenv that has torch but not shardcheck, must find it (exit 1, saying what), and must
find nothing when pointed at the builtin without the plant (exit 0). The scripts and their runs
are subprocesses only: they go in the background (tests/background.py).

Over 20 s: five scripts run, and again with --variant none once a scenario (seven runs), every run
a world of spawned processes that import torch (about 1.5 s a run on 2 cores); in the full suite
they run in the background while other tests go on.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import torch_only_python
from shardcheck.harness.controller.commands import repro
from shardcheck.scenarios import get_suite
from shardcheck.targets import resolve

# kind -> (the mutant that plants it, a regressions scenario where it shows, what the script says)
KINDS = {
    "value": ("chunk_off_by_one", "thd-tp2-chunks", "rank 0 sample 0 response token 0: log-prob"),
    "gradient": ("entropy_no_grad", "thd-tp2-chunks", "gradient"),
    "input changed in place": ("inplace_temperature", "thd-tp2-chunks",
                               "changed the logits in place in the forward (aten.div_.Tensor at "),
    "collective mismatch": ("reduce_op_swap", "thd-tp2-chunks",
                            "collective mismatch in group [0, 1] call 0: rank 0 issued all_reduce(MAX)"),
    "crash": ("entropy_none", "ag-empty-local-slices", "rank 0 raised AttributeError"),
}


def _scripts(folder: Path) -> dict:
    python = torch_only_python(folder)
    # torch is there: every script imports it
    out = {"imports_shardcheck": subprocess.run([python, "-c", "import shardcheck"], capture_output=True,
                                                timeout=60, cwd=folder).returncode == 0}
    by_name = {sc.name: sc for sc in get_suite("regressions")}
    clean: dict[str, tuple[str, subprocess.CompletedProcess]] = {}  # scenario -> (program, its run with --variant none)
    for kind, (mutant, scenario, _) in KINDS.items():
        # written as `shardcheck repro --target builtin:MUTANT --suite regressions --scenario NAME`
        # writes it (in this process: the command's own handling is tested in-process below)
        path, spec = folder / f"{mutant}.py", f"builtin:{mutant}"
        repro.write(str(path), repro.script_text(spec, resolve(spec), by_name[scenario], None, path.name))
        found = subprocess.run([python, str(path)], capture_output=True, text=True, timeout=120, cwd=folder)
        # with --variant none the scripts of one scenario are one program (what differs is the
        # variant they default to and the header naming it): run once a scenario
        program = _without_variant(path.read_text(), mutant)
        if scenario not in clean:
            clean[scenario] = (program, subprocess.run([python, str(path), "--variant", "none"], capture_output=True,
                                                       text=True, timeout=120, cwd=folder))
        out[kind] = {"text": path.read_text(), "runs": [found, clean[scenario][1]],
                     "same_program": program == clean[scenario][0]}
    out["nccl"] = subprocess.run([python, str(path), "--backend", "nccl"], capture_output=True, text=True, timeout=120,
                                 cwd=folder)
    return out


def _without_variant(text: str, mutant: str) -> str:
    """The script with the variant it defaults to (and its header, which names it) taken out."""
    body = text[text.index('"""', 3) + 3:]
    return body.replace(f'"variant": "{mutant}"', '"variant": None').replace(f"builtin:{mutant}", "builtin")


BACKGROUND = {"repro-kinds": (_scripts, 900)}


@pytest.mark.background("repro-kinds")
@pytest.mark.parametrize("kind", list(KINDS))
def test_the_script_finds_each_kind_with_torch_alone(kind, background):
    done = background("repro-kinds")
    assert not done["imports_shardcheck"], "the venv must not have shardcheck"
    mutant, scenario, says = KINDS[kind]
    text, runs = done[kind]["text"], done[kind]["runs"]
    assert text.count("\n") < 300
    assert "NotImplementedError" not in text and "written above by shardcheck repro" not in text  # slots filled
    assert f"builtin:{mutant} on scenario {scenario}" in text.splitlines()[0]
    found, clean = runs
    assert found.returncode == 1, found.stdout + found.stderr
    assert found.stdout.startswith("FOUND") and says in found.stdout, found.stdout
    if kind == "input changed in place":  # the line that wrote: the mutant's logits.div_(t)
        line = next(n for n, text in enumerate(Path(repro.__file__).parents[3].joinpath(
            "targets", "mutants.py").read_text().splitlines(), 1) if "inputs.logits.div_(" in text)
        assert f"targets/mutants.py:{line})" in found.stdout, found.stdout
    assert done[kind]["same_program"], "with --variant none, the scripts of one scenario are one program"
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert clean.stdout.startswith("NOT FOUND"), clean.stdout


@pytest.mark.background("repro-kinds")
@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has a GPU a rank: nccl would run")
def test_nccl_without_a_gpu_a_rank_is_refused_before_any_rank_starts(background):
    done = background("repro-kinds")["nccl"]
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--backend nccl: a GPU a rank, and this machine has" in done.stderr and not done.stdout, done.stderr


def _report(path: Path, spec: str, scenario, failures: list) -> Path:
    """A JSON report as `run --json-report` writes it, the fields repro reads."""
    entry = {"name": scenario.name, "verdict": "fail" if failures else "pass", "failures": failures,
             "scenario": scenario.to_dict()}
    path.write_text(json.dumps({"target_spec": spec, "scenarios": [entry]}))
    return path


def test_from_a_report_the_header_says_what_was_found(tmp_path, cli_in_process, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where the script goes by default
    sc = next(s for s in get_suite("regressions") if s.name == "thd-tp2-chunks")
    failure = {"kind": "collective_mismatch", "phase": "forward", "message": "group [0, 1] call 0: they differ"}
    report = _report(tmp_path / "r.json", "builtin:reduce_op_swap", sc, [failure])
    proc = cli_in_process("repro", "--report", str(report), "--scenario", sc.name)
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "repro-thd-tp2-chunks.py").read_text()
    assert "Expected (shardcheck found): collective_mismatch in the forward: group [0, 1] call 0" in text
    assert '"variant": "reduce_op_swap"' in text


@pytest.mark.parametrize("args, says", [
    (["--target", "builtin", "--suite", "regressions", "--scenario", "no-such"], "unknown scenario(s) 'no-such'"),
    (["--target", "plants:CorruptValue", "--suite", "regressions", "--scenario", "thd-tp2-chunks"],
     "cannot say how it calls its code"),
    (["--target", "builtin", "--suite", "smoke", "--scenario", "thd-tp2cp1-replay"], "kept tokens"),
    (["--target", "builtin", "--suite", "regressions"], "the following arguments are required: --scenario"),
])
def test_bad_input_is_one_line_and_status_2(tmp_path, args, says, cli_in_process, monkeypatch):
    monkeypatch.chdir(tmp_path)
    proc = cli_in_process("repro", *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert says in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not list(tmp_path.iterdir()), "nothing is written for bad input"


def test_a_report_without_that_failure_and_a_file_in_the_way_are_refused(tmp_path, cli_in_process, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sc = next(s for s in get_suite("regressions") if s.name == "thd-tp2-chunks")
    passed = _report(tmp_path / "r.json", "builtin", sc, [])
    proc = cli_in_process("repro", "--report", str(passed), "--scenario", sc.name)
    assert proc.returncode == 2 and "did not fail" in proc.stderr, proc.stderr
    mine = tmp_path / "mine.py"
    mine.write_text("# the user's\n")
    proc = cli_in_process("repro", "--target", "builtin", "--suite", "regressions", "--scenario", sc.name,
                          "--out", str(mine))
    assert proc.returncode == 2 and "exists" in proc.stderr, proc.stderr
    assert mine.read_text() == "# the user's\n"


def test_a_run_fuzz_and_simulate_offer_the_command_where_a_script_can_be_written():
    """Under each failure shardcheck run shows (RunInfo.repro, set where the target has a repro
    call), and for fuzz's and simulate's minimal scenario; not for a scenario repro refuses."""
    from shardcheck.harness.controller.reports.fuzz_report import repro_offer
    from shardcheck.harness.controller.reports.run_report import render_table
    from shardcheck.harness.controller.reports.verdict import RunInfo, Verdict
    from shardcheck.harness.wire import Failure

    plain, replayed = (next(s for s in get_suite("smoke") if s.name == n) for n in ("thd-tp2cp1-basic", "thd-tp2cp1-replay"))
    command = "shardcheck repro --target builtin:x --suite smoke --scenario {scenario}"
    info = RunInfo({"name": "builtin:x"}, "builtin:x", 4, "gloo", "", True, repro=command)
    verdicts = [Verdict(sc, "fail", failures=[Failure("value_mismatch", "off", [0])]) for sc in (plain, replayed)]
    text = render_table(verdicts, info)
    assert text.count("as a script needing only torch:") == 1
    assert "as a script needing only torch: shardcheck repro --target builtin:x --suite smoke --scenario thd-tp2cp1-basic" in text
    info.repro = None  # a target without a repro call
    assert "as a script" not in render_table(verdicts, info)
    assert repro_offer("builtin:chunk_off_by_one", plain, "m.json") == (
        "shardcheck repro --target builtin:chunk_off_by_one --scenario-file m.json --scenario thd-tp2cp1-basic")
    assert repro_offer("builtin", replayed, "m.json") is None
    assert repro_offer("plants:CorruptValue", plain, "m.json") is None


def test_the_html_page_offers_the_command_beside_the_replay():
    from shardcheck.harness.controller.reports.html_report import render

    plain, replayed = (next(s for s in get_suite("smoke") if s.name == n) for n in ("thd-tp2cp1-basic", "thd-tp2cp1-replay"))
    entries = [{"name": sc.name, "verdict": "fail", "failures": [{"kind": "value_mismatch", "message": "off"}],
                "scenario": sc.to_dict()} for sc in (plain, replayed)]
    doc = {"target_spec": "builtin:x", "repro": "shardcheck repro --report r.json --scenario {scenario}",
           "scenarios": entries}
    page = render(doc)
    assert page.count("shardcheck repro") == 1
    assert "shardcheck repro --target builtin:x --scenario-file scenario.json --scenario thd-tp2cp1-basic" in page
    assert "shardcheck repro" not in render(dict(doc, repro=None))


def test_a_script_too_long_to_read_is_refused_with_the_count(tmp_path, cli_in_process, monkeypatch):
    """One line of data a rank: a world of 64 ranks would take the script past 300 lines."""
    from shardcheck.scenarios import Sample, Scenario, write_scenario_file

    monkeypatch.chdir(tmp_path)
    wide = Scenario("wide", (Sample(300, 200),), vocab=16, tp=2, cp=32, layout="zigzag", seed=1)
    write_scenario_file(str(tmp_path / "s.json"), wide)
    proc = cli_in_process("repro", "--target", "builtin", "--scenario-file", "s.json", "--scenario", "wide")
    assert proc.returncode == 2 and "lines; a script stays under 300 (it holds a line of data a rank: tp * cp = 64)" in proc.stderr, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.json"]


def test_the_scripts_deadline_follows_progress(monkeypatch, tmp_path):
    """The script's watch of its ranks: a rank that makes no progress (a sleep, as a rank waiting
    on a collective that never comes) is hung after TIMEOUT_S; one still using CPU is moving, not
    hung, however long it takes, up to GIVE_UP_S, after which it is given up on (exit 3, never
    "FOUND": at load 12 to 19 a fixed 15 s deadline said FOUND for correct code)."""
    import multiprocessing
    import time

    from shardcheck.harness.controller.commands import repro_script

    monkeypatch.setattr(repro_script, "TIMEOUT_S", 0.6)
    monkeypatch.setattr(repro_script, "GIVE_UP_S", 30.0)
    ctx = multiprocessing.get_context("fork")

    procs = []

    def started(target):
        procs.append(ctx.Process(target=target, daemon=True))
        procs[-1].start()
        return procs[-1]

    def spin(seconds):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass

    (tmp_path / "calls.0").write_text("")  # each rank's log of its calls, which it opens first
    waiting, working = started(lambda: time.sleep(60)), started(lambda: spin(1.5))
    try:
        t0 = time.monotonic()
        assert repro_script.watch([working], str(tmp_path)) == ([], [])  # 1.5 s of work, past TIMEOUT_S
        assert time.monotonic() - t0 >= 1.0
        assert repro_script.watch([waiting], str(tmp_path)) == ([0], [])
        monkeypatch.setattr(repro_script, "GIVE_UP_S", 0.5)
        looping = started(lambda: spin(60))
        assert repro_script.watch([looping], str(tmp_path)) == ([], [0])
    finally:
        for p in procs:
            p.kill()
            p.join()
