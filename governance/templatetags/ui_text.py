"""Template filters for text a person must read exactly (web.reveal)."""

from __future__ import annotations

from django import template
from django.utils.safestring import SafeString

from governance.web import reveal

register = template.Library()


@register.filter
def revealed(text: str | None) -> SafeString:
    """Escaped, with bidi controls and invisible characters shown as code points.
    None (a value that was never recorded) shows as an empty string."""
    return reveal.reveal(text or "")


@register.filter
def hidden_count(text: str) -> int:
    return reveal.hidden_count(text)
