"""Second look: a sample of recent approvals, re-read by a different approver.

Signatures (keyword-only):

    second_looks_sample(*, actor, at, fraction=None) -> int     (the job, daily)
        Approved grant requests and approved destructive actions decided since the
        last run's upper bound (the SecondLookMark watermark; at least the 24 h
        before `at`, so a decision that committed just after a run is still read),
        each sampled with probability SECOND_LOOK_FRACTION. A run that comes late,
        or after days without one, covers the whole gap. The draw is a keyed hash of
        the item (SECRET_KEY), so it is stable (running twice samples the same set,
        once: a unique constraint) and an approver cannot predict it.
    second_look_decide(*, second_look_id, reviewer, verdict, comment, actor, at)
        -> SecondLook
        verdict: "confirm" | "flag" (flag notifies the admins). Raises Forbidden
        `self_review` (the original approver, or anyone with a stake in the agent's
        call: approvals.stakeholders, which includes the requester, the owners of
        the agent and the agents above it, and whoever held a live token for them
        when the request or call was made) / `not_assigned` (neither the sampled
        reviewer nor an admin) / `not_allowed`,
        GovernanceError `comment_required` / `invalid_verdict`, Conflict
        `already_decided`.
"""

from __future__ import annotations

import hashlib
import hmac
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import IntegrityError, transaction
from django.db.models import Q

from governance import audit, notifications, roles
from governance.codes import EventType
from governance.errors import Conflict, Forbidden, GovernanceError
from governance.models import Approval, Grant, SecondLook, SecondLookMark
from governance.selectors import approver_users
from governance.services.approvals import stakeholders
from governance.services.claims import locked_mark

WINDOW = timedelta(days=1)
VERDICTS = {"confirm": SecondLook.Status.CONFIRMED, "flag": SecondLook.Status.FLAGGED}


def _drawn(kind: str, pk: Any, fraction: float) -> bool:
    digest = hmac.new(settings.SECRET_KEY.encode(), f"{kind}:{pk}".encode(), hashlib.sha256)
    return int.from_bytes(digest.digest()[:8], "big") / 2**64 < fraction


def _event(
    look: SecondLook, event_type: str, actor: audit.Actor, at: datetime, **data: Any
) -> None:
    """One shape: the approved thing (a grant, or the destructive call's approval)."""
    if look.approval is not None:
        subject, actions = look.approval, [look.approval.action]
    else:
        assert look.grant is not None
        subject, actions = look.grant, list(look.grant.actions)
    audit.append(
        event_type=event_type,
        actor=actor,
        at=at,
        agent=subject.agent.name,
        tool=subject.tool.name,
        action=",".join(actions),  # the whole list, as data.actions
        scope=subject.scope,
        grant_id=look.grant_id,
        approval_id=str(look.approval_id or ""),
        break_glass=bool(look.grant and look.grant.break_glass),
        data={"second_look_id": look.pk, "kind": look.kind, "actions": actions, **data},
    )


def _barred(
    approver_id: Any, agent: Any, grant: Grant | None, approval: Approval | None
) -> set[Any]:
    """Who may not take the second look: the approver whose decision it re-checks and
    everyone with a stake in the agent's access (its owner up the agent tree, the
    requesters up the grant chain, whoever held a live token for the agent when the
    approved request or call was made)."""
    if approval is not None:
        at = approval.requested_at
    else:
        assert grant is not None
        at = grant.created_at
    return {approver_id} | stakeholders(agent, grant, at=at)


def second_looks_sample(*, actor: audit.Actor, at: datetime, fraction: float | None = None) -> int:
    fraction = settings.SECOND_LOOK_FRACTION if fraction is None else fraction
    with transaction.atomic():
        # Locked: two workers sample one window after the other, never the same gap
        # twice at once (the unique constraints would hold anyway).
        mark = locked_mark(SecondLookMark)
        since = at - WINDOW
        if mark.sampled_through is not None:
            since = min(since, mark.sampled_through)
        if mark.sampled_through is None or at > mark.sampled_through:
            mark.sampled_through = at  # rows first, the sampled events last
            mark.save(update_fields=["sampled_through"])
        return _sample(since, at, actor, fraction)


