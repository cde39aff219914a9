"""The confirmation gate answered by a rule: a human or a policy confirms a destructive
call (DESIGN: "a human (or a configured policy) approves or denies").

Before, authorize()'s own message said "a human or policy must approve this exact
call", and no policy could. Now an approver with no stake in the agent writes a
confirmation policy for one agent's destructive calls on one tool and action inside a
scope, for a bounded window: `approve` lets each matching call through once (an
approval decided by the policy and used at once), `deny` refuses each, and a deny
wins, over a person's approval too. Every decision here is checked with its event."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from django.contrib.auth.models import Group, User
from django.core import mail
from django.test import Client
from django.utils import timezone

from governance import roles
from governance.audit import Actor
from governance.codes import NotificationEvent
from governance.errors import Conflict, Forbidden, GovernanceError
from governance.models import (
    Agent,
    Approval,
    AuditEvent,
    ConfirmationPolicy,
    Grant,
    Notification,
    SecondLook,
)
from governance.policy import authorize
from governance.services import agents, approvals, confirmation, grants, second_look
from governance.services.access import access_check
from tests import ui_world
from tests.conftest import MS, NOW, accounts_changed_at

pytestmark = pytest.mark.django_db

WRITTEN = NOW - timedelta(minutes=10)  # the policy's start; it lives one hour
ENDS = WRITTEN + timedelta(hours=1)


def approver(user: User) -> User:
    # An approver since before the world's NOW, as the reports of its moments read it.
    with accounts_changed_at(NOW - timedelta(days=1)):
        user.groups.add(Group.objects.get_or_create(name=roles.APPROVERS)[0])
    return User.objects.get(pk=user.pk)  # roles are cached on the instance


@pytest.fixture
def world(make_agent, make_tool, make_task, make_grant, alice, bob) -> Any:
    """cleaner (alice's agent) holds read + delete on repo:acme/*, live around NOW and
    ENDS; bob is an approver with no stake in it."""
    agent = make_agent("cleaner")
    tool = make_tool("repo")
    task = make_task("OPS-1")
    grant = make_grant(
        agent,
        tool,
        actions=("read", "delete"),
        scope="repo:acme/*",
        starts_at=NOW - timedelta(hours=1),
        duration=timedelta(hours=3),
    )
    return SimpleNamespace(agent=agent, tool=tool, task=task, grant=grant, bob=approver(bob))


def write(world: Any, verdict: str = "approve", **kw: Any) -> ConfirmationPolicy:
    kw.setdefault("author", world.bob)
    kw.setdefault("scope", "repo:acme/tmp/*")
    return confirmation.policy_create(
        agent=kw.pop("agent", world.agent),
        tool=world.tool,
        action=kw.pop("action", "delete"),
        verdict=verdict,
        reason=kw.pop("reason", "scratch space is disposable"),
        duration=kw.pop("duration", timedelta(hours=1)),
        actor=Actor.user(kw["author"]),
        at=kw.pop("at", WRITTEN),
        **kw,
    )


SCRATCH = "repo:acme/tmp/build-1"  # under the scope write() gives a policy


def ask(at: datetime = NOW, scope: str = SCRATCH, **kw: Any) -> Any:
    kw.setdefault("action", "delete")
    return access_check(agent="cleaner", tool="repo", scope=scope, at=at, **kw)


def event_of(decision: Any) -> AuditEvent:
    return AuditEvent.objects.get(uid=decision.decision_id)


@pytest.mark.parametrize(
    ("at", "scope", "action", "answer"),
    [
        (WRITTEN - MS, "repo:acme/tmp/build-1", "delete", "approval_required"),
        (WRITTEN, "repo:acme/tmp/build-1", "delete", "policy"),
        (ENDS - MS, "repo:acme/tmp/build-1", "delete", "policy"),
        (ENDS, "repo:acme/tmp/build-1", "delete", "approval_required"),
        (NOW, "repo:acme/tmp", "delete", "approval_required"),  # the pattern needs a segment
        (NOW, "repo:acme/tmp2/x", "delete", "approval_required"),
        (NOW, "repo:acme/src/main.py", "delete", "approval_required"),
        (NOW, "repo:acme/tmp/build-1", "read", "grant"),  # not destructive: no gate at all
    ],
    ids=["before", "from", "until", "after", "parent", "sibling", "outside", "read"],
)
def test_an_approve_policy_lets_each_matching_call_through_once(world, at, scope, action, answer):
    policy = write(world)
    decision = ask(at=at, scope=scope, action=action)
    event = event_of(decision)
    if answer == "approval_required":
        assert (decision.decision, decision.reason) == ("approval_required", "approval_required")
        assert event.event_type == "access.approval_required"
        assert decision.policy_id is None and json.loads(event.data) == {}
        assert Approval.objects.get(pk=decision.approval_id).status == "pending"
        return
    assert (decision.decision, decision.reason) == ("allow", "allowed")
    assert event.event_type == "access.allowed"
    if answer == "grant":
        assert decision.approval_id is None and not Approval.objects.exists()
        return
    # Recorded as an approval the policy decided, used by this call at once.
    approval = Approval.objects.get(pk=decision.approval_id)
    assert (approval.status, approval.policy_id, approval.decided_by) == (
        "consumed",
        policy.pk,
        None,
    )
    assert approval.consumed_at == at and approval.arguments_hash == event.arguments_hash
    assert (event.approval_id, json.loads(event.data)) == (
        str(approval.pk),
        {"confirmation_policy": policy.pk},
    )
    # Once: the next call is its own call, with its own record.
    again = ask(at=at, scope=scope)
    assert again.allowed and again.approval_id != decision.approval_id


def test_a_deny_policy_wins_over_an_approve_policy_and_over_a_persons_approval(world, carol):
    pending = ask()
    approvals.approval_approve(
        approval_id=pending.approval_id, approver=world.bob, actor=Actor.user(world.bob), at=NOW
    )
    write(world, "approve")
    deny = write(world, "deny", author=approver(carol), reason="no deletes during the freeze")
    for decision in (ask(), ask(approval=pending.approval_id)):
        assert (decision.decision, decision.reason) == ("deny", "approval_denied")
        assert f"policy #{deny.pk}" in decision.message
        event = event_of(decision)
        assert event.event_type == "access.denied"
        assert json.loads(event.data) == {"confirmation_policy": deny.pk}
    # The person's approval was not used up by the refused call.
    assert Approval.objects.get(pk=pending.approval_id).status == "approved"


@pytest.mark.parametrize(
    ("scope", "answer"),
    [
        ("repo:acme/prod", "deny"),  # the repository the deny's `*` sits under
        ("repo:acme/prod/x", "deny"),
        ("repo:acme/prod/x/y", "deny"),
        # Case does not count for a deny: PROD is prod to a tool that names things
        # without regard to case (a GitHub repository).
        ("repo:acme/PROD", "deny"),
        ("repo:acme/Prod/x", "deny"),
        ("repo:acme/prod2", "approve"),  # a sibling is not under it
        ("repo:acme/pro", "approve"),
    ],
)
def test_a_deny_policy_covers_the_resource_its_star_sits_under_in_any_case(
    world, carol, make_grant, scope, answer
):
    """`deny repo:acme/prod/*` beside `approve repo:acme/*`: the deny's author meant
    prod, the repository itself above all (deleting it deletes everything in it), in
    any spelling of its case. It read as a grant's pattern, only what is below prod and
    to the byte, so the approve policy let the deletion of repo:acme/prod itself, and
    of anything in repo:acme/PROD, through."""
    from governance.services.reports import access_rows

    approve = write(world, "approve", scope="repo:acme/*")
    deny = write(world, "deny", scope="repo:acme/prod/*", author=approver(carol),
                 reason="prod is never deleted by rule")  # fmt: skip
    decision = ask(scope=scope)
    event = event_of(decision)
    if answer == "deny":
        assert (decision.decision, decision.reason) == ("deny", "approval_denied")
        assert (event.event_type, json.loads(event.data)) == (
            "access.denied", {"confirmation_policy": deny.pk},
        )  # fmt: skip
    else:
        assert (decision.decision, decision.policy_id) == ("allow", approve.pk)
        assert (event.event_type, event.decision) == ("access.allowed", "allow")
    # The access report names the deny for a grant on prod itself, as the gate asks it.
    exact = make_grant(world.agent, world.tool, actions=("delete",), scope="repo:acme/prod")
    shouted = make_grant(world.agent, world.tool, actions=("delete",), scope="repo:acme/PROD/*")
    for grant in (exact, shouted):
        (row,) = [r for r in access_rows(NOW) if r["grant"] == grant.pk]
        assert f"deny#{deny.pk}" in row["policies"] and f"approve#{approve.pk}" in row["policies"]


def test_a_persons_recent_denial_of_the_exact_call_beats_an_approve_policy(world, carol):
    pending = ask()
    approvals.approval_deny(
        approval_id=pending.approval_id,
        approver=world.bob,
        reason="not this one",
        actor=Actor.user(world.bob),
        at=NOW,
    )
    write(world, "approve", author=approver(carol))
    decision = ask(at=NOW + MS)
    assert (decision.decision, decision.reason) == ("deny", "approval_denied")
    assert decision.approval_id == pending.approval_id
    event = event_of(decision)
    assert (event.event_type, event.approval_id) == ("access.denied", pending.approval_id)
    assert Approval.objects.filter(policy__isnull=False).count() == 0
    # Other calls the policy covers still go through.
    assert ask(at=NOW + MS, scope="repo:acme/tmp/other").allowed


def test_revoking_ends_a_policy_at_once(world, agent_client):
    policy = write(world)
    allowed = ask()
    assert allowed.allowed and event_of(allowed).event_type == "access.allowed"
    # The agent reads which policy decided its approval.
    polled = agent_client(world.agent).get(f"/api/v1/approvals/{allowed.approval_id}").json()
    assert (polled["status"], polled["policy"], polled["decided_by"]) == (
        "consumed",
        policy.pk,
        None,
    )
    confirmation.policy_revoke(
        policy_id=policy.pk, by=world.bob, reason="done", actor=Actor.user(world.bob), at=NOW
    )
    revoked = AuditEvent.objects.order_by("-seq").first()
    assert revoked.event_type == "confirmation_policy.revoked"
    assert json.loads(revoked.data)["policy"] == policy.pk
    decision = ask()
    assert decision.decision == "approval_required"
    assert event_of(decision).event_type == "access.approval_required"
    with pytest.raises(Conflict) as exc:
        confirmation.policy_revoke(
            policy_id=policy.pk, by=world.bob, reason="x", actor=Actor.user(world.bob), at=NOW
        )
    assert exc.value.code == "not_live"


def test_the_same_policy_asked_twice_is_one_policy_and_revoking_it_ends_it(world, human_client):
    """A double click wrote two identical approve policies: revoking "the" policy left
    the other approving deletes. Asked again while it lives, it is the same policy (the
    API answers 200, nothing written); another duration, reason or scope is another."""
    first = write(world)
    events = AuditEvent.objects.count()
    assert write(world, at=WRITTEN + timedelta(seconds=2)).pk == first.pk
    assert AuditEvent.objects.count() == events
    body = {"agent": "cleaner", "tool": "repo", "action": "delete", "scope": "repo:acme/tmp/*",
            "verdict": "approve", "reason": "scratch space", "duration_seconds": 3600}  # fmt: skip
    bob = human_client(world.bob)
    made = bob.post("/api/v1/confirmation-policies", body, format="json")
    again = bob.post("/api/v1/confirmation-policies", body, format="json")
    assert (made.status_code, again.status_code) == (201, 200), again.content
    assert again.json()["id"] == made.json()["id"]
    other = write(world, duration=timedelta(hours=2))
    assert other.pk != first.pk
    confirmation.policy_revoke(
        policy_id=first.pk, by=world.bob, reason="done", actor=Actor.user(world.bob), at=NOW
    )
    assert ConfirmationPolicy.objects.filter(revoked_at__isnull=True).count() == 2


def test_a_task_bound_policy_answers_only_under_its_task(world):
    write(world, task=world.task)
    outside = ask()
    assert outside.decision == "approval_required"
    assert event_of(outside).event_type == "access.approval_required"
    inside = ask(task="OPS-1")
    assert inside.allowed and event_of(inside).event_type == "access.allowed"


def test_nobody_writes_a_policy_for_their_own_agents_calls(world, alice, carol):
    # The owner, even as an approver; a person without the approver role; an auditor.
    with pytest.raises(Forbidden) as exc:
        write(world, author=approver(alice))
    assert exc.value.code == "self_approval"
    with pytest.raises(Forbidden) as exc:
        write(world, author=carol)
    assert exc.value.code == "not_approver"
    assert not ConfirmationPolicy.objects.exists()
    assert not AuditEvent.objects.filter(event_type__startswith="confirmation_policy").exists()


@pytest.mark.parametrize("verdict", ["approve", "deny"])
def test_a_deactivated_approver_writes_or_revokes_no_policy(world, carol, verdict):
    """An approver deactivated since writes nothing in their name (their approve policy
    would not answer anyway: the decision asks the author's role): refused, not_approver,
    nothing written; nor do they revoke one an active approver wrote."""
    carol = approver(carol)
    carol.is_active = False
    carol.save(update_fields=["is_active"])
    before = AuditEvent.objects.count()
    with pytest.raises(Forbidden) as exc:
        write(world, verdict, author=carol)
    assert (exc.value.code, exc.value.status) == ("not_approver", 403)
    policy = write(world, verdict)  # bob's
    after = AuditEvent.objects.count()
    assert after == before + 1
    with pytest.raises(Forbidden) as exc:
        confirmation.policy_revoke(
            policy_id=policy.pk, by=carol, reason="no", actor=Actor.user(carol), at=NOW
        )
    assert exc.value.code == "not_approver"
    policy.refresh_from_db()
    assert policy.revoked_at is None and AuditEvent.objects.count() == after
    assert list(ConfirmationPolicy.objects.values_list("created_by", flat=True)) == [world.bob.pk]


def test_the_owner_may_restrict_their_own_agent_with_a_deny_policy(world, alice):
    deny = write(world, "deny", author=approver(alice), reason="nothing under tmp goes")
    decision = ask()
    assert (decision.decision, decision.reason, decision.policy_id) == (
        "deny",
        "approval_denied",
        deny.pk,
    )
    assert json.loads(event_of(decision).data) == {"confirmation_policy": deny.pk}


def test_a_subagents_own_grant_counts_for_nothing(world, make_agent, make_grant):
    """A subagent only ever holds a subset of its parent's grants. Its own grant (a row
    from before the services refused one, or written around them) was obeyed: a delete
    grant of its own asked a person under the parent's prod freeze's neighbours, and
    could be approved. It is not a grant: no_grant, nobody asked, not in the report."""
    from governance.services.reports import access_rows

    child = make_agent("sweeper")
    grandchild = make_agent("sweeper.sub")
    own = [
        make_grant(agent, world.tool, actions=("delete", "read"), scope="repo:acme/*",
                   starts_at=NOW - timedelta(hours=1), duration=timedelta(hours=3))
        for agent in (child, grandchild)
    ]  # fmt: skip
    # Before they were made subagents, each had a grant of its own.
    for name in ("sweeper", "sweeper.sub"):
        before = access_check(agent=name, tool="repo", action="read", scope="repo:acme/x", at=NOW)
        assert before.allowed and event_of(before).decision == "allow"
    Agent.objects.filter(pk=child.pk).update(parent=world.agent)
    Agent.objects.filter(pk=grandchild.pk).update(parent=child)
    for name, action in [(n, a) for n in ("sweeper", "sweeper.sub") for a in ("delete", "read")]:
        refused = access_check(
            agent=name, tool="repo", action=action, scope="repo:acme/tmp/x", at=NOW + MS
        )
        assert (refused.decision, refused.reason, refused.grant_id) == ("deny", "no_grant", None)
        assert refused.message == (
            f"No grant gives {action!r} on this tool. A subagent holds only grants its "
            "parent delegated to it."
        )
        event = event_of(refused)
        assert (event.decision, event.reason, event.grant_id) == ("deny", "no_grant", None)
    assert not Approval.objects.filter(agent__in=[child, grandchild]).exists()
    assert not {g.pk for g in own} & {r["grant"] for r in access_rows(NOW + MS)}
    # The parent's own grant is untouched.
    assert ask(at=NOW + MS, action="read").allowed


def test_nobody_with_a_stake_lifts_a_deny_on_their_own_agents_calls(
    world, alice, carol, dave, make_agent
):
    """Revoking a deny only checked the approver role: the owner, frozen out of prod
    deletes by someone else, lifted the freeze and went on. Lifting a deny loosens, so
    it takes what writing an approve takes: no stake in the agent or any agent below
    it (whose calls the deny binds). Revoking an approve policy restricts: anyone may."""
    freeze = write(world, "deny", scope="repo:acme/prod/*", reason="prod freeze")
    child = make_agent("sweeper", parent=world.agent, owner=approver(carol))
    stakes = (approver(alice), approver(carol))  # the owner; the subagent's owner
    before = AuditEvent.objects.count()
    for person in stakes:
        with pytest.raises(Forbidden) as refused:
            confirmation.policy_revoke(
                policy_id=freeze.pk, by=person, reason="done", actor=Actor.user(person), at=NOW
            )
        assert refused.value.code == "self_approval"
    assert AuditEvent.objects.count() == before
    assert ConfirmationPolicy.objects.get(pk=freeze.pk).revoked_at is None
    denied = ask(scope="repo:acme/prod/db")
    assert (denied.reason, event_of(denied).reason) == ("approval_denied", "approval_denied")
    # An approver with no stake lifts it; the owner may revoke an approve policy.
    outsider = approver(dave)
    confirmation.policy_revoke(
        policy_id=freeze.pk, by=outsider, reason="freeze over", actor=Actor.user(outsider), at=NOW
    )
    lifted = AuditEvent.objects.filter(event_type="confirmation_policy.revoked").get()
    assert lifted.actor == f"user:{dave.username}"
    loose = write(world, "approve")
    confirmation.policy_revoke(
        policy_id=loose.pk, by=approver(alice), reason="ask me", actor=Actor.user(alice), at=NOW
    )
    assert ConfirmationPolicy.objects.get(pk=loose.pk).revoked_at == NOW
    assert child.parent_id == world.agent.pk


def test_a_policy_whose_author_comes_to_act_as_the_agent_stops_answering(world):
    policy = write(world)
    assert ask().allowed
    # bob issues himself a token for cleaner: he could now make the calls his own
    # policy approves. From then on it answers nothing, even once the token is revoked.
    token, _ = agents.token_issue(
        created_by=world.bob, agent=world.agent, actor=Actor.user(world.bob), at=NOW
    )
    agents.token_revoke(token=token, actor=Actor.user(world.bob), at=NOW)
    decision = ask(at=NOW + MS)
    assert decision.decision == "approval_required" and decision.policy_id is None
    assert event_of(decision).event_type == "access.approval_required"
    assert ConfirmationPolicy.objects.get(pk=policy.pk).live_at(NOW + MS)  # still on record


def test_the_report_of_a_moment_before_the_author_took_a_stake_still_names_the_policy(
    world, human_client, carol
):
    """bob's approve policy answered cleaner's deletes at t; at NOW he issued himself a
    token for cleaner. The report of t then left the policy out, as if the gate had
    ignored it at t: the stake counted tokens issued after the moment. A token is a
    stake from its issue on: the report of t names the policy, as the gate answered
    then; the report and the gate from NOW on leave it out."""
    policy = write(world)
    t = NOW - timedelta(minutes=5)
    then = ask(at=t)
    assert (then.decision, then.policy_id) == ("allow", policy.pk)
    assert event_of(then).event_type == "access.allowed"
    token, _ = agents.token_issue(
        created_by=world.bob, agent=world.agent, actor=Actor.user(world.bob), at=NOW
    )
    auditor = human_client(carol, "auditors")

    def named(at: datetime) -> list[str]:
        response = auditor.get("/api/v1/reports/access", {"at": at.isoformat()})
        assert response.status_code == 200, response.content
        event = AuditEvent.objects.order_by("-seq").first()
        assert (event.event_type, event.actor) == ("report.exported", "user:carol")
        return {row["grant"]: row["policies"] for row in response.json()["rows"]}[world.grant.pk]

    assert named(t) == [f"approve#{policy.pk}"]
    assert token.created_at == NOW  # the issue's moment, as its event says
    assert authorize(agent="cleaner", tool="repo", action="delete", scope=SCRATCH, at=t).allowed
    assert named(NOW) == []
    later = ask(at=NOW + MS)
    assert (later.decision, later.policy_id) == ("approval_required", None)
    assert event_of(later).event_type == "access.approval_required"


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"action": "read"}, "not_destructive"),
        ({"scope": "repo:acme/../x"}, "invalid_scope"),
        ({"reason": "  "}, "reason_required"),
        ({"duration": timedelta(days=365)}, "duration_too_long"),
        ({"duration": timedelta(0)}, "invalid_duration"),
    ],
)
def test_a_bad_policy_is_refused_with_its_code_and_nothing_is_written(world, change, code):
    before = AuditEvent.objects.count()
    with pytest.raises(GovernanceError) as exc:
        write(world, **change)
    assert exc.value.code == code
    assert not ConfirmationPolicy.objects.exists() and AuditEvent.objects.count() == before


def test_what_if_reads_the_policy_and_writes_nothing(world):
    policy = write(world)
    before = AuditEvent.objects.count()
    decision = authorize(
        agent="cleaner", tool="repo", action="delete", scope="repo:acme/tmp/x", at=NOW
    )
    assert (decision.decision, decision.policy_id) == ("allow", policy.pk)
    assert not Approval.objects.exists() and AuditEvent.objects.count() == before


def test_the_api_writes_lists_and_revokes_policies(world, human_client, carol, agent_client):
    bob = human_client(world.bob)
    body = {
        "agent": "cleaner",
        "tool": "repo",
        "action": "delete",
        "scope": "repo:acme/tmp/*",
        "verdict": "approve",
        "reason": "scratch space",
        "duration_seconds": 3600,
    }
    made = bob.post("/api/v1/confirmation-policies", body, format="json")
    assert made.status_code == 201, made.content
    policy = ConfirmationPolicy.objects.get(pk=made.json()["id"])
    assert (policy.created_by, policy.verdict, made.json()["created_by"]) == (
        world.bob,
        "approve",
        "bob",
    )
    created = AuditEvent.objects.get(event_type="confirmation_policy.created")
    assert (created.agent, created.tool, created.scope) == ("cleaner", "repo", "repo:acme/tmp/*")
    assert created.actor == "user:bob"

    # Bad input: a clear 400 naming the field; nothing written.
    for change, code, field in [
        ({"agent": "nobody"}, "unknown_agent", "agent"),
        ({"action": "read"}, "not_destructive", "action"),
        ({"duration_seconds": 10**8}, "duration_too_long", "duration_seconds"),
        ({"verdict": "maybe"}, "invalid_request", "verdict"),
    ]:
        refused = bob.post("/api/v1/confirmation-policies", {**body, **change}, format="json")
        assert refused.status_code == 400, refused.content
        error = refused.json()["error"]
        assert error["code"] == code and field in error["fields"], error
    assert ConfirmationPolicy.objects.count() == 1

    auditor = human_client(carol, roles.AUDITORS)
    listed = auditor.get("/api/v1/confirmation-policies")
    assert listed.status_code == 200 and [p["id"] for p in listed.json()] == [policy.pk]
    assert auditor.post("/api/v1/confirmation-policies", body, format="json").status_code == 403
    assert agent_client(world.agent).get("/api/v1/confirmation-policies").status_code == 403

    url = f"/api/v1/confirmation-policies/{policy.pk}/revoke"
    revoked = bob.post(url, {"reason": "done"}, format="json")
    assert revoked.status_code == 200 and revoked.json()["revoked_by"] == "bob"
    assert AuditEvent.objects.filter(event_type="confirmation_policy.revoked").count() == 1
    again = bob.post(url, {"reason": "done"}, format="json")
    assert again.status_code == 409 and again.json()["error"]["code"] == "not_live"
    missing = bob.post(
        "/api/v1/confirmation-policies/999999/revoke", {"reason": "x"}, format="json"
    )
    assert missing.status_code == 404


def test_the_approvals_inbox_lists_the_live_policies(world):
    # The page asks the real clock.
    live = write(world, at=timezone.now() - timedelta(minutes=1))
    ended = write(world, "deny", at=timezone.now() - timedelta(hours=3))
    client = Client()
    client.force_login(world.bob)
    html = client.get("/ui/inbox/approvals/").content.decode()
    assert f'id="policy-{live.pk}"' in html and "repo:acme/tmp/*" in html
    assert f'id="policy-{ended.pk}"' not in html


def test_an_approver_writes_and_revokes_a_policy_in_the_ui_and_an_owner_cannot() -> None:
    world = ui_world.build()  # bot-a, alice's agent, may delete under repo:acme/*
    form = {"agent": "bot-a", "tool": "repo", "action": "delete", "scope": "repo:acme/tmp/*",
            "verdict": "approve", "reason": "scratch", "hours": "2"}  # fmt: skip
    bob = ui_world.signed_in("approver")
    page = bob.get("/ui/inbox/approvals/").content.decode()
    assert 'action="/ui/inbox/approvals/policies/new"' in page  # the form is on the page
    assert ui_world.post(bob, "/ui/inbox/approvals/policies/new", form).status_code == 302
    policy = ConfirmationPolicy.objects.get()
    assert (policy.created_by.username, policy.expires_at - policy.starts_at) == (
        "bob",
        timedelta(hours=2),
    )
    assert AuditEvent.objects.filter(event_type="confirmation_policy.created").count() == 1
    # The agent's delete there now goes through without a person, on record.
    decision = access_check(
        agent="bot-a", tool="repo", action="delete", scope="repo:acme/tmp/x", at=timezone.now()
    )
    assert decision.allowed and decision.policy_id == policy.pk
    assert event_of(decision).event_type == "access.allowed"

    # alice owns bot-a: even as an approver she gets 403 self_approval, nothing written.
    alice = approver(world.alice)
    client = Client(enforce_csrf_checks=True)
    client.force_login(alice)
    client.get("/ui/")
    refused = ui_world.post(client, "/ui/inbox/approvals/policies/new", form)
    assert refused.status_code == 403 and "self_approval" in refused.content.decode()
    assert ConfirmationPolicy.objects.count() == 1

    # bob then issues himself a token for bot-a: the inbox says his policy no longer answers.
    row = f'id="policy-{policy.pk}"'
    assert "not answering" not in bob.get("/ui/inbox/approvals/").content.decode().split(row)[1]
    bob_user = world.users["approver"]
    agents.token_issue(
        created_by=bob_user, agent=world.agent, actor=Actor.user(bob_user), at=timezone.now()
    )
    html = bob.get("/ui/inbox/approvals/").content.decode()
    assert "not answering" in html.split(row)[1].split("</tr>")[0]

    revoke = f"/ui/inbox/approvals/policies/{policy.pk}/revoke"
    assert ui_world.post(bob, revoke, {"reason": "done"}).status_code == 302
    policy.refresh_from_db()
    assert policy.revoked_by.username == "bob" and policy.revoke_reason == "done"
    after = access_check(
        agent="bot-a", tool="repo", action="delete", scope="repo:acme/tmp/x", at=timezone.now()
    )
    assert after.decision == "approval_required"
    assert event_of(after).event_type == "access.approval_required"


# --- Found by review: stakes through the grant and the agent tree, second looks ----------


def test_the_person_who_asked_for_the_grant_cannot_confirm_its_calls_by_rule(
    world, make_grant, alice, system
):
    """By hand the grant's requester may not approve its calls; by rule neither."""
    dave = approver(User.objects.create_user("dave"))
    ask_grant = grants.grant_issue(
        agent=world.agent, tool=world.tool, actions=["delete"], scope="repo:acme/tmp/*",
        duration=timedelta(hours=3), justification="cleanup", requested_by=dave,
        approved_by=world.bob, actor=system, at=NOW - timedelta(hours=1),
    )  # fmt: skip
    with pytest.raises(Forbidden) as exc:
        write(world, author=dave)
    assert exc.value.code == "self_approval" and not ConfirmationPolicy.objects.exists()

    # Written before his grant existed: it stops answering for calls under that grant.
    grants.grant_revoke(
        grant_id=ask_grant.pk, reason="x", revoked_by=world.bob, actor=system, at=WRITTEN
    )
    grants.grant_revoke(
        grant_id=world.grant.pk, reason="x", revoked_by=world.bob, actor=system, at=WRITTEN
    )
    write(world, author=dave, at=WRITTEN + MS)
    assert ask().reason == "grant_revoked"  # no live grant yet: denied before the gate
    mine = grants.grant_issue(
        agent=world.agent, tool=world.tool, actions=["delete"], scope="repo:acme/*",
        duration=timedelta(hours=3), justification="again", requested_by=dave,
        approved_by=world.bob, actor=system, at=NOW - timedelta(minutes=1),
    )  # fmt: skip
    decision = ask()
    assert (decision.decision, decision.grant_id, decision.policy_id) == (
        "approval_required",
        mine.pk,
        None,
    )
    assert event_of(decision).event_type == "access.approval_required"


def test_a_token_for_an_agent_above_silences_the_authors_policy(world, make_agent, make_grant):
    parent = make_agent("lead")
    child = make_agent("sweeper", parent=parent)
    lead = make_grant(parent, world.tool, actions=("delete",), scope="repo:acme/*",
                      starts_at=NOW - timedelta(hours=1), duration=timedelta(hours=3),
                      delegable=True)  # fmt: skip
    grants.grant_delegate(
        parent_grant_id=lead.pk, child=child, actions=["delete"], scope="repo:acme/*",
        expires_at=lead.expires_at, justification="clean up", actor=Actor.agent(parent),
        at=NOW - timedelta(minutes=20),
    )  # fmt: skip
    write(world, agent=child)
    asked = {"agent": "sweeper", "tool": "repo", "action": "delete", "scope": "repo:acme/tmp/x"}
    assert access_check(at=NOW, **asked).allowed
    agents.token_issue(created_by=world.bob, agent=parent, actor=Actor.user(world.bob), at=NOW)
    decision = access_check(at=NOW + MS, **asked)
    assert (decision.decision, decision.policy_id) == ("approval_required", None)
    assert event_of(decision).event_type == "access.approval_required"
    with pytest.raises(Forbidden):
        write(world, agent=child, at=NOW + MS)


def test_calls_a_policy_approved_are_sampled_for_a_second_look_by_someone_else(world, carol):
    approver(carol)
    write(world)
    decisions = [ask(at=NOW + i * MS) for i in range(3)]
    assert all(d.allowed for d in decisions)
    second_look.second_looks_sample(
        actor=Actor.system("t"), at=NOW + timedelta(minutes=1), fraction=1.0
    )
    looks = SecondLook.objects.filter(kind="approval")
    assert {str(look.approval_id) for look in looks} == {d.approval_id for d in decisions}
    # The policy's author is the approver whose decision is re-checked; not its reviewer.
    assert {look.original_approver_id for look in looks} == {world.bob.pk}
    assert all(look.reviewer_id not in (None, world.bob.pk) for look in looks)


def test_writing_a_policy_tells_the_agents_owner_and_the_other_approvers(
    world, approvers, alice, django_capture_on_commit_callbacks
):
    for person, address in ((alice, "alice@example.test"), (world.bob, "bob@example.test")):
        person.email = address
        person.save(update_fields=["email"])
    with django_capture_on_commit_callbacks(execute=True):
        policy = write(world, reason="scratch; ops password=hunter2 (never)")
    rows = Notification.objects.filter(event=NotificationEvent.POLICY_WRITTEN)
    told = sorted(r.target for r in rows if r.channel == "email")
    # The owner and every approver but the author (bob), each once.
    assert told == sorted(["alice@example.test", *(u.email for u in approvers)])
    assert {r.data["policy"] for r in rows} == {policy.pk}
    assert all("hunter2" not in json.dumps(r.data) + r.body for r in rows)  # masked
    assert len(mail.outbox) == len(told)
    assert "approve every delete by cleaner" in mail.outbox[0].body


# --- The access report names them ---------------------------------------------------------


def test_the_access_report_names_the_policies_that_answer_for_a_grants_destructive_calls(
    world, make_grant, human_client, carol
):
    """An auditor asking who could do what must see that a grant's deletes went through
    without a person (an approve policy) or could not go through at all (a deny). Before,
    the report (and its JSON over the API, which also dropped `blocked_by`) said nothing
    of policies."""
    from governance.services import reports

    allowing = write(world)  # delete under repo:acme/tmp/*
    denying = write(world, "deny", scope="repo:acme/*/secrets")
    # Another grant of the same agent and tool, on scopes neither policy touches.
    elsewhere = make_grant(
        world.agent,
        world.tool,
        actions=("read", "delete"),
        scope="repo:other/*",
        starts_at=NOW - timedelta(hours=1),
        duration=timedelta(hours=3),
    )

    def policies_at(at: datetime) -> dict[int, list[str]]:
        return {row["grant"]: row["policies"] for row in reports.access_rows(at)}

    both = [f"approve#{allowing.pk}", f"deny#{denying.pk}"]
    assert policies_at(NOW) == {world.grant.pk: both, elsewhere.pk: []}
    assert policies_at(WRITTEN - MS)[world.grant.pk] == []  # not yet in force
    assert policies_at(ENDS)[world.grant.pk] == []  # over
    confirmation.policy_revoke(
        policy_id=denying.pk, by=world.bob, reason="done", actor=Actor.user(world.bob), at=NOW
    )
    assert policies_at(NOW - MS)[world.grant.pk] == both  # the past is as it was
    assert policies_at(NOW)[world.grant.pk] == [f"approve#{allowing.pk}"]

    # Over the API, in JSON and CSV, with the export on record.
    auditor = human_client(carol, "auditors")
    answer = auditor.get("/api/v1/reports/access", {"at": (NOW - MS).isoformat()})
    assert answer.status_code == 200, answer.content
    rows = {row["grant"]: row for row in answer.json()["rows"]}
    assert rows[world.grant.pk]["policies"] == both
    assert rows[world.grant.pk]["blocked_by"] is None
    event = AuditEvent.objects.order_by("-seq").first()
    assert (event.event_type, event.actor) == ("report.exported", "user:carol")
    csv_text = auditor.get(
        "/api/v1/reports/access", {"at": (NOW - MS).isoformat(), "format": "csv"}
    ).content.decode()
    header, *lines = csv_text.splitlines()
    assert header.split(",")[-1] == '"policies"'
    assert any(line.endswith(f'"approve#{allowing.pk},deny#{denying.pk}"') for line in lines)


@pytest.mark.parametrize(
    ("a", "b", "overlap"),
    [
        ("repo:acme/*", "repo:acme/tmp/*", True),
        ("repo:acme/*/secrets", "repo:acme/tmp/*", True),  # repo:acme/tmp/secrets
        ("repo:acme/*/secrets", "repo:acme/tmp", False),  # one segment fewer
        ("repo:acme/api/*", "repo:acme/api2/*", False),
        ("repo:acme/api", "repo:acme/api", True),
        ("repo:acme/api", "repo:acme/api/*", False),  # a trailing * needs a segment
        ("repo:acme/*", "mail:acme/*", False),
        ("*", "mail:x", True),
        ("repo:a/*/c", "repo:a/b/*", True),  # repo:a/b/c
        ("repo:a/*/c", "repo:a/b/d", False),
        ("repo:a/../b", "repo:a/*", False),  # not a pattern at all
    ],
)
def test_two_scope_patterns_overlap_when_some_resource_matches_both(a, b, overlap):
    from governance.policy import patterns_overlap, scope_matches

    assert patterns_overlap(a, b) is overlap
    assert patterns_overlap(b, a) is overlap
    # Checked against the matcher itself, on the resources the patterns spell.
    witnesses = {p.replace("*", "x") for p in (a, b) if p != "*"} | {
        p.replace("*", "x") + "/y" for p in (a, b) if p.endswith("*")
    }
    if any(scope_matches(a, r) and scope_matches(b, r) for r in witnesses):
        assert overlap


def test_the_access_report_lists_only_the_policies_the_gate_would_ask(
    world, make_task, make_tool, make_grant
):
    """A policy is listed under a grant only where the gate would ask it: the task must
    match (and be open), the action be one the grant holds, and an approve policy's
    author must have no stake in the agent's calls."""
    from governance.services import reports

    other_task = make_task("OPS-2")
    window = {"starts_at": NOW - timedelta(hours=1), "duration": timedelta(hours=3)}
    on_task = make_grant(
        world.agent, world.tool, ("delete",), "repo:acme/*", task=world.task, **window
    )
    on_other = make_grant(
        world.agent, world.tool, ("delete",), "repo:acme/*", task=other_task, **window
    )
    reading = make_grant(world.agent, world.tool, ("read",), "repo:acme/*", **window)
    task_bound = write(world, task=world.task)
    # On an irreversible tool every action is destructive: an update policy answers there.
    mailer = make_tool("mailer", actions=("read", "update"), irreversible=True)
    mailing = make_grant(world.agent, mailer, ("update",), "repo:acme/*", **window)
    update_policy = confirmation.policy_create(
        agent=world.agent, tool=mailer, action="update", verdict="approve", scope="repo:acme/*",
        reason="r", duration=timedelta(hours=1), actor=Actor.user(world.bob), author=world.bob,
        at=WRITTEN,
    )  # fmt: skip

    def listed(at: datetime = NOW) -> dict[int, list[str]]:
        return {row["grant"]: row["policies"] for row in reports.access_rows(at)}

    found = listed()
    assert found[world.grant.pk] == found[on_task.pk] == [f"approve#{task_bound.pk}"]
    assert found[on_other.pk] == [] and found[reading.pk] == []
    assert found[mailing.pk] == [f"approve#{update_policy.pk}"]
    # Its task closed: a task-bound policy answers nothing.
    from governance.services import tasks

    tasks.task_close(task=world.task, actor=Actor.user(world.bob), at=NOW + MS)
    assert listed(NOW + 2 * MS)[world.grant.pk] == []
    assert listed(NOW)[world.grant.pk] == [f"approve#{task_bound.pk}"]  # as it was
    # bob comes to hold a token for the agent: his approve policies stop answering, and
    # the report stops listing them; the gate agrees.
    agents.token_issue(created_by=world.bob, agent=world.agent, actor=Actor.user(world.bob), at=NOW)
    assert listed()[mailing.pk] == []
    decision = access_check(
        agent="cleaner", tool="mailer", action="update", scope="repo:acme/x", at=NOW
    )
    assert (decision.decision, decision.policy_id) == ("approval_required", None)
    assert event_of(decision).event_type == "access.approval_required"


def test_a_parents_deny_policy_binds_what_it_hands_down(world, make_agent, carol):
    """A deny on the parent (delete under repo:acme/prod/* refused, even with a person's
    approval) used to bind the parent alone: handed `delete` on repo:acme/* the subagent
    got approval_required, and with a person's approval, or an approve policy of its
    own, deleted under prod. A deny up the delegation chain binds every grant below it;
    an approve policy answers for its own agent only. The access report says so too."""
    from governance.models import Grant
    from governance.services.reports import access_rows

    Grant.objects.filter(pk=world.grant.pk).update(delegable=True)
    child = make_agent("sweeper", parent=world.agent)
    handed = grants.grant_delegate(
        parent_grant_id=world.grant.pk,
        child=child,
        actions=["delete"],
        scope="repo:acme/*",
        expires_at=world.grant.expires_at,
        justification="clean up",
        actor=Actor.agent(world.agent),
        at=NOW - timedelta(minutes=20),
    )
    freeze = write(world, "deny", scope="repo:acme/prod/*", reason="prod freeze")
    write(world, "approve", scope="repo:acme/*")  # the parent's own: not the child's
    prod = {"tool": "repo", "action": "delete", "scope": "repo:acme/prod/db", "at": NOW}

    first = access_check(agent="sweeper", **prod)
    assert (first.decision, first.reason, first.policy_id) == ("deny", "approval_denied", freeze.pk)
    assert json.loads(event_of(first).data) == {"confirmation_policy": freeze.pk}
    assert Approval.objects.filter(agent=child).count() == 0
    # A person's approval of the exact call changes nothing while the deny stands.
    write(world, "approve", agent=child, author=approver(carol), scope="repo:acme/*")
    again = access_check(agent="sweeper", **prod)
    assert (again.decision, again.reason) == ("deny", "approval_denied")
    assert event_of(again).reason == "approval_denied"
    # Outside the deny's scope the child's own approve policy answers; the parent's does not.
    other = access_check(agent="sweeper", **{**prod, "scope": "repo:acme/tmp/x"})
    assert other.allowed and other.policy_id != freeze.pk
    assert event_of(other).decision == "allow"
    (row,) = [r for r in access_rows(NOW) if r["grant"] == handed.pk]
    assert f"deny#{freeze.pk}" in row["policies"]


@pytest.mark.parametrize("how", ["deactivated", "role_removed"])
def test_an_approve_policy_stops_answering_once_its_author_may_no_longer_approve(world, how):
    """A policy is a standing approval: it answers only while its author could approve
    by hand (active, an approver). Their deny policies keep binding."""
    from governance.services import reports
    from governance.web.queries import live_confirmation_policies

    approve = write(world)
    deny = write(world, "deny", scope="repo:acme/tmp/keep/*")
    assert ask().reason == "allowed"
    bob = User.objects.get(pk=world.bob.pk)
    with accounts_changed_at(NOW):  # between the two questions, on the world's clock
        if how == "deactivated":
            bob.is_active = False
            bob.save()
        else:
            bob.groups.clear()
    decision = ask(at=NOW + MS)
    assert (decision.decision, decision.reason) == ("approval_required", "approval_required")
    event = AuditEvent.objects.get(uid=decision.decision_id)
    assert (event.decision, event.reason) == ("approval_required", "approval_required")
    denied = ask(at=NOW + MS, scope="repo:acme/tmp/keep/x")
    assert (denied.decision, denied.reason) == ("deny", "approval_denied")
    # What people read says the same: the report, and the policy list's marker.
    (row,) = [r for r in reports.access_rows(NOW + MS) if r["grant"] == world.grant.pk]
    assert f"approve#{approve.pk}" not in row["policies"]
    assert f"deny#{deny.pk}" in row["policies"]
    silenced = {p.pk: p.silenced for p in live_confirmation_policies(NOW + MS)}
    assert silenced == {approve.pk: True, deny.pk: False}


def test_an_approve_policy_stops_answering_once_another_definition_of_the_tool_is_approved(
    world, person
):
    """A policy approves calls to the tool as it was when it was written. The tool
    changed what it says (quarantined, every decision denied), an admin approved the new
    definition, and the policy went on approving its deletes: open approvals are voided
    on a quarantine for that reason, a standing one was not. Its denies keep binding."""
    from governance.services import reports, tools
    from governance.web.queries import live_confirmation_policies

    approve = write(world)
    deny = write(world, "deny", scope="repo:acme/tmp/keep/*")
    assert approve.definition_hash == world.tool.approved_hash != ""
    assert ask().reason == "allowed"
    tools.tool_update_definition(
        tool=world.tool, description="deletes now also purge backups", actor=Actor.system("sync"),
        at=NOW,
    )  # fmt: skip
    assert ask(at=NOW + MS).reason == "tool_quarantined"
    admin = person("ada", roles.ADMINS)
    tool = type(world.tool).objects.get(pk=world.tool.pk)
    tools.tool_approve_definition(
        tool=tool, definition_hash=tool.definition_hash, approver=admin, actor=Actor.user(admin),
        at=NOW + MS,
    )  # fmt: skip
    decision = ask(at=NOW + 2 * MS)
    assert (decision.decision, decision.reason) == ("approval_required", "approval_required")
    event = event_of(decision)
    assert (event.decision, event.reason) == ("approval_required", "approval_required")
    denied = ask(at=NOW + 2 * MS, scope="repo:acme/tmp/keep/x")
    assert (denied.decision, denied.reason) == ("deny", "approval_denied")
    (row,) = [r for r in reports.access_rows(NOW + 2 * MS) if r["grant"] == world.grant.pk]
    assert row["policies"] == [f"deny#{deny.pk}"]
    silenced = {p.pk: p.silenced for p in live_confirmation_policies(NOW + 2 * MS)}
    assert silenced == {approve.pk: True, deny.pk: False}
    # A policy written against the definition approved now answers again.
    again = write(world, at=NOW + 3 * MS)
    assert ask(at=NOW + 4 * MS).policy_id == again.pk


def test_a_parents_approve_policy_does_not_answer_for_its_subagent(world, make_agent):
    """An approve policy answers for its own agent's calls only; a deny binds below."""
    Grant.objects.filter(pk=world.grant.pk).update(delegable=True)
    child = make_agent("sweeper", parent=world.agent)
    grants.grant_delegate(
        parent_grant_id=world.grant.pk, child=child, actions=["delete"],
        scope="repo:acme/tmp/*", expires_at=world.grant.expires_at, justification="clean tmp",
        actor=Actor.agent(world.agent), at=NOW - timedelta(minutes=20),
    )  # fmt: skip
    write(world, "approve", scope="repo:acme/tmp/*")  # the parent's own
    decision = access_check(agent="sweeper", tool="repo", action="delete",
                            scope="repo:acme/tmp/build-1", at=NOW)  # fmt: skip
    assert (decision.decision, decision.reason, decision.policy_id) == (
        "approval_required", "approval_required", None,
    )  # fmt: skip
    event = AuditEvent.objects.get(uid=decision.decision_id)
    assert (event.event_type, event.decision) == ("access.approval_required", "approval_required")
    assert "confirmation_policy" not in (event.data or "")
    assert Approval.objects.get(pk=decision.approval_id).status == "pending"


def test_the_upgrade_silences_a_policy_0022_carried_past_a_re_approval(world, person):
    """0022 gave every existing policy its tool's definition approved at the upgrade:
    a policy written before a re-approval then answered for the new definition, which
    the current code refuses (the test above). 0024 empties, from the log, the hash of
    every policy written before its tool's last `tool.approved`; later ones keep theirs."""
    import importlib

    from django.db import connection

    from governance.services import tools

    migration = importlib.import_module(
        "governance.migrations.0024_policy_hash_only_if_written_after_approval"
    )
    old = write(world)
    tools.tool_update_definition(
        tool=world.tool, description="deletes now also purge backups", actor=Actor.system("sync"),
        at=NOW,
    )  # fmt: skip
    admin = person("ada", roles.ADMINS)
    tool = type(world.tool).objects.get(pk=world.tool.pk)
    tools.tool_approve_definition(
        tool=tool, definition_hash=tool.definition_hash, approver=admin, actor=Actor.user(admin),
        at=NOW + MS,
    )  # fmt: skip
    # As 0022 left it: the hash of the definition approved at the upgrade.
    type(old).objects.filter(pk=old.pk).update(definition_hash=tool.definition_hash)
    assert ask(at=NOW + 2 * MS).policy_id == old.pk  # the hole
    new = write(world, scope="repo:acme/tmp/new/*", at=NOW + 2 * MS)

    class Editor:  # a schema editor's execute() (SQLite's will not open inside a test)
        def execute(self, sql: str) -> None:
            with connection.cursor() as cursor:
                cursor.execute(sql)

    migration.empty_stale(None, Editor())

    old.refresh_from_db()
    new.refresh_from_db()
    assert (old.definition_hash, new.definition_hash) == ("", tool.definition_hash)
    decision = ask(at=NOW + 3 * MS)
    assert (decision.decision, decision.policy_id) == ("approval_required", None)
    event = event_of(decision)
    assert (event.decision, event.reason) == ("approval_required", "approval_required")
    assert ask(at=NOW + 3 * MS, scope="repo:acme/tmp/new/x").policy_id == new.pk


def test_suspending_an_agent_ends_its_approve_policies_and_keeps_its_deny_policies(
    world, carol, make_agent, make_grant, system
):
    """A standing approval of an agent's destructive calls outlived its suspension: after
    the resume (the incident investigated, a new token), the policy went on letting its
    deletes through with no person looking, though every hand approval was voided. Now
    suspension ends the approve policies of every agent it reaches, each on record, and
    after the resume a person confirms each call again; a deny policy stays (it only
    restricts), as does a policy of an agent the suspension did not reach."""
    helper = make_agent("helper", parent=world.agent)  # its own policy, no grant needed
    other = make_agent("other")
    make_grant(other, world.tool, actions=("delete",), scope="repo:acme/*",
               starts_at=NOW - timedelta(hours=1), duration=timedelta(hours=3))  # fmt: skip
    approve = write(world)
    approve_helper = write(world, agent=helper)
    approve_other = write(world, agent=other)
    deny = write(world, "deny", author=approver(carol), scope="repo:acme/keep/*")
    assert ask().reason == "allowed"  # the policy answers before the suspension
    agents.agent_suspend(agent=world.agent, reason="token leaked", actor=system, at=NOW)
    ended = {p.pk: p for p in ConfirmationPolicy.objects.all()}
    for policy in (approve, approve_helper):
        assert (ended[policy.pk].revoked_at, ended[policy.pk].revoke_reason) == (
            NOW, confirmation.SUSPENDED_REASON,
        )  # fmt: skip
    assert ended[deny.pk].revoked_at is None and ended[approve_other.pk].revoked_at is None
    revoked = AuditEvent.objects.filter(event_type="confirmation_policy.revoked").order_by("seq")
    assert [
        (json.loads(e.data)["policy"], e.agent, e.actor, json.loads(e.data)["reason"])
        for e in revoked
    ] == [
        (approve.pk, "cleaner", system.label, confirmation.SUSPENDED_REASON),
        (approve_helper.pk, "helper", system.label, confirmation.SUSPENDED_REASON),
    ]
    suspended = {
        e.agent: json.loads(e.data) for e in AuditEvent.objects.filter(event_type="agent.suspended")
    }
    assert suspended["cleaner"]["approve_policies_ended"] == [approve.pk]
    assert suspended["helper"]["approve_policies_ended"] == [approve_helper.pk]
    agents.agent_resume(agent=world.agent, reason="rotated", actor=system, at=NOW + MS)
    after = ask(at=NOW + 2 * MS)
    assert (after.decision, after.policy_id) == ("approval_required", None)
    assert event_of(after).event_type == "access.approval_required"
    kept = ask(at=NOW + 3 * MS, scope="repo:acme/keep/x")
    assert (kept.decision, kept.reason) == ("deny", "approval_denied")
    assert json.loads(event_of(kept).data) == {"confirmation_policy": deny.pk}
    # The agent the suspension did not reach keeps its policy.
    theirs = access_check(agent="other", tool="repo", action="delete", scope=SCRATCH, at=NOW)
    assert (theirs.decision, theirs.policy_id) == ("allow", approve_other.pk)
