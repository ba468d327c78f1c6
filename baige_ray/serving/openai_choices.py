"""The choices of one OpenAI request, and their answers in OpenAI's shapes, whole or as streamed chunks.

vLLM fans a request with `n` > 1 out into n requests of one sample each (its ParentRequest), and so
does this server, before either engine sees it: choice `prompt_index * n + j` is a request of its own
whose seed, when the request set one, is `seed + j` (vLLM's derivation: each sample differs, and the
whole request is reproducible), unseeded otherwise. The engine prefills each prompt once for its n
samples (serving/engine.py).

Echo (completions) puts the prompt's text before the choice's, and with `logprobs` its tokens'
log-probabilities before the choice's (the first token's null); with max_tokens=0 the answer is the
prompt alone (one token was generated, and is counted, as vLLM counts it). A stream echoes with each
choice's first chunk and carries each token's log-probabilities in the chunk its text comes in. Usage
counts each prompt's tokens once and every choice's completion tokens, as vLLM's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from baige_ray.serving.generators import TextDelta, TextOutput
from baige_ray.serving.logprob_token_names import CONTEXT_TOKENS, LogprobTokenNames, TokenDecoding
from baige_ray.serving.openai_logprobs import chat_logprobs, completion_logprobs, next_text_offset
from baige_ray.serving.openai_responses import chat_choice, chat_message_choice, completion_choice
from baige_ray.serving.sampling_params import SamplingParams
from baige_ray.serving.token_logprobs import PromptLogprobs, TokenLogprobs
from baige_ray.serving.tool_calls import ToolCallRequest, ToolCallStream

SEEDS = 2**63  # a sample's seed wraps within the range a request's may take


@dataclass(frozen=True)
class Choice:
    prompt_index: int
    prompt: list[int]  # as submitted (fitted to the context)
    params: SamplingParams  # n=1
    echo_text: str = ""  # the prompt's text, when the request echoes it


def fan_out(requests: Sequence[tuple[list[int], SamplingParams]], echo_texts: Sequence[str] = ()) -> list[Choice]:
    """Each (prompt, sampling) as its n choices, in index order."""
    choices = []
    for prompt_index, (prompt, params) in enumerate(requests):
        echo_text = echo_texts[prompt_index] if echo_texts else ""
        for sample in range(params.n):
            seed = None if params.seed is None else (params.seed + sample) % SEEDS
            choices.append(Choice(prompt_index, prompt, dataclasses.replace(params, n=1, seed=seed), echo_text))
    return choices


def usage_counts(choices: Sequence[Choice], outputs: Sequence[TextOutput]) -> dict:
    prompts = {choice.prompt_index: output.prompt_tokens for choice, output in zip(choices, outputs)}
    return dict(prompt_tokens=sum(prompts.values()), completion_tokens=sum(o.completion_tokens for o in outputs))


def _tokens(entries: Sequence[TokenLogprobs]) -> list[int]:
    return [entry[0][0] for entry in entries]


@dataclass
class _Streamed:
    """What a streamed choice has sent: whether its echo, where its text offsets go on, how many of its
    tokens' log-probabilities."""

    echoed: bool = False
    text_offset: int = 0
    entries_sent: int = 0
    prompt_logprobs: PromptLogprobs | None = None
    last_generated: list[int] = dataclasses.field(default_factory=list)  # what the next chunk's names read after


