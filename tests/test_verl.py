"""The verl target. Checking real verl needs a checkout (never pip install verl: it pulls ray):
set SHARDCHECK_VERL_SRC to a clone of verl-project/verl. Era detection, the packing rule, the
import machinery and bad input are checked without it, on small fake checkouts.

Over 20 s: with a checkout holding verl's history, the historical fixes each run shardcheck twice,
and the repro test three scripts of a four-rank world in a fresh virtualenv (without one: 2 s)."""

import json
import logging
import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest

from conftest import export_commit, run_cli, run_on_world, torch_only_python
from shardcheck.errors import BadInput
from shardcheck.scenarios.scenario import Sample, Scenario
from shardcheck.scenarios.suites import get_suite
from shardcheck.targets import resolve
from shardcheck.targets.base import TargetConfig, data_path, knob_skip_reason
from shardcheck.targets.verl import ENV, compile_call_site, detect_era, packing_mismatch, source, target

VERL_SRC = os.environ.get(ENV)
# In-process specs by module path: pytest run from the checkout imports the distribution metadata
# it finds first on sys.path, and a stale shardcheck.egg-info there may predate the verl entry
# point. The CLI runs below start from tmp_path, where the installed metadata is found.
PLAIN, ACTOR = "shardcheck.targets.verl:target", "shardcheck.targets.verl:VerlActorTarget"
REGISTERED = any(ep.name == "verl" for ep in entry_points(group="shardcheck.targets"))
needs_verl = pytest.mark.skipif(not VERL_SRC, reason=f"{ENV} is not set: no verl checkout to check (clone "
                                "verl-project/verl and point it there; never pip install verl, it pulls ray)")

TP_OLD = """
import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu


class _VocabParallelEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, vocab_parallel_logits):
        return vocab_parallel_logits.sum(-1)


def vocab_parallel_entropy(vocab_parallel_logits):
    return _VocabParallelEntropy.apply(vocab_parallel_logits)


def vocab_parallel_log_probs_from_logits(logits, labels):
    return logits
"""

TP_NEW = TP_OLD.replace("        return vocab_parallel_logits.sum(-1)", """\
        @torch.compile(dynamic=True)
        def mul_reduce(a, b):
            return (a * b).sum(dim=-1, keepdim=True)

        return vocab_parallel_logits.sum(-1)""") + """

def vocab_parallel_entropy_with_chunking(vocab_parallel_logits, chunk_size=2048):
    return vocab_parallel_logits


def vocab_parallel_sum_pi_squared(vocab_parallel_logits):
    return vocab_parallel_logits
"""

LEGACY_ACTOR = """
class MegatronPPOActor:
    def forward_backward_batch(self, data, calculate_entropy=False):
        def forward_step(batch_iter, model):
            def logits_processor(logits, label, label_mask):
                assert logits.shape[:2] == label.shape[:2]
                log_probs = vocab_parallel_log_probs_from_logits(logits, label)
                log_probs = log_probs.masked_fill(~label_mask, 0.0)
                ret = {"log_probs": log_probs}
                if calculate_entropy:
                    ret["entropy"] = vocab_parallel_entropy(logits)
                return ret
            return logits_processor
"""

ENGINE_CLOSURE = """
class MegatronEngineWithLMHead:
    def forward_step(self, batch_iter, model, postprocess_micro_batch_func):
        temperature = 1.0

        def logits_processor(logits, label):
            logits.div_(temperature)
            ret = {}
            if calculate_entropy:
                logits_bak = logits.clone()
                ret["entropy"] = vocab_parallel_entropy(logits)
            else:
                logits_bak = logits
            label = torch.roll(label, shifts=-1, dims=1)
            ret["log_probs"] = vocab_parallel_log_probs_from_logits(logits_bak, label)
            return ret
"""

ENGINE_METHOD = """
class MegatronEngineWithLMHead:
    def _lm_head_logits_processor(self, logits, label, temperature, *, calculate_entropy, data_format):
        logits.div_(temperature.unsqueeze(dim=-1))
        ret = {}
        if calculate_entropy:
            logits_bak = logits.clone()
            if self.engine_config.entropy_from_logits_with_chunking:
                ret["entropy"] = vocab_parallel_entropy_with_chunking(logits)
            else:
                ret["entropy"] = vocab_parallel_entropy(logits)
        else:
            logits_bak = logits
        ret["log_probs"] = vocab_parallel_log_probs_from_logits(logits_bak, label)
        return ret
"""

UTIL_OLD = """
def preprocess_packed_seqs_no_padding(input_ids, pre_process=True):
    pass


def postprocess_packed_seqs_no_padding(output, packed_seq_params, input_ids, batch_size, post_process=True):
    pass
"""

UTIL_NEW = """
def preprocess_thd_engine(input_ids, pre_process=True, need_roll=False, cp_layout="zigzag"):
    pass


def postprocess_thd_engine(output, packed_seq_params, input_ids, batch_size, post_process=True):
    pass


def preprocess_bshd_engine(input_ids, pre_process=True, need_roll=False):
    pass


def postprocess_bshd_engine(output, attention_mask, post_process=True):
    pass
"""


def _fake_checkout(root, tp=TP_OLD, legacy=None, engine=None, util=None):
    files = {"verl/utils/megatron/tensor_parallel.py": tp, "verl/workers/actor/megatron_actor.py": legacy,
             "verl/workers/engine/megatron/transformer_impl.py": engine, "verl/models/mcore/util.py": util}
    for rel, text in files.items():
        if text is not None:
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(text))
    return root


def test_era_of_an_old_checkout(tmp_path):
    """The legacy actor computing log-probs before the entropy, on the same logits (before #1672)."""
    era = detect_era(_fake_checkout(tmp_path, legacy=LEGACY_ACTOR))
    assert era.functions == ("vocab_parallel_entropy", "vocab_parallel_log_probs_from_logits")
    assert not era.entropy_compiled and era.packing is None
    site = era.call_sites["legacy"]
    assert set(era.call_sites) == {"legacy"}
    assert site["params"] == ["logits", "label", "label_mask"]
    assert site["function"] == "MegatronPPOActor.forward_backward_batch.logits_processor"
    assert site["first_call"] == "vocab_parallel_log_probs_from_logits"
    assert not site["clones_for_entropy"] and not site["temperature"] and not site["rolls_label"]


