"""What the planner knows about a model: shapes, batch, precision and experts.

Parameter and FLOP counts follow the decoder-only transformer of Megatron-LM
(Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", Appendix: 12*l*h^2 parameters for a dense model
with FFN = 4h), generalized to any FFN width, grouped-query attention (fewer
KV heads) and mixture-of-experts MLPs. Biases are left out (< 0.1% of weights).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from baige_ray.api.validation import require_choice, require_int

DTYPE_BYTES = (1, 2, 4)


@dataclass(kw_only=True, frozen=True)
class ModelSpec:
    """A decoder-only transformer to plan. `num_experts=0` means a dense MLP in every layer."""

    name: str = "model"
    num_layers: int
    hidden: int
    ffn_hidden: int
    num_heads: int
    num_kv_heads: int | None = None
    seq_len: int
    vocab_size: int
    global_batch: int
    dtype_bytes: int = 2
    num_experts: int = 0
    top_k: int = 1
    expert_ffn_hidden: int | None = None

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden", "ffn_hidden", "num_heads", "seq_len", "vocab_size", "global_batch"):
            require_int("ModelSpec", field, getattr(self, field), minimum=1)
        require_choice("ModelSpec", "dtype_bytes", self.dtype_bytes, DTYPE_BYTES)
        require_int("ModelSpec", "num_experts", self.num_experts, minimum=0)
        if self.hidden % self.num_heads:
            raise ValueError(f"ModelSpec.hidden={self.hidden} is invalid: expected a multiple of "
                             f"num_heads={self.num_heads}")
        kv = self.kv_heads
        require_int("ModelSpec", "num_kv_heads", kv, minimum=1)
        if self.num_heads % kv:
            raise ValueError(f"ModelSpec.num_kv_heads={kv} is invalid: expected a divisor of "
                             f"num_heads={self.num_heads}")
        if self.num_experts:
            require_int("ModelSpec", "top_k", self.top_k, minimum=1)
            if self.top_k > self.num_experts:
                raise ValueError(f"ModelSpec.top_k={self.top_k} is invalid: expected <= "
                                 f"num_experts={self.num_experts}")
            require_int("ModelSpec", "expert_ffn_hidden", self.expert_ffn, minimum=1)

    # ---- shapes ---------------------------------------------------------------------------

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads if self.num_kv_heads is not None else self.num_heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * (self.hidden // self.num_heads)

    @property
    def expert_ffn(self) -> int:
        return self.expert_ffn_hidden if self.expert_ffn_hidden is not None else self.ffn_hidden

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    # ---- parameters -----------------------------------------------------------------------

    @property
    def attention_params(self) -> int:
        """Q and O are h x h; K and V are h x kv_dim (grouped-query attention shrinks them)."""
        return 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_dim

    @property
    def dense_layer_params(self) -> int:
        """Per layer, replicated across expert-parallel ranks: attention, norms, router or dense MLP."""
        norms = 4 * self.hidden
        if self.is_moe:
            return self.attention_params + norms + self.hidden * self.num_experts
        return self.attention_params + norms + 2 * self.hidden * self.ffn_hidden

    @property
    def expert_layer_params(self) -> int:
        """Per layer, all experts together (sharded across expert-parallel ranks)."""
        return self.num_experts * 2 * self.hidden * self.expert_ffn if self.is_moe else 0

    @property
    def embedding_params(self) -> int:
        """Token + learned position embedding (first stage)."""
        return (self.vocab_size + self.seq_len) * self.hidden

    @property
    def output_params(self) -> int:
        """Untied LM head (last stage), as in the reference GPT."""
        return self.vocab_size * self.hidden

    @property
    def num_params(self) -> int:
        per_layer = self.dense_layer_params + self.expert_layer_params
        return self.num_layers * per_layer + self.embedding_params + self.output_params

    # ---- FLOPs (forward, per token) --------------------------------------------------------

    @property
    def layer_flops_per_token(self) -> float:
        """Forward FLOPs per token per layer: 2 per weight of the GEMMs a token passes through, plus
        4*s*h for Q.K^T and attention.V (Narayanan et al. 2021, eq. 3: 24bsh^2 + 4bs^2h per layer).
        An MoE token visits top_k experts and the router."""
        matmul = self.attention_params
        matmul += (self.hidden * self.num_experts + self.top_k * 2 * self.hidden * self.expert_ffn
                   if self.is_moe else 2 * self.hidden * self.ffn_hidden)
        return 2.0 * matmul + 4.0 * self.seq_len * self.hidden

    @property
    def attention_core_flops_per_token(self) -> float:
        """The part selective recomputation redoes (Korthikanti et al. 2022, sec. 5): QK^T, softmax, AV."""
        return 4.0 * self.seq_len * self.hidden

    @property
    def logits_flops_per_token(self) -> float:
        return 2.0 * self.hidden * self.vocab_size

    def model_flops_per_step(self) -> float:
        """Forward + backward (3x forward) FLOPs of one step, no recomputation: the MFU numerator
        (Chowdhery et al. 2022, PaLM, appendix B)."""
        per_token = self.num_layers * self.layer_flops_per_token + self.logits_flops_per_token
        return 3.0 * per_token * self.seq_len * self.global_batch

    # ---- construction ----------------------------------------------------------------------

    @classmethod
    def from_gpt_config(cls, config: Any, *, global_batch: int, dtype_bytes: int = 2,
                        name: str = "gpt") -> ModelSpec:
        """The spec of the reference `baige_ray.models.gpt.GPTConfig` (dense, full multi-head attention)."""
        return cls(name=name, num_layers=config.num_layers, hidden=config.hidden, ffn_hidden=config.mlp_hidden,
                   num_heads=config.num_heads, seq_len=config.seq_len, vocab_size=config.vocab_size,
                   global_batch=global_batch, dtype_bytes=dtype_bytes)


def model_spec_from_dict(data: Any, *, default_name: str = "model") -> ModelSpec:
    if not isinstance(data, dict):
        raise ValueError(f"model spec={data!r} is invalid: expected a mapping")
    known = set(ModelSpec.__dataclass_fields__)
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"model spec has unknown keys {unknown}: expected some of {sorted(known)}")
    fields = {"name": default_name, **data}
    if "ffn_hidden" not in fields and isinstance(fields.get("hidden"), int):
        fields["ffn_hidden"] = 4 * fields["hidden"]
    try:
        return ModelSpec(**fields)
    except TypeError as error:
        raise ValueError(f"model spec is incomplete: {error}") from None


def load_model_spec(path: str | Path) -> ModelSpec:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"model spec path={str(path)!r} is invalid: expected an existing YAML file")
    return model_spec_from_dict(yaml.safe_load(path.read_text()), default_name=path.stem)
