"""The collective trace and the lockstep check, on one shared 4-rank gloo world.

Over 20 s: every mutant runs the scenarios of its suite up to the first that shows it (30 tests).
"""

import pytest

from plants import ROUTES
from shardcheck.harness.controller.commands import runner
from shardcheck.harness.controller.reports.run_report import SilentReport
from shardcheck.scenarios import Sample, Scenario, get_suite
from shardcheck.targets.mutants import MUTANTS

pytestmark = pytest.mark.world


def _run(world, target, scenarios):
    return runner.run(scenarios, target, reporter=SilentReport(), world=world)


def test_builtin_passes_the_regressions(world):
    result = _run(world, "builtin", get_suite("regressions"))
    assert result.exit_code == 0, [v.headline() for v in result.verdicts]


@pytest.mark.parametrize("name", sorted(n for n, cls in MUTANTS.items() if cls.found_by == "run"))
def test_every_mutant_is_caught_with_its_kind_and_phase(world, name):
    """The mutant's suite, scenario by scenario, up to the first that shows its kind in its phase
    (the scenarios after it would add time, not evidence)."""
    starts = len(world.startup_seconds)
    kind, phase = MUTANTS[name].expected
    verdicts = []
    for sc in get_suite(MUTANTS[name].suite):
        result = _run(world, f"builtin:{name}", [sc])
        verdicts += result.verdicts
        found = [f for v in result.verdicts for f in v.failures if f.kind == kind and f.phase == phase]
        if found:
            break
    assert found and result.exit_code == 1, {v.scenario.name: [(f.kind, f.phase) for f in v.failures] for v in verdicts}
    if kind == "collective_mismatch":
        for f in found:  # reported within a second of the divergent call
            assert f.details["reported_after_s"] < 1.0, f.details
        # and no rank went on into the backend to wait out its timeout there
        stuck = [(v.scenario.name, f.message) for v in verdicts for f in v.failures
                 if f.kind in ("rank_error", "timeout")]
        assert not stuck and max(v.seconds for v in verdicts) < 5, stuck
        # the mismatched call was never issued: the world goes on without a restart
        assert len(world.startup_seconds) == starts
    if phase == "backward":  # explained in anomaly mode, whose notice is the harness's, not the ranks' output
        assert not any("Anomaly Detection" in line for line, _ in world.rank_output()), world.rank_output()


def test_same_shape_skip_is_caught_at_the_skipped_call(world):
    """gloo would pair rank 1's entropy all-gather with rank 0's sum-of-exp one (same shape, same
    op): the call stack in the fingerprint tells them apart, at the first divergent call."""
    sc = get_suite("regressions")[2]
    [v] = _run(world, "builtin:skip_same_shape_allgather", [sc]).verdicts
    f = v.failures[0]
    assert f.kind == "collective_mismatch" and f.phase == "forward"
    assert f.details["call"] == 2 and "differ in stack" in f.message, f.message
    assert "tp group" in f.message


def test_reduce_op_swap_is_caught(world):
    sc = get_suite("regressions")[2]
    [v] = _run(world, "builtin:reduce_op_swap", [sc]).verdicts
    f = v.failures[0]
    assert f.kind == "collective_mismatch" and f.details["call"] == 0
    assert "all_reduce(MAX" in f.message and "all_reduce(SUM" in f.message and "differ in reduce_op" in f.message


TP2 = Scenario("tp2", (Sample(11, 4), Sample(7, 3)), vocab=16, tp=2, entropy_coef=0.1, seed=5)


@pytest.mark.parametrize("phase", ["forward", "backward"])
@pytest.mark.parametrize("route", ROUTES)
def test_one_extra_call_on_one_rank_is_caught_through_every_route(world, route, phase):
    [v] = _run(world, f"plants:extra_{route}_{phase}", [TP2]).verdicts
    assert v.status == "fail"
    f = v.failures[0]
    assert f.kind == "collective_mismatch", [x.message for x in v.failures]
    assert f.phase == phase
    # the call site of the extra call: the first frame outside torch and shardcheck
    site = "megatron/core/tensor_parallel/mappings.py" if route == "megatron" else "plants.py"
    assert site in f.message, f.message
    assert f.details["reported_after_s"] < 1.0


def test_a_rank_that_raises_is_named_with_where_its_peers_wait(world):
    sc = Scenario("ag", (Sample(11, 4), Sample(19, 9)), vocab=16, cp=2, layout="allgather", seed=3)
    starts = len(world.startup_seconds)
    result = _run(world, "plants:RaiseOnCpRank1", [sc])
    assert result.info.target.get("seen_on_a_rank"), "a failed run still reports the ranks' description"
    [v] = result.verdicts
    f = v.failures[0]
    assert f.kind == "rank_error"
    assert "planted failure on cp rank 1" in f.message and "plants.py" in f.message
    assert "was waiting in all_reduce" in f.message and "builtin.py" in f.message
    assert len(world.startup_seconds) == starts  # nothing half-issued: no restart needed


