"""The areal:fsdp target (AReaL's FSDP engine with Ulysses sequence parallelism and vocab-parallel
TP). Checking real AReaL needs a checkout (never pip install areal): set SHARDCHECK_AREAL_SRC to a
clone of inclusionAI/AReaL. Without one only the refusals run (no world, well under a second);
with one, the sequence_parallel and logprob suites and a few scenarios with a Ulysses pad and a
temperature run: sp 4 and tp on the session's 4-rank world, sp 2 on its 2-rank world (on gloo
torch's all-gather backward runs only on an sp group of global ranks 0..sp-1, so a 4-rank world's
second sp-2 replica cannot run it: see the target's docstring). A few seconds."""

import os
from pathlib import Path

import pytest

from conftest import export_commit, run_on_world
from shardcheck.errors import BadInput
from shardcheck.scenarios.scenario import Scenario
from shardcheck.scenarios.suites import get_suite
from shardcheck.targets import areal, resolve
from shardcheck.targets.areal import ENV
from shardcheck.targets.areal_fsdp import CLASS, CONTEXT, ENGINE_FILE, METHODS
from shardcheck.targets.base import TargetConfig
from shardcheck.targets.frameworks import areal_target as target

AREAL_SRC = os.environ.get(ENV)
SPEC = "shardcheck.targets.areal_fsdp:make"  # by module path: the registry's metadata may be stale
needs_areal = pytest.mark.skipif(not AREAL_SRC, reason=f"{ENV} is not set: no AReaL checkout to check (clone "
                                 "inclusionAI/AReaL and point it there; never pip install areal)")


def test_the_variant_is_listed_and_needs_a_checkout_with_the_fsdp_engine(tmp_path, monkeypatch):
    assert "fsdp" in target.variants and "fsdp" in areal.target.variants
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(BadInput, match=ENV):
        target("fsdp")
    # a folder without the FSDP engine's file is not a checkout this target reads
    with pytest.raises(BadInput, match=f"no {ENGINE_FILE}"):
        target("fsdp", TargetConfig(str(tmp_path)))
    # an FSDP engine file without the methods (nor the inline era's forward): refused in one line
    engine = tmp_path / ENGINE_FILE
    engine.parent.mkdir(parents=True)
    engine.write_text("class FSDPEngine:\n    pass\n")
    with pytest.raises(BadInput, match="no FSDP engine") as exc:
        target("fsdp", TargetConfig(str(tmp_path)))
    assert str(ENGINE_FILE) in str(exc.value) and "\n" not in str(exc.value)
    engine.write_text(f"class {CONTEXT}:\n    pass\n\nclass {CLASS}:\n"
                      + "".join(f"    def {m}(self):\n        return undefined_name\n\n" for m in METHODS))
    with pytest.raises(BadInput, match="option cp_all_gather is not areal:fsdp's"):
        target("fsdp", TargetConfig(str(tmp_path), (("cp_all_gather", "torch"),)))
    with pytest.raises(BadInput, match="path='backward': expected train or forward"):
        target("fsdp", TargetConfig(str(tmp_path), (("path", "backward"),)))
    with pytest.raises(BadInput, match="no areal/models/fsdp/ulysses.py or areal/utils/ulysses.py"):
        target("fsdp", TargetConfig(str(tmp_path)))
    # the inline era (FSDPEngine.forward with the Ulysses gather in it): its forward path only
    engine.write_text("class FSDPEngine:\n    def forward(self, input_, post_hook=None):\n"
                      "        return ulysses_pad_and_slice_inputs(input_)\n")
    (tmp_path / "areal/utils").mkdir(parents=True)
    (tmp_path / "areal/utils/ulysses.py").write_text("")
    with pytest.raises(BadInput, match="computes log-probs inline in FSDPEngine.forward.*path=forward"):
        target("fsdp", TargetConfig(str(tmp_path)))
    assert target("fsdp", TargetConfig(str(tmp_path), (("path", "forward"),))).era.kind == "inline"
    # areal's own factory: fsdp is the registered one's, path is fsdp's
    with pytest.raises(BadInput, match="built by the registered target"):
        areal.target("fsdp", TargetConfig(str(tmp_path)))
    with pytest.raises(BadInput, match="option path applies to areal:fsdp only"):
        target("engine", TargetConfig(str(tmp_path), (("path", "train"),)))


# scenarios the suites leave out: a Ulysses pad of 1 (packed length 7 at sp 2) with a temperature, three
# samples at sp 4 (pad 3), and vocab-parallel TP at sp 1 with a temperature
EXTRA = [
    {"name": "ulysses-sp2-odd-temp", "samples": [[5, 3], [2, 1]], "vocab": 16, "sp": 2, "layout": "ulysses",
     "entropy_coef": 0.05, "temperature": 0.7, "seed": 601},
    {"name": "ulysses-sp4-three-samples", "samples": [[11, 4], [7, 5], [3, 2]], "vocab": 48, "sp": 4,
     "layout": "ulysses", "entropy_coef": 0.1, "temperature": 0.7, "seed": 602},
    {"name": "thd-tp2-temp", "samples": [[12, 5], [7, 3]], "vocab": 32, "tp": 2, "entropy_coef": 0.1,
     "temperature": 1.3, "seed": 603},
]


