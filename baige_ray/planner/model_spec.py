"""What the planner knows about a model: shapes, batch, precision and experts.

Parameter and FLOP counts follow the decoder-only transformer of Megatron-LM
(Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", Appendix: 12*l*h^2 parameters for a dense model
with FFN = 4h), generalized to any FFN width, grouped-query attention (fewer
KV heads), mixture-of-experts MLPs and the Llama family (SwiGLU MLP, RoPE,
RMSNorm, tied embeddings, a head_dim of its own). Biases are left out (< 0.1%
of weights).

Norms: with `rms_norm` (Llama family) the count is exact: one weight vector per
norm, two norms per layer plus the final one. The LayerNorm default keeps the
Megatron count (weight and bias of the two per-layer norms, no final norm) so
specs written before price the same.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import yaml

from baige_ray.api.validation import require_choice, require_int
from baige_ray.catalog import published_model

DTYPE_BYTES = (1, 2, 4)
DEFAULT_GLOBAL_BATCH = 1024  # sequences, for Hugging Face configs that carry no batch
DEFAULT_SEQ_LEN_CAP = 4096  # load_model_spec's seq_len for a config.json whose context is longer

# Hugging Face model_types of SwiGLU + RoPE + RMSNorm decoders, the family from_hf_config can price.
HF_LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
HF_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(kw_only=True, frozen=True)
class ModelSpec:
    """A decoder-only transformer to plan. `num_experts=0` means a dense MLP in every layer.

    `gated_mlp`: SwiGLU (gate, up, down matrices) instead of up, down. `learned_positions`: a position
    embedding table of seq_len rows (off for RoPE). `tied_embeddings`: the LM head reuses the token
    embedding (no parameters of its own; its FLOPs stay). `head_dim`: Q/O are hidden x num_heads*head_dim
    and K/V hidden x kv_heads*head_dim; None means hidden / num_heads. `rms_norm`: RMSNorm (weight only).
    """

    name: str = "model"
    num_layers: int
    hidden: int
    ffn_hidden: int
    num_heads: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    seq_len: int
    vocab_size: int
    global_batch: int
    dtype_bytes: int = 2
    num_experts: int = 0
    top_k: int = 1
    expert_ffn_hidden: int | None = None
    num_dense_layers: int = 0  # of an MoE model: layers with a dense MLP (ffn_hidden) instead of experts
    shared_expert_ffn: int = 0  # of an MoE model: FFN width of the experts every token passes, per MoE layer
    gated_mlp: bool = False
    learned_positions: bool = True
    tied_embeddings: bool = False
    rms_norm: bool = False
    # Attention by a fused kernel (SDPA's flash or memory-efficient kernels, as transformers runs a Hugging
    # Face model): no (sequence x sequence) scores are kept for backward, Korthikanti's 5as^2b term is 0.
    fused_attention: bool = False
    # Whether the engines can split its sequences over context-parallel ranks (a Hugging Face model, dense or
    # MoE: parallel/context_parallel.py), so the planner may search CP degrees for it.
    context_parallel: bool = False

    @property
    def splits_sequence_with_tp(self) -> bool:
        """Whether tensor parallelism runs with sequence parallelism here (parallel/sequence_parallel.py):
        for dense models; an MoE layer takes the whole sequence on every TP rank."""
        return self.num_experts == 0

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden", "ffn_hidden", "num_heads", "seq_len", "vocab_size", "global_batch"):
            require_int("ModelSpec", field, getattr(self, field), minimum=1)
        require_choice("ModelSpec", "dtype_bytes", self.dtype_bytes, DTYPE_BYTES)
        require_int("ModelSpec", "num_experts", self.num_experts, minimum=0)
        for field in ("gated_mlp", "learned_positions", "tied_embeddings", "rms_norm", "fused_attention",
                      "context_parallel"):
            _require_bool(field, getattr(self, field))
        self._validate_heads()
        if self.num_experts:
            require_int("ModelSpec", "top_k", self.top_k, minimum=1)
            if self.top_k > self.num_experts:
                raise ValueError(f"ModelSpec.top_k={self.top_k} is invalid: expected <= "
                                 f"num_experts={self.num_experts}")
            require_int("ModelSpec", "expert_ffn_hidden", self.expert_ffn, minimum=1)
            require_int("ModelSpec", "num_dense_layers", self.num_dense_layers, minimum=0)
            if self.num_dense_layers >= self.num_layers:
                raise ValueError(f"ModelSpec.num_dense_layers={self.num_dense_layers} is invalid: expected fewer "
                                 f"than num_layers={self.num_layers} (an MoE model has at least one MoE layer)")
            require_int("ModelSpec", "shared_expert_ffn", self.shared_expert_ffn, minimum=0)

    def _validate_heads(self) -> None:
        if self.head_dim is not None:
            require_int("ModelSpec", "head_dim", self.head_dim, minimum=1)
        elif self.hidden % self.num_heads:
            raise ValueError(f"ModelSpec.hidden={self.hidden} is invalid: expected a multiple of "
                             f"num_heads={self.num_heads} (or set head_dim)")
        kv = self.kv_heads
        require_int("ModelSpec", "num_kv_heads", kv, minimum=1)
        if self.num_heads % kv:
            raise ValueError(f"ModelSpec.num_kv_heads={kv} is invalid: expected a divisor of "
                             f"num_heads={self.num_heads}")

    # ---- shapes ---------------------------------------------------------------------------

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads if self.num_kv_heads is not None else self.num_heads

    @property
    def head_size(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden // self.num_heads

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_size

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_size

    @property
    def expert_ffn(self) -> int:
        return self.expert_ffn_hidden if self.expert_ffn_hidden is not None else self.ffn_hidden

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.gated_mlp else 2

    @property
    def moe_layer_share(self) -> float:
        """The fraction of layers with experts. Per-layer figures below are averages over all layers
        (exact in sums over the model; a stage of only dense or only MoE layers differs from them)."""
        return (self.num_layers - self.num_dense_layers) / self.num_layers if self.is_moe else 0.0

    # ---- parameters -----------------------------------------------------------------------

    @property
    def attention_params(self) -> int:
        """Q and O are h x q_dim; K and V are h x kv_dim (grouped-query attention shrinks them)."""
        return 2 * self.hidden * self.q_dim + 2 * self.hidden * self.kv_dim

    @property
    def norm_params_per_layer(self) -> int:
        return (2 if self.rms_norm else 4) * self.hidden

    @property
    def dense_layer_params(self) -> float:
        """Per layer, replicated across expert-parallel ranks: attention, norms, and the dense MLP or
        the router and shared experts."""
        common = self.attention_params + self.norm_params_per_layer
        dense_mlp = self.mlp_matrices * self.hidden * self.ffn_hidden
        if not self.is_moe:
            return common + dense_mlp
        moe = self.hidden * self.num_experts + self.mlp_matrices * self.hidden * self.shared_expert_ffn
        share = self.moe_layer_share
        return common + share * moe + (1 - share) * dense_mlp

    @property
    def expert_layer_params(self) -> float:
        """Per layer, all routed experts together (sharded across expert-parallel ranks)."""
        return self.moe_layer_share * self.num_experts * self.mlp_matrices * self.hidden * self.expert_ffn

    @property
    def embedding_params(self) -> int:
        """Token embedding, plus the learned position embedding when there is one (first stage)."""
        return (self.vocab_size + (self.seq_len if self.learned_positions else 0)) * self.hidden

    @property
    def output_params(self) -> int:
        """Final norm (RMSNorm models only, see the module doc) and LM head unless tied (last stage)."""
        head = 0 if self.tied_embeddings else self.vocab_size * self.hidden
        return head + (self.hidden if self.rms_norm else 0)

    @property
    def num_params(self) -> int:
        per_layer = self.dense_layer_params + self.expert_layer_params
        return round(self.num_layers * per_layer) + self.embedding_params + self.output_params

    # ---- FLOPs (forward, per token) --------------------------------------------------------

    @property
    def layer_flops_per_token(self) -> float:
        """Forward FLOPs per token per layer: 2 per weight of the GEMMs a token passes through, plus
        4*s*q_dim for Q.K^T and attention.V (Narayanan et al. 2021, eq. 3: 24bsh^2 + 4bs^2h per layer).
        An MoE token visits the router, top_k experts and the shared experts (averaged with dense layers)."""
        mlp = self.mlp_matrices * self.hidden
        moe = self.hidden * self.num_experts + mlp * (self.top_k * self.expert_ffn + self.shared_expert_ffn)
        share = self.moe_layer_share
        matmul = self.attention_params + share * moe + (1 - share) * mlp * self.ffn_hidden
        return 2.0 * matmul + self.attention_core_flops_per_token

    @property
    def attention_core_flops_per_token(self) -> float:
        """The part selective recomputation redoes (Korthikanti et al. 2022, sec. 5): QK^T, softmax, AV."""
        return 4.0 * self.seq_len * self.q_dim

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
        """The spec of the reference `baige_ray.models.gpt.GPTConfig` (full multi-head attention; with
        `moe`, its leading dense layers and shared experts too)."""
        moe = config.moe
        expert_ffn = (moe.expert_ffn_hidden or config.mlp_hidden) if moe is not None else 0
        experts = {} if moe is None else {"num_experts": moe.num_experts, "top_k": moe.top_k,
                                          "expert_ffn_hidden": expert_ffn, "num_dense_layers": moe.num_dense_layers,
                                          "shared_expert_ffn": moe.num_shared_experts * expert_ffn}
        return cls(name=name, num_layers=config.num_layers, hidden=config.hidden, ffn_hidden=config.mlp_hidden,
                   num_heads=config.num_heads, seq_len=config.seq_len, vocab_size=config.vocab_size,
                   global_batch=global_batch, dtype_bytes=dtype_bytes, **experts)

    @classmethod
    def from_hf_config(cls, config: dict, *, global_batch: int, seq_len: int | None = None,
                       dtype_bytes: int | None = None, name: str | None = None) -> ModelSpec:
        """The spec of a Hugging Face `config.json` of the Llama family (HF_LLAMA_FAMILY); `seq_len`
        defaults to max_position_embeddings, `dtype_bytes` to the config's (torch_)dtype, `name` to the
        first of its architectures. Not counted: Qwen2-MoE's shared-expert gate (one vector per layer),
        Qwen2's Q/K/V biases and Qwen3's Q/K norms (< 0.1% of weights)."""
        hf = _HFConfig.of(config, name)
        heads, hidden = hf.required_int("num_attention_heads"), hf.required_int("hidden_size")
        head_dim = hf.optional_int("head_dim")
        experts = hf.experts()
        return cls(
            name=hf.model, num_layers=hf.required_int("num_hidden_layers"), hidden=hidden,
            ffn_hidden=hf.required_int("intermediate_size"), num_heads=heads,
            num_kv_heads=hf.optional_int("num_key_value_heads") or heads,
            head_dim=head_dim if head_dim is not None and head_dim * heads != hidden else None,
            seq_len=seq_len if seq_len is not None else hf.required_int("max_position_embeddings"),
            vocab_size=hf.required_int("vocab_size"), global_batch=global_batch,
            dtype_bytes=dtype_bytes if dtype_bytes is not None else hf.dtype_bytes(), **experts,
            gated_mlp=True, learned_positions=False, rms_norm=True, tied_embeddings=hf.tied_embeddings(),
            fused_attention=True, context_parallel=True)


def _require_bool(field: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"ModelSpec.{field}={value!r} is invalid: expected True or False")


@dataclass(kw_only=True, frozen=True)
class _HFConfig:
    """A Hugging Face config dict with reads that name the key and the model when they fail."""

    data: dict
    model: str

    @classmethod
    def of(cls, config: Any, name: str | None) -> _HFConfig:
        if not isinstance(config, dict):
            raise ValueError(f"Hugging Face config={config!r:.80} is invalid: expected a mapping")
        architectures = config.get("architectures") or []
        model = name or (architectures[0] if isinstance(architectures, list) and architectures else None)
        hf = cls(data=config, model=str(model or config.get("model_type") or "config"))
        model_type = hf.data.get("model_type")
        if model_type not in HF_LLAMA_FAMILY:
            hf.fail("model_type", model_type, "one of " + ", ".join(HF_LLAMA_FAMILY))
        return hf

    def fail(self, key: str, value: Any, allowed: str) -> NoReturn:
        raise ValueError(f"Hugging Face config of {self.model}: {key}={value!r} is invalid: expected {allowed}")

    def required_int(self, key: str) -> int:
        if key not in self.data:
            raise ValueError(f"Hugging Face config of {self.model} lacks the required key {key!r}")
        value = self.optional_int(key)
        if value is None:
            self.fail(key, None, "an integer >= 1")
        return value

    def optional_int(self, key: str, *, minimum: int = 1) -> int | None:
        value = self.data.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
            self.fail(key, value, f"an integer >= {minimum}")
        return value

    def dtype_bytes(self) -> int:
        key = "torch_dtype" if "torch_dtype" in self.data else "dtype"
        value = self.data.get(key) or "bfloat16"
        if value not in HF_DTYPE_BYTES:
            self.fail(key, value, "one of " + ", ".join(HF_DTYPE_BYTES))
        return HF_DTYPE_BYTES[value]

    def tied_embeddings(self) -> bool:
        value = self.data.get("tie_word_embeddings", False)  # the Llama family's class default
        if not isinstance(value, bool):
            self.fail("tie_word_embeddings", value, "true or false")
        return value

    def experts(self) -> dict[str, Any]:
        """Mixtral names its experts num_local_experts and sizes them by intermediate_size;
        Qwen-MoE says num_experts and moe_intermediate_size."""
        key = "num_local_experts" if "num_local_experts" in self.data else "num_experts"
        num_experts = self.optional_int(key, minimum=0) or 0
        if not num_experts:
            return {}
        ffn_key = "moe_intermediate_size" if "moe_intermediate_size" in self.data else "intermediate_size"
        expert_ffn = self.required_int(ffn_key)
        shared = self.optional_int("shared_expert_intermediate_size", minimum=0) or 0  # Qwen2-MoE
        shared += (self.optional_int("n_shared_experts", minimum=0) or 0) * expert_ffn  # DeepSeek
        return {"num_experts": num_experts, "top_k": self.required_int("num_experts_per_tok"),
                "expert_ffn_hidden": expert_ffn, "num_dense_layers": self.dense_layer_count(),
                "shared_expert_ffn": shared}

    def dense_layer_count(self) -> int:
        """Layers of an MoE config with a dense MLP (hf_moe_layers), its keys checked first."""
        self.optional_int("first_k_dense_replace", minimum=0)
        self.optional_int("decoder_sparse_step", minimum=1)
        layers = self.required_int("num_hidden_layers")
        return layers - sum(hf_moe_layers(self.data, layers))


def hf_moe_layers(config: dict, num_layers: int) -> list[bool]:
    """Which layers of a Hugging Face MoE config have experts: all but DeepSeek's `first_k_dense_replace`
    leading ones, Qwen-MoE's `mlp_only_layers` and those off its `decoder_sparse_step`."""
    if "first_k_dense_replace" in config:
        first_sparse = config.get("first_k_dense_replace") or 0
        return [index >= first_sparse for index in range(num_layers)]
    dense_only = set(config.get("mlp_only_layers") or [])
    step = config.get("decoder_sparse_step") or 1
    return [index not in dense_only and (index + 1) % step == 0 for index in range(num_layers)]


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


