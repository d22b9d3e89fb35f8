"""``shardcheck simulate``: the trace comparison (pure), every hang mutant caught on the fake
world, builtin clean, the command's search with its replay on a real world, and bad input.

Over 20 s: every hang mutant simulated, the search replayed on a real world, and two
simulations that wait out their deadlines on purpose (one on a CPU held busy).
"""

import json
import os
import subprocess
import sys

import pytest

from conftest import run_cli
from shardcheck.harness.controller.commands import runner
from shardcheck.harness.controller.worlds.simulated import FakeWorld
from shardcheck.harness.controller.reports.run_report import SilentReport
from shardcheck.harness.rank.checks.symmetry import first_divergence
from shardcheck.harness.rank.plumbing.trace import Call
from shardcheck.scenarios import Sample, Scenario, get_suite
from shardcheck.targets.mutants import MUTANTS

HANGS = sorted(name for name, cls in MUTANTS.items() if cls.expected[0] == "collective_mismatch")


def _call(group, ranks, number, shapes=((4,),), phase="forward", op="all_reduce"):
    return Call(op=op, group=group, ranks=list(ranks), number=number, shapes=[list(s) for s in shapes],
                dtype="float32", reduce_op="SUM", root=None, phase=phase, site="t.py:1", stack=["t.py:1"])


def test_the_first_divergence_is_named_in_the_lockstep_words():
    same = {0: [_call("1", [0, 1], 0)], 1: [_call("1", [0, 1], 0)]}
    assert first_divergence(same, {}) is None
    shorter = {0: [_call("1", [0, 1], 0), _call("1", [0, 1], 1)], 1: [_call("1", [0, 1], 0)]}
    d = first_divergence(shorter, {0: {"1": "cp"}, 1: {"1": "cp"}})
    assert d.message.startswith("cp group [0, 1] call 1: rank 0 all_reduce(SUM, float32[4]) in forward at t.py:1; "
                                "rank 1 finished the scenario after 1 calls in this group")
    assert (d.call, d.ranks, d.phase) == (1, [0, 1], "forward") and len(d.last_matched) == 1
    shapes = {0: [_call("2", [0, 1], 0, ((3,),))], 1: [_call("2", [0, 1], 0, ((5,),))]}
    assert first_divergence(shapes, {}).message.endswith("(they differ in shapes)")


def test_of_two_divergent_groups_the_one_a_rank_meets_first_is_reported():
    traces = {0: [_call("tp", [0, 1], 0), _call("cp", [0, 2], 0, ((9,),))],
              1: [_call("tp", [0, 1], 0, ((7,),))],
              2: [_call("cp", [0, 2], 0, ((1,),))]}
    d = first_divergence(traces, {})
    assert d.group_ranks == [0, 1] and "(they differ in shapes)" in d.message


@pytest.fixture(scope="module")
def fake():
    with FakeWorld([1, 2, 4, 8], timeout=60) as w:
        yield w


@pytest.mark.parametrize("name", HANGS)
def test_every_hang_mutant_is_caught_by_simulation(fake, name):
    """The mutant's suite, scenario by scenario, up to the first that shows it (as test_lockstep)."""
    kind, phase = MUTANTS[name].expected
    verdicts = []
    for sc in get_suite(MUTANTS[name].suite):
        verdicts += runner.run([sc], f"builtin:{name}", reporter=SilentReport(), world=fake).verdicts
        found = [f for v in verdicts for f in v.failures if f.kind == kind and (phase is None or f.phase == phase)]
        if found:
            break
    assert found, [v.headline() for v in verdicts if v.status != "pass"]
    assert found[0].details.get("simulated") and " call " in found[0].message


