"""Every change to a grant, each with its audit event in the same transaction.

Request -> approve (starts the clock) | deny; issue (admin, already approved);
revoke (ends every delegated descendant too); delegate (a narrowed copy for a
subagent, never wider than the parent); expire (bookkeeping only: decisions
already refuse expired grants on their own).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F

from governance import audit, notifications, roles
from governance.codes import ACTION_VALUES, LIMIT_BOUNDS, Decision, EventType, limit_problem
from governance.errors import Conflict, Forbidden, GovernanceError
from governance.models import Agent, Approval, Grant, Task, Tool
from governance.policy import grant_dead_reason, pattern_is_valid, pattern_within, scope_matches
from governance.services.approvals import stakeholders
from governance.services.claims import claim_each
from sandbox_runner.egress import parse_destination
from sandbox_runner.spec import DEFAULT_LIMITS

# As the API schema declares (GrantRequestIn), for every door: a matrix file too.
MAX_FIELDS = 100
MAX_FIELD_NAME = 100
# A field name is printable ASCII with no comma: exports join a grant's fields with
# commas, so `["email", "name"]` and `["email,name"]` would read the same, and a bidi
# control or line break in one would turn a printed report's row around.
FIELD_NAME = re.compile(r"[!-+\--~]+")
MAX_EGRESS = 100
MAX_EGRESS_ENTRY = 300
MAX_JUSTIFICATION = 2000


def whole_seconds(window: timedelta) -> timedelta:
    """A grant's window as a duration a request can ask for: cut to whole seconds, never
    longer than the window. A window narrowed to a reviewer's expiry, or delegated to
    a caller's, has the microseconds of its start (timezone.now()) in it."""
    return window - timedelta(microseconds=window.microseconds)


def validate_shape(
    *,
    tool: Tool,
    actions: Sequence[str],
    scope: str,
    fields: Sequence[str] = (),
    egress: Sequence[str] = (),
    duration: timedelta | None = None,
    justification: str | None = None,
) -> None:
    """The rules every grant obeys, whichever door it comes through."""
    errors: dict[str, str] = {}
    if not actions or any(a not in ACTION_VALUES for a in actions):
        errors["actions"] = f"Actions must be a non-empty list from {sorted(ACTION_VALUES)}."
    elif len(set(actions)) != len(actions):
        errors["actions"] = "Actions must not repeat."
    elif unsupported := [a for a in actions if not tool.supports(a)]:
        errors["actions"] = f"Tool {tool.name} does not support {', '.join(unsupported)}."
    if not pattern_is_valid(scope):
        errors["scope"] = (
            "Scope must be a canonical pattern like repo:acme/api/* ('*' only as a whole "
            "segment; no '..', '%', '\\', empty segments or non-ASCII)."
        )
    if len(fields) > MAX_FIELDS or any(
        not isinstance(f, str) or len(f) > MAX_FIELD_NAME or not FIELD_NAME.fullmatch(f)
        for f in fields
    ):
        errors["fields"] = (
            f"Fields must be at most {MAX_FIELDS} names of 1-{MAX_FIELD_NAME} printable "
            "ASCII characters, with no space or comma."
        )
    if len(egress) > MAX_EGRESS or any(
        not isinstance(e, str) or len(e) > MAX_EGRESS_ENTRY for e in egress
    ):
        errors["egress"] = (
            f"Egress must be at most {MAX_EGRESS} entries of at most {MAX_EGRESS_ENTRY} characters."
        )
    for item in () if "egress" in errors else egress:
        # The runner's own parser, so a grant can never hold an entry its proxy reads
        # differently (or refuses) at run time.
        try:
            parse_destination(item)
        except (ValueError, TypeError):
            errors["egress"] = f"Egress entry {item!r} is not host:port."
            break
    if justification is not None and len(justification) > MAX_JUSTIFICATION:
        errors["justification"] = (
            f"The justification must be at most {MAX_JUSTIFICATION} characters."
        )
    if duration is not None:
        if duration <= timedelta(0):
            errors["duration"] = "Duration must be positive."
        elif duration > settings.GRANT_MAX_TTL:
            hours = settings.GRANT_MAX_TTL.total_seconds() / 3600
            errors["duration"] = (
                f"Duration exceeds the maximum grant lifetime of {hours:g} hours; "
                "there are no permanent grants."
            )
        elif duration % timedelta(seconds=1):
            errors["duration"] = "Duration must be a whole number of seconds."
    if errors:
        raise GovernanceError(
            "invalid_grant", "The grant is not valid: " + " ".join(errors.values()), fields=errors
        )


def grant_event(
    grant: Grant, event_type: str, *, actor: audit.Actor, at: datetime, data: dict[str, Any]
) -> None:
    """The one shape of an audit event about a grant: its subject fields, then `data`.
    Every service that changes a grant (issue, revoke, narrow, break-glass, reviews,
    unused flags) writes through here. The `action` column holds the grant's whole
    action list, comma-joined (so a scan of the column for `delete` finds it), and
    data.actions holds it as a list: the log alone says what the grant allowed."""
    audit.append(
        event_type=event_type,
        actor=actor,
        at=at,
        agent=grant.agent.name,
        task=grant.task.key if grant.task else "",
        tool=grant.tool.name,
        action=",".join(grant.actions),
        scope=grant.scope,
        grant_id=grant.pk,
        break_glass=grant.break_glass,
        data={"actions": list(grant.actions), **data},
    )


def _event(grant: Grant, event_type: str, actor: audit.Actor, at: datetime, **data: Any) -> None:
    grant_event(
        grant,
        event_type,
        actor=actor,
        at=at,
        data={
            "status": grant.status,
            "starts_at": grant.starts_at.isoformat() if grant.starts_at else None,
            "expires_at": grant.expires_at.isoformat() if grant.expires_at else None,
            **data,
        },
    )


