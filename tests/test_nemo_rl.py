"""The nemo_rl target. Checking real NeMo-RL needs a checkout (never pip install nemo-rl: it pulls
ray, vLLM and more): set SHARDCHECK_NEMO_RL_SRC to a clone of NVIDIA-NeMo/RL. Era detection,
capabilities, the import's hygiene and bad input are checked on small fake checkouts without it;
the historical fix needs SHARDCHECK_NEMO_RL_REPO (a clone with its history).

Over 20 s: with a checkout (about 110 s here), every variant runs suites on real worlds and the
historical fixes run shardcheck and a repro script at two commits each (without one: 1 s)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import export_commit, run_cli, torch_only_python
from shardcheck.errors import BadInput
from shardcheck.scenarios import suites
from shardcheck.targets import nemo_rl
from shardcheck.targets.base import TargetConfig
from shardcheck.targets.checkout import Checkout
from shardcheck.targets.nemo_rl import ENV, FRAMEWORK, MODULE, SAMPLING_MODULE, detect_era, source

NEMO_RL_SRC = os.environ.get(ENV)
needs_nemo_rl = pytest.mark.skipif(not NEMO_RL_SRC, reason=f"{ENV} is not set: no NeMo-RL checkout to check "
                                   "(clone NVIDIA-NeMo/RL and point it there; never pip install nemo-rl)")

OLD = """
    import torch

    def from_parallel_logits_to_logprobs(vocab_parallel_logits, target, vocab_start_index, vocab_end_index,
                                         group, inference_only=False):
        return None
    """

NEW = """
    import torch

    def from_parallel_logits_to_logprobs(vocab_parallel_logits, target, vocab_start_index, vocab_end_index,
                                         tp_group, inference_only=False, cp_group=None, chunk_size=None,
                                         sampling_params=None):
        return None

    def from_parallel_logits_to_logprobs_packed_sequences(vocab_parallel_logits, target, cu_seqlens_padded,
                                                          unpacked_seqlen, vocab_start_index, vocab_end_index,
                                                          group, inference_only=False, cp_group=None,
                                                          chunk_size=None, sampling_params=None,
                                                          target_is_pre_rolled=False):
        return None

    class ChunkedDistributedEntropy(torch.autograd.Function):
        pass

    class AllGatherCPTensor(torch.autograd.Function):
        def backward(ctx, grad_output):
            index = torch.tensor(
                [0, 1], device="cpu", pin_memory=True
            ).cuda(non_blocking=True)
            return grad_output.index_select(1, index), None, None
    """


def _line(text: str, fragment: str) -> int:
    return next(i for i, line in enumerate(textwrap.dedent(text).splitlines(), 1) if fragment in line)


PIN, CUDA = _line(NEW, "pin_memory"), _line(NEW, ".cuda(")


def _fake_checkout(root, model_utils: str, files: dict | None = None):
    path = root / "nemo_rl" / "distributed" / "model_utils.py"
    path.parent.mkdir(parents=True)
    path.write_text(textwrap.dedent(model_utils))
    for name, text in (files or {}).items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))
    return root


def _scenario(name: str):
    return next(s for s in suites.get_suite("smoke") if s.name == name)


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(nemo_rl, "_cuda_devices", lambda: 0)


def test_era_of_an_old_checkout(tmp_path):
    era = detect_era(_fake_checkout(tmp_path, OLD))
    assert era.tp_group_name == "group"
    assert not era.cp and not era.chunking and not era.sampling
    assert not era.packed and not era.pre_rolled and not era.entropy
    assert era.cuda_calls == () and era.cp_backward_needs_cuda is None


def test_era_of_a_new_checkout(tmp_path):
    era = detect_era(_fake_checkout(tmp_path, NEW))
    assert era.tp_group_name == "tp_group" and era.cp and era.chunking and era.sampling
    assert era.packed and era.pre_rolled and era.entropy
    # pin_memory=True on one line, .cuda() on the next: both named, the first gates cp > 1
    assert era.cuda_calls == (f"AllGatherCPTensor.backward:{PIN}", f"AllGatherCPTensor.backward:{CUDA}")
    assert era.cp_backward_needs_cuda == PIN


def test_capabilities_follow_the_era(tmp_path, no_cuda):
    old = nemo_rl.target(config=TargetConfig(str(_fake_checkout(tmp_path / "old", OLD))))
    assert old.capabilities.layouts == {"bshd"}
    assert "has no from_parallel_logits_to_logprobs_packed_sequences" in old.capabilities.skip_reason(
        _scenario("thd-tp2cp1-many"))
    assert "has no ChunkedDistributedEntropy" in old.capabilities.skip_reason(_scenario("bshd-tp2cp1-basic"))
    assert old.capabilities.skip_reason(_scenario("bshd-tp2cp1-many")) is None
    assert "no all-gather CP" in old.capabilities.skip_reason(_scenario("allgather-tp2cp2-many"))
    per_sequence = nemo_rl.target("per_sequence", config=TargetConfig(str(tmp_path / "old")))
    assert per_sequence.capabilities.skip_reason(_scenario("thd-tp2cp1-many")) is None
    assert "takes no cp_group" in per_sequence.capabilities.skip_reason(_scenario("zigzag-tp2cp2-many"))
    with pytest.raises(BadInput, match="no target_is_pre_rolled"):
        nemo_rl.target("pre_rolled", config=TargetConfig(str(tmp_path / "old")))
    with pytest.raises(BadInput, match="takes no sampling_params"):
        nemo_rl.target("sampling", config=TargetConfig(str(tmp_path / "old")))


def test_cp_needs_cuda_where_the_source_builds_its_index_on_cuda(tmp_path, monkeypatch, no_cuda):
    src = str(_fake_checkout(tmp_path, NEW))
    new = nemo_rl.target(config=TargetConfig(src))
    assert new.capabilities.layouts == {"thd", "bshd", "zigzag"}
    why = new.capabilities.skip_reason(_scenario("zigzag-tp2cp2-many"))
    assert f"AllGatherCPTensor.backward (model_utils.py:{PIN})" in why and ".cuda()" in why
    assert new.capabilities.skip_reason(_scenario("thd-tp2cp1-many")) is None
    forced = nemo_rl.target(config=TargetConfig(src, (("cp_on_cpu", "true"),)))
    assert forced.capabilities.skip_reason(_scenario("zigzag-tp2cp2-many")) is None
    monkeypatch.setenv("SHARDCHECK_BACKEND", "gloo-cuda")  # ranks on a (shared) GPU, asked for
    assert nemo_rl.target(config=TargetConfig(src)).capabilities.skip_reason(_scenario("zigzag-tp2cp2-many")) is None
    monkeypatch.setenv("SHARDCHECK_BACKEND", "gloo")
    assert nemo_rl.target(config=TargetConfig(src)).capabilities.skip_reason(_scenario("zigzag-tp2cp2-many"))
    monkeypatch.setenv("SHARDCHECK_BACKEND", "auto")
    monkeypatch.setattr(nemo_rl, "_cuda_devices", lambda: 2)  # a CP world can be nccl there
    assert nemo_rl.target(config=TargetConfig(src)).capabilities.skip_reason(_scenario("zigzag-tp2cp2-many")) is None
    with pytest.raises(BadInput, match="cp_on_cpu='maybe'"):
        nemo_rl.target(config=TargetConfig(src, (("cp_on_cpu", "maybe"),)))


def test_sampling_shape_requirements_are_skips_with_the_reason(tmp_path):
    from shardcheck.scenarios import Sample, Scenario

    sc = Scenario("s", (Sample(23, 5), Sample(14, 5)), vocab=8, tp=2, top_k=4, top_p=0.9)
    assert "B*S=37 local rows divisible by tp=2" in nemo_rl.sampling_shape_reason(sc)
    sc = Scenario("s", (Sample(23, 5), Sample(15, 5)), vocab=8, tp=2, top_k=4, top_p=0.9)
    assert nemo_rl.sampling_shape_reason(sc) is None and nemo_rl.scenario_sampling(sc) == (4, 0.9)
    sc = Scenario("s", (Sample(23, 5), Sample(15, 5)), vocab=8, tp=2, top_k=4, log_probs_chunk_size=3)
    assert "chunk_size*B=3" in nemo_rl.sampling_shape_reason(sc)
    sc = Scenario("s", (Sample(23, 5), Sample(14, 5)), vocab=8, tp=2)  # nothing filtered: no requirement
    assert nemo_rl.sampling_shape_reason(sc) is None and nemo_rl.scenario_sampling(sc) is None
    assert nemo_rl.scenario_sampling(Scenario("s", (Sample(4, 2),), vocab=8, top_p=0.9)) == (None, 0.9)


def test_the_import_runs_no_package_init_writes_nothing_and_is_undone(tmp_path):
    src = _fake_checkout(tmp_path, textwrap.dedent(OLD) + "import shardcheck_absent_module\n", {
        "nemo_rl/__init__.py": "raise RuntimeError('nemo_rl/__init__.py must not run')\n",
        "nemo_rl/distributed/__init__.py": "raise RuntimeError('must not run')\n",
    })
    import dataclasses

    checkout = Checkout(dataclasses.replace(FRAMEWORK, stubbable=("shardcheck_absent_module",)), src)
    before = (set(sys.modules), list(sys.meta_path), sys.dont_write_bytecode)
    try:
        module = checkout.import_module(MODULE)
        assert module.__file__ == str(src / "nemo_rl/distributed/model_utils.py")
        assert checkout.stubs == ["shardcheck_absent_module"] and SAMPLING_MODULE not in sys.modules
        assert set(checkout.package_inits_not_run) == {"nemo_rl", "nemo_rl.distributed"}
    finally:
        checkout.release()
    assert (set(sys.modules), list(sys.meta_path), sys.dont_write_bytecode) == before
    assert not list(src.rglob("*.pyc")), "bytecode was written into the checkout"


def test_a_missing_module_it_may_not_stub_is_one_line(tmp_path):
    src = _fake_checkout(tmp_path, textwrap.dedent(OLD) + "import shardcheck_absent_module\n")
    checkout = Checkout(FRAMEWORK, src)
    try:
        with pytest.raises(BadInput, match=r"cannot be imported \(nemo_rl.distributed.model_utils\): No module named "
                                           "'shardcheck_absent_module'"):
            checkout.import_module(MODULE)
    finally:
        checkout.release()


def test_the_source_must_be_named_and_be_a_checkout(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(BadInput, match="needs a NeMo-RL source checkout"):
        source()
    with pytest.raises(BadInput, match="is not a NeMo-RL checkout") as info:
        source(str(tmp_path))
    assert "\n" not in str(info.value)
    monkeypatch.setenv(ENV, str(tmp_path / "x"))
    with pytest.raises(BadInput, match="NeMo-RL source .* is not a directory"):
        source()


@pytest.mark.parametrize("where", ["missing", "empty"])
def test_cli_without_a_checkout_is_one_line_exit_2(tmp_path, monkeypatch, where, cli_in_process):
    monkeypatch.delenv(ENV, raising=False)
    path = tmp_path / "x" if where == "missing" else tmp_path
    proc = cli_in_process("run", "--target", "nemo_rl", "--nemo-rl-src", str(path))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    want = "is not a directory" if where == "missing" else "is not a NeMo-RL checkout"
    assert proc.stderr.strip().count("\n") == 0 and want in proc.stderr
    assert "Traceback" not in proc.stderr


def test_variants_and_options_are_listed_and_checked(tmp_path, no_cuda):
    from shardcheck.targets import resolve

    # cwd: not the project's root, whose ignored shardcheck.egg-info may predate this entry point
    listing = run_cli("targets", cwd=str(tmp_path))
    assert listing.returncode == 0 and "nemo_rl:per_sequence" in listing.stdout, listing.stdout + listing.stderr
    assert "nemo_rl:pre_rolled" in listing.stdout and "cp_on_cpu" in listing.stdout
    src = str(_fake_checkout(tmp_path / "src", NEW))
    with pytest.raises(BadInput, match="no variant 'nope'"):
        nemo_rl.target("nope", TargetConfig(src))
    with pytest.raises(BadInput, match="no option 'chunk'"):
        resolve("shardcheck.targets.nemo_rl:target", TargetConfig(src, (("chunk", "4"),)))
    described = nemo_rl.target("pre_rolled", TargetConfig(src)).describe()
    assert "negative entropy" in described["entropy"] and described["name"] == "nemo_rl:pre_rolled"
    assert described["version"].startswith("checkout ") and "logprobs_params" not in described["era"]
    # nemo_rl:dtensor's option call (its worker's train or get_logprobs call) is its own
    with pytest.raises(BadInput, match="option call is nemo_rl:dtensor's"):
        nemo_rl.target("sampling", TargetConfig(src, (("call", "get_logprobs"),)))
    with pytest.raises(BadInput, match="option call='eval': expected train or get_logprobs"):
        nemo_rl.target(None, TargetConfig(src, (("call", "eval"),)))


def test_the_data_path_and_the_fused_loss_follow_the_checkout(tmp_path, no_cuda):
    """Without NeMo-RL's packing (data.py) the harness lays the rows out and the fused loss is not
    offered; a layout option other than framework or shardcheck is one line of bad input."""
    src = str(_fake_checkout(tmp_path, NEW))
    plain = nemo_rl.target(None, TargetConfig(src))
    assert plain.data_path is None and plain.describe()["data_path"] == "shardcheck's layout (no packing)"
    assert plain.framework_files == ("nemo_rl/distributed/model_utils.py",)
    with pytest.raises(BadInput, match="has no fused packed loss"):
        nemo_rl.target("fused_loss", TargetConfig(src))
    with pytest.raises(BadInput, match="option layout='mine': expected framework or shardcheck"):
        nemo_rl.target(None, TargetConfig(src, (("layout", "mine"),)))


# ---- against a real checkout ----------------------------------------------------------------

def _run(tmp_path, target: str, *args: str) -> tuple:
    """``shardcheck run --target TARGET ARGS`` with a JSON report, from a directory other than the
    project's root (see above)."""
    report = tmp_path / f"{target.replace(':', '-')}.json"
    proc = run_cli("run", "--target", target, *args, "--json-report", str(report), cwd=str(tmp_path))
    doc = json.loads(report.read_text()) if report.exists() else {}
    return proc, {v["name"]: v for v in doc.get("scenarios", [])}, doc


