"""The areal target. Checking real AReaL needs a checkout (never pip install areal: it pulls ray,
transformers, megatron-bridge and more): set SHARDCHECK_AREAL_SRC to a clone of inclusionAI/AReaL.
Era detection, capabilities and skip reasons, bad input and the hygiene of what is compiled and
imported are checked on small fake checkouts without it; the historical fixes need
SHARDCHECK_AREAL_REPO (a clone with its history).

Over 20 s: with a checkout and its history (about 50 s here), the target runs suites and
training steps on real worlds and the historical fixes run shardcheck at two commits each
(without one: 1 s)."""

import dataclasses
import json
import os
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import export_commit, run_on_world
from shardcheck.errors import BadInput
from shardcheck.scenarios import Scenario, suites
from shardcheck.targets import areal, frameworks
from shardcheck.targets.areal import ENV, FRAMEWORK, detect_era
from shardcheck.targets.areal_data import compile_methods
from shardcheck.targets.base import TargetConfig
from shardcheck.targets.checkout import Checkout

AREAL_SRC = os.environ.get(ENV)
needs_areal = pytest.mark.skipif(not AREAL_SRC, reason=f"{ENV} is not set: no AReaL checkout to check (clone "
                                 "inclusionAI/AReaL and point it there; never pip install areal)")
REPO_ENV = "SHARDCHECK_AREAL_REPO"
needs_history = pytest.mark.skipif(not os.environ.get(REPO_ENV), reason=f"{REPO_ENV} is not set: no AReaL git "
                                   "repository with its history (a clone of inclusionAI/AReaL) to check past "
                                   "commits against")

# ---- fake checkouts ---------------------------------------------------------------------------

ENGINE = """
    class MegatronEngine:
        def forward_backward_batch(self, mb_list, process_output_fn, forward_only=False):
            def forward_step(batch_iter, model):
                return {"_cp_local_labels": split_packed_seqs_for_context_parallel(batch_iter, model)}
            return forward_step

        def _compute_logprobs_and_loss(self, output, inputs, loss_fn, loss_weight_fn, total_loss_weight):
            return reassemble_cp_packed_logprobs(output, inputs)

        def _compute_forward_result(self, output, inputs):
            return output
    """
TRAIN_ENGINE = "def reorder_and_pad_outputs(outputs, output_seqlens, mb_list, aggregate_fn):\n    return outputs\n"
VOCAB_PARALLEL = """
    import functools

    import torch
    from areal.infra.platforms import is_npu_available  # must not be run: pulls transformers


    def _log_softmax(logits, temperature):
        return torch.log_softmax(logits.float() / temperature, dim=-1)


    def gather_logprobs(logits, labels, temperature=1.0, tp_group=None, chunk_size=1024):
        return _log_softmax(logits, temperature).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


    def gather_logprobs_entropy(logits, labels, temperature=1.0, tp_group=None, chunk_size=1024):
        logp = _log_softmax(logits, temperature)
        return gather_logprobs(logits, labels, temperature), -(logp.exp() * logp).sum(-1)


    if not is_npu_available:
        _log_softmax = torch.compile(_log_softmax)
    """
DATA = """
    def amend_position_ids(data): ...
    def pack_tensor_dict(data): ...
    def pad_packed_tensor_dict(data, pad_to_length, pad_value=0.0, {align}): ...
    def pad_mb_list(mb_list, pad_value=0.0, pad_to_maximum=False, {align}): ...
    def unpad_logits(logits, padding_length, cu_seqlens=None, old_cu_seqlens=None): ...
    class MicroBatchList: ...
    """
NEW_ALIGN, OLD_ALIGN = "seq_align_to=None", "align_sequences=False, align_to_multiple_of=None"
CP = "def preprocess_packed_seqs_context_parallel(input_ids, cu_seqlens): ...\n"
MPU_FUNCTIONAL = """
    from megatron.core import parallel_state as mpu
    from areal.platforms import is_npu_available

    def gather_logprobs(logits, labels, temperature=1.0, chunk_size=1024):
        return mpu

    def gather_logprobs_entropy(logits, labels, temperature=1.0, chunk_size=1024):
        return _VocabParallelEntropy.apply(logits), mpu
    """
MPU_ENTROPY = """
    import torch

    class _VocabParallelEntropy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, logits):
            return logits.sum(-1)
    """


def _checkout(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))
    return root


def _new(root: Path) -> Path:
    """A checkout of the newest era: vocab_parallel.py, the packing, the engine's methods."""
    return _checkout(root, {"areal/engine/megatron_engine.py": ENGINE,
                            "areal/engine/core/train_engine.py": TRAIN_ENGINE,
                            "areal/utils/functional/vocab_parallel.py": VOCAB_PARALLEL,
                            "areal/utils/data.py": DATA.replace("{align}", NEW_ALIGN),
                            "areal/engine/megatron_utils/packed_context_parallel.py": CP})


def _old(root: Path) -> Path:
    """A checkout before 62d41759c: functional.py driven by parallel_state, verl's entropy."""
    return _checkout(root, {"areal/engine/megatron_engine.py": "class MegatronEngine:\n    pass\n",
                            "areal/utils/functional.py": MPU_FUNCTIONAL,
                            "areal/utils/mcore/functional.py": MPU_ENTROPY,
                            "areal/utils/data.py": DATA.replace("{align}", OLD_ALIGN),
                            "areal/utils/mcore/packed_context_parallel.py": CP})