def refuse_read_only(person: Any) -> None:
    """An auditor files no grant request, for any agent (403 `auditor_read_only`)."""
    if person is not None and roles.is_read_only(person):
        raise Forbidden("auditor_read_only", "Auditors are read-only: they cannot request grants.")


def grant_request(
    *,
    agent: Agent,
    tool: Tool,
    actions: Sequence[str],
    scope: str,
    duration: timedelta,
    justification: str,
    actor: audit.Actor,
    at: datetime,
    requested_by: Any = None,
    requested_by_agent: Agent | None = None,
    task: Task | None = None,
    fields: Sequence[str] = (),
    egress: Sequence[str] = (),
    limits: dict[str, Any] | None = None,
    delegable: bool = False,
    before_event: Callable[[Grant], None] | None = None,
) -> Grant:
    """A pending request: never live until a different human approves it.
    Approvers are notified after the commit. `before_event` lets a caller change its
    own rows with the new request in hand before any event is written (the chain
    lock is the last lock a transaction takes). Under a bearer token revoked since the
    request was let in (actor.token_id), the 401 of the door, nothing written: its
    event refuses it (audit.append)."""
    with transaction.atomic():
        grant = _request_row(
            agent=agent,
            tool=tool,
            actions=actions,
            scope=scope,
            duration=duration,
            justification=justification,
            requested_by=requested_by,
            requested_by_agent=requested_by_agent,
            task=task,
            fields=fields,
            egress=egress,
            limits=limits,
            delegable=delegable,
            at=at,
        )
        if before_event is not None:
            before_event(grant)
        _requested_event(grant, actor, at)
        notifications.request_pending(grant=grant, at=at)
    return grant


def _request_row(
    *,
    agent: Agent,
    tool: Tool,
    actions: Sequence[str],
    scope: str,
    duration: timedelta,
    justification: str,
    requested_by: Any,
    requested_by_agent: Agent | None,
    task: Task | None,
    fields: Sequence[str],
    egress: Sequence[str],
    limits: dict[str, Any] | None,
    delegable: bool,
    at: datetime,
) -> Grant:
    """The request's row, checked and inserted (its event is the caller's)."""
    refuse_subagent_grant(agent)
    validate_shape(
        tool=tool,
        actions=actions,
        scope=scope,
        fields=fields,
        egress=egress,
        duration=duration,
        justification=justification,
    )
    if not justification.strip():
        raise GovernanceError("justification_required", "Say why the grant is needed.")
    if requested_by is None and requested_by_agent is None:
        raise GovernanceError("requester_required", "A grant request needs a requester.")
    refuse_read_only(requested_by)
    if requested_by_agent is not None:
        # Counted under the requesting agent's lock: two requests at once see each other.
        lock_agent(requested_by_agent.pk)
        waiting = Grant.objects.filter(
            requested_by_agent=requested_by_agent, status=Grant.Status.PENDING
        ).count()
        if waiting >= settings.GRANT_REQUEST_PENDING_MAX:
            raise Conflict(
                "request_backlog",
                f"{waiting} of this agent's grant requests already await a person "
                "(GRANT_REQUEST_PENDING_MAX): wait for one to be decided or to lapse.",
            )
    try:
        with transaction.atomic():
            require_open_task(task.pk if task else None, at)
            grant = Grant.objects.create(
                created_at=at,
                agent=agent,
                tool=tool,
                task=task,
                actions=list(actions),
                scope=scope,
                fields=list(fields),
                egress=list(egress),
                justification=justification,
                requested_by=requested_by,
                requested_by_agent=requested_by_agent,
                requested_duration=duration,
                delegable=delegable,
                **_limits(limits),
            )
    except IntegrityError:
        raise Conflict(
            "duplicate_request",
            "A request for this agent, tool, task and scope is already pending.",
        ) from None
    return grant


def refuse_subagent_grant(agent: Agent) -> None:
    """A subagent only ever holds a subset of its parent's grants: it gets them by
    delegation of a live grant of its parent (grant_delegate), never by a request, an
    approval or break-glass of its own. authorize() does not count such a grant either
    (one made before this rule, or written around the services)."""
    if agent.parent_id is not None:
        parent = Agent.objects.values_list("name", flat=True).get(pk=agent.parent_id)
        raise Forbidden("subagent_needs_delegation", subagent_refusal(agent.name, parent))


def subagent_refusal(name: str, parent: str) -> str:
    return (
        f"{name} is a subagent of {parent}: it gets grants only by delegation of "
        f"{parent}'s live grants (POST /api/v1/delegations), never its own."
    )


def require_open_task(task_id: int | None, at: datetime) -> None:
    """A grant bound to a task lives only while the task is open, so none is requested
    or issued for a task that is not. The task's row stays locked to the commit: a
    close (which updates it first) cannot slip between this check and the new grant."""
    if task_id is None:
        return
    task = Task.objects.select_for_update(no_key=True).get(pk=task_id)
    if not task.is_open_at(at):
        raise Conflict("task_closed", f"The task {task.key} is not open.")


def _limits(limits: dict[str, Any] | None) -> dict[str, Any]:
    """The grant's code-execution ceilings as columns, each within codes.LIMIT_BOUNDS."""
    limits = limits or {}
    unknown = set(limits) - set(LIMIT_BOUNDS)
    if unknown:
        raise GovernanceError("invalid_limits", f"Unknown limits: {', '.join(sorted(unknown))}.")
    for key, value in limits.items():
        problem = limit_problem(key, value)
        if problem:
            raise GovernanceError(
                "invalid_limits", f"The {key} limit {problem}, got {value!r}."[:300]
            )
    return {f"limit_{k}": v for k, v in limits.items()}


