"""Which group sizes a job can run at, and its layout at each: whole data-parallel replicas, same global batch."""

from __future__ import annotations

import dataclasses

from baige_ray.engines.layout import ParallelLayout
from baige_ray.runtime.train_loop import TrainJob


def replica_size(layout: ParallelLayout) -> int:
    return layout.tp * layout.pp


def valid_sizes(job: TrainJob, layout: ParallelLayout, min_workers: int, max_workers: int) -> tuple[int, ...]:
    """Sizes in [min, max] made of whole replicas whose data-parallel degree splits the global batch."""
    sizes = []
    unit = replica_size(layout)
    for size in range(unit, max_workers + 1, unit):
        if size < min_workers:
            continue
        try:
            job.train.per_worker_batch(size // unit)
        except ValueError:
            continue
        sizes.append(size)
    return tuple(sizes)


def layout_for(layout: ParallelLayout, num_workers: int) -> ParallelLayout:
    """The same tensor/pipeline shape with as many data-parallel replicas as `num_workers` holds."""
    unit = replica_size(layout)
    if num_workers % unit:
        raise ValueError(f"num_workers={num_workers} is invalid: expected a multiple of tp x pp = {unit}")
    return dataclasses.replace(layout, dp=num_workers // unit)
