"""The reference GPT as a model plug-in: its pipeline stages, tensor-parallel plan, data and checkpoint.

A stage owns a contiguous range of blocks, plus the embeddings if it is first and the final
norm and LM head if it is last. Blocks sit in a ModuleDict keyed by their global index, so a
parameter is called `blocks.7.mlp.up.weight` on whichever rank holds it: state moves between
layouts by name.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from baige_ray.models.corpus import CorpusConfig, CorpusWindows, stdlib_corpus
from baige_ray.models.gpt import GPT, GPTConfig
from baige_ray.models.moe import MoELayer
from baige_ray.models.plugin import ModelPlugin, register_model


class GPTStage(nn.Module):
    def __init__(self, model: GPT, first_layer: int, last_layer: int, *, is_first: bool, is_last: bool):
        super().__init__()
        self.is_first, self.is_last = is_first, is_last
        if is_first:
            self.token_embedding = model.token_embedding
            self.position_embedding = model.position_embedding
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(first_layer, last_layer)})
        if is_last:
            self.final_norm = model.final_norm
            self.lm_head = model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.token_embedding(x) + self.position_embedding(positions)
        for block in self.blocks.values():
            x = block(x)
        return self.lm_head(self.final_norm(x)) if self.is_last else x


@register_model(GPTConfig)
class GPTPlugin(ModelPlugin):
    config: GPTConfig

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    @property
    def seq_len(self) -> int:
        return self.config.seq_len

    def build_model(self) -> nn.Module:
        return GPT(self.config)

    def build_stage(self, model: nn.Module, first_layer: int, last_layer: int, *, is_first: bool,
                    is_last: bool) -> nn.Module:
        return GPTStage(model, first_layer, last_layer, is_first=is_first, is_last=is_last)

    def stage_blocks(self, stage: nn.Module) -> list[nn.Module]:
        return list(stage.blocks.values())

    def tensor_parallel_plan(self, tp: int) -> dict[str, Any]:
        """Megatron-LM's scheme: q, k, v and up column-wise, o and down row-wise (one all-reduce per sub-layer).

        An MoE model's MLPs stay whole on every TP rank: its experts are split by expert parallelism."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        if self.config.num_heads % tp:
            raise ValueError(f"tensor parallel degree {tp} must divide the model's num_heads={self.config.num_heads}")
        column, row = ColwiseParallel, RowwiseParallel
        plan = {"attn.q_proj": column(), "attn.k_proj": column(), "attn.v_proj": column(), "attn.o_proj": row()}
        if self.config.moe is None:
            plan.update({"mlp.up": column(), "mlp.down": row()})
        return plan

    def sequence_parallel_plan(self, tp: int) -> dict[str, Any] | None:
        """An MoE model's MLPs take the whole sequence on every rank: no sequence parallelism there."""
        from baige_ray.parallel.sequence_parallel import row_parallel_to_sequence_slices, sequence_parallel_styles

        if self.config.moe is not None:
            return None
        plan = self.tensor_parallel_plan(tp)
        plan.update({"attn.o_proj": row_parallel_to_sequence_slices(), "mlp.down": row_parallel_to_sequence_slices()})
        plan.update(sequence_parallel_styles(norms=("attn_norm", "mlp_norm"), positional_inputs=("attn", "mlp")))
        return plan

    def layer_costs(self) -> tuple[float, ...]:
        """Forward FLOPs per token of each block: attention (projections and scores), then the dense
        MLP or the router plus top-k routed and shared experts."""
        c = self.config
        attention = 2 * 4 * c.hidden * c.hidden + 2 * 2 * c.seq_len * c.hidden
        dense = 2 * 2 * c.hidden * c.mlp_hidden
        costs = []
        for index in range(c.num_layers):
            if c.is_moe_layer(index):
                expert = 2 * 2 * c.hidden * (c.moe.expert_ffn_hidden or c.mlp_hidden)
                costs.append(attention + 2 * c.hidden * c.moe.num_experts
                             + (c.moe.top_k + c.moe.num_shared_experts) * expert)
            else:
                costs.append(attention + dense)
        return tuple(float(cost) for cost in costs)

    def check_expert_parallel(self, ep: int) -> None:
        if self.config.moe is None:
            raise ValueError(f"ParallelLayout.ep={ep} is invalid: GPTConfig.moe is None (the model has no experts)")
        self.config.moe.check_expert_parallel(ep)

    def expert_modules(self, stage: nn.Module) -> list[nn.Module]:
        return [block.mlp for block in stage.blocks.values() if isinstance(block.mlp, MoELayer)]

    def inference_expert_layers(self, model: nn.Module) -> list[nn.Module]:
        return [block.mlp for block in model.blocks if isinstance(block.mlp, MoELayer)]

    @property
    def has_auxiliary_loss(self) -> bool:
        return self.config.moe is not None and self.config.moe.aux_loss_coef > 0

    def open_data(self, data: Any) -> CorpusWindows:
        data = CorpusConfig() if data is None else data
        if not isinstance(data, CorpusConfig):
            raise ValueError(f"data={data!r} is invalid for the byte-level GPT: expected a CorpusConfig")
        return CorpusWindows(stdlib_corpus(data), self.config.seq_len)

    def model_spec(self, *, global_batch: int, dtype_bytes: int = 2):
        from baige_ray.planner.model_spec import ModelSpec

        return ModelSpec.from_gpt_config(self.config, global_batch=global_batch, dtype_bytes=dtype_bytes)

    def save_final(self, directory: Path, weights: dict[str, torch.Tensor], *, step: int) -> Path:
        from baige_ray.checkpoint.final import save_model_checkpoint

        return save_model_checkpoint(directory, weights, model_config=self.config, step=step)

    def build_inference_model(self, weights: dict[str, torch.Tensor]) -> nn.Module:
        model = GPT(self.config)
        model.load_state_dict(weights)
        return model.eval()

    def build_decoder(self, weights: dict[str, torch.Tensor]):
        from baige_ray.models.gpt_decoding import GPTDecoder

        return GPTDecoder(self.build_inference_model(weights))

    def text_codec(self):
        from baige_ray.models.gpt_decoding import ByteCodec

        return ByteCodec()

    def check_vllm(self) -> None:
        from baige_ray.models.gpt_hf import check_gpt2_compatible

        check_gpt2_compatible(self.config)

    @contextlib.contextmanager
    def vllm_source(self):
        """vLLM runs the GPT as the GPT-2 model it is (models/gpt_hf.py), with a byte-level tokenizer: a
        directory of its config and tokenizer, which vLLM reads once while it builds its engine."""
        import tempfile

        from baige_ray.models.generation import VLLMSource
        from baige_ray.models.gpt_hf import write_gpt2_directory

        self.check_vllm()
        with tempfile.TemporaryDirectory(prefix="baige-gpt2-") as directory:
            write_gpt2_directory(Path(directory), self.config)
            yield VLLMSource(model_dir=directory, max_context=self.config.seq_len)

    def vllm_weights(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from baige_ray.models.gpt_hf import to_gpt2_weights

        return to_gpt2_weights(weights, self.config)

    def save_hf_directory(self, directory: Path, weights: dict[str, torch.Tensor], *, step: int) -> Path:
        from baige_ray.models.gpt_hf import write_gpt2_directory

        return write_gpt2_directory(directory, self.config, weights)
