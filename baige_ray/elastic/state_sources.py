"""Where a recovering job's state comes from: live snapshots, replicas on other nodes, checkpoints.

`StateSources` is the elastic controller's collaborator for keeping state safe and finding it again:
every step it may ask two workers on other nodes to copy the newest snapshot (replicas.py) and a
background thread to persist one; after a failure it picks the newest complete state among the
survivors' snapshots, the replicas and the persisted checkpoints.
"""

from __future__ import annotations

import shutil
import threading
import time
from typing import Any, Callable

import ray

from baige_ray.api.elastic import ElasticConfig
from baige_ray.checkpoint.persister import AsyncPersister
from baige_ray.checkpoint.store import begin_checkpoint, commit_checkpoint, load_latest_good
from baige_ray.elastic import calls
from baige_ray.elastic.replica_copies import ReplicaCopies
from baige_ray.elastic.shelf import ShelfRef
from baige_ray.elastic.shelf_readers import ShelfReaders
from baige_ray.elastic.workers import Worker
from baige_ray.ops.events import EventLog
from baige_ray.parallel.layout import ParallelLayout
from baige_ray.parallel.shards import assemble
from baige_ray.planner.replicas import exposed_stages, replica_floor, replica_holders

CALL_TIMEOUT_S = 120.0
PERSIST_TIMEOUT_S = 1800.0  # every rank writing its pieces of a checkpoint


