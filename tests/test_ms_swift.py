"""modelscope/ms-swift's Megatron GRPO forward_step (``--target ms_swift``, targets/ms_swift.py).

Without a checkout (SHARDCHECK_MS_SWIFT_SRC) only the bad-input checks run; with one at the pin
(3602360a5, docs/ms-swift.md) a handful of smoke scenarios run on the session's 4-rank world:
at tp 1 every value and gradient is right (thd, bshd, zigzag CP through reconstruct_tensor_cp),
and at tp > 1 the log-prob gradient is wrong (the live finding: vocab_parallel_utils's all-reduces
have no backward), values right; a `shardcheck repro` script of it, run with torch and
megatron-core alone, finds that gradient. With SHARDCHECK_MS_SWIFT_REPO (a clone with ms-swift's
history, the pull-request refs included): the merged fix #9960 (abfe0c447, PackedSeqParams
without total_tokens) passes where its parent a54a4ae5c raised; the fix of PR #9947 (its head
0684a6d83, megatron-core's vocab_parallel_cross_entropy; open, not merged at the pin) passes
where its parent 225b1a0eb fails, and the repro script finds nothing there. With
SHARDCHECK_MCORE_BRIDGE_SRC (a modelscope/mcore-bridge checkout) its split_cp_inputs splits the
CP rows, else the harness's zigzag split stands in.

Over 20 s: with a checkout and its history (about 35 s on a 2-core VM), two world runs of two
exported commits each, the pin's smoke scenarios, and the repro script run twice in a world of its
own (each run imports megatron-core on every rank); without them, under a second."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from conftest import export_commit, run_cli, run_on_world, torch_only_python
from shardcheck.errors import BadInput
from shardcheck.scenarios import Scenario, get_suite
from shardcheck.targets import ms_swift
from shardcheck.targets.base import TargetConfig

SRC = os.environ.get(ms_swift.ENV)
REPO_ENV = "SHARDCHECK_MS_SWIFT_REPO"
needs_src = pytest.mark.skipif(not SRC, reason=f"{ms_swift.ENV} is not set: no ms-swift checkout to check (export "
                                               "modelscope/ms-swift at ci/frameworks.toml's pin and point it there)")
needs_history = pytest.mark.skipif(
    not os.environ.get(REPO_ENV), reason=f"{REPO_ENV} is not set: no ms-swift git repository with its history and "
    "pull-request refs (a clone of modelscope/ms-swift) to check other commits against")
# PR #9947 "Fix Megatron GRPO vocab-parallel log-prob gradients", open (not merged) at the pin: its head
# (refs/pull/9947/head) and that head's parent, an ancestor of the pin
FIX = "0684a6d838775a0ea91f73daf4d88a225f2a4297"
PARENT = "225b1a0eb455aca3d54fc4d9e34a5a146b154ae9"
# the smallest scenario of the finding: one sample of two tokens, vocabulary 4 split over tp 2
TINY = {"name": "tiny-tp2", "samples": [[2, 1]], "vocab": 4, "tp": 2, "with_entropy": False, "entropy_coef": 0.0,
        "seed": 1}
# the same with an entropy term: vocab_parallel_log_softmax's gradient, which the fix leaves as it was
TINY_ENTROPY = dict(TINY, name="tiny-tp2-entropy", with_entropy=True, entropy_coef=0.1)
# PR #9960 "fix：(megatron 0.16.1) support PackedSeqParams without total_tokens", merged (an ancestor of the pin):
# get_packed_seq_params passed total_tokens=, which megatron-core 0.16's PackedSeqParams does not take (since
# ca937fbaf, 2026-08-11); the fix sets it only where the field exists
MERGED_FIX = "abfe0c4476b86fc648a603fa089dd4a9ef3883ee"
MERGED_PARENT = "a54a4ae5c8680451ba4ddc91ad4577a38c74d560"
# its smallest scenario: one packed (padding_free) sample of two tokens; right-padded, the same never builds them
TINY_THD = {"name": "tiny-thd", "samples": [[2, 1]], "vocab": 4, "tp": 1, "with_entropy": False, "entropy_coef": 0.0,
            "seed": 1}
TINY_BSHD = dict(TINY_THD, name="tiny-bshd", layout="bshd")
PIN_SCENARIOS = ("thd-tp1cp1-basic", "bshd-tp1cp1-edges", "zigzag-tp1cp2-edges", "zigzag-tp1cp4-long-prompt",
                 "thd-tp2cp1-many", "allgather-tp1cp2-basic")


def test_a_folder_that_is_not_an_ms_swift_checkout_is_one_line(tmp_path):
    with pytest.raises(BadInput) as exc:
        ms_swift.target(None, TargetConfig(str(tmp_path)))
    assert "ms-swift" in str(exc.value) and "\n" not in str(exc.value)


def test_an_mcore_bridge_option_that_is_not_a_checkout_is_one_line(tmp_path):
    with pytest.raises(BadInput) as exc:
        ms_swift.bridge_source(TargetConfig(None, (("mcore_bridge", str(tmp_path)),)))
    assert "mcore-bridge" in str(exc.value) and "\n" not in str(exc.value)


@needs_src
@pytest.mark.world
def test_at_the_pin_tp_1_is_right_and_tp_2_has_the_wrong_log_prob_gradient(world, tmp_path, monkeypatch):
    from shardcheck.targets.base import SRC_ENV

    monkeypatch.setenv(SRC_ENV, SRC)
    scenarios = [s for s in get_suite("smoke") if s.name in PIN_SCENARIOS]
    verdicts = {v["name"]: v for v in run_on_world(world, scenarios, "ms_swift", tmp_path / "pin.json",
                                                   "smoke").report["scenarios"]}
    for name in PIN_SCENARIOS[:4]:
        assert verdicts[name]["verdict"] == "pass", (name, verdicts[name].get("failures"))
    live = verdicts["thd-tp2cp1-many"]
    assert live["kinds"] == ["grad_mismatch"] and live["max_error"]["log_probs"] < 1e-5, live
    assert live["max_error"]["grad"] > 0.1, live["max_error"]
    assert verdicts["allgather-tp1cp2-basic"]["verdict"] == "skip"
    assert "all-gather" in verdicts["allgather-tp1cp2-basic"]["reason"]


def _verdicts_at(world, tmp_path, monkeypatch, commit: str, name: str, scenarios: list) -> dict:
    """The scenarios' verdicts with ``commit`` exported from the history clone (its swift/ folder)."""
    src = export_commit(os.environ[REPO_ENV], commit, tmp_path / name, "swift")
    monkeypatch.setenv(ms_swift.ENV, src)
    monkeypatch.setenv("SHARDCHECK_MS_SWIFT_COMMIT", commit)
    report = run_on_world(world, scenarios, "ms_swift", tmp_path / f"{name}.json", name).report
    assert report["target"]["commit"] == commit
    return {v["name"]: v for v in report["scenarios"]}


