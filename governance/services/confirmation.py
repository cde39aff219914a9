"""Confirmation policies: the confirmation gate answered by a rule, not a person.

A policy covers one agent's destructive calls on one tool and action, inside a scope
pattern, optionally only under one task, for a bounded window (at most GRANT_MAX_TTL).
`approve` lets each matching call through once (recorded as an approval the policy
decided and the call used at once); `deny` refuses each matching call, even one that
names a person's approval. Only authorize() reads policies for a decision.

Who may write one: a person with the approver role; for `approve`, one with no stake
in the calls (the same people as for approving them by hand, stakeholders(), through
the agent and through every live grant the calls would run under). An approve policy
whose author takes such a stake later stops answering (policy._policy_verdicts). A
deny only restricts: any approver may write one. Revoking ends either at once.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction

from governance import audit, notifications, roles, selectors
from governance.codes import ActionClass, EventType
from governance.errors import Conflict, Forbidden, GovernanceError, NotFound
from governance.models import Agent, ConfirmationPolicy, Task, Tool
from governance.policy import pattern_is_valid
from governance.services.approvals import stakeholders
from governance.services.grants import lock_agent, require_open_task


def _event(
    policy: ConfirmationPolicy, event_type: str, actor: audit.Actor, at: datetime, **data: Any
) -> None:
    audit.append(
        event_type=event_type,
        actor=actor,
        at=at,
        agent=policy.agent.name,
        task=policy.task.key if policy.task else "",
        tool=policy.tool.name,
        action=policy.action,
        scope=policy.scope,
        data={
            "policy": policy.pk,
            "verdict": policy.verdict,
            "starts_at": policy.starts_at.isoformat(),
            "expires_at": policy.expires_at.isoformat(),
            **data,
        },
    )


def _require_approver(user: Any) -> None:
    if roles.is_read_only(user):
        raise Forbidden("auditor_read_only", "Auditors are read-only.")
    # Active, too (roles.may_approve): a deactivated approver writes nothing in their
    # name, whatever door the call came by.
    if not roles.may_approve(user):
        raise Forbidden("not_approver", "Confirmation policies are written by active approvers.")


def policy_stakeholders(agent: Agent, tool: Tool, action: str, *, at: datetime) -> set[Any]:
    """Everyone with a stake in the agent's `action` calls on `tool` from `at` on: its
    people (stakeholders) and those of every live grant that holds the action."""
    people = stakeholders(agent, None, at=at)
    for grant in selectors.live_grants(at).filter(agent=agent, tool=tool):
        if action in (grant.actions or []):
            people |= stakeholders(agent, grant, at=at)
    return people


def validate_policy(
    *, tool: Tool, action: str, scope: str, verdict: str, reason: str, duration: timedelta
) -> None:
    """What a policy must be, whoever writes it and however (API, UI, a matrix file):
    raises GovernanceError with the first problem's code."""
    if verdict not in ConfirmationPolicy.Verdict.values:
        raise GovernanceError("invalid_verdict", "The verdict is approve or deny.")
    if action not in ActionClass.values:
        raise GovernanceError("invalid_action", f"{action!r} is not an action class.")
    if action not in (tool.actions or []):
        raise GovernanceError("action_not_supported", f"The tool does not support {action!r}.")
    if not (tool.irreversible or action == ActionClass.DELETE):
        raise GovernanceError(
            "not_destructive",
            "Only destructive calls (delete, or any action on an irreversible tool) pass "
            "the confirmation gate; this one needs no policy.",
        )
    if not pattern_is_valid(scope):
        raise GovernanceError(
            "invalid_scope", "The scope is not a valid pattern.", fields={"scope": "invalid"}
        )
    if not reason.strip():
        raise GovernanceError("reason_required", "Say why calls like these need no person.")
    if duration <= timedelta(0):
        raise GovernanceError("invalid_duration", "The duration must be positive.")
    if duration > settings.GRANT_MAX_TTL:
        hours = int(settings.GRANT_MAX_TTL.total_seconds() // 3600)
        raise GovernanceError(
            "duration_too_long", f"A policy lives at most {hours} hours (GRANT_MAX_TTL_HOURS)."
        )


def policy_create(
    *,
    author: Any,
    agent: Agent,
    tool: Tool,
    action: str,
    scope: str,
    verdict: str,
    reason: str,
    duration: timedelta,
    actor: audit.Actor,
    at: datetime,
    task: Task | None = None,
) -> ConfirmationPolicy:
    """A live policy from `at` for `duration`, with its event. The same policy asked for
    again while it lives (a double click, a retry) is that one: nothing is written (a
    second copy outlived the revoke of the first and kept approving calls)."""
    _require_approver(author)
    validate_policy(
        tool=tool, action=action, scope=scope, verdict=verdict, reason=reason, duration=duration
    )
    # Nobody confirms their own agent's calls, by hand or by rule: not the agent's
    # people, nor anyone with a stake in a live grant the calls would run under (its
    # requester, up its delegation chain). authorize() applies the same rule to each
    # call, so a stake taken later silences the policy too. A deny only restricts:
    # anyone with the approver role may write one, the agent's owner included.
    if verdict == ConfirmationPolicy.Verdict.APPROVE and author.pk in policy_stakeholders(
        agent, tool, action, at=at
    ):
        raise Forbidden("self_approval", "Nobody writes a policy for their own agent's calls.")
    with transaction.atomic():
        # The agent's row (before the task, as everywhere) serialises policy writes for
        # it: two copies asked at once cannot both miss each other.
        lock_agent(agent.pk)
        require_open_task(task.pk if task else None, at)
        # As approved now (the caller's Tool may be older than an approval).
        definition = Tool.objects.values_list("approved_hash", flat=True).get(pk=tool.pk)
        same = ConfirmationPolicy.objects.filter(
            created_by=author, agent=agent, tool=tool, task=task, action=action, scope=scope,
            verdict=verdict, reason=reason, definition_hash=definition, revoked_at__isnull=True,
        )  # fmt: skip
        for earlier in same:
            if earlier.live_at(at) and earlier.expires_at - earlier.starts_at == duration:
                return earlier
        policy = ConfirmationPolicy.objects.create(
            agent=agent,
            tool=tool,
            task=task,
            action=action,
            scope=scope,
            verdict=verdict,
            reason=reason,
            created_by=author,
            created_at=at,
            starts_at=at,
            expires_at=at + duration,
            definition_hash=definition,
        )
        _event(policy, EventType.CONFIRMATION_POLICY_CREATED, actor, at, reason=reason)
        notifications.policy_written(policy=policy, at=at)  # sent after the commit
    return policy


def policy_revoke(
    *, policy_id: int, by: Any, reason: str, actor: audit.Actor, at: datetime
) -> ConfirmationPolicy:
    """End a live policy now; calls it covered ask a person again."""
    _require_approver(by)
    if not reason.strip():
        raise GovernanceError("reason_required", "Say why the policy is revoked.")
    with transaction.atomic():
        policy = (
            ConfirmationPolicy.objects.select_for_update(of=("self",), no_key=True)
            .select_related("agent", "tool", "task")
            .filter(pk=policy_id)
            .first()
        )
        if policy is None:
            raise NotFound("not_found", "No such confirmation policy.")
        if not policy.live_at(at):
            raise Conflict("not_live", "The policy has already ended.")
        # Lifting a deny loosens what it binds (the agent, and every agent below it):
        # the rule for writing an approve, for each of them.
        if policy.verdict == ConfirmationPolicy.Verdict.DENY and any(
            by.pk in policy_stakeholders(bound, policy.tool, policy.action, at=at)
            for bound in selectors.agent_tree(Agent.objects.all(), policy.agent_id)
        ):
            raise Forbidden(
                "self_approval", "Nobody lifts a deny policy on their own agent's calls."
            )
        policy.revoked_at = at
        policy.revoked_by = by
        policy.revoke_reason = reason
        policy.save(update_fields=["revoked_at", "revoked_by", "revoke_reason"])
        _event(policy, EventType.CONFIRMATION_POLICY_REVOKED, actor, at, reason=reason)
    return policy


# Why an approve policy ended when its agent was suspended (agents.agent_suspend).
SUSPENDED_REASON = "ended: the agent was suspended"


def approve_policies_end(agent_id: int, at: datetime) -> list[int]:
    """End the agent's live approve policies at `at` (SUSPENDED_REASON); their ids.
    A standing "yes" to destructive calls does not outlast an incident: after a
    resume, a person confirms each call again until an approver writes a new policy,
    as the hand approvals voided with them are asked again. Deny policies stay (they
    only restrict). Rows only, locked first: the caller writes the events after its
    own rows (approve_policies_ended_events)."""
    ids = list(
        ConfirmationPolicy.objects.select_for_update(no_key=True)
        .filter(
            agent_id=agent_id,
            verdict=ConfirmationPolicy.Verdict.APPROVE,
            revoked_at__isnull=True,
            expires_at__gt=at,
        )
        .order_by("pk")
        .values_list("pk", flat=True)
    )
    ConfirmationPolicy.objects.filter(pk__in=ids).update(
        revoked_at=at, revoke_reason=SUSPENDED_REASON
    )
    return ids


def approve_policies_ended_events(ids: list[int], actor: audit.Actor, at: datetime) -> None:
    """One confirmation_policy.revoked event per policy approve_policies_end ended, in
    the shape policy_revoke writes."""
    ended = ConfirmationPolicy.objects.select_related("agent", "tool", "task").filter(pk__in=ids)
    for policy in ended.order_by("pk"):
        _event(
            policy, EventType.CONFIRMATION_POLICY_REVOKED, actor, at, reason=policy.revoke_reason
        )
