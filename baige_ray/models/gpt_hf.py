"""The reference GPT in Hugging Face's GPT-2 format, so transformers and vLLM run it as `GPT2LMHeadModel`.

The reference GPT is GPT-2's architecture with exact GELU and an untied LM head: learned
positions, pre-norm LayerNorm blocks, biased projections, 1/sqrt(head_dim) attention. Only the
parameter layout differs: GPT-2 keeps q, k and v as one fused `c_attn` projection and stores its
projections as Conv1D weights, (in, out) where a Linear's are (out, in). The conversion is exact.
MoE variants have no GPT-2 counterpart.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from baige_ray.models.gpt import GPTConfig

_BLOCK_RENAMES = {  # ours -> GPT-2's, inside block i ("transformer.h.{i}.")
    "attn_norm": "ln_1",
    "mlp_norm": "ln_2",
    "attn.o_proj": "attn.c_proj",
    "mlp.up": "mlp.c_fc",
    "mlp.down": "mlp.c_proj",
}
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def check_gpt2_compatible(config: GPTConfig) -> None:
    if config.moe is not None:
        raise ValueError("GPTConfig.moe is set: a mixture-of-experts GPT has no GPT-2 equivalent for "
                         "Hugging Face or vLLM (serve it with engine='builtin')")


def gpt2_config_dict(config: GPTConfig) -> dict:
    """config.json of the equivalent `GPT2LMHeadModel`."""
    check_gpt2_compatible(config)
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.seq_len,
        "n_embd": config.hidden,
        "n_layer": config.num_layers,
        "n_head": config.num_heads,
        "n_inner": config.mlp_hidden,
        "activation_function": "gelu",  # exact erf GELU, as F.gelu
        "layer_norm_epsilon": 1e-5,  # nn.LayerNorm's default
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "tie_word_embeddings": False,
        "scale_attn_weights": True,
        "bos_token_id": None, "eos_token_id": None,  # byte-level: no end-of-text token
        "torch_dtype": "float32",
    }


def to_gpt2_weights(weights: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Canonical GPT weights (`GPT.state_dict()` names) under GPT-2's names and layout."""
    check_gpt2_compatible(config)
    converted = {
        "transformer.wte.weight": weights["token_embedding.weight"],
        "transformer.wpe.weight": weights["position_embedding.weight"],
        "transformer.ln_f.weight": weights["final_norm.weight"],
        "transformer.ln_f.bias": weights["final_norm.bias"],
        "lm_head.weight": weights["lm_head.weight"],
    }
    for index in range(config.num_layers):
        ours, theirs = f"blocks.{index}.", f"transformer.h.{index}."
        for kind in ("weight", "bias"):
            converted[f"{theirs}attn.c_attn.{kind}"] = torch.cat(
                [weights[f"{ours}attn.{proj}.{kind}"] for proj in ("q_proj", "k_proj", "v_proj")])
            for old, new in _BLOCK_RENAMES.items():
                converted[f"{theirs}{new}.{kind}"] = weights[f"{ours}{old}.{kind}"]
        for name in _CONV1D:
            converted[theirs + name] = converted[theirs + name].t()
    return {name: tensor.contiguous() for name, tensor in converted.items()}


def _byte_level_alphabet() -> dict[int, str]:
    """The character GPT-2's byte-level alphabet writes each byte as: printable Latin-1 bytes stand for
    themselves, the 68 others take the code points from 256 on, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)}
    stand_ins = iter(range(256, 512))
    return {byte: chr(byte) if byte in printable else chr(next(stand_ins)) for byte in range(256)}


def byte_tokenizer():
    """A Hugging Face fast tokenizer whose token ids are the text's UTF-8 bytes, as the GPT reads it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # ByteLevel writes each byte as a printable character; the vocabulary maps that character back to it.
    vocab = {character: byte for byte, character in _byte_level_alphabet().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, clean_up_tokenization_spaces=False)


def write_gpt2_directory(directory: Path, config: GPTConfig,
                         weights: dict[str, torch.Tensor] | None = None) -> Path:
    """config.json and the byte tokenizer (and model.safetensors when `weights` are given) of the GPT
    as a GPT-2 model."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(gpt2_config_dict(config), indent=2))
    byte_tokenizer().save_pretrained(directory)
    if weights is not None:
        tensors = {name: tensor.detach().to("cpu", torch.float32)
                   for name, tensor in to_gpt2_weights(weights, config).items()}
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory
