"""Where a command's CPU goes, by process role: run it, sample every process's CPU time from /proc twice a
second, and charge each interval's CPU to the title the process had (Ray names its workers
`ray::IDLE` while they start, `ray::Actor.method` while they run a method). Linux only.

    python .ci/cpu_by_role.py --out build/cpu-by-role.txt -- make test

The summary: CPU seconds in all, then per title, largest first. A process that starts and ends between two
samples is missed, so the total is a lower bound; processes already running when it starts are charged
only what they use afterwards.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from collections import Counter
from pathlib import Path

SAMPLE_S = 0.5
TICKS = os.sysconf("SC_CLK_TCK")
KNOWN = ("gcs_server", "raylet", "dashboard.py", "dashboard/agent.py", "log_monitor", "monitor.py",
         "runtime_env/agent", "default_worker.py", "setup_worker.py", "pytest", "multiprocessing")


def title(pid: int) -> str | None:
    """The process's role: its Ray title, a known Ray or test process, or the start of its command line."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None
    if command.startswith("ray::"):
        return command.split()[0]
    return next((f"process: {key}" for key in KNOWN if key in command), f"other: {command[:50]}")


def cpu_seconds(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def sample(seen: dict[int, float], charged: Counter, first: bool) -> None:
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        pid = int(entry)
        used, role = cpu_seconds(pid), title(pid)
        if used is None or role is None or role == "other: ":  # kernel threads have no command line
            continue
        before = seen.get(pid, used if first else 0.0)  # a process new since the last sample: all it used
        charged[role] += used - before
        seen[pid] = used


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where the summary is written")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("a command to run is required, after --")
    seen, charged = {}, Counter()
    sample(seen, charged, first=True)
    charged.clear()
    began = time.monotonic()
    child = subprocess.Popen(command)
    while child.poll() is None:
        time.sleep(SAMPLE_S)
        sample(seen, charged, first=False)
    wall = time.monotonic() - began
    lines = [f"{sum(charged.values()):9.1f} CPU-s in all over {wall:.1f} s of wall time"]
    lines += [f"{seconds:9.1f} {role}" for role, seconds in charged.most_common() if seconds >= 0.05]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"CPU by role written to {args.out}")
    return child.returncode


if __name__ == "__main__":
    raise SystemExit(main())
