"""Membership of a torch.distributed process group that can be left and re-joined in-process.

Every (re)formation of the group is a new *generation*. Rank 0 of a generation
hosts a fresh TCPStore; all keys live under a per-generation prefix, so a late
message from an old generation can never satisfy a rendezvous of a new one.
Leaving destroys the default process group, after which the same process can
join the next generation: no restart, no re-import of torch.
"""

from __future__ import annotations

import datetime
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class StoreAddress:
    host: str
    port: int


@dataclass(frozen=True)
class GroupMembership:
    store: StoreAddress
    rank: int
    world_size: int
    generation: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"GroupMembership.rank={self.rank!r} is invalid: expected 0 <= rank < world_size={self.world_size}"
            )
        if self.generation < 0:
            raise ValueError(f"GroupMembership.generation={self.generation!r} is invalid: expected >= 0")


STORE_CONNECT_TIMEOUT_S = 5.0  # the host's store is listening before any member is asked to join
# Connecting the members (all of them arrived and alive) takes milliseconds; one that dies between arriving
# and connecting leaves the others in gloo's connect, which nothing interrupts, for this long.
GROUP_CONNECT_TIMEOUT_S = 15.0


class ProcessGroupMember:
    """The process-group side of one worker: host a store, join, leave, join again."""

    def __init__(self, backend: str, *, timeout_s: float = 60.0, connect_timeout_s: float = GROUP_CONNECT_TIMEOUT_S):
        self.backend = backend
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.connect_timeout = datetime.timedelta(seconds=min(connect_timeout_s, timeout_s))
        self.membership: GroupMembership | None = None
        self._hosted_store: dist.TCPStore | None = None
        self._hosted_address: StoreAddress | None = None

    def host_store(self, host: str) -> StoreAddress:
        """Start a rendezvous store on a free port of this host; the previous one is dropped."""
        self._hosted_store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=self.timeout)
        self._hosted_address = StoreAddress(host, self._hosted_store.port)
        return self._hosted_address

    def join(self, membership: GroupMembership, abandoned: Callable[[], bool] = lambda: False) -> None:
        """Join `membership`'s generation once every member has arrived; `abandoned()` turning true (the
        controller gave the generation up: a member died before arriving) ends the wait at once."""
        if self.membership is not None:
            self.leave()
        store = self._store_for(membership.store)
        prefixed = dist.PrefixStore(f"baige/generation-{membership.generation}", store)
        await_arrivals(prefixed, membership.world_size, abandoned, self.timeout.total_seconds())
        # The group's timeout bounds gloo's connect as well as its collectives: connect under the short one,
        # then give the collectives theirs (a step's slowest rank may lag the others by seconds).
        dist.init_process_group(
            self.backend,
            store=prefixed,
            rank=membership.rank,
            world_size=membership.world_size,
            timeout=self.connect_timeout,
        )
        dist.distributed_c10d._set_pg_timeout(self.timeout)
        self.membership = membership

    def leave(self) -> None:
        # The groups are held until the caches below let go of them, then destroyed on another thread:
        # gloo's destructor waits for a collective still in flight, which a live peer that left it (an
        # aborted step, a regroup a member died in) holds for the whole timeout.
        groups = list(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else []
        if dist.is_initialized():
            dist.destroy_process_group()
        forget_device_meshes()
        forget_deepspeed_groups()
        threading.Thread(target=groups.clear, name="baige-destroy-process-groups", daemon=True).start()
        self.membership = None

    def _store_for(self, address: StoreAddress) -> dist.Store:
        if address == self._hosted_address and self._hosted_store is not None:
            return self._hosted_store
        # TCPStore retries a refused connection for twice its timeout: a member asked to join a generation
        # whose host died must fail at once (a dead process) or soon (a dead node), not hold the next regroup.
        connect_s = min(STORE_CONNECT_TIMEOUT_S, self.timeout.total_seconds())
        with socket.create_connection((address.host, address.port), timeout=connect_s):
            pass
        store = dist.TCPStore(address.host, address.port, is_master=False,
                              timeout=datetime.timedelta(seconds=connect_s))
        store.set_timeout(self.timeout)
        return store


class RendezvousAbandoned(RuntimeError):
    """The controller gave up the generation this worker was joining: a member will never arrive."""


def await_arrivals(store: dist.Store, world_size: int, abandoned: Callable[[], bool], timeout_s: float) -> None:
    """Count this member in and wait, polling, until all `world_size` have arrived.

    init_process_group waits for missing members inside the store client, where nothing can
    interrupt it for the whole timeout; a survivor stuck there would make the controller's next
    regroup queue behind it. Arriving here first leaves init_process_group only members that
    are alive, and this wait ends as soon as the controller abandons the generation.
    """
    deadline = time.monotonic() + timeout_s
    pause = 0.002
    arrived = store.add("arrived", 1)
    while arrived < world_size:
        if abandoned():
            raise RendezvousAbandoned(f"generation abandoned with {arrived} of {world_size} members arrived")
        if time.monotonic() > deadline:
            raise TimeoutError(f"rendezvous timed out after {timeout_s:.0f}s with {arrived} of {world_size} members")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
        arrived = store.add("arrived", 0)


def forget_device_meshes() -> None:
    """Drop DTensor's caches of device meshes from earlier generations.

    DTensor caches redistribution planners and sharding decisions keyed by device
    mesh, and meshes compare equal by rank layout, not by communicator. A new
    generation with the same layout would otherwise reuse a mesh whose process
    groups were destroyed with the old generation.
    """
    from torch.distributed.tensor import DTensor, _redistribute
    from torch.distributed.tensor._sharding_prop import LocalLRUCache

    _redistribute.clear_redistribute_planner_cache()
    clear_native_cache = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native_cache is not None:  # the C++ dispatch fast path keeps its own copy
        clear_native_cache()
    propagator = DTensor._op_dispatcher.sharding_propagator
    # A fresh object, not cache_clear(): the cache is thread-local and actors run several threads.
    propagator.propagate_op_sharding = LocalLRUCache(propagator.propagate_op_sharding_non_cached)


# deepspeed.utils.groups caches the process groups of the first engine built in a process.
_DEEPSPEED_GROUP_DEFAULTS = {
    "_EXPERT_PARALLEL_GROUP": dict,
    "_EXPERT_PARALLEL_GROUP_RANKS": dict,
    "_EXPERT_DATA_PARALLEL_GROUP": dict,
    "_EXPERT_DATA_PARALLEL_GROUP_RANKS": dict,
    "_ALL_TO_ALL_GROUP": dict,
    "_WORLD_GROUP": lambda: None,
    "_ZERO_PARAM_INTRA_PARALLEL_GROUP": lambda: None,
    "_TENSOR_MODEL_PARALLEL_GROUP": lambda: None,
    "_MODEL_PARALLEL_GROUP": lambda: None,
    "_DATA_PARALLEL_GROUP": lambda: None,
    "mpu": lambda: None,
    "mesh_device": lambda: None,
}


def forget_deepspeed_groups() -> None:
    """Reset DeepSpeed's module-level group cache, which would outlive the generation it was built in."""
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is None:  # DeepSpeed never ran in this process
        return
    for name, default in _DEEPSPEED_GROUP_DEFAULTS.items():
        if hasattr(groups, name):
            setattr(groups, name, default())


class CollectiveAborted(RuntimeError):
    """The controller abandoned this step: a peer is gone, so the collective can never complete."""


# Set by the worker's control thread when the controller reports a lost peer; cleared by the next step.
STEP_ABORT = threading.Event()
_waiting: threading.Event | None = None  # what the training thread sleeps on right now


_pending_hooks: set[torch.futures.Future] = set()  # DDP buckets in flight (abortable_mean_hook)
_hooks_lock = threading.Lock()


def abort_step() -> None:
    """Called on the control thread: make a collective waiting in `all_reduce_abortable` give up, and fail
    the DDP buckets in flight (`abortable_mean_hook`), which releases a backward waiting for them."""
    STEP_ABORT.set()
    waiting = _waiting
    if waiting is not None:
        waiting.set()
    with _hooks_lock:
        pending = list(_pending_hooks)
    for future in pending:
        _settle(future, error=CollectiveAborted("step abandoned: a peer of this collective was lost"))


# No annotations on `bucket` and the return: DDP checks them against its own types, which the postponed
# annotations of this module are not (strings).
def abortable_mean_hook(group: dist.ProcessGroup | None, bucket):
    """DDP's own reduction (each rank's gradients divided by the group size, then summed), as a
    communication hook whose future `abort_step()` can fail. DDP's backward waits for its buckets where
    nothing interrupts it: a survivor whose peer died mid-step sat there for the whole collective timeout
    (3 s for 0.3 s steps). The abandoned all-reduce ends on gloo's thread by that timeout, harming nothing.
    For gloo only: a CUDA future carries stream semantics this plain future does not."""
    tensor = bucket.buffer()
    tensor.div_(dist.get_world_size(group))
    work = dist.all_reduce(tensor, group=group, async_op=True)
    result = torch.futures.Future()
    with _hooks_lock:
        _pending_hooks.add(result)

    def finish(done: torch.futures.Future) -> None:
        with _hooks_lock:
            _pending_hooks.discard(result)
        try:
            done.wait()
        except Exception as error:  # a peer's socket closed: the step fails with gloo's own error
            _settle(result, error=error)
            return
        _settle(result, value=tensor)

    work.get_future().add_done_callback(finish)
    if STEP_ABORT.is_set():
        _settle(result, error=CollectiveAborted("step abandoned: a peer of this collective was lost"))
    return result


def _settle(future: torch.futures.Future, *, value: torch.Tensor | None = None,
            error: BaseException | None = None) -> None:
    """Complete `future` once: the abort and gloo's own completion race, and the first one wins."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)
    except RuntimeError:  # already completed
        pass


def all_reduce_abortable(tensor: torch.Tensor, group: dist.ProcessGroup | None = None,
                         op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
    """`dist.all_reduce`, but a survivor blocked on a dead peer returns as soon as `abort_step()` runs.

    A blocked gloo wait cannot be interrupted, and destroying the group does not
    release peers waiting on this rank, so without this the survivors sit out the
    whole collective timeout. The training thread sleeps on an event that either
    the collective's completion or the abort sets (no polling). An abandoned
    collective finishes (by the timeout) on gloo's own thread, with the old
    generation's group, harming nothing.
    """
    wait_abortable(dist.all_reduce(tensor, op=op, group=group, async_op=True))


def all_gather_abortable(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's `tensor`, stacked in rank order on a new first dimension (as `all_reduce_abortable`)."""
    return PendingGather(tensor, group).result()


class PendingGather:
    """An all-gather started now and running while this thread computes; `result()` waits for it (as
    `all_reduce_abortable` waits) and returns every rank's tensor stacked in rank order."""

    def __init__(self, tensor: torch.Tensor, group: dist.ProcessGroup):
        self._ranks, self._shape = dist.get_world_size(group), tensor.shape
        self._gathered = tensor.new_empty((self._ranks * tensor.shape[0], *tensor.shape[1:]))  # gloo's: on dim 0
        self._sent = tensor.contiguous()  # kept alive, unchanged, until the collective has read it
        self._work = dist.all_gather_into_tensor(self._gathered, self._sent, group=group, async_op=True)

    def result(self) -> torch.Tensor:
        wait_abortable(self._work)
        return self._gathered.view(self._ranks, *self._shape)


def all_to_all_abortable(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`tensor[j]` sent to rank j; returns what each rank i sent this one at index i (as `all_reduce_abortable`)."""
    received = tensor.new_empty(tensor.shape)  # contiguous, as the collective writes it (empty_like keeps strides)
    wait_abortable(dist.all_to_all_single(received, tensor.contiguous(), group=group, async_op=True))
    return received


def wait_abortable(work: dist.Work) -> None:
    """Wait for a collective that `abort_step()` may give up on (see `all_reduce_abortable`)."""
    global _waiting
    finished = threading.Event()
    work.get_future().add_done_callback(lambda _: finished.set())
    _waiting = finished
    try:
        if STEP_ABORT.is_set() and not work.is_completed():
            raise CollectiveAborted("step abandoned: a peer of this collective was lost")
        finished.wait()
        if STEP_ABORT.is_set() and not work.is_completed():
            raise CollectiveAborted("step abandoned: a peer of this collective was lost")
    finally:
        _waiting = None
    work.wait()  # surfaces an error the collective ended with
