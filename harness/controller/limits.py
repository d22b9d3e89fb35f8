"""What a world may ask of this machine, checked before any world starts: how many ranks, how
much memory a scenario takes on each, and how long a timeout the store and the backend accept.

A world past these ends badly and late: ranks that outnumber the cores time out in megatron's
group creation (blamed on the target as a hang), ranks that outgrow the memory are killed by the
OOM killer (blamed on the target as a rank killed by SIGKILL, or the controller itself is
killed), and a timeout past what torch converts overflows after the world has started. Each is
refused here instead, with one line naming the figures. ``--allow-large-world`` lifts the rank
and memory bounds (they are estimates); the timeout bound is not an estimate and stays.

Everything here is arithmetic on a scenario's fields and a few files under /proc and /sys: no
torch import, so the CLI refuses in milliseconds.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from shardcheck.errors import BadInput
from shardcheck.harness.controller.memory import size_text
from shardcheck.harness.layout import allgather_pieces, zigzag_positions
from shardcheck.scenarios.scenario import Scenario

MiB = 1 << 20
GiB = 1 << 30

# -- figures -------------------------------------------------------------------------------------
# Ranks fork from a server that imported torch and megatron-core once (world._start_context), so a
# rank's own memory is the pages it writes. Measured on a 4-rank gloo world (VmRSS, Pss and
# Private_* of /proc/PID/smaps_rollup): idle 288 MiB RSS, 68 MiB Pss, 16 MiB private; after the 52
# smoke scenarios 321 MiB RSS, 94 MiB Pss, 37 MiB private; from 2 to 16 ranks the world's total
# Pss grew by 20 MiB a rank idle, 26 MiB after three scenarios. 128 MiB a rank is 3.5x the largest
# private size seen: room for copy-on-write growth over a long run and for a target's own imports.
RANK_BYTES = 128 * MiB
# The controller (about 220 MiB RSS with torch imported) and the fork server (about 350 MiB RSS,
# much of it shared with the ranks): kept out of what the ranks may have.
CONTROLLER_BYTES = 512 * MiB
# Gloo worlds on 2 cores, the first five smoke scenarios on each (World(n).run): 16 ranks start in
# 4.3 s and take 0.75 s at worst a scenario, 32 start in 9.9 s and take 3.5 s, 64 start in 13.9 s
# and hang past the 60 s timeout in megatron's group creation. 8 a core stays well inside that.
RANKS_PER_CORE = 8
# multiprocessing's wait (poll) takes whole milliseconds in a C int: a wait past 2**31 - 1 ms
# (24.8 days) raises OverflowError (World.run has waited the timeout + 10 s in one call); TCPStore and gloo add the timeout to a steady-clock time in
# int64 nanoseconds, which overflows past about 9.2e9 s (seen: 1e10 s fails to connect, 1e13 s
# makes gloo refuse "Invalid timeout", past 8.64e13 s datetime.timedelta overflows). A week is
# far above any scenario's need and 3.5x inside the smallest of those.
MAX_TIMEOUT_S = 7 * 24 * 3600.0

# The data path's own figures (mirrored: their modules import torch; tests check they agree).
BLOCK_ROWS = 64  # scenarios.data.BLOCK_ROWS: logit rows are generated 64 at a time, full vocab
CHUNK_ROWS = 256  # reference.DEFAULT_CHUNK_ROWS: the float64 reference's rows per chunk, at most
# (fewer past a vocabulary of 4096: reference.chunk_rows_for; the estimate stays the upper bound)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# float64 [chunk rows, vocab] tensors alive at once in the reference: the scaled logits, the
# log-softmax, the probabilities, the gradient and one temporary (p * s, or the comparison's).
REFERENCE_F64_COPIES = 5
# A target's own float32 [rows, vocab / tp] tensors at its peak, as the builtin's: s and p saved
# for the backward, the gradient and its temporaries. Measured: 6 with the entropy gradient
# (entropy_coef != 0), 4 without.
TARGET_F32_COPIES = {True: 6, False: 4}
# Python bookkeeping per local row (row_positions tuples, the per-row target and share maps):
# measured 374 bytes a row at vocab 8 with the tensors; 256 for the Python part.
ROW_PYTHON_BYTES = 256
MAX_CHUNKS_WALKED = 20_000  # past this many reference chunks, each is bounded instead of walked


# -- the machine ---------------------------------------------------------------------------------
def usable_cores(root: str = "/sys/fs/cgroup") -> int:
    """The cores this process may run on: its CPU affinity, lowered by a cgroup v2 CPU quota
    (``cpu.max``: "quota period", or "max" for none), since ranks past those share them."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = _read(Path(root) / "cpu.max")
    if quota:
        parts = quota.split()
        if len(parts) == 2 and parts[0] != "max":
            try:
                cores = min(cores, max(1, math.ceil(int(parts[0]) / int(parts[1]))))
            except (ValueError, ZeroDivisionError):
                pass
    return max(1, cores)


