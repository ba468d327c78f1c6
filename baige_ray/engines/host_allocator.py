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

A worker gets these variables through its actor's `runtime_env`, unless its node already starts every
worker with them. The Ray nodes baige-ray starts itself (the simulated cluster, `open_cluster`'s local
instance) do that for the default allocator and carry `HOST_ALLOCATOR_LABEL` to say so. Ray starts an
actor with a `runtime_env` through `setup_worker.py`, a second interpreter, and cannot hand it a worker
it prestarted. On the 2 x 4 simulated cluster, 8 workers started in 11.0 s from their nodes' environment
(2.6 s of CPU each) and in 13.7-17.7 s through a `runtime_env` (3.1-4.0 s each).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Collection

import psutil

from baige_ray.allocator_env import HOST_ALLOCATOR_LABEL, allocator_env_vars

# Below this share of the host's memory available, a worker hands its cached free memory back.
MIN_AVAILABLE_FRACTION = 0.1


def cluster_node_allocators() -> set[str | None]:
    """The host allocator each live node of the connected cluster starts its workers with (its
    `HOST_ALLOCATOR_LABEL`; None for a node started without one)."""
    import ray

    return {node.get("Labels", {}).get(HOST_ALLOCATOR_LABEL) for node in ray.nodes() if node.get("Alive")}


def worker_runtime_env(host_allocator: str, node_allocators: Collection[str | None] = (None,)) -> dict | None:
    """Ray's `runtime_env` for a worker actor (merged with the job's own), or None to inherit the job's
    and its node's environment: where every node (`node_allocators`, `cluster_node_allocators()`) starts
    its workers with `host_allocator`'s, or it sets nothing."""
    env_vars = allocator_env_vars(host_allocator)
    if set(node_allocators) == {host_allocator}:
        return None
    node_set = set(node_allocators) - {None, "system"}  # nodes whose environment sets an allocator
    if node_set and not env_vars:  # glibc's own behaviour cannot be brought back by setting variables
        raise ValueError(f"ScalingConfig.host_allocator={host_allocator!r} is invalid on this cluster: its nodes "
                         f"start every worker with the {sorted(node_set)} allocator's environment (node label "
                         f"{HOST_ALLOCATOR_LABEL}); expected one of {sorted(node_set)}, or nodes started "
                         "without that environment")
    if node_set and "GLIBC_TUNABLES" not in env_vars:  # not the nodes' tunables either
        env_vars["GLIBC_TUNABLES"] = os.environ.get("GLIBC_TUNABLES", "")
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
