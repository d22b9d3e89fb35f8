"""radixark/miles's get_log_probs_and_entropy (``--target miles``, targets/miles.py).

Without a checkout (SHARDCHECK_MILES_SRC) the target is refused in one line and the checkout
tests skip, saying why; with one at ci/frameworks.toml's pin, the smoke suite runs: every value
matches, and every gradient is the live finding of docs/miles.md (megatron-core's fused cross
entropy rounds its gradient to bfloat16 for float32 logits), nothing else. With SHARDCHECK_MILES_REPO
(a clone with its history), #1185's parent and fix are checked.

Over 20 s: with a checkout and its history, about 25 s on a quiet 2-core machine (the smoke suite
laid out by miles's get_batch, two commits exported and run, a repro script's own world), more on a
loaded one; without a checkout, well under a second."""

from __future__ import annotations

import os

import pytest

from conftest import export_commit, run_on_world, write_scenarios
from shardcheck.errors import BadInput
from shardcheck.scenarios import Scenario, get_suite
from shardcheck.targets import miles
from shardcheck.targets.base import TargetConfig

MILES_SRC = os.environ.get(miles.ENV)
needs_miles = pytest.mark.skipif(
    not MILES_SRC, reason=f"{miles.ENV} is not set: no miles checkout to check (clone radixark/miles at "
    "ci/frameworks.toml's pin and point it there)")
REPO_ENV = "SHARDCHECK_MILES_REPO"
needs_history = pytest.mark.skipif(
    not os.environ.get(REPO_ENV), reason=f"{REPO_ENV} is not set: no miles git repository with its history (a clone of "
    "radixark/miles) to check other commits against")
SPEC = "shardcheck.targets.miles:target"
# #1185 (d2e0b35cb, "Fix CP slice parallel state access"): slice_with_cp read the ParallelState's
# cp_rank / cp_size, which it does not have (its cp group's rank and size), so get_batch raised on every
# packed micro-batch, CP or not; the smallest scenario, in float32 (bfloat16 came later, #1469)
CP_SLICE_FIX = "d2e0b35cb7e031d13aa616a3e7b7316c13a93e0f"
CP_SLICE = [{"name": "cp-slice-1185", "samples": [[2, 1]], "vocab": 4, "seed": 1},
            {"name": "cp-slice-1185-zigzag", "layout": "zigzag", "cp": 2, "samples": [[6, 3], [5, 2]], "vocab": 8,
             "seed": 1}]
# the smallest scenario of the finding (docs/miles.md)
TINY = {"name": "tiny", "samples": [[2, 1]], "vocab": 4, "with_entropy": False, "entropy_coef": 0.0, "seed": 1}


def test_a_folder_that_is_not_a_miles_checkout_is_one_line(tmp_path):
    with pytest.raises(BadInput) as exc:
        miles.target(None, TargetConfig(str(tmp_path)))
    assert "miles" in str(exc.value) and "\n" not in str(exc.value)


