"""`shardcheck repro`: one failure as a standalone script its code's maintainers can run.

The script (body: ``repro_script.py``) starts a world of the scenario's size with multiprocessing
and gloo, generates the scenario's inputs from its seed as shardcheck does, lays each rank's rows
out as the failing run did (written into the script as data), calls the code under test the way
its target does (the target's ``repro_call``, source text), and checks in plain code what can
fail: each rank's collectives against its group's, a crash, inputs changed in place, values and
gradients against a float64 computation. It prints one paragraph and exits 1 (found) or 0.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shardcheck.errors import BadInput
from shardcheck.harness.controller.commands import repro_script
from shardcheck.harness.controller.reports.report_file import read_report
from shardcheck.harness.rank.checks.compare import TOLERANCES
from shardcheck.harness.wire import Failure
from shardcheck.scenarios.layout import rank_layout
from shardcheck.scenarios.scenario import Scenario, data_id
from shardcheck.targets.base import (TargetConfig, data_path, definitions, knob_skip_reason, loss_form, resolved_knobs,
                                     step_skip_reason)

MAX_LINES = 300  # the promise: a reader takes it in at one sitting
_STUB = '''def call_code_under_test(logits, rank):  # written above by shardcheck repro
    raise NotImplementedError
'''
_CASE_LINE = "CASE: dict = {}  # written above by shardcheck repro\n"


@dataclasses.dataclass(frozen=True)
class Reported:
    """A failure as a JSON report (run --json-report) holds it."""

    spec: str
    scenario: Scenario
    failure: Failure | None  # None: named by a scenario, not a report
    inplace: bool  # whether the run checked for inputs changed in place
    layouts: dict[int, dict[str, Any]]  # rank -> the rows a framework's data path built there (none: shardcheck's)
    config: TargetConfig | None  # the target's checkout and options in that run (older reports: None)


def from_report(path: str, name: str) -> Reported:
    """``name``'s first failure, from a JSON report (read back: an older one's missing fields
    take their defaults)."""
    report = read_report(path)
    verdict = next((v for v in report.verdicts if v.scenario.name == name), None)
    if verdict is None:
        raise BadInput(f"--report {path} has no scenario {name!r}")
    if not verdict.failures:
        raise BadInput(f"scenario {name!r} did not fail in {path} ({verdict.status}): nothing to reproduce")
    refused = kinds_refusal([f.kind for f in verdict.failures])
    if refused:
        raise BadInput(f"scenario {name!r} in {path}: {refused}")
    info, given = report.info, report.info.target_config
    config = TargetConfig(given.get("src"), tuple(tuple(kv) for kv in given.get("options", []))) if given else None
    return Reported(info.target_spec, verdict.scenario, verdict.failures[0], info.inplace, verdict.layouts, config)


def script_text(spec: str, target: Any, scenario: Scenario, failure: Failure | None,
                name: str = "repro.py", inplace: bool = True, layouts: dict[int, dict[str, Any]] | None = None) -> str:
    """The script for ``scenario`` on ``target`` (named by ``spec``), expecting ``failure``;
    ``inplace``: whether it checks for inputs changed in place (run --no-inplace: not);
    ``layouts``: the rows the target's data path built on each rank in a run (a report's, or a run's),
    where it lays them out."""
    refuse_unless_writable(spec, target, scenario)
    sc, call = scenario, target.repro_call()
    built = needs_layouts(target, sc)
    built_by = data_path(target).name if built else None  # the framework's code lays the rows out
    if built and not layouts:
        raise RuntimeError(f"{sc.name}: the target's data path lays out its rows; give the run's layouts")
    src = str(target.src) if target.src is not None else _source_tree()
    variant = spec.partition(":")[2]
    case = {
        "target": spec,
        "code": {"src": src, "variant": variant or None},
        "scenario": {
            "name": sc.name, "seed": sc.seed, "vocab": sc.vocab, "dtype": sc.dtype, "layout": sc.layout,
            "tp": sc.tp, "cp": sc.cp, "sp": sc.sp, "temperature": float(sc.temperature), "entropy_coef": float(sc.entropy_coef),
            "with_entropy": sc.with_entropy, "chunk_size": sc.log_probs_chunk_size,
            "totals": [s.total for s in sc.samples], "prompts": [s.prompt for s in sc.samples],
            "data_ids": [data_id(sc, i) for i in range(len(sc.samples))],
            "entropy_sign": definitions(target).entropy_sign,  # -1: the target's entropy is sum p log p
            "data_path": built_by,
            "knobs": resolved_knobs(data_path(target), sc) if built else {},  # the data path's (pad_multiplier, ...)
        },
        "ranks": [_rank(sc, r, layouts if built else None) for r in range(sc.tp * sc.seq)],
        "inplace": inplace,
        "tolerances": {d: {k: [t.atol, t.rtol] for k, t in tols.items()} for d, tols in TOLERANCES.items()},
    }
    body = Path(repro_script.__file__).read_text()
    body = body[body.index("import argparse"):]  # its own header comment is the writer's business
    if _CASE_LINE not in body or _STUB not in body:  # the slots the writer fills: a script never keeps them
        raise RuntimeError("repro_script.py lost a slot the writer fills (CASE or call_code_under_test)")
    text = (_header(spec, sc, failure, src, name, inplace, built_by) + body.replace(_CASE_LINE, _case_text(case))
            .replace(_STUB, call.strip("\n") + "\n"))
    text = re.sub(r"\n\n\n+", "\n\n", text)  # one blank line between definitions: more of it on a screen
    lines = text.count("\n")
    if lines >= MAX_LINES:  # a design limit, not the user's input: say so plainly
        raise BadInput(f"the script for {sc.name!r} would be {lines} lines; a script stays under {MAX_LINES} "
                       f"(it holds a line of data a rank: tp * {'sp' if sc.sp > 1 else 'cp'} = {sc.tp * sc.seq})")
    return text


def refuse_unless_writable(spec: str, target: Any, scenario: Scenario) -> None:
    """BadInput (one line) when no script can be written for ``scenario`` on ``target``."""
    refused = refusal(target, scenario)
    if refused:
        raise BadInput(f"target {spec!r}, scenario {scenario.name!r}: {refused}")


def refusal(target: Any, scenario: Scenario) -> str | None:
    """Why no script can be written for ``scenario`` on ``target`` (None: one can)."""
    refused = target_refusal(target) or scenario_refusal(scenario)
    if refused:
        return refused
    skipped = (step_skip_reason(target, scenario) or target.capabilities.skip_reason(scenario)
               or knob_skip_reason(target, scenario))
    if skipped:
        return f"the target skips it ({skipped})"
    defined = definitions(target)
    if scenario.cp > 1 and {defined.loss_over, defined.entropy_loss_over} != {"share"}:
        return ("under CP the target returns other tokens than each rank's share (its declared definitions: "
                f"{defined.loss_source or defined.entropy_source}): repro does not write those yet")
    return None


def target_refusal(target: Any) -> str | None:
    """Why no script can be written for ``target`` (a target whose data path the script cannot
    run says so by having no repro call)."""
    if not target.repro_call():
        return "the target cannot say how it calls its code (it has no repro_call)"
    if loss_form(target) != "weighted":
        return "the target computes its own loss: repro does not write those yet"
    return None


def scenario_refusal(scenario: Scenario) -> str | None:
    if scenario.processed or scenario.sampling:
        return ("it renormalises over kept tokens (top-k/top-p, replayed keep sets): "
                "repro does not write those yet")
    return None


# failures a script does not look for: what the model is handed, a training step's masked NaN
NOT_SCRIPTED = ("layout_mismatch", "mask_leak")


def kinds_refusal(kinds: Sequence[str]) -> str | None:
    """Why a failure of these kinds alone is not written as a script, or None."""
    if kinds and set(kinds) <= set(NOT_SCRIPTED):
        return f"a script does not look for {' or '.join(sorted(set(kinds)))} yet"
    return None


def refuse_existing(path: str) -> None:
    """BadInput when ``path`` is there: it is the user's, and left alone."""
    if os.path.lexists(path):
        raise BadInput(f"--out {path} exists; give another path or remove it")


