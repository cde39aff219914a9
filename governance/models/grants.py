from __future__ import annotations

from collections.abc import Iterator

from django.conf import settings
from django.db import models
from django.db.models import F, Q, Value
from django.db.models.functions import Coalesce
from django.utils import timezone

from governance.models.agents import Agent
from governance.models.tasks import Task
from governance.models.tools import Tool
from sandbox_runner.spec import LIMIT_NAMES


class Grant(models.Model):
    """Agent x tool x action classes x scope x time window. Never deleted.

    A grant ends as expired, revoked or denied. `expires_at` is mandatory
    once the grant exists (capped by settings.GRANT_MAX_TTL in the service);
    a pending request carries a requested duration instead, because approval
    starts the clock. Liveness is decided at decision time from the window,
    never from `status`, which is bookkeeping for people and reports, and in
    one place only: governance.policy (authorize, grant_dead_reason).
    """

    class Status(models.TextChoices):
        PENDING = "pending"
        ACTIVE = "active"
        DENIED = "denied"
        REVOKED = "revoked"
        EXPIRED = "expired"

    agent = models.ForeignKey(Agent, on_delete=models.PROTECT, related_name="grants")
    tool = models.ForeignKey(Tool, on_delete=models.PROTECT, related_name="grants")
    task = models.ForeignKey(
        Task, null=True, blank=True, on_delete=models.PROTECT, related_name="grants"
    )
    actions = models.JSONField(help_text="Action classes, e.g. ['read']")
    scope = models.CharField(max_length=500, help_text="Resource pattern, e.g. repo:acme/api/*")
    fields = models.JSONField(default=list, blank=True, help_text="Optional field allowlist")
    egress = models.JSONField(default=list, blank=True, help_text="host:port allowlist")
    # Code-execution ceilings; null means the runner's floor applies.
    limit_cpus = models.FloatField(null=True, blank=True)
    limit_memory_mb = models.PositiveIntegerField(null=True, blank=True)
    limit_pids = models.PositiveIntegerField(null=True, blank=True)
    limit_wall_seconds = models.PositiveIntegerField(null=True, blank=True)
    limit_scratch_mb = models.PositiveIntegerField(
        null=True, blank=True, help_text="Size of the sandbox's /workspace (MiB)"
    )

    justification = models.TextField()
    requested_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    requested_by_agent = models.ForeignKey(
        Agent, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    approved_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.PENDING)
    requested_duration = models.DurationField(null=True, blank=True)
    # The service's `at` (the moment the request, delegation or break-glass was made),
    # which the request's expiry and its stakeholders are judged against.
    created_at = models.DateTimeField(default=timezone.now)
    decided_at = models.DateTimeField(null=True, blank=True)
    decision_reason = models.TextField(blank=True)
    starts_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    revoked_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )

    delegated_from = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.PROTECT, related_name="delegations"
    )
    delegable = models.BooleanField(default=False)
    break_glass = models.BooleanField(default=False)

    use_count = models.PositiveBigIntegerField(default=0)
    last_used_at = models.DateTimeField(null=True, blank=True)
    # Lifecycle bookkeeping (claimed by conditional UPDATE, so each notice goes out once).
    expiring_notified_at = models.DateTimeField(null=True, blank=True)
    unused_flagged_at = models.DateTimeField(null=True, blank=True)
    # The actions the last `grant.unused_flagged` found idle: flagged again when another
    # goes idle or one of these was used since (a new idle spell), not on every scan.
    unused_flagged_actions = models.JSONField(default=list, blank=True)

    class Meta:
        ordering = ["-id"]
        indexes = [
            # authorize() looks grants up by (agent, tool) on every decision.
            models.Index(fields=["agent", "tool"], name="grant_agent_tool"),
            # The expiry job's "due" query only ever scans live rows.
            models.Index(
                fields=["expires_at"], name="grant_active_expiry", condition=Q(status="active")
            ),
        ]
        constraints = [
            models.CheckConstraint(
                condition=Q(expires_at__isnull=True)
                | Q(starts_at__isnull=True)
                | Q(expires_at__gt=F("starts_at")),
                name="grant_expires_after_start",
            ),
            # No permanent grants: anything that ever was live has a window.
            models.CheckConstraint(
                condition=Q(status__in=["pending", "denied"])
                | Q(starts_at__isnull=False, expires_at__isnull=False),
                name="grant_live_states_have_window",
            ),
            models.CheckConstraint(
                condition=Q(requested_by__isnull=False) | Q(requested_by_agent__isnull=False),
                name="grant_has_requester",
            ),
            # Separation of duties: nobody approves their own request.
            models.CheckConstraint(
                condition=Q(approved_by__isnull=True)
                | Q(requested_by__isnull=True)
                | ~Q(approved_by=F("requested_by")),
                name="grant_approver_is_not_requester",
            ),
            # Live without a human approver only when handed down by a parent grant,
            # or opened as break-glass (which names its opener and is reviewed after).
            models.CheckConstraint(
                condition=~Q(status="active")
                | Q(approved_by__isnull=False)
                | Q(delegated_from__isnull=False)
                | Q(break_glass=True),
                name="grant_active_is_approved",
            ),
            models.CheckConstraint(
                condition=~Q(status="revoked") | Q(revoked_at__isnull=False),
                name="grant_revoked_has_time",
            ),
            models.CheckConstraint(
                condition=~Q(delegated_from=F("id")), name="grant_not_own_parent"
            ),
            # One pending request per thing; Coalesce so "no task" counts as a
            # value (NULLs are distinct in a plain unique index).
            models.UniqueConstraint(
                "agent",
                "tool",
                "scope",
                Coalesce("task", Value(0)),
                condition=Q(status="pending"),
                name="grant_one_pending_request",
            ),
        ]

    def __str__(self) -> str:
        return (
            f"grant#{self.pk} {self.agent_id}:{self.tool_id} {','.join(self.actions)} {self.scope}"
        )

    def chain(self) -> Iterator[Grant]:
        """This grant, then each grant it was delegated from, nearest first; bounded,
        as the decision's ancestor walk is, so a corrupted cycle cannot loop."""
        grant: Grant | None = self
        for _ in range(32):
            if grant is None:
                return
            yield grant
            grant = grant.delegated_from

    def limits(self) -> dict[str, float]:
        """The code-execution ceilings this grant sets (absent: the runner's floor)."""
        values = {name: getattr(self, f"limit_{name}") for name in LIMIT_NAMES}
        return {name: value for name, value in values.items() if value is not None}


