"""Agents and their tokens: create, suspend (the kill switch), resume, issue, revoke.

Suspension and resume are each one audit event per agent (`agent.suspended`,
`agent.reactivated`): the access reports read an agent's past state from them
(services.reports.StateLog), so the row's status says only how it is now."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction

from governance import audit, selectors
from governance.codes import EventType
from governance.errors import Conflict, GovernanceError
from governance.models import Agent, AgentToken, Approval
from governance.services import confirmation
from governance.services.grants import (
    WITHDRAWN_REASON,  # noqa: F401 - agent_suspend's reason
    requests_withdraw,
    requests_withdrawn_events,
)

NAME_HELP = "lower-case letters, digits, '.', '_' and '-', starting with a letter or digit"


def validate_name(name: str, what: str) -> None:
    import re

    if not re.fullmatch(r"[a-z0-9][a-z0-9._-]{0,99}", name or ""):
        raise GovernanceError(f"invalid_{what}_name", f"A {what} name uses {NAME_HELP}.")


def agent_create(
    *,
    name: str,
    owner: Any,
    actor: audit.Actor,
    at: datetime,
    parent: Agent | None = None,
    description: str = "",
) -> Agent:
    """A new, active agent. Refused (Conflict `parent_suspended`) under a suspended
    parent: a subagent of a suspended agent is suspended too (agent_suspend), so a
    new active one would be a way around the kill switch."""
    validate_name(name, "agent")
    try:
        with transaction.atomic():
            if parent is not None:
                # Locked, so a suspend of the parent (which locks it first) cannot slip
                # between this check and the new row: either it sees the child or the
                # child sees the suspension.
                parent = Agent.objects.select_for_update(no_key=True).get(pk=parent.pk)
                _refuse_suspended_parent(parent, name)
            agent = Agent.objects.create(
                name=name, owner=owner, parent=parent, description=description
            )
            audit.append(
                event_type=EventType.AGENT_CREATED,
                actor=actor,
                at=at,
                agent=name,
                data={"owner": owner.get_username(), "parent": parent.name if parent else None},
            )
    except IntegrityError:
        raise Conflict("agent_exists", f"An agent named {name!r} already exists.") from None
    return agent


# How deep the agent tree may grow (a root agent is level 1). Every walk of the tree
# (suspension's kill switch, stakes, deny policies: 32 levels) then reaches all of it;
# an agent 33 levels down used to stay active when its root was suspended.
AGENT_TREE_MAX_DEPTH = 16


def _refuse_suspended_parent(parent: Agent, name: str) -> None:
    """Refuse when the parent or any agent above it is suspended, or when the new agent
    would sit deeper than AGENT_TREE_MAX_DEPTH."""
    above: Agent | None = parent
    for _ in range(AGENT_TREE_MAX_DEPTH - 1):
        if above is None:
            return
        if above.status != Agent.Status.ACTIVE:
            raise Conflict(
                "parent_suspended",
                f"The agent {above.name} is suspended, so {name} cannot act under it: "
                "a subagent of a suspended agent is suspended too.",
            )
        above = above.parent
    if above is not None:
        raise GovernanceError(
            "agent_tree_too_deep",
            f"An agent sits at most {AGENT_TREE_MAX_DEPTH} levels down its tree; "
            f"{name} would be deeper.",
        )


def _tree_locked(agent: Agent) -> list[Agent]:
    """The agent and every agent below it, each row locked, parents before children."""
    return selectors.agent_tree(Agent.objects.select_for_update(no_key=True), agent.pk)


def agent_suspend(*, agent: Agent, reason: str, actor: audit.Actor, at: datetime) -> Agent:
    """Every decision for the agent is denied from this moment; its open
    approval requests are voided so nothing queued can fire later, and the grant
    requests it filed itself (through its token, which may be in someone else's hands)
    are closed as denied, one `grant.denied` event each (WITHDRAWN_REASON):
    none of them can be approved after a resume. A request a person filed for it
    stays theirs to decide (none is approved while the agent is suspended). Its live
    approve confirmation policies end too, one `confirmation_policy.revoked` event each
    (confirmation.SUSPENDED_REASON): after a resume a person confirms its destructive
    calls again; deny policies stay.

    Every agent below it (subagents, theirs, ...) is suspended with it, in the same
    transaction: a parent controls its subagents, so a compromised parent's
    subagents must not keep acting on their own grants and tokens. The rows are
    locked and changed first, then one `agent.suspended` event per agent newly
    suspended (a subagent's names the agent it was suspended through in
    `cascade_from`); agents already suspended are left as they are.

    The way back is agent_resume, one agent at a time: resuming an agent does not
    resume its subagents (each is resumed on its own, and never while an agent above
    it is suspended), and a subagent cannot be created under a suspended agent
    (agent_create). The approvals voided here stay voided."""
    with transaction.atomic():
        suspended: list[tuple[Agent, int, list[int], list[int]]] = []
        for member in _tree_locked(agent):
            updated = Agent.objects.filter(pk=member.pk, status=Agent.Status.ACTIVE).update(
                status=Agent.Status.SUSPENDED, suspended_at=at
            )
            if updated:
                voided = Approval.objects.filter(
                    agent=member, status__in=[Approval.Status.PENDING, Approval.Status.APPROVED]
                ).update(status=Approval.Status.EXPIRED)
                # Its own requests (an approver deciding one now finds it closed), and
                # the standing approvals of its destructive calls.
                withdrawn = requests_withdraw(member.pk, at)
                ended = confirmation.approve_policies_end(member.pk, at)
                suspended.append((member, voided, withdrawn, ended))
        for member, voided, withdrawn, ended in suspended:
            data: dict[str, Any] = {
                "reason": reason,
                "approvals_voided": voided,
                "requests_withdrawn": withdrawn,
                "approve_policies_ended": ended,
            }
            if member.pk != agent.pk:
                data["cascade_from"] = agent.name
            audit.append(
                event_type=EventType.AGENT_SUSPENDED,
                actor=actor,
                at=at,
                agent=member.name,
                data=data,
            )
            requests_withdrawn_events(withdrawn, actor, at)
            confirmation.approve_policies_ended_events(ended, actor, at)
    agent.refresh_from_db()
    return agent


def agent_resume(*, agent: Agent, reason: str, actor: audit.Actor, at: datetime) -> Agent:
    """Lift the kill switch from one suspended agent after an investigation: its
    decisions are made again from `at`, with a new token.

    - A reason is required (`reason_required`): what the investigation found.
    - Only a suspended agent is resumed (409 `agent_not_suspended`), never while
      its parent or any agent above it is suspended (409 `parent_suspended`, as
      agent_create), and never at a moment before its suspension (409
      `resume_before_suspension`: the reports order state events by time).
    - This agent only: its subagents stay suspended until each is resumed on its
      own (their parent resumed first), so none comes back unexamined.
    - Its tokens still live are revoked, in the same transaction: a suspended agent
      may have been compromised, and a token of its from before must never work
      again. An admin issues it a new one. Each revocation is the usual
      `agent_token.revoked` event (as token_revoke writes it).
    - Approvals voided and approve policies ended at suspension stay so. Its grants
      are unchanged: they are time-boxed, so each allows again exactly what it allows
      at the time of the call; one that ended meanwhile stays ended.
    - One `agent.reactivated` event (after the token events): the reason, when the
      suspension began, and the prefixes of the tokens revoked.

    The agent's row is locked first, as agent_suspend locks every agent it reaches:
    a suspension racing the resume (of this agent or of one above it, which reaches
    this row too) is decided in order, either before (refused: still suspended, or
    `parent_suspended`) or after it (suspended again). Every row is changed before
    the first event is written: the chain lock is the last lock taken."""
    if not isinstance(reason, str) or not reason.strip():
        raise GovernanceError(
            "reason_required",
            "Resuming an agent needs a reason: what the investigation found.",
            fields={"reason": "required"},
        )
    with transaction.atomic():
        locked = Agent.objects.select_for_update(no_key=True).get(pk=agent.pk)
        if locked.status != Agent.Status.SUSPENDED:
            raise Conflict(
                "agent_not_suspended",
                f"The agent {locked.name} is not suspended: there is nothing to resume.",
            )
        if locked.parent_id is not None:
            # Read after the lock: a suspension above that committed first is seen here
            # (it locked this row too before changing anything).
            _refuse_suspended_parent(Agent.objects.get(pk=locked.parent_id), locked.name)
        suspended_at = locked.suspended_at
        if suspended_at is not None and at < suspended_at:
            raise Conflict(
                "resume_before_suspension",
                f"The agent {locked.name} was suspended at {suspended_at.isoformat()}; "
                "it cannot be resumed at an earlier moment.",
            )
        Agent.objects.filter(pk=locked.pk).update(status=Agent.Status.ACTIVE, suspended_at=None)
        stale = tokens_revoke_live(agent=locked, actor=actor, at=at)
        audit.append(
            event_type=EventType.AGENT_REACTIVATED,
            actor=actor,
            at=at,
            agent=locked.name,
            data={
                "reason": reason,
                "suspended_at": suspended_at.isoformat() if suspended_at else None,
                "tokens_revoked": stale,
            },
        )
    agent.refresh_from_db()
    return agent


_PREFIX_TRIES = 5


def token_issue(
    *,
    created_by: Any,
    actor: audit.Actor,
    at: datetime,
    agent: Agent | None = None,
    user: Any = None,
    days: int = 30,
) -> tuple[AgentToken, str]:
    """Returns the token and its plaintext, which is shown once and never stored.

    A suspended agent gets none (Conflict `agent_suspended`): its tokens would not work,
    and agent_resume revokes every token issued before it. The agent's row is locked,
    so a suspension or a resume committing meanwhile is seen. A holder (the agent, or
    the person for a personal token) with AGENT_TOKEN_MAX_LIVE live tokens already
    gets no more (Conflict `too_many_tokens`): rate limits are per token, and every
    live token is a credential to guard. The holder's row is locked before they are
    counted, so two issues at once cannot both pass the cap."""
    if not 0 < days <= settings.AGENT_TOKEN_MAX_DAYS:
        raise GovernanceError(
            "invalid_expiry",
            f"Token lifetime must be 1 to {settings.AGENT_TOKEN_MAX_DAYS} days.",
        )
    with transaction.atomic():
        if agent is not None:
            status = Agent.objects.select_for_update().values_list("status", flat=True)
            if status.get(pk=agent.pk) != Agent.Status.ACTIVE:
                raise Conflict(
                    "agent_suspended",
                    f"{agent.name} is suspended: resume it first, then issue its token "
                    "(a resume revokes every token issued before it).",
                )
            live = selectors.live_tokens(at).filter(agent=agent)
        else:
            type(user).objects.select_for_update().filter(pk=user.pk).exists()
            live = selectors.live_tokens(at).filter(agent=None, user=user)
        if (count := live.count()) >= settings.AGENT_TOKEN_MAX_LIVE:
            holder = agent.name if agent is not None else user.get_username()
            raise Conflict(
                "too_many_tokens",
                f"{holder} already holds {count} live tokens (at most "
                f"{settings.AGENT_TOKEN_MAX_LIVE}): revoke one it no longer uses first.",
            )
        for attempt in range(_PREFIX_TRIES):
            # The prefix (the lookup key) is 32 random bits: a collision is rare, not
            # impossible, and is met with another draw, never a database error.
            plaintext, prefix, digest = AgentToken.generate(personal=agent is None)
            try:
                with transaction.atomic():  # a savepoint: a collision undoes the row only
                    token = AgentToken.objects.create(
                        agent=agent,
                        user=user,
                        prefix=prefix,
                        digest=digest,
                        created_by=created_by,
                        created_at=at,
                        expires_at=at + timedelta(days=days),
                    )
                break
            except IntegrityError:
                if (
                    attempt == _PREFIX_TRIES - 1
                    or not AgentToken.objects.filter(prefix=prefix).exists()
                ):
                    raise
        audit.append(
            event_type=EventType.TOKEN_ISSUED,
            actor=actor,
            at=at,
            agent=agent.name if agent else "",
            data={
                "prefix": prefix,
                "holder": agent.name if agent else user.get_username(),
                "expires_at": token.expires_at.isoformat(),
            },
        )
    return token, plaintext


def token_revoke(*, token: AgentToken, actor: audit.Actor, at: datetime) -> AgentToken:
    with transaction.atomic():
        if AgentToken.objects.filter(pk=token.pk, revoked_at__isnull=True).update(revoked_at=at):
            _token_revoked_event(
                prefix=token.prefix,
                agent=token.agent.name if token.agent else "",
                actor=actor,
                at=at,
            )
    token.refresh_from_db()
    return token


def tokens_revoke_live(
    *, actor: audit.Actor, at: datetime, agent: Agent | None = None, user: Any = None
) -> list[str]:
    """Revoke every token of one holder (an agent, or a person's personal tokens) still
    live at `at`, in the caller's transaction: the rows locked and changed, then one
    `agent_token.revoked` event each (as token_revoke writes it). Called where the holder
    may have been compromised: agent_resume, and a person's deactivation
    (services.people). The revoked tokens' prefixes, oldest first. Every other row
    change of the caller's comes before this: its events take the chain lock."""
    holder = {"agent_id": agent.pk} if agent is not None else {"user_id": user.pk}
    stale = list(
        AgentToken.objects.select_for_update(no_key=True)
        .filter(**holder, revoked_at__isnull=True, expires_at__gt=at)
        .order_by("pk")
        .values_list("pk", "prefix")
    )
    AgentToken.objects.filter(pk__in=[pk for pk, _ in stale]).update(revoked_at=at)
    for _, prefix in stale:
        _token_revoked_event(prefix=prefix, agent=agent.name if agent else "", actor=actor, at=at)
    return [prefix for _, prefix in stale]


def _token_revoked_event(*, prefix: str, agent: str, actor: audit.Actor, at: datetime) -> None:
    """A token's revocation, on record (token_revoke, and agent_resume for each of the
    resumed agent's tokens): the same event whoever revokes it."""
    audit.append(
        event_type=EventType.TOKEN_REVOKED, actor=actor, at=at, agent=agent, data={"prefix": prefix}
    )
