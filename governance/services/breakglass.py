"""Break-glass: emergency elevation by a human, with a trail someone must close.

Signatures (all keyword-only; `actor` is who is recorded in the audit log, `at` is now):

    breakglass_open(*, opener, agent, tool, actions, scope, ticket, reason, actor, at,
                    ttl=None, task=None) -> BreakGlass
        A live grant at once (flagged break_glass), the review item due in
        BREAKGLASS_REVIEW_WITHIN, every skipped approver notified. Raises Forbidden
        `human_only` (not a person) / `auditor_read_only` (an auditor and nothing
        more, even the agent's owner) / `not_allowed` (neither approver, admin nor the
        agent's owner), GovernanceError `invalid_ticket` / `reason_required` /
        `breakglass_ttl_too_long` (longer than BREAKGLASS_MAX_TTL or GRANT_MAX_TTL,
        whichever is shorter: refused, never shortened) / `invalid_ttl` /
        `invalid_grant`, RateLimited
        `breakglass_rate_limited` (with `retry_after`, the seconds until an open
        leaves the hour), Conflict `breakglass_active` (a break-glass for this agent
        and tool is live: at most one at a time, whoever opened it) /
        `breakglass_unreviewed` (an earlier one for this agent and tool still awaits
        its review: a second person ratifies or confirms it closed before elevation
        continues, so nobody chains break-glass back to back). Calling it again with
        the same opener, agent, tool, actions, scope, task and ticket while that one's
        grant is live returns the same row (the one exact repeat).
    breakglass_close(*, breakglass_id, closed_by, comment, actor, at) -> BreakGlass
        Ends the grant early (revoked, with anything delegated from it; that
        `grant.revoked` is the one event). `closed_by` is an approver, an admin or
        the person who opened it (Forbidden `not_allowed`). A break-glass whose
        grant already ended elsewhere is marked closed too (`breakglass.closed`
        event); closing a closed one changes nothing.
    breakglass_ratify(*, breakglass_id, reviewer, comment, actor, at, duration=None)
        -> BreakGlass
        Closes the review by turning the access into a normal grant request (pending,
        requested by the reviewer, needs a different approver, never the opener:
        grants._approve_row). `ratified_request`. Without a duration it asks for the
        break-glass window, cut to GRANT_MAX_TTL (the maximum may have been lowered).
    breakglass_confirm_closed(*, breakglass_id, reviewer, comment, actor, at) -> BreakGlass
        Closes the review: the incident is over; a still-live grant is revoked now.
    breakglass_reviews_mark_overdue(*, actor, at) -> int      (the job)

Reviews: `reviewer` is an approver or admin, never the opener and never anyone with
a stake in the agent (approvals.stakeholders; Forbidden `self_review`); a comment is
required; a second decision gets Conflict
`already_reviewed` and changes nothing. The review row is locked (SELECT FOR UPDATE),
so two people deciding at once decide it once.

Selectors for pages: breakglass_active(at), breakglass_reviews_pending(at) (each row
with `.is_overdue`), in governance/selectors.py.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import transaction

from governance import audit, notifications, roles
from governance.codes import EventType
from governance.errors import Conflict, Forbidden, GovernanceError, RateLimited
from governance.models import Agent, BreakGlass, Grant, Task, Tool
from governance.selectors import approver_users
from governance.services.approvals import stakeholders
from governance.services.claims import claim_each
from governance.services.grants import (
    grant_event,
    grant_request,
    grant_revoke,
    refuse_subagent_grant,
    require_open_task,
    validate_shape,
    whole_seconds,
)


def _event(bg: BreakGlass, event_type: str, actor: audit.Actor, at: datetime, **data: Any) -> None:
    grant_event(
        bg.grant,
        event_type,
        actor=actor,
        at=at,
        data={"breakglass_id": bg.pk, "ticket": bg.ticket, **data},
    )


def _check_opener(opener: Any, agent: Agent) -> None:
    # Agents (and their tokens) never elevate themselves or anyone else.
    if not roles.is_human(opener):
        raise Forbidden("human_only", "Only a person can open break-glass, never an agent.")
    # Auditors are read-only, even for an agent they own.
    if roles.is_read_only(opener):
        raise Forbidden(
            "auditor_read_only", "Auditors are read-only: they cannot open break-glass."
        )
    # And active: a deactivated account opens nothing, whatever door it came by.
    if not getattr(opener, "is_active", False) or not (
        roles.is_approver(opener) or agent.owner_id == opener.pk
    ):
        raise Forbidden(
            "not_allowed",
            "Break-glass is opened by an approver, an admin or the agent's accountable owner.",
        )


def ttl_cap() -> timedelta:
    """The longest break-glass there is: BREAKGLASS_MAX_TTL, and never longer than any
    grant may live (GRANT_MAX_TTL: "no grant lives longer", break-glass's grant too,
    and its ratification files a request for the same window, which could not be)."""
    return min(settings.BREAKGLASS_MAX_TTL, settings.GRANT_MAX_TTL)


def _check_ttl(ttl: timedelta) -> None:
    if ttl <= timedelta(0):
        raise GovernanceError("invalid_ttl", "The break-glass lifetime must be positive.")
    cap = ttl_cap()
    if ttl > cap:
        limit = cap.total_seconds() / 60
        why = ""
        if settings.GRANT_MAX_TTL < settings.BREAKGLASS_MAX_TTL:
            hours = settings.GRANT_MAX_TTL.total_seconds() / 3600
            why = f" (no grant lives longer than GRANT_MAX_TTL_HOURS={hours:g})"
        raise GovernanceError(
            "breakglass_ttl_too_long",
            f"Break-glass lasts at most {limit:g} minutes{why}; "
            f"{ttl.total_seconds() / 60:g} were asked for. Ask for less (it is refused, "
            "not shortened).",
            fields={"ttl": f"at most {limit:g} minutes"},
        )


def _live_for(agent: Agent, tool: Tool, at: datetime) -> Any:
    """Break-glass for this agent and tool whose grant can still allow something: not
    one whose opener's account is deactivated (authorize() refuses it), or nobody else
    could open one for the incident until its TTL ran out."""
    return (
        BreakGlass.objects.select_related("grant")
        .filter(
            grant__agent=agent,
            grant__tool=tool,
            grant__status=Grant.Status.ACTIVE,
            grant__expires_at__gt=at,
            closed_at__isnull=True,
            expires_at__gt=at,
            opened_by__is_active=True,
        )
        .order_by("-opened_at", "-pk")
    )


def _is_repeat(
    live: BreakGlass,
    opener: Any,
    ticket: str,
    actions: Sequence[str],
    scope: str,
    task: Task | None,
) -> bool:
    """The exact same request again (a retry, a double click): nothing wider, nothing
    for another task, nobody else's."""
    grant = live.grant
    return (
        live.opened_by_id == opener.pk
        and live.ticket == ticket
        and sorted(grant.actions) == sorted(actions)
        and grant.scope == scope
        and grant.task_id == (task.pk if task else None)
    )


