"""Make invisible and bidirectional characters visible, for reviewing a tool's
changed definition: a description can hide instructions in zero-width or
right-to-left-override characters that a plain diff would never show.
"""

from __future__ import annotations

import difflib
import json
import unicodedata
from typing import Any

from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

# Bidi controls are Cf too, but named here so the page can call them out.
BIDI = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def _visible(ch: str) -> str:
    """Escaped HTML for one character; invisible ones become a marked code point."""
    if ch in ("\n", " "):
        return ch
    category = unicodedata.category(ch)
    if ch in BIDI:
        return f'<mark class="bidi" title="bidi control">[U+{ord(ch):04X} bidi]</mark>'
    if category in ("Cf", "Cc", "Co", "Cn", "Zl", "Zp") or (category == "Zs" and ch != " "):
        name = unicodedata.name(ch, "unnamed")
        return f'<mark class="invisible" title="{escape(name)}">[U+{ord(ch):04X}]</mark>'
    if ord(ch) > 0x7E and unicodedata.category(ch).startswith("M"):
        return f'<mark class="invisible" title="combining mark">[U+{ord(ch):04X}]</mark>'
    return str(escape(ch))


def reveal(text: str) -> SafeString:
    return mark_safe("".join(_visible(ch) for ch in text))  # noqa: S308 - each char escaped


def hidden_count(text: str) -> int:
    return sum(1 for ch in text if _visible(ch).startswith("<mark"))


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False)


def side_by_side(old: dict[str, Any], new: dict[str, Any]) -> list[dict[str, Any]]:
    """Per field: the approved and the current text, line by line, changes marked."""
    rows = []
    for field in ("name", "description", "input_schema"):
        a, b = _text(old.get(field, "")), _text(new.get(field, ""))
        a_lines, b_lines = a.split("\n"), b.split("\n")
        lines = []
        matcher = difflib.SequenceMatcher(a=a_lines, b=b_lines, autojunk=False)
        for op, i1, i2, j1, j2 in matcher.get_opcodes():
            left, right = a_lines[i1:i2], b_lines[j1:j2]
            for k in range(max(len(left), len(right))):
                lines.append(
                    {
                        "old": reveal(left[k]) if k < len(left) else None,
                        "new": reveal(right[k]) if k < len(right) else None,
                        "changed": op != "equal",
                    }
                )
        rows.append(
            {
                "field": field,
                "changed": a != b,
                "lines": lines,
                "hidden_old": hidden_count(a),
                "hidden_new": hidden_count(b),
            }
        )
    return rows


def pretty_json(text: str) -> SafeString:
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        return reveal(text)
    return reveal(json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False))


def _plain_key(key: Any) -> bool:
    return not isinstance(key, str) or (key.isascii() and key.isprintable())


def keys_escaped(value: Any) -> Any:
    """`value` (a call's masked arguments) with every key that is not printable ASCII
    written as its escapes (`pаth` with a Cyrillic а is `p\\u0430th`): a look-alike
    of another key is another argument, and an approver reading the page must not
    take it for the one the tool reads. Values are shown as they are (repr already
    escapes what is invisible in them)."""
    if isinstance(value, dict):
        return {(k if _plain_key(k) else ascii(k)[1:-1]): keys_escaped(v) for k, v in value.items()}
    if isinstance(value, list):
        return [keys_escaped(v) for v in value]
    return value


def escaped_key_count(value: Any) -> int:
    """How many keys keys_escaped() rewrote: the page says so above the arguments."""
    if isinstance(value, dict):
        own = sum(1 for k in value if not _plain_key(k))
        return own + sum(escaped_key_count(v) for v in value.values())
    if isinstance(value, list):
        return sum(escaped_key_count(v) for v in value)
    return 0
