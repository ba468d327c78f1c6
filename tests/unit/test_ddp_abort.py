"""DDP on gloo through abortable_mean_hook (parallel/distributed.py): the same gradients as DDP's own
reduction, bit for bit, and a backward waiting on a peer that never comes is released by abort_step()
at once instead of at the collective timeout. Two processes, gloo on 127.0.0.1."""

from __future__ import annotations

import os
import threading
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from tests.helpers import free_port, rank_context


def _rank(rank: int, port: int, mode: str, out) -> None:
    from baige_ray.parallel.distributed import abort_step, abortable_mean_hook

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    ddp = DistributedDataParallel(model)
    if mode != "ddp's own":
        ddp.register_comm_hook(None, abortable_mean_hook)
    batch = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    if mode == "peer lost":
        if rank == 1:  # never reaches the backward: the peer that died
            time.sleep(5)
            return
        threading.Timer(0.3, abort_step).start()  # the controller's abort, on the control thread
        began = time.monotonic()
        try:
            ddp(batch).sum().backward()
            out.put(("no error", time.monotonic() - began))
        except RuntimeError as error:
            out.put((str(error), time.monotonic() - began))
    else:
        ddp(batch).sum().backward()
        out.put((rank, [p.grad.flatten().tolist() for p in model.parameters()]))
    time.sleep(0.5)  # the queue's feeder thread sends before the process ends
    os._exit(0)


def _run(mode: str, answers: int) -> list:
    context = rank_context()
    out, port = context.Queue(), free_port()
    ranks = [context.Process(target=_rank, args=(rank, port, mode, out)) for rank in range(2)]
    for process in ranks:
        process.start()
    try:
        return [out.get(timeout=60) for _ in range(answers)]
    finally:
        for process in ranks:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()


def test_the_hook_reduces_exactly_as_ddp_does():
    assert dict(_run("ddp's own", 2)) == dict(_run("hook", 2))


def test_a_backward_waiting_for_a_lost_peer_is_released_by_the_abort():
    ((message, seconds),) = _run("peer lost", 1)
    assert "a peer of this collective was lost" in message and seconds < 2.0
