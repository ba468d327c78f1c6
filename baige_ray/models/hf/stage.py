"""Pipeline stages of a Hugging Face causal LM that keep its own parameter names.

The module names come from the model's pipeline plan in transformers (`base_model_pp_plan`:
embedding, decoder layers, final norm; the head's `_pp_plan`), under the base model's prefix, so a
stage's parameters are called exactly as in the checkpoint (`model.layers.7.mlp.up_proj.weight`):
state moves between layouts, and into `save_pretrained` directories, by name. Decoder layers sit in a
ModuleDict keyed by their global index. Every stage holds the rotary embedding (buffers only).

A model that ties its head to its input embedding (`tie_word_embeddings`) keeps the tie in every stage
that holds the head: the last stage holds the embedding module too (not called in its forward), its
head's weight is the embedding's, and so both stages call the one weight `model.embed_tokens.weight`,
as the checkpoint does. The engine sums the two stages' gradients of it (Megatron-LM's embedding group).

Under tensor parallelism the embedding and the head are split by vocabulary rows (Megatron-LM's
vocabulary-parallel embedding): each rank looks up the tokens in its rows and the partial embeddings
are summed; the head computes its rows' logits, gathered for the loss. A tied pair shares one shard.
"""

from __future__ import annotations

import torch
from torch import nn

from baige_ray.parallel import context_parallel


def pipeline_module_names(causal_lm: nn.Module) -> tuple[str, str, str, str, str]:
    """(base prefix, embedding, layers, final norm, head) from the model's transformers pipeline plan."""
    config = causal_lm.config
    plan = list(getattr(config, "base_model_pp_plan", None) or {})
    head_plan = list(getattr(type(causal_lm), "_pp_plan", None) or {})
    if len(plan) != 3 or len(head_plan) != 1:
        raise ValueError(f"{type(causal_lm).__name__} has no transformers pipeline plan of embedding, layers, norm "
                         f"and head (base_model_pp_plan={plan}, _pp_plan={head_plan})")
    embedding, layers, norm = plan
    return causal_lm.base_model_prefix, embedding, layers, norm, head_plan[0]


