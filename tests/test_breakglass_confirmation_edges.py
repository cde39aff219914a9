"""Edges of break-glass, confirmation policies and the approval decision that a mutation
run of services/breakglass.py, confirmation.py and approvals.py found untested: each
test here fails on one or more of its mutants (/tmp/scratch_bgmut) and checks the
answer, the rows and the audit events through the real services."""

from __future__ import annotations

import json
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest

from governance import roles
from governance.audit import Actor
from governance.codes import EventType
from governance.errors import Conflict, Forbidden, GovernanceError
from governance.models import Approval, AuditEvent, BreakGlass, ConfirmationPolicy, Grant
from governance.policy import authorize
from governance.services import approvals, confirmation
from governance.services import breakglass as bgs
from governance.services.access import access_check
from governance.services.grants import grant_narrow, grants_expire
from tests.conftest import MS, NOW
from tests.lifecycle_fixtures import BG_REASON, BG_SCOPE

pytestmark = pytest.mark.django_db

SCOPE, REASON = BG_SCOPE, BG_REASON


def events(event_type: str, **filters: object) -> list[AuditEvent]:
    return list(AuditEvent.objects.filter(event_type=event_type, **filters).order_by("seq"))


def written() -> tuple[int, int, int]:
    return BreakGlass.objects.count(), Grant.objects.count(), AuditEvent.objects.count()


def ask(at, agent="bot", action="update", scope="repo:acme/api/x"):
    return {"agent": agent, "tool": "repo", "action": action, "scope": scope, "at": at}


# --- Opening -------------------------------------------------------------------------


def test_a_live_break_glass_for_one_agent_leaves_another_agent_on_the_same_tool_free(
    bg_world, open_bg, make_agent
):
    """One at a time per agent AND tool: an incident on another agent is another matter."""
    first = open_bg()
    other = make_agent("bot2")
    second = open_bg(bg_world["frank"], ticket="INC-43", agent=other)
    assert second.pk != first.pk and second.grant.agent == other
    assert authorize(**ask(NOW, agent="bot2")).allowed and authorize(**ask(NOW)).allowed
    opened = events(EventType.BREAKGLASS_OPENED)
    assert [(e.agent, e.actor) for e in opened] == [("bot", "user:erin"), ("bot2", "user:frank")]


def test_a_break_glass_whose_grant_a_review_narrowed_stops_blocking_at_the_grants_end(
    bg_world, open_bg
):
    """The grant, not the break-glass row, says how long the elevation lives: from the
    narrowed end on (the very microsecond), a new incident may open one again."""
    frank, grace, heidi = bg_world["frank"], bg_world["grace"], bg_world["heidi"]
    bg = open_bg()
    end = NOW + timedelta(minutes=10)
    grant_narrow(
        grant_id=bg.grant_id, reason="review: shorter", expires_at=end,
        narrowed_by=grace, actor=Actor.user(grace), at=NOW + timedelta(minutes=1),
    )  # fmt: skip
    bgs.breakglass_ratify(
        breakglass_id=bg.pk, reviewer=frank, comment="was needed", actor=Actor.user(frank),
        at=NOW + timedelta(minutes=5),
    )  # fmt: skip
    assert BreakGlass.objects.get(pk=bg.pk).expires_at > end  # the row is not synced yet
    assert not authorize(**ask(end)).allowed

    again = open_bg(heidi, ticket="INC-43", at=end)
    assert again.pk != bg.pk and again.opened_by == heidi
    assert authorize(**ask(end)).allowed
    (_, opened) = events(EventType.BREAKGLASS_OPENED)
    assert (opened.actor, opened.grant_id) == ("user:heidi", again.grant_id)
    assert json.loads(opened.data)["ticket"] == "INC-43"


