"""Read queries shared by the UI, the API, reports and commands."""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import (
    BooleanField,
    Case,
    Exists,
    F,
    Func,
    OuterRef,
    Q,
    QuerySet,
    Subquery,
    Value,
    When,
)
from django.utils import timezone

from governance import roles
from governance.codes import ActionClass, EventType
from governance.models import (
    Agent,
    AgentToken,
    Approval,
    AuditEvent,
    ConfirmationPolicy,
    Grant,
    GrantActionUse,
    ReviewItem,
    Tool,
)
from governance.models.reviews import undecided_at_due_q
from governance.models.tasks import open_at_q


def live_grants(at: datetime, then: dict[int, AccountThen] | None = None) -> QuerySet[Grant]:
    """Grants whose own window is open at `at` (ancestors are checked by authorize()).
    A subagent's grant counts only as a delegation, a break-glass grant only while its
    opener's account is active (authorize() says the same): active at `at`, so a past
    moment's report keeps one whose opener was deactivated only later. `then`:
    accounts_at(at), when the caller has read it already."""
    if then is None:
        then = accounts_at(at)
    active_then = [pk for pk, a in then.items() if a.active is True]
    inactive_then = [pk for pk, a in then.items() if a.active is False]
    opener_inactive = (
        Q(requested_by__isnull=True)
        | (Q(requested_by__is_active=False) & ~Q(requested_by_id__in=active_then))
        | Q(requested_by_id__in=inactive_then)
    )
    return (
        Grant.objects.exclude(status__in=[Grant.Status.PENDING, Grant.Status.DENIED])
        .filter(starts_at__lte=at, expires_at__gt=at)
        .filter(Q(revoked_at__isnull=True) | Q(revoked_at__gt=at))
        .filter(Q(delegated_from__isnull=False) | Q(agent__parent__isnull=True))
        .exclude(Q(break_glass=True) & opener_inactive)
        .select_related(
            "agent",
            "tool",
            "task",
            "requested_by",
            "requested_by_agent",
            "approved_by",
            "delegated_from",
        )
    )


@dataclass(frozen=True)
class AccountThen:
    """What an account was at a past moment, where it changed since (None: unchanged)."""

    active: bool | None = None
    superuser: bool | None = None
    roles: frozenset[str] | None = None


def accounts_at(at: datetime) -> dict[int, AccountThen]:
    """The accounts that changed after `at`, as they were at `at`, by id; any other is as
    it is now. Read from the person.* events (services.people): the first change of each
    after `at` holds, as its `before`, the value it had then."""
    then: dict[int, dict[str, Any]] = {}
    changes = (
        AuditEvent.objects.filter(
            event_type__in=[EventType.PERSON_CHANGED, EventType.PERSON_ROLES_CHANGED],
            created_at__gt=at,
            seq__gt=0,
        )
        .order_by("seq")
        .values_list("event_type", "data")
    )
    for event_type, raw in changes:
        data = json.loads(raw)
        found = then.setdefault(data["person_id"], {})
        if event_type == EventType.PERSON_CHANGED:
            for field, name in (("is_active", "active"), ("is_superuser", "superuser")):
                change = data["changed"].get(field)
                if isinstance(change, dict) and name not in found:
                    found[name] = bool(change["before"])
        elif "roles" not in found:
            roles = set(data["roles"])
            roles |= set(data.get("removed", []))
            roles -= set(data.get("added", []))
            if renamed := data.get("renamed"):
                roles = (roles - {renamed["to"]}) | {renamed["from"]}
            found["roles"] = frozenset(roles)
    return {pk: AccountThen(**found) for pk, found in then.items() if found}


@dataclass(frozen=True)
class ActiveChange:
    """An account deactivated or activated again: when, and is_active before and after."""

    when: datetime
    before: bool
    after: bool


