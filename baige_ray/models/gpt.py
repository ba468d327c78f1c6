"""A small decoder-only GPT, the reference model of baige-ray.

Attention and MLP projections are separate Linear layers (q, k, v, o; up, down)
so that tensor parallelism can shard them column- and row-wise by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from baige_ray.api.validation import require_int, require_number
from baige_ray.models.moe import MoEConfig, MoELayer


@dataclass(kw_only=True, frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 128
    num_layers: int = 4
    num_heads: int = 4
    hidden: int = 128
    ffn_hidden: int | None = None
    dropout: float = 0.0
    moe: MoEConfig | None = None  # routed experts in place of the dense MLP (after moe.num_dense_layers blocks)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "num_layers", "num_heads", "hidden"):
            require_int("GPTConfig", name, getattr(self, name), minimum=1)
        if self.ffn_hidden is not None:
            require_int("GPTConfig", "ffn_hidden", self.ffn_hidden, minimum=1)
        if self.hidden % self.num_heads != 0:
            raise ValueError(
                f"GPTConfig.hidden={self.hidden!r} is invalid: expected a multiple of num_heads={self.num_heads}"
            )
        require_number("GPTConfig", "dropout", self.dropout, minimum=0, maximum=1)
        if isinstance(self.moe, dict):  # as a checkpoint's JSON manifest holds it
            object.__setattr__(self, "moe", MoEConfig(**self.moe))
        if self.moe is not None and not isinstance(self.moe, MoEConfig):
            raise ValueError(f"GPTConfig.moe={self.moe!r} is invalid: expected a MoEConfig or None")

    def is_moe_layer(self, index: int) -> bool:
        return self.moe is not None and index >= self.moe.num_dense_layers

    @property
    def mlp_hidden(self) -> int:
        return self.ffn_hidden if self.ffn_hidden is not None else 4 * self.hidden

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden, config.hidden)
        self.k_proj = nn.Linear(config.hidden, config.hidden)
        self.v_proj = nn.Linear(config.hidden, config.hidden)
        self.o_proj = nn.Linear(config.hidden, config.hidden)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 for the head count keeps this correct when tensor parallelism shards the heads.
        q, k, v = (
            proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.o_proj(y.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.up = nn.Linear(config.hidden, config.mlp_hidden)
        self.down = nn.Linear(config.mlp_hidden, config.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, index: int):
        super().__init__()
        self.attn_norm = nn.LayerNorm(config.hidden)
        self.attn = CausalSelfAttention(config)
        self.mlp_norm = nn.LayerNorm(config.hidden)
        if config.is_moe_layer(index):
            self.mlp = MoELayer(config.hidden, config.mlp_hidden, config.moe, num_layers=config.num_layers)
        else:
            self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.hidden)
        self.position_embedding = nn.Embedding(config.seq_len, config.hidden)
        self.blocks = nn.ModuleList(Block(config, index) for index in range(config.num_layers))
        self.final_norm = nn.LayerNorm(config.hidden)
        self.lm_head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        # GPT-2 scaling of residual projections keeps activations bounded as depth grows.
        for name, param in self.named_parameters():
            if name.endswith(("o_proj.weight", "down.weight")):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.num_layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.final_norm(x))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def language_model_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def generate(
    model: GPT,
    prompt: torch.Tensor,
    num_new_tokens: int,
    *,
    temperature: float = 0.8,
    top_k: int | None = 40,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Sample continuations of `prompt` (batch, time) autoregressively."""
    model.eval()
    tokens = prompt
    for _ in range(num_new_tokens):
        window = tokens[:, -model.config.seq_len :]
        logits = model(window)[:, -1, :] / max(temperature, 1e-5)
        if top_k is not None:
            kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1, None]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        next_token = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
        tokens = torch.cat([tokens, next_token], dim=1)
    return tokens
