"""Messages that point the right way (issue 23, item 5): the in-place write named is the one
that changed the tensor, values read differently when they differ, every command takes the
same check switches, and a detached output is named where it left the graph, as a graph problem.

Each test failed on the main of its commit; the project lead folds them into the fault matrix."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import plants
from shardcheck.cli import build_parser
from shardcheck.harness.controller import fuzz, runner
from shardcheck.harness.controller.report import SilentReport
from shardcheck.scenarios import Sample, Scenario

SC = Scenario("m", (Sample(9, 5), Sample(6, 3)), vocab=16, tp=2, entropy_coef=0.1, seed=3)


def _line_of(obj, text: str) -> str:
    """``tests/plants.py:LINE`` of the first line of ``obj``'s source holding ``text``."""
    lines, first = inspect.getsourcelines(obj)
    k = next(i for i, ln in enumerate(lines) if text in ln)
    return f"plants.py:{first + k}"


def _shown(message: str) -> tuple[str, str, str]:
    """(was, now, what follows) as an input_mutated message writes them."""
    inside = message.split("(was ", 1)[1]
    was, rest = inside.split(", now ", 1)
    now, rest = rest.split(" ", 1)
    return was, now, rest


# -- input_mutated: the write that changed it, and values that read apart ---------------------------
@pytest.mark.world
def test_the_write_named_is_the_backward_one_that_changed_the_logits_not_a_division_by_one(world):
    """verl's engine divides the logits by a temperature of 1.0 in place (no bit changes), then
    its entropy backward changes them: the message named the division. Here two no-op divisions
    in the forward, then a one-ulp write in the backward."""
    [v] = runner.run([SC], "plants:NoOpWritesThenOneUlpInBackward", reporter=SilentReport(), world=world).verdicts
    assert v.kinds == ["input_mutated"], [f.message for f in v.failures]  # values and gradients are right
    changed_at = _line_of(plants._NudgesSavedLogitsInBackward, "the planted write")
    noops = [_line_of(plants.NoOpWritesThenOneUlpInBackward, "first no-op"),
             _line_of(plants.NoOpWritesThenOneUlpInBackward, "the second")]
    for f in v.failures:
        assert (f.field, f.phase, f.details["write_phase"]) == ("logits", "backward", "backward")
        assert f.details["op"] == "aten.copy_.default" and f.details["site"][0].endswith(changed_at), f.details
        assert f.details["changed"] == 1 and f.details["unchanged_writes"] == 2
        said = f.message.split("; ", 1)[1]
        assert said.startswith(f"first in-place write that changed it: aten.copy_.default at tests/{changed_at} "
                               "in backward; 2 earlier in-place writes left it unchanged: aten.div_."), f.message
        assert all(f"tests/{line} in forward" in said for line in noops), f.message
        # one ulp up, in float32: read apart, each as its own float32
        assert np.nextafter(np.float32(f.want), np.float32(np.inf)) == np.float32(f.got)
        was, now, rest = _shown(f.message)
        assert was != now and rest.startswith("(1 ulp of float32))"), f.message
        assert (np.float32(float(was)), np.float32(float(now))) == (np.float32(f.want), np.float32(f.got))


# -- the check switches on every command ---------------------------------------------------------------
@pytest.mark.parametrize("command", [["fuzz"], ["simulate"], ["invariance"]])
def test_every_command_that_checks_a_target_takes_no_inplace(command):
    args = build_parser().parse_args([*command, "--target", "builtin", "--no-inplace"])
    assert args.no_inplace is True


def test_the_replay_line_of_a_search_keeps_no_inplace():
    from shardcheck.cli import _target_args

    args = build_parser().parse_args(["fuzz", "--target", "builtin", "--no-inplace", "--target-opt", "a=b"])
    assert _target_args(args) == ["--no-inplace", "--target-opt", "a=b"]


@pytest.mark.world
def test_fuzz_without_the_input_check_looks_past_a_known_write_and_finds_the_wrong_value(world):
    """The plant scales the gradient fed into its log-probs in place in every scenario, and is wrong
    at sample 1 token 3 only. With the input check the search stops at the first scenario drawn;
    without it, it finds the value. (About 20 s: a search, then its shrinking.)"""
    common = dict(max_examples=25, seed=2, tp=(1,), cp=(1,), layouts=["thd"], world=world, database=None,
                  max_shrinks=8)
    blind = fuzz.fuzz("plants:GradScaledInPlaceAndCorruptValue", inplace=False, **common)
    assert blind.failure is not None and "input_mutated" not in blind.failure.kinds
    assert "value_mismatch" in blind.failure.kinds and blind.searched > 1, blind.failure.headline()
    seeing = fuzz.fuzz("plants:GradScaledInPlaceAndCorruptValue", **dict(common, max_examples=1, max_shrinks=0))
    assert seeing.searched == 1 and "input_mutated" in seeing.failure.kinds


