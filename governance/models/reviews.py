from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import F, Q

from governance.models.agents import Agent
from governance.models.approvals import Approval
from governance.models.grants import Grant


class ReviewCampaign(models.Model):
    """A re-certification round: one item per live grant that needs a look.

    `key` makes opening idempotent where the trigger is ("scheduled:2026Q4",
    "incident:breakglass:7"); on-demand campaigns without a key always open anew.
    """

    class Kind(models.TextChoices):
        SCHEDULED = "scheduled"
        ON_DEMAND = "on_demand"
        INCIDENT = "incident"

    class Status(models.TextChoices):
        OPEN = "open"
        CLOSED = "closed"

    key = models.CharField(max_length=100, unique=True, null=True, blank=True)
    kind = models.CharField(max_length=10, choices=Kind.choices)
    reason = models.TextField()
    # Limits the campaign to one agent's grants (incident campaigns).
    agent = models.ForeignKey(
        Agent, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    opened_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    opened_at = models.DateTimeField()
    due_at = models.DateTimeField()
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.OPEN)
    closed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-opened_at"]
        constraints = [
            models.CheckConstraint(
                condition=Q(due_at__gt=F("opened_at")), name="campaign_due_after_open"
            ),
        ]

    def __str__(self) -> str:
        return f"campaign #{self.pk} {self.kind}"


class ReviewItem(models.Model):
    """One grant to keep, narrow or revoke, with a comment, by an assigned reviewer
    who is never the grant's approver or requester."""

    class Status(models.TextChoices):
        PENDING = "pending"
        KEPT = "kept"
        NARROWED = "narrowed"
        REVOKED = "revoked"
        # Nobody decided by the due date: REVIEW_DEFAULT_RULE applied.
        AUTO_REVOKED = "auto_revoked"
        AUTO_KEPT = "auto_kept"
        # The grant ended on its own before anyone decided: nothing left to review.
        ENDED = "ended"

    class Proposal(models.TextChoices):
        NONE = ""
        REMOVE = "remove"  # nothing it holds was used
        NARROW_TO_READ = "narrow_to_read"  # only read was used
        NARROW_TO_USED = "narrow_to_used"  # keep the actions used, drop the idle ones

    campaign = models.ForeignKey(ReviewCampaign, on_delete=models.PROTECT, related_name="items")
    grant = models.ForeignKey(Grant, on_delete=models.PROTECT, related_name="review_items")
    reviewer = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    proposal = models.CharField(max_length=20, choices=Proposal.choices, blank=True, default="")
    # With a proposal: the actions found idle when the campaign opened (all of them for
    # `remove`), so the reviewer sees which rights went unused.
    idle_actions = models.JSONField(default=list, blank=True)
    status = models.CharField(max_length=15, choices=Status.choices, default=Status.PENDING)
    due_at = models.DateTimeField()
    decided_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    decided_at = models.DateTimeField(null=True, blank=True)
    comment = models.TextField(blank=True)
    reminded_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["due_at", "id"]
        indexes = [
            models.Index(fields=["due_at"], name="review_item_due", condition=Q(status="pending")),
        ]
        constraints = [
            models.UniqueConstraint(fields=["campaign", "grant"], name="review_item_once"),
            models.CheckConstraint(
                condition=Q(status="pending") | Q(decided_at__isnull=False),
                name="review_item_decided_has_time",
            ),
        ]

    def __str__(self) -> str:
        return f"review item #{self.pk} grant#{self.grant_id} ({self.status})"


class LiveGrantSnapshot(models.Model):
    """The number of live grants on one day, in total and per agent name.

    Recorded daily so a report can show the matrix stays flat or shrinks;
    a rise is highlighted by selectors.grant_trend().
    """

    day = models.DateField(unique=True)
    taken_at = models.DateTimeField()
    total = models.PositiveIntegerField()
    per_agent = models.JSONField(default=dict)

    class Meta:
        ordering = ["day"]

    def __str__(self) -> str:
        return f"{self.day}: {self.total}"


class SecondLook(models.Model):
    """An approved grant request or destructive action, sampled for review by a
    different approver (not the one who approved it, nor its requester)."""

    class Kind(models.TextChoices):
        GRANT = "grant"
        APPROVAL = "approval"

    class Status(models.TextChoices):
        PENDING = "pending"
        CONFIRMED = "confirmed"
        FLAGGED = "flagged"

    kind = models.CharField(max_length=10, choices=Kind.choices)
    grant = models.ForeignKey(
        Grant, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    approval = models.ForeignKey(
        Approval, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    original_approver = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+"
    )
    reviewer = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    sampled_at = models.DateTimeField()
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.PENDING)
    decided_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    decided_at = models.DateTimeField(null=True, blank=True)
    comment = models.TextField(blank=True)

    class Meta:
        ordering = ["-sampled_at"]
        constraints = [
            models.CheckConstraint(
                condition=Q(kind="grant", grant__isnull=False, approval__isnull=True)
                | Q(kind="approval", approval__isnull=False),
                name="second_look_names_its_subject",
            ),
            # Sampled at most once each, however often the sampler runs.
            models.UniqueConstraint(
                fields=["grant"], condition=Q(kind="grant"), name="second_look_grant_once"
            ),
            models.UniqueConstraint(
                fields=["approval"],
                condition=Q(kind="approval"),
                name="second_look_approval_once",
            ),
            models.CheckConstraint(
                condition=Q(decided_by__isnull=True) | ~Q(decided_by=F("original_approver")),
                name="second_look_by_another_approver",
            ),
        ]

    def __str__(self) -> str:
        return f"second look #{self.pk} {self.kind}"


class SecondLookMark(models.Model):
    """How far second-look sampling has read (one row, pk 1): the upper bound of the
    last run's window. The next run samples from here (or the last 24 h, whichever
    is longer), so a run that comes late or after a gap still sees every approval
    decided since the one before (services.second_look; the pattern of UsageFold).
    """

    sampled_through = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"second looks sampled through {self.sampled_through}"


def undecided_at_due_q() -> Q:
    """Review items still undecided at their due date, whatever came after: under
    REVIEW_DEFAULT_RULE `revoke` each ended its grant at due_at. Pending still, revoked
    by the job, or closed `ended` later because the grant ended meanwhile (revoked,
    expired, its task closed) before the job ran. policy._REVIEW_DUE says it in SQL."""
    return Q(status__in=["pending", "auto_revoked"]) | Q(
        status="ended", decided_at__gte=F("due_at")
    )
