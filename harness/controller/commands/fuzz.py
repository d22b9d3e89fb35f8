"""Property-based search for a failing scenario.

Hypothesis draws scenarios (:mod:`shardcheck.scenarios.strategies`), one world started once runs
each of them through :func:`shardcheck.harness.controller.commands.runner.run`, and a ``fail`` verdict is the
property's failure: hypothesis shrinks it to the smallest scenario that still fails, which is
written as a scenario file that ``shardcheck run --scenario-file`` replays.

Failing examples are kept in hypothesis' example database (``.shardcheck/hypothesis``), under a
key made of the target and the search space, so the next search for that target tries them first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import os
import random
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from hypothesis import HealthCheck, Phase, Verbosity, assume, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase
from hypothesis.errors import Flaky, Unsatisfiable

from shardcheck.errors import BadInput, ShardcheckError
from shardcheck.harness.controller.commands import runner
from shardcheck.harness.controller.reports.run_report import SilentReport
from shardcheck.harness.controller.reports.verdict import ERROR, FAIL, PASS, SKIP, Verdict
from shardcheck.harness.controller.worlds.choice import World, world_for
from shardcheck.scenarios import strategies
from shardcheck.scenarios.scenario import LAYOUTS, SP_LAYOUTS, Scenario

DEFAULT_DATABASE = ".shardcheck/hypothesis"
DEFAULT_OUT = ".shardcheck/fuzz-failure.json"


@contextlib.contextmanager
def hypothesis_home(directory: str) -> Iterator[None]:
    """hypothesis' own files (its cache of constants) under ``directory``, beside the example
    database, not in a ``.hypothesis/`` of the current folder; as it was afterwards."""
    import hypothesis.configuration as configuration

    before = getattr(configuration, "__hypothesis_home_directory", None)  # a module global, not mangled
    configuration.set_hypothesis_home_dir(directory)
    try:
        yield
    finally:
        configuration.set_hypothesis_home_dir(before)
DEFAULT_TP = (1, 2, 4)
DEFAULT_CP = (1, 2, 4)
AUTO_MAX_RANKS = 4  # without --nproc, (tp, cp) pairs needing more ranks are left out
MAX_RANKS = 16


@dataclass
class Event:
    """One scenario the search ran (not the ones it answered from its cache)."""

    number: int
    shrinking: bool
    verdict: Verdict
    elapsed: float


@dataclass
class FuzzResult:
    target: str
    seed: int
    nproc: int
    pairs: list[tuple[int, int]]  # the (tp, cp) the search drew from
    layouts: list[str]
    searched: int = 0  # distinct scenarios run until the first failure (or the end)
    shrink_runs: int = 0  # distinct scenarios run while shrinking
    counts: dict[str, int] = field(default_factory=lambda: {PASS: 0, FAIL: 0, SKIP: 0})
    failure: Verdict | None = None  # the minimal failing verdict
    first_failure: Verdict | None = None  # as first found, before shrinking
    flaky: bool = False  # the minimal scenario did not fail again when hypothesis replayed it
    shrink_budget_spent: bool = False
    startup_seconds: list[float] = field(default_factory=list)
    scenario_seconds: float = 0.0  # time inside the world, start-up excluded
    wall_seconds: float = 0.0

    @property
    def runs(self) -> int:
        return self.searched + self.shrink_runs

    @property
    def exit_code(self) -> int:
        return 1 if self.failure is not None else 0

    def minimal_scenario(self, name: str = "fuzz-minimal") -> Scenario | None:
        """The minimal failing scenario, named and described for a scenario file."""
        if self.failure is None:
            return None
        v = self.failure
        about = f"found by shardcheck fuzz --target {self.target} --seed {self.seed}: {v.headline()}"
        return dataclasses.replace(v.scenario, name=name, description=about[:400])


class _Found(Exception):
    """A failing verdict, raised for hypothesis to shrink (always from one place, so hypothesis
    sees one bug)."""


class _Search:
    """The property hypothesis tests: run a scenario (once: hypothesis may draw it again) and
    fail when its verdict does."""

    def __init__(self, result: FuzzResult, target_spec: str, world: World, max_shrinks: int,
                 progress: Callable[[Event], None] | None, inplace: bool = True) -> None:
        self.result, self.target_spec, self.world = result, target_spec, world
        self.max_shrinks, self.progress = max_shrinks, progress
        self.inplace = inplace  # False: a known write into the inputs does not end the search
        self.cache: dict[str, Verdict] = {}
        self.error: Exception | None = None
        self.last: Verdict | None = None  # hypothesis replays the minimal failing example last
        self.skip_reason = "nothing could be drawn"
        self.t0 = time.perf_counter()

    def check(self, sc: Scenario) -> None:
        if self.error is not None:  # the world is lost: end the search as fast as hypothesis lets us
            raise self.error
        verdict = self.cache.get(sc.key)
        if verdict is None:
            r = self.result
            if r.first_failure is not None and r.shrink_runs >= self.max_shrinks:
                r.shrink_budget_spent = True
                return  # unknown counts as passing: the shrinker settles on the smallest it has
            verdict = self._run(sc)
        if verdict.status == ERROR:  # the harness's own failure (a plugin's check): not the target's to shrink
            self.error = ShardcheckError(f"scenario {sc.name!r}: {verdict.headline()}")
            raise self.error
        assume(verdict.status != SKIP)  # outside the target's capabilities: not an example
        if verdict.status == FAIL:
            self.last = verdict
            raise _Found(verdict.headline())

    def _run(self, sc: Scenario) -> Verdict:
        r = self.result
        shrinking = r.first_failure is not None
        starts = len(self.world.startup_seconds)
        started = time.perf_counter()
        try:
            [verdict] = runner.run([sc], self.target_spec, reporter=SilentReport(), nproc=self.world.nproc,
                                   world=self.world, inplace=self.inplace).verdicts
        except Exception as exc:
            self.error = exc
            raise
        restarts = sum(self.world.startup_seconds[starts:])  # after a hang: stated apart, like the first
        r.scenario_seconds += time.perf_counter() - started - restarts
        self.cache[sc.key] = verdict
        r.counts[verdict.status] = r.counts.get(verdict.status, 0) + 1  # a timeout: no finding, searched on
        if verdict.status == SKIP:
            self.skip_reason = verdict.reason or self.skip_reason
        if shrinking:
            r.shrink_runs += 1
        else:
            r.searched += 1
        if verdict.status == FAIL and r.first_failure is None:
            r.first_failure = verdict
        if self.progress is not None:
            self.progress(Event(r.runs, shrinking, verdict, time.perf_counter() - self.t0))
        return verdict


def plan_world(tp: Sequence[int], cp: Sequence[int], layouts: Sequence[str],
               nproc: int | None, max_ranks: int = MAX_RANKS,
               sp: Sequence[int] | None = None) -> tuple[int, list[tuple[int, int]]]:
    """The world size and the (tp, sequence size) pairs a search draws from: every pair whose
    product divides the world, so data-parallel replicas fill it (as a suite run does). The
    sequence size is a cp (``cp``) for the Megatron family's layouts and an sp (``sp``, default
    ``cp``) for the sequence-parallel ones."""
    sp = cp if sp is None else sp
    for name, values in (("tp", tp), ("cp", cp), ("sp", sp)):
        if not values:
            raise BadInput(f"--{name} needs at least one value")
        for v in values:
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise BadInput(f"--{name} values must be integers >= 1, got {v!r}")
    pairs = sorted({(t, c) for t in tp for c in sorted(set(cp) | set(sp))
                    if any(drawable(name, c, cp, sp) for name in layouts)})
    if not pairs:
        raise BadInput(f"no tp in {sorted(tp)} and cp in {sorted(cp)} (sp in {sorted(sp)}) fits the layouts "
                       f"{list(layouts)} (thd and bshd need cp 1, zigzag and allgather cp >= 2, ulysses and ring "
                       "sp >= 2)")
    if nproc is None:
        small = [t * c for t, c in pairs if t * c <= AUTO_MAX_RANKS]
        if not small:
            raise BadInput(f"every tp * cp asked for exceeds {AUTO_MAX_RANKS} ranks: give --nproc")
        nproc = math.lcm(*small)
    if not 1 <= nproc <= max_ranks:
        raise BadInput(f"--nproc must be between 1 and {max_ranks}, got {nproc}")
    fitting = [(t, c) for t, c in pairs if nproc % (t * c) == 0]
    if not fitting:
        raise BadInput(f"no tp * cp among {sorted({t * c for t, c in pairs})} divides a world of {nproc} ranks")
    return nproc, fitting


def drawable(layout: str, seq: int, cp: Sequence[int], sp: Sequence[int]) -> bool:
    """Whether a search draws ``layout`` with its sequence over ``seq`` ranks: a size of its own
    family's list (sp for the sequence-parallel layouts, cp for the others) that it fits."""
    return strategies.layout_fits(layout, seq) and seq in (sp if layout in SP_LAYOUTS else cp)


