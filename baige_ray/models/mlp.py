"""A small MLP regression task: the recovery benchmark's model (512-2048-512 by default).

Samples are index-addressed like the corpus: sample i is a deterministic function of
(seed, i), so any data-parallel split of a step reads exactly the same samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from baige_ray.api.validation import require_int
from baige_ray.models.plugin import ModelPlugin, register_model


@dataclass(kw_only=True, frozen=True)
class MLPConfig:
    sizes: tuple[int, ...] = (512, 2048, 512)
    momentum: float = 0.9

    def __post_init__(self) -> None:
        if len(self.sizes) < 2:
            raise ValueError(f"MLPConfig.sizes={self.sizes!r} is invalid: expected at least input and output sizes")
        for size in self.sizes:
            require_int("MLPConfig", "sizes", size, minimum=1)
        if not 0 <= self.momentum < 1:
            raise ValueError(f"MLPConfig.momentum={self.momentum!r} is invalid: expected 0 <= momentum < 1")


class MLP(nn.Sequential):
    def __init__(self, config: MLPConfig):
        layers: list[nn.Module] = []
        for index, (fan_in, fan_out) in enumerate(zip(config.sizes, config.sizes[1:])):
            layers.append(nn.Linear(fan_in, fan_out))
            if index < len(config.sizes) - 2:
                layers.append(nn.ReLU())
        super().__init__(*layers)


def regression_batch(config: MLPConfig, indices: range, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs from N(0, 1) per sample index; targets from a fixed random teacher (same for every sample)."""
    inputs = torch.stack([_sample(seed, index, config.sizes[0]) for index in indices])
    teacher = torch.Generator().manual_seed(seed + 0x5EED)
    weights = torch.randn(config.sizes[0], config.sizes[-1], generator=teacher) / config.sizes[0] ** 0.5
    return inputs, torch.tanh(inputs @ weights)


def _sample(seed: int, index: int, size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed((seed * 1_000_003 + index) % 2**63)
    return torch.randn(size, generator=generator)


@register_model(MLPConfig)
class MLPPlugin(ModelPlugin):
    """The MLP runs on its own data-parallel SGD engine; it has no blocks to pipeline or tensor-parallelize."""

    config: MLPConfig
    engine = "mlp"  # engines/factory.py: its own data-parallel SGD engine

    @property
    def num_layers(self) -> int:
        return len(self.config.sizes) - 1

    @property
    def seq_len(self) -> int:
        return 1

    @property
    def supports_uneven_data_parallel(self) -> bool:
        return False

    def build_model(self) -> nn.Module:
        return MLP(self.config)

    def build_stage(self, model, first_layer, last_layer, *, is_first, is_last) -> nn.Module:
        raise ValueError("the MLP is not split into pipeline stages: expected pp=1")

    def stage_blocks(self, stage: nn.Module) -> list[nn.Module]:
        return [stage]

    def tensor_parallel_plan(self, tp: int) -> dict:
        raise ValueError(f"tensor parallel degree {tp} is invalid for the MLP: expected tp=1")

    def open_data(self, data) -> None:
        if data is not None:
            raise ValueError(f"data={data!r} is invalid for the MLP: it trains on its own regression samples")
        return None

    def model_spec(self, *, global_batch: int, dtype_bytes: int = 2):
        raise ValueError("layout='auto' is invalid for MLPConfig: the planner models transformers")

    def save_final(self, directory, weights, *, step: int):
        from baige_ray.checkpoint.final import save_model_checkpoint

        return save_model_checkpoint(directory, weights, model_config=self.config, step=step)

    def build_inference_model(self, weights: dict[str, torch.Tensor]) -> nn.Module:
        model = MLP(self.config)
        model.load_state_dict(weights)
        return model.eval()
