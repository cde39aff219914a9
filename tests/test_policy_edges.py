"""authorize() at the edges a mutation run found untested: each test here passes on
governance/policy.py and fails on a one-token change of it that the other decision
tests let through (the runs: /tmp/scratch_polmut and /tmp/scratch_polmut2; each test's
docstring names its mutants).

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
from tests.conftest import MS, NOW, accounts_changed_at

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


# --- Canonical resources: the edges of the rules ------------------------------------------


def test_a_resource_with_an_empty_ntfs_stream_type_is_not_canonical(bot, make_grant):
    """`x::y` holds `::`, an NTFS stream separator, though no `:$`: no canonical resource
    (the API's SCOPE_PATTERN says the same), even where a grant's pattern covers it
    as one segment (mutant S6: `::` allowed)."""
    agent, repo = bot
    make_grant(agent, repo, ("read",), "repo:acme/api/*", starts_at=S)
    assert_denied(ask(scope="repo:acme/api/x::y"), "scope_mismatch")
    assert_denied(ask(scope="repo:acme/api/x::"), "scope_mismatch")


def test_a_resource_of_exactly_the_longest_length_is_allowed_one_more_is_refused(bot, make_grant):
    """MAX_SCOPE_LEN (500) characters is a resource; 501 is a bad question (mutants S8,
    A17: the longest one refused)."""
    agent, repo = bot
    grant = make_grant(agent, repo, ("read",), "repo:acme/api/*", starts_at=S)
    longest = "repo:acme/api/" + "x" * (500 - len("repo:acme/api/"))
    assert len(longest) == 500
    allowed = ask(scope=longest)
    assert_allowed(allowed, grant)
    assert event_of(allowed).scope == longest
    assert_denied(ask(scope=longest + "x"), "invalid_request")


# --- Which grant answers when several could -----------------------------------------------


def test_the_oldest_covering_grant_answers_live_or_dead(bot, make_grant, system):
    """Of two live grants that cover the call the allow is under the older; of two
    expired ones the denial names the older (candidates read in id order, the first
    dead one of a reason kept: mutants A13, T17)."""
    agent, repo = bot
    older = make_grant(agent, repo, ("read",), "repo:acme/*", starts_at=S)
    newer = make_grant(agent, repo, ("read",), "repo:acme/api/*", starts_at=S)
    assert older.pk < newer.pk
    assert_allowed(ask(), older)
    # Both end: the answer names the older, each time.
    for grant in (older, newer):
        Grant.objects.filter(pk=grant.pk).update(expires_at=NOW)
    assert_denied(ask(NOW + MS), "grant_expired", older.pk)
    assert_denied(ask(NOW + 2 * MS), "grant_expired", older.pk)


# --- A grant's window to the microsecond --------------------------------------------------


def test_a_grant_is_live_from_its_start_instant_not_a_microsecond_before(bot, make_grant):
    """starts_at is the first live instant (mutant T5: live only after it)."""
    agent, repo = bot
    grant = make_grant(agent, repo, ("read",), "repo:acme/api/*", starts_at=NOW)
    assert_denied(ask(NOW - timedelta(microseconds=1)), "grant_not_started", grant.pk)
    assert_allowed(ask(NOW), grant)


# --- A subagent's own grant -----------------------------------------------------------------


def test_a_subagents_own_grant_is_no_grant_to_a_call_or_to_a_report(
    make_agent, make_tool, make_grant
):
    """A subagent's own grant (it got it before it was made one) counts for nothing: a
    call under it is no_grant, and asked about the grant rather than a call (a report,
    a delegation) it is no grant either (mutant D15: counted there)."""
    repo = make_tool("repo")
    lead, sub = make_agent("lead"), make_agent("sub")
    own = make_grant(sub, repo, ("read",), "repo:acme/*", starts_at=S)
    assert grant_dead_reason(own.pk, NOW) is None
    # Made a subagent since (a row from before the rule, or written around the services).
    Agent.objects.filter(pk=sub.pk).update(parent=lead)
    refused = access.access_check(
        agent="sub", tool="repo", action="read", scope="repo:acme/x", at=NOW
    )
    assert_denied(refused, "no_grant")
    assert grant_dead_reason(own.pk, NOW) == Reason.NO_GRANT


# --- A named approval: its approver's stake, and the policies beside it ----------------------


@pytest.fixture
def gated(bot, make_grant, bob) -> Any:
    """bot's delete of repo:acme/api/x asked at NOW (approval_required) and approved by
    bob, who has no stake in bot (alice owns it and asked for its grant)."""
    from governance.services import approvals

    agent, repo = bot
    grant = make_grant(agent, repo, ("delete",), "repo:acme/api/*", starts_at=S)
    asked = ask(action="delete")
    assert asked.decision == "approval_required" and asked.grant_id == grant.pk
    approvals.approval_approve(
        approval_id=asked.approval_id, approver=bob, actor=Actor.user(bob), at=NOW
    )
    return asked


def assert_approval_used(decision: Any, gated: Any) -> None:
    from governance.models import Approval

    assert (decision.decision, decision.reason, decision.approval_id, decision.policy_id) == (
        "allow", "allowed", gated.approval_id, None,
    )  # fmt: skip
    event = event_of(decision)
    assert (event.event_type, event.approval_id, json.loads(event.data)) == (
        "access.allowed", gated.approval_id, {},
    )  # fmt: skip
    assert Approval.objects.get(pk=gated.approval_id).status == "consumed"


# (issued, lifetime in days, revoked) relative to NOW, when the call was asked; the call
# with the approval is made at NOW + MS.
US = timedelta(microseconds=1)
TOKEN_TIMES = {
    # Issued and revoked again while the call waited: a stake (mutants G13, G14: held
    # only if still held when the call is made).
    "held_while_the_call_waited": (US, 1, 5 * US, True),
    # Created at the very instant the call is made: a stake then (mutant G16).
    "created_as_the_call_is_made": (MS, 1, None, True),
    # Expired, or revoked, at the very instant the call was asked: no stake over the
    # call's life (mutants G17, G18, G21).
    "expired_as_the_call_was_asked": (-timedelta(days=1), 1, None, False),
    "revoked_as_the_call_was_asked": (-timedelta(hours=1), 1, timedelta(0), False),
    # Created after the moment the call is made: no stake then (mutant G19).
    "created_after_the_call": (2 * MS, 1, None, False),
}


@pytest.mark.parametrize(("issued", "days", "revoked", "stake"), TOKEN_TIMES.values(),
                         ids=TOKEN_TIMES.keys())  # fmt: skip
def test_an_approvers_token_is_a_stake_only_if_held_from_the_call_being_asked_to_its_making(
    bot, gated, bob, system, issued, days, revoked, stake
):
    """bob approved bot's call; a token for bot he created stops the approval from
    allowing it if he held it at some moment from the call being asked (NOW) to its
    being made (NOW + MS): the token's bounds count to the microsecond."""
    from governance.models import Approval
    from governance.services import agents

    token, _ = agents.token_issue(created_by=bob, agent=bot[0], actor=system, at=NOW + issued,
                                  days=days)  # fmt: skip
    if revoked is not None:
        agents.token_revoke(token=token, actor=system, at=NOW + revoked)
    used = ask(NOW + MS, action="delete", approval=gated.approval_id)
    if not stake:
        assert_approval_used(used, gated)
        return
    assert (used.decision, used.reason, used.approval_id) == (
        "deny", "approval_invalid", gated.approval_id,
    )  # fmt: skip
    assert "since taken a stake" in used.message
    event = event_of(used)
    assert (event.event_type, event.reason, event.approval_id) == (
        "access.denied", "approval_invalid", gated.approval_id,
    )  # fmt: skip
    assert Approval.objects.get(pk=gated.approval_id).status == "approved"  # not used up


@pytest.mark.parametrize(
    "change", ["deactivated", "role_removed", "role_moved_to_admin", "restored"]
)
def test_an_approval_whose_approver_lost_their_authority_since_allows_nothing(
    bot, gated, bob, change
):
    """bob approved bot's call, then his account was deactivated (he left, or it was
    taken over) or the approver role was taken from him: what he confirmed goes with
    his authority, as an approve policy's does, and the approval stays unused for a new
    look. Moved to admins, or deactivated and reactivated, it is his again (within its
    TTL)."""
    from django.contrib.auth.models import Group

    from governance import roles
    from governance.models import Approval

    approvers = Group.objects.get(name=roles.APPROVERS)
    with accounts_changed_at(NOW):
        if change in ("deactivated", "restored"):
            bob.is_active = False
            bob.save()
        if change == "restored":
            bob.is_active = True
            bob.save()
        if change == "role_moved_to_admin":
            bob.groups.add(Group.objects.get_or_create(name=roles.ADMINS)[0])
        if change in ("role_removed", "role_moved_to_admin"):
            bob.groups.remove(approvers)
    used = ask(NOW + MS, action="delete", approval=gated.approval_id)
    if change in ("restored", "role_moved_to_admin"):
        assert_approval_used(used, gated)
        return
    assert (used.decision, used.reason, used.approval_id) == (
        "deny", "approval_invalid", gated.approval_id,
    )  # fmt: skip
    assert "since been deactivated or is no longer an approver" in used.message
    event = event_of(used)
    assert (event.event_type, event.reason, event.approval_id) == (
        "access.denied", "approval_invalid", gated.approval_id,
    )  # fmt: skip
    assert Approval.objects.get(pk=gated.approval_id).status == "approved"  # not used up


def test_a_named_approval_is_what_the_gate_checks_even_where_a_policy_would_approve(
    bot, gated, approvers
):
    """An approve policy stands in for a person only when the call names no approval.
    One that is named is checked and used up: a made-up id is refused, though the
    policy would have let the call through; bob's approval allows the call once and is
    consumed, the policy not recorded as its answer (mutant G47)."""
    agent, repo = bot
    erin = approvers[0]
    policy = approve_policy(erin, agent, repo, NOW)
    made_up = "00000000-0000-4000-8000-000000000000"
    refused = ask(NOW + MS, action="delete", approval=made_up)
    assert (refused.decision, refused.reason, refused.policy_id) == (
        "deny", "approval_invalid", None,
    )  # fmt: skip
    event = event_of(refused)
    assert (event.event_type, event.reason, event.approval_id) == (
        "access.denied", "approval_invalid", "",
    )  # fmt: skip
    assert_approval_used(ask(NOW + 2 * MS, action="delete", approval=gated.approval_id), gated)
    # With no approval named, the policy answers.
    assert_policy_allowed(ask(NOW + 3 * MS, action="delete"), policy)


def test_an_approval_of_one_action_is_not_used_for_another_under_the_same_grant(
    bot, make_tool, make_grant, bob
):
    """On an irreversible tool every action passes the gate: an approval bob gave to an
    update is refused for an execute with the same grant, resource and arguments, and
    stays unused for the update it was given to (mutant G5: the action not bound)."""
    from governance.models import Approval
    from governance.services import approvals

    agent = bot[0]
    deploy = make_tool("deploy", actions=("update", "execute"), irreversible=True)
    grant = make_grant(agent, deploy, ("update", "execute"), "repo:acme/api/*", starts_at=S)
    call = {"tool": "deploy", "arguments": {"ref": "v1"}}
    asked = ask(action="update", **call)
    assert (asked.decision, asked.grant_id) == ("approval_required", grant.pk)
    approvals.approval_approve(
        approval_id=asked.approval_id, approver=bob, actor=Actor.user(bob), at=NOW
    )
    other = ask(NOW + MS, action="execute", approval=asked.approval_id, **call)
    assert (other.decision, other.reason, other.message) == (
        "deny", "approval_invalid", "The approval is for a different call.",
    )  # fmt: skip
    event = event_of(other)
    assert (event.event_type, event.reason, event.action, event.approval_id) == (
        "access.denied", "approval_invalid", "execute", asked.approval_id,
    )  # fmt: skip
    assert Approval.objects.get(pk=asked.approval_id).status == "approved"
    assert_approval_used(ask(NOW + 2 * MS, action="update", approval=asked.approval_id, **call),
                         asked)  # fmt: skip


def test_a_deny_policy_binds_though_its_author_owns_the_agent_and_another_approves(
    make_agent, make_tool, make_grant, approvers
):
    """erin owns bot and forbids its deletes under repo:acme/*; frank's approve policy
    would let them through. Her stake bars her approving, never her denying: the deny
    wins (mutant G34: a stakeholder's deny dropped with her approves)."""
    from governance.services import confirmation

    erin, frank, *_ = approvers
    bot, repo = make_agent("bot", owner=erin), make_tool("repo")
    make_grant(bot, repo, ("delete",), "repo:acme/api/*", starts_at=S)
    deny = confirmation.policy_create(
        author=erin, agent=bot, tool=repo, action="delete", scope="repo:acme/*",
        verdict="deny", reason="freeze", duration=timedelta(hours=1), actor=Actor.user(erin),
        at=NOW - timedelta(minutes=10),
    )  # fmt: skip
    approve_policy(frank, bot, repo, NOW - timedelta(minutes=5))
    refused = ask_delete("bot", "repo:acme/api/x")
    assert (refused.decision, refused.reason, refused.policy_id) == (
        "deny", "approval_denied", deny.pk,
    )  # fmt: skip
    event = event_of(refused)
    assert (event.event_type, event.reason, json.loads(event.data)) == (
        "access.denied", "approval_denied", {"confirmation_policy": deny.pk},
    )  # fmt: skip


def test_a_field_limited_grant_does_not_cover_a_call_naming_an_empty_list_of_fields(
    bot, make_grant
):
    """A grant limited to some fields covers a call only if it names fields, each one of
    them: `"fields": []` names none (a tool may read it as "every field"), so it is
    refused as a call naming no fields is (mutant A7: an empty list accepted)."""
    agent, repo = bot
    grant = make_grant(agent, repo, ("read",), "repo:acme/api/*", fields=["name"], starts_at=S)
    assert_allowed(ask(arguments={"fields": ["name"]}), grant)
    for arguments in ({"fields": []}, {}):
        refused = ask(arguments=arguments)
        assert_denied(refused, "scope_mismatch")
        assert event_of(refused).arguments_hash == refused.arguments_hash


def test_a_delegation_outside_its_parent_is_named_before_an_expired_one(
    make_agent, make_tool, make_grant
):
    """sub holds two delegations covering the call: one from lead's grant on
    repo:acme/a/*, expired; one from lead's grant on repo:acme/*, since narrowed around
    the services to repo:acme/b/* (so the call is outside it). Outside its parent is
    the more specific reason: the denial names that one, though the expired one is
    older (mutant T16: outside-parent last in the precedence)."""
    repo = make_tool("repo")
    lead = make_agent("lead")
    sub = make_agent("sub", parent=lead)
    wide = {"starts_at": S, "duration": E - S, "delegable": True}
    near = make_grant(lead, repo, ("read",), "repo:acme/a/*", **wide)
    far = make_grant(lead, repo, ("read",), "repo:acme/*", **wide)
    made = [
        grants.grant_delegate(
            parent_grant_id=parent.pk,
            child=sub,
            actions=["read"],
            scope="repo:acme/a/*",
            expires_at=expires,
            justification="x",
            actor=Actor.agent(lead),
            at=S + MS,
        )  # fmt: skip
        for parent, expires in ((near, S + timedelta(minutes=10)), (far, E))
    ]
    expired, outside = made
    ask_sub = {"agent": "sub", "tool": "repo", "action": "read", "scope": "repo:acme/a/x"}
    assert_allowed(access.access_check(**ask_sub, at=NOW), outside)
    Grant.objects.filter(pk=far.pk).update(scope="repo:acme/b/*")
    refused = access.access_check(**ask_sub, at=NOW + MS)
    assert_denied(refused, "delegation_outside_parent", outside.pk)
    assert expired.pk < outside.pk
    assert grant_dead_reason(expired.pk, NOW + MS) == Reason.GRANT_EXPIRED


def test_a_denied_request_is_no_grant_not_an_error(bot, alice, bob, system):
    """A request a person denied never was a grant: a call it would have covered is
    no_grant, like one with no request at all (mutant A21: a denied row read as a
    candidate, and the denial became an `error`)."""
    agent, repo = bot
    asked = grants.grant_request(
        agent=agent, tool=repo, actions=["read"], scope="repo:acme/api/*",
        duration=timedelta(hours=1), justification="triage", requested_by=alice,
        actor=Actor.user(alice), at=S,
    )  # fmt: skip
    grants.grant_deny(grant_id=asked.pk, approver=bob, reason="no", actor=Actor.user(bob), at=S)
    refused = ask()
    assert_denied(refused, "no_grant")
    assert refused.message == "No grant gives 'read' on this tool."


def test_a_break_glass_grant_with_no_opener_on_record_is_dead_and_the_denial_says_break_glass(
    bot, make_grant, approvers
):
    """Break-glass rides on its opener's own authority: with no person as its opener on
    its row (written around the services) it has none, and is revoked (mutant A20: a missing
    opener read as an active one). The denial says break-glass, though an ordinary
    grant made after it is dead too (mutant A11: the flag of the last dead grant)."""
    from governance.services import breakglass

    agent, repo = bot
    erin = approvers[0]
    bg = breakglass.breakglass_open(
        opener=erin, agent=agent, tool=repo, actions=["read"], scope="repo:acme/api/*",
        ticket="INC-7", reason="outage", actor=Actor.user(erin), at=S,
    )  # fmt: skip
    assert_allowed(ask(), bg.grant)
    # The agent itself on record as asking (the schema wants a requester): no person's.
    Grant.objects.filter(pk=bg.grant_id).update(requested_by=None, requested_by_agent=agent)
    make_grant(agent, repo, ("read",), "repo:acme/*", starts_at=S, duration=timedelta(minutes=10))
    refused = ask(NOW + MS)
    assert_denied(refused, "grant_revoked", bg.grant_id)
    assert refused.break_glass and event_of(refused).break_glass


def test_a_grant_pattern_of_exactly_the_longest_length_covers_its_resources(bot, make_grant):
    """A pattern may be MAX_SCOPE_LEN (500) characters long, as a resource may: the grant
    covers the resource below its trailing `*` (mutant S12: the longest pattern not
    valid, so the grant covered nothing)."""
    agent, repo = bot
    pattern = "repo:acme/" + "x" * 488 + "/*"
    assert len(pattern) == 500
    grant = make_grant(agent, repo, ("read",), pattern, starts_at=S)
    assert_allowed(ask(scope=pattern[:-1] + "y"), grant)


@pytest.mark.parametrize(
    ("live_minutes", "due_ago", "job_at", "reason", "item_status"),
    [
        # Expired ten minutes ago, its review due five minutes ago: expiry ended it first
        # (mutant T13: the review's due date looked at before the expiry).
        (20, 5, NOW + MS, "grant_expired", "ended"),
        # Its review due ten minutes ago, while it was live; expired five minutes ago:
        # the due date ended it first, whether the job ran after the expiry (the item is
        # closed `ended`) or between the two (it revokes from the due date). Before, the
        # answer was `grant_expired` until a job ran in between: the reason on record
        # hung on when the job happened to run.
        (25, 10, NOW + MS, "grant_revoked", "ended"),
        (25, 10, NOW - timedelta(minutes=7), "grant_revoked", "auto_revoked"),
    ],
)
def test_a_grant_ended_by_expiry_or_by_its_undecided_review_names_whichever_came_first(
    bot, make_grant, system, live_minutes, due_ago, job_at, reason, item_status
):
    """The denial names what ended the grant first, before the review job has run (asked
    once the grant has expired) and after it alike."""
    from governance.models import ReviewItem
    from governance.services import reviews

    agent, repo = bot
    grant = make_grant(agent, repo, ("read",), "repo:acme/api/*", starts_at=S,
                       duration=timedelta(minutes=live_minutes))  # fmt: skip
    campaign = reviews.review_campaign_open(
        kind="on_demand", reason="incident", actor=system, at=NOW - timedelta(minutes=20),
        due_at=NOW - timedelta(minutes=due_ago),
    )  # fmt: skip
    item = campaign.items.get(grant=grant)
    if job_at > NOW:
        assert_denied(ask(), reason, grant.pk)
    reviews.review_items_apply_due_rule(actor=system, at=job_at)
    assert ReviewItem.objects.get(pk=item.pk).status == item_status
    assert_denied(ask(NOW + 2 * MS), reason, grant.pk)


# --- Questions about a grant rather than a call -------------------------------------------


def test_a_grant_bound_to_no_task_serves_a_named_task_only_while_it_exists_and_is_open(
    bot, make_grant, make_task
):
    """Asked about calls under a task (a report narrowed to it), a grant bound to no task
    is dead for a task that does not exist or has ended, and live for an open one
    (mutants K6: the named task not looked at, K12: an unknown one read as open).
    Nothing is written."""
    agent, repo = bot
    grant = make_grant(agent, repo, ("read",), "repo:acme/api/*", starts_at=S)
    make_task("T-open")
    make_task("T-ended", ends_at=NOW - MS)
    before = AuditEvent.objects.count()
    answers = {key: grant_dead_reason(grant.pk, NOW, task=key) for key in
               ("T-open", "T-ended", "T-nope")}  # fmt: skip
    assert answers == {
        "T-open": None,
        "T-ended": Reason.TASK_CLOSED,
        "T-nope": Reason.TASK_UNKNOWN,
    }
    assert grant_dead_reason(grant.pk, NOW) is None
    assert AuditEvent.objects.count() == before


def test_a_call_under_way_is_dead_once_its_grant_no_longer_holds_its_action_or_resource(
    bot, make_grant, system
):
    """What a call allowed once and still running (a sandbox run) must go on satisfying:
    narrowing its grant ends it at once, for an action the grant no longer holds or a
    resource it no longer covers, while the call the narrowed grant still covers goes
    on (mutants K10, K11: call_dead_reason's action or scope check dropped)."""
    from governance.policy import call_dead_reason

    agent, repo = bot
    grant = make_grant(agent, repo, ("read", "update"), "repo:acme/*", starts_at=S)
    call = {"action": "update", "scope": "repo:acme/web/x", "task": None, "at": NOW + MS}
    assert call_dead_reason(grant.pk, **call) is None
    grants.grant_narrow(grant_id=grant.pk, reason="less", actor=system, at=NOW,
                        actions=["read"], scope="repo:acme/api/*")  # fmt: skip
    assert call_dead_reason(grant.pk, **call) == Reason.NO_GRANT
    assert call_dead_reason(grant.pk, **{**call, "action": "read"}) == Reason.SCOPE_MISMATCH
    assert (
        call_dead_reason(grant.pk, **{**call, "action": "read", "scope": "repo:acme/api/x"}) is None
    )
    assert_allowed(ask(NOW + MS), grant)


def test_a_report_about_a_moment_before_a_parent_was_narrowed_finds_its_delegation_live(
    make_agent, make_tool, make_grant, system
):
    """lead's grant on repo:acme/* was narrowed to repo:acme/a/* at NOW, which revoked
    what it had handed to sub on repo:acme/b/*. Five minutes before, the delegation was
    within its parent as the parent was then (PastState.shapes, from the log): live
    then, not outside its parent (mutant D12: the parent's shape as it is now)."""
    repo = make_tool("repo")
    lead = make_agent("lead")
    sub = make_agent("sub", parent=lead)
    parent = make_grant(lead, repo, ("read",), "repo:acme/*", starts_at=S, duration=E - S,
                        delegable=True)  # fmt: skip
    handed = grants.grant_delegate(
        parent_grant_id=parent.pk, child=sub, actions=["read"], scope="repo:acme/b/*",
        expires_at=E, justification="b", actor=Actor.agent(lead), at=S + MS,
    )  # fmt: skip
    grants.grant_narrow(grant_id=parent.pk, reason="a only", actor=system, at=NOW,
                        scope="repo:acme/a/*")  # fmt: skip
    assert grant_dead_reason(handed.pk, NOW) == Reason.GRANT_REVOKED
    then = PastState(shapes={parent.pk: (frozenset(["read"]), "repo:acme/*")})
    assert grant_dead_reason(handed.pk, NOW - timedelta(minutes=5), then) is None
    # Without the shape it held then, the report would call it outside its parent.
    assert (
        grant_dead_reason(handed.pk, NOW - timedelta(minutes=5), PastState())
        == Reason.DELEGATION_OUTSIDE_PARENT
    )


def test_an_approval_asked_under_one_grant_is_not_used_under_another(bot, make_grant, bob):
    """bot's delete was asked under its grant B while its older grant A had not started;
    bob approved it. Once A starts, the same call is under A (the oldest live grant):
    the approval was checked against B's people, so under A the call needs a new look,
    and the approval stays unused (mutant G9: the grant not bound)."""
    from governance.models import Approval
    from governance.services import approvals

    agent, repo = bot
    later = NOW + timedelta(minutes=1)
    a = make_grant(agent, repo, ("delete",), "repo:acme/*", starts_at=later)
    b = make_grant(agent, repo, ("delete",), "repo:acme/api/*", starts_at=S)
    asked = ask(action="delete")
    assert (asked.decision, asked.grant_id) == ("approval_required", b.pk)
    approvals.approval_approve(
        approval_id=asked.approval_id, approver=bob, actor=Actor.user(bob), at=NOW
    )
    used = ask(later, action="delete", approval=asked.approval_id)
    assert (used.decision, used.reason, used.grant_id, used.message) == (
        "deny", "approval_invalid", a.pk, "The approval is for a different call.",
    )  # fmt: skip
    event = event_of(used)
    assert (event.event_type, event.reason, event.grant_id, event.approval_id) == (
        "access.denied", "approval_invalid", a.pk, asked.approval_id,
    )  # fmt: skip
    assert Approval.objects.get(pk=asked.approval_id).status == "approved"
