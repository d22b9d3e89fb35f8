"""shardcheck's pytest plugin, registered through the ``pytest11`` entry point.

In a test file::

    import pytest
    from shardcheck.pytest_plugin import parametrize_suite

    pytestmark = pytest.mark.multigpu

    @parametrize_suite("regressions")          # one test id per scenario
    def test_logprobs(shardcheck, scenario):
        shardcheck.check(scenario)             # fails with the scenario's findings

Launch it either way people launch distributed tests:

- ``pytest -m multigpu``: shardcheck starts the ranks once per session (per xdist worker: each
  world has its own OS-picked port, so ``-n 2`` workers never share ports or ranks);
- ``torchrun --nproc-per-node N -m pytest -m multigpu``: every rank runs pytest and shardcheck
  joins the launcher's world instead of starting one; every rank reaches the same verdict.

Options: ``--shardcheck-target`` (default ``builtin``, or ``SHARDCHECK_TARGET``),
``--shardcheck-backend`` (auto, gloo, nccl), ``--shardcheck-nproc`` (ranks shardcheck starts,
default 4), ``--shardcheck-timeout`` (seconds per scenario), ``--shardcheck-no-inplace`` (as
``shardcheck run --no-inplace``: the inputs are not checked).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import pytest

from shardcheck.backend import BACKENDS

if TYPE_CHECKING:
    from shardcheck.run_options import RunConfig

MARKER = "multigpu"
DEFAULT_NPROC = 4


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("shardcheck", "shardcheck: sharded log-prob and entropy checks")
    group.addoption("--shardcheck-target", default=None, metavar="SPEC",
                    help="target the shardcheck fixture checks: NAME, NAME:VARIANT or module:callable "
                         "(default: $SHARDCHECK_TARGET or builtin)")
    group.addoption("--shardcheck-target-src", default=None, metavar="DIR",
                    help="a source checkout for the target (as shardcheck run --target-src)")
    group.addoption("--shardcheck-target-opt", action="append", default=[], metavar="KEY=VALUE",
                    help="an option for the target, repeatable (as shardcheck run --target-opt)")
    group.addoption("--shardcheck-html-report", default=None, metavar="FILE",
                    help="one HTML page for every scenario the session checks (as shardcheck run --html-report)")
    group.addoption("--shardcheck-backend", default="auto", choices=BACKENDS,
                    help="torch.distributed backend (default auto: nccl with one GPU per rank, else gloo)")
    group.addoption("--shardcheck-nproc", type=int, default=None, metavar="N",
                    help=f"ranks shardcheck starts (default {DEFAULT_NPROC}; under torchrun: its world)")
    group.addoption("--shardcheck-timeout", type=float, default=60.0, metavar="S",
                    help="seconds a scenario may take before its ranks are declared hung (default 60)")
    group.addoption("--shardcheck-no-inplace", action="store_true",
                    help="do not check that the target leaves its inputs unchanged (as shardcheck run --no-inplace)")


# Notices megatron-core and torch print when shardcheck imports them in a pytest process (a
# torchrun rank): about their optional accelerators and their own deprecations, not your code.
IMPORT_NOISE = (
    "ignore:Transformer Engine and Apex are not installed:UserWarning",
    "ignore:The following imports from `dynamic_context.py`:DeprecationWarning",
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning",
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{MARKER}: checks sharded code on a multi-rank world (shardcheck); "
                   f"select with -m {MARKER}, leave out with -m 'not {MARKER}'")
    for line in IMPORT_NOISE:
        config.addinivalue_line("filterwarnings", line)


def parametrize_suite(suite: str | Iterable[Any], argname: str = "scenario") -> pytest.MarkDecorator:
    """``pytest.mark.parametrize`` over a named suite (or given scenarios), with each scenario's
    name as its test id, so a junit report has one testcase per scenario."""
    from shardcheck.scenarios import get_suite

    scenarios = get_suite(suite) if isinstance(suite, str) else list(suite)
    return pytest.mark.parametrize(argname, scenarios, ids=[s.name for s in scenarios])


class ShardcheckSession:
    """The session's world and run configuration (its default target, the target's checkout and
    options, the checks); :meth:`check` runs one scenario on every rank."""

    def __init__(self, world: Any, target: str, report: Any = None, inplace: bool = True,
                 config: RunConfig | None = None) -> None:
        from shardcheck.run_options import RunConfig

        self.world = world
        self.report = report  # --shardcheck-html-report's page, or None
        self.config = (config or RunConfig(target)).replace(target=target, inplace=inplace)

    @property
    def target(self) -> str:
        return self.config.target

    @property
    def inplace(self) -> bool:  # --shardcheck-no-inplace: False
        return self.config.inplace

    def run(self, scenario: Any, target: str | None = None) -> Any:
        """The scenario's :class:`~shardcheck.harness.controller.reports.verdict.Verdict` (pass, fail or skip)."""
        from shardcheck.harness.controller.commands import runner
        from shardcheck.harness.controller.reports.run_report import SilentReport

        config = self.config.for_target(target or self.target)
        result = runner.run([scenario], config.target, reporter=self.report or SilentReport(), world=self.world,
                            config=config)
        return result.verdicts[0]

    def check(self, scenario: Any, target: str | None = None) -> Any:
        """Run the scenario; fail the test with its findings, skip it with the reason."""
        from shardcheck.harness.controller.reports.run_report import render_failure
        from shardcheck.harness.controller.reports.verdict import ERROR, FAIL, SKIP, TIMED_OUT

        verdict = self.run(scenario, target)
        if verdict.status == SKIP:
            pytest.skip(verdict.reason or "outside the target's capabilities")
        if verdict.status == TIMED_OUT:  # the machine's, not the target's: nothing was found either way
            pytest.skip(f"timed out, the machine was too slow: {verdict.headline()}")
        if verdict.status == ERROR:  # shardcheck's own part failed (a plugin's check): no finding either way
            pytest.fail(f"shardcheck's own error, not a finding of the target: {verdict.headline()}\n"
                        f"{render_failure(verdict)}", pytrace=False)
        if verdict.status == FAIL:
            # first line: the kind and where, which junit shows as the failure message
            pytest.fail(f"{verdict.headline()}\n{render_failure(verdict)}", pytrace=False)
        return verdict


    def invariance(self, scenarios: Any, *, axes: Iterable[str] | None = None, expect: str | dict | None = None,
                   target: str | None = None) -> Any:
        """The invariance matrix of the scenarios' samples (an :class:`InvarianceResult`);
        ``expect`` ("packing=bitwise,tp=ulp:8", or {axis: "bitwise"}) overrides the target's
        declared contract."""
        from shardcheck.harness.controller.commands.invariance import AXES, check_invariance, parse_expect
        from shardcheck.run_options import in_effect

        if isinstance(expect, dict):
            expect = ",".join(f"{a}={e}" for a, e in expect.items())
        scenarios = [scenarios] if not isinstance(scenarios, (list, tuple)) else list(scenarios)
        config = self.config.for_target(target or self.target)
        with in_effect(config):
            return check_invariance(scenarios, config.target, axes=list(axes or AXES), expect=parse_expect(expect),
                                    world=self.world)

    def check_invariance(self, scenarios: Any, *, axes: Iterable[str] | None = None,
                         expect: str | dict | None = None, target: str | None = None) -> Any:
        """Fail the test when the contract (the target's, or ``expect``) is broken on any axis;
        the message starts with the first violation (axis, layouts, sample, token, both values)."""
        from shardcheck.harness.controller.reports.invariance_report import render

        result = self.invariance(scenarios, axes=axes, expect=expect, target=target)
        if result.violations:
            pytest.fail(f"invariance_violation: {result.violations[0].message}\n{render(result)}", pytrace=False)
        return result


