"""ci/frameworks.toml, the framework commits the framework tests pass at: one entry for every
framework target, each pin a full commit, and a commit of the clone the environment names."""

import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from shardcheck.targets.source import source_env, source_names

PINS = tomllib.loads((Path(__file__).resolve().parent.parent / "ci" / "frameworks.toml").read_text())


def test_every_framework_target_is_pinned_to_a_full_commit_of_its_repository():
    assert sorted(PINS) == sorted(source_names())
    for name, pin in PINS.items():
        assert re.fullmatch(r"[0-9a-f]{40}", pin["commit"]), (name, pin["commit"])
        assert re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", pin["repository"]), (name, pin["repository"])
        assert pin["src_env"] == source_env(name), name  # the variable the target reads
        assert pin["repo_env"] == source_env(name).replace("_SRC", "_REPO"), name


def _clones() -> list[tuple[str, str]]:
    """(framework, folder) for each clone the environment names (source or history)."""
    return [(name, os.environ[pin[env]]) for name, pin in PINS.items() for env in ("src_env", "repo_env")
            if os.environ.get(pin[env])]


@pytest.mark.skipif(not _clones(), reason="no framework clone named (SHARDCHECK_<NAME>_SRC / _REPO): nothing to "
                    "check the pins against")
@pytest.mark.parametrize("name, folder", _clones())
def test_a_pin_is_a_commit_of_the_clone_named(name, folder):
    if not (Path(folder) / ".git").exists():
        pytest.skip(f"{folder} is not a git clone (an exported tree): no history to look the pin up in")
    found = subprocess.run(["git", "-C", folder, "cat-file", "-e", f"{PINS[name]['commit']}^{{commit}}"],
                           capture_output=True, timeout=30)
    assert found.returncode == 0, f"{name}: {PINS[name]['commit']} is not a commit of {folder}"