def activity_since(since: datetime, people: Collection[int]) -> dict[int, list[ActiveChange]]:
    """These people's is_active changes after `since`, by id, in the order they were
    made (their person.changed events), to say whether each was active at any moment
    from `since` on (was_active), as accounts_at says it for one moment."""
    found: dict[int, list[ActiveChange]] = {}
    changes = AuditEvent.objects.filter(
        event_type=EventType.PERSON_CHANGED, created_at__gt=since, seq__gt=0
    ).order_by("seq")
    for when, raw in changes.values_list("created_at", "data"):
        data = json.loads(raw)
        change = data["changed"].get("is_active")
        if data["person_id"] in people and isinstance(change, dict):
            found.setdefault(data["person_id"], []).append(
                ActiveChange(when, bool(change["before"]), bool(change["after"]))
            )
    return found


def was_active(changes: list[ActiveChange], now: bool, moment: datetime) -> bool:
    """Whether an account was active at `moment` (from activity_since's `since` on): the
    first change after it says what it was then; with none, it was as it is now."""
    for change in changes:
        if change.when > moment:
            return change.before
    return now


def may_approve_at(user: Any, then: dict[int, AccountThen]) -> bool:
    """roles.may_approve() as of the moment `then` (accounts_at) was read for."""
    was = then.get(user.pk) if user is not None else None
    if was is None:
        return roles.may_approve(user)
    return roles.may_approve_as(
        active=user.is_active if was.active is None else was.active,
        superuser=user.is_superuser if was.superuser is None else was.superuser,
        roles=user.groups.values_list("name", flat=True) if was.roles is None else was.roles,
    )


def agent_tree(agents: QuerySet[Agent], root_id: int) -> list[Agent]:
    """The agent and every agent below it, rows of `agents` (which may lock them),
    parents before children. Bounded as the delegation walk is, and each agent once,
    so a corrupted cycle cannot loop."""
    found = list(agents.filter(pk=root_id))
    seen = {a.pk for a in found}
    frontier = list(seen)
    for _ in range(32):
        if not frontier:
            break
        children = [
            child
            for child in agents.filter(parent_id__in=frontier).order_by("pk")
            if child.pk not in seen
        ]
        found.extend(children)
        seen.update(c.pk for c in children)
        frontier = [c.pk for c in children]
    return found


def grants_in_force(at: datetime) -> QuerySet[Grant]:
    """live_grants() less those bound to a task that is not open at `at` (ended or
    closed before the job has revoked them, or not started) and those whose review fell
    due undecided (REVIEW_DEFAULT_RULE revoke): grants that could allow a call at `at`
    (ancestors aside). What the matrix file and the daily count hold."""
    found = live_grants(at).filter(Q(task__isnull=True) | open_at_q(at, "task__"))
    if settings.REVIEW_DEFAULT_RULE == "revoke":  # as policy._window_reason decides
        overdue = ReviewItem.objects.filter(undecided_at_due_q(), due_at__lte=at)
        found = found.exclude(pk__in=overdue.values("grant_id"))
    return found


def live_tokens(at: datetime) -> QuerySet[AgentToken]:
    """Tokens that work at `at` (as far as their own row goes): not expired, not revoked
    by then."""
    return AgentToken.objects.filter(expires_at__gt=at).filter(
        Q(revoked_at__isnull=True) | Q(revoked_at__gt=at)
    )


def live_policies(at: datetime) -> QuerySet[ConfirmationPolicy]:
    """Confirmation policies in force at `at`: the window policy._POLICY_QUERY reads."""
    return ConfirmationPolicy.objects.filter(starts_at__lte=at, expires_at__gt=at).filter(
        Q(revoked_at__isnull=True) | Q(revoked_at__gt=at)
    )


def matrix_summary() -> dict[str, Any]:
    now = timezone.now()
    return {
        "agents": Agent.objects.count(),
        "tools": Tool.objects.count(),
        "live_grants": live_grants(now).count(),
        "pending_requests": Grant.objects.filter(status=Grant.Status.PENDING).count(),
        "pending_approvals": Approval.objects.filter(
            status=Approval.Status.PENDING, expires_at__gt=now
        ).count(),
        "events": AuditEvent.objects.count(),
    }


