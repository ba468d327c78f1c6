"""Where copies of the newest snapshot must live so that losing any one node loses no state.

Every worker keeps its own stage's newest snapshot in host memory. A stage whose holders
sit on two or more nodes (data-parallel peers across nodes) survives any single node's loss
as it is. A stage whose every holder shares one node (tensor- or pipeline-parallel groups
inside a node, a single-node job) does not: for those layouts two workers on two different
nodes, spares first since they are idle, each keep a full replica (every stage, one step).
Losing any node leaves at least one of them.
"""

from __future__ import annotations

from collections.abc import Sequence

from baige_ray.planner.fits import HostCopies

SNAPSHOT_BUFFERS = 2  # HostSnapshotter keeps the newest snapshot and the one before it (ElasticConfig.snapshot_slots)
REPLICA_BUFFERS = 2  # a holder keeps its replica until the next copy is whole (ElasticWorkerActor.copy_replica)


def exposed_stages(stage_of_rank: Sequence[int], node_of_rank: Sequence[str], sharded: bool = False) -> list[int]:
    """Stages whose every holder sits on one node: that node's loss takes their live snapshot with it.
    Sharded snapshots hold each shard once, so a stage spread over several nodes is exposed too."""
    if sharded:
        return sorted(set(stage_of_rank))
    nodes_of_stage: dict[int, set[str]] = {}
    for stage, node in zip(stage_of_rank, node_of_rank):
        nodes_of_stage.setdefault(stage, set()).add(node)
    return sorted(stage for stage, nodes in nodes_of_stage.items() if len(nodes) == 1)


def replica_holders(candidate_nodes: Sequence[str], copies: int = 2) -> list[int]:
    """Indices of `copies` candidates on distinct nodes, earliest first (callers list spares first);
    fewer when the candidates span fewer nodes, none when they all share one (no copy would help)."""
    chosen: list[int] = []
    seen: set[str] = set()
    for index, node in enumerate(candidate_nodes):
        if node not in seen:
            chosen.append(index)
            seen.add(node)
        if len(chosen) == copies:
            break
    return chosen if len(chosen) > 1 else []


def stages_behind(step_of_stage: dict[int, int]) -> list[int]:
    """Stages whose snapshot is older than the newest among them: a replica mixes no steps, so these
    are read again (they catch up within a step) before the parts are merged."""
    newest = max(step_of_stage.values(), default=None)
    return sorted(stage for stage, step in step_of_stage.items() if step < newest)


def replica_floor(next_step: int, generation_start: int, snapshot_every: int = 1,
                  replicate_every: int = 1) -> int | None:
    """The oldest replica step allowed when `next_step` is dispatched: the snapshot whose copy began at
    least a full step ago. Steps run one ahead, so a node lost in any step in flight then redoes at most
    `replicate_every + snapshot_every + 1` steps (3 with both at 1). None: no bound yet (this process-group
    generation has taken no such snapshot)."""
    copied_after = next_step - 3  # completed when step next_step - 2 began: one full step ago
    copied_after -= (copied_after + 1) % replicate_every  # the newest step a copy began after
    floor = copied_after - copied_after % snapshot_every  # the newest snapshot it could read
    return floor if floor >= generation_start else None


def host_copies(stage_of_rank: Sequence[int], node_of_worker: Sequence[str], *, num_spares: int,
                replicate: bool, sharded: bool = False, snapshot_slots: int = SNAPSHOT_BUFFERS) -> HostCopies:
    """What an elastic job keeps in host memory beside training, its workers placed as `node_of_worker`
    says: members by rank, then `num_spares` spares. Replicas go where `replicate_if_due` puts them
    (state_sources.py): to two workers on distinct nodes, idle spares first, when some stage is exposed."""
    world = len(stage_of_rank)
    holders: tuple[int, ...] = ()
    if replicate and exposed_stages(stage_of_rank, node_of_worker[:world], sharded=sharded):
        candidates = [*range(world, world + num_spares), *range(world)]
        holders = tuple(candidates[i] for i in replica_holders([node_of_worker[c] for c in candidates]))
    return HostCopies(snapshot_copies=snapshot_slots, replica_workers=holders,
                      replica_copies=REPLICA_BUFFERS if holders else 0, num_spares=num_spares)
