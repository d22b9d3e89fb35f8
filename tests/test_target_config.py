"""One way to configure any target (``--target-src DIR``, ``--target-opt KEY=VALUE``), the
public helpers that give an adapter its labels and scored rows, and a target without parallel
code (tp 1, cp 1) finding something to check in every built-in suite."""

import pytest

from shardcheck.errors import BadInput
from shardcheck.harness.controller.commands import runner
from shardcheck.harness.controller.reports.run_report import SilentReport
from shardcheck.scenarios import SUITES, get_suite
from shardcheck.targets import TargetConfig, resolve
from shardcheck.targets.base import OPTS_ENV


def test_options_reach_a_factory_that_takes_config_and_unknown_keys_are_refused(tmp_path):
    target = resolve("plants:one_device", TargetConfig(str(tmp_path), (("entropy", "false"),)))
    assert target.describe()["src"] == str(tmp_path) and not target.capabilities.entropy
    with pytest.raises(BadInput, match=r"has no option 'entropie' \(known: entropy, shift_labels\)"):
        resolve("plants:one_device", TargetConfig(None, (("entropie", "false"),)))
    with pytest.raises(BadInput, match="target 'builtin' takes no --target-src or --target-opt"):
        resolve("builtin", TargetConfig(str(tmp_path), (("x", "1"),)))
    with pytest.raises(BadInput, match=r"could not be built: ValueError: option entropy='maybe'"):
        resolve("plants:one_device", TargetConfig(None, (("entropy", "maybe"),)))


def test_the_config_travels_in_the_environment(tmp_path):
    config = TargetConfig(str(tmp_path), (("a", "1"), ("b", "x=y")))
    assert TargetConfig.from_environment(config.to_environment()) == config
    assert TargetConfig.from_environment({}) == TargetConfig()
    with pytest.raises(ValueError, match=f"{OPTS_ENV} is not a JSON list"):
        TargetConfig.from_environment({OPTS_ENV: "{"})


@pytest.mark.parametrize("args, fragment", [
    (["--target", "plants:one_device", "--target-opt", "nope=1"], "has no option 'nope'"),
    (["--target", "builtin", "--target-opt", "x=1"], "target 'builtin' takes no --target-opt"),
    (["--target", "plants:one_device", "--target-opt", "novalue"], "expected KEY=VALUE, got 'novalue'"),
    (["--target", "plants:one_device", "--target-src", "/no/such/dir"], "--target-src '/no/such/dir' is not a directory"),
])
def test_bad_target_options_are_one_line_and_exit_2(cli_in_process, args, fragment):
    result = cli_in_process("run", "--suite", "regressions", *args)
    assert result.returncode == 2 and fragment in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.world
def test_a_one_device_target_has_something_to_check_in_every_suite(world, monkeypatch):
    """tp 1, cp 1, thd and bshd, no replay: each built-in suite has a scenario it runs (but the
    training suite, whose every scenario is a training step: not a loss of this target's, and the
    sequence_parallel suite, whose every scenario is an sp layout); the rest are skipped with the
    target's reasons. The same target with its labels a row late fails."""
    monkeypatch.setenv(OPTS_ENV, '[["entropy", "true"]]')
    runs = {name: runner.run(get_suite(name), "plants:one_device", reporter=SilentReport(), world=world).verdicts
            for name in sorted(SUITES)}
    for name, verdicts in runs.items():
        passed = [v for v in verdicts if v.status == "pass"]
        if name == "training":
            assert all(v.status == "skip" and "a training step" in v.reason for v in verdicts)
            continue
        if name == "sequence_parallel":
            assert all(v.status == "skip" and "not supported (supports bshd, thd)" in v.reason for v in verdicts)
            continue
        assert passed and all(v.status != "fail" for v in verdicts), (name, [v.headline() for v in verdicts])
    reasons = {v.reason for verdicts in runs.values() for v in verdicts if v.status == "skip"}
    assert "no vocab-parallel code: one device's logits" in reasons
    monkeypatch.setenv(OPTS_ENV, '[["shift_labels", "true"]]')
    [v] = runner.run([s for s in get_suite("regressions") if s.name == "thd-one-device-edges"],
                     "plants:one_device", reporter=SilentReport(), world=world).verdicts
    assert v.status == "fail" and "value_mismatch" in v.kinds, v.headline()


def test_the_helpers_give_each_rank_its_labels_and_rows():
    """held_rows, scored_rows and row_labels against the layout, all-gather CP included."""
    import torch

    from shardcheck.scenarios.layout import rank_layout
    from shardcheck.scenarios import Sample, Scenario
    from shardcheck.targets import RankInputs

    sc = Scenario("h", (Sample(9, 4), Sample(6, 5)), vocab=8, cp=2, layout="allgather")
    tokens = [torch.arange(9) + 100, torch.arange(6) + 200]
    for cp_rank in range(2):
        layout = rank_layout(sc, 0, cp_rank)
        inputs = RankInputs(torch.zeros(layout.shape), tokens, [9, 6], [4, 5], "allgather", False, 0.0, 1.0, -1,
                            None, None, None, 0, 1, cp_rank, 2, rank_layout=layout)
        labels = inputs.row_labels()
        assert inputs.scored_rows() is None  # all-gather: the share is scored elsewhere
        for i, (rows, js) in enumerate(inputs.held_rows()):
            prompt = sc.samples[i].prompt
            assert labels[rows].tolist() == [int(tokens[i][prompt + j]) for j in js.tolist()]
        assert sum(len(js) for _, js in inputs.held_rows()) > 0
