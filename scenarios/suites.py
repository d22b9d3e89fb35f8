"""Named suites of scenarios, and loading scenarios from a file."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from shardcheck.errors import BadInput
from shardcheck.scenarios import regressions, smoke
from shardcheck.scenarios.scenario import Scenario

# Every named suite, by name: a new suite is a function in smoke.py or regressions.py, listed here.
SUITES: dict[str, Callable[[], list[Scenario]]] = {
    fn.__name__: fn for fn in (smoke.smoke, smoke.logprob, smoke.large, regressions.regressions, regressions.replay,
                               regressions.sampling)
}


def get_suite(name: str) -> list[Scenario]:
    if name not in SUITES:
        raise BadInput(f"unknown suite {name!r} (known: {', '.join(sorted(SUITES))})")
    scenarios = SUITES[name]()
    names = [s.name for s in scenarios]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise BadInput(f"suite {name!r} has duplicate scenario names: {', '.join(dupes)}")
    return scenarios


def load_scenario_file(path: str | Path) -> list[Scenario]:
    """A JSON file holding one scenario object or a list of them."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise BadInput(f"scenario file {str(p)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInput(f"scenario file {str(p)!r} cannot be read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise BadInput(f"scenario file {str(p)!r} is not valid JSON: {exc}") from None
    items = data if isinstance(data, list) else [data]
    if not items:
        raise BadInput(f"scenario file {str(p)!r} holds no scenario")
    scenarios = []
    first: dict[str, int] = {}  # name -> the entry that first has it
    for i, item in enumerate(items):
        try:
            sc = Scenario.from_dict(item)
        except BadInput as exc:
            raise BadInput(f"scenario file {str(p)!r}, entry {i}: {exc}") from None
        if sc.name in first:  # --scenario, the reports and a replay name a scenario by it
            raise BadInput(f"scenario file {str(p)!r}: entries {first[sc.name]} and {i} are both named {sc.name!r}")
        first[sc.name] = i
        scenarios.append(sc)
    return scenarios


def write_scenario_file(path: str | Path, scenario: Scenario) -> None:
    """A scenario file that :func:`load_scenario_file` reads back: one field a line, so it reads
    well and diffs well."""
    fields = sorted(scenario.to_dict().items())
    Path(path).write_text("{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in fields) + "\n}\n")
