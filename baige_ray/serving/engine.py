"""Continuous batching: requests join and leave the running batch at every step, any prompt lengths.

Each `step()` first admits waiting requests while the batch has room: a joining request's prompt
is prefilled (one forward over its tokens, its first token sampled; the prompts admitted together that
no cached block starts share one left-padded forward) and its cache joins the batch's (`PagedKVBatch`:
blocks of a pool, gathered for each forward). Then one decode forward runs over every running row's
newest token and each row samples its next one. A row that samples end-of-text, reaches its token
budget or is cancelled leaves at once, freeing its slot for the next waiting request.

Each row samples with its own seeded generator and its request's sampling fields (serving/row_sampling.py:
penalties, biases, nucleus and min-p sampling in vLLM's order, the whole batch at once), so a request's
tokens do not depend on what it shares the batch with, up to floating-point summation order. Tokens go to the
request's `on_event` callback as they are sampled (the server streams them); it runs on the
engine's thread and must not block.

With a prefix store (serving/kv_blocks.py), a prompt whose leading full blocks are cached is
prefilled from the first token after them, on top of their keys and values; the blocks of every
prompt, and of every finished request's prompt and answer, are stored for the requests after it.
The tokens a request gets do not depend on whether its prefix was cached, up to floating-point
summation order. A request asking for its prompt's log-probabilities reads no cached block (it needs
the logits of every prompt position, as vLLM skips its prefix cache for it); its blocks are stored.

With a KV memory budget (`EngineLimits.kv_cache_memory_bytes`, serving/kv_memory.py) the engine's context
is what the budget holds for one request, a longer request is refused with the numbers, a waiting request
is admitted, in arrival order, once the batch has room for it as it is, and when the rows, growing, would
pass the budget, the newest leaves the batch and is recomputed when admitted again (same tokens).

A request prefilled by another engine (serving/prefill.py: prefill/decode disaggregation) joins
with `submit_prefilled`: its cache goes straight into the batch and its generator resumes from the
state the prefill left, so it gets the tokens it would have got here.

`submit`, `submit_prefilled` and `cancel` may be called from any thread; `step` from one thread only
(engine_runner.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import torch

from baige_ray.api.validation import require_int
from baige_ray.failpoints import SAMPLING, fail_point
from baige_ray.models.generation import KV, KVDecoder, seeded_generator
from baige_ray.models.weights_in_place import copy_weights_in_place
from baige_ray.serving.causal_lm_generation import FinishReason, Generation, SamplingParams
from baige_ray.serving.chunked_prefill import ChunkedPrefill
from baige_ray.serving.context_length import require_fit
from baige_ray.serving.device_memory import ModelOffload
from baige_ray.serving.kv_batch import PagedKVBatch
from baige_ray.serving.kv_blocks import PrefixBlockStore
from baige_ray.serving.kv_memory import KVFootprint, KVMemoryBudget
from baige_ray.serving.lora_adapters import BASE, AdapterSet, rows_use
from baige_ray.serving.row_sampling import SampledToken, sample_rows
from baige_ray.serving.sampling_params import require_implemented, stops_at
from baige_ray.serving.token_logprobs import PromptLogprobs, TokenLogprobs, prompt_logprobs


@dataclass(frozen=True)
class TokenEvent:
    """A sampled token (`finish_reason` None), or the end of a request (`token` None). `log_prob` and
    `logprobs` (serving/token_logprobs.py), when the request asked for them: the sampled token's, on the
    end event the stopping token's (when one was sampled). A request's first event carries its
    `prompt_logprobs` when it asked for them."""

    token: int | None
    finish_reason: FinishReason | None = None
    # On an end event: the sampled token that ended the request (end of text, a stop token id). It is no
    # part of the answer's text, but vLLM counts it among the completion tokens, and so does usage here.
    stop_token: int | None = None
    log_prob: float | None = None
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: PromptLogprobs | None = None


EventSink = Callable[[TokenEvent], None]


@dataclass(kw_only=True, frozen=True)
class PrefilledRequest:
    params: SamplingParams
    prompt_length: int  # tokens of the prompt the cache holds
    budget: int  # new tokens the request may have, the first one included
    first_token: int  # the end-of-text token when finish_reason is "stop"
    finish_reason: FinishReason | None  # set when the first token already ended the request: nothing to decode
    kv: KV  # per layer (keys, values), each [1, kv_heads, prompt_length - kv_from, head_dim], on the CPU; empty
    # when finished
    generator_state: torch.Tensor  # the request's sampling generator after its first token
    weights_version: int = 0  # of the weights that ran the prompt (the server sets it)
    prompt: tuple[int, ...] = ()  # its tokens: the decode side keeps its blocks and those of the answer
    kv_from: int = 0  # the first position `kv` holds: the decode side had the blocks before it in its prefix cache
    first_log_prob: float | None = None  # the first token's, when the request asked for log-probabilities
    first_logprobs: TokenLogprobs | None = None  # the first token's likeliest, when the request asked for them
    prompt_logprobs: PromptLogprobs | None = None  # when the request asked for them

    def first_events(self) -> list[TokenEvent]:
        """What the client sees of the prefill: the first token, and the end if that token brought it."""
        figures = dict(log_prob=self.first_log_prob, logprobs=self.first_logprobs, prompt_logprobs=self.prompt_logprobs)
        if self.finish_reason == "stop":  # an end-of-text token is not reported as text
            return [TokenEvent(None, "stop", stop_token=self.first_token, **figures)]
        events = [TokenEvent(self.first_token, **figures)]
        if self.finish_reason == "length":
            events.append(TokenEvent(None, "length"))
        return events


class EngineFull(RuntimeError):
    """The waiting queue is full: the caller should answer 503 and ask the client to retry."""


@dataclass(kw_only=True)
class _Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    on_event: EventSink
    budget: int
    generator: torch.Generator
    generated: int = 0
    last_token: int = 0
    sampled: list[int] = field(default_factory=list)  # every token sampled, end-of-text included
    prefilled: KV | None = None  # the prompt's cache when another engine prefilled it (from position kv_from)
    kv_from: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # computed by its prefill; sent with its first event
    adapter: int = BASE  # the LoRA adapter's slot (AdapterSet), BASE for the model alone
    preempted: bool = False  # its keys and values were dropped for memory: recomputed when admitted again

    @property
    def fed_tokens(self) -> list[int]:
        """The tokens whose keys and values it holds while decoding: the prompt and all it sampled but the last."""
        return self.prompt + self.sampled[:-1]


@dataclass(kw_only=True, frozen=True)
class EngineLimits:
    max_batch_size: int = 32  # rows decoded together
    max_waiting: int = 256  # requests queued for a slot; beyond that submit raises EngineFull
    # The tokens one step runs, as vLLM's option of that name: a token of each decoding row, and a chunk of
    # a prompt longer than this (chunked_prefill.py). None: a prompt is prefilled whole, in one step (vLLM:
    # its own default budget).
    max_num_batched_tokens: int | None = None
    # Bytes the running batch's keys and values may take, as vLLM's option of that name (kv_memory.py): a
    # request that could not fit alone is refused, others wait for room or are preempted. None: no bound.
    kv_cache_memory_bytes: int | None = None

    def __post_init__(self) -> None:
        require_int("EngineLimits", "max_batch_size", self.max_batch_size, minimum=1)
        require_int("EngineLimits", "max_waiting", self.max_waiting, minimum=0)
        if self.kv_cache_memory_bytes is not None:
            require_int("EngineLimits", "kv_cache_memory_bytes", self.kv_cache_memory_bytes, minimum=1)
        if self.max_num_batched_tokens is not None:
            # vLLM's rule too: a step must hold a token of every row it may decode.
            require_int("EngineLimits", "max_num_batched_tokens", self.max_num_batched_tokens,
                        minimum=self.max_batch_size)


class _Identified(Protocol):
    id: int


RequestT = TypeVar("RequestT", bound=_Identified)


class RequestQueue(Generic[RequestT]):
    """Requests waiting for an engine's thread, and the ids of cancelled ones; safe from any thread."""

    def __init__(self, max_waiting: int):
        self.max_waiting = max_waiting
        self._waiting: deque[RequestT] = deque()
        self._cancelled: set[int] = set()
        self._work = threading.Condition(threading.Lock())
        self._interrupted = False  # work other than a request arrived (a call between steps): no idle wait
        self._ids = itertools.count()

    def __len__(self) -> int:
        return len(self._waiting)

    def next_id(self) -> int:
        return next(self._ids)

    def put(self, request: RequestT) -> None:
        """Queue a request; raises EngineFull when `max_waiting` are already queued."""
        with self._work:
            if len(self._waiting) >= self.max_waiting:
                raise EngineFull(f"{len(self._waiting)} requests are already waiting for a slot")
            self._waiting.append(request)
            self._work.notify()

    def cancel(self, request_id: int) -> None:
        with self._work:
            self._cancelled.add(request_id)
            self._work.notify()

    def take(self) -> RequestT | None:
        """The longest-waiting request, or None."""
        with self._work:
            return self._waiting.popleft() if self._waiting else None

    def put_front(self, request: RequestT) -> None:
        """Queue a request taken back from the batch ahead of every other (no bound: it was admitted once)."""
        with self._work:
            self._waiting.appendleft(request)

    def peek(self) -> RequestT | None:
        """The longest-waiting request, left in the queue, or None."""
        with self._work:
            return self._waiting[0] if self._waiting else None

    def take_cancelled(self) -> set[int]:
        """Ids cancelled since the last call; those still waiting are dropped."""
        with self._work:
            cancelled, self._cancelled = self._cancelled, set()
            if cancelled:
                self._waiting = deque(r for r in self._waiting if r.id not in cancelled)
        return cancelled

    def wait(self, timeout_s: float, *, busy: bool) -> None:
        """Sleep until a request arrives, `interrupt` is called (or `timeout_s` passes), unless `busy` or
        one is queued."""
        with self._work:
            if not self._waiting and not busy and not self._interrupted:
                self._work.wait(timeout_s)
            self._interrupted = False

    def interrupt(self) -> None:
        """End the engine thread's idle wait (now, or the next one if it is not waiting yet)."""
        with self._work:
            self._interrupted = True
            self._work.notify()