def test_the_same_opener_and_ticket_for_another_scope_is_not_handed_the_live_one(bg_world, open_bg):
    """A repeat is the exact same request: asked for another scope, the opener would be
    told (201) they hold access they do not."""
    bg = open_bg()
    before = written()
    with pytest.raises(Conflict) as caught:
        open_bg(scope="repo:acme/web/*", at=NOW + timedelta(minutes=1))
    assert caught.value.code == "breakglass_active"
    assert written() == before
    assert Grant.objects.get().scope == SCOPE and BreakGlass.objects.get().pk == bg.pk
    assert not authorize(**ask(NOW + timedelta(minutes=1), scope="repo:acme/web/x")).allowed


@pytest.mark.parametrize("reason", ["", "   ", "\n\t"])
def test_a_break_glass_needs_a_reason_that_says_something(open_bg, reason):
    with pytest.raises(GovernanceError) as caught:
        open_bg(reason=reason)
    assert caught.value.code == "reason_required"
    assert written() == (0, 0, AuditEvent.objects.count()) and not events(
        EventType.BREAKGLASS_OPENED
    )
    assert not authorize(**ask(NOW)).allowed


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"actions": ["fly"]}, "actions"),
        ({"actions": []}, "actions"),
        ({"actions": ["read", "read"]}, "actions"),
        ({"actions": ["delete"], "tool": "read-only"}, "actions"),
        ({"scope": "repo:acme/../etc/*"}, "scope"),
        ({"scope": "repo:acme/a*"}, "scope"),
    ],
)
def test_a_break_glass_grant_has_the_shape_every_grant_has(open_bg, make_tool, change, field):
    if change.get("tool") == "read-only":
        change["tool"] = make_tool("viewer", actions=("read",))
    with pytest.raises(GovernanceError) as caught:
        open_bg(**change)
    assert caught.value.code == "invalid_grant" and field in caught.value.fields
    assert BreakGlass.objects.count() == 0 and Grant.objects.count() == 0
    assert not events(EventType.BREAKGLASS_OPENED)


def test_break_glass_is_never_opened_under_a_closed_task(open_bg, make_task, system):
    """A grant bound to a task dies with it: one opened under a closed task would live."""
    from governance.services.tasks import task_close

    task = make_task("OPS-9")
    task_close(task=task, actor=system, at=NOW - timedelta(minutes=5))
    before = written()
    with pytest.raises(Conflict) as caught:
        open_bg(task=task)
    assert caught.value.code == "task_closed"
    assert written() == before and not events(EventType.BREAKGLASS_OPENED)
    assert not authorize(**ask(NOW)).allowed


def test_the_opened_event_names_the_person_and_the_approvers_told(bg_world, open_bg):
    """DESIGN: break-glass decisions name the person who made them, in the event itself."""
    bg = open_bg(bg_world["frank"])
    (opened,) = events(EventType.BREAKGLASS_OPENED)
    data = json.loads(opened.data)
    assert (opened.actor, opened.grant_id, opened.break_glass) == ("user:frank", bg.grant_id, True)
    assert (data["opened_by"], data["ticket"], data["breakglass_id"]) == ("frank", "INC-42", bg.pk)
    assert data["reason"] == REASON
    assert data["expires_at"] == (NOW + timedelta(hours=1)).isoformat()
    assert data["review_due_at"] == (NOW + timedelta(hours=24)).isoformat()
    assert sorted(data["notified"]) == ["erin", "grace", "heidi"]  # not frank himself
    assert (bg.grant.requested_by, bg.opened_by) == (bg_world["frank"], bg_world["frank"])


# --- Closing -------------------------------------------------------------------------


def test_an_agent_never_closes_break_glass(bg_world, open_bg):
    """Only a person ends it early: an agent's principal is refused, not crashed on."""
    from governance.api.auth import AgentPrincipal
    from governance.models import AgentToken

    bg = open_bg()
    before = written()
    principal = AgentPrincipal(agent=bg_world["agent"], token=AgentToken())
    with pytest.raises(Forbidden) as caught:
        bgs.breakglass_close(
            breakglass_id=bg.pk, closed_by=principal, comment="done",
            actor=Actor.agent(bg_world["agent"]), at=NOW + timedelta(minutes=5),
        )  # fmt: skip
    assert caught.value.code == "not_allowed"
    assert written() == before
    bg.refresh_from_db()
    assert (bg.closed_at, bg.grant.status) == (None, "active")
    assert authorize(**ask(NOW + timedelta(minutes=5))).allowed


