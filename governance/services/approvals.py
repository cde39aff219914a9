"""The confirmation gate's human side: approve or deny one pending call.

Deciding refuses an approval that is not pending (Conflict `not_pending`), whose
grant is no longer live (Conflict `grant_not_live`), whose call's task is no longer
open (Conflict `task_closed`), or that someone with a stake in the call would confirm
(Forbidden `self_approval`). A denial also answers the
same call asked again within APPROVAL_TTL (services.access: `approval_denied`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import transaction
from django.db.models import Q

from governance import audit, roles, selectors
from governance.codes import EventType
from governance.errors import Conflict, Forbidden
from governance.models import Agent, AgentToken, Approval, BreakGlass, Grant
from governance.policy import grant_dead_reason
from governance.services.claims import claim_each


def _event(
    approval: Approval, event_type: str, actor: audit.Actor, at: datetime, **data: Any
) -> None:
    """The one shape of an approval's audit event: the exact call it is bound to."""
    audit.append(
        event_type=event_type,
        actor=actor,
        at=at,
        agent=approval.agent.name,
        task=approval.task.key if approval.task else "",
        tool=approval.tool.name,
        action=approval.action,
        scope=approval.scope,
        arguments_hash=approval.arguments_hash,
        approval_id=str(approval.pk),
        grant_id=approval.grant_id,
        # A call under break-glass: everything about it carries the flag.
        break_glass=approval.grant is not None and approval.grant.break_glass,
        data=data,
    )


def stakeholders(agent: Agent | None, grant: Grant | None, *, at: datetime) -> set[Any]:
    """Who has a stake in what `agent` does under `grant`, and so may not confirm or
    re-check it: the agent's owner and the owners of the agents above it (a parent
    controls its subagents), and, up a delegated grant's chain, every grant's
    requester and holder's owner (a delegated grant has no human requester of its
    own: the person behind it asked for the parent).

    Also whoever could act as the agent from `at` (the moment the request or the
    approval was created) on: the creator of every token of the agent, or of an agent
    above it, that was live at any moment since (not revoked or expired by `at`,
    whenever it was created). And whoever opened a break-glass up the grant's chain
    or whose break-glass the grant ratifies. An admin who issues himself a token for someone else's
    agent can file requests as that agent, or make the approved call with it once he
    has approved it himself; he must do neither under his own name."""
    users = set()
    tree: list[int] = []
    for _ in range(32):  # bounded, as the delegation walk is
        if agent is None:
            break
        users.add(agent.owner_id)
        tree.append(agent.pk)
        agent = agent.parent
    chain = list(grant.chain()) if grant is not None else []
    for link in chain:
        users.update((link.requested_by_id, link.agent.owner_id))
        tree.append(link.agent_id)
    # Whoever declared the emergency: a break-glass grant up the chain, or the request
    # that continues one after its ratification, is their own access decision.
    users.update(
        BreakGlass.objects.filter(
            Q(grant_id__in=[link.pk for link in chain])
            | Q(ratified_request_id__in=[link.pk for link in chain])
        ).values_list("opened_by_id", flat=True)
    )
    users.update(
        selectors.live_tokens(at).filter(agent_id__in=tree).values_list("created_by_id", flat=True)
    )
    users.discard(None)
    return users


@dataclass(frozen=True)
class Call:
    """One pending item as approvals.stakeholders() reads it: the agent that acts, the
    grant it acts under (whose delegation chain counts), and the moment that decides
    which tokens count (the request's or the call's)."""

    key: Any
    agent_id: int
    grant_id: int | None
    at: datetime


