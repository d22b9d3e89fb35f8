"""What a world may ask of the machine (harness/controller/worlds/limits.py, machine.py, scenario_memory.py): ranks against cores and
memory, a scenario's memory estimate against what is available, the timeout against what torch
and the OS accept. Each refusal is one line, exit status 2, before any world starts
(``cli_in_process`` fails the test if one starts)."""

import datetime
import json
import math
import multiprocessing as mp
from multiprocessing.connection import wait
from types import SimpleNamespace

import pytest

from shardcheck.errors import BadInput
from shardcheck.harness.controller.worlds import limits
from shardcheck.harness.controller.worlds import memory_estimate as scenario_memory
from shardcheck.harness.controller.worlds import machine as host
from shardcheck.harness.controller.worlds.machine import GiB, MiB, Machine
from shardcheck.harness.controller.worlds.memory_estimate import scenario_bytes
from shardcheck.scenarios import Scenario, get_suite
from shardcheck.scenarios.suites import SUITES


def _one_line_error(proc, *fragments: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("shardcheck: error: "), lines[0]
    for f in fragments:
        assert f in lines[0], lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout
    return lines[0]


def _file(tmp_path, *scenarios: dict) -> str:
    p = tmp_path / "s.json"
    p.write_text(json.dumps(list(scenarios)))
    return str(p)


@pytest.fixture
def machine(monkeypatch):
    """This machine, as the CLI sees it, made 2 cores and 8 GiB available."""
    monkeypatch.setattr(host, "usable_cores", lambda: 2)
    monkeypatch.setattr(host, "available_memory", lambda: 8 * GiB)
    return Machine(2, 8 * GiB)


@pytest.fixture
def runs(monkeypatch):
    """``runner.run`` replaced by a recorder: a command that gets past every check stops there."""
    from shardcheck.harness.controller.commands import runner

    seen = []

    def fake_run(scenarios, target, **kw):
        seen.append(SimpleNamespace(scenarios=list(scenarios), **kw))
        return SimpleNamespace(verdicts=[], exit_code=0)

    monkeypatch.setattr(runner, "run", fake_run)
    return seen


SMALL = {"name": "small", "samples": [[10, 5]], "vocab": 32}
HUGE_VOCAB = {"name": "huge-vocab", "samples": [[10, 5]], "vocab": 10**9}
BIG_VOCAB = {"name": "big-vocab", "samples": [[10, 5], [20, 8]], "vocab": 2 * 10**7, "tp": 2}
TWO_GIB = {"name": "two-gib", "samples": [[10, 5]], "vocab": 2 * 10**6}  # about 2 GiB a rank


# -- ranks -------------------------------------------------------------------------------------------
def test_max_ranks_is_the_lesser_of_cores_and_memory():
    assert Machine(2, 24 * GiB).max_ranks == 2 * host.RANKS_PER_CORE == 16
    # 8 GiB less the controller's 512 MiB, at 128 MiB a rank
    assert Machine(64, 8 * GiB).max_ranks == (8 * GiB - 512 * MiB) // (128 * MiB) == 60
    assert Machine(4, None).max_ranks == 32  # memory unknown: the cores only
    assert Machine(4, 100 * MiB).max_ranks == 1  # never below one rank


def test_check_nproc_refuses_past_the_bound_and_the_override_lifts_it():
    small = Machine(2, 8 * GiB)
    limits.check_nproc(16, machine=small)
    with pytest.raises(BadInput, match=r"--nproc 17 is more ranks than this machine can hold: at most 16 "
                                       r"\(8 a core x 2 cores; 8.0 GiB of memory available holds 60"):
        limits.check_nproc(17, machine=small)
    limits.check_nproc(10**6, machine=small, allow_large_world=True)
    limits.check_nproc(None, machine=small)


@pytest.mark.parametrize("command", ["run", "invariance"])
def test_nproc_past_the_machine_is_one_line(cli_in_process, machine, command):
    line = _one_line_error(cli_in_process(command, "--nproc", "1000"),
                           "--nproc 1000 is more ranks than this machine can hold: at most 16",
                           "8 a core x 2 cores", "--allow-large-world")
    assert "8.0 GiB" in line


def test_nproc_past_the_real_machine_is_one_line(cli_in_process):
    """Not patched: the figures this machine reads for itself."""
    _one_line_error(cli_in_process("run", "--nproc", "100000"), "more ranks than this machine can hold", "a core")


def test_world_the_scenarios_need_is_bounded_too(cli_in_process, machine, tmp_path):
    wide = {"name": "wide", "samples": [[10, 5]], "vocab": 64, "tp": 64}
    _one_line_error(cli_in_process("run", "--scenario-file", _file(tmp_path, wide)),
                    "these scenarios need a world of 64 ranks (the lcm of their tp*cp)", "at most 16")


def test_allow_large_world_lets_a_large_nproc_past_the_checks(cli_in_process, machine, runs):
    assert cli_in_process("run", "--nproc", "1000", "--scenario", "thd-tp1cp1-basic").returncode == 2
    assert runs == []
    proc = cli_in_process("run", "--nproc", "1000", "--scenario", "thd-tp1cp1-basic", "--allow-large-world")
    assert proc.returncode == 0, proc.stderr
    [call] = runs
    assert call.nproc == 1000 and [s.name for s in call.scenarios] == ["thd-tp1cp1-basic"]


def test_a_world_within_the_bound_gets_past_the_checks(cli_in_process, machine, runs):
    proc = cli_in_process("run", "--nproc", "16", "--suite", "smoke")
    assert proc.returncode == 0, proc.stderr
    assert runs[0].nproc == 16


# -- available memory --------------------------------------------------------------------------------
def _tree(tmp_path, files: dict[str, str]):
    for name, text in files.items():
        p = tmp_path / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path


def _available(tmp_path, proc_cgroup: str, files: dict[str, str], mem_available_kb: int = 20 * 1024 * 1024):
    root = _tree(tmp_path / "cg", files)
    (tmp_path / "meminfo").write_text(f"MemTotal: 99999999 kB\nMemAvailable: {mem_available_kb} kB\n")
    (tmp_path / "cgroup").write_text(proc_cgroup)
    return host.available_memory(str(tmp_path / "meminfo"), str(tmp_path / "cgroup"), str(root))


def test_memory_is_memavailable_without_a_cgroup_limit(tmp_path):
    assert _available(tmp_path, "0::/\n", {"memory.max": "max\n", "memory.current": "123\n"}) == 20 * GiB
    assert _available(tmp_path, "0::/\n", {}) == 20 * GiB  # no cgroup files at all


def test_memory_is_the_cgroup_v2_headroom_when_nearer(tmp_path):
    files = {"memory.max": f"{4 * GiB}\n", "memory.current": f"{GiB}\n",
             "memory.stat": f"anon 1\ninactive_file {GiB // 2}\n"}
    assert _available(tmp_path, "0::/\n", files) == 3 * GiB + GiB // 2  # page cache can be reclaimed


def test_a_parent_cgroup_limit_applies(tmp_path):
    files = {"job/memory.max": "max\n", "job/memory.current": "0\n",
             "memory.max": f"{2 * GiB}\n", "memory.current": f"{GiB}\n"}
    assert _available(tmp_path, "0::/job\n", files) == GiB


def test_cgroup_v1_limit_and_its_no_limit(tmp_path):
    v1 = "4:memory:/box\n1:cpu:/\n"
    limited = {"memory/box/memory.limit_in_bytes": f"{6 * GiB}\n", "memory/box/memory.usage_in_bytes": f"{GiB}\n"}
    assert _available(tmp_path, v1, limited) == 5 * GiB
    unlimited = {"memory/box/memory.limit_in_bytes": "9223372036854771712\n",
                 "memory/box/memory.usage_in_bytes": f"{GiB}\n"}
    assert _available(tmp_path / "u", v1, unlimited) == 20 * GiB


def test_nothing_readable_means_memory_unknown(tmp_path):
    assert host.available_memory(str(tmp_path / "no"), str(tmp_path / "no"), str(tmp_path / "no")) is None


@pytest.fixture
def eight_cpus(monkeypatch):
    """The process's CPU affinity made 8 CPUs, whatever this machine has."""
    monkeypatch.setattr(host.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)


# ranks past the quota share its cores, so any part of a core counts as a whole one (math.ceil):
# 1.5 and 2.2 tell rounding up from rounding down or to the nearest
@pytest.mark.parametrize("cpu_max, cores", [
    ("50000 100000\n", 1),
    ("150000 100000\n", 2),
    ("220000 100000\n", 3),
    ("250000 100000\n", 3),
    ("300000 100000\n", 3),
    ("max 100000\n", 8),      # no quota: the affinity
    ("1200000 100000\n", 8),  # a quota past the affinity: the affinity
])
def test_a_cpu_quota_lowers_the_cores(tmp_path, eight_cpus, cpu_max, cores):
    (tmp_path / "cpu.max").write_text(cpu_max)
    assert host.usable_cores(str(tmp_path)) == cores


def test_no_cpu_quota_file_leaves_the_affinity(tmp_path, eight_cpus):
    assert host.usable_cores(str(tmp_path / "none")) == 8


def test_an_affinity_smaller_than_the_quota_wins(tmp_path, monkeypatch):
    # three CPUs, not this machine's count, so an affinity that is not read shows
    monkeypatch.setattr(host.os, "sched_getaffinity", lambda pid: {1, 4, 6}, raising=False)
    (tmp_path / "cpu.max").write_text("500000 100000\n")
    assert host.usable_cores(str(tmp_path)) == 3


def test_without_an_affinity_the_cpu_count_is_the_cores(tmp_path, monkeypatch):
    def no_affinity(pid):
        raise AttributeError("sched_getaffinity")  # not Linux

    monkeypatch.setattr(host.os, "sched_getaffinity", no_affinity, raising=False)
    monkeypatch.setattr(host.os, "cpu_count", lambda: 6)
    (tmp_path / "cpu.max").write_text("250000 100000\n")
    assert host.usable_cores(str(tmp_path)) == 3
    assert host.usable_cores(str(tmp_path / "none")) == 6


# -- a scenario's memory -----------------------------------------------------------------------------
def test_the_mirrored_figures_match_the_data_path():
    from shardcheck.reference import DEFAULT_CHUNK_ROWS
    from shardcheck.scenarios import DTYPES, data

    assert scenario_memory.BLOCK_ROWS == data.BLOCK_ROWS
    assert scenario_memory.CHUNK_ROWS == DEFAULT_CHUNK_ROWS
    assert scenario_memory.DTYPE_BYTES == {n: data.torch_dtype(n).itemsize for n in DTYPES}


def _all_suite_scenarios():
    return [sc for name in SUITES for sc in get_suite(name)]


def test_pieces_are_the_layouts():
    """The estimate's rows are the rows a rank really holds and scores."""
    from shardcheck.scenarios.layout import rank_layout
    from shardcheck.harness.rank.life import shard

    odd = Scenario("odd", ((37, 20), (5, 2), (130, 65)), vocab=8, cp=3, layout="zigzag")
    for sc in [*_all_suite_scenarios(), odd, Scenario("odd-ag", odd.samples, vocab=8, cp=3, tp=2, layout="allgather")]:
        for r in range(sc.cp):
            layout = rank_layout(sc, 0, r)
            assert scenario_memory.local_pieces(sc, r) == [(p.stream, p.start, p.stop) for p in layout.pieces], sc.name
            share = shard.share_pieces(layout)
            assert scenario_memory.share_pieces(sc, r) == [(p.stream, p.start, p.stop) for p in share], sc.name


def test_suite_scenarios_are_small():
    worst = max(scenario_bytes(sc) for sc in _all_suite_scenarios())
    assert 0 < worst < 16 * MiB


@pytest.mark.parametrize("pieces", [
    [(0, 0, 6_000_000)],  # one long sample
    [(i, 3, 70) for i in range(90_000)],  # many short ones, each across two blocks
], ids=["one-long", "many-short"])
def test_many_reference_chunks_are_bounded_not_walked(monkeypatch, pieces):
    """Past MAX_CHUNKS_WALKED reference chunks the worst chunk is bounded, at no less."""
    bounded = scenario_memory.reference_bytes(pieces, 1000, 4)
    monkeypatch.setattr(scenario_memory, "MAX_CHUNKS_WALKED", 10**9)
    walked = scenario_memory.reference_bytes(pieces, 1000, 4)
    assert walked <= bounded < 1.5 * walked, (bounded, walked)


def test_huge_vocabularies_are_estimated_past_any_machine():
    # a 64-row block of a billion float32 columns, drawn and scaled: 512 GB before anything else
    assert scenario_bytes(Scenario.from_dict(HUGE_VOCAB)) > 2 * 64 * 10**9 * 4
    assert scenario_bytes(Scenario.from_dict(BIG_VOCAB)) > 20 * GiB


def test_the_estimate_grows_with_vocab_rows_and_narrows_with_tp_and_cp():
    base = Scenario("b", ((2000, 1000),), vocab=200_000)
    est = scenario_bytes(base)
    assert 1.9 < scenario_bytes(Scenario("b", ((2000, 1000),), vocab=400_000)) / est < 2.1
    assert scenario_bytes(Scenario("b", ((4000, 2000),), vocab=200_000)) > 1.7 * est
    assert scenario_bytes(Scenario("b", ((2000, 1000),), vocab=200_000, tp=2)) < 0.7 * est
    assert scenario_bytes(Scenario("b", ((2000, 1000),), vocab=200_000, cp=2, layout="zigzag")) < 0.7 * est
    # invariance runs have no reference, and send their outputs back
    assert scenario_bytes(base, reference=False, outputs=True) < est


# VmHWM of the rank minus its idle VmRSS, builtin target, gloo, one scenario on a fresh world (this
# machine, the measurements the estimate was made against; the last four were not fitted).
MEASURED = [
    ({"samples": [[10, 5]], "vocab": 2_000_000}, 2026373120),
    ({"samples": [[10, 5]], "vocab": 2_000_000, "dtype": "bfloat16"}, 1818386432),
    ({"samples": [[100, 50]], "vocab": 200_000}, 1207017472),
    ({"samples": [[1000, 500]], "vocab": 200_000}, 6294683648),
    ({"samples": [[2000, 1000]], "vocab": 200_000}, 10313994240),
    ({"samples": [[2000, 1000]], "vocab": 200_000, "tp": 2}, 6279262208),
    ({"samples": [[2000, 1000]], "vocab": 200_000, "entropy_coef": 0.1}, 12861038592),
    ({"samples": [[2000, 1000]], "vocab": 200_000, "dtype": "bfloat16"}, 8348921856),
    ({"samples": [[400000, 200000]], "vocab": 8}, 177807360),
    ({"samples": [[30, 10]] * 20, "vocab": 200_000}, 4675452928),
    ({"samples": [[600, 300], [200, 100]], "vocab": 200_000, "cp": 2, "layout": "zigzag"}, 3466629120),
    ({"samples": [[600, 300], [200, 100]], "vocab": 200_000, "cp": 2, "layout": "allgather"}, 3508432896),
    ({"samples": [[10, 5]], "vocab": 5_000_000}, 4982493184),
]


@pytest.mark.parametrize("fields,peak", MEASURED, ids=[f"m{i}" for i in range(len(MEASURED))])
def test_the_estimate_is_near_the_measured_peak(fields, peak):
    est = scenario_bytes(Scenario.from_dict({"name": "m", **fields}))
    assert 0.85 * peak < est < 1.25 * peak, (est / GiB, peak / GiB)


def test_invariance_estimate_is_near_the_measured_peak():
    """Outputs sent back, no reference (``Checks(outputs=True, reference=False, inplace=False)``)."""
    for fields, peak in [({"vocab": 200_000}, 4840251392), ({"vocab": 200_000, "tp": 2}, 2424528896)]:
        sc = Scenario.from_dict({"name": "m", "samples": [[1000, 500]], **fields})
        est = scenario_bytes(sc, reference=False, outputs=True)
        assert 0.85 * peak < est < 1.25 * peak, (est / GiB, peak / GiB)


@pytest.mark.parametrize("fields", [HUGE_VOCAB, BIG_VOCAB], ids=["vocab-1e9", "vocab-2e7"])
def test_a_scenario_past_the_memory_is_one_line(cli_in_process, machine, tmp_path, fields):
    _one_line_error(cli_in_process("run", "--scenario-file", _file(tmp_path, fields)),
                    f"scenario {fields['name']!r} needs about", "GiB a rank", "8.0 GiB free", "--allow-large-world")


def test_replicas_count(cli_in_process, machine, tmp_path, runs):
    """A scenario that fits one rank may not fit four: every data-parallel replica holds it."""
    f = _file(tmp_path, TWO_GIB)
    assert cli_in_process("run", "--scenario-file", f).returncode == 0
    _one_line_error(cli_in_process("run", "--scenario-file", f, "--nproc", "4"),
                    "scenario 'two-gib' needs about 2.0 GiB a rank: 8.0 GiB for 4 ranks")
    assert cli_in_process("run", "--scenario-file", f, "--nproc", "4", "--allow-large-world").returncode == 0
    assert [c.nproc for c in runs] == [None, 4]


def test_scenarios_a_world_skips_are_not_counted(machine, tmp_path):
    """--nproc 3 skips a tp=2 scenario (2 does not divide 3): its memory is not asked for."""
    big_tp2 = Scenario.from_dict(BIG_VOCAB)
    limits.check_run([big_tp2, Scenario.from_dict(SMALL)], 3, machine=machine)
    with pytest.raises(BadInput, match="big-vocab"):
        limits.check_run([big_tp2], 2, machine=machine)


def test_invariance_counts_its_variants_and_what_the_controller_keeps(cli_in_process, machine, tmp_path):
    line = _one_line_error(cli_in_process("invariance", "--scenario-file", _file(tmp_path, BIG_VOCAB)),
                           "scenario 'big-vocab' needs about", "over its invariance variants",
                           "the controller keeps of their gradients")
    assert "for 4 ranks" in line  # invariance's world: at least 4
    from shardcheck.harness.controller.commands.invariance import AXES

    limits.check_invariance_world(get_suite("smoke"), list(AXES), None, machine=machine)
    limits.check_invariance_world([Scenario.from_dict(BIG_VOCAB)], list(AXES), None, machine=machine,
                            allow_large_world=True)


# -- timeouts ----------------------------------------------------------------------------------------
def test_check_timeout_bounds():
    assert limits.check_timeout(limits.MAX_TIMEOUT_S) == limits.MAX_TIMEOUT_S
    assert limits.check_timeout(0.5) == 0.5
    for bad in (math.nan, math.inf, -math.inf, 0.0, -1.0):
        with pytest.raises(BadInput, match="finite number of seconds > 0"):
            limits.check_timeout(bad)
    with pytest.raises(BadInput, match="more than the most a world can wait: 604800 s"):
        limits.check_timeout(limits.MAX_TIMEOUT_S * 1.001)


def test_the_bound_is_inside_what_torch_and_the_os_accept():
    """The world waits on its pipes with multiprocessing's wait (poll: whole milliseconds in a C
    int) for up to the timeout plus a grace, and hands the timeout to TCPStore and gloo as a
    timedelta (int64 nanoseconds past a steady clock)."""
    import torch.distributed as dist

    grace = 10.0
    assert (limits.MAX_TIMEOUT_S + grace) * 1000 < 2**31 - 1
    a, b = mp.Pipe()
    b.send(1)
    assert wait([a], timeout=limits.MAX_TIMEOUT_S + grace) == [a]  # ready: returns at once
    with pytest.raises(OverflowError):  # the edge the bound keeps away from
        wait([a], timeout=2**31 / 1000 + 1)
    td = datetime.timedelta(seconds=limits.MAX_TIMEOUT_S)
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=td)
    client = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=td)
    client.set("k", "v")
    master.wait(["k"], td)
    assert master.get("k") == b"v"


