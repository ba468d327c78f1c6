"""LoRA adapters served by vLLM: its multi-LoRA (`LoRARequest`s, rows of several adapters in one batch).

vLLM reads an adapter from a PEFT adapter directory. A directory adapter is handed to it where it lies;
a training job's adapter in memory is written by the replica, as peft saves it, into a directory of its
own in /dev/shm (memory-backed where the host has it), and read from there: vLLM takes adapters from
nowhere else. A replaced adapter gets a new vLLM id, so a request already running finishes with the
matrices it started with, and the next requests use the new ones (the built-in engine swaps them under
running requests, serving/lora_adapters.py).

The engine is built for a largest rank and a number of adapters in one batch (`LoRASlots`): an adapter
published later with a larger rank is refused with the rank the engine was built for.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from baige_ray.serving.lora_adapters import AdapterSource, JobAdapter, adapter_rank

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values vLLM's max_lora_rank accepts
SMALLEST_ENGINE_RANK = 16  # vLLM's default: room for a later adapter of a larger rank than the first ones
SCRATCH_ROOT = Path("/dev/shm")


@dataclass(frozen=True)
class LoRASlots:
    """What a vLLM engine is built for: adapters of rank up to `max_rank`, `max_loras` of them in one batch."""

    max_rank: int
    max_loras: int

    def __post_init__(self):
        if self.max_rank not in VLLM_LORA_RANKS:
            raise ValueError(f"LoRASlots.max_rank={self.max_rank} is invalid: vLLM takes one of {VLLM_LORA_RANKS}")
        if self.max_loras < 1:
            raise ValueError(f"LoRASlots.max_loras={self.max_loras} is invalid: expected at least 1")

    def engine_args(self) -> dict[str, Any]:
        return dict(enable_lora=True, max_lora_rank=self.max_rank, max_loras=self.max_loras)


def lora_slots(sources: dict[str, AdapterSource]) -> LoRASlots:
    """Slots for the adapters an application starts with: the smallest rank vLLM accepts that holds each (at
    least 16), and two per adapter in a batch (the version a running request started with beside a newer one)."""
    rank = max(SMALLEST_ENGINE_RANK, *(adapter_rank(source) for source in sources.values()))
    fitting = [allowed for allowed in VLLM_LORA_RANKS if allowed >= rank]
    if not fitting:
        raise ValueError(f"adapters of rank {rank} cannot be served by vLLM: its largest LoRA rank is "
                         f"{VLLM_LORA_RANKS[-1]}")
    return LoRASlots(max_rank=fitting[0], max_loras=2 * max(1, len(sources)))


class VLLMAdapters:
    """The adapters a vLLM engine serves, by name: `prepare` (any thread) makes an adapter's LoRARequest,
    `add` (the engine's thread) serves it, `request_for` gives a request's."""

    def __init__(self, slots: LoRASlots):
        self.slots = slots
        self._requests: dict[str, Any] = {}
        self._ids = itertools.count(1)
        root = SCRATCH_ROOT if SCRATCH_ROOT.is_dir() else None
        self._scratch = Path(tempfile.mkdtemp(prefix="baige-lora-", dir=root))
        self._cleanup = weakref.finalize(self, shutil.rmtree, self._scratch, ignore_errors=True)

    def prepare(self, name: str, source: AdapterSource) -> Any:
        """vLLM's LoRARequest for `source` under a new id; a job's adapter is written to this engine's
        scratch directory first. A ValueError where the adapter's rank exceeds the engine's."""
        from vllm.lora.request import LoRARequest

        rank = adapter_rank(source)
        if rank > self.slots.max_rank:
            raise ValueError(f"adapter {name!r} has rank {rank}: this vLLM engine was built for ranks up to "
                             f"{self.slots.max_rank} (from the adapters it started with); serve it from the start")
        adapter_id = next(self._ids)
        path = self._write(source, self._scratch / f"{name}-{adapter_id}") if isinstance(source, JobAdapter) else source
        return LoRARequest(lora_name=f"{name}@{adapter_id}", lora_int_id=adapter_id, lora_path=str(path))

    def add(self, name: str, request: Any) -> None:
        """Serve `request` (from `prepare`) as adapter `name` from the next request on."""
        previous = self._requests.get(name)
        self._requests[name] = request
        if previous is not None:  # a request queued with it may still have vLLM read it: older ones go
            self._forget_older_than(previous)

    def request_for(self, name: str) -> Any:
        if name not in self._requests:
            raise ValueError(f"adapter {name!r} is not served: expected one of {sorted(self._requests)}")
        return self._requests[name]

    def close(self) -> None:
        self._cleanup()

    def _forget_older_than(self, kept: Any) -> None:
        live = {Path(request.lora_path) for request in self._requests.values()} | {Path(kept.lora_path)}
        for folder in self._scratch.iterdir():
            if folder not in live:
                shutil.rmtree(folder, ignore_errors=True)

    @staticmethod
    def _write(source: JobAdapter, directory: Path) -> Path:
        from baige_ray.models.adapters import save_adapter

        return save_adapter(directory, source.tensors(), source.config, base_model="")