def _lock_pending(grant_id: int, at: datetime) -> Grant:
    """The request, row-locked: two approvers (or approve and deny) at once
    decide it exactly once; the loser gets a clear Conflict.

    A request older than GRANT_REQUEST_TTL is closed by time, not by the job:
    it is refused (`request_expired`) even if grant_requests_expire has not run
    yet, so a stale request can never become a live grant."""
    grant = (
        Grant.objects.select_for_update(of=("self",), no_key=True)
        .select_related("agent", "tool", "task")
        .get(pk=grant_id)
    )
    # Closed by the expiry job, or due to be: the same answer whether or not it ran
    # ("already denied" would say a person denied it).
    closed_by_job = (
        grant.status == Grant.Status.DENIED
        and grant.approved_by_id is None
        and grant.decision_reason == REQUEST_EXPIRED_REASON
    )
    if grant.status != Grant.Status.PENDING and not closed_by_job:
        raise Conflict("not_pending", f"The request is already {grant.status}.")
    if closed_by_job or grant.created_at <= at - settings.GRANT_REQUEST_TTL:
        hours = settings.GRANT_REQUEST_TTL.total_seconds() / 3600
        raise Conflict(
            "request_expired",
            f"The request was made {grant.created_at.isoformat()} and expired undecided "
            f"after {hours:g} hours; ask again if it is still needed.",
        )
    return grant


def _narrowing(
    grant: Grant,
    actions: Sequence[str] | None,
    scope: str | None,
    duration: timedelta | None,
    reason: str = "",
    delegable: bool | None = None,
) -> dict[str, Any]:
    """What the approver cut from the request; never anything wider or longer.

    An approver may grant less than was asked (fewer actions, a scope inside
    the requested one, a shorter window, no handing down to subagents), never
    more: a wider grant is a new request that someone else has to approve.
    """
    narrowed: dict[str, Any] = {}
    errors: dict[str, str] = {}
    assert grant.requested_duration is not None
    if actions is not None and list(actions) != list(grant.actions):
        if not actions or len(set(actions)) != len(actions):
            errors["actions"] = "Keep at least one action, each once."
        elif not set(actions) <= set(grant.actions):
            errors["actions"] = "Only actions that were requested can be approved."
        else:
            narrowed["actions"] = [a for a in grant.actions if a in set(actions)]
    if scope is not None and scope != grant.scope:
        if not pattern_within(scope, grant.scope):
            errors["scope"] = f"The scope must lie inside the requested scope {grant.scope}."
        else:
            narrowed["scope"] = scope
    if duration is not None and duration != grant.requested_duration:
        if not timedelta(0) < duration <= grant.requested_duration:
            errors["duration"] = "The duration must be positive and no longer than requested."
        else:
            narrowed["duration_seconds"] = int(duration.total_seconds())
    if delegable is not None and delegable != grant.delegable:
        # A delegable grant is handed on by the agent with nobody asked: only the
        # request can ask for that, and an approver may only take it away.
        if delegable:
            errors["delegable"] = (
                "The request did not ask to be delegable: an approval cannot make it so."
            )
        else:
            narrowed["delegable"] = False
    if errors:
        raise GovernanceError(
            "invalid_narrowing",
            "The approval would not narrow the request: " + " ".join(errors.values()),
            fields=errors,
        )
    return narrowed


def grant_approve(
    *,
    grant_id: int,
    approver: Any,
    actor: audit.Actor,
    at: datetime,
    actions: Sequence[str] | None = None,
    scope: str | None = None,
    duration: timedelta | None = None,
    delegable: bool | None = None,
    reason: str = "",
) -> Grant:
    """Approval starts the clock: starts_at = now, expires_at = now + duration.

    `actions`, `scope`, `duration` and `delegable` (False: the agent may not hand
    the grant to its subagents, though the request asked for it; None: as
    requested) optionally narrow the request (see _narrowing); what was cut is
    recorded in the grant.issued event, as is the approver's `reason` (also kept in
    decision_reason, as a denial's is).
    """
    with transaction.atomic():
        task_id, agent_id = Grant.objects.values_list("task_id", "agent_id").get(pk=grant_id)
        # The agent first (a suspension committing meanwhile is seen: no grant is issued
        # to it), then the task (task_close locks it before the grants it ends): the
        # order break-glass and delegation take.
        lock_agent(agent_id)
        require_open_task(task_id, at)
        grant = _lock_pending(grant_id, at)
        extra = _approve_row(grant, approver, at, actions, scope, duration, reason, delegable)
        _event(
            grant, EventType.GRANT_ISSUED, actor, at, approved_by=approver.get_username(), **extra
        )
    return grant


def lock_agent(agent_id: int) -> None:
    """Hold the agent's row (before any of its grants): a suspension waits, or is seen."""
    Agent.objects.select_for_update(no_key=True).filter(pk=agent_id).values_list("pk").get()


