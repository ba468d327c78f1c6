"""`make test` runs most of the unit tier at nice 19 beside the Ray tiers; a unit module that reads the
clock must be marked `wall_clock` (tests/conftest.py) so that it runs alone, where a bound it asserts
cannot be missed for want of CPU."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import WALL_CLOCK_MODULES

UNIT_DIR = Path(__file__).resolve().parent
# What a test or its helpers use to bound or measure wall time.
READS_THE_CLOCK = re.compile(r"time\.monotonic\(|perf_counter\(|timeout\s*=\s*[0-9.]|TIMEOUT_S\s*=|deadline")


def test_every_unit_module_that_reads_the_clock_is_marked_wall_clock():
    reading = {path.stem for path in UNIT_DIR.glob("test_*.py")
               if path.stem != Path(__file__).stem and READS_THE_CLOCK.search(path.read_text())}
    assert reading - WALL_CLOCK_MODULES == set(), "add these to tests/conftest.py's WALL_CLOCK_MODULES"


def test_every_module_marked_wall_clock_exists():
    assert WALL_CLOCK_MODULES - {path.stem for path in UNIT_DIR.glob("test_*.py")} == set()
