"""Prefill without decode, and the hand-off to a decode engine: prefill/decode disaggregation.

A `PrefillEngine` only runs prompts. Each step takes up to `max_batch_size` waiting requests and runs
one forward per distinct prompt length over every prompt of that length (equal lengths need no
padding, so rows change each other's numbers at most by summation order, as in the decode batch); a
prompt whose log-probabilities were asked for runs alone and whole, every position's logits kept.
It samples each request's first token with the request's own seeded generator and hands the request
on as a `PrefilledRequest`: that token, the prompt's cache, and the generator's state after it. A
decode engine (`ContinuousBatchingEngine.submit_prefilled`) puts the cache straight into its running
batch and resumes the generator, so the request gets the tokens one colocated engine would give it.

A hand-off holds only CPU tensors, ints and the sampling params, so it travels through Ray's object
store to a decode replica in another process or on another node.

With prefix caches (serving/kv_blocks.py) on both sides, the decode side says how many leading tokens
its own cache holds (`known_tokens`) and the hand-off carries keys and values only after them
(`kv_from`); the decode engine takes the rest from its blocks. The prefill engine then runs each prompt
on its own, from the first token after the blocks its own cache holds, and keeps the prompt's blocks.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from baige_ray.models.generation import KVDecoder, seeded_generator
from baige_ray.models.weights_in_place import copy_weights_in_place
from baige_ray.serving.causal_lm_generation import FinishReason, Generation, SamplingParams
from baige_ray.serving.context_length import require_fit
from baige_ray.serving.engine import (
    ContinuousBatchingEngine,
    EngineLimits,
    GenerationCollector,
    PrefilledRequest,
    RequestQueue,
)
from baige_ray.serving.kv_blocks import PrefixBlockStore
from baige_ray.serving.row_sampling import sample_rows
from baige_ray.serving.sampling_params import require_implemented, stops_at
from baige_ray.serving.token_logprobs import PromptLogprobs, prompt_logprobs

PrefillSink = Callable[[PrefilledRequest], None]


@dataclass(kw_only=True)
class _Prompt:
    id: int
    tokens: list[int]
    params: SamplingParams
    budget: int
    on_prefilled: PrefillSink
    known_tokens: int = 0  # leading tokens the receiving engine's prefix cache holds: not sent
    generator: torch.Generator | None = None  # set when its first token is sampled

    @property
    def prompt(self) -> list[int]:  # a row to sample (models/logits_processing.py)
        return self.tokens

    @property
    def sampled(self) -> list[int]:
        return []


class PrefillEngine:
    """`submit` and `cancel` from any thread, `step` from one (engine_runner.py); `on_prefilled` runs on
    the stepping thread and must not block."""

    def __init__(self, decoder: KVDecoder, *, eos_token_id: int | None, limits: EngineLimits = EngineLimits(),
                 prefixes: PrefixBlockStore | None = None):
        self.decoder, self.eos_token_id, self.limits = decoder, eos_token_id, limits
        self.prefixes = prefixes
        self._queue: RequestQueue[_Prompt] = RequestQueue(limits.max_waiting)
        self._num_prefilling = 0

    def load_weights(self, weights: dict[str, torch.Tensor], prefixes: PrefixBlockStore | None = None) -> None:
        """New weights of the model it runs, copied in between two steps (the engine's thread), and
        `prefixes` as the cache of the new weights."""
        copy_weights_in_place(self.decoder.model, weights)
        self.prefixes = prefixes

    def submit(self, prompt: Sequence[int], params: SamplingParams, on_prefilled: PrefillSink,
               known_tokens: int = 0) -> int:
        """Queue a prompt; returns its id. `known_tokens` leading tokens' keys and values are not sent (the
        receiver holds them). Raises EngineFull when `max_waiting` are already queued, and ValueError when
        the prompt and its new tokens do not fit the context (it is never cut) or it asks for sampling this
        engine does not implement."""
        if not prompt:
            raise ValueError("the prompt is empty: a request needs at least one token")
        if not 0 <= known_tokens < len(prompt):
            raise ValueError(f"known_tokens={known_tokens} is invalid: expected 0 to {len(prompt) - 1} (the prompt's "
                             "last token is always run here)")
        require_fit(len(prompt), params.max_new_tokens, self.decoder.max_context)
        require_implemented(params, "builtin")
        request = _Prompt(id=self._queue.next_id(), tokens=list(prompt), params=params, on_prefilled=on_prefilled,
                          budget=params.max_new_tokens, known_tokens=known_tokens)
        self._queue.put(request)
        return request.id

    def cancel(self, request_id: int) -> None:
        self._queue.cancel(request_id)

    @property
    def num_waiting(self) -> int:
        return len(self._queue)

    @property
    def num_running(self) -> int:
        """Prompts in the step running now."""
        return self._num_prefilling

    @property
    def max_context(self) -> int:
        return self.decoder.max_context

    @property
    def context_limit(self) -> None:
        """Nothing below the model's context: the decode replica, which holds the keys and values, bounds them."""
        return None

    def wait_for_work(self, timeout_s: float) -> None:
        self._queue.wait(timeout_s, busy=False)

    def interrupt_wait(self) -> None:
        self._queue.interrupt()

    def step(self) -> bool:
        """Prefill up to `max_batch_size` waiting prompts; False when none was waiting."""
        self._queue.take_cancelled()
        batch: list[_Prompt] = []
        while len(batch) < self.limits.max_batch_size and (request := self._queue.take()) is not None:
            batch.append(request)
        self._num_prefilling = len(batch)
        try:
            scored = [request for request in batch if request.params.prompt_logprobs is not None]
            for request in scored:  # every position's logits: no cached prefix, no group
                self._prefill_scored(request)
            batch = [request for request in batch if request.params.prompt_logprobs is None]
            if self.prefixes is not None:  # each from where its cached prefix ends
                for request in batch:
                    self._prefill_cached(request)
            else:
                groups: dict[int, list[_Prompt]] = defaultdict(list)
                for request in batch:
                    groups[len(request.tokens)].append(request)
                for group in groups.values():
                    self._prefill(group)
        finally:
            self._num_prefilling = 0
        return bool(batch)

    def _prefill(self, group: list[_Prompt]) -> None:
        rows, length = len(group), len(group[0].tokens)
        tokens = torch.tensor([request.tokens for request in group], dtype=torch.long)
        logits, cache = self.decoder.forward(tokens, torch.arange(length).repeat(rows, 1),
                                             torch.ones(rows, length, dtype=torch.long), None)
        for row, request in enumerate(group):
            self._hand_off(request, logits[row], cache, row)

    def _prefill_cached(self, request: _Prompt) -> None:
        length = len(request.tokens)
        past, cached = self.prefixes.cached_prefix(request.tokens)
        logits, cache = self.decoder.forward(torch.tensor([request.tokens[cached:]], dtype=torch.long),
                                             torch.arange(cached, length)[None, :],
                                             torch.ones(1, length, dtype=torch.long), past)
        self._hand_off(request, logits[0], cache, 0)  # before the blocks are kept: the first token waits on it
        self.prefixes.keep_tokens(request.tokens, cache)
        self.prefixes.settle()

    def _prefill_scored(self, request: _Prompt) -> None:
        """A prompt whose log-probabilities were asked for: run whole, every position's logits kept."""
        length = len(request.tokens)
        logits, cache = self.decoder.forward(torch.tensor([request.tokens], dtype=torch.long),
                                             torch.arange(length)[None, :], torch.ones(1, length, dtype=torch.long),
                                             None, all_positions=True)
        scores = prompt_logprobs(logits[0], request.tokens, request.params.prompt_logprobs)
        self._hand_off(request, logits[0, -1], cache, 0, scores)
        if self.prefixes is not None:
            self.prefixes.keep_tokens(request.tokens, cache)
            self.prefixes.settle()

    def _hand_off(self, request: _Prompt, logits: torch.Tensor, cache, row: int,
                  scores: PromptLogprobs | None = None) -> None:
        request.generator = seeded_generator(request.params.seed)
        (first,) = sample_rows(logits[None], [request], self.eos_token_id)
        token, generator = first.token, request.generator
        finish: FinishReason | None = "stop" if stops_at(request.params, token, self.eos_token_id) else None
        if finish is None and request.budget <= 1:
            finish = "length"
        start = request.known_tokens
        # Copies, not views: a row sliced from the group's cache would carry the whole group's storage.
        kv = [] if finish else [(_own_row(keys, row, start), _own_row(values, row, start)) for keys, values in cache]
        request.on_prefilled(PrefilledRequest(
            params=request.params, prompt_length=len(request.tokens), budget=request.budget, first_token=token,
            finish_reason=finish, kv=kv, generator_state=generator.get_state(), prompt=tuple(request.tokens),
            kv_from=0 if finish else start, first_log_prob=first.log_prob, first_logprobs=first.logprobs,
            prompt_logprobs=scores,
        ))