def _approve_row(
    grant: Grant,
    approver: Any,
    at: datetime,
    actions: Sequence[str] | None,
    scope: str | None,
    duration: timedelta | None,
    reason: str = "",
    delegable: bool | None = None,
) -> dict[str, Any]:
    """Check and apply an approval to a locked pending request; returns what the
    grant.issued event adds (what was narrowed).

    Refused (Forbidden `self_approval`): the requester; anyone with a stake in the
    agent (approvals.stakeholders as of the request's creation: the owners up the
    agent tree and whoever held a live token for them then), whoever filed the
    request (the agent or a person), the person who opened the break-glass this
    request ratifies among them."""
    refuse_subagent_grant(grant.agent)  # a request filed before the rule
    if grant.requested_by_id is not None and grant.requested_by_id == approver.pk:
        raise Forbidden("self_approval", "Nobody approves their own request.")
    # Every request, not only the agent's own: an owner approving a request someone
    # else filed for their agent is still approving their own agent's access.
    if approver.pk in stakeholders(grant.agent, grant, at=grant.created_at):
        raise Forbidden(
            "self_approval",
            "An agent's owner (or the owner of an agent above it), anyone who held a "
            "token for it when the request was made, or whoever opened the break-glass "
            "it ratifies, cannot approve its grants.",
        )
    roles.require_may_approve(approver, "Grant requests")
    # The row as it is now (a caller's Agent instance may be older than a suspension).
    status = Agent.objects.filter(pk=grant.agent_id).values_list("status", flat=True).get()
    if status != Agent.Status.ACTIVE:
        raise Conflict(
            "agent_suspended", f"{grant.agent.name} is suspended: no grant is issued to it."
        )
    assert grant.requested_duration is not None
    narrowed = _narrowing(grant, actions, scope, duration, delegable=delegable)
    requested = {
        "actions": list(grant.actions),
        "scope": grant.scope,
        "duration_seconds": int(grant.requested_duration.total_seconds()),
        "delegable": grant.delegable,
    }
    grant.actions = narrowed.get("actions", grant.actions)
    grant.scope = narrowed.get("scope", grant.scope)
    grant.delegable = narrowed.get("delegable", grant.delegable)
    window = (
        timedelta(seconds=narrowed["duration_seconds"])
        if "duration_seconds" in narrowed
        else grant.requested_duration
    )
    if window > settings.GRANT_MAX_TTL:
        # The maximum in force now, not when the request was filed: it may have been
        # lowered since. Refused, never shortened behind the approver's back.
        hours = settings.GRANT_MAX_TTL.total_seconds() / 3600
        raise GovernanceError(
            "invalid_grant",
            f"The requested duration exceeds the maximum grant lifetime now in force "
            f"({hours:g} hours): approve it with a shorter duration, or deny it.",
            fields={"duration": f"at most {hours:g} hours"},
        )
    grant.status = Grant.Status.ACTIVE
    grant.approved_by = approver
    grant.decided_at = at
    grant.decision_reason = reason
    grant.starts_at = at
    grant.expires_at = at + window
    grant.save()
    extra: dict[str, Any] = {"narrowed": narrowed, "requested": requested} if narrowed else {}
    if reason:
        extra["reason"] = reason
    return extra


def _refused_by(grant: Grant, person: Any) -> Any:
    """Who is named as the decider of a refused request. Anyone may turn a request down,
    but only someone who could have approved it is named: the requester's, a
    stakeholder's (the agent's owner's) or a non-approver's refusal is a withdrawal,
    named by its event's actor only."""
    if person is None or person.pk == grant.requested_by_id or not roles.may_approve(person):
        return None
    if person.pk in stakeholders(grant.agent, grant, at=grant.created_at):
        return None
    return person


def grant_deny(
    *, grant_id: int, approver: Any, reason: str, actor: audit.Actor, at: datetime
) -> Grant:
    with transaction.atomic():
        grant = _lock_pending(grant_id, at)
        grant.status = Grant.Status.DENIED
        grant.approved_by = _refused_by(grant, approver)
        grant.decided_at = at
        grant.decision_reason = reason
        grant.save()
        _event(grant, EventType.GRANT_DENIED, actor, at, reason=reason)
    return grant


# Why a request an agent filed itself was closed when the agent was suspended (its
# token may have been in someone else's hands): agents.agent_suspend.
WITHDRAWN_REASON = "withdrawn: the agent that filed it was suspended"


def requests_withdraw(agent_id: int, at: datetime) -> list[int]:
    """Close the requests the agent filed itself and still pending, as denied
    (WITHDRAWN_REASON); their ids. Rows only: the caller, holding the agent's row,
    writes their events after its own rows (requests_withdrawn_events). Locked first,
    so a person's deny or the expiry job deciding one meanwhile leaves it out."""
    ids = list(
        Grant.objects.select_for_update(no_key=True)
        .filter(requested_by_agent_id=agent_id, status=Grant.Status.PENDING)
        .order_by("pk")
        .values_list("pk", flat=True)
    )
    Grant.objects.filter(pk__in=ids).update(
        status=Grant.Status.DENIED, decided_at=at, decision_reason=WITHDRAWN_REASON
    )
    return ids


def requests_withdrawn_events(ids: list[int], actor: audit.Actor, at: datetime) -> None:
    """One `grant.denied` event per request requests_withdraw closed."""
    for grant in Grant.objects.filter(pk__in=ids).select_related("agent", "tool", "task"):
        _event(grant, EventType.GRANT_DENIED, actor, at, reason=WITHDRAWN_REASON)


def grant_issue(
    *,
    agent: Agent,
    tool: Tool,
    actions: Sequence[str],
    scope: str,
    duration: timedelta,
    justification: str,
    requested_by: Any,
    approved_by: Any,
    actor: audit.Actor,
    at: datetime,
    task: Task | None = None,
    fields: Sequence[str] = (),
    egress: Sequence[str] = (),
    limits: dict[str, Any] | None = None,
    delegable: bool = False,
) -> Grant:
    """A live grant whose request and approval were decided elsewhere (matrix
    import with --apply-approved, demo data): literally request + approve in
    one transaction, so the same rules and the same two events apply."""
    if approved_by is None or requested_by is None or approved_by.pk == requested_by.pk:
        raise Forbidden("self_approval", "A live grant needs a requester and a different approver.")
    with transaction.atomic():
        lock_agent(agent.pk)
        grant = _request_row(
            agent=agent,
            tool=tool,
            actions=actions,
            scope=scope,
            duration=duration,
            justification=justification,
            requested_by=requested_by,
            requested_by_agent=None,
            task=task,
            fields=fields,
            egress=egress,
            limits=limits,
            delegable=delegable,
            at=at,
        )
        extra = _approve_row(grant, approved_by, at, None, None, None)
        _requested_event(grant, actor, at)
        _event(
            grant,
            EventType.GRANT_ISSUED,
            actor,
            at,
            approved_by=approved_by.get_username(),
            **extra,
        )
    return grant


def _descendants(grant_ids: list[int]) -> list[Grant]:
    found: list[Grant] = []
    frontier = grant_ids
    while frontier:
        children = list(
            Grant.objects.select_for_update(of=("self",), no_key=True)
            .select_related("agent", "tool", "task")
            .filter(delegated_from_id__in=frontier)
        )
        found.extend(children)
        frontier = [c.pk for c in children]
    return found


