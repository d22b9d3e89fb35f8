"""Runs scenarios against a target on one reused world and turns rank results into verdicts."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from shardcheck.harness.controller.reports.verdict import ERROR, FAIL, SKIP, TIMED_OUT, RunInfo, Verdict, merge
from shardcheck.harness.controller.reports.reach_report import Reach
from shardcheck.harness.controller.commands.repro import target_refusal
from shardcheck.harness.controller.worlds.choice import World, world_for
from shardcheck.harness import wire
from shardcheck.harness.wire import EXPLAIN, ROOT_CAUSES
from shardcheck.scenarios.scenario import Scenario
from shardcheck.targets import Target, resolve
from shardcheck.run_config import RunConfig, active, effective, in_effect
from shardcheck.targets.base import TargetConfig, data_path, knob_skip_reason, step_skip_reason


class Reporter(Protocol):
    def start(self, info: RunInfo, scenarios: list[Scenario]) -> None: ...
    def add(self, verdict: Verdict) -> None: ...
    def finish(self, info: RunInfo) -> None: ...


@dataclass
class RunResult:
    verdicts: list[Verdict]
    info: RunInfo

    @property
    def exit_code(self) -> int:
        if any(v.status == FAIL for v in self.verdicts):
            return 1
        if any(v.status == ERROR for v in self.verdicts):  # the harness's own failure: no finding either way
            return 2
        return 3 if any(v.status == TIMED_OUT for v in self.verdicts) else 0


_RESOLVED: dict[tuple, Target] = {}


def controller_target(spec: str, config: RunConfig | None = None) -> Target:
    """The target as the controller needs it (capabilities, contract, a description until the
    ranks give theirs), configured by ``config`` (default: the run configuration in effect),
    resolved once per spec, configuration and setting: a user's ``SHARDCHECK_*`` variable (a
    commit pin) changes what a spec names, so it is part of the key. For slime resolving is a
    ``git rev-parse`` and a parse of its source: a fuzz search or a pytest session must not pay
    it per scenario."""
    config = (config or effective(spec)).for_target(spec)
    key = (spec, config.target_key(), tuple(sorted(wire.user_settings().items())))
    if key not in _RESOLVED:
        _RESOLVED[key] = resolve(spec, TargetConfig.of_run(config))
    return _RESOLVED[key]


def _place(verdict: Verdict, placement: dict[int, str] | None) -> None:
    """Name where each rank of a hang or a crash runs, when the world spans machines."""
    if not placement:
        return
    for f in verdict.failures:
        if f.kind in ROOT_CAUSES:
            ranks = sorted(set(f.ranks) | {int(r) for r in f.details.get("sides", {})})
            f.details["placement"] = {str(r): placement[r] for r in ranks if r in placement}


def _layout_note(target: Target, scenario: Scenario) -> str | None:
    """Why the target's own data path did not lay the scenario out (None: it did, or it has none)."""
    path = data_path(target)
    return path.builds(scenario) if path is not None else None


def _unexplained(verdict: Verdict) -> bool:
    """Whether a failure says a run with ``explain`` would name its call site."""
    return any(f.details.get(EXPLAIN) for f in verdict.failures)


def _explained(first: Verdict, again: Verdict) -> Verdict:
    """The second run's verdict when it found those kinds again (now with their call sites);
    else the first, saying that they did not happen again."""
    wanted = {f.kind for f in first.failures if f.details.get(EXPLAIN)}
    if set(again.kinds) >= wanted:
        for f in again.failures:
            f.details.pop(EXPLAIN, None)  # asked once: a site still unknown stays so
        return again
    for f in first.failures:
        if f.details.pop(EXPLAIN, None):
            f.message += "; this did not happen again when the scenario was run to find its call site"
    first.seconds = again.seconds
    return first


def world_size_for(scenarios: Sequence[Scenario]) -> int:
    """The smallest world every scenario fits in (data-parallel replicas fill the rest)."""
    return math.lcm(*(s.ranks for s in scenarios)) if scenarios else 1


def run(
    scenarios: Sequence[Scenario],
    target_spec: str,
    *,
    reporter: Reporter,
    nproc: int | None = None,
    timeout: float = 60.0,
    lockstep: bool | None = None,
    trace: bool | None = None,
    world: World | None = None,
    backend: str | None = None,
    inplace: bool | None = None,
    coverage: bool | None = None,
    repro: str | None = None,
    mask_leak: bool | None = None,
    config: RunConfig | None = None,
) -> RunResult:
    """Check every scenario; ranks start once (on first need) and are reused throughout.

    Data-parallel replicas (when tp * cp < world size) run the same scenario, and each is
    checked: replicas that disagree are a finding too. ``trace`` puts every rank's collective
    calls in each verdict (a failing one always carries the calls leading up to it).
    ``backend`` (gloo, nccl or auto) is that of the world started here (a given ``world`` has
    its own). ``inplace`` checks that the target leaves its inputs unchanged (``input_mutated``).
    ``coverage`` measures which lines of the target's ``framework_files`` ran (``info.coverage``).
    ``mask_leak`` runs a training step again with NaN at every masked position (``mask_leak``).
    ``config``: the target's configuration and the run's switches (default: the configuration in
    effect, else the environment's: :func:`shardcheck.run_config.effective`); a switch given here
    overrides its own. The world started here is gloo's where neither names a backend.
    """
    configured = config is not None or active() is not None
    config = (config or effective(target_spec)).for_target(target_spec)
    switches = {"lockstep": lockstep, "trace": trace, "inplace": inplace, "coverage": coverage,
                "mask_leak": mask_leak, "backend": backend}
    config = config.replace(**{k: v for k, v in switches.items() if v is not None})
    world_backend = config.backend if backend is not None or configured else "gloo"
    with in_effect(config):  # the world's ranks, and whatever else asks, run with it
        return _run(scenarios, config, reporter=reporter, nproc=nproc, timeout=timeout, world=world, repro=repro,
                    backend=world_backend)


