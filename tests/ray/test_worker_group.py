import pytest

from baige_ray.api.configs import ScalingConfig
from baige_ray.jobs.worker_group import WorkerGroup
from baige_ray.runtime.resources import choose_device_resource


@pytest.fixture(scope="module")
def group(local_ray):
    workers = WorkerGroup(ScalingConfig(num_workers=4), timeout_s=60)
    yield workers
    workers.shutdown()


def test_one_worker_per_simulated_gpu(group):
    infos = group.device_infos
    assert sorted(info.device_index for info in infos) == [0, 1, 2, 3]
    assert {info.ray_resource for info in infos} == {"GPU"}
    assert all(info.simulated and info.device_kind == "cpu" for info in infos)
    assert len({info.pid for info in infos}) == 4


def test_rejoin_new_generation_in_same_process(group):
    assert group.form_process_group() == 0
    assert group.call("all_reduce", [1.0]) == [[4.0]] * 4
    pids_before = group.call("ping")
    group.call("leave_group")
    assert group.form_process_group() == 1
    # ranks differ per worker, so the sum proves every member contributed in the new generation
    sums = group.call_each("all_reduce", [[float(rank)] for rank in range(4)])
    assert sums == [[6.0]] * 4
    assert group.call("ping") == pids_before


def test_rejoin_without_explicit_leave(group):
    generation = group.form_process_group()
    assert group.form_process_group() == generation + 1
    assert group.call("all_reduce", [2.0]) == [[8.0]] * 4


def test_cpu_workers_when_gpus_are_short():
    assert choose_device_resource(ScalingConfig(num_workers=8), {"GPU": 4.0, "CPU": 8.0}) == "CPU"
    assert choose_device_resource(ScalingConfig(num_workers=4), {"GPU": 4.0}) == "GPU"
    with pytest.raises(Exception, match="needs 8 GPUs; the cluster has 4"):
        choose_device_resource(ScalingConfig(num_workers=8, accelerator="gpu"), {"GPU": 4.0})
