"""Named suites of scenarios, and loading scenarios from a file."""

from __future__ import annotations

import codecs
import json
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from shardcheck.errors import BadInput
from shardcheck.scenarios import regressions, sequence_parallel, smoke, training
from shardcheck.scenarios.scenario import Scenario

# Every named suite, by name: a new suite is a function in smoke.py, regressions.py, training.py or
# sequence_parallel.py, listed here.
SUITES: dict[str, Callable[[], list[Scenario]]] = {
    fn.__name__: fn for fn in (smoke.smoke, smoke.logprob, smoke.large, regressions.regressions, regressions.replay,
                               regressions.sampling, training.training,
                               sequence_parallel.sequence_parallel)
}


def get_suite(name: str) -> list[Scenario]:
    if name not in SUITES:
        raise BadInput(f"unknown suite {name!r} (known: {', '.join(sorted(SUITES))})")
    scenarios = SUITES[name]()
    names = [s.name for s in scenarios]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise BadInput(f"suite {name!r} has duplicate scenario names: {', '.join(dupes)}")
    return scenarios


PROGRESS_EVERY = 1.0  # seconds between two progress calls while a scenario file is read


def load_scenario_file(path: str | Path, progress: Callable[[int, int, int], None] | None = None) -> list[Scenario]:
    """A JSON file holding one scenario object or a list of them, read and validated one entry at
    a time: memory holds the scenarios and one chunk of the file, not the whole document as
    Python objects (a 46 MB file of 509,018 scenarios peaked at 540 MB read whole). ``progress``
    is called with (scenarios so far, where in the file, its size) every PROGRESS_EVERY seconds,
    and once at the end (where = size) if it was called at all."""
    p = Path(path)
    try:
        f = open(p, "rb")
    except FileNotFoundError:
        raise BadInput(f"scenario file {str(p)!r} does not exist") from None
    except OSError as exc:
        raise BadInput(f"scenario file {str(p)!r} cannot be read: {exc}") from None
    scenarios: list[Scenario] = []
    first: dict[str, int] = {}  # name -> the entry that first has it
    with f:
        try:
            size = os.fstat(f.fileno()).st_size
            reader = _Entries(f)
            said, last = False, time.monotonic()
            for i, item in enumerate(reader):
                try:
                    sc = Scenario.from_dict(item)
                except BadInput as exc:
                    raise BadInput(f"scenario file {str(p)!r}, entry {i}: {exc}") from None
                if sc.name in first:  # --scenario, the reports and a replay name a scenario by it
                    raise BadInput(f"scenario file {str(p)!r}: entries {first[sc.name]} and {i} are both named "
                                   f"{sc.name!r}")
                first[sc.name] = i
                scenarios.append(sc)
                if progress is not None and time.monotonic() - last >= PROGRESS_EVERY:
                    progress(len(scenarios), min(reader.consumed, size - 1), size)
                    said, last = True, time.monotonic()
        except (OSError, UnicodeDecodeError) as exc:
            raise BadInput(f"scenario file {str(p)!r} cannot be read: {exc}") from None
        except json.JSONDecodeError as exc:
            raise BadInput(f"scenario file {str(p)!r} is not valid JSON: {exc}") from None
        except _TooLong as exc:
            raise BadInput(f"scenario file {str(p)!r}: {exc}") from None
    if not scenarios:
        raise BadInput(f"scenario file {str(p)!r} holds no scenario")
    if said:
        progress(len(scenarios), size, size)
    return scenarios


class _TooLong(ValueError):
    """An entry past _Entries.MAX_ENTRY: not read to its end."""


class _Entries:
    """The entries of a JSON document that is one object or a list, decoded one at a time from
    chunks of the file; errors read as json's own, their line, column and char counted from the
    file's start."""

    CHUNK = 256 << 10
    MAX_ENTRY = 16 << 20  # what one entry may take; an error is found after reading no further

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.decoder = json.JSONDecoder()
        self.text = ""  # what is read and not yet forgotten
        self.pos = 0  # where in self.text the next thing to read is
        self.at = 0  # where self.text starts in the whole document (chars)
        self.lines = 0  # newlines before self.at
        self.line_start = 0  # where the line self.at is on starts (chars)
        self.eof = False
        self._decode = codecs.getincrementaldecoder("utf-8")()

    @property
    def consumed(self) -> int:
        """How far into the file the entries read so far reach (chars: bytes for ASCII)."""
        return self.at + self.pos

    def _more(self) -> bool:
        """Read one more chunk (forgetting what is consumed); whether there was any."""
        if self.eof:
            return False
        gone = self.text[:self.pos]
        newlines = gone.count("\n")
        if newlines:
            self.lines += newlines
            self.line_start = self.at + gone.rindex("\n") + 1
        self.at += self.pos
        data = self.f.read(self.CHUNK)
        self.eof = not data
        self.text = self.text[self.pos:] + self._decode.decode(data, final=self.eof)
        self.pos = 0
        return not self.eof

    def _error(self, msg: str, pos: int) -> json.JSONDecodeError:
        """json's error at ``pos`` in self.text, placed in the whole document."""
        before = self.text[:pos]
        line = self.lines + before.count("\n") + 1
        col = pos - before.rindex("\n") if "\n" in before else self.at + pos - self.line_start + 1
        err = json.JSONDecodeError(msg, "", 0)
        err.msg, err.pos, err.lineno, err.colno = msg, self.at + pos, line, col
        err.args = (f"{msg}: line {line} column {col} (char {self.at + pos})",)
        return err

    def _next(self) -> str:
        """The next character that is not white space ('' at the end), not consumed."""
        while True:
            m = _SPACE.match(self.text, self.pos)
            self.pos = m.end()
            if self.pos < len(self.text) or not self._more():
                return self.text[self.pos:self.pos + 1]

    def _value(self) -> Any:
        while True:
            try:
                value, end = self.decoder.raw_decode(self.text, self.pos)
            except json.JSONDecodeError as exc:
                err = self._error(exc.msg, exc.pos)
                if len(self.text) - self.pos > self.MAX_ENTRY:
                    raise _TooLong(f"the entry at line {self.lines + self.text.count(chr(10), 0, self.pos) + 1} is "
                                   f"longer than {self.MAX_ENTRY >> 20} MiB or not valid JSON: {err}") from None
                if self._more():  # the entry may go on in the next chunk
                    continue
                raise err from None
            if end == len(self.text) and self._more():  # a number may go on past the chunk
                continue
            self.pos = end
            return value

    def __iter__(self) -> Iterator[Any]:
        if self._next() != "[":
            value = self._value()
            if self._next():
                raise self._error("Extra data", self.pos)
            yield value
            return
        self.pos += 1
        if self._next() == "]":
            self.pos += 1
        else:
            while True:
                yield self._value()
                c = self._next()
                if c == "]":
                    self.pos += 1
                    break
                if c != ",":
                    raise self._error("Expecting ',' delimiter", self.pos)
                self.pos += 1
                if not self._next():
                    raise self._error("Expecting value", self.pos)
        if self._next():
            raise self._error("Extra data", self.pos)


_SPACE = re.compile(r"[ \t\n\r]*")


def write_scenario_file(path: str | Path, scenario: Scenario) -> None:
    """A scenario file that :func:`load_scenario_file` reads back: one field a line, so it reads
    well and diffs well."""
    fields = sorted(scenario.to_dict().items())
    Path(path).write_text("{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in fields) + "\n}\n")
