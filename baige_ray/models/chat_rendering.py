"""A conversation as the model is trained on it: rendered by its chat template, each token marked trained or not.

Rows come in the shapes TRL and OpenAI use: `messages` (a list of {"role", "content"}), or `prompt` and
`completion` (both strings: plain text, no template; both lists of messages: a conversation whose
completion follows the prompt). Which tokens the loss trains is `train_on`:
- "assistant": every assistant reply (the completion of a prompt/completion row);
- "completion": the last assistant reply only (the completion of a prompt/completion row);
- "all": every token.

The trained spans are found on the rendered text, then mapped onto tokens by their character offsets:
- a template with generation markers (`{% generation %}`) says itself where each reply is;
- otherwise the conversation is rendered turn by turn: the text up to a reply, with the generation
  prompt, and the text through it must each begin the whole conversation's text, and the reply is what
  lies between them. A template that rewrites earlier turns when later ones follow (one that drops
  earlier reasoning, say) fails that check and is refused with the turn where it failed: no mask is
  ever guessed, or left silently empty.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TRAIN_ON = ("assistant", "completion", "all")
_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")

Span = tuple[int, int]  # [start, end) in characters of the rendered text


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered, or its trained tokens cannot be found."""


@dataclass(frozen=True)
class RenderedConversation:
    ids: list[int]
    trained: list[bool]  # per token: whether the loss trains it (as the target of the tokens before it)


def chat_template_of(tokenizer: PreTrainedTokenizerBase, chat_template: str | None) -> str:
    """The template to render with: the caller's, else the tokenizer's own; ValueError without either."""
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one renders conversations
        template = template.get("default")
    if not isinstance(template, str) or not template.strip():
        raise ValueError("the tokenizer has no chat template: pass chat_template= (a Jinja template string), or "
                         "train on prompt/completion rows of plain text")
    return template


def render_conversation(row: dict, tokenizer: PreTrainedTokenizerBase, *, chat_template: str | None,
                        train_on: str) -> RenderedConversation:
    """`row`'s tokens and which of them are trained; ValueError naming what is wrong with the row or template."""
    if train_on not in TRAIN_ON:
        raise ValueError(f"train_on={train_on!r} is invalid: expected one of {', '.join(TRAIN_ON)}")
    if "messages" in row and row["messages"] is not None:
        messages = _messages(row["messages"], "messages")
        text, spans = _render_messages(messages, tokenizer, chat_template, _replies(messages, train_on))
    elif "prompt" in row and "completion" in row:
        text, spans = _render_prompt_completion(row["prompt"], row["completion"], tokenizer, chat_template)
    else:
        raise ValueError(f"a row with fields {sorted(row)} is invalid: expected 'messages', or 'prompt' and "
                         "'completion'")
    if train_on == "all":
        spans = [(0, len(text))]
    return _tokens_with_spans(text, spans, tokenizer)