@needs_nemo_rl
@pytest.mark.world
def test_nemo_rl_passes_every_smoke_scenario_it_runs(tmp_path):
    """Point SHARDCHECK_NEMO_RL_SRC at a commit whose functions are right (NeMo-RL's newest was, at
    7ea279abf): every scenario it runs passes; all-gather CP is skipped (not NeMo-RL's), and
    zigzag too on a machine without two GPUs (AllGatherCPTensor.backward's .cuda())."""
    proc, verdicts, doc = _run(tmp_path, "nemo_rl", "--suite", "smoke")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert {v["verdict"] for v in verdicts.values()} == {"pass", "skip"}
    assert verdicts["thd-tp2cp1-basic"]["verdict"] == "pass" and verdicts["bshd-tp4cp1-edges"]["verdict"] == "pass"
    assert "no all-gather CP" in verdicts["allgather-tp2cp2-basic"]["reason"]
    if nemo_rl._cuda_devices() < 2 and doc["target"]["era"]["cp_backward_needs_cuda"]:
        assert "AllGatherCPTensor.backward" in verdicts["zigzag-tp2cp2-basic"]["reason"]
    assert doc["target"]["stubbed_modules"] == []


@needs_nemo_rl
@pytest.mark.world
def test_each_calling_convention_passes(tmp_path):
    names = ["thd-tp2cp1-edges", "thd-tp4cp1-many", "bshd-tp2cp1-basic", "thd-tp2cp1-bf16"]
    for variant in ("per_sequence", "pre_rolled", "sampling"):
        proc, verdicts, _ = _run(tmp_path, f"nemo_rl:{variant}", "--suite", "smoke",
                                 *[a for n in names for a in ("--scenario", n)])
        assert proc.returncode == 0, variant + proc.stdout[-3000:] + proc.stderr[-2000:]
        assert {v["verdict"] for v in verdicts.values()} == {"pass"}, variant


