"""Fault injection for serving: a reference GPT whose engine raises mid-request, on a prompt's cue.

`FaultyGPTConfig` is a `GPTConfig` with its own plug-in, so any process that unpickles it (a Serve
replica reading the application's registry) builds `FaultyGPTDecoder`, the real GPT decoder with a
fault: a prompt holding POISON (a byte no other prompt holds) arms it when the prompt is prefilled,
and the forward `fail_after` forwards later raises FaultInjected, inside the engine's step. So the
poisoned request and any request decoding beside it are mid-generation when the engine fails, and
requests without POISON are served normally (by a replacement replica, say). With `fail_always`
every forward raises: a model the engine cannot run, whose replica fails its warm-up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from baige_ray.models.generation import KV
from baige_ray.models.gpt import GPTConfig
from baige_ray.models.gpt_decoding import GPTDecoder
from baige_ray.models.gpt_plugin import GPTPlugin
from baige_ray.models.plugin import register_model

POISON = "\x07"  # BEL, one byte: one token for the GPT's byte codec
FAULT_MESSAGE = "injected engine fault"


class FaultInjected(RuntimeError):
    pass


@dataclass(kw_only=True, frozen=True)
class FaultyGPTConfig(GPTConfig):
    fail_after: int = 0  # forwards that still run once a POISON prompt is prefilled (its prefill included)
    fail_always: bool = False  # every forward raises


class FaultyGPTDecoder(GPTDecoder):
    def __init__(self, model, config: FaultyGPTConfig):
        super().__init__(model)
        self.fault = config
        self.forwards_left: int | None = None  # armed: forwards before one raises
        self.num_faults = 0

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                past: KV | None) -> tuple[torch.Tensor, KV]:
        if self.fault.fail_always:
            self._raise("this model raises in every forward")
        if past is None and self.forwards_left is None and bool((input_ids == ord(POISON)).any()):
            self.forwards_left = self.fault.fail_after
        if self.forwards_left is not None:
            if self.forwards_left == 0:
                self.forwards_left = None
                self._raise(f"a poisoned prompt was prefilled {self.fault.fail_after} forwards ago")
            self.forwards_left -= 1
        return super().forward(input_ids, position_ids, attention_mask, past)

    def _raise(self, why: str) -> None:
        self.num_faults += 1
        raise FaultInjected(f"{FAULT_MESSAGE}: {why}")


@register_model(FaultyGPTConfig)
class FaultyGPTPlugin(GPTPlugin):
    config: FaultyGPTConfig

    def build_decoder(self, weights: dict[str, torch.Tensor]):
        return FaultyGPTDecoder(self.build_inference_model(weights), self.config)
