"""Shared fixtures and tier markers.

Tiers follow directories: tests/unit (no Ray), tests/ray (a local Ray with fake
GPUs), tests/cluster (the simulated 2x4 multi-node cluster). One Ray session is
alive at a time: each tier's fixture opens its session once and closes the
other tier's. With RAY_ADDRESS set, both Ray tiers use the user's cluster. `make test RAY_TIER_LANES=2`
runs tests/ray and tests/cluster in two pytest processes side by side, each with its own Ray sessions:
`--dashboard-port` gives the second its own dashboard (the state API the tests read lives there).
Serve, once a module starts it, stays up for the later modules of the session
(each deletes the applications it made): serve() joins a running Serve on its
proxy's port, and starting Serve again costs seconds each module.
"""

from __future__ import annotations

import shutil
import tempfile
from contextlib import ExitStack
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SIM_2X4 = REPO_ROOT / "clusters" / "sim-2x4.yaml"
SIM_4X2 = REPO_ROOT / "clusters" / "sim-4x2.yaml"
_TIERS = ("unit", "ray", "cluster")
# Unit modules whose tests read the clock: a timeout, a bounded wait, a measured duration. Beside a test that
# starts four ranks on two cores, a bound could be missed for want of CPU alone: `make test` runs the rest of
# the unit tier first (`-m "not wall_clock"`), then these among themselves (`-m wall_clock`).
WALL_CLOCK_MODULES = frozenset({
    "test_abortable_collectives", "test_arbiter_loop", "test_bench_overhead", "test_calibration_probe_layers",
    "test_calibration_probe_timing", "test_checkpoint_persister", "test_controller_commands",
    "test_controller_fake_pool", "test_corrupt_checkpoint_events", "test_ddp_abort", "test_deepspeed_init",
    "test_docs_build", "test_elastic_parts", "test_elastic_watch", "test_engine_failures", "test_failpoints",
    "test_host_allocator", "test_job_progress", "test_leaving_a_broken_generation", "test_liveness",
    "test_rendezvous", "test_replica_reports", "test_replica_wait", "test_serving_engine", "test_step_accounts",
    "test_step_progress", "test_topology_graph",
})


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--dashboard-port", type=int, default=None,
                     help="the dashboard port of the Ray sessions these tests start (default: Ray's, 8265)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = Path(str(item.fspath)).relative_to(REPO_ROOT / "tests").parts[0]
        if tier in _TIERS:
            item.add_marker(getattr(pytest.mark, tier))
        if tier == "unit" and Path(str(item.fspath)).stem in WALL_CLOCK_MODULES:
            item.add_marker(pytest.mark.wall_clock)
    # The 4 x 2 cluster's tests last, not between the 2 x 4 cluster's: each change of simulated
    # cluster shuts one down and starts the other (about 25 s). The sort is stable: the order stays
    # the files' order otherwise.
    items.sort(key=lambda item: "sim_cluster_4x2" in getattr(item, "fixturenames", ()))


def _timeline_writer():
    """Where each test's start and end go when .ci/cpu_by_role.py runs the suite (BAIGE_TEST_TIMELINE)."""
    import os

    path = os.environ.get("BAIGE_TEST_TIMELINE")
    return open(path, "a", buffering=1) if path else None


_TIMELINE = _timeline_writer()


def pytest_runtest_logstart(nodeid: str, location) -> None:
    if _TIMELINE:
        import time

        _TIMELINE.write(f"start {time.monotonic()} {nodeid}\n")


def pytest_runtest_logfinish(nodeid: str, location) -> None:
    if _TIMELINE:
        import time

        _TIMELINE.write(f"end {time.monotonic()} {nodeid}\n")


RAY_FULL_DISK = 0.95  # Ray's local_fs_capacity_threshold: above it the object store cannot spill


def pytest_sessionstart(session: pytest.Session) -> None:
    """On a disk over 95% full Ray's object store refuses to spill (OutOfDiskError), so every regroup
    that moves state fails, and a recovery test retries until it times out: say why at once."""
    directory = tempfile.gettempdir()
    usage = shutil.disk_usage(directory)
    used = 1 - usage.free / usage.total
    if used > RAY_FULL_DISK:
        raise pytest.UsageError(f"the disk under {directory} is {used:.1%} full ({usage.free / 2**30:.1f} GiB free): "
                                f"Ray's object store fails above {RAY_FULL_DISK:.0%}; free some space first")


class RaySessions:
    """Holds the one open Ray session and which tier opened it."""

    def __init__(self, dashboard_port: int | None = None) -> None:
        self.dashboard_port = dashboard_port
        self.kind: str | None = None
        self.session = None
        self._stack = ExitStack()

    def use(self, kind: str, **open_cluster_args):
        from baige_ray.topology.connect import open_cluster

        if self.kind != kind:
            self.close()
            self.session = self._stack.enter_context(open_cluster(dashboard_port=self.dashboard_port,
                                                                  **open_cluster_args))
            self.kind = kind
        return self.session

    def close(self) -> None:
        self._stack.close()
        self.kind, self.session = None, None


@pytest.fixture(scope="session", autouse=True)
def _own_calibration_dir(tmp_path_factory):
    """Plans in tests never price with a calibration the user's machine kept."""
    import os

    from baige_ray.constants import CALIBRATION_DIR_ENV

    previous = os.environ.get(CALIBRATION_DIR_ENV)
    os.environ[CALIBRATION_DIR_ENV] = str(tmp_path_factory.mktemp("calibration"))
    yield
    if previous is None:
        os.environ.pop(CALIBRATION_DIR_ENV, None)
    else:
        os.environ[CALIBRATION_DIR_ENV] = previous


@pytest.fixture(scope="session")
def ray_sessions(request):
    sessions = RaySessions(request.config.getoption("--dashboard-port"))
    yield sessions
    sessions.close()


# Module-scoped: a module never mixes tiers, and opening is a no-op while that tier's session is up,
# so a session handed out is never one the other tier has already replaced.
@pytest.fixture(scope="module")
def local_ray(ray_sessions):
    """A single-node local Ray advertising 4 fake GPUs (or the RAY_ADDRESS cluster)."""
    return ray_sessions.use("local", local_num_cpus=4, local_num_gpus=4)


@pytest.fixture(scope="module")
def sim_cluster(ray_sessions):
    """The simulated 2-node x 4-GPU cluster from clusters/sim-2x4.yaml (or the RAY_ADDRESS cluster)."""
    return ray_sessions.use("cluster", descriptor=SIM_2X4)


@pytest.fixture(scope="module")
def sim_cluster_4x2(ray_sessions):
    """Four simulated nodes with two fake GPUs each, for tests that remove and re-add whole nodes."""
    return ray_sessions.use("cluster-4x2", descriptor=SIM_4X2)
