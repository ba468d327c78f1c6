"""Batched sampling: a request's tokens do not depend on what it was batched with."""

from __future__ import annotations

import torch

from baige_ray.models.gpt import GPT, GPTConfig
from baige_ray.models.gpt_decoding import decode_tokens, encode_prompt, generate_batch
from baige_ray.serving.requests import GenerateRequest

CONFIG = GPTConfig(seq_len=16, num_layers=1, num_heads=2, hidden=16)


def model() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG)


def request(prompt: str, new: int = 5, temperature: float = 1.0, seed: int | None = 1) -> GenerateRequest:
    return GenerateRequest(prompt=prompt, max_new_tokens=new, temperature=temperature, seed=seed)


def test_batched_results_equal_one_request_at_a_time():
    gpt = model()
    batch = [request("def ", 5, seed=1), request("import os", 3, seed=2), request("abc ", 7, 0.5, seed=3),
             request("class", 4, 0.0, seed=None)]
    together = generate_batch(gpt, batch)
    alone = [generate_batch(gpt, [r])[0] for r in batch]
    assert together == alone
    assert [len(tokens) for tokens in together] == [5, 3, 7, 4]


def test_seed_fixes_the_sample_and_other_seeds_differ():
    gpt = model()
    first = generate_batch(gpt, [request("x", 12, seed=5)])[0]
    assert generate_batch(gpt, [request("x", 12, seed=5)])[0] == first
    others = {tuple(generate_batch(gpt, [request("x", 12, seed=s)])[0]) for s in range(6, 10)}
    assert others != {tuple(first)}


def test_zero_temperature_is_greedy():
    gpt = model().eval()
    tokens = generate_batch(gpt, [request("def f", 4, temperature=0.0, seed=None)])[0]
    context = torch.tensor([encode_prompt("def f", CONFIG.seq_len)])
    for token in tokens:
        assert token == int(gpt(context)[0, -1].argmax())
        context = torch.cat([context, torch.tensor([[token]])], dim=1)


def test_prompt_longer_than_the_window_keeps_its_tail():
    assert encode_prompt("é" * 20, 16) == list(("é" * 20).encode())[-16:]
    assert len(generate_batch(model(), [request("y" * 40, 3)])[0]) == 3


def test_decode_replaces_invalid_utf8():
    assert decode_tokens([104, 105]) == "hi"
    assert decode_tokens([0xC3]) == "" and decode_tokens([0xFF, 0x41]) == "\ufffdA"  # unfinished; invalid