def matrix_snapshot(at: datetime) -> dict[str, Any]:
    """The live grant matrix at `at` as plain data, in a stable order.

    What `matrix_export` writes: every agent and tool, the tasks open at `at`, and
    the grants and confirmation policies in force at `at` (a grant or policy bound to a
    task that is no longer open is not: the file imports back as it was exported), each
    grant with its review date (`review_due_at`: when its pending re-certification falls
    due, null when none is pending). Ordered by
    name/key (grants by agent, tool, task, scope, id) so two exports of the
    same state are byte-identical and diff cleanly under version control.
    """
    from governance.models import Task  # local: this function was appended to the module

    # Sorted in Python, not SQL: SQLite and PostgreSQL disagree on where NULL
    # task keys go and on collation ("bot-a" vs "bota"), and the file must not.
    # A grant's review date: its earliest pending review item due after `at` (one due
    # by then has ended it under REVIEW_DEFAULT_RULE revoke, or kept it under keep).
    review_due = (
        ReviewItem.objects.filter(
            grant_id=OuterRef("pk"), status=ReviewItem.Status.PENDING, due_at__gt=at
        )
        .order_by("due_at")
        .values("due_at")[:1]
    )
    grants = sorted(
        grants_in_force(at)
        .select_related("requested_by_agent")
        .annotate(review_due=Subquery(review_due)),
        key=lambda g: (g.agent.name, g.tool.name, g.task.key if g.task else "", g.scope, g.pk),
    )
    # A policy bound to a task that is not open answers no call: not in force.
    policies = sorted(
        (
            p
            for p in live_policies(at).select_related("agent", "tool", "task", "created_by")
            if p.task is None or p.task.is_open_at(at)
        ),
        key=lambda p: (
            p.agent.name, p.tool.name, p.action, p.task.key if p.task else "", p.scope,
            p.verdict, p.pk,
        ),
    )  # fmt: skip
    task_ids = {x.task_id for x in [*grants, *policies] if x.task_id is not None}
    tasks = sorted(
        (
            k
            for k in Task.objects.filter(
                Q(status=Task.Status.OPEN) | Q(pk__in=task_ids)
            ).select_related("owner")
            if k.is_open_at(at) or k.pk in task_ids
        ),
        key=lambda k: k.key,
    )
    agents = sorted(Agent.objects.select_related("owner", "parent"), key=lambda a: a.name)
    tools = sorted(Tool.objects.all(), key=lambda t: t.name)

    return {
        "version": 1,
        "agents": [
            {
                "name": a.name,
                "owner": a.owner.get_username(),
                "parent": a.parent.name if a.parent else None,
                "status": a.status,
            }
            for a in agents
        ],
        "tools": [
            {
                "name": t.name,
                "kind": t.kind,
                "actions": sorted(t.actions),
                "third_party": t.third_party,
                "irreversible": t.irreversible,
                "description": t.description,
                "input_schema": t.input_schema,
                "definition_hash": t.definition_hash,
                "quarantined": t.is_quarantined,
            }
            for t in tools
        ],
        "tasks": [
            {
                "key": k.key,
                "owner": k.owner.get_username(),
                "status": k.status,
                "window": {"starts_at": k.starts_at, "ends_at": k.ends_at},
            }
            for k in tasks
        ],
        "grants": [
            {
                "id": g.pk,
                "agent": g.agent.name,
                "tool": g.tool.name,
                "task": g.task.key if g.task else None,
                "actions": list(g.actions),
                "scope": g.scope,
                "fields": list(g.fields),
                "egress": list(g.egress),
                "limits": g.limits(),
                "justification": g.justification,
                "requester": (
                    g.requested_by.get_username()
                    if g.requested_by
                    else (f"agent:{g.requested_by_agent.name}" if g.requested_by_agent else None)
                ),
                "approver": g.approved_by.get_username() if g.approved_by else None,
                "starts_at": g.starts_at,
                "expires_at": g.expires_at,
                "review_due_at": g.review_due,  # type: ignore[attr-defined]
                "delegated_from": g.delegated_from_id,
                "delegable": g.delegable,
                "break_glass": g.break_glass,
            }
            for g in grants
        ],
        # The confirmation gate's standing answers: with the grants, what the agents
        # can do, and which of their destructive calls need no person.
        "confirmation_policies": [
            {
                "id": p.pk,
                "agent": p.agent.name,
                "tool": p.tool.name,
                "task": p.task.key if p.task else None,
                "action": p.action,
                "scope": p.scope,
                "verdict": p.verdict,
                "reason": p.reason,
                "author": p.created_by.get_username(),
                "starts_at": p.starts_at,
                "expires_at": p.expires_at,
            }
            for p in policies
        ],
    }


