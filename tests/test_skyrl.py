"""The skyrl target. Checking real SkyRL needs a checkout (never pip install skyrl: it pulls ray,
vLLM and its whole training stack): set SHARDCHECK_SKYRL_SRC to a clone of NovaSky-AI/SkyRL.
Era detection, capabilities, the import's hygiene and bad input are checked on small fake
checkouts without it; the historical fixes need SHARDCHECK_SKYRL_REPO (a clone with its
history).

Over 20 s: with a checkout, each world test runs SkyRL's real code on a 4-rank gloo world, and
skyrl:loss runs the training suite twice (token_mean, sequence_mean), a mask-leak step and three
commits of SkyRL's history (about 30 s of the file's time together)."""

import dataclasses
import json
import os
import sys
import textwrap

import pytest

from conftest import export_commit, run_on_world
from shardcheck.errors import BadInput
from shardcheck.scenarios.scenario import Scenario
from shardcheck.scenarios.suites import get_suite
from shardcheck.targets import skyrl
from shardcheck.targets.base import OPTS_ENV, TargetConfig
from shardcheck.targets.checkout import Checkout
from shardcheck.targets.frameworks import skyrl_target as target
from shardcheck.targets.skyrl import ENV, FRAMEWORK, MODULE, detect_era
from shardcheck.targets.compiled import with_newer_fields
from shardcheck.targets.skyrl_data import ALLGATHER_WHY, SkyRLDataPath

SKYRL_SRC = os.environ.get(ENV)
needs_skyrl = pytest.mark.skipif(not SKYRL_SRC, reason=f"{ENV} is not set: no SkyRL checkout to check (clone "
                                 "NovaSky-AI/SkyRL and point it there; never pip install skyrl)")
REPO_ENV = "SHARDCHECK_SKYRL_REPO"
needs_history = pytest.mark.skipif(
    not os.environ.get(REPO_ENV), reason=f"{REPO_ENV} is not set: no SkyRL git repository with its history (a "
    "clone of NovaSky-AI/SkyRL) to check past commits against")

MEGATRON = "skyrl/backends/skyrl_train/distributed/megatron"
# Signatures only: what era detection reads (nothing here runs SkyRL's code).
LOGPROBS = """
def from_parallel_logits_to_logprobs(vocab_parallel_logits, target, vocab_start_index, vocab_end_index, tp_group,
                                     inference_only=False, cp_group=None, chunk_size=None):
    pass
"""
PACKED = """
def from_parallel_logits_to_logprobs_packed_sequences(vocab_parallel_logits, target, cu_seqlens_padded,
                                                      unpacked_seqlen, vocab_start_index, vocab_end_index, group,
                                                      inference_only=False, cp_group=None, chunk_size=None{}):
    pass
"""
FUSED = """
def from_parallel_hidden_to_logprobs(hidden, lm_head_weight, target, vocab_start_index, vocab_end_index):
    pass

def from_parallel_hidden_to_logprobs_packed_sequences(hidden, lm_head_weight, target, cu_seqlens_padded):
    pass

def _fused_vocab_parallel_entropy_from_hidden(hidden, lm_head_weight, tp_group, chunk_size=None):
    pass
"""
MODEL_UTILS_NEW = LOGPROBS + PACKED.format(", attention_mask=None, sub_seq_lengths=None") + FUSED + """
def vocab_parallel_entropy(vocab_parallel_logits, chunk_size=None, chunk_memory_mb=512):
    pass
"""
MODEL_UTILS_OLD = LOGPROBS + PACKED.format("") + """
def vocab_parallel_entropy(vocab_parallel_logits):
    pass
"""
UTILS_NEW = """
def preprocess_packed_seqs(input_ids, attention_mask, pre_process=True, sub_seq_lengths=None, fp8_enabled=False):
    return input_ids, PackedSeqParams(qkv_format="thd", total_tokens=0)
"""
UTILS_OLD = """
def preprocess_packed_seqs(input_ids, attention_mask, pre_process=True):
    return input_ids, PackedSeqParams(qkv_format="thd")

def postprocess_packed_seqs(output, packed_seq_params, attention_mask, batch_size, seq_len, post_process=True):
    return output
"""
BATCH_NEW = """
def convert_prompts_responses_to_batch_tensors(pad_token_id, prompts, responses, rewards, loss_masks):
    pass
"""
BATCH_OLD = BATCH_NEW.replace("pad_token_id", "tokenizer")
WRAPPER_NEW = """
def _build_packed_targets(sequences, attention_mask, packed_seq_params, sub_seq_lengths=None):
    pass
"""


