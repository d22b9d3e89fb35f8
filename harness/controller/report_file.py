"""Where a report is written: the path checked before any world starts, temporary files unique to
this process and always removed, one file mode for every report (the umask's), and a write that
fails said in one line.

A report path that exists must be a regular file: a device, a FIFO or a socket is refused rather
than replaced by the atomic rename (``--json-report /dev/full`` once turned the device node into
a plain file). Two runs given the same path each work: their temporary files do not meet, and the
last to finish leaves its report.
"""

from __future__ import annotations

import os
import secrets
import stat
from typing import Any, Callable

from shardcheck.errors import BadInput
from shardcheck.harness.wire import process_alive


def check_report_path(path: str, option: str, what: str) -> None:
    """BadInput (one line) unless ``path`` can take a report (``what``, given by ``option``): a
    regular file or nothing yet, in a folder that exists and can be written."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise BadInput(f"{option} {path!r}: {exc.strerror}") from None
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise BadInput(f"{option} {path!r} is a directory")
        if not stat.S_ISREG(st.st_mode):
            raise BadInput(f"{option} {path!r} is not a regular file (a device, FIFO or socket): give a file's path")
    folder = os.path.dirname(os.path.abspath(path)) or "."
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise BadInput(f"cannot write {what} {path!r}: its folder does not exist or is not writable")


def temp_beside(path: str, tag: str) -> str:
    """A temporary file's name in ``path``'s folder (so that a rename onto ``path`` is atomic),
    unique to this process and call."""
    folder, base = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{base}.{os.getpid()}.{secrets.token_hex(4)}.{tag}")


def sweep_beside(path: str) -> None:
    """Remove the temporary files of runs on ``path`` whose process is gone (killed mid-write)."""
    folder, base = os.path.split(os.path.abspath(path))
    prefix = f".{base}."
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        parts = name[len(prefix):].split(".") if name.startswith(prefix) else []
        if len(parts) == 3 and parts[0].isdigit() and parts[2] in ("tmp", "old") and not process_alive(int(parts[0])):
            remove_quietly(os.path.join(folder, name))


def report_mode() -> int:
    """The mode a new report gets: 0666 less the umask, as any file the user makes."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def replace_with(path: str, data: bytes) -> None:
    """``data`` as the whole of ``path``, atomically (a reader sees the old file or the new one);
    the temporary file is removed whatever happens."""
    tmp = temp_beside(path, "tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, report_mode())
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        remove_quietly(tmp)


def remove_quietly(path: str | None) -> None:
    if path:
        try:
            os.unlink(path)
        except OSError:
            pass


def write_error(option: str, path: str, exc: OSError) -> str:
    """The one line a failed report write is said in."""
    return f"cannot write {option} {path!r}: {exc.strerror or exc}"


class GuardedWrites:
    """A report's writes: the first that fails (a full disk) is kept as ``failed``, in one line,
    and no later write is tried; the run goes on (what it found is still in memory and on the
    terminal) and the command then exits 2 saying so."""

    def __init__(self, what: str, path: str) -> None:
        self.what, self.path = what, path
        self.failed: str | None = None

    def __call__(self, write: Callable[..., Any], *args: Any) -> bool:
        """``write(*args)``; whether it was tried and went through."""
        if self.failed:
            return False
        try:
            write(*args)
            return True
        except OSError as exc:
            self.failed = write_error(self.what, self.path, exc)
            return False
