"""The rank side: a process that joins the world once, then runs scenario after scenario.

It imports the wire, the groups, the layouts and shards, the target and the comparison,
never the controller. Each scenario: configure groups -> layout -> local shard -> target ->
outputs -> loss and backward -> comparison with the reference -> a result message.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: a rank arms its parent-death signal before anything else
    from shardcheck.harness.wire import Checks, RankResult
    from shardcheck.run_config import RunConfig


def rank_main(rank: int, world_size: int, store_port: int, conn: Any, options: dict[str, Any]) -> None:
    """Process entry point (started by the controller: forked from its server, or spawned)."""
    from shardcheck.harness.wire import die_with_parent, process_alive  # light: armed before torch loads

    die_with_parent()
    _let_the_fork_server_go()
    controller = options.get("controller_pid")
    if controller is not None and not process_alive(controller):  # it died before the signal was armed
        os._exit(1)
    if options.get("output_file"):  # the controller shows each distinct line once, not as it comes
        fd = os.open(options["output_file"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    if "environment" in options:  # the controller's, as of this start (not the fork server's)
        os.environ.clear()
        os.environ.update(options["environment"])
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import faulthandler
    import signal
    import warnings

    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    warnings.filterwarnings("ignore", message=".*Apex is not installed.*")  # megatron-core's, as the harness imports it
    # torch's deprecation notices about the API a target calls are the target's business
    warnings.filterwarnings("ignore", category=FutureWarning)
    # On a timeout the controller asks where every rank stands before it ends them.
    dump = open(options["traceback_file"], "w")  # noqa: SIM115 (lives as long as the process)
    faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)

    from shardcheck.harness import wire

    t0 = time.perf_counter()
    try:
        import datetime

        import torch
        import torch.distributed as dist

        from shardcheck.backend import process_group_backend, rank_device
        from shardcheck.harness.rank.plumbing import gloo_device

        torch.set_num_threads(1)
        backend = options.get("backend", "gloo")
        device = rank_device(backend, rank)
        timeout = datetime.timedelta(seconds=options["collective_timeout"])
        store = dist.TCPStore("127.0.0.1", store_port, is_master=False,
                              timeout=datetime.timedelta(seconds=options["start_timeout"]))
        if process_group_backend(backend) == "gloo" and gloo_device.wanted(os.environ):
            gloo_device.share()  # one event-loop thread a rank, not one a group
        dist.init_process_group(process_group_backend(backend), store=store, rank=rank, world_size=world_size, timeout=timeout)
        runner = prepare(rank, world_size, "127.0.0.1", store_port, options, device)
    except BaseException as exc:  # noqa: BLE001  (reported to the controller, then exit)
        conn.send(wire.message(wire.FATAL, error=wire.error_payload(exc)))
        return
    conn.send(wire.message(wire.READY, pid=os.getpid(), seconds=time.perf_counter() - t0))

    while True:
        try:
            while not conn.poll(1.0):  # idle: look for the controller now and then, not only at EOF
                if controller is not None and not process_alive(controller):
                    raise EOFError
            name, kwargs = conn.recv()
        except (EOFError, OSError):  # the controller is gone
            break
        if name == wire.STOP:
            break
        if name == wire.RUN:
            from contextlib import nullcontext

            from shardcheck.run_config import RunConfig, in_effect

            checks = wire.Checks.from_wire(kwargs["checks"])
            wire.apply_settings(kwargs.get("settings", {}))
            config = RunConfig.from_wire(kwargs["config"]) if "config" in kwargs else None
            # in effect while the scenario runs: what a target asks of the run (its backend) is the controller's
            with in_effect(config) if config is not None else nullcontext():
                result = runner.run(kwargs["scenario"], kwargs["target"], kwargs["seq"], checks, config)
            conn.send(wire.message(wire.RESULT, **result.to_wire()))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001  (best effort on the way out)
        pass


def prepare(rank: int, world_size: int, store_host: str, store_port: int, options: dict[str, Any],
            device: Any) -> RankRunner:
    """Ready this process, already in the default process group, to run scenarios: group
    timeouts, megatron's import, the collective trace and the lockstep check (over the store at
    ``store_host:store_port``). Used by the controller's ranks and by a joined world (torchrun) alike."""
    from shardcheck.harness.rank.plumbing import groups
    from shardcheck.harness.rank.plumbing import trace

    groups.set_timeout(options["collective_timeout"])

    trace.install()
    lockstep = None
    if options.get("lockstep", True):
        from shardcheck.harness.rank.checks.lockstep import Lockstep

        board = None
        if options.get("board"):  # a world the controller started on this machine
            from shardcheck.harness.rank.plumbing.board import Board

            board = Board(options["board"], world_size, rank)
        lockstep = Lockstep(store_port, rank, world_size, options["collective_timeout"], label=groups.label,
                            host=store_host, member_groups=groups.member_groups, board=board)
    return RankRunner(rank, lockstep, device)


