"""Flash snapshots: the engine's state copied to host memory after every step without stalling the next.

The copy runs on a background thread while the next step's forward and backward
read (but do not write) the weights. Only the optimizer update writes them, so the
engine runs `fence()` just before it: the stall is the part of the copy that did
not fit under forward and backward, usually none. Under FSDP2 and ZeRO-3 each rank
copies only its own shards (parallel/shards.py) into its shelf in node shared memory
(shelf.py), where they outlive the worker. Engines whose snapshot needs a collective
(tensor- or expert-parallel DTensors gathered whole) take it on the training thread in
step order, synchronously, and it counts as stall. So does a state of at most `INLINE_COPY_BYTES`:
copying it takes less than the interpreter's switches between the two threads cost the training
thread (a 0.1M-parameter policy's RL step, 2 workers on 2 cores: 30.8 ms with the thread, 29.3 inline).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from baige_ray.elastic.shelf import SnapshotShelf
from baige_ray.engines.base import Engine
from baige_ray.parallel.packed_tensors import pack_tensors
from baige_ray.parallel.shards import ShardedPart
from baige_ray.parallel.state import CanonicalState

INLINE_COPY_BYTES = 4 << 20  # well under a millisecond to copy on a host


class HostSnapshotter:
    def __init__(self, engine: Engine, *, latest: tuple[int, CanonicalState | ShardedPart] | None = None,
                 shelf: SnapshotShelf | None = None):
        """`latest` carries the newest snapshot over from the engine of an earlier generation; `shelf`
        keeps sharded snapshots (those of engines whose `snapshot_is_sharded`) outside this process."""
        self.engine: Engine | None = engine
        self.shelf = shelf if engine.snapshot_is_sharded else None
        self.last_stall_s = 0.0
        self._latest = latest
        self._latest_bytes = _state_bytes(latest[1]) if latest is not None else None
        # Double buffering: the next copy overwrites the snapshot before the latest, which no one
        # reads any more (readers get copies: `latest_copy`), so steady state allocates nothing.
        self._spare: CanonicalState | None = None
        # Held while a copy writes into the spare buffers and while a reader clones the latest:
        # after a publish the old latest becomes the spare, so the two must never overlap.
        self._buffers = threading.Lock()
        self._copying: threading.Thread | None = None
        self._failure: BaseException | None = None
        engine.before_update_hooks.append(self._fence_for_update)

    def after_step(self, step: int, then: Callable | None = None) -> None:
        """Start snapshotting the state as it is after `step` (waits for a previous copy first); `then`
        is called with the snapshot once taken, before any later copy may overwrite it (a checkpoint
        written from it: the next copy, and the update after it, wait for it)."""
        self.fence()
        source = self.engine.snapshot_source()  # looked up here, on the training thread
        if not self.engine.snapshot_is_local or self._small():
            started = time.perf_counter()
            self._take(step, source, then)
            self.last_stall_s = time.perf_counter() - started
            return
        self._copying = threading.Thread(target=self._copy, args=(step, source, then), name=f"snapshot-{step}",
                                         daemon=True)
        self._copying.start()

    def _small(self) -> bool:
        """The last snapshot was small enough to copy on the training thread (the first goes to a thread)."""
        return self._latest_bytes is not None and self._latest_bytes <= INLINE_COPY_BYTES

    def _copy(self, step: int, source, then: Callable | None) -> None:
        try:
            self._take(step, source, then)
        except BaseException as error:  # surfaced by fence() on the training thread
            self._failure = error

    def _take(self, step: int, source, then: Callable | None = None) -> None:
        with self._buffers:
            taken = None
            try:
                if self.shelf is None:
                    self._publish(step, source(self._spare))
                else:
                    into = self.shelf.begin(source.layout())
                    self._latest = (step, self.shelf.commit(step, source(into)))
                taken = self._latest[1]
                self._latest_bytes = _state_bytes(taken)
            finally:
                if then is not None:
                    then(taken)  # None: the copy failed

    def _publish(self, step: int, state: CanonicalState) -> None:
        previous = self._latest
        self._latest = (step, state)
        reusable = previous is not None and previous[1] is not state and not isinstance(previous[1], ShardedPart)
        self._spare = previous[1] if reusable else None  # a shelf's part stays on the shelf

    def fence(self) -> float:
        """Wait for an in-flight copy; returns the seconds waited."""
        started = time.perf_counter()
        if self._copying is not None:
            self._copying.join()
            self._copying = None
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise RuntimeError("snapshot copy failed") from failure
        return time.perf_counter() - started

    def _fence_for_update(self) -> None:
        self.last_stall_s = self.fence()

    def _await_copy(self) -> None:
        """Readers (any thread) wait for an in-flight copy without taking it over: only the training
        thread's `fence()` may forget it, or its fence before the next update would not wait for it."""
        copying = self._copying
        if copying is not None:
            copying.join()

    def latest(self) -> tuple[int, CanonicalState] | None:
        """The newest complete snapshot as (step it was taken after, state): valid until the next two steps."""
        self._await_copy()
        return self._latest

    def latest_copy(self) -> tuple[int, CanonicalState] | None:
        """The newest snapshot, copied: safe to hand to another thread or process while training goes on."""
        return self._latest_copied(_clone_tree)

    def latest_weights_copy(self) -> tuple[int, CanonicalState | ShardedPart] | None:
        """The newest snapshot's weights alone (no optimizer state), copied and packed so that Ray moves
        them without pickling (parallel/packed_tensors.py): what serving them needs."""
        return self._latest_copied(lambda state: {"model": pack_tensors(_clone_tree(state["model"])), "optimizer": {}})

    def _latest_copied(self, copy: Callable[[CanonicalState], CanonicalState]):
        self._await_copy()
        with self._buffers:
            if self._latest is None:
                return None
            step, state = self._latest
            if isinstance(state, ShardedPart):
                return step, ShardedPart(copy(state.state), dict(state.boxes))
            return step, copy(state)

    def drop(self) -> None:
        """Forget the engine (a new generation builds a new one); the latest snapshot is kept."""
        self.fence()
        if self.engine is None:
            return
        if self._fence_for_update in self.engine.before_update_hooks:
            self.engine.before_update_hooks.remove(self._fence_for_update)
        self.engine = None  # its memory goes before the next generation builds its own
        self._spare = None


    def forget(self) -> None:
        """Let go of every snapshot, a shelf's mapping included (the run is over)."""
        self._await_copy()
        with self._buffers:
            self._latest, self._spare, self.shelf = None, None, None


def _state_bytes(state) -> int:
    if isinstance(state, ShardedPart):
        return state.nbytes
    if isinstance(state, dict):
        return sum(_state_bytes(value) for value in state.values())
    return state.numel() * state.element_size() if isinstance(state, torch.Tensor) else 0


def _clone_tree(tree):
    if isinstance(tree, dict):
        return {key: _clone_tree(value) for key, value in tree.items()}
    return tree.clone()