def _scenario(name: str) -> Scenario:
    return next(s for s in suites.get_suite("smoke") if s.name == name)


@pytest.fixture
def on_gloo(monkeypatch):
    monkeypatch.setenv("SHARDCHECK_BACKEND", "gloo")


def test_era_of_the_newest_checkout(tmp_path):
    era = detect_era(_new(tmp_path))
    assert era.functions == "vocab_parallel" and era.functions_file == "areal/utils/functional/vocab_parallel.py"
    assert era.packing == {"cp_file": "areal/engine/megatron_utils/packed_context_parallel.py",
                              "seq_align_to": True, "fp8": False}
    assert era.engine["cp_local"] and era.engine["reassembles"]


def test_era_of_a_checkout_before_the_vocab_parallel_functions(tmp_path):
    era = detect_era(_old(tmp_path))
    assert era.functions == "mpu" and era.functions_file == "areal/utils/functional.py"
    assert era.packing == {"cp_file": "areal/utils/mcore/packed_context_parallel.py", "seq_align_to": False,
                              "fp8": False}
    assert era.engine is None


def test_a_checkout_without_the_functions_is_one_line(tmp_path):
    src = _checkout(tmp_path, {"areal/engine/megatron_engine.py": ""})
    with pytest.raises(BadInput, match="has neither areal/utils/functional/vocab_parallel.py") as info:
        areal.target(None, TargetConfig(str(src)))
    assert "\n" not in str(info.value)


def test_capabilities_and_skip_reasons(tmp_path, on_gloo, monkeypatch):
    src = str(_new(tmp_path))
    default = areal.target(None, TargetConfig(src)).capabilities
    assert "no all-gather CP" in default.skip_reason(_scenario("allgather-tp2cp2-many"))
    assert "replays no keep sets" in default.skip_reason(_scenario("thd-tp2cp1-replay"))
    for name in ("bshd-tp2cp1-basic", "zigzag-tp2cp2-basic", "thd-tp4cp1-edges"):
        assert default.skip_reason(_scenario(name)) is None, name
    engine = areal.target("engine", TargetConfig(src)).capabilities
    assert "packs every batch" in engine.skip_reason(_scenario("bshd-tp2cp1-basic"))
    assert engine.skip_reason(_scenario("thd-tp2cp1-basic")) is None
    # torch's gloo all-gather backward: skipped with the reason unless asked for or on nccl
    assert "scatters with the CP group's rank as a global src" in engine.skip_reason(_scenario("zigzag-tp2cp2-basic"))
    for option in ("torch", "shardcheck"):
        given = areal.target("engine", TargetConfig(src, (("cp_all_gather", option),))).capabilities
        assert given.skip_reason(_scenario("zigzag-tp2cp2-basic")) is None
    monkeypatch.setenv("SHARDCHECK_BACKEND", "nccl")
    assert areal.target("engine", TargetConfig(src)).capabilities.skip_reason(_scenario("zigzag-tp2cp2-basic")) is None
    forward = areal.target("forward", TargetConfig(src)).capabilities
    assert "log-probs only" in forward.skip_reason(_scenario("thd-tp2cp1-basic"))
    assert forward.skip_reason(_scenario("zigzag-tp2cp2-many")) is None  # no reassembly on forward_batch's path
    long = Scenario("long", _scenario("thd-tp2cp1-many").samples, vocab=32, tp=2,
                    layout_knobs={"max_tokens_per_mb": 16})
    assert "split these" in engine.skip_reason(long) and default.skip_reason(long) is None


def test_the_variants_need_the_engine_and_its_packing(tmp_path):
    old = str(_old(tmp_path / "old"))
    assert areal.target(None, TargetConfig(old)).definitions.loss_over == "held"
    with pytest.raises(BadInput, match="came with 0369627d4"):
        areal.target("engine", TargetConfig(old))
    new = str(_new(tmp_path / "new"))
    with pytest.raises(BadInput, match="runs on AReaL's own packing .*layout=shardcheck was asked"):
        areal.target("forward", TargetConfig(new, (("layout", "shardcheck"),)))
    with pytest.raises(BadInput, match="option cp_all_gather='nccl': expected torch or shardcheck"):
        areal.target("engine", TargetConfig(new, (("cp_all_gather", "nccl"),)))
    with pytest.raises(BadInput, match="option layout='mine': expected framework or shardcheck"):
        areal.target(None, TargetConfig(new, (("layout", "mine"),)))
    with pytest.raises(BadInput, match="no variant 'policy'"):
        areal.target("policy", TargetConfig(new))
    engine = areal.target("engine", TargetConfig(new))
    assert engine.definitions.loss_over == "gathered"
    assert "reassemble_cp_packed_logprobs" in engine.definitions.loss_source
    described = engine.describe()
    assert described["name"] == "areal:engine" and described["version"].startswith("checkout ")
    assert described["cp_all_gather"].startswith("torch's own on nccl")
    plain = areal.target(None, TargetConfig(new, (("layout", "shardcheck"),)))
    assert plain.data_path is None and plain.describe()["data_path"] == "shardcheck's layout (layout=shardcheck)"


