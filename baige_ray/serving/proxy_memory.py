"""Giving Serve's HTTP proxies back the memory a request backlog left them (the arbiter decides when:
policies/memory_return.py).

Each proxy runs glibc's `malloc_trim` in its own process (through Ray's `__ray_call__`), which unmaps the
free pages of every allocator arena. Where the C library has no `malloc_trim` (musl, macOS) nothing is done.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProxyMemory:
    node_id: str
    resident_before: int  # bytes
    resident_after: int

    @property
    def returned(self) -> int:
        return self.resident_before - self.resident_after


def return_proxy_memory(timeout_s: float = 10.0) -> list[ProxyMemory]:
    """Trim every running Serve proxy's heap; what each held before and after. A proxy that does not answer
    within `timeout_s` (dead, restarting) is skipped: the next return reaches it."""
    import ray

    proxies = serve_proxies(timeout_s)
    trim = _heap_trimmer()
    calls = {node_id: proxy.__ray_call__.remote(trim) for node_id, proxy in proxies.items()}
    ray.wait(list(calls.values()), num_returns=len(calls), timeout=timeout_s)
    trimmed = []
    for node_id, call in calls.items():
        try:
            before, after = ray.get(call, timeout=0)
        except Exception as error:  # noqa: BLE001 - one proxy gone must not stop the others' return
            logger.info("proxy on node %s was not trimmed: %s", node_id, error)
            continue
        trimmed.append(ProxyMemory(str(node_id), before, after))
    return trimmed


def serve_proxies(timeout_s: float = 10.0) -> dict:
    """Serve's running HTTP proxies, node id -> actor handle, as Serve's controller lists them."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    return ray.get(controller.get_proxies.remote(), timeout=timeout_s)


def _heap_trimmer():
    """The function each proxy runs: its resident bytes before and after giving free heap pages back to the
    system. Defined in here so that Ray ships it by value: by reference, the proxy would import this package
    (and torch with it), 170 MiB more than it gives back."""

    def trim_own_heap(_actor: object) -> tuple[int, int]:
        import ctypes

        import psutil

        process = psutil.Process()
        before = process.memory_info().rss
        malloc_trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
        if malloc_trim is not None:
            malloc_trim(0)
        return before, process.memory_info().rss

    return trim_own_heap
