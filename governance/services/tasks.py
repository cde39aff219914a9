"""Tasks: open, and close (which ends every grant bound to the task)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db import IntegrityError, transaction

from governance import audit
from governance.codes import EventType
from governance.errors import Conflict, GovernanceError
from governance.models import Grant, Task
from governance.services.grants import grant_revoke


def task_open(
    *,
    key: str,
    owner: Any,
    actor: audit.Actor,
    at: datetime,
    title: str = "",
    ends_at: datetime | None = None,
) -> Task:
    if not key or len(key) > 100 or key != key.strip():
        raise GovernanceError("invalid_task_key", "A task key is 1-100 characters, no padding.")
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
        if not Task.objects.filter(pk=task.pk, status=Task.Status.OPEN).update(
            status=Task.Status.CLOSED, closed_at=at
        ):
            task.refresh_from_db()
            return task
        audit.append(event_type=EventType.TASK_CLOSED, actor=actor, at=at, task=task.key)
        for grant_id in Grant.objects.filter(
            task=task, status__in=[Grant.Status.ACTIVE, Grant.Status.PENDING]
        ).values_list("pk", flat=True):
            grant_revoke(
                grant_id=grant_id,
                reason=f"task {task.key} closed",
                actor=actor,
                at=at,
                revoked_by=closed_by,
            )
    task.refresh_from_db()
    return task