@needs_nemo_rl
@pytest.mark.world
def test_the_dtensor_workers_path_passes_on_dtensor_logits(tmp_path):
    """nemo_rl:dtensor: get_next_token_logprobs_from_logits's DTensor branch (logits a DTensor
    sharded over the vocabulary on a ('tp',) mesh of the rank's TP group), which no target reached
    before issue 39; its packed layout (thd) is skipped, saying why; zigzag at cp > 1 is its CP
    path (test_the_dtensor_cp_path_passes_where_torch_shards_evenly)."""
    names = [f"{n}-logprob" for n in ("bshd-tp2cp1-basic", "bshd-tp4cp1-edges", "bshd-tp1cp1-basic",
                                       "thd-tp2cp1-basic", "zigzag-tp2cp2-basic")]
    proc, verdicts, doc = _run(tmp_path, "nemo_rl:dtensor", "--suite", "logprob", "--coverage",
                               *[a for n in names for a in ("--scenario", n)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert [verdicts[n]["verdict"] for n in names[:3]] == ["pass"] * 3
    assert "[batch, sequence] batches (bshd" in verdicts["thd-tp2cp1-basic-logprob"]["reason"]
    assert verdicts["zigzag-tp2cp2-basic-logprob"]["verdict"] == "pass"
    ran = {f.rpartition(":")[2] for f in doc["coverage"]["files"]["nemo_rl/distributed/model_utils.py"]["functions"]}
    assert {"get_next_token_logprobs_from_logits", "get_logprobs_from_vocab_parallel_logits",
            "dtensor_from_parallel_logits_to_logprobs"} <= ran, ran
    # with a scenario's top-k / top-p: DistributedLogprobWithSampling on the DTensor branch, checked
    # against the filtered truth (ignoring sampling_params fails it)
    import dataclasses

    from conftest import write_scenarios
    from shardcheck.scenarios import get_suite

    [sc] = [dataclasses.replace(sc, with_entropy=False, entropy_coef=0.0) for sc in get_suite("sampling")
            if sc.name == "sampling-bshd-tp2"]
    f = write_scenarios(tmp_path / "sampling.json", [sc])
    proc, verdicts, _ = _run(tmp_path, "nemo_rl:dtensor", "--scenario-file", str(f))
    assert proc.returncode == 0 and verdicts["sampling-bshd-tp2"]["verdict"] == "pass", proc.stdout[-3000:]
    # the DTensor worker computes no entropy on this path: a scenario with one is skipped, saying so
    proc, verdicts, _ = _run(tmp_path, "nemo_rl:dtensor", "--suite", "smoke", "--scenario", "bshd-tp2cp1-basic",
                             "--allow-all-skipped")
    assert "computes no entropy" in verdicts["bshd-tp2cp1-basic"]["reason"], verdicts


@needs_nemo_rl
@pytest.mark.world
def test_the_dtensor_worker_builds_its_own_mesh_through_the_harness(tmp_path):
    """nemo_rl:dtensor at tp 2: the worker's own __init__ mesh statements (init_device_mesh (dp, cp,
    tp), its meshes sliced from it) run once through framework_groups (the set-up's barrier and the
    lists' all-gather over the world), their groups checked against the harness's; the logits a
    DTensor on its tp_mesh take get_next_token_logprobs_from_logits's DTensor branch."""
    proc, verdicts, doc = _run(tmp_path, "nemo_rl:dtensor", "--suite", "logprob", "--scenario",
                               "bshd-tp2cp1-basic-logprob", "--trace", "--coverage")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    [v] = verdicts.values()
    calls = [c for trace in v["traces"].values() for c in trace]
    set_up = [c for c in calls if c["phase"] == "framework groups set-up"]
    assert {c["op"] for c in set_up} >= {"barrier", "all_gather"}, set_up
    forward = {tuple(c["ranks"]) for c in calls if c["phase"] == "forward"}
    assert forward and forward <= {(0, 1), (2, 3)}, forward  # its tp_mesh's groups
    assert "init_device_mesh" in doc["target"]["device_mesh"] and "LOCAL_RANK" in doc["target"]["device_mesh"]
    files = doc["coverage"]["files"]
    ran = {f.rpartition(":")[2] for f in files["nemo_rl/distributed/model_utils.py"]["functions"]}
    assert {"get_logprobs_from_vocab_parallel_logits", "dtensor_from_parallel_logits_to_logprobs"} <= ran, ran
    worker_file = files["nemo_rl/models/policy/workers/dtensor_policy_worker.py"]
    worker = {f.rpartition(":")[2] for f in worker_file["functions"]}
    assert any(f.endswith(".__init__") for f in worker), worker


@needs_nemo_rl
@pytest.mark.world
def test_the_dtensor_worker_at_tp1_hands_plain_logits_to_the_full_vocabulary_branch(tmp_path):
    """At tp 1, cp 1 the worker parallelizes nothing, so train's get_next_token_logprobs_from_logits
    takes its plain-tensor branch: next_token_logits[:, :-1] (non-contiguous for 2+ samples),
    apply_top_k_top_p, log_softmax. Top-k alone passes on 2 bshd samples, top-k and top-p on one.
    Found at the pin: top-p on 2+ samples raises, NeMo-RL's own error
    (_apply_top_k_top_p_fn's logits.view(-1, vocab_size) on that view; docs/nemo-rl.md)."""
    import dataclasses

    from conftest import write_scenarios
    from shardcheck.scenarios import get_suite

    [sc] = [s for s in get_suite("sampling") if s.name == "sampling-bshd-tp2"]  # top-k 8, top-p 0.8, 2 samples
    base = dataclasses.replace(sc, tp=1, with_entropy=False, entropy_coef=0.0)
    f = write_scenarios(tmp_path / "tp1.json", [
        dataclasses.replace(base, name="tp1-topk", top_p=1.0),
        dataclasses.replace(base, name="tp1-topk-topp-one", samples=base.samples[:1]),
        dataclasses.replace(base, name="tp1-topk-topp")])
    proc, verdicts, doc = _run(tmp_path, "nemo_rl:dtensor", "--scenario-file", str(f), "--coverage")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert verdicts["tp1-topk"]["verdict"] == verdicts["tp1-topk-topp-one"]["verdict"] == "pass", verdicts
    [failure] = verdicts["tp1-topk-topp"]["failures"]
    assert failure["kind"] == "rank_error" and "view size is not compatible" in failure["message"], failure
    assert "logits_sampling_utils.py:" in failure["message"], failure["message"]
    files = doc["coverage"]["files"]
    ran = {f.rpartition(":")[2] for f in files["nemo_rl/distributed/model_utils.py"]["functions"]}
    assert "get_next_token_logprobs_from_logits" in ran and "get_logprobs_from_vocab_parallel_logits" not in ran, ran
    sampled = {f.rpartition(":")[2] for f in files["nemo_rl/algorithms/logits_sampling_utils.py"]["functions"]}
    assert {"_apply_top_k_only_fn", "_ApplyTopKTopP.backward"} <= sampled, sampled
    assert "Tensor.cuda returns the tensor itself" in doc["target"]["tp1"]


@needs_nemo_rl
@pytest.mark.world
def test_the_dtensor_cp_path_passes_where_torch_shards_evenly(tmp_path):
    """nemo_rl:dtensor at cp > 1: the padded [B, S] batch sharded by torch's context_parallel as
    NeMo-RL's DTensor worker calls it (the rows learned by the position trace), seq_index, input_ids
    a DTensor on the cp mesh, logits [Shard(1), Shard(-1)] on a ('cp', 'tp') mesh, NeMo-RL's own CP
    gather and backward. One world: the smoke zigzag cells at cp 2 (tp 1, 2) and cp 4 pass, top-k /
    top-p at cp 2 tp 2 passes (DistributedLogprobWithSampling), S % 2cp != 0 (torch's silent
    contiguous shards) passes; S % cp != 0, reachable with NeMo-RL's base config
    (make_sequence_length_divisible_by = tp with dtensor_cfg.context_parallel_size > 1), sends
    uneven all-gathers: a collective_mismatch."""
    import dataclasses

    from conftest import write_scenarios
    from shardcheck.scenarios import get_suite

    smoke = {sc.name: sc for sc in get_suite("smoke")}
    logprob = {sc.name: sc for sc in get_suite("logprob")}
    [sampling] = [sc for sc in get_suite("sampling") if sc.name == "sampling-zigzag-tp2cp2"]
    cells = ["zigzag-tp1cp2-many", "zigzag-tp2cp2-many", "zigzag-tp1cp4-many"]
    scenarios = [smoke[n] for n in cells] + [
        dataclasses.replace(sampling, with_entropy=False, entropy_coef=0.0),
        dataclasses.replace(logprob["zigzag-tp2cp2-edges-logprob"], name="dtensor-contiguous-tp2cp2",
                            layout_knobs=(("make_sequence_length_divisible_by", 2),)),  # S = 18: contiguous
        dataclasses.replace(logprob["zigzag-tp1cp2-basic-logprob"], name="dtensor-uneven-cp2",
                            layout_knobs=(("make_sequence_length_divisible_by", 1),)),  # S = 23 at cp 2
    ]
    f = write_scenarios(tmp_path / "dtensor_cp.json", scenarios)
    proc, verdicts, doc = _run(tmp_path, "nemo_rl:dtensor", "--scenario-file", str(f), "--coverage",
                               "--timeout", "120")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    passed = [*cells, "sampling-zigzag-tp2cp2", "dtensor-contiguous-tp2cp2"]
    assert {n: verdicts[n]["verdict"] for n in passed} == dict.fromkeys(passed, "pass"), proc.stdout[-3000:]
    assert "create_context_parallel_ctx" in doc["target"]["data_path"]
    uneven = verdicts["dtensor-uneven-cp2"]
    assert uneven["verdict"] == "fail", uneven
    assert {f["kind"] for f in uneven["failures"]} == {"collective_mismatch"}, uneven["failures"]
    assert "all_gather" in uneven["failures"][0]["message"], uneven["failures"][0]
    ran = {f.rpartition(":")[2] for f in doc["coverage"]["files"]["nemo_rl/distributed/model_utils.py"]["functions"]}
    assert {"get_next_token_logprobs_from_logits", "get_logprobs_from_vocab_parallel_logits",
            "dtensor_from_parallel_logits_to_logprobs", "DistributedLogprob.backward",
            "DistributedLogprobWithSampling.backward"} <= ran, ran


@needs_nemo_rl
@pytest.mark.world
def test_the_sampling_variant_meets_the_filtered_truth(tmp_path):
    """nemo_rl:sampling filters the logits itself (top-k, then top-p): the sampling suite's truth,
    keep sets filtered from the float64 logits, is met in thd and bshd at tp 1 and 2, chunked too;
    the default variant skips them (it filters nothing)."""
    proc, verdicts, _ = _run(tmp_path, "nemo_rl:sampling", "--suite", "sampling")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert {n for n, v in verdicts.items() if v["verdict"] == "pass"} >= {
        "sampling-thd-one-device", "sampling-thd-tp2-topk", "sampling-thd-tp2-topp", "sampling-bshd-tp2"}
    proc, verdicts, _ = _run(tmp_path, "nemo_rl", "--suite", "sampling", "--allow-all-skipped")
    assert {v["verdict"] for v in verdicts.values()} == {"skip"}


@needs_nemo_rl
@pytest.mark.world
@pytest.mark.skipif(nemo_rl._cuda_devices() >= 2, reason="a CUDA world runs cp > 1")
def test_cp_on_a_cpu_world_fails_with_nemo_rls_error(tmp_path):
    proc, verdicts, _ = _run(tmp_path, "nemo_rl", "--target-opt", "cp_on_cpu=true", "--suite", "smoke",
                             "--scenario", "zigzag-tp1cp2-many", "--nproc", "2")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    failure = verdicts["zigzag-tp1cp2-many"]["failures"][0]
    assert failure["kind"] == "rank_error" and "model_utils.py" in failure["message"], failure


CUDA_INDEX = 'device="cpu", pin_memory=True\n        ).cuda(non_blocking=True)'
ALL_REDUCE = "        torch.distributed.all_reduce(grad_output, group=ctx.cp_group)\n"


def _cp_on_this_device(root, *, all_reduce: bool = True):
    """A copy of the checkout's nemo_rl/ whose AllGatherCPTensor.backward builds its index on the
    gradient's device (its one .cuda() line; nothing else changed), so NeMo-RL's CP runs on a CPU
    world; ``all_reduce=False`` also removes the backward's sum over the CP ranks (the plant)."""
    import shutil

    shutil.copytree(os.path.join(NEMO_RL_SRC, "nemo_rl"), root / "nemo_rl",
                    ignore=lambda d, names: [n for n in names if not n.endswith(".py")
                                             and not os.path.isdir(os.path.join(d, n))])
    utils = root / "nemo_rl" / "distributed" / "model_utils.py"
    text = utils.read_text()
    assert text.count(CUDA_INDEX) == 1 and text.count(ALL_REDUCE) == 1, "AllGatherCPTensor.backward changed"
    text = text.replace(CUDA_INDEX, 'device="cpu"\n        ).to(grad_output.device)')
    utils.write_text(text if all_reduce else text.replace(ALL_REDUCE, "        pass  # planted\n"))
    return root


@needs_nemo_rl
@pytest.mark.world
def test_nemo_rls_cp_is_checked_over_the_gathered_sequence(tmp_path):
    """NeMo-RL's log-probs are gathered over CP (every CP rank holds, and takes its loss over, the
    whole sequence) and its entropy is computed on each rank's own rows: declared so, the reference
    follows. With the backward's one CUDA line ported to the rank's device (a CPU world), every
    zigzag scenario passes; with the backward's all-reduce removed every CP rank's gradient is
    1/cp of the truth, and it fails grad_mismatch (under each rank's share it would pass)."""
    zigzag = ["zigzag-tp1cp2-edges", "zigzag-tp2cp2-many", "zigzag-tp1cp4-long-prompt"]
    args = ["--suite", "smoke", *[a for n in zigzag for a in ("--scenario", n)], "--target-opt", "cp_on_cpu=true"]
    right = _cp_on_this_device(tmp_path / "right")
    proc, verdicts, doc = _run(tmp_path, "nemo_rl:per_sequence", "--target-src", str(right), *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert {v["verdict"] for v in verdicts.values()} == {"pass"}
    assert "every CP rank's log-probs checked" in doc["target"]["definitions"]["loss"]
    planted = _cp_on_this_device(tmp_path / "planted", all_reduce=False)
    proc, verdicts, _ = _run(tmp_path, "nemo_rl:per_sequence", "--target-src", str(planted), *args)
    assert proc.returncode == 1
    for name, v in verdicts.items():
        assert set(v["kinds"]) == {"grad_mismatch"}, (name, v["kinds"])


@needs_nemo_rl
def test_importing_the_real_checkout_writes_nothing_into_it():
    src = source(NEMO_RL_SRC)
    before = set(src.rglob("*.pyc"))
    checkout = Checkout(FRAMEWORK, src)
    try:
        module = checkout.import_module(MODULE)
        assert hasattr(module, "from_parallel_logits_to_logprobs") and checkout.stubs == []
    finally:
        checkout.release()
    assert set(src.rglob("*.pyc")) == before
    assert not [m for m in sys.modules if m == "nemo_rl" or m.startswith("nemo_rl.")]


REPO_ENV = "SHARDCHECK_NEMO_RL_REPO"
needs_history = pytest.mark.skipif(
    not os.environ.get(REPO_ENV), reason=f"{REPO_ENV} is not set: no NeMo-RL git repository with its history "
    "(a clone of NVIDIA-NeMo/RL) to check past commits against")
FIX = "df31c1bf4"  # "chunked logprob calculation with deferred fp32 cast": DistributedLogprob casts to float32
PARENT = "83c6bfc97"



@needs_history
@pytest.mark.world
def test_the_half_precision_gradient_fixed_at_df31c1bf4(tmp_path):
    """Before df31c1bf4, DistributedLogprob computed the log-softmax and the softmax it saves for
    backward in the logits' own dtype: handed bfloat16 logits (as the packed get_logprobs path
    passed its output uncast), its gradient is off by ~2.5%. df31c1bf4 casts to float32 inside."""
    scenario = ["--suite", "regressions", "--scenario", "thd-tp2-bf16-wide"]
    parent, verdicts, _ = _run(tmp_path, "nemo_rl", "--nemo-rl-src",
                               export_commit(os.environ[REPO_ENV], PARENT, tmp_path / "parent", "nemo_rl"), *scenario)
    assert parent.returncode == 1, parent.stdout[-2000:] + parent.stderr[-2000:]
    assert verdicts["thd-tp2-bf16-wide"]["kinds"] == ["grad_mismatch"], verdicts
    fixed, verdicts, _ = _run(tmp_path, "nemo_rl", "--nemo-rl-src",
                              export_commit(os.environ[REPO_ENV], FIX, tmp_path / "fix", "nemo_rl"),
                              *scenario)
    assert fixed.returncode == 0, fixed.stdout[-2000:] + fixed.stderr[-2000:]


@needs_history
def test_a_repro_script_shows_the_half_precision_gradient_with_torch_and_nemo_rl_alone(tmp_path):
    """`shardcheck repro` at df31c1bf4's parent: the script, run where shardcheck is not installed,
    finds the gradient off in bfloat16; pointed at the fix it finds nothing."""
    repo = os.environ[REPO_ENV]
    script = tmp_path / "repro.py"
    made = run_cli("repro", "--target", "nemo_rl", "--target-src", export_commit(repo, PARENT, tmp_path / "p", "nemo_rl"),
                   "--suite", "regressions", "--scenario", "thd-tp2-bf16-wide", "--out", str(script))
    assert made.returncode == 0, made.stderr
    assert script.read_text().count("\n") < 300
    python = torch_only_python(tmp_path)
    run = lambda *extra: subprocess.run([python, str(script), *extra], capture_output=True, text=True,  # noqa: E731
                                        timeout=180, cwd=tmp_path)
    parent, fix = run(), run("--src", export_commit(repo, FIX, tmp_path / "f", "nemo_rl"))
    assert parent.returncode == 1 and "gradient -0.013305664, want -0.013630881" in parent.stdout, parent.stdout
    assert fix.returncode == 0 and fix.stdout.startswith("NOT FOUND"), fix.stdout + fix.stderr


@needs_nemo_rl
def test_repro_refuses_what_its_script_cannot_check(tmp_path):
    """NeMo-RL gathers its log-probs over CP (its declared definition), and its other variants run
    its loss wrappers: repro says so in one line instead of writing a script that would misjudge."""
    for spec, scenario, said in (("nemo_rl", "zigzag-tp2cp2-basic", "under CP the target returns other tokens"),
                                 ("nemo_rl:per_sequence", "thd-tp2cp1-basic", "cannot say how it calls")):
        made = run_cli("repro", "--target", spec, "--target-opt", "layout=shardcheck", "--target-opt", "cp_on_cpu=true",
                       "--scenario", scenario, "--out", str(tmp_path / "r.py"))
        assert made.returncode == 2 and said in made.stderr and made.stderr.count("\n") == 1, made.stderr
        assert not (tmp_path / "r.py").exists()


# The smallest scenario of the top-p bug found at the pin (docs/nemo-rl.md): two samples of 3 tokens (prompt 1),
# V = 4, bshd, tp 1, top-p 0.9: NeMo-RL's DTensor worker's train takes the full-vocabulary branch.
TOPP = {"name": "dtensor-tp1-topp-two-samples", "samples": [[3, 1], [3, 1]], "vocab": 4, "tp": 1, "cp": 1,
        "layout": "bshd", "with_entropy": False, "entropy_coef": 0.0, "log_probs_chunk_size": -1, "temperature": 1.0,
        "dtype": "float32", "seed": 1, "replay_keep": False, "top_k": 0, "top_p": 0.9,
        "description": "NeMo-RL's DTensor worker at tp 1: top-p on the non-contiguous [:, :-1] view of 2 samples"}


def _dtensor_repro(tmp_path, name: str, scenarios: list) -> tuple:
    """`shardcheck repro --target nemo_rl:dtensor` for scenario ``name`` of ``scenarios``: (the command, the script)."""
    (tmp_path / "sc.json").write_text(json.dumps(scenarios))
    script = tmp_path / f"{name}.py"
    made = run_cli("repro", "--target", "nemo_rl:dtensor", "--scenario-file", str(tmp_path / "sc.json"),
                   "--scenario", name, "--out", str(script), cwd=str(tmp_path))
    return made, script


@needs_nemo_rl
def test_a_repro_script_makes_the_dtensor_workers_call_with_torch_and_nemo_rl_alone(tmp_path):
    """nemo_rl:dtensor's repro call (train, cp 1): at tp 1 the plain logits through
    get_next_token_logprobs_from_logits's full-vocabulary branch (its .cuda() the target's stand-in), at
    tp 2 a Shard(-1) DTensor on a ('tp',) mesh of the TP group; both scripts, run where shardcheck is not
    installed, find nothing on the top-p scenario without its filter. The filtered scenario itself is
    refused by the harness (sampling scenarios: no script yet), no longer for want of a repro call."""
    python = torch_only_python(tmp_path)
    plain = [dict(TOPP, name="tp1-plain", top_p=1.0), dict(TOPP, name="tp2-plain", top_p=1.0, tp=2, vocab=8)]
    for sc in plain:
        made, script = _dtensor_repro(tmp_path, sc["name"], plain)
        assert made.returncode == 0, made.stderr
        assert script.read_text().count("\n") < 300
        run = subprocess.run([python, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert run.returncode == 0 and run.stdout.startswith("NOT FOUND: nemo_rl:dtensor"), run.stdout + run.stderr
    made, script = _dtensor_repro(tmp_path, TOPP["name"], [TOPP])
    assert made.returncode == 2 and "top-k/top-p" in made.stderr and "repro_call" not in made.stderr, made.stderr
    assert not script.exists()
    for option in ("call=get_logprobs", "temperature_in_place=true"):  # the first: written; the second: refused
        target = nemo_rl.target("dtensor", TargetConfig(NEMO_RL_SRC, (tuple(option.split("=")),)))
        assert bool(target.repro_call()) == (option == "call=get_logprobs"), option


@needs_nemo_rl
@pytest.mark.xfail(strict=True, reason="repro refuses top-k/top-p scenarios (harness/controller/commands/repro.py "
                   "scenario_refusal): the script's CASE carries no top_k/top_p, and its truth neither draws the "
                   "tokens inside the keep sets nor renormalises over them")
def test_a_repro_script_shows_the_dtensor_tp1_top_p_error(tmp_path):
    """The top-p bug as a standalone script: FOUND (exit 1, NeMo-RL's view error); top-k 2 alone: NOT FOUND."""
    python = torch_only_python(tmp_path)
    for sc, code, said in ((TOPP, 1, "view size is not compatible"),
                           (dict(TOPP, name="tp1-topk2", top_p=1.0, top_k=2), 0, "NOT FOUND")):
        made, script = _dtensor_repro(tmp_path, sc["name"], [sc])
        assert made.returncode == 0, made.stderr
        run = subprocess.run([python, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert run.returncode == code and said in run.stdout, run.stdout + run.stderr


# ----------------------------------------------------------------------------------------------
# NeMo-RL's own data path (_pack_sequences_for_megatron) and its fused packed loss


@needs_nemo_rl
@pytest.mark.world
def test_nemo_rls_packing_lays_out_the_packed_rows(tmp_path):
    """thd rows are laid out by NeMo-RL's _pack_sequences_for_megatron (each sequence padded to
    make_sequence_length_divisible_by, tp by default), bshd by shardcheck with the reason; the
    knobs move the padding and the run still passes; the fused packed loss passes too."""
    proc, verdicts, doc = _run(tmp_path, "nemo_rl", "--suite", "smoke", "--scenario", "thd-tp2cp1-bf16",
                               "--scenario", "bshd-tp2cp1-basic")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    name = "nemo_rl/models/megatron/data.py:_pack_sequences_for_megatron"
    assert doc["target"]["data_path"] == name
    assert verdicts["thd-tp2cp1-bf16"]["layout_built_by"] == name
    assert "NeMo-RL packs with sequence packing only" in verdicts["bshd-tp2cp1-basic"]["layout_note"]
    base = {"samples": [[23, 9], [14, 6], [5, 2]], "vocab": 64, "tp": 2, "seed": 5}
    scenarios = tmp_path / "knobs.json"
    scenarios.write_text(json.dumps([
        dict(base, name="divisible-by-8", layout_knobs={"make_sequence_length_divisible_by": 8}),
        dict(base, name="bucket-64", layout_knobs={"pad_packed_seq_to_multiple_of": 64}),
        dict(base, name="pipeline-pad", layout_knobs={"pad_packed_seq_to": 96})]))
    for variant in ("nemo_rl", "nemo_rl:per_sequence", "nemo_rl:pre_rolled", "nemo_rl:fused_loss"):
        proc, verdicts, doc = _run(tmp_path, variant, "--scenario-file", str(scenarios))
        assert proc.returncode == 0, variant + proc.stdout[-3000:] + proc.stderr[-2000:]
        assert all(v["layout_built_by"] == name for v in doc["scenarios"]), variant
        # local rows: 23, 14, 5 padded to 8 (24 + 16 + 8); to 2 with the stream to 64; to 96 in all
        assert {n: v["layouts"]["0"]["shape"][1] for n, v in verdicts.items()} == {
            "divisible-by-8": 48, "bucket-64": 64, "pipeline-pad": 96}, variant
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([dict(base, name="bad", layout_knobs={"pad_packed_seq_to_multiple_of": 0})]))
    proc, _, _ = _run(tmp_path, "nemo_rl", "--scenario-file", str(bad))
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "layout knob pad_packed_seq_to_multiple_of must be an integer >= 1, got 0" in proc.stderr
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps([dict(base, name="unknown", layout_knobs={"pad_multiplier": 2})]))
    proc, verdicts, _ = _run(tmp_path, "nemo_rl", "--scenario-file", str(unknown), "--allow-all-skipped")
    assert "has no layout knob pad_multiplier" in verdicts["unknown"]["reason"]


PR_3182 = "4d756fe39"  # "fix: handle inflated packed sequence lengths in input-id packing (#3182)"


@needs_history
@pytest.mark.world
def test_the_inflated_last_sequence_fixed_at_4d756fe39(tmp_path):
    """NeMo-RL's packer gives the packed stream's alignment padding (pad_packed_seq_to_multiple_of,
    FP8 or HybridEP) to the last sequence; before #3182 the fused loss's _pack_input_ids copied that
    inflated length out of the unpacked input_ids, wider than its rows: a crash in NeMo-RL's own
    data path, reached only through its packing and its fused loss."""
    scenarios = tmp_path / "inflated.json"
    scenarios.write_text(json.dumps([{"name": "packed-last-inflated", "samples": [[5, 2], [11, 4]], "vocab": 32,
                                      "layout_knobs": {"pad_packed_seq_to_multiple_of": 32}, "seed": 3182}]))
    repo = os.environ[REPO_ENV]
    parent, verdicts, doc = _run(tmp_path, "nemo_rl:fused_loss", "--nemo-rl-src",
                                 export_commit(repo, f"{PR_3182}~1", tmp_path / "parent", "nemo_rl"),
                                 "--scenario-file", str(scenarios))
    assert parent.returncode == 1, parent.stdout[-2000:] + parent.stderr[-2000:]
    failure = verdicts["packed-last-inflated"]["failures"][0]
    assert failure["kind"] == "rank_error", failure
    assert "The expanded size of the tensor (27) must match the existing size (11)" in failure["message"]
    assert "loss/utils.py" in failure["message"] and "in _pack_input_ids" in failure["message"]
    assert verdicts["packed-last-inflated"]["layout_built_by"].endswith("_pack_sequences_for_megatron")
    fixed, verdicts, _ = _run(tmp_path, "nemo_rl:fused_loss", "--nemo-rl-src",
                              export_commit(repo, PR_3182, tmp_path / "fix", "nemo_rl"), "--scenario-file", str(scenarios))
    assert fixed.returncode == 0, fixed.stdout[-2000:] + fixed.stderr[-2000:]
    assert verdicts["packed-last-inflated"]["verdict"] == "pass"
    # the harness's own rows never reach it: the default variant at the parent passes
    default, verdicts, _ = _run(tmp_path, "nemo_rl", "--nemo-rl-src", str(tmp_path / "parent"),
                                "--scenario-file", str(scenarios))
    assert default.returncode == 0 and verdicts["packed-last-inflated"]["verdict"] == "pass"


# ----------------------------------------------------------------------------------------------
# nemo_rl:loss: ClippedPGLossFn in the training step, with the DTensor worker's lines around it

WORKER = """
    class DTensorPolicyWorker:
        def train(self, data, loss_fn, eval_mode=False):
            for mb in data:
                loss, loss_metrics = loss_fn(logits, mb)
                loss = loss / num_microbatches
                if not eval_mode:
                    loss *= self.dp_size
                    loss.backward()
                loss = 0
    """


def test_the_workers_lines_between_its_loss_and_backward_are_read_from_its_file(tmp_path):
    from shardcheck.targets.nemo_rl_loss import worker_loss_lines

    path = tmp_path / "worker.py"
    path.write_text(textwrap.dedent(WORKER))
    assert [ast_line for ast_line in map(__import__("ast").unparse, worker_loss_lines(path))] == [
        "loss = loss / num_microbatches", "loss *= self.dp_size"]


def test_nemo_rl_loss_refuses_a_commit_with_neither_of_its_training_steps_and_options_not_its_own(tmp_path,
                                                                                                 cli_in_process):
    src = _fake_checkout(tmp_path / "new", NEW, {"nemo_rl/algorithms/loss/loss_functions.py": """
        class ClippedPGLossFn:
            def __call__(self, next_token_logprobs, data, global_valid_seqs, global_valid_toks):
                pass
        """})
    made = cli_in_process("run", "--target", "nemo_rl:loss", "--target-src", str(src), "--suite", "training")
    assert made.returncode == 2 and made.stderr.count("\n") == 1, made.stderr
    assert "DTensor-worker era" in made.stderr and "nor a Megatron LossPostProcessor" in made.stderr, made.stderr
    for spec, opt, said in (("nemo_rl:loss", "cp_on_cpu=true", "takes no option 'cp_on_cpu'"),
                            ("nemo_rl", "token_level_loss=false", "token_level_loss is nemo_rl:loss's")):
        made = cli_in_process("run", "--target", spec, "--target-src", str(src), "--target-opt", opt, "--suite",
                              "training")
        assert made.returncode == 2 and said in made.stderr and made.stderr.count("\n") == 1, made.stderr


N1_FIX, N1_PARENT = "af9f6e86", "bb75f66a"  # #266 "fix accumulation of loss across microbatches"
N1_SCENARIO = [{"name": "n1-dp2-mb2", "samples": [[23, 9], [14, 6], [9, 1], [17, 11], [30, 4], [12, 7], [20, 10],
                                                  [11, 3]],
                "vocab": 48, "dp": 2, "micro_batch_size": 2, "layout": "bshd", "with_entropy": False, "seed": 601}]


@needs_history
@pytest.mark.world
def test_the_micro_batch_token_mean_fixed_at_266(tmp_path):
    """Before #266 NeMo-RL's ClippedPGLossFn took each micro-batch's token mean and its worker
    divided by the micro-batch count: the step's gradient was a mean of micro-batch means, a
    factor per sample against the global token mean. #266 normalises by the global batch's valid
    tokens (or samples, token_level_loss=false) and multiplies by dp: both pass. Its masked_mean
    multiplies by the mask, so NaN at a masked position reaches the loss (latent: NeMo-RL's
    rollouts hold finite values there)."""
    scenarios = tmp_path / "n1.json"
    scenarios.write_text(json.dumps(N1_SCENARIO))
    repo = os.environ[REPO_ENV]
    parent = export_commit(repo, N1_PARENT, tmp_path / "parent", "nemo_rl")
    fix = export_commit(repo, N1_FIX, tmp_path / "fix", "nemo_rl")
    proc, verdicts, doc = _run(tmp_path, "nemo_rl:loss", "--nemo-rl-src", parent, "--scenario-file", str(scenarios),
                               "--no-mask-leak")
    [v] = verdicts.values()
    assert proc.returncode == 1 and v["kinds"] == ["grad_mismatch"], proc.stdout[-2000:]
    assert "is off by no one factor: sample 0 x 0.846" in v["failures"][0]["message"], v["failures"][0]
    for extra in ((), ("--target-opt", "token_level_loss=false")):
        proc, verdicts, doc = _run(tmp_path, "nemo_rl:loss", "--nemo-rl-src", fix, "--scenario-file",
                                   str(scenarios), "--no-mask-leak", *extra)
        assert proc.returncode == 0, proc.stdout[-2000:]
    assert doc["target"]["worker_lines"].endswith("train: loss *= self.dp_size"), doc["target"]
    proc, verdicts, doc = _run(tmp_path, "nemo_rl:loss", "--nemo-rl-src", fix, "--scenario-file", str(scenarios),
                               "--coverage")
    [v] = verdicts.values()
    assert proc.returncode == 1 and v["kinds"] == ["mask_leak"], proc.stdout[-2000:]
    ran = {name for f in doc["coverage"]["files"].values() for name in f["functions"]}
    for name in ("nemo_rl/algorithms/loss_functions.py:ClippedPGLossFn.__call__",
                 "nemo_rl/algorithms/utils.py:masked_mean",
                 "megatron-core/megatron/core/pipeline_parallel/schedules.py:forward_backward_no_pipelining",
                 "megatron-core/megatron/core/distributed/finalize_model_grads.py:finalize_model_grads"):
        assert name in ran, sorted(ran)


# eras the sweep found the adapter mis-calling (ours): each was a rank_error over months of commits
LOSS_ERAS = [
    ("0fae6bc24", 1),  # the loss config's ratio_eps_min (renamed ratio_clip_min since): #266's bug, then
    ("b9607949d", 0),  # the loss taking global_valid_seqs and global_valid_toks, its loss_type from the config
    ("dc9dce44b", 0),  # loss/ (#1920): no MetricNormalizer, no top-k / top-p check, a TypedDict config
]


@needs_history
@pytest.mark.world
@pytest.mark.parametrize("rev, code", LOSS_ERAS, ids=[rev for rev, _ in LOSS_ERAS])
def test_nemo_rl_loss_follows_the_eras_the_sweep_found(rev, code, tmp_path):
    scenarios = tmp_path / "n1.json"
    scenarios.write_text(json.dumps(N1_SCENARIO))
    # the loss config of these eras is the GRPO example config's (nemo_rl_loss.example_loss_config)
    src = export_commit(os.environ[REPO_ENV], rev, tmp_path / "src", "nemo_rl", "examples/configs/grpo_math_1B.yaml")
    proc, verdicts, _ = _run(tmp_path, "nemo_rl:loss", "--nemo-rl-src", src, "--scenario-file", str(scenarios),
                             "--no-mask-leak")
    [v] = verdicts.values()
    assert proc.returncode == code, proc.stdout[-2000:]
    assert v["kinds"] == (["grad_mismatch"] if code else []), v


@needs_nemo_rl
@pytest.mark.world
def test_nemo_rl_loss_runs_the_megatron_post_processor_at_the_pin_and_coverage_names_it(tmp_path):
    """At the pin the loss takes log-probs and NeMo-RL's LossPostProcessor wraps it: the step's
    gradient is the declared objective's in both token_level_loss modes (dp 2 x tp 2, three
    micro-batches), and --coverage names the post-processor, the loss, the schedule and DDP."""
    proc, verdicts, doc = _run(tmp_path, "nemo_rl:loss", "--suite", "training", "--scenario", "step-bshd-dp2tp2-mb3",
                               "--no-mask-leak", "--target-opt", "token_level_loss=false")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert doc["target"]["post_processor"].startswith("nemo_rl/models/megatron/train.py:LossPostProcessor")
    # the token mean (the default), its gradient right: the one finding is the mask leak
    proc, verdicts, doc = _run(tmp_path, "nemo_rl:loss", "--suite", "training", "--scenario", "step-bshd-dp2tp2-mb3",
                               "--coverage")
    ran = {name for f in doc["coverage"]["files"].values() for name in f["functions"]}
    for name in ("nemo_rl/models/megatron/train.py:LossPostProcessor.__call__",
                 "nemo_rl/algorithms/loss/loss_functions.py:ClippedPGLossFn.__call__",
                 "nemo_rl/algorithms/loss/utils.py:prepare_loss_input",
                 "megatron-core/megatron/core/pipeline_parallel/schedules.py:forward_backward_no_pipelining",
                 "megatron-core/megatron/core/distributed/finalize_model_grads.py:finalize_model_grads"):
        assert name in ran, sorted(ran)
    [v] = verdicts.values()
    assert v["kinds"] == ["mask_leak"], v  # masked_mean multiplies by the mask (latent: docs/nemo-rl.md)


@needs_history
@pytest.mark.world
def test_the_dtensor_get_logprobs_temperature_fixed_at_ba648542d(tmp_path, monkeypatch):
    """#714 (ba648542d): the V1 DTensor worker's train() divided its logits by the generation
    temperature, its get_logprobs() did not (prev/reference log-probs of z, training's of z / T).
    nemo_rl:dtensor runs the worker's own lines between the model's output and the log-prob call
    (compiled alone from the commit's worker file), so the commit decides: at the parent
    (401cf126f) get_logprobs's log-probs are off at T = 0.5, at the fix they pass. Both commits read
    the engine from the environment: NRL_VLLM_USE_V1=0 (V0, whose generation log-probs are of
    z / T, the harness's reference); at NeMo-RL's default (V1) the fixed worker divides by nothing."""
    import dataclasses

    from conftest import write_scenarios
    from shardcheck.scenarios import get_suite

    monkeypatch.setenv("NRL_VLLM_USE_V1", "0")
    [sc] = [dataclasses.replace(s, name="dtensor-t05", samples=s.samples[:1], temperature=0.5)
            for s in get_suite("logprob") if s.name == "bshd-tp1cp1-basic-logprob"]
    f = write_scenarios(tmp_path / "t05.json", [sc])
    repo = os.environ[REPO_ENV]
    parent, verdicts, _ = _run(tmp_path, "nemo_rl:dtensor", "--target-opt", "call=get_logprobs", "--nemo-rl-src",
                               export_commit(repo, "401cf126f", tmp_path / "parent", "nemo_rl"), "--scenario-file",
                               str(f))
    assert parent.returncode == 1, parent.stdout[-2000:] + parent.stderr[-2000:]
    assert "value_mismatch" in verdicts["dtensor-t05"]["kinds"], verdicts
    fixed, verdicts, _ = _run(tmp_path, "nemo_rl:dtensor", "--target-opt", "call=get_logprobs", "--nemo-rl-src",
                              export_commit(repo, "ba648542d", tmp_path / "fix", "nemo_rl"), "--scenario-file", str(f))
    assert fixed.returncode == 0 and verdicts["dtensor-t05"]["verdict"] == "pass", fixed.stdout[-2000:]
    # before e861b94dd only get_logprobs's call runs (train's log-probs came from its loss functions then)
    with pytest.raises(BadInput, match="call=get_logprobs runs there"):
        nemo_rl.target("dtensor", TargetConfig(str(tmp_path / "parent")))
