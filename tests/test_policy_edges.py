"""authorize() at the edges a mutation run found untested: each test here passes on
governance/policy.py and fails on a one-token change of it that the other decision
tests let through (the run: /tmp/scratch_polmut, named in each test's comment).

Decisions are asked through access_check() and checked with the audit event they
wrote; the pure functions (pattern_within, scope_matches) as tables."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest

from governance.audit import Actor
from governance.codes import Reason
from governance.models import Agent, AuditEvent, Grant
from governance.policy import PastState, grant_dead_reason, pattern_within
from governance.services import access, grants
from tests.conftest import MS, NOW

S = NOW - timedelta(minutes=30)
E = NOW + timedelta(minutes=30)


def event_of(decision: Any) -> AuditEvent:
    """The decision's own event, the newest in the log."""
    event = AuditEvent.objects.order_by("-seq").first()
    assert event is not None and str(event.uid) == decision.decision_id
    return event


def assert_denied(decision: Any, reason: str, dead: int | None = None) -> None:
    assert (decision.decision, decision.reason) == ("deny", reason), decision.message
    assert decision.grant_id is None and decision.dead_grant_id == dead
    event = event_of(decision)
    assert (event.event_type, event.decision, event.reason) == ("access.denied", "deny", reason)
    assert json.loads(event.data) == ({"grant_not_live": dead} if dead else {})


def assert_allowed(decision: Any, grant: Grant) -> None:
    assert (decision.decision, decision.reason, decision.grant_id) == ("allow", "allowed", grant.pk)
    event = event_of(decision)
    assert (event.event_type, event.reason, event.grant_id) == (
        "access.allowed",
        "allowed",
        grant.pk,
    )


# --- pattern_within / scope_matches: the edges -------------------------------------------

WITHIN = [
    # A literal last segment is not a trailing `*` (mutants W1, W6).
    ("repo:acme/api/x", "repo:acme/api", False),
    ("repo:acme/web", "repo:acme/api", False),
    # A trailing `*` needs a segment: the parent itself is not under it (W2).
    ("repo:acme/api", "repo:acme/api/*", False),
    # Shorter than the outer pattern, which asks for more segments (W3: an IndexError).
    ("repo:acme/x", "repo:acme/*/src", False),
    ("repo:acme", "repo:acme/*/src", False),
    # Another kind is never within (W8); an invalid inner pattern never is (W11).
    ("git:acme/api/x", "repo:acme/api/*", False),
    ("repo:acme/api/../x", "repo:acme/api/*", False),
    ("repo:acme/api/a*", "repo:acme/api/*", False),
    # `*` under a literal segment is wider than the literal (W5, W12).
    ("repo:acme/*/src", "repo:acme/api/src", False),
    ("repo:acme/*/src", "repo:acme/*/src", True),
    ("repo:acme/api/src", "repo:acme/api/src", True),
    # A bare `*` is within nothing but `*`, kind or none.
    ("*", "acme/*", False),
    ("*", "*/x", False),
    ("*", "*", True),
    ("acme/x", "*/x", True),
]


@pytest.mark.parametrize(("inner", "outer", "expected"), WITHIN)
def test_pattern_within_at_its_edges(inner, outer, expected):
    assert pattern_within(inner, outer) is expected


# --- Reason precedence ---------------------------------------------------------------


@pytest.fixture
def bot(make_agent, make_tool) -> Any:
    return make_agent("bot"), make_tool("repo", actions=("read", "update", "delete"))


def ask(at: Any = NOW, **kw: Any) -> Any:
    question = {"agent": "bot", "tool": "repo", "action": "read", "scope": "repo:acme/api/x"}
    return access.access_check(at=at, **{**question, **kw})