def _own_row(tensor: torch.Tensor, row: int, start: int) -> torch.Tensor:
    return tensor[row : row + 1, :, start:].to("cpu", copy=True)


def generate_disaggregated(prefill: PrefillEngine, decode: ContinuousBatchingEngine, prompts: Sequence[Sequence[int]],
                           params: Sequence[SamplingParams],
                           hand_offs: list[PrefilledRequest] | None = None) -> list[Generation]:
    """Prefill on one engine, decode on the other, on the calling thread (tests): a prefill step's
    requests join the decode batch while earlier ones are decoding. Each hand-off is appended to
    `hand_offs` when given."""
    collector = GenerationCollector(len(prompts))

    def hand_off(index: int) -> PrefillSink:
        def on_prefilled(prefilled: PrefilledRequest) -> None:
            if hand_offs is not None:
                hand_offs.append(prefilled)
            sink = collector.sink(index)
            for event in prefilled.first_events():
                sink(event)
            if prefilled.finish_reason is None:
                decode.submit_prefilled(prefilled, sink)
        return on_prefilled

    for index, (prompt, request_params) in enumerate(zip(prompts, params)):
        prefill.submit(prompt, request_params, hand_off(index), known_tokens=decode.known_prefix_tokens(prompt))
    while prefill.step() | decode.step():  # `|`, not `or`: both engines step every round
        pass
    return collector.generations()
