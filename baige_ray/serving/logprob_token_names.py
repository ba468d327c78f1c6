"""The text a log-probability entry names a token by, as vLLM's server names it.

A token is named by decoding it alone. A byte-level BPE token can hold part of a UTF-8 character, and
decoded alone it then ends in U+FFFD. vLLM reads such a token with the tokens before it (up to 4, enough
for any UTF-8 sequence): the name is the text that token completes, or "" while the character is still
unfinished. The same holds for each alternative in the position's top log-probabilities, each read after
the same tokens. At a generated position the tokens before are the generated ones (not the prompt); at an
echoed prompt position they are the prompt's, less its first token, which has no entry of its own (and
is named alone). Evaluation harnesses compare these names with their own continuations, so they must be
vLLM's exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

UNFINISHED = "\ufffd"
CONTEXT_TOKENS = 4  # a UTF-8 character spans at most 4 bytes, so at most 4 byte tokens


class TokenDecoding(Protocol):
    def token_text(self, token: int) -> str:
        """One token decoded alone, special tokens included."""

    def tokens_text(self, tokens: list[int]) -> str:
        """Tokens decoded together, special tokens included."""


class LogprobTokenNames:
    def __init__(self, codec: TokenDecoding):
        self._codec = codec

    def plain(self, token: int) -> str:
        """The token decoded alone (the first prompt token's name)."""
        return self._codec.token_text(token)

    def after(self, context: Sequence[int]) -> Callable[[int], str]:
        """Names at a position whose entry comes after the tokens `context` (the last 4 count)."""
        window = list(context[-CONTEXT_TOKENS:])

        def name(token: int) -> str:
            alone = self._codec.token_text(token)
            return self._completed(token, window) if alone.endswith(UNFINISHED) else alone

        return name

    def _completed(self, token: int, context: list[int]) -> str:
        """What `token` completes after the shortest tail of `context` that finishes its character; ""
        when none does. The tail's own unfinished tokens named "", so their bytes are this token's text."""
        for size in range(1, len(context) + 1):
            tail = context[-size:]
            whole = self._codec.tokens_text(tail + [token])
            if whole.endswith(UNFINISHED):
                continue
            finished = len(tail)
            while finished > 0 and self._codec.token_text(tail[finished - 1]).endswith(UNFINISHED):
                finished -= 1
            prefix = self._codec.tokens_text(tail[:finished]) if finished else ""
            return whole[_common_prefix_length(prefix, whole):]
        return ""


def _common_prefix_length(first: str, second: str) -> int:
    if second.startswith(first):
        return len(first)
    length = 0
    for a, b in zip(first, second):
        if a != b:
            break
        length += 1
    return length
