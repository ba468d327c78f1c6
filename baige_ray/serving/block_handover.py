"""A stopping replica's hottest prefix blocks, handed to a peer so what was hot stays in the pool.

Serve calls a replica's `__del__` once it has drained (a device the arbiter takes back for training, a
scale-down). If peers of its deployment keep running (not when the application is being deleted), the
replica's blocks of its device and host tiers, most recent first up to the device tier's budget, go to
one of them: through the prefix-routing ingress when there is one, whose router picks the peer holding
the fewest and credits the departed replica's prefixes to it, else through the deployment's own handle.
A hand-over that fails or takes too long is logged; the stop goes on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from ray import serve

from baige_ray.serving.engine_runner import EngineRunner
from baige_ray.serving.kv_blocks import PrefixBlockStore

HANDOVER_TIMEOUT_S = 10.0  # well within Serve's graceful shutdown timeout (60 s)

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class BlockHandoverClient:
    app_name: str
    replica: str
    via: str | None  # the prefix-routing ingress's deployment; None: the replicas' own deployment

    async def hand_over(self, store: PrefixBlockStore, runner: EngineRunner, registry: Any) -> None:
        if not self._peers_stay():
            return
        try:
            handover = await runner.between_steps(lambda: store.hottest(store.config.device_bytes))
            if not handover.ids:
                return
            handover = dataclasses.replace(handover, departed=self.replica)
            kept = await asyncio.wait_for(self._target().remote(handover), HANDOVER_TIMEOUT_S)
        except Exception as error:  # a stop must not fail for its hand-over: the blocks are then lost, no more
            logger.warning("replica %s of %s: prefix blocks not handed over: %r", self.replica, self.app_name, error)
            return
        registry.record_event.remote("kv_handover", f"a stopping replica handed {len(handover.ids)} prefix blocks "
                                     f"to a peer, which kept {kept}", replica=self.replica, app=self.app_name,
                                     blocks=len(handover.ids), kept=kept)

    def _peers_stay(self) -> bool:
        """Whether a peer of this deployment keeps running: not when the application is being deleted."""
        application = serve.status().applications.get(self.app_name)
        if application is None or application.status == "DELETING":
            return False
        deployment = application.deployments.get(serve.get_replica_context().deployment)
        return deployment is not None and deployment.replica_states.get("RUNNING", 0) > 0

    def _target(self):
        if self.via is not None:  # through the ingress: its router picks the peer and credits it
            return serve.get_deployment_handle(self.via, app_name=self.app_name).hand_over
        deployment = serve.get_replica_context().deployment
        return serve.get_deployment_handle(deployment, app_name=self.app_name).adopt_blocks
