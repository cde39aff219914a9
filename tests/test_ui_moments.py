"""Date-times on the UI's forms are moments a page can use. `0001-01-01T00:00+05:00`
is valid ISO 8601 but falls before year 1 in UTC; it used to crash the query or the
template (a 500, after the audit page had already written its look). Now it is a 400
with a sentence, and nothing is written."""

from __future__ import annotations

import pytest

from governance.models import AuditEvent
from tests import ui_world

pytestmark = pytest.mark.django_db

LO = "0001-01-01T00:00%2B05:00"  # 0000-12-31T19:00 in UTC
HI = "9999-12-31T23:59-05:00"  # 10000-01-01T04:59 in UTC
WHAT_IF = "/ui/what-if/?agent=bot-a&tool=repo&action=read&scope=repo:acme/x"
PATHS = [
    f"/ui/audit/?start={LO}",
    f"/ui/audit/?end={HI}",
    f"/ui/audit/export?format=csv&start={LO}",
    f"/ui/exports/access?format=csv&at={LO}",
    f"/ui/exports/access?format=csv&at={HI}",
    f"/ui/exports/access?format=csv&start={LO}&end=2026-01-01T00:00Z",
    f"/ui/exports/decisions?format=csv&start={LO}&end={HI}",
    f"/ui/reports/print?at={LO}",
    f"/ui/reports/print?at={HI}",
    f"{WHAT_IF}&at={LO}",
    f"{WHAT_IF}&at={HI}",
]


@pytest.mark.parametrize("path", PATHS)
def test_a_moment_outside_the_calendar_in_utc_is_a_400_and_writes_nothing(path):
    ui_world.build()
    client = ui_world.signed_in("auditor")
    client.raise_request_exception = False
    before = AuditEvent.objects.count()

    response = client.get(path)

    assert response.status_code == 400, (path, response.status_code)
    assert b"between 0001-01-02 and 9999-12-30 (UTC)" in response.content
    assert AuditEvent.objects.count() == before


@pytest.mark.parametrize(
    "path",
    ["/ui/reports/print?at=9999-12-30T00:00Z", f"{WHAT_IF}&at=0001-01-02T00:00Z"],
)
def test_the_last_and_first_usable_days_still_answer(path):
    ui_world.build()
    client = ui_world.signed_in("auditor")
    assert client.get(path).status_code == 200


def test_every_date_time_input_says_it_is_read_as_utc():
    """A browser's datetime-local input carries no zone and the server reads it as UTC
    (TIME_ZONE): an admin east or west of Greenwich setting a review's expiry, or an
    auditor picking an export window, must be told so by the field's own label."""
    import re
    from pathlib import Path

    templates = Path(__file__).resolve().parent.parent / "templates"
    inputs = 0
    for page in sorted(templates.rglob("*.html")):
        text = page.read_text()
        for match in re.finditer(r'<input[^>]*type="datetime-local"', text):
            inputs += 1
            label = text.rfind("<label", 0, match.start())
            assert label != -1, f"{page.name}: a date-time input with no label"
            words = text[label : match.start()]
            assert "UTC" in words, f"{page.name}: {words!r} does not say UTC"
    assert inputs >= 9


# Offsets Python reads (to ±23:59:59.999999) that PostgreSQL does not take (past 15:59,
# or with a fraction of a second): the moment went to the query as typed, and the page
# was a 500 there (the audit page after writing its look). They are moments like any
# other, handed on in UTC.
ODD_OFFSETS = [
    "2026-01-01T00:00%2B23:00",
    "2026-01-01T00:00%2B05:45:30.5",
    "2026-06-01T00:00-16:30",
]
ODD_PAGES = [
    "/ui/audit/?start={}",
    "/ui/audit/export?format=csv&start={}",
    "/ui/exports/access?format=csv&at={}",
    "/ui/exports/decisions?format=csv&start={}&end=2027-01-01T00:00Z",
    "/ui/reports/print?at={}",
]


@pytest.mark.parametrize("moment", ODD_OFFSETS)
@pytest.mark.parametrize("page", ODD_PAGES)
def test_a_moment_at_any_offset_python_reads_is_answered(page, moment):
    ui_world.build()
    client = ui_world.signed_in("auditor")
    client.raise_request_exception = False
    before = AuditEvent.objects.count()

    response = client.get(page.format(moment))

    assert response.status_code == 200, (page, moment, response.status_code)
    assert AuditEvent.objects.count() == before + 1  # the look, or the export, on record


def test_a_review_narrowed_to_an_expiry_at_a_far_offset_is_stored_in_utc():
    from datetime import UTC, timedelta

    world = ui_world.build()
    extra = ui_world.build_lifecycle(world)
    client = ui_world.signed_in("admin")
    end = (world.grant.expires_at - timedelta(minutes=10)).replace(second=0, microsecond=0)
    typed = end.astimezone(UTC).replace(tzinfo=None) + timedelta(hours=20)
    response = ui_world.post(
        client,
        f"/ui/reviews/items/{extra.item_id}/decide",
        {"decision": "narrow", "comment": "shorter", "expires_at": f"{typed:%Y-%m-%dT%H:%M}+20:00"},
    )
    assert response.status_code == 302, response.status_code
    world.grant.refresh_from_db()
    assert world.grant.expires_at == end
    assert AuditEvent.objects.filter(event_type="grant.narrowed", grant_id=world.grant.pk).exists()
