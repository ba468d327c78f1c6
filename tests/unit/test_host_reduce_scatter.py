"""host_reduce_scatter.HostReduceScatter: FSDP2's gradient reduce-scatter on CPU workers, in two gloo processes."""

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers import rank_context


def _rank(rank: int, path: str, results) -> None:
    from baige_ray.engines.host_reduce_scatter import HostReduceScatter

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    comm = HostReduceScatter()
    first = comm.allocate((4,), dtype=torch.float32, device=torch.device("cpu"))
    first.copy_(torch.arange(4.0) + 10 * rank)  # rank 0: 0 1 2 3, rank 1: 10 11 12 13
    output = torch.empty(2)
    comm(output, first, dist.group.WORLD, dist.ReduceOp.AVG)
    again = comm.allocate((4,), dtype=torch.float32, device=torch.device("cpu"))
    fresh = comm.allocate((4,), dtype=torch.float32, device=torch.device("cpu"))
    results[rank] = (output.tolist(), again is first, fresh is first)
    dist.destroy_process_group()


def test_each_rank_gets_the_mean_of_its_shard_and_an_input_buffer_is_reused_once_reduced(tmp_path):
    results = mp.Manager().dict()
    rank_context()
    mp.start_processes(_rank, args=(str(tmp_path / "store"), results), nprocs=2, start_method="forkserver")
    assert results[0][0] == [5.0, 6.0] and results[1][0] == [7.0, 8.0]  # (0+10)/2, (1+11)/2 | (2+12)/2, (3+13)/2
    assert results[0][1:] == (True, False)  # the reduced input comes back once; a second request is new memory