def test_the_loss_variant_is_refused_where_its_actor_or_option_is_not(tmp_path):
    """areal:loss needs the PPO actor's loss (grpo_loss_fn) beside the engine: a checkout without it
    is one line; entropy_bonus takes none or adapter, and is areal:loss's alone."""
    new = str(_new(tmp_path))
    with pytest.raises(BadInput, match="no grpo_loss_fn in areal/trainer/ppo/actor.py") as info:
        frameworks.areal_target("loss", TargetConfig(new))
    assert "\n" not in str(info.value)
    with pytest.raises(BadInput, match="option entropy_bonus='yes': expected none or adapter"):
        frameworks.areal_target("loss", TargetConfig(new, (("entropy_bonus", "yes"),)))
    with pytest.raises(BadInput, match="option entropy_bonus is areal:loss's"):
        areal.target("engine", TargetConfig(new, (("entropy_bonus", "adapter"),)))


def test_compiling_and_importing_write_nothing_and_are_undone(tmp_path):
    """The functions are compiled from their file (the module's top level, which imports
    areal.infra.platforms and torch.compiles, is not run); a module of AReaL imported as it is
    (verl's entropy before 62d41759c) runs no package __init__; nothing is written into the
    checkout; release() undoes all of it."""
    import torch

    src = _checkout(_new(tmp_path), {"areal/__init__.py": "raise RuntimeError('areal/__init__.py must not run')\n",
                                     "areal/utils/mcore/functional.py": MPU_ENTROPY})
    before = (set(sys.modules), list(sys.meta_path), sys.dont_write_bytecode)
    target = areal.target(None, TargetConfig(str(src)))
    try:
        fns = target._functions()
        logits, labels = torch.tensor([[0.0, 1.0], [2.0, 0.0]]), torch.tensor([1, 0])
        assert torch.allclose(fns["gather_logprobs"](logits, labels), torch.log_softmax(logits, -1)[[0, 1], [1, 0]])
        assert fns["gather_logprobs"].__code__.co_filename == str(src / "areal/utils/functional/vocab_parallel.py")
        assert set(sys.modules) == before[0]  # compiled, not imported
    finally:
        target.release()
    # the import as the target makes it, but without the eager switch: importing torch._dynamo
    # costs seconds (the history tests run it, at b160ebe2b)
    checkout = Checkout(dataclasses.replace(FRAMEWORK, eager=False), src)
    try:
        module = checkout.import_module(areal.MPU_ENTROPY_MODULE)
        assert module.__file__ == str(src / "areal/utils/mcore/functional.py")
        assert set(checkout.package_inits_not_run) == {"areal", "areal.utils", "areal.utils.mcore"}
    finally:
        checkout.release()
    assert (set(sys.modules), list(sys.meta_path), sys.dont_write_bytecode) == before
    assert not list(src.rglob("*.pyc")), "bytecode was written into the checkout"


def test_methods_compiled_alone_name_what_they_lack(tmp_path):
    path = _new(tmp_path) / "areal/engine/megatron_engine.py"
    with pytest.raises(LookupError, match="read reassemble_cp_packed_logprobs, split_packed_seqs_for_context_parallel"):
        compile_methods(path, "MegatronEngine", ("forward_backward_batch", "_compute_logprobs_and_loss"), {})
    methods = compile_methods(path, "MegatronEngine", ("_compute_logprobs_and_loss",),
                              {"reassemble_cp_packed_logprobs": lambda output, inputs: (output, inputs)})
    assert methods["_compute_logprobs_and_loss"](None, 1, 2, None, None, None) == (1, 2)
    line = path.read_text().splitlines().index("    def _compute_logprobs_and_loss(self, output, inputs, loss_fn, "
                                              "loss_weight_fn, total_loss_weight):") + 1
    assert methods["_compute_logprobs_and_loss"].__code__.co_firstlineno == line  # its line in the file
    with pytest.raises(LookupError, match="has no _train_step"):
        compile_methods(path, "MegatronEngine", ("_train_step",), {})


@pytest.mark.parametrize("where", ["missing", "not a checkout"])
def test_cli_without_a_checkout_is_one_line_exit_2(tmp_path, monkeypatch, cli_in_process, where):
    monkeypatch.delenv(ENV, raising=False)
    path = tmp_path / "x" if where == "missing" else tmp_path
    proc = cli_in_process("run", "--target", "areal", "--areal-src", str(path))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    want = "is not a directory" if where == "missing" else "is not a AReaL checkout"
    assert proc.stderr.strip().count("\n") == 0 and want in proc.stderr and "Traceback" not in proc.stderr


def test_a_layout_knob_value_it_does_not_take_is_one_line_exit_2(tmp_path, cli_in_process):
    src = _new(tmp_path / "src")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"name": "bad", "samples": [[5, 2]], "vocab": 8,
                                "layout_knobs": {"pad_to_maximum": "yes"}}]))
    proc = cli_in_process("run", "--target", "areal", "--areal-src", str(src), "--scenario-file", str(bad))
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "layout knob pad_to_maximum must be true or false, got 'yes'" in proc.stderr


# ---- against a real checkout --------------------------------------------------------------------