def test_closing_names_who_ended_it_on_the_grant_and_in_the_event(bg_world, open_bg):
    frank = bg_world["frank"]
    bg = open_bg()
    at = NOW + timedelta(minutes=5)
    bg = bgs.breakglass_close(
        breakglass_id=bg.pk, closed_by=frank, comment="fixed", actor=Actor.user(frank), at=at
    )
    grant = Grant.objects.get(pk=bg.grant_id)
    assert (grant.status, grant.revoked_by, grant.revoked_at) == ("revoked", frank, at)
    assert (bg.closed_by, bg.closed_at) == (frank, at)
    (revoked,) = events(EventType.GRANT_REVOKED, grant_id=bg.grant_id)
    assert revoked.actor == "user:frank" and revoked.break_glass
    assert events(EventType.BREAKGLASS_CLOSED) == []  # the revoke is the one event


def test_closing_at_the_grants_last_instant_leaves_it_expired(bg_world, open_bg, system):
    """At expires_at the grant has already expired (refused from that very moment): a
    close then is on record as a close, never as a revoke that cut it short."""
    erin = bg_world["erin"]
    bg = open_bg(ttl=timedelta(minutes=10))
    end = NOW + timedelta(minutes=10)
    bg = bgs.breakglass_close(
        breakglass_id=bg.pk, closed_by=erin, comment="done", actor=Actor.user(erin), at=end
    )
    assert events(EventType.GRANT_REVOKED, grant_id=bg.grant_id) == []
    (closed,) = events(EventType.BREAKGLASS_CLOSED)
    data = json.loads(closed.data)
    assert (data["closed_by"], data["grant_status"], data["comment"]) == ("erin", "expired", "done")
    assert (closed.actor, closed.grant_id) == ("user:erin", bg.grant_id)
    assert grants_expire(actor=system, at=end) == 1
    assert Grant.objects.get(pk=bg.grant_id).status == "expired"


# --- Confirmation policies -----------------------------------------------------------

WRITTEN = NOW - timedelta(minutes=10)


@pytest.fixture
def pol_world(make_agent, make_tool, make_task, person) -> SimpleNamespace:
    """cleaner (alice's agent), repo (delete is destructive) and pay (irreversible: every
    action is); bob and carol are approvers with no stake in cleaner."""
    return SimpleNamespace(
        agent=make_agent("cleaner"),
        tool=make_tool("repo"),
        pay=make_tool("pay", actions=("read", "create", "update"), irreversible=True),
        task=make_task("OPS-1"),
        bob=person("bob2", roles.APPROVERS),
        carol=person("carol", roles.APPROVERS),
    )


def policy(w: SimpleNamespace, **kw: Any) -> Any:
    args = {
        "author": w.bob, "agent": w.agent, "tool": w.pay, "action": "create",
        "scope": "pay:acme/*", "verdict": "approve", "reason": "refunds under 10 EUR",
        "duration": timedelta(hours=1), "at": WRITTEN, "task": None,
    }  # fmt: skip
    args.update(kw)
    return confirmation.policy_create(actor=Actor.user(args["author"]), **args)


def created_events() -> list[AuditEvent]:
    return events(EventType.CONFIRMATION_POLICY_CREATED)


