"""Read queries for the web UI's pages (the shared ones are in governance.selectors)."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable
from datetime import date, datetime, time, timedelta
from typing import Any

from django.core.paginator import Page, Paginator
from django.db.models import Count, Q, QuerySet
from django.db.models.functions import TruncDate

from governance import audit, roles, selectors
from governance.codes import ActionClass, EventType
from governance.models import (
    Agent,
    Approval,
    AuditEvent,
    ConfirmationPolicy,
    Grant,
    SandboxRun,
    Tool,
)
from governance.services.approvals import Call, staked
from governance.services.outcomes import DECISION_EVENTS

ACTIONS = list(ActionClass.values)


def pending_requests_for(user: Any, limit: int) -> list[Grant]:
    """Requests this person may decide, oldest first: not their own, and none they
    have a stake in as of the request's creation (owners up the agent tree, token
    creators, the people up a delegation chain): the rule grant_approve enforces.
    The queryset leaves out the plain cases in SQL; `staked` decides the rest for
    all of them at once, and only the page is read whole."""
    rows = list(
        Grant.objects.filter(status=Grant.Status.PENDING)
        .exclude(requested_by=user)
        .exclude(Q(requested_by_agent__isnull=False) & Q(agent__owner=user))
        .order_by("created_at", "pk")
        .values_list(
            "pk",
            "agent_id",
            "agent__parent_id",
            "agent__owner_id",
            "delegated_from_id",
            "requested_by_id",
            "created_at",
        )
    )
    agents = {row[1]: (row[2], row[3]) for row in rows}
    grants = {row[0]: (row[4], row[5], row[1]) for row in rows}
    calls = [Call(row[0], row[1], row[0], row[6]) for row in rows]
    stake = staked(user.pk, calls, agents, grants)
    page = [c.key for c in calls if c.key not in stake][:limit]
    found = Grant.objects.select_related(
        "agent__owner", "tool", "task", "requested_by", "requested_by_agent"
    ).in_bulk(page)
    return [found[pk] for pk in page]


def pending_approvals_for(user: Any, at: datetime, limit: int) -> list[Approval]:
    """Open destructive-action approvals this person may decide, soonest to expire
    first: none they have a stake in as of the call (the rule approval_decide enforces),
    decided for all of them at once as for requests."""
    rows = list(
        Approval.objects.filter(status=Approval.Status.PENDING, expires_at__gt=at)
        .exclude(agent__owner=user)
        .exclude(grant__requested_by=user)
        .order_by("expires_at", "pk")
        .values_list(
            "pk",
            "agent_id",
            "agent__parent_id",
            "agent__owner_id",
            "grant_id",
            "grant__delegated_from_id",
            "grant__requested_by_id",
            "grant__agent_id",
            "requested_at",
        )
    )
    agents = {row[1]: (row[2], row[3]) for row in rows}
    grants = {row[4]: (row[5], row[6], row[7]) for row in rows if row[4] is not None}
    calls = [Call(row[0], row[1], row[4], row[8]) for row in rows]
    stake = staked(user.pk, calls, agents, grants)
    page = [c.key for c in calls if c.key not in stake][:limit]
    found = Approval.objects.select_related("agent", "tool", "task", "grant").in_bulk(page)
    return [found[pk] for pk in page]


def expiring_soon(at: datetime, within: timedelta = timedelta(hours=24)) -> QuerySet[Grant]:
    return selectors.live_grants(at).filter(expires_at__lte=at + within).order_by("expires_at")


def _days(at: datetime, days: int) -> list[date]:
    today = at.date()
    return [today - timedelta(days=days - 1 - i) for i in range(days)]


def live_grants_per_day(
    at: datetime, days: int = 14, top: int = 4
) -> tuple[list[str], list[tuple[str, list[int]]]]:
    """Grants live at the end of each day (the last day: now), total and for the
    agents with the most. Computed from the grants' own windows."""
    day_list = _days(at, days)
    moments = [
        min(at, datetime.combine(d, time.max, tzinfo=at.tzinfo)) for d in day_list
    ]  # end of each day, and now for today
    start = moments[0] - timedelta(days=1)
    windows = (
        Grant.objects.exclude(status__in=[Grant.Status.PENDING, Grant.Status.DENIED])
        .filter(starts_at__lte=at, expires_at__gt=start)
        .values_list("agent__name", "starts_at", "expires_at", "revoked_at")
    )
    total = [0] * days
    per_agent: dict[str, list[int]] = defaultdict(lambda: [0] * days)
    for name, starts, expires, revoked in windows:
        for i, moment in enumerate(moments):
            if starts <= moment < expires and (revoked is None or revoked > moment):
                total[i] += 1
                per_agent[name][i] += 1
    # Days the daily job recorded (LiveGrantSnapshot) are shown as recorded; the
    # others (before the job ran, and today) are computed from the grants' windows.
    from governance.models import LiveGrantSnapshot

    index = {d: i for i, d in enumerate(day_list)}
    for snap in LiveGrantSnapshot.objects.filter(day__in=day_list[:-1]):
        i = index[snap.day]
        total[i] = snap.total
        for name in set(per_agent) | set(snap.per_agent):
            per_agent[name][i] = int(snap.per_agent.get(name, 0))
    busiest = sorted(per_agent, key=lambda n: (-sum(per_agent[n]), n))[:top]
    labels = [d.strftime("%m-%d") for d in day_list]
    return labels, [("total", total), *[(name, per_agent[name]) for name in busiest]]