# --- Lifecycle (issue #5) --------------------------------------------------------------


def approver_users(*, exclude: Any = ()) -> list[Any]:
    """Active people who may approve (groups approvers/admins, superusers), by username,
    minus `exclude` (users or user ids): the pool for notices, reviews and second looks."""
    from django.contrib.auth import get_user_model

    from governance import roles

    excluded = {getattr(u, "pk", u) for u in exclude if u is not None}
    found = (
        get_user_model()
        .objects.filter(is_active=True)
        .filter(Q(is_superuser=True) | Q(groups__name__in=[roles.ADMINS, roles.APPROVERS]))
        .distinct()
        .order_by("username")
    )
    return [u for u in found if u.pk not in excluded]


# The action classes whose idleness makes a grant "unused" while it is still read
# through: read, the least a grant holds, is not proposed away from a grant whose other
# rights are used (a wholly idle grant is proposed for removal, read and all).
WRITE_ACTIONS = tuple(a for a in ActionClass.values if a != ActionClass.READ)
_CHUNK = 500  # grant ids per IN list


class HoldsAction(Func):
    """Whether a grant's JSON action list holds one action, in SQL (policy's main query
    says it the same way): jsonb containment on PostgreSQL, json_each on SQLite."""

    output_field = BooleanField()

    def __init__(self, action: str) -> None:
        super().__init__(F("actions"), Value(action))

    def _parts(self, compiler: Any, connection: Any) -> tuple[str, str, list[Any]]:
        column, column_params = compiler.compile(self.source_expressions[0])
        value, value_params = compiler.compile(self.source_expressions[1])
        return column, value, [*column_params, *value_params]

    def as_sqlite(self, compiler: Any, connection: Any, **extra: Any) -> tuple[str, list[Any]]:
        column, value, params = self._parts(compiler, connection)
        return f"EXISTS (SELECT 1 FROM json_each({column}) AS j WHERE j.value = {value})", params

    def as_postgresql(self, compiler: Any, connection: Any, **extra: Any) -> tuple[str, list[Any]]:
        column, value, params = self._parts(compiler, connection)
        return f"({column} @> jsonb_build_array(({value})::text))", params


def unused_proposal(actions: Collection[str], idle: Collection[str]) -> str:
    """What a grant holding `actions`, of which `idle` went unused, is proposed for:
    removal when none was used; narrowing to read when read alone was; else narrowing
    to the actions used (dropping the idle ones)."""
    used = [a for a in actions if a not in idle]
    if not used:
        return ReviewItem.Proposal.REMOVE.value
    if used == [ActionClass.READ]:
        return ReviewItem.Proposal.NARROW_TO_READ.value
    return ReviewItem.Proposal.NARROW_TO_USED.value