@pytest.mark.parametrize(
    "change",
    [
        "author", "agent", "tool", "task", "action", "scope", "verdict", "reason",
        "definition", "duration", "after_it_ended",
    ],
)  # fmt: skip
def test_a_policy_that_differs_in_anything_is_another_policy(
    pol_world, make_agent, make_tool, change
):
    """Only the exact same policy asked again while it lives is that one: anything else
    handed back the first (the caller told its policy was written, nothing recorded)."""
    from governance.services import tools

    w = pol_world
    first = policy(w)
    kw: dict[str, Any] = {"at": WRITTEN + timedelta(seconds=5)}
    if change == "author":
        kw["author"] = w.carol
    elif change == "agent":
        kw["agent"] = make_agent("cleaner2")
    elif change == "tool":
        kw["tool"] = make_tool("pay2", actions=("read", "create", "update"), irreversible=True)
    elif change == "task":
        kw["task"] = w.task
    elif change == "action":
        kw["action"] = "update"
    elif change == "scope":
        kw["scope"] = "pay:acme/eu/*"
    elif change == "verdict":
        kw["verdict"] = "deny"
    elif change == "reason":
        kw["reason"] = "refunds under 5 EUR"
    elif change == "definition":
        system = Actor.system("test")
        changed = tools.tool_update_definition(
            tool=w.pay, actor=system, at=WRITTEN, description="pay, now with payouts"
        )
        tools.tool_approve_definition(
            tool=changed, definition_hash=changed.definition_hash, approver=w.carol,
            actor=Actor.user(w.carol), at=WRITTEN + MS,
        )  # fmt: skip
        kw["tool"] = changed
    elif change == "duration":
        kw["duration"] = timedelta(hours=2)
    elif change == "after_it_ended":
        kw["at"] = first.expires_at
    second = policy(w, **kw)
    assert second.pk != first.pk
    assert ConfirmationPolicy.objects.count() == 2
    made = created_events()
    assert [json.loads(e.data)["policy"] for e in made] == [first.pk, second.pk]
    assert made[1].actor == f"user:{second.created_by.username}"
    # ...and the exact repeat while the second lives is the second, with nothing written.
    before = AuditEvent.objects.count()
    assert policy(w, **{**kw, "at": kw["at"] + timedelta(seconds=1)}).pk == second.pk
    assert AuditEvent.objects.count() == before


# --- Reviews -------------------------------------------------------------------------


@pytest.mark.parametrize("review", ["ratify", "confirm_closed"])
def test_a_token_held_while_it_was_open_bars_its_creator_from_the_review_later_too(
    bg_world, open_bg, review
):
    """heidi issued herself a token for the agent while the break-glass was open and
    revoked it at once: she could have acted as the agent under it. A day later, with
    the token long gone, she still may not sign it off; grace may."""
    from governance.services import agents

    heidi, grace = bg_world["heidi"], bg_world["grace"]
    bg = open_bg()
    token, _ = agents.token_issue(
        created_by=heidi, agent=bg_world["agent"], actor=Actor.user(heidi), at=NOW + MS
    )
    agents.token_revoke(token=token, actor=Actor.user(heidi), at=NOW + 2 * MS)
    later = NOW + timedelta(hours=20)
    before = AuditEvent.objects.count()
    with pytest.raises(Forbidden) as caught:
        getattr(bgs, f"breakglass_{review}")(
            breakglass_id=bg.pk, reviewer=heidi, comment="fine", actor=Actor.user(heidi), at=later
        )
    assert caught.value.code == "self_review"
    assert BreakGlass.objects.get(pk=bg.pk).review_status == "pending"
    assert AuditEvent.objects.count() == before
    done = getattr(bgs, f"breakglass_{review}")(
        breakglass_id=bg.pk, reviewer=grace, comment="fine", actor=Actor.user(grace), at=later
    )
    assert (done.reviewed_by, done.reviewed_at) == (grace, later)
    kind = (
        EventType.BREAKGLASS_RATIFIED
        if review == "ratify"
        else (EventType.BREAKGLASS_CONFIRMED_CLOSED)
    )
    (decided,) = events(kind)
    assert decided.actor == "user:grace" and json.loads(decided.data)["reviewed_by"] == "grace"


