"""Every option a command accepts has an effect, or is refused (issue 38): walked from the parser
itself, so an option added later is covered without touching this file.

For each command and each of its options, the command's plan (``Command.plan``: the run's
configuration, the scenarios and the command's own settings, decided before anything starts;
``execute`` reads nothing else) is built from a base command line with and without the option.
The option passes when the plans differ, when the command refuses it (BadInput naming the
option), or when it lifts a refusal (``--allow-large-world`` over a world too large for the
machine). An option the command declares as accepted without effect must say so in its help.
No world starts: the whole walk takes about a second."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import pytest

from shardcheck.cli import build_parser
from shardcheck.command import COMMANDS
from shardcheck.errors import BadInput
from shardcheck.scenarios import get_suite
from shardcheck.targets.source import load_framework, source_names

# What each command needs to plan at all ({tmp}: a folder of the test's); a new command needs a line here.
BASES = {
    "run": [],
    "invariance": ["--scenario", "thd-tp1cp1-basic"],
    "bisect": ["--src-repo", "{tmp}", "--target", "slime", "--good", "HEAD~3", "--bad", "HEAD"],
    "sweep": ["--src-repo", "{tmp}/repo", "--target", "slime"],
    "fuzz": [],
    "simulate": [],
    "repro": ["--target", "builtin", "--scenario", "thd-tp1cp1-basic", "--out", "{tmp}/repro.py"],
    "report": ["{tmp}/report.json", "--html", "{tmp}/page.html"],
    "suites": [],
    "targets": [],
}
# a world no machine holds: refused unless the command is told to allow it
TOO_LARGE = ["--nproc", "100000"]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def _other(choices: list[str], default: object) -> str:
    return next(c for c in choices if c != default)


def _value(action: argparse.Action, base: list[str], tmp: Path) -> list[str]:
    """A valid value for ``action``, other than its default and than what the base gives it."""
    if action.nargs == 0:
        return []
    if action.choices:
        return [_other(list(action.choices), action.default)]
    dest = action.dest
    given = [base[i + 1] for i, word in enumerate(base[:-1]) if word in action.option_strings]
    suite = next((base[i + 1] for i, w in enumerate(base[:-1]) if w == "--suite"), None)
    names = [s.name for s in get_suite(suite or ("regressions" if "--good" in base else "smoke"))]
    if dest.startswith("src_") and dest[len("src_"):] in source_names():  # a framework's checkout: the file every checkout of it has
        checkout = tmp / dest
        marker = checkout / load_framework(dest[len("src_"):]).marker
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text("")
        return [str(checkout)]
    if dest.startswith("repo_"):
        return [str(tmp / "repo")]
    values = {
        "target": ["builtin:skip_empty_rank", "slime:policy_loss"],
        "suite": ["logprob", "regressions", "smoke"],
        "scenario": [n for n in names if n not in given],
        "scenario_file": [str(tmp / "scenarios.json")],
        "target_src": [str(tmp)],
        "target_opt": ["a=b"],
        "json_report": [str(tmp / "r.json")],
        "html_report": [str(tmp / "r.html")],
        "out": [str(tmp / "out.json")],
        "html": [str(tmp / "other.html")],
        "github_summary": [str(tmp / "summary.md")],
        "annotations": [str(tmp)],
        "report": [str(tmp / "report.json")],
        "src_repo": [str(tmp / "repo"), str(tmp / "repo2")],
        "axis": ["rerun"],
        "expect": ["packing=bitwise"],
        "tp": ["1,2"],
        "cp": ["1,2"],
        "sp": ["8,16"],
        "layout": ["thd"],
        "good": ["HEAD~2"],
        "bad": ["HEAD~1"],
        "timeout": ["30"],
        "since": ["2025-06-01"],
        "revisions": ["HEAD~1..HEAD"],
        "files": ["slime/backends/megatron_utils/loss.py"],
        "cache": [str(tmp / "cache")],
        "jobs": ["2"],
        "tags": ["v*"],
        "json": [str(tmp / "sweep.json")],
    }
    if dest in values:
        return [_other(values[dest], given[0] if given else action.default)]
    if action.type is int:
        return [str((action.default or 1) + 1)]
    pytest.fail(f"no value for {action.option_strings[0]} (dest {dest}): add one to _value", pytrace=False)


def _without(base: list[str], action: argparse.Action, parser: argparse.ArgumentParser) -> list[str]:
    """``base`` less what gives ``action``, or an option exclusive with it, a value."""
    drop = set(action.option_strings)
    for group in parser._mutually_exclusive_groups:
        if action in group._group_actions:
            drop |= {o for a in group._group_actions for o in a.option_strings}
    out, skip = [], False
    for word in base:
        if skip:
            skip = False
        elif word in drop:
            skip = True
        else:
            out.append(word)
    return out


class Unparsed(Exception):
    """The command line does not parse (a required option left out)."""


def _plan(parser: argparse.ArgumentParser, name: str, argv: list[str]) -> object:
    """The plan, or the BadInput that refused it; Unparsed when argparse refuses the line."""
    try:
        args = parser.parse_args([name, *argv])
    except BadInput as exc:
        return Unparsed(str(exc))
    try:
        return COMMANDS[name].plan(args)
    except BadInput as exc:
        return exc


def _files(tmp: Path) -> None:
    smoke = get_suite("smoke")
    # the first smoke scenario's name, other samples: a file is not the suite it was taken from
    (tmp / "scenarios.json").write_text(json.dumps([smoke[0].to_dict() | {"seed": 7}]))
    # a run's report of one failed scenario (report --github-summary and --annotations read its verdicts)
    (tmp / "report.json").write_text(json.dumps({"target_spec": "builtin", "scenarios": [
        {"name": smoke[0].name, "verdict": "fail", "failures": [{"kind": "value_mismatch", "message": "off"}],
         "scenario": smoke[0].to_dict()}]}))
    # a git clone with one commit: what sweep's --src-repo must be before it plans anything
    for repo in (tmp / "repo", tmp / "repo2"):
        repo.mkdir(exist_ok=True)
        git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com"]
        subprocess.run(["git", "init", "-q", str(repo)], check=True)
        subprocess.run(git + ["commit", "-q", "--allow-empty", "-m", "one"], check=True)


def test_every_command_has_a_base_line():
    assert set(_subparsers(build_parser())) == set(COMMANDS) == set(BASES)


def _walk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, commands: set[str] | None = None) -> tuple[int, list[str]]:
    """(options walked, those accepted and dropped) of ``commands`` (default: all)."""
    monkeypatch.chdir(tmp_path)  # a default output (repro-NAME.py, .shardcheck/) lands here
    for name in source_names():
        monkeypatch.delenv(f"SHARDCHECK_{name.upper()}_SRC", raising=False)
    monkeypatch.delenv("SHARDCHECK_TARGET", raising=False)
    _files(tmp_path)
    whole = build_parser()
    walked, silent = 0, []
    for name, parser in _subparsers(whole).items():
        if commands is not None and name not in commands:
            continue
        base = [w.replace("{tmp}", str(tmp_path)) for w in BASES[name]]
        before = _plan(whole, name, base)
        assert not isinstance(before, BadInput), f"{name} {' '.join(base)}: {before}"
        for action in _options(parser):
            flag = action.option_strings[-1]
            rest = _without(base, action, parser) if not action.required else base
            given = [flag, *_value(action, base, tmp_path)]
            argv = [*rest, *given] if not action.required else _without(base, action, parser) + given
            reference = _plan(whole, name, rest) if rest != base else before
            after = _plan(whole, name, argv)
            walked += 1
            assert not isinstance(after, Unparsed), f"{name} {' '.join(argv)}: {after}"
            if isinstance(after, BadInput):  # refused: in words naming what was given
                assert any(word in str(after) for word in {*action.option_strings, *given[1:]}), \
                    f"{name} {flag} refused, but not for itself: {after}"
                continue
            if isinstance(reference, (BadInput, Unparsed)) or after != reference:
                continue
            if "--nproc" in {o for a in _options(parser) for o in a.option_strings} and flag != "--nproc":
                if isinstance(_plan(whole, name, [*rest, *TOO_LARGE]), BadInput) and \
                        not isinstance(_plan(whole, name, [*argv, *TOO_LARGE]), BadInput):
                    continue  # it lifts a refusal
            if flag in COMMANDS[name].accepted_without_effect:
                assert "accepted" in (action.help or ""), f"{name} {flag}: its help must say it is only accepted"
                continue
            silent.append(f"{name} {flag}")
    return walked, silent


def test_every_option_of_every_command_has_an_effect_or_is_refused(tmp_path, monkeypatch):
    walked, silent = _walk(tmp_path, monkeypatch)
    assert not silent, f"options accepted and dropped (neither in the plan nor refused): {silent}"
    assert walked > 80, walked  # every command's options were reached


def test_the_walk_finds_an_option_that_is_dropped(tmp_path, monkeypatch):
    """The test itself can fail: an option added to run that nothing reads is caught."""
    from shardcheck.check_commands import Run

    add = Run.add_options

    def with_a_dropped_option(self, parser):
        add(self, parser)
        parser.add_argument("--ignored-by-everyone", action="store_true")

    monkeypatch.setattr(Run, "add_options", with_a_dropped_option)
    assert _walk(tmp_path, monkeypatch, {"run"})[1] == ["run --ignored-by-everyone"]
