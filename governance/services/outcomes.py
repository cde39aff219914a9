"""The agent reports what a decided tool call did: once, and only its own."""

from __future__ import annotations

import uuid
from datetime import datetime

from django.db import IntegrityError, transaction

from governance import audit
from governance.codes import EventType
from governance.errors import Conflict, NotFound
from governance.models import Agent, AuditEvent, DecisionOutcome

DECISION_EVENTS = (
    EventType.ACCESS_ALLOWED,
    EventType.ACCESS_DENIED,
    EventType.ACCESS_APPROVAL_REQUIRED,
)


def outcome_report(
    *,
    agent: Agent,
    decision_id: str,
    outcome: str,
    at: datetime,
    result_digest: str = "",
    excerpt: str = "",
    actor: audit.Actor | None = None,
) -> audit.Written:
    """`actor`: who reports (the API's: the agent, under its token); the agent by default."""
    try:
        uid = uuid.UUID(decision_id)
    except ValueError:
        raise NotFound("not_found", "No such decision.") from None
    decision = AuditEvent.objects.filter(
        uid=uid, event_type__in=DECISION_EVENTS, actor=f"agent:{agent.name}"
    ).first()
    if decision is None:
        # Someone else's decision looks exactly like a missing one.
        raise NotFound("not_found", "No such decision.")
    # Validated as a digest by the API; masked all the same, as the excerpt is, since
    # the log keeps whatever it is given for good.
    digest = audit.mask(result_digest)
    try:
        with transaction.atomic():
            DecisionOutcome.objects.create(
                decision_id=uid,
                agent=agent,
                outcome=outcome,
                result_digest=digest,
                reported_at=at,
            )
            return audit.append(
                event_type=EventType.ACCESS_OUTCOME,
                actor=actor or audit.Actor.agent(agent),
                at=at,
                agent=agent.name,
                task=decision.task,
                tool=decision.tool,
                action=decision.action,
                scope=decision.scope,
                decision=decision.decision,
                reason=decision.reason,
                grant_id=decision.grant_id,
                break_glass=decision.break_glass,  # every event about the call says so
                data={
                    "decision_id": str(uid),
                    "outcome": outcome,
                    "result_digest": digest,
                    "excerpt": audit.mask(excerpt)[:1000],
                },
            )
    except IntegrityError:
        raise Conflict("already_reported", "The outcome of this decision was reported.") from None
