"""A trace of every collective a rank issues, whichever way it was called.

One interception point: a ``torch.library`` kernel on each ``c10d`` op at the dispatcher's
``BackendSelect`` key, which re-dispatches below that key. Every route reaches these ops:
``torch.distributed.*`` (sync, async, coalesced, point-to-point), ``torch.distributed.nn``
(forward and backward), functional collectives (plain and autograd), megatron-core's mappings,
from any thread. Before the call goes on to gloo or NCCL, an optional checker (the lockstep)
sees it and may stop it by raising.

Each record: op, group (global ranks), shapes, dtype, reduce op, root, phase (``backward`` when
autograd's engine runs it), call site (first frame outside torch and the harness), and the call's
number within its group.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import sys
import sysconfig
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from shardcheck.harness.wire import short_path

# op -> (index of the argument whose shapes must agree across ranks, or None; root argument index)
_OPS: dict[str, tuple[int | None, int | None]] = {
    "allreduce_": (0, None),
    "allreduce_coalesced_": (0, None),
    "broadcast_": (0, 2),
    "reduce_": (0, 3),
    "allgather_": (1, None),
    "_allgather_base_": (1, None),
    "allgather_coalesced_": (1, None),
    "allgather_into_tensor_coalesced_": (1, None),
    "reduce_scatter_": (0, None),
    "_reduce_scatter_base_": (0, None),
    "reduce_scatter_tensor_coalesced_": (0, None),
    "alltoall_": (None, None),  # uneven splits are legal: shapes may differ across ranks
    "alltoall_base_": (None, None),
    "gather_": (1, 3),
    "scatter_": (0, 3),
    "barrier": (None, None),
    "monitored_barrier_": (None, None),
    "send": (0, 2),
    "recv_": (0, 2),
    "recv_any_source_": (0, None),
}
POINT_TO_POINT = frozenset({"send", "recv", "recv_any_source"})  # public op names
_PUBLIC_NAMES = {
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce_coalesced", "broadcast_": "broadcast",
    "reduce_": "reduce", "allgather_": "all_gather", "_allgather_base_": "all_gather_into_tensor",
    "allgather_coalesced_": "all_gather_coalesced", "allgather_into_tensor_coalesced_":
    "all_gather_into_tensor_coalesced", "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_":
    "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced_": "reduce_scatter_tensor_coalesced",
    "alltoall_": "all_to_all", "alltoall_base_": "all_to_all_single", "gather_": "gather",
    "scatter_": "scatter", "barrier": "barrier", "monitored_barrier_": "monitored_barrier", "send": "send",
    "recv_": "recv", "recv_any_source_": "recv_any_source",
}

STACK_DEPTH = 3  # frames of the call stack every member of a group must share
STACK_SHOWN = 3
# frames that are never the code under test: torch, the harness, the standard library, and
# decorators that wrap torch's API (deprecation shims: typing_extensions, wherever it is installed,
# which in a layered environment is not this interpreter's own site-packages)
_SHIM = importlib.util.find_spec("typing_extensions")
_SKIPPED = (
    os.path.dirname(torch.__file__) + os.sep,
    os.path.dirname(importlib.util.find_spec("shardcheck.harness").origin) + os.sep,  # all of the harness
    # the harness's own modules that sit below the targets (their floor, not their folder)
    importlib.util.find_spec("shardcheck.backend").origin,
    importlib.util.find_spec("shardcheck.scenarios.traced_layout").origin,
    sysconfig.get_paths()["stdlib"] + os.sep,
    *((_SHIM.origin,) if _SHIM is not None and _SHIM.origin else ()),
    # shardcheck's pass-through wrappers between a caller under test and the function it calls
    importlib.util.find_spec("shardcheck.targets.passthrough").origin,
)


@dataclass
class Call:
    """One collective as a rank issued it."""

    op: str
    group: str  # the group's name: the same on every member
    ranks: list[int]  # the group's global ranks
    number: int  # this rank's call number within the group
    shapes: list[list[int]]
    dtype: str | None
    reduce_op: str | None
    root: int | None
    phase: str  # forward | backward | gradient sync (a training step's, after its last backward)
    site: str  # file:line of the first frame outside torch and the harness
    # that frame and its callers (outside torch and the harness): two calls of the same shape
    # through one helper differ here, so a skipped call cannot silently pair with the next one
    stack: list[str] = field(default_factory=list)
    # in backward: where the autograd node that issued it was made in the forward (recorded when
    # the forward ran under anomaly mode: a scenario run again to explain a finding)
    created_at: str | None = None

    def fingerprint(self) -> dict[str, Any]:
        """What every member of the group must agree on."""
        return {k: getattr(self, k) for k in FINGERPRINT}

    def fingerprint_key(self) -> tuple:
        """The fingerprint as a hashable tuple (cheap; for memoising its digest)."""
        return (self.op, tuple(map(tuple, self.shapes)), self.dtype, self.reduce_op, self.root, self.phase,
                tuple(self.stack))

    def describe(self) -> str:
        shape = ",".join("x".join(map(str, s)) for s in self.shapes) or "-"
        parts = [f"{self.op}(", f"{self.reduce_op}, " if self.reduce_op else "",
                 f"root={self.root}, " if self.root is not None else "", f"{self.dtype}[{shape}])"]
        via = " <- ".join(self.stack[1:STACK_SHOWN])
        made = f" (its forward at {self.created_at})" if self.created_at else ""
        return "".join(parts) + f" in {self.phase} at {self.site}" + (f" <- {via}" if via else "") + made

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


FINGERPRINT = ("op", "shapes", "dtype", "reduce_op", "root", "phase", "site", "stack")

Checker = Callable[[Call], None]


@dataclass
class Trace:
    """The calls of one scenario on this rank, and the per-group counters that number them."""

    calls: list[Call] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)
    checker: Checker | None = None


# The process-wide state of the trace (reset by :func:`reset`):
_lock = threading.Lock()
_active: Trace | None = None  # one scenario at a time per rank; calls from any thread land here
_label: str | None = None  # the phase of calls outside autograd's backward, where not forward (labelled)
_library: Any = None
_group_ranks: dict[str, list[int]] = {}  # group name -> global ranks (names are unique per process)


class _Backend:
    failed = False


_backend = _Backend()


def install() -> None:
    """Register the interception kernels (once per process; idempotent)."""
    global _library
    with _lock:
        if _library is not None:
            return
        lib = torch.library.Library("c10d", "IMPL")
        for name in _OPS:
            if hasattr(torch.ops.c10d, name):
                lib.impl(name, _kernel(name), "BackendSelect")
        _library = lib


def reset() -> None:
    """Forget the process's trace state (a world left, another may be joined). The kernels stay
    registered: a ``torch.library`` registration lives as long as the process."""
    global _active
    with _lock:
        _active = None
        _group_ranks.clear()
        _backend.failed = False


@contextlib.contextmanager
def labelled(phase: str) -> Iterator[None]:
    """Calls issued inside (outside autograd's backward) are of ``phase``, not forward: a
    training step's gradient sync after the last backward ("gradient sync")."""
    global _label
    saved, _label = _label, phase
    try:
        yield
    finally:
        _label = saved


def start(checker: Checker | None = None) -> Trace:
    """Begin a new trace (a scenario); calls are numbered from 0 in every group."""
    global _active
    _active = Trace(checker=checker)
    _backend.failed = False
    return _active


def stop() -> Trace | None:
    global _active
    trace, _active = _active, None
    return trace


def backend_failed() -> bool:
    """Whether a collective failed inside the backend since the last :func:`start`."""
    return _backend.failed


def _kernel(name: str) -> Callable[..., Any]:
    op = getattr(torch.ops.c10d, name).default
    after = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.BackendSelect)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        trace = _active
        if trace is not None:
            call = _record(name, args, trace)
            if trace.checker is not None and call is not None:
                trace.checker(call)  # may raise: the call then never reaches the backend
        if name == "alltoall_base_" and args[1].numel() == 0 and _fake_backend():
            args = _fake_alltoall_input(args)
        tensor = _first_tensor(args)
        keys = torch._C._dispatch_keys(tensor) & after if tensor is not None else after
        try:
            return op.redispatch(keys, *args, **kwargs)
        except BaseException:
            _backend.failed = True  # the backend's own state may now be out of step across ranks
            raise

    return kernel


