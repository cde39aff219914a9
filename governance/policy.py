"""authorize(): the one access decision. Pure: it reads, never writes.

Every access question (REST API, web UI what-if, sandbox runner, delegation)
is answered here and nowhere else. The checklist runs in a fixed order and
the first failing check names the reason; anything unexpected is a denial
with reason `error`. Time comes in as `at`: expiry is decided by comparing
windows with `at`, never by whether a job has run.

Writes that follow a decision (audit event, usage, creating or consuming an
approval) live in services.access.access_check(), in one transaction.

The common case is one round trip: agent, tool, task and the candidate
grants come back from a single prepared query (with each candidate grant's review
due date). Delegated grants (ancestor walk) cost one more query, an approval two (its
row, and its approver's stake now), only when present.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.conf import settings

from governance import db, roles
from governance.audit import arguments_digest
from governance.codes import ACTION_VALUES, ActionClass, Reason
from governance.codes import Decision as Verdict
from governance.models.tasks import window_open_at
from governance.text import is_text

log = logging.getLogger(__name__)

MAX_SCOPE_LEN = 500
MAX_NAME_LEN = 100

# --- Scope matching ------------------------------------------------------------
# Resources are `type:path/with/segments`. Matching is exact about boundaries:
# a resource must already be canonical (no empty segments, none ending in a dot, none
# with a `;` parameter, no percent-encoding, no backslashes, printable ASCII only), so
# there is no second spelling of a path for a pattern (a grant's, or a deny policy's)
# to miss. Case is significant.
_RESOURCE_CHARS = re.compile(r"[A-Za-z0-9._~:@!$&'()+,;=/-]+")
_PATTERN_CHARS = re.compile(r"[A-Za-z0-9._~:@!$&'()+,;=/*-]+")
# The part before the first `:` is a kind (`repo`, `s3`, `db.prod`), a name and never a
# path: `srv/prod/db:x` is no resource of kind `srv/prod/db`. Read as one, a file under
# a deny policy's `srv/prod/*` (or its `:$DATA` stream) escaped the policy.
_KIND = re.compile(r"[A-Za-z][A-Za-z0-9_+-]*(?:\.[A-Za-z0-9_+-]+)*")


def _split(value: str) -> tuple[str, list[str]]:
    kind, sep, path = value.partition(":")
    if not sep:
        return "", kind.split("/")
    return kind, path.split("/")


def _kind_ok(value: str) -> bool:
    """No kind, or a kind that is a name (_KIND)."""
    kind, sep, _path = value.partition(":")
    return not sep or bool(_KIND.fullmatch(kind))


def _segments_ok(segments: list[str]) -> bool:
    """No empty segment, none ending in a dot (so none made only of dots: `..` is "up",
    and Windows reads `prod.` as `prod`), none holding a `;` (servers that take `;`
    parameters, Tomcat's, read `prod;v=1` as `prod`, and `..;` as "up") and none with an
    NTFS stream name (`prod::$DATA`, `prod:$I30:$INDEX_ALLOCATION` are `prod`)."""
    return all(
        seg and ";" not in seg and not seg.endswith(".") and "::" not in seg and ":$" not in seg
        for seg in segments
    )


def resource_is_canonical(resource: str) -> bool:
    if not (0 < len(resource) <= MAX_SCOPE_LEN) or not _RESOURCE_CHARS.fullmatch(resource):
        return False
    _kind, segments = _split(resource)
    return _kind_ok(resource) and _segments_ok(segments)


def pattern_is_valid(pattern: str) -> bool:
    """`*` is allowed only as a whole segment (or as the whole pattern)."""
    if pattern == "*":
        return True
    if not (0 < len(pattern) <= MAX_SCOPE_LEN) or not _PATTERN_CHARS.fullmatch(pattern):
        return False
    _kind, segments = _split(pattern)
    if not _kind_ok(pattern):  # `*` in it too
        return False
    return _segments_ok(segments) and all(seg == "*" or "*" not in seg for seg in segments)


# Grant patterns are few and fixed: their validity is remembered, not re-parsed.
_pattern_ok = functools.lru_cache(maxsize=8192)(pattern_is_valid)


def scope_matches(pattern: str, resource: str) -> bool:
    """Does a grant's pattern cover a concrete resource?

    `*` in the middle matches exactly one segment; a trailing `*` matches one
    or more segments below. `repo:acme/api/*` covers `repo:acme/api/x/y`
    but not `repo:acme/api2/x`, `repo:acme/api`, or `repo:acme/api/../x`.
    """
    if not resource_is_canonical(resource) or not pattern_is_valid(pattern):
        return False
    return _covers(pattern, resource)


def _covers(pattern: str, resource: str) -> bool:
    """scope_matches() for a pattern and a resource already checked as valid."""
    if pattern == "*":
        return True
    p_kind, p_segs = _split(pattern)
    r_kind, r_segs = _split(resource)
    if p_kind != r_kind:
        return False
    for i, seg in enumerate(p_segs):
        if seg == "*" and i == len(p_segs) - 1:
            return len(r_segs) > i
        if i >= len(r_segs) or (seg != "*" and seg != r_segs[i]):
            return False
    return len(r_segs) == len(p_segs)


def pattern_within(inner: str, outer: str) -> bool:
    """Is every resource `inner` can match also matched by `outer`? (delegation)"""
    if not pattern_is_valid(inner) or not pattern_is_valid(outer):
        return False
    if outer == "*":
        return True
    if inner == "*":
        return False
    i_kind, i_segs = _split(inner)
    o_kind, o_segs = _split(outer)
    if i_kind != o_kind:
        return False
    for idx, seg in enumerate(o_segs):
        trailing = seg == "*" and idx == len(o_segs) - 1
        if trailing:
            return len(i_segs) > idx
        if idx >= len(i_segs):
            return False
        inner_seg = i_segs[idx]
        if inner_seg == "*" and idx == len(i_segs) - 1:
            return False  # inner's tail covers more depth than outer's single segment
        if seg != "*" and inner_seg != seg:
            return False
    return len(i_segs) == len(o_segs)


def patterns_overlap(a: str, b: str) -> bool:
    """Is there a resource both patterns match? (which confirmation policies can answer
    some call under a grant, in the access report)"""
    if not pattern_is_valid(a) or not pattern_is_valid(b):
        return False
    if a == "*" or b == "*":
        return True
    a_kind, a_segs = _split(a)
    b_kind, b_segs = _split(b)
    if a_kind != b_kind:
        return False
    for idx in range(min(len(a_segs), len(b_segs))):
        if (a_segs[idx] == "*" and idx == len(a_segs) - 1) or (
            b_segs[idx] == "*" and idx == len(b_segs) - 1
        ):
            # A trailing `*` takes this segment and any below it: whatever the other
            # pattern asks of them, some resource has them.
            return True
        if "*" not in (a_segs[idx], b_segs[idx]) and a_segs[idx] != b_segs[idx]:
            return False
    return len(a_segs) == len(b_segs)


def policy_covers(
    verdict: str, pattern: str, scope: str, match: Callable[[str, str], bool] = scope_matches
) -> bool:
    """Does a confirmation policy's scope pattern cover `scope` (a resource; or, with
    `match=patterns_overlap`, some resource of a grant's pattern)?

    An approve policy's pattern matches as a grant's does. A deny only ever restricts,
    so it reads its author's intent wide: `repo:acme/prod/*` means prod, the repository
    itself (its deletion above all) as well as everything in it, where a grant's `X/*`
    gives only what is below X; and `repo:acme/PROD/x` is prod to every tool that names
    things without regard to case (GitHub's repositories, S3 on some gateways, Windows
    paths), so a deny matches without regard to (ASCII) case."""
    if verdict != "deny":
        return match(pattern, scope)
    pattern, scope = pattern.lower(), scope.lower()
    base, sep, star = pattern.rpartition("/")
    wide = (pattern, base) if sep and star == "*" and pattern_is_valid(base) else (pattern,)
    return any(match(each, scope) for each in wide)


# --- The decision --------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    """The answer. `allowed` is true only for decision == allow."""

    decision: str
    reason: str
    message: str
    grant_id: int | None = None
    approval_id: str | None = None
    expires_at: datetime | None = None
    break_glass: bool = False
    destructive: bool = False
    agent_id: int | None = None
    tool_id: int | None = None
    task_id: int | None = None
    arguments_hash: str = ""
    decision_id: str | None = None  # the audit event's uid, set by access_check
    # The confirmation policy that answered the gate (approve or deny), if one did.
    policy_id: int | None = None
    # A denial because the grant that covers the call is not live: which grant (never
    # grant_id, which names only a live grant covering the call: the one an allow was
    # under, or the one the confirmation gate was asked under; the API shows it only
    # with an allow).
    dead_grant_id: int | None = None
    # The newest audit event the decision's read could see: every state change writes
    # one, so access_check's append can tell whether the state changed since (a revoke
    # committing while this decision waited for the chain lock) and decide again.
    seen_seq: int | None = None

    @property
    def allowed(self) -> bool:
        return self.decision == Verdict.ALLOW


def _deny(reason: Reason, message: str, **kwargs: Any) -> Decision:
    return Decision(decision=Verdict.DENY, reason=reason, message=message, **kwargs)


# The candidate grants are this agent's on this tool that hold the action; the
# tool's support for the action and its approval state come back as booleans.
# Times arrive as integer microseconds (db.query): compared, never parsed.
_MAIN_COLUMNS = """
SELECT a.id, a.status,
       t.id, {t_action}, t.irreversible, t.definition_hash = t.approved_hash,
       k.id, k.starts_at, k.ends_at, k.closed_at,
       g.id, g.task_id, g.scope, {g_fields}, g.status, g.starts_at, g.expires_at,
       g.revoked_at, g.delegated_from_id, g.break_glass,
       (SELECT e.seq FROM governance_auditevent e ORDER BY e.seq DESC LIMIT 1),
       {review_due}, a.parent_id, {opener_active}
FROM (SELECT 1 AS one) AS o
LEFT JOIN governance_agent a ON a.name = %s
LEFT JOIN governance_tool t ON t.name = %s
LEFT JOIN governance_task k ON k.key = %s
LEFT JOIN governance_grant g
       ON g.agent_id = a.id AND g.tool_id = t.id AND g.status NOT IN ('pending', 'denied')
      AND {g_action}
ORDER BY g.id
"""
_MAIN_KINDS = "isibbbittt" + "iisssttti" + "bitib"  # one letter per column (db.query)
# When the grant's oldest undecided review item fell due: past it, REVIEW_DEFAULT_RULE
# `revoke` has ended the grant, whether or not the job has run (_window_reason). Once
# the job has applied the rule (`auto_revoked`), or closed the item `ended` because the
# grant ended before the job ran, the item still says when: a question about a moment
# between the due date and the job's run gets the same answer as then
# (models.reviews.undecided_at_due_q says the same for the ORM).
_REVIEW_DUE = """(SELECT min(r.due_at) FROM governance_reviewitem r
        WHERE r.grant_id = {grant}.id AND (r.status IN ('pending', 'auto_revoked')
              OR (r.status = 'ended' AND r.decided_at >= r.due_at)))"""
# A break-glass grant rides on its opener's own authority (no second person approved
# it): it is live only while the opener's account is active. True for any other grant.
_OPENER_ACTIVE = """(NOT g.break_glass
        OR (SELECT u.is_active FROM auth_user u WHERE u.id = g.requested_by_id) IS TRUE)"""
_MAIN_QUERY = {
    # jsonb: `?` is "has this string element"; fields only when the list is not empty.
    "postgresql": _MAIN_COLUMNS.format(
        t_action="t.actions ? %s",
        g_action="g.actions ? %s",
        g_fields="CASE WHEN jsonb_array_length(g.fields) = 0 THEN NULL ELSE g.fields::text END",
        review_due=_REVIEW_DUE.format(grant="g"),
        opener_active=_OPENER_ACTIVE,
    ),
    "sqlite": _MAIN_COLUMNS.format(
        t_action="EXISTS (SELECT 1 FROM json_each(t.actions) AS j WHERE j.value = %s)",
        g_action="EXISTS (SELECT 1 FROM json_each(g.actions) AS j WHERE j.value = %s)",
        g_fields="CASE WHEN json_array_length(g.fields) = 0 THEN NULL ELSE g.fields END",
        review_due=_REVIEW_DUE.format(grant="g"),
        opener_active=_OPENER_ACTIVE,
    ),
}

# Every ancestor of a delegated grant, nearest first, with its holder's status: a
# parent agent's suspension (the kill switch) ends what it handed down. Depth-capped
# so a corrupted cycle cannot loop forever. With what each holds (tool, task, actions,
# scope), its holder's parent and its id: a row wider than the one above it is refused
# (_ancestors_reason), as it held them at a past moment when the question is about one.
_ANCESTORS_COLUMNS = """
WITH RECURSIVE chain(id, parent_id, agent_id, status, starts_at, expires_at, revoked_at,
                     depth) AS (
    SELECT p.id, p.delegated_from_id, p.agent_id, p.status, p.starts_at, p.expires_at,
           p.revoked_at, 1
    FROM governance_grant p WHERE p.id = %s
    UNION ALL
    SELECT p.id, p.delegated_from_id, p.agent_id, p.status, p.starts_at, p.expires_at,
           p.revoked_at, chain.depth + 1
    FROM governance_grant p JOIN chain ON p.id = chain.parent_id
    WHERE chain.depth < 32
)
SELECT chain.status, chain.starts_at, chain.expires_at, chain.revoked_at, a.status, a.id,
       {review_due}, g.tool_id, g.task_id, {actions}, g.scope, a.parent_id, chain.id
FROM chain JOIN governance_agent a ON a.id = chain.agent_id
JOIN governance_grant g ON g.id = chain.id
ORDER BY chain.depth
"""
_ANCESTORS_QUERY = {
    vendor: _ANCESTORS_COLUMNS.format(review_due=_REVIEW_DUE.format(grant="chain"), actions=cast)
    for vendor, cast in (("postgresql", "g.actions::text"), ("sqlite", "g.actions"))
}

# Whether the person in `column` may approve now: active, and an approver or admin (the
# rule roles.may_approve states). A confirmation, hand-made or standing, answers only
# with its author's present authority.
_MAY_APPROVE_SQL = f"""EXISTS (
    SELECT 1 FROM auth_user u WHERE u.id = {{column}} AND u.is_active AND (
        u.is_superuser OR EXISTS (
            SELECT 1 FROM auth_user_groups ug JOIN auth_group r ON r.id = ug.group_id
            WHERE ug.user_id = u.id AND r.name IN ('{roles.ADMINS}', '{roles.APPROVERS}'))))"""

# A person's approval is good only while their authority is: one deactivated since (a
# departed or compromised account), or no longer an approver, confirms nothing any more.
_APPROVAL_QUERY = f"""
SELECT a.id, a.agent_id, a.tool_id, a.action, a.scope, a.arguments_hash, a.status,
       a.expires_at, a.task_id, a.grant_id, a.decided_by_id, a.requested_at,
       {_MAY_APPROVE_SQL.format(column="a.decided_by_id")}
FROM governance_approval a WHERE a.id = %s AND a.agent_id = %s
"""

# The live confirmation policies for this agent, tool and action (and the call's task,
# for a task-bound policy); their scope patterns are matched in Python, as grants' are.
# And whether the author may approve now (active, an approver or admin): an approve
# policy is a standing approval, and stops answering with its author's authority, or
# once the tool has another approved definition than the one it was written against.
_POLICY_QUERY = f"""
SELECT p.id, p.verdict, p.scope, p.created_by_id, p.created_at,
       {_MAY_APPROVE_SQL.format(column="p.created_by_id")}
       AND p.definition_hash = (SELECT t.approved_hash FROM governance_tool t
                                WHERE t.id = p.tool_id)
FROM governance_confirmationpolicy p
WHERE p.agent_id = %s AND p.tool_id = %s AND p.action = %s
  AND (p.task_id IS NULL OR p.task_id = %s)
  AND p.starts_at <= %s AND p.expires_at > %s
  AND (p.revoked_at IS NULL OR p.revoked_at > %s)
ORDER BY p.id
"""
# The agent (depth 1) and every agent above it.
_TREE_UP = """tree(id, parent_id, depth) AS (
    SELECT a.id, a.parent_id, 1 FROM governance_agent a WHERE a.id = %s
    UNION ALL
    SELECT a.id, a.parent_id, tree.depth + 1
    FROM governance_agent a JOIN tree ON a.id = tree.parent_id WHERE tree.depth < 32
)"""

# Who has a stake in a call by this agent under this grant, as services.approvals.
# stakeholders() counts them: the owners of the agent and of every agent above it;
# up the grant's delegation chain, each grant's requester and its holder's owner; the
# creators of the tokens of all those agents, with each token's lifetime; and whoever
# opened a break-glass up the chain or whose break-glass a grant in it ratifies.
_STAKE_QUERY = f"""
WITH RECURSIVE {_TREE_UP}, chain(id, parent_id, requested_by_id, agent_id, depth) AS (
    SELECT g.id, g.delegated_from_id, g.requested_by_id, g.agent_id, 1
    FROM governance_grant g WHERE g.id = %s
    UNION ALL
    SELECT g.id, g.delegated_from_id, g.requested_by_id, g.agent_id, chain.depth + 1
    FROM governance_grant g JOIN chain ON g.id = chain.parent_id WHERE chain.depth < 32
), stake_agents(id) AS (
    SELECT id FROM tree UNION SELECT agent_id FROM chain
)
SELECT t.created_by_id, t.expires_at, t.revoked_at, t.created_at FROM governance_agenttoken t
WHERE t.agent_id IN (SELECT id FROM stake_agents) AND t.created_by_id IS NOT NULL
UNION ALL
SELECT a.owner_id, NULL, NULL, NULL FROM governance_agent a
WHERE a.id IN (SELECT id FROM stake_agents)
UNION ALL
SELECT requested_by_id, NULL, NULL, NULL FROM chain WHERE requested_by_id IS NOT NULL
UNION ALL
SELECT b.opened_by_id, NULL, NULL, NULL FROM governance_breakglass b
WHERE b.grant_id IN (SELECT id FROM chain) OR b.ratified_request_id IN (SELECT id FROM chain)
"""
# (Tokens first: PostgreSQL types a UNION's columns from its first branch on, and two
# bare NULLs first would be typed text.)


def stake_check(agent_id: int, grant_id: int) -> Callable[[int, datetime, datetime], bool]:
    """has_stake(author, since, as_of): did this person have a stake in a call by this
    agent under this grant as of `as_of`? They own the agent (or one above it), asked
    for the grant (or one it was delegated from), or held a token for any of those
    agents at some moment from `since` (when they wrote a policy, or the call was
    asked) to `as_of` (the moment the question is about): a token created after it is
    no stake then, so a report about an earlier moment answers as the gate did. The
    owners are as the rows are now, also when the question is about a past moment."""
    owners: set[int] = set()
    tokens: list[tuple[int, Any, Any, Any]] = []  # (creator, expires, revoked or None, created)
    for user_id, expires, revoked, created in db.execute(_STAKE_QUERY, [agent_id, grant_id]):
        if expires is None:  # an owner's or a requester's row
            owners.add(user_id)
        else:
            tokens.append((user_id, db.read_dt(expires), db.read_dt(revoked), db.read_dt(created)))

    def has_stake(author: int, since: datetime, as_of: datetime) -> bool:
        return author in owners or any(
            user == author
            and created <= as_of
            and expires > since
            and (revoked is None or revoked > since)
            for user, expires, revoked, created in tokens
        )

    return has_stake


def _policy_verdicts(
    agent_id: int,
    tool_id: int,
    grant_id: int,
    action: str,
    scope: str,
    task_id: int | None,
    at: datetime,
    above: list[int],
) -> list[tuple[int, str]]:
    """(policy id, verdict) of every live confirmation policy covering this call, less
    the approving ones whose author has a stake in it (stake_check) or may no longer
    approve (deactivated, or no approver role now). Nobody confirms their own agent's
    calls, by hand or by rule. A deny only ever restricts, whoever
    wrote it. `above`: the agents up the grant's delegation chain and up the agent tree;
    their denies bind every agent below them, whichever grant it calls under (a subagent
    never does what its parent is refused), their approves answer for their own calls
    only."""
    when = db.param_dt(at)
    found = []
    for holder in (agent_id, *above):
        rows = db.execute(_POLICY_QUERY, [holder, tool_id, action, task_id, when, when, when])
        found += [
            (pid, verdict, author, db.read_dt(written))
            for pid, verdict, pattern, author, written, may_approve in rows
            if (holder == agent_id or verdict == "deny")
            and (verdict == "deny" or may_approve)
            and policy_covers(verdict, pattern, scope)
        ]
    if not any(verdict == "approve" for _, verdict, _, _ in found):
        return [(pid, verdict) for pid, verdict, _, _ in found]
    has_stake = stake_check(agent_id, grant_id)
    return [
        (pid, verdict)
        for pid, verdict, author, since in found
        if verdict == "deny" or not has_stake(author, since, at)
    ]


def _window_reason(
    status: str,
    starts_at: int | None,
    expires_at: int | None,
    revoked_at: int | None,
    at: int,
    review_due: int | None = None,
) -> Reason | None:
    """None when the grant's own window is live at `at`, else why not (times: db.to_us).
    A review item still undecided at its due date revokes the grant then, under
    REVIEW_DEFAULT_RULE `revoke`: decided here, as expiry is, not by the job having run
    (the job does the bookkeeping: the item, the grant's row and their events)."""
    if status in ("pending", "denied") or starts_at is None or expires_at is None:
        return Reason.NO_GRANT
    if revoked_at is not None and revoked_at <= at:
        return Reason.GRANT_REVOKED
    # Whichever ended the grant first names it: a review that fell due while the grant
    # was live revoked it then, whether or not the job has run since (it back-dates the
    # revoke to the due date); one due after the expiry found it already expired.
    if (
        review_due is not None
        and review_due <= at
        and review_due < expires_at
        and settings.REVIEW_DEFAULT_RULE == "revoke"
    ):
        return Reason.GRANT_REVOKED
    if expires_at <= at:
        return Reason.GRANT_EXPIRED
    if starts_at > at:
        return Reason.GRANT_NOT_STARTED
    return None


def _task_open_at(starts: int | None, ends: int | None, closed: int | None, at: datetime) -> bool:
    """models.tasks.window_open_at on a task row's raw times (db.query's microseconds)."""
    times = (None if v is None else db.from_us(v) for v in (starts, ends, closed))
    return window_open_at(*times, at)


# Most specific first when several matching grants are dead for different reasons.
_DEAD_PRECEDENCE = (
    Reason.DELEGATION_OUTSIDE_PARENT,
    Reason.GRANT_REVOKED,
    Reason.GRANT_EXPIRED,
    Reason.GRANT_NOT_STARTED,
)


@dataclass(frozen=True)
class PastState:
    """Which agents were suspended and which tools quarantined at a past moment, and what
    the grants narrowed since held then. The rows say only how they are now; a report
    about that moment builds this from the audit log (services.reports.state_at) and
    hands it to grant_dead_reason()."""

    suspended_agents: frozenset[int] = frozenset()
    quarantined_tools: frozenset[int] = frozenset()
    # (actions, scope) at the moment, by grant id, of each grant narrowed after it (its
    # first grant.narrowed event's `before`); any other grant holds what its row says.
    # A delegation is checked against its ancestors' shapes then: narrowing a parent
    # later (and revoking what no longer fits, then) does not make it outside its parent
    # before the narrowing.
    shapes: Mapping[int, tuple[frozenset[str], str]] = field(default_factory=dict, hash=False)

    def shape(
        self, grant_id: int, actions: frozenset[str], scope: str
    ) -> tuple[frozenset[str], str]:
        """What the grant held at the moment; `actions` and `scope`: what its row says."""
        return self.shapes.get(grant_id, (actions, scope))


def _ancestor_rows(parent_id: int) -> list[tuple[Any, ...]]:
    """Each grant up a delegation chain from `parent_id`, nearest first: its window,
    its holder's status and id, its review due date, what it holds, its holder's
    parent and its id (_ANCESTORS_QUERY)."""
    kinds = "sttts" + "it" + "iissi" + "i"
    return db.query(_ANCESTORS_QUERY[db.connection.vendor], [parent_id], kinds)


@dataclass(frozen=True)
class _Held:
    """What a delegated grant holds, to be within the grant above it: its holder's parent
    agent (who must hold that one), tool, task, actions and scope (for a call, the one
    action and the resource it is on)."""

    holder_parent: int | None
    tool_id: int
    task_id: int | None
    actions: frozenset[str]
    scope: str


def ancestor_agents(parent_id: int | None) -> list[int]:
    """The agents holding each grant up a delegation chain from `parent_id`, nearest
    first (none for a grant that was not delegated)."""
    return [] if parent_id is None else [row[5] for row in _ancestor_rows(parent_id)]


_PARENTS_QUERY = f"WITH RECURSIVE {_TREE_UP} SELECT id FROM tree WHERE depth > 1 ORDER BY depth"


def parent_agents(agent_id: int) -> list[int]:
    """Every agent above this one in the agent tree, nearest first."""
    return [row[0] for row in db.query(_PARENTS_QUERY, [agent_id], "i")]


def binding_agents(agent_id: int, delegated: list[int]) -> list[int]:
    """The agents whose deny policies bind this agent's calls under a grant whose
    delegation chain is held by `delegated`: those, and every agent above it in the
    tree (a subagent never makes a call its parent is refused, whichever grant it
    holds), once each."""
    found = dict.fromkeys([*delegated, *parent_agents(agent_id)])
    found.pop(agent_id, None)
    return list(found)


def _ancestors_reason(
    rows: list[tuple[Any, ...]], at: int, below: _Held, past: PastState | None = None
) -> Reason | None:
    """Why a delegated grant is dead because of an ancestor (`rows`: _ancestor_rows),
    or None. An ancestor that was refused, or whose agent is suspended, cuts the chain:
    `grant_revoked`. Each link holds no more than the one above it (`below`: what the
    grant under the chain holds): held by that grant's holder's parent, on its tool and
    task, with its actions and within its scope. grant_delegate and grant_narrow keep
    it so; a row written around them (an UPDATE, a repointed delegated_from) that is
    wider is `delegation_outside_parent`, whatever the database let through. `past`:
    `at` is a past moment; each link holds what it held then (PastState.shapes)."""
    for row in rows:
        status, starts, expires, revoked, agent_status, agent_id, review_due = row[:7]
        tool_id, task_id, actions, scope, holder_parent, grant_id = row[7:]
        held = frozenset(_json_list(actions))
        if past is not None:
            held, scope = past.shape(grant_id, held, scope)
        if (
            agent_id != below.holder_parent
            or (tool_id, task_id) != (below.tool_id, below.task_id)
            or not below.actions <= held
            or not pattern_within(below.scope, scope)
        ):
            return Reason.DELEGATION_OUTSIDE_PARENT
        below = _Held(holder_parent, tool_id, task_id, held, scope)
        if (agent_id in past.suspended_agents) if past else agent_status != "active":
            return Reason.GRANT_REVOKED
        reason = _window_reason(status, starts, expires, revoked, at, review_due)
        if reason is not None:
            return Reason.GRANT_REVOKED if reason == Reason.NO_GRANT else reason
    # The chain's root (the farthest row) was not delegated: its holder's own grant. A
    # subagent's own grant counts for nothing (authorize), so it has nothing to hand
    # down: the links checked above each other, a delegation from it was still live.
    if rows and below.holder_parent is not None:
        return Reason.DELEGATION_OUTSIDE_PARENT
    return None


_GRANT_COLUMNS = """
SELECT g.status, g.starts_at, g.expires_at, g.revoked_at, g.delegated_from_id,
       a.status, t.definition_hash = t.approved_hash,
       k.id, k.starts_at, k.ends_at, k.closed_at, g.agent_id, g.tool_id, g.scope, {actions},
       {review_due}, a.parent_id, {opener_active}, g.id
FROM governance_grant g
JOIN governance_agent a ON a.id = g.agent_id
JOIN governance_tool t ON t.id = g.tool_id
LEFT JOIN governance_task k ON k.id = g.task_id
WHERE g.id {{where}}
"""
_GRANT_QUERY = {
    "postgresql": _GRANT_COLUMNS.format(
        actions="g.actions::text",
        review_due=_REVIEW_DUE.format(grant="g"),
        opener_active=_OPENER_ACTIVE,
    ),
    "sqlite": _GRANT_COLUMNS.format(
        actions="g.actions",
        review_due=_REVIEW_DUE.format(grant="g"),
        opener_active=_OPENER_ACTIVE,
    ),
}
_GRANT_KINDS = "stttisb" + "ittt" + "ii" + "ss" + "t" + "ib" + "i"
_BATCH = 500  # grants per query in grant_dead_reasons


def _grant_rows(ids: Sequence[int]) -> list[tuple[Any, ...]]:
    where = "= %s" if len(ids) == 1 else f"IN ({', '.join(['%s'] * len(ids))})"
    return db.query(_GRANT_QUERY[db.connection.vendor].format(where=where), list(ids), _GRANT_KINDS)


_TASK_QUERY = "SELECT k.starts_at, k.ends_at, k.closed_at FROM governance_task k WHERE k.key = %s"


def _named_task_reason(task: str, at: datetime) -> Reason | None:
    """Why a call named under `task` is refused at `at` whatever grant it uses (authorize
    step 4: the task exists and is open), or None."""
    found = db.query(_TASK_QUERY, [task], "ttt")
    if not found:
        return Reason.TASK_UNKNOWN
    if not _task_open_at(*found[0], at):
        return Reason.TASK_CLOSED
    return None


def _grant_dead(
    grant_id: int, at: datetime, past: PastState | None, task: str | None = None
) -> tuple[Reason | None, tuple[Any, ...] | None]:
    """grant_dead_reason()'s answer, and the grant's row (None if there is none)."""
    rows = _grant_rows([grant_id])
    if not rows:
        return Reason.NO_GRANT, None
    # The named task matters only to a grant bound to no task (row[7]: its task).
    named = _named_task_reason(task, at) if task is not None and rows[0][7] is None else None
    return _row_dead(rows[0], at, past, named), rows[0]


def _row_dead(
    row: tuple[Any, ...], at: datetime, past: PastState | None, named: Reason | None
) -> Reason | None:
    """_grant_dead() for a grant's row; `named`: _named_task_reason() of the task the
    question is about, None if there is none or it is open."""
    status, starts, expires, revoked, parent_id, agent_status, approved = row[:7]
    task_id, task_starts, task_ends, task_closed, agent_id, tool_id = row[7:13]
    if parent_id is None and row[16] is not None:
        return Reason.NO_GRANT  # a subagent's own grant counts for nothing (authorize)
    if past is not None:
        agent_status = "suspended" if agent_id in past.suspended_agents else "active"
        approved = tool_id not in past.quarantined_tools
    if agent_status != "active":
        return Reason.AGENT_SUSPENDED
    if not approved:
        return Reason.TOOL_QUARANTINED
    if task_id is not None:
        if not _task_open_at(task_starts, task_ends, task_closed, at):
            return Reason.TASK_CLOSED
    elif named is not None:
        # A grant bound to no task serves calls under any task, each only while that
        # task is open (authorize step 4, before the grant's window is looked at).
        return named
    at_us = db.to_us(at)
    reason = _window_reason(status, starts, expires, revoked, at_us, row[15])
    if reason is None and past is None and not row[17]:
        # Break-glass whose opener is deactivated now. A past moment's report has
        # already left out one whose opener was inactive then: selectors.live_grants
        # reads accounts as they were (their person.* events).
        reason = Reason.GRANT_REVOKED
    if reason is None and parent_id is not None:
        actions, scope = frozenset(_json_list(row[14])), row[13]
        if past is not None:
            actions, scope = past.shape(row[18], actions, scope)
        held = _Held(row[16], tool_id, task_id, actions, scope)
        reason = _ancestors_reason(_ancestor_rows(parent_id), at_us, held, past)
    return reason


def grant_dead_reasons(
    grant_ids: Iterable[int],
    at: datetime,
    past: PastState | None = None,
    *,
    task: str | None = None,
) -> dict[int, Reason | None]:
    """grant_dead_reason() for many grants at once (an access report's rows): their rows
    read _BATCH at a time, not one query each, by the same rules (_row_dead)."""
    ids = list(dict.fromkeys(grant_ids))
    named = _named_task_reason(task, at) if task is not None else None
    found: dict[int, Reason | None] = dict.fromkeys(ids, Reason.NO_GRANT)
    for start in range(0, len(ids), _BATCH):
        for row in _grant_rows(ids[start : start + _BATCH]):
            found[row[18]] = _row_dead(row, at, past, named)
    return found


def grant_dead_reason(
    grant_id: int, at: datetime, past: PastState | None = None, *, task: str | None = None
) -> Reason | None:
    """None if the grant could allow something at `at`, else the reason it cannot.

    Used where the question is about a grant rather than a call (delegation, the
    access reports): the same window, task and ancestor rules as authorize(), in the
    same module. A grant bound to a task is dead once the task is not open (closed, or
    past its ends_at even before the job closes it); its delegations carry the same task.
    `past`: `at` is a past moment, and agent and tool state, and what a delegation and
    the grants above it held, are as they were then. `task`: the question is about
    calls under this task (a report narrowed to it): a grant bound to no task serves
    them only while it exists and is open.
    """
    return _grant_dead(grant_id, at, past, task)[0]


def call_dead_reason(
    grant_id: int, *, action: str, scope: str, task: str | None, at: datetime
) -> Reason | None:
    """None if the grant could still allow this very call at `at`, else why not: what
    a call allowed once and still under way (a sandbox run, from its allow to its end)
    must go on satisfying. grant_dead_reason()'s rules, and the grant still holds the
    action and covers the resource (a narrowing takes effect at once), and the task the
    call was made under is still open."""
    dead, row = _grant_dead(grant_id, at, None)
    if dead is not None or row is None:
        return dead
    pattern, actions = row[13:15]
    if action not in _json_list(actions):
        return Reason.NO_GRANT
    if not (resource_is_canonical(scope) and _pattern_ok(pattern) and _covers(pattern, scope)):
        return Reason.SCOPE_MISMATCH
    # A grant bound to a task allows calls under that task only, and _grant_dead has
    # just checked it: the task is read again only for a grant without one.
    if task and row[7] is None:
        return _named_task_reason(task, at)
    return None


def _json_list(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, str):
        value = json.loads(value)
    return list(value)


def _fields_ok(granted: list[str], arguments: Mapping[str, Any] | None) -> bool:
    """A field-limited grant covers a call only if the call names its fields."""
    if not granted:
        return True
    requested = (arguments or {}).get("fields")
    if not isinstance(requested, list) or not requested:
        return False
    return all(isinstance(f, str) and f in granted for f in requested)


def _validate(
    agent: str, tool: Any, action: Any, scope: Any, task: Any, arguments: Any, approval: Any
) -> str | None:
    if not isinstance(agent, str) or not agent or len(agent) > MAX_NAME_LEN:
        return "agent must be a non-empty name"
    if not isinstance(tool, str) or not tool or len(tool) > MAX_NAME_LEN:
        return "tool must be a non-empty name of at most 100 characters"
    if action not in ACTION_VALUES:
        return f"action must be one of {', '.join(sorted(ACTION_VALUES))}"
    if not isinstance(scope, str) or not scope or len(scope) > MAX_SCOPE_LEN:
        return "scope must be a non-empty resource of at most 500 characters"
    if task is not None and (not isinstance(task, str) or not task or len(task) > MAX_NAME_LEN):
        return "task must be a task key or null"
    if arguments is not None and not isinstance(arguments, Mapping):
        return "arguments must be an object or null"
    if approval is not None and not isinstance(approval, str):
        return "approval must be an approval id or null"
    for name, value in (("tool", tool), ("scope", scope), ("task", task), ("approval", approval)):
        if value is not None and not is_text(value):  # storable: the question is on record
            return f"{name} holds a NUL byte or text that is not UTF-8"
    return None


def authorize(
    *,
    agent: Any,
    tool: str,
    action: str,
    scope: str,
    at: datetime,
    task: str | None = None,
    arguments: Mapping[str, Any] | None = None,
    approval: str | None = None,
) -> Decision:
    """Answer one access question as of `at`. Never raises; errors deny."""
    try:
        return _authorize(
            agent=agent.name if hasattr(agent, "name") else agent,
            tool=tool,
            action=action,
            scope=scope,
            at=at,
            task=task,
            arguments=arguments,
            approval=approval,
        )
    except Exception:
        log.exception("authorize() failed; denying")
        return _deny(Reason.ERROR, "The decision could not be made, so access is denied.")


def _authorize(
    *,
    agent: str,
    tool: str,
    action: str,
    scope: str,
    at: datetime,
    task: str | None,
    arguments: Mapping[str, Any] | None,
    approval: str | None,
) -> Decision:
    if at.tzinfo is None:
        raise ValueError("authorize() needs an aware `at`")
    # 0. Well-formed question. Before touching the database.
    problem = _validate(agent, tool, action, scope, task, arguments, approval)
    if problem:
        return _deny(Reason.INVALID_REQUEST, problem)
    try:
        args_hash = arguments_digest(arguments)
    except (TypeError, ValueError):
        return _deny(Reason.INVALID_REQUEST, "arguments must be plain JSON values")

    at_us = db.to_us(at)
    rows = db.query(
        _MAIN_QUERY[db.connection.vendor], [action, agent, tool, task or "", action], _MAIN_KINDS
    )
    first = rows[0]
    agent_id, agent_status, tool_id, tool_has_action, irreversible, approved = first[:6]
    task_id, task_starts, task_ends, task_closed = first[6:10]
    ctx: dict[str, Any] = {
        "agent_id": agent_id,
        "tool_id": tool_id,
        "arguments_hash": args_hash,
        "seen_seq": first[20] or 0,
    }

    # 1. The agent exists and is not suspended (the kill switch).
    if agent_id is None:
        return _deny(Reason.UNKNOWN_AGENT, f"No agent is named {agent!r}.", **ctx)
    if agent_status != "active":
        return _deny(Reason.AGENT_SUSPENDED, "The agent is suspended.", **ctx)
    # 2. The tool is in the inventory, byte for byte, and its definition is approved.
    if tool_id is None:
        return _deny(Reason.UNKNOWN_TOOL, "The tool is not in the inventory.", **ctx)
    if not approved:
        return _deny(
            Reason.TOOL_QUARANTINED,
            "The tool's definition changed and awaits re-approval by an admin.",
            **ctx,
        )
    # 3. The tool can do this kind of thing at all.
    if not tool_has_action:
        return _deny(Reason.ACTION_NOT_SUPPORTED, f"The tool does not support {action!r}.", **ctx)
    # 4. The task, when named, exists and is open at `at`.
    if task is not None:
        if task_id is None:
            return _deny(Reason.TASK_UNKNOWN, f"No task has the key {task!r}.", **ctx)
        ctx["task_id"] = task_id
        if not _task_open_at(task_starts, task_ends, task_closed, at):
            return _deny(Reason.TASK_CLOSED, "The task is not open.", **ctx)
    # 5. The resource is canonical: one spelling per resource.
    if not resource_is_canonical(scope):
        return _deny(
            Reason.SCOPE_MISMATCH,
            "The scope is not a canonical resource (no '..', '%', '\\\\', '*', empty "
            "segments or non-ASCII characters).",
            **ctx,
        )

    # 6. A grant for this agent, tool, action and task covers the resource and
    #    is live at `at` (own window and every delegation ancestor's). The rows
    #    are the agent's grants on this tool that hold the action.
    applicable = False
    in_scope_dead: dict[Reason, int] = {}  # why a covering grant is dead: the first such
    live: tuple[Any, ...] | None = None
    own_grant = False  # a subagent's grant that was not delegated to it (not counted)
    above: list[int] = []  # the live grant's ancestors' agents (the gate's deny policies)
    for row in rows:
        g_id, g_task, g_scope, g_fields, g_status, g_starts, g_expires, g_revoked = row[10:18]
        if g_id is None:
            continue
        if g_task is not None and g_task != ctx.get("task_id"):
            continue
        if row[18] is None and first[22] is not None:
            # A subagent holds only what its parent delegates (Agent): a grant of its
            # own (made before that rule, or written around the services) counts for
            # nothing.
            own_grant = True
            continue
        applicable = True
        # `scope` was found canonical above: only the pattern needs checking.
        covered = _pattern_ok(g_scope) and _covers(g_scope, scope)
        if not covered or (g_fields and not _fields_ok(_json_list(g_fields), arguments)):
            continue
        reason = _window_reason(g_status, g_starts, g_expires, g_revoked, at_us, row[21])
        if reason is None and not row[23]:
            reason = Reason.GRANT_REVOKED  # break-glass whose opener is deactivated
        chain: list[tuple[Any, ...]] = []
        if reason is None and row[18] is not None:
            chain = _ancestor_rows(row[18])
            held = _Held(first[22], tool_id, g_task, frozenset([action]), scope)
            reason = _ancestors_reason(chain, at_us, held)
        if reason is None:
            live, above = row, [ancestor[5] for ancestor in chain]
            break
        in_scope_dead.setdefault(reason, g_id)
        # A denial because a break-glass grant ended still touches break-glass: say so.
        ctx["break_glass"] = ctx.get("break_glass", False) or bool(row[19])

    if live is None:
        if not applicable:
            message = f"No grant gives {action!r} on this tool."
            if own_grant:
                message += " A subagent holds only grants its parent delegated to it."
            return _deny(Reason.NO_GRANT, message, **ctx)
        if not in_scope_dead:
            return _deny(Reason.SCOPE_MISMATCH, "No grant covers this resource.", **ctx)
        reason = next(r for r in _DEAD_PRECEDENCE if r in in_scope_dead)
        dead = in_scope_dead[reason]
        message = f"The matching grant #{dead} is not live ({reason})."
        return _deny(reason, message, dead_grant_id=dead, **ctx)

    ctx.update(grant_id=live[10], expires_at=db.from_us(live[16]), break_glass=bool(live[19]))
    # 7. Destructive actions pass the confirmation gate, even with a grant.
    destructive = bool(irreversible) or action == ActionClass.DELETE
    if not destructive:
        return Decision(Verdict.ALLOW, Reason.ALLOWED, "Allowed by a live grant.", **ctx)
    ctx["destructive"] = True
    # A confirmation policy may answer for a person: a deny wins over everything (an
    # approval included), an approve stands in for one when none is named.
    verdicts = _policy_verdicts(
        agent_id,
        tool_id,
        ctx["grant_id"],
        action,
        scope,
        ctx.get("task_id"),
        at,
        binding_agents(agent_id, above),
    )
    denying = [pid for pid, verdict in verdicts if verdict == "deny"]
    if denying:
        return _deny(
            Reason.APPROVAL_DENIED,
            f"Confirmation policy #{denying[0]} denies this call.",
            policy_id=denying[0],
            **ctx,
        )
    if approval is None:
        if verdicts:
            return Decision(
                Verdict.ALLOW,
                Reason.ALLOWED,
                f"Allowed once by confirmation policy #{verdicts[0][0]}.",
                policy_id=verdicts[0][0],
                **ctx,
            )
        return Decision(
            Verdict.APPROVAL_REQUIRED,
            Reason.APPROVAL_REQUIRED,
            "This action is destructive: a human or policy must approve this exact call.",
            **ctx,
        )
    try:
        approval_uuid = str(uuid.UUID(approval))
    except ValueError:
        return _deny(Reason.APPROVAL_INVALID, "The approval id is not valid.", **ctx)
    # Scoped to the asking agent: another agent's approval id must look exactly
    # like one that does not exist (no oracle for other agents' approvals).
    found = db.execute(_APPROVAL_QUERY, [db.param_uuid(approval_uuid), agent_id])
    if not found:
        return _deny(Reason.APPROVAL_INVALID, "No such approval.", **ctx)
    _, ap_agent, ap_tool, ap_action, ap_scope, ap_hash, ap_status, ap_expires = found[0][:8]
    ap_task, ap_grant, ap_decider, ap_requested, ap_decider_may_approve = found[0][8:]
    ctx["approval_id"] = approval_uuid
    expires = db.read_dt(ap_expires)
    bound = (
        ap_agent == agent_id
        and ap_tool == tool_id
        and ap_action == action
        and ap_scope == scope
        and ap_hash == args_hash
        and ap_task == ctx.get("task_id")
        # Under the grant it was asked for: the approver was checked against that
        # grant's people, and a call now running under another grant needs a new look.
        and ap_grant == ctx["grant_id"]
    )
    if not bound:
        return _deny(Reason.APPROVAL_INVALID, "The approval is for a different call.", **ctx)
    if ap_status != "approved" or expires is None or expires <= at:
        return _deny(
            Reason.APPROVAL_INVALID, f"The approval is not usable (status {ap_status}).", **ctx
        )
    # The person who confirmed it has been deactivated or lost the approver role since (a
    # departed or compromised account, a role taken away): their confirmation goes with
    # their authority.
    if ap_decider is not None and not ap_decider_may_approve:
        return _deny(
            Reason.APPROVAL_INVALID,
            "The person who approved this call has since been deactivated or is no longer "
            "an approver; it needs a new approval.",
            **ctx,
        )
    # The person who confirmed the call was checked for a stake when they decided. One
    # taken since (they own the agent now, or issued themselves a token for it, even one
    # revoked again) would let them make the call they confirmed: a new look is needed.
    # The rule approve policies follow (stake_check), from when the call was asked.
    if ap_decider is not None and stake_check(agent_id, ctx["grant_id"])(
        ap_decider, db.read_dt(ap_requested), at
    ):
        return _deny(
            Reason.APPROVAL_INVALID,
            "The person who approved this call has since taken a stake in the agent; "
            "it needs a new approval.",
            **ctx,
        )
    return Decision(Verdict.ALLOW, Reason.ALLOWED, "Allowed once by an approval.", **ctx)


# --- The checklist, as data (for "why" pages) ----------------------------------------
# The same steps _authorize() walks, in the same order, each with the reasons it can
# answer. The UI's explain and what-if pages show a decision against this list: the
# steps before the one that answered passed, that one decided, the rest never ran.
# Kept beside _authorize() so a new check is added to both in one place.
CHECKLIST: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("request", "The question is well-formed", (Reason.INVALID_REQUEST,)),
    (
        "agent",
        "The agent exists and is active (not suspended)",
        (Reason.UNKNOWN_AGENT, Reason.AGENT_SUSPENDED),
    ),
    (
        "tool",
        "The tool is in the inventory and its definition is approved",
        (Reason.UNKNOWN_TOOL, Reason.TOOL_QUARANTINED),
    ),
    ("action", "The tool supports the action", (Reason.ACTION_NOT_SUPPORTED,)),
    ("task", "The task, if named, exists and is open", (Reason.TASK_UNKNOWN, Reason.TASK_CLOSED)),
    ("resource", "The resource is canonical", ()),
    (
        "grant",
        "A live grant for this agent, tool, action and task covers the resource",
        (
            Reason.NO_GRANT,
            Reason.SCOPE_MISMATCH,
            Reason.GRANT_NOT_STARTED,
            Reason.GRANT_EXPIRED,
            Reason.GRANT_REVOKED,
        ),
    ),
    (
        "gate",
        "A destructive action carries a matching, unused, unexpired approval, or a "
        "confirmation policy approves it (a policy's deny wins)",
        (
            Reason.APPROVAL_REQUIRED,
            Reason.APPROVAL_INVALID,
            Reason.APPROVAL_DENIED,
            Reason.APPROVAL_BACKLOG,
        ),
    ),
)


def deciding_step(reason: str, scope: str) -> str | None:
    """Which CHECKLIST step produced `reason` (None: allowed, or an error).

    scope_mismatch comes from two steps: the resource itself is not canonical
    (step "resource"), or no grant's pattern covers it (step "grant").
    """
    if reason == Reason.SCOPE_MISMATCH and not resource_is_canonical(scope):
        return "resource"
    for key, _label, reasons in CHECKLIST:
        if reason in reasons:
            return key
    return None
