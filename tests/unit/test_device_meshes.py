from pathlib import Path

import torch
import torch.distributed as dist

from tests.helpers import spawn_ranks


def _gloo_transport_threads() -> int:
    return sum(1 for task in Path("/proc/self/task").iterdir()
               if (task / "comm").read_text().strip() == "gloo_tcp_loop")


def _slice_meshes(rank: int, port: int, results) -> None:
    import os

    from baige_ray.engines.parallelize import sliced_meshes

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    dense = sliced_meshes("cpu", {"pp": 1, "dp": 2, "tp": 1})
    experts = sliced_meshes("cpu", {"pp": 1, "edp": 1, "ep": 2, "tp": 1})
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total, group=dense["dp"].get_group())
    results[rank] = {
        "dense": sorted(dense),
        "dense_is_world": dense["dp"].get_group() == dist.group.WORLD,
        "experts": sorted(experts),
        "dp_is_ep": experts["dp"] is experts["ep"],
        "replicas_are_dp": dense["replicas"] is dense["dp"] and experts["replicas"] is experts["dp"],
        "sum": total.item(),
        "gloo_threads": _gloo_transport_threads(),
    }
    dist.destroy_process_group()


def test_dimensions_of_one_rank_get_no_process_group():
    results = spawn_ranks(_slice_meshes, 2)
    for rank in (0, 1):
        assert results[rank]["dense"] == ["dp", "replicas"]  # without cp, the replicas are the dp ranks
        assert results[rank]["replicas_are_dp"]
        assert results[rank]["dense_is_world"]  # a dimension spanning every rank reuses the default group
        assert results[rank]["experts"] == ["dp", "ep", "replicas"]
        assert results[rank]["dp_is_ep"]
        assert results[rank]["sum"] == 3.0
        # Only the default group's transport: a group of one rank would add a thread waking every 10 ms.
        assert results[rank]["gloo_threads"] == 1
