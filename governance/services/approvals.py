"""The confirmation gate's human side: approve or deny one pending call.

Deciding refuses an approval that is not pending (Conflict `not_pending`), whose
grant is no longer live (Conflict `grant_not_live`), whose call's task is no longer
open (Conflict `task_closed`), or that someone with a stake in the call would confirm
(Forbidden `self_approval`). A denial also answers the
same call asked again within APPROVAL_TTL (services.access: `approval_denied`).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db import transaction
from django.db.models import Q

from governance import audit, roles, selectors
from governance.codes import EventType
from governance.errors import Conflict, Forbidden
from governance.models import Agent, Approval, BreakGlass, Grant
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