def _run(world, tmp_path, monkeypatch, target: str, scenarios, *, src: str | None = None, commit: str | None = None,
         options: dict | None = None, **checks):
    """``shardcheck run --target TARGET`` on the session's world with the checkout ``src`` (default:
    SHARDCHECK_AREAL_SRC), ``--target-opt``s and the run's ``checks`` (mask_leak, coverage):
    verdicts by name, and the report."""
    if src is not None:
        monkeypatch.setenv(ENV, src)
    if commit is not None:
        monkeypatch.setenv("SHARDCHECK_AREAL_COMMIT", commit)
    if options:
        monkeypatch.setenv("SHARDCHECK_TARGET_OPTS", json.dumps([[k, v] for k, v in options.items()]))
    else:
        monkeypatch.delenv("SHARDCHECK_TARGET_OPTS", raising=False)
    scenarios = [s if isinstance(s, Scenario) else Scenario.from_dict(s) for s in scenarios]
    run = run_on_world(world, scenarios, target, tmp_path / f"{target.replace(':', '-')}.json", "areal", **checks)
    return run, {v["name"]: v for v in run.report["scenarios"]}


def _smoke(*names: str) -> list[Scenario]:
    return [s for s in suites.get_suite("smoke") if not names or s.name in names]


@needs_areal
@pytest.mark.world
def test_areal_passes_every_smoke_scenario_it_runs(world, tmp_path, monkeypatch):
    """AReaL's newest functions (4aef98d8d) are right on every smoke scenario they run, their thd and
    zigzag rows laid out by AReaL's own packing; all-gather CP and replay are skipped, each with
    its reason."""
    run, verdicts = _run(world, tmp_path, monkeypatch, "areal", _smoke())
    assert run.exit_code == 0, run.stdout[-3000:]
    assert {v["verdict"] for v in verdicts.values()} == {"pass", "skip"}
    assert "no all-gather CP" in verdicts["allgather-tp2cp2-basic"]["reason"]
    assert "replays no keep sets" in verdicts["thd-tp2cp1-replay"]["reason"]
    assert verdicts["zigzag-tp2cp2-basic"]["layout_built_by"].endswith("preprocess_packed_seqs_context_parallel")
    assert "packs every batch" in verdicts["bshd-tp2cp1-basic"]["layout_note"]
    assert run.report["target"]["stubbed_modules"] == []
    assert run.report["target"]["era"]["functions"] == "vocab_parallel"


@needs_areal
@pytest.mark.world
def test_the_engines_train_path_holds_every_token_on_every_cp_rank(world, tmp_path, monkeypatch):
    """areal:engine (train_batch's path, compiled from megatron_engine.py): every CP rank's loss
    gets every token (reassemble_cp_packed_logprobs), checked as gathered. On gloo torch's own
    all-gather backward is skipped with the reason; with shardcheck's gloo-safe all-gather of the
    same contract every zigzag scenario passes."""
    names = ("thd-tp2cp1-edges", "thd-tp1cp1-long-prompt", "zigzag-tp2cp2-edges", "zigzag-tp1cp4-basic",
             "zigzag-tp1cp2-many")
    run, verdicts = _run(world, tmp_path, monkeypatch, "areal:engine", _smoke(*names))
    assert run.exit_code == 0, run.stdout[-3000:]
    assert "torch limitation" in verdicts["zigzag-tp2cp2-edges"]["reason"]
    assert verdicts["thd-tp2cp1-edges"]["verdict"] == "pass"
    run, verdicts = _run(world, tmp_path, monkeypatch, "areal:engine", _smoke(*names),
                         options={"cp_all_gather": "shardcheck"})
    assert run.exit_code == 0 and {v["verdict"] for v in verdicts.values()} == {"pass"}, run.stdout[-3000:]
    assert "every CP rank's log-probs and entropy checked" in run.report["target"]["definitions"]["loss"]
    assert run.report["target"]["cp_all_gather"].startswith("shardcheck's gloo-safe all-gather")


FORWARD_UNDER_CP = [
    {"name": "forward-cp2", "samples": [[2, 1]], "vocab": 2, "cp": 2, "layout": "zigzag", "with_entropy": False,
     "seed": 1},
    {"name": "forward-tp2cp2", "samples": [[2, 1]], "vocab": 4, "tp": 2, "cp": 2, "layout": "zigzag",
     "with_entropy": False, "seed": 1},
    {"name": "forward-cp1", "samples": [[2, 1]], "vocab": 2, "with_entropy": False, "seed": 1},
]


@needs_areal
@pytest.mark.world
def test_forward_batch_under_cp_scores_the_wrong_rows(world, tmp_path, monkeypatch):
    """A finding at AReaL's newest commit (since d58cca56f): forward_batch (compute_logp: the
    reference, teacher and proximal log-probs) keeps the logits CP-local but
    _compute_forward_result rolls the labels on the unpadded, unsplit input_ids and never
    reassembles: tp = 1 scores the first N local rows (wrong values), tp > 1 raises."""
    run, verdicts = _run(world, tmp_path, monkeypatch, "areal:forward", FORWARD_UNDER_CP)
    assert run.exit_code == 1, run.stdout[-3000:]
    assert verdicts["forward-cp1"]["verdict"] == "pass"
    assert "value_mismatch" in verdicts["forward-cp2"]["kinds"], verdicts["forward-cp2"]
    failure = verdicts["forward-tp2cp2"]["failures"][0]
    assert failure["kind"] == "rank_error" and "IndexError: shape mismatch" in failure["message"], failure
    assert "vocab_parallel.py" in failure["message"]


