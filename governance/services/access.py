"""access_check(): authorize() plus its writes, in one transaction.

The decision's audit event (which is also the record of the grant's use:
services.usage folds allowed events into use_count / last_used_at, so no
grant row is updated per call), and creating or consuming an approval,
commit together or not at all. If any of it fails (audit write refused,
database gone) the answer is deny with reason `error`, never allow.

The common case on PostgreSQL is two round trips: the decision's read, then
the event as one statement that commits on its own (no BEGIN, no COMMIT of
ours). authorize() reads in READ COMMITTED either way, so a transaction
around the read would not make it any more current; a decision that creates
or consumes an approval writes in a transaction, with its event.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connection, transaction

from governance import audit, db, notifications
from governance.codes import Decision as Verdict
from governance.codes import EventType, Reason
from governance.errors import Unauthenticated
from governance.models import Approval
from governance.policy import Decision, authorize
from governance.text import printable

log = logging.getLogger(__name__)

ATTEMPTS = 3  # decisions made again when the state changed under them, then deny `error`
# A decision made again after a change is decided at the change's moment, at most this
# far past its own `at` (a change commits within the wait for the chain lock).
RETRY_AHEAD_MAX = timedelta(seconds=60)

_EVENT_FOR = {
    Verdict.ALLOW: EventType.ACCESS_ALLOWED,
    Verdict.DENY: EventType.ACCESS_DENIED,
    Verdict.APPROVAL_REQUIRED: EventType.ACCESS_APPROVAL_REQUIRED,
}

# Advisory lock namespaces (the two-key form: they never meet the audit chain's one-key
# lock): "one open request per exact call", and "at most APPROVAL_PENDING_MAX open
# requests per agent".
_CALL_LOCK_SPACE = 0x41505052  # "APPR"
_AGENT_LOCK_SPACE = 0x41504741  # "APGA"


def _lock(space: int, *parts: Any) -> None:
    """Serialise what is keyed by `parts` until the transaction ends. PostgreSQL only:
    SQLite already serialises writers. Taken before the chain lock, as every row lock is."""
    if connection.vendor != "postgresql":
        return
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()
    key = int.from_bytes(digest[:4], "big", signed=True)
    with connection.cursor() as cur:
        cur.execute("SELECT pg_advisory_xact_lock(%s, %s)", [space, key])


# Single use, no time-of-check gap: the row changes only if it is still
# approved and unexpired at this instant; a second caller updates nothing.
_CONSUME = """
UPDATE governance_approval SET status = 'consumed', consumed_at = %s
WHERE id = %s AND status = 'approved' AND expires_at > %s
"""


def _same_call(decision: Decision, *, action: str, scope: str) -> Any:
    """Approvals asked for exactly this call (agent, tool, grant, action, scope, task
    and arguments)."""
    return Approval.objects.filter(
        agent_id=decision.agent_id,
        tool_id=decision.tool_id,
        grant_id=decision.grant_id,
        action=action,
        scope=scope,
        arguments_hash=decision.arguments_hash,
        task_id=decision.task_id,
    )


def _denied_lately(same_call: Any, at: datetime) -> Approval | None:
    """The request for this exact call a person denied within APPROVAL_TTL, if any."""
    return (
        same_call.filter(status=Approval.Status.DENIED, decided_at__gt=at - settings.APPROVAL_TTL)
        .order_by("-decided_at")
        .first()
    )


def _policy_approval(
    decision: Decision,
    *,
    action: str,
    scope: str,
    at: datetime,
    preview: str,
    attachments: Mapping[str, Any] | None,
) -> Approval:
    """The record of a call a confirmation policy approved: an approval decided by the
    policy and used by this call at once. A person's denial of this exact call within
    APPROVAL_TTL comes first (that denied request is returned instead)."""
    denied = _denied_lately(_same_call(decision, action=action, scope=scope), at)
    if denied is not None:
        return denied
    return _new_approval(
        decision,
        action=action,
        scope=scope,
        at=at,
        preview=preview,
        attachments=attachments,
        policy_id=decision.policy_id,
        status=Approval.Status.CONSUMED,
        decided_at=at,
        decision_reason=f"confirmation policy #{decision.policy_id}",
        consumed_at=at,
    )


def _new_approval(
    decision: Decision,
    *,
    action: str,
    scope: str,
    at: datetime,
    preview: str,
    attachments: Mapping[str, Any] | None,
    **state: Any,
) -> Approval:
    """An approval for exactly this call, asked at `at` (pending unless `state` says)."""
    return Approval.objects.create(
        agent_id=decision.agent_id,
        tool_id=decision.tool_id,
        grant_id=decision.grant_id,
        task_id=decision.task_id,
        action=action,
        scope=scope,
        arguments_hash=decision.arguments_hash,
        # The masked arguments, so the approver sees exactly what would run
        # (secrets and PII already masked, as in the audit event).
        arguments_preview=json.loads(preview),
        attachments=dict(attachments or {}),
        requested_at=at,
        expires_at=at + settings.APPROVAL_TTL,
        **state,
    )


def _pending_approval(
    decision: Decision,
    *,
    action: str,
    scope: str,
    at: datetime,
    preview: str = "{}",
    attachments: Mapping[str, Any] | None = None,
) -> Approval | None:
    """Reuse the caller's open request for this exact call, or open one; or, when a
    person denied this exact call within APPROVAL_TTL, that denied request (the
    gate answers `approval_denied`: no new request, nobody notified again, so an
    agent cannot wear approvers down by asking again and again). None when a new
    request would be one more than APPROVAL_PENDING_MAX of the agent's awaiting a
    person (changing one argument makes a new call: the count is per agent)."""
    assert decision.agent_id and decision.tool_id and decision.grant_id
    # One identical call at the same instant shares one approval (one request, one
    # notification) instead of each opening its own.
    _lock(
        _CALL_LOCK_SPACE,
        decision.agent_id,
        decision.tool_id,
        decision.grant_id,
        action,
        scope,
        decision.arguments_hash,
        decision.task_id,
    )
    same_call = _same_call(decision, action=action, scope=scope)
    existing = (
        same_call.filter(status=Approval.Status.PENDING, expires_at__gt=at)
        .order_by("-requested_at")
        .first()
    )
    if existing is not None:
        if attachments and not existing.attachments:
            # Asked first without them (a runner that did not send the script): the
            # same call, so the same bytes; the person deciding now can read them.
            existing.attachments = dict(attachments)
            existing.save(update_fields=["attachments"])
        return existing
    denied = _denied_lately(same_call, at)
    if denied is not None:
        return denied
    # Counted under a per-agent lock, so calls with different arguments at the same
    # instant cannot each find room for one more.
    _lock(_AGENT_LOCK_SPACE, decision.agent_id)
    waiting = Approval.objects.filter(
        agent_id=decision.agent_id, status=Approval.Status.PENDING, expires_at__gt=at
    )
    if waiting.count() >= settings.APPROVAL_PENDING_MAX:
        return None
    created = _new_approval(
        decision, action=action, scope=scope, at=at, preview=preview, attachments=attachments
    )
    # Only for a new request (not a reused one); sent after the commit.
    notifications.approval_needed(approval=created, at=at)
    return created


def _gate(
    decision: Decision,
    *,
    action: str,
    scope: str,
    at: datetime,
    preview: str,
    attachments: Mapping[str, Any] | None,
) -> Decision:
    """The confirmation gate's writes: record the approval of a confirmation policy
    that let the call through, consume the named approval (once, atomically) or open
    a pending one for this exact call, unless a person denied this exact call within
    APPROVAL_TTL (deny `approval_denied`, naming that approval). Inside the decision's
    transaction; only destructive calls get here."""
    if decision.allowed and decision.policy_id:
        approval = _policy_approval(
            decision, action=action, scope=scope, at=at, preview=preview, attachments=attachments
        )
        if approval.status == Approval.Status.DENIED:
            return _denied(decision, approval)
        return replace(decision, approval_id=str(approval.pk))
    if decision.allowed and decision.approval_id:
        consumed = db.change(_CONSUME, [at, db.param_uuid(decision.approval_id), at])
        if consumed != 1:
            return replace(
                decision,
                decision=Verdict.DENY,
                reason=Reason.APPROVAL_INVALID,
                message="The approval was already used.",
            )
        return decision
    pending = _pending_approval(
        decision, action=action, scope=scope, at=at, preview=preview, attachments=attachments
    )
    if pending is None:
        return replace(
            decision,
            decision=Verdict.DENY,
            reason=Reason.APPROVAL_BACKLOG,
            message=(
                f"{settings.APPROVAL_PENDING_MAX} of this agent's destructive calls already "
                "await a person; no new request is opened until they are decided or expire."
            ),
        )
    if pending.status == Approval.Status.DENIED:
        return _denied(decision, pending)
    return replace(decision, approval_id=str(pending.id))


def _denied(decision: Decision, denied: Approval) -> Decision:
    """Deny `approval_denied`: a person denied this exact call within APPROVAL_TTL."""
    assert denied.decided_at is not None
    again = (denied.decided_at + settings.APPROVAL_TTL).isoformat()
    return replace(
        decision,
        decision=Verdict.DENY,
        reason=Reason.APPROVAL_DENIED,
        approval_id=str(denied.id),
        policy_id=None,
        message=f"A person denied this exact call; it is not asked again before {again}.",
    )


# A caller's own refusal of a call a grant covers, asked before the confirmation gate:
# (reason, message) to deny, or None. See access_check(refuse=...).
Refusal = Callable[[Decision], tuple[str, str] | None]

_TOKEN_REVOKED = "SELECT revoked_at IS NOT NULL FROM governance_agenttoken WHERE id = %s"


def token_revoked(token_id: int, *, hold: bool = False) -> bool:
    """Whether the bearer token a request was let in with has been revoked since (or is
    gone): the one rule for a token in flight, asked by a decision (token_refusal) and
    by a write made under the token (require_live_token).

    hold=True (inside the write's transaction): on PostgreSQL the token's row is
    share-locked until the commit, so a revoke (an UPDATE of the row) either committed
    first and is seen here, or waits for this transaction and is recorded after its
    events. SQLite's writers are serialised already (BEGIN IMMEDIATE)."""
    sql = _TOKEN_REVOKED
    if hold and connection.vendor == "postgresql":
        sql += " FOR SHARE"
    revoked = db.query(sql, [token_id], "b")
    return not revoked or bool(revoked[0][0])


def token_refusal(token_id: int) -> Refusal:
    """A refusal for a call whose bearer token has been revoked since the request was let
    in. Asked after the decision's read: a revoke committing after it is a change the
    event's append refuses (StateChanged), and the question is asked again, so no
    decision under a token is recorded after its revoke."""

    def refuse(decision: Decision) -> tuple[str, str] | None:
        if token_revoked(token_id):
            return Reason.TOKEN_REVOKED, "The token this request was made with was revoked."
        return None

    return refuse


# The token whose row this thread's transaction holds (token_revoked(hold=True)), with
# the no-op commit hook that marks it: Django drops the hook at COMMIT or ROLLBACK, and
# with a savepoint rolled back, as PostgreSQL then releases the row.
_holding = threading.local()


def require_live_token(token_id: int | None) -> None:
    """For a change made under a bearer token that is not a decision: refuse it
    (Unauthenticated: the 401 the token would get at the door, nothing written) when
    the token was revoked after the request was let in. Asked by audit.append for
    every event of an actor with a token (api.views.actor_for), so inside the change's
    transaction, before its events. Taken after the change's other row locks
    (agent_resume locks an agent before its tokens). None: no token (the UI, a
    command, an in-process caller).

    The first ask in a transaction holds the token's row (token_revoked); a later one
    (the change's next event) only reads it: the row is held already, and a lock taken
    after the chain lock could wait while every decision waits for that one."""
    if token_id is None:
        return
    held = getattr(_holding, "mark", None)
    holding = (
        held is not None
        and held[0] == token_id
        and any(func is held[1] for _sids, func, _robust in connection.run_on_commit)
    )
    if token_revoked(token_id, hold=not holding):
        raise Unauthenticated()
    if not holding and connection.in_atomic_block and connection.vendor == "postgresql":

        def mark() -> None:
            return None

        transaction.on_commit(mark)
        _holding.mark = (token_id, mark)


def _decide_and_record(
    question: dict[str, Any],
    *,
    actor: audit.Actor,
    subject: dict[str, str],
    args_json: str,
    refuse: Refusal | None = None,
    attachments: Mapping[str, Any] | None = None,
) -> tuple[Decision, audit.Written]:
    """One attempt: the decision, the gate's writes and the event, or StateChanged
    (nothing written) when the state changed after the decision read it."""
    # Inside a caller's transaction (and on SQLite) the whole decision runs in a
    # savepoint, so a database error in it cannot poison the caller's work. Alone
    # on PostgreSQL, the read needs no transaction and the event commits itself,
    # or, with the gate's writes, commits with them.
    alone = connection.vendor == "postgresql" and not connection.in_atomic_block
    with nullcontext() if alone else transaction.atomic():
        decision = authorize(**question)
        action, scope, at = question["action"], question["scope"], question["at"]
        if refuse is not None and decision.grant_id and decision.decision != Verdict.DENY:
            refused = refuse(decision)
            if refused is not None:
                reason, message = refused
                decision = replace(
                    decision,
                    decision=Verdict.DENY,
                    reason=reason,  # type: ignore[arg-type]  # the caller's own code
                    message=message,
                    approval_id=None,
                    policy_id=None,  # no policy decided this
                )
        gated = (decision.allowed and (decision.approval_id or decision.policy_id)) or (
            decision.decision == Verdict.APPROVAL_REQUIRED
        )
        with transaction.atomic() if alone and gated else nullcontext():
            if gated:
                decision = _gate(
                    decision,
                    action=action,
                    scope=scope,
                    at=at,
                    preview=args_json,
                    attachments=attachments,
                )
            written = audit.append(
                event_type=_EVENT_FOR[Verdict(decision.decision)],
                actor=actor,
                at=at,
                arguments_json=args_json,
                arguments_hash=decision.arguments_hash,
                decision=decision.decision,
                reason=decision.reason,
                grant_id=decision.grant_id,
                approval_id=decision.approval_id or "",
                break_glass=decision.break_glass,
                standalone=alone and not gated,
                seen_seq=decision.seen_seq,
                data=_event_data(decision),
                **subject,
            )
    return decision, written


def _event_data(decision: Decision) -> dict[str, Any] | None:
    """What the event adds: which confirmation policy answered the gate, and which
    grant covered the call but was not live, when either did."""
    data: dict[str, Any] = {}
    if decision.policy_id:
        data["confirmation_policy"] = decision.policy_id
    if decision.dead_grant_id:
        data["grant_not_live"] = decision.dead_grant_id
    return data or None


def record_malformed(*, agent: str, body: Any, problems: Mapping[str, str], at: datetime) -> None:
    """A body that is not a question (an action outside the five, an empty or
    overlong tool name, a list for arguments) is answered 400 and never decided: no
    grant read, no approval touched. It is still on record, as a denial with reason
    `invalid_request` naming what was sent where it was text (cut and escaped as
    every event's columns are) and what was wrong with it. The arguments are not
    read: they could not be masked as the schema's arguments are. A record that
    cannot be written is logged; the answer is the 400 either way."""
    sent = body if isinstance(body, Mapping) else {}

    def said(key: str) -> str:
        value = sent.get(key)
        return value if isinstance(value, str) else ""

    try:
        with transaction.atomic():
            audit.append(
                event_type=EventType.ACCESS_DENIED,
                actor=audit.Actor("agent", f"agent:{agent}"),
                at=at,
                agent=agent,
                task=said("task"),
                tool=said("tool"),
                action=said("action"),
                scope=said("scope"),
                decision=Verdict.DENY,
                reason=Reason.INVALID_REQUEST,
                # Bounded as every event is: a key is a field's name, which for a key
                # the schema does not take is the agent's own text (20 of 100,000
                # characters each made a 2 MB event no one can delete).
                data={
                    "problems": {
                        printable(key[:100]): printable(problem[:200])
                        for key, problem in problems.items()
                    }
                },
            )
    except Exception:
        log.exception("could not record a malformed authorize request")


def access_check(
    *,
    agent: Any,
    tool: str,
    action: str,
    scope: str,
    at: datetime,
    task: str | None = None,
    arguments: Mapping[str, Any] | None = None,
    approval: str | None = None,
    refuse: Refusal | None = None,
    attachments: Mapping[str, Any] | None = None,
) -> Decision:
    """Decide, record and account for one tool call. Never raises.

    `refuse` lets a caller that asks on behalf of something with limits of its own
    (the sandbox: a code-execution tool, an allowed backend, the grant's ceiling) turn
    down a call a grant covers before the confirmation gate: the answer is deny with
    the caller's reason, recorded as such, and no approval is opened or used up.

    `attachments` (already masked) go on an approval this call opens, for the person
    asked to read beside the arguments: the sandbox's script and input, whose hashes
    are among the arguments. They are not hashed themselves."""
    agent_name = agent.name if hasattr(agent, "name") else str(agent)
    actor = audit.Actor("agent", f"agent:{agent_name}")
    subject = {
        "agent": agent_name,
        "task": task or "",
        "tool": tool,
        "action": action,
        "scope": scope,
    }
    question = {
        "agent": agent_name,
        "tool": tool,
        "action": action,
        "scope": scope,
        "at": at,
        "task": task,
        "arguments": arguments,
        "approval": approval,
    }
    try:
        args_json = audit.masked_arguments_json(arguments if isinstance(arguments, Mapping) else {})
        for _attempt in range(ATTEMPTS):
            try:
                decision, written = _decide_and_record(
                    question,
                    actor=actor,
                    subject=subject,
                    args_json=args_json,
                    refuse=refuse,
                    attachments=attachments,
                )
                return replace(decision, decision_id=str(written.uid))
            except audit.StateChanged as changed:
                # A revoke, suspension or other change committed while this decision
                # waited for the chain lock: its answer may be stale, so decide again,
                # no earlier than the change (a revoke "from T" applies to it). A change
                # only commits within the wait, so one dated far ahead is not followed.
                since = audit.changed_at(changed.seen_seq) if changed.seen_seq else None
                if since is not None:
                    at = question["at"]
                    question["at"] = max(at, min(since, at + RETRY_AHEAD_MAX))
                continue
        raise audit.StateChanged(f"the state kept changing over {ATTEMPTS} attempts")
    except Exception:
        log.exception("access_check failed; denying")
    failed = Decision(
        decision=Verdict.DENY,
        reason=Reason.ERROR,
        message="The decision could not be recorded, so access is denied.",
    )
    try:
        # Best effort: if the database is reachable at all, the denial is logged.
        with transaction.atomic():
            written = audit.append(
                event_type=EventType.ACCESS_DENIED,
                actor=actor,
                at=at,
                decision=Verdict.DENY,
                reason=Reason.ERROR,
                **subject,
            )
        return replace(failed, decision_id=str(written.uid))
    except Exception:
        log.exception("could not record the failed decision either")
        return failed