def unused_grants(at: datetime, limit: int | None = None) -> list[Grant]:
    """Grants in force (grants_in_force: not one whose task is over, nor one whose
    review fell due undecided: those allow nothing, and flagging one told its people
    to act on access already gone) with rights not used for UNUSED_GRANT_HOURS, for the
    dashboard, the flag job and the next campaign: wholly idle ones, and those whose create, update,
    delete or execute went unused while the grant was used for something else (per
    action: GrantActionUse). Each with `.idle_actions` (in the grant's order),
    `.keep_actions` (the used ones), `.proposal` (unused_proposal), `.idle_since` (the
    last use of an idle action, or the start) and `.action_last_used` ({action: its
    own last use}). An action used through a delegation below the grant (its subagents,
    at most 32 levels down) was used. Never-used grants and actions count from the start.

    `limit`: the first so many in the same order (by agent name, then id), read a page
    at a time; the dashboard built every idle grant with its relations to show 20
    (50,430 of them at a customer's size: 12.5 s)."""
    if not settings.UNUSED_GRANT_HOURS:
        return []  # the scan is off
    cutoff = at - timedelta(hours=settings.UNUSED_GRANT_HOURS)
    whole = Q(last_used_at__lte=cutoff) | Q(last_used_at__isnull=True, starts_at__lte=cutoff)
    part = Q()
    for action in WRITE_ACTIONS:
        fresh = GrantActionUse.objects.filter(
            grant_id=OuterRef("pk"), action=action, last_used_at__gt=cutoff
        )
        part |= Q(HoldsAction(action)) & ~Exists(fresh)
    idle = grants_in_force(at).filter(whole | (Q(starts_at__lte=cutoff) & part))
    idle = idle.order_by("agent__name", "id")
    found: list[Grant] = []
    if limit is None:
        own, below = _fresh_uses(cutoff)  # which is idle: from the uses since the cutoff
        candidates = [
            grant
            for grant in idle
            if _idle_actions(grant, cutoff, own.get(grant.pk, {}), below.get(grant.pk, set()))
        ]
        uses = _action_uses([g.pk for g in candidates])  # then their last uses, for show
        for grant in candidates:
            # Read again: a fold committed since the read above may have made it busy.
            if _mark_idle(grant, cutoff, uses.get(grant.pk, {}), below.get(grant.pk, set())):
                found.append(grant)
        return found
    start, size = 0, max(limit, 1)
    while len(found) < limit:
        page = list(idle[start : start + size])
        uses, below = _uses_and_below(page, cutoff)
        for grant in page:
            if len(found) < limit and _mark_idle(
                grant, cutoff, uses.get(grant.pk, {}), below.get(grant.pk, set())
            ):
                found.append(grant)
        if len(page) < size:
            break  # no more idle grants
        # Doubling: a run of busy grants costs a few pages, never one page per row.
        start, size = start + size, size * 2
    return found


def _idle_actions(
    grant: Grant, cutoff: datetime, own: dict[str, datetime], below: set[str]
) -> list[str] | None:
    """The grant's idle actions when it is to be proposed (None: it is not): all of
    them when nothing was used (by it or below it), else those idle when one of them
    is not read. A grant used since the cutoff with no use of any action on record
    (usage recorded before uses were kept per action) is left alone: what it was used
    for is not known."""
    used = below | {a for a, when in own.items() if when > cutoff}
    held = list(grant.actions)
    idle = [a for a in held if a not in used]
    if not idle:
        return None
    if len(idle) == len(held):
        recent = grant.last_used_at is not None and grant.last_used_at > cutoff
        return None if recent or below else idle
    return idle if any(a != ActionClass.READ for a in idle) else None


