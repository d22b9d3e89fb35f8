"""torch:loss_parallel, PyTorch's DTensor vocab-parallel cross entropy, on a DeviceMesh built from
each rank's real tensor-parallel group (gloo): the DTensor family's reference target. Its
backward runs inside loss_parallel() (the target's backward_context); a plant whose backward
runs outside it shows the harness is what puts it there."""

import pytest

from conftest import run_on_world
from shardcheck.scenarios import Sample, Scenario

pytestmark = pytest.mark.world


def _scenarios():
    samples = (Sample(13, 5), Sample(9, 1), Sample(21, 12), Sample(6, 5))
    out = [Scenario(f"{layout}-tp{tp}", samples, vocab=24, tp=tp, layout=layout, with_entropy=False,
                    entropy_coef=0.0, temperature=0.7, seed=5)
           for layout, tp in (("thd", 1), ("thd", 2), ("bshd", 4))]
    out.append(Scenario("with-entropy", (Sample(9, 4),), vocab=8, tp=2, seed=1))
    out.append(Scenario("zigzag-cp2", (Sample(9, 4),), vocab=8, tp=2, cp=2, layout="zigzag", with_entropy=False,
                        entropy_coef=0.0, seed=1))
    return out


def test_loss_parallel_passes_and_says_what_it_cannot_do(tmp_path, world):
    proc = run_on_world(world, _scenarios(), "torch:loss_parallel", tmp_path / "r.json", "loss_parallel")
    by = {v["name"]: v for v in proc.report["scenarios"]}
    assert [by[n]["verdict"] for n in ("thd-tp1", "thd-tp2", "bshd-tp4")] == ["pass"] * 3, proc.stdout
    assert by["with-entropy"]["verdict"] == "skip" and "computes no entropy" in by["with-entropy"]["reason"]
    assert by["zigzag-cp2"]["verdict"] == "skip" and "no context parallelism" in by["zigzag-cp2"]["reason"]
    assert proc.exit_code == 0 and proc.report["target"]["name"] == "torch:loss_parallel"


def test_a_backward_outside_loss_parallel_is_the_targets_error_in_backward(tmp_path, world):
    sc = [s for s in _scenarios() if s.name == "thd-tp2"]
    proc = run_on_world(world, sc, "plants:loss_parallel_backward_outside", tmp_path / "r.json", "plant")
    (v,) = proc.report["scenarios"]
    assert proc.exit_code == 1 and v["verdict"] == "fail", proc.stdout
    raised = [f for f in v["failures"] if f["kind"] == "rank_error"]
    assert raised and all("nll_loss_backward" in f["message"] and "DTensor" in f["message"] for f in raised), \
        v["failures"]
