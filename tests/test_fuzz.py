"""Fuzzing: the strategies (pure, no world), and ``shardcheck fuzz`` finding, shrinking and
writing a length-dependent planted bug whose scenario file then replays to the same failure.

Over 20 s: on a loaded machine (about 18 s on a quiet one): 29 tests, among them hypothesis
searches that shrink on a real world and the command's find-shrink-write-replay in a process of
its own."""

import json
import re

import pytest
from hypothesis import find, given, settings
from hypothesis import strategies as st

from conftest import run_cli, run_on_world
from shardcheck.errors import BadInput
from shardcheck.harness.controller.commands import fuzz
from shardcheck.scenarios import LAYOUTS, Sample, Scenario, load_scenario_file
from shardcheck.strategies import (
    boundary_positions,
    coarsen_chunk_size,
    layouts,
    lengths,
    samples,
    scenarios,
    vocabs,
)

MUTANT = "builtin:unpadded_chunk_start"
PURE = settings(max_examples=150, deadline=None, database=None)


def _planted(sc: Scenario) -> bool:
    """Where the mutant is wrong: a zigzag sample needing no padding, with chunks of 3 rows or
    more, whose response starts on the first row of a CP chunk other than the first."""
    unit = 2 * sc.cp
    return sc.layout == "zigzag" and any(
        s.total % unit == 0 and s.total // unit >= 3 and s.prompt > 1 and (s.prompt - 1) % (s.total // unit) == 0
        for s in sc.samples)


# -- strategies: pure and fast ---------------------------------------------------------------------

@PURE
@given(scenarios(tp=(1, 2, 4), cp=(1, 2, 4), ranks=4))
def test_drawn_scenarios_are_valid_and_round_trip_through_json(sc):
    assert Scenario.from_json(sc.to_json()) == sc
    assert Scenario.from_dict(json.loads(json.dumps(sc.to_dict()))).key == sc.key
    assert 4 % (sc.tp * sc.cp) == 0 and sc.vocab % sc.tp == 0
    assert (sc.layout in ("zigzag", "allgather")) == (sc.cp > 1)
    assert all(1 <= s.response <= s.total - 1 for s in sc.samples)


@PURE
@given(scenarios(tp=2, cp=[2, 4], layout="allgather", vocab=[8, 16], chunk_size=3, entropy=[(True, 0.1)],
                 temperature=0.7, seed=5, max_samples=2, max_total=12, name="mine"))
def test_what_is_given_is_kept(sc):
    assert (sc.tp, sc.layout, sc.log_probs_chunk_size, sc.with_entropy, sc.entropy_coef) == (2, "allgather", 3, True, 0.1)
    assert sc.cp in (2, 4) and sc.vocab in (8, 16) and (sc.temperature, sc.seed, sc.name) == (0.7, 5, "mine")
    assert len(sc.samples) <= 2 and max(s.total for s in sc.samples) <= 12


@PURE
@given(st.data())
def test_the_small_strategies_compose(data):
    cp = data.draw(st.sampled_from((1, 2, 4)))
    layout = data.draw(layouts(cp))
    total = data.draw(lengths(cp, max_total=30))
    batch = data.draw(samples(tp=2, cp=cp, layout=layout, chunk_size=4, max_size=3, max_total=30))
    vocab = data.draw(vocabs(2))
    assert 2 <= total <= 30 and 1 <= len(batch) <= 3 and vocab % 2 == 0
    Scenario("composed", batch, vocab=vocab, tp=2, cp=cp, layout=layout, log_probs_chunk_size=4)


def test_edges_are_where_ranks_and_chunks_split_a_sample():
    # zigzag, cp 2, total 8: chunks of 2 rows start at 2, 4 and 6
    assert boundary_positions([8], cp=2, layout="zigzag") == [[2, 4, 6]]
    # all-gather, cp 2: 20 rows, 10 a rank; sample 0 crosses at row 10, sample 1 lies on rank 1
    assert boundary_positions([12, 8], cp=2, layout="allgather") == [[10], []]
    # packed, chunks of 4 local rows: sample 0 at row 4, sample 1 (rows 6..11) at row 8
    assert boundary_positions([6, 6], chunk_size=4) == [[4], [2]]
    assert coarsen_chunk_size(1, 100) == 13 and coarsen_chunk_size(16, 100) == 16 and coarsen_chunk_size(-1, 100) == -1