@pytest.mark.parametrize(
    ("dead", "answer"),
    [(("revoked", "expired"), "revoked"), (("expired", "not_started"), "expired")],
    ids=["revoked_over_expired", "expired_over_not_started"],
)
def test_among_covering_grants_dead_for_different_reasons_precedence_names_one(
    bot, make_grant, system, dead, answer
):
    """Two grants cover the call, each dead for its own reason: revoked wins over
    expired, expired over not started, whichever is older (mutants T14, T15)."""
    agent, repo = bot
    made = {}
    for why in dead:  # the first made has the lower id: the order candidates are read in
        if why == "expired":
            made[why] = make_grant(agent, repo, starts_at=S, duration=timedelta(minutes=10))
        elif why == "not_started":
            made[why] = make_grant(agent, repo, starts_at=NOW + timedelta(hours=1))
        else:
            made[why] = make_grant(agent, repo, starts_at=S)
            grants.grant_revoke(grant_id=made[why].pk, reason="x", actor=system, at=NOW - MS)
    reason = {"revoked": "grant_revoked", "expired": "grant_expired"}[answer]
    assert_denied(ask(), reason, made[answer].pk)


# --- Tasks ---------------------------------------------------------------------------


def test_a_task_bound_grant_serves_no_call_that_names_no_task(bot, make_grant, make_task):
    """A grant bound to a task allows calls under that task only: a call naming no task
    is not one of them (mutant K3)."""
    agent, repo = bot
    task = make_task("T-1")
    bound = make_grant(agent, repo, ("update",), "repo:acme/api/*", task=task, starts_at=S)
    assert_allowed(ask(action="update", task="T-1"), bound)
    refused = ask(action="update")
    assert_denied(refused, "no_grant")
    assert refused.task_id is None and event_of(refused).task == ""


# --- The delegation chain --------------------------------------------------------------


@pytest.fixture
def chain(make_agent, make_tool, make_grant, settings) -> Any:
    """lead -> helper -> helper2 -> helper3, each holding read on a narrower scope,
    delegated down the agent tree."""
    settings.DELEGATION_MAX_DEPTH = 4
    repo = make_tool("repo", actions=("read", "update"))
    lead = make_agent("lead")
    agents_, links = [lead], []
    grant = make_grant(lead, repo, ("read",), "repo:acme/*", starts_at=S, duration=E - S,
                       delegable=True)  # fmt: skip
    links.append(grant)
    for depth, name in enumerate(("helper", "helper2", "helper3"), start=1):
        child = make_agent(name, parent=agents_[-1])
        grant = grants.grant_delegate(
            parent_grant_id=grant.pk, child=child, actions=["read"],
            scope="repo:acme/" + "/".join(["x"] * depth) + "/*", expires_at=E,
            justification="narrower", actor=Actor.agent(agents_[-1]), at=S + depth * MS,
            delegable=depth < 3,
        )  # fmt: skip
        agents_.append(child)
        links.append(grant)
    return agents_, links


def ask_helper3(at: Any = NOW) -> Any:
    return access.access_check(
        agent="helper3", tool="repo", action="read", scope="repo:acme/x/x/x/1", at=at
    )


def test_every_link_of_a_four_level_chain_is_checked(chain):
    """Each link is checked against the one above it and each ancestor's holder must be
    active: the root's holder cut off (its row written around the services, which would
    have suspended the whole tree) ends the grant three links down (mutants D5, D10,
    D11: the middle links compared with the wrong `below`, only the nearest ancestor
    walked, a chain query cut at depth 2)."""
    agents_, links = chain
    assert_allowed(ask_helper3(), links[3])
    Agent.objects.filter(pk=agents_[0].pk).update(status="suspended")
    assert_denied(ask_helper3(NOW + MS), "grant_revoked", links[3].pk)
    assert grant_dead_reason(links[3].pk, NOW + MS) == Reason.GRANT_REVOKED


@pytest.mark.parametrize("status", ["denied", "pending"])
def test_a_delegation_whose_ancestor_row_is_no_grant_allows_nothing(chain, status):
    """An ancestor whose row says it was never granted (denied, or still a request:
    written around the services) cuts the chain, window or not (mutants T1, T2)."""
    _agents, links = chain
    Grant.objects.filter(pk=links[1].pk).update(status=status)
    assert_denied(ask_helper3(), "grant_revoked", links[3].pk)
    assert grant_dead_reason(links[3].pk, NOW) == Reason.GRANT_REVOKED
    assert grant_dead_reason(links[1].pk, NOW) == Reason.NO_GRANT