@pytest.mark.parametrize("stake", ["parent_owner", "parent_token"])
def test_whoever_stands_behind_a_parent_writes_no_approve_policy_for_its_subagent(
    pol_world, make_agent, person, stake
):
    """The parent controls its subagents: its owner (or whoever holds a token for it)
    confirming the child's calls by rule confirms their own. Even with no grant live
    for the child yet: the policy would answer for whatever is handed down later."""
    from governance.services import agents

    w = pol_world
    dave = person("dave", roles.APPROVERS)
    parent = make_agent("parent", owner=dave if stake == "parent_owner" else None)
    child = make_agent("parent.child", parent=parent, owner=w.carol)
    if stake == "parent_token":
        agents.token_issue(created_by=dave, agent=parent, actor=Actor.user(dave), at=WRITTEN - MS)
    before = AuditEvent.objects.count()
    with pytest.raises(Forbidden) as caught:
        policy(w, author=dave, agent=child)
    assert caught.value.code == "self_approval"
    assert ConfirmationPolicy.objects.count() == 0 and AuditEvent.objects.count() == before
    # A deny only restricts: dave may write that; bob, with no stake, an approve.
    assert policy(w, author=dave, agent=child, verdict="deny").verdict == "deny"
    assert policy(w, agent=child).created_by == w.bob
    made = created_events()
    assert [(e.agent, e.actor) for e in made] == [
        ("parent.child", "user:dave"), ("parent.child", "user:bob2"),
    ]  # fmt: skip


# --- Approving and denying a call ----------------------------------------------------


@pytest.fixture
def call(make_agent, make_tool, make_grant, person) -> SimpleNamespace:
    """bot (alice's) holds read + delete on repo:acme/* (asked by alice, approved by bob);
    its delete of repo:acme/x waits for a person. carol is an approver with no stake."""
    agent = make_agent("bot")
    grant = make_grant(agent, make_tool("repo"), ("read", "delete"), "repo:acme/*")
    asked = access_check(agent="bot", tool="repo", action="delete", scope="repo:acme/x", at=NOW)
    assert asked.decision == "approval_required"
    return SimpleNamespace(
        grant=grant, approval_id=asked.approval_id, carol=person("carol", roles.APPROVERS)
    )


def do(at=NOW, **kw):
    return access_check(agent="bot", tool="repo", action="delete", scope="repo:acme/x", at=at, **kw)


@pytest.mark.parametrize("approve", [True, False])
def test_a_decision_is_on_record_with_who_when_why_and_its_own_event(call, approve):
    """Approved or denied, the row and the event say which, by whom and why; a call under
    an ordinary grant is never flagged break-glass. An approval lets the call through
    once; a denial answers the same call asked again."""
    carol = call.carol
    decide = approvals.approval_approve if approve else approvals.approval_deny
    at = NOW + timedelta(minutes=1)
    decided = decide(
        approval_id=call.approval_id, approver=carol, reason="checked the ticket",
        actor=Actor.user(carol), at=at,
    )  # fmt: skip
    row = Approval.objects.get(pk=call.approval_id)
    assert (row.status, row.decided_by, row.decided_at, row.decision_reason) == (
        "approved" if approve else "denied", carol, at, "checked the ticket",
    )  # fmt: skip
    assert decided.status == row.status
    kind = EventType.APPROVAL_APPROVED if approve else EventType.APPROVAL_DENIED
    (event,) = events(kind)
    assert (event.actor, event.approval_id, event.grant_id) == (
        "user:carol", str(call.approval_id), call.grant.pk,
    )  # fmt: skip
    assert event.break_glass is False
    assert json.loads(event.data) == {"reason": "checked the ticket"}
    assert not events(EventType.APPROVAL_DENIED if approve else EventType.APPROVAL_APPROVED)
    first = do(at + MS, approval=call.approval_id) if approve else do(at + MS)
    if approve:
        assert first.allowed and first.approval_id == call.approval_id
        again = do(at + 2 * MS, approval=call.approval_id)  # consumed: used once
        assert (again.allowed, again.reason) == (False, "approval_invalid")
        assert AuditEvent.objects.get(uid=again.decision_id).reason == "approval_invalid"
    else:
        assert (first.decision, first.reason) == ("deny", "approval_denied")
    assert AuditEvent.objects.get(uid=first.decision_id).decision == first.decision


