"""The suite's time budget (tests/budget.py): written out for small cases."""

from pathlib import Path

import budget


def test_seconds_are_summed_per_file_over_every_phase():
    phases = [("tests/a.py::t1", 1.5), ("tests/a.py::t1", 0.5), ("tests/a.py::t2[x]", 3.0), ("tests/b.py::t", 2.0)]
    assert budget.file_seconds(phases) == {"tests/a.py": 5.0, "tests/b.py": 2.0}


def test_a_slow_file_is_named_unless_its_docstring_says_why(tmp_path: Path):
    (tmp_path / "slow_silent.py").write_text('"""Checks things."""\n')
    (tmp_path / "slow_said.py").write_text('"""Checks things.\n\nOver 20 s: two torchrun launches."""\n')
    (tmp_path / "quick.py").write_text('"""Quick."""\n')
    lines = budget.over_budget({"slow_silent.py": 31.0, "slow_said.py": 45.0, "quick.py": 19.9}, tmp_path)
    assert lines == ["slow_silent.py took 31.0 s (budget 20 s) and its docstring does not say why "
                     "(a paragraph beginning 'Over 20 s:')"]