def _mark_idle(grant: Grant, cutoff: datetime, own: dict[str, datetime], below: set[str]) -> bool:
    """Set the unused_grants attributes on `grant`; False if it is not idle."""
    idle = _idle_actions(grant, cutoff, own, below)
    if idle is None:
        return False
    lasts = [own[a] for a in idle if a in own]
    if len(idle) == len(grant.actions) and grant.last_used_at is not None:
        lasts.append(grant.last_used_at)
    grant.idle_actions = idle  # type: ignore[attr-defined]
    grant.keep_actions = [a for a in grant.actions if a not in idle]  # type: ignore[attr-defined]
    grant.proposal = unused_proposal(grant.actions, idle)  # type: ignore[attr-defined]
    grant.idle_since = max([grant.starts_at, *lasts])  # type: ignore[attr-defined]
    grant.action_last_used = own  # type: ignore[attr-defined]
    return True


def _action_uses(pks: list[int]) -> dict[int, dict[str, datetime]]:
    """Each grant's own last use per action, by grant id."""
    found: dict[int, dict[str, datetime]] = {}
    for i in range(0, len(pks), _CHUNK):
        rows = GrantActionUse.objects.filter(grant_id__in=pks[i : i + _CHUNK])
        for pk, action, when in rows.values_list("grant_id", "action", "last_used_at"):
            found.setdefault(pk, {})[action] = when
    return found


def _fresh_uses(since: datetime) -> tuple[dict[int, dict[str, datetime]], dict[int, set[str]]]:
    """Every use since `since`: each grant's own ({grant: {action: last use}}), and the
    actions each grant was used for through the delegations below it (at most 32
    levels up from the delegation used): a parent grant its subagents use for an
    action has not left that action idle (removing it would end theirs too)."""
    own: dict[int, dict[str, datetime]] = {}
    up: dict[int, set[str]] = {}
    rows = GrantActionUse.objects.filter(last_used_at__gt=since).values_list(
        "grant_id", "grant__delegated_from_id", "action", "last_used_at"
    )
    for pk, parent, action, when in rows:
        own.setdefault(pk, {})[action] = when
        if parent is not None:
            up.setdefault(parent, set()).add(action)
    below: dict[int, set[str]] = {}
    for _ in range(32):  # bounded as every delegation walk is
        frontier = {pk: acts - below.get(pk, set()) for pk, acts in up.items()}
        frontier = {pk: acts for pk, acts in frontier.items() if acts}
        if not frontier:
            break
        for pk, acts in frontier.items():
            below.setdefault(pk, set()).update(acts)
        up = {}
        parents = Grant.objects.filter(pk__in=list(frontier), delegated_from__isnull=False)
        for pk, parent in parents.values_list("pk", "delegated_from_id"):
            up.setdefault(parent, set()).update(frontier[pk])
    return own, below


def _uses_and_below(
    grants: list[Grant], since: datetime
) -> tuple[dict[int, dict[str, datetime]], dict[int, set[str]]]:
    """For a page of grants: each one's own last use per action, and the actions each
    was used for since `since` through the delegations below it (_fresh_uses read from
    the other end: one query for the page and its first level of delegations, then one
    per level below, not every use since `since`)."""
    pks = [grant.pk for grant in grants]
    held = {grant.pk: set(grant.actions) for grant in grants}
    own: dict[int, dict[str, datetime]] = {}
    below: dict[int, set[str]] = {}
    columns = ("pk", "delegated_from_id", "action_uses__action", "action_uses__last_used_at")
    # Level 0: the page's grants (their own uses) and their delegations.
    rows = Grant.objects.filter(Q(pk__in=pks) | Q(delegated_from_id__in=pks))
    frontier: dict[int, set[int]] = {pk: {pk} for pk in pks}  # grant -> page grants above
    for level in range(32):  # bounded as every delegation walk is
        next_level: dict[int, set[int]] = {}
        for pk, parent, action, when in rows.values_list(*columns):
            if level == 0 and pk in held and action is not None:
                own.setdefault(pk, {})[action] = when
            roots = frontier.get(parent) if parent is not None else None
            if not roots:
                continue
            if action is not None and when > since:
                for root in roots:
                    below.setdefault(root, set()).add(action)
            next_level.setdefault(pk, set()).update(roots)
        # A page grant whose every action is used below it needs no deeper look.
        frontier = {
            pk: live
            for pk, roots in next_level.items()
            if (live := {r for r in roots if not held[r] <= below.get(r, set())})
        }
        if not frontier:
            break
        rows = Grant.objects.filter(delegated_from_id__in=list(frontier))
    return own, below