def breakglass_open(
    *,
    opener: Any,
    agent: Agent,
    tool: Tool,
    actions: Sequence[str],
    scope: str,
    ticket: str,
    reason: str,
    actor: audit.Actor,
    at: datetime,
    ttl: timedelta | None = None,
    task: Task | None = None,
) -> BreakGlass:
    """Open break-glass: see the module docstring."""
    _check_opener(opener, agent)
    refuse_subagent_grant(agent)
    # Matched as given (not trimmed): the API schema declares the same full match. And
    # no longer than its column, as the API and the form say: the format itself may have
    # no bound (the default has none), and the command passed a longer one through
    # (PostgreSQL's DataError, a traceback; SQLite kept it whole).
    longest = BreakGlass._meta.get_field("ticket").max_length
    if (
        not isinstance(ticket, str)
        or len(ticket) > longest
        or not re.fullmatch(settings.BREAKGLASS_TICKET_PATTERN, ticket)
    ):
        raise GovernanceError(
            "invalid_ticket",
            f"A ticket reference matching {settings.BREAKGLASS_TICKET_PATTERN}, at most "
            f"{longest} characters, is required.",
            fields={"ticket": f"required, in the configured format, at most {longest} characters"},
        )
    if not (reason or "").strip():
        raise GovernanceError("reason_required", "Say why break-glass is needed.")
    ttl = settings.BREAKGLASS_DEFAULT_TTL if ttl is None else ttl
    _check_ttl(ttl)
    validate_shape(tool=tool, actions=actions, scope=scope)
    with transaction.atomic():
        # One opener at a time: the per-hour count below cannot be raced past.
        get_user_model().objects.select_for_update(no_key=True).filter(pk=opener.pk).first()
        # One agent at a time: two people opening for it at once see each other's.
        held = Agent.objects.select_for_update(no_key=True).filter(pk=agent.pk).first()
        if held is None or held.status != Agent.Status.ACTIVE:
            # Every call of a suspended agent is refused: a grant would only be noise
            # (the banner, every approver notified, an incident campaign).
            raise Conflict(
                "agent_suspended",
                f"{agent.name} is suspended (the kill switch): break-glass cannot reach it.",
            )
        # Likewise a quarantined tool: every call to it is refused until an admin
        # approves its changed definition (the tool as it is now, not the caller's copy).
        if type(tool).objects.get(pk=tool.pk).is_quarantined:
            raise Conflict(
                "tool_quarantined",
                f"{tool.name} is quarantined (its definition changed and awaits an admin): "
                "break-glass cannot reach it. Approve the definition first.",
            )
        live = _live_for(agent, tool, at).first()
        if live is not None:
            if _is_repeat(live, opener, ticket, actions, scope, task):
                return live  # the same emergency, asked twice: one break-glass
            raise Conflict(
                "breakglass_active",
                f"Break-glass {live.ticket} is already open for {agent.name} on "
                f"{tool.name} until {live.grant.expires_at.isoformat()}; one at a time. "
                "Use it, or close it and open a new one once it is reviewed.",
                fields={"ticket": live.ticket, "expires_at": live.grant.expires_at.isoformat()},
            )
        earlier = (
            BreakGlass.objects.filter(
                grant__agent=agent, grant__tool=tool, review_status=BreakGlass.Review.PENDING
            )
            .order_by("opened_at", "pk")
            .first()
        )
        if earlier is not None:
            raise Conflict(
                "breakglass_unreviewed",
                f"Break-glass {earlier.ticket} (#{earlier.pk}) for {agent.name} on "
                f"{tool.name} still awaits its review: an approver other than its opener "
                "ratifies it or confirms it closed before break-glass is opened again.",
                fields={"ticket": earlier.ticket, "breakglass_id": str(earlier.pk)},
            )
        # No upper bound: a concurrent open whose clock read a microsecond later than
        # ours still counts (it committed before we got the lock).
        recent = sorted(
            BreakGlass.objects.filter(
                opened_by=opener, opened_at__gt=at - timedelta(hours=1)
            ).values_list("opened_at", flat=True)
        )
        if len(recent) >= settings.BREAKGLASS_MAX_PER_HOUR:
            # Free again when enough of them have left the hour (with a lowered limit,
            # more than the oldest one).
            frees_at = recent[len(recent) - settings.BREAKGLASS_MAX_PER_HOUR] + timedelta(hours=1)
            raise RateLimited(
                "breakglass_rate_limited",
                f"You opened break-glass {len(recent)} times in the last hour (the limit is "
                f"{settings.BREAKGLASS_MAX_PER_HOUR}); ask an approver for a normal grant.",
                retry_after=max(1, math.ceil((frees_at - at).total_seconds())),
            )
        require_open_task(task.pk if task else None, at)
        grant = Grant.objects.create(
            created_at=at,
            agent=agent,
            tool=tool,
            task=task,
            actions=list(actions),
            scope=scope,
            justification=f"break-glass {ticket}: {reason}",
            requested_by=opener,
            status=Grant.Status.ACTIVE,
            decided_at=at,
            starts_at=at,
            expires_at=at + ttl,
            break_glass=True,
        )
        bg = BreakGlass.objects.create(
            grant=grant,
            opened_by=opener,
            ticket=ticket,
            reason=reason,
            opened_at=at,
            expires_at=at + ttl,
            review_due_at=at + settings.BREAKGLASS_REVIEW_WITHIN,
        )
        # The incident campaign first (its usage fold updates grant rows): the events
        # come last, so the chain lock is the last lock this transaction takes.
        if settings.BREAKGLASS_OPENS_CAMPAIGN:
            from governance.services.reviews import review_campaign_open

            review_campaign_open(
                kind="incident",
                reason=f"break-glass {ticket} on {agent.name}: {reason}",
                key=f"incident:breakglass:{bg.pk}",
                agent=agent,
                opened_by=opener,
                actor=actor,
                at=at,
            )
        skipped = approver_users(exclude=[opener])
        _event(
            bg,
            EventType.BREAKGLASS_OPENED,
            actor,
            at,
            opened_by=opener.get_username(),
            reason=reason,
            expires_at=bg.expires_at.isoformat(),
            review_due_at=bg.review_due_at.isoformat(),
            notified=[u.get_username() for u in skipped],
        )
        notifications.breakglass_opened(breakglass=bg, notify_users=skipped, at=at)
    return bg


