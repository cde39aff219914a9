from __future__ import annotations

from datetime import datetime

from django.conf import settings
from django.db import models
from django.db.models import F, Q


class Task(models.Model):
    """The unit of work. Grants bound to a task die with it."""

    class Status(models.TextChoices):
        OPEN = "open"
        CLOSED = "closed"

    key = models.CharField(max_length=100, unique=True, help_text="Ticket or task id")
    title = models.CharField(max_length=200, blank=True)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+")
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.OPEN)
    starts_at = models.DateTimeField()
    ends_at = models.DateTimeField(null=True, blank=True)
    closed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["key"]
        constraints = [
            models.CheckConstraint(
                condition=Q(ends_at__isnull=True) | Q(ends_at__gt=F("starts_at")),
                name="task_ends_after_start",
            ),
            models.CheckConstraint(
                condition=Q(status="open", closed_at__isnull=True)
                | Q(status="closed", closed_at__isnull=False),
                name="task_closed_has_time",
            ),
        ]

    def __str__(self) -> str:
        return self.key

    def is_open_at(self, at: datetime) -> bool:
        return window_open_at(self.starts_at, self.ends_at, self.closed_at, at)


def window_open_at(
    starts_at: datetime | None, ends_at: datetime | None, closed_at: datetime | None, at: datetime
) -> bool:
    """A task is open from its start until it ends or is closed, whichever is first.

    Decided from the times, never from `status` (bookkeeping); authorize() uses
    this same function on the raw row.
    """
    if starts_at is not None and starts_at > at:
        return False
    if ends_at is not None and ends_at <= at:
        return False
    return closed_at is None or closed_at > at


def open_at_q(at: datetime, prefix: str = "") -> Q:
    """window_open_at() as a query filter, for a task reached through `prefix`
    (`task__`): the same rule, where rows are filtered in the database."""
    return (
        Q(**{f"{prefix}starts_at__lte": at})
        & (Q(**{f"{prefix}ends_at__isnull": True}) | Q(**{f"{prefix}ends_at__gt": at}))
        & (Q(**{f"{prefix}closed_at__isnull": True}) | Q(**{f"{prefix}closed_at__gt": at}))
    )