@needs_areal
@pytest.mark.world
def test_areals_layout_knobs_move_its_padding(world, tmp_path, monkeypatch):
    """pad_to_maximum pads the micro-batch to max_tokens_per_mb rounded up to lcm(alignment, 256);
    enable_fp8 aligns each sequence to 16; a batch longer than max_tokens_per_mb (several
    micro-batches) is skipped, with the reason."""
    base = {"samples": [[23, 9], [14, 6], [5, 2]], "vocab": 64, "tp": 2, "seed": 5}
    run, verdicts = _run(world, tmp_path, monkeypatch, "areal", [
        dict(base, name="page"), dict(base, name="to-maximum",
                                      layout_knobs={"pad_to_maximum": True, "max_tokens_per_mb": 300}),
        dict(base, name="fp8", layout_knobs={"enable_fp8": True}),
        dict(base, name="two-micro-batches", layout_knobs={"max_tokens_per_mb": 32})])
    assert run.exit_code == 0, run.stdout[-3000:]
    assert {n: v["verdict"] for n, v in verdicts.items()} == {"page": "pass", "to-maximum": "pass", "fp8": "pass",
                                                              "two-micro-batches": "skip"}
    rows = {n: v["layouts"]["0"]["shape"][1] for n, v in verdicts.items() if v.get("layouts")}
    assert rows == {"page": 256, "to-maximum": 512, "fp8": 256}, rows
    assert "split these 42 tokens" in verdicts["two-micro-batches"]["reason"]
    pieces = {n: v["layouts"]["0"]["pieces"] for n, v in verdicts.items() if v.get("layouts")}
    assert pieces["fp8"] != pieces["page"]  # each sequence padded to 16 (32, 16, 16), not to tp


DIST_F_GATHER = "    gathered_list = dist_F.all_gather(local_tensor, group=cp_group)\n"
OWN_ROWS_ONLY = """    gathered_list = [torch.empty_like(local_tensor) for _ in range(cp_size)]
    dist.all_gather(gathered_list, local_tensor.detach(), group=cp_group)
    gathered_list[mpu.get_context_parallel_rank()] = local_tensor  # planted: no sum over CP in backward
"""


def _copy_without_the_cp_sum(root: Path) -> Path:
    """The files the adapter reads, copied from the checkout, reassemble_cp_packed_logprobs planted to
    keep each rank's own gradient only (AReaL's gather of the logits before d58cca56f)."""
    files = ["areal/engine/megatron_engine.py", "areal/engine/core/train_engine.py", "areal/utils/data.py",
             "areal/utils/math.py", "areal/utils/constants.py", "areal/utils/functional/vocab_parallel.py",
             "areal/engine/megatron_utils/packed_context_parallel.py"]
    for name in files:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(AREAL_SRC) / name, root / name)
    cp = root / files[-1]
    text = cp.read_text()
    assert text.count(DIST_F_GATHER) == 1, "reassemble_cp_packed_logprobs changed"
    cp.write_text(text.replace(DIST_F_GATHER, OWN_ROWS_ONLY))
    return root


@needs_areal
@pytest.mark.world
def test_gathered_catches_a_reassembly_whose_backward_does_not_sum(world, tmp_path, monkeypatch):
    """Why areal:engine declares loss_over="gathered" from 95e2379d0: every CP rank's loss is the
    whole sequence's / cp, so only a backward that sums the CP ranks' gradients is right. With the
    reassembly's sum planted away each rank's gradient is 1/cp of the truth: grad_mismatch, every
    scenario (under the per-rank convention it would pass)."""
    src = str(_copy_without_the_cp_sum(tmp_path / "planted"))
    run, verdicts = _run(world, tmp_path, monkeypatch, "areal:engine", _smoke("zigzag-tp1cp2-edges",
                                                                              "zigzag-tp2cp2-many"), src=src,
                         options={"cp_all_gather": "torch"})  # the plant calls no dist_F
    assert run.exit_code == 1, run.stdout[-3000:]
    for name, v in verdicts.items():
        assert set(v["kinds"]) == {"grad_mismatch"}, (name, v["kinds"])


def _training(*names: str) -> list[Scenario]:
    return [s for s in suites.get_suite("training") if s.name in names]


ADAPTER_TERMS = {"entropy_bonus": "adapter", "cp_all_gather": "shardcheck"}