def _locked(breakglass_id: int) -> BreakGlass:
    return (
        BreakGlass.objects.select_for_update(of=("self",), no_key=True)
        .select_related("grant__agent", "grant__tool", "grant__task", "opened_by")
        .get(pk=breakglass_id)
    )


def breakglass_close(
    *, breakglass_id: int, closed_by: Any, comment: str, actor: audit.Actor, at: datetime
) -> BreakGlass:
    """End the elevation early. The grant's `grant.revoked` event is the one event;
    if the grant already ended elsewhere, `breakglass.closed` records the close."""
    if not (comment or "").strip():
        raise GovernanceError("comment_required", "Say why break-glass is closed.")
    with transaction.atomic():
        bg = _locked(breakglass_id)
        # Auditors are read-only, even for a break-glass they opened before they became
        # one (an approver or admin ends it).
        if roles.is_human(closed_by) and roles.is_read_only(closed_by):
            raise Forbidden(
                "auditor_read_only",
                "Auditors are read-only: they cannot close break-glass; an approver or admin can.",
            )
        # The person who opened it may end it early (less access is never a risk);
        # anyone else needs to be an approver or admin.
        if not (
            roles.is_human(closed_by)
            and (roles.is_approver(closed_by) or bg.opened_by_id == closed_by.pk)
        ):
            raise Forbidden(
                "not_allowed",
                "Break-glass is closed early by an approver, an admin or whoever opened it.",
            )
        if bg.closed_at is not None:
            return bg
        bg.closed_at = at
        bg.closed_by = closed_by
        bg.save(update_fields=["closed_at", "closed_by"])
        ended = []
        if _still_live(bg.grant, at):
            # grant_revoke locks the grant and reads it again: a revoke committing
            # meanwhile leaves it nothing to end, and then the close is on record below.
            ended = grant_revoke(
                grant_id=bg.grant_id,
                reason=f"break-glass {bg.ticket} closed early: {comment}",
                actor=actor,
                at=at,
                revoked_by=closed_by,
            )
        if not ended:
            bg.grant.refresh_from_db()
            _event(
                bg,
                EventType.BREAKGLASS_CLOSED,
                actor,
                at,
                closed_by=closed_by.get_username(),
                comment=comment,
                grant_status=_ended_as(bg.grant),
            )
    bg.grant.refresh_from_db()
    return bg


