"""How a worker process's host memory allocator treats the memory it frees.

glibc's malloc returns large blocks to the kernel as soon as they are freed (each one above 32 MB is its
own mmap) and trims its heaps, so the next step's all-gathered layer, gradient bucket or logits are
faulted in again page by page, zeroed by the kernel. On a CPU worker training Qwen2.5-0.5B that was
about 2 million page faults a step, more than half of the step's CPU time spent in the kernel. A Ray
actor runs its methods on a thread of its own, so its tensors live in a per-thread arena that glibc trims
more eagerly still: `fit`'s workers faulted 60% more than torchrun's ranks on the same model.

"cached" (the default) keeps freed memory in the process for reuse, the way PyTorch's CUDA caching
allocator does on the device and `torch.backends.xeon.run_cpu` does on the host by preloading tcmalloc or
jemalloc: one arena for every thread, no block handed to mmap, no automatic trim. A worker's resident
memory then stays at its peak; `return_freed_memory` (malloc_trim) still hands it back on purpose, after
an engine is dropped, and after any step that leaves the host short of memory (`give_back_under_pressure`).
"system" leaves the allocator as the process starts it. A process whose allocator
is not glibc's (tcmalloc or jemalloc preloaded) ignores these variables.
"""

from __future__ import annotations

import ctypes

import psutil

from baige_ray.api.configs import HOST_ALLOCATORS

# Below this share of the host's memory available, a worker hands its cached free memory back.
MIN_AVAILABLE_FRACTION = 0.1

_GLIBC_CACHED = {
    "MALLOC_ARENA_MAX": "1",  # the actor's method thread shares the main arena, which grows without trimming
    "MALLOC_MMAP_MAX_": "0",  # large blocks come from the heap, and go back to it when freed
    "MALLOC_TRIM_THRESHOLD_": str(2**62),  # never shrink the heap on free
}


def allocator_env_vars(host_allocator: str) -> dict[str, str]:
    """The environment a worker process starts with for `host_allocator` (glibc reads it at start-up,
    so it cannot be set from inside a running actor)."""
    if host_allocator not in HOST_ALLOCATORS:
        raise ValueError(f"host_allocator={host_allocator!r} is invalid: expected one of {HOST_ALLOCATORS}")
    return dict(_GLIBC_CACHED) if host_allocator == "cached" else {}


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