def _messages(value: Any, field: str) -> list[dict]:
    """OpenAI-shaped messages with string content (typed text parts joined, as a chat server joins them)."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"{field}={value!r} is invalid: expected a non-empty list of {{'role', 'content'}} messages")
    messages = []
    for index, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"{field}[{index}]={message!r} is invalid: expected a message with a 'role'")
        messages.append({**message, "content": _text_content(message.get("content"), f"{field}[{index}].content")})
    return messages


def _text_content(content: Any, field: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(part.get("text", "")) for part in content)
    raise ValueError(f"{field}={content!r} is invalid: expected a string or a list of text parts")


def _replies(messages: list[dict], train_on: str) -> list[int]:
    """Indices of the assistant messages `train_on` trains."""
    replies = [index for index, message in enumerate(messages) if message["role"] == "assistant"]
    if train_on == "all":
        return []
    if not replies:
        raise ValueError(f"a conversation without an assistant message has nothing to train with train_on="
                         f"{train_on!r} (roles: {[m['role'] for m in messages]}); use train_on='all'")
    if train_on == "completion":
        if replies[-1] != len(messages) - 1:
            raise ValueError("train_on='completion' trains the conversation's final reply, but its last message "
                             f"is from {messages[-1]['role']!r}, not the assistant")
        return replies[-1:]
    return replies


def _render_messages(messages: list[dict], tokenizer: PreTrainedTokenizerBase, chat_template: str | None,
                     replies: list[int]) -> tuple[str, list[Span]]:
    template = chat_template_of(tokenizer, chat_template)
    render = _renderer(tokenizer, template)
    if _GENERATION_MARKER.search(template):
        text, marked = render(messages, generation_spans=True)
        if len(marked) != sum(m["role"] == "assistant" for m in messages):
            raise ChatTemplateError(
                f"the chat template's generation markers enclose {len(marked)} spans in a conversation of "
                f"{sum(m['role'] == 'assistant' for m in messages)} assistant messages: expected one per reply")
        order = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        return text, [span for index, span in zip(order, marked) if index in replies]
    text, _ = render(messages)
    return text, [_reply_span(messages, index, render, text) for index in replies]


def _reply_span(messages: list[dict], index: int, render: Callable, whole: str) -> Span:
    """Where reply `index` lies in `whole`: after the text of the turns before it with the generation
    prompt, up to the end of the text through it, both of which must begin `whole`."""
    before, _ = render(messages[:index], add_generation_prompt=True)
    through, _ = render(messages[: index + 1])
    if not whole.startswith(through) or not through.startswith(before):
        raise ChatTemplateError(
            f"the chat template cannot be masked: rendered turn by turn, the conversation up to assistant message "
            f"{index} is not the beginning of the whole conversation's text (the template changes earlier turns "
            "as later ones follow); add {% generation %} markers around the replies, pass another chat_template=, "
            "or use train_on='all'")
    if len(through) == len(before):
        raise ChatTemplateError(f"the chat template renders assistant message {index} as no text: nothing to train")
    return len(before), len(through)


def _render_prompt_completion(prompt: Any, completion: Any, tokenizer: PreTrainedTokenizerBase,
                              chat_template: str | None) -> tuple[str, list[Span]]:
    """Strings: prompt + completion + eos, the completion trained (TRL's standard format). Message lists: the
    conversation prompt + completion under the template, what follows the prompt's generation prompt trained."""
    if isinstance(prompt, str) and isinstance(completion, str):
        if not completion:
            raise ValueError("completion='' is invalid: expected text to train")
        text = prompt + completion + tokenizer.eos_token
        return text, [(len(prompt), len(text))]
    if isinstance(prompt, list) and isinstance(completion, list):
        prompt_messages, completion_messages = _messages(prompt, "prompt"), _messages(completion, "completion")
        render = _renderer(tokenizer, chat_template_of(tokenizer, chat_template))
        before, _ = render(prompt_messages, add_generation_prompt=True)
        whole, _ = render(prompt_messages + completion_messages)
        if not whole.startswith(before) or len(whole) == len(before):
            raise ChatTemplateError("the chat template cannot be masked: the prompt rendered with its generation "
                                    "prompt is not the beginning of the prompt and completion rendered together")
        return whole, [(len(before), len(whole))]
    raise ValueError(f"prompt and completion of types {type(prompt).__name__} and {type(completion).__name__} are "
                     "invalid: expected two strings, or two lists of messages")


def _renderer(tokenizer: PreTrainedTokenizerBase, template: str) -> Callable:
    """render(messages, add_generation_prompt=False, generation_spans=False) -> (text, generation spans),
    with the tokenizer's special tokens as the template's variables, as apply_chat_template renders."""
    from jinja2 import TemplateError
    from transformers.utils.chat_template_utils import render_jinja_template

    variables = dict(tokenizer.special_tokens_map)

    def render(messages: list[dict], *, add_generation_prompt: bool = False,
               generation_spans: bool = False) -> tuple[str, list[Span]]:
        try:
            texts, spans = render_jinja_template([messages], chat_template=template,
                                                 add_generation_prompt=add_generation_prompt,
                                                 return_assistant_tokens_mask=generation_spans, **variables)
        except TemplateError as error:
            raise ChatTemplateError(f"the chat template refused the conversation: {error}") from error
        return texts[0], [tuple(span) for span in spans[0]] if spans else []

    return render


def _tokens_with_spans(text: str, spans: list[Span], tokenizer: PreTrainedTokenizerBase) -> RenderedConversation:
    """`text`'s tokens (no special tokens added: the template placed its own), a token trained where it
    starts inside a span."""
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"{type(tokenizer).__name__} gives no character offsets, which marking trained tokens "
                         "needs: load the tokenizer's fast version (tokenizer.json)")
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    trained = [end > start and any(a <= start < b for a, b in spans) for start, end in encoded["offset_mapping"]]
    return RenderedConversation(ids=list(encoded["input_ids"]), trained=trained)