def test_a_report_about_a_moment_an_ancestor_was_suspended_finds_the_grant_dead(chain):
    """A past moment's answer reads the ancestor's suspension from the moment's state,
    not from the row as it is now (mutants D6, D7). Nothing is written."""
    agents_, links = chain
    before = AuditEvent.objects.count()
    then = PastState(suspended_agents=frozenset([agents_[1].pk]))
    assert grant_dead_reason(links[3].pk, NOW, then) == Reason.GRANT_REVOKED
    assert grant_dead_reason(links[3].pk, NOW, PastState()) is None
    assert AuditEvent.objects.count() == before


# --- Stakes: an approve policy never answers for its author's own stake ------------------


def approve_policy(author: Any, agent: Agent, tool: Any, at: Any) -> Any:
    from governance.services import confirmation

    return confirmation.policy_create(
        author=author, agent=agent, tool=tool, action="delete", scope="repo:acme/*",
        verdict="approve", reason="scratch space is disposable", duration=timedelta(hours=1),
        actor=Actor.user(author), at=at,
    )  # fmt: skip


def ask_delete(agent: str, scope: str) -> Any:
    return access.access_check(agent=agent, tool="repo", action="delete", scope=scope, at=NOW)


def assert_policy_allowed(decision: Any, policy: Any) -> None:
    assert (decision.decision, decision.reason, decision.policy_id) == (
        "allow",
        "allowed",
        policy.pk,
    )
    event = event_of(decision)
    assert (event.event_type, json.loads(event.data)) == (
        "access.allowed",
        {"confirmation_policy": policy.pk},
    )


def assert_asks_a_person(decision: Any) -> None:
    assert (decision.decision, decision.reason, decision.policy_id) == (
        "approval_required", "approval_required", None,
    )  # fmt: skip
    event = event_of(decision)
    assert (event.event_type, event.reason) == ("access.approval_required", "approval_required")
    assert event.approval_id == decision.approval_id


def test_an_approve_policy_does_not_answer_under_a_grant_its_author_asked_for_up_the_chain(
    make_agent, make_tool, make_grant, approvers
):
    """erin wrote an approve policy for sub's deletes; then asked for a grant for lead,
    sub's parent, which lead handed down to sub. Under that delegation she has a stake
    (the requester of a grant up its chain) and her policy does not answer; under lead's
    other grant it does (mutants G24, G27: requesters up the chain not counted)."""
    erin, frank, *_ = approvers
    repo = make_tool("repo")
    lead = make_agent("lead")
    sub = make_agent("sub", parent=lead)
    policy = approve_policy(erin, sub, repo, NOW - timedelta(minutes=25))
    theirs = make_grant(lead, repo, ("delete",), "repo:acme/a/*", starts_at=S, duration=E - S,
                        delegable=True)  # fmt: skip
    request = grants.grant_request(
        agent=lead, tool=repo, actions=["delete"], scope="repo:acme/b/*",
        duration=timedelta(hours=1), justification="b too", requested_by=erin, delegable=True,
        actor=Actor.user(erin), at=NOW - timedelta(minutes=20),
    )  # fmt: skip
    hers = grants.grant_approve(
        grant_id=request.pk, approver=frank, actor=Actor.user(frank),
        at=NOW - timedelta(minutes=20),
    )  # fmt: skip
    for parent, scope in ((theirs, "repo:acme/a/tmp/*"), (hers, "repo:acme/b/tmp/*")):
        grants.grant_delegate(
            parent_grant_id=parent.pk, child=sub, actions=["delete"], scope=scope,
            expires_at=NOW + timedelta(minutes=20), justification="tmp", actor=Actor.agent(lead),
            at=NOW - timedelta(minutes=15),
        )  # fmt: skip
    assert_policy_allowed(ask_delete("sub", "repo:acme/a/tmp/x"), policy)
    assert_asks_a_person(ask_delete("sub", "repo:acme/b/tmp/x"))


