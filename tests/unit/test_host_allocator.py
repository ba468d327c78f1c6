"""Worker processes' host allocator settings, checked in a child process that stands in for a worker
(glibc reads them at start-up): the minor page faults a 64 MB block takes to fill on a thread (a Ray
actor's methods run on one) after blocks of that size were freed.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from baige_ray.engines.host_allocator import allocator_env_vars, give_back_under_pressure, worker_runtime_env

BLOCK_PAGES = (64 << 20) // 4096

CHILD = """
import json, resource, threading
def second_block_faults(out):
    for _ in range(3):
        block = bytearray(64 << 20); block[::4096] = b"x" * len(block[::4096]); del block
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    block = bytearray(64 << 20); block[::4096] = b"x" * len(block[::4096])
    out.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
out = []
# a Ray actor runs its methods on a thread of its own, with a per-thread arena unless told otherwise
thread = threading.Thread(target=second_block_faults, args=(out,)); thread.start(); thread.join()
print(json.dumps(out[0]))
"""


def _second_block_faults(host_allocator: str) -> int:
    env = {name: value for name, value in os.environ.items() if not name.startswith("MALLOC_")}
    env.update(allocator_env_vars(host_allocator))
    completed = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=60,
                               check=True)
    return json.loads(completed.stdout)


def _huge_pages_on_request() -> bool:
    setting = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return setting.is_file() and ("[madvise]" in setting.read_text() or "[always]" in setting.read_text())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_large_blocks_are_faulted_in_again_by_default_kept_by_retain_and_on_huge_pages_when_cached():
    system = _second_block_faults("system")
    assert system > BLOCK_PAGES // 2
    assert _second_block_faults("retain") < BLOCK_PAGES // 100
    if _huge_pages_on_request():
        assert _second_block_faults("cached") < system // 10


def test_system_allocator_leaves_the_job_environment_alone():
    assert worker_runtime_env("system") is None
    assert worker_runtime_env("cached")["env_vars"]["MALLOC_ARENA_MAX"] == "1"
    with pytest.raises(ValueError, match="host_allocator"):
        allocator_env_vars("tcmalloc")


def test_cached_memory_is_given_back_only_when_the_host_runs_short():
    assert give_back_under_pressure(min_available_fraction=0.0) is False
    assert give_back_under_pressure(min_available_fraction=1.01) is True


def test_huge_pages_are_asked_for_beside_the_tunables_the_process_was_given(monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.tcache_count=0")
    assert allocator_env_vars("cached")["GLIBC_TUNABLES"] == "glibc.malloc.tcache_count=0:glibc.malloc.hugetlb=1"
