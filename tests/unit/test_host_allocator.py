"""The "cached" host allocator keeps freed blocks for reuse: a second large allocation costs no page faults.

A child process stands in for a worker (glibc reads the variables at start-up): it allocates and frees a
64 MB block, then counts the minor page faults the next 64 MB block takes to fill.
"""

import json
import os
import subprocess
import sys

import pytest

from baige_ray.runtime.host_allocator import allocator_env_vars, give_back_under_pressure, worker_runtime_env

BLOCK_PAGES = (64 << 20) // 4096

CHILD = """
import json, resource, threading
def second_block_faults(out):
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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_cached_allocator_reuses_freed_blocks_where_the_system_default_faults_them_in_again():
    assert _second_block_faults("system") > BLOCK_PAGES // 2
    assert _second_block_faults("cached") < BLOCK_PAGES // 20


def test_system_allocator_leaves_the_job_environment_alone():
    assert worker_runtime_env("system") is None
    assert set(worker_runtime_env("cached")["env_vars"]) == {"MALLOC_ARENA_MAX", "MALLOC_MMAP_MAX_",
                                                            "MALLOC_TRIM_THRESHOLD_"}
    with pytest.raises(ValueError, match="host_allocator"):
        allocator_env_vars("tcmalloc")


def test_cached_memory_is_given_back_only_when_the_host_runs_short():
    assert give_back_under_pressure(min_available_fraction=0.0) is False
    assert give_back_under_pressure(min_available_fraction=1.01) is True
