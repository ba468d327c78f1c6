"""Hugging Face causal LMs (Llama, Mistral, Qwen2, Qwen3) as baige-ray models."""

from baige_ray.models.hf.model import SUPPORTED_ARCHITECTURES, HFModel

__all__ = ["SUPPORTED_ARCHITECTURES", "HFModel"]