TRACE_CAP = 2000  # calls per rank and scenario sent back when the whole trace is asked for
TRACE_TAIL = 12  # calls per rank sent back with a failure


def _trace_payload(calls: Any, everything: bool, failed: bool, cap: int | None = TRACE_CAP) -> list[dict[str, Any]]:
    if calls is None or not (everything or failed):
        return []
    chosen = calls.calls[:cap] if everything else calls.calls[-TRACE_TAIL:]
    return [c.to_dict() for c in chosen]


def _let_the_fork_server_go() -> None:
    """A rank forked from the server inherits the controller's end of the pipe whose closing
    tells the server to exit; while the rank holds it, the server, this rank's parent, outlives a
    killed controller and the parent-death signal never comes. Let it go."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
        server._forkserver_alive_fd = None


class RankRunner:
    """Runs one scenario at a time on this rank and returns its result as plain data."""

    trace_cap: int | None = TRACE_CAP  # calls sent back when the whole trace is asked for (None: all)

    def __init__(self, rank: int, lockstep: Any, device: Any = None) -> None:
        from shardcheck.harness.rank.plumbing.megatron_core import load_parallel_state

        load_parallel_state()  # before the first scenario, and without the rest of megatron-core
        self.rank = rank
        self.lockstep = lockstep
        self.device = device
        self._targets: dict[Any, Any] = {}
        self._current: Any = None
        self.layout: dict[str, Any] | None = None  # the scenario's rows as the framework built them

    def target(self, spec: str, config: RunConfig | None = None) -> Any:
        """The target for ``spec`` as ``config`` configures it (a checkout, ``--target-opt``s;
        default: the configuration in effect here) and as the user's ``SHARDCHECK_*`` variables
        the controller handed over leave it (a commit pin), resolved once. Moving to another
        target first undoes what the previous one set process-wide (``release()``: slime's stubs,
        its env and sys.path), so the next target runs in the process it would have had alone."""
        from shardcheck.harness import wire
        from shardcheck.run_config import effective

        config = (config or effective(spec)).for_target(spec)
        key = (spec, config.target_key(), tuple(sorted(wire.user_settings().items())))
        if self._current not in (None, key):
            previous = self._targets.get(self._current)
            if previous is not None:
                from shardcheck.targets import release

                release(previous)
            self._targets.pop(self._current, None)
        self._current = key
        if key not in self._targets:
            from shardcheck.targets import resolve
            from shardcheck.targets.base import TargetConfig

            self._targets[key] = resolve(spec, TargetConfig.of_run(config))
        return self._targets[key]

    def close(self) -> None:
        """Leave the process as it was before the first scenario: targets released, the trace's
        and the groups' state reset (a joined world may be followed by another)."""
        from shardcheck.harness.rank.plumbing import groups
        from shardcheck.harness.rank.plumbing import trace

        from shardcheck.targets import release

        for t in self._targets.values():
            release(t)
        self._targets.clear()
        self._current = None
        trace.reset()
        groups.reset()

    def run(self, scenario: dict[str, Any], target: str, seq: int, checks: Checks | None = None,
            config: RunConfig | None = None) -> RankResult:
        """One scenario on this rank, with ``checks`` (the wire's Checks; the default ones
        when None) and the run's ``config`` (the one in effect here when None: a joined world's
        controller is this process). The explain check is a dispatch mode on every op: it is run
        only to explain a change already found."""
        from shardcheck.harness import wire
        from shardcheck.harness.rank.checks import CHECKS
        from shardcheck.harness.rank.pipeline import CheckRaised, Frame, pipeline_for
        from shardcheck.harness.wire import Failure, RankResult

        from shardcheck.run_config import effective

        t0 = time.perf_counter()
        checks = checks or wire.Checks()
        config = (config or effective(target)).for_target(target)
        pipeline = pipeline_for(checks, CHECKS)
        # what the scenario has found so far: kept when a later step (the backward) fails
        frame = Frame(self.rank, seq, scenario.get("name", "?"), checks, self.lockstep, found=[])
        described, produced = {}, None
        raised = False
        self.layout = None
        reached: dict[str, Any] = {}
        try:
            pipeline.frame("begin", frame)
            if checks.coverage:
                from shardcheck.harness.rank.life.reach import measured

                with measured(self.target(target, config), reached):
                    described, produced = self._run(scenario, config, frame, pipeline)
            else:
                described, produced = self._run(scenario, config, frame, pipeline)
            pipeline.frame("finish", frame)
        except BaseException as exc:  # noqa: BLE001  (a crash of the target is a finding)
            if not pipeline.claim(frame, exc):  # a check's own finding, or the target raised
                raised = True
                kind, what, err = self._raised(exc)
                # a raise names no rank: the same cause on several ranks is one failure listing them
                frame.found.append(Failure(kind, what, [self.rank], details={"at": time.time(), **err}))
                try:
                    pipeline.frame("abandon", frame, what)
                except CheckRaised:  # the first failure of a check is the one reported
                    pass
        finally:
            pipeline.frame("end", frame)
        if not described and self._current in self._targets and self._current[0] == target:
            try:  # a failed run still names what it ran
                from shardcheck.targets.base import description

                described = description(self._targets[self._current])
            except Exception:  # noqa: BLE001  (the report keeps the controller's description)
                pass
        # Without lockstep a raise may leave peers mid-collective; with it, only a failure inside
        # the backend can. The controller then restarts the world before the next scenario.
        desync = frame.desync or (raised and self.lockstep is None)
        failures, calls = frame.found, frame.calls
        return RankResult(
            self.rank, seq, failures, frame.errors, time.perf_counter() - t0, described, frame.notes, desync,
            calls=len(calls.calls) if calls is not None else 0,
            # the whole trace when asked for; otherwise, for a failure, the calls leading up to it
            trace=_trace_payload(calls, checks.trace_calls, bool(failures or frame.notes), self.trace_cap),
            # the target's outputs as raw data (only when asked for, and only when it ran through)
            outputs=produced,
            layout=self.layout,
            reached=reached or None,
        )

    @staticmethod
    def _raised(exc: BaseException) -> tuple[str, str, dict[str, Any]]:
        """(kind, message, details) of a raise no check claimed: the harness's own (a check's hook,
        the target's adapter refusing what it was given) or the target's (anything else)."""
        from shardcheck.errors import ShardcheckError
        from shardcheck.harness.rank.pipeline import CheckRaised, raise_payload
        from shardcheck.harness.wire import HARNESS_ERROR, RANK_ERROR

        if isinstance(exc, CheckRaised):
            err = raise_payload(exc.error)
            where = f" at {err['where']}" if err["where"] else ""
            return HARNESS_ERROR, (f"the check {exc.check} raised at {exc.point}: {err['type']}: {err['message']}"
                                   f"{where} (a check's failure, not the target's)"), {**err, "check": exc.check}
        err = raise_payload(exc)
        if isinstance(exc, ShardcheckError):
            return HARNESS_ERROR, f"the target could not be run here: {err['message']}", err
        return RANK_ERROR, f"raised {err['type']}: {err['message']}" + (f" at {err['where']}" if err["where"] else ""), err

    def rank_inputs(self, sc: Any, data: Any, layout: Any, logits: Any, form: str, rollout: Any) -> Any:
        """What this rank hands the target for ``sc`` laid out as ``layout``, with ``logits``."""
        from shardcheck.harness.rank.plumbing import groups
        from shardcheck.harness.rank.life import shard
        from shardcheck.targets import RankInputs

        return RankInputs(
            logits=logits,
            tokens=[data.tokens(i) for i in range(len(sc.samples))],
            total_lengths=[s.total for s in sc.samples],
            response_lengths=[s.response for s in sc.samples],
            layout=sc.layout,
            with_entropy=sc.with_entropy,
            entropy_coef=float(sc.entropy_coef),
            temperature=float(sc.temperature),
            chunk_size=sc.log_probs_chunk_size,
            max_seq_lens=[layout.shape[1]] * len(sc.samples) if sc.layout == "bshd" else None,
            tp_group=groups.tp_group(),
            # under sp the sequence axis is the sp group's: the target has no CP group
            cp_group=groups.cp_group() if sc.sp == 1 else None,
            tp_rank=groups.tp_rank(),
            tp_size=sc.tp,
            cp_rank=groups.cp_rank() if sc.sp == 1 else 0,
            cp_size=sc.cp,
            rank_layout=layout,
            policy=shard.policy_batch(data, layout) if form == "policy" else None,
            keep_sets=[data.keep_sets(i) for i in range(len(sc.samples))] if sc.replay_keep else None,
            top_k=sc.top_k,
            top_p=float(sc.top_p),
            rollout=rollout,
            sp_group=groups.sp_group(),
            sp_rank=groups.cp_rank() if sc.sp > 1 else 0,
            sp_size=sc.sp,
            world=groups,
        )

    def _run(self, scenario_dict: dict[str, Any], config: RunConfig, frame: Any, pipeline: Any) -> tuple[dict, dict | None]:
        """The scenario's steps; findings go into the frame's ``found`` and ``errors`` as they are
        made, so a step that raises (the backward) does not hide what the earlier ones found."""
        import torch

        from shardcheck.harness.rank.plumbing import groups
        from shardcheck.harness.rank.life import shard
        from shardcheck.harness.rank.life.data_path import layout_for, layout_payload
        from shardcheck.harness.rank.life.loss import policy_gradients, share_gradients
        from shardcheck.harness.rank.life.model_stand_in import model_output
        from shardcheck.harness.rank.pipeline import Life
        from shardcheck.scenarios import Scenario
        from shardcheck.scenarios.data import ScenarioData
        from shardcheck.targets import loss_form
        from shardcheck.targets.base import definitions, description

        sc = Scenario.from_dict(scenario_dict)
        target = self.target(config.target, config)
        groups.configure(sc.tp, sc.cp, sc.sp)
        form = loss_form(target)
        if form == "step":  # the whole training step around the target (harness/rank/life/training_step.py)
            from shardcheck.harness.rank.life.training_step import run_step

            step = run_step(self, sc, target, frame, pipeline)
            return {**description(target), "training_step": step}, None
        data = ScenarioData(sc, loss=form)
        layout, rollout, moved = layout_for(target, data, groups.tp_rank(), groups.cp_rank(), self.rank)
        self.layout = layout_payload(layout)
        frame.found += moved
        leaf = shard.local_logits(data, layout).to(self.device).requires_grad_()
        # a non-leaf activation, as a model's output is: autograd lets a target write into it
        inputs = self.rank_inputs(sc, data, layout, model_output(leaf, target, sc.cp, groups.cp_group()), form, rollout)
        # the reference follows the target's definitions: its entropy's sign, and what it owes
        # (its share, the tokens its rows score, or with CP every token: the loss over the
        # gathered sequence / cp on each rank)
        defined = definitions(target)
        life = Life(self.rank, frame.checks, sc, data, layout, target, inputs, leaf, form, defined,
                    owed=shard.owed_layout(layout, defined.loss_over),
                    owed_entropy=shard.owed_layout(layout, defined.entropy_loss_over),
                    # the reference runs where the rank computes: on its GPU under nccl, in row chunks
                    reference_device=self.device if getattr(self.device, "type", "cpu") == "cuda" else None,
                    found=frame.found, errors=frame.errors)
        pipeline.call("inputs_made", life)
        with pipeline.around("forward", life):
            life.outputs = target.compute(inputs)
        life.entropy = getattr(life.outputs, "entropy", None) if sc.with_entropy else None
        pipeline.call("after_forward", life)
        if life.stopped:
            return description(target), None
        if form == "policy":
            # a malformed loss is reported above; the rank has nothing to differentiate, and its
            # peers' backward collectives then show the asymmetry
            life.fed = policy_gradients(life.outputs.loss)
        else:
            # Differentiate whatever is well formed, so a malformed output on one rank does not
            # leave its peers alone in a backward collective. Where a field is owed gathered,
            # every CP rank's loss is the whole sequence's / cp; under sp every rank owes every
            # token (gathered), and its loss is the whole sequence's / sp.
            lp_scale, ent_scale = (sc.sp * (sc.cp if over == "gathered" else 1)
                                   for over in (defined.loss_over, defined.entropy_loss_over))
            weights = [(w_lp / lp_scale, w_ent / ent_scale) for (w_lp, _), (_, w_ent)
                       in zip(shard.share_weights(data, life.owed), shard.share_weights(data, life.owed_entropy))]
            life.fed = share_gradients(life.outputs.log_probs, life.entropy, weights, sc.entropy_coef)
        pipeline.call("before_backward", life)
        if life.fed:
            # inside what the target's framework runs its backward in (loss_parallel's handlers)
            with pipeline.around("backward", life), target.backward_context():
                torch.autograd.backward([f.output for f in life.fed], [f.grad for f in life.fed])
        life.grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
        pipeline.call("after_backward", life)
        pipeline.call("result", life)
        return description(target), life.produced