@pytest.fixture(scope="session")
def shardcheck_world(request: pytest.FixtureRequest) -> Any:
    """One world for the whole session: started here, or joined under torchrun."""
    from shardcheck.errors import ShardcheckError
    from shardcheck.harness.controller.worlds.joined import launched_by_torchrun
    from shardcheck.harness.controller.worlds.choice import world_for

    opt = request.config.getoption
    try:
        config = run_config(request.config)
        world = world_for(opt("--shardcheck-nproc") or DEFAULT_NPROC, join=launched_by_torchrun(),
                          backend=config.backend, timeout=opt("--shardcheck-timeout"), lockstep=config.lockstep).world
        world.start()
    except ShardcheckError as exc:
        pytest.exit(f"shardcheck: {exc}", returncode=2)
    try:
        yield world
    finally:
        world.close()


def run_config(config: pytest.Config) -> RunConfig:
    """The session's run configuration from its ``--shardcheck-*`` options, by the builder the
    command line uses (``SHARDCHECK_TARGET`` the default target); BadInput, one line, naming the
    option."""
    from shardcheck.run_options import build

    opt = config.getoption
    return build(target=opt("--shardcheck-target"), target_src=opt("--shardcheck-target-src"),
                 target_options=opt("--shardcheck-target-opt"), backend=opt("--shardcheck-backend"),
                 inplace=not opt("--shardcheck-no-inplace"), flag_prefix="--shardcheck-")


@pytest.fixture(scope="session")
def shardcheck(request: pytest.FixtureRequest) -> ShardcheckSession:
    """Check scenarios against the session's target on the session's world."""
    from shardcheck.errors import BadInput
    from shardcheck.targets import resolve
    from shardcheck.targets.base import TargetConfig

    opt = request.config.getoption
    path = opt("--shardcheck-html-report")
    try:
        config = run_config(request.config)
        resolve(config.target, TargetConfig.of_run(config))  # a bad spec or option is one line, once, before any rank starts
        if path:
            from shardcheck.harness.controller.reports.html_report import check_writable

            check_writable(path)
    except BadInput as exc:
        pytest.exit(f"shardcheck: {exc}", returncode=2)
    world = request.getfixturevalue("shardcheck_world")
    report = None
    if path and getattr(world, "rank", 0) == 0:  # under torchrun, rank 0 writes it
        from shardcheck.harness.controller.reports.html_report import SessionHtmlReport

        report = SessionHtmlReport(path)

        def close() -> None:
            report.close()
            if report.failed:  # the tests' own outcomes stand; the page is what could not be kept
                pytest.exit(f"shardcheck: {report.failed}", returncode=2)

        request.addfinalizer(close)
    return ShardcheckSession(world, config.target, report, inplace=config.inplace, config=config)
