"""The lockstep's board: where the ranks of a world on one machine announce the calls they are
about to issue, in memory they share, and wake the peers that wait on them.

Over the store a call costs every rank two round trips through the controller's server thread,
which every call of every rank queues on; on a 2-core machine that was most of what lockstep
cost. Here a rank writes one word and wakes each peer of the group with a futex: microseconds.

The board is a file in the world's folder (removed with it), mapped by the controller and by
every rank. Each rank owns a region that only it writes:

- word 0: its wake counter: a peer bumps it after writing, then wakes it (a futex on the word's
  low 32 bits, which is why the board needs Linux on a little-endian machine);
- word 1: how many calls it has announced (the controller's sign of progress);
- SLOTS slots of two words, one per group it called in this scenario: the group's key (a hash
  of its name, found by linear probing from ``key % SLOTS``) and its state: the scenario (8
  bits), the call number (20 bits) and the fingerprint's digest (36 bits), or a mark that it
  finished or stopped instead of making that call.

A state is one aligned 64-bit word, written and read whole, so a reader sees the old call or the
new, never half of each. A peer's bump can be lost when two peers bump at once; the waiter then
wakes at its timeout (every wait has one) and reads again.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import mmap
import os
import platform
import sys

SLOTS = 128  # groups one rank may call in within one scenario
_HEADER = 2
_REGION = _HEADER + 2 * SLOTS  # words per rank
_SEQ_SHIFT, _NUMBER_SHIFT = 56, 36
_NUMBER_MASK = (1 << 20) - 1
_CODE_MASK = (1 << 36) - 1
FINISHED, STOPPED = 1, 2  # codes of a call a rank will never make (0: nothing written)
AHEAD = -1  # read: the peer is past this call (it made it: every member agreed on it)
_FIRST_DIGEST = 3

_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine().lower())
# syscall(2) is variadic: every integer goes as a long
_FUTEX_CALL = ctypes.c_long(_SYS_FUTEX or 0)
_WAIT, _WAKE, _WAKE_ALL, _ZERO = ctypes.c_long(0), ctypes.c_long(1), ctypes.c_long(0x7FFFFFFF), ctypes.c_long(0)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def supported() -> bool:
    """Whether this machine can share a board between processes (futexes, little-endian words)."""
    return sys.platform == "linux" and sys.byteorder == "little" and _SYS_FUTEX is not None


@functools.lru_cache(maxsize=4096)  # a call site's digest repeats thousands of times a run
def code_of(digest: str) -> int:
    """A fingerprint digest (hex) as the 36-bit code a state holds, clear of the marks."""
    code = int(digest, 16) & _CODE_MASK
    return code if code >= _FIRST_DIGEST else code + _FIRST_DIGEST


_keys: dict[str, int] = {}


def _key(group: str) -> int:
    key = _keys.get(group)
    if key is None:
        key = _keys[group] = int.from_bytes(hashlib.blake2b(group.encode(), digest_size=8).digest(), "little") | 1
    return key


class Board:
    """One process's view of the board: a rank's (``rank`` given) or the controller's."""

    @classmethod
    def create(cls, path: str, world_size: int) -> Board:
        """An empty board for ``world_size`` ranks at ``path``, as the controller sees it."""
        with open(path, "wb") as f:
            f.truncate(world_size * _REGION * 8)
        return cls(path, world_size)

    def __init__(self, path: str, world_size: int, rank: int | None = None) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, world_size * _REGION * 8)
        finally:
            os.close(fd)
        self.words = memoryview(self._mm).cast("Q")
        self._address = ctypes.addressof(ctypes.c_char.from_buffer(self._mm))
        self.world_size = world_size
        self.rank = rank
        self._seq = 0
        self._slots: dict[str, int] = {}  # this rank's slot of each group it called in this scenario
        libc = ctypes.CDLL(None, use_errno=True)
        self._syscall = libc.syscall
        self._syscall.restype = ctypes.c_long
        self._no_time = ctypes.c_void_p(None)

    # -- the owner's side ------------------------------------------------------------------------
    def begin(self, seq: int) -> None:
        """A new scenario: this rank's slots are emptied (no peer reads the last scenario's any
        more: the controller starts a scenario only after every rank returned the one before)."""
        w, base = self.words, self._base(self.rank)
        for i in self._slots.values():
            w[base + _HEADER + 2 * i + 1] = 0
            w[base + _HEADER + 2 * i] = 0
        self._slots = {}
        self._seq = seq & 0xFF

    def post(self, group: str, number: int, code: int, peers: list[int]) -> None:
        """Say that this rank is at call ``number`` of ``group`` (with ``code``: its digest, or a
        mark), then wake ``peers``."""
        w, base = self.words, self._base(self.rank)
        i = self._slots.get(group)
        if i is None:
            i = self._slots[group] = self._insert(group)
        w[base + _HEADER + 2 * i + 1] = (self._seq << _SEQ_SHIFT) | ((number & _NUMBER_MASK) << _NUMBER_SHIFT) | code
        w[base + 1] += 1
        for p in peers:
            self.wake(p)

    def _insert(self, group: str) -> int:
        w, base, key = self.words, self._base(self.rank), _key(group)
        start = key % SLOTS
        for k in range(SLOTS):
            i = (start + k) % SLOTS
            if w[base + _HEADER + 2 * i] in (0, key):
                w[base + _HEADER + 2 * i] = key
                return i
        raise RuntimeError(f"the lockstep board holds {SLOTS} groups a rank and scenario; "
                           f"this rank called in more (group {group!r})")

    def wake(self, peer: int) -> None:
        w, at = self.words, self._base(peer)
        w[at] = (w[at] + 1) & 0xFFFFFFFF
        self._syscall(_FUTEX_CALL, ctypes.c_void_p(self._address + at * 8), _WAKE, _WAKE_ALL,
                      self._no_time, self._no_time, _ZERO)

    # -- reading and waiting ---------------------------------------------------------------------
    def read(self, peer: int, group: str, number: int) -> int | None:
        """What ``peer`` said about call ``number`` of ``group``: its code, AHEAD when it is past
        that call, None when it has not got there yet."""
        w, base, key = self.words, self._base(peer), _key(group)
        start = key % SLOTS
        for k in range(SLOTS):
            i = (start + k) % SLOTS
            found = w[base + _HEADER + 2 * i]
            if found == key:
                state = w[base + _HEADER + 2 * i + 1]
                if state >> _SEQ_SHIFT != self._seq or state == 0:
                    return None
                ahead = (((state >> _NUMBER_SHIFT) & _NUMBER_MASK) - number) & _NUMBER_MASK
                if ahead == 0:
                    return state & _CODE_MASK
                return AHEAD if ahead < (_NUMBER_MASK >> 1) else None
            if found == 0:
                return None
        return None

    def ticket(self) -> int:
        """This rank's wake counter: read before looking at the board, handed to :meth:`wait`."""
        return self.words[self._base(self.rank)]

    def wait(self, ticket: int, timeout: float) -> None:
        """Sleep until a peer bumps this rank's counter past ``ticket``, or ``timeout`` seconds."""
        if timeout <= 0:
            return
        ts = _Timespec(int(timeout), int((timeout % 1) * 1e9))
        self._syscall(_FUTEX_CALL, ctypes.c_void_p(self._address + self._base(self.rank) * 8), _WAIT,
                      ctypes.c_long(ticket), ctypes.byref(ts), self._no_time, _ZERO)

    def calls(self) -> int:
        """Calls announced by every rank so far (it moves while any rank makes progress)."""
        w = self.words
        return sum(w[self._base(r) + 1] for r in range(self.world_size))

    @staticmethod
    def _base(rank: int | None) -> int:
        return rank * _REGION  # type: ignore[operator]