class _Namespaced(ExampleDatabase):
    """hypothesis' directory database with its keys prefixed, so each target and search space has
    its own failures (the test function, hence hypothesis' own key, is the same for all)."""

    def __init__(self, inner: ExampleDatabase, namespace: str) -> None:
        super().__init__()
        self.inner = inner
        self.prefix = hashlib.sha256(namespace.encode()).hexdigest()[:16].encode() + b"."

    def save(self, key: bytes, value: bytes) -> None:
        self.inner.save(self.prefix + key, value)

    def fetch(self, key: bytes) -> Iterable[bytes]:
        return self.inner.fetch(self.prefix + key)

    def delete(self, key: bytes, value: bytes) -> None:
        self.inner.delete(self.prefix + key, value)

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:
        self.inner.move(self.prefix + src, self.prefix + dest, value)


def fuzz(
    target_spec: str,
    *,
    max_examples: int = 100,
    seed: int | None = None,
    tp: Sequence[int] = DEFAULT_TP,
    cp: Sequence[int] = DEFAULT_CP,
    layouts: Sequence[str] | None = None,
    nproc: int | None = None,
    sp: Sequence[int] | None = None,
    max_samples: int = strategies.MAX_SAMPLES,
    max_total: int = strategies.MAX_TOTAL,
    max_shrinks: int = 300,
    timeout: float = 60.0,
    lockstep: bool = True,
    backend: str = "gloo",
    database: str | None = DEFAULT_DATABASE,
    world: World | None = None,
    progress: Callable[[Event], None] | None = None,
    on_start: Callable[[FuzzResult], None] | None = None,
    max_ranks: int = MAX_RANKS,
    inplace: bool = True,
) -> FuzzResult:
    """Search for a scenario the target fails; shrink the first one found to a minimal one.

    All examples run in one world: ``world`` if given (its size then bounds tp * cp), otherwise
    one started here before the search and closed after it. ``max_shrinks`` bounds the distinct
    scenarios run while shrinking; past it, the smallest failure so far is the answer.
    ``on_start`` sees the plan (seed, world size, pairs, layouts) before the world starts.
    ``inplace`` (``--no-inplace``: False) checks that the target leaves its inputs unchanged; off,
    a target known to write into them is searched for its other failures.
    """
    from shardcheck.harness.controller.commands.runner import controller_target

    if max_examples < 1:
        raise BadInput(f"--max-examples must be >= 1, got {max_examples}")
    if seed is not None and (not isinstance(seed, int) or seed < 0):
        raise BadInput(f"--seed must be an integer >= 0, got {seed!r}")
    if not timeout > 0:
        raise BadInput(f"--timeout must be > 0, got {timeout}")
    if max_shrinks < 0:
        raise BadInput(f"--max-shrinks must be >= 0, got {max_shrinks}")
    if not (1 <= max_samples and 2 <= max_total):
        raise BadInput(f"need max_samples >= 1 and max_total >= 2, got {max_samples}, {max_total}")
    asked = list(layouts) if layouts is not None else list(LAYOUTS)
    unknown = [name for name in asked if name not in LAYOUTS]
    if unknown:
        raise BadInput(f"unknown layout(s) {', '.join(unknown)} (known: {', '.join(LAYOUTS)})")
    caps = controller_target(target_spec).capabilities
    usable = [name for name in asked if name in caps.layouts]
    if not usable:
        raise BadInput(f"target {target_spec!r} supports none of the layouts {asked}")
    dtype = "float32" if "float32" in caps.dtypes else sorted(caps.dtypes)[0]
    entropy = strategies.ENTROPY if caps.entropy else ((False, 0.0),)
    replay_keep = (False, True) if caps.replay_keep else (False,)  # shrinking heads to no keep sets
    sampling = strategies.SAMPLING if caps.sampling else ((0, 1.0),)
    tp = [t for t in tp if caps.tp_sizes is None or t in caps.tp_sizes]
    sp = list(cp) if sp is None else list(sp)  # before cp is narrowed: the sp layouts' sizes are their own
    cp = [c for c in cp if caps.cp_sizes is None or c in caps.cp_sizes]
    if not tp or not cp:
        raise BadInput(f"target {target_spec!r} runs at none of the {'tp' if not tp else 'cp'} sizes asked for "
                       f"(it supports {sorted(caps.tp_sizes if not tp else caps.cp_sizes)})")
    size, pairs = plan_world(tp, cp, usable, world.nproc if world is not None else nproc, max_ranks, sp)
    # the world is chosen before the search (nccl that cannot be had is BadInput now); it starts later
    chosen = world_for(size, given=world, backend=backend, timeout=timeout, lockstep=lockstep)
    seed = random.randrange(2**32) if seed is None else seed
    result = FuzzResult(target_spec, seed, size, pairs, usable)
    strategy = strategies.scenarios(
        tp=sorted({t for t, _ in pairs}), cp=sorted({c for _, c in pairs}), layout=usable, ranks=size,
        entropy=entropy, dtype=dtype, replay_keep=replay_keep, sampling=sampling, max_samples=max_samples,
        max_total=max_total,
    )
    if sorted(set(sp)) != sorted(set(cp)):  # each family at its own sizes
        strategy = strategy.filter(lambda sc: drawable(sc.layout, sc.seq, cp, sp))
    active = chosen.world
    runs = _Search(result, target_spec, active, max_shrinks, progress, inplace)
    namespace = repr((target_spec, pairs, usable, size, max_samples, max_total, dtype, entropy, replay_keep,
                      sampling))
    if sorted(set(sp)) != sorted(set(cp)):
        namespace += f" sp={sorted(set(sp))}"
    if not inplace:  # failures of the input check are not this search's to try first
        namespace += " no-inplace"
    db = _Namespaced(DirectoryBasedExampleDatabase(database), namespace) if database is not None else None
    search = settings(
        max_examples=max_examples, deadline=None, database=db,
        phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink), verbosity=Verbosity.quiet,
        report_multiple_bugs=False, suppress_health_check=(HealthCheck.too_slow, HealthCheck.filter_too_much),
        print_blob=False,
    )(hypothesis_seed(seed)(given(strategy)(runs.check)))

    if on_start is not None:
        on_start(result)
    begun = time.perf_counter()
    starts_before = len(active.startup_seconds)
    try:
        active.ensure_ready()  # before the search: start-up is not charged to any example
        runs.t0 = time.perf_counter()
        try:
            with hypothesis_home(os.path.join(os.path.dirname(database or DEFAULT_DATABASE), "hypothesis-home")):
                search()
        except _Found:
            pass
        except Flaky:
            result.flaky = True
        except Unsatisfiable:
            if result.counts[PASS] + result.counts[FAIL] == 0:
                raise BadInput(f"target {target_spec!r} skipped every scenario drawn: {runs.skip_reason}") from None
        if runs.error is not None:
            raise runs.error
        result.failure = runs.last
    finally:
        result.startup_seconds = list(active.startup_seconds[starts_before:])
        if chosen.owned:
            active.close()
        result.wall_seconds = time.perf_counter() - begun
    return result