@pytest.mark.parametrize(
    ("token", "barred"),
    [
        ("expired_before", False),
        ("expired_as_asked", False),  # expires_at == the moment the call was asked
        ("revoked_as_asked", False),  # revoked_at == that moment
        ("revoked_after", True),  # live when asked: carol could have made the call herself
        ("live", True),
    ],
)
def test_a_token_bars_its_creator_from_confirming_only_if_it_was_live_when_asked(
    call, token, barred
):
    from governance.services import agents

    carol = call.carol
    agent = call.grant.agent
    me = Actor.user(carol)
    if token == "expired_before":
        agents.token_issue(
            created_by=carol, agent=agent, actor=me, at=NOW - timedelta(days=2), days=1
        )
    elif token == "expired_as_asked":
        agents.token_issue(
            created_by=carol, agent=agent, actor=me, at=NOW - timedelta(days=1), days=1
        )
    else:
        made, _ = agents.token_issue(
            created_by=carol, agent=agent, actor=me, at=NOW - timedelta(hours=1)
        )
        if token != "live":
            at = NOW if token == "revoked_as_asked" else NOW + timedelta(minutes=1)
            agents.token_revoke(token=made, actor=me, at=at)
    before = AuditEvent.objects.count()
    decide_at = NOW + timedelta(minutes=2)
    if barred:
        with pytest.raises(Forbidden) as caught:
            approvals.approval_approve(
                approval_id=call.approval_id, approver=carol, actor=me, at=decide_at
            )
        assert caught.value.code == "self_approval"
        assert Approval.objects.get(pk=call.approval_id).status == "pending"
        assert AuditEvent.objects.count() == before
    else:
        approvals.approval_approve(
            approval_id=call.approval_id, approver=carol, actor=me, at=decide_at
        )
        assert Approval.objects.get(pk=call.approval_id).decided_by == carol
        (approved,) = events(EventType.APPROVAL_APPROVED)
        assert approved.actor == "user:carol" and AuditEvent.objects.count() == before + 1


def test_who_asked_for_the_grant_up_a_delegation_confirms_none_of_the_subagents_calls(
    make_agent, make_tool, make_grant, person, alice
):
    """alice asked for the parent's grant, but owns neither agent (dave owns the parent,
    carol the subagent): she is behind the grant the subagent acts under, so she may
    not confirm its delete. frank, with no stake, may."""
    from governance.services.grants import grant_delegate

    dave, carol = person("dave"), person("carol")
    frank = person("frank", roles.APPROVERS)
    parent = make_agent("parent", owner=dave)
    child = make_agent("parent.child", parent=parent, owner=carol)
    granted = make_grant(parent, make_tool("repo"), ("read", "delete"), "repo:acme/*",
                         delegable=True)  # fmt: skip
    assert granted.requested_by == alice
    grant_delegate(
        parent_grant_id=granted.pk, child=child, actions=["delete"], scope="repo:acme/api/*",
        expires_at=granted.expires_at, justification="subtask", actor=Actor.agent(parent),
        at=NOW,
    )  # fmt: skip
    asked = access_check(
        agent="parent.child", tool="repo", action="delete", scope="repo:acme/api/x", at=NOW
    )
    assert asked.decision == "approval_required"
    before = AuditEvent.objects.count()
    for who in (alice, dave, carol):
        with pytest.raises(Forbidden) as caught:
            approvals.approval_approve(
                approval_id=asked.approval_id, approver=who, actor=Actor.user(who), at=NOW
            )
        assert caught.value.code == "self_approval"
    assert Approval.objects.get(pk=asked.approval_id).status == "pending"
    assert AuditEvent.objects.count() == before
    approvals.approval_approve(
        approval_id=asked.approval_id, approver=frank, actor=Actor.user(frank), at=NOW
    )
    (approved,) = events(EventType.APPROVAL_APPROVED)
    assert (approved.actor, approved.agent) == ("user:frank", "parent.child")


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"verdict": "allow"}, "invalid_verdict"),
        ({"verdict": ""}, "invalid_verdict"),
        ({"action": "fly"}, "invalid_action"),
        ({"action": "delete"}, "action_not_supported"),  # pay supports no delete
    ],
)
def test_a_policy_names_a_verdict_and_an_action_its_tool_has(pol_world, change, code):
    before = AuditEvent.objects.count()
    with pytest.raises(GovernanceError) as caught:
        policy(pol_world, **change)
    assert caught.value.code == code
    assert ConfirmationPolicy.objects.count() == 0 and AuditEvent.objects.count() == before