@needs_history
@pytest.mark.world
def test_the_merged_fix_9960_builds_packed_seq_params_that_its_parent_could_not(world, tmp_path, monkeypatch):
    """At #9960's parent every padding_free forward_step raised (rank_error: prepare_batch's
    get_packed_seq_params hands megatron-core 0.16's PackedSeqParams a total_tokens it has no field
    for); the right-padded path, which builds none, passed; at the merged fix both pass."""
    import dataclasses

    from megatron.core.packed_seq_params import PackedSeqParams

    if "total_tokens" in {f.name for f in dataclasses.fields(PackedSeqParams)}:
        pytest.skip("the installed megatron-core's PackedSeqParams has total_tokens: the parent's call is valid there")
    scenarios = [Scenario.from_dict(TINY_THD), Scenario.from_dict(TINY_BSHD)]
    parent = _verdicts_at(world, tmp_path, monkeypatch, MERGED_PARENT, "parent", scenarios)
    [failure] = parent["tiny-thd"]["failures"]
    assert failure["kind"] == "rank_error", failure
    assert "TypeError: PackedSeqParams.__init__() got an unexpected keyword argument 'total_tokens'" in failure["message"]
    assert "swift/megatron/utils/utils.py:245 in get_packed_seq_params" in failure["message"], failure
    assert parent["tiny-bshd"]["verdict"] == "pass", parent["tiny-bshd"].get("failures")
    fix = _verdicts_at(world, tmp_path, monkeypatch, MERGED_FIX, "fix", scenarios)
    assert fix["tiny-thd"]["verdict"] == fix["tiny-bshd"]["verdict"] == "pass", fix["tiny-thd"].get("failures")


