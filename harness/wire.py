"""The wire: the only module both sides import, and the only things that cross between them
(and the two things both sides do to a rank: its status key in the store, its parent-death guard).

Messages are ``(name, kwargs)`` tuples of plain data. A rank's answer to ``run`` is one
:class:`RankResult`, built by :meth:`RankResult.error` (for a rank that raised, died or hung,
on either side) or by the rank's runner, and serialized by :meth:`RankResult.to_wire` /
:meth:`RankResult.from_wire` alone (as pytest-xdist serializes its reports in one place).

Controller -> rank:
    run   scenario (dict), target (spec str), seq (int), checks (a Checks, as to_wire gives it),
          config (the run's RunConfig, as to_wire gives it: the target's checkout, options,
          backend and switches), settings (the user's SHARDCHECK_* variables, as the
          controller has them now: what a target reads of its environment itself)
                                                           run one scenario
    stop                                                   leave the loop and exit
Rank -> controller (the controller adds who sent it on arrival):
    ready   pid, seconds                                   joined the world, waiting for work
    result  a RankResult, as RankResult.to_wire gives it
    fatal   error (dict)                                   cannot go on; the rank exits
"""

from __future__ import annotations

import dataclasses
import os
import time
import traceback
from dataclasses import dataclass
from dataclasses import field as _field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shardcheck.run_config import RunConfig

RUN, STOP = "run", "stop"


def status_key(seq: int, rank: int) -> str:
    """The store key under which a rank's state in scenario ``seq`` is written: by the rank's
    lockstep, and by the controller for a rank it saw die (its peers stop waiting at once)."""
    return f"status/{seq}/{rank}"


def die_with_parent() -> None:
    """Ask Linux to kill this process if its parent dies, so no rank (or simulation process)
    outlives a killed controller."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
SETTINGS_PREFIX = "SHARDCHECK_"


def process_alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie: a killed controller its own parent has not reaped yet
    is gone for its ranks and for the next run's sweep alike. One of another user counts."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)  # no /proc (not Linux): existence is all there is to know
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


def progress(store: Any, board: Any = None) -> tuple[int | None, int]:
    """What moves while ranks make progress, for deadlines that follow it: how many keys the c10d
    store holds (statuses, and every call lockstep checks over the store; None where the store
    cannot say) and how many calls were announced on the lockstep's shared board, if any."""
    try:
        keys = store.num_keys()
    except Exception:  # noqa: BLE001  (a store without the count, or gone)
        keys = None
    return keys, board.calls() if board is not None else 0


def user_settings() -> dict[str, str]:
    """The user's SHARDCHECK_* variables as the controller has them now (a commit pin, the extra
    checks): sent with each run, so a world started before they changed sees what a new one
    would. The run's configuration is not among them: it travels as a RunConfig."""
    return {k: v for k, v in os.environ.items() if k.startswith(SETTINGS_PREFIX)}


# the run's configuration, among the settings of a sender that sends no ``config`` of its own
RUN_CONFIG_SETTING = "run_config"


def target_settings() -> dict[str, str]:
    """:func:`user_settings` and the run configuration in effect (under :data:`RUN_CONFIG_SETTING`),
    for a sender whose run message has no ``config`` (the simulated world)."""
    import json

    from shardcheck.run_config import active

    config = active()
    return user_settings() | ({RUN_CONFIG_SETTING: json.dumps(config.to_wire())} if config is not None else {})


def apply_settings(settings: dict[str, str]) -> None:
    """On a rank: the controller's SHARDCHECK_* variables, exactly (those it no longer has go);
    a run configuration among them is received (it goes to no variable)."""
    settings = dict(settings)
    config = settings.pop(RUN_CONFIG_SETTING, None)
    if config is not None:
        import json

        from shardcheck.run_config import RunConfig, receive

        receive(RunConfig.from_wire(json.loads(config)))
    for k in [k for k in os.environ if k.startswith(SETTINGS_PREFIX) and k not in settings]:
        del os.environ[k]
    os.environ.update(settings)
READY, RESULT, FATAL = "ready", "result", "fatal"


def message(name: str, **kwargs: Any) -> tuple[str, dict[str, Any]]:
    return name, kwargs


@dataclass(frozen=True)
class Checks:
    """What a rank checks, and sends back, for one scenario."""

    trace_calls: bool = False  # send the whole collective trace back, not only a failure's tail
    inplace: bool = True  # the target leaves its inputs, and the gradients fed to its outputs, unchanged
    outputs: bool = False  # send the target's own outputs and logit gradient back, bit for bit
    reference: bool = True  # compare values and gradient with the float64 reference
    explain: bool = False  # find the call site of the first in-place write (a dispatch mode on every op)
    coverage: bool = False  # which lines of the target's framework_files ran (coverage.py)
    mask_leak: bool = True  # a training step again with NaN at every masked position: nothing unmasked changes

    @classmethod
    def of_run(cls, config: RunConfig, **overrides: Any) -> Checks:
        """The rank's checks of a scenario: ``config``'s switches, with ``overrides`` (explain, outputs)."""
        return cls(**{"trace_calls": config.trace, "inplace": config.inplace, "coverage": config.coverage,
                      "mask_leak": config.mask_leak, **overrides})

    def to_wire(self) -> dict[str, bool]:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Checks:
        return cls(**d)


def short_path(path: str) -> str:
    """A source path as every report shows it: from the package root for installed code
    (``site-packages/x/y.py`` -> ``x/y.py``), relative to the working folder for the rest."""
    for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
        if marker in path:
            return path.split(marker, 1)[1]
    cwd = os.getcwd() + os.sep
    return path[len(cwd):] if path.startswith(cwd) else path


