"""Where a framework target's source checkout is, and what it is: the part a command line needs
before anything heavy is imported.

A framework target (slime, verl, NeMo-RL, ...) registers its :class:`Framework` in the
``shardcheck.sources`` entry-point group under its target's name. From the names alone, read
without importing a framework adapter (or torch), every command gets a ``--<name>-src DIR`` flag
and every rank the ``SHARDCHECK_<NAME>_SRC`` variable: the command line names no framework.
"""

from __future__ import annotations

import ast
import os
import subprocess
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path

from shardcheck.errors import BadInput
# The group's names and each one's variable belong to the run configuration, which reads them
# without a target (RunConfig.from_environment); kept importable from here.
from shardcheck.run_config import SOURCES_GROUP as GROUP
from shardcheck.run_config import source_env, source_names  # noqa: F401

# the file an exported source tree (bisect's, from git archive: no .git) says its commit in
EXPORTED_COMMIT = ".shardcheck-exported-commit"


def source_flag(name: str) -> str:
    """The command-line flag naming ``name``'s checkout: ``--nemo-rl-src`` for nemo_rl."""
    return f"--{name.replace('_', '-')}-src"


def load_framework(name: str) -> "Framework":
    """The :class:`Framework` registered under ``name``; BadInput when there is none."""
    found = [ep for ep in entry_points(group=GROUP) if ep.name == name]
    if not found:
        raise BadInput(f"no framework target {name!r} takes a source checkout "
                       f"(known: {', '.join(source_names()) or 'none'})")
    return found[0].load()


@dataclass(frozen=True)
class Framework:
    """What a framework target says of its checkout; everything else about finding, validating
    and loading one is written once (here and in :mod:`shardcheck.targets.checkout`).

    ``packages``: its top-level packages. ``package_inits``: which of its packages'
    ``__init__.py`` run when its modules are imported: "skip" (none: every package is made as an
    empty package over the checkout's folder, so an ``__init__`` that pulls ray, configures
    logging or edits sys.path is not run), "skip_above" (only those of the packages holding the
    modules imported are skipped; a package they import runs its own, where it defines what they
    take from it) or "run" (all, the checkout on sys.path, as the framework's own runs do). ``stubbable``: the modules it imports but the checked path does not use, stubbed
    only when missing. ``eager``: torch.compile'd helpers run eagerly (compiling costs seconds per
    process on a CPU and is not what is checked)."""

    name: str  # the target's name, as registered: nemo_rl
    title: str  # as messages name it: NeMo-RL
    marker: str  # a file every checkout of it has, relative to its root
    packages: tuple[str, ...]
    stubbable: tuple[str, ...] = ()
    package_inits: str = "skip"
    eager: bool = False
    clone: str = ""  # where to get a checkout, for the message when none is given

    @property
    def env(self) -> str:
        return source_env(self.name)

    @property
    def flag(self) -> str:
        return source_flag(self.name)

    def source(self, src: str | os.PathLike | None = None) -> Path:
        """The checkout named by ``src`` (``--<name>-src``/``--target-src``) or the environment;
        BadInput (one line) naming the problem when it is not given or not a checkout of it."""
        value = src or os.environ.get(self.env)
        if not value:
            where = f" ({self.clone})" if self.clone else ""
            article = "an" if self.title[:1].lower() in "aeiou" else "a"
            raise BadInput(f"the {self.name} target needs {article} {self.title} source checkout{where}: give "
                           f"{self.flag} DIR or set {self.env}")
        path = Path(value).expanduser().resolve()
        if not path.is_dir():
            raise BadInput(f"{self.title} source {str(path)!r} is not a directory")
        if not (path / self.marker).is_file():
            raise BadInput(f"{str(path)!r} is not a {self.title} checkout (no {self.marker})")
        return path

    def commit(self, src: Path) -> str | None:
        """The commit the checkout is at (``SHARDCHECK_<NAME>_COMMIT`` where set: an exported
        tree's)."""
        return os.environ.get(f"SHARDCHECK_{self.name.upper()}_COMMIT") or source_commit(src)

    def __post_init__(self) -> None:
        if self.package_inits not in ("skip", "skip_above", "run"):
            raise ValueError(f"package_inits={self.package_inits!r}: expected skip, skip_above or run")

    def parse(self, src: Path, rel: str | os.PathLike) -> ast.Module | None:
        """A file of the checkout, parsed (nothing imported); None where the file is not there;
        BadInput (one line) naming the file and line where it does not parse."""
        path = src / rel
        if not path.is_file():
            return None
        try:
            return ast.parse(path.read_text(), filename=str(path))
        except SyntaxError as exc:
            raise BadInput(f"{self.title} at {src} cannot be read: {rel} line {exc.lineno}: {exc.msg}") from None

    def owns(self, module: str) -> bool:
        """Whether ``module`` is one of the framework's own (not a third party's)."""
        return any(module == p or module.startswith(p + ".") for p in self.packages)


def functions_named(tree: ast.AST | None, name: str) -> list[ast.FunctionDef]:
    """Every function or method called ``name`` in a parsed file (none for a missing file)."""
    if tree is None:
        return []
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name]


def parameters(fn: ast.FunctionDef) -> list[str]:
    """A parsed function's parameter names, in order (positional, then keyword-only)."""
    return [a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs]


def source_commit(src: str | os.PathLike) -> str | None:
    """The commit a target's source checkout is at: what :data:`EXPORTED_COMMIT` says where bisect
    exported it, else ``git rev-parse HEAD`` there; None for a folder that is not the top of a
    git work tree (an exported tree inside another repository must not take its commit)."""
    exported = Path(src, EXPORTED_COMMIT)
    if exported.is_file():
        return exported.read_text().strip() or None
    try:
        out = subprocess.run(["git", "-C", str(src), "rev-parse", "--show-toplevel", "HEAD"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.split()
    if out.returncode or len(lines) != 2 or Path(lines[0]).resolve() != Path(src).resolve():
        return None
    return lines[1]
