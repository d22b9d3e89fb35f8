"""The GitHub workflows in ci/github/ call only commands and options that exist: a workflow a
user copies must not fail on a renamed flag."""

import re
import shlex
from pathlib import Path

import pytest

from shardcheck.cli import build_parser

WORKFLOWS = sorted((Path(__file__).resolve().parent.parent / "ci" / "github").glob("*.yml"))


def _commands(text: str) -> list[list[str]]:
    """Shell words of each command in the workflow's `run:` steps (inline or block, continuation
    lines joined); names, env values and comments are not commands."""
    lines, run_indent, block = [], None, False
    for raw in text.splitlines():
        indent = len(raw) - len(raw.lstrip())
        if block and raw.strip() and indent <= run_indent:
            block = False
        m = re.match(r"^(\s*)(- )?run:\s*(.*)$", raw)
        if m:
            run_indent = len(m.group(1)) + len(m.group(2) or "")
            if m.group(3).strip() in ("|", ">", "|-", ">-"):
                block = True
            else:
                lines.append(m.group(3))
        elif block:
            lines.append(raw.strip())
    commands = []
    for line in re.sub(r"\\\n", " ", "\n".join(lines)).splitlines():
        if "shardcheck" in line:
            commands.append(shlex.split(line, comments=True))
    return commands


def _cli_options() -> dict[str, set[str]]:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return {name: {o for a in p._actions for o in a.option_strings} for name, p in sub.choices.items()}


def _plugin_options() -> set[str]:
    from shardcheck import pytest_plugin

    seen: set[str] = set()

    class Group:  # collects the names pytest_addoption registers
        def addoption(self, *names, **kwargs):
            seen.update(names)

    class Parser(Group):
        def getgroup(self, *args, **kwargs):
            return Group()

    pytest_plugin.pytest_addoption(Parser())
    return seen


def test_there_are_workflows_to_check():
    assert {p.name for p in WORKFLOWS} >= {"shardcheck-cpu.yml", "shardcheck-gpu.yml"}


def _problems(text: str) -> tuple[list[str], int]:
    """(what is wrong, how many shardcheck invocations were checked) for a workflow's text."""
    cli, plugin = _cli_options(), _plugin_options()
    problems, checked = [], 0
    for words in _commands(text):
        for i, word in enumerate(words):
            if Path(word).name == "shardcheck" and i + 1 < len(words) and not words[i + 1].startswith("-"):
                command, checked = words[i + 1], checked + 1
                if command not in cli:
                    problems.append(f"no command 'shardcheck {command}'")
                    continue
                unknown = {w.split("=")[0] for w in words[i + 2:] if w.startswith("--")} - cli[command]
                problems += [f"shardcheck {command} has no {o}" for o in sorted(unknown)]
        if "pytest" in words:
            asked = {w.split("=")[0] for w in words if w.startswith("--shardcheck-")}
            checked += bool(asked)
            problems += [f"the pytest plugin has no {o}" for o in sorted(asked - plugin)]
    return problems, checked


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_workflow_uses_only_existing_options(path):
    problems, checked = _problems(path.read_text())
    assert checked, f"{path.name}: no shardcheck command found to check"
    assert not problems, f"{path.name}: {problems}"


def test_the_check_catches_renamed_flags_and_commands():
    text = """    steps:
      - name: shardcheck (CPU) run --not-an-option
        run: |
          shardcheck run --suite smoke \\
            --json-reprot r.json
          .venv/bin/shardcheck fuzzz --seed 0
      - run: python -m pytest -m multigpu --shardcheck-tagret x --shardcheck-backend gloo
"""
    problems, checked = _problems(text)
    assert checked == 3
    assert problems == ["shardcheck run has no --json-reprot", "no command 'shardcheck fuzzz'",
                        "the pytest plugin has no --shardcheck-tagret"]