def grant_revoke(
    *,
    grant_id: int,
    reason: str,
    actor: audit.Actor,
    at: datetime,
    revoked_by: Any = None,
    effective_at: datetime | None = None,
) -> list[Grant]:
    """Revoke at once, and everything delegated from it, in one transaction.

    Safe to call twice: an already-ended grant is left as it is. A person revoking a
    delegated grant overrules its delegation (_overruled). `effective_at` (earlier
    than `at`): a job applying, late, a rule that authorize() applied from that moment
    on (a review's due date); the rows say when access ended, the events when the job
    recorded it.
    """
    with transaction.atomic():
        overruled = _overruled(grant_id, revoked_by, _ended_at(at, effective_at))
        ended = grants_revoke(
            grant_ids=[grant_id],
            reason=reason,
            actor=actor,
            at=at,
            revoked_by=revoked_by,
            effective_at=effective_at,
        )
        _withdraw_delegation(overruled, grant_id, actor, at)
    return ended


def _ended_at(at: datetime, effective_at: datetime | None) -> datetime:
    """When a revoke recorded at `at` takes effect (`effective_at`, if earlier)."""
    return at if effective_at is None else min(at, effective_at)


def _ancestor_ids(grant_id: int) -> list[int]:
    """The grant's delegation ancestors, nearest first (bounded, each once)."""
    chain: list[int] = []
    cursor = Grant.objects.filter(pk=grant_id).values_list("delegated_from_id", flat=True).get()
    while cursor is not None and cursor not in chain and len(chain) < 32:
        chain.append(cursor)
        cursor = Grant.objects.filter(pk=cursor).values_list("delegated_from_id", flat=True).get()
    return chain


def lock_chain(grant_id: int) -> Grant:
    """The grant, read under its lock, its delegation ancestors locked before it, root
    first: the order a revoke or narrowing takes (_overruled), so a caller that goes on
    to either waits for, and then sees, one committing meanwhile."""
    locking = Grant.objects.select_for_update(of=("self",), no_key=True)
    for pk in reversed(_ancestor_ids(grant_id)):  # root first
        locking.filter(pk=pk).values_list("pk").get()
    return locking.select_related("agent", "tool", "task").get(pk=grant_id)


def _overruled(grant_id: int, person: Any, at: datetime) -> list[Grant]:
    """A person ending or narrowing a live delegated grant overrules the delegation:
    no grant above it can be delegated any more. Its holder could otherwise hand the
    same back at once (or have it handed back from one level up), undoing a revoke or
    a review's narrowing; a person must grant it again. The ancestors' rows, locked
    here root first, before the child's (the order narrowing a parent takes) and
    changed; the ones that were delegable are returned for _withdraw_delegation. A grant
    that ran out before `at` is overruled by nothing: it had already ended."""
    if (
        person is None
        or not Grant.objects.filter(
            pk=grant_id, status=Grant.Status.ACTIVE, expires_at__gt=at
        ).exists()
    ):
        return []
    withdrawn = []
    for pk in reversed(_ancestor_ids(grant_id)):  # root first
        ancestor = (
            Grant.objects.select_for_update(of=("self",), no_key=True)
            .select_related("agent", "tool", "task")
            .get(pk=pk)
        )
        if ancestor.delegable:
            ancestor.delegable = False
            ancestor.save(update_fields=["delegable"])
            withdrawn.append(ancestor)
    return withdrawn


def _withdraw_delegation(
    withdrawn: list[Grant], child_id: int, actor: audit.Actor, at: datetime
) -> None:
    """The events of _overruled()'s changes, after every row the transaction changes."""
    for grant in withdrawn:
        _event(
            grant,
            EventType.GRANT_DELEGATION_WITHDRAWN,
            actor,
            at,
            reason=f"a person overruled delegation #{child_id}: nothing more is delegated "
            "from this grant",
            overruled=child_id,
        )


def grants_revoke(
    *,
    grant_ids: Sequence[int],
    reason: str,
    actor: audit.Actor,
    at: datetime,
    revoked_by: Any = None,
    effective_at: datetime | None = None,
) -> list[Grant]:
    """grant_revoke for several grants in one transaction (a task's, a narrowed grant's
    delegations): every row is locked and changed first and the events come last, so
    the chain lock is the last lock the transaction takes (tests/conftest.py)."""
    ended_at = _ended_at(at, effective_at)
    if not reason.strip():
        raise GovernanceError("reason_required", "Say why the grant is revoked.")
    with transaction.atomic():
        roots = list(
            Grant.objects.select_for_update(of=("self",), no_key=True)
            .select_related("agent", "tool", "task")
            .filter(pk__in=grant_ids)
            .order_by("pk")
        )
        if len(roots) != len(set(grant_ids)):
            raise Grant.DoesNotExist("No such grant.")
        ended: list[tuple[Grant, int]] = []  # with the root it was revoked through
        seen: set[int] = set()
        for root in roots:
            for grant in [root, *_descendants([root.pk])]:
                if grant.pk in seen or grant.status not in (
                    Grant.Status.ACTIVE,
                    Grant.Status.PENDING,
                ):
                    continue
                if grant.status == Grant.Status.ACTIVE and grant.expires_at <= ended_at:
                    # It ran out before this revoke took effect: it expired, and the
                    # expiry job records it so (grant.expired), not as revoked.
                    continue
                seen.add(grant.pk)
                grant.status = Grant.Status.REVOKED if grant.starts_at else Grant.Status.DENIED
                grant.revoked_at = max(ended_at, grant.starts_at) if grant.starts_at else None
                grant.revoked_by = revoked_by
                grant.decision_reason = reason
                if not grant.starts_at:
                    # A request refused this way is decided as grant_deny decides one:
                    # when, and by whom (never its requester or owner as "approver").
                    grant.decided_at = at
                    grant.approved_by = _refused_by(grant, revoked_by)
                grant.save()
                ended.append((grant, root.pk))
        # Nothing asked or approved under an ended grant may fire later, even if the
        # same call comes back under a new grant (with other people to approve it).
        open_ones = Approval.objects.select_for_update().filter(
            grant__in=[g for g, _ in ended],
            status__in=[Approval.Status.PENDING, Approval.Status.APPROVED],
        )
        voided = Counter(open_ones.values_list("grant_id", flat=True))
        open_ones.update(status=Approval.Status.EXPIRED)
        for grant, root_pk in ended:
            data: dict[str, Any] = {"cascade_from": root_pk} if grant.pk != root_pk else {}
            if grant.revoked_at is not None and grant.revoked_at != at:
                data["effective_at"] = grant.revoked_at.isoformat()
            if voided.get(grant.pk):
                data["approvals_voided"] = voided[grant.pk]
            # A request that never started is refused, not revoked: the event says what
            # the row now says.
            kind = EventType.GRANT_REVOKED if grant.starts_at else EventType.GRANT_DENIED
            _event(grant, kind, actor, at, reason=reason, **data)
    return [g for g, _ in ended]


