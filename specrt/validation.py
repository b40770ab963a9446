"""Checks of values a user passes (Python API, CLI, manifest): the type and the range, with a
message naming the value and the rule. Bools are not integers here (``max_new_tokens=True``
is a mistake, not 1); numpy integers and floats are numbers."""

from __future__ import annotations

import math
import numbers

from specrt.errors import InvalidInputError


def out_of_range(name: str, value: object, rule: str) -> InvalidInputError:
    return InvalidInputError(f"{name}={_shown(value)} is out of range: {rule}", name)


def wrong_type(name: str, value: object, wanted: str, rule: str) -> InvalidInputError:
    message = f"{name}={_shown(value)} is {_kind(value)}, not {wanted}: {rule}"
    return InvalidInputError(message, name)


def _shown(value: object) -> str:
    """``value`` as a message shows it: an integer of hundreds of digits by its length (one
    line stays one line, and past 4,300 digits Python refuses to print it at all)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        if abs(int(value)) >= 10**20:
            return f"<an integer of {math.floor(math.log10(abs(int(value)))) + 1} digits>"
    return repr(value)


def _kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, numbers.Real):
        if isinstance(value, float):  # 3.0 too: JSON and Python tell it from 3
            return "a decimal number" if math.isfinite(value) else "not a finite number"
        return "a number"
    if type(value).__module__ == "numpy":  # np.True_ is a "bool" by name: "a bool, not a boolean"
        return f"numpy's {type(value).__name__}"
    return f"a {type(value).__name__}"


def integer(name: str, value: object, low: int, high: int | None = None, rule: str = "") -> int:
    """``value`` as an int in [low, high]; anything else (a bool, a float, a string) refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise wrong_type(name, value, "an integer", rule or _integer_rule(low, high))
    value = int(value)
    if value < low or (high is not None and value > high):
        raise out_of_range(name, value, rule or _integer_rule(low, high))
    return value


def number(name: str, value: object, rule: str, check) -> float:
    """``value`` as a finite float passing ``check``; bools and non-numbers refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise wrong_type(name, value, "a number", rule)
    try:
        value = float(value)
    except OverflowError:  # an integer beyond any float (10**400)
        raise out_of_range(name, value, rule) from None
    if not (math.isfinite(value) and check(value)):
        raise out_of_range(name, value, rule)
    return value


def flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise wrong_type(name, value, "a boolean", "use True or False")
    return value


def _integer_rule(low: int, high: int | None) -> str:
    return f"use an integer in [{low}, {high}]" if high is not None else f"use an integer >= {low}"