def write(path: str, text: str) -> None:
    """Write the script at ``path``; a file already there is the user's and is left alone."""
    try:
        with open(path, "x") as f:
            f.write(text)
    except FileExistsError:
        refuse_existing(path)
    except OSError as exc:
        raise BadInput(f"--out {path}: {exc.strerror or exc}") from None


def needs_layouts(target: Any, sc: Scenario) -> bool:
    """Whether the target's own data path lays out ``sc``'s rows (a script then needs the run's)."""
    path = data_path(target)
    return path is not None and path.builds(sc) is None


def _rank(sc: Scenario, rank: int, layouts: dict[int, dict[str, Any]] | None) -> dict[str, Any]:
    """What global rank ``rank`` holds: megatron's order puts tp innermost (rank = cp_rank * tp + tp_rank;
    under sp, cp_rank is the rank's place in the sp group).
    The rows are the framework's where ``layouts`` has them; the share (what the rank returns) is the harness's."""
    lay = rank_layout(sc, rank % sc.tp, rank // sc.tp)
    rows = {"pieces": [[p.stream, p.start, p.stop] for p in lay.pieces], "shape": list(lay.shape)}
    if layouts is not None:
        built = next(v for v in layouts.values() if (v["tp_rank"], v["cp_rank"]) == (lay.tp_rank, lay.cp_rank))
        rows = {"pieces": built["pieces"], "shape": built["shape"]}
    return {"tp_rank": lay.tp_rank, "cp_rank": lay.cp_rank, **rows, "columns": list(lay.columns),
            "share": [list(s) for s in lay.share]}


def _case_text(case: dict[str, Any]) -> str:
    """CASE as Python source: one line a key, one a rank."""
    lines = ["CASE = {"]
    for key, value in case.items():
        if key == "ranks":
            lines += ['    "ranks": ['] + [f"        {json.dumps(r)}," for r in value] + ["    ],"]
        else:
            lines.append(f"    {json.dumps(key)}: {_py(json.dumps(value))},")
    return "\n".join(lines) + "\n}\n"


def _py(text: str) -> str:
    return text.replace("true", "True").replace("false", "False").replace("null", "None")


def _header(spec: str, sc: Scenario, failure: Failure | None, src: str, name: str, inplace: bool,
            built_by: str | None) -> str:
    if failure:
        where = f" in the {failure.phase}" if failure.phase else ""
        expected = f"{failure.kind}{where}: {' '.join(str(failure.message).split())[:300]}"
    else:
        expected = "not given (written from a scenario, not a report): the script says what it finds"
    commit = _commit(src)
    return "\n".join([
        f'"""shardcheck repro ({datetime.date.today().isoformat()}): {spec} on scenario {sc.name} ({sc.layout}, '
        f"tp={sc.tp}, cp={sc.cp}, {sc.dtype})",
        "A world of tp * cp processes (gloo; nccl if asked), torch alone: the scenario's inputs from its seed, each rank's rows as the "
        "failing run laid them out, the code called as shardcheck's target calls it, plain checks against float64.",
        f"Code under test: {src}" + (f" at commit {commit}" if commit else "")
        + (f"; its {built_by} lays out the rows (run again and checked)" if built_by else ""),
        f"Expected (shardcheck found): {expected}",
        f"Run: python {name} [--src CHECKOUT] [--variant NAME|none] [--backend gloo|nccl]"
        + (" [--no-inplace]" if inplace else "") + "; exit 1: found (it says what), 0: not, 3: gave up (too slow)."
        + ("" if inplace else " Inputs changed in place: not checked.") + '"""',
        "",
    ]) + "\n"


def _source_tree() -> str:
    """shardcheck's source tree (its targets/ folder beside shardcheck/), which the builtin's
    call loads: an installed wheel has none."""
    root = Path(repro_script.__file__).resolve().parents[3]
    if not (root / "targets" / "builtin.py").is_file():
        raise BadInput("repro needs shardcheck's source tree (an editable install, pip install -e); "
                       f"{root} has no targets/ folder")
    return str(root)


def _commit(src: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", src, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                             timeout=10, env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"})
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    if commit and subprocess.run(["git", "-C", src, "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, timeout=10).stdout.strip():
        commit += " with uncommitted changes"
    return commit or None
