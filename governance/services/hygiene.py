"""Jobs that keep the matrix shrinking: unused-grant flags, the daily trend snapshot,
expiring-soon notices and token expiry bookkeeping.

Signatures (keyword-only; each is a job, safe to run twice and from two workers):

    grants_flag_unused(*, actor, at) -> int        one `grant.unused_flagged` per grant
        per idle spell, naming its idle actions (flagged again when they change, or
        after one of them was used since)
    trend_snapshot_record(*, actor, at) -> LiveGrantSnapshot   one per UTC day, missed
        days (the job did not run) recorded late
    grants_notify_expiring(*, actor, at) -> int    one notice per grant
    tokens_expire(*, actor, at) -> int             one `agent_token.expired` per token
    expire_due(*, actor, at) -> dict[str, int]      every end-of-window bookkeeping step

Read side: selectors.unused_grants(at) and selectors.grant_trend().
"""

from __future__ import annotations

from datetime import UTC, date, datetime, time, timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Count

from governance import audit, notifications
from governance.codes import EventType
from governance.models import AgentToken, Grant, LiveGrantSnapshot
from governance.selectors import grants_in_force, unused_grants
from governance.services.approvals import approvals_expire
from governance.services.claims import claim_each, run_parts
from governance.services.grants import grant_event, grant_requests_expire, grants_expire
from governance.services.tasks import tasks_end
from governance.services.usage import usage_fold


def grants_flag_unused(*, actor: audit.Actor, at: datetime) -> int:
    """Flag live grants with rights idle for UNUSED_GRANT_HOURS (selectors.unused_grants):
    a wholly idle grant is proposed for removal; one whose create, update, delete or
    execute went unused while it was used for something else, for narrowing to the
    actions used (`narrow_to_read` when that is read alone). The event names the idle
    actions, and the grant's requester and the agent's owner are told (they can give it
    back now). The flag is what the next campaign's item and the dashboard show; the
    decision stays with a reviewer.

    Once per idle spell: flagged again only when the idle actions are not those last
    flagged (another went idle, or one was used again) or one of them was used since
    the flag (idle again after a use), not on every scan of a grant still read daily."""
    usage_fold(at=at)  # usage as of now, not as of the last scheduled fold
    found = {g.pk: g for g in unused_grants(at)}
    due = [pk for pk, g in found.items() if _new_spell(g)]

    def claim(pk: int) -> int:
        grant = found[pk]
        # The flag as read (None: never flagged): one worker that flagged it meanwhile
        # has moved it on, and the other's claim finds nothing.
        return Grant.objects.filter(pk=pk, unused_flagged_at=grant.unused_flagged_at).update(
            unused_flagged_at=at,
            unused_flagged_actions=grant.idle_actions,  # type: ignore[attr-defined]
        )

    def announce(pk: int) -> None:
        grant = Grant.objects.select_related("agent", "tool", "task").get(pk=pk)
        idle = found[pk]
        last = idle.action_last_used  # type: ignore[attr-defined]
        grant_event(
            grant,
            EventType.GRANT_UNUSED_FLAGGED,
            actor=actor,
            at=at,
            data={
                "proposal": idle.proposal,  # type: ignore[attr-defined]
                "idle_actions": idle.idle_actions,  # type: ignore[attr-defined]
                "keep_actions": idle.keep_actions,  # type: ignore[attr-defined]
                "last_used": {
                    a: last[a].isoformat() if a in last else None
                    for a in idle.idle_actions  # type: ignore[attr-defined]
                },
                "idle_since": idle.idle_since.isoformat(),  # type: ignore[attr-defined]
                "hours": settings.UNUSED_GRANT_HOURS,
            },
        )
        notifications.grant_unused(
            grant=grant,
            proposal=idle.proposal,  # type: ignore[attr-defined]
            idle_actions=idle.idle_actions,  # type: ignore[attr-defined]
            keep_actions=idle.keep_actions,  # type: ignore[attr-defined]
            at=at,
        )

    return claim_each(due, claim=claim, announce=announce)


def _new_spell(grant: Grant) -> bool:
    """Whether an idle grant's flag is due (grants_flag_unused)."""
    if grant.unused_flagged_at is None:
        return True
    idle = grant.idle_actions  # type: ignore[attr-defined]
    if sorted(idle) != sorted(grant.unused_flagged_actions or []):
        return True
    last = grant.action_last_used  # type: ignore[attr-defined]
    used = [last[a] for a in idle if a in last]
    if len(idle) == len(grant.actions) and grant.last_used_at is not None:
        used.append(grant.last_used_at)  # wholly idle: any use since the flag
    return any(when > grant.unused_flagged_at for when in used)


# A beat that was down for a while leaves days unrecorded: the next run records each of
# them (counted from the grants' own windows, as any day is), at most this many back.
TREND_BACKFILL_DAYS = 92


