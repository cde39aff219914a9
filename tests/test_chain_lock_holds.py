"""Slow work is done before the audit append that takes the chain lock, never under it.

The append takes the chain lock (an advisory transaction lock, held until COMMIT), and
every decision of every agent waits for it. An export makes its file first: an XLSX of
XLSX_MAX_ROWS rows takes seconds, and made after the record it stalled the whole
fleet's /authorize for as long. What must not happen without the record (the matrix
file handed to a file or stdout) is still done after it, in the same transaction. A
review campaign tells its reviewers (a notification row per person) before its event.

The lock is probed from a connection of its own (PostgreSQL) while the real work runs:
the probe wraps the real function, it does not replace it. benchmarks/jobs.py measures
how long each job holds the lock.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from django.db import connection
from django.utils import timezone
from openpyxl import load_workbook

from governance import audit
from governance.audit import Actor
from governance.models import AuditEvent
from governance.services import exports
from governance.services import matrix as matrix_service
from tests import ui_world
from tests.conftest import NOW, last_event

pytestmark = pytest.mark.django_db(transaction=True)


def chain_lock_free() -> bool:
    """Whether another connection could take the chain lock now (and let it go)."""
    with psycopg.connect(**connection.get_connection_params(), autocommit=True) as other:
        taken = other.execute("SELECT pg_try_advisory_lock(%s)", [audit.CHAIN_LOCK_KEY])
        free = bool(taken.fetchone()[0])
        if free:
            other.execute("SELECT pg_advisory_unlock(%s)", [audit.CHAIN_LOCK_KEY])
        return free


def probing(real: Callable[..., Any], seen: list[bool]) -> Callable[..., Any]:
    def probe(*args: Any, **kwargs: Any) -> Any:
        seen.append(chain_lock_free())
        return real(*args, **kwargs)

    return probe


@pytest.mark.parametrize("path", ["/ui/exports/access", "/ui/audit/export?agent=bot-a"])
def test_an_xlsx_export_is_made_while_decisions_can_still_take_the_chain_lock(
    postgres_only: None, monkeypatch, path: str
) -> None:
    ui_world.build()
    client = ui_world.signed_in("auditor")
    seen: list[bool] = []
    monkeypatch.setattr(exports, "to_xlsx", probing(exports.to_xlsx, seen))
    before = AuditEvent.objects.count()
    separator = "&" if "?" in path else "?"
    response = client.get(f"{path}{separator}format=xlsx")
    assert response.status_code == 200
    assert seen == [True]  # made once, with the lock free for every decision
    book = load_workbook(io.BytesIO(response.getvalue()))
    event = last_event()
    data = json.loads(event.data)
    assert (event.event_type, data["format"]) == ("report.exported", "xlsx")
    assert data["rows"] == book.active.max_row - 1 >= 1  # the file holds what is recorded
    assert AuditEvent.objects.count() == before + 1


def test_the_matrix_is_handed_out_only_with_its_record_and_made_before_it(
    postgres_only: None, monkeypatch, tmp_path
) -> None:
    """Made outside the lock; delivered after the record is appended (under the lock,
    in its transaction), so a delivery that fails leaves no record."""
    ui_world.build()
    made: list[bool] = []
    monkeypatch.setattr(matrix_service, "_yaml", probing(matrix_service._yaml, made))
    delivered: list[tuple[bool, str]] = []

    def deliver(text: str) -> None:
        delivered.append((chain_lock_free(), text))

    before = AuditEvent.objects.count()
    actor = Actor.system("test")
    text = matrix_service.matrix_export_recorded(at=NOW, actor=actor, deliver=deliver)
    assert made == [True]
    assert delivered == [(False, text)]  # after the record: the lock is this export's
    event = last_event()
    assert (event.event_type, json.loads(event.data)["report"]) == ("report.exported", "matrix")
    assert AuditEvent.objects.count() == before + 1


def test_a_matrix_that_cannot_be_delivered_leaves_no_record(tmp_path) -> None:
    ui_world.build()

    def deliver(text: str) -> None:
        raise OSError("the disk is full")

    before = AuditEvent.objects.count()
    with pytest.raises(OSError, match="the disk is full"):
        matrix_service.matrix_export_recorded(at=NOW, actor=Actor.system("test"), deliver=deliver)
    assert AuditEvent.objects.count() == before
    assert not AuditEvent.objects.filter(event_type="report.exported").exists()


def test_a_campaign_tells_its_reviewers_before_it_takes_the_chain_lock(
    postgres_only: None, monkeypatch
) -> None:
    from governance import notifications
    from governance.models import ReviewItem
    from governance.services import reviews

    ui_world.build()
    seen: list[bool] = []
    monkeypatch.setattr(notifications, "review_due", probing(notifications.review_due, seen))
    campaign = reviews.review_campaign_open(
        kind="on_demand", reason="probe", agent=None, opened_by=None,
        actor=Actor.system("test"), at=timezone.now(),
    )  # fmt: skip
    items = ReviewItem.objects.filter(campaign=campaign)
    assert items.exists()
    assert seen and all(seen)  # each reviewer told with the lock free
    assert len(seen) == len({item.reviewer_id for item in items})
    event = last_event()
    assert event.event_type == "review.campaign_opened"
    assert json.loads(event.data)["campaign_id"] == campaign.pk