@needs_areal
def test_the_loss_variant_declares_areals_normalisation_and_what_it_skips(on_gloo):
    """areal:loss declares the global batch's token mean in AReaL's own names, read from its files
    (the actor's loss_weight_fn, train_batch's total_loss_weight over DP x CP and loss_multiplier
    with len(mb_list)), megatron's two-value form; what it cannot run is skipped, saying why."""
    target = frameworks.areal_target("loss", TargetConfig(AREAL_SRC))
    try:
        assert target.loss_form == "step" and target.calculate_per_token_loss is False
        assert target.definitions.objective == "token_mean"
        source = target.definitions.objective_source
        for said in ("lambda x: x['loss_mask'].count_nonzero()", "areal/trainer/ppo/actor.py:",
                     "mpu.get_data_parallel_group(with_context_parallel=True)",
                     "self.optimizer.get_loss_scale().item() * len(mb_list)"):
            assert said in source, source
        cells = {s.name: s for s in suites.get_suite("training")}
        skip = target.capabilities.skip_reason
        assert "has no entropy term" in skip(cells["step-thd-dp2-mb3"])  # entropy_coef 0.1
        assert "no all-gather CP" in skip(cells["step-allgather-cp2tp2-mb3"])
        assert "packs every batch" in skip(cells["step-bshd-dp2tp2-mb3"])
        assert "torch limitation" in skip(cells["step-zigzag-dp2cp2-mb2"])  # a CP group other than ranks 0, 1
        masked = Scenario.from_dict({"name": "m", "samples": [[6, 1], [7, 3]], "vocab": 8, "micro_batch_size": 1,
                                     "seed": 3})
        assert "has every token masked" in skip(masked)
        described = target.describe()
        assert described["loss"]["loss_fn"].startswith("areal/trainer/ppo/actor.py:")
        assert "functools.partial(grpo_loss_fn" in described["loss"]["loss_fn"]
    finally:
        target.release()
    with_terms = frameworks.areal_target("loss", TargetConfig(AREAL_SRC, tuple(ADAPTER_TERMS.items())))
    assert with_terms.capabilities.skip_reason(cells["step-thd-dp2-mb3"]) is None
    assert with_terms.capabilities.skip_reason(cells["step-zigzag-dp2cp2-mb2"]) is None


@needs_areal
@pytest.mark.world
def test_areals_ppo_actor_loss_passes_the_training_step(world, tmp_path, monkeypatch):
    """AReaL's PPO actor loss through train_batch at the pin: the optimizer's gradient is the global
    batch's token mean over dp, micro-batches, tp and cp (the adapter's entropy term and gloo-safe
    CP all-gather on). The mask-leak run is off here: its NaN stops in AReaL's own guard (below)."""
    names = ("step-thd-dp2-mb3", "step-zigzag-cp4-mb2", "step-zigzag-tp2cp2-mb3", "step-thd-dp2tp2-bf16",
             "step-bshd-dp2tp2-mb3")
    run, verdicts = _run(world, tmp_path, monkeypatch, "areal:loss", _training(*names), options=ADAPTER_TERMS,
                         mask_leak=False)
    assert run.exit_code == 0, run.stdout[-3000:]
    assert {n: v["verdict"] for n, v in verdicts.items()} == {**{n: "pass" for n in names[:-1]},
                                                              "step-bshd-dp2tp2-mb3": "skip"}


@needs_areal
@pytest.mark.world
def test_the_mask_leak_run_stops_in_areals_prox_logp_guard(world, tmp_path, monkeypatch):
    """A finding, judged by design (docs/areal.md): the mask-leak run's NaN at the masked tokens of
    the old log-probs reaches prox_logp (as AReaL's compute_advantages leaves it, logprobs and
    prox_logp the same), and grpo_loss_fn's _resolve_proximal_logp refuses a NaN anywhere in it:
    the step raises instead of letting it through."""
    run, verdicts = _run(world, tmp_path, monkeypatch, "areal:loss", _training("step-thd-dp2-mb3"),
                         options=ADAPTER_TERMS)
    assert run.exit_code == 1, run.stdout[-3000:]
    [failure] = verdicts["step-thd-dp2-mb3"]["failures"]
    assert failure["kind"] == "rank_error", failure
    assert "prox_logp contains NaN or Inf" in failure["message"], failure["message"]
    assert "areal/trainer/ppo/actor.py" in failure["message"] and "_resolve_proximal_logp" in failure["message"]


@needs_areal
@pytest.mark.world
def test_coverage_of_the_loss_names_areals_loss_the_schedule_and_ddp(world, tmp_path, monkeypatch):
    run, _ = _run(world, tmp_path, monkeypatch, "areal:loss", _training("step-thd-dp2-mb3"), options=ADAPTER_TERMS,
                  mask_leak=False, coverage=True)
    assert run.exit_code == 0, run.stdout[-3000:]
    ran = {name for f in run.report["coverage"]["files"].values() for name in f["functions"]}
    for name in ("areal/trainer/ppo/actor.py:grpo_loss_fn", "areal/utils/functional/functional.py:ppo_actor_loss_fn",
                 "areal/engine/megatron_engine.py:MegatronEngine.train_batch",
                 "areal/engine/megatron_engine.py:MegatronEngine._compute_logprobs_and_loss",
                 "areal/engine/core/train_engine.py:compute_total_loss_weight",
                 "megatron-core/megatron/core/pipeline_parallel/schedules.py:forward_backward_no_pipelining",
                 "megatron-core/megatron/core/distributed/param_and_grad_buffer.py:_ParamAndGradBucketGroup."
                 "finish_grad_sync",
                 "megatron-core/megatron/core/distributed/finalize_model_grads.py:finalize_model_grads"):
        assert name in ran, sorted(ran)


@needs_areal
def test_compiling_the_real_checkout_writes_nothing_into_it():
    target = areal.target("engine", TargetConfig(AREAL_SRC))
    src = target.src
    before = set(src.rglob("*.pyc"))
    try:
        assert set(target._functions()) >= {"gather_logprobs", "gather_logprobs_entropy"}
        assert set(target.data_path.functions()) >= {"pack_tensor_dict", "pad_mb_list",
                                                     "preprocess_packed_seqs_context_parallel"}
        assert target.stubs == []
    finally:
        target.release()
    assert set(src.rglob("*.pyc")) == before
    assert not [m for m in sys.modules if m == "areal" or m.startswith("areal.")]