class ContinuousBatchingEngine:
    def __init__(self, decoder: KVDecoder, *, eos_token_id: int | None, limits: EngineLimits = EngineLimits(),
                 prefixes: PrefixBlockStore | None = None, adapters: AdapterSet | None = None):
        """`adapters`: the LoRA adapters requests may name (lora_adapters.py), applied per row, several in
        one batch; requests with one read and keep no prefix blocks (those hold the model's own keys)."""
        self.decoder, self.eos_token_id, self.limits = decoder, eos_token_id, limits
        self.prefixes = prefixes
        self.adapters = adapters
        self._queue: RequestQueue[_Request] = RequestQueue(limits.max_waiting)
        self._running: list[_Request] = []
        self._prefilling: deque[ChunkedPrefill] = deque()  # long prompts, a chunk a step, oldest first
        self._step_prompt_tokens = 0  # prompt tokens the current step prefilled whole (max_num_batched_tokens)
        self._cache = PagedKVBatch()
        self._offload: ModelOffload | None = None  # while asleep: its weights in host memory
        self._kv_budget = None if limits.kv_cache_memory_bytes is None else self._measured_budget()
        self.preemptions = 0  # requests taken out of the batch for memory, and recomputed later

    def _measured_budget(self) -> KVMemoryBudget:
        """The budget over what one token's keys and values take in this model, read off a one-token forward."""
        one = torch.zeros(1, 1, dtype=torch.long)
        with rows_use([BASE]), torch.no_grad():
            _, cache = self.decoder.forward(one, one, torch.ones_like(one), None)
        return KVMemoryBudget(self.limits.kv_cache_memory_bytes, KVFootprint.of(cache), self._cache.block_tokens)

    # -- taking turns with training on a device (serving/device_memory.py) ------------------------
    def sleep(self) -> int:
        """Give back the device memory an idle engine holds (the running batch's keys and values; the
        weights, moved to host memory, on an accelerator); bytes released. Between steps, idle only."""
        if self.num_running or self.num_waiting:
            raise RuntimeError(f"an engine with {self.num_running} running and {self.num_waiting} waiting requests "
                               "cannot sleep: its rollouts have not finished")
        if self._offload is not None:
            return 0
        released = self._cache.pool_bytes
        self._cache = PagedKVBatch(self._cache.block_tokens)
        self._offload = ModelOffload(self.decoder.model, self.decoder.device)
        return released + self._offload.moved_bytes

    def wake(self) -> None:
        """Its weights back on its device (at once, or at the first request that arrives)."""
        if self._offload is not None:
            self._offload.restore()
            self._offload = None

    @property
    def asleep(self) -> bool:
        return self._offload is not None

    def load_weights(self, weights: dict[str, torch.Tensor], prefixes: PrefixBlockStore | None = None) -> None:
        """New weights of the model it runs, copied in between two steps (the engine's thread), and
        `prefixes` as the cache of the new weights (the old one's blocks are of the old weights). Running
        requests go on with the new weights."""
        copy_weights_in_place(self.decoder.model, weights)
        self.prefixes = prefixes

    # -- any thread ---------------------------------------------------------------------------
    def submit(self, prompt: Sequence[int], params: SamplingParams, on_event: EventSink) -> int:
        """Queue a request (with the LoRA adapter `params.adapter` names, if any); returns its id.
        Raises EngineFull when `max_waiting` are already queued, and ValueError when the prompt and its new
        tokens do not fit the context (it is never cut), it asks for sampling this engine does not implement
        (sampling_params.py) or for an adapter it does not serve."""
        if not prompt:
            raise ValueError("the prompt is empty: a request needs at least one token")
        require_fit(len(prompt), params.max_new_tokens, self.decoder.max_context)
        self._require_memory(len(prompt), params.max_new_tokens)
        require_implemented(params, "builtin")
        adapter = params.adapter
        if adapter is not None and self.adapters is None:
            raise ValueError(f"adapter {adapter!r} is not served: this engine serves no adapters")
        request = _Request(
            id=self._queue.next_id(), prompt=list(prompt), params=params, on_event=on_event,
            budget=params.max_new_tokens, generator=seeded_generator(params.seed),
            adapter=BASE if adapter is None else self.adapters.slot_of(adapter),
        )
        self._queue.put(request)
        return request.id

    def submit_prefilled(self, prefilled: PrefilledRequest, on_event: EventSink) -> int:
        """Queue a request another engine prefilled, to decode from its second token on (its first
        token was already reported by whoever prefilled it); returns its id. Raises EngineFull."""
        if prefilled.finish_reason is not None:
            raise ValueError(f"the prefilled request already finished ({prefilled.finish_reason!r}): "
                             "there is nothing to decode")
        if prefilled.prompt_length + prefilled.budget > self.decoder.max_context:
            raise ValueError(f"a prompt of {prefilled.prompt_length} tokens and {prefilled.budget} new ones exceed "
                             f"this engine's context of {self.decoder.max_context}: the engines serve different models")
        self._require_memory(prefilled.prompt_length, prefilled.budget)
        generator = torch.Generator()
        generator.set_state(prefilled.generator_state)
        device = self.decoder.device
        request = _Request(
            id=self._queue.next_id(), prompt=list(prefilled.prompt), params=prefilled.params, on_event=on_event,
            budget=prefilled.budget, generator=generator, generated=1, last_token=prefilled.first_token,
            sampled=[prefilled.first_token], kv_from=prefilled.kv_from,
            prefilled=[(keys.to(device), values.to(device)) for keys, values in prefilled.kv],
        )
        self._queue.put(request)
        return request.id

    def cancel(self, request_id: int) -> None:
        """Stop a request (its client went away); it gets no further events."""
        self._queue.cancel(request_id)

    def known_prefix_tokens(self, prompt: Sequence[int]) -> int:
        """Leading tokens of `prompt` whose keys and values this engine's prefix cache holds: a prefill
        engine need not send those (any thread)."""
        return 0 if self.prefixes is None else self.prefixes.cached_tokens(prompt)

    @property
    def num_waiting(self) -> int:
        return len(self._queue)

    @property
    def max_context(self) -> int:
        """The most tokens (prompt plus new ones) a request may have here: the model's context, or less
        where the KV memory budget holds less."""
        if self._kv_budget is None:
            return self.decoder.max_context
        return min(self.decoder.max_context, self._kv_budget.max_tokens_alone)

    @property
    def context_limit(self) -> str | None:
        """Why `max_context` is below the model's context (the memory budget's numbers), or None."""
        if self._kv_budget is None or self._kv_budget.max_tokens_alone >= self.decoder.max_context:
            return None
        return self._kv_budget.describe()

    def _require_memory(self, prompt_tokens: int, new_tokens: int) -> None:
        if self._kv_budget is not None and (reason := self._kv_budget.refusal(prompt_tokens, new_tokens)):
            raise ValueError(reason)

    @property
    def num_running(self) -> int:
        """Requests decoding, and those whose prompt is being prefilled a chunk at a time."""
        return len(self._running) + self._rows_prefilling()

    def _rows_prefilling(self) -> int:
        return sum(len(prefill.requests) for prefill in self._prefilling)

    # -- the engine's thread --------------------------------------------------------------------
    def wait_for_work(self, timeout_s: float) -> None:
        """Sleep until a request arrives (or `timeout_s` passes) when nothing is queued or running."""
        self._queue.wait(timeout_s, busy=bool(self._running))

    def interrupt_wait(self) -> None:
        """Another thread has work for the engine's (a call between steps): end its idle wait (any thread)."""
        self._queue.interrupt()

    def step(self) -> bool:
        """Admit what fits, run the next chunk of a long prompt, then decode one token for every running
        row; False when there was nothing to do."""
        if self._offload is not None and self.num_waiting:
            self.wake()
        self._drop_cancelled()
        self._step_prompt_tokens = 0
        admitted = self._admit()
        chunked = self._advance_chunked_prefill()
        self._make_room()
        decoding = bool(self._running)
        if decoding:
            self._decode()
        return bool(admitted or chunked or decoding)

    def _drop_cancelled(self) -> None:
        cancelled = self._queue.take_cancelled()
        if cancelled and any(r.id in cancelled for r in self._running):
            self._keep_rows([i for i, r in enumerate(self._running) if r.id not in cancelled])
        if cancelled and self._prefilling:
            for prefill in self._prefilling:
                prefill.requests = [r for r in prefill.requests if r.id not in cancelled]
            self._prefilling = deque(prefill for prefill in self._prefilling if prefill.requests)

    def _admit(self) -> int:
        admitted: list[_Request] = []
        while (len(self._running) + self._rows_prefilling() + len(admitted) < self.limits.max_batch_size
               and (request := self._queue.peek()) is not None and self._memory_admits(request, admitted)):
            admitted.append(self._queue.take())
        self._limit_pool(admitted)
        same_prompt: dict[tuple[int, ...], list[_Request]] = {}  # keyed by adapter, then the prompt's tokens
        for request in admitted:
            if request.preempted:
                self._resume(request)
            elif request.prefilled is None:
                same_prompt.setdefault((request.adapter, *request.prompt), []).append(request)
            else:
                cache = self._whole_prompt_cache(request)
                self._running.append(request)
                self._cache.add(cache, cache[0][0].shape[2])
                request.prefilled = None
        uncached = {key for key, requests in same_prompt.items()
                    if self._holds_no_prefix(requests[0]) and not _scores_prompt(requests)
                    and not self._prefilled_in_chunks(len(requests[0].prompt))}
        if len(uncached) > 1:
            together = [same_prompt.pop(key) for key in list(same_prompt) if key in uncached]
            for batch in batches_of_similar_width(together):
                if len(batch) > 1:
                    self._prefill_together(batch)
                else:
                    self._prefill(batch[0])
        for requests in same_prompt.values():
            self._prefill(requests)
        return len(admitted)

    # -- within a KV memory budget (kv_memory.py) ------------------------------------------------
    def _next_lengths(self, joining: Sequence[_Request] = ()) -> list[int]:
        """The tokens each row holds after the next decode: running rows, prompts prefilling in chunks, `joining`."""
        waiting = [*(r for prefill in self._prefilling for r in prefill.requests), *joining]
        return [length + 1 for length in self._cache.lengths] + [len(r.fed_tokens) + 1 for r in waiting]

    def _memory_admits(self, request: _Request, admitted: list[_Request]) -> bool:
        """Whether the budget holds `request` beside the batch and those admitted this step, as they are now
        (rows that grow past it later are preempted: `_make_room`). An empty batch first gives back a pool
        grown for earlier rows, so a request that fits alone always runs."""
        if self._kv_budget is None:
            return True
        lengths = self._next_lengths([*admitted, request])
        if self._kv_budget.holds(lengths, self._cache.num_blocks):
            return True
        if self._running or self._prefilling or not self._cache.num_blocks:
            return False
        self._cache = PagedKVBatch(self._cache.block_tokens)
        return self._kv_budget.holds(lengths)

    def _limit_pool(self, joining: Sequence[_Request] = ()) -> None:
        """The pool grows to what the batch's next step needs, not past it (doubling would)."""
        if self._kv_budget is not None:
            needed = self._kv_budget.pool_blocks(self._next_lengths(joining))
            self._cache.max_blocks = max(self._cache.num_blocks, needed)

    def _make_room(self) -> None:
        """Before a decode: while the rows, each one token longer, would pass the budget, the newest row that
        can be recomputed leaves the batch for the front of the queue (vLLM's recompute preemption)."""
        if self._kv_budget is None:
            return
        others = self._next_lengths()[len(self._running):]
        lengths = [length + 1 for length in self._cache.lengths]
        recomputable = [bool(request.prompt) for request in self._running]  # a hand-over may come without its prompt
        for row in self._kv_budget.rows_to_preempt(lengths, others, self._cache.num_blocks, recomputable):
            request = self._running[row]
            self._keep_rows([kept for kept in range(len(self._running)) if kept != row])
            request.preempted = True
            self._queue.put_front(request)
            self.preemptions += 1
        self._limit_pool()

    def _resume(self, request: _Request) -> None:
        """A preempted request back in the batch: the keys and values of what it was fed, recomputed in one
        forward; it decodes on from the token it sampled last, with its own generator."""
        fed = request.fed_tokens
        with rows_use([request.adapter]):
            _, cache = self.decoder.forward(torch.tensor([fed], dtype=torch.long), torch.arange(len(fed))[None, :],
                                            torch.ones(1, len(fed), dtype=torch.long), None)
        request.preempted = False
        self._running.append(request)
        self._cache.add(cache, len(fed))

    def _holds_no_prefix(self, request: _Request) -> bool:
        return not self._uses_prefixes(request) or self.prefixes.cached_tokens(request.prompt) == 0

    def _uses_prefixes(self, request: _Request) -> bool:
        """Whether `request` reads and keeps prefix blocks: the store holds the model's own keys, not an adapter's."""
        return self.prefixes is not None and request.adapter == BASE

    def _whole_prompt_cache(self, request: _Request) -> KV:
        """A prefilled request's cache over its whole prompt: what the prefill engine sent, after the leading
        blocks this engine's prefix cache holds (recomputed here if they went meanwhile)."""
        if request.kv_from == 0:
            self._store_blocks(request.prompt, request.prefilled)
            return request.prefilled
        past, cached = (None, 0) if self.prefixes is None else self.prefixes.cached_prefix(request.prompt,
                                                                                            limit=request.kv_from)
        if cached < request.kv_from:
            tokens = torch.tensor([request.prompt[cached:request.kv_from]], dtype=torch.long)
            _, past = self.decoder.forward(tokens, torch.arange(cached, request.kv_from)[None, :],
                                           torch.ones(1, request.kv_from, dtype=torch.long), past)
        cache = [(torch.cat([past_keys, keys], dim=2), torch.cat([past_values, values], dim=2))
                 for (past_keys, past_values), (keys, values) in zip(past, request.prefilled)]
        self._store_blocks(request.prompt, cache)
        return cache

    def _prefill(self, requests: list[_Request]) -> None:
        """Requests of one prompt (an RL group, several samplings of a question) in one forward: each draws
        its first token from the same logits with its own generator and starts from the same keys and values.
        One forward per request cost a group of 16 two thirds of its rollout on a small model.

        A group asking for its prompt's log-probabilities needs the logits of every prompt position: it reads
        no cached prefix (as vLLM skips its prefix cache then) and keeps every position's logits."""
        prompt = requests[0].prompt
        length = len(prompt)
        scored = _scores_prompt(requests)
        past, cached = (None, 0) if scored else self._cached_prefix(requests[0])
        if self._prefilled_in_chunks(length - cached):
            self._prefilling.append(ChunkedPrefill(requests, prompt, cached, past, scored))
            return
        tokens = torch.tensor([prompt[cached:]], dtype=torch.long)
        self._step_prompt_tokens += length - cached
        with rows_use([requests[0].adapter]):
            logits, cache = self.decoder.forward(tokens, torch.arange(cached, length)[None, :],
                                                 torch.ones(1, length, dtype=torch.long), past,
                                                 **({"all_positions": True} if scored else {}))
        self._prefilled(requests, logits, cache, scored)

    def _prefilled(self, requests: list[_Request], logits: torch.Tensor, cache: KV, scored: bool) -> None:
        """A prompt's forward has run (`logits`: its last position's, or every position's when `scored`)."""
        if scored:
            for request in requests:
                if request.params.prompt_logprobs is not None:
                    request.prompt_logprobs = prompt_logprobs(logits[0], requests[0].prompt,
                                                              request.params.prompt_logprobs)
            logits = logits[:, -1]
        self._start_rows(requests, logits[0], cache)

    def _prefilled_in_chunks(self, uncached_tokens: int) -> bool:
        budget = self.limits.max_num_batched_tokens
        return budget is not None and uncached_tokens > budget

    def _advance_chunked_prefill(self) -> bool:
        """The next chunk of the oldest long prompt: what the step's budget leaves after the prompts it prefilled
        whole and a token of each decoding row (at least one token, so a long prompt always advances); its
        requests sample their first tokens once its last chunk has run."""
        if not self._prefilling:
            return False
        prefill = self._prefilling[0]
        with rows_use([prefill.requests[0].adapter]):
            left = self.limits.max_num_batched_tokens - self._step_prompt_tokens - len(self._running)
            whole = prefill.advance(self.decoder, left)
        if whole is not None:
            self._prefilling.popleft()
            self._prefilled(prefill.requests, *whole, prefill.scored)
        return True

    def _prefill_together(self, groups: list[list[_Request]]) -> None:
        """Several prompts none of whose blocks are cached, in one forward, left-padded as the decode batch
        is (the padding masked): a forward of a small model costs about the same for one prompt or eight,
        and an RL rollout admits all its groups at once. A row's numbers differ from a prefill of its prompt
        alone in the last bits only, as they do with the rows it is decoded beside."""
        prompts = [requests[0].prompt for requests in groups]
        width = max(len(prompt) for prompt in prompts)
        self._step_prompt_tokens += sum(len(prompt) for prompt in prompts)
        tokens = torch.tensor([[0] * (width - len(prompt)) + prompt for prompt in prompts], dtype=torch.long)
        mask = torch.tensor([[0] * (width - len(prompt)) + [1] * len(prompt) for prompt in prompts], dtype=torch.long)
        with rows_use([requests[0].adapter for requests in groups]):
            logits, cache = self.decoder.forward(tokens, (mask.cumsum(1) - 1).clamp(min=0), mask, None)
        for row, (requests, prompt) in enumerate(zip(groups, prompts)):
            first = width - len(prompt)
            # Copies: the prefix store keeps a prompt's blocks, and must not hold the padded batch with them.
            own = [(keys[row:row + 1, :, first:].contiguous(), values[row:row + 1, :, first:].contiguous())
                   for keys, values in cache]
            self._start_rows(requests, logits[row], own)

    def _start_rows(self, requests: list[_Request], logits: torch.Tensor, cache: KV) -> None:
        """Requests of one prompt, prefilled (`logits`: its last position's; `cache`: batch 1, its every
        token): each samples its first token, and those still going join the batch."""
        # The first tokens go out before the blocks are stored.
        sampled = sample_rows(logits.expand(len(requests), -1), requests, self.eos_token_id)
        decoding = [request for request, first in zip(requests, sampled) if self._report(request, first) is None]
        if self._uses_prefixes(requests[0]):
            self._store_blocks(requests[0].prompt, cache)
        if self.prefixes is not None:
            self.prefixes.settle()
        if decoding:
            self._running.extend(decoding)
            self._cache.add(cache, len(requests[0].prompt), copies=len(decoding))

    def _cached_prefix(self, request: _Request) -> tuple[KV | None, int]:
        return self.prefixes.cached_prefix(request.prompt) if self._uses_prefixes(request) else (None, 0)

    def _store_blocks(self, tokens: list[int], cache: KV) -> None:
        if self.prefixes is not None:
            self.prefixes.keep_tokens(tokens, cache)

    def _decode(self) -> None:
        tokens = torch.tensor([[request.last_token] for request in self._running], dtype=torch.long)
        with rows_use([request.adapter for request in self._running]):
            logits, cache = self.decoder.forward(tokens, self._cache.next_positions(), self._cache.attention_mask(1),
                                                 self._cache.layers)
        self._cache.grow(cache)
        sampled = sample_rows(logits, self._running, self.eos_token_id)
        finished = [self._report(request, token) is not None for request, token in zip(self._running, sampled)]
        if any(finished):
            for row in (row for row, done in enumerate(finished) if done):
                self._store_answer(row)
            self._keep_rows([row for row, done in enumerate(finished) if not done])
        fail_point(SAMPLING)

    def _store_answer(self, row: int) -> None:
        """Keep the blocks of a finished row's prompt and answer (the next turn of a chat starts with them)."""
        request = self._running[row]
        if not self._uses_prefixes(request) or not request.prompt:  # not request.prompt: prefilled elsewhere, unsaid
            return
        length = self._cache.lengths[row]
        fed = request.prompt + request.sampled[:-1]  # the last token sampled was never run through the model
        if len(fed) != length:
            raise RuntimeError(f"row {row} holds {length} tokens' keys, expected {len(fed)}")
        self._store_blocks(fed, self._cache.row(row))

    def _keep_rows(self, rows: list[int]) -> None:
        self._running = [self._running[row] for row in rows]
        self._cache.keep(rows)

    def _report(self, request: _Request, sampled: SampledToken) -> FinishReason | None:
        """Record and report the request's sampled token; returns why it finished, if it did."""
        token = sampled.token
        request.last_token = token
        request.sampled.append(token)
        figures = dict(log_prob=sampled.log_prob, logprobs=sampled.logprobs, prompt_logprobs=request.prompt_logprobs)
        request.prompt_logprobs = None  # the first event only
        if stops_at(request.params, token, self.eos_token_id):
            request.on_event(TokenEvent(None, "stop", stop_token=token, **figures))
            return "stop"
        request.generated += 1
        request.on_event(TokenEvent(token, **figures))
        if request.generated >= request.budget:
            request.on_event(TokenEvent(None, "length"))
            return "length"
        return None


