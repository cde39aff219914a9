from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import F, Q

from governance.models.grants import Grant


class BreakGlass(models.Model):
    """Emergency elevation: a live grant opened by a human without approval.

    The grant itself (flagged `break_glass`) is what authorize() sees; this row
    holds the incident trail and the post-incident review item, which must be
    closed (ratified into a normal grant request, or confirmed closed) with a
    comment by someone other than the opener within BREAKGLASS_REVIEW_WITHIN.
    Overdue is decided from `review_due_at`, not from `overdue_at`, which only
    records that the overdue notice went out.
    """

    class Review(models.TextChoices):
        PENDING = "pending"
        RATIFIED = "ratified"
        CONFIRMED_CLOSED = "confirmed_closed"

    grant = models.OneToOneField(Grant, on_delete=models.PROTECT, related_name="breakglass")
    opened_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+"
    )
    ticket = models.CharField(max_length=100)
    reason = models.TextField()
    opened_at = models.DateTimeField()
    expires_at = models.DateTimeField()
    closed_at = models.DateTimeField(null=True, blank=True)
    closed_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    review_status = models.CharField(max_length=20, choices=Review.choices, default=Review.PENDING)
    review_due_at = models.DateTimeField()
    reviewed_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    reviewed_at = models.DateTimeField(null=True, blank=True)
    review_comment = models.TextField(blank=True)
    # The normal grant request a ratification turned this into.
    ratified_request = models.ForeignKey(
        Grant, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    overdue_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-opened_at"]
        indexes = [
            models.Index(
                fields=["review_due_at"],
                name="breakglass_review_due",
                condition=Q(review_status="pending"),
            ),
            models.Index(fields=["opened_by", "opened_at"], name="breakglass_by_opener"),
        ]
        constraints = [
            models.CheckConstraint(
                condition=Q(expires_at__gt=F("opened_at")), name="breakglass_expires_after_open"
            ),
            # Separation of duties: the opener does not review their own incident.
            models.CheckConstraint(
                condition=Q(reviewed_by__isnull=True) | ~Q(reviewed_by=F("opened_by")),
                name="breakglass_reviewer_is_not_opener",
            ),
            models.CheckConstraint(
                condition=Q(review_status="pending")
                | Q(reviewed_by__isnull=False, reviewed_at__isnull=False),
                name="breakglass_review_names_reviewer",
            ),
        ]

    def __str__(self) -> str:
        return f"break-glass #{self.pk} {self.ticket}"
