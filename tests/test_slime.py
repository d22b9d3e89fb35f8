"""The slime target. Checking real slime needs a checkout (slime is not on PyPI): set
SHARDCHECK_SLIME_SRC to one. Era detection and bad input are checked without it.

Over 20 s: with a checkout (about 110 s here), each entry point runs suites on real worlds and the
historical fixes run shardcheck and repro scripts at several commits (without one: 1 s)."""

import json
import os
import subprocess
import textwrap

import pytest

from conftest import export_commit, run_cli, torch_only_python, write_scenarios
from shardcheck.errors import BadInput
from shardcheck.scenarios import Scenario, get_suite
from shardcheck.targets.slime import ENV, detect_era, source

SLIME_SRC = os.environ.get(ENV)
needs_slime = pytest.mark.skipif(not SLIME_SRC, reason=f"{ENV} is not set: no slime checkout to check "
                                 "(clone THUDM/slime and point it there; never pip install 'slime')")


def _fake_checkout(tmp_path, body: str, ppo: str = ""):
    loss = tmp_path / "slime" / "backends" / "megatron_utils" / "loss.py"
    loss.parent.mkdir(parents=True)
    loss.write_text(textwrap.dedent(body))
    if ppo:
        (tmp_path / "slime" / "utils").mkdir(parents=True)
        (tmp_path / "slime" / "utils" / "ppo_utils.py").write_text(ppo)
    return tmp_path


def test_era_of_an_old_checkout(tmp_path):
    src = _fake_checkout(tmp_path, """
        def get_log_probs_and_entropy(logits, *, args, unconcat_tokens, total_lengths, response_lengths,
                                      with_entropy=False, non_loss_data=True, max_seq_lens=None):
            if args.qkv_format == "bshd":
                pass
            return {"log_probs": []}
        """, ppo="def calculate_log_probs_and_entropy(logits, tokens, tp_group, need_entropy_grad=True): pass")
    era = detect_era(src)
    assert era.returns == "dict" and era.qkv_format and era.max_seq_lens
    assert not era.allgather_cp and not era.top_p_replay
    assert era.entropy_grad_flag == "need_entropy_grad"


def test_a_checkout_without_git_is_named_by_its_folder_in_skip_reasons(tmp_path, monkeypatch):
    from shardcheck.targets.base import TargetConfig
    from shardcheck.targets.slime import target

    monkeypatch.delenv("SHARDCHECK_SLIME_COMMIT", raising=False)
    monkeypatch.delenv("SHARDCHECK_TARGET_COMMIT", raising=False)
    src = _fake_checkout(tmp_path / "slime-export", """
        def get_log_probs_and_entropy(logits, *, args, unconcat_tokens, total_lengths, response_lengths,
                                      with_entropy=False, non_loss_data=True):
            return {"log_probs": []}
        """)
    slime = target(config=TargetConfig(str(src), (("layout", "shardcheck"),)))
    bshd = next(s for s in get_suite("smoke") if s.layout == "bshd")
    reason = slime.capabilities.skip_reason(bshd)
    assert "slime at slime-export has no such layout" in reason and "?" not in reason, reason
    assert slime.describe()["version"].startswith("checkout ")


def test_era_of_a_new_checkout(tmp_path):
    src = _fake_checkout(tmp_path, """
        def get_log_probs_and_entropy(logits, *, args, unconcat_tokens, total_lengths, response_lengths,
                                      with_entropy=False, non_loss_data=True, top_p_token_ids=None,
                                      top_p_token_offsets=None):
            if args.allgather_cp:
                pass
            return torch.empty((0,)), {"log_probs": []}
        """)
    era = detect_era(src)
    assert era.returns == "tuple (empty, dict)" and era.allgather_cp and era.top_p_replay
    assert not era.qkv_format and era.entropy_grad_flag is None