def _fake_checkout(root, new: bool = True, **files: str):
    texts = {f"{MEGATRON}/model_utils.py": MODEL_UTILS_NEW if new else MODEL_UTILS_OLD,
             f"{MEGATRON}/megatron_utils.py": UTILS_NEW if new else UTILS_OLD,
             "skyrl/train/dataset/preprocess.py": BATCH_NEW if new else BATCH_OLD,
             "skyrl/backends/skyrl_train/workers/megatron/megatron_model_wrapper.py": WRAPPER_NEW if new else "",
             **files}
    for rel, text in texts.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))
    return root


def _scenario(smoke_name: str, **changes) -> Scenario:
    found = next(s for s in get_suite("smoke") if s.name == smoke_name)
    return dataclasses.replace(found, **changes)


def test_era_of_an_old_and_a_new_checkout(tmp_path):
    new = detect_era(_fake_checkout(tmp_path / "new"))
    assert dataclasses.asdict(new) == {"thd_path": "packed", "entropy_chunk_size": True, "logprobs_chunk_size": True,
                   "batch_pad": "pad_token_id", "fp8_knob": True, "fused_lm_head": True}
    old = detect_era(_fake_checkout(tmp_path / "old", new=False))
    assert dataclasses.asdict(old) == {"thd_path": "unpacked", "entropy_chunk_size": False, "logprobs_chunk_size": True,
                   "batch_pad": "tokenizer", "fp8_knob": False, "fused_lm_head": False}


def test_capabilities_say_why_a_scenario_is_not_skyrls(tmp_path):
    src = str(_fake_checkout(tmp_path / "new"))
    plain = target(None, TargetConfig(src))
    assert plain.name == "skyrl" and plain.capabilities.layouts == {"thd", "zigzag", "bshd"}
    why = plain.capabilities.skip_reason
    assert why(_scenario("allgather-tp2cp2-basic")) == ALLGATHER_WHY
    assert "replays no rollout keep sets" in why(_scenario("thd-tp2cp1-replay"))
    assert why(_scenario("zigzag-tp2cp2-basic")) is None and why(_scenario("bshd-tp2cp1-basic")) is None
    fused = target("fused_lm_head", TargetConfig(src))
    assert "NotImplementedError" in fused.capabilities.skip_reason(_scenario("thd-tp2cp1-basic"))  # entropy_coef 0.1
    assert fused.capabilities.skip_reason(_scenario("thd-tp2cp1-long-prompt")) is None  # entropy, coef 0
    # a tree whose packing the adapter does not follow: bshd only, with the reason
    bare = _fake_checkout(tmp_path / "bare", new=False, **{f"{MEGATRON}/megatron_utils.py": UTILS_NEW})
    only_bshd = target(None, TargetConfig(str(bare)))
    assert only_bshd.capabilities.layouts == {"bshd"}
    assert "no sequence packing the adapter follows" in only_bshd.capabilities.skip_reason(
        _scenario("thd-tp2cp1-basic"))


def test_the_data_path_follows_the_checkout(tmp_path):
    new = SkyRLDataPath(_fake_checkout(tmp_path / "new"))
    assert set(new.knobs()) == {"fp8_enabled"} and new.knobs()["fp8_enabled"].problem(1) is not None
    assert new.params_passed == {"qkv_format", "total_tokens"} and not new.has_unpack and new.has_targets
    assert new.builds(_scenario("allgather-tp2cp2-basic")) == ALLGATHER_WHY
    assert new.builds(_scenario("zigzag-tp2cp2-basic")) is None
    old = SkyRLDataPath(_fake_checkout(tmp_path / "old", new=False))
    assert old.knobs() == {} and old.has_unpack and not old.has_targets and old.batch_params[0] == "tokenizer"
    described = target(None, TargetConfig(str(tmp_path / "old"))).describe()
    assert described["data_path"] == SkyRLDataPath.name and "postprocess_packed_seqs" in described["functions"][
        "thd, zigzag"]
    assert described["version"].startswith("checkout ") and "loss" in described["definitions"]


def test_a_newer_field_is_kept_as_an_attribute():
    @dataclasses.dataclass
    class Params:
        qkv_format: str = "sbhd"

    kept = with_newer_fields(Params, ["total_tokens"])(qkv_format="thd", total_tokens=12)
    assert isinstance(kept, Params) and kept.qkv_format == "thd" and kept.total_tokens == 12
    assert with_newer_fields(Params, []) is Params