def staked(
    person_id: int,
    calls: list[Call],
    agents: dict[int, tuple[int | None, int]],
    grants: dict[int, tuple[int | None, int | None, int]],
) -> set[Any]:
    """The keys of `calls` that `person_id` has a stake in: `person_id in
    stakeholders(agent, grant, at=at)` for each, decided for all of them at once.
    An inbox (web.queries) asked stakeholders() item by item (two or three queries each) until it
    had its page, and an admin who issued the agents' tokens has a stake in every
    one: 6,000 queries for an empty inbox. Here: one query per level of the agent
    tree and of delegation above the items, one for the break-glass this person
    opened, one for the tokens they created. Keep it stakeholders()'s exact rule
    (tests/test_ui_scale.py compares the two over a varied world).

    `agents`: what the caller read already, {id: (parent id, owner id)}; `grants`:
    {id: (delegated_from id, requested_by id, agent id)}; both are filled in."""
    # Each item's delegation chain: the grant and up to 31 grants above it (Grant.chain).
    wanted = {c.grant_id for c in calls} | {up for up, _, _ in grants.values()}
    for _ in range(33):
        wanted -= set(grants) | {None}
        if not wanted:
            break
        rows = Grant.objects.filter(pk__in=wanted).values_list(
            "pk", "delegated_from_id", "requested_by_id", "agent_id"
        )
        grants.update({pk: (up, by, agent) for pk, up, by, agent in rows})
        wanted = {up for up, _, _ in grants.values()}
    chains = {c.key: _walk(c.grant_id, lambda g: grants[g][0]) for c in calls}
    # The agents: each item's and every one above it; each chain link's (its owner).
    needed = {c.agent_id for c in calls} | {grants[g][2] for ch in chains.values() for g in ch}
    wanted = needed | {parent for parent, _ in agents.values()}
    for _ in range(33):
        wanted -= set(agents) | {None}
        if not wanted:
            break
        rows = Agent.objects.filter(pk__in=wanted).values_list("pk", "parent_id", "owner_id")
        agents.update({pk: (parent, owner) for pk, parent, owner in rows})
        wanted = {parent for parent, _ in agents.values()}
    # What this person did that gives them a stake: break-glass opened (up a chain, or
    # ratified by a request in it), and agent tokens created, each live until its end.
    opened = {
        pk
        for row in BreakGlass.objects.filter(opened_by_id=person_id).values_list(
            "grant_id", "ratified_request_id"
        )
        for pk in row
        if pk is not None
    }
    live_until: dict[int, datetime] = {}
    if calls:
        # Only a token live at the earliest moment or later can count for any item.
        earliest = min(c.at for c in calls)
        tokens = (
            AgentToken.objects.filter(
                created_by_id=person_id, agent__isnull=False, expires_at__gt=earliest
            )
            .filter(Q(revoked_at__isnull=True) | Q(revoked_at__gt=earliest))
            .values_list("agent_id", "expires_at", "revoked_at")
        )
        for agent_id, expires, revoked in tokens:
            end = expires if revoked is None else min(expires, revoked)
            live_until[agent_id] = max(end, live_until.get(agent_id, end))
    found: set[Any] = set()
    for c in calls:
        chain = chains[c.key]
        above = _walk(c.agent_id, lambda a: agents[a][0])
        tree = above + [grants[g][2] for g in chain]
        if (
            any(agents[a][1] == person_id for a in above)
            or any(person_id in (grants[g][1], agents[grants[g][2]][1]) for g in chain)
            or any(g in opened for g in chain)
            or any(a in live_until and live_until[a] > c.at for a in tree)
        ):
            found.add(c.key)
    return found


def _walk(start: int | None, up: Callable[[int], int | None]) -> list[int]:
    """`start` and up to 31 steps above it, nearest first (bounded as every walk
    up a tree or a delegation chain is, so a corrupted cycle cannot loop)."""
    out: list[int] = []
    cursor = start
    for _ in range(32):
        if cursor is None:
            break
        out.append(cursor)
        cursor = up(cursor)
    return out


