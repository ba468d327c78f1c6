"""LoRA adapters applied per request by the built-in engine, several in one batch.

Each Linear module some adapter targets is replaced once (`MultiLoRALinear`, holding the same weight):
its output is the base layer's, plus, for the rows of the batch that asked for adapter i, `scale_i * x @ A_i^T @ B_i^T`
(S-LoRA's and vLLM's multi-LoRA: the base weights stay shared and unmerged, so rows of different adapters,
and of none, decode together). Which adapter each row uses is set around a forward (`rows_use`).

Adapters come as PEFT adapter directories (`adapter_config.json`, `adapter_model.safetensors`, as peft
and `fit(..., adapter=...)` write them) or as a training job's adapter weights in memory (canonical names:
`model.layers.0.self_attn.q_proj.lora_A.default.weight`).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

_ROWS: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("lora_rows", default=None)
BASE = -1  # a row that uses no adapter


@dataclass(frozen=True)
class LoRAWeights:
    """One adapter: per target module (the model's own name, `model.layers.0.self_attn.q_proj`) its A
    (rank x in) and B (out x rank) matrices, and the scale of B A (lora_alpha / r, or / sqrt(r) with rsLoRA)."""

    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]
    scale: float


def read_peft_adapter(directory: str | Path) -> LoRAWeights:
    """A PEFT adapter directory's LoRA matrices (safetensors only: nothing is unpickled)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config_path, weights_path = directory / "adapter_config.json", directory / "adapter_model.safetensors"
    if not config_path.is_file() or not weights_path.is_file():
        raise ValueError(f"{directory} is not a PEFT adapter directory: expected adapter_config.json and "
                         "adapter_model.safetensors")
    config = json.loads(config_path.read_text())
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora"):
        raise ValueError(f"{directory} holds a {config.get('peft_type')} adapter: expected plain LoRA")
    tensors = load_file(str(weights_path))
    named = {key.removeprefix("base_model.model."): tensor for key, tensor in tensors.items()}
    return _pair_up(named, _scale(config["lora_alpha"], config["r"], config.get("use_rslora", False)), str(directory))


def lora_weights_from_state(weights: dict[str, torch.Tensor], lora_alpha: float, r: int,
                            use_rslora: bool = False) -> LoRAWeights:
    """A training job's adapter (its final or snapshot weights, canonical names with peft's adapter name)."""
    named = {name.replace(".default.", "."): tensor for name, tensor in weights.items()
             if ".lora_A." in name or ".lora_B." in name}
    return _pair_up(named, _scale(lora_alpha, r, use_rslora), "the job's weights")


def _scale(lora_alpha: float, r: int, use_rslora: bool) -> float:
    return lora_alpha / math.sqrt(r) if use_rslora else lora_alpha / r


def _pair_up(named: dict[str, torch.Tensor], scale: float, source: str) -> LoRAWeights:
    modules = {}
    for key, tensor in named.items():
        if key.endswith(".lora_A.weight"):
            module = key.removesuffix(".lora_A.weight")
            b = named.get(f"{module}.lora_B.weight")
            if b is None:
                raise ValueError(f"{source}: {module} has a LoRA A matrix and no B")
            modules[module] = (tensor.float(), b.float())
    if not modules:
        raise ValueError(f"{source} holds no LoRA matrices (lora_A / lora_B weights)")
    return LoRAWeights(modules=modules, scale=scale)


@dataclass(frozen=True)
class JobAdapter:
    """A training job's adapter as it was at `step`, in the object store (no file written): a replica reads
    its weights from there."""

    weights: Any  # ray.ObjectRef to the job's newest snapshot weights (the adapter's alone)
    step: int
    config: Any  # the job's peft LoraConfig

    @property
    def root(self) -> str:
        return f"memory: training step {self.step}"

    @property
    def rank(self) -> int:
        return largest_rank(self.config.r, getattr(self.config, "rank_pattern", None))

    def tensors(self) -> dict[str, torch.Tensor]:
        """The adapter's weights by canonical name (peft's, with its adapter name)."""
        import ray

        from baige_ray.parallel.packed_tensors import state_tensors

        return state_tensors(ray.get(self.weights))

    def read(self) -> LoRAWeights:
        config = self.config
        use_rslora = bool(getattr(config, "use_rslora", False))
        return lora_weights_from_state(self.tensors(), config.lora_alpha, config.r, use_rslora)


AdapterSource = str | JobAdapter  # a PEFT directory's path, or a job's adapter in memory


def served_adapters(adapters: dict | None) -> dict[str, AdapterSource]:
    """`serve(adapters=...)` checked on the driver: adapter name -> the absolute path of a PEFT adapter
    directory, or a running job's adapter in memory (a TrainingJob launched with `adapter=`: its newest
    snapshot, no file written); a ValueError naming what is wrong."""
    served: dict[str, AdapterSource] = {}
    for name, source in (adapters or {}).items():
        if not isinstance(name, str) or not name or ":" in name:
            raise ValueError(f"adapters: the name {name!r} is invalid: expected a non-empty string without ':' "
                             "(requests name an adapter alone or as '<model>:<adapter>')")
        served[name] = _job_adapter(name, source) if hasattr(source, "latest_model_state") else _directory(name, source)
    return served


def _directory(name: str, directory: Any) -> str:
    path = Path(directory).resolve() if isinstance(directory, (str, Path)) else None
    if path is None or not (path / "adapter_config.json").is_file():
        raise ValueError(f"adapters[{name!r}]={directory!r} is invalid: expected a PEFT adapter directory "
                         "(adapter_config.json, adapter_model.safetensors), as fit(..., adapter=...) writes, or a "
                         "TrainingJob launched with adapter=")
    read_peft_adapter(path)  # a corrupt or non-LoRA adapter fails here, not in every replica
    return str(path)


def _job_adapter(name: str, job: Any) -> JobAdapter:
    config = getattr(job, "adapter", None)
    if config is None:
        raise ValueError(f"adapters[{name!r}] is a training job without an adapter: launch it with adapter=")
    import ray

    step, weights = job.latest_model_state()
    # A copy this process owns (an adapter is small): the job's controller owns its snapshot, which goes with it,
    # and a replica restarted later must still find what it serves.
    return JobAdapter(weights=ray.put(ray.get(weights)), step=int(step), config=config)


def read_adapter(source: AdapterSource) -> LoRAWeights:
    return source.read() if isinstance(source, JobAdapter) else read_peft_adapter(source)


def adapter_rank(source: AdapterSource) -> int:
    """The largest LoRA rank of the adapter's matrices (its `r`, or a larger one its `rank_pattern` gives)."""
    if isinstance(source, JobAdapter):
        return source.rank
    config = json.loads((Path(source) / "adapter_config.json").read_text())
    return largest_rank(config["r"], config.get("rank_pattern"))


def largest_rank(r: int, rank_pattern: dict | None) -> int:
    """An adapter's largest rank: its `r`, or a larger one its per-module `rank_pattern` gives."""
    return max([int(r), *map(int, (rank_pattern or {}).values())])


def adapter_root(source: AdapterSource) -> str:
    """Where the adapter came from, as GET /v1/models says."""
    return source.root if isinstance(source, JobAdapter) else source


class MultiLoRALinear(nn.Linear):
    """A Linear layer with any number of LoRA adapters, each row of a batch using its own (or none). It
    holds the replaced layer's own weight and bias under the same names, so the model's state dict, and
    weights copied into it in place, are unchanged."""

    def __init__(self, base: nn.Linear):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.adapters: dict[int, tuple[torch.Tensor, torch.Tensor, float]] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        rows = _ROWS.get()
        if rows is None or not self.adapters:
            return y
        for slot in rows.unique().tolist():
            if slot in self.adapters:
                a, b, scale = self.adapters[slot]
                chosen = rows == slot
                y[chosen] += scale * ((x[chosen] @ a.t()) @ b.t())
        return y


class AdapterSet:
    """The adapters a model serves, by name, each in a slot; installs MultiLoRALinear where they need it."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.slots: dict[str, int] = {}

    @staticmethod
    def prepare(name: str, source: AdapterSource) -> LoRAWeights:
        """The adapter's matrices read from `source` (any thread, before `add` on the engine's)."""
        return read_adapter(source)

    def add(self, name: str, weights: LoRAWeights) -> int:
        """Serve `weights` as adapter `name` (replacing an adapter of that name); returns its slot."""
        modules = dict(self.model.named_modules())
        unknown = sorted(set(weights.modules) - set(modules))
        if unknown:
            raise ValueError(f"adapter {name!r} targets modules the model does not have: {unknown[:3]}")
        slot = self.slots.get(name, len(self.slots))
        for module in self.model.modules():  # a replaced adapter leaves nothing where it no longer acts
            if isinstance(module, MultiLoRALinear):
                module.adapters.pop(slot, None)
        for module_name, (a, b) in weights.modules.items():
            wrapped = self._wrapped(module_name, modules[module_name])
            if a.shape[1] != wrapped.in_features or b.shape[0] != wrapped.out_features or a.shape[0] != b.shape[1]:
                raise ValueError(f"adapter {name!r}: {module_name}'s LoRA matrices {tuple(a.shape)} and "
                                 f"{tuple(b.shape)} do not fit its {wrapped.in_features} -> {wrapped.out_features} layer")
            like = {"device": wrapped.weight.device, "dtype": wrapped.weight.dtype}
            wrapped.adapters[slot] = (a.to(**like), b.to(**like), weights.scale)
        self.slots[name] = slot
        return slot

    def _wrapped(self, module_name: str, module: nn.Module) -> MultiLoRALinear:
        if isinstance(module, MultiLoRALinear):
            return module
        if not isinstance(module, nn.Linear):
            raise ValueError(f"LoRA on {module_name} ({type(module).__name__}) is not supported: expected a Linear layer")
        parent_name, _, child = module_name.rpartition(".")
        wrapped = MultiLoRALinear(module)
        setattr(self.model.get_submodule(parent_name) if parent_name else self.model, child, wrapped)
        return wrapped

    def slot_of(self, name: str | None) -> int:
        """The slot of adapter `name` (BASE for None); ValueError naming the adapters served otherwise."""
        if name is None:
            return BASE
        if name not in self.slots:
            raise ValueError(f"adapter {name!r} is not served: expected one of {sorted(self.slots)}")
        return self.slots[name]


@contextlib.contextmanager
def rows_use(slots: Sequence[int] | None) -> Iterator[None]:
    """Within it, row i of every forward uses adapter slot `slots[i]` (BASE: none); None: no adapter at all."""
    token = _ROWS.set(None if slots is None or all(s == BASE for s in slots) else torch.tensor(list(slots)))
    try:
        yield
    finally:
        _ROWS.reset(token)