def _fake_backend() -> bool:
    return dist.is_initialized() and dist.get_backend() == "fake"


def _fake_alltoall_input(args: tuple) -> tuple:
    """torch's fake process group (a simulated world) fills an all-to-all's output by repeating
    its input, and refuses an empty input where the output is not: a rank sending nothing (Ulysses'
    gather on a rank with only padding) is legal on gloo and NCCL, so it gets one row to repeat.
    No data moves in a simulated world; its values are never checked."""
    output, given, group, out_splits, in_splits = args[:5]
    one = [1] + [0] * (len(in_splits) - 1) if in_splits else in_splits
    return (output, given.new_zeros((1, *given.shape[1:])), group, out_splits, one, *args[5:])


def _record(name: str, args: tuple, trace: Trace) -> Call | None:
    pg_obj = next((a for a in args if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type())), None)
    if pg_obj is None:
        return None
    pg = dist.ProcessGroup.unbox(pg_obj)
    group = pg.group_name
    ranks = _group_ranks.get(group)
    if ranks is None:
        try:
            ranks = dist.get_process_group_ranks(pg)
        except (RuntimeError, ValueError, KeyError):
            ranks = list(range(pg.size()))
        _group_ranks[group] = ranks
    with _lock:
        number = trace.counters.get(group, 0)
        trace.counters[group] = number + 1
    shape_arg, root_arg = _OPS[name]
    tensors = tensors_in(args[shape_arg]) if shape_arg is not None else []
    all_tensors = tensors_in(args)
    red = next((a for a in args if isinstance(a, torch.ScriptObject) and "ReduceOp" in str(a._type())), None)
    stack = call_stack()
    node = torch._C._current_autograd_node()
    phase = "backward" if node is not None else (_label or "forward")
    call = Call(
        op=_PUBLIC_NAMES[name],
        group=group,
        ranks=ranks,
        number=number,
        shapes=[list(t.shape) for t in tensors],
        dtype=str(all_tensors[0].dtype).replace("torch.", "") if all_tensors else None,
        reduce_op=_reduce_name(red) if red is not None else None,
        root=args[root_arg] if root_arg is not None and isinstance(args[root_arg], int) else None,
        phase=phase,
        site=stack[0] if stack else (f"(backward of {node.name()})" if node is not None else "(no Python caller)"),
        stack=stack,
        created_at=_forward_site(node) if node is not None else None,
    )
    trace.calls.append(call)
    return call


