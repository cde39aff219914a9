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
        if self.starts_at > at:
            return False
        if self.ends_at is not None and self.ends_at <= at:
            return False
        return self.closed_at is None or self.closed_at > at
