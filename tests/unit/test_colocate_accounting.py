"""The colocate benchmark's busy device-seconds: a device counts once, whoever keeps it busy."""

from __future__ import annotations

import pytest

from baige_ray.bench.colocate_accounting import PoolSample, infer_device_seconds, train_device_seconds

A0, A1 = ("node-a", 0), ("node-a", 1)


def test_training_counts_whole_and_shared_devices_while_it_runs():
    samples = [PoolSample(at=0.0, training=True, whole=6, shared=frozenset({A0})),
               PoolSample(at=10.0, training=False, whole=6, shared=frozenset({A0})),  # regrouping: idle
               PoolSample(at=12.0, training=True, whole=6),
               PoolSample(at=20.0, training=True, whole=6)]
    assert train_device_seconds(samples, 0.0, 20.0) == pytest.approx(7 * 10 + 0 * 2 + 6 * 8)


def test_replica_compute_counts_only_on_devices_training_does_not_already_keep_busy():
    devices = {"r0": A0, "r1": A1}
    samples = [
        PoolSample(at=0.0, training=True, whole=6, shared=frozenset({A0}), busy_s={"r0": 0.0, "r1": 0.0},
                   replica_devices=devices),
        PoolSample(at=1.0, training=True, whole=6, shared=frozenset({A0}), busy_s={"r0": 0.3, "r1": 0.4},
                   replica_devices=devices),  # r0's 0.3 s overlap the harvest rank beside it
        PoolSample(at=2.0, training=False, whole=6, shared=frozenset({A0}), busy_s={"r0": 0.5, "r1": 0.5},
                   replica_devices=devices),  # training paused from here: replica compute counts
        PoolSample(at=3.0, training=True, whole=6, busy_s={"r0": 0.9, "r1": 0.5, "r2": 0.2},
                   replica_devices={**devices, "r2": ("node-b", 3)}),  # a new replica counts from zero
    ]
    # Each interval is judged by the state at its start: r1 0.4, then r1 0.1 (r0 still shared), then
    # r0 0.4 and r2 0.2 (training paused at 2.0).
    assert infer_device_seconds(samples) == pytest.approx(0.4 + 0.1 + 0.4 + 0.2)


def test_no_samples_no_busy_time():
    assert infer_device_seconds([]) == 0.0
    assert train_device_seconds([], 0.0, 5.0) == 0.0
