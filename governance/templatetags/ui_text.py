"""Template filters for text a person must read exactly (web.reveal)."""

from __future__ import annotations

from django import template
from django.utils.safestring import SafeString

from governance.web import reveal

register = template.Library()


@register.filter
def revealed(text: str) -> SafeString:
    """Escaped, with bidi controls and invisible characters shown as code points."""
    return reveal.reveal(text)


@register.filter
def hidden_count(text: str) -> int:
    return reveal.hidden_count(text)
