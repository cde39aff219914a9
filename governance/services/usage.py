"""Grant usage, folded in from the audit log.

access_check() does not UPDATE the grant row on every allowed call (that row
would be hot for a busy agent, and the update would sit in front of the audit
chain's critical section). The decision's `access.allowed` event, which names
the grant and commits in the decision's one statement, is the record of the
use. usage_fold() adds the events written since the last fold to each grant's
use_count and last_used_at, and per action class to its GrantActionUse rows (read,
create, update, delete and execute are separate grants: a delete right that is never
used is unused, however often the grant reads). It runs every minute (beat) and before anything
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
from governance.models import AuditEvent, Grant, GrantActionUse, UsageFold
from governance.services.claims import locked_mark


def usage_fold(*, at: datetime | None = None) -> int:
    """Fold every allowed decision since the last fold into its grant, and into the
    grant's use of the call's action (GrantActionUse); return how many."""
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
            .values("grant_id", "action")
            .annotate(n=Count("seq"), last=Max("created_at"))
            .order_by("grant_id", "action")  # one lock order for every folder
        )
        per_grant: dict[int, dict[str, tuple[int, datetime]]] = {}
        for use in uses:
            per_grant.setdefault(use["grant_id"], {})[use["action"]] = (use["n"], use["last"])
        total = 0
        for grant_id, actions in per_grant.items():
            n = sum(count for count, _ in actions.values())
            last = max(when for _, when in actions.values())
            grant = Grant.objects.filter(pk=grant_id)
            # Never used before: the fold's last use (SQLite's max() of NULL is NULL).
            grant.filter(last_used_at__isnull=True).update(last_used_at=last)
            found = grant.update(
                use_count=F("use_count") + n,
                last_used_at=Greatest(F("last_used_at"), Value(last)),
            )
            if found:  # the rows below need their grant (one that is not: nothing to note)
                for action, (count, when) in actions.items():
                    _fold_action(grant_id, action, count, when)
            total += n
        mark.seq = head
        mark.folded_at = at or timezone.now()
        mark.save(update_fields=["seq", "folded_at"])
        return total


def _fold_action(grant_id: int, action: str, count: int, last: datetime) -> None:
    """Add `count` uses ending at `last` to the grant's row for `action` (created on its
    first use). Under the watermark's lock: no other folder writes these rows."""
    use = GrantActionUse.objects.filter(grant_id=grant_id, action=action)
    changed = use.update(
        use_count=F("use_count") + count,
        last_used_at=Greatest(F("last_used_at"), Value(last)),
    )
    if not changed:
        GrantActionUse.objects.create(
            grant_id=grant_id, action=action, use_count=count, last_used_at=last
        )


def grant_usage(grant: Grant) -> tuple[int, datetime | None]:
    """One grant's usage as of now: the folded count plus its allowed events after
    the watermark (a read; the grant page shows this, lists show the folded value)."""
    mark = UsageFold.objects.filter(pk=1).values_list("seq", flat=True).first() or 0
    pending = AuditEvent.objects.filter(
        seq__gt=mark, grant_id=grant.pk, event_type=EventType.ACCESS_ALLOWED
    ).aggregate(n=Count("seq"), last=Max("created_at"))
    last = max((t for t in (grant.last_used_at, pending["last"]) if t is not None), default=None)
    return grant.use_count + pending["n"], last


def grant_action_usage(grant: Grant) -> list[tuple[str, int, datetime | None]]:
    """grant_usage() per action the grant holds, in its order: (action, uses, last use),
    0 and None for one never used (the grant page: which of its rights are idle)."""
    mark = UsageFold.objects.filter(pk=1).values_list("seq", flat=True).first() or 0
    found: dict[str, tuple[int, datetime | None]] = {
        a: (n, last)
        for a, n, last in grant.action_uses.values_list("action", "use_count", "last_used_at")
    }
    pending = (
        AuditEvent.objects.filter(
            seq__gt=mark, grant_id=grant.pk, event_type=EventType.ACCESS_ALLOWED
        )
        .values("action")
        .annotate(n=Count("seq"), last=Max("created_at"))
        .order_by()
    )
    for row in pending:
        n, last = found.get(row["action"], (0, None))
        found[row["action"]] = (n + row["n"], max(t for t in (last, row["last"]) if t))
    return [(a, *found.get(a, (0, None))) for a in grant.actions]