class GrantActionUse(models.Model):
    """How often, and when last, a grant was used for one action class: read, create,
    update, delete and execute are separate grants, so a grant holding read and delete
    whose agent only reads has an unused delete (selectors.unused_grants). Folded in
    from the `access.allowed` events by services.usage.usage_fold(), with the grant's
    own use_count / last_used_at, never written by a decision. A row exists once the
    grant was used for the action; none: never used for it."""

    grant = models.ForeignKey(Grant, on_delete=models.PROTECT, related_name="action_uses")
    action = models.CharField(max_length=64)
    use_count = models.PositiveBigIntegerField(default=0)
    last_used_at = models.DateTimeField()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["grant", "action"], name="grant_action_use_once"),
        ]
        indexes = [
            # The unused scan reads the uses since its cutoff (delegations' too).
            models.Index(fields=["last_used_at"], name="grant_action_use_last"),
        ]

    def __str__(self) -> str:
        return f"grant#{self.grant_id} {self.action}: {self.use_count}, last {self.last_used_at}"


class UsageFold(models.Model):
    """How far grant usage has been folded in from the audit log (one row, pk 1).

    A decision records a grant's use only as its `access.allowed` event (written
    in the decision's one statement, never an UPDATE of the grant row per call);
    services.usage.usage_fold() adds the events after `seq` to each grant's
    use_count and last_used_at, and to its GrantActionUse row for the call's action.
    """

    seq = models.BigIntegerField(default=0)
    folded_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"usage folded through seq {self.seq}"