def grant_delegate(
    *,
    parent_grant_id: int,
    child: Agent,
    actions: Sequence[str],
    scope: str,
    expires_at: datetime,
    justification: str,
    actor: audit.Actor,
    at: datetime,
    fields: Sequence[str] | None = None,
    egress: Sequence[str] | None = None,
    limits: dict[str, Any] | None = None,
    delegable: bool = False,
) -> Grant:
    """Hand a subagent a subset of a live grant. Never wider, never longer.

    `fields`, `egress`, `limits`: narrower than the parent's (None: the parent's own).
    `delegable`: the subagent may hand it down again, within DELEGATION_MAX_DEPTH.
    Asking again for the same delegation (parent, subagent, actions, scope, expiry,
    envelope) while it is active returns the grant made the first time, with no new
    event. A refusal (Forbidden, Conflict) is on record: grant.delegation_refused,
    written once the refused transaction is undone. Under the parent's bearer token
    revoked since the request was let in (actor.token_id), the delegation, or the
    refusal, is the 401 of the door with nothing written (audit.append refuses its
    event), so no delegation is recorded after its revoke."""
    try:
        with transaction.atomic():
            # The subagent as it is now, held: a suspension committing meanwhile is seen.
            # Agent before grant, the order break-glass takes (its campaign folds usage).
            child = Agent.objects.select_for_update(no_key=True).get(pk=child.pk)
            parent = (
                Grant.objects.select_for_update(of=("self",), no_key=True)
                .select_related("agent", "tool", "task")
                .get(pk=parent_grant_id)
            )
            if child.parent_id != parent.agent_id:
                raise Forbidden(
                    "not_a_subagent", f"{child.name} is not a subagent of {parent.agent}."
                )
            if child.status != Agent.Status.ACTIVE:
                raise Conflict(
                    "agent_suspended", f"{child.name} is suspended: nothing is handed down."
                )
            if not parent.delegable:
                raise Forbidden("not_delegable", "The parent grant does not allow delegation.")
            depth = 0
            cursor: Grant | None = parent
            while cursor is not None and cursor.delegated_from_id is not None:
                depth += 1
                cursor = cursor.delegated_from
            if depth + 1 > settings.DELEGATION_MAX_DEPTH:
                raise Forbidden("depth_exceeded", "The delegation chain is already at its limit.")
            if delegable and depth + 2 > settings.DELEGATION_MAX_DEPTH:
                raise Forbidden(
                    "depth_exceeded",
                    "This delegation is at the chain's limit: it cannot be handed down again.",
                )
            # Live per the decision module: own window, every ancestor, agent, tool.
            dead = grant_dead_reason(parent.pk, at)
            if dead is not None:
                raise Forbidden("parent_not_live", f"The parent grant is not live ({dead}).")
            if not set(actions) <= set(parent.actions) or not actions:
                raise Forbidden(
                    "wider_actions", "A delegation can only carry the parent's actions."
                )
            if not pattern_within(scope, parent.scope):
                raise Forbidden("wider_scope", "The scope must lie inside the parent's scope.")
            assert parent.expires_at is not None
            if expires_at > parent.expires_at:
                raise Forbidden("longer_expiry", "A delegation cannot outlive its parent grant.")
            if expires_at <= at:
                raise GovernanceError("invalid_expiry", "The expiry must be in the future.")
            fields, egress, ceiling = _narrowed_envelope(parent, fields, egress, limits)
            validate_shape(
                tool=parent.tool,
                actions=actions,
                scope=scope,
                fields=fields,
                egress=egress,
                justification=justification,
            )
            # The parent's row lock serialises delegations from it: no twin can slip in.
            for twin in Grant.objects.filter(
                delegated_from=parent,
                agent=child,
                status=Grant.Status.ACTIVE,
                revoked_at__isnull=True,
                scope=scope,
                expires_at=expires_at,
                delegable=delegable,
            ):
                if (set(twin.actions), set(twin.fields), set(twin.egress), twin.limits()) == (
                    set(actions),
                    set(fields),
                    set(egress),
                    ceiling,
                ):
                    return twin
            grant = Grant.objects.create(
                created_at=at,
                agent=child,
                tool=parent.tool,
                task=parent.task,
                actions=list(actions),
                scope=scope,
                fields=fields,
                egress=egress,
                **{f"limit_{name}": value for name, value in ceiling.items()},
                delegable=delegable,
                justification=justification,
                requested_by_agent=parent.agent,
                status=Grant.Status.ACTIVE,
                decided_at=at,
                starts_at=at,
                expires_at=expires_at,
                delegated_from=parent,
                break_glass=parent.break_glass,
            )
            _event(
                grant,
                EventType.GRANT_DELEGATED,
                actor,
                at,
                delegated_from=parent.pk,
                depth=depth + 1,
                justification=justification,
                **envelope_data(grant),
            )
        return grant
    except (Forbidden, Conflict) as refused:
        with transaction.atomic():
            parent = Grant.objects.select_related("agent", "tool", "task").get(pk=parent_grant_id)
            audit.append(
                event_type=EventType.GRANT_DELEGATION_REFUSED,
                actor=actor,
                at=at,
                agent=parent.agent.name,
                task=parent.task.key if parent.task else "",
                tool=parent.tool.name,
                # What was asked for, as grant_event fills the column for a grant (the
                # whole list stays in data.actions; the column holds 64 characters).
                action=",".join(actions)[:64],
                scope=scope,
                decision=Decision.DENY,
                reason=refused.code,
                grant_id=parent.pk,
                break_glass=parent.break_glass,
                data={
                    "subagent": child.name,
                    "actions": list(actions),
                    "expires_at": expires_at.isoformat(),
                    "delegable": delegable,
                    "message": refused.message,
                },
            )
        raise