def test_era_of_an_engine_that_rolls_its_labels(tmp_path):
    """The engine's closure rolling the packed labels itself, its packing without need_roll
    (before #4250)."""
    era = detect_era(_fake_checkout(tmp_path, engine=ENGINE_CLOSURE, util=UTIL_OLD))
    site = era.call_sites["engine"]
    assert site["function"] == "MegatronEngineWithLMHead.forward_step.logits_processor"
    assert site["params"] == ["logits", "label"] and site["rolls_label"] and site["clones_for_entropy"]
    assert site["first_call"] == "vocab_parallel_entropy"
    assert era.packing == {"preprocess": "preprocess_packed_seqs_no_padding",
                              "postprocess": "postprocess_packed_seqs_no_padding", "need_roll": False,
                              "cp_layout": False, "bshd": None}


def test_era_of_a_new_checkout(tmp_path):
    era = detect_era(_fake_checkout(tmp_path, tp=TP_NEW, engine=ENGINE_METHOD, util=UTIL_NEW))
    assert era.functions == ("vocab_parallel_entropy", "vocab_parallel_log_probs_from_logits",
                             "vocab_parallel_entropy_with_chunking", "vocab_parallel_sum_pi_squared")
    assert era.entropy_compiled
    site = era.call_sites["engine"]
    assert site["function"] == "MegatronEngineWithLMHead._lm_head_logits_processor"
    assert site["params"][:4] == ["self", "logits", "label", "temperature"] and not site["rolls_label"]
    assert era.packing["preprocess"] == "preprocess_thd_engine" and era.packing["need_roll"]
    assert era.packing["bshd"] == {"preprocess": "preprocess_bshd_engine", "postprocess": "postprocess_bshd_engine"}