@pytest.mark.world
def test_simulate_without_the_input_check_passes_a_target_known_to_write_into_its_logits(tmp_path, monkeypatch):
    """``shardcheck simulate --scenario-file F --no-inplace`` through ``main``, on its fake world."""
    from shardcheck.cli import main

    monkeypatch.chdir(tmp_path)
    sc = dict(SC.to_dict(), temperature=0.9)
    (tmp_path / "s.json").write_text(json.dumps([sc]))
    argv = ["simulate", "--target", "builtin:inplace_temperature", "--scenario-file", "s.json", "-q"]
    assert main(argv) == 1  # input_mutated: it divides the logits it is given by 0.9
    assert main([*argv, "--no-inplace"]) == 0  # its values, gradients and collectives are right


@pytest.mark.world
def test_the_pytest_session_takes_the_switch_to_its_runs(world):
    from shardcheck.pytest_plugin import ShardcheckSession

    sc = Scenario.from_dict(dict(SC.to_dict(), temperature=0.9))
    assert ShardcheckSession(world, "builtin:inplace_temperature").run(sc).kinds == ["input_mutated"]
    assert ShardcheckSession(world, "builtin:inplace_temperature", inplace=False).run(sc).status == "pass"


def test_the_pytest_plugin_offers_the_switch():
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--help"], capture_output=True,
                          text=True, cwd="/", env=env, timeout=120)
    assert "--shardcheck-no-inplace" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]


# -- a detached output: where it left the graph, as a graph problem -------------------------------------
@pytest.mark.world
def test_a_detached_entropy_names_the_line_that_cut_it_not_the_adapters_compute(world):
    """The entropy is made under torch.no_grad() in a function of the target's (the framework's):
    that function's line is named, the values are said to be right, and no value is called wrong."""
    [v] = runner.run([SC], "plants:EntropyLeftGraphInFramework", reporter=SilentReport(), world=world).verdicts
    [head] = [f for f in v.failures if f.field == "entropy"]
    cut = _line_of(plants._framework_entropy_for_logging, "the planted cut")
    assert head.details["malformed"] == "detached" and head.details["graph_op"] == "Tensor.clone"
    assert head.message.startswith("entropy of sample 0 does not require grad"), head.message
    assert (f"a problem of the autograd graph, not of the values): it left the graph at tests/{cut} in "
            "_framework_entropy_for_logging") in head.message
    assert "(Tensor.clone under torch.no_grad())" in head.message
    assert head.message.endswith("; its values match the reference"), head.message
    compute = _line_of(plants.EntropyLeftGraphInFramework, "def compute")
    assert f"tests/{compute}" not in head.message  # the adapter's compute is where it was called from, not the cut
    # the values are right: what else fails is the gradient the entropy term should have carried
    assert set(v.kinds) == {"value_mismatch", "grad_mismatch"}
    assert [f for f in v.failures if f.kind == "value_mismatch" and "malformed" not in f.details] == []


@pytest.mark.world
def test_a_detach_in_compute_is_named_at_its_line(world):
    [v] = runner.run([SC], "plants:DetachedOutputs", reporter=SilentReport(), world=world).verdicts
    [head] = [f for f in v.failures if f.details.get("malformed") == "detached"]
    line = _line_of(plants.DetachedOutputs, "e.detach()")
    assert f"it left the graph at tests/{line} in compute" in head.message and "(Tensor.detach)" in head.message


# -- the real cases, on a framework checkout -------------------------------------------------------------
VERL_SRC = os.environ.get("SHARDCHECK_VERL_SRC")


@pytest.mark.world
@pytest.mark.skipif(not VERL_SRC, reason="SHARDCHECK_VERL_SRC is not set: no verl checkout to check")
def test_verls_division_by_a_temperature_of_one_is_not_named_for_its_entropy_backwards_write(world, tmp_path):
    """verl's engine divides the logits by the temperature in place (1.0: nothing changes), then
    _VocabParallelEntropy.backward subtracts from and adds back to them, not exactly. The write
    named is the backward's in tensor_parallel.py; the division is counted as harmless. (Slow:
    the ranks import verl and megatron-core.)"""
    from shardcheck.targets.verl import detect_era, source

    era = detect_era(source())
    if "engine" not in era["call_sites"]:
        pytest.skip("this verl commit has no engine call site (the temperature division in place)")
    sc = Scenario("verl-t1", (Sample(9, 5), Sample(6, 3)), vocab=32, entropy_coef=0.1, temperature=1.0, seed=5)
    [v] = runner.run([sc], "shardcheck.targets.verl:VerlActorTarget", reporter=SilentReport(), world=world).verdicts
    found = [f for f in v.failures if f.kind == "input_mutated" and f.field == "logits"]
    assert found, v.headline()
    for f in found:
        assert f.phase == "backward" and f.details["write_phase"] == "backward", f.message
        assert "tensor_parallel.py" in f.details["site"][0], f.details
        assert f.details["unchanged_writes"] >= 1 and "aten.div_" in f.details["unchanged"][0], f.details
        assert "transformer_impl.py" in f.details["unchanged"][0]
        was, now, _ = _shown(f.message)
        assert was != now, f.message