@needs_areal
@pytest.mark.world
def test_the_fsdp_engine_matches_the_reference_under_ulysses_and_tp(world, world2, tmp_path):
    """FSDPEngine._prepare_mb_inputs -> _compute_logprobs_and_loss at sp 1, 2 and 4 and tp 1, 2 and 4:
    values and gradients right (dist_F.all_gather's backward sums over the sp group, the harness's
    contract); bshd, CP and the ring layout skipped with their reasons, tp 2 x sp 2 with torch's gloo
    limitation; coverage names the engine's methods, Ulysses' and vocab_parallel's functions."""
    scenarios = get_suite("sequence_parallel") + get_suite("logprob") + [Scenario.from_dict(sc) for sc in EXTRA]
    on2 = [sc for sc in scenarios if sc.sp == 2]
    runs = [run_on_world(world, [sc for sc in scenarios if sc.sp != 2], SPEC, tmp_path / "r4.json", "areal-fsdp"),
            run_on_world(world2, on2, SPEC, tmp_path / "r2.json", "areal-fsdp")]
    verdicts = {v["name"]: v for run in runs for v in run.report["scenarios"]}
    failed = {n: v.get("failures") for n, v in verdicts.items() if v["verdict"] not in ("pass", "skip")}
    assert not failed, runs[0].stdout[-3000:] + runs[1].stdout[-3000:]
    assert all(v["reason"] for v in verdicts.values() if v["verdict"] == "skip")
    passed = {n for n, v in verdicts.items() if v["verdict"] == "pass"}
    assert {"ulysses-sp2-padded", "ulysses-sp4-padding-rank", "ulysses-sp2-exact", "ulysses-sp2-odd-temp",
            "ulysses-sp4-three-samples", "thd-tp2-temp", "thd-tp1cp1-basic-logprob", "thd-tp2cp1-basic-logprob",
            "thd-tp4cp1-basic-logprob"} <= passed
    assert "_AlltoAll" in verdicts["ulysses-tp2-sp2-chunks"]["reason"]
    assert "packs every micro-batch" in verdicts["bshd-tp1cp1-basic-logprob"]["reason"]
    # the rows were learned through the position trace from AReaL's own _prepare_mb_inputs
    assert {verdicts[n].get("layout_built_by") for n in passed} == {f"{ENGINE_FILE}:{CLASS}._prepare_mb_inputs"}
    report = runs[0].report["target"]
    assert report["name"] == "areal:fsdp" and report["src"] == str(Path(AREAL_SRC).resolve())
    assert {"gather_logprobs_entropy", "ulysses_prepare_inputs", "dist_F"} <= set(
        report["names_bound_from_the_engine_file's_imports"])
    # coverage on one scenario: sp 2 with a Ulysses pad
    covered = run_on_world(world2, [Scenario.from_dict(EXTRA[0])], SPEC, tmp_path / "c.json", "areal-fsdp",
                           coverage=True)
    assert covered.exit_code == 0, covered.stdout[-3000:]
    ran = {name for f in covered.report["coverage"]["files"].values() for name in f["functions"]}
    for name in (f"{ENGINE_FILE}:FSDPEngine._prepare_mb_inputs", f"{ENGINE_FILE}:FSDPEngine._sp_all_gather",
                 f"{ENGINE_FILE}:FSDPEngine._compute_logprobs_entropy",
                 f"{ENGINE_FILE}:FSDPEngine._compute_logprobs_and_loss",
                 "areal/models/fsdp/ulysses.py:ulysses_pad_and_slice_inputs",
                 "areal/models/fsdp/ulysses.py:ulysses_prepare_inputs",
                 "areal/utils/functional/vocab_parallel.py:gather_logprobs_entropy"):
        assert name in ran, sorted(ran)


@needs_areal
@pytest.mark.world
def test_the_forward_path_matches_the_reference(world2, tmp_path, monkeypatch):
    """path=forward: _compute_forward_result -> _compute_logprobs (log-probs only) at sp 2 with a pad."""
    import json

    from shardcheck.targets.base import OPTS_ENV

    monkeypatch.setenv(OPTS_ENV, json.dumps([["path", "forward"]]))
    sc = dict(EXTRA[0], name="ulysses-sp2-odd-forward", with_entropy=False, entropy_coef=0.0)
    run = run_on_world(world2, [Scenario.from_dict(sc)], SPEC, tmp_path / "f.json", "areal-fsdp")
    assert run.exit_code == 0 and run.report["scenarios"][0]["verdict"] == "pass", run.stdout[-3000:]
    assert run.report["target"]["path"] == "forward"


@needs_areal
def test_the_registered_name_builds_it():
    built = resolve("areal:fsdp", TargetConfig(None))
    assert built.name == "areal:fsdp" and {"thd", "ulysses"} == set(built.capabilities.layouts)


