"""The mutation check of the harness's own core: does the suite catch a bug planted in it?

Each mutation below plants one realistic bug (a sign, an off-by-one, a skipped element, NaN let
through, a 1-ulp difference counted as none, a collective's reduce op or phase not compared, an
in-place write not looked for in the backward, a verdict's ranks or findings lost) in one file of
the reference, the comparison, the layouts, the collective trace, the in-place check, the
invariance check or the verdicts, and names the test files that should catch it. A mutation
meets the bar when at least two of those tests fail, one of them end to end (a real world).

How: the repository's files (``git ls-files -co --exclude-standard``: the working tree, not
.venv or build outputs) are copied into a scratch folder, which gets a virtualenv of its own
whose site-packages reach the main venv's by a plain path in a .pth file (torch and
megatron-core without a second install; the main venv's own .pth files, shardcheck's editable
install of this checkout among them, are then not run) and an editable install of the copy.
A baseline run of every selected test must pass first; then each mutation is written into the
copy, its tests run with the scratch python, and the original text put back. The working tree
is never written. The scratch folder goes at the end (``--keep``: it stays), on Ctrl-C too.

    .venv/bin/python tools/mutation_check.py            # every mutation (about 7 minutes on 2 cores)
    .venv/bin/python tools/mutation_check.py --list     # the mutations, each checked against its file
    .venv/bin/python tools/mutation_check.py --only zigzag-chunks-swapped --keep

Exit status: 0 every mutation meets the bar, 1 some does not (or the baseline failed), 2 bad
input (an unknown --only, a snippet not found exactly once in its file, a test file missing).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAIN_VENV = ROOT / ".venv"
RUN_TIMEOUT_S = 600.0  # one mutation's pytest run; a run past it is killed and reported
BASELINE_TIMEOUT_S = 3600.0  # the baseline runs every selected file at once
SETUP_TIMEOUT_S = 300.0  # venv, pip install, collection
IDS_SHOWN = 3
# Files whose every test runs a real world: counted end to end even where a test lacks the
# `world` marker (the marker is what counts everywhere else).
END_TO_END_FILES = frozenset({"tests/test_run.py", "tests/test_lockstep.py"})
AREAS = ("reference", "comparison", "layout", "trace", "in-place", "invariance", "verdict")


class BadInput(Exception):
    """Input the check cannot run with: one line, exit status 2."""


@dataclass(frozen=True)
class Mutation:
    """One planted bug: ``old`` (found exactly once in ``file``) becomes ``new``."""

    name: str
    area: str
    file: str  # relative to the repository root
    old: str
    new: str
    tests: tuple[str, ...]  # test files or node ids, relative to the root
    bug: str  # the bug in words

    def test_files(self) -> list[str]:
        return [t.split("::", 1)[0] for t in self.tests]


MUTATIONS: tuple[Mutation, ...] = (
    # -- reference ---------------------------------------------------------------------------
    Mutation(
        "truth-entropy-sign", "reference", "reference/truth.py",
        "entropies[start:stop] = log_s - _row_dots(e, d) / big_s",
        "entropies[start:stop] = _row_dots(e, d) / big_s - log_s",
        ("tests/test_reference.py", "tests/test_compare.py"),
        "the truth's entropy has the wrong sign"),
    Mutation(
        "truth-grad-without-temperature", "reference", "reference/truth.py",
        "scale = total * temperature  # p / t = e / scale",
        "scale = total",
        ("tests/test_reference.py", "tests/test_compare.py"),
        "the truth's gradient leaves the softmax term undivided by the temperature"),
    Mutation(
        "policy-old-log-probs-from-entropy", "reference", "harness/rank/life/shard.py",
        "truth, _ = share_truth(data, layout)",
        "_, truth = share_truth(data, layout)",
        ("tests/test_shard.py", "tests/test_policy_loss.py"),
        "the policy batch's old log-probs are the truth's entropies (the ratio is not 1)"),
    # -- comparison --------------------------------------------------------------------------
    Mutation(
        "compare-nan-passes", "comparison", "harness/rank/checks/compare.py",
        "close = (got - want).abs() <= tol.atol + tol.rtol * want.abs()",
        "close = ~((got - want).abs() > tol.atol + tol.rtol * want.abs())",
        ("tests/test_compare.py",),
        "NaN is taken as close (NaN > tol is False)"),
    Mutation(
        "compare-last-output-skipped", "comparison", "harness/rank/checks/compare.py",
        "bad = mismatch_mask(got, want, tol).nonzero().flatten().tolist()",
        "bad = mismatch_mask(got[:-1], want[:-1], tol).nonzero().flatten().tolist()",
        ("tests/test_compare.py",),
        "a rank's last output value is never compared (off by one)"),
    Mutation(
        "compare-grad-columns-from-zero", "comparison", "harness/rank/checks/compare.py",
        "columns=slice(*layout.columns)",
        "columns=slice(0, layout.columns[1] - layout.columns[0])",
        ("tests/test_compare.py",),
        "the reference gradient of every TP rank is taken over TP rank 0's vocab columns"),
    # -- layout ------------------------------------------------------------------------------
    Mutation(
        "allgather-padding-rounded-down", "layout", "scenarios/layout.py",
        "return -(-total // unit) * unit // scenario.cp",
        "return total // unit * unit // scenario.cp",
        ("tests/test_layout.py", "tests/test_shard.py", "tests/test_run.py"),
        "all-gather CP rounds the packed length down to a multiple of cp * tp, not up"),
    Mutation(
        "zigzag-chunks-swapped", "layout", "scenarios/layout.py",
        "return [range(cp_rank * k, (cp_rank + 1) * k), range((2 * cp - 1 - cp_rank) * k, (2 * cp - cp_rank) * k)]",
        "return [range((2 * cp - 1 - cp_rank) * k, (2 * cp - cp_rank) * k), range(cp_rank * k, (cp_rank + 1) * k)]",
        ("tests/test_layout.py", "tests/test_shard.py", "tests/test_compare.py"),
        "a zigzag CP rank holds its two chunks in the wrong order"),
    Mutation(
        "first-response-row-unscored", "layout", "scenarios/layout.py",
        "if s.prompt - 1 <= position < s.total - 1:",
        "if s.prompt <= position < s.total - 1:",
        ("tests/test_layout.py", "tests/test_shard.py", "tests/test_compare.py"),
        "the row scoring response token 0 (row prompt - 1) counts as unscored"),
    # -- trace (the collective trace and the lockstep check) ------------------------------------
    Mutation(
        "reduce-op-not-fingerprinted", "trace", "harness/rank/plumbing/trace.py",
        "return (self.op, tuple(map(tuple, self.shapes)), self.dtype, self.reduce_op, self.root, self.phase,",
        "return (self.op, tuple(map(tuple, self.shapes)), self.dtype, self.root, self.phase,",
        ("tests/test_lockstep_channels.py", "tests/test_lockstep.py"),
        "the lockstep's digest leaves out the reduce op: MAX against SUM goes on"),
    Mutation(
        "backward-calls-traced-as-forward", "trace", "harness/rank/plumbing/trace.py",
        'phase = "backward" if node is not None else "forward"',
        'phase = "forward"',
        ("tests/test_lockstep.py", "tests/test_reports.py"),
        "every collective is recorded in the forward phase"),
    Mutation(
        "late-peer-taken-as-agreeing", "trace", "harness/rank/plumbing/arrivals.py",
        "if all(s == code or s == board_mod.AHEAD for s in said):",
        "if all(s in (code, board_mod.AHEAD, None) for s in said):",
        # the whole of test_lockstep.py would wait out a deadline per divergent call
        ("tests/test_lockstep_channels.py", "tests/test_lockstep.py::test_reduce_op_swap_is_caught",
         "tests/test_lockstep.py::test_same_shape_skip_is_caught_at_the_skipped_call",
         "tests/test_lockstep.py::test_builtin_passes_the_regressions"),
        "a peer that has not arrived yet reads as agreeing on the board: the call goes on unchecked"),
    # -- in-place ----------------------------------------------------------------------------
    Mutation(
        "backward-inputs-not-checked", "in-place", "harness/rank/checks/inplace.py",
        'life.found += self.guard.check("backward")',
        "pass",
        ("tests/test_inplace.py", "tests/test_lockstep.py::test_every_mutant_is_caught_with_its_kind_and_phase"),
        "the inputs and fed gradients are not compared again after the backward"),
    Mutation(
        "inplace-reported-in-every-phase", "in-place", "harness/rank/checks/inplace.py",
        "            if w.found_in is not None:\n                continue\n",
        "",
        ("tests/test_inplace.py",),
        "a tensor changed in the forward is reported again after the backward"),
    # -- invariance --------------------------------------------------------------------------
    Mutation(
        "one-ulp-counted-as-equal", "invariance", "harness/controller/commands/invariance.py",
        "count = int((ulp > 0).sum())",
        "count = int((ulp > 1).sum())",
        ("tests/test_invariance.py",),
        "a difference of one ulp counts as bitwise equal"),
    Mutation(
        "worst-difference-at-argmin", "invariance", "harness/controller/commands/invariance.py",
        "k = int(ulp.reshape(-1).argmax())",
        "k = int(ulp.reshape(-1).argmin())",
        ("tests/test_invariance.py",),
        "the difference reported is at the closest element, not the farthest"),
    # -- verdict -----------------------------------------------------------------------------
    Mutation(
        "merged-ranks-overwritten", "verdict", "harness/controller/reports/verdict.py",
        "m.ranks = sorted(set(m.ranks) | set(f.ranks))",
        "m.ranks = sorted(set(f.ranks))",
        ("tests/test_reports.py", "tests/test_faults.py::test_a_malformed_output_is_the_targets_and_names_its_compute"),
        "a finding every rank made names only the last rank merged"),
    Mutation(
        "layout-coverage-dropped", "verdict", "harness/controller/reports/verdict.py",
        "for res in [*results, RankResult(-1, None, coverage_failures(scenario, layouts))]:",
        "for res in results:",
        ("tests/test_traced_layout.py", "tests/test_verdict.py"),
        "the layout_mismatch findings about all ranks' rows together never reach the verdict"),
    Mutation(
        "any-timeout-is-timed-out", "verdict", "harness/controller/reports/verdict.py",
        'if any(f.kind == TIMEOUT for f in failures) and all(\n'
        '            f.kind == TIMEOUT or "waited_for" in f.details for f in failures):',
        "if any(f.kind == TIMEOUT for f in failures):",
        ("tests/test_json_report.py", "tests/test_verdict.py",
         "tests/test_faults.py::test_a_hang_names_the_rank_that_did_not_arrive_and_where_it_was",
         "tests/test_faults.py::test_the_rank_that_did_not_come_heads_the_verdict_when_replicas_finished",
         "tests/test_faults.py::test_a_deadline_missed_while_waiting_for_a_cpu_is_the_machines_and_a_wrong_value_beside_it_the_targets",
         "tests/test_simulate.py::test_a_simulation_starved_of_cpu_times_out_and_is_not_blamed_on_the_target"),
        "a verdict with a real finding beside a missed deadline is timed out (exit 3), not failed"),
)


# -- checking the list ---------------------------------------------------------------------------
def check_mutations(mutations: Sequence[Mutation], tree: Path) -> None:
    """Every ``old`` occurs exactly once in its file of ``tree`` and every test file exists, so
    the list cannot rot silently; BadInput names the first that does not."""
    names = [m.name for m in mutations]
    if len(set(names)) != len(names):
        raise BadInput("two mutations share a name")
    for m in mutations:
        if m.area not in AREAS:
            raise BadInput(f"mutation {m.name}: unknown area {m.area!r} (areas: {', '.join(AREAS)})")
        path = tree / m.file
        if not path.is_file():
            raise BadInput(f"mutation {m.name}: {m.file} does not exist")
        found = path.read_text().count(m.old)
        if found != 1:
            raise BadInput(f"mutation {m.name}: its old text occurs {found} times in {m.file}, not once")
        if m.old == m.new:
            raise BadInput(f"mutation {m.name}: old and new are the same text")
        for f in m.test_files():
            if not (tree / f).is_file():
                raise BadInput(f"mutation {m.name}: test file {f} does not exist")


def select(mutations: Sequence[Mutation], only: str | None) -> list[Mutation]:
    if only is None:
        return list(mutations)
    chosen = [m for m in mutations if m.name == only]
    if not chosen:
        raise BadInput(f"no mutation named {only!r} (--list shows them)")
    return chosen


def pytest_targets(mutations: Iterable[Mutation]) -> list[str]:
    """The files and node ids to run, once each: a node id whose whole file runs is left out."""
    targets = list(dict.fromkeys(t for m in mutations for t in m.tests))
    whole = {t for t in targets if "::" not in t}
    return [t for t in targets if "::" not in t or t.split("::", 1)[0] not in whole]


# -- the scratch copy ------------------------------------------------------------------------------
def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True,
                          timeout=60).stdout


def copy_working_tree(dest: Path) -> int:
    """The working tree's tracked and untracked-not-ignored files into ``dest``; how many."""
    paths = [p for p in _git("ls-files", "-co", "--exclude-standard", "-z").split("\0") if p]
    copied = 0
    for rel in paths:
        src, dst = ROOT / rel, dest / rel
        if not src.exists() and not src.is_symlink():  # deleted in the working tree
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), dst)
        elif src.is_dir():  # a submodule's folder
            shutil.copytree(src, dst, symlinks=True)
        else:
            shutil.copy2(src, dst)
        copied += 1
    return copied


