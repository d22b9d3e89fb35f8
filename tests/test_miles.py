"""radixark/miles's get_log_probs_and_entropy (``--target miles``, targets/miles.py).

Without a checkout (SHARDCHECK_MILES_SRC) the target is refused in one line and the checkout
tests skip, saying why; with one at ci/frameworks.toml's pin, the smoke suite runs: every value
matches, and every gradient is the live finding of docs/miles.md (megatron-core's fused cross
entropy rounds its gradient to bfloat16 for float32 logits), nothing else."""

from __future__ import annotations

import os

import pytest

from conftest import run_on_world, write_scenarios
from shardcheck.errors import BadInput
from shardcheck.scenarios import Scenario, get_suite
from shardcheck.targets import miles
from shardcheck.targets.base import TargetConfig

MILES_SRC = os.environ.get(miles.ENV)
needs_miles = pytest.mark.skipif(
    not MILES_SRC, reason=f"{miles.ENV} is not set: no miles checkout to check (clone radixark/miles at "
    "ci/frameworks.toml's pin and point it there)")
SPEC = "shardcheck.targets.miles:target"
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