def _still_live(grant: Grant, at: datetime) -> bool:
    """Closing ends only what has not ended: a grant past its TTL expired then (the job
    marks it), and recording a revoke now would say the access was cut short."""
    return grant.status == Grant.Status.ACTIVE and grant.expires_at > at


def _ended_as(grant: Grant) -> str:
    return "expired" if grant.status == Grant.Status.ACTIVE else grant.status


def _start_review(breakglass_id: int, reviewer: Any, comment: str, at: datetime) -> BreakGlass:
    # An approver or admin who may approve now (roles.may_approve: active, as every
    # other decision's service asks): a deactivated one's ratify filed a request in
    # their name, and their confirm closed the review, on no one's authority.
    if not roles.may_approve(reviewer):
        raise Forbidden(
            "not_allowed", "Break-glass reviews are decided by active approvers or admins."
        )
    if not (comment or "").strip():
        raise GovernanceError("comment_required", "A review decision needs a comment.")
    bg = _locked(breakglass_id)
    if bg.review_status != BreakGlass.Review.PENDING:
        raise Conflict("already_reviewed", f"The review is already {bg.review_status}.")
    if bg.opened_by_id == reviewer.pk:
        raise Forbidden("self_review", "Nobody reviews the break-glass they opened.")
    # Nor anyone with a stake in the agent that held the access (its owners up the
    # tree, whoever held a token for it since the access was opened): the same people
    # who may not approve its calls or re-certify its grants.
    if reviewer.pk in stakeholders(bg.grant.agent, bg.grant, at=bg.opened_at):
        raise Forbidden(
            "self_review", "Nobody reviews break-glass access on an agent they have a stake in."
        )
    return bg


def _ratified_duration(grant: Grant) -> timedelta:
    """The request a ratification files asks for the break-glass window, but never
    longer than a grant may now live: one opened before GRANT_MAX_TTL was lowered
    could otherwise never be ratified (the UI and API pass no duration; the request
    would be refused `invalid_grant`). Its approver may narrow it further."""
    window = whole_seconds(grant.expires_at - grant.starts_at)  # type: ignore[operator]
    return min(window, settings.GRANT_MAX_TTL)


