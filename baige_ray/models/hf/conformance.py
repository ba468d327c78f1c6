"""A conformance matrix over the architectures the README claims: one published config.json per architecture.

`examples/models/` (shipped as `baige_ray.published`) holds each checkpoint's config.json exactly as published (citations in
examples/models/SOURCES.md). `shrink_config` turns one into a model of a few hundred thousand parameters
that keeps every flag (tied embeddings, rope kind, biases, Q/K norms, sliding windows, head_dim set apart,
shared experts, top-k renormalisation, dense layers between sparse ones) and changes sizes only, so a tiny
model exercises the same code paths as the real one. `flags_of` names those flags, for a support table.
Pure Python + transformers; no Ray.
"""

from __future__ import annotations

import copy
import json

from baige_ray.catalog import PUBLISHED_PACKAGE, shipped_folder

MODELS_DIR = shipped_folder(PUBLISHED_PACKAGE)

# One published checkpoint per supported architecture; together they cover every flag `flags_of` reports.
PUBLISHED_CONFIGS: dict[str, str] = {
    "LlamaForCausalLM": "llama-3.2-1b.json",  # tied embeddings, llama3 rope scaling
    "MistralForCausalLM": "mistral-7b-v0.1.json",  # sliding window 4096
    "Qwen2ForCausalLM": "qwen2.5-0.5b.json",  # implicit q/k/v bias, tied, use_sliding_window false
    "Qwen3ForCausalLM": "qwen3-0.6b.json",  # Q/K norms, head_dim 128 != 1024/16, tied
    "MixtralForCausalLM": "mixtral-8x7b-v0.1.json",  # 8 experts top-2 (always renormalised)
    "Qwen2MoeForCausalLM": "qwen1.5-moe-a2.7b.json",  # shared expert, norm_topk_prob false, qkv bias
    "Qwen3MoeForCausalLM": "qwen3-30b-a3b.json",  # norm_topk_prob true, head_dim apart, Q/K norms
}
# Flags no per-architecture pick carries: no Qwen-org checkpoint ships yarn in its config.json (the Qwen2.5
# and Qwen3 model cards tell users to add it), so yarn comes from a published Llama-family checkpoint.
EXTRA_CONFIGS: dict[str, str] = {"yarn-llama-2-13b-64k.json": "LlamaForCausalLM"}

TINY = {"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128, "num_hidden_layers": 4,
        "max_position_embeddings": 256}
# Three distinct widths (dense 128, routed 64, shared 96): a module built with the wrong one fails to load.
TINY_MOE = {"moe_intermediate_size": 64, "shared_expert_intermediate_size": 96}
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
# The keys shrink_config may change; every other published key is kept exactly.
SIZE_KEYS = frozenset({*TINY, *TINY_MOE, *EXPERT_COUNT_KEYS, *TOKEN_ID_KEYS, "vocab_size", "num_key_value_heads",
                       "head_dim", "num_experts_per_tok", "sliding_window", "max_window_layers", "layer_types",
                       "mlp_only_layers", "decoder_sparse_step", "first_k_dense_replace", "rope_scaling",
                       "rope_parameters"})


def load_published(name: str) -> dict:
    """A published config.json from examples/models/ (package data), by file name or architecture name."""
    return json.loads((MODELS_DIR / PUBLISHED_CONFIGS.get(name, name)).read_text())


