"""Tasks: open, and close (which ends every grant bound to the task and voids every
open approval of a call made under it), by hand or, once a task's window has ended,
by the expiry job (tasks_end)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import Case, F, Q, Value, When

from governance import audit
from governance.codes import EventType
from governance.errors import Conflict, GovernanceError
from governance.models import Approval, Grant, Task
from governance.services.claims import claim_each
from governance.services.grants import grants_revoke
from governance.text import is_line


def validate_key(key: str) -> None:
    """1-100 printable ASCII characters, no padding: a `\x01` in a key hides in every
    list and spreadsheet exports cannot hold it; a zero-width space, a right-to-left
    override or a Cyrillic `І` made a second task that every page showed as `INC-42`,
    and an approver reading "task INC-42" took its grant to end with INC-42."""
    if (
        not key
        or len(key) > 100
        or key != key.strip()
        or not is_line(key)
        or not (key.isascii() and key.isprintable())
    ):
        raise GovernanceError(
            "invalid_task_key",
            "A task key is 1-100 printable ASCII characters (a ticket reference like "
            "INC-42): no padding, no control or other characters.",
        )
    # Its page would be the close action's URL; a browser resolves `.` and `..` in a
    # URL, so the close button of `acme/x/..` would post to `acme`'s.
    if key.endswith("/close") or any(part in (".", "..") for part in key.split("/")):
        raise GovernanceError(
            "invalid_task_key", "A task key cannot end in '/close' or hold a '.' or '..' part."
        )


def task_open(
    *,
    key: str,
    owner: Any,
    actor: audit.Actor,
    at: datetime,
    title: str = "",
    ends_at: datetime | None = None,
) -> Task:
    validate_key(key)
    if not is_line(title):
        raise GovernanceError(
            "invalid_task_title", "A task title is one line of text, with no control characters."
        )
    if ends_at is not None and ends_at <= at:
        raise GovernanceError("invalid_window", "A task must end after it starts.")
    try:
        with transaction.atomic():
            task = Task.objects.create(
                key=key, title=title, owner=owner, starts_at=at, ends_at=ends_at
            )
            audit.append(event_type=EventType.TASK_OPENED, actor=actor, at=at, task=key)
    except IntegrityError:
        raise Conflict("task_exists", f"A task with key {key!r} already exists.") from None
    return task


def task_close(*, task: Task, actor: audit.Actor, at: datetime, closed_by: Any = None) -> Task:
    """A grant bound to a task dies with it, in the same transaction."""
    with transaction.atomic():
        if _claim_close(task.pk, at):
            _announce_close(task.pk, actor=actor, at=at, closed_by=closed_by, why="closed")
    task.refresh_from_db()
    return task


def tasks_end(*, actor: audit.Actor, at: datetime) -> int:
    """Bookkeeping: close the tasks whose window has ended (ends_at <= at) as a close
    would: `task.closed` (data.why = "ended") and every grant bound to it revoked,
    one event each. authorize() already refuses such a task from ends_at on; this
    makes the rows and the log say so. Safe to run twice and from two workers."""
    due = Task.objects.filter(status=Task.Status.OPEN, ends_at__lte=at).values_list("pk", flat=True)
    return claim_each(
        due,
        claim=lambda pk: _claim_close(pk, at),
        announce=lambda pk: _announce_close(pk, actor=actor, at=at, closed_by=None, why="ended"),
    )


def _claim_close(pk: int, at: datetime) -> int:
    # A task that ran out is closed from its end, however late the job (or a person
    # closing it) records it: authorize() refused it from then on.
    return Task.objects.filter(pk=pk, status=Task.Status.OPEN).update(
        status=Task.Status.CLOSED,
        closed_at=Case(When(ends_at__lt=at, then=F("ends_at")), default=Value(at)),
    )


def _announce_close(pk: int, *, actor: audit.Actor, at: datetime, closed_by: Any, why: str) -> None:
    key, ends_at = Task.objects.values_list("key", "ends_at").get(pk=pk)
    bound = Grant.objects.filter(task_id=pk, status__in=[Grant.Status.ACTIVE, Grant.Status.PENDING])
    grant_ids = list(bound.values_list("pk", flat=True))
    # A task that ran out ended its grants at its end (authorize() refused them from then
    # on), however late the job, or a person closing it, records it.
    effective_at = ends_at if ends_at is not None and ends_at <= at else None
    # Calls made under the task whatever their grant (one bound to no task serves every
    # task's calls): none can be allowed any more (authorize(): task_closed), so their
    # open approvals are voided, as a revoke voids a grant's, not left for a person to
    # approve in vain nor counted against APPROVAL_PENDING_MAX until they expire. Those
    # of the grants revoked below are the revoke's to void and count (grant.revoked);
    # it leaves a grant already past its end, so this takes that one's. Done before the
    # revokes append their events: an approval being decided right now holds its row,
    # then takes the chain lock, so this waits for it (and voids what it approved)
    # without holding the chain lock itself.
    ended_at = at if effective_at is None else effective_at
    revoked_below = bound.filter(Q(status=Grant.Status.PENDING) | Q(expires_at__gt=ended_at))
    voided = (
        Approval.objects.filter(
            task_id=pk, status__in=[Approval.Status.PENDING, Approval.Status.APPROVED]
        )
        .exclude(grant__in=revoked_below)
        .update(status=Approval.Status.EXPIRED)
    )
    if grant_ids:
        grants_revoke(
            grant_ids=grant_ids,
            reason=f"task {key} {why}",
            actor=actor,
            at=at,
            revoked_by=closed_by,
            effective_at=effective_at,
        )
    data: dict[str, Any] = {"why": why}
    if ends_at is not None and ends_at < at:
        data["effective_at"] = ends_at.isoformat()
    if voided:
        data["approvals_voided"] = voided
    # Last: the chain lock is the last lock this transaction takes.
    audit.append(event_type=EventType.TASK_CLOSED, actor=actor, at=at, task=key, data=data)