def test_an_auditor_is_told_they_are_read_only_when_writing_a_policy(pol_world, person):
    auditor = person("audrey", roles.AUDITORS)
    with pytest.raises(Forbidden) as caught:
        policy(pol_world, author=auditor)
    assert caught.value.code == "auditor_read_only"
    assert ConfirmationPolicy.objects.count() == 0 and not created_events()


@pytest.mark.parametrize("grant_on", ["another_tool", "another_action"])
def test_a_grant_the_calls_would_not_run_under_gives_its_requester_no_stake(
    pol_world, make_tool, grant_on
):
    """bob asked for cleaner's grant on another tool (or one without the policy's action):
    no call the policy answers runs under it, so he may still write it. The same grant
    on the policy's tool and action bars him."""
    w = pol_world
    tool = make_tool("other") if grant_on == "another_tool" else w.pay
    actions = ("read", "create") if grant_on == "another_tool" else ("read", "update")
    from governance.services import grants

    grants.grant_issue(
        agent=w.agent, tool=tool, actions=list(actions), scope="pay:acme/*",
        duration=timedelta(hours=2), justification="t", requested_by=w.bob,
        approved_by=w.carol, actor=Actor.user(w.carol), at=WRITTEN - timedelta(minutes=5),
    )  # fmt: skip
    written_ = policy(w)
    assert written_.created_by == w.bob
    (made,) = created_events()
    assert (made.actor, json.loads(made.data)["policy"]) == ("user:bob2", written_.pk)
    grants.grant_issue(
        agent=w.agent, tool=w.pay, actions=["create"], scope="pay:acme/*",
        duration=timedelta(hours=2), justification="t", requested_by=w.bob,
        approved_by=w.carol, actor=Actor.user(w.carol), at=WRITTEN - timedelta(minutes=5),
    )  # fmt: skip
    with pytest.raises(Forbidden) as caught:
        policy(w, scope="pay:acme/eu/*")
    assert caught.value.code == "self_approval"
    assert ConfirmationPolicy.objects.count() == 1 and len(created_events()) == 1


def test_a_policy_may_live_exactly_the_longest_a_grant_may(pol_world, settings):
    made = policy(pol_world, duration=settings.GRANT_MAX_TTL)
    assert made.expires_at - made.starts_at == settings.GRANT_MAX_TTL
    (event,) = created_events()
    assert json.loads(event.data)["expires_at"] == made.expires_at.isoformat()


def test_ratifying_at_the_due_moment_is_overdue_and_asks_for_the_duration_given(bg_world, open_bg):
    """Overdue from the due time itself (as the pages show it); a reviewer who gives a
    duration gets a request for that one, not the break-glass window."""
    frank = bg_world["frank"]
    bg = open_bg()
    done = bgs.breakglass_ratify(
        breakglass_id=bg.pk, reviewer=frank, comment="keep", actor=Actor.user(frank),
        at=bg.review_due_at, duration=timedelta(hours=2),
    )  # fmt: skip
    assert done.ratified_request.requested_duration == timedelta(hours=2)
    (ratified,) = events(EventType.BREAKGLASS_RATIFIED)
    data = json.loads(ratified.data)
    assert (data["overdue"], data["reviewed_by"]) == (True, "frank")
    (requested,) = events(EventType.GRANT_REQUESTED, grant_id=done.ratified_request_id)
    assert requested.actor == "user:frank"


