"""A framework's functions or classes compiled alone from their own file.

The modules around a framework's data-path and loss functions import its whole training stack
(ray, transformers, megatron-bridge, its config system). Compiling just the definitions checked,
from the checkout's file with its path and line numbers kept, runs the framework's own code
(tracebacks, coverage and in-place write sites name its lines) without importing the rest.
Annotations are not evaluated (``from __future__ import annotations``), so a type named only in a
signature needs nothing; every other name the definitions read from outside themselves must be
given, or this raises before anything runs (the adapter's error, never the framework's).
"""

from __future__ import annotations

import __future__
import ast
import builtins
import symtable
from pathlib import Path
from typing import Any, Iterable

from shardcheck.errors import ShardcheckError

_BUILTINS = frozenset(dir(builtins))


def names_read(table: symtable.SymbolTable) -> set[str]:
    """Global names read anywhere inside ``table`` (its functions, methods, nested scopes)."""
    out = {s.get_name() for s in table.get_symbols()
           if (s.is_global() or (s.is_free() and table.get_type() == "class")) and s.is_referenced()}
    for child in table.get_children():
        out |= names_read(child)
    return out


def module_imports(tree: ast.Module, package: str) -> dict[str, tuple[str, str | None]]:
    """A file's module-level imports, as its definitions see them: name -> (module, attribute, or
    None for the module itself); ``package`` resolves relative imports."""
    out: dict[str, tuple[str, str | None]] = {}
    for node in tree.body:
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = (a.name if a.asname else a.name.split(".")[0], None)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            for a in node.names:
                out[a.asname or a.name] = (base, a.name)
    return out


def _not_loaded(name: str, path: Path) -> Any:
    def absent(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"shardcheck did not load {name} (read by {path.name}): this path was not expected "
                           "to call it")
    return absent


class NotCompiled(ShardcheckError, LookupError):
    """What :func:`compile_alone` cannot compile at a commit: a definition the file lacks, or a
    name the definitions read that the adapter does not give. An era the adapter does not model:
    on a rank, the harness's own error (the commit "cannot run"), never the target's finding; a
    LookupError still, for the adapters that try one era's names, then another's."""


def compile_alone(path: Path, names: Iterable[str], given: dict[str, Any],
                  off_path: Iterable[str] = ()) -> dict[str, Any]:
    """The top-level definitions ``names`` of ``path``, compiled alone into a namespace holding
    ``given``; LookupError naming what is missing (a definition, or a name they read). Names in
    ``off_path`` (read only on branches the adapter does not take) are bound to a function that
    raises, naming itself, if it is ever called."""
    wanted = list(names)
    tree = ast.parse(path.read_text(), filename=str(path))
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    absent = [n for n in wanted if n not in defs]
    if absent:
        raise NotCompiled(f"{path}: no top-level {', '.join(absent)}")
    nodes = sorted((defs[n] for n in wanted), key=lambda n: n.lineno)
    module = ast.Module(body=nodes, type_ignores=[])
    code = compile(module, str(path), "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True)
    table = symtable.symtable("from __future__ import annotations\n" + ast.unparse(module), str(path), "exec")
    reads: set[str] = set()
    for child in table.get_children():
        reads |= names_read(child)
    # decorators and base classes are read at module level
    reads |= {s.get_name() for s in table.get_symbols() if s.is_referenced() and s.is_global()} - {"annotations"}
    missing = sorted(reads - set(given) - set(wanted) - set(off_path) - _BUILTINS)
    if missing:
        raise NotCompiled(f"{path}: {', '.join(wanted)} read {', '.join(missing)}, which the adapter does not give")
    namespace: dict[str, Any] = {"__name__": f"shardcheck_compiled_{path.stem}", "__file__": str(path),
                                 **{n: _not_loaded(n, path) for n in off_path}, **given}
    exec(code, namespace)  # noqa: S102 - the framework's own definitions, from its file
    return namespace


def with_newer_fields(cls: type, newer: list[str]) -> type:
    """``cls`` taking, besides its own fields, keywords a newer release of it has (kept as plain
    attributes): the installed megatron-core's PackedSeqParams, handed what a framework written
    against a newer one passes. The framework's code then runs unchanged; its report says which."""
    if not newer:
        return cls

    def __init__(self: Any, **kwargs: Any) -> None:
        kept = {k: kwargs.pop(k) for k in newer if k in kwargs}
        cls.__init__(self, **kwargs)
        vars(self).update(kept)

    return type(f"{cls.__name__}WithNewerFields", (cls,), {"__init__": __init__, "__doc__": cls.__doc__})