def test_the_source_must_be_named_and_be_a_checkout(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    for arg, words in ((None, "needs a verl source checkout"), (str(tmp_path), "is not a verl checkout"),
                       (str(tmp_path / "nope"), "is not a directory")):
        with pytest.raises(BadInput, match=words) as exc:
            source(arg)
        assert "\n" not in str(exc.value)
    (tmp_path / "verl/utils/megatron").mkdir(parents=True)
    (tmp_path / "verl/utils/megatron/tensor_parallel.py").write_text("def vocab_parallel_entropy(x):\n  (\n")
    with pytest.raises(BadInput, match="cannot be read: verl/utils/megatron/tensor_parallel.py line"):
        detect_era(tmp_path)


def test_cli_with_a_directory_that_is_not_verl_is_one_line_exit_2(tmp_path, cli_in_process):
    proc = cli_in_process("run", "--target", "verl", "--verl-src", str(tmp_path))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "is not a verl checkout" in proc.stderr and "tensor_parallel.py" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_variants_options_and_call_sites_are_checked(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    old = str(_fake_checkout(tmp_path / "old", legacy=LEGACY_ACTOR))
    bare = str(_fake_checkout(tmp_path / "bare"))
    assert set(target.variants) == {"actor", "fsdp", "loss"}
    assert set(target.options) == {"call_site", "entropy_chunking", "fused_kernels", "layout", "loss_agg_mode",
                                  "loss_scale_factor"}
    with pytest.raises(BadInput, match="no variant 'nope'"):
        target("nope", TargetConfig(old))
    # through resolve, as the CLI builds it (module:callable: the registry's metadata may be stale
    # where pytest runs from the checkout, see REGISTERED)
    with pytest.raises(BadInput, match="has no option 'chunks'"):
        resolve(PLAIN, TargetConfig(old, (("chunks", "1"),)))
    with pytest.raises(BadInput, match="call_site applies to verl:actor only"):
        resolve(PLAIN, TargetConfig(old, (("call_site", "engine"),)))
    with pytest.raises(BadInput, match="no vocab_parallel_entropy_with_chunking"):
        resolve(PLAIN, TargetConfig(old, (("entropy_chunking", "true"),)))
    with pytest.raises(BadInput, match="expected true or false"):
        resolve(PLAIN, TargetConfig(old, (("entropy_chunking", "maybe"),)))
    with pytest.raises(BadInput, match="no actor call site to check: no logits_processor in .*megatron_actor.py; "
                                       "no MegatronEngineWithLMHead"):
        target("actor", TargetConfig(bare))
    with pytest.raises(BadInput, match="no actor call site to check: no MegatronEngineWithLMHead"):
        target("actor", TargetConfig(old, (("call_site", "engine"),)))
    with pytest.raises(BadInput, match="call_site='both': expected legacy, engine or auto"):
        target("actor", TargetConfig(old, (("call_site", "both"),)))
    with pytest.raises(BadInput, match="layout='mine': expected framework or shardcheck"):
        target("actor", TargetConfig(old, (("layout", "mine"),)))
    with pytest.raises(BadInput, match="option loss_agg_mode is verl:loss's"):
        target("actor", TargetConfig(old, (("loss_agg_mode", "token-mean"),)))
    if REGISTERED:
        with pytest.raises(BadInput, match="no variant 'nope'"):
            resolve("verl:nope", TargetConfig(old))
    actor = target("actor", TargetConfig(old))
    assert actor.kind == "legacy" and actor.describe()["call_site"]["kind"] == "legacy"


def test_every_smoke_scenario_runs_or_has_a_true_reason(tmp_path):
    """Skips come with their reasons: all-gather CP and replayed keep sets for both. With verl's own
    packing laying out the rows (the default) nothing else is skipped; on the harness's rows
    (layout=shardcheck) the engine call site also skips the scenarios whose rows verl's packing puts
    elsewhere (tp / 2*tp*cp padding)."""
    new = str(_fake_checkout(tmp_path, tp=TP_NEW, engine=ENGINE_METHOD, util=UTIL_NEW))
    plain, actor = target(None, TargetConfig(new)), target("actor", TargetConfig(new))
    own_rows = target("actor", TargetConfig(new, (("layout", "shardcheck"),)))
    assert data_path(actor) is not None and data_path(own_rows) is None and data_path(plain) is None
    for sc in get_suite("smoke"):
        why = plain.capabilities.skip_reason(sc)
        assert (why is None) == (sc.layout != "allgather" and not sc.replay_keep), (sc.name, why)
        assert why is None or "all-gather CP" in why or "top-p / top-k" in why
        assert actor.capabilities.skip_reason(sc) == why, sc.name
        assert actor.data_path.builds(sc) is None or sc.layout == "allgather", sc.name
        why = own_rows.capabilities.skip_reason(sc)
        if why is None:
            assert packing_mismatch(sc) is None and sc.layout != "allgather"
        else:
            assert why.strip(), sc.name


UTIL_KNOBS = UTIL_NEW.replace(
    "def preprocess_thd_engine(input_ids, pre_process=True, need_roll=False, cp_layout=\"zigzag\"):",
    "def preprocess_thd_engine(input_ids, pre_process=True, need_roll=False, use_fp8_padding=False,\n"
    "                          local_cp_size=None, min_local_rows=None, pad_to_length_bucket=None,\n"
    "                          cp_layout=\"zigzag\"):") + """

def preprocess_packed_seqs(input_ids, attention_mask, pre_process=True, use_fp8_padding=False):
    pass


def postprocess_packed_seqs(output, packed_seq_params, attention_mask, batch_size, seq_len, post_process=True):
    pass
"""


def test_the_data_path_is_verls_packing_with_the_knobs_its_functions_take(tmp_path):
    """The engine's data path is preprocess_thd_engine (bshd: preprocess_bshd_engine), the legacy
    actor's preprocess_packed_seqs; the knobs are the layout arguments those functions take, with
    verl's defaults; a value of the wrong type is one line of bad input; framework_files names the
    modules checked."""
    new = _fake_checkout(tmp_path / "new", tp=TP_NEW, engine=ENGINE_METHOD, util=UTIL_KNOBS)
    engine = target("actor", TargetConfig(str(new)))
    path = data_path(engine)
    assert path.name == "verl/models/mcore/util.py:preprocess_thd_engine / preprocess_bshd_engine"
    knobs = path.knobs()
    assert {k: v.default for k, v in knobs.items()} == {
        "use_fp8_padding": False, "min_local_rows": None, "pad_to_length_bucket": None, "cp_layout": "zigzag"}
    assert knobs["use_fp8_padding"].problem(True) is None and knobs["pad_to_length_bucket"].problem(64) is None
    assert "true or false" in knobs["use_fp8_padding"].problem("yes")
    assert "integer >= 1" in knobs["min_local_rows"].problem(0)
    assert "zigzag, contiguous" in knobs["cp_layout"].problem("ring")
    assert engine.framework_files == ("verl/utils/megatron/tensor_parallel.py", "verl/models/mcore/util.py",
                                      "verl/workers/engine/megatron/transformer_impl.py")
    assert target(None, TargetConfig(str(new))).framework_files == ("verl/utils/megatron/tensor_parallel.py",)
    base = get_suite("smoke")[0].to_dict()
    bad = Scenario.from_dict(dict(base, name="bad", layout_knobs={"use_fp8_padding": "yes"}))
    with pytest.raises(BadInput) as exc:
        knob_skip_reason(engine, bad)
    assert "\n" not in str(exc.value) and "layout knob use_fp8_padding must be true or false, got 'yes'" in str(exc.value)
    good = Scenario.from_dict(dict(base, name="good", layout_knobs={"use_fp8_padding": True}))
    assert knob_skip_reason(engine, good) is None
    # verl's contiguous CP layout needs a newer megatron-core than this machine's: a skip, never verl's error
    import dataclasses

    from megatron.core.packed_seq_params import PackedSeqParams
    contiguous = Scenario.from_dict(dict(base, name="contiguous", layout_knobs={"cp_layout": "contiguous"}))
    why = knob_skip_reason(engine, contiguous)
    if "cp_partition_mode" in {f.name for f in dataclasses.fields(PackedSeqParams)}:
        assert why is None
    else:
        assert "cannot run here" in why and "cp_partition_mode" in why, why
    allgather = next(sc for sc in get_suite("smoke") if sc.layout == "allgather")
    assert "no all-gather CP layout of its own" in path.builds(allgather)
    # the legacy actor: preprocess_packed_seqs, thd and zigzag; bshd laid out by shardcheck
    old = _fake_checkout(tmp_path / "old", legacy=LEGACY_ACTOR, util=UTIL_KNOBS)
    legacy = target("actor", TargetConfig(str(old)))
    assert legacy.kind == "legacy" and data_path(legacy).name == "verl/models/mcore/util.py:preprocess_packed_seqs"
    assert set(data_path(legacy).knobs()) == {"use_fp8_padding"}
    assert legacy.framework_files[2] == "verl/workers/actor/megatron_actor.py"
    bshd = next(sc for sc in get_suite("smoke") if sc.layout == "bshd")
    assert "preprocess_bshd" in data_path(legacy).builds(bshd)
    # a checkout without the legacy packing function has no data path there
    bare = target("actor", TargetConfig(str(_fake_checkout(tmp_path / "bare", legacy=LEGACY_ACTOR))))
    assert data_path(bare) is None


def test_the_packing_rule_follows_verls_padding():
    def sc(layout, tp, cp, *lengths):
        return Scenario("x", tuple(Sample(n, 1) for n in lengths), vocab=32, tp=tp, cp=cp, layout=layout)

    assert packing_mismatch(sc("thd", 1, 1, 23, 5)) is None
    assert packing_mismatch(sc("thd", 2, 1, 24, 16)) is None
    assert "multiple of tp=2; lengths [23]" in packing_mismatch(sc("thd", 2, 1, 24, 23))
    # zigzag: ceil(L / 2cp) rows a chunk in the harness, ceil(L / (2 tp cp)) * tp in verl
    assert packing_mismatch(sc("zigzag", 1, 2, 23, 9, 2)) is None
    assert packing_mismatch(sc("zigzag", 2, 2, 24, 23, 16)) is None
    assert "lengths [9]" in packing_mismatch(sc("zigzag", 2, 2, 24, 9))
    assert packing_mismatch(sc("bshd", 2, 1, 24, 7)) is None
    assert "longest sample (17)" in packing_mismatch(sc("bshd", 2, 1, 17, 4))


def test_the_call_site_is_compiled_from_verls_file(tmp_path):
    """Its line numbers and file are verl's (tracebacks and in-place write sites name verl's
    lines); the names it reads from outside itself are listed, builtins and its own excluded."""
    src = _fake_checkout(tmp_path, legacy=LEGACY_ACTOR)
    site = detect_era(src).call_sites["legacy"]
    fn, namespace, free = compile_call_site(src, site)
    assert free == ["calculate_entropy", "vocab_parallel_entropy", "vocab_parallel_log_probs_from_logits"]
    assert fn.__code__.co_filename == str(src / "verl/workers/actor/megatron_actor.py")
    assert fn.__code__.co_firstlineno == site["line"]
    with pytest.raises(AttributeError) as exc:  # its first line: assert logits.shape[:2] == ...
        fn(None, None, None)
    frame = exc.traceback[-1]  # pytest's line numbers count from 0
    assert str(frame.path) == str(src / "verl/workers/actor/megatron_actor.py") and frame.lineno == site["line"]
    assert "calculate_entropy" not in namespace, "the caller's variables are bound per call, not at compile time"


def test_import_runs_no_package_init_stubs_only_missing_modules_and_is_undone(tmp_path):
    src = _fake_checkout(tmp_path, tp=TP_OLD + "\nimport ray\nfrom verl.utils.helpers import one\n")
    (tmp_path / "verl/__init__.py").write_text("raise RuntimeError('verl/__init__.py must not run')\n")
    (tmp_path / "verl/utils/__init__.py").write_text("raise RuntimeError('verl/utils/__init__.py must not run')\n")
    (tmp_path / "verl/utils/helpers.py").write_text("one = 1\n")
    modules_before, meta_before = set(sys.modules), list(sys.meta_path)
    had_ray, had_warning_once = "ray" in sys.modules, hasattr(logging.Logger, "warning_once")
    verl = target(config=TargetConfig(str(src)))
    try:
        tp = verl.modules()["verl.utils.megatron.tensor_parallel"]
        assert tp.one == 1 and hasattr(tp, "vocab_parallel_entropy")
        assert verl.stubs == ([] if had_ray else ["ray"])
        assert hasattr(logging.Logger, "warning_once")
    finally:
        verl.release()
    added = set(sys.modules) - modules_before  # torch and megatron modules imported on the way stay
    assert not [m for m in added if m == "verl" or m.startswith("verl.") or m == "ray"], added
    assert sys.meta_path == meta_before and hasattr(logging.Logger, "warning_once") == had_warning_once
    assert not list(tmp_path.rglob("__pycache__")), "bytecode was written into the checkout"
    # a module that is missing and not one verl can do without is the checkout's problem, named
    bad = target(config=TargetConfig(str(_fake_checkout(tmp_path / "bad", tp=TP_OLD + "\nimport not_a_module_anywhere\n"))))
    try:
        with pytest.raises(BadInput, match="cannot be imported .*not_a_module_anywhere"):
            bad.modules()
    finally:
        bad.release()


# ----------------------------------------------------------------------------------------------
# with a real checkout

# Scenarios that leave the inputs alone in every era: bfloat16 logits (megatron's cross entropy
# copies them to float32 instead of subtracting in place), no entropy (its backward writes into the
# logits it saved), temperature 1 (the call site divides in place; verl's packing gives padding rows
# temperature 0, which it raises to 1e-8), lengths nothing pads. A zigzag response crossing the end
# of CP chunk 2 (sample 0, token 4: row 17) catches labels shifted across CP chunks.
CLEAN = [
    {"name": "clean-zigzag-cp2", "samples": [[24, 10], [16, 7]], "vocab": 64, "cp": 2, "layout": "zigzag"},
    {"name": "clean-zigzag-tp2cp2", "samples": [[24, 10], [16, 7]], "vocab": 64, "tp": 2, "cp": 2,
     "layout": "zigzag"},
    {"name": "clean-thd-tp2", "samples": [[24, 10], [16, 7]], "vocab": 64, "tp": 2},
    {"name": "clean-bshd-tp2", "samples": [[24, 10], [24, 7]], "vocab": 64, "tp": 2, "layout": "bshd"},
]
CLEAN = [dict(sc, with_entropy=False, temperature=1.0, dtype="bfloat16", seed=11 + i) for i, sc in enumerate(CLEAN)]


@needs_verl
@pytest.mark.world
@pytest.mark.parametrize("spec", [PLAIN, ACTOR])
def test_verl_matches_the_reference_where_it_leaves_its_inputs_alone(spec, world, tmp_path):
    if spec == ACTOR and not detect_era(source()).call_sites:
        pytest.skip("this verl commit has no actor call site the adapter reads")
    scenarios = [Scenario.from_dict(sc) for sc in CLEAN]
    run = run_on_world(world, scenarios, spec, tmp_path / "r.json", "clean")
    verdicts = {v["name"]: v["verdict"] for v in run.report["scenarios"]}
    assert run.report["target"]["era"] and run.report["target"]["src"] == str(source())
    assert set(verdicts.values()) <= {"pass", "skip"} and "pass" in verdicts.values(), run.stdout[-3000:]


@needs_verl
@pytest.mark.world
def test_smoke_findings_at_the_newest_commit_are_verls_in_place_writes(world, tmp_path):
    """The values and gradients of every smoke scenario the target supports are right (verl's
    newest commit, 1dda039b9, and every commit of tensor_parallel.py before it), except the entropy
    of float16 logits (computed in float16, its gradient too before #1007); what fails is verl writing into the logits it is
    given: megatron's cross entropy (called without a clone when no entropy is wanted) in the
    forward, _VocabParallelEntropy.backward's sub_ then add_ (not exact, since #1007) in the
    backward. Every skip has its reason."""
    run = run_on_world(world, get_suite("smoke"), PLAIN, tmp_path / "r.json", "smoke")
    for v in run.report["scenarios"]:
        if v["verdict"] == "skip":
            assert v["reason"], v["name"]
            continue
        for f in v.get("failures") or []:
            if f["kind"] in ("value_mismatch", "grad_mismatch") and v["scenario"]["dtype"] == "float16":
                assert f["kind"] == "grad_mismatch" or "entropy" in f["message"], f
                continue
            assert f["kind"] == "input_mutated", (v["name"], f["message"])
            assert "tensor_parallel.py" in f["message"] or "cross_entropy.py" in f["message"], f["message"]


@needs_verl
@pytest.mark.world
def test_chunked_entropy_cannot_be_differentiated_over_several_chunks(tmp_path):
    """verl's vocab_parallel_entropy_with_chunking (#6446): each chunk's backward writes into its
    view of the logits (sub_ then add_), bumping the version every other chunk's saved view
    shares, so the next chunk's backward raises. One chunk is fine."""
    if "vocab_parallel_entropy_with_chunking" not in detect_era(source()).functions:
        pytest.skip("this verl commit has no vocab_parallel_entropy_with_chunking")
    base = {"samples": [[9, 5], [6, 3]], "vocab": 32, "entropy_coef": 0.1, "temperature": 0.7, "seed": 5}
    scenarios = tmp_path / "chunks.json"
    scenarios.write_text(json.dumps([dict(base, name="one-chunk"),
                                     dict(base, name="three-chunks", log_probs_chunk_size=6)]))
    report = tmp_path / "r.json"
    proc = run_cli("run", "--target", "verl", "--target-opt", "entropy_chunking=true", "--scenario-file",
                   str(scenarios), "--nproc", "1", "--json-report", str(report), cwd=str(tmp_path))
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    doc = json.loads(report.read_text())
    assert doc["target"]["entropy_chunking"] is True
    verdicts = {v["name"]: v for v in doc["scenarios"]}
    assert verdicts["one-chunk"]["verdict"] == "pass", verdicts["one-chunk"]
    failure = verdicts["three-chunks"]["failures"][0]
    assert failure["kind"] == "rank_error" and "modified by an inplace operation" in failure["message"]
    assert "tensor_parallel.py" in failure["message"] and "in backward" in failure["message"]


# Scenarios whose rows verl's packing puts elsewhere than the harness (skipped on the harness's
# rows): sequences not a multiple of tp, CP chunks longer than ceil(L / 2cp), a batch row padded to
# tp. Clean as CLEAN is.
PADDED = [
    {"name": "padded-thd-tp2", "samples": [[23, 10], [9, 4]], "vocab": 64, "tp": 2},
    {"name": "padded-zigzag-tp2cp2", "samples": [[23, 10], [9, 4]], "vocab": 64, "tp": 2, "cp": 2,
     "layout": "zigzag"},
    {"name": "padded-bshd-tp2", "samples": [[17, 9], [12, 11]], "vocab": 64, "tp": 2, "layout": "bshd"},
]
PADDED = [dict(sc, with_entropy=False, temperature=1.0, dtype="bfloat16", seed=31 + i) for i, sc in enumerate(PADDED)]


@needs_verl
@pytest.mark.world
def test_verls_own_packing_lays_out_what_the_harness_rows_could_not(world, tmp_path):
    """Scenarios the engine skipped on the harness's rows run on the rows verl's packing lays out
    (the position trace): values and gradients are right; the report names the function that laid
    them out. What fails is verl's in-place division of the padding rows its packing adds: it
    gives them temperature 0, raised to 1e-8, and divides the logits in place."""
    actor = target("actor")
    if actor.data_path is None:
        pytest.skip("this verl commit has no packing the adapter follows")
    scenarios = [Scenario.from_dict(sc) for sc in PADDED]
    assert all(packing_mismatch(sc) for sc in scenarios)
    run = run_on_world(world, scenarios, ACTOR, tmp_path / "r.json", "padded")
    for v in run.report["scenarios"]:
        if v["scenario"]["layout"] == "bshd" and actor.data_path.builds(Scenario.from_dict(v["scenario"])):
            continue
        assert v["verdict"] in ("pass", "fail") and v["layout_built_by"] == actor.data_path.name, v["name"]
        for f in v.get("failures") or []:
            assert f["kind"] == "input_mutated" and "padding" in f["message"], (v["name"], f["message"])

REPO_ENV = "SHARDCHECK_VERL_REPO"
PR_4250 = "10175743f"  # "fix bugs in mcore backend context-parallel code logic": labels rolled in the packing


def _repo_with(commit: str) -> str | None:
    for repo in (os.environ.get(REPO_ENV), VERL_SRC):
        if repo and subprocess.run(["git", "-C", repo, "cat-file", "-e", f"{commit}^{{commit}}"],
                                   capture_output=True).returncode == 0:
            return repo
    return None



@pytest.mark.world
@pytest.mark.skipif(not _repo_with(PR_4250), reason=f"neither {REPO_ENV} nor {ENV} is a verl git repository "
                    f"holding {PR_4250} (a clone of verl-project/verl with its history)")
def test_labels_rolled_across_cp_chunks_fail_before_4250_and_pass_after(tmp_path):
    """Before #4250 the engine's logits processor rolled the packed labels itself
    (torch.roll(label, -1) on the CP rank's buffer): the last row of a zigzag chunk got the first
    token of the rank's next chunk as its label. #4250 rolls them in verl's packing
    (need_roll), with the token that follows in the sequence."""
    repo = _repo_with(PR_4250)
    scenarios = tmp_path / "clean.json"
    scenarios.write_text(json.dumps(CLEAN[:2]))
    args = ["run", "--target", "verl:actor", "--target-opt", "call_site=engine", "--scenario-file", str(scenarios)]
    parent = export_commit(repo, f"{PR_4250}~1", tmp_path / "before", "verl")
    before = run_cli(*args, "--verl-src", parent, cwd=str(tmp_path))
    assert before.returncode == 1, before.stdout[-3000:] + before.stderr[-2000:]
    assert "value_mismatch" in before.stdout and "log_probs sample 0 token 4" in before.stdout
    assert "grad_mismatch" in before.stdout and "input_mutated" not in before.stdout
    after = run_cli(*args, "--verl-src", export_commit(repo, PR_4250, tmp_path / "after", "verl"),
                    cwd=str(tmp_path))
    assert after.returncode == 0, after.stdout[-3000:] + after.stderr[-2000:]


PR_6001 = "45c0f58a6"  # "[data] fix: pad data in preprocess_packed_seqs if shorter than align_size (#6001)"


@pytest.mark.world
@pytest.mark.skipif(not _repo_with(PR_6001), reason=f"neither {REPO_ENV} nor {ENV} is a verl git repository "
                    f"holding {PR_6001} (a clone of verl-project/verl with its history)")
def test_a_sequence_shorter_than_the_cp_alignment_breaks_the_legacy_packing_before_6001(tmp_path):
    """Before #6001 preprocess_packed_seqs sliced a sequence shorter than 2*tp*cp past its end.
    Reached through the legacy actor's packing (the data path of verl:actor at those commits),
    at tp=2, cp=2 (align 8, chunks of 2 rows): a sequence of 2 tokens gives CP rank 1 an empty
    slice for its 2 rows (RuntimeError on that rank, in preprocess_packed_seqs); one of 3 tokens
    gives it one token, which broadcasts over both rows: position 2 held twice, silently (a layout
    mismatch). #6001 pads the sequence first: both pass."""
    repo = _repo_with(PR_6001)
    scenarios = tmp_path / "short.json"
    base = {"vocab": 64, "tp": 2, "cp": 2, "layout": "zigzag", "with_entropy": False, "temperature": 1.0,
            "dtype": "bfloat16", "seed": 7}
    scenarios.write_text(json.dumps([dict(base, name="short2", samples=[[2, 1], [16, 7]]),
                                     dict(base, name="short3", samples=[[3, 1], [16, 7]])]))
    args = ["run", "--target", "verl:actor", "--scenario-file", str(scenarios)]
    before_report, after_report = tmp_path / "before.json", tmp_path / "after.json"
    parent = export_commit(repo, f"{PR_6001}~1", tmp_path / "before", "verl")
    before = run_cli(*args, "--verl-src", parent, "--json-report", str(before_report), cwd=str(tmp_path))
    assert before.returncode == 1, before.stdout[-3000:] + before.stderr[-2000:]
    doc = json.loads(before_report.read_text())
    assert doc["target"]["call_site"]["kind"] == "legacy"
    verdicts = {v["name"]: v for v in doc["scenarios"]}
    errors = [f for f in verdicts["short2"]["failures"] if f["kind"] == "rank_error"]
    assert errors and "RuntimeError" in errors[0]["message"], verdicts["short2"]["failures"]
    assert "util.py" in errors[0]["message"] and "in preprocess_packed_seqs" in errors[0]["message"]
    mismatch = [f for f in verdicts["short3"]["failures"] if f["kind"] == "layout_mismatch"]
    assert mismatch and "sample 0 position 2 is held 2 times by cp rank 1" in mismatch[0]["message"], \
        verdicts["short3"]["failures"]
    fix = export_commit(repo, PR_6001, tmp_path / "after", "verl")
    after = run_cli(*args, "--verl-src", fix, "--json-report", str(after_report), cwd=str(tmp_path))
    assert after.returncode == 0, after.stdout[-3000:] + after.stderr[-2000:]
    for v in json.loads(after_report.read_text())["scenarios"]:
        assert v["verdict"] == "pass" and v["layout_built_by"] == "verl/models/mcore/util.py:preprocess_packed_seqs"


PR_2484 = "73fc53f60"  # the legacy actor's log-probs on a clone: megatron's cross entropy wrote into the logits


@pytest.mark.skipif(not _repo_with(PR_2484), reason=f"neither {REPO_ENV} nor {ENV} is a verl git repository "
                    f"holding {PR_2484} (a clone of verl-project/verl with its history)")
def test_a_repro_script_shows_the_legacy_actor_crash_with_torch_and_verl_alone(tmp_path):
    """`shardcheck repro --no-inplace` at #2484's parent (the legacy actor's closure on shardcheck's
    rows): the script, run where shardcheck is not installed, finds the backward's "modified by an
    inplace operation" in verl's entropy; pointed at the fix it finds nothing. With the in-place
    check on, the fix shows verl's own entropy backward changing the logits (since #1007)."""
    repo = _repo_with(PR_2484)
    script, checked = tmp_path / "repro.py", tmp_path / "checked.py"
    parent = export_commit(repo, f"{PR_2484}~1", tmp_path / "p", "verl")
    common = ["--target", "verl:actor", "--target-src", parent, "--target-opt", "call_site=legacy", "--target-opt",
              "layout=shardcheck", "--suite", "regressions", "--scenario", "zigzag-tp2cp2-empty-share"]
    for out, extra in ((script, ["--no-inplace"]), (checked, [])):
        made = run_cli("repro", *common, *extra, "--out", str(out))
        assert made.returncode == 0 and out.read_text().count("\n") < 300, made.stderr
    python = torch_only_python(tmp_path)
    run = lambda path, *extra: subprocess.run([python, str(path), *extra], capture_output=True, text=True,  # noqa: E731
                                              timeout=180, cwd=tmp_path)
    fix = export_commit(repo, PR_2484, tmp_path / "f", "verl")
    before, after, in_place = run(script), run(script, "--src", fix), run(checked, "--src", fix)
    assert before.returncode == 1 and "ranks 0, 1, 2, 3 raised RuntimeError" in before.stdout, before.stdout
    assert "modified by an inplace operation" in before.stdout and "tensor_parallel.py:131" in before.stdout
    assert after.returncode == 0 and "not checked (--no-inplace)" in after.stdout, after.stdout + after.stderr
    assert in_place.returncode == 1 and "changed the logits in place in the backward (aten.sub_" in in_place.stdout
    assert "tensor_parallel.py:133" in in_place.stdout, in_place.stdout



PR_6267 = "b916f6036"  # "[megatron] fix: fix bugs when using position_ids in cp (#6267)"


@pytest.mark.world
@pytest.mark.skipif(not _repo_with(PR_6267), reason=f"neither {REPO_ENV} nor {ENV} is a verl git repository "
                    f"holding {PR_6267} (a clone of verl-project/verl with its history)")
def test_position_ids_handed_to_the_model_under_cp_fixed_at_6267(tmp_path):
    """Before #6267 preprocess_thd_engine gave the rows of a zigzag CP rank's second chunk position
    ids that are not their positions (they started past the chunk's start). What the model is
    handed is checked against the learned layout (harness/rank/life/model_inputs.py): a
    layout_mismatch naming the rows at the parent, nothing at the fix."""
    repo = _repo_with(PR_6267)
    args = ["run", "--target", "verl:actor", "--suite", "smoke", "--scenario", "zigzag-tp1cp2-basic", "--no-inplace"]
    before = run_cli(*args, "--verl-src", export_commit(repo, f"{PR_6267}~1", tmp_path / "before", "verl"),
                     cwd=str(tmp_path))
    assert before.returncode == 1, before.stdout[-3000:] + before.stderr[-2000:]
    assert ("preprocess_thd_engine / preprocess_bshd_engine handed the model position ids that are not the rows' "
            "positions: row 6 (sample 0 position 12) holds 18") in before.stdout, before.stdout[-3000:]
    after = run_cli(*args, "--verl-src", export_commit(repo, PR_6267, tmp_path / "after", "verl"), cwd=str(tmp_path))
    assert after.returncode == 0, after.stdout[-3000:] + after.stderr[-2000:]


# -- verl:loss: verl's policy loss in the training step ------------------------------------------------------------
# by module path, as PLAIN and ACTOR (the registry's metadata may be stale where pytest runs from the checkout)
LOSS = "shardcheck.targets.verl_loss:build"

AGG_BEFORE_5417 = """
def agg_loss(loss_mat, loss_mask, loss_agg_mode, dp_size=1, batch_num_tokens=None, global_batch_size=None,
             loss_scale_factor=None):
    if loss_agg_mode == "token-mean":
        loss = masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    elif loss_agg_mode == "seq-mean-token-mean":
        loss = masked_sum(loss_mat, loss_mask) / global_batch_size * dp_size
    elif loss_agg_mode == "seq-mean-token-sum-norm":
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        loss = torch.sum(seq_losses) / loss_scale_factor * dp_size
    else:
        raise ValueError(loss_agg_mode)
    return loss
"""

# since #5417 the norm mode is the sequence mean over loss_scale_factor
NORM_BEFORE_5417 = '''    elif loss_agg_mode == "seq-mean-token-sum-norm":
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        loss = torch.sum(seq_losses) / loss_scale_factor * dp_size'''
AGG_SINCE_5417 = AGG_BEFORE_5417.replace(NORM_BEFORE_5417, '''    elif loss_agg_mode in ["seq-mean-token-sum", "seq-mean-token-sum-norm"]:
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        loss = masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss /= loss_scale_factor''')

LOSSES = """
def ppo_loss(config, model_output, data, dp_group=None):
    config.global_batch_info["dp_size"] = data["dp_size"]
"""

ENGINE_LOSS = ENGINE_METHOD + """
    def prepare_model_outputs(self, output, data):
        return output

    def postprocess_micro_batch_func(self, output, data, forward_only, loss_function):
        loss, metrics = loss_function(model_output=self.prepare_model_outputs(output, data), data=data)
        return loss * data["num_micro_batch"], {"loss": loss.detach().item(), "metrics": metrics}


class MegatronEngine:
    def get_data_parallel_size(self):
        return mpu.get_data_parallel_world_size()

    def get_data_parallel_group(self):
        return mpu.get_data_parallel_group()

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        tu.assign_non_tensor(data, sp_size=self.engine_config.context_parallel_size)
        loss_mask = data["loss_mask"]
        batch_num_tokens = loss_mask.sum().to(get_device_id())
        torch.distributed.all_reduce(batch_num_tokens, group=self.get_data_parallel_group())
        tu.assign_non_tensor(data, batch_num_tokens=batch_num_tokens.item())
        tu.assign_non_tensor(data, dp_size=self.get_data_parallel_size())
        micro_batches, indices = prepare_micro_batches(data=data)
        tu.assign_non_tensor(data, batch_num_tokens=0)
"""


def _fake_loss_checkout(root, agg=AGG_BEFORE_5417, losses=LOSSES, engine=ENGINE_LOSS):
    _fake_checkout(root, tp=TP_NEW, engine=engine, util=UTIL_NEW)
    for rel, text in (("verl/trainer/ppo/core_algos.py", agg), ("verl/workers/utils/losses.py", losses)):
        if text is not None:
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(textwrap.dedent(text))
    return str(root)


def test_the_loss_era_and_each_modes_objective_are_read_from_the_checkout(tmp_path, monkeypatch):
    """agg_loss's modes and what its norm mode is, and forward_backward_batch's global batch info
    lines (up to its split of the mini-batch), read from verl's files; each mode declares the
    objective it is, or every scenario is skipped saying why."""
    from shardcheck.targets.verl_loss import detect_loss_era

    monkeypatch.delenv(ENV, raising=False)
    before = _fake_loss_checkout(tmp_path / "before")
    era = detect_loss_era(tmp_path / "before")
    assert era["agg_loss"]["modes"] == ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
    assert era["agg_loss"]["norm_is_global_token_sum"]
    engine_lines = (tmp_path / "before" / "verl/workers/engine/megatron/transformer_impl.py").read_text().splitlines()
    chosen = [engine_lines[a - 1].strip() for a, _ in era["global_batch_info_lines"]]
    assert chosen == ['loss_mask = data["loss_mask"]', "batch_num_tokens = loss_mask.sum().to(get_device_id())",
                      "torch.distributed.all_reduce(batch_num_tokens, group=self.get_data_parallel_group())",
                      "tu.assign_non_tensor(data, batch_num_tokens=batch_num_tokens.item())",
                      "tu.assign_non_tensor(data, dp_size=self.get_data_parallel_size())"]
    since = _fake_loss_checkout(tmp_path / "since", agg=AGG_SINCE_5417)
    assert detect_loss_era(tmp_path / "since")["agg_loss"]["modes"] == [
        "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]

    def loss(src, **options):
        return resolve(LOSS, TargetConfig(src, tuple(options.items())))

    step = get_suite("training")[0]
    assert loss(before).definitions.objective == "token_mean" and loss(before).loss_agg_mode == "token-mean"
    assert loss(before, loss_agg_mode="seq-mean-token-mean").definitions.objective == "sample_mean"
    norm = loss(before, loss_agg_mode="seq-mean-token-sum-norm")
    assert "loss_scale_factor=batch_num_tokens makes it the token mean" in norm.capabilities.skip_reason(step)
    counted = loss(before, loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor="batch_num_tokens")
    assert counted.definitions.objective == "token_mean" and counted.capabilities.skip_reason(step) is None
    for mode, words in (("seq-mean-token-sum-norm", "is the mean over samples of each sample's token sum, over "
                                                    "loss_scale_factor"),
                        ("seq-mean-token-sum", "each sample's token sum: not an objective")):
        reason = loss(since, loss_agg_mode=mode).capabilities.skip_reason(step)
        assert words in reason and "\n" not in reason, reason
    for options, words in (({"loss_agg_mode": "token-sum"}, "agg_loss at before takes token-mean"),
                           ({"loss_agg_mode": "seq-mean-token-sum-norm", "loss_scale_factor": "7"},
                            "only batch_num_tokens"),
                           ({"loss_scale_factor": "batch_num_tokens"}, "read by loss_agg_mode=seq-mean-token-sum-norm"),
                           ({"call_site": "legacy"}, "call_site=engine only"),
                           ({"layout": "shardcheck"}, "layout=framework only")):
        with pytest.raises(BadInput, match=words):
            loss(before, **options)
    with pytest.raises(BadInput, match="no ppo_loss in verl/workers/utils/losses.py"):
        loss(_fake_loss_checkout(tmp_path / "no-loss", losses=None))
    with pytest.raises(BadInput, match="has no MegatronEngine.get_data_parallel_size"):
        loss(_fake_loss_checkout(tmp_path / "no-engine", engine=ENGINE_METHOD))


def _step_scenarios(*names):
    return [sc for sc in get_suite("training") if sc.name in names]


@needs_verl
@pytest.mark.world
def test_verls_token_mean_loss_passes_the_training_step(world, tmp_path):
    """verl:loss at the pin, verl's default loss_agg_mode (token-mean): ppo_loss on the engine's model
    output, the engine's global batch info (the mini-batch's loss_mask summed over the data-parallel
    group) and its loss * num_micro_batch for megatron-core's two-value form: the gradient DDP leaves
    is the global batch's token mean at dp 2 x 3 micro-batches (and a copy of the step: dp 4 in all),
    dp 2 x cp 2 and tp 2 x cp 2; NaN at masked positions reaches nothing (the mask-leak check on).
    verl's in-place writes into the logits are known (the engine's logits.div_): --no-inplace."""
    scenarios = _step_scenarios("step-thd-dp2-mb3", "step-zigzag-dp2cp2-mb2", "step-zigzag-tp2cp2-mb3")
    run = run_on_world(world, scenarios, LOSS, tmp_path / "r.json", "training", inplace=False)
    assert run.exit_code == 0, run.stdout[-3000:]
    assert {v["verdict"] for v in run.report["scenarios"]} == {"pass"}
    loss = run.report["target"]["loss"]
    assert loss["loss_agg_mode"] == "token-mean" and "ppo_loss" in loss["loss_function"]
    assert "loss_agg_mode=token-mean" in run.report["target"]["definitions"]["objective"]


@needs_verl
@pytest.mark.world
def test_verls_seq_mean_token_mean_is_the_sample_mean_and_lets_nan_at_masked_positions_in(world, tmp_path,
                                                                                             monkeypatch):
    """loss_agg_mode=seq-mean-token-mean: the gradient is the mean of each sample's token mean over the
    global batch. A finding at the pin, latent: agg_loss's sequence modes sum loss_mat * loss_mask
    (core_algos.py, seq-mean-token-mean's torch.sum(loss_mat * loss_mask, dim=-1)), so NaN at a masked
    token (its logits, advantage or old log-prob) makes the loss NaN; masked_sum, which token-mean
    uses, selects (#2377). verl's own rollouts give finite values there."""
    from shardcheck.targets.base import OPTS_ENV

    monkeypatch.setenv(OPTS_ENV, json.dumps([["loss_agg_mode", "seq-mean-token-mean"]]))
    scenarios = _step_scenarios("step-thd-dp2-mb3", "step-zigzag-cp4-mb2")
    run = run_on_world(world, scenarios, LOSS, tmp_path / "r.json", "training", inplace=False, mask_leak=False)
    assert run.exit_code == 0, run.stdout[-3000:]
    assert "each sample's masked token mean" in run.report["target"]["definitions"]["objective"]
    leak = run_on_world(world, _step_scenarios("step-thd-dp4"), LOSS, tmp_path / "l.json", "training",
                        inplace=False)
    assert leak.exit_code == 1, leak.stdout[-3000:]
    assert ("mask_leak [ranks 0]: NaN at the masked positions of the logits and advantages and old_log_probs "
            "reached the loss of micro-batch 0") in leak.stdout, leak.stdout[-3000:]


@needs_verl
def test_verls_sums_are_skipped_saying_why():
    """token-sum, seq-mean-token-sum and (since #5417) seq-mean-token-sum-norm are sums, not a mean
    the reference computes: every step scenario is skipped with the reason."""
    era_modes = resolve(LOSS, TargetConfig(None)).loss_era["agg_loss"]["modes"]
    for mode in ("token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        if mode not in era_modes:
            continue
        loss = resolve(LOSS, TargetConfig(None, (("loss_agg_mode", mode),)))
        reasons = {loss.capabilities.skip_reason(sc) for sc in get_suite("training")}
        assert len(reasons) == 1 and "not an objective the reference computes" in reasons.pop(), mode


ENGINE = "verl/workers/engine/megatron/transformer_impl.py"


@needs_verl
@pytest.mark.world
def test_coverage_of_verls_loss_names_the_loss_the_engine_the_schedule_and_ddp(world, tmp_path):
    run = run_on_world(world, _step_scenarios("step-thd-dp2-mb3"), LOSS, tmp_path / "r.json", "training",
                       inplace=False, mask_leak=False, coverage=True)
    assert run.exit_code == 0, run.stdout[-3000:]
    ran = {name for f in run.report["coverage"]["files"].values() for name in f["functions"]}
    for name in ("verl/workers/utils/losses.py:ppo_loss", "verl/trainer/ppo/core_algos.py:agg_loss",
                 "verl/trainer/ppo/core_algos.py:compute_policy_loss_vanilla",
                 f"{ENGINE}:MegatronEngine.forward_backward_batch",
                 f"{ENGINE}:MegatronEngineWithLMHead.postprocess_micro_batch_func",
                 "megatron-core/megatron/core/pipeline_parallel/schedules.py:forward_backward_no_pipelining",
                 "megatron-core/megatron/core/distributed/finalize_model_grads.py:finalize_model_grads",
                 "megatron-core/megatron/core/distributed/param_and_grad_buffer.py:_ParamAndGradBucketGroup."
                 "finish_grad_sync"):
        assert name in ran, sorted(ran)


PR_5366 = "3671d37fe"  # "correct & consistent loss aggregation for seq-mean-token-sum-norm": * dp_size
PR_2377 = "5cbad8379"  # masked_sum selects instead of multiplying (before the engine's ppo_loss existed)


@pytest.mark.world
@pytest.mark.skipif(not _repo_with(PR_5366), reason=f"neither {REPO_ENV} nor {ENV} is a verl git repository "
                    f"holding {PR_5366} (a clone of verl-project/verl with its history)")
def test_the_norm_modes_missing_dp_factor_fails_before_5366_and_passes_after(world2, tmp_path, monkeypatch):
    """Before #5366, agg_loss's seq-mean-token-sum-norm was the micro-batch's token sum over
    loss_scale_factor, without the * dp_size the other modes have to cancel DDP's mean over the
    data-parallel ranks. With loss_scale_factor the global batch's masked-in count its objective is
    the token mean: at dp 2 the gradient is x 0.5 (= 1 / dp) at the parent, right at the fix (the
    mask-leak check off: the branch's loss_mat * loss_mask lets NaN in at both)."""
    from shardcheck.targets.base import OPTS_ENV, SRC_ENV

    repo = _repo_with(PR_5366)
    monkeypatch.setenv(OPTS_ENV, json.dumps([["loss_agg_mode", "seq-mean-token-sum-norm"],
                                             ["loss_scale_factor", "batch_num_tokens"]]))
    said = {}
    for name, rev in (("parent", f"{PR_5366}~1"), ("fix", PR_5366)):
        monkeypatch.setenv(SRC_ENV, export_commit(repo, rev, tmp_path / name, "verl"))
        said[name] = run_on_world(world2, _step_scenarios("step-thd-dp2-mb3"), LOSS, tmp_path / f"{name}.json",
                                  "training", inplace=False, mask_leak=False)
    assert said["parent"].exit_code == 1, said["parent"].stdout[-3000:]
    assert ("grad_mismatch [ranks 0,1]: the step's gradient (DDP's main_grad, what the optimizer sees) is x 0.500 "
            "the reference's on every row (= 1 / dp): token_mean scaled wrong") in said["parent"].stdout
    assert said["fix"].exit_code == 0, said["fix"].stdout[-3000:]


@pytest.mark.skipif(not _repo_with(PR_2377), reason=f"neither {REPO_ENV} nor {ENV} is a verl git repository "
                    f"holding {PR_2377} (a clone of verl-project/verl with its history)")
def test_an_era_before_the_engines_loss_is_refused_in_one_line(tmp_path):
    """#2377 (masked_sum multiplied by the mask) predates verl/workers/utils/losses.py: its loss was
    the legacy MegatronPPOActor's, which verl:loss does not follow."""
    parent = export_commit(_repo_with(PR_2377), f"{PR_2377}~1", tmp_path / "parent", "verl")
    with pytest.raises(BadInput, match="no ppo_loss in verl/workers/utils/losses.py") as exc:
        resolve(LOSS, TargetConfig(parent))
    assert "\n" not in str(exc.value)