def decisions_per_day(at: datetime, days: int = 14) -> tuple[list[str], dict[str, list[int]]]:
    """Allow / approval required / deny decisions per day, from the audit log."""
    day_list = _days(at, days)
    since = datetime.combine(day_list[0], time.min, tzinfo=at.tzinfo)
    counted = (
        AuditEvent.objects.filter(event_type__in=DECISION_EVENTS, created_at__gte=since)
        .annotate(day=TruncDate("created_at"))
        .values("day", "decision")
        .annotate(n=Count("seq"))
    )
    index = {d: i for i, d in enumerate(day_list)}
    out: dict[str, list[int]] = {v: [0] * days for v in ("allow", "approval_required", "deny")}
    for row in counted:
        i = index.get(row["day"])
        if i is not None and row["decision"] in out:
            out[row["decision"]][i] += row["n"]
    return [d.strftime("%m-%d") for d in day_list], out


MATRIX_PAGE = 100  # agents per page: 100 rows x 50 tools is a page a browser draws at once


def matrix(
    at: datetime,
    *,
    task: str = "",
    owner: str = "",
    kind: str = "",
    agent: str = "",
    page: int | None = None,
    size: int = MATRIX_PAGE,
) -> tuple[Page[Agent], list[Tool], dict[tuple[int, int], list[dict[str, Any]]]]:
    """Agents x tools, a page of agents at a time (by name); each cell the live action
    classes, destructive ones marked. Only the grants of the page's agents are read: the
    whole matrix (100,000 live grants over 1,000 agents x 50 tools) was one page of
    8.8 MB that took 15-32 s. `agent` keeps the agents whose name contains it."""
    grants = selectors.live_grants(at)
    agents = Agent.objects.select_related("owner").order_by("name", "pk")
    tools = Tool.objects.order_by("name")
    if task:
        grants = grants.filter(task__key=task)
    if owner:
        agents = agents.filter(owner__username=owner)
    if agent:
        agents = agents.filter(name__icontains=agent)
    if kind:
        grants = grants.filter(tool__kind=kind)
        tools = tools.filter(kind=kind)
    if task:
        # The rows and columns the task has live grants in, over every page (so the
        # columns stay the same from one page to the next).
        agents = agents.filter(pk__in=grants.values("agent_id"))
        tools = tools.filter(pk__in=grants.values("tool_id"))
    shown = Paginator(agents, size).get_page(page)
    shown.object_list = list(shown.object_list)
    found: dict[tuple[int, int], set[str]] = defaultdict(set)
    on_page = grants.filter(agent_id__in=[a.pk for a in shown.object_list])
    for agent_id, tool_id, actions in on_page.values_list("agent_id", "tool_id", "actions"):
        found[(agent_id, tool_id)].update(actions)
    tool_list = list(tools)
    tool_map = {t.pk: t for t in tool_list}
    cells = {
        key: [
            {"action": a, "destructive": tool_map[key[1]].is_destructive(a)}
            for a in ACTIONS
            if a in actions
        ]
        for key, actions in found.items()
        if key[1] in tool_map
    }
    return shown, tool_list, cells