_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def _forward_site(node: Any) -> str | None:
    """The first frame outside torch and the harness of the forward stack torch recorded for an
    autograd node (anomaly mode records it as ``metadata["traceback_"]``), innermost first."""
    try:
        frames = node.metadata.get("traceback_") or []
    except (AttributeError, RuntimeError):
        return None
    for text in reversed(frames):
        m = _FRAME.search(text)
        if m and not (m.group(1).startswith(_SKIPPED) or m.group(1).startswith("<")):
            return f"{short_path(m.group(1))}:{m.group(2)}"
    return None


def _reduce_name(red: Any) -> str:
    try:
        return dist.ReduceOp.RedOpType(int(red.op())).name
    except (ValueError, TypeError, RuntimeError):
        return str(red.op())


def tensors_in(x: Any) -> list[torch.Tensor]:
    """The tensors in an op argument (a tensor, or nested lists and tuples of them)."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in tensors_in(y)]
    return []


def _first_tensor(x: Any) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (list, tuple)):
        for y in x:
            t = _first_tensor(y)
            if t is not None:
                return t
    return None


def call_stack(depth: int = STACK_DEPTH, frame: Any = None) -> list[str]:
    """``file:line`` of the innermost frames outside torch and the harness (the code under test),
    innermost first, from ``frame`` outwards (default: the caller's caller)."""
    out = []
    frame = frame if frame is not None else sys._getframe(2)
    while frame is not None and len(out) < depth:
        path = frame.f_code.co_filename
        if not (path.startswith(_SKIPPED) or path.startswith("<")):
            out.append(f"{short_path(path)}:{frame.f_lineno}")
        frame = frame.f_back
    return out