# ---- AReaL's history ---------------------------------------------------------------------------

PR_667, PR_667_PARENT = "62d41759c", "b160ebe2b"  # "vocab parallel logprobs and entropy" (#667)
PR_1249, PR_1249_PARENT = "95e2379d0", "2498d17e7"  # CP log-probs reassembled before the loss (#1249)
CP_LOCAL = "d58cca56f"  # #1223, "avoid gathering CP logits"


def _export(tmp_path: Path, rev: str) -> str:
    return export_commit(os.environ[REPO_ENV], rev, tmp_path / rev.replace("~", "-parent"), "areal")


@needs_history
@pytest.mark.world
def test_the_entropy_backward_on_shared_logits_fixed_at_62d41759c(world, tmp_path, monkeypatch):
    """Before 62d41759c AReaL's megatron path computed the entropy (verl's _VocabParallelEntropy,
    which saves its input for backward) and the log-probs (megatron-core's
    vocab_parallel_cross_entropy, which writes into its input) on the same scaled logits: the
    entropy's backward raises at tp = 2 once the entropy is differentiated (entropy_coef != 0;
    AReaL's own losses detach it, so it was latent). 62d41759c's fused function fixes it."""
    scenarios = _smoke("thd-tp2cp1-basic", "thd-tp2cp1-long-prompt")  # entropy_coef 0.1 and 0
    parent = _export(tmp_path, PR_667_PARENT)
    run, verdicts = _run(world, tmp_path, monkeypatch, "areal", scenarios, src=parent, commit=PR_667_PARENT)
    assert run.exit_code == 1 and run.report["target"]["era"]["functions"] == "mpu", run.stdout[-3000:]
    failure = verdicts["thd-tp2cp1-basic"]["failures"][0]
    assert failure["kind"] == "rank_error" and "modified by an inplace operation" in failure["message"], failure
    assert "areal/utils/mcore/functional.py" in failure["message"] and "in backward" in failure["message"]
    assert verdicts["thd-tp2cp1-long-prompt"]["verdict"] == "pass"  # the entropy detached, as AReaL's loss does
    run, verdicts = _run(world, tmp_path, monkeypatch, "areal", scenarios, src=_export(tmp_path, PR_667),
                         commit=PR_667)
    assert run.exit_code == 0 and run.report["target"]["era"]["functions"] == "vocab_parallel", run.stdout[-3000:]


CP_LOSS = [{"name": "cp-loss-inputs", "samples": [[7, 4], [7, 5]], "vocab": 16, "cp": 2, "layout": "zigzag",
            "seed": 1249}]


@needs_history
@pytest.mark.world
def test_the_cp_local_loss_inputs_fixed_at_95e2379d0(world2, tmp_path, monkeypatch):
    """d58cca56f kept the logits CP-local and handed the loss each rank's own padded, zigzag-ordered
    log-probs with the whole sequence's old log-probs and advantages: AReaL's PPO loss cannot combine
    them (any cp >= 2). 95e2379d0 reassembles them first; it passes with torch's own all-gather
    (a 2-rank world: the CP group is global ranks 0 and 1)."""
    options = {"cp_all_gather": "torch"}
    run, verdicts = _run(world2, tmp_path, monkeypatch, "areal:engine", CP_LOSS, src=_export(tmp_path, PR_1249_PARENT),
                         commit=PR_1249_PARENT, options=options)
    assert run.exit_code == 1, run.stdout[-3000:]
    failure = verdicts["cp-loss-inputs"]["failures"][0]
    assert failure["kind"] == "rank_error", failure
    assert "handed log-probs of shape (128,) with inputs['logprobs'] of shape (14,)" in failure["message"]
    run, verdicts = _run(world2, tmp_path, monkeypatch, "areal:engine", CP_LOSS, src=_export(tmp_path, PR_1249),
                         commit=PR_1249, options=options)
    assert run.exit_code == 0, run.stdout[-3000:]


def engine_declared_gathered(config=None):
    """areal:engine with loss_over forced to "gathered" (a test's target: the wrong declaration
    before d58cca56f, when AReaL gathered the logits with the gradient on each rank's own rows)."""
    target = areal.target("engine", config)
    target.definitions = dataclasses.replace(target.definitions, loss_over="gathered")
    return target


engine_declared_gathered.options = areal.OPTIONS


