"""The examples README.md, docs/fuzzing.md and docs/invariance.md quote come from the commands they show.

Every fenced block of those pages whose first line is ``$ shardcheck ...`` is an example: the
command runs (``python -m shardcheck``, in an empty temporary folder, so no `.shardcheck/`
database or report of an earlier run is read) and its stdout must be the rest of the block, but
for what the pages say varies: times (``0.22s``, ``787 scenarios/min``; the column widths they
set) and the clone's own path in front of a source file (``targets/builtin.py:149``).

The fuzz example's counts are hypothesis' draws and shrinks from the shown seed: the same on
every run in a fresh folder (no timing, worker count or database enters them: the world has
4 ranks by default, the database is the folder's ``.shardcheck/hypothesis``), but not across
hypothesis versions, so the page names the version it was made with; with another one installed
only what any version gives is checked (exit 1, the minimal scenario's layout and kind) and the
rest is skipped, saying so.

Time: the examples each need a world of their own (start-up is most of it: 2 and 4 ranks), so they
run side by side, about 12 s on an idle 2-core machine (and 20-30 s on a busy one), in the
background while other tests go on (tests/background.py); none needs a framework checkout.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import hypothesis
import pytest

from conftest import cli_env

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("README.md", "docs/fuzzing.md", "docs/invariance.md")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
HYPOTHESIS_NAMED = re.compile(r"hypothesis (\d+\.\d+\.\d+)")


def examples() -> list[tuple[str, str, str]]:
    """(page, command, quoted output) of every ``$ shardcheck`` block of the pages."""
    found = []
    for page in PAGES:
        for block in FENCE.findall((ROOT / page).read_text()):
            first, _, rest = block.partition("\n")
            if first.startswith("$ shardcheck "):
                found.append((page, first[2:], rest))
    return found


def normalise(text: str) -> str:
    """What varies between runs taken out: times and rates, the column widths they set, the clone's path."""
    text = text.replace(f"{ROOT}/", "")
    text = re.sub(r"\b\d+\.\d+s\b", "<t>", text)
    text = re.sub(r"\b\d+ scenarios/min\b", "<n> scenarios/min", text)
    text = re.sub(r"-{2,}", "--", text)
    text = re.sub(r"[ \t]+", " ", text)
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def _run_examples(folder: Path) -> dict[str, tuple[int, str, str]]:
    """Every example run once, side by side, each in an empty folder: {command: (exit status, stdout, stderr)}."""
    procs = {}
    for i, (_, command, _) in enumerate(examples()):
        (folder / str(i)).mkdir()
        argv = [sys.executable, "-m", "shardcheck", *shlex.split(command)[1:]]
        procs[command] = subprocess.Popen(argv, cwd=folder / str(i), env=cli_env(), stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True)
    out = {}
    try:
        for command, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=300)
            out[command] = (proc.returncode, stdout, stderr)
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
    return out


# run in the background while other tests go on (tests/background.py)
BACKGROUND = {"readme-examples": (_run_examples, 300)}


@pytest.fixture
def runs(background):
    return background("readme-examples")


def test_the_pages_quote_examples():
    commands = [command for _, command, _ in examples()]
    assert any(c.startswith("shardcheck run ") for c in commands), commands
    assert any(c.startswith("shardcheck fuzz ") for c in commands), commands
    assert any(c.startswith("shardcheck invariance ") for c in commands), commands
    # README's table of commands names the invariance example the page shows (it had drifted from it)
    invariance = next(c for c in commands if c.startswith("shardcheck invariance "))
    assert f"`{invariance}`" in (ROOT / "README.md").read_text()


@pytest.mark.background("readme-examples")
@pytest.mark.parametrize("page,command,quoted", examples(),
                         ids=[f"{page}:{command.split()[1]}" for page, command, _ in examples()])
def test_example_output_is_what_the_page_quotes(runs, page, command, quoted):
    rc, stdout, stderr = runs[command]
    assert rc in (0, 1), f"{command} exited {rc}:\n{stderr[-2000:]}"
    if command.startswith("shardcheck fuzz "):
        named = HYPOTHESIS_NAMED.findall((ROOT / page).read_text())
        assert named, f"{page} must name the hypothesis version its fuzz example was made with"
        if hypothesis.__version__ not in named:
            assert rc == 1 and "minimal failing scenario: zigzag " in stdout, stdout
            pytest.skip(f"{page}'s fuzz example was made with hypothesis {named[0]}, "
                        f"{hypothesis.__version__} is installed: its draws and shrinks differ, so only "
                        "the exit status and the minimal scenario's layout were checked")
    assert normalise(stdout) == normalise(quoted), (
        f"{page}: the output of `{command}` is not what the page quotes; rerun it and quote it\n"
        f"--- quoted\n{quoted}\n--- now\n{stdout}")
