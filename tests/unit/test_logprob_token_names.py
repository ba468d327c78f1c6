"""Log-probability entries name tokens as vLLM's server does: at a generated position, a token holding
part of a UTF-8 character is read with the generated tokens before it ("" while the character is
unfinished); an echoed prompt position reads it after the prompt's tokens but the first. Bytes are tokens
here (the reference GPT's codec)."""

from __future__ import annotations

from baige_ray.models.gpt_decoding import ByteCodec
from baige_ray.serving.logprob_token_names import LogprobTokenNames
from baige_ray.serving.openai_logprobs import chat_logprobs, completion_logprobs

NAMES = LogprobTokenNames(ByteCodec())
EURO = list("€".encode())  # three bytes: e2 82 ac


def test_a_character_split_over_generated_tokens_is_named_by_the_token_that_finishes_it():
    generated = [ord("a"), *EURO, ord("b")]
    names = [NAMES.after(generated[:i])(token) for i, token in enumerate(generated)]
    assert names == ["a", "", "", "€", "b"]
    assert NAMES.after([])(EURO[0]) == ""  # nothing generated before it: unfinished
    assert NAMES.plain(EURO[0]) == "\ufffd"  # the first prompt token's name: the token alone


def test_each_alternative_at_a_position_is_read_after_the_same_generated_tokens():
    name = NAMES.after([ord("x"), *EURO[:2]])
    assert [name(token) for token in (EURO[2], ord("y"), 0x80, 0xE2)] == ["€", "y", "₀", ""]


def test_completions_and_chat_logprobs_name_each_token_after_the_tokens_before_it_that_vllm_reads():
    tokens = [*EURO, ord("!")]
    entries = [[(token, -0.5)] for token in tokens]
    # Echoed: the prompt is the euro sign's first two bytes. The first is named alone; the second is read after
    # nothing (vLLM's context leaves the first prompt token out); the generated ones after the generated only.
    echoed = completion_logprobs([*EURO[:2], *tokens], [None, entries[1], *entries], 0, NAMES, num_prompt=2)
    assert echoed["tokens"] == ["\ufffd", "", "", "", "€", "!"]
    assert echoed["top_logprobs"][4] == {"€": -0.5} and echoed["text_offset"] == [0, 1, 1, 1, 1, 2]
    prompt = [ord("a"), *EURO]  # read after the prompt's tokens but the first
    echoed = completion_logprobs(prompt, [None, *[[(t, -1.0)] for t in EURO]], 0, NAMES, num_prompt=4)
    assert echoed["tokens"] == ["a", "", "", "€"]
    # a stream's later chunk reads its first tokens after the earlier chunk's
    later = completion_logprobs(tokens[2:], entries[2:], 0, NAMES, generated_before=tokens[:2])
    assert later["tokens"] == ["€", "!"]
    chat = chat_logprobs(entries, 1, NAMES)
    assert [entry["token"] for entry in chat["content"]] == ["", "", "€", "!"]
    assert chat["content"][2]["bytes"] == list("€".encode())
