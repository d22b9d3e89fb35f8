"""Everything installs under the one import namespace ``shardcheck``."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.launch  # a wheel build: a pip process and a setuptools build
def test_wheel_holds_only_the_shardcheck_namespace(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path),
         str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    [wheel] = tmp_path.glob("shardcheck-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"shardcheck", next(t for t in tops if t.endswith(".dist-info"))}, tops
    for module in ("reference/truth.py", "scenarios/scenario.py", "harness/wire.py", "harness/rank/main.py",
                   "harness/controller/worlds/spawned.py", "targets/builtin.py",
                   "cli.py", "__main__.py"):
        assert f"shardcheck/{module}" in names
    meta = zipfile.ZipFile(wheel)
    ep = next(n for n in names if n.endswith("entry_points.txt"))
    text = meta.read(ep).decode()
    assert "shardcheck = shardcheck.cli:main" in text
    assert "[shardcheck.targets]" in text and "builtin = shardcheck.targets.mutants:builtin" in text
