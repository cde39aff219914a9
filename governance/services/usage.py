"""Grant usage, folded in from the audit log.

access_check() does not UPDATE the grant row on every allowed call (that row
would be hot for a busy agent, and the update would sit in front of the audit
chain's critical section). The decision's `access.allowed` event, which names
the grant and commits in the decision's one statement, is the record of the
use. usage_fold() adds the events written since the last fold to each grant's
use_count and last_used_at. It runs every minute (beat) and before anything
that reads usage to act on it (the unused-grant scan, a review campaign).

Safe to run twice and from two workers: the watermark row is locked, and the
events it folds are exactly those with seq in (watermark, head]. Every event
up to the head it reads has committed: a seq is handed out under the chain
lock, which its transaction holds until it commits.
"""

from __future__ import annotations

from datetime import datetime

from django.db import transaction
from django.db.models import Count, F, Max, Value
from django.db.models.functions import Greatest
from django.utils import timezone

from governance.codes import EventType
from governance.models import AuditEvent, Grant, UsageFold
from governance.services.claims import locked_mark


def usage_fold(*, at: datetime | None = None) -> int:
    """Fold every allowed decision since the last fold into its grant; return how many."""
    with transaction.atomic():
        mark = locked_mark(UsageFold)
        head = AuditEvent.objects.aggregate(head=Max("seq"))["head"] or 0
        if head <= mark.seq:
            return 0
        uses = (
            AuditEvent.objects.filter(
                seq__gt=mark.seq,
                seq__lte=head,
                event_type=EventType.ACCESS_ALLOWED,
                grant_id__isnull=False,
            )
            .values("grant_id")
            .annotate(n=Count("seq"), last=Max("created_at"))
            .order_by("grant_id")  # one lock order for every folder
        )
        total = 0
        for use in uses:
            grant = Grant.objects.filter(pk=use["grant_id"])
            # Never used before: the fold's last use (SQLite's max() of NULL is NULL).
            grant.filter(last_used_at__isnull=True).update(last_used_at=use["last"])
            grant.update(
                use_count=F("use_count") + use["n"],
                last_used_at=Greatest(F("last_used_at"), Value(use["last"])),
            )
            total += use["n"]
        mark.seq = head
        mark.folded_at = at or timezone.now()
        mark.save(update_fields=["seq", "folded_at"])
        return total


def grant_usage(grant: Grant) -> tuple[int, datetime | None]:
    """One grant's usage as of now: the folded count plus its allowed events after
    the watermark (a read; the grant page shows this, lists show the folded value)."""
    mark = UsageFold.objects.filter(pk=1).values_list("seq", flat=True).first() or 0
    pending = AuditEvent.objects.filter(
        seq__gt=mark, grant_id=grant.pk, event_type=EventType.ACCESS_ALLOWED
    ).aggregate(n=Count("seq"), last=Max("created_at"))
    last = max((t for t in (grant.last_used_at, pending["last"]) if t is not None), default=None)
    return grant.use_count + pending["n"], last
