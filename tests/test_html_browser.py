"""The HTML report in a real browser: headless Chromium (Debian's ``chromium`` package; ci/install.sh
installs it from the machine's apt cache when it can, never downloading; without it these tests
skip with that reason) opens the page and what a person sees in it is checked. The screenshots
are kept (``SHARDCHECK_ARTIFACTS``, else the test's temporary folder).

Over 20 s: run before tests/test_run.py (as CI runs them), it pays for the session's smoke run
through the command line (68 scenarios, shared with test_run); Chromium starts six times."""

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from conftest import run_on_world
from shardcheck.harness.controller.reports.html_report import render, write
from shardcheck.scenarios import Sample, Scenario, get_suite

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [pytest.mark.world, pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium: Debian's chromium package is not installed (ci/install.sh installs it "
                              "from the apt cache when it can; a browser is never downloaded at run time)")]


def _browser(page: Path, *args: str, fragment: str = "") -> tuple[str, float]:
    t0 = time.perf_counter()
    proc = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                           *args, page.as_uri() + fragment], capture_output=True, text=True, timeout=60)
    return proc.stdout, time.perf_counter() - t0


def _seen(dom: str) -> str:
    """The text a person reads: scripts and styles out, tags out, spaces folded."""
    dom = re.sub(r"<(script|style)[^>]*>.*?</\1>", "", dom, flags=re.S)
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", dom))


def _artifacts(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("SHARDCHECK_ARTIFACTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def test_a_hang_and_a_wrong_value_as_a_person_sees_them(world, tmp_path):
    hang = [s for s in get_suite("regressions") if s.name == "ag-empty-local-slices"]
    wrong = [Scenario("corrupt", (Sample(12, 6), Sample(10, 7)), vocab=16, tp=2, seed=3)]
    for name, scenarios, target in (("hang", hang, "builtin:skip_empty_rank"), ("value", wrong, "plants:CorruptValue")):
        report = run_on_world(world, scenarios, target, tmp_path / f"{name}.json", name).report
        page = tmp_path / f"{name}.html"
        write(str(page), render(report))
        dom, _ = _browser(page, "--dump-dom")
        seen = _seen(dom)
        assert f"FAILED {scenarios[0].name}" in seen, seen[:2000]
        if name == "hang":
            lanes = dom.split('class="lanes"')[1].split("</table>")[0]
            divergent = re.search(r'<tr class="divergent">(.*?)</tr>', lanes, re.S).group(1)
            assert "finished the scenario after 0 calls here" in divergent and "all_reduce(SUM" in divergent
            layout = dom.split("Layout map")[1]
            assert layout.count('class="strip"') == 2 and "rank 1 (tp 0, cp 1)" in _seen(layout)
            # the table's filter, preset by the link: failing scenarios only
            filtered, _ = _browser(page, "--dump-dom", fragment="#verdict=fail")
            rows = re.findall(r'<tr class="(\w+)" data-kinds="[^"]*"( style="display: none;")?>', filtered)
            assert rows and all(bool(hidden) == (cls != "fail") for cls, hidden in rows), rows
        else:
            assert "sample 1 (7 response tokens): value wrong at tokens 3" in seen
        shot = _artifacts(tmp_path) / f"report-{name}.png"
        _browser(page, "--window-size=1200,1600", f"--screenshot={shot}")
        assert shot.stat().st_size > 10_000


@pytest.mark.background("smoke-cli")
def test_the_smoke_report_renders_whole_and_filters(smoke_cli):
    """The page `shardcheck run --html-report` wrote for the smoke suite."""
    page = smoke_cli.html_report
    assert smoke_cli.proc.returncode == 0, smoke_cli.proc.stderr[-2000:]
    assert page.stat().st_size < 2 * 2**20
    # how fast it opens is a figure for a benchmark, not a bound for a test (a loaded machine's
    # browser start alone varies from 1 to 4 s): here, that it opens whole
    dom, _ = _browser(page, "--dump-dom")
    assert _seen(dom).count(" pass ") >= 64
    assert 'id="filter"' in dom  # the filter came up (its script ran without an error stopping the page)
