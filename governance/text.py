"""What counts as text: one set of checks for every way in (API, web UI, matrix
import), so a value one door refuses is not stored through another."""

from __future__ import annotations

import re

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