def _run_checked(cmd: Sequence[str], what: str, **kwargs: object) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=SETUP_TIMEOUT_S, **kwargs)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}): {(proc.stdout + proc.stderr)[-2000:]}")
    return proc


def main_venv_paths() -> tuple[str, str]:
    """(the main venv's site-packages, the interpreter it was made from)."""
    python = MAIN_VENV / "bin" / "python"
    if not python.exists():
        raise BadInput(f"no virtualenv at {MAIN_VENV}: the scratch venv reaches its site-packages")
    out = _run_checked([str(python), "-c", "import sys, sysconfig; print(sysconfig.get_paths()['purelib']); "
                        "print(sys._base_executable)"], "asking the main venv for its paths").stdout.split("\n")
    return out[0], out[1]


def make_scratch_venv(venv: Path) -> Path:
    """A virtualenv whose site-packages reach the main venv's by a plain path (torch, pytest, pip
    and setuptools from there, without running the .pth files there); its python."""
    site_packages, base_python = main_venv_paths()
    _run_checked([base_python, "-m", "venv", "--without-pip", str(venv)], "making the scratch venv")
    python = venv / "bin" / "python"
    own = _run_checked([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                       "asking the scratch venv for its site-packages").stdout.strip()
    Path(own, "main_venv.pth").write_text(site_packages + "\n")
    return python


def scratch_env(venv: Path) -> dict[str, str]:
    """The environment the copy's tests run in: the scratch venv's bin first on PATH (the
    `shardcheck` command), no PYTHONPATH leading elsewhere, no bytecode written (a mutation
    the same size as the original, written in the same second, would load a stale .pyc)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = os.pathsep.join([str(venv / "bin"), env.get("PATH", "")])
    env["VIRTUAL_ENV"] = str(venv)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def install_copy(python: Path, copy: Path, env: dict[str, str], cwd: Path) -> None:
    """``pip install -e`` the copy into the scratch venv, then make sure shardcheck (and its
    folders mapped by pyproject.toml) import from the copy, not from this checkout."""
    _run_checked([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", str(copy)],
                 "installing the copy into the scratch venv", env=env, cwd=cwd)
    modules = ("shardcheck", "shardcheck.harness", "shardcheck.reference", "shardcheck.scenarios", "shardcheck.targets")
    code = f"import importlib; [print(importlib.import_module(m).__file__) for m in {modules!r}]"
    files = _run_checked([str(python), "-c", code], "importing shardcheck in the scratch venv", env=env,
                         cwd=cwd).stdout.split()
    outside = [f for f in files if not Path(f).resolve().is_relative_to(copy.resolve())]
    if outside or len(files) != len(modules):
        raise RuntimeError(f"the scratch venv imports shardcheck from outside the copy {copy}: {outside or files}")
    if not (python.parent / "shardcheck").exists():
        raise RuntimeError(f"the scratch venv has no shardcheck command in {python.parent}")


# -- running pytest --------------------------------------------------------------------------------
@dataclass
class PytestRun:
    failing: list[str]  # node ids of tests that failed or errored, in order
    passed: int
    returncode: int | None  # None: killed at the timeout
    seconds: float
    log: Path

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (ranks may sit in sessions of their own)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found: list[int] = []
    frontier = {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - set(found)
        found += sorted(frontier)
    return found


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a pytest run this script started: its process group and every process below it."""
    below = _descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    for pid in below:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    proc.wait()


def run_pytest(python: Path, copy: Path, targets: Sequence[str], env: dict[str, str], timeout: float,
               log: Path) -> PytestRun:
    """``pytest -v TARGETS`` in the copy, its output in ``log`` (and a JUnit file beside it)."""
    junit = log.with_suffix(".xml")
    cmd = [str(python), "-m", "pytest", "-v", "-rfE", "-p", "no:cacheprovider", "-p", "no:randomly",
           "-o", "junit_family=xunit1", f"--junitxml={junit}", *targets]
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=copy, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            returncode: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            returncode = None
        except BaseException:  # Ctrl-C: leave no pytest or rank behind
            kill_tree(proc)
            raise
    seconds = time.perf_counter() - t0
    text = log.read_text(errors="replace")
    if returncode is not None and junit.exists():
        failing, passed = results_from_junit(junit)
    else:  # killed: what the verbose lines said until then
        failing, passed = results_from_output(text)
    if returncode not in (None, 0, 1) and not failing:  # pytest itself failed (usage, internal error)
        raise RuntimeError(f"pytest exited {returncode} with no failing test: {text[-2000:]}")
    return PytestRun(failing, passed, returncode, seconds, log)


def results_from_junit(path: Path) -> tuple[list[str], int]:
    """(failing node ids, passed count) from a JUnit file written with junit_family=xunit1."""
    failing, passed = [], 0
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        outcome = {child.tag for child in case}
        if outcome & {"failure", "error"}:
            failing.append(_node_id(case.attrib))
        elif not outcome & {"skipped"}:
            passed += 1
    return list(dict.fromkeys(failing)), passed


def _node_id(attrs: dict[str, str]) -> str:
    file, classname, name = attrs.get("file"), attrs.get("classname", ""), attrs.get("name", "")
    if not file:  # a collection error: the name is the module's
        return name
    module = file.removesuffix(".py").replace("/", ".")
    inner = classname[len(module) + 1:].replace(".", "::") if classname.startswith(module + ".") else ""
    return "::".join(p for p in (file, inner, name) if p)


_VERBOSE_LINE = re.compile(r"^(\S+\.py::.*?) (PASSED|FAILED|ERROR)(?: |$)")
_COLLECTION_ERROR = re.compile(r"^ERROR (\S+\.py)(?: - |$)")


def results_from_output(text: str) -> tuple[list[str], int]:
    """(failing node ids, passed count) from pytest -v's lines, for a run killed before its end."""
    failing, passed = [], 0
    for line in text.splitlines():
        m = _VERBOSE_LINE.match(line)
        if m and m.group(2) == "PASSED":
            passed += 1
        elif m:
            failing.append(m.group(1))
        elif c := _COLLECTION_ERROR.match(line):
            failing.append(c.group(1))
    return list(dict.fromkeys(failing)), passed


def world_test_ids(python: Path, copy: Path, targets: Sequence[str], env: dict[str, str]) -> set[str]:
    """The node ids carrying the `world` marker (a real multi-process world), unmutated."""
    proc = subprocess.run([str(python), "-m", "pytest", "--collect-only", "-q", "-m", "world", "-p", "no:cacheprovider",
                           "-p", "no:randomly", *targets], cwd=copy, env=env, capture_output=True, text=True,
                          timeout=SETUP_TIMEOUT_S)
    if proc.returncode not in (0, 5):  # 5: nothing selected
        raise RuntimeError(f"collecting the world tests failed (exit {proc.returncode}): {proc.stdout[-2000:]}")
    return {line.strip() for line in proc.stdout.splitlines() if "::" in line}


# -- one mutation ----------------------------------------------------------------------------------
@dataclass
class Outcome:
    mutation: Mutation
    run: PytestRun
    end_to_end: list[str]  # the failing tests that run a real world

    @property
    def meets_bar(self) -> bool:
        return len(self.run.failing) >= 2 and bool(self.end_to_end)

    def verdict(self) -> str:
        if self.meets_bar:
            word = "meets the bar"
        elif not self.run.failing:
            word = "NOT CAUGHT"
        elif len(self.run.failing) < 2:
            word = "one test only"
        else:
            word = "no end-to-end test"
        return word + (f" (killed at {self.run.seconds:.0f} s)" if self.run.timed_out else "")


def is_end_to_end(node_id: str, world_ids: set[str]) -> bool:
    return node_id in world_ids or node_id.split("::", 1)[0] in END_TO_END_FILES


def try_mutation(m: Mutation, python: Path, copy: Path, env: dict[str, str], world_ids: set[str],
                 timeout: float, logs: Path) -> Outcome:
    """Plant ``m`` in the copy, run its tests, put the original text back (whatever happens)."""
    path = copy / m.file
    original = path.read_text()
    if original.count(m.old) != 1:
        raise BadInput(f"mutation {m.name}: its old text occurs {original.count(m.old)} times in {m.file}, not once")
    path.write_text(original.replace(m.old, m.new))
    try:
        run = run_pytest(python, copy, m.tests, env, timeout, logs / f"{m.name}.log")
    finally:
        path.write_text(original)
    return Outcome(m, run, [t for t in run.failing if is_end_to_end(t, world_ids)])


# -- the report ------------------------------------------------------------------------------------
def render_table(outcomes: Sequence[Outcome]) -> str:
    header = ("mutation", "area", "failing", "e2e", "verdict")
    rows = [(o.mutation.name, o.mutation.area, str(len(o.run.failing)), "yes" if o.end_to_end else "no", o.verdict())
            for o in outcomes]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def render_failing(outcomes: Sequence[Outcome]) -> str:
    """The first failing tests of each mutation (end-to-end ones marked)."""
    lines = []
    for o in outcomes:
        e2e = set(o.end_to_end)
        shown = sorted(o.run.failing, key=lambda t: t not in e2e)[:IDS_SHOWN]  # an end-to-end one first
        more = len(o.run.failing) - len(shown)
        names = ", ".join(t + (" [e2e]" if t in e2e else "") for t in shown) or "none"
        lines.append(f"{o.mutation.name}: {names}" + (f" (+{more} more)" if more > 0 else ""))
    return "\n".join(lines)


def score_line(outcomes: Sequence[Outcome]) -> str:
    caught = sum(o.meets_bar for o in outcomes)
    return f"{caught} of {len(outcomes)} mutations caught by >= 2 tests, one end to end"


def describe_commit() -> str:
    commit = _git("rev-parse", "--short", "HEAD").strip()
    return commit + (" with uncommitted changes" if _git("status", "--porcelain").strip() else "")


def render_list(mutations: Sequence[Mutation]) -> str:
    lines = []
    for m in mutations:
        lines.append(f"{m.name} [{m.area}] {m.file}: {m.bug}")
        lines.append(f"    tests: {' '.join(m.tests)}")
    return "\n".join(lines)


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# -- the whole check -------------------------------------------------------------------------------
def _stop_on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # the same way out as Ctrl-C: the scratch folder and runs go


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tools/mutation_check.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", metavar="NAME", help="run this mutation alone")
    p.add_argument("--list", action="store_true", help="list the mutations (each checked against its file) and exit")
    p.add_argument("--keep", action="store_true", help="keep the scratch folder (the copy, the venv, each run's log)")
    p.add_argument("--timeout", type=float, default=RUN_TIMEOUT_S, metavar="S",
                   help=f"seconds one mutation's pytest run may take (default {RUN_TIMEOUT_S:.0f})")
    return p.parse_args(argv)


def run_check(mutations: Sequence[Mutation], timeout: float, scratch: Path) -> tuple[int, str]:
    """(exit status, the commit the copy was taken at)."""
    copy, venv, logs = scratch / "repo", scratch / "venv", scratch / "logs"
    logs.mkdir(parents=True)
    commit = describe_commit()  # now: others may commit while the check runs
    copied = copy_working_tree(copy)
    say(f"copied {copied} files of the working tree ({commit}) into {copy}")
    check_mutations(mutations, copy)
    python = make_scratch_venv(venv)
    env = scratch_env(venv)
    install_copy(python, copy, env, cwd=scratch)
    targets = pytest_targets(mutations)
    world_ids = world_test_ids(python, copy, targets, env)
    say(f"baseline: {' '.join(targets)} ({len(world_ids)} end-to-end tests among them)")
    baseline = run_pytest(python, copy, targets, env, BASELINE_TIMEOUT_S, logs / "baseline.log")
    if baseline.timed_out or baseline.failing:
        why = f"killed after {baseline.seconds:.0f} s" if baseline.timed_out else "failing"
        say(f"the baseline is not green ({why}; log: {baseline.log}): " + (", ".join(baseline.failing) or "no result"))
        return 1, commit
    say(f"baseline: {baseline.passed} passed in {baseline.seconds:.0f} s")
    outcomes = []
    for i, m in enumerate(mutations, 1):
        o = try_mutation(m, python, copy, env, world_ids, timeout, logs)
        say(f"[{i}/{len(mutations)}] {m.name}: {len(o.run.failing)} failing, end to end: "
            f"{'yes' if o.end_to_end else 'no'} ({o.run.seconds:.0f} s) - {o.verdict()}")
        outcomes.append(o)
    print(render_table(outcomes))
    print()
    print(render_failing(outcomes))
    print()
    print(score_line(outcomes))
    return (0 if all(o.meets_bar for o in outcomes) else 1), commit


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    try:
        mutations = select(MUTATIONS, args.only)
        check_mutations(mutations, ROOT)
    except BadInput as exc:
        print(f"mutation_check: {exc}", file=sys.stderr)
        return 2
    if args.list:
        print(render_list(mutations))
        return 0
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    started = time.perf_counter()
    scratch = Path(tempfile.mkdtemp(prefix="shardcheck-mutation-"))
    try:
        code, commit = run_check(mutations, args.timeout, scratch)
    except BadInput as exc:
        print(f"mutation_check: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # the scratch venv or pytest itself failed: nothing was measured
        print(f"mutation_check: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        say("stopped")
        return 130
    finally:
        if args.keep:
            say(f"kept {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    python = Path(sys.executable)
    shown = os.path.relpath(python, ROOT) if python.is_relative_to(ROOT) else str(python)
    print(f"commit {commit}; {time.perf_counter() - started:.0f} s")
    print(f"command: {shlex.join([shown, os.path.relpath(__file__, ROOT), *argv])}")
    return code


if __name__ == "__main__":
    sys.exit(main())
