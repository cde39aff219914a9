from __future__ import annotations

from django.db import models
from django.db.models import Q


class Notification(models.Model):
    """One message to one target (an e-mail address or a configured webhook), and
    how its delivery went.

    A table rather than audit events because delivery is mutable bookkeeping:
    attempts, the last error and the final status change with every retry, and
    the audit chain is append-only and records governance state, whose volume
    must not depend on a third party's uptime. The row is written in the same
    transaction as the change it announces (an outbox): a rolled-back change
    leaves no notification, and a committed one always has its row, even if
    the broker was down at commit time (the sweep job picks it up).
    """

    class Channel(models.TextChoices):
        EMAIL = "email"
        WEBHOOK = "webhook"

    class Status(models.TextChoices):
        PENDING = "pending"
        SENDING = "sending"
        SENT = "sent"
        FAILED = "failed"

    event = models.CharField(max_length=50, db_index=True)
    channel = models.CharField(max_length=10, choices=Channel.choices)
    # An e-mail address; for a webhook the SHA-256 of its URL (webhook URLs carry
    # secrets, so the URL itself is read from settings at delivery time).
    target = models.CharField(max_length=254)
    subject = models.CharField(max_length=200)
    body = models.TextField()
    data = models.JSONField(default=dict, blank=True)
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    last_error = models.TextField(blank=True)
    created_at = models.DateTimeField()
    next_attempt_at = models.DateTimeField()
    claimed_at = models.DateTimeField(null=True, blank=True)
    sent_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]
        indexes = [
            # The sweep's "due" query only scans undelivered rows.
            models.Index(
                fields=["next_attempt_at"],
                name="notification_due",
                condition=Q(status__in=["pending", "sending"]),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.event} -> {self.channel} ({self.status})"