def delegation_chains(grants: Iterable[Grant]) -> dict[int, list[Grant]]:
    """Each grant and every grant it was delegated from, nearest first, by the grant's
    id: one query per level of delegation for all of them (a page listing a subagent's
    delegated grants read each chain a link at a time, a query per link per grant)."""
    grants = list(grants)
    known = {g.pk: g for g in grants}
    wanted = {g.delegated_from_id for g in grants} - set(known) - {None}
    for _ in range(32):  # bounded, as the decision's ancestor walk is
        if not wanted:
            break
        found = Grant.objects.select_related("agent", "approved_by").in_bulk(wanted)
        known.update(found)
        wanted = {g.delegated_from_id for g in found.values()} - set(known) - {None}
    chains: dict[int, list[Grant]] = {}
    for grant in grants:
        chain: list[Grant] = []
        cursor: Grant | None = grant
        while cursor is not None and cursor not in chain and len(chain) < 32:
            chain.append(cursor)
            cursor = known.get(cursor.delegated_from_id) if cursor.delegated_from_id else None
        chains[grant.pk] = chain
    return chains


def delegation_chain(grant: Grant) -> list[Grant]:
    """The grant and every grant it was delegated from, nearest first."""
    return delegation_chains([grant])[grant.pk]


def subagent_tree(agent: Agent) -> list[tuple[int, Agent]]:
    """Depth-first (depth, agent) under `agent`."""
    out: list[tuple[int, Agent]] = []
    children: dict[int | None, list[Agent]] = defaultdict(list)
    for a in Agent.objects.order_by("name"):
        children[a.parent_id].append(a)

    def walk(node: Agent, depth: int) -> None:
        for child in children.get(node.pk, []):
            if len(out) < 500:
                out.append((depth, child))
                walk(child, depth + 1)

    walk(agent, 1)
    return out


def ancestors(agent: Agent) -> list[Agent]:
    out, cursor = [], agent.parent
    while cursor is not None and len(out) < 32:
        out.append(cursor)
        cursor = cursor.parent
    return list(reversed(out))


# The most events a page walks itself: those after the newest checkpoint, a minute's
# worth while the checkpoint job runs (about 0.7 s at this many). More, and the page
# says they are unchecked rather than take longer.
TAIL_LIMIT = 10_000


def chain_status(now: datetime) -> dict[str, Any]:
    """The audit chain's state for a page, in bounded work: never a walk from genesis.

    One cost 33 s at 500,000 events, made by each web process every 10 minutes (past
    gunicorn's worker timeout), and on every view while the chain was not OK. Now a
    page shows what the last full walk found (audit.last_full_verify: the nightly job,
    `manage.py audit_verify`, the button, the checkpoint job over damage) and any
    `audit.verify_failed` recorded since, and checks itself only the events after the
    newest checkpoint (audit.verify_tail, at most TAIL_LIMIT): a deleted or edited
    newest event shows at once; an edited older one at the next full walk, and the
    page says when the last one was and what it found.

    `state`: "ok" (the last full walk passed, or this view's check covered the whole
    log, and nothing since says otherwise), "failed" (damage is known: `findings`),
    or "unknown" (no full walk on record, or too many events since the newest
    checkpoint to check here: `pending` says which).
    """
    walked = audit.last_full_verify()
    checkpoint = audit.latest_checkpoint()
    since, tail = audit.verify_tail(checkpoint, now, TAIL_LIMIT)
    failure = audit.recorded_failure()
    findings: list[dict[str, Any]] = []

    def finding(bad_seq: int | None, problem: str, source: str) -> None:
        if not any((f["bad_seq"], f["problem"]) == (bad_seq, problem) for f in findings):
            findings.append({"bad_seq": bad_seq, "problem": problem, "source": source})

    if tail is not None and not tail.ok:
        finding(tail.bad_seq, tail.problem, "this view's check")
    if walked is not None and "unreadable" in walked:
        unreadable = f"the record of the last full walk is unreadable ({walked['unreadable']})"
        finding(None, unreadable, "the record of the last full walk")
        walked = None
    elif walked is not None and not walked["ok"]:
        finding(walked["bad_seq"], walked["problem"], "the last full walk")
    elif walked is not None and not audit.holds(walked["count"], walked["head"]):
        gone = "the log no longer holds the head the last full walk verified there: events "
        finding(walked["count"], gone + "were deleted or rewritten since", "this view's check")
    # A failure recorded after the last full walk (the checkpoint job refused; or the
    # record of a later pass is gone): damage is known until a full walk passes again.
    if failure is not None and (walked is None or failure["seq"] > walked["count"]):
        source = f"audit.verify_failed #{failure['seq']}"
        finding(failure.get("bad_seq"), str(failure.get("problem") or ""), source)
    pending = ""
    if tail is None:
        pending = (
            f"more than {TAIL_LIMIT:,} events since the newest checkpoint (seq {since}): "
            "too many to check on a page; is the checkpoint job running?"
        )
    elif walked is None and since:
        pending = (
            "no full walk from genesis is on record yet (the nightly job, manage.py "
            "audit_verify or the button below make one)"
        )
    state = "failed" if findings else "unknown" if pending else "ok"
    first = findings[0] if findings else {"bad_seq": None, "problem": pending}
    return {
        "ok": state == "ok",
        "state": state,
        "count": tail.count if tail is not None else audit.head_seq(),
        "head_hash": tail.head if tail is not None else "",
        "bad_seq": first["bad_seq"],
        "problem": first["problem"],
        "findings": findings,
        "pending": pending,
        "at": now,
        "full_walk": walked,
        "full_walk_at": walked["time"] if walked else None,
        "tail_from": since,
        "checkpoint": checkpoint,
    }


