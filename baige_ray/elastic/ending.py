"""The end of an elastic run: the final weights gathered and written, every worker stopped and the
run's snapshot shelves removed, exactly once."""

from __future__ import annotations

from pathlib import Path

from baige_ray.elastic import calls
from baige_ray.elastic.crew import Crew
from baige_ray.elastic.job_record import JobRecord
from baige_ray.elastic.state_sources import CALL_TIMEOUT_S
from baige_ray.elastic.workers import Worker, WorkerPool
from baige_ray.engines.train_job import TrainJob
from baige_ray.parallel.state import merge_weights


class RunEnd:
    def __init__(self, crew: Crew, pool: WorkerPool, job: TrainJob, run_name: str, run_dir: Path, record: JobRecord):
        self.crew, self.pool, self.job, self.record = crew, pool, job, record
        self.run_name, self.run_dir = run_name, run_dir
        self.released = False  # workers stopped and shelves removed
        self._shelves_discarded = False

    def final_weights(self, step: int, incoming: list[Worker]) -> dict:
        """Write the members' weights as the run's final directory; (checkpoint_path, final_state)."""
        # Weights only: Adam's moments would triple what every owner gathers, and the final
        # directory keeps weights (snapshots and persisted checkpoints keep the rest).
        # Training is over: the snapshots go before the full weights are gathered, and the workers
        # before those are written and handed on; beside them they would not fit a host sized for
        # training (bench scale).
        self._discard_shelves()
        parts = calls.get([w.actor.export_weights.remote() for w in self.crew.members], timeout=CALL_TIMEOUT_S)
        self.release(incoming)
        weights = merge_weights(parts)
        del parts
        path = self.job.save_final(self.run_dir / "final", weights, step=step)
        return {"checkpoint_path": path, "final_state": self.pool.put({"model": weights, "optimizer": {}})}

    def release(self, incoming: list[Worker]) -> None:
        """Stop every worker of the run (members, spares, `incoming` harvest ranks) and forget its record."""
        if self.released:
            return
        self.released = True
        if not self._shelves_discarded:
            self._discard_shelves()
        self.pool.stop(self.crew.everyone() + [w for w in incoming if w.actor is not None])
        self.crew.take_spares(self.crew.spares)
        self.record.delete()

    def _discard_shelves(self) -> None:
        # Only members hold snapshots; a spare may still be starting, and asking it would wait for that.
        self.pool.discard_shelves(self.crew.members, self.run_name)
        self._shelves_discarded = True
