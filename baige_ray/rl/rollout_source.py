"""Training workers read a policy trainer's rollouts from its board (actors/rollout_board.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import ray
import torch

from baige_ray.elastic.workers import NAMESPACE
from baige_ray.models.plugin import ProvidedSamples
from baige_ray.topology.head import on_head_node

BOARD_PREFIX = "baige-rollouts:"


@dataclasses.dataclass(frozen=True)
class RolloutSource(ProvidedSamples):
    """The samples of run `run_name`'s rollout board: small and picklable, it names the board."""

    run_name: str

    @property
    def fingerprint(self) -> str:
        return f"rollouts:{self.run_name}"

    @property
    def board_name(self) -> str:
        return BOARD_PREFIX + self.run_name

    def batch(self, indices: Sequence[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        board = ray.get_actor(self.board_name, namespace=NAMESPACE)
        return ray.get(board.batch.remote(list(indices)))


def start_board(run_name: str, batch_size: int, keep: int = 2) -> ray.actor.ActorHandle:
    """The run's board (a few iterations of token ids): owned by the driver that publishes to it, so
    it ends with that driver."""
    from baige_ray.actors.rollout_board import RolloutBoard

    return ray.remote(RolloutBoard).options(name=BOARD_PREFIX + run_name, namespace=NAMESPACE, num_cpus=0,
                                            scheduling_strategy=on_head_node()).remote(batch_size, keep)
