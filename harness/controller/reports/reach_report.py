"""What a run reached of the framework's own code (``--coverage``): the lines of its log-prob,
data and loss modules that ran on any rank in any scenario, and by function.

The ranks measure (``harness/rank/life/reach.py``); this side adds their lines up and names the
functions (``file:function``, methods as ``Class.method``) from the checkout's source.
"""

from __future__ import annotations

import ast
import os
from typing import Any


class Reach:
    """Lines run so far, per framework file, over every rank and scenario."""

    def __init__(self, src: str | None) -> None:
        self.src = src
        self.executed: dict[str, set[int]] = {}
        self.statements: dict[str, set[int]] = {}
        self.paths: dict[str, str] = {}  # files outside the checkout (megatron-core's): where they are

    def add(self, reached: dict[str, Any] | None) -> None:
        for rel, lines in (reached or {}).items():
            self.executed.setdefault(rel, set()).update(lines["executed"])
            self.statements.setdefault(rel, set()).update(lines["statements"])
            if rel.startswith("megatron-core/") and lines.get("path"):
                self.paths[rel] = lines["path"]

    def summary(self) -> dict[str, Any]:
        """{"files": {rel: {"lines", "statements", "percent", "functions", "not_reached"}}, ...}."""
        files = {}
        for rel in sorted(self.statements):
            executed, statements = self.executed[rel] & self.statements[rel], self.statements[rel]
            path = self.paths.get(rel) or (os.path.join(self.src, rel) if self.src else None)
            functions = _functions(path) if path else []
            ran = [f"{rel}:{name}" for name, body in functions if body & executed]
            missed = [f"{rel}:{name}" for name, body in functions if body and not body & executed]
            files[rel] = {"lines": len(executed), "statements": len(statements),
                          "percent": round(100.0 * len(executed) / len(statements), 1) if statements else 0.0,
                          "functions": ran, "not_reached": missed}
        return {"src": self.src, "files": files}


def _functions(path: str) -> list[tuple[str, set[int]]]:
    """(qualified name, the lines of its own body, nested functions excluded) of every function."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return []
    out: list[tuple[str, set[int]]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                # a nested def's own line runs in this function; its body does not
                nested = {n.lineno for sub in ast.walk(child) if sub is not child
                          and isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                          for stmt in sub.body for n in ast.walk(stmt) if hasattr(n, "lineno")}
                body = {n.lineno for stmt in child.body for n in ast.walk(stmt) if isinstance(n, ast.stmt)} - nested
                out.append((name, body))
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")

    visit(tree, "")
    return out


def render(summary: dict[str, Any] | None, width: int = 6) -> list[str]:
    """The terminal's lines: per file its line coverage, the functions that ran and those that did not."""
    if not summary or not summary.get("files"):
        return []
    lines = ["framework code reached (--coverage; lines of its log-prob, data and loss modules that ran, and of "
             "megatron-core's schedule and DDP in a training step):"]
    for rel, f in summary["files"].items():
        lines.append(f"  {rel}: {f['percent']}% of {f['statements']} statements")
        ran = [n.split(":", 1)[1] for n in f["functions"]]
        missed = [n.split(":", 1)[1] for n in f["not_reached"]]
        lines.append(f"    ran: {', '.join(ran[:width * 3]) or 'nothing'}" + (" ..." if len(ran) > width * 3 else ""))
        if missed:
            lines.append(f"    not reached: {', '.join(missed[:width * 3])}" + (" ..." if len(missed) > width * 3 else ""))
    return lines