def event_counts_by_type(qs: QuerySet[AuditEvent]) -> Counter[str]:
    return Counter(dict(qs.values_list("event_type").annotate(n=Count("seq"))))


def live_confirmation_policies(at: datetime) -> list[ConfirmationPolicy]:
    """Policies in their window now (for people to see; decisions ask authorize()).
    `silenced` marks an approve policy whose author has since come to hold a stake in
    the agent or its calls' grants, or may no longer approve (deactivated, role gone),
    or that was written against another definition of the tool than the approved one:
    authorize() no longer lets it answer."""
    from governance.services.confirmation import policy_stakeholders

    found = list(
        selectors.live_policies(at)
        .select_related("agent", "tool", "task", "created_by")
        .order_by("expires_at", "id")[:200]
    )
    for policy in found:
        policy.silenced = policy.verdict == "approve" and (  # type: ignore[attr-defined]
            not roles.may_approve(policy.created_by)
            or not policy.for_current_definition()
            or policy.created_by_id
            in policy_stakeholders(policy.agent, policy.tool, policy.action, at=policy.created_at)
        )
    return found


# --- Sandbox runs ----------------------------------------------------------------------


def runs_page(
    *, agent: str, status: str, before: int | None, size: int
) -> tuple[list[SandboxRun], int | None]:
    """Newest first; (the page, the id to page on from, or None at the end)."""
    qs = SandboxRun.objects.all()
    if agent:
        qs = qs.filter(agent=agent)
    if status:
        qs = qs.filter(status=status)
    if before:
        qs = qs.filter(pk__lt=before)
    page = list(qs.order_by("-pk")[: size + 1])
    return page[:size], (page[size - 1].pk if len(page) > size else None)


def run_events(run: SandboxRun) -> list[AuditEvent]:
    """The run's own events (requested, started, each egress attempt, finished, reaped):
    the agent's sandbox events since the request that name the run."""
    return list(
        AuditEvent.objects.filter(
            agent=run.agent,
            event_type__startswith="sandbox.",
            created_at__gte=run.requested_at,
            data__contains=f'"run_id":"{run.run_id}"',
        ).order_by("seq")[:2000]
    )


def egress_attempts(events: list[AuditEvent]) -> list[dict[str, Any]]:
    """Each egress attempt among a run's events, with what the proxy decided."""
    egress = (EventType.SANDBOX_EGRESS_ALLOWED, EventType.SANDBOX_EGRESS_DENIED)
    attempts = []
    for e in events:
        if e.event_type in egress:
            data = json.loads(e.data)
            attempts.append(
                {
                    "event": e,
                    "allowed": e.event_type == EventType.SANDBOX_EGRESS_ALLOWED,
                    # The proxy records no address for a destination it refused
                    # before resolving it (not allowlisted, unresolvable): null.
                    "destination": data.get("destination") or "",
                    "address": data.get("address") or "",
                    "reason": data.get("egress_reason") or "",
                }
            )
    return attempts