class DecoderStage(nn.Module):
    """Decoder layers [first, last) plus the embedding (first stage) or the final norm and head (last)."""

    def __init__(self, causal_lm: nn.Module, first_layer: int, last_layer: int, *, is_first: bool, is_last: bool,
                 tied: bool = False):
        super().__init__()
        prefix, embedding, layers, norm, head = pipeline_module_names(causal_lm)
        base = getattr(causal_lm, prefix)
        self.config = causal_lm.config
        self.is_first, self.is_last = is_first, is_last
        self._names = (prefix, embedding, layers, norm, head)
        parts = nn.Module()
        self.tied = tied
        if is_first or (tied and is_last):
            parts.add_module(embedding, getattr(base, embedding))
        parts.add_module(layers, nn.ModuleDict({str(i): getattr(base, layers)[i] for i in range(first_layer, last_layer)}))
        parts.add_module("rotary_emb", base.rotary_emb)
        if is_last:
            parts.add_module(norm, getattr(base, norm))
        self.add_module(prefix, parts)
        if is_last:
            self.add_module(head, getattr(causal_lm, head))
        self._layer_types = list(getattr(self.config, "layer_types", None) or [])
        if not self._layer_types and getattr(self.config, "sliding_window", None):
            # Mistral, Mixtral, Qwen3-MoE: without layer_types, a window set in the config masks every layer
            self._layer_types = ["sliding_attention"] * self.config.num_hidden_layers
        self.router_loss = None  # a RouterBalanceLoss (moe.py) when the model adds its router's load-balancing loss
        self.tie_embeddings()

    def tie_embeddings(self) -> None:
        """Make the head's weight the input embedding's again (after materialising from the meta device,
        which gives every module a parameter of its own)."""
        if self.tied and self.is_last:
            _, embedding, _, _, head = self._names
            getattr(self, head).weight = getattr(self.base, embedding).weight

    def shard_vocabulary(self, tp_mesh) -> None:
        """Split the embedding and the head this stage holds by vocabulary rows over `tp_mesh`."""
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        prefix, embedding, _, _, head = self._names
        plan = {}
        if self.is_first or (self.tied and self.is_last):
            plan[f"{prefix}.{embedding}"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        if self.is_last:
            plan[head] = ColwiseParallel(output_layouts=Replicate())
        parallelize_module(self, tp_mesh, plan)
        self.tie_embeddings()  # parallelize_module gave the head a sharded weight of its own

    @property
    def tied_embedding(self) -> nn.Parameter | None:
        """The input embedding's weight, which the head shares, if this stage holds either."""
        if not (self.tied and (self.is_first or self.is_last)):
            return None
        return getattr(self.base, self._names[1]).weight

    @property
    def base(self) -> nn.Module:
        return getattr(self, self._names[0])

    @property
    def layers(self) -> nn.ModuleDict:
        return getattr(self.base, self._names[2])

    def as_causal_lm(self) -> nn.Module:
        """The transformers causal LM made of this stage's own modules, where the stage holds the whole
        model: generation with transformers' forward and cache on the training weights, nothing copied
        (the optimizer's in-place updates show at once). Built on the meta device, then every module of
        it replaced by the stage's; its config is a copy (generation may change it)."""
        import copy

        from transformers import AutoModelForCausalLM

        prefix, embedding, layers, norm, head = self._names
        num_layers = self.config.num_hidden_layers
        if not (self.is_first and self.is_last) or sorted(map(int, self.layers)) != list(range(num_layers)):
            raise ValueError(f"a stage of layers {sorted(map(int, self.layers))} is not the whole model of "
                             f"{num_layers} layers: only a rank holding all of it generates with it")
        with torch.device("meta"):
            causal_lm = AutoModelForCausalLM.from_config(copy.deepcopy(self.config))
        base = getattr(causal_lm, prefix)
        setattr(base, embedding, getattr(self.base, embedding))
        setattr(base, layers, nn.ModuleList(self.layers[str(i)] for i in range(num_layers)))
        setattr(base, norm, getattr(self.base, norm))
        base.rotary_emb = self.base.rotary_emb
        setattr(causal_lm, head, getattr(self, head))
        left = [name for name, tensor in [*causal_lm.named_parameters(), *causal_lm.named_buffers()] if tensor.is_meta]
        if left:
            raise ValueError(f"{type(causal_lm).__name__} has modules a pipeline stage does not hold: {left[:5]}")
        return causal_lm

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (first stage) or hidden states in; `positions`, each token's position in its document
        where a sequence packs several (restarting at 0 at each): rotary embeddings follow them and
        transformers' masks then keep attention inside each document."""
        _, embedding, _, norm, head = self._names
        hidden = getattr(self.base, embedding)(x) if self.is_first else x
        if positions is None:
            positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        position_embeddings = self.base.rotary_emb(hidden, positions)
        # Under context parallelism the attention masks by global position across the group itself.
        masks = self._masks(hidden, positions) if context_parallel.active() is None else {}
        for index, layer in self.layers.items():
            kind = self._layer_types[int(index)] if self._layer_types else "full_attention"
            hidden = layer(hidden, attention_mask=masks.get(kind), position_ids=positions,
                           position_embeddings=position_embeddings)
        if not self.is_last:
            return hidden
        logits = getattr(self, head)(getattr(self.base, norm)(hidden))
        return self.router_loss.attach(logits) if self.router_loss is not None else logits

    def _masks(self, hidden: torch.Tensor, positions: torch.Tensor) -> dict:
        """transformers' own causal masks (None where SDPA's is_causal suffices), sliding windows included."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        arguments = {"config": self.config, "inputs_embeds": hidden, "attention_mask": None,
                     "past_key_values": None, "position_ids": positions}
        masks = {"full_attention": create_causal_mask(**arguments)}
        if "sliding_attention" in self._layer_types:
            masks["sliding_attention"] = create_sliding_window_causal_mask(**arguments)
        return masks
