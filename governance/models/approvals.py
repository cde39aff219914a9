from __future__ import annotations

import uuid
from typing import Any

from django.conf import settings
from django.db import models
from django.db.models import F, Q

from governance.models.agents import Agent
from governance.models.grants import Grant
from governance.models.tasks import Task
from governance.models.tools import Tool


class ConfirmationPolicy(models.Model):
    """The confirmation gate answered by a rule instead of a person, for one agent's
    destructive calls on one tool and action inside a scope pattern (optionally only
    under one task), for a bounded window.

    `approve`: each matching call is allowed once, recorded as an approval consumed
    at once and naming this policy. `deny`: each matching call is denied
    (`approval_denied`), and deny wins over approve. Written by a person with the
    approver role (for `approve`, one with no stake in the agent's calls); never
    deleted, ends by expiry or revocation. Only governance.policy.authorize() reads it
    for a decision.
    """

    class Verdict(models.TextChoices):
        APPROVE = "approve"
        DENY = "deny"

    agent = models.ForeignKey(Agent, on_delete=models.PROTECT, related_name="+")
    tool = models.ForeignKey(Tool, on_delete=models.PROTECT, related_name="+")
    task = models.ForeignKey(
        Task, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    action = models.CharField(max_length=10)
    scope = models.CharField(max_length=500, help_text="Resource pattern, e.g. repo:acme/tmp/*")
    verdict = models.CharField(max_length=10, choices=Verdict.choices)
    reason = models.TextField()
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+"
    )
    created_at = models.DateTimeField()
    starts_at = models.DateTimeField()
    expires_at = models.DateTimeField()
    revoked_at = models.DateTimeField(null=True, blank=True)
    revoked_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    revoke_reason = models.TextField(blank=True)
    # The tool's approved definition (its hash) when the policy was written: an approve
    # policy is a standing approval of calls to the tool as it was then, and stops
    # answering once another definition is approved (as open approvals are voided).
    definition_hash = models.CharField(max_length=64, blank=True, default="")

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["agent", "tool", "action"], name="confirm_policy_call")]
        constraints = [
            models.CheckConstraint(
                condition=Q(expires_at__gt=F("starts_at")), name="confirm_policy_window"
            ),
            models.CheckConstraint(
                condition=Q(verdict__in=["approve", "deny"]), name="confirm_policy_verdict"
            ),
            # Every end is accounted for: a person revoked it, or the service that ended
            # it (a suspension: services.confirmation.approve_policies_end) says why.
            models.CheckConstraint(
                condition=Q(revoked_at__isnull=True)
                | Q(revoked_by__isnull=False)
                | ~Q(revoke_reason=""),
                name="confirm_policy_revoked_by",
            ),
        ]

    def __str__(self) -> str:
        return f"confirmation policy #{self.pk} ({self.verdict})"

    def for_current_definition(self) -> bool:
        """Written against the tool's approved definition as it is now (policy.py's
        _POLICY_QUERY asks the same in SQL)."""
        return self.definition_hash == self.tool.approved_hash

    def live_at(self, at: Any) -> bool:
        """Bookkeeping for lists; decisions ask authorize()."""
        ended = self.revoked_at is not None and self.revoked_at <= at
        return self.starts_at <= at < self.expires_at and not ended


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
    # Set when a confirmation policy, not a person, answered the gate for this call.
    policy = models.ForeignKey(
        ConfirmationPolicy, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
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
    def hidden_values(self) -> int:
        """How many values in the preview are masked: a key named like a credential
        (`auth_token`) hides whatever the agent put there, and the approval binds it."""
        from governance.audit import hidden_values  # audit imports the models

        return hidden_values(self.arguments_preview)

    @property
    def unseen(self) -> list[str]:
        """What the arguments name only by hash and the approver cannot read: a sandbox
        run's script or input whose runner did not send the bytes."""
        preview = self.arguments_preview if isinstance(self.arguments_preview, dict) else {}
        shown = self.attachments if isinstance(self.attachments, dict) else {}
        return [n for n in ("script", "input") if preview.get(f"{n}_sha256") and n not in shown]