def test_the_edge_bias_finds_the_planted_condition_often():
    drawn = []

    @settings(max_examples=300, deadline=None, database=None, derandomize=True)  # a rate: no flake
    @given(scenarios(tp=1, cp=(2, 4), layout="zigzag", max_total=1024))
    def collect(sc):
        drawn.append(sc)

    collect()
    assert sum(map(_planted, drawn)) / len(drawn) > 0.06  # uniform random lengths up to 1024: 0.012


def test_shrinking_heads_for_fewest_samples_shortest_lengths_smallest_vocab():
    # derandomized: a random search can stop in a local minimum (the seed 3 case of the benchmark)
    quiet = settings(database=None, max_examples=2000, derandomize=True)
    two = find(scenarios(ranks=4), lambda sc: len(sc.samples) >= 2, settings=quiet)
    assert two.samples == (Sample(2, 1), Sample(2, 1)) and (two.vocab, two.tp, two.cp, two.layout) == (1, 1, 1, "thd")
    planted = find(scenarios(ranks=4), _planted, settings=quiet)
    # 12 is the shortest total with chunks of 3 rows at cp 2 ([12/2]); the shrinker guarantees a
    # local minimum only (no smaller length keeps the condition between [20/4] and [12/2])
    [sample] = planted.samples
    assert _planted(planted) and sample.total <= 24 and (planted.vocab, planted.tp, planted.cp) == (1, 1, 2)
    assert (planted.log_probs_chunk_size, planted.with_entropy, planted.temperature) == (-1, False, 1.0)


@pytest.mark.parametrize("kwargs,fragment", [
    ({"cp": 1, "layout": "zigzag"}, "no tp in [1, 2] and cp in [1]"),
    ({"tp": 2, "vocab": [3]}, "no vocab in [3] is divisible"),
    ({"chunk_size": 0}, "log_probs_chunk_size must be -1"),
    ({"entropy": [(False, 0.1)]}, "needs with_entropy=true"),
    ({"tp": 4, "cp": 2, "ranks": 4}, "in a world of 4 ranks"),
])
def test_impossible_strategies_are_bad_input_at_once(kwargs, fragment):
    with pytest.raises(BadInput, match=re.escape(fragment)):
        scenarios(**kwargs)