@needs_history
@pytest.mark.world
def test_the_unmerged_pr_9947_fixes_the_log_prob_gradient_and_leaves_the_log_softmax_one(world, tmp_path, monkeypatch):
    """PR #9947 is not merged at the pin (its head is refs/pull/9947/head): at the head's parent the
    tiny scenario's gradient is wrong (grad_mismatch, values right); at the head it passes; with an entropy term it fails at both (vocab_parallel_log_softmax's
    all-reduces, which the fix does not touch: the latent finding of docs/ms-swift.md)."""
    scenarios = [Scenario.from_dict(TINY), Scenario.from_dict(TINY_ENTROPY)]
    parent = _verdicts_at(world, tmp_path, monkeypatch, PARENT, "parent", scenarios)
    fix = _verdicts_at(world, tmp_path, monkeypatch, FIX, "fix", scenarios)
    assert parent["tiny-tp2"]["kinds"] == ["grad_mismatch"], parent["tiny-tp2"]
    assert parent["tiny-tp2"]["max_error"]["log_probs"] < 1e-6
    assert fix["tiny-tp2"]["verdict"] == "pass", fix["tiny-tp2"].get("failures")
    assert parent["tiny-tp2-entropy"]["kinds"] == fix["tiny-tp2-entropy"]["kinds"] == ["grad_mismatch"]


@pytest.fixture(scope="module")
def repro(tmp_path_factory) -> tuple[str, str]:
    """`shardcheck repro` of the tiny scenario, written once from the pin's checkout, and a python
    that reaches torch and megatron-core alone (no shardcheck): (python, script)."""
    folder = tmp_path_factory.mktemp("repro")
    (folder / "tiny.json").write_text(json.dumps([TINY]))
    made = run_cli("repro", "--target", "ms_swift", "--ms-swift-src", SRC, "--scenario-file", str(folder / "tiny.json"),
                   "--scenario", "tiny-tp2", "--out", str(folder / "repro.py"), cwd=str(folder))
    assert made.returncode == 0, made.stderr
    return torch_only_python(folder), str(folder / "repro.py")


def _run_script(python: str, script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([python, script, *args], capture_output=True, text=True, timeout=300, cwd=os.path.dirname(script))


@needs_src
def test_a_repro_script_finds_the_tp_gradient_with_torch_megatron_core_and_ms_swift_alone(repro):
    """The script (no shardcheck: a venv that reaches torch and megatron-core alone) runs forward_step
    and its callees from the checkout and names the wrong gradient of the live finding: exit 1."""
    ran = _run_script(*repro)
    assert ran.returncode == 1, ran.stdout[-2000:] + ran.stderr[-2000:]
    assert "FOUND in ms_swift" in ran.stdout and "raised" not in ran.stdout, ran.stdout
    assert "rank 0 logits row [0, 0] column 0: gradient 0, want -0.17090442" in ran.stdout, ran.stdout
    assert "rank 1 logits row [0, 0] column 3: gradient -0.69476461, want -0.28584406" in ran.stdout, ran.stdout


@needs_src
@needs_history
def test_the_repro_script_finds_nothing_at_pr_9947s_fix(repro, tmp_path):
    """The same script pointed at PR #9947's head (--src): every value and gradient right, exit 0."""
    fixed = export_commit(os.environ[REPO_ENV], FIX, tmp_path / "fix", "swift")
    ran = _run_script(*repro, "--src", fixed)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    assert ran.stdout.startswith("NOT FOUND: ms_swift"), ran.stdout
