"""How a worker process's host memory allocator treats the memory it frees.

glibc's malloc returns large blocks to the kernel as soon as they are freed (each one above a threshold
that moves up to 32 MB is its own mmap) and trims its heaps, so the next step's all-gathered layer,
gradient bucket or logits are faulted in again page by page, zeroed by the kernel. On a CPU worker
training Qwen2.5-0.5B that was about 2 million page faults a step, more than half of the step's CPU time
spent in the kernel. A Ray actor runs its methods on a thread of its own, so its tensors live in a
per-thread arena that glibc trims more eagerly still: `fit`'s workers faulted 60% more than torchrun's
ranks on the same model.

"cached" (the default) keeps freed blocks under 32 MB in the process for reuse, the way PyTorch's CUDA
caching allocator does on the device and `torch.backends.xeon.run_cpu` does on the host by preloading
tcmalloc or jemalloc: one arena for every thread, a fixed 32 MB mmap threshold, no automatic trim. Larger
blocks are still mapped and returned when freed (the heap never holds them, so it cannot fragment around
them), on transparent huge pages where the kernel allows them on request: a fault then brings 2 MiB.
Qwen2.5-0.5B's FSDP2 step on two CPU workers went from 14-16 s to 8.8 s, its peak from 7.4 to 8.6 GB.

"retain" keeps every freed block, large ones too: that step took 6.5 s, but a worker's resident
memory grew 1.5-2.3 GB above glibc's within a few steps (the heap fragments around the large blocks),
and torchrun's DeepSpeed ZeRO-3 ranks of the same model ran out of host memory under it. The memory check
prices live tensors, not that: use it only with memory to spare. Under either, a worker hands its free memory back
(malloc_trim) after a step that leaves its host with less than 10% available
(`give_back_under_pressure`), and after an engine is dropped.

"system" leaves the allocator as the process starts it. A process whose allocator is not glibc's
(tcmalloc or jemalloc preloaded) ignores these variables.
"""

from __future__ import annotations

import ctypes
import os

import psutil

from baige_ray.api.configs import HOST_ALLOCATORS

# Below this share of the host's memory available, a worker hands its cached free memory back.
MIN_AVAILABLE_FRACTION = 0.1

_MMAP_THRESHOLD = 32 << 20  # the most glibc accepts
_NEVER_TRIM = str(2**62)
_GLIBC = {
    "cached": {
        "MALLOC_ARENA_MAX": "1",  # the actor's method thread shares the main arena
        "MALLOC_MMAP_THRESHOLD_": str(_MMAP_THRESHOLD),  # fixed: glibc's own moves with the blocks freed
        "MALLOC_TRIM_THRESHOLD_": _NEVER_TRIM,
        "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1",  # mapped blocks ask for transparent huge pages
    },
    "retain": {
        "MALLOC_ARENA_MAX": "1",
        "MALLOC_MMAP_MAX_": "0",  # large blocks come from the heap too, and go back to it when freed
        "MALLOC_TRIM_THRESHOLD_": _NEVER_TRIM,
    },
    "system": {},
}


def allocator_env_vars(host_allocator: str) -> dict[str, str]:
    """The environment a worker process starts with for `host_allocator` (glibc reads it at start-up,
    so it cannot be set from inside a running actor)."""
    if host_allocator not in HOST_ALLOCATORS:
        raise ValueError(f"host_allocator={host_allocator!r} is invalid: expected one of {HOST_ALLOCATORS}")
    env_vars = dict(_GLIBC[host_allocator])
    own_tunables = os.environ.get("GLIBC_TUNABLES")
    if own_tunables and "GLIBC_TUNABLES" in env_vars:  # add to the tunables this process was given
        env_vars["GLIBC_TUNABLES"] = f"{own_tunables}:{env_vars['GLIBC_TUNABLES']}"
    return env_vars


def worker_runtime_env(host_allocator: str) -> dict | None:
    """Ray's `runtime_env` for a worker actor (merged with the job's own), or None to inherit the job's."""
    env_vars = allocator_env_vars(host_allocator)
    return {"env_vars": env_vars} if env_vars else None


def return_freed_memory() -> None:
    """Hand the free memory of the heap back to the system (the cached allocator and glibc's default
    both keep some): after an engine is dropped, or when the host runs short."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def give_back_under_pressure(min_available_fraction: float = MIN_AVAILABLE_FRACTION) -> bool:
    """Return the freed memory this process caches when the host has less than `min_available_fraction`
    of its memory available, so that a cache never starves a neighbour (another worker, a Serve
    replica, a snapshot). True when it did; the next step then faults in what it reuses."""
    memory = psutil.virtual_memory()
    if memory.available >= min_available_fraction * memory.total:
        return False
    return_freed_memory()
    return True