def breakglass_active(at: datetime) -> QuerySet[Any]:
    """Break-glass elevations live at `at`: shown on every page while active."""
    from governance.models import BreakGlass

    return (
        BreakGlass.objects.filter(opened_at__lte=at, expires_at__gt=at, closed_at__isnull=True)
        # The grant's own end too: a review may have narrowed its expiry since.
        .filter(grant__status=Grant.Status.ACTIVE, grant__expires_at__gt=at)
        # Live only while its opener's account is active (authorize() says the same).
        .filter(opened_by__is_active=True)
        .select_related("grant__agent", "grant__tool", "opened_by")
        .order_by("expires_at")
    )


def breakglass_reviews_pending(at: datetime, *, overdue_only: bool = False) -> list[Any]:
    """Post-incident reviews still open, oldest due first, each with `.is_overdue`
    decided from the due time itself (not from whether the overdue job has run).
    `overdue_only`: just those past due, for the banner on every page; the database
    picks them (the partial index breakglass_review_due), not a loop over the rest."""
    from governance.models import BreakGlass

    pending = BreakGlass.objects.filter(review_status=BreakGlass.Review.PENDING)
    if overdue_only:
        pending = pending.filter(review_due_at__lte=at)
    found = list(
        pending.select_related("grant__agent", "grant__tool", "opened_by").order_by("review_due_at")
    )
    for bg in found:
        bg.is_overdue = bg.review_due_at <= at
    return found


# Pending items before decided ones, each group soonest due first (a campaign's items
# share a due date: then in the order they were made). By status alone, "ended" and
# "kept" came before "pending".
PENDING_FIRST = (Case(When(status="pending", then=0), default=1), "due_at", "pk")


def review_items_query(user: Any, *, decided: bool = False) -> QuerySet[Any]:
    """A person's open items: those assigned to them, and for an admin also those that
    fall to the admins (unassigned, or whose reviewer may no longer decide:
    services.reviews._reviewers; decided by nobody, they fell to the default rule with
    no page listing them); with `decided`, then the items assigned to them or decided
    by them that are closed. PENDING_FIRST. A query that pages slice and count: a
    reviewer with 4,250 items was sent all of them, a form each, in one page of 7.5 MB."""
    from governance.models import ReviewItem

    pending = Q(status=ReviewItem.Status.PENDING)
    open_to_them = Q(reviewer=user)
    if roles.is_admin(user):
        deciders = [person.pk for person in approver_users()]
        open_to_them |= Q(reviewer__isnull=True) | ~Q(reviewer_id__in=deciders)
    wanted = pending & open_to_them
    if decided:
        wanted |= ~pending & (Q(reviewer=user) | Q(decided_by=user))
    return (
        ReviewItem.objects.filter(wanted)
        .select_related("campaign", "reviewer", "decided_by", "grant__agent", "grant__tool")
        .select_related("grant__task")
        .order_by(*PENDING_FIRST)
    )


def review_items_counts(user: Any) -> tuple[int, int]:
    """(open items assigned to this person, open items fallen to the admins, for an
    admin). Counted apart: whether an admin may decide a fallen item is worked out per
    page (review_items_marked), so a count of them all cannot say "waiting on me" (an
    admin who approved the grants saw every fallen item as theirs, and could decide none)."""
    from governance.models import ReviewItem

    open_items = review_items_query(user)
    assigned = open_items.filter(reviewer=user, status=ReviewItem.Status.PENDING).count()
    return assigned, (open_items.count() - assigned) if roles.is_admin(user) else 0


