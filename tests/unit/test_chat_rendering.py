"""Which tokens of a conversation are trained, under the chat templates the models publish.

The templates in fixtures/chat_templates are Meta Llama 3 Instruct's, Qwen2.5 Instruct's and Mistral 7B
Instruct's as published (SOURCES.md). The trained tokens must decode to exactly the assistant replies,
each with the end-of-turn text its template puts after it (what the model must learn to stop on).
"""

from pathlib import Path

import pytest

from baige_ray.models.chat_rendering import ChatTemplateError, render_conversation

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello, how can I help?"}, {"role": "user", "content": "Say bye"},
            {"role": "assistant", "content": "Bye now!"}]
# What each template renders after a reply, with the tokenizer's eos `<|endoftext|>` (the tiny tokenizer's).
END_OF_TURN = {"llama3": "<|eot_id|>", "qwen2.5": "<|im_end|>\n", "mistral": "<|endoftext|>"}
REPLY_PREFIX = {"llama3": "", "qwen2.5": "", "mistral": " "}  # Mistral's template puts a space before a reply


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from baige_ray.models.tokenizer import load_tokenizer, train_bpe_tokenizer
    from tests.hf_helpers import text_files

    root = tmp_path_factory.mktemp("chat-tokenizer")
    return load_tokenizer(train_bpe_tokenizer(text_files(root / "text"), root / "tokenizer", vocab_size=384))


def trained_text(tokenizer, rendered) -> list[str]:
    """The trained runs of tokens, each decoded."""
    runs, current = [], []
    for token, trained in zip(rendered.ids, rendered.trained):
        if trained:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs + ([tokenizer.decode(current)] if current else [])


@pytest.mark.parametrize("family", ["llama3", "qwen2.5", "mistral"])
def test_published_templates_mark_exactly_the_assistant_replies(tokenizer, family):
    template = (TEMPLATES / f"{family}.jinja").read_text()
    replies = [REPLY_PREFIX[family] + m["content"] + END_OF_TURN[family] for m in MESSAGES if m["role"] == "assistant"]

    every = render_conversation({"messages": MESSAGES}, tokenizer, chat_template=template, train_on="assistant")
    assert trained_text(tokenizer, every) == replies
    last = render_conversation({"messages": MESSAGES}, tokenizer, chat_template=template, train_on="completion")
    assert trained_text(tokenizer, last) == replies[-1:]
    assert last.ids == every.ids
    everything = render_conversation({"messages": MESSAGES}, tokenizer, chat_template=template, train_on="all")
    assert all(everything.trained) and tokenizer.decode(everything.ids) == tokenizer.apply_chat_template(
        MESSAGES, chat_template=template, tokenize=False)


def test_generation_markers_say_where_the_replies_are(tokenizer):
    marked = ("{% for m in messages %}<|{{ m.role }}|>{% if m.role == 'assistant' %}{% generation %}"
              "{{ m.content }}<|end|>{% endgeneration %}{% else %}{{ m.content }}<|end|>{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    rendered = render_conversation({"messages": MESSAGES}, tokenizer, chat_template=marked, train_on="assistant")
    assert trained_text(tokenizer, rendered) == ["Hello, how can I help?<|end|>", "Bye now!<|end|>"]


def test_a_template_that_rewrites_earlier_turns_is_refused_with_the_reason(tokenizer):
    """Like templates that drop an earlier reply's reasoning once a later turn follows: turn by turn, the
    text up to a reply is not where the whole conversation's text begins, so no mask can be trusted."""
    rewriting = ("{% for m in messages %}<|{{ m.role }}|>{% if m.role == 'assistant' and not loop.last %}"
                 "(earlier reply){% else %}{{ m.content }}{% endif %}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    with pytest.raises(ChatTemplateError, match="cannot be masked.*changes earlier turns"):
        render_conversation({"messages": MESSAGES}, tokenizer, chat_template=rewriting, train_on="assistant")
    whole = render_conversation({"messages": MESSAGES}, tokenizer, chat_template=rewriting, train_on="all")
    assert all(whole.trained)


def test_prompt_and_completion_rows(tokenizer):
    text = render_conversation({"prompt": "2 + 2 =", "completion": " 4"}, tokenizer, chat_template=None,
                               train_on="assistant")
    assert trained_text(tokenizer, text) == [" 4<|endoftext|>"]  # the completion and eos, as TRL trains it
    template = (TEMPLATES / "qwen2.5.jinja").read_text()
    chat = render_conversation({"prompt": MESSAGES[:2], "completion": MESSAGES[2:3]}, tokenizer,
                               chat_template=template, train_on="completion")
    assert trained_text(tokenizer, chat) == ["Hello, how can I help?<|im_end|>\n"]


@pytest.mark.parametrize("row, train_on, message", [
    ({"messages": [{"role": "user", "content": "Hi"}]}, "assistant", "without an assistant message"),
    ({"messages": MESSAGES[:4]}, "completion", "last message is from 'user'"),
    ({"text": "plain"}, "assistant", "expected 'messages', or 'prompt' and 'completion'"),
    ({"messages": [{"role": "user", "content": 3}]}, "all", r"messages\[0\].content=3 is invalid"),
    ({"prompt": "a", "completion": [{"role": "assistant", "content": "b"}]}, "assistant", "two strings"),
])
def test_bad_rows_are_refused_naming_the_field(tokenizer, row, train_on, message):
    template = (TEMPLATES / "llama3.jinja").read_text()
    with pytest.raises(ValueError, match=message):
        render_conversation(row, tokenizer, chat_template=template, train_on=train_on)


def test_typed_text_parts_render_as_their_text(tokenizer):
    template = (TEMPLATES / "llama3.jinja").read_text()
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in MESSAGES]
    as_parts = render_conversation({"messages": parts}, tokenizer, chat_template=template, train_on="assistant")
    as_text = render_conversation({"messages": MESSAGES}, tokenizer, chat_template=template, train_on="assistant")
    assert as_parts == as_text