def _requested_event(grant: Grant, actor: audit.Actor, at: datetime) -> None:
    """grant.requested: what was asked for (how long included), why, and its whole
    envelope. A request: pending, with no window yet, also when grant_issue() has
    already approved the row (its grant.issued event follows)."""
    duration = grant.requested_duration
    _event(
        grant,
        EventType.GRANT_REQUESTED,
        actor,
        at,
        status=Grant.Status.PENDING,
        starts_at=None,
        expires_at=None,
        duration_seconds=int(duration.total_seconds()) if duration is not None else None,
        justification=grant.justification,
        **envelope_data(grant),
    )


def envelope_data(grant: Grant) -> dict[str, Any]:
    """What a grant allows besides its actions and scope, as its events record it."""
    return {
        "fields": list(grant.fields),
        "egress": list(grant.egress),
        "limits": grant.limits(),
        "delegable": grant.delegable,
    }


def _destination(entry: str) -> Any:
    try:
        return parse_destination(entry)
    except (ValueError, TypeError):
        return None  # validate_shape words the error


def _narrowed_envelope(
    parent: Grant,
    fields: Sequence[str] | None,
    egress: Sequence[str] | None,
    limits: dict[str, Any] | None,
) -> tuple[list[str], list[str], dict[str, Any]]:
    """A delegation's fields, egress and limits: the parent's, or narrower ones asked
    for. Never wider: a field list inside the parent's (a parent with none covers any
    list, and an empty one is no limit), egress from the parent's list, and each limit
    at most the parent's (the runner's floor where the parent sets none)."""
    if fields is None:
        fields = list(parent.fields)
    elif parent.fields and not (fields and set(fields) <= set(parent.fields)):
        raise Forbidden("wider_fields", "A delegation can only carry the parent's fields.")
    if egress is None:
        egress = list(parent.egress)
    else:
        # Compared as the runner's proxy reads them; kept in the parent's spelling.
        # (An entry that does not parse is left for validate_shape to refuse, a 400.)
        allowed = {_destination(entry): entry for entry in parent.egress}
        wanted = [(e, _destination(e)) for e in egress]
        if extra := sorted(e for e, d in wanted if d is not None and d not in allowed):
            raise Forbidden(
                "wider_egress", f"Egress to {', '.join(extra)} is not in the parent grant."
            )
        egress = list(dict.fromkeys(e if d is None else allowed[d] for e, d in wanted))
    ceiling = parent.limits()
    for name, value in _limits(limits).items():
        name = name.removeprefix("limit_")
        cap = ceiling.get(name, getattr(DEFAULT_LIMITS, name))
        if value > cap:
            raise Forbidden(
                "wider_limits", f"The {name} limit {value} is above the parent grant's {cap}."
            )
        ceiling[name] = value
    return list(fields), list(egress), ceiling


def grants_expire(*, actor: audit.Actor, at: datetime) -> int:
    """Bookkeeping: mark grants past their window as expired, one event each.

    Claims each row with a conditional UPDATE so two workers never both
    announce the same expiry.
    """
    due = Grant.objects.filter(status=Grant.Status.ACTIVE, expires_at__lte=at).values_list(
        "pk", flat=True
    )
    return claim_each(
        due,
        claim=lambda pk: Grant.objects.filter(pk=pk, status=Grant.Status.ACTIVE).update(
            status=Grant.Status.EXPIRED
        ),
        announce=lambda pk: _event(_with_names(pk), EventType.GRANT_EXPIRED, actor, at),
    )


def _with_names(pk: int) -> Grant:
    return Grant.objects.select_related("agent", "tool", "task").get(pk=pk)


REQUEST_EXPIRED_REASON = "request expired undecided"


def grant_requests_expire(*, actor: audit.Actor, at: datetime) -> int:
    """Close requests nobody decided within GRANT_REQUEST_TTL, one event each.

    They become `denied` (not `expired`): the database reserves `expired` for
    grants that had a window (grant_live_states_have_window), and a request
    never had one. Each row is claimed with a conditional UPDATE on
    status='pending', so an approve, a deny or a second worker racing this
    job decides the request exactly once.
    """
    cutoff = at - settings.GRANT_REQUEST_TTL
    due = Grant.objects.filter(status=Grant.Status.PENDING, created_at__lte=cutoff).values_list(
        "pk", flat=True
    )
    return claim_each(
        due,
        claim=lambda pk: Grant.objects.filter(
            pk=pk, status=Grant.Status.PENDING, created_at__lte=cutoff
        ).update(
            status=Grant.Status.DENIED,
            # When it stopped being decidable, however late the job runs.
            decided_at=F("created_at") + settings.GRANT_REQUEST_TTL,
            decision_reason=REQUEST_EXPIRED_REASON,
        ),
        announce=lambda pk: _announce_request_expired(_with_names(pk), actor, at),
    )