class AnswerShaper:
    """The choices' answers: `whole` for a request answered at once, `chunk` for each streamed piece."""

    def __init__(self, choices: Sequence[Choice], *, chat: bool, codec: TokenDecoding, echo: bool = False,
                 echo_only: bool = False, tool_calls: ToolCallRequest | None = None):
        """`tool_calls`: a chat request's answers go through the app's tool-call parser (serving/tool_calls.py)."""
        self.choices, self.chat, self.names = list(choices), chat, LogprobTokenNames(codec)
        self.echo, self.echo_only = echo, echo_only
        self.tool_calls = tool_calls
        self._streamed = [_Streamed() for _ in self.choices]
        self._tool_streams: dict[int, ToolCallStream] = {}  # a streamed choice's parser, made at its first piece

    def whole(self, index: int, output: TextOutput) -> dict:
        """Choice `index`'s entry of the response's `choices`."""
        if self.chat and self.tool_calls is not None:
            message, finish_reason = self.tool_calls.whole(output.text, output.token_ids, output.finish_reason,
                                                           self.choices[index].prompt)
            return chat_message_choice(index, message, finish_reason, self._chat_logprobs(index, output.logprobs))
        if self.chat:
            return chat_choice(index, output.text, output.finish_reason, self._chat_logprobs(index, output.logprobs))
        entries = () if self.echo_only else output.logprobs or ()
        text = "" if self.echo_only else output.text
        if self.echo:
            return self._echoed(index, text, entries, output.prompt_logprobs, output.finish_reason)
        return completion_choice(index, text, output.finish_reason, self._completion_logprobs(index, [], entries))

    def chunk(self, index: int, piece: TextDelta | TextOutput) -> dict | None:
        """The fields of choice `index`'s chunk for `piece` (completion_chunk's or chat_chunk's), or None when
        the piece shows nothing (the generated token of an echo-only request)."""
        state = self._streamed[index]
        if isinstance(piece, TextOutput):
            entries = () if self.echo_only else (piece.logprobs or ())[state.entries_sent:]
            text, finish_reason, prompt_logprobs = "", piece.finish_reason, piece.prompt_logprobs
        elif self.echo_only:
            state.prompt_logprobs = piece.prompt_logprobs or state.prompt_logprobs
            return None
        else:
            entries, text, finish_reason, prompt_logprobs = piece.logprobs, piece.text, None, piece.prompt_logprobs
        state.entries_sent += len(entries)
        if self.chat and self.tool_calls is not None:
            return self._tool_chunk(index, piece, entries)
        if self.chat:
            delta = {"content": text} if finish_reason is None else {}
            return dict(delta=delta, finish_reason=finish_reason, index=index,
                        logprobs=self._chat_logprobs(index, entries))
        if self.echo and not state.echoed:
            state.echoed = True
            choice = self._echoed(index, text, entries, prompt_logprobs or state.prompt_logprobs, finish_reason)
        else:
            choice = completion_choice(index, text, finish_reason, self._completion_logprobs(index, [], entries))
        if choice["logprobs"] is not None:
            state.text_offset = next_text_offset(choice["logprobs"], state.text_offset)
        return dict(text=choice["text"], finish_reason=finish_reason, index=index, logprobs=choice["logprobs"])

    def _tool_chunk(self, index: int, piece: TextDelta | TextOutput, entries: Sequence[TokenLogprobs]) -> dict | None:
        """As vLLM streams through a tool-call parser: the parser's delta of each piece, none while it holds the
        text back (unless log-probabilities are to be sent); the end flushes it, with the finish reason."""
        if index not in self._tool_streams:
            self._tool_streams[index] = self.tool_calls.stream(self.choices[index].prompt)
        stream = self._tool_streams[index]
        finished = isinstance(piece, TextOutput)
        delta = stream.delta("" if finished else piece.text, () if finished else piece.token_ids, finished)
        logprobs = self._chat_logprobs(index, entries)
        if delta is None and not finished and logprobs is None:
            return None
        finish_reason = stream.finish_reason(piece.finish_reason) if finished else None
        return dict(delta=delta or {}, finish_reason=finish_reason, index=index, logprobs=logprobs)

    def _echoed(self, index: int, text: str, entries: Sequence[TokenLogprobs], prompt_logprobs: PromptLogprobs | None,
                finish_reason: str | None) -> dict:
        choice = self.choices[index]
        logprobs = None
        if choice.params.num_logprobs is not None:
            scores = prompt_logprobs or (None,) * len(choice.prompt)
            logprobs = self._completion_logprobs(index, choice.prompt, entries, scores)
        return completion_choice(index, choice.echo_text + text, finish_reason, logprobs)

    def _completion_logprobs(self, index: int, prompt: list[int], entries: Sequence[TokenLogprobs],
                             prompt_logprobs: PromptLogprobs = ()) -> dict | None:
        num_logprobs = self.choices[index].params.num_logprobs
        if num_logprobs is None:
            return None
        state = self._streamed[index]
        logprobs = completion_logprobs([*prompt, *_tokens(entries)], [*prompt_logprobs, *entries], num_logprobs,
                                       self.names, state.text_offset, num_prompt=len(prompt),
                                       generated_before=state.last_generated)
        state.last_generated = [*state.last_generated, *_tokens(entries)][-CONTEXT_TOKENS:]
        return logprobs

    def _chat_logprobs(self, index: int, entries: Sequence[TokenLogprobs] | None) -> dict | None:
        num_logprobs = self.choices[index].params.num_logprobs
        if num_logprobs is None:
            return None
        state = self._streamed[index]
        logprobs = chat_logprobs(entries or (), num_logprobs, self.names, state.last_generated)
        state.last_generated = [*state.last_generated, *_tokens(entries or ())][-CONTEXT_TOKENS:]
        return logprobs