@pytest.mark.parametrize("args", [
    ["run"], ["invariance"], ["fuzz"], ["bisect", "--slime-repo", "x", "--good", "a", "--bad", "b"],
], ids=["run", "invariance", "fuzz", "bisect"])
@pytest.mark.parametrize("value,fragment", [
    ("1e12", "argument --timeout: 1e+12 is more than the most a world can wait: 604800 s"),
    ("nan", "argument --timeout: must be a finite number of seconds > 0, got nan"),
    ("inf", "argument --timeout: must be a finite number of seconds > 0, got inf"),
    ("0", "argument --timeout: must be a finite number of seconds > 0"),
    ("abc", "argument --timeout: invalid float value: 'abc'"),
])
def test_timeout_past_the_bound_is_one_line(cli_in_process, args, value, fragment):
    _one_line_error(cli_in_process(*args, "--timeout", value), fragment)


def test_the_largest_timeout_is_taken(cli_in_process, runs):
    proc = cli_in_process("run", "--scenario", "thd-tp1cp1-basic", "--timeout", str(limits.MAX_TIMEOUT_S))
    assert proc.returncode == 0, proc.stderr
    assert runs[0].timeout == limits.MAX_TIMEOUT_S


@pytest.mark.world
def test_a_world_runs_at_the_largest_timeout():
    """End to end at the bound: the store, gloo, megatron's groups and the controller's waits."""
    from shardcheck.harness.controller.worlds.spawned import SpawnedWorld

    [sc] = [s for s in get_suite("smoke") if s.name == "thd-tp1cp1-basic"]
    with SpawnedWorld(1, timeout=limits.MAX_TIMEOUT_S) as w:
        [result] = w.run(sc.to_dict(), "builtin")
    assert result.failures == [], [f.message for f in result.failures]