class GenerationCollector:
    """Event sinks that gather each request's tokens and finish reason (tests, warm-up, benches)."""

    def __init__(self, num_requests: int):
        self._tokens: list[list[int]] = [[] for _ in range(num_requests)]
        self._reasons: list[FinishReason | None] = [None] * num_requests
        self._log_probs: list[list[float]] = [[] for _ in range(num_requests)]

    def sink(self, index: int) -> EventSink:
        def on_event(event: TokenEvent) -> None:
            if event.token is not None:
                self._tokens[index].append(event.token)
            else:
                self._reasons[index] = event.finish_reason
            if event.log_prob is not None:
                self._log_probs[index].append(event.log_prob)
        return on_event

    def generations(self) -> list[Generation]:
        return [Generation(tokens=t, finish_reason=r, log_probs=lp or None)
                for t, r, lp in zip(self._tokens, self._reasons, self._log_probs)]


def generate_all(engine: ContinuousBatchingEngine, prompts: Sequence[Sequence[int]],
                 params: Sequence[SamplingParams], adapters: Sequence[str | None] | None = None) -> list[Generation]:
    """Run requests to completion on the calling thread (tests, warm-up): one Generation per prompt, each
    with its adapter of `adapters` (None: the model alone)."""
    collector = GenerationCollector(len(prompts))
    for index, (prompt, request_params) in enumerate(zip(prompts, params)):
        if adapters and adapters[index] is not None:
            request_params = dataclasses.replace(request_params, adapter=adapters[index])
        engine.submit(prompt, request_params, collector.sink(index))
    while engine.step():
        pass
    return collector.generations()


MAX_PADDING = 2.0  # a prefill batch's padded tokens are at most this many times its prompts' own


def batches_of_similar_width(groups: list[list[_Request]]) -> list[list[list[_Request]]]:
    """Groups of one prompt each, batched shortest first while padding a batch to its widest prompt at most
    doubles its tokens: a 2,048-token prompt admitted with fifteen short ones made sixteen prefills of 2,048."""
    batches: list[list[list[_Request]]] = []
    for group in sorted(groups, key=lambda requests: len(requests[0].prompt)):
        widened = (batches[-1] if batches else []) + [group]
        real = sum(len(requests[0].prompt) for requests in widened)
        if batches and len(group[0].prompt) * len(widened) <= MAX_PADDING * real:
            batches[-1] = widened
        else:
            batches.append([group])
    return batches


def _scores_prompt(requests: list[_Request]) -> bool:
    """Whether a request of one prompt's group asks for the prompt's log-probabilities."""
    return any(request.params.prompt_logprobs is not None for request in requests)