def test_sequence_parallel_layouts_are_simulated_at_sp_8_and_64():
    # a packed sequence of sp + 3 tokens: 2 rows a rank, the ranks past the middle hold only padding
    # the ends of the range (16 and 32 cost seconds and show nothing 8 and 64 do not); the mutant's
    # gather is the same code under either layout
    sizes = (8, 64)
    scenarios = [Scenario(f"{layout}-sp{sp}", (Sample(sp + 3, 2),), vocab=4, sp=sp, layout=layout, seed=sp)
                 for sp in sizes for layout in ("ulysses", "ring")]
    with FakeWorld(list(sizes), timeout=60) as world:
        good = runner.run(scenarios, "builtin", reporter=SilentReport(), world=world).verdicts
        bad = runner.run([sc for sc in scenarios if sc.layout == "ulysses"], "builtin:ulysses_skip_padding_rank",
                         reporter=SilentReport(), world=world).verdicts
    assert [v.status for v in good] == ["pass"] * len(scenarios), [v.headline() for v in good]
    for v in bad:  # every size: the padding-only ranks skip the gather, the others wait in it
        [hang] = [f for f in v.failures if f.kind == "collective_mismatch"]
        assert hang.phase == "forward" and "sp group" in hang.message and "all_to_all_single" in hang.message
        sp = v.scenario.sp
        gone = sorted(int(r) for r, side in hang.details["sides"].items() if "finished_after" in side)
        assert hang.ranks == list(range(sp)) and gone == list(range(-(-(sp + 3) // 2), sp)), (v.scenario.name, gone)


def test_simulate_without_the_input_check_passes_a_target_known_to_write_into_its_logits(fake):
    """The simulated world takes the run's input check like any other: builtin:inplace_temperature
    divides the logits it is given by 0.9 (input_mutated), and with the check off (``simulate
    --no-inplace``: tests/test_command_options.py holds the flag to the plan) its values,
    gradients and collectives are right. On the module's world: no world of its own each."""
    sc = Scenario("m", (Sample(9, 5), Sample(6, 3)), vocab=16, tp=2, entropy_coef=0.1, temperature=0.9, seed=3)
    [checked] = runner.run([sc], "builtin:inplace_temperature", reporter=SilentReport(), world=fake).verdicts
    [unchecked] = runner.run([sc], "builtin:inplace_temperature", reporter=SilentReport(), world=fake,
                             inplace=False).verdicts
    assert checked.kinds == ["input_mutated"], checked.headline()
    assert unchecked.status == "pass", unchecked.headline()


def test_builtin_is_clean_in_simulation_on_wide_layouts(fake):
    """Layouts a real world here cannot hold: tp 2 x cp 4 (8 ranks), long prompts leaving high CP
    ranks with no response token, empty all-gather slices."""
    scenarios = [Scenario(f"{lay}-8", (Sample(61, 3), Sample(40, 2), Sample(9, 8)), vocab=32, tp=2, cp=4, layout=lay,
                          entropy_coef=0.1, log_probs_chunk_size=5) for lay in ("zigzag", "allgather")]
    verdicts = runner.run(scenarios, "builtin", reporter=SilentReport(), world=fake).verdicts
    assert [v.status for v in verdicts] == ["pass", "pass"], [v.headline() for v in verdicts]
    bad = runner.run(scenarios, "builtin:skip_empty_rank", reporter=SilentReport(), world=fake).verdicts
    assert any("collective_mismatch" in v.kinds for v in bad)


def _simulate_search(folder):
    """The real ``shardcheck simulate`` process, in the background: (its run, where it wrote)."""
    out = folder / "min.json"
    return run_cli("simulate", "--target", "builtin:skip_empty_rank", "--tp", "1,2,4", "--cp", "2,4,8,16",
                   "--seed", "1", "--max-examples", "40", "--out", str(out), "-q", cwd=str(folder), timeout=300), out


BACKGROUND = {"simulate-search": (_simulate_search, 300)}


@pytest.mark.world
@pytest.mark.background("simulate-search")
def test_the_search_finds_shrinks_and_replays_on_a_real_world(background):
    proc, out = background("simulate-search")
    tmp_path = out.parent
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "collective_mismatch" in proc.stdout and " call 0: rank " in proc.stdout
    assert "values are not checked" in proc.stdout
    assert "replayed on a real world of" in proc.stdout and "the same kind as simulated" in proc.stdout, proc.stdout
    assert json.loads(out.read_text())["layout"] == "allgather"
    # hypothesis' own files go under .shardcheck/, beside its example database, not into the folder run in
    assert not (tmp_path / ".hypothesis").exists() and (tmp_path / ".shardcheck" / "hypothesis-home").is_dir()


def test_the_search_finds_nothing_in_builtin(fake):
    """The search's API on the module's simulated world (the command is the same search)."""
    from shardcheck.harness.controller.commands import fuzz

    clean = fuzz.fuzz("builtin", tp=(1, 2), cp=(2, 4, 8), max_examples=20, seed=1, world=fake, database=None,
                      max_ranks=fake.nproc)
    assert clean.failure is None and clean.counts["pass"] >= 15 and max(t * c for t, c in clean.pairs) == 8


@pytest.mark.parametrize("args, fragment", [
    (["--tp", "8", "--cp", "256"], "tp * cp = 2048 exceeds --max-world 1024"),
    (["--tp", "4", "--cp", "4", "--max-world", "8"], "tp * cp = 16 exceeds --max-world 8"),
    (["--target", "nope"], "unknown target 'nope'"),
    (["--max-world", "0"], "--max-world must be >= 1"),
])
def test_bad_input_is_one_line_exit_2(cli_in_process, args, fragment):
    proc = cli_in_process("simulate", *args)
    assert proc.returncode == 2 and fragment in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_a_scenario_file_with_a_vocab_tp_does_not_divide_is_one_line(cli_in_process, tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"name": "x", "samples": [[9, 4]], "vocab": 33, "tp": 2}))
    proc = cli_in_process("simulate", "--scenario-file", str(path))
    assert proc.returncode == 2 and "vocab 33 is not divisible by tp 2" in proc.stderr


_GROUPS_SEEN = r"""
import json, sys
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.testing._internal.distributed.fake_pg import FakeStore
from megatron.core import parallel_state as ps
from shardcheck.harness.rank.plumbing import groups

def value(v):
    if v is c10d.GroupMember.NON_GROUP_MEMBER:
        return "NON_GROUP_MEMBER"
    if isinstance(v, dist.ProcessGroup):
        return ["group", v.group_name, getattr(v, "group_desc", ""), dist.get_process_group_ranks(v)]
    if isinstance(v, (list, tuple)):
        return [value(x) for x in v]
    if isinstance(v, dict):
        return {str(k): value(x) for k, x in v.items()}
    return v if v is None or isinstance(v, (int, float, str, bool)) else type(v).__name__

def seen():
    names = [k for k in vars(ps) if k.startswith("_") and k[1:2].isupper()] + ["_global_process_group_list"]
    pgs = {pg.group_name: dist.get_process_group_ranks(pg) for pg in c10d._world.pg_group_ranks
           if pg is not c10d.GroupMember.NON_GROUP_MEMBER}
    return {"globals": {k: value(getattr(ps, k)) for k in names}, "torch groups": pgs,
            "group count": c10d._world.group_count}

out = []
for world, tp, cp, ranks in json.loads(sys.argv[1]):
    for rank in ranks:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        groups.share_rank_lists(True)
        groups.configure(tp, cp)
        fast = seen()
        kept = len(groups._rank_lists)
        groups.share_rank_lists(False)
        groups.reset()
        dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                     distributed_timeout_minutes=groups._timeout_s / 60.0,
                                     create_gloo_process_groups=False)
        scratch = seen()
        ps.destroy_model_parallel()
        dist.destroy_process_group()
        out.append({"case": [world, tp, cp, rank], "kept": kept, "mine": len(fast["torch groups"]),
                    "differ": sorted(k for k in scratch["globals"] if fast["globals"][k] != scratch["globals"][k])
                              + [k for k in ("torch groups", "group count") if fast[k] != scratch[k]]})
print(json.dumps(out))
"""


def test_each_simulated_rank_gets_the_groups_megatron_gives_it():
    """The fake world's fast path (megatron's rank lists computed once per layout, only the rank's
    own groups created: groups.share_rank_lists) against a from-scratch initialize_model_parallel
    for that rank: every parallel_state global (groups by name, description and ranks; rank
    lists), torch's groups and its group count are the same."""
    cases = [(1, 1, 1, [0]), (8, 2, 4, list(range(8))), (16, 2, 4, [0, 5, 10, 15]), (16, 4, 2, [3, 12]),
             (64, 4, 16, [0, 17, 63]), (512, 8, 64, [0, 77, 300, 511])]
    proc = subprocess.run([sys.executable, "-c", _GROUPS_SEEN, json.dumps(cases)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(seen) == sum(len(c[3]) for c in cases)
    assert [s for s in seen if s["differ"]] == []
    # the fast path was taken: the rank lists are kept, and a rank of 512 holds a handful of groups
    assert all(s["kept"] > 0 for s in seen)
    assert all(s["mine"] < 30 for s in seen if s["case"][0] == 512), seen


def test_a_simulation_still_going_rank_after_rank_is_not_hung():
    """Four simulated ranks of 0.5 s each, with a 1.5 s timeout: each rank has the timeout to
    itself (the deadline follows the simulation's progress), so 2 s in all pass."""
    sc = Scenario("slow4", (Sample(12, 4),), vocab=8, tp=4)
    with FakeWorld([4], timeout=1.5, workers=1) as w:
        result = runner.run([sc], "plants:SlowPerRank", reporter=SilentReport(), world=w)
    v = result.verdicts[0]
    assert v.status == "pass" and v.seconds > 2.0, [f.message for f in v.failures]


@pytest.mark.skipif(not os.path.exists("/proc/self/task/%d/schedstat" % os.getpid()),
                    reason="no schedstat: how long a process waited for a CPU cannot be known here")
@pytest.mark.calm
def test_a_simulation_starved_of_cpu_times_out_and_is_not_blamed_on_the_target(tmp_path):
    """The simulation process runs at SCHED_IDLE on a CPU a busy process holds: the deadline it
    misses is the machine's (timeout, exit status 3), not 'a target that never returns', with the
    machine loaded besides (a busy process a core, started here: it was judged the target's)."""
    from plants import hog_cpu, machine_loaded

    sc = Scenario("starved", (Sample(12, 4),), vocab=8, tp=2)
    with FakeWorld([2], timeout=2, workers=1) as w:
        w.ensure_ready()  # started before the load: its start-up is not what is tested
        hog = subprocess.Popen([sys.executable, "-c", "import os\nos.sched_setaffinity(0, {%d})\nwhile True: pass"
                                % hog_cpu()])
        try:
            with machine_loaded(per_core=1):
                result = runner.run([sc], "plants:StarvedEverywhere", reporter=SilentReport(), world=w)
        finally:
            hog.kill()
            hog.wait()
    v = result.verdicts[0]
    assert v.status == "timeout" and result.exit_code == 3, [(f.kind, f.message) for f in v.failures]
    assert "simulated rank 0 gave no result within 2s" in v.failures[0].message
    assert "for a CPU" in v.failures[0].message
    from shardcheck.harness.controller.reports.html_report import write_verdicts
    from shardcheck.harness.controller.reports.run_report import render_table

    assert "0 failed, 0 skipped, 1 timed out (the machine was too slow" in render_table([v], result.info)
    write_verdicts(str(tmp_path / "p.html"), {"summary": {"timeout": 1, "total": 1}}, [v], lambda _: 0)
    assert "1 timed out" in (tmp_path / "p.html").read_text()


def test_a_training_step_of_dp_x_tp_x_cp_ranks_is_checked_for_hangs():
    """dp 4 x tp 2 x cp 4 = 32 simulated ranks, every one of them (a 512-rank step takes about 6 s:
    docs/training.md): the whole step (megatron-core's schedule, DDP's gradient all-reduce) on the
    fake world. Long prompts leave CP ranks no response token; a loss that does not reach its
    logits there skips the model's CP collective in backward: a collective mismatch."""
    samples = tuple(Sample(61, 3) if i % 2 else Sample(40, 2) for i in range(4))
    scenario = Scenario("step-32", samples, vocab=32, dp=4, tp=2, cp=4, layout="zigzag")
    assert scenario.ranks == 32
    with FakeWorld([32], timeout=120) as world:
        [good] = runner.run([scenario], "builtin:loss", reporter=SilentReport(), world=world).verdicts
        [bad] = runner.run([scenario], "plants:StepLossMissesLogits", reporter=SilentReport(), world=world).verdicts
    assert good.status == "pass", good.headline()
    assert bad.status == "fail" and "collective_mismatch" in bad.kinds, bad.headline()
    head = next(f for f in bad.failures if f.kind == "collective_mismatch")
    assert head.details.get("simulated") and "all_reduce" in head.message, head.message
