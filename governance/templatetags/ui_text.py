"""Template filters for text a person must read exactly (web.reveal)."""

from __future__ import annotations

from pprint import pformat
from typing import Any

from django import template
from django.utils.safestring import SafeString

from governance.services.outcomes import DECISION_EVENTS
from governance.web import reveal

register = template.Library()


@register.filter
def revealed(text: object) -> SafeString:
    """Escaped, with bidi controls and invisible characters shown as code points.
    None (a value that was never recorded) shows as an empty string; anything else
    that is not text (a number in a stored JSON list) as its str()."""
    if text is None:
        return reveal.reveal("")
    return reveal.reveal(text if isinstance(text, str) else str(text))


@register.filter
def hidden_count(text: str | None) -> int:
    return reveal.hidden_count(text or "")


@register.filter
def arguments(preview: Any) -> str:
    """A call's masked arguments as the pages show them: pprint, keys that are not
    printable ASCII escaped (reveal.keys_escaped). Autoescaped as any text."""
    return pformat(reveal.keys_escaped(preview))


@register.filter
def escaped_keys(preview: Any) -> int:
    return reveal.escaped_key_count(preview)


@register.filter
def explainable(event: Any) -> bool:
    """Whether the explain page ("why") answers for this event: a decision's own
    event. A sandbox run's or egress attempt's events, or an outcome report, carry a
    decision too, but the decision they refer to is another event (its own link)."""
    return event.event_type in DECISION_EVENTS
