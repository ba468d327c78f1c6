"""Where a command's CPU goes, by process role and by test module: run it, sample every process's CPU time
from /proc twice a second, and charge each interval's CPU to the title the process had (Ray names its
workers `ray::IDLE` while they start, `ray::Actor.method` while they run a method). CPU a process uses in
its first STARTING_S seconds is also counted as starting (interpreter, imports, Ray's registration, model
construction). When the command runs pytest, tests/conftest.py writes when each test starts and ends to
the file named by BAIGE_TEST_TIMELINE, and the summary adds a table per test module: its wall time, the
machine's idle share, the CPU of starting processes and the roles that used most (where tests run side by
side, as under pytest-xdist, an interval counts for every test running in it). Linux only.

    python .ci/cpu_by_role.py --out build/cpu-by-role.txt -- make test
    python .ci/cpu_by_role.py --out build/ray-tier.txt -- .venv/bin/python -m pytest tests/ray tests/cluster

A process that starts and ends between two samples is missed, so the totals are lower bounds; processes
already running when it starts are charged only what they use afterwards.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

SAMPLE_S = 0.5
STARTING_S = 8.0
TICKS = os.sysconf("SC_CLK_TCK")
TIMELINE_ENV = "BAIGE_TEST_TIMELINE"
STARTING = f"(processes in their first {STARTING_S:.0f} s)"
KNOWN = ("gcs_server", "raylet", "dashboard.py", "dashboard/agent.py", "log_monitor", "monitor.py",
         "runtime_env/agent", "default_worker.py", "setup_worker.py", "pytest", "multiprocessing")


def title(pid: int) -> str | None:
    """The process's role: its Ray title, a known Ray or test process, or the start of its command line."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None
    if command.startswith("ray::"):
        return command.split()[0].split(".")[0]
    return next((f"process: {key}" for key in KNOWN if key in command), f"other: {command[:50]}")


def cpu_and_start(pid: int) -> tuple[float, int] | None:
    """CPU seconds used (utime + stime) and the start time in ticks, which tells a reused pid apart."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / TICKS, int(fields[19])


def machine_idle_and_total() -> tuple[float, float]:
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (values[3] + values[4]) / TICKS, sum(values) / TICKS


@dataclass
class Interval:
    ended: float
    idle_s: float
    total_s: float
    by_role: Counter = field(default_factory=Counter)


class Sampler:
    """Each sample's CPU per role since the last, with the processes still starting counted apart."""

    def __init__(self) -> None:
        self._seen: dict[tuple[int, int], tuple[float, float]] = {}  # (pid, start) -> (cpu, first seen)
        self._machine = machine_idle_and_total()
        self.sample(first=True)

    def sample(self, first: bool = False) -> Interval:
        now = time.monotonic()
        idle, total = machine_idle_and_total()
        interval = Interval(now, idle - self._machine[0], total - self._machine[1])
        self._machine = (idle, total)
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            pid = int(entry)
            measured, role = cpu_and_start(pid), title(pid)
            if measured is None or role is None or role == "other: ":  # kernel threads have no command line
                continue
            used, start = measured
            before, born = self._seen.get((pid, start), (used if first else 0.0, now))
            interval.by_role[role] += used - before
            if not first and now - born <= STARTING_S:
                interval.by_role[STARTING] += used - before
            self._seen[(pid, start)] = (used, born)
        return interval


def read_timeline(path: Path) -> list[tuple[float, float, str]]:
    """(began, ended, test id) of each finished test, on time.monotonic's clock."""
    began, spans = {}, []
    for line in path.read_text().splitlines() if path.is_file() else []:
        kind, moment, test = line.split(" ", 2)
        if kind == "start":
            began[test] = float(moment)
        elif test in began:
            spans.append((began.pop(test), float(moment), test))
    return spans


def role_lines(charged: Counter, wall: float) -> list[str]:
    roles = Counter({role: seconds for role, seconds in charged.items() if role != STARTING})
    in_all = sum(roles.values())
    lines = [f"{in_all:9.1f} CPU-s in all over {wall:.1f} s of wall time",
             f"{charged[STARTING]:9.1f} of them ({charged[STARTING] / max(in_all, 1e-9):.0%}) in processes' "
             f"first {STARTING_S:.0f} s: starting, importing, registering"]
    lines += [f"{seconds:9.1f} {role}" for role, seconds in roles.most_common() if seconds >= 0.05]
    return lines


def module_lines(intervals: list[Interval], spans: list[tuple[float, float, str]]) -> list[str]:
    modules: dict[str, list] = defaultdict(lambda: [0.0, 0.0, 0.0, Counter()])  # wall, idle, total, roles
    for began, ended, test in spans:
        module = modules[test.split("::")[0]]
        module[0] += ended - began
        for interval in intervals:
            if began < interval.ended <= ended:
                module[1] += interval.idle_s
                module[2] += interval.total_s
                module[3].update(interval.by_role)
    lines = ["== by test module: wall s, machine idle, CPU-s of starting processes, most CPU-s by role"]
    for name, (wall, idle, total, roles) in sorted(modules.items(), key=lambda item: -item[1][0]):
        top = ", ".join(f"{role} {seconds:.0f}" for role, seconds in roles.most_common(5) if role != STARTING)
        lines.append(f"{wall:7.1f} s  idle {idle / max(total, 1e-9):4.0%}  starting {roles[STARTING]:6.1f}  "
                     f"{name}: {top}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where the summary is written")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("a command to run is required, after --")
    timeline = Path(tempfile.mkdtemp()) / "timeline.txt"
    sampler, intervals = Sampler(), []
    began = time.monotonic()
    child = subprocess.Popen(command, env={**os.environ, TIMELINE_ENV: str(timeline)})
    while child.poll() is None:
        time.sleep(SAMPLE_S)
        intervals.append(sampler.sample())
    charged = Counter()
    for interval in intervals:
        charged.update(interval.by_role)
    lines = role_lines(charged, time.monotonic() - began) + module_lines(intervals, read_timeline(timeline))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"CPU by role written to {args.out}")
    return child.returncode


if __name__ == "__main__":
    raise SystemExit(main())
