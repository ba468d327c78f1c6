"""The topology actor: a LiveTopology (topology/live.py) kept current by polling Ray's node table.

Membership is polled, not subscribed: Ray exposes no public, stable
node-membership subscription (GCS pubsub is internal and changes between
releases), while `ray.nodes()` is a single GCS call. Polling every second costs
nothing measurable and bounds staleness to about a second, the same budget the
elastic controller has for detection; the controller also sees actor deaths
directly, so it never waits on this poll to react.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from baige_ray.topology.descriptor import ClusterDescriptor
from baige_ray.topology.live import LiveTopology

logger = logging.getLogger(__name__)


class TopologyActor(LiveTopology):
    """A LiveTopology that refreshes itself on a thread of its own: what runs as the Ray actor."""

    def __init__(self, *, poll_interval_s: float = 1.0, start_polling: bool = True, **discovery: Any):
        super().__init__(**discovery)
        self._stop = threading.Event()
        self._thread = None
        if start_polling:
            self._thread = threading.Thread(target=self._poll, args=(poll_interval_s,), daemon=True,
                                            name="topology-poll")
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _poll(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.refresh()
            except Exception:  # keep serving the last good graph; the next poll retries
                logger.exception("topology refresh failed")


def start_topology_actor(*, descriptor: ClusterDescriptor | None = None, name: str | None = None, **kwargs: Any):
    """Start TopologyActor as a Ray actor (no CPU reserved, it mostly sleeps) and return its handle."""
    import ray

    options: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 4}
    if name:
        options.update(name=name, get_if_exists=True)
    return ray.remote(TopologyActor).options(**options).remote(descriptor=descriptor, **kwargs)
