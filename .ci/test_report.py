"""Where the suite's time went, from pytest's JUnit XML reports: each tier's wall time and test count,
the ten slowest tests (setup, call and teardown together), the three slowest of each tier (a tier's own
outlier shows even beside slower tiers) and the modules that cost most.

    python .ci/test_report.py build/test-reports/*.xml
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ElementTree
from collections import Counter
from pathlib import Path

NUM_SLOWEST = 10
NUM_MODULES = 10
NUM_PER_TIER = 3


def read_reports(paths: list[Path]) -> tuple[list[tuple[str, int, float]], list[tuple[str, str, float]]]:
    """(tier name, tests, wall seconds) per report, and (tier name, test id, seconds) of every test."""
    tiers, tests = [], []
    for path in paths:
        root = ElementTree.parse(path).getroot()
        suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
        tiers.append((path.stem, sum(int(s.get("tests", 0)) for s in suites),
                      sum(float(s.get("time", 0.0)) for s in suites)))
        for case in root.iter("testcase"):
            tests.append((path.stem, f"{case.get('classname')}::{case.get('name')}", float(case.get("time", 0.0))))
    return tiers, tests


def report(paths: list[Path]) -> str:
    tiers, tests = read_reports(paths)
    lines = ["== test time by tier"]
    lines += [f"{seconds:8.1f} s  {count:5d} tests  {name}" for name, count, seconds in tiers]
    lines.append(f"== the {NUM_SLOWEST} slowest tests")
    slowest_first = sorted(tests, key=lambda t: -t[2])
    lines += [f"{seconds:8.1f} s  {test}" for _, test, seconds in slowest_first[:NUM_SLOWEST]]
    for name, _, _ in tiers:
        lines.append(f"== the {NUM_PER_TIER} slowest of {name}")
        lines += [f"{seconds:8.1f} s  {test}" for tier, test, seconds in slowest_first if tier == name][:NUM_PER_TIER]
    modules = Counter()
    for _, test, seconds in tests:
        modules[test.split("::")[0]] += seconds
    lines.append(f"== the {NUM_MODULES} costliest modules")
    lines += [f"{seconds:8.1f} s  {module}" for module, seconds in modules.most_common(NUM_MODULES)]
    return "\n".join(lines)


if __name__ == "__main__":
    found = [Path(argument) for argument in sys.argv[1:] if Path(argument).is_file()]
    print(report(found) if found else "no test report found")