def breakglass_ratify(
    *,
    breakglass_id: int,
    reviewer: Any,
    comment: str,
    actor: audit.Actor,
    at: datetime,
    duration: timedelta | None = None,
) -> BreakGlass:
    """Close the review by turning the access into a normal, pending grant request."""
    with transaction.atomic():
        bg = _start_review(breakglass_id, reviewer, comment, at)
        grant = bg.grant

        def ratified_by(request: Grant) -> None:
            bg.review_status = BreakGlass.Review.RATIFIED
            bg.reviewed_by = reviewer
            bg.reviewed_at = at
            bg.review_comment = comment
            bg.ratified_request = request
            bg.save()

        request = grant_request(
            agent=grant.agent,
            tool=grant.tool,
            task=grant.task,
            actions=list(grant.actions),
            scope=grant.scope,
            duration=duration or _ratified_duration(grant),
            justification=f"ratifies break-glass {bg.ticket}: {comment}",
            requested_by=reviewer,
            actor=actor,
            at=at,
            before_event=ratified_by,
        )
        _event(
            bg,
            EventType.BREAKGLASS_RATIFIED,
            actor,
            at,
            reviewed_by=reviewer.get_username(),
            comment=comment,
            ratified_request=request.pk,
            overdue=at >= bg.review_due_at,
        )
    return bg


def breakglass_confirm_closed(
    *, breakglass_id: int, reviewer: Any, comment: str, actor: audit.Actor, at: datetime
) -> BreakGlass:
    """Close the review: the incident is over. A grant still live is revoked now."""
    with transaction.atomic():
        bg = _start_review(breakglass_id, reviewer, comment, at)
        bg.review_status = BreakGlass.Review.CONFIRMED_CLOSED
        bg.reviewed_by = reviewer
        bg.reviewed_at = at
        bg.review_comment = comment
        if bg.closed_at is None:
            bg.closed_at = at
            bg.closed_by = reviewer
        bg.save()
        if _still_live(bg.grant, at):
            grant_revoke(
                grant_id=bg.grant_id,
                reason=f"break-glass {bg.ticket} confirmed closed: {comment}",
                actor=actor,
                at=at,
                revoked_by=reviewer,
            )
        _event(
            bg,
            EventType.BREAKGLASS_CONFIRMED_CLOSED,
            actor,
            at,
            reviewed_by=reviewer.get_username(),
            comment=comment,
            overdue=at >= bg.review_due_at,
        )
    return bg


def breakglass_reviews_mark_overdue(*, actor: audit.Actor, at: datetime) -> int:
    """The job: reviews still open past their due time are announced as overdue, once
    each (claimed by a conditional UPDATE on overdue_at). Overdue is shown from the due
    time itself (selectors), so this records it, sends the notice and, should the
    grant still be live (settings keep its lifetime within the review window, so only
    a changed row could be), revokes it: unreviewed break-glass is flagged and ends."""
    due = BreakGlass.objects.filter(
        review_status=BreakGlass.Review.PENDING, review_due_at__lte=at, overdue_at__isnull=True
    ).values_list("pk", flat=True)

    def announce(pk: int) -> None:
        bg = BreakGlass.objects.select_related(
            "grant__agent", "grant__tool", "grant__task", "opened_by"
        ).get(pk=pk)
        if _still_live(bg.grant, at):
            grant_revoke(
                grant_id=bg.grant_id,
                reason=f"break-glass {bg.ticket}: review overdue",
                actor=actor,
                at=at,
            )
        _event(
            bg, EventType.BREAKGLASS_REVIEW_OVERDUE, actor, at, due_at=bg.review_due_at.isoformat()
        )
        notifications.review_overdue(
            users=approver_users(),
            subject=f"OVERDUE: break-glass {bg.ticket} has no post-incident review",
            body=(
                f"Break-glass #{bg.pk} ({bg.ticket}), opened by "
                f"{bg.opened_by.get_username()} for agent {bg.grant.agent.name}, was due "
                f"for review by {bg.review_due_at.isoformat()}. Ratify it or confirm it closed."
            ),
            data={"breakglass_id": bg.pk, "ticket": bg.ticket, "grant_id": bg.grant_id},
            at=at,
        )

    return claim_each(
        due,
        claim=lambda pk: BreakGlass.objects.filter(
            pk=pk, review_status=BreakGlass.Review.PENDING, overdue_at__isnull=True
        ).update(overdue_at=at),
        announce=announce,
    )
