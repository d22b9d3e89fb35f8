"""Where a report is written: the path checked before any world starts, temporary files unique to
this process and always removed, one file mode for every report (the umask's), and a write that
fails said in one line.

A report path that exists must be a regular file: a device, a FIFO or a socket is refused rather
than replaced by the atomic rename (``--json-report /dev/full`` once turned the device node into
a plain file). Two runs given the same path each work: their temporary files do not meet, and the
last to finish leaves its report.

A saved report is read back as a :class:`SavedReport` (its :class:`RunInfo` and
:class:`Verdict` s, each through its ``from_dict``), by every command that reads one: an older
shardcheck's report too, what it lacks given its default.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from dataclasses import dataclass
from typing import Any, Callable

from shardcheck.errors import BadInput
from shardcheck.harness.controller.reports.verdict import RunInfo, Verdict
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


# What the page and the commands that read a saved report call it when a document lacks it: an
# older shardcheck wrote fewer fields, a run stopped early fewer still.
REPORT_FIELDS = ("target", "summary", "ranks")


@dataclass
class SavedReport:
    """A saved JSON report (``run --json-report``) read back: the run's info and its verdicts,
    in the file's order, and what the document says of the run as a whole."""

    info: RunInfo
    verdicts: list[Verdict]
    summary: dict[str, int] | None = None  # status -> count, and total (None: not written)
    planned: int | None = None  # how many scenarios the run meant to check
    complete: bool = True  # False: the run did not finish (an older report does not say: True)
    absent: tuple[str, ...] = ()  # of REPORT_FIELDS, those the document lacks

    @classmethod
    def from_dict(cls, doc: Any) -> SavedReport:
        """The report a JSON document holds; BadInput (one line) when it is not a shardcheck
        report (no ``scenarios`` list, or an entry that is not a verdict)."""
        if not isinstance(doc, dict):
            raise BadInput("not a shardcheck JSON report (not an object)")
        if "scenarios" not in doc:
            raise BadInput("not a shardcheck JSON report: no scenarios field")
        if not isinstance(doc["scenarios"], list):
            raise BadInput("not a shardcheck JSON report: its scenarios field is not a list")
        verdicts = []
        for i, entry in enumerate(doc["scenarios"]):
            try:
                verdicts.append(Verdict.from_dict(entry))
            except (BadInput, TypeError, ValueError, AttributeError) as exc:  # a field of another type
                raise BadInput(f"not a shardcheck JSON report: scenario {i}: {' '.join(str(exc).split())}") from None
        return cls(RunInfo.from_dict(doc), verdicts, doc.get("summary") or None, doc.get("planned"),
                   doc.get("complete", True) is not False, tuple(k for k in REPORT_FIELDS if k not in doc))


def read_report(path: str, option: str = "--report") -> SavedReport:
    """The saved report at ``path`` (given by ``option``); BadInput (one line) when it cannot be
    read or is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise BadInput(f"{option} {path!r} does not exist") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise BadInput(f"{option} {path!r}: cannot read a JSON report: {' '.join(str(exc).split())}") from None
    try:
        return SavedReport.from_dict(doc)
    except BadInput as exc:
        raise BadInput(f"{option} {path!r}: {exc}") from None
