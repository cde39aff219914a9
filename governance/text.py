"""What counts as text: one set of checks for every way in (API, web UI, matrix
import), so a value one door refuses is not stored through another."""

from __future__ import annotations

import math
import re
from decimal import Decimal
from typing import Any

# C0 controls and DEL: never part of a name, key or one-line title (they hide in a
# list, and spreadsheet formats refuse most of them).
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def is_utf8(value: str) -> bool:
    """No lone UTF-16 surrogate (`\\ud800` sent as a JSON escape): such a string
    cannot be encoded, so it can be neither stored nor written back in a response."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def is_text(value: str) -> bool:
    """Text PostgreSQL can store: no NUL, no lone surrogate (not UTF-8)."""
    return "\x00" not in value and is_utf8(value)


def is_line(value: str) -> bool:
    """Storable text on one line, with no control characters (keys, titles)."""
    return is_utf8(value) and not _CONTROL.search(value)


def printable(value: str) -> str:
    """`value` as it can be written out: a lone surrogate becomes its `\\ud800` escape,
    so quoting what a client sent can never make the reply itself fail."""
    return value.encode("utf-8", "backslashreplace").decode("utf-8")


def storable(value: Any) -> Any:
    """`value` (plain JSON) with every text in it printable(): keys and values."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {storable(key): storable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [storable(item) for item in value]
    return value


def json_problem(value: Any, depth: int = 0, *, finite: bool = True) -> str | None:
    """Why `value` cannot be stored and hashed as plain JSON (jsonb), or None: text that
    is not text, a key that is not a string, a date or binary (YAML has them), a number
    that is not finite (1e400 reads as Infinity, which jsonb refuses), or nesting
    deeper than hashing and masking walk. `finite=False` leaves numbers to the caller."""
    if depth > 32:
        return "nested too deeply (at most 32 levels)"
    if isinstance(value, str):
        return None if is_text(value) else "holds text with a NUL byte or a lone surrogate"
    if isinstance(value, float):
        if finite and not math.isfinite(value):
            return "holds a number that is not finite (NaN, or too big for a double: 1e400)"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return "has a key that is not a string"
            problem = json_problem(key, depth + 1) or json_problem(item, depth + 1, finite=finite)
            if problem:
                return problem
        return None
    if isinstance(value, list):
        for item in value:
            problem = json_problem(item, depth + 1, finite=finite)
            if problem:
                return problem
        return None
    if value is None or isinstance(value, bool | int):
        return None
    return "holds a value that is not plain JSON (a date, binary data or a set)"


def jsonb_form(value: Any) -> Any:
    """`value` as PostgreSQL's jsonb gives it back, so that what is hashed is what is
    stored, on every database. jsonb keeps numbers as exact decimals of the digits
    Python writes: a float Python writes with an exponent (1e16, 1.2345678901234567e+20:
    every float of 1e16 or more) comes back as the integer those digits spell
    (10000000000000000, 123456789012345670000), and -0.0 as 0.0; every other float
    reads back as itself, and integers, text, booleans and null are kept. Keys are
    not reordered here: hashes sort them. Idempotent: jsonb_form(jsonb_form(v)) ==
    jsonb_form(v). Expects a value json_problem() found no problem with."""
    if isinstance(value, float):
        if value == 0:
            return 0.0  # numeric has no negative zero
        text = repr(value)
        # An exact conversion of the digits, not int(value): int(1.2345678901234567e+20)
        # is the double's binary value, 123456789012345677877, not what jsonb keeps.
        return int(Decimal(text)) if "e+" in text else value
    if isinstance(value, dict):
        return {key: jsonb_form(item) for key, item in value.items()}
    if isinstance(value, list):
        return [jsonb_form(item) for item in value]
    return value