def test_bad_input_is_one_line(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    src = str(_fake_checkout(tmp_path / "new"))
    old_tree = tmp_path / "old-tree" / "skyrl-train/skyrl_train/distributed/megatron/model_utils.py"
    old_tree.parent.mkdir(parents=True)
    old_tree.write_text("")
    cases = [
        (lambda: target(None, TargetConfig(str(tmp_path / "old-tree"))), "from before 2026-02-15"),
        (lambda: target(None, TargetConfig(str(tmp_path))), "is not a SkyRL checkout"),
        (lambda: target(None, TargetConfig()), "needs a SkyRL source checkout"),
        (lambda: target(None, TargetConfig(src, (("temperature_in_place", "maybe"),))), "expected true or false"),
        (lambda: target("fused_lm_head", TargetConfig(src, (("temperature_in_place", "true"),))),
         "temperature_in_place does not apply"),
        (lambda: target("fused_lm_head", TargetConfig(str(_fake_checkout(tmp_path / "o", new=False)))),
         "has no fused LM-head log-prob"),
        (lambda: target("nope", TargetConfig(src)), "has no variant 'nope'"),
        (lambda: target(None, TargetConfig(str(_fake_checkout(tmp_path / "x", **{
            "skyrl/train/dataset/preprocess.py": "def other(): pass\n"})))),
         "has no convert_prompts_responses_to_batch_tensors in skyrl/train/dataset/preprocess.py"),
    ]
    for build, message in cases:
        with pytest.raises(BadInput, match=message) as info:
            build()
        assert "\n" not in str(info.value)


def test_the_command_line_refuses_what_is_not_a_checkout_in_one_line(tmp_path, cli_in_process):
    listing = cli_in_process("targets")
    assert listing.returncode == 0 and "skyrl:fused_lm_head" in listing.stdout and "temperature_in_place" in \
        listing.stdout
    for flag in ("--skyrl-src", "--target-src"):
        run = cli_in_process("run", "--target", "skyrl", flag, str(tmp_path))
        assert run.returncode == 2 and run.stderr.strip().count("\n") == 0, run.stderr
        assert "is not a SkyRL checkout" in run.stderr and "Traceback" not in run.stderr
    run = cli_in_process("run", "--target", "skyrl", "--target-src", str(_fake_checkout(tmp_path / "src")),
                         "--target-opt", "chunk=4")
    assert run.returncode == 2 and "no option 'chunk'" in run.stderr and run.stderr.strip().count("\n") == 0


def test_the_import_runs_no_package_init_writes_nothing_and_is_undone(tmp_path):
    src = _fake_checkout(tmp_path, **{
        f"{MEGATRON}/model_utils.py": MODEL_UTILS_NEW + "import shardcheck_absent_module\n",
        "skyrl/__init__.py": "raise RuntimeError('skyrl/__init__.py must not run')\n",
        "skyrl/backends/__init__.py": "raise RuntimeError('must not run')\n"})
    # eager=False: switching torch.compile off imports torch._dynamo (seconds), which the base's own tests cover
    checkout = Checkout(dataclasses.replace(FRAMEWORK, stubbable=("shardcheck_absent_module",), eager=False), src)
    before = (set(sys.modules), list(sys.meta_path), sys.dont_write_bytecode)
    try:
        module = checkout.import_module(MODULE)
        assert module.__file__ == str(src / MEGATRON / "model_utils.py")
        assert checkout.stubs == ["shardcheck_absent_module"]
        assert {"skyrl", "skyrl.backends"} <= set(checkout.package_inits_not_run)
    finally:
        checkout.release()
    assert (set(sys.modules), list(sys.meta_path), sys.dont_write_bytecode) == before
    assert not list(src.rglob("*.pyc")), "bytecode was written into the checkout"


# ---- against a real checkout ----------------------------------------------------------------

DATA_PATH = SkyRLDataPath.name


def _run(world, tmp_path, scenarios, spec: str = "skyrl") -> dict:
    run = run_on_world(world, scenarios, spec, tmp_path / f"{spec.replace(':', '-')}.json", "skyrl")
    return {v["name"]: v for v in run.report["scenarios"]} | {"": run.report}


@needs_skyrl
@pytest.mark.world
def test_smoke_passes_but_for_the_entropy_of_half_precision_logits(world, tmp_path):
    """Every smoke scenario SkyRL runs is laid out by its own batch and packing and passes, except
    the entropy of float16 logits: _VocabParallelEntropy computes in the logits' dtype (no float32
    upcast; SkyRL's own logits are float32, Megatron's Float16Module casts the last stage's output).
    All-gather CP (not SkyRL's) and replayed keep sets are skipped with the reason."""
    verdicts = _run(world, tmp_path, get_suite("smoke"))
    report = verdicts.pop("")
    assert report["target"]["src"] == str(FRAMEWORK.source()) and report["target"]["era"]["thd_path"]
    for name, v in verdicts.items():
        if v["verdict"] == "skip":
            assert v["reason"] in (ALLGATHER_WHY, skyrl.REPLAY_WHY) or v["reason"].startswith(
                "a training step"), (name, v["reason"])  # the smoke suite's step cells: not this loss
            continue
        assert v["layout_built_by"] == DATA_PATH, name
        if v["scenario"]["dtype"] == "float16":
            assert v["kinds"] == ["value_mismatch"] and all("entropy" in f["message"] for f in v["failures"]), v
            continue
        assert v["verdict"] == "pass", (name, v["failures"])
    assert {v["layout"] for v in verdicts.values() if v["verdict"] == "pass"} == {"thd", "zigzag", "bshd"}


@needs_skyrl
@pytest.mark.world
def test_the_fused_lm_head_and_the_fp8_alignment_pass(world, tmp_path):
    """skyrl:fused_lm_head (the given logits as the hidden states, an identity LM head) passes where
    SkyRL runs it (no entropy gradient); the fp8_enabled knob pads every packed sequence to
    lcm(alignment, 16*cp) and still passes."""
    if not detect_era(FRAMEWORK.source()).fused_lm_head:
        pytest.skip("this SkyRL commit has no fused LM-head log-prob")
    names = ["thd-tp2cp1-many", "zigzag-tp2cp2-long-prompt", "bshd-tp2cp1-long-prompt", "zigzag-tp2cp2-basic"]
    # temperature 0.8 (the weight divided by it), the entropy without gradient
    cooled = [_scenario(n, name=f"{n}-no-entropy-grad", entropy_coef=0.0)
              for n in ("thd-tp2cp1-basic", "zigzag-tp2cp2-basic", "bshd-tp2cp1-basic")]
    verdicts = _run(world, tmp_path, [_scenario(n) for n in names] + cooled, "skyrl:fused_lm_head")
    assert "NotImplementedError" in verdicts.pop("zigzag-tp2cp2-basic")["reason"]  # entropy_coef 0.1
    assert {n: v["verdict"] for n, v in verdicts.items() if n} == {n: "pass" for n in names[:3]} | {
        s.name: "pass" for s in cooled}, verdicts
    base = {"samples": [[9, 4], [6, 2]], "vocab": 16, "tp": 2, "entropy_coef": 0.1, "seed": 4,
            "layout_knobs": {"fp8_enabled": True}}
    knobbed = [Scenario.from_dict(dict(base, name="fp8-zigzag", cp=2, layout="zigzag")),
               Scenario.from_dict(dict(base, name="fp8-thd"))]
    verdicts = _run(world, tmp_path, knobbed)
    # 9 and 6 tokens, each padded to lcm(2*tp*cp, 16*cp) = 32 (zigzag: split over 2 CP ranks), lcm(tp, 16) = 16
    assert {n: (v["verdict"], v["layouts"]["0"]["shape"][1]) for n, v in verdicts.items() if n} == {
        "fp8-zigzag": ("pass", 32), "fp8-thd": ("pass", 32)}


@needs_skyrl
@pytest.mark.world
def test_the_in_place_temperature_is_reported_as_the_callers_write(world, tmp_path, monkeypatch):
    monkeypatch.setenv(OPTS_ENV, json.dumps([["temperature_in_place", "true"]]))
    verdicts = _run(world, tmp_path, [_scenario("thd-tp2cp1-basic")])  # temperature 0.8
    failure = verdicts["thd-tp2cp1-basic"]["failures"][0]
    assert failure["kind"] == "input_mutated" and "skyrl.py" in failure["message"], failure
    assert "aten.div_" in failure["message"]


@needs_skyrl
def test_importing_the_real_checkout_writes_nothing_into_it():
    src = FRAMEWORK.source(SKYRL_SRC)
    before = set(src.rglob("*.pyc"))
    checkout = Checkout(FRAMEWORK, src)
    try:
        assert hasattr(checkout.import_module(MODULE), "vocab_parallel_entropy") and checkout.stubs == []
    finally:
        checkout.release()
    assert set(src.rglob("*.pyc")) == before
    assert not [m for m in sys.modules if m == "skyrl" or m.startswith("skyrl.")]


ENTROPY_FIX = "c89adcb14"  # "fix entropy backward mutating the logits in place" (#1648)
SHORT_FIX = "bcc85e241"  # "fix short sequences under CP in preprocess_packed_seqs" (#1407)


def _at(commit: str, tmp_path, monkeypatch) -> None:
    """Point the ranks at ``commit`` of the repository (its skyrl/ tree, exported)."""
    # the folders the adapter reads (skyrl/ as a whole also holds docs images)
    monkeypatch.setenv(ENV, export_commit(os.environ[REPO_ENV], commit, tmp_path / commit.replace("~", "-parent-"),
                                          "skyrl/backends", "skyrl/train/dataset"))


@needs_history
@pytest.mark.world
def test_the_entropy_backward_writing_into_the_logits_fixed_at_c89adcb14(world, tmp_path, monkeypatch):
    """Before #1648 _VocabParallelEntropy.backward subtracted from and added back to its saved input
    in place: the logits the loss's log-probs were computed from. With chunked log-probs
    (ChunkedDistributedLogprob saves those logits; SkyRL chunked by default before bfa4dc338) the
    backward raises; unchunked, the logits are changed after backward ((x - s) + s != x)."""
    base = {"samples": [[5, 3]], "vocab": 8, "layout": "bshd", "entropy_coef": 0.1, "seed": 1}
    scenarios = [Scenario.from_dict(dict(base, name="chunked", log_probs_chunk_size=2)),
                 Scenario.from_dict(dict(base, name="unchunked"))]
    _at(f"{ENTROPY_FIX}~1", tmp_path, monkeypatch)
    verdicts = _run(world, tmp_path, scenarios)
    crash, write = verdicts["chunked"]["failures"][0], verdicts["unchunked"]["failures"][0]
    assert crash["kind"] == "rank_error" and "modified by an inplace operation" in crash["message"], crash
    assert "model_utils.py" in crash["message"] and "in backward" in crash["message"]
    assert write["kind"] == "input_mutated" and "in backward" in write["message"], write
    assert "aten.sub_" in write["message"] and "model_utils.py" in write["message"]
    _at(ENTROPY_FIX, tmp_path, monkeypatch)
    verdicts = _run(world, tmp_path, scenarios)
    assert {verdicts[n]["verdict"] for n in ("chunked", "unchunked")} == {"pass"}, verdicts


@needs_history
@pytest.mark.world
def test_a_sequence_shorter_than_the_cp_alignment_fixed_at_bcc85e241(world, tmp_path, monkeypatch):
    """Before #1407 preprocess_packed_seqs sliced CP rank r's chunk out of the unpadded tokens: at
    tp=2, cp=2 (alignment 8, chunks of 2 rows) a sequence of 2 tokens gives CP rank 1 an empty
    slice for 2 rows (RuntimeError in SkyRL's data path); one of 3 tokens gives it 1 token, which
    broadcasts into its padding row: position 2 held twice, silently. Found through SkyRL's own
    data path (the position trace)."""
    base = {"vocab": 8, "tp": 2, "cp": 2, "layout": "zigzag", "seed": 2}
    scenarios = [Scenario.from_dict(dict(base, name="short2", samples=[[2, 1], [9, 4]])),
                 Scenario.from_dict(dict(base, name="short3", samples=[[3, 1], [9, 4]]))]
    _at(f"{SHORT_FIX}~1", tmp_path, monkeypatch)
    verdicts = _run(world, tmp_path, scenarios)
    errors = [f for f in verdicts["short2"]["failures"] if f["kind"] == "rank_error"]
    assert errors and "The expanded size of the tensor (2) must match the existing size (0)" in errors[0]["message"]
    assert "megatron_utils.py" in errors[0]["message"] and "in preprocess_packed_seqs" in errors[0]["message"]
    mismatch = verdicts["short3"]["failures"][0]
    assert mismatch["kind"] == "layout_mismatch", verdicts["short3"]["failures"]
    assert "sample 0 position 2 is held 2 times by cp rank 1" in mismatch["message"]
    _at(SHORT_FIX, tmp_path, monkeypatch)
    verdicts = _run(world, tmp_path, scenarios)
    assert {(v["verdict"], v["layout_built_by"]) for n, v in verdicts.items() if n} == {("pass", DATA_PATH)}


# ---- skyrl:loss, SkyRL's policy loss in the training step (docs/training.md) -------------------

PPO_TRAINER = """
def reduce_loss(loss, loss_mask):
    return (loss * loss_mask).sum()

def ppo_policy_loss(log_probs, old_log_probs, advantages, config, loss_mask=None, rollout_logprobs=None):
    pass

def apply_loss_reduction_to_advantages_minibatch(advantages, loss_mask, loss_reduction, micro_batch_size, max_seq_len):
    if loss_reduction == "token_mean":
        pass
    elif loss_reduction == "sequence_mean":
        pass
"""
PPO_LOSS = """
def reduce_loss(loss, loss_mask, loss_reduction, max_seq_len=None):
    if loss_reduction == "token_mean":
        pass
    elif loss_reduction == "sequence_mean":
        pass
    elif loss_reduction == "seq_mean_token_sum_norm":
        pass

def ppo_policy_loss(log_probs, old_log_probs, advantages, config, loss_mask=None, rollout_logprobs=None):
    pass
"""
WRAPPER_LOSS = """
class MegatronModelWrapper:
    def forward_backward_mini_batch(self, micro_batches):
        def loss_func(logits, data):
            grad_sum_correction_factor = 1
"""


def test_the_loss_era_and_its_reductions_are_read_from_the_checkout(tmp_path):
    from shardcheck.targets.skyrl_loss import detect_loss_era

    ppo = "skyrl/backends/skyrl_train/utils/ppo_utils.py"
    wrapper = "skyrl/backends/skyrl_train/workers/megatron/megatron_model_wrapper.py"
    new = detect_loss_era(_fake_checkout(tmp_path / "new", **{ppo: PPO_TRAINER, wrapper: WRAPPER_LOSS}))
    assert new == {"reduced_by": "trainer", "reductions": ["token_mean", "sequence_mean"], "rescale": True}
    old = detect_loss_era(_fake_checkout(tmp_path / "old", **{
        ppo: PPO_LOSS, wrapper: WRAPPER_LOSS.replace("grad_sum_correction_factor", "loss")}))
    assert old == {"reduced_by": "reduce_loss", "rescale": False,
                   "reductions": ["token_mean", "sequence_mean", "seq_mean_token_sum_norm"]}
    with pytest.raises(BadInput, match="has no MegatronModelWrapper.forward_backward_mini_batch.loss_func"):
        detect_loss_era(_fake_checkout(tmp_path / "bare", **{ppo: PPO_TRAINER}))


def test_the_entropy_term_skips_where_skyrl_weighs_it_otherwise_than_the_objective():
    """SkyRL's entropy term is each micro-batch's token mean, averaged over micro-batches: it is the
    sample mean where every micro-batch holds one sample, and no objective where they differ."""
    from shardcheck.targets.skyrl_loss import ENTROPY_WHY, entropy_reduction_differs

    cells = {s.name: s for s in get_suite("training")}
    one_each = cells["step-thd-dp2-mb3"]  # three micro-batches of one sample, entropy_coef 0.1
    assert entropy_reduction_differs(one_each, "sample_mean") is None
    why = entropy_reduction_differs(one_each, "token_mean")
    assert why.startswith(ENTROPY_WHY) and "the declared token_mean's" in why
    assert entropy_reduction_differs(cells["step-zigzag-cp4-mb2"], "sample_mean").startswith(ENTROPY_WHY)
    assert entropy_reduction_differs(dataclasses.replace(one_each, entropy_coef=0.0), "token_mean") is None


@needs_skyrl
def test_the_loss_variant_declares_skyrls_reduction_and_refuses_what_means_no_objective():
    loss = target("loss", TargetConfig(SKYRL_SRC))
    assert loss.name == "skyrl:loss" and loss.loss_form == "step" and loss.calculate_per_token_loss is False
    assert loss.definitions.objective == "token_mean" and "loss_reduction=token_mean" in \
        loss.definitions.objective_source
    seq = target("loss", TargetConfig(SKYRL_SRC, (("loss_reduction", "sequence_mean"),)))
    assert seq.definitions.objective == "sample_mean"
    for options, message in ((("loss_reduction", "token_mean_legacy"),), "no objective the step is checked against"),\
                            ((("loss_reduction", "prompt_mean"),), "no objective the step is checked against"), \
                            ((("loss_reduction", "seq_mean_token_sum_norm"),), "Dr. GRPO"), \
                            ((("loss_reduction", "nope"),), "has no loss_reduction 'nope'"), \
                            ((("use_kl_loss", "maybe"),), "expected true or false"):
        with pytest.raises(BadInput, match=message) as info:
            target("loss", TargetConfig(SKYRL_SRC, options))
        assert "\n" not in str(info.value)
    with pytest.raises(BadInput, match="is skyrl:loss's"):
        target(None, TargetConfig(SKYRL_SRC, (("loss_reduction", "sequence_mean"),)))


def _loss_run(world, tmp_path, scenarios, monkeypatch, options=(), **run) -> dict:
    monkeypatch.setenv(OPTS_ENV, json.dumps([list(kv) for kv in options]))
    run.setdefault("mask_leak", False)
    report = tmp_path / f"loss-{len(list(tmp_path.iterdir()))}.json"
    done = run_on_world(world, scenarios, "skyrl:loss", report, "skyrl", **run)
    return {v["name"]: v for v in done.report["scenarios"]} | {"": done.report}


def _no_entropy(name: str) -> Scenario:
    found = next(s for s in get_suite("training") if s.name == name)
    return dataclasses.replace(found, name=f"{name}-no-entropy", entropy_coef=0.0)


@needs_skyrl
@pytest.mark.world
@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean"])
def test_the_training_suite_at_the_pin(world, tmp_path, monkeypatch, reduction):
    """Every cell SkyRL runs passes (the mask-leak check off: the next test), but bfloat16 under
    sequence_mean: the entropy kernel's known half-precision finding (its values, 5-6 bfloat16 ulps).
    All-gather CP is not SkyRL's; a cell whose entropy term SkyRL weighs otherwise than the
    declared objective is skipped, saying so."""
    from shardcheck.targets.skyrl_loss import ENTROPY_WHY

    verdicts = _loss_run(world, tmp_path, get_suite("training"), monkeypatch, (("loss_reduction", reduction),))
    report = verdicts.pop("")
    assert f"loss_reduction={reduction}" in report["target"]["definitions"]["objective"]
    got = {n: v["verdict"] for n, v in verdicts.items()}
    skipped = {n for n, v in verdicts.items() if v["verdict"] == "skip"}
    assert {n for n in skipped if verdicts[n]["reason"] == ALLGATHER_WHY} == {
        "step-allgather-dp2cp2-tokens", "step-allgather-cp2tp2-mb3"}
    assert all(verdicts[n]["reason"].startswith(ENTROPY_WHY) for n in skipped if "allgather" not in n)
    passed = {"step-zigzag-dp2cp2-mb2", "step-bshd-dp2tp2-mb3"}  # no entropy in their loss
    if reduction == "token_mean":  # two micro-batches of equal masked-in counts: their means are the token mean
        passed |= {"step-zigzag-cp4-mb2"}
    else:  # one sample a micro-batch: the entropy's micro-batch means are the samples' means
        passed |= {"step-thd-dp2-mb3", "step-zigzag-tp2cp2-mb3", "step-thd-dp4"}
        bf16 = verdicts["step-thd-dp2tp2-bf16"]
        assert bf16["kinds"] == ["value_mismatch"] and all("entropy" in f["message"] for f in bf16["failures"])
    assert {n for n, v in got.items() if v == "pass"} == passed, got


@needs_skyrl
@pytest.mark.world
def test_skyrls_loss_lets_nan_at_masked_positions_in(world, tmp_path, monkeypatch):
    """A finding at the pin (docs/skyrl.md): reduce_loss multiplies by the loss mask ((loss * loss_mask)
    .sum()), so NaN at a masked token (its log-prob, advantage or old log-prob) makes the loss NaN:
    the pattern SkyRL fixed in compute_approx_kl (#1635) after NaN there reached a real run's loss.
    (With an entropy in the loss, vocab_parallel_entropy_weighted_sum's (entropy * weights).sum()
    lets a NaN logit row in too; this cell has none.)"""
    cell = next(s for s in get_suite("training") if s.name == "step-bshd-dp2tp2-mb3")
    verdicts = _loss_run(world, tmp_path, [cell], monkeypatch, mask_leak=True)
    leak = verdicts[cell.name]["failures"][0]
    assert leak["kind"] == "mask_leak", verdicts[cell.name]["failures"]
    assert ("NaN at the masked positions of the logits and advantages and old_log_probs reached the loss of "
            "micro-batch 0") in leak["message"], leak["message"]


@needs_skyrl
@pytest.mark.world
def test_coverage_of_skyrls_loss_names_the_loss_func_the_schedule_and_ddp(world, tmp_path, monkeypatch):
    verdicts = _loss_run(world, tmp_path, [_no_entropy("step-zigzag-dp2cp2-mb2")], monkeypatch, coverage=True)
    files = verdicts[""]["coverage"]["files"]
    ran = {name for f in files.values() for name in f["functions"]}
    for name in ("skyrl/backends/skyrl_train/workers/megatron/megatron_model_wrapper.py:MegatronModelWrapper."
                 "forward_backward_mini_batch.loss_func",
                 "skyrl/backends/skyrl_train/utils/ppo_utils.py:ppo_policy_loss",
                 "skyrl/backends/skyrl_train/utils/ppo_utils.py:reduce_loss",
                 "skyrl/backends/skyrl_train/utils/ppo_utils.py:apply_loss_reduction_to_advantages_minibatch",
                 "skyrl/backends/skyrl_train/distributed/megatron/model_utils.py:"
                 "from_parallel_logits_to_logprobs_packed_sequences",
                 "megatron-core/megatron/core/pipeline_parallel/schedules.py:forward_backward_no_pipelining",
                 "megatron-core/megatron/core/distributed/finalize_model_grads.py:finalize_model_grads",
                 "megatron-core/megatron/core/distributed/param_and_grad_buffer.py:_ParamAndGradBucketGroup."
                 "finish_grad_sync"):
        assert name in ran, sorted(ran)


LOSS_FIX = "bf243b8d6"  # "Implement loss reduction via advantage normalization and fix token_mean" (#1296)
CP_SCALE = "8376455c8"  # "[megatron] Fix loss aggregation for context parallelism (CP)" (#1420)


def _loss_at(commit: str, tmp_path, monkeypatch) -> None:
    """Point the ranks at ``commit`` of the repository: the folders skyrl:loss reads."""
    dest = tmp_path / commit.replace("~", "-parent-")
    monkeypatch.setenv(ENV, export_commit(os.environ[REPO_ENV], commit, dest, "skyrl/backends",
                                          "skyrl/train/dataset", "skyrl/train/config"))


@needs_history
@pytest.mark.world
def test_the_token_mean_of_micro_batch_means_fixed_at_1296(world, tmp_path, monkeypatch):
    """Before #1296 reduce_loss took token_mean within each micro-batch (masked_mean) and megatron's
    schedule and DDP averaged the micro-batches: with micro-batches of unequal token counts (three of
    one sample each on each of 2 replicas) the optimizer's gradient is off by a factor per sample.
    #1296 scales the advantages by the mini-batch's token count (apply_loss_reduction_to_advantages_
    minibatch) and multiplies the loss by num_microbatches x dp: the declared token mean."""
    cell = [_no_entropy("step-thd-dp2-mb3")]
    _loss_at(f"{LOSS_FIX}~1", tmp_path, monkeypatch)
    failures = _loss_run(world, tmp_path, cell, monkeypatch)[cell[0].name]["failures"]
    assert failures[0]["kind"] == "grad_mismatch", failures
    assert "off by no one factor: sample 0 x 0.786, sample 1 x 1.100, sample 2 x 5.500" in failures[0]["message"]
    _loss_at(LOSS_FIX, tmp_path, monkeypatch)
    verdict = _loss_run(world, tmp_path, cell, monkeypatch)[cell[0].name]
    assert verdict["verdict"] == "pass", verdict["failures"]


@needs_history
@pytest.mark.world
def test_the_cp_factor_1420_added_to_the_policy_loss(world, tmp_path, monkeypatch):
    """#1420 counted the CP ranks in the wrapper's grad_sum_correction_factor (dp with CP), but
    megatron's schedule already multiplies a two-value loss by cp: the gradient is x cp. Its parent
    (#1296) passes; the pin's wrapper counts dp without CP again (#1751, "fix CP loss scaling")."""
    cell = [_no_entropy("step-zigzag-cp4-mb2")]
    _loss_at(CP_SCALE, tmp_path, monkeypatch)
    failures = _loss_run(world, tmp_path, cell, monkeypatch)[cell[0].name]["failures"]
    assert failures[0]["kind"] == "grad_mismatch", failures
    assert "is x 4.000 the reference's on every row (= cp)" in failures[0]["message"], failures[0]["message"]
    _loss_at(f"{CP_SCALE}~1", tmp_path, monkeypatch)
    assert _loss_run(world, tmp_path, cell, monkeypatch)[cell[0].name]["verdict"] == "pass"