def _run(scenarios: Sequence[Scenario], config: RunConfig, *, reporter: Reporter, nproc: int | None,
         timeout: float, world: World | None, repro: str | None, backend: str) -> RunResult:
    target_spec, lockstep, inplace = config.target, config.lockstep, config.inplace
    coverage, mask_leak = config.coverage, config.mask_leak
    target = controller_target(target_spec, config)
    t0 = time.perf_counter()
    # A given world has its size already: scenarios it cannot hold are skipped, not run on it.
    given = world.nproc if world is not None else nproc
    skips: dict[int, str] = {}  # by place in the list: two scenarios may share a name
    for i, sc in enumerate(scenarios):
        knobs = knob_skip_reason(target, sc)  # first: a knob value it cannot take is bad input, skipped or not
        reason = step_skip_reason(target, sc) or target.capabilities.skip_reason(sc) or knobs
        if reason is None and given is not None and given % sc.ranks:
            sizes = ("dp*" if sc.dp > 1 else "") + ("tp*sp" if sc.sp > 1 else "tp*cp") + f"={sc.ranks}"
            reason = f"needs {sizes} ranks to divide the world size {given}"
        if reason is not None:
            skips[i] = reason
    runnable = [(i, sc) for i, sc in enumerate(scenarios) if i not in skips]
    size = given or world_size_for([sc for _, sc in runnable])
    chosen = world_for(size, given=world, backend=backend, timeout=timeout, lockstep=lockstep)
    world = chosen.world
    info = RunInfo(target.describe(), target_spec, size, world.backend, chosen.why, world.lockstep, inplace=inplace,
                   repro=repro if target_refusal(target) is None else None,
                   target_config=_target_config(target, config),
                   mask_leak=mask_leak)
    reach = Reach(str(target.src) if target.src is not None else None) if coverage else None
    reporter.start(info, list(scenarios))
    verdicts = [(i, Verdict(scenarios[i], SKIP, reason=why)) for i, why in skips.items()]
    for _, v in verdicts:
        reporter.add(v)
    own_world = chosen.owned
    events_before = len(world.events)
    world.progress = getattr(reporter, "world_starting", None)
    try:
        # Group by (tp, cp) so megatron's groups are rebuilt once per layout, not per scenario.
        for i, sc in sorted(runnable, key=lambda p: (p[1].tp, p[1].cp)):
            # a (re)start is reported on its own (startup_seconds), not charged to the scenario
            world.ensure_ready()
            started = time.perf_counter()
            results = world.run(sc.to_dict(), target_spec, wire.Checks.of_run(config))
            verdict = merge(sc, results, time.perf_counter() - started)
            verdict.layout_note = _layout_note(target, sc)
            _place(verdict, getattr(world, "placement", None))
            if _unexplained(verdict):
                # the call site of an in-place write, and where a backward collective's autograd
                # node was made, are found by watches too dear to keep on: run the scenario again
                # with them (every rank decides the same, from the verdict)
                again = world.run(sc.to_dict(), target_spec, wire.Checks.of_run(config, explain=True, coverage=False))
                verdict = _explained(verdict, merge(sc, again, time.perf_counter() - started))
            if results and results[0].target:
                info.target = results[0].target
            if reach is not None:
                for res in results:
                    reach.add(res.reached)
                info.coverage = reach.summary()
            verdicts.append((i, verdict))
            reporter.add(verdict)
    finally:
        info.startup_seconds = [round(s, 3) for s in world.startup_seconds]
        info.world_events = world.events[events_before:]
        world.progress = None
        if hasattr(world, "rank_output"):  # a spawned world's ranks' own printing
            info.rank_output = [{"line": line, "ranks": ranks} for line, ranks in world.rank_output()]
        if own_world:
            world.close()
        info.wall_seconds = round(time.perf_counter() - t0, 3)
        verdicts.sort(key=lambda p: p[0])  # suite order, whatever ran first
        reporter.finish(info)
    return RunResult([v for _, v in verdicts], info)


def _target_config(target: Any, run: RunConfig) -> dict[str, Any]:
    """The target's checkout (as resolved) and options, as a report keeps them."""
    config = TargetConfig.of_run(run)
    src = target.src
    return {"src": str(src) if src is not None else config.src, "options": [list(kv) for kv in config.options]}
