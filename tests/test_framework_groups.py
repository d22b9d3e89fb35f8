"""The groups a framework's own code builds (its DeviceMesh), through ``RankInputs.framework_groups``:
built once per world and layout, checked against the harness's groups of the same role, labelled
by role in the trace (harness/rank/plumbing/groups.py: framework_groups)."""

from __future__ import annotations

from shardcheck.harness.controller.commands import runner
from shardcheck.harness.controller.reports.run_report import SilentReport
from shardcheck.scenarios import Sample, Scenario


def _sp2(name: str) -> Scenario:
    return Scenario(name=name, samples=[Sample(9, 4), Sample(6, 3)], vocab=16, layout="ulysses", sp=2)


def test_the_builtins_own_mesh_is_built_once_and_its_sp_calls_are_labelled(world):
    """sp 2 in the 4-rank world, twice: the builtin's init_device_mesh (dp, sp, tp) runs in the
    first scenario only (the set-up barrier and the lists' all-gather there, none in the second),
    and its Ulysses all-to-alls go to the mesh's sp groups [0, 1] and [2, 3]."""
    result = runner.run([_sp2("first"), _sp2("second")], "builtin", reporter=SilentReport(), world=world, trace=True)
    assert result.exit_code == 0, [v.headline() for v in result.verdicts]
    first, second = ([c for trace in v.traces.values() for c in trace] for v in result.verdicts)
    set_up = [c for c in first if c["phase"] == "framework groups set-up"]
    assert {c["op"] for c in set_up} >= {"barrier", "all_gather"} and len({tuple(c["ranks"]) for c in set_up}) == 1
    assert not [c for c in second if c["phase"] == "framework groups set-up"]
    gathers = {tuple(c["ranks"]) for c in first + second if c["op"] == "all_to_all_single"}
    assert gathers == {(0, 1), (2, 3)}, gathers


def test_a_mesh_whose_sp_groups_differ_from_the_harnesss_is_refused_on_every_rank(world):
    """A plant ordering its mesh (sp, dp, tp): sp groups [0, 2], [1, 3] where the harness's are
    [0, 1], [2, 3]. Every rank refuses alike, as the harness's error naming both lists, never as
    the target's finding; the builtin's own mesh passes the same scenario (above)."""
    result = runner.run([_sp2("strided")], "plants:SpMeshOutermost", reporter=SilentReport(), world=world)
    (verdict,) = result.verdicts
    kinds = {f.kind for f in verdict.failures}
    assert kinds == {"harness_error"}, verdict.headline()
    message = verdict.failures[0].message
    # the first role differing, dp or sp, names both lists ([0, 1] and [0, 2] either way round)
    assert "the framework's own" in message and "[0, 2]" in message and "[0, 1]" in message, message
    assert sorted(verdict.failures[0].ranks) == [0, 1, 2, 3], verdict.failures[0].ranks