def test_a_rank_that_dies_is_named_and_the_world_restarts(world):
    sc = Scenario("ag", (Sample(11, 4), Sample(19, 9)), vocab=16, cp=2, layout="allgather", seed=3)
    starts = len(world.startup_seconds)
    [v] = _run(world, "plants:DieOnCpRank1", [sc]).verdicts
    messages = " | ".join(f.message for f in v.failures)
    assert v.failures[0].kind == "rank_error" and "died (exit code 3)" in messages, messages
    assert "was waiting in all_reduce" in messages, messages
    [after] = _run(world, "builtin", [sc]).verdicts
    assert after.status == "pass" and len(world.startup_seconds) == starts + 1


def test_the_trace_sees_every_route_in_forward_and_backward(world):
    """Every route reaches the one interception point, with the right op, group and phase; and the
    lockstep check passes them all (no false positive on uneven or point-to-point calls)."""
    result = runner.run([TP2], "plants:AllRoutes", reporter=SilentReport(), world=world, trace=True)
    [v] = result.verdicts
    assert v.status == "pass", v.headline()
    calls = v.traces[0]
    seen = {(c["op"], c["phase"]) for c in calls if c["ranks"] == [0, 1]}
    for op in ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
               "all_to_all_single", "barrier", "send"):
        assert (op, "forward") in seen, (op, sorted(seen))
    assert ("recv", "forward") in {(c["op"], c["phase"]) for c in v.traces[1]}
    # functional collectives arrive as the coalesced ops
    assert ("all_gather_into_tensor_coalesced", "forward") in seen
    assert ("reduce_scatter_tensor_coalesced", "forward") in seen
    # backward: dist.nn's all_reduce, the autograd functional all-gather (a reduce-scatter), and
    # megatron's copy_to_tensor_model_parallel_region (an all-reduce)
    backward = [c for c in calls if c["phase"] == "backward"]
    assert {c["op"] for c in backward} >= {"all_reduce", "reduce_scatter_tensor_coalesced"}, backward
    assert len(backward) >= 3
    sites = {c["site"].split(":")[0] for c in calls}
    assert any(s.endswith("tests/plants.py") for s in sites), sites
    assert "megatron/core/tensor_parallel/mappings.py" in sites, sites
    assert not any("typing_extensions" in s for s in sites), sites  # a deprecation shim is no call site
    one = next(c for c in calls if c["op"] == "all_reduce" and c["phase"] == "forward")
    assert one["reduce_op"] == "SUM" and one["dtype"] == "float32" and one["shapes"] == [[4]]
    assert [c["number"] for c in calls if c["group"] == one["group"]][:3] == [0, 1, 2]


def test_no_frame_of_the_harness_is_named_as_a_call_site():
    """A call site is the first frame outside torch and the harness: every module of the harness,
    wherever its folder puts it (the rank's plumbing, the controller, and the harness's own modules
    below the targets), is passed over; a target's module is not."""
    from pathlib import Path

    import shardcheck
    from shardcheck.harness.rank.plumbing import trace
    from shardcheck.targets import builtin

    root = Path(shardcheck.__file__).resolve().parent.parent
    own = [*(root / "harness").rglob("*.py"), root / "shardcheck" / "backend.py",
           root / "scenarios" / "traced_layout.py"]
    assert len(own) > 40
    missed = [str(p) for p in own if not str(p.resolve()).startswith(trace._SKIPPED)]
    assert not missed, missed
    assert not str(Path(builtin.__file__).resolve()).startswith(trace._SKIPPED)


def test_the_4_rank_world_holds_sp2_x_dp2_and_tp2_x_sp2_cells(world):
    """The sequence-parallel groups the builtin's Ulysses gather runs in, as the trace sees them: an
    sp 2 scenario in the 4-rank world is two data-parallel copies, sp groups [0, 1] and [2, 3]; tp 2
    x sp 2 takes the 4 ranks, TP fastest (tp groups [0, 1], [2, 3]; sp groups [0, 2], [1, 3]). Each
    gather is one all-to-all a field in forward and its transpose in backward."""
    suite = {sc.name: sc for sc in get_suite("sequence_parallel")}
    cells = [suite["ulysses-sp2-padded"], suite["ulysses-tp2-sp2-chunks"]]
    result = runner.run(cells, "builtin", reporter=SilentReport(), world=world, trace=True)
    assert result.exit_code == 0, [v.headline() for v in result.verdicts]
    for v, want in zip(result.verdicts, ([[0, 1], [2, 3]], [[0, 2], [1, 3]])):
        gathers = [(c["ranks"], c["phase"]) for trace in v.traces.values() for c in trace
                   if c["op"] == "all_to_all_single"]
        assert sorted({tuple(r) for r, _ in gathers}) == [tuple(g) for g in want], (v.scenario.name, gathers)
        assert {p for _, p in gathers} == {"forward", "backward"}
    tp_calls = {tuple(c["ranks"]) for trace in result.verdicts[1].traces.values() for c in trace
                if c["op"] != "all_to_all_single" and c["phase"] in ("forward", "backward")}
    assert tp_calls == {(0, 1), (2, 3)}, tp_calls