def review_items_marked(user: Any, items: Any, at: datetime) -> list[Any]:
    """`items` (a page of review_items_query) each with `.is_overdue` and `.may_decide`:
    an item that fell to the admins is theirs to decide unless this one is barred from
    the grant and another is not (_reviewers, the rule the service applies); worked out
    for the page's items only, so its queries are bounded by the page, not the backlog."""
    from governance.models import ReviewItem
    from governance.services.reviews import _reviewers

    found = list(items)
    for item in found:
        pending = item.status == ReviewItem.Status.PENDING
        item.is_overdue = pending and item.due_at <= at
        item.may_decide = pending and (item.reviewer_id == user.pk or user in _reviewers(item))
    return found


def review_items_for(user: Any, at: datetime, *, limit: int = 50) -> list[Any]:
    """The first `limit` of a person's open items (review_items_query), marked."""
    return review_items_marked(user, review_items_query(user)[:limit], at)


def grant_trend(*, days: int = 30) -> dict[str, Any]:
    """Daily live-grant counts (oldest first) and whether they rose: `rise` is true when
    the latest total exceeds the one before it or the first in the window;
    `rising_agents` names agents whose count went up since the previous snapshot."""
    from governance.models import LiveGrantSnapshot

    snaps = list(LiveGrantSnapshot.objects.order_by("-day")[:days])[::-1]
    series = [{"day": s.day.isoformat(), "total": s.total, "per_agent": s.per_agent} for s in snaps]
    rise, rising = False, []
    if len(snaps) >= 2:
        last, prev = snaps[-1], snaps[-2]
        rise = last.total > prev.total or last.total > snaps[0].total
        rising = sorted(
            name for name, count in last.per_agent.items() if count > prev.per_agent.get(name, 0)
        )
    return {"series": series, "rise": rise, "rising_agents": rising}


def second_looks_for(user: Any) -> QuerySet[Any]:
    """A reviewer's pending second looks, oldest first."""
    from governance.models import SecondLook

    return (
        SecondLook.objects.filter(reviewer=user, status=SecondLook.Status.PENDING)
        .select_related("grant__agent", "grant__tool", "approval__agent", "approval__tool")
        .select_related("original_approver")
        .order_by("sampled_at", "id")
    )


def review_campaigns(*, open_only: bool = False) -> QuerySet[Any]:
    """Campaigns, newest first, each with `pending` and `total` item counts."""
    from django.db.models import Count

    from governance.models import ReviewCampaign

    found = ReviewCampaign.objects.annotate(
        total=Count("items"), pending=Count("items", filter=Q(items__status="pending"))
    ).order_by("-opened_at", "-id")
    return found.filter(status=ReviewCampaign.Status.OPEN) if open_only else found


def by_name(model: type[Any], what: str, **lookup: Any) -> Any:
    """The object a request names (an agent by name, a task by key), or a 400
    `unknown_<what>` that says which: for the API and the UI's forms alike."""
    from governance.errors import GovernanceError
    from governance.text import is_text

    field, value = next(iter(lookup.items()))
    found = model.objects.filter(**lookup).first() if is_text(str(value)) else None
    if found is None:
        raise GovernanceError(
            f"unknown_{what}", f"No {what} has the {field} {value!r}.", fields={what: "unknown"}
        )
    return found


def agent_named_by(user: Any, name: str) -> Agent:
    """The agent a person names in a request: any, for those who may read every agent
    (admins, approvers, auditors); their own only, for anyone else, another's answering
    exactly as a name nobody has (no way to learn which agent names exist)."""
    from governance import roles

    agent = by_name(Agent, "agent", name=name)
    if agent.owner_id == user.pk or roles.is_approver(user) or roles.is_auditor(user):
        return agent
    return by_name(Agent, "agent", name=name, owner_id=user.pk)  # the unknown answer
