from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models
from django.db.models import F, Q

from governance.models.agents import Agent
from governance.models.grants import Grant
from governance.models.tasks import Task
from governance.models.tools import Tool


class Approval(models.Model):
    """The confirmation gate for one destructive call.

    Bound to agent, tool, action, scope and the keyed hash of the exact
    arguments, single use, short-lived. Consumption is one conditional
    UPDATE (status approved -> consumed) so two callers can never both use it.
    """

    class Status(models.TextChoices):
        PENDING = "pending"
        APPROVED = "approved"
        DENIED = "denied"
        CONSUMED = "consumed"
        EXPIRED = "expired"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    agent = models.ForeignKey(Agent, on_delete=models.PROTECT, related_name="approvals")
    tool = models.ForeignKey(Tool, on_delete=models.PROTECT, related_name="approvals")
    grant = models.ForeignKey(Grant, on_delete=models.PROTECT, related_name="approvals")
    task = models.ForeignKey(
        Task, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    action = models.CharField(max_length=10)
    scope = models.CharField(max_length=500)
    arguments_hash = models.CharField(max_length=64)
    arguments_preview = models.JSONField(default=dict, blank=True, help_text="Masked arguments")
    # What the approver reads beside the arguments when these hold only hashes: a
    # sandbox run's script and input, each checked against the hash the approval binds
    # (so it is exactly what would run) and masked as arguments are. Not hashed itself.
    attachments = models.JSONField(
        default=dict, blank=True, help_text="Masked script and input of a sandbox run"
    )
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.PENDING)
    requested_at = models.DateTimeField()
    expires_at = models.DateTimeField()
    decided_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    decided_at = models.DateTimeField(null=True, blank=True)
    decision_reason = models.TextField(blank=True)
    consumed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-requested_at"]
        indexes = [
            models.Index(
                fields=["expires_at"], name="approval_open_expiry", condition=Q(status="pending")
            ),
        ]
        constraints = [
            models.CheckConstraint(
                condition=Q(expires_at__gt=F("requested_at")), name="approval_expires_after_request"
            ),
            models.CheckConstraint(
                condition=~Q(status="consumed") | Q(consumed_at__isnull=False),
                name="approval_consumed_has_time",
            ),
        ]

    def __str__(self) -> str:
        return f"approval {self.id} ({self.status})"

    @property
    def preview_truncated(self) -> bool:
        """The preview is only the start of a call too long to show (audit's cut)."""
        preview = self.arguments_preview
        return isinstance(preview, dict) and bool(preview.get("_truncated"))

    @property
    def unseen(self) -> list[str]:
        """What the arguments name only by hash and the approver cannot read: a sandbox
        run's script or input whose runner did not send the bytes."""
        preview = self.arguments_preview if isinstance(self.arguments_preview, dict) else {}
        shown = self.attachments if isinstance(self.attachments, dict) else {}
        return [n for n in ("script", "input") if preview.get(f"{n}_sha256") and n not in shown]
