"""The verl:fsdp target (verl's FSDP engine with Ulysses sequence parallelism). Checking real
verl needs a checkout (never pip install verl: it pulls ray): set SHARDCHECK_VERL_SRC to a clone
of verl-project/verl. Without one only the refusals run (no world, well under a second); with
one, the sequence_parallel and logprob suites and a few float32 scenarios with chunked entropy and
a temperature run on the session's 4-rank world (a few seconds); with a verl clone holding its
history (SHARDCHECK_VERL_REPO, or SHARDCHECK_VERL_SRC a clone), three fixed bugs of the engine's
path fail at their parent and pass at their fix (about a second each)."""

import os
from pathlib import Path

import pytest

from conftest import export_commit, run_on_world
from shardcheck.errors import BadInput
from shardcheck.scenarios.scenario import Scenario
from shardcheck.scenarios.suites import get_suite
from shardcheck.targets import resolve
from shardcheck.targets.base import TargetConfig
from shardcheck.targets.frameworks import verl_target as target
from shardcheck.targets.verl import ENV
from shardcheck.targets.verl_fsdp import ENGINE_FILE, METHODS

VERL_SRC = os.environ.get(ENV)
SPEC = "shardcheck.targets.verl_fsdp:make"  # by module path: the registry's metadata may be stale
needs_verl = pytest.mark.skipif(not VERL_SRC, reason=f"{ENV} is not set: no verl checkout to check (clone "
                                "verl-project/verl and point it there; never pip install verl, it pulls ray)")


def test_the_variant_is_listed_and_needs_a_checkout_with_the_fsdp_engine(tmp_path, monkeypatch):
    assert "fsdp" in target.variants
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(BadInput, match=ENV):
        target("fsdp")
    # a verl checkout (its marker file) without the FSDP engine: refused in one line, naming what is missing
    marker = tmp_path / "verl/utils/megatron/tensor_parallel.py"
    marker.parent.mkdir(parents=True)
    marker.write_text("")
    with pytest.raises(BadInput, match="no FSDP engine") as exc:
        target("fsdp", TargetConfig(str(tmp_path)))
    assert str(ENGINE_FILE) in str(exc.value) and "\n" not in str(exc.value)
    engine = tmp_path / ENGINE_FILE
    engine.parent.mkdir(parents=True)
    engine.write_text("class FSDPEngineWithLMHead:\n" + "".join(f"    def {m}(self):\n        return undefined_name\n\n"
                                                               for _, m in METHODS))
    with pytest.raises(BadInput, match="option entropy_chunking is not verl:fsdp's"):
        target("fsdp", TargetConfig(str(tmp_path), (("entropy_chunking", "true"),)))
    with pytest.raises(BadInput, match="fused_kernels='triton': expected torch or off"):
        target("fsdp", TargetConfig(str(tmp_path), (("fused_kernels", "triton"),)))
    with pytest.raises(BadInput, match="fused_kernels applies to verl:fsdp only"):
        target("actor", TargetConfig(str(tmp_path), (("fused_kernels", "torch"),)))


# float32 scenarios the suites leave out at tp 1: chunked entropy (verl's entropy_from_logits_with_chunking)
# under sp 2 and without padding removal (bshd), each with a temperature
EXTRA = [
    {"name": "ulysses-sp2-chunks-temp", "samples": [[17, 9], [6, 2]], "vocab": 32, "sp": 2, "layout": "ulysses",
     "entropy_coef": 0.05, "log_probs_chunk_size": 4, "temperature": 0.8, "seed": 401},
    {"name": "ulysses-sp4-three-samples", "samples": [[11, 4], [7, 5], [3, 2]], "vocab": 48, "sp": 4,
     "layout": "ulysses", "entropy_coef": 0.1, "temperature": 0.7, "seed": 402},
    {"name": "bshd-chunks-temp", "samples": [[12, 5], [7, 3]], "vocab": 32, "layout": "bshd", "entropy_coef": 0.1,
     "log_probs_chunk_size": 3, "temperature": 1.3, "seed": 404},
]