def available_memory(meminfo: str = "/proc/meminfo", proc_cgroup: str = "/proc/self/cgroup",
                     root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes a new world may take: MemAvailable, or less where a cgroup's memory limit is nearer
    (the OOM killer acts on the cgroup, whatever the machine has free). None when nothing can be
    read (not Linux): the memory checks are then not made."""
    figures = [x for x in (_meminfo_available(meminfo), cgroup_headroom(proc_cgroup, root)) if x is not None]
    return min(figures) if figures else None


def _meminfo_available(path: str) -> int | None:
    text = _read(Path(path))
    for line in (text or "").splitlines():
        if line.startswith("MemAvailable:"):
            try:
                return int(line.split()[1]) * 1024
            except (IndexError, ValueError):
                return None
    return None


UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a number near 2**63


def cgroup_headroom(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """The least headroom (limit - usage + reclaimable page cache) over this process's memory
    cgroup and its ancestors, each of whose limits applies; None where no limit is set.

    cgroup v2: ``memory.max`` ("max": none), ``memory.current``, ``inactive_file`` of
    ``memory.stat``; the process's cgroup is the "0::PATH" line of /proc/self/cgroup (under a
    cgroup namespace PATH is "/", the root of the mount). cgroup v1: the ``memory`` controller's
    ``memory.limit_in_bytes``, ``memory.usage_in_bytes`` and ``total_inactive_file``."""
    paths = _cgroup_paths(proc_cgroup)
    found = []
    v2 = paths.get("")
    if v2 is not None:
        found += [_headroom(d, "memory.max", "memory.current", "inactive_file") for d in _ancestors(root, v2)]
    v1 = paths.get("memory")
    if v1 is not None:
        found += [_headroom(d, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
                  for d in _ancestors(os.path.join(root, "memory"), v1)]
    if v2 is None and v1 is None:  # no /proc/self/cgroup: the mount's root, as v2 would have it
        found.append(_headroom(Path(root), "memory.max", "memory.current", "inactive_file"))
    found = [x for x in found if x is not None]
    return min(found) if found else None


def _cgroup_paths(proc_cgroup: str) -> dict[str, str]:
    """Controller -> path from /proc/self/cgroup ("" is cgroup v2's unified hierarchy)."""
    out: dict[str, str] = {}
    for line in (_read(Path(proc_cgroup)) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            out[""] = path
        elif "memory" in controllers.split(","):
            out["memory"] = path
    return out


def _ancestors(root: str, path: str) -> list[Path]:
    """The cgroup's folder and its parents up to the mount's root, those that exist."""
    base = Path(root)
    here = base / path.strip("/")
    out = []
    while True:
        if here.is_dir():
            out.append(here)
        if here == base or base not in here.parents:
            break
        here = here.parent
    return out or ([base] if base.is_dir() else [])


def _headroom(folder: Path, limit_file: str, usage_file: str, inactive_key: str) -> int | None:
    limit_text = _read(folder / limit_file)
    if limit_text is None or limit_text.strip() == "max":
        return None
    try:
        limit = int(limit_text)
        usage = int(_read(folder / usage_file) or 0)
    except ValueError:
        return None
    if limit >= UNLIMITED:
        return None
    inactive = 0
    for line in (_read(folder / "memory.stat") or "").splitlines():
        key, _, value = line.partition(" ")
        if key == inactive_key:
            try:
                inactive = int(value)
            except ValueError:
                pass
    return max(0, limit - usage + inactive)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


# -- ranks ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Machine:
    """What the bounds are made from (given in tests; read from /proc and /sys otherwise)."""

    cores: int
    memory: int | None  # bytes available; None: unknown, memory is not checked

    @classmethod
    def here(cls) -> Machine:
        return cls(usable_cores(), available_memory())

    @property
    def max_ranks(self) -> int:
        """The largest world this machine is trusted with: RANKS_PER_CORE a core, and as many
        ranks of RANK_BYTES as the memory past the controller's holds; at least 1."""
        by_cores = RANKS_PER_CORE * self.cores
        return max(1, min(by_cores, self.ranks_by_memory if self.memory is not None else by_cores))

    @property
    def ranks_by_memory(self) -> int:
        return max(0, ((self.memory or 0) - CONTROLLER_BYTES) // RANK_BYTES)

    def figures(self) -> str:
        text = f"{RANKS_PER_CORE} a core x {self.cores} core{'s' * (self.cores != 1)}"
        if self.memory is not None:
            text += (f"; {size_text(self.memory)} of memory available holds {self.ranks_by_memory} "
                     f"at {size_text(RANK_BYTES)} a rank")
        return text


OVERRIDE = "--allow-large-world"


def check_nproc(nproc: int | None, *, allow_large_world: bool = False, machine: Machine | None = None,
                what: str | None = None) -> None:
    """Refuse a world of ``nproc`` ranks past :attr:`Machine.max_ranks` (unless allowed).
    ``what`` names where the size came from when it was not --nproc."""
    if nproc is None or allow_large_world:
        return
    machine = machine or Machine.here()
    if nproc > machine.max_ranks:
        who = what or f"--nproc {nproc}"
        raise BadInput(f"{who} is more ranks than this machine can hold: at most {machine.max_ranks} "
                       f"({machine.figures()}) ({OVERRIDE} to start it anyway)")


# -- timeouts ------------------------------------------------------------------------------------
def check_timeout(seconds: float, option: str = "--timeout") -> float:
    """``seconds`` if a world can wait that long; BadInput for NaN, inf, <= 0, or past
    MAX_TIMEOUT_S (where torch's and the OS's conversions overflow, after the world started)."""
    if not math.isfinite(seconds) or not seconds > 0:
        raise BadInput(f"{option} must be a finite number of seconds > 0, got {seconds}")
    if seconds > MAX_TIMEOUT_S:
        raise BadInput(f"{option} {seconds:g} is more than the most a world can wait: "
                       f"{MAX_TIMEOUT_S:.0f} s (7 days)")
    return seconds


def timeout_seconds(text: str) -> float:
    """argparse ``type`` of every --timeout: a float within :func:`check_timeout`'s bounds (the
    error keeps argparse's words for what is not a number)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    try:
        return check_timeout(value, "")
    except BadInput as exc:
        raise argparse.ArgumentTypeError(str(exc).strip()) from None


# -- a scenario's memory -------------------------------------------------------------------------
Run = tuple[int, int, int]  # (stream, start, stop): consecutive rows of one stream, as layout.Piece


def local_pieces(sc: Scenario, cp_rank: int) -> list[Run]:
    """The logit rows a (tp, ``cp_rank``) rank holds, as ``rank_layout(sc, 0, cp_rank).pieces``
    would give them, without building the layout's share (O(tokens) for a long sample)."""
    samples = sc.samples
    if sc.layout == "thd":
        return [(i, 0, s.total) for i, s in enumerate(samples)]
    if sc.layout == "bshd":
        m = max(s.total for s in samples)
        return [(i, 0, m) for i in range(len(samples))]
    if sc.layout == "zigzag":
        return [(i, r.start, r.stop) for i, s in enumerate(samples) for r in zigzag_positions(s.total, sc.cp, cp_rank)]
    return [(p.stream, p.start, p.stop) for p in allgather_pieces(sc, cp_rank)]


def share_pieces(sc: Scenario, cp_rank: int) -> list[Run]:
    """The rows scoring the rank's share of response tokens, merged into runs as
    ``shard.share_pieces`` merges them: the rows the values' reference generates."""
    out: list[Run] = []
    for i, s in enumerate(sc.samples):
        lo, hi = s.prompt - 1, s.total - 1
        ranges = [range(0, s.total)] if sc.cp == 1 else zigzag_positions(s.total, sc.cp, cp_rank)
        for r in ranges:
            a, b = max(lo, r.start), min(hi, r.stop)
            if a >= b:
                continue
            if out and out[-1][0] == i and out[-1][2] == a:
                out[-1] = (i, out[-1][1], b)
            else:
                out.append((i, a, b))
    return out


def _blocks(start: int, stop: int) -> int:
    return 0 if stop <= start else (stop - 1) // BLOCK_ROWS - start // BLOCK_ROWS + 1


def _rows(pieces: Iterable[Run]) -> int:
    return sum(b - a for _, a, b in pieces)


def generation_bytes(pieces: Sequence[Run], vocab: int, dsize: int) -> tuple[int, int]:
    """(peak, kept) bytes of generating ``pieces``' logit rows (``PieceRows.rows``): every row
    full vocab, in whole blocks of BLOCK_ROWS drawn as float32. Peak: the blocks so far, plus the
    block being drawn (float32 randn, and its scaled float32 copy when the dtype is narrower),
    or a piece's blocks concatenated; then the pieces concatenated. Kept: what the result holds
    (a view of its piece's blocks when there is one piece)."""
    blocks = [_blocks(a, b) for _, a, b in pieces]
    kept_blocks = sum(blocks) * BLOCK_ROWS * vocab * dsize
    drawing = BLOCK_ROWS * vocab * (4 if dsize == 4 else 8)
    concat = max((n * BLOCK_ROWS * vocab * dsize for n in blocks if n > 1), default=0)
    joined = _rows(pieces) * vocab * dsize if len(pieces) > 1 else 0
    return kept_blocks + max(drawing, concat) + joined, (joined if len(pieces) > 1 else kept_blocks)


def _chunks(pieces: Sequence[Run], size: int) -> Iterator[list[Run]]:
    """``pieces`` cut into consecutive runs of ``size`` rows (the reference's chunks)."""
    chunk: list[Run] = []
    room = size
    for stream, a, b in pieces:
        while a < b:
            take = min(room, b - a)
            chunk.append((stream, a, a + take))
            a, room = a + take, room - take
            if room == 0:
                yield chunk
                chunk, room = [], size
    if chunk:
        yield chunk


def reference_bytes(pieces: Sequence[Run], vocab: int, dsize: int) -> int:
    """Peak bytes of the float64 reference over ``pieces`` (``reference.truth``): chunk after
    chunk of CHUNK_ROWS rows, each generated (full vocab, see :func:`generation_bytes`) and then
    held while REFERENCE_F64_COPIES float64 [chunk, vocab] tensors are alive."""
    rows = _rows(pieces)
    if rows == 0:
        return 0
    if rows > CHUNK_ROWS * MAX_CHUNKS_WALKED:  # bound a chunk: every piece in it adds a block at each end
        shortest = max(1, min(b - a for _, a, b in pieces if b > a))
        k = min(len(pieces), CHUNK_ROWS // shortest + 2)  # the most pieces a chunk can touch
        gen_rows = min(CHUNK_ROWS + 2 * BLOCK_ROWS * k, sum(_blocks(a, b) for _, a, b in pieces) * BLOCK_ROWS)
        kept = gen_rows * vocab * dsize + (CHUNK_ROWS * vocab * dsize if k > 1 else 0)
        peak = kept + max(BLOCK_ROWS * vocab * 8, gen_rows * vocab * dsize)
        return max(peak, kept + REFERENCE_F64_COPIES * CHUNK_ROWS * vocab * 8)
    worst = 0
    for chunk in _chunks(pieces, CHUNK_ROWS):
        peak, kept = generation_bytes(chunk, vocab, dsize)
        worst = max(worst, peak, kept + REFERENCE_F64_COPIES * _rows(chunk) * vocab * 8)
    return worst


def rank_bytes(sc: Scenario, cp_rank: int = 0, *, reference: bool = True, outputs: bool = False) -> int:
    """Peak bytes one rank of ``sc`` (at ``cp_rank``) allocates for the scenario, by phase
    (``harness.rank.main.RankRunner._run``), the largest phase counted:

    - the local logits (``shard.local_logits``): rows generated full vocab, see
      :func:`generation_bytes`; then its vocab columns copied (tp > 1) or viewed (tp = 1: the
      generated rows, block padding included, stay as the leaf);
    - the target: the leaf, the copy handed to the target (R x V/tp, the dtype's size), and the
      target's own TARGET_F32_COPIES float32 R x V/tp tensors;
    - the comparison (``reference``): the leaf, the copy, the gradient and its float64 copy, and
      the reference's chunk (:func:`reference_bytes`) over the local rows (the gradient) or the
      share rows (the values), whichever is larger;
    - the outputs sent back (``outputs``, invariance): the gradient, its copy and the pickle;
    - plus ROW_PYTHON_BYTES a local row.

    Measured peaks (VmHWM minus the idle rank's VmRSS, builtin target, gloo) against this:
    vocab 2e6, one sample 10/5: 1.89 GiB (estimate 2.00 GiB); vocab 2e5, one sample 2000/1000:
    9.61 GiB (9.58), tp=2 5.85 (5.82), entropy_coef 0.1 11.98 (11.96), bfloat16 7.78 (7.47);
    100/50: 1.12 (1.23); 20 samples of 30/10: 4.35 (4.33); zigzag cp=2: 3.23 (3.59); vocab 5e6:
    4.64 (4.99). tests/test_limits.py keeps them (MEASURED) within -15 % / +25 %.
    """
    dsize = DTYPE_BYTES[sc.dtype]
    vocab, local_vocab = sc.vocab, sc.vocab // sc.tp
    pieces = local_pieces(sc, cp_rank)
    rows = _rows(pieces)
    generated, kept = generation_bytes(pieces, vocab, dsize)
    leaf = kept if sc.tp == 1 else rows * local_vocab * dsize
    local = rows * local_vocab
    held = leaf + local * dsize  # the leaf and the copy the target is given
    entropy_grad = sc.with_entropy and sc.entropy_coef != 0
    phases = [generated, held + TARGET_F32_COPIES[entropy_grad] * local * 4]
    if reference:
        values = reference_bytes(share_pieces(sc, cp_rank), vocab, dsize)
        grad = local * (dsize + 8) + reference_bytes(pieces, vocab, dsize)
        phases.append(held + max(values, grad))
    if outputs:
        phases.append(held + 3 * local * dsize)
    return max(phases) + ROW_PYTHON_BYTES * rows


def scenario_bytes(scenario: Scenario, *, reference: bool = True, outputs: bool = False) -> int:
    """Peak bytes a rank allocates for ``scenario``: the most over its CP ranks (TP ranks differ
    only in which columns they keep, data-parallel replicas repeat one of them). Why it is what
    it is: :func:`rank_bytes`. An estimate, within about 25 % of the measured peaks, mostly
    above; the target's own share is the builtin target's."""
    return max(rank_bytes(scenario, r, reference=reference, outputs=outputs) for r in range(scenario.cp))


# -- the checks the CLI makes --------------------------------------------------------------------
def _world_size(scenarios: Sequence[Scenario]) -> int:
    """runner.world_size_for: the smallest world every scenario fits in."""
    return math.lcm(*(s.ranks for s in scenarios)) if scenarios else 1


def _check_fits(name: str, per_rank: int, ranks: int, machine: Machine, *, controller: int | None = None) -> None:
    """Refuse when ``ranks`` ranks of ``per_rank`` bytes do not fit in the memory past the
    controller's and every rank's own. ``controller``: invariance, the bytes its controller
    keeps of the variants' outputs (``per_rank`` is then the most over the variants)."""
    if machine.memory is None:
        return
    room = machine.memory - CONTROLLER_BYTES - ranks * RANK_BYTES
    need = per_rank * ranks + (controller or 0)
    if need > room:
        over = " over its invariance variants" if controller is not None else ""
        kept = f" and {size_text(controller)} the controller keeps of their gradients" if controller is not None else ""
        raise BadInput(
            f"scenario {name!r} needs about {size_text(per_rank)} a rank{over}: {size_text(per_rank * ranks)} for "
            f"{ranks} rank{'s' * (ranks != 1)}{kept}, more than the {size_text(max(room, 0))} available to them "
            f"({size_text(machine.memory)} free, less {size_text(CONTROLLER_BYTES)} for the controller and "
            f"{size_text(RANK_BYTES)} a rank) ({OVERRIDE} to run it anyway)")


def check_run(scenarios: Sequence[Scenario], nproc: int | None, *, allow_large_world: bool = False,
              machine: Machine | None = None) -> None:
    """What ``shardcheck run`` is about to start: a world of ``nproc`` ranks (default: the
    smallest every scenario fits in) within :attr:`Machine.max_ranks`, and every scenario it
    will run (tp * cp dividing the world) within the memory, on every rank (data-parallel
    replicas run it too)."""
    if allow_large_world:
        return
    machine = machine or Machine.here()
    size = nproc or _world_size(scenarios)
    check_nproc(size, machine=machine,
                what=None if nproc else f"these scenarios need a world of {size} ranks (the lcm of their tp*cp), which")
    for sc in scenarios:
        if size % sc.ranks == 0:
            _check_fits(sc.name, scenario_bytes(sc), size, machine)


def check_invariance(scenarios: Sequence[Scenario], axes: Sequence[str], nproc: int | None, *,
                     allow_large_world: bool = False, machine: Machine | None = None) -> None:
    """What ``shardcheck invariance`` is about to start (``check_invariance``'s world: ``nproc``,
    default the smallest every base fits in, at least 4): the world within the cores and memory,
    and each base's variants along ``axes`` (tp = 1 holds the whole vocab on a rank, cp = 1 every
    row) within the memory. Variants run without the reference and send their outputs back; the
    controller keeps each variant's logit gradient, [total, vocab] per sample, for the rest of
    the run, so those add up over the bases."""
    if allow_large_world:
        return
    from shardcheck.harness.controller.invariance import variants  # imports torch

    machine = machine or Machine.here()
    size = nproc or max(4, _world_size(scenarios))
    check_nproc(size, machine=machine,
                what=None if nproc else f"these scenarios need a world of {size} ranks (the lcm of their tp*cp), which")
    kept: dict[str, int] = {}  # scenario key -> bytes the controller keeps of its outputs
    for base in scenarios:
        per_rank, in_flight = 0, 0
        for axis in axes:
            for v in variants(axis, base, size):
                sc = v.scenario
                if sc is None:
                    continue
                per_rank = max(per_rank, scenario_bytes(sc, reference=False, outputs=True))
                grads = sum(s.total for s in sc.samples) * sc.vocab * DTYPE_BYTES[sc.dtype]
                kept[sc.key] = grads
                in_flight = max(in_flight, grads * (size // sc.ranks))  # every replica's gradient arrives
        _check_fits(base.name, per_rank, size, machine, controller=sum(kept.values()) + in_flight)