def _announce_request_expired(grant: Grant, actor: audit.Actor, at: datetime) -> None:
    _event(
        grant,
        EventType.GRANT_REQUEST_EXPIRED,
        actor,
        at,
        reason=REQUEST_EXPIRED_REASON,
        created_at=grant.created_at.isoformat(),
        effective_at=(grant.created_at + settings.GRANT_REQUEST_TTL).isoformat(),
    )


def grant_narrow(
    *,
    grant_id: int,
    reason: str,
    actor: audit.Actor,
    at: datetime,
    actions: Sequence[str] | None = None,
    scope: str | None = None,
    expires_at: datetime | None = None,
    delegable: bool | None = None,
    narrowed_by: Any = None,
) -> Grant:
    """Shrink a live grant in place, at once: fewer actions, a scope inside the old one
    (policy.pattern_within), an earlier expiry, `delegable` False (its agent may no
    longer hand it to subagents). Never wider: anything else is refused, a grant made
    delegable (403 `wider_delegation`) included.

    Delegations that no longer fit inside the narrowed grant are revoked in the same
    transaction, so a delegated grant never exceeds its parent; when delegation is
    switched off, every live delegation from it is revoked (with what hangs below):
    what the agent handed down is what the person just said it may not hand down. The
    `grant.narrowed` event records before and after. Narrowing to what it already is
    changes nothing.
    """
    if not reason.strip():
        raise GovernanceError("reason_required", "Say why the grant is narrowed.")
    with transaction.atomic():
        overruled = _overruled(grant_id, narrowed_by, at)  # undone with the rest if refused
        grant = (
            Grant.objects.select_for_update(of=("self",), no_key=True)
            .select_related("agent", "tool", "task")
            .get(pk=grant_id)
        )
        if grant.status != Grant.Status.ACTIVE or grant_dead_reason(grant.pk, at) is not None:
            raise Conflict("grant_not_live", "Only a live grant can be narrowed.")
        assert grant.expires_at is not None
        new_actions = list(actions) if actions is not None else list(grant.actions)
        new_scope = scope if scope is not None else grant.scope
        new_expiry = expires_at if expires_at is not None else grant.expires_at
        if not new_actions or not set(new_actions) <= set(grant.actions):
            raise Forbidden("wider_actions", "Narrowing keeps a non-empty subset of the actions.")
        if len(set(new_actions)) != len(new_actions):
            raise GovernanceError("invalid_grant", "Actions must not repeat.")
        if new_scope != grant.scope and not pattern_within(new_scope, grant.scope):
            raise Forbidden("wider_scope", "The new scope must lie inside the current one.")
        if new_expiry > grant.expires_at:
            raise Forbidden("longer_expiry", "Narrowing cannot extend a grant.")
        if delegable and not grant.delegable:
            raise Forbidden(
                "wider_delegation",
                "Narrowing cannot make a grant delegable: that is a new grant for a person "
                "to approve.",
            )
        new_delegable = grant.delegable if delegable is None else delegable
        if new_expiry <= at:
            raise GovernanceError(
                "invalid_expiry", "The new expiry must be in the future (revoke instead)."
            )
        before = {"actions": list(grant.actions), "scope": grant.scope}
        before["expires_at"] = grant.expires_at.isoformat()
        before["delegable"] = grant.delegable
        new_actions = [a for a in grant.actions if a in new_actions]  # the grant's order
        if (new_actions, new_scope, new_expiry, new_delegable) == (
            grant.actions,
            grant.scope,
            grant.expires_at,
            grant.delegable,
        ):
            transaction.set_rollback(True)  # nothing changed: nothing is overruled either
            return grant
        # Only a switch made now ends the delegations: a grant whose delegation was
        # withdrawn earlier (_overruled) keeps the ones that still fit, as then.
        delegation_ended = grant.delegable and not new_delegable
        grant.actions = new_actions
        grant.scope = new_scope
        grant.expires_at = new_expiry
        grant.delegable = new_delegable
        grant.save(update_fields=["actions", "scope", "expires_at", "delegable"])
        # A call asked (or approved) under the grant that it no longer covers can never
        # be allowed under it: voided, as a revoke voids them, not left for a person to
        # approve in vain.
        uncovered = [
            approval.pk
            for approval in Approval.objects.select_for_update().filter(
                grant=grant, status__in=[Approval.Status.PENDING, Approval.Status.APPROVED]
            )
            if approval.action not in new_actions or not scope_matches(new_scope, approval.scope)
        ]
        Approval.objects.filter(pk__in=uncovered).update(status=Approval.Status.EXPIRED)
        voided = {"approvals_voided": len(uncovered)} if uncovered else {}
        # Delegations that no longer fit are revoked (with what hangs below them); the
        # narrowed event comes last, after every row this transaction changes.
        misfits: list[int] = []
        frontier = [grant]
        if delegation_ended:
            misfits = [child.pk for child in _descendants_of(grant.pk)]
            frontier = []
        while frontier:
            parent = frontier.pop()
            for child in _descendants_of(parent.pk):
                fits = (
                    set(child.actions) <= set(parent.actions)
                    and pattern_within(child.scope, parent.scope)
                    and child.expires_at is not None
                    and parent.expires_at is not None
                    and child.expires_at <= parent.expires_at
                )
                if fits:
                    frontier.append(child)
                else:
                    misfits.append(child.pk)
        if misfits:
            grants_revoke(
                grant_ids=misfits,
                reason=f"parent grant #{grant.pk} narrowed"
                + (": it may no longer be delegated" if delegation_ended else ""),
                actor=actor,
                at=at,
                revoked_by=narrowed_by,
            )
        _event(
            grant,
            EventType.GRANT_NARROWED,
            actor,
            at,
            reason=reason,
            before=before,
            delegable=grant.delegable,
            **voided,
        )
        _withdraw_delegation(overruled, grant.pk, actor, at)
    return grant


def _descendants_of(grant_id: int) -> list[Grant]:
    return list(
        Grant.objects.select_for_update(of=("self",), no_key=True).filter(
            delegated_from_id=grant_id, status=Grant.Status.ACTIVE
        )
    )