def _decide(
    *, approval_id: Any, approver: Any, approve: bool, reason: str, actor: audit.Actor, at: datetime
) -> Approval:
    with transaction.atomic():
        approval = (
            Approval.objects.select_for_update(of=("self",), no_key=True)
            .select_related("agent", "tool", "grant", "task")
            .get(pk=approval_id)
        )
        if approval.status != Approval.Status.PENDING:
            raise Conflict("not_pending", f"The approval is {approval.status}, not pending.")
        if approval.expires_at <= at:  # the expiry job has not closed it yet
            raise Conflict(
                "not_pending",
                f"The approval expired at {approval.expires_at.isoformat()}: nothing to "
                "decide; the agent must ask again.",
            )
        # Nobody with a stake in the call confirms it (separation of duties).
        # Whoever could act as the agent when the call was asked counts too.
        if approver.pk in stakeholders(approval.agent, approval.grant, at=approval.requested_at):
            raise Forbidden("self_approval", "Nobody approves their own agent's action.")
        roles.require_may_approve(approver, "Approvals")
        # The call it confirms can no longer happen: its grant ended (expired, revoked,
        # task closed, agent suspended) after the approval was asked for.
        if approval.grant_id is not None and (dead := grant_dead_reason(approval.grant_id, at)):
            raise Conflict(
                "grant_not_live",
                f"The grant this approval is for is no longer live ({dead}); nothing to decide.",
            )
        # Nor under a task that is no longer open (closed, or past its end before the job
        # closed it): authorize() refuses the call `task_closed`, whichever grant it is
        # under, one bound to no task included. The task's close voids its approvals;
        # one approved just before the close committed is voided by it too (it voids
        # approved ones as well), so no lock on the task is taken here.
        if approval.task is not None and not approval.task.is_open_at(at):
            raise Conflict(
                "task_closed",
                f"The task {approval.task.key} this call was made under is not open; "
                "nothing to decide.",
            )
        approval.status = Approval.Status.APPROVED if approve else Approval.Status.DENIED
        approval.decided_by = approver
        approval.decided_at = at
        approval.decision_reason = reason
        approval.save()
        _event(
            approval,
            EventType.APPROVAL_APPROVED if approve else EventType.APPROVAL_DENIED,
            actor,
            at,
            reason=reason,
        )
    return approval


def approval_approve(
    *, approval_id: Any, approver: Any, actor: audit.Actor, at: datetime, reason: str = ""
) -> Approval:
    return _decide(
        approval_id=approval_id, approver=approver, approve=True, reason=reason, actor=actor, at=at
    )


def approval_deny(
    *, approval_id: Any, approver: Any, reason: str, actor: audit.Actor, at: datetime
) -> Approval:
    return _decide(
        approval_id=approval_id, approver=approver, approve=False, reason=reason, actor=actor, at=at
    )


def approvals_expire(*, actor: audit.Actor, at: datetime) -> int:
    """Bookkeeping: approvals still pending or approved past expires_at become
    expired, one event each. Consumption already refuses them (it requires
    expires_at > at), so this only makes the record say so.

    Each row is claimed with a conditional UPDATE on the status it was read
    with, so two workers (or a consume racing an expire) act on it once.
    """
    open_statuses = [Approval.Status.PENDING, Approval.Status.APPROVED]
    due = Approval.objects.filter(status__in=open_statuses, expires_at__lte=at).values_list(
        "pk", "status"
    )

    def announce(row: tuple[object, str]) -> None:
        pk, status = row
        approval = Approval.objects.select_related("agent", "tool", "task").get(pk=pk)
        expires_at = approval.expires_at.isoformat()
        _event(
            approval,
            EventType.APPROVAL_EXPIRED,
            actor,
            at,
            previous_status=status,
            expires_at=expires_at,
        )

    return claim_each(
        due,
        claim=lambda row: Approval.objects.filter(
            pk=row[0], status=row[1], expires_at__lte=at
        ).update(status=Approval.Status.EXPIRED),
        announce=announce,
    )