def _sample(since: datetime, at: datetime, actor: audit.Actor, fraction: float) -> int:
    """Sample the approvals decided in (since, at]."""
    candidates: list[tuple[str, Any, Any, set[Any]]] = []
    for grant in (
        Grant.objects.filter(approved_by__isnull=False, decided_at__gt=since, decided_at__lte=at)
        .exclude(status__in=[Grant.Status.PENDING, Grant.Status.DENIED])
        .select_related("agent")
    ):
        barred = _barred(grant.approved_by_id, grant.agent, grant, None)
        candidates.append(("grant", grant, grant.approved_by_id, barred))
    # Decided by a person, or by a confirmation policy: then its author is the approver
    # whose decision is re-checked.
    for approval in (
        Approval.objects.filter(Q(decided_by__isnull=False) | Q(policy__isnull=False))
        .filter(
            decided_at__gt=since,
            decided_at__lte=at,
            status__in=[
                Approval.Status.APPROVED,
                Approval.Status.CONSUMED,
                Approval.Status.EXPIRED,
            ],
        )
        .select_related("agent", "grant", "policy")
    ):
        approver_id = approval.decided_by_id or approval.policy.created_by_id
        barred = _barred(approver_id, approval.agent, approval.grant, approval)
        candidates.append(("approval", approval, approver_id, barred))
    pool = approver_users()
    users = get_user_model().objects.in_bulk([c[2] for c in candidates])
    sampled = 0
    for index, (kind, subject, approver_id, barred) in enumerate(candidates):
        if not _drawn(kind, subject.pk, fraction):
            continue
        eligible = [u for u in pool if u.pk not in barred]
        reviewer = eligible[index % len(eligible)] if eligible else None
        try:
            with transaction.atomic():
                look = SecondLook.objects.create(
                    kind=kind,
                    grant=subject if kind == "grant" else subject.grant,
                    approval=subject if kind == "approval" else None,
                    original_approver=users[approver_id],
                    reviewer=reviewer,
                    sampled_at=at,
                )
                _event(
                    look,
                    EventType.SECOND_LOOK_SAMPLED,
                    actor,
                    at,
                    original_approver=users[approver_id].get_username(),
                    reviewer=reviewer.get_username() if reviewer else None,
                )
                sampled += 1
        except IntegrityError:
            continue  # sampled already (an earlier run, or another worker just now)
    return sampled


def second_look_decide(
    *,
    second_look_id: int,
    reviewer: Any,
    verdict: str,
    comment: str,
    actor: audit.Actor,
    at: datetime,
) -> SecondLook:
    if verdict not in VERDICTS:
        raise GovernanceError("invalid_verdict", f"Verdict must be one of {sorted(VERDICTS)}.")
    if not (comment or "").strip():
        raise GovernanceError("comment_required", "A second look needs a comment.")
    # Active too: the reviewer drawn when it was sampled may have been deactivated since.
    if not roles.may_approve(reviewer):
        raise Forbidden("not_allowed", "Second looks are decided by active approvers or admins.")
    with transaction.atomic():
        look = (
            SecondLook.objects.select_for_update(of=("self",), no_key=True)
            .select_related("grant__agent", "grant__tool", "approval__agent", "approval__tool")
            .get(pk=second_look_id)
        )
        if look.status != SecondLook.Status.PENDING:
            raise Conflict("already_decided", f"The second look is already {look.status}.")
        agent = look.approval.agent if look.approval_id else look.grant.agent
        if reviewer.pk in _barred(look.original_approver_id, agent, look.grant, look.approval):
            raise Forbidden(
                "self_review",
                "A second look is by a different approver, with no stake in the agent.",
            )
        if not (look.reviewer_id in (None, reviewer.pk) or roles.is_admin(reviewer)):
            raise Forbidden("not_assigned", "The second look is assigned to another approver.")
        look.status = VERDICTS[verdict]
        look.decided_by = reviewer
        look.decided_at = at
        look.comment = comment
        look.save(update_fields=["status", "decided_by", "decided_at", "comment"])
        _event(
            look,
            EventType.SECOND_LOOK_DECIDED,
            actor,
            at,
            verdict=verdict,
            comment=comment,
            decided_by=reviewer.get_username(),
        )
        if verdict == "flag":
            admins = [u for u in approver_users() if roles.is_admin(u)]
            notifications.second_look_flagged(look=look, users=admins, at=at)
    return look
