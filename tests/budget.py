"""The suite's time budget: a test file that takes more than BUDGET_S says why in its module
docstring, in a paragraph that begins with WHY. Checked at the end of every session (a line in
the terminal summary, not a failure: a loaded machine must not turn the suite red)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

BUDGET_S = 20.0
WHY = "Over 20 s:"


def file_seconds(durations: list[tuple[str, float]]) -> dict[str, float]:
    """Wall seconds per test file from (nodeid, seconds) of every phase of every test."""
    out: dict[str, float] = defaultdict(float)
    for nodeid, seconds in durations:
        out[nodeid.split("::", 1)[0]] += seconds
    return dict(out)


def says_why(path: Path) -> bool:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return any(paragraph.strip().startswith(WHY) for paragraph in doc.split("\n\n"))


def over_budget(seconds: dict[str, float], root: Path) -> list[str]:
    """A line for each file over the budget whose docstring does not say why, slowest first."""
    return [f"{name} took {s:.1f} s (budget {BUDGET_S:.0f} s) and its docstring does not say why "
            f"(a paragraph beginning {WHY!r})"
            for name, s in sorted(seconds.items(), key=lambda kv: -kv[1])
            if s > BUDGET_S and (root / name).exists() and not says_why(root / name)]
