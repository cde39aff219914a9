"""The API schema's task key and title patterns and the task service say the same thing.

Schemathesis generates task bodies from these patterns and flags any that the server
then refuses (it found a title with a control character, which the schema allowed and
the service refuses); this checks the agreement directly, both ways.
"""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from governance.api.serializers import TASK_KEY_PATTERN, TASK_TITLE_PATTERN
from governance.services.tasks import validate_key
from governance.text import is_line

KEY = re.compile(TASK_KEY_PATTERN)
TITLE = re.compile(TASK_TITLE_PATTERN)


def key_accepted(key: str) -> bool:
    try:
        validate_key(key)
    except Exception:  # noqa: BLE001 - any refusal
        return False
    return True


TEXT = st.text(alphabet=st.characters(codec="utf-8", max_codepoint=0x3000), max_size=12)


@settings(max_examples=500, deadline=None)
@given(TEXT)
def test_the_schema_and_the_service_agree_on_task_keys(key: str) -> None:
    assert bool(KEY.fullmatch(key)) == key_accepted(key), repr(key)


@settings(max_examples=500, deadline=None)
@given(TEXT)
def test_the_schema_and_the_service_agree_on_task_titles(title: str) -> None:
    assert bool(TITLE.fullmatch(title)) == is_line(title), repr(title)


def test_known_titles() -> None:
    for title in ("", "Fix the login bug", "Ünïcødé ✓"):
        assert TITLE.fullmatch(title) and is_line(title)
    for title in ("a\x17b", "two\nlines", "tab\there", "del\x7f"):
        assert not TITLE.fullmatch(title) and not is_line(title)
