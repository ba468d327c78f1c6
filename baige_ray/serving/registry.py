"""The per-application actor replicas share: the current weights and the request ledger.

Weights arrive as an ObjectRef to {param name: CPU tensor} (a live training job's in-memory
snapshot, or a checkpoint the driver loaded and verified). The registry fetches them once and puts
its own copy in the object store, so serving keeps working after the training worker that produced
the snapshot is released for lending; that copy is packed (parallel/packed_tensors.py), so replicas
read it where it lies instead of unpickling it. A replica loads the newest version when it starts (so a lent
replica starts with the current weights) and learns of newer ones in the answer to its periodic
load report, which is how weights are swapped in place on every replica without a redeploy. Between two
reports a replica waits on `newer_weights` (a long poll, as Serve's own controller pushes config), so a
publish reaches every replica at once instead of at its next report.
It also keeps the application's event log (in memory): a replica whose engine failed records it there.

Replicas that take turns with training on their devices (reinforcement learning, colocated) are told
to sleep (give back their device memory) and wake the same way: `set_asleep` wakes the long polls, each
replica reports the state it reached, and `settled` waits for them. Publishing weights wakes them.

A LoRA adapter the application serves is replaced the same way (`publish_adapter`, a training job's newer
adapter): it makes a new version whose base weights are those the replicas hold, so a replica swaps the
adapter alone between two steps and reports the version as it would new weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping

import ray

from baige_ray.ops.events import EventLog
from baige_ray.policies.disaggregation import SideLoad
from baige_ray.serving.ledger import EngineLoad, RequestLedger
from baige_ray.topology.head import on_head_node

REGISTRY_NAMESPACE = "baige"
STALE_RECHECK_S = 0.5  # a replica that stopped reporting leaves the live set without a report to wake anyone


def registry_name(app_name: str) -> str:
    return f"baige-serving:{app_name}"


class ServingRegistry:
    def __init__(self) -> None:
        self._version = 0  # of what is served: the weights and the adapters beside them
        self._weights_version = 0  # the version at which the weights themselves last changed
        self._adapters: dict[str, object] = {}  # adapter name -> its newest source (lora_adapters.AdapterSource)
        self._max_adapter_rank: int | None = None  # the largest rank vLLM engines were built for (None: any)
        self._step = -1
        self._model_config = None
        self._state_ref: ray.ObjectRef | None = None
        self._ledger = RequestLedger()
        self._loaded_versions: dict[str, int] = {}
        self._devices: dict[str, tuple[str, int]] = {}
        self._prefix_caches: dict[str, dict] = {}  # replica -> its prefix cache's last report
        self._events = EventLog(None)
        self._asleep = False  # what the replicas are asked to be: asleep while training uses their devices
        self._replicas_asleep: dict[str, bool] = {}  # what each last reported
        self._published = asyncio.Event()  # set, and replaced, at each publish: wakes the replicas' long polls
        self._reported_load = asyncio.Event()  # likewise when a replica reports new weights loaded

    async def publish_weights(self, step: int, state_refs: list, model_config, keep_copy: bool = True) -> int:
        """Hold a private copy of the state in `state_refs[0]`; returns the new weights version. Without
        `keep_copy`, a packed state is served from where it lies: its owner (a training job whose
        lifetime bounds the application's, as a reinforcement-learning run's rollout replicas) keeps it."""
        from baige_ray.parallel.packed_tensors import PackedTensors, pack_tensors  # torch: only where weights come

        state = await state_refs[0]
        if not isinstance(state, Mapping) or not state:
            raise ValueError(f"the published state is {type(state).__name__}, expected a non-empty dict of tensors")
        if isinstance(state, PackedTensors) and not keep_copy:
            self._state_ref = state_refs[0]  # no copy: two of a 2 GB policy filled the object store and spilled
        else:
            self._state_ref = ray.put(state if isinstance(state, PackedTensors) else pack_tensors(state))
        self._step, self._model_config = step, model_config
        self._version += 1
        self._weights_version = self._version
        self._asleep = False  # new weights are to be served
        self._wake_long_polls()
        return self._version

    def serve_adapters(self, sources: dict, max_rank: int | None = None) -> None:
        """The adapters the application starts with (name -> source): the names `publish_adapter` may replace;
        `max_rank`: the largest LoRA rank its engines were built for (vLLM's), None where any rank serves."""
        self._adapters = dict(sources)
        self._max_adapter_rank = max_rank

    def max_adapter_rank(self) -> int | None:
        return self._max_adapter_rank

    def publish_adapter(self, name: str, source) -> int:
        """Serve `source` as adapter `name` from now on (replicas swap it in place); returns the new version."""
        if name not in self._adapters:
            raise ValueError(f"adapter {name!r} is not served by this application: expected one of "
                             f"{sorted(self._adapters)} (serve(adapters=...) names them)")
        self._adapters[name] = source
        self._version += 1
        self._wake_long_polls()
        return self._version

    def set_asleep(self, asleep: bool) -> None:
        """Ask every replica to give back its device memory (True) or take it again (False)."""
        self._asleep = bool(asleep)
        self._wake_long_polls()

    def _wake_long_polls(self) -> None:
        self._published.set()
        self._published = asyncio.Event()

    async def newer_weights(self, version: int, timeout_s: float, asleep: bool = False) -> tuple[int, bool]:
        """(newest weights version, whether replicas are to sleep), as soon as either differs from what the
        replica has (`version`, `asleep`) or after `timeout_s`."""
        if self._version <= version and self._asleep == asleep:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._published.wait(), timeout_s)
        return self._version, self._asleep

    def weights(self) -> tuple[int, int, object, list, int, dict]:
        """(version, step, model config, [ref], the version at which the weights last changed, adapter name
        -> newest source) of what is served; the ref is wrapped so it travels unresolved. A replica already
        holding those weights takes the adapters alone."""
        if self._state_ref is None:
            raise LookupError("no weights published yet")
        return (self._version, self._step, self._model_config, [self._state_ref], self._weights_version,
                dict(self._adapters))

    async def report(self, replica: str, latencies: list[float], busy_s: float, ongoing: int, loaded_version: int,
                     device: tuple[str, int] | None = None, engine: EngineLoad | None = None,
                     prefix_cache: dict | None = None, asleep: bool = False) -> int:
        """Account a replica's recent work (and the (node id, device index) it runs on, if any, its
        engine's role and queue, its prefix cache's counts); answers the newest weights version."""
        if device is not None:
            self._devices[replica] = (str(device[0]), int(device[1]))
        if prefix_cache is not None:
            self._prefix_caches[replica] = prefix_cache
        now = time.time()
        self._ledger.record(replica, now, latencies, busy_s, ongoing, engine)
        if self._loaded_versions.get(replica) != loaded_version or self._replicas_asleep.get(replica) != asleep:
            self._loaded_versions[replica] = loaded_version
            self._replicas_asleep[replica] = asleep
            self._reported_load.set()
            self._reported_load = asyncio.Event()
        return self._version

    def replicas_behind(self, version: int) -> list[str]:
        """Live replicas still serving weights older than `version`."""
        live = self._ledger.live_replicas(time.time())
        return sorted(r for r in live if self._loaded_versions.get(r, 0) < version)

    async def caught_up(self, version: int, timeout_s: float) -> list[str]:
        """Live replicas still behind `version`, as soon as there are none or after `timeout_s`."""
        return await self._until_none(lambda: self.replicas_behind(version), timeout_s)

    async def settled(self, timeout_s: float) -> list[str]:
        """Live replicas not yet asleep or awake as asked, as soon as there are none or after `timeout_s`."""
        def unsettled() -> list[str]:
            live = self._ledger.live_replicas(time.time())
            return sorted(r for r in live if self._replicas_asleep.get(r, False) != self._asleep)
        return await self._until_none(unsettled, timeout_s)

    async def _until_none(self, pending, timeout_s: float) -> list[str]:
        deadline = time.monotonic() + timeout_s
        while (left_over := pending()) and (left := deadline - time.monotonic()) > 0:
            with contextlib.suppress(asyncio.TimeoutError):  # woken by a report; or look again: one may have died
                await asyncio.wait_for(self._reported_load.wait(), min(left, STALE_RECHECK_S))
        return left_over

    def load(self, window_s: float = 5.0) -> dict:
        window = self._ledger.window(time.time(), window_s)
        return {**vars(window), "requests_per_busy_s": window.requests_per_busy_s}

    def side_loads(self) -> dict[str, SideLoad]:
        """Per role ("prefill", "decode", "colocated"), the live replicas and their engines' queues."""
        return self._ledger.side_loads(time.time())

    def busy_seconds(self) -> dict[str, float]:
        return self._ledger.busy_seconds()

    def replica_devices(self) -> dict[str, tuple[str, int]]:
        """(node id, device index) of each replica that holds a device."""
        return dict(self._devices)

    def prefix_caches(self) -> dict[str, dict]:
        """Each replica's prefix cache as it last reported it (blocks, hits per tier, misses, bytes moved)."""
        return dict(self._prefix_caches)

    def requests_served(self) -> int:
        return self._ledger.requests_served()

    def record_event(self, kind: str, reason: str, **fields) -> None:
        """One event in the application's log (ops/events.py kinds), e.g. a replica's engine failure."""
        self._events.record(kind, reason, **fields)

    def events(self, n: int = 20) -> list[dict]:
        """The application's last `n` events, oldest first."""
        return self._events.recent(n)


def get_or_create_registry(app_name: str) -> ray.actor.ActorHandle:
    return (
        ray.remote(ServingRegistry)
        .options(
            name=registry_name(app_name),
            namespace=REGISTRY_NAMESPACE,
            get_if_exists=True,
            lifetime="detached",
            num_cpus=0,
            scheduling_strategy=on_head_node(),  # replicas on a lost node die; the weights they serve must not
        )
        .remote()
    )
