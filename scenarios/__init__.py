"""Scenarios (plain data), the data generated from them, and named suites."""

from shardcheck.scenarios.scenario import CP_LAYOUTS, DTYPES, LAYOUTS, MEGATRON_LAYOUTS, SP_LAYOUTS, Sample, Scenario
from shardcheck.scenarios.suites import SUITES, get_suite, load_scenario_file, write_scenario_file

__all__ = [
    "CP_LAYOUTS",
    "DTYPES",
    "LAYOUTS",
    "MEGATRON_LAYOUTS",
    "SP_LAYOUTS",
    "SUITES",
    "Sample",
    "Scenario",
    "get_suite",
    "load_scenario_file",
    "write_scenario_file",
]
