"""`HFModel`: a Hugging Face causal LM as a baige-ray model config (small, picklable, validated on creation).

`HFModel(path)` reads a local directory in Hugging Face format: config.json, safetensors weights
(one file or shards with model.safetensors.index.json) and, usually, the tokenizer files.
`HFModel.from_config(config)` describes fresh weights (initialized from the training seed).
Nothing is downloaded: a path that is not a local directory is an error, not a hub name.
Pickled weights (pytorch_model.bin) are refused: loading them could run arbitrary code.
"""

from __future__ import annotations

import json
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any

# The Llama family (RMSNorm, RoPE, grouped-query attention, SwiGLU) and its mixture-of-experts
# variants (models/hf/moe.py): one decoder-layer interface, embed_tokens / layers / norm /
# rotary_emb under `model`, and `lm_head`.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
DEFAULT_MAX_SEQ_LEN = 2048
SAFETENSORS_INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _fail(field_name: str, value: Any, allowed: str) -> None:
    raise ValueError(f"HFModel.{field_name}={value!r} is invalid: expected {allowed}")


def read_config_file(directory: Path) -> dict:
    path = directory / "config.json"
    if not directory.is_dir():
        _fail("path", str(directory), "a local directory in Hugging Face format (nothing is downloaded)")
    if not path.is_file():
        _fail("path", str(directory), "a directory holding config.json (Hugging Face format); it has none")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error})") from None


def architecture_of(config: dict) -> str:
    """The config's architecture if supported; a ValueError naming the supported ones otherwise."""
    names = config.get("architectures") or []
    by_type = {model_type: name for name, model_type in SUPPORTED_ARCHITECTURES.items()}
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    if not names and config.get("model_type") in by_type:
        return by_type[config["model_type"]]
    found = names or [config.get("model_type")]
    raise ValueError(f"architecture {found} is not supported: expected one of {sorted(SUPPORTED_ARCHITECTURES)}")


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files holding the weights; refuses pickled checkpoints."""
    index = directory / SAFETENSORS_INDEX
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [name for name in shards if not (directory / name).is_file()]
        if missing:
            raise ValueError(f"{index} names shards that are missing: {missing}")
        return [directory / name for name in shards]
    files = sorted(directory.glob("*.safetensors"))
    if files:
        return files
    if any(directory.glob("pytorch_model*.bin")):
        raise ValueError(f"{directory} holds pickled weights (pytorch_model*.bin) only: expected safetensors "
                         "(loading pickles can run arbitrary code; convert with save_pretrained(safe_serialization=True))")
    raise ValueError(f"{directory} holds no weights: expected model.safetensors or shards with {SAFETENSORS_INDEX}")


def has_tokenizer(directory: Path) -> bool:
    return any((directory / name).is_file() for name in TOKENIZER_FILES)


@dataclass(frozen=True)
class HFModel:
    """A Hugging Face causal LM of the Llama family, from a local directory or from a config.

    `seq_len` is the training sequence length (default: the model's maximum positions, at most
    2048); `tokenizer` a directory with the tokenizer files (default: `path` when it holds them).
    """

    path: str | Path | None = None
    _: KW_ONLY
    seq_len: int | None = None
    tokenizer: str | Path | None = None
    trust_remote_code: bool = False
    config: dict = field(default_factory=dict)
    architecture: str = field(init=False, default="")

    def __post_init__(self) -> None:
        if self.path is not None:
            directory = Path(self.path).expanduser().resolve()  # workers do not share our working directory
            object.__setattr__(self, "path", directory)
            object.__setattr__(self, "config", read_config_file(directory))
            weight_files(directory)
        elif not self.config:
            _fail("path", None, "a model directory, or a config through HFModel.from_config")
        if not isinstance(self.trust_remote_code, bool):
            _fail("trust_remote_code", self.trust_remote_code, "True or False")
        object.__setattr__(self, "architecture", architecture_of(self.config))
        self._check_seq_len()
        self._check_tokenizer()

    @classmethod
    def from_config(cls, config: Any, *, seq_len: int | None = None, tokenizer: str | Path | None = None,
                    trust_remote_code: bool = False) -> HFModel:
        """Fresh weights for `config` (a transformers PretrainedConfig or its dict)."""
        as_dict = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        return cls(None, config=as_dict, seq_len=seq_len, tokenizer=tokenizer, trust_remote_code=trust_remote_code)

    @property
    def max_positions(self) -> int:
        """The longest sequence the model's positions reach: max_position_embeddings, stretched by its rope
        scaling as vLLM derives max_model_len (YaRN: factor x original_max_position_embeddings; linear and
        dynamic: factor x max_position_embeddings; Llama 3's and LongRoPE's configs already give the stretched
        length)."""
        positions = int(self.config.get("max_position_embeddings", DEFAULT_MAX_SEQ_LEN))
        scaling = self.config.get("rope_scaling") or self.config.get("rope_parameters") or {}
        kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
        factor = scaling.get("factor") if isinstance(scaling, dict) else None
        if not factor or kind in (None, "default", "llama3", "longrope", "su"):
            return positions
        if kind == "yarn" and scaling.get("original_max_position_embeddings"):
            return max(positions, int(factor * int(scaling["original_max_position_embeddings"])))
        return int(factor * positions)

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    @property
    def name(self) -> str:
        return Path(self.path).name if self.path is not None else self.config.get("model_type", "model")

    def _check_seq_len(self) -> None:
        if self.seq_len is None:
            object.__setattr__(self, "seq_len", min(self.max_positions, DEFAULT_MAX_SEQ_LEN))
        if isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int) or self.seq_len < 1:
            _fail("seq_len", self.seq_len, "a positive integer")
        if self.seq_len > self.max_positions:
            _fail("seq_len", self.seq_len, f"at most the model's {self.max_positions} positions (max_position_embeddings"
                  f"={self.config.get('max_position_embeddings')}, rope_scaling={self.config.get('rope_scaling')})")

    def _check_tokenizer(self) -> None:
        if self.tokenizer is None and self.path is not None and has_tokenizer(self.path):
            object.__setattr__(self, "tokenizer", self.path)
        if self.tokenizer is None:
            return
        object.__setattr__(self, "tokenizer", Path(self.tokenizer).expanduser().resolve())
        size = len(self.load_tokenizer())
        if size > self.vocab_size:
            _fail("tokenizer", str(self.tokenizer),
                  f"a tokenizer whose vocabulary fits the model's vocab_size={self.vocab_size}; it has {size} tokens")

    def load_tokenizer(self):
        from baige_ray.models.tokenizer import load_tokenizer

        if self.tokenizer is None:
            raise ValueError(f"HFModel {self.name} has no tokenizer: pass tokenizer=DIRECTORY")
        return load_tokenizer(self.tokenizer, trust_remote_code=self.trust_remote_code)

    def transformers_config(self):
        """The transformers config object (float32 training weights, SDPA attention)."""
        from transformers import AutoConfig

        values = {key: value for key, value in self.config.items() if key not in ("model_type", "transformers_version")}
        config = AutoConfig.for_model(SUPPORTED_ARCHITECTURES[self.architecture], **values)
        config._attn_implementation = "sdpa"
        return config