def _scale_index(i: int, layers: int, n: int) -> int:
    return min(n - 1, i * n // layers)


def shrink_config(published: dict, *, vocab_size: int, bos_token_id: int | None = None,
                  eos_token_id: int | None = None, pad_token_id: int | None = None, hidden_size: int = 64,
                  window: int = 16) -> dict:
    """A tiny copy of `published`: every flag kept, sizes shrunk; `transformers.AutoConfig.for_model(**d)`
    accepts it (model_type is inside).

    hidden_size/4 heads gives head_dim 16 (vLLM's CPU attention needs 32 or more: pass hidden_size=128);
    a published head_dim set apart from hidden/heads stays apart (twice or half the natural one). Every
    non-null sliding_window becomes `window`, active or not, so a stack that applies an inactive window
    diverges; whether it is active (use_sliding_window, layer_types) is kept. Rope scaling keeps its factor,
    and original_max_position_embeddings keeps its ratio to max_position_embeddings (at least 16), so the
    scaling still changes the frequencies. Token ids are the given ones, or None where published."""
    p, d = published, copy.deepcopy(published)
    heads, layers, n = p["num_attention_heads"], p["num_hidden_layers"], TINY["num_hidden_layers"]
    d.update(TINY, hidden_size=hidden_size, vocab_size=vocab_size)
    kv = p.get("num_key_value_heads") or heads
    if "num_key_value_heads" in p:
        d["num_key_value_heads"] = TINY["num_attention_heads"] if kv == heads else (1 if kv == 1 else 2)
    natural = hidden_size // TINY["num_attention_heads"]
    if p.get("head_dim"):
        published_natural = p["hidden_size"] // heads
        d["head_dim"] = natural if p["head_dim"] == published_natural else (
            natural * 2 if p["head_dim"] > published_natural else natural // 2)
    for key in EXPERT_COUNT_KEYS:
        if p.get(key):
            d[key] = 4
    if p.get("num_experts_per_tok"):
        d["num_experts_per_tok"] = min(2, p["num_experts_per_tok"])
    for key, size in TINY_MOE.items():
        if p.get(key):
            d[key] = size
    if "max_window_layers" in p:
        mwl = p["max_window_layers"]
        scaled = round(mwl * n / layers)
        d["max_window_layers"] = min(n - 1, max(1, scaled)) if 0 < mwl < layers else min(n, scaled)
    if p.get("mlp_only_layers"):
        dense = sorted({_scale_index(i, layers, n) for i in p["mlp_only_layers"]})
        d["mlp_only_layers"] = dense[:n - 1]  # at least one sparse layer stays
    if p.get("decoder_sparse_step"):
        d["decoder_sparse_step"] = min(n, p["decoder_sparse_step"])
    if p.get("first_k_dense_replace"):
        d["first_k_dense_replace"] = min(n - 1, max(1, round(p["first_k_dense_replace"] * n / layers)))
    if p.get("layer_types"):
        kinds = [p["layer_types"][i * layers // n] for i in range(n)]
        missing = [k for k in dict.fromkeys(p["layer_types"]) if k not in kinds]
        d["layer_types"] = kinds[:n - len(missing)] + missing  # both kinds of layer stay
    for key in ("rope_scaling", "rope_parameters"):
        rope = p.get(key)
        if isinstance(rope, dict) and rope.get("original_max_position_embeddings"):
            ratio = p["max_position_embeddings"] / rope["original_max_position_embeddings"]
            d[key]["original_max_position_embeddings"] = max(16, int(TINY["max_position_embeddings"] / ratio))
    if p.get("sliding_window"):
        d["sliding_window"] = window
    for key, value in zip(TOKEN_ID_KEYS, (bos_token_id, eos_token_id, pad_token_id)):
        if value is not None or key in p:
            d[key] = value
    return d


def tiny_config(published: dict, **kwargs):
    """`shrink_config` as a transformers config object."""
    from transformers import AutoConfig
    return AutoConfig.for_model(**shrink_config(published, **kwargs))


def sparse_layers(config: dict) -> list[int] | None:
    """Indices of the MoE layers (None for a dense model), as Qwen2-MoE/Qwen3-MoE/DeepSeek place them."""
    if not any(config.get(key) for key in EXPERT_COUNT_KEYS):
        return None
    dense = set(config.get("mlp_only_layers") or ())
    step, first_k = config.get("decoder_sparse_step") or 1, config.get("first_k_dense_replace") or 0
    return [i for i in range(config["num_hidden_layers"])
            if i not in dense and (i + 1) % step == 0 and i >= first_k]


def _rope_kind(config: dict) -> str:
    for key in ("rope_scaling", "rope_parameters"):
        rope = config.get(key)
        if isinstance(rope, dict) and (rope.get("rope_type") or rope.get("type")):
            return rope.get("rope_type") or rope["type"]
    return "default"


def _sliding(config: dict) -> bool:
    if any(kind == "sliding_attention" for kind in config.get("layer_types") or ()):
        return True
    if "use_sliding_window" in config:  # the Qwen families: the window only acts when switched on
        return bool(config["use_sliding_window"] and config.get("sliding_window"))
    return bool(config.get("sliding_window"))


def flags_of(config: dict) -> dict[str, object]:
    """The flags that matter for conformance, from a published (or shrunk) config.json dict."""
    model_type, heads = config.get("model_type"), config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    sparse = sparse_layers(config)
    moe = sparse is not None
    if model_type == "qwen2":  # Qwen2 builds q/k/v with bias=True whatever the config says
        bias = True
    else:
        bias = bool(config.get("attention_bias", config.get("qkv_bias", model_type == "qwen2_moe")))
    return {
        "architecture": (config.get("architectures") or [model_type])[0],
        "tied_embeddings": bool(config.get("tie_word_embeddings", False)),
        "rope": _rope_kind(config),
        "attention_bias": bias,
        "qk_norm": model_type in ("qwen3", "qwen3_moe"),
        "attention": "MHA" if kv == heads else ("MQA" if kv == 1 else "GQA"),
        "sliding_window": _sliding(config),
        "head_dim_apart": config.get("head_dim") not in (None, config["hidden_size"] // heads),
        "moe": moe,
        "shared_experts": moe and bool(config.get("shared_expert_intermediate_size") or config.get("n_shared_experts")),
        # Mixtral renormalises the top-k router weights unconditionally
        "norm_topk_prob": (model_type == "mixtral" or bool(config.get("norm_topk_prob", False))) if moe else None,
        "dense_layers": config["num_hidden_layers"] - len(sparse) if moe else None,
    }


# The layouts the conformance test (tests/ray/test_hf_conformance.py) trains each model in, as
# `baige-ray fit --layout` writes them; tied embeddings also run ZeRO-3 and PP2xTP2 (tests/ray/test_hf_tied.py).
DENSE_LAYOUTS = ("dp=2,tp=2", "pp=2,dp=2", "pp=2,dp=2,engine=fsdp2")
MOE_LAYOUTS = ("dp=4,ep=4", "dp=2,ep=2,tp=2")
TABLE_START, TABLE_END = "<!-- conformance table: generated by baige_ray.models.hf.conformance.support_table -->", \
    "<!-- end of conformance table -->"


def _flag_words(flags: dict) -> str:
    words = [flags["attention"]]
    words += [label for key, label in (("tied_embeddings", "tied embeddings"), ("attention_bias", "QKV bias"),
                                       ("qk_norm", "Q/K norm"), ("sliding_window", "sliding window"),
                                       ("head_dim_apart", "head_dim apart"), ("shared_experts", "shared experts"))
              if flags[key]]
    if flags["rope"] != "default":
        words.append(f"rope {flags['rope']}")
    if flags["moe"]:
        words.append("norm_topk_prob" if flags["norm_topk_prob"] else "top-k not renormalised")
    return ", ".join(words)


def support_table() -> str:
    """The README's support table: each published config the conformance test runs, its flags, layouts, engines."""
    rows = ["| Architecture | Published config (tiny copy tested) | Flags | Layouts checked against one process | Engines |",
            "|---|---|---|---|---|"]
    configs = [(arch, name) for arch, name in PUBLISHED_CONFIGS.items()] + [(a, n) for n, a in EXTRA_CONFIGS.items()]
    for arch, name in configs:
        flags = flags_of(load_published(name))
        layouts = MOE_LAYOUTS if flags["moe"] else DENSE_LAYOUTS
        engines = "built-in (vLLM refused: MoE reload)" if flags["moe"] else "built-in, vLLM"
        rows.append(f"| {arch} | `{name}` | {_flag_words(flags)} | {'; '.join(layouts)} | {engines} |")
    return "\n".join([TABLE_START, *rows, TABLE_END])