@needs_verl
@pytest.mark.world
def test_the_fsdp_engine_matches_the_reference_under_ulysses(world, tmp_path):
    """verl's FSDPEngineWithLMHead.prepare_model_inputs / prepare_model_outputs at sp 1, 2 and 4:
    values and gradients right (Gather's backward scales by sp, the harness's contract); TP, CP and
    the ring layout skipped with their reasons; coverage names the engine's methods and Ulysses'."""
    scenarios = (get_suite("sequence_parallel") + get_suite("logprob")
                 + [Scenario.from_dict(sc) for sc in EXTRA])
    run = run_on_world(world, scenarios, SPEC, tmp_path / "r.json", "verl-fsdp")
    verdicts = {v["name"]: v for v in run.report["scenarios"]}
    failed = {n: v.get("failures") for n, v in verdicts.items() if v["verdict"] not in ("pass", "skip")}
    assert not failed, run.stdout[-4000:]
    assert all(v["reason"] for v in verdicts.values() if v["verdict"] == "skip")
    passed = {n for n, v in verdicts.items() if v["verdict"] == "pass"}
    assert {"ulysses-sp2-padded", "ulysses-sp4-padding-rank", "ulysses-sp2-exact", "bshd-chunks-temp",
            "ulysses-sp2-chunks-temp", "thd-tp1cp1-basic-logprob", "bshd-tp1cp1-basic-logprob"} <= passed
    assert "vocab-parallel" in verdicts["ulysses-tp2-sp2-chunks"]["reason"]
    # the rows were learned through the position trace from verl's own prepare_model_inputs
    assert {verdicts[n].get("layout_built_by") for n in passed} == {
        f"{ENGINE_FILE}:FSDPEngineWithLMHead.prepare_model_inputs"}, run.stdout[-2000:]
    assert run.report["target"]["name"] == "verl:fsdp" and run.report["target"]["src"] == str(Path(VERL_SRC).resolve())
    # coverage on one scenario (it costs seconds a scenario): sp 2, chunked entropy
    covered = run_on_world(world, [Scenario.from_dict(EXTRA[0])], SPEC, tmp_path / "c.json", "verl-fsdp",
                           coverage=True)
    assert covered.exit_code == 0, covered.stdout[-3000:]
    ran = {name for f in covered.report["coverage"]["files"].values() for name in f["functions"]}
    for name in (f"{ENGINE_FILE}:FSDPEngineWithLMHead.prepare_model_inputs",
                 f"{ENGINE_FILE}:FSDPEngineWithLMHead.prepare_model_outputs",
                 "verl/utils/ulysses.py:ulysses_pad_and_slice_inputs", "verl/utils/ulysses.py:gather_outputs_and_unpad",
                 "verl/utils/ulysses.py:Gather.backward", "verl/utils/torch_functional.py:logprobs_from_logits",
                 "verl/utils/torch_functional.py:entropy_from_logits_with_chunking",
                 "verl/workers/utils/padding.py:no_padding_2_padding"):
        assert name in ran, sorted(ran)


@needs_verl
@pytest.mark.world
def test_the_ulysses_gathers_go_to_the_groups_verls_own_mesh_built(world2):
    """sp 2 twice on the 2-rank world (no other test builds verl's mesh there): verl's own
    FSDPEngine._init_device_mesh builds the meshes in the first scenario only (the harness's set-up
    barrier and its check of the groups against its own, none in the second; coverage names it and
    create_device_mesh), and every gather of verl's gather_outputs_and_unpad goes to that mesh's sp
    group, the same one in both scenarios; both pass."""
    from shardcheck.harness.controller.commands import runner
    from shardcheck.harness.controller.reports.run_report import SilentReport

    scenarios = [Scenario.from_dict({"name": f"sp2-{i}", "samples": [[9, 4], [6, 3]], "vocab": 16, "sp": 2,
                                     "layout": "ulysses", "entropy_coef": 0.1, "seed": 510 + i}) for i in range(2)]
    result = runner.run(scenarios, SPEC, reporter=SilentReport(), world=world2, trace=True, coverage=True)
    assert result.exit_code == 0, [v.headline() for v in result.verdicts]
    described = result.info.target
    assert described["era"]["device_mesh"] and described["ulysses_group"].startswith(
        "built by verl's FSDPEngine._init_device_mesh"), described
    first, second = ([c for trace in v.traces.values() for c in trace] for v in result.verdicts)
    set_up = [c for c in first if c["phase"] == "framework groups set-up"]
    assert {c["op"] for c in set_up} >= {"barrier", "all_gather"}, first
    assert not [c for c in second if c["phase"] == "framework groups set-up"]
    gathers = [c for c in first + second if "verl/utils/ulysses.py:" in c["site"]]
    assert gathers and {c["op"] for c in gathers} == {"all_gather_into_tensor"}, first + second
    assert {(c["group"], tuple(c["ranks"])) for c in gathers} == {(gathers[0]["group"], (0, 1))}, gathers
    ran = {name for f in result.info.coverage["files"].values() for name in f["functions"]}
    assert {f"{ENGINE_FILE}:FSDPEngine._init_device_mesh",
            "verl/workers/engine/fsdp/utils.py:create_device_mesh"} <= ran, sorted(ran)


@needs_verl
def test_the_registered_name_builds_it():
    built = resolve("verl:fsdp", TargetConfig(None))
    assert built.name == "verl:fsdp" and built.capabilities.tp_sizes == frozenset({1})
    assert {"thd", "bshd", "ulysses"} == set(built.capabilities.layouts)


REPO_ENV = "SHARDCHECK_VERL_REPO"
# (fix, option, scenario, the parent's finding kinds, a line of the parent's report)
FIXES = [
    # "[model, fsdp] fix: honor SP-rolled labels in fused kernels (#6068) (#6268)": with use_fused_kernels and
    # Ulysses sp 2, the model's fused forward (dense_common.forward_with_torch_backend) rolled its own SP slice of
    # the ids: the last row of SP rank 0's slice got its slice's first token as its label, not the next slice's.
    # Packed length 7 (5 + 2, padded to 8): row 3 scores sample 0's response token 2. The fix hands the model
    # the engine's globally rolled labels (shift_labels).
    ("575d5a8ab", "torch",
     {"name": "fused-sp2", "samples": [[5, 3], [2, 1]], "vocab": 16, "sp": 2, "layout": "ulysses",
      "with_entropy": False, "entropy_coef": 0.0, "seed": 501},
     {"value_mismatch", "grad_mismatch"}, "log_probs sample 0 token 2"),
    # "[fsdp] fix: FSDP logits temperature scaling for view tensors (#6935)": prepare_model_outputs divided the
    # model's logits by the temperature in place (div_ on the squeeze(0) view); out of place since
    ("51504d849", "off",
     {"name": "thd-temperature", "samples": [[9, 4], [6, 3]], "vocab": 32, "entropy_coef": 0.1,
      "temperature": 0.8, "seed": 503},
     {"input_mutated"}, "aten.div_.Tensor at"),
    # "[fsdp] fix: build no-padding attention mask from input ids (#6345)": without padding removal the engine
    # built the model's attention mask from the response-only loss_mask (each sample's prompt hidden)
    ("baccd33a0", "off",
     {"name": "bshd", "samples": [[9, 4], [6, 3]], "vocab": 32, "layout": "bshd", "entropy_coef": 0.1,
      "seed": 504},
     {"rank_error"}, "hands the model attention_mask"),
]


def _repo_with(commit: str) -> str | None:
    import subprocess

    for repo in (os.environ.get(REPO_ENV), VERL_SRC):
        if repo and subprocess.run(["git", "-C", repo, "cat-file", "-e", f"{commit}^{{commit}}"],
                                   capture_output=True).returncode == 0:
            return repo
    return None


@pytest.mark.world
@pytest.mark.parametrize("fix, fused, scenario, kinds, line", FIXES, ids=[f[0] for f in FIXES])
def test_a_fixed_fsdp_engine_bug_fails_at_the_parent_and_passes_at_the_fix(fix, fused, scenario, kinds, line, world,
                                                                           tmp_path, monkeypatch):
    """Each of three fixes to verl's FSDP engine path (FIXES): the parent's finding, then a pass."""
    import json

    from shardcheck.targets.base import OPTS_ENV, SRC_ENV

    repo = _repo_with(fix)
    if repo is None:
        pytest.skip(f"neither {REPO_ENV} nor {ENV} is a verl git repository holding {fix} (a clone of "
                    "verl-project/verl with its history)")
    monkeypatch.setenv(OPTS_ENV, json.dumps([["fused_kernels", fused]]))
    said = {}
    for name, rev in (("parent", f"{fix}~1"), ("fix", fix)):
        monkeypatch.setenv(SRC_ENV, export_commit(repo, rev, tmp_path / name, "verl"))
        said[name] = run_on_world(world, [Scenario.from_dict(scenario)], SPEC, tmp_path / f"{name}.json", "fixes")
    parent = said["parent"].report["scenarios"][0]
    assert parent["verdict"] == "fail", said["parent"].stdout[-3000:]
    assert {f["kind"] for f in parent["failures"]} == kinds, parent["failures"]
    assert line in said["parent"].stdout, said["parent"].stdout[-3000:]
    assert said["fix"].exit_code == 0, said["fix"].stdout[-3000:]
    assert said["fix"].report["target"]["fused_kernels"] == fused