def test_an_approve_policy_does_not_answer_under_the_grant_that_ratifies_its_authors_break_glass(
    make_agent, make_tool, make_grant, approvers
):
    """erin wrote an approve policy for bot's deletes, then opened break-glass for bot;
    frank ratified it and grace approved the request it filed. Under that grant erin has
    a stake (it continues her break-glass) and her policy does not answer; under bot's
    other grant it does (mutant G23: the ratified break-glass not counted)."""
    from governance.services import breakglass

    erin, frank, grace, _ = approvers
    bot, repo = make_agent("bot"), make_tool("repo")
    other = make_grant(bot, repo, ("delete",), "repo:acme/web/*", starts_at=S, duration=E - S)
    policy = approve_policy(erin, bot, repo, NOW - timedelta(minutes=50))
    bg = breakglass.breakglass_open(
        opener=erin, agent=bot, tool=repo, actions=["delete"], scope="repo:acme/api/*",
        ticket="INC-42", reason="outage", actor=Actor.user(erin), at=NOW - timedelta(minutes=40),
    )  # fmt: skip
    bg = breakglass.breakglass_ratify(
        breakglass_id=bg.pk, reviewer=frank, comment="needed", actor=Actor.user(frank),
        at=NOW - timedelta(minutes=30), duration=timedelta(hours=2),
    )  # fmt: skip
    ratified = grants.grant_approve(
        grant_id=bg.ratified_request_id, approver=grace, actor=Actor.user(grace),
        at=NOW - timedelta(minutes=25),
    )  # fmt: skip
    breakglass.breakglass_close(
        breakglass_id=bg.pk, closed_by=frank, comment="over", actor=Actor.user(frank),
        at=NOW - timedelta(minutes=20),
    )  # fmt: skip
    assert_policy_allowed(ask_delete("bot", "repo:acme/web/x"), policy)
    under_ratified = ask_delete("bot", "repo:acme/api/x")
    assert_asks_a_person(under_ratified)
    assert under_ratified.grant_id == ratified.pk and other.pk != ratified.pk


def test_a_grant_handed_down_from_a_subagents_own_grant_allows_nothing(
    make_agent, make_tool, make_grant
):
    """mid held a grant of its own and handed it down to low; then mid was made a
    subagent of top (a row from before the rule, or written around the services). mid's
    own grant counts for nothing now, so it has nothing to hand down: low's delegation
    from it is outside its parent, as grant_delegate would have refused it."""
    repo = make_tool("repo")
    top, mid = make_agent("top"), make_agent("mid")
    low = make_agent("low", parent=mid)
    own = make_grant(mid, repo, ("read",), "repo:acme/*", starts_at=S, duration=E - S,
                     delegable=True)  # fmt: skip
    handed = grants.grant_delegate(
        parent_grant_id=own.pk, child=low, actions=["read"], scope="repo:acme/x/*",
        expires_at=E, justification="x", actor=Actor.agent(mid), at=S + MS,
    )  # fmt: skip
    ask_low = {"agent": "low", "tool": "repo", "action": "read", "scope": "repo:acme/x/1"}
    assert_allowed(access.access_check(**ask_low, at=NOW), handed)
    Agent.objects.filter(pk=mid.pk).update(parent=top)
    mids = access.access_check(agent="mid", tool="repo", action="read", scope="repo:acme/x/1",
                               at=NOW + MS)  # fmt: skip
    assert_denied(mids, "no_grant")
    assert_denied(access.access_check(**ask_low, at=NOW + MS), "delegation_outside_parent",
                  handed.pk)  # fmt: skip
    assert grant_dead_reason(handed.pk, NOW + MS) == Reason.DELEGATION_OUTSIDE_PARENT