def error_payload(exc: BaseException, skip_prefixes: tuple[str, ...] = ()) -> dict[str, Any]:
    """An exception as plain data: type, message, where it was raised, and the traceback."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = None
    for fr in reversed(frames):
        if not any(fr.filename.startswith(p) for p in skip_prefixes):
            where = f"{short_path(fr.filename)}:{fr.lineno} in {fr.name}"
            break
    if where is None and frames:
        where = f"{short_path(frames[-1].filename)}:{frames[-1].lineno} in {frames[-1].name}"
    return {
        "type": type(exc).__name__,
        "message": str(exc).strip().splitlines()[0][:500] if str(exc).strip() else "",
        "where": where,
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-8000:],
    }


VALUE_MISMATCH = "value_mismatch"
GRAD_MISMATCH = "grad_mismatch"
RANK_ERROR = "rank_error"
COLLECTIVE_MISMATCH = "collective_mismatch"
INPUT_MUTATED = "input_mutated"
INVARIANCE_VIOLATION = "invariance_violation"
# the framework's data path lost a (sample, position), held one twice, gave a CP rank's TP ranks
# different rows, or laid the real tokens out differently from their positions
LAYOUT_MISMATCH = "layout_mismatch"
# NaN put at every masked position (prompt, padding and masked tokens' logits rows, masked
# tokens' per-token inputs) changed an unmasked output, the loss or an unmasked gradient
MASK_LEAK = "mask_leak"
# a deadline the machine missed: the rank waited for a CPU through much of it (not the target's)
TIMEOUT = "timeout"
# the harness's own part failed on a rank (a check's hook raised, a plugin's check included; the
# target's adapter refused the checkout it was given): never the target's; the verdict is "error"
HARNESS_ERROR = "harness_error"
KINDS = (VALUE_MISMATCH, GRAD_MISMATCH, RANK_ERROR, COLLECTIVE_MISMATCH, INPUT_MUTATED, INVARIANCE_VIOLATION,
         LAYOUT_MISMATCH, MASK_LEAK, TIMEOUT, HARNESS_ERROR)
# The kinds that name where a run stopped (a rank raised, died or hung; ranks diverged; the
# harness failed): listed first in a verdict, with where each rank runs. Any other kind, a check's
# own, is rendered alike.
ROOT_CAUSES = (HARNESS_ERROR, RANK_ERROR, COLLECTIVE_MISMATCH, TIMEOUT)
# A failure's detail saying that running the scenario again with Checks.explain would name its
# call site (the write watch, the forward stack of a backward call): the controller does so.
EXPLAIN = "explain"

@dataclass
class Failure:
    """One thing found wrong. Position fields are global: sample index, response token index
    (row P - 1 + token scores it), vocab column; ``position`` is the row's place in its sample
    (used for rows that score no token: prompt and padding rows)."""

    kind: str
    message: str
    ranks: list[int] = _field(default_factory=list)
    field: str | None = None  # log_probs | entropy | loss | grad; the input, for input_mutated
    phase: str | None = None  # forward | backward, for collective mismatches and input_mutated
    sample: int | None = None
    token: int | None = None
    position: int | None = None
    column: int | None = None
    got: float | None = None
    want: float | None = None
    details: dict[str, Any] = _field(default_factory=dict)

    def identity(self) -> tuple:
        """What makes two ranks' reports the same finding (TP and DP replicas repeat them)."""
        if self.kind == COLLECTIVE_MISMATCH and "group" in self.details:
            # members may have seen different subsets of the group when they stopped
            return (self.kind, self.details["group"], self.details.get("call"))
        if self.kind == RANK_ERROR and "type" in self.details:
            # the same exception raised at the same place on several ranks is one finding
            d = self.details
            return (self.kind, d["type"], d.get("message"), d.get("where"))
        return (self.kind, self.field, self.sample, self.token, self.position, self.column, self.message)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v not in (None, {}, [])} | {
            "ranks": self.ranks
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Failure:
        return cls(**d)


@dataclass
class RankResult:
    """What one rank sends back for one scenario (or what the controller says for it when it
    raised, died or hung before it could)."""

    rank: int
    seq: int | None
    failures: list[Failure] = _field(default_factory=list)
    max_error: dict[str, float] = _field(default_factory=dict)  # field -> max |got - want|
    seconds: float = 0.0
    target: dict[str, Any] = _field(default_factory=dict)  # the target's describe(), as the rank saw it
    notes: list[dict[str, Any]] = _field(default_factory=list)  # why a peer stopped, as it said
    desync: bool = False  # the backend's groups may be out of step: restart before the next scenario
    calls: int = 0  # collectives traced
    trace: list[dict[str, Any]] = _field(default_factory=list)  # call records (a failure's, or all)
    outputs: dict[str, Any] | None = None  # the target's outputs, when asked for (invariance)
    # the rows the framework's data path built on this rank (rank/data_path.layout_payload); None
    # when the harness laid them out
    layout: dict[str, Any] | None = None
    # --coverage: per framework file (relative to the checkout), the lines that ran and its statements
    reached: dict[str, Any] | None = None
    received_at: float | None = None  # set by the controller on arrival

    @classmethod
    def error(cls, rank: int, message: str, *, desync: bool, details: dict[str, Any] | None = None,
              kind: str = "rank_error") -> RankResult:
        """A rank that raised, died or hung: one ``rank_error`` naming it (or a ``timeout``: a
        deadline the machine missed)."""
        now = time.time()
        failure = Failure(kind, message, [rank], details={"at": now, **(details or {})})
        return cls(rank, None, [failure], desync=desync, received_at=now)

    def to_wire(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["failures"] = [f.to_dict() for f in self.failures]
        return d

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> RankResult:
        return cls(**(d | {"failures": [Failure.from_dict(f) for f in d["failures"]]}))