@needs_miles
@pytest.mark.world
def test_the_values_match_and_the_gradient_is_rounded_to_bfloat16_by_megatron_cores_cross_entropy(world, tmp_path,
                                                                                                      monkeypatch):
    from shardcheck.targets.base import SRC_ENV

    monkeypatch.setenv(SRC_ENV, MILES_SRC)
    run = run_on_world(world, get_suite("smoke"), SPEC, tmp_path / "smoke.json", "smoke")
    verdicts = run.report["scenarios"]
    ran = [v for v in verdicts if v["verdict"] != "skip"]
    assert len(ran) >= 50, [(v["name"], v.get("reason")) for v in verdicts]
    for v in ran:
        # float32 logits: the rounding is far outside float32's tolerance; bfloat16's allows it
        expected = [["grad_mismatch"]] if v["scenario"]["dtype"] == "float32" else [[], ["grad_mismatch"]]
        assert v["kinds"] in expected, (v["name"], v["kinds"])
        assert v["max_error"]["log_probs"] < 1e-5 and v["max_error"].get("entropy", 0) < 1e-5, v["name"]
        # the bfloat16 rounding of a gradient element of magnitude <= 1: at most 2**-8 relative
        assert v["max_error"]["grad"] < 4e-3, (v["name"], v["max_error"])
    skipped = {v["reason"] for v in verdicts if v["verdict"] == "skip"}
    assert any("replay" in r for r in skipped) and any("training step" in r for r in skipped), skipped
    tiny = run_on_world(world, [Scenario.from_dict(TINY)], SPEC, tmp_path / "tiny.json",
                        str(write_scenarios(tmp_path / "tiny-file.json", [Scenario.from_dict(TINY)])))
    [v] = tiny.report["scenarios"]
    assert v["kinds"] == ["grad_mismatch"] and "got -0.238281, want -0.238016" in tiny.stdout, tiny.stdout[-2000:]
    assert run.report["target"]["parallel_state"].startswith("miles/backends/megatron_utils/parallel.py:")
    # every layout, bshd and all-gather CP among them, laid out by miles's own get_batch
    assert {v["layout_built_by"] for v in ran} == {"miles/backends/training_utils/data.py:get_batch"}, \
        {v["name"]: v["layout_built_by"] for v in ran}
    assert {v["scenario"]["layout"] for v in ran} == {"thd", "zigzag", "allgather", "bshd"}


@needs_miles
def test_a_repro_script_shows_the_rounded_gradient_with_torch_megatron_core_and_miles_alone(tmp_path):
    """`shardcheck repro` writes the smallest scenario as a script: run in this venv (torch and
    megatron-core, no shardcheck import needed), it finds the bfloat16 gradient: exit 1."""
    import json
    import subprocess
    import sys

    from conftest import run_cli

    (tmp_path / "tiny.json").write_text(json.dumps([TINY]))
    made = run_cli("repro", "--target", "miles", "--miles-src", MILES_SRC, "--scenario-file", str(tmp_path / "tiny.json"),
                   "--scenario", "tiny", "--out", str(tmp_path / "repro.py"), cwd=str(tmp_path))
    assert made.returncode == 0, made.stderr
    run = subprocess.run([sys.executable, str(tmp_path / "repro.py")], capture_output=True, text=True, timeout=180,
                         cwd=tmp_path)
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    assert "FOUND in miles" in run.stdout and "gradient -0.23828125, want -0.23801616" in run.stdout, run.stdout


@needs_history
@pytest.mark.world
def test_the_cp_slice_fix_1185_fails_at_its_parent_and_not_at_the_fix(world, tmp_path, monkeypatch):
    """At #1185's parent get_batch's slice_with_cp raised AttributeError on every rank (rank_error);
    at the fix the values match, and the gradient is the rounding finding both commits share."""
    from shardcheck.targets.base import SRC_ENV

    scenarios = [Scenario.from_dict(d) for d in CP_SLICE]
    spec_file = str(write_scenarios(tmp_path / "cp-slice.json", scenarios))
    repo = os.environ[REPO_ENV]
    for rev, name in ((CP_SLICE_FIX + "^", "parent"), (CP_SLICE_FIX, "fix")):
        monkeypatch.setenv(SRC_ENV, export_commit(repo, rev, tmp_path / name, "miles"))
        run = run_on_world(world, scenarios, SPEC, tmp_path / f"{name}.json", spec_file)
        verdicts = {v["name"]: v for v in run.report["scenarios"]}
        assert set(verdicts) == {d["name"] for d in CP_SLICE}
        for v in verdicts.values():
            if name == "parent":  # get_batch raised: it laid out nothing
                assert v["kinds"] == ["rank_error"], (name, v["name"], v["kinds"])
            else:
                assert v["layout_built_by"] == "miles/backends/training_utils/data.py:get_batch", v
                assert v["kinds"] == ["grad_mismatch"], (name, v["name"], v["kinds"])
                assert v["max_error"]["log_probs"] < 1e-5 and v["max_error"]["grad"] < 4e-3, v["max_error"]
        if name == "parent":
            assert "AttributeError: 'ParallelState' object has no attribute 'cp_rank'" in run.stdout, run.stdout[-2000:]
            assert "cp_utils.py:255 in slice_with_cp" in run.stdout, run.stdout[-2000:]