def load_model_spec(reference: str | Path, *, global_batch: int | None = None,
                    seq_len: int | None = None) -> ModelSpec:
    """A planner YAML, or a Hugging Face config.json (a file, or a model directory holding one), by path or
    by the name of one that ships with baige-ray (`"qwen2.5-0.5b"`: catalog.model_names()).

    `global_batch` (sequences, default DEFAULT_GLOBAL_BATCH) and `seq_len` (default: max_position_embeddings
    capped at DEFAULT_SEQ_LEN_CAP) apply to config.json only; a YAML carries its own."""
    path = published_model(reference)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model path={str(path)!r} is invalid: a directory must hold a Hugging Face "
                             f"config.json")
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"model spec path={str(path)!r} is invalid: expected an existing YAML file, "
                         f"Hugging Face config.json or model directory")
    if path.suffix == ".json":
        return _load_hf_config(path, global_batch=global_batch, seq_len=seq_len)
    for field, value in (("global_batch", global_batch), ("seq_len", seq_len)):
        if value is not None:
            raise ValueError(f"{field}={value!r} is invalid for the model YAML {str(path)!r}: expected it "
                             f"in the YAML (the override is for Hugging Face config.json only)")
    return model_spec_from_dict(yaml.safe_load(path.read_text()), default_name=path.stem)


def _load_hf_config(path: Path, *, global_batch: int | None, seq_len: int | None) -> ModelSpec:
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"model config {str(path)!r} is invalid: not JSON ({error})") from None
    # A model directory's config.json is named after its directory.
    name = path.parent.name if path.name == "config.json" else path.stem
    if seq_len is None and isinstance(config, dict):
        context = config.get("max_position_embeddings")
        seq_len = min(context, DEFAULT_SEQ_LEN_CAP) if isinstance(context, int) and context > 0 else None
    global_batch = DEFAULT_GLOBAL_BATCH if global_batch is None else global_batch
    try:
        return ModelSpec.from_hf_config(config, global_batch=global_batch, seq_len=seq_len, name=name)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None