# --- The last survivors: confirm-closed, and who may end or bind a policy ------------------


def test_confirm_closed_keeps_who_closed_it_and_revokes_a_live_grant_in_the_reviewers_name(
    bg_world, open_bg, make_agent
):
    """Mutants B80 (the earlier close overwritten by the review) and B82 (the review's
    revoke named nobody): one break-glass frank closed, one still open on another
    agent, both confirmed closed by grace."""
    frank, grace = bg_world["frank"], bg_world["grace"]
    closed = open_bg()
    first, later = NOW + timedelta(minutes=5), NOW + timedelta(minutes=20)
    bgs.breakglass_close(
        breakglass_id=closed.pk, closed_by=frank, comment="fixed", actor=Actor.user(frank), at=first
    )
    done = bgs.breakglass_confirm_closed(
        breakglass_id=closed.pk, reviewer=grace, comment="over", actor=Actor.user(grace), at=later
    )
    assert (done.closed_by, done.closed_at, done.reviewed_by) == (frank, first, grace)
    stored = BreakGlass.objects.get(pk=closed.pk)
    assert (stored.closed_by, stored.closed_at) == (frank, first)
    (confirmed,) = events(EventType.BREAKGLASS_CONFIRMED_CLOSED)
    assert (confirmed.actor, json.loads(confirmed.data)["reviewed_by"]) == ("user:grace", "grace")

    still = open_bg(ticket="INC-43", agent=make_agent("other"))
    done = bgs.breakglass_confirm_closed(
        breakglass_id=still.pk, reviewer=grace, comment="over", actor=Actor.user(grace), at=later
    )
    grant = Grant.objects.get(pk=still.grant_id)
    assert (grant.status, grant.revoked_by, grant.revoked_at) == ("revoked", grace, later)
    assert (done.closed_by, done.closed_at) == (grace, later)
    (revoked,) = events(EventType.GRANT_REVOKED, grant_id=still.grant_id)
    assert revoked.actor == "user:grace" and revoked.break_glass


def test_only_an_approver_revokes_a_policy_and_only_with_a_reason(pol_world, person):
    """Mutants C39 (no role check in policy_revoke: the API and the UI refuse a
    non-approver, the service did not) and C34 (a blank reason taken)."""
    made = policy(pol_world)
    refused = (
        (person("nora"), "not needed", "not_approver"),
        (person("audrey", roles.AUDITORS), "not needed", "auditor_read_only"),
        (pol_world.carol, "   ", "reason_required"),
    )
    before = AuditEvent.objects.count()  # the people's own person.* events written
    for who, reason, code in refused:
        with pytest.raises(GovernanceError) as caught:
            confirmation.policy_revoke(
                policy_id=made.pk, by=who, reason=reason, actor=Actor.user(who), at=NOW
            )
        assert caught.value.code == code
    assert ConfirmationPolicy.objects.get(pk=made.pk).revoked_at is None
    assert AuditEvent.objects.count() == before
    confirmation.policy_revoke(
        policy_id=made.pk, by=pol_world.carol, reason="done", actor=Actor.user(pol_world.carol),
        at=NOW,
    )  # fmt: skip
    assert ConfirmationPolicy.objects.get(pk=made.pk).revoked_by == pol_world.carol
    revoked = AuditEvent.objects.latest("seq")
    assert (revoked.event_type, revoked.actor) == (
        EventType.CONFIRMATION_POLICY_REVOKED, "user:carol",
    )  # fmt: skip


def test_no_policy_is_written_under_a_closed_task(pol_world, system):
    """Mutant C21 (no open-task check in policy_create): a task-bound policy for a
    closed task would be on record, answering nothing, as if it bound something."""
    from governance.services.tasks import task_close

    task_close(task=pol_world.task, actor=system, at=WRITTEN - MS)
    with pytest.raises(Conflict) as caught:
        policy(pol_world, task=pol_world.task)
    assert caught.value.code == "task_closed"
    assert ConfirmationPolicy.objects.count() == 0 and not created_events()
