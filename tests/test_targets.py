"""Targets other than builtin: megatron-core's cross entropy, and a plugin of an earlier contract
(the example plugin and three earlier ones, installed as packages: tests/test_contract.py)."""

import pytest

from conftest import run_on_world, write_scenarios
from shardcheck.scenarios import Sample, Scenario, get_suite, load_scenario_file

pytestmark = pytest.mark.world


def _scenarios(layouts, with_entropy=True):
    out = []
    for layout, tp, cp in layouts:
        out.append(Scenario(f"{layout}-tp{tp}cp{cp}", (Sample(13, 5), Sample(9, 1), Sample(21, 12)), vocab=24,
                            tp=tp, cp=cp, layout=layout, with_entropy=with_entropy,
                            entropy_coef=0.1 if with_entropy else 0.0, temperature=0.7, seed=9))
    return out


def test_megatron_cross_entropy_passes_and_states_what_it_cannot_do(tmp_path, world):
    """On the session's four-rank world: the size `shardcheck run` starts for these scenarios."""
    scenarios = _scenarios([("thd", 2, 1), ("bshd", 2, 1), ("zigzag", 2, 2), ("allgather", 2, 2)], False)
    scenarios.append(Scenario("with-entropy", (Sample(9, 4),), vocab=8, tp=2, seed=1))
    f = write_scenarios(tmp_path / "s.json", scenarios)
    proc = run_on_world(world, load_scenario_file(f), "megatron", tmp_path / "r.json", str(f))
    assert proc.exit_code == 0, proc.stdout
    doc = proc.report
    by = {v["name"]: v for v in doc["scenarios"]}
    assert [by[n]["verdict"] for n in ("thd-tp2cp1", "bshd-tp2cp1", "zigzag-tp2cp2")] == ["pass"] * 3
    assert by["with-entropy"]["verdict"] == "skip" and "computes no entropy" in by["with-entropy"]["reason"]
    assert by["allgather-tp2cp2"]["verdict"] == "skip"
    assert doc["target"]["name"] == "megatron" and doc["target"]["version"]


class _LastMonthsTarget:
    """A plugin written against the contract before release() was added to it."""

    name = "last-month"

    def __init__(self):
        from shardcheck.targets import Capabilities

        self.capabilities = Capabilities(layouts=frozenset({"thd"}))

    def describe(self) -> dict:
        return {"name": self.name, "version": "0.0.1"}

    def compute(self, inputs):
        from shardcheck.targets.builtin import BuiltinTarget

        return BuiltinTarget().compute(inputs)


def last_months_target():
    return _LastMonthsTarget()


def test_a_target_written_before_release_existed_still_runs_with_a_notice(world):
    """`release()` joined the Target contract later; a plugin without it stopped every run ("does
    not provide ... release()", exit 2). It runs, passing, with one FutureWarning naming what it
    lacks (tests/test_contract.py runs plugins of three earlier contracts as installed packages)."""
    import warnings

    from shardcheck.harness.controller.commands import runner
    from shardcheck.harness.controller.reports.run_report import SilentReport
    from shardcheck.targets import resolve

    spec = "test_targets:last_months_target"
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert resolve(spec).name == "last-month"
        resolve(spec)  # once a spec and process
    notices = [w for w in said if issubclass(w.category, FutureWarning)]
    assert len(notices) == 1 and "defaults for release()" in str(notices[0].message), [str(w.message) for w in said]
    sc = [s for s in get_suite("smoke") if s.name == "thd-tp2cp1-basic"]
    result = runner.run(sc, spec, reporter=SilentReport(), world=world)
    assert result.exit_code == 0, [v.headline() for v in result.verdicts]
    result = runner.run(sc, "builtin", reporter=SilentReport(), world=world)  # the ranks move on from it
    assert result.exit_code == 0, [v.headline() for v in result.verdicts]