class StateSources:
    """The job's replicas and persisted checkpoints, and the choice of the newest state to resume from."""

    def __init__(self, elastic: ElasticConfig, run_name: str, events: EventLog,
                 shelf_readers: ShelfReaders | None = None):
        self.elastic = elastic
        self.shelf_readers = shelf_readers or ShelfReaders()
        self.run_name = run_name
        self.events = events
        self.replica_copies = ReplicaCopies()
        self._persister: AsyncPersister | None = None
        self._sharded_writer: threading.Thread | None = None  # commits the sharded checkpoint being written
        self._sharded_step: int | None = None
        self._committed_sharded_step: int | None = None
        self._staged: dict = {}  # step -> the staging directory its ranks write into
        self._replica_behind = False  # the last wait for replicas gave up

    @property
    def last_persisted_step(self) -> int | None:
        """The step of the newest checkpoint committed to persist_path by this controller, if any."""
        steps = [step for step in (self._committed_sharded_step,
                                   self._persister.last_persisted_step if self._persister else None) if step is not None]
        return max(steps, default=None)

    def report(self) -> dict:
        """The job status's part about state kept elsewhere: the newest persisted step, and how long
        training stalled for slow replica copies."""
        return {"persisted_step": self.last_persisted_step,
                "replica_wait_s": round(self.replica_copies.waited_s, 3)}

    def newest_snapshot(self, holders: list[tuple[int, Worker]], layout: ParallelLayout,
                        replicas: list[Worker] = (), members: list[tuple[int, Worker]] | None = None,
                        spares: list[Worker] = (), leaving: list[tuple[int, Worker]] = ()):
        """(step, refs to the parts to assemble) of the newest snapshot every stage still has: live in the
        holders or in `leaving` (ranks that still answer but are stopped before the restore), or in a
        replica (all stages at one step) held on another node. Sharded layouts: on the shelves of every
        rank in `members`, dead or alive, read by a holder or spare on its node, or by a reader started
        there (shelf_readers.py).

        Falls back to the newest good persisted checkpoint; (None, None) when there is neither.
        The parts stay in the object store: workers fetch them from each other.
        """
        if layout.snapshots_are_sharded:
            readers = [w for _, w in holders] + list(spares)
            live = newest_on_shelves(members or list(holders) + list(leaving), readers, self.shelf_readers.on_node)
        else:
            live = newest_live(list(holders) + list(leaving), layout)
        replica_steps = answers_or_none([w.actor.replica_step.remote() for w in replicas])
        replica = max(((step, w) for step, w in zip(replica_steps, replicas) if step is not None),
                      key=lambda pair: pair[0], default=None)
        if replica is not None and (live is None or replica[0] > live[0]):
            self.events.record("checkpoint", f"restored the replica of step {replica[0]}", step=replica[0])
            return replica[0], [replica[1].actor.replica_state.remote()]
        if live is None:
            return self.persisted_state()
        return live

    def release_shelves(self, parts: list | None, kept: list[Worker], timeout_s: float = 10.0) -> None:
        """Once restored, remove the shelves that workers no longer in `kept` (dead ones) left behind,
        and stop the readers started for them."""
        names = {worker.name for worker in kept}
        refs = [part.reader.discard_shelf_of.remote(part.worker_name) for part in parts or []
                if isinstance(part, ShelfRef) and part.worker_name not in names]
        if refs:
            calls.wait(refs, num_returns=len(refs), timeout=timeout_s)
        self.shelf_readers.stop()

    def readable_replicas(self, members: list[Worker], lost: dict[int, str], readable: set[int]) -> list[Worker]:
        """Replica holders still reachable: none of the lost members, unless they still answer."""
        gone = {members[rank].name for rank in lost if rank not in readable}
        return [w for w in self.replica_copies.holders if w.name not in gone and w.actor is not None]

    def replicate_if_due(self, step: int, members: list[Worker], layout: ParallelLayout,
                         idle_spares: list[Worker]) -> None:
        """After `step`, ask two workers on different nodes to copy every stage's newest snapshot, where a
        node's loss would otherwise lose a stage (replicas.py). A holder still copying is left to finish."""
        every = self.elastic.replicate_every
        if not every or (step + 1) % every:
            return
        nodes = [w.info.node_id for w in members]
        stages = [layout.coords(rank).pp for rank in range(len(members))]
        if not exposed_stages(stages, nodes, sharded=layout.snapshots_are_sharded):
            self.replica_copies.clear()
            return
        candidates = idle_spares + members  # idle spares first
        holders = [candidates[i] for i in replica_holders([w.info.node_id for w in candidates])]
        self.replica_copies.start(holders, replica_sources(members, stages, layout.snapshots_are_sharded,
                                                          turn=step // every))

    def await_replicas(self, next_step: int, generation_start: int, wait_s: float,
                       in_flight: list | None = None) -> None:
        """Before `next_step` is dispatched, let replicas that trail by more than a copy catch up.

        `generation_start` is the first step of the current process-group generation. While this waits,
        a failure of the step `in_flight` ends the wait at once (its recovery is due); a hang is not
        watched here: the caller caps `wait_s` at the heartbeat timeout, so it is seen no later than
        heartbeats alone would see it. A copy later than that is let be."""
        if not self.elastic.replicate_every or not self.replica_copies.holders:
            return
        floor = replica_floor(next_step, generation_start, self.elastic.snapshot_every, self.elastic.replicate_every)
        behind = floor is not None and not self.replica_copies.wait_for(floor, wait_s, in_flight)
        if behind and not self._replica_behind:  # once, not every step until it catches up
            self.events.record("checkpoint", f"a replica is behind step {floor}: a lost node may redo more steps",
                               step=next_step)
        self._replica_behind = behind

    @staticmethod
    def newest_weights(holders: list[tuple[int, Worker]], layout: ParallelLayout) -> tuple[int, dict]:
        """(step, the model's canonical weights) from the newest in-memory snapshot of `holders`."""
        for _ in range(10):  # stages can be a step apart for a moment while training runs
            step, state = StateSources.gather_state(holders, layout, weights_only=True)
            if state is not None:
                return step, state["model"]
            time.sleep(0.05)
        raise RuntimeError("no snapshot yet: training has not completed a step")

    @staticmethod
    def gather_state(holders: list[tuple[int, Worker]], layout: ParallelLayout, *, weights_only: bool = False):
        """(step, canonical state) assembled from one snapshot per pipeline stage (every rank's shards when
        sharded), fetched here while training may go on: each part comes with its own step, and parts of
        different steps are not merged. `weights_only`: without the optimizer state (for serving)."""
        sharded = layout.snapshots_are_sharded
        sources: dict[int, Worker] = {}
        for rank, worker in holders:
            sources.setdefault(rank if sharded else layout.coords(rank).pp, worker)
        method = "weights_snapshot_with_step" if weights_only else "snapshot_with_step"
        parts = answers_or_none([getattr(w.actor, method).remote() for w in sources.values()])
        steps = {part[0] for part in parts if part is not None}
        if None in parts or len(steps) != 1 or len(sources) != (layout.world_size if sharded else layout.pp):
            return None, None  # a stage missing or mid-step: the next attempt will do
        return steps.pop(), assemble([part[1] for part in parts])

    def persisted_state(self):
        if self.elastic.persist_path is None:
            return None, None
        found = load_latest_good(self.elastic.persist_path, on_skip=lambda step, path, error: self.events.record(
            "checkpoint", f"skipped persisted step {step}: {error}", step=step, skipped=str(path)))
        if found is None:
            return None, None
        step, state, _ = found
        self.events.record("checkpoint", f"restored persisted step {step}", step=step)
        return step, [ray.put(state)]

    def persist_if_due(self, step: int, members: list[Worker], layout: ParallelLayout) -> None:
        """After `step`, hand the newest snapshot to the persister on a thread of its own, when due."""
        every = self.elastic.persist_every
        if not every or (step + 1) % every:
            return
        meta = {"layout": layout.describe(), "run": self.run_name}
        if layout.snapshots_are_sharded:
            self._commit_sharded(step, members, meta)
            return
        if self._persister is None:
            self._persister = AsyncPersister(self.elastic.persist_path, keep_last=self.elastic.keep_checkpoints,
                                             on_written=self._record_written)
        persister, holders = self._persister, list(enumerate(members))

        def gather_and_submit() -> None:  # off the training loop: fetching the snapshot takes a while
            gathered_step, state = self.gather_state(holders, layout)
            if state is not None:
                persister.submit(gathered_step, state, meta)

        threading.Thread(target=gather_and_submit, daemon=True).start()

    def persist_target(self, step: int, layout: ParallelLayout) -> str | None:
        """Where the ranks of a sharded layout write their pieces of step `step`'s snapshot, when a
        checkpoint is due after it (None otherwise). Asked when the step is dispatched: each rank then
        writes right after its snapshot copy, before the next copy may overwrite it (checkpoint/sharded.py)."""
        every = self.elastic.persist_every
        if not layout.snapshots_are_sharded or not every or (step + 1) % every:
            return None
        if self._sharded_writer is not None and self._sharded_writer.is_alive():
            self.events.record("checkpoint", f"skipped persisting step {step}: step "
                               f"{self._sharded_step} is still being written", step=step)
            return None
        self._staged[step] = begin_checkpoint(self.elastic.persist_path, step)
        return str(self._staged[step])

    def _record_written(self, step: int, error: BaseException | None, seconds: float) -> None:
        """What the persister did, as the job's event (a full disk, a dead mount: the job trains on)."""
        if error is not None:
            self.events.record("checkpoint", f"persisting step {step} failed: {error}", step=step)
        else:
            self.events.record("checkpoint", f"persisted step {step} in {seconds:.1f} s", step=step,
                               seconds=round(seconds, 3))

    def _commit_sharded(self, step: int, members: list[Worker], meta: dict) -> None:
        """A thread waits for every rank's files of step `step` and commits the checkpoint; a lost worker
        or a full disk leaves it uncommitted (pruned later) and the next one is tried as usual."""
        staging = self._staged.pop(step, None)
        if staging is None:  # not due, or skipped while the last was still being written
            return
        root, ranks = self.elastic.persist_path, list(members)

        def commit() -> None:
            try:
                written = calls.get([w.actor.persisted.remote(step) for w in ranks], timeout=PERSIST_TIMEOUT_S)
                files = {name: record for records, _ in written for name, record in records.items()}
                commit_checkpoint(root, staging, step, files, meta=meta, keep_last=self.elastic.keep_checkpoints,
                                  ranks=len(ranks))
            except Exception as error:
                shutil.rmtree(staging, ignore_errors=True)
                self.events.record("checkpoint", f"persisting step {step} failed: {error}", step=step)
                return
            self._committed_sharded_step = step
            nbytes = sum(record["bytes"] for record in files.values())
            seconds = max(took for _, took in written)
            self.events.record("checkpoint", f"persisted step {step}: {nbytes / 1e9:.2f} GB by {len(ranks)} ranks "
                               f"in {seconds:.1f} s", step=step, bytes=nbytes, seconds=round(seconds, 3))

        self._sharded_step = step
        self._sharded_writer = threading.Thread(target=commit, name=f"persist-{step}", daemon=True)
        self._sharded_writer.start()

    def close(self, timeout_s: float = 60.0) -> None:
        """Let checkpoints being written finish."""
        self.shelf_readers.stop()
        if self._persister is not None:
            self._persister.close(timeout=timeout_s)
        if self._sharded_writer is not None:
            self._sharded_writer.join(timeout=timeout_s)


def newest_live(holders: list[tuple[int, Worker]], layout: ParallelLayout):
    """(step, refs to one whole part per stage) of the newest snapshot every stage has in a holder; None."""
    steps = answers_or_none([w.actor.snapshot_step.remote() for _, w in holders])  # None: no snapshot, or dead
    by_step: dict[int, dict[int, Worker]] = {}
    for (rank, worker), step in zip(holders, steps):
        if step is not None:
            by_step.setdefault(step, {}).setdefault(layout.coords(rank).pp, worker)
    complete = [step for step, stages in by_step.items() if len(stages) == layout.pp]
    if not complete:
        return None
    newest = max(complete)
    return newest, [w.actor.snapshot_state.remote() for w in by_step[newest].values()]


def newest_on_shelves(members: list[tuple[int, Worker]], readers: list[Worker],
                      reader_on: Callable[[str], Any | None] = lambda node_id: None):
    """(step, refs to every rank's part) of the newest sharded snapshot that every rank's shelf holds;
    None when one has none whole or its node is gone.

    A shelf is read by a worker of its node that stays through the restore (`readers`: members that
    live on, spares), or else by the reader `reader_on(node_id)` gives (None: the node is gone). A
    worker being stopped does not read: the restore reads the shelves after it is gone."""
    if not members:
        return None
    on_node: dict[str, Any] = {}
    for worker in readers:
        on_node.setdefault(worker.info.node_id, worker.actor)
    staying = {worker.name for worker in readers}
    askers = []
    for _, worker in members:
        if worker.name in staying:
            askers.append(worker.actor)
        elif worker.info is None:  # never came up: it left no shelf
            askers.append(None)
        else:
            node_id = worker.info.node_id
            if node_id not in on_node:
                on_node[node_id] = reader_on(node_id)
            askers.append(on_node[node_id])
    if None in askers:
        return None
    steps = answers_or_none([asker.shelf_steps_of.remote(worker.name)
                             for asker, (_, worker) in zip(askers, members)])
    if None in steps:
        return None
    common = set.intersection(*(set(found) for found in steps))
    if not common:
        return None
    step = max(common)
    return step, [ShelfRef(worker.name, worker.info.node_id, step, asker)
                  for asker, (_, worker) in zip(askers, members)]


def settle_parts(parts: list | None, timeout_s: float = CALL_TIMEOUT_S) -> None:
    """Wait until the gathered parts exist in the object store, so their holders may then be stopped."""
    refs = [part for part in parts or [] if calls.is_answer(part)]
    if refs:
        calls.wait(refs, num_returns=len(refs), timeout=timeout_s, fetch_local=False)


def answers_or_none(refs: list[ray.ObjectRef], timeout_s: float = CALL_TIMEOUT_S) -> list:
    """Each call's result, or None where the actor died or did not answer in time."""
    calls.wait(refs, num_returns=len(refs), timeout=timeout_s)
    answers = []
    for ref in refs:
        try:
            answers.append(calls.get(ref, timeout=0))
        except Exception:  # dead, or still silent: not a holder we can use
            answers.append(None)
    return answers


def replica_sources(members: list[Worker], stages: list[int], sharded: bool, turn: int) -> dict[int, Any]:
    """The actor each replica copy reads from: every rank's shards when snapshots are sharded, else one
    rank per stage, taking turns among the stage's ranks (serving a copy slows the server's step: always
    the same rank would make it look like a straggler)."""
    if sharded:
        return {rank: worker.actor for rank, worker in enumerate(members)}
    ranks_of_stage: dict[int, list[int]] = {}
    for rank, stage in enumerate(stages):
        ranks_of_stage.setdefault(stage, []).append(rank)
    return {stage: members[ranks[turn % len(ranks)]].actor for stage, ranks in ranks_of_stage.items()}