def trend_snapshot_record(*, actor: audit.Actor, at: datetime) -> LiveGrantSnapshot:
    """Count live grants in total and per agent at the end of the UTC day before `at`'s
    (the job runs just after midnight: the day that has just ended), once per day: those
    in force then (one bound to a task that had ended is not, job or no job). The
    dashboard's chart reads each day's point at that day's end, as here.

    Days missed since the newest snapshot (the job did not run: beat down, a worker
    outage) are recorded first, oldest first, each as it would have been, so the daily
    series an auditor reads has no hole where a rise could hide. Returns the snapshot
    of the day before `at`'s."""
    day = at.astimezone(UTC).date() - timedelta(days=1)
    newest = (
        LiveGrantSnapshot.objects.filter(day__lt=day).order_by("-day").values_list("day", flat=True)
    ).first()
    first = (
        day
        if newest is None
        else max(newest + timedelta(days=1), day - timedelta(days=TREND_BACKFILL_DAYS))
    )
    missed = [first + timedelta(days=n) for n in range((day - first).days)]
    for past in missed:
        _record_day(past, actor=actor, at=at, backfilled=True)
    return _record_day(day, actor=actor, at=at, backfilled=False)


def _record_day(
    day: date, *, actor: audit.Actor, at: datetime, backfilled: bool
) -> LiveGrantSnapshot:
    existing = LiveGrantSnapshot.objects.filter(day=day).first()
    if existing is not None:
        return existing
    end = datetime.combine(day, time.max, tzinfo=UTC)
    rows = grants_in_force(end).values("agent__name").annotate(n=Count("id")).order_by()
    per_agent = {row["agent__name"]: row["n"] for row in rows}
    data = {
        "day": day.isoformat(),
        "counted_at": end.isoformat(),
        "total": sum(per_agent.values()),
        "per_agent": per_agent,
    }
    if backfilled:
        data["backfilled"] = True  # recorded late: its day's own run was missed
    try:
        with transaction.atomic():
            snap = LiveGrantSnapshot.objects.create(
                day=day, taken_at=at, total=data["total"], per_agent=per_agent
            )
            audit.append(event_type=EventType.TREND_RECORDED, actor=actor, at=at, data=data)
    except IntegrityError:
        return LiveGrantSnapshot.objects.get(day=day)  # another worker was first
    return snap


def grants_notify_expiring(*, actor: audit.Actor, at: datetime) -> int:
    """Tell requester and owner once when a live grant has GRANT_EXPIRING_NOTICE left.
    No audit event: a notice changes no governance state (the Notification row is its
    record). Delegated grants are skipped: their parent's notice covers them."""
    soon = at + settings.GRANT_EXPIRING_NOTICE
    due = Grant.objects.filter(
        status=Grant.Status.ACTIVE,
        expiring_notified_at__isnull=True,
        delegated_from__isnull=True,
        expires_at__gt=at,
        expires_at__lte=soon,
    ).values_list("pk", flat=True)
    return claim_each(
        due,
        claim=lambda pk: Grant.objects.filter(pk=pk, expiring_notified_at__isnull=True).update(
            expiring_notified_at=at
        ),
        announce=lambda pk: notifications.grant_expiring(
            grant=Grant.objects.select_related("agent__owner", "tool", "task", "requested_by").get(
                pk=pk
            ),
            at=at,
        ),
    )


def tokens_expire(*, actor: audit.Actor, at: datetime) -> int:
    """Bookkeeping: announce each token past its expiry once (`agent_token.expired`).
    Authentication already refuses it from expires_at on; this only records it."""
    due = AgentToken.objects.filter(
        expires_at__lte=at, expiry_announced_at__isnull=True, revoked_at__isnull=True
    ).values_list("pk", flat=True)

    def announce(pk: int) -> None:
        token = AgentToken.objects.select_related("agent", "user").get(pk=pk)
        holder = token.agent.name if token.agent else f"user:{token.user.get_username()}"
        audit.append(
            event_type=EventType.TOKEN_EXPIRED,
            actor=actor,
            at=at,
            agent=token.agent.name if token.agent else "",
            data={
                "prefix": token.prefix,
                "holder": holder,
                "expires_at": token.expires_at.isoformat(),
            },
        )

    return claim_each(
        due,
        claim=lambda pk: AgentToken.objects.filter(
            pk=pk, expiry_announced_at__isnull=True, revoked_at__isnull=True
        ).update(expiry_announced_at=at),
        announce=announce,
    )


def expire_due(*, actor: audit.Actor, at: datetime) -> dict[str, int]:
    """Everything whose window has ended, marked so, one audit event each: tasks past
    ends_at closed (their grants revoked), grants and approvals past their end expired,
    grant requests left undecided past GRANT_REQUEST_TTL closed, and expired tokens
    announced. Bookkeeping only: authorize() and authentication already refuse all of
    these from the end of their window on. How many of each, by name. Each part runs
    even if one before it failed (claims.run_parts)."""
    return run_parts(
        "expire_due",
        {
            # Grants first: one that ran out before its task ended is recorded as
            # expired, not as revoked by the task's end.
            "grants": lambda: grants_expire(actor=actor, at=at),
            "tasks": lambda: tasks_end(actor=actor, at=at),
            "approvals": lambda: approvals_expire(actor=actor, at=at),
            "requests": lambda: grant_requests_expire(actor=actor, at=at),
            "tokens": lambda: tokens_expire(actor=actor, at=at),
        },
    )