def test_world_plan_fits_every_pair():
    assert fuzz.plan_world((1, 2, 4), (1, 2, 4), LAYOUTS, None) == (4, [(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (4, 1)])
    assert fuzz.plan_world((1,), (1, 2), LAYOUTS, None) == (2, [(1, 1), (1, 2)])
    assert fuzz.plan_world((2,), (2,), ["zigzag"], 8) == (8, [(2, 2)])
    with pytest.raises(BadInput, match="cp 1"):
        fuzz.plan_world((1,), (1,), ["zigzag"], None)


# -- the command line ------------------------------------------------------------------------------

@pytest.mark.parametrize("args,fragment", [
    (["--tp", "x"], "expected integers separated by commas"),
    (["--layout", "zigzag", "--cp", "1"], "no tp in"),
    (["--target", "builtin:nope"], "has no variant 'nope'"),
], ids=["tp-text", "layout-cp", "target"])
def test_bad_input_is_one_line_and_exit_2(tmp_path, monkeypatch, cli_in_process, args, fragment):
    monkeypatch.chdir(tmp_path)  # where .shardcheck would be made
    proc = cli_in_process("fuzz", *args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("shardcheck: error: ") and fragment in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / ".shardcheck").exists()


@pytest.mark.parametrize("kwargs,fragment", [
    ({"max_examples": 0}, "--max-examples must be >= 1"),
    ({"tp": [0]}, "--tp values must be integers >= 1"),
    ({"seed": -1}, "--seed must be an integer >= 0"),
    ({"layouts": ["nope"]}, "unknown layout(s) nope"),
    ({"timeout": 0}, "--timeout must be > 0"),
    ({"tp": [4], "cp": [2]}, "exceeds 4 ranks: give --nproc"),
])
def test_bad_options_are_refused_before_any_world_starts(kwargs, fragment):
    with pytest.raises(BadInput, match=re.escape(fragment)):
        fuzz.fuzz("builtin", **kwargs)


@pytest.mark.world
def _fuzz_the_planted_bug(folder):
    """The real ``shardcheck fuzz`` process, in the background: (its run, where it wrote)."""
    out = folder / "found" / "minimal.json"
    # the Megatron family's layouts, where the planted bug lies (the sp layouts would share the 40 draws)
    return run_cli("fuzz", "--target", MUTANT, "--seed", "0", "--max-examples", "40", "--out", str(out), "-q",
                   "--layout", "thd,bshd,zigzag,allgather", cwd=str(folder), timeout=300), out


BACKGROUND = {"fuzz-planted": (_fuzz_the_planted_bug, 300)}


@pytest.mark.background("fuzz-planted")
def test_fuzz_finds_shrinks_writes_and_replays_the_planted_bug(tmp_path, world, background):
    """The real ``shardcheck fuzz`` process; the file it writes is replayed on the session's world
    (``shardcheck run`` itself is run end to end in test_run)."""
    proc, out = background("fuzz-planted")
    folder = out.parent.parent
    assert proc.returncode == 1, proc.stdout + proc.stderr
    [sc] = load_scenario_file(out)
    # shrunk: one or two short samples and a small vocabulary, still on the planted condition
    assert len(sc.samples) <= 2 and sum(s.total for s in sc.samples) <= 24 and sc.vocab <= 4, sc
    assert _planted(sc) and sc.tp == 1
    assert "FAILURE found after" in proc.stdout and f"written to {out}" in proc.stdout
    replay = f"replay: shardcheck run --target {MUTANT} --scenario-file {out}"
    assert replay in proc.stdout, proc.stdout
    kinds = re.search(r"minimal failing scenario: .*\[([a-z_, ]+)\]", proc.stdout).group(1).split(", ")
    assert "value_mismatch" in kinds
    assert any((folder / ".shardcheck" / "hypothesis").iterdir()), "the failure must be kept for next time"

    # the replay: the scenario file, run and reported as `shardcheck run --json-report` does (4 ranks
    # hold any cp the search drew)
    again = run_on_world(world, load_scenario_file(out), MUTANT, tmp_path / "replay.json", str(out))
    assert again.exit_code == 1, again.stdout
    [verdict] = again.report["scenarios"]
    assert verdict["verdict"] == "fail" and verdict["kinds"] == kinds


@pytest.mark.world
def test_fuzzing_the_correct_target_finds_nothing(tmp_path, monkeypatch, capsys):
    """``shardcheck fuzz`` through ``main`` in this process: its own one-rank world, no interpreter start."""
    from shardcheck.cli import main

    monkeypatch.chdir(tmp_path)
    code = main(["fuzz", "--target", "builtin", "--seed", "11", "--max-examples", "12", "--tp", "1", "--cp", "1"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "no failure found in" in out and "scenarios/min" in out
    assert "seed 11, 1 rank," in err and not (tmp_path / ".shardcheck" / "fuzz-failure.json").exists()


# -- the Python API on one shared world (the session's two-rank world) ------------------------------

@pytest.mark.world
def test_api_on_a_shared_world_finds_nothing_in_the_correct_target(world2):
    starts = len(world2.startup_seconds)
    result = fuzz.fuzz("builtin", max_examples=30, seed=4, world=world2, database=None)
    assert result.failure is None and result.exit_code == 0 and result.counts["fail"] == 0
    assert result.searched >= 20 and result.nproc == 2 and {c for _, c in result.pairs} == {1, 2}
    assert len(world2.startup_seconds) == starts and result.startup_seconds == []


@pytest.mark.world
def test_the_fuzzer_draws_replayed_keep_sets_when_the_target_applies_them(world2):
    """keep_ids_unshifted only goes wrong on scenarios with keep sets at tp > 1: found only
    because the fuzzer draws them for a target whose capabilities say it applies them."""
    result = fuzz.fuzz("builtin:keep_ids_unshifted", max_examples=60, seed=1, tp=(2,), cp=(1,), world=world2,
                       database=None)
    assert result.failure is not None and result.failure.scenario.replay_keep
    assert {"value_mismatch", "grad_mismatch"} & set(result.failure.kinds)


@PURE
@given(scenarios(replay_keep=True, max_samples=2))
def test_replay_keep_is_drawn_when_asked(sc):
    assert sc.replay_keep


@PURE
@given(scenarios(sampling=[(4, 1.0), (40, 0.5)], vocab=[2, 8], tp=1, max_samples=2))
def test_sampling_is_drawn_when_asked_and_top_k_fits_the_vocabulary(sc):
    assert sc.sampling and not sc.replay_keep and sc.top_k <= sc.vocab


@pytest.mark.world
def test_the_fuzzer_draws_sampling_scenarios_when_the_target_filters(world2):
    """A plain top-k / top-p filter passes what the fuzzer draws (a fixed seed, so the same
    draws every time); the same target without the filter is caught, on a sampling scenario."""
    good = fuzz.fuzz("plants:SamplingTp1", max_examples=25, seed=3, tp=(1,), cp=(1,), world=world2,
                     database=None)
    assert good.failure is None and good.counts["pass"] >= 20, good.counts
    bad = fuzz.fuzz("plants:SamplingIgnored", max_examples=60, seed=3, tp=(1,), cp=(1,), world=world2,
                    database=None)
    assert bad.failure is not None and bad.failure.scenario.sampling, bad.counts


@pytest.mark.world
def test_a_found_failure_is_tried_first_next_time(world2, tmp_path):
    db = str(tmp_path / "db")
    first = fuzz.fuzz(MUTANT, max_examples=60, seed=0, layouts=["zigzag"], world=world2, database=db)
    assert first.failure is not None and _planted(first.failure.scenario)
    second = fuzz.fuzz(MUTANT, max_examples=60, seed=1, layouts=["zigzag"], world=world2, database=db)
    assert second.searched == 1 and second.failure.scenario.key == first.failure.scenario.key


def test_an_interrupted_search_writes_the_failure_it_saw_unshrunk_and_says_so(tmp_path):
    """A fuzz run stopped after a failure used to write nothing; the latest failing scenario it saw
    (the smallest so far, once shrinking) is written where --out says, with the command to rerun it."""
    import io

    from shardcheck.harness.controller.commands.fuzz import Event
    from shardcheck.harness.controller.reports.fuzz_report import Progress, write_unshrunk
    from shardcheck.harness.controller.reports.verdict import Verdict
    from shardcheck.scenarios import Sample, Scenario
    from shardcheck.scenarios.suites import load_scenario_file

    big = Scenario("big", (Sample(40, 9), Sample(30, 5)), vocab=32, cp=2, layout="zigzag")
    small = Scenario("small", (Sample(12, 3),), vocab=32, cp=2, layout="zigzag")
    out = tmp_path / "f.json"
    progress = Progress(err=io.StringIO(), quiet=True)
    assert write_unshrunk(progress, str(out), "builtin") == "" and not out.exists()
    progress(Event(1, False, Verdict(big, "fail"), 1.0))
    said = write_unshrunk(progress, str(out), "builtin")
    assert said.startswith(f"; the failing scenario seen last (not shrunk) is in {out}: shardcheck run "), said
    progress(Event(2, True, Verdict(small, "fail"), 2.0))
    progress(Event(3, True, Verdict(Scenario("passes", (Sample(8, 2),), vocab=32), "pass"), 3.0))
    assert "(partly shrunk)" in write_unshrunk(progress, str(out), "builtin")
    assert [sc.samples for sc in load_scenario_file(out)] == [small.samples]
