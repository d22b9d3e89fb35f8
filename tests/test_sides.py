"""The package's shape: nothing that runs in a rank imports the controller side; no module
imports one on a higher floor; no circle of imports."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RANK_SIDE = [ROOT / "harness" / "rank", ROOT / "targets", ROOT / "reference"]
SHARED = [ROOT / "harness" / "wire.py", ROOT / "scenarios", ROOT / "harness" / "backend.py"]


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def _files(paths):
    for p in paths:
        yield from ([p] if p.is_file() else sorted(p.rglob("*.py")))


def test_the_rank_side_and_the_shared_modules_never_import_the_controller_side():
    offenders = {str(f.relative_to(ROOT)): sorted(m for m in _imports(f) if m.startswith("shardcheck.harness.controller"))
                 for f in _files(RANK_SIDE + SHARED)}
    assert not {f: m for f, m in offenders.items() if m}, offenders


def test_the_check_sees_an_import_of_the_controller(tmp_path):
    bad = tmp_path / "x.py"
    bad.write_text("def f():\n    from shardcheck.harness.controller.worlds.spawned import SpawnedWorld\n")
    assert "shardcheck.harness.controller.worlds.spawned" in _imports(bad)


def test_the_wire_is_the_only_result_type():
    """No module builds a rank's result as a dict any more: every result is a RankResult."""
    for f in _files([ROOT / "harness"]):
        text = f.read_text()
        assert '"desync":' not in text and "'desync':" not in text, f


# -- floors: each imports only its own floor and those below -----------------------------------------
PACKAGES = {"shardcheck": "shardcheck", "harness": "shardcheck.harness", "reference": "shardcheck.reference",
            "scenarios": "shardcheck.scenarios", "targets": "shardcheck.targets"}
# lowest first; a module belongs to the first (longest) prefix it matches
FLOORS = [
    ("shardcheck.errors", 0),  # one-line errors, the version: everyone may raise and say them
    ("shardcheck.scenarios", 1),  # what is checked: scenarios, their data, layouts, suites, strategies
    ("shardcheck.reference", 2),  # the float64 truth
    # the wire both sides share, and what a run is configured with (targets read both)
    ("shardcheck.harness.wire", 3), ("shardcheck.backend", 3), ("shardcheck.run_config", 3),
    ("shardcheck.targets", 4),  # the target contract and the adapters
    ("shardcheck.harness.rank", 5),  # a rank: runs a target, checks it
    ("shardcheck.harness.controller", 6),  # drives worlds, verdicts, reports
    ("shardcheck.harness", 3),
    ("shardcheck", 7),  # the command line, the pytest plugin, the public strategies
]


def _modules() -> dict[str, Path]:
    out = {}
    for folder, package in PACKAGES.items():
        for f in sorted((ROOT / folder).rglob("*.py")):
            parts = [p for p in f.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            out[".".join([package, *parts])] = f
    return out


def _floor(module: str) -> int:
    if module == "shardcheck":  # the package itself: its version
        return 0
    return next(k for prefix, k in sorted(FLOORS, key=lambda p: -len(p[0]))
                if module == prefix or module.startswith(prefix + "."))


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, f in modules.items():
        found = set()
        for node in ast.walk(ast.parse(f.read_text())):  # every import, module level or in a function
            if isinstance(node, ast.Import):
                wanted = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                # "from package import module" depends on the module (the package's __init__ only
                # where a name is taken from it)
                wanted = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                          for a in node.names]
            else:
                continue
            for m in wanted:
                while m and m not in modules:
                    m = m.rpartition(".")[0]
                if m and m != name:
                    found.add(m)
        graph[name] = found
    return graph


def _upward(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} (floor {_floor(m)}) imports {i} (floor {_floor(i)})"
                  for m, deps in graph.items() for i in deps if _floor(i) > _floor(m))


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_one_on_a_higher_floor_and_there_is_no_circle():
    graph = _graph()
    assert len(graph) > 60  # the whole package was read
    assert _upward(graph) == []
    assert _circles(graph) == []


def test_the_graph_check_sees_an_import_up_and_a_circle():
    graph = {"shardcheck.scenarios.a": {"shardcheck.harness.controller.worlds.spawned"},
             "shardcheck.targets.x": {"shardcheck.targets.y"}, "shardcheck.targets.y": {"shardcheck.targets.x"}}
    assert _upward(graph) == ["shardcheck.scenarios.a (floor 1) imports shardcheck.harness.controller.worlds.spawned (floor 6)"]
    assert _circles(graph) == [["shardcheck.targets.x", "shardcheck.targets.y"]]