@needs_history
@pytest.mark.world
def test_the_cp_convention_follows_the_commit(world, tmp_path, monkeypatch):
    """Before d58cca56f AReaL all-gathered the logits over CP with the gradient kept on each rank's
    own rows and its loss weight normalised over DP only: each rank's own rows carry its whole
    gradient, so the target declares loss_over="held" there and passes; declared "gathered" it
    fails grad_mismatch (each rank's gradient 1/cp). forward_batch under CP is right there, and
    wrong from d58cca56f on (the finding above)."""
    before = _export(tmp_path, f"{CP_LOCAL}~1")
    zigzag = _smoke("zigzag-tp1cp2-edges", "zigzag-tp2cp2-many")
    run, verdicts = _run(world, tmp_path, monkeypatch, "areal:engine", zigzag, src=before, commit=f"{CP_LOCAL}~1")
    assert run.exit_code == 0 and {v["verdict"] for v in verdicts.values()} == {"pass"}, run.stdout[-3000:]
    assert "the tokens its own rows score" in run.report["target"]["definitions"]["loss"]
    run, verdicts = _run(world, tmp_path, monkeypatch, "test_areal:engine_declared_gathered", zigzag, src=before,
                         commit=f"{CP_LOCAL}~1")
    assert run.exit_code == 1
    for name, v in verdicts.items():
        assert set(v["kinds"]) == {"grad_mismatch"}, (name, v["kinds"])
    run, verdicts = _run(world, tmp_path, monkeypatch, "areal:forward", FORWARD_UNDER_CP, src=before,
                         commit=f"{CP_LOCAL}~1")
    assert run.exit_code == 0, run.stdout[-3000:]
    run, verdicts = _run(world, tmp_path, monkeypatch, "areal:forward", FORWARD_UNDER_CP,
                         src=_export(tmp_path, CP_LOCAL), commit=CP_LOCAL)
    assert run.exit_code == 1 and verdicts["forward-cp1"]["verdict"] == "pass"


PR_1104 = "be621da55"  # "fix pad_packed_tensor_dict": no padding sequence where there is nothing to pad
PAGE = [{"name": "packed-to-a-page", "samples": [[200, 50], [56, 10]], "vocab": 32, "seed": 1104},
        {"name": "packed-to-a-page-cp2", "samples": [[200, 50], [56, 10]], "vocab": 32, "cp": 2, "layout": "zigzag",
         "seed": 1104}]


@needs_history
@pytest.mark.world
def test_a_zero_length_sequence_handed_to_the_model_fixed_at_be621da55(world2, tmp_path, monkeypatch):
    """pad_packed_tensor_dict appended the padded length to cu_seqlens even when there was nothing
    to pad: two samples filling AReaL's 256-token page exactly gave the model's attention a
    sequence of zero length (cu_seqlens [0, 200, 256, 256]). What the model is handed is checked
    against the learned layout (harness/rank/life/model_inputs.py): a layout_mismatch at the parent,
    nothing at the fix."""
    run, verdicts = _run(world2, tmp_path, monkeypatch, "areal", PAGE, src=_export(tmp_path, f"{PR_1104}~1"),
                         commit=f"{PR_1104}~1")
    assert run.exit_code == 1, run.stdout[-3000:]
    for name in ("packed-to-a-page", "packed-to-a-page-cp2"):
        [failure] = verdicts[name]["failures"]
        assert failure["kind"] == "layout_mismatch", failure
        assert failure["message"].endswith("handed the model cu_seqlens [0, 200, 256, 256]: sequence 2 has zero "
                                           "length (256 to 256)"), failure["message"]
    run, verdicts = _run(world2, tmp_path, monkeypatch, "areal", PAGE, src=_export(tmp_path, PR_1104), commit=PR_1104)
    assert run.exit_code == 0, run.stdout[-3000:]


PR_1273, PR_1273_PARENT = "5e9fb505c", "b4387877b"  # "compensate pipeline schedule's /num_microbatches" (#1273)
TWO_MICRO_BATCHES = [{"name": "step-thd-dp4-mb2", "samples": [[23, 9], [14, 6], [9, 1], [17, 11], [30, 4], [12, 7],
                                                              [19, 8], [11, 5]],
                      "vocab": 32, "dp": 4, "micro_batch_size": 1, "seed": 1273}]


@needs_history
@pytest.mark.world
def test_the_schedules_division_by_num_microbatches_cancelled_at_5e9fb505c(world, tmp_path, monkeypatch):
    """Before #1273 train_batch's loss_multiplier was dp x loss_scale: megatron's schedule divides a
    two-value loss by num_microbatches, so two micro-batches gave the optimizer half the gradient.
    5e9fb505c multiplies by len(mb_list). dp 4 and two micro-batches keep the factor's name apart;
    cp 1: that era hands its loss CP-local log-probs (fixed at 95e2379d0). The mask-leak run is
    off: its NaN stops in AReaL's guard at both commits."""
    run, verdicts = _run(world, tmp_path, monkeypatch, "areal:loss", TWO_MICRO_BATCHES,
                         src=_export(tmp_path, PR_1273_PARENT), commit=PR_1273_PARENT, mask_leak=False)
    assert run.exit_code == 1, run.stdout[-3000:]
    first = verdicts["step-thd-dp4-mb2"]["failures"][0]
    assert first["kind"] == "grad_mismatch", first
    assert "is x 0.500 the reference's on every row (= 1 / num_microbatches): token_mean scaled wrong" in \
        first["message"], first["message"]
    assert "self.optimizer.get_loss_scale().item()" in run.report["target"]["loss"]["loss_multiplier"]
    run, verdicts = _run(world, tmp_path, monkeypatch, "areal:loss", TWO_MICRO_BATCHES,
                         src=_export(tmp_path, PR_1273), commit=PR_1273, mask_leak=False)
    assert run.exit_code == 0, run.stdout[-3000:]
    assert run.report["target"]["loss"]["loss_multiplier"].endswith("* len(mb_list)")