REPO_ENV = "SHARDCHECK_AREAL_REPO"
# "[Bug Fix] Fix bugs in FSDP ulysses sequence parallel and megatron engine. (#292)" (PR 803, "fix the
# all-gather bug with ulysses"): in FSDPEngine.forward (and train_batch, eval_batch) the last sp rank trimmed
# its Ulysses pad from its local logits before dist_F.all_gather, so the ranks gathered unequal sizes (NCCL
# hangs or errors, gloo aborts); the fix trims the gathered logits. Packed length 7 at sp 2 (pad 1): rank 0
# gathers [4, V], rank 1 [3, V]. The engine is the inline era's (PPOActor.compute_logp -> FSDPEngine.forward).
FIX, FIX_PARENT = "08e703258", "1214477438471e0d18e0d2779facb2e254327ee3"
ODD = {"name": "ulysses-sp2-odd", "samples": [[5, 3], [2, 1]], "vocab": 16, "sp": 2, "layout": "ulysses",
       "with_entropy": False, "entropy_coef": 0.0, "temperature": 0.7, "seed": 701}
EVEN = dict(ODD, name="ulysses-sp2-even", samples=[[5, 3], [3, 1]])


def _repo_with(commit: str) -> str | None:
    import subprocess

    for repo in (os.environ.get(REPO_ENV), AREAL_SRC):
        if repo and subprocess.run(["git", "-C", repo, "cat-file", "-e", f"{commit}^{{commit}}"],
                                   capture_output=True).returncode == 0:
            return repo
    return None


@pytest.mark.world
def test_the_ulysses_all_gather_fix_fails_at_its_parent_and_passes_at_the_fix(world2, tmp_path, monkeypatch):
    """08e703258: at its parent the all-gather of unequal sizes (a collective mismatch, the shapes
    named) where the packed length is not a multiple of sp, a pass where it is; at the fix both pass."""
    import json

    from shardcheck.targets.base import OPTS_ENV, SRC_ENV

    repo = _repo_with(FIX)
    if repo is None:
        pytest.skip(f"neither {REPO_ENV} nor {ENV} is an AReaL git repository holding {FIX} (a clone of "
                    "inclusionAI/AReaL with its history)")
    monkeypatch.setenv(OPTS_ENV, json.dumps([["path", "forward"]]))
    scenarios = [Scenario.from_dict(ODD), Scenario.from_dict(EVEN)]
    said = {}
    for name, rev in (("parent", FIX_PARENT), ("fix", FIX)):
        monkeypatch.setenv(SRC_ENV, export_commit(repo, rev, tmp_path / name, "areal"))
        said[name] = run_on_world(world2, scenarios, SPEC, tmp_path / f"{name}.json", "fixes")
    parent = {v["name"]: v for v in said["parent"].report["scenarios"]}
    assert parent["ulysses-sp2-odd"]["verdict"] == "fail", said["parent"].stdout[-3000:]
    assert {f["kind"] for f in parent["ulysses-sp2-odd"]["failures"]} == {"collective_mismatch"}
    assert "all_gather(float32[4x16])" in said["parent"].stdout and "all_gather(float32[3x16])" in said[
        "parent"].stdout, said["parent"].stdout[-3000:]
    assert parent["ulysses-sp2-even"]["verdict"] == "pass", said["parent"].stdout[-3000:]
    assert said["parent"].report["target"]["era"]["kind"] == "inline"
    assert said["fix"].exit_code == 0, said["fix"].stdout[-3000:]


@needs_areal
@pytest.mark.world
def test_the_engines_groups_are_built_by_areals_own_parallel_helper():
    """sp 2, traced: AReaL's create_process_group lines build ParallelHelper's mesh (dp, sp, tp) in
    the framework groups set-up (its barrier and the harness's check of the groups against its
    own), and the engine's _sp_all_gather runs on that mesh's sp group [0, 1]. A 2-rank world of
    its own: the session's worlds keep the mesh the tests above built, and build none again. A
    few seconds."""
    from shardcheck.harness.controller.commands import runner
    from shardcheck.harness.controller.reports.run_report import SilentReport
    from shardcheck.harness.controller.worlds.spawned import SpawnedWorld

    with SpawnedWorld(2, timeout=20) as fresh:
        result = runner.run([Scenario.from_dict(EXTRA[0])], SPEC, reporter=SilentReport(), world=fresh, trace=True)
    assert result.exit_code == 0, [v.headline() for v in result.verdicts]
    calls = [c for trace in result.verdicts[0].traces.values() for c in trace]
    set_up = [c for c in calls if c["phase"] == "framework groups set-up"]
    assert {c["op"] for c in set_up} >= {"barrier", "all_gather"}, set_up
    gathers = {tuple(c["ranks"]) for c in calls if c["op"] == "all_gather" and str(ENGINE_FILE) in c["site"]}
    assert gathers == {(0, 1)}, calls
    described = resolve("areal:fsdp", TargetConfig(None)).description()["process_groups"]
    assert described.startswith("built by AReaL's own code") and "ParallelHelper" in described, described
