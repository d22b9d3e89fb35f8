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
    # everything a run needs, its suites, the HTML page's template and the repro scripts' body among
    # them (Python modules read as text: no data files to forget)
    for module in ("reference/truth.py", "scenarios/scenario.py", "harness/wire.py", "harness/rank/main.py",
                   "harness/controller/worlds/spawned.py", "targets/builtin.py",
                   "scenarios/smoke.py", "scenarios/regressions.py", "scenarios/training.py",
                   "scenarios/sequence_parallel.py", "harness/controller/reports/html_report.py",
                   "harness/controller/commands/repro_script.py", "harness/controller/reports/github_summary.py",
                   "pytest_plugin.py", "cli.py", "__main__.py"):
        assert f"shardcheck/{module}" in names
    meta = zipfile.ZipFile(wheel)
    ep = next(n for n in names if n.endswith("entry_points.txt"))
    text = meta.read(ep).decode()
    assert "shardcheck = shardcheck.cli:main" in text
    assert "[shardcheck.targets]" in text and "builtin = shardcheck.targets.mutants:builtin" in text


def test_the_changelog_heads_with_this_version_and_its_target_contract():
    """The version is written once (shardcheck/__init__.py); CHANGELOG.md's newest entry names it
    and the Target contract it ships, so a release cannot go out with a stale changelog."""
    import re

    import shardcheck
    from shardcheck.targets.base import CONTRACT_VERSION

    head = re.search(r"^## (\S+) \(Target contract (\d+)\)", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert head and head.groups() == (shardcheck.__version__, str(CONTRACT_VERSION)), head
