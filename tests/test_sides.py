"""The harness's two sides: nothing that runs in a rank imports the controller side."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RANK_SIDE = [ROOT / "harness" / "rank", ROOT / "targets", ROOT / "reference"]
SHARED = [ROOT / "harness" / "wire.py", ROOT / "harness" / "layout.py", ROOT / "harness" / "backend.py"]


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
    bad.write_text("def f():\n    from shardcheck.harness.controller.world import World\n")
    assert "shardcheck.harness.controller.world" in _imports(bad)


def test_the_wire_is_the_only_result_type():
    """No module builds a rank's result as a dict any more: every result is a RankResult."""
    for f in _files([ROOT / "harness"]):
        text = f.read_text()
        assert '"desync":' not in text and "'desync':" not in text, f