def test_the_source_must_be_named_and_be_a_checkout(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(BadInput, match="needs a slime source checkout"):
        source()
    with pytest.raises(BadInput, match="is not a slime checkout"):
        source(str(tmp_path))


def test_cli_without_a_checkout_is_one_line_exit_2(tmp_path, cli_in_process):
    env_free = cli_in_process("run", "--target", "slime", "--slime-src", str(tmp_path))
    assert env_free.returncode == 2 and "is not a slime checkout" in env_free.stderr
    assert "Traceback" not in env_free.stderr


@needs_slime
@pytest.mark.world
def test_slime_passes_every_smoke_scenario_it_supports(tmp_path):
    """Point SHARDCHECK_SLIME_SRC at a commit whose log-probs are right (slime's newest was, at
    624b824a8): every scenario it supports passes, the rest are skipped with the reason."""
    report = tmp_path / "r.json"
    proc = run_cli("run", "--target", "slime", "--suite", "smoke", "--json-report", str(report))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(report.read_text())
    assert doc["target"]["name"] == "slime" and doc["target"]["era"]
    verdicts = {v["verdict"] for v in doc["scenarios"]}
    assert verdicts <= {"pass", "skip"} and "pass" in verdicts


def test_policy_loss_is_a_variant_of_the_slime_target(tmp_path, cli_in_process):
    proc = cli_in_process("targets")
    assert proc.returncode == 0 and "policy_loss" in proc.stdout, proc.stdout
    from shardcheck.targets import resolve

    with pytest.raises(BadInput, match="no variant 'nope'"):
        resolve("slime:nope")


@needs_slime
@pytest.mark.world
def test_slime_applies_replayed_keep_sets_where_its_era_takes_them(tmp_path):
    """get_log_probs_and_entropy's top_p_token_ids / top_p_token_offsets (the adapter hands the
    keep sets over in slime's own format) and policy_loss_function (the batch's
    rollout_top_p_token_ids/offsets, rollout_top_p != 1): the replay suite, whose truth is
    renormalised over the sets, passes through both where slime supports the layout."""
    for target in ("slime", "slime:policy_loss"):
        report = tmp_path / "r.json"
        proc = run_cli("run", "--target", target, "--suite", "replay", "--json-report", str(report))
        doc = json.loads(report.read_text())
        if not doc["target"]["era"].get("top_p_replay"):
            pytest.skip("this slime commit takes no top-p replay")
        assert proc.returncode == 0, proc.stdout[-3000:]
        verdicts = {v["name"]: v["verdict"] for v in doc["scenarios"]}
        assert {verdicts[n] for n in ("replay-zigzag-tp2cp2", "replay-thd-tp2", "replay-allgather-tp2cp2",
                                      "replay-thd-one-device")} == {"pass"}, (target, verdicts)


@needs_slime
@pytest.mark.world
def test_slime_policy_loss_passes_every_smoke_scenario_it_supports(tmp_path):
    """policy_loss_function with old log-probs equal to the truth (ratio 1) and KL off: its loss
    value and gradient match the reference wherever slime's log-probs are right."""
    report = tmp_path / "r.json"
    proc = run_cli("run", "--target", "slime:policy_loss", "--suite", "smoke", "--json-report", str(report))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(report.read_text())
    assert doc["target"]["name"] == "slime:policy_loss"
    assert "args_read_but_not_set" in doc["target"] and not doc["target"]["args_read_but_not_set"]
    verdicts = {v["verdict"] for v in doc["scenarios"]}
    assert verdicts <= {"pass", "skip"} and "pass" in verdicts


REPO_ENV = "SHARDCHECK_SLIME_REPO"
needs_slime_history = pytest.mark.skipif(
    not os.environ.get(REPO_ENV), reason=f"{REPO_ENV} is not set: no slime git repository with its history "
    "(a clone of THUDM/slime) to check past commits against")
PR_2153 = "fa3c990af"  # "bugfix": moves the with_entropy_grad decision out of policy_loss_function



@needs_slime_history
@pytest.mark.world
def test_a_bug_at_one_call_site_shows_only_through_the_caller(tmp_path):
    """The gradient decision at one call site: before PR #2153, policy_loss_function passed
    with_entropy_grad to a get_log_probs_and_entropy that no longer took it. Calling the function directly passes; the
    policy loss target names the caller's line."""
    src = export_commit(os.environ[REPO_ENV], f"{PR_2153}~1", tmp_path / "slime")
    scenario = ["--suite", "regressions", "--scenario", "thd-tp2-chunks", "--slime-src", src]
    direct = run_cli("run", "--target", "slime", *scenario)
    assert direct.returncode == 0, direct.stdout[-2000:]
    caller = run_cli("run", "--target", "slime:policy_loss", *scenario)
    assert caller.returncode == 1, caller.stdout[-2000:]
    assert "rank_error" in caller.stdout and "with_entropy_grad" in caller.stdout
    assert "in policy_loss_function" in caller.stdout, "the error is placed at slime's call site"


GET_BATCH_OLD = '''
def get_batch(data_iterator, keys, pad_multiplier: int = 128, qkv_format: str = "thd", allgather_cp: bool = False):
    if qkv_format == "thd":
        if allgather_cp:
            cu = torch.tensor([0], device=torch.cuda.current_device())
        else:
            cu = torch.tensor([0]).cuda() * 2
    if allgather_cp:
        pass
'''


def test_get_batch_is_read_from_its_source(tmp_path):
    """Which knobs slime's get_batch has, and which layout's branch needs CUDA (the innermost
    ``if allgather_cp`` around a ``.cuda()``), from a checkout's source."""
    from shardcheck.targets.slime_data import read_get_batch

    data = tmp_path / "slime" / "backends" / "megatron_utils" / "data.py"
    data.parent.mkdir(parents=True)
    data.write_text(GET_BATCH_OLD)
    found = read_get_batch(tmp_path)
    assert found["params"] == ["data_iterator", "keys", "pad_multiplier", "qkv_format", "allgather_cp"]
    assert found["pad_multiplier_default"] == 128 and found["current_device"]
    assert found["cuda_lines"] == {"thd": 7, "zigzag": 7}  # the else branch: all-gather CP runs on a CPU
    data.write_text("def get_batch(data_iterator, keys):\n    pass\n")
    assert read_get_batch(tmp_path)["pad_multiplier_default"] is None
    data.unlink()
    assert read_get_batch(tmp_path) is None


def test_the_layout_option_is_checked(cli_in_process, tmp_path):
    got = cli_in_process("run", "--target", "slime", "--target-src", str(tmp_path), "--target-opt", "layout=mine")
    assert got.returncode == 2 and got.stderr == ("shardcheck: error: option layout='mine': expected framework "
                                                  "(slime's get_batch) or shardcheck\n")


@needs_slime
@pytest.mark.world
def test_slime_lays_out_its_rows_with_get_batch_and_its_knob(tmp_path):
    """By default slime's own get_batch lays out every thd, zigzag and all-gather scenario (its
    padding to tp * 128 included); pad_multiplier in a scenario reaches it; a bad value is one line."""
    base = [s for s in get_suite("smoke") if s.name in ("zigzag-tp2cp2-edges", "allgather-tp1cp4-long-prompt",
                                                        "bshd-tp2cp1-basic")]
    scenarios = base + [Scenario.from_dict(dict(base[-1].to_dict(), name="ag-pm1", layout_knobs={"pad_multiplier": 1}))]
    report = tmp_path / "r.json"
    proc = run_cli("run", "--target", "slime:loss", "--scenario-file", str(write_scenarios(tmp_path / "s.json",
                   scenarios)), "--json-report", str(report), "--no-mask-leak")  # its mask_leak: tested below
    assert proc.returncode == 0, proc.stdout[-3000:]
    doc = {v["name"]: v for v in json.loads(report.read_text())["scenarios"]}
    assert doc["zigzag-tp2cp2-edges"]["layout_built_by"] == "slime/backends/megatron_utils/data.py:get_batch"
    rows = lambda name: {lay["shape"][1] for lay in doc[name]["layouts"].values()}  # noqa: E731
    assert rows("zigzag-tp2cp2-edges") == {256} and rows("allgather-tp1cp4-long-prompt") == {128}
    assert max(rows("ag-pm1")) < 128
    assert doc["bshd-tp2cp1-basic"]["verdict"] == "skip"  # slime's newest has no bshd
    bad = write_scenarios(tmp_path / "bad.json", [Scenario.from_dict(dict(base[-1].to_dict(), name="bad",
                                                                          layout_knobs={"pad_multiplier": -1}))])
    proc = run_cli("run", "--target", "slime", "--scenario-file", str(bad))
    assert proc.returncode == 2 and "layout knob pad_multiplier must be an integer >= 1, got -1" in proc.stderr


PR_2123 = "6ad61127e"  # "Fix training stuck on all-gather cp": placeholders that require grad as the values do
PR_1678 = "92682315a"  # "bugfixes from community": loss_function's loss + 0 * logits.sum() under all-gather CP


@needs_slime_history
@pytest.mark.world
def test_a_hang_only_slimes_own_padding_reaches(tmp_path):
    """slime's get_batch pads the packed stream to cp * tp * 128: with one sample of 100 tokens at
    cp 2, CP rank 1 holds only padding. Before PR #2123 its all-gather redistribution then made the
    entropy differentiable on one rank only: a backward all-reduce on rank 1 alone (a hang). The
    harness's own layout (padding to cp * tp) gives both ranks response rows and passes."""
    repo = os.environ[REPO_ENV]
    scenario = ["--suite", "regressions", "--scenario", "ag-cp2-padding-rank"]
    parent = export_commit(repo, f"{PR_2123}~1", tmp_path / "parent")
    own = run_cli("run", "--target", "slime", "--target-src", parent, "--target-opt", "layout=shardcheck", *scenario)
    assert own.returncode == 0, own.stdout[-2000:]
    framework = run_cli("run", "--target", "slime", "--target-src", parent, *scenario)
    assert framework.returncode == 1 and "collective_mismatch in backward" in framework.stdout, framework.stdout
    fixed = run_cli("run", "--target", "slime", "--target-src", export_commit(repo, PR_2123, tmp_path / "fix"),
                    *scenario)
    assert fixed.returncode == 0, fixed.stdout[-2000:]


@needs_slime_history
@pytest.mark.world
def test_a_repro_script_runs_slimes_get_batch_and_shows_the_hang_only_it_reaches(tmp_path):
    """`shardcheck repro` for #2123's hang: the script lays the rows out as get_batch did in the run
    (from the report, or from a run of its own: the same rows) and runs get_batch again on the real
    tokens, checking they land there; at the parent it finds rank 1's backward all-reduce alone,
    pointed at the fix it finds nothing."""
    repo = os.environ[REPO_ENV]
    parent = export_commit(repo, f"{PR_2123}~1", tmp_path / "parent")
    scenario = ["--suite", "regressions", "--scenario", "ag-cp2-padding-rank"]
    run_cli("run", "--target", "slime", "--target-src", parent, *scenario, "--json-report", str(tmp_path / "r.json"))
    from_report, from_target = tmp_path / "a.py", tmp_path / "b.py"
    made = [run_cli("repro", "--report", str(tmp_path / "r.json"), "--scenario", "ag-cp2-padding-rank", "--out",
                    str(from_report)),
            run_cli("repro", "--target", "slime", "--target-src", parent, *scenario, "--out", str(from_target))]
    assert [m.returncode for m in made] == [0, 0], [m.stderr for m in made]
    case = [path.read_text().split("CASE = {")[1].split("\n}\n")[0] for path in (from_report, from_target)]
    assert case[0] == case[1] and '"data_path": "slime/backends/megatron_utils/data.py:get_batch"' in case[0]
    assert '"pieces": [[1, 128, 256]]' in case[0]  # CP rank 1: only get_batch's padding
    python = torch_only_python(tmp_path)
    run = lambda *extra: subprocess.run([python, str(from_report), *extra], capture_output=True, text=True,  # noqa: E731
                                        timeout=180, cwd=tmp_path)
    before, after = run(), run("--src", export_commit(repo, PR_2123, tmp_path / "fix"))
    assert before.returncode == 1 and "collective mismatch in group [0, 1]" in before.stdout, before.stdout
    assert "rank 0 made no call; rank 1 issued all_reduce(SUM) [[50]] in backward" in before.stdout
    assert after.returncode == 0 and after.stdout.startswith("NOT FOUND"), after.stdout + after.stderr


@needs_slime_history
@pytest.mark.world
def test_a_rank_whose_loss_misses_its_logits_hangs_the_models_backward(tmp_path):
    """Before PR #1678 slime's loss_function had no loss + 0 * logits.sum(): a CP rank holding
    only padding (get_batch's) has a loss that does not reach its logits, so in the training step
    the model's CP collective in backward runs on the other rank alone, while this one has gone on
    to DDP's gradient all-reduce. At the fix that is gone (what is left at that commit is
    megatron-core's fused cross entropy rounding the gradient to bfloat16)."""
    repo = os.environ[REPO_ENV]
    scenario = ["--suite", "regressions", "--scenario", "ag-cp2-padding-rank", "--json-report"]
    parent = run_cli("run", "--target", "slime:loss", "--target-src",
                     export_commit(repo, f"{PR_1678}~1", tmp_path / "parent"), *scenario, str(tmp_path / "p.json"))
    [v] = json.loads((tmp_path / "p.json").read_text())["scenarios"]
    assert parent.returncode == 1 and v["kinds"] == ["collective_mismatch"], parent.stdout[-2000:]
    message = v["failures"][0]["message"]
    assert "rank 0 waits in cp call 4 all_reduce(SUM, float32[1]) in backward" in message, message
    assert "megatron/core/distributed/distributed_data_parallel.py" in message, message
    run_cli("run", "--target", "slime:loss", "--target-src", export_commit(repo, PR_1678, tmp_path / "fix"),
            *scenario, str(tmp_path / "f.json"))
    [v] = json.loads((tmp_path / "f.json").read_text())["scenarios"]
    assert "collective_mismatch" not in v["kinds"], v["kinds"]


PR_1822 = "2928bba9d"  # "Revert no_grad for entropy to prevent comm stuck in dsa": None entropy of an empty slice


@needs_slime
@needs_slime_history
def test_a_repro_script_shows_a_slime_bug_with_torch_and_slime_alone(tmp_path):
    """`shardcheck repro` at the parent of #1822 (shardcheck's rows, whose all-gather slices are
    empty on a rank): the script, run where shardcheck is not installed, finds the None entropy's
    crash in slime's loss.py; pointed at the newest checkout it finds nothing. At the fix itself it
    finds the next bug of that era (#1846's hang in backward), as shardcheck does."""
    repo = os.environ[REPO_ENV]
    script = tmp_path / "repro.py"
    made = run_cli("repro", "--target", "slime", "--target-src", export_commit(repo, f"{PR_1822}~1", tmp_path / "p"),
                   "--target-opt", "layout=shardcheck", "--suite", "regressions", "--scenario", "ag-empty-local-slices",
                   "--out", str(script))
    assert made.returncode == 0, made.stderr
    assert script.read_text().count("\n") < 300
    python = torch_only_python(tmp_path)
    run = lambda *extra: subprocess.run([python, str(script), *extra], capture_output=True, text=True,  # noqa: E731
                                        timeout=180, cwd=tmp_path)
    parent, newest, fix = run(), run("--src", SLIME_SRC), run("--src", export_commit(repo, PR_1822, tmp_path / "f"))
    assert parent.returncode == 1, parent.stdout + parent.stderr
    assert "raised AttributeError: 'NoneType' object has no attribute 'dtype'" in parent.stdout, parent.stdout
    assert "slime/backends/megatron_utils/loss.py" in parent.stdout
    assert newest.returncode == 0 and newest.stdout.startswith("NOT FOUND"), newest.stdout + newest.stderr
    assert fix.returncode == 1 and "collective mismatch" in fix.stdout and "in backward" in fix.stdout, fix.stdout


@needs_slime
@pytest.mark.world
@pytest.mark.parametrize("per_token", ["false", "true"])
def test_slimes_loss_function_passes_the_training_step_in_both_reductions(tmp_path, per_token):
    """slime:loss in megatron-core's schedule and DDP, on get_batch's micro-batches: dp 2, up to three
    micro-batches, cp 4, a token budget; sample mean (slime's default) and token mean: the gradient
    the optimizer sees is right (the mask-leak check off: test_slimes_loss_lets_nan_at_masked_positions_in)."""
    report = tmp_path / "r.json"
    proc = run_cli("run", "--target", "slime:loss", "--suite", "training", "--target-opt",
                   f"calculate_per_token_loss={per_token}", "--json-report", str(report), "--no-mask-leak")
    assert proc.returncode == 0, proc.stdout[-3000:]
    doc = json.loads(report.read_text())
    ran = [v for v in doc["scenarios"] if v["verdict"] == "pass"]
    assert len(ran) >= 7, [(v["name"], v["verdict"], v.get("reason")) for v in doc["scenarios"]]
    objective = doc["target"]["definitions"]["objective"]
    assert f"calculate_per_token_loss={per_token}" in objective, objective
    # and the loss train_one_step logs (its reduce_train_step_metrics) is the objective's value
    step = doc["target"]["training_step"]
    assert step["logged_loss"].startswith("compared"), step
    # the global batch split by slime's own build_dp_schedule
    assert step["split"] == "slime:loss's split_batch", step
    assert doc["target"]["batch_split"].startswith("build_dp_schedule"), doc["target"]


@needs_slime
def test_slime_splits_the_steps_global_batch_with_its_own_build_dp_schedule():
    """slime packs the whole step first (first fit, bins of max_tokens_per_gpu x cp tokens), then
    deals the bins out round-robin: at a budget of 30, lengths 23 10 17 30 5 8 make the bins
    [0 4] [1 2] [3] [5], so replica 0 runs [0 4] then [3] (megatron's rule would give it 0 1 2).
    A budget slime cannot hand over (not a multiple of cp) skips the scenario, saying why."""
    from shardcheck.scenarios import Sample
    from shardcheck.targets.base import step_batches, step_skip_reason
    from shardcheck.targets.slime import SlimeLossTarget

    target = SlimeLossTarget(SLIME_SRC)
    sc = Scenario("split", [Sample(t, 4) for t in (23, 10, 17, 30, 5, 8)], vocab=16, dp=2, micro_batch_tokens=30)
    assert step_batches(target, sc) == ([[(0, 4), (3,)], [(1, 2), (5,)]], "slime:loss's split_batch")
    assert sc.micro_batches(0) != [(0, 4), (3,)]
    odd = Scenario("odd", [Sample(t, 4) for t in (23, 10, 17, 30)], vocab=16, dp=2, cp=2, layout="zigzag",
                   micro_batch_tokens=61)
    assert step_skip_reason(target, odd) == ("slime:loss cannot split this global batch: slime's token budget is "
                                             "--max-tokens-per-gpu x cp: micro_batch_tokens 61 is not a multiple of "
                                             "cp 2")


@needs_slime
@pytest.mark.world
def test_slimes_loss_lets_nan_at_masked_positions_in(tmp_path):
    """A finding at 624b824a8, latent: slime's get_sum_of_sample_mean multiplies by the loss mask
    ((x_i * loss_mask_i).sum()), so NaN at a masked token (its log-prob, advantage or old log-prob)
    makes the loss NaN; so does loss + 0 * logits.sum() under all-gather CP for a NaN in a
    padding row. slime's own rollouts give finite values there, so its callers do not hit it."""
    proc = run_cli("run", "--target", "slime:loss", "--suite", "training", "--scenario", "step-thd-dp4")
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert ("mask_leak [ranks 0]: NaN at the masked positions of the logits and advantages and old_log_probs "
            "reached the loss of micro-batch 0") in proc.stdout, proc.stdout[-3000:]


PR_990 = "f9f00b2cb"  # "Fix per token loss scale": loss_function's per-token loss * cp_size
PR_987 = "763f18d5b"  # "fix scaling of per token loss": the sample mean's rescale kept off the per-token loss


@needs_slime_history
@pytest.mark.world
def test_the_per_token_loss_scale_slime_fixed_twice(tmp_path):
    """With calculate_per_token_loss, slime's loss_function first applied the sample mean's rescale
    (num_microbatches / global_batch_size * dp_cp) to the per-token loss too (fixed in #987), then
    lacked the CP factor that cancels megatron's count over the CP ranks (fixed in #990). At cp 4
    with two micro-batches of two samples, the gradient the optimizer sees is x 0.5, then x 0.25
    (= 1 / cp), then at the declared scale. What is left at #990 is that era's other finding, known
    before this check: megatron-core's fused cross entropy rounds the gradient to bfloat16 (0.2 %);
    the newest slime passes (test_slimes_loss_function_passes_the_training_step_in_both_reductions)."""
    repo = os.environ[REPO_ENV]
    scenario = ["--suite", "training", "--scenario", "step-zigzag-cp4-mb2", "--target-opt",
                "calculate_per_token_loss=true"]
    said = {}
    for name, rev in (("before 987", f"{PR_987}~1"), ("before 990", f"{PR_990}~1"), ("990", PR_990)):
        src = export_commit(repo, rev, tmp_path / name.replace(" ", "-"))
        proc = run_cli("run", "--target", "slime:loss", "--target-src", src, *scenario)
        assert proc.returncode == 1, proc.stdout[-3000:]
        said[name] = next(line for line in proc.stdout.splitlines() if line.startswith("  grad_mismatch"))
    assert "is x 0.500 the reference's on every row" in said["before 987"], said
    assert "is x 0.250 the reference's on every row (= 1 / cp)" in said["before 990"], said
    assert "has the declared token_mean's scale (x 1.000 on every row)" in said["990"], said
    assert all("beyond that its elements differ by up to 0.2" in line for line in said.values()), said


@needs_slime
@pytest.mark.world
def test_coverage_of_slimes_loss_names_the_entry_point_the_schedule_and_ddp(tmp_path):
    report = tmp_path / "r.json"
    proc = run_cli("run", "--target", "slime:loss", "--suite", "training", "--scenario", "step-thd-dp2-mb3",
                   "--coverage", "--no-mask-leak", "--json-report", str(report))
    assert proc.returncode == 0, proc.stdout[-3000:]
    files = json.loads(report.read_text())["coverage"]["files"]
    ran = {name for f in files.values() for name in f["functions"]}
    for name in ("slime/backends/megatron_utils/loss.py:loss_function",
                 "slime/observability/train_metric_utils.py:reduce_train_step_metrics",
                 "slime/utils/dp_schedule.py:build_dp_schedule",
                 "megatron-core/megatron/core/pipeline_parallel/schedules.py:forward_backward_no_pipelining",
                 "megatron-core/megatron/core/distributed/finalize_model_grads.py:finalize_model_grads",
                 "megatron-core/megatron/core/distributed/param_and_grad_buffer.py:_ParamAndGradBucketGroup."
                 "finish_grad_sync"):
        assert name in ran, sorted(ran)


@needs_slime_history
@pytest.mark.world
def test_slime_loss_takes_loss_function_from_the_module_it_records_in(tmp_path):
    """Harness noise the sweep found (docs/slime.md, "A sweep of slime's history"): at f27ef35c9
    (#2184; until e593fa0a0, #2216) get_batch's data path imports slime's loss module anew, and the
    adapter took loss_function from that fresh module while its recorder sat on the one it had
    imported first: in a suite's world every scenario but the last raised "called
    get_log_probs_and_entropy 0 times". The regressions suite in one world now shows slime's own
    findings only (mask_leak: its loss multiplies by the mask), no rank_error."""
    src = export_commit(os.environ[REPO_ENV], "f27ef35c99", tmp_path / "slime")
    res = run_cli("run", "--target", "slime:loss", "--target-src", src, "--suite", "regressions",
                  "--json-report", str(tmp_path / "r.json"))
    kinds = {f["kind"] for sc in json.loads((tmp_path / "r.json").read_text())["scenarios"]
             for f in sc.get("failures", [])}
    assert kinds == {"mask_leak"}, res.stdout[-3000:]


# slime:loss's eras the sweep found the adapter did not model (docs/slime.md, "A sweep of slime's
# history"): each runs now, showing slime's own findings, or is refused as an era not modelled
ERAS = {
    "e0be9a075": None,  # policy_loss_func, no loss_function: cannot run
    "fcbc9972c": {"grad_mismatch", "input_mutated"},  # its loss a sum of sample means (x samples), fixed by
    # 2ad9627a2 "bugfix"; the in-place temperature of the day (#214)
    "067d65a4a": {"grad_mismatch"},  # #179's enable_off_policy_correction read (megatron's bfloat16 gradient)
    "2f4bd0d88": {"grad_mismatch"},  # #1926's build_dp_schedule (helpers inline, no rollout_indices)
    "a3c5462a7": {"grad_mismatch"},  # #1984's group_indices and group_mask_sums
}


@needs_slime_history
@pytest.mark.world
@pytest.mark.parametrize("commit", list(ERAS))
def test_slime_loss_runs_each_era_or_says_it_cannot(commit, tmp_path):
    src = export_commit(os.environ[REPO_ENV], commit, tmp_path / "slime")
    res = run_cli("run", "--target", "slime:loss", "--target-src", src, "--suite", "regressions", "--scenario",
                  "thd-tp2-chunks", "--no-mask-leak", "--json-report", str(tmp_path / "r.json"))
    if ERAS[commit] is None:
        assert res.returncode == 2 and "has no policy_loss_function" in res.stderr, res.stderr
        return
    kinds = {f["kind"] for sc in json.loads((tmp_path / "r.json").read_text())["scenarios"]
             for f in sc.get("failures", [])}
    assert kinds == ERAS[commit], res.stdout[-3000:]
