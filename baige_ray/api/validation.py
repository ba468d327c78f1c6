"""Small checks shared by config dataclasses; each raises a ValueError naming the field."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any


def is_int(value: Any) -> bool:
    """An int that is not a bool (JSON's true is not 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An int or a float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _fail(owner: str, field: str, value: Any, allowed: str) -> None:
    raise ValueError(f"{owner}.{field}={value!r} is invalid: expected {allowed}")


def require_int(owner: str, field: str, value: Any, *, minimum: int | None = None) -> None:
    if not is_int(value):
        _fail(owner, field, value, "an integer" + (f" >= {minimum}" if minimum is not None else ""))
    if minimum is not None and value < minimum:
        _fail(owner, field, value, f"an integer >= {minimum}")


def require_number(
    owner: str,
    field: str,
    value: Any,
    *,
    minimum: float | None = None,
    exclusive_minimum: bool = False,
    maximum: float | None = None,
) -> None:
    allowed = "a number"
    if minimum is not None:
        allowed += f" {'>' if exclusive_minimum else '>='} {minimum}"
    if maximum is not None:
        allowed += f" <= {maximum}"
    if not is_number(value):
        _fail(owner, field, value, allowed)
    if minimum is not None and (value < minimum or (exclusive_minimum and value == minimum)):
        _fail(owner, field, value, allowed)
    if maximum is not None and value > maximum:
        _fail(owner, field, value, allowed)


def require_choice(owner: str, field: str, value: Any, choices: Collection[Any]) -> None:
    if value not in choices:
        _fail(owner, field, value, "one of " + ", ".join(repr(c) for c in choices))


def require_divisible(owner: str, field: str, value: int, divisor: int, divisor_name: str) -> None:
    if value % divisor != 0:
        _fail(owner, field, value, f"a multiple of {divisor_name}={divisor}")
