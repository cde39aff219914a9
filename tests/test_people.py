"""Accounts and roles are state: who may approve, review or export. Every change to a
person's account or role groups is an audit event (governance.services.people), made
through the Django admin, a shell or a command alike, never with the password hash."""

from __future__ import annotations

import json
from datetime import timedelta
from io import StringIO

import pytest
from django.contrib.auth.models import Group, User
from django.contrib.auth.signals import user_logged_in
from django.core.management import CommandError, call_command
from django.test import RequestFactory
from django.utils import timezone

from governance import roles
from governance.models import AgentToken, AuditEvent
from governance.services import agents, people
from tests.conftest import NOW

pytestmark = pytest.mark.django_db


def person_events() -> list[tuple[str, str, dict]]:
    found = AuditEvent.objects.filter(event_type__startswith="person.").order_by("seq")
    return [(e.event_type, e.actor, json.loads(e.data)) for e in found]


def test_account_and_role_changes_from_a_shell_are_events_never_with_the_hash():
    approvers = Group.objects.create(name="approvers")
    admins = Group.objects.create(name="admins")
    sam = User.objects.create_user("sam", password="first-pass-123")
    sam.groups.add(approvers)
    admins.user_set.add(sam)  # the other side of the relation
    sam.set_password("second-pass-456")
    sam.is_superuser = True
    sam.save()
    sam.groups.remove(admins)
    sam.groups.clear()
    sam.delete()
    kinds = [(kind, actor) for kind, actor, _ in person_events()]
    assert kinds == [
        ("person.created", "system:unattributed"),
        ("person.roles_changed", "system:unattributed"),
        ("person.roles_changed", "system:unattributed"),
        ("person.changed", "system:unattributed"),
        ("person.roles_changed", "system:unattributed"),
        ("person.roles_changed", "system:unattributed"),
        ("person.deleted", "system:unattributed"),
    ]
    data = [d for _, _, d in person_events()]
    assert data[0] == {
        "person": "sam", "person_id": data[0]["person_id"], "username": "sam",
        "is_active": True, "is_superuser": False, "is_staff": False,
    }  # fmt: skip
    assert (data[1]["added"], data[1]["roles"]) == (["approvers"], ["approvers"])
    assert (data[2]["added"], data[2]["roles"]) == (["admins"], ["admins", "approvers"])
    assert data[3]["changed"] == {
        "is_superuser": {"before": False, "after": True},
        "password": "changed",
    }
    assert (data[4]["removed"], data[4]["roles"]) == (["admins"], ["approvers"])
    assert (data[5]["removed"], data[5]["roles"]) == (["approvers"], [])
    assert data[6]["person"] == "sam"
    stored = "".join(e.data for e in AuditEvent.objects.all())
    assert "pbkdf2" not in stored and "pass-123" not in stored and "pass-456" not in stored
    call_command("audit_verify")  # raises SystemExit(1) on a broken chain


def test_a_login_or_a_save_that_changes_nothing_is_not_an_event():
    sam = User.objects.create_user("sam", password="first-pass-123")
    before = AuditEvent.objects.count()
    user_logged_in.send(sender=User, request=RequestFactory().get("/"), user=sam)
    sam.refresh_from_db()
    assert sam.last_login is not None  # Django's own handler saved it
    sam.first_name = "Sam"
    sam.save()
    assert AuditEvent.objects.count() == before


def test_the_actor_is_the_signed_in_person_of_the_request():
    boss = User.objects.create_user("boss", is_superuser=True, is_staff=True)
    request = RequestFactory().post("/admin/")
    request.user = boss
    token = people.set_request(request)
    try:
        ghost = User.objects.create_user("ghost")
        ghost.groups.add(Group.objects.create(name="approvers"))
    finally:
        people.reset_request(token)
    assert [(k, a) for k, a, _ in person_events()][-2:] == [
        ("person.created", "user:boss"),
        ("person.roles_changed", "user:boss"),
    ]


def test_an_account_added_in_the_django_admin_is_an_event_naming_the_admin(client):
    boss = User.objects.create_superuser("boss", password="boss-pass-123")
    client.force_login(boss)
    response = client.post(
        "/admin/auth/user/add/",
        {
            "username": "mallory",
            "password1": "Sup3r-long-pass!",
            "password2": "Sup3r-long-pass!",
            "usable_password": "true",
        },
    )
    assert response.status_code == 302, response.content[:2000]
    mallory = User.objects.get(username="mallory")
    (kind, actor, data) = person_events()[-1]
    assert (kind, actor, data["person_id"]) == ("person.created", "user:boss", mallory.pk)
    assert data["is_superuser"] is False
    assert mallory.date_joined <= timezone.now()


def _audit_write_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    from governance import audit

    def refused(**kwargs: object) -> None:
        raise RuntimeError("the audit write failed")

    monkeypatch.setattr(audit, "append", refused)


@pytest.mark.django_db(transaction=True)
def test_a_shell_change_whose_event_cannot_be_written_does_not_stand(monkeypatch):
    """Outside a transaction (a shell, createsuperuser) the change committed before its
    signal ran: a failed event left a new superuser with no trace. It is undone."""
    from governance import roles

    sam = User.objects.create_user("sam", password="first-pass-123")
    before = person_events()
    with monkeypatch.context() as broken:
        _audit_write_fails(broken)
        sam.is_superuser = True
        sam.set_password("second-pass-456")
        with pytest.raises(RuntimeError, match="audit write failed"):
            sam.save()
        with pytest.raises(RuntimeError, match="audit write failed"):
            User.objects.create_superuser("root2", password="pw-123456")
    stored = User.objects.get(pk=sam.pk)
    assert not stored.is_superuser and not roles.is_admin(stored)
    assert stored.check_password("first-pass-123")
    assert not User.objects.filter(username="root2").exists()
    assert person_events() == before


def test_renaming_or_deleting_a_group_is_an_event_for_each_member():
    """A role is a group's name: renaming `ops` to `approvers` (the Django admin's
    group form does it) made every member an approver, and deleting `approvers` took
    the role from all of them, without an event."""
    from governance import roles

    ops = Group.objects.create(name="ops")
    eve = User.objects.create_user("eve", password="pw-123456")
    finn = User.objects.create_user("finn", password="pw-123456")
    ops.user_set.add(eve, finn)
    start = len(person_events())
    ops.name = roles.APPROVERS
    ops.save()
    renamed = person_events()[start:]
    assert [(kind, data["person"]) for kind, _, data in renamed] == [
        ("person.roles_changed", "eve"),
        ("person.roles_changed", "finn"),
    ]
    assert renamed[0][2]["renamed"] == {"from": "ops", "to": roles.APPROVERS}
    assert renamed[0][2]["roles"] == [roles.APPROVERS]
    Group.objects.get(name=roles.APPROVERS).delete()
    removed = person_events()[start + 2 :]
    assert [(data["person"], data["removed"], data["roles"]) for _, _, data in removed] == [
        ("eve", [roles.APPROVERS], []),
        ("finn", [roles.APPROVERS], []),
    ]
    assert not roles.is_approver(User.objects.get(username="eve"))


@pytest.mark.django_db(transaction=True)
def test_a_group_renamed_from_a_shell_whose_events_cannot_be_written_keeps_its_name(
    monkeypatch,
):
    """Group.save() outside a transaction commits before post_save: a rename of `ops` to
    `approvers` whose events failed left every member an approver with no event."""
    from governance import roles

    ops = Group.objects.create(name="ops")
    eve = User.objects.create_user("eve", password="pw-123456")
    finn = User.objects.create_user("finn", password="pw-123456")
    ops.user_set.add(eve, finn)
    before = person_events()
    calls = []

    def second_fails(**kwargs):  # eve's event is written, finn's is not: neither stands
        calls.append(kwargs)
        if len(calls) == 2:
            raise RuntimeError("audit write failed")
        return real_append(**kwargs)

    from governance import audit

    real_append = audit.append
    monkeypatch.setattr(audit, "append", second_fails)
    ops.name = roles.APPROVERS
    with pytest.raises(RuntimeError, match="audit write failed"):
        ops.save()
    monkeypatch.undo()
    assert Group.objects.get(pk=ops.pk).name == "ops"
    assert not roles.is_approver(User.objects.get(username="eve"))
    assert person_events() == before


def test_django_permissions_given_or_taken_are_events_for_each_person_they_reach():
    """A Django permission (auth.change_user, say) opens the admin's account pages: giving
    one to a person or to a group of theirs changed what they may do without an event."""
    from django.contrib.auth.models import Permission

    change_user = Permission.objects.get(codename="change_user", content_type__app_label="auth")
    view_group = Permission.objects.get(codename="view_group", content_type__app_label="auth")
    sam = User.objects.create_user("sam", password="pw-123456", is_staff=True)
    eve = User.objects.create_user("eve", password="pw-123456")
    ops = Group.objects.create(name="ops")
    ops.user_set.add(sam, eve)
    start = len(person_events())
    sam.user_permissions.add(change_user, view_group)
    change_user.user_set.remove(sam)  # the other side of the relation
    ops.permissions.add(change_user)
    view_group.group_set.add(ops)
    ops.permissions.clear()
    sam.user_permissions.clear()
    changed = [
        (kind, actor, data["person"], data.get("added"), data.get("removed"), data.get("group"))
        for kind, actor, data in person_events()[start:]
    ]
    kind, unattributed = "person.permissions_changed", "system:unattributed"
    assert changed == [
        (kind, unattributed, "sam", ["auth.change_user", "auth.view_group"], None, None),
        (kind, unattributed, "sam", None, ["auth.change_user"], None),
        (kind, unattributed, "sam", ["auth.change_user"], None, "ops"),
        (kind, unattributed, "eve", ["auth.change_user"], None, "ops"),
        (kind, unattributed, "sam", ["auth.view_group"], None, "ops"),
        (kind, unattributed, "eve", ["auth.view_group"], None, "ops"),
        (kind, unattributed, "sam", None, ["auth.change_user", "auth.view_group"], "ops"),
        (kind, unattributed, "eve", None, ["auth.change_user", "auth.view_group"], "ops"),
        (kind, unattributed, "sam", None, ["auth.view_group"], None),
    ]


# --- Review findings: tokens and notices ------------------------------------------------


def test_a_revoked_token_is_refused_whatever_the_clock(make_agent, alice, system):
    from rest_framework.test import APIClient

    now = timezone.now()
    token, plaintext = agents.token_issue(
        created_by=alice, agent=make_agent(), actor=system, at=now
    )
    # Revoked by a host whose clock runs two seconds ahead of this one.
    agents.token_revoke(token=token, actor=system, at=now + timedelta(seconds=2))
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    assert client.get("/api/v1/me").status_code == 401


def test_the_admin_site_cannot_filter_tokens_by_digest(make_agent, alice, system, client):
    heidi = User.objects.create_user("heidi", password="pw-heidi-123456", is_staff=True)
    heidi.groups.add(Group.objects.get_or_create(name=roles.ADMINS)[0])
    token, _ = agents.token_issue(created_by=alice, agent=make_agent(), actor=system, at=NOW)
    client.force_login(heidi)
    base = "/admin/governance/agenttoken/"
    assert client.get(base).status_code == 200
    assert client.get(base, {"prefix": token.prefix}).status_code == 200  # other lookups work
    for lookup in ("digest__startswith", "digest", "digest__gt"):
        answer = client.get(base, {lookup: token.digest[:6]})
        assert answer.status_code == 400 or token.prefix not in answer.content.decode(), lookup


@pytest.mark.parametrize("by", ["carol", "gone", "nobody"])
def test_agent_token_create_records_only_an_active_admin_as_creator(make_agent, person, by):
    agent = make_agent()
    person("carol", roles.AUDITORS)
    gone = User.objects.create_superuser("gone", password="x-very-long-pw-1")
    gone.is_active = False
    gone.save()
    with pytest.raises(CommandError) as refused:
        call_command("agent_token", "create", agent.name, "--by", by, stdout=StringIO())
    assert "not an active admin" in str(refused.value)
    assert not AgentToken.objects.filter(agent=agent).exists()


def test_agent_token_revoke_touches_agents_tokens_only_and_api_token_peoples(
    make_agent, alice, system
):
    """`agent_token revoke` revoked a person's usr_ token too; each command now finds
    only its own kind, as `api_token revoke` already did."""

    personal, _ = agents.token_issue(created_by=alice, user=alice, actor=system, at=timezone.now())
    agents_own, _ = agents.token_issue(
        created_by=alice, agent=make_agent(), actor=system, at=timezone.now()
    )
    before = AuditEvent.objects.count()
    with pytest.raises(CommandError, match="No token has the prefix"):
        call_command("agent_token", "revoke", personal.prefix, stdout=StringIO())
    with pytest.raises(CommandError, match="No personal token has the prefix"):
        call_command("api_token", "revoke", agents_own.prefix, stdout=StringIO())
    assert AuditEvent.objects.count() == before
    assert AgentToken.objects.filter(revoked_at__isnull=False).count() == 0
    call_command("agent_token", "revoke", agents_own.prefix, stdout=StringIO())
    call_command("api_token", "revoke", personal.prefix, stdout=StringIO())
    assert AgentToken.objects.filter(revoked_at__isnull=False).count() == 2
    assert AuditEvent.objects.filter(event_type="agent_token.revoked").count() == 2


def test_agent_token_create_defaults_to_the_first_active_admin(make_agent, db):
    agent = make_agent()
    gone = User.objects.create_superuser("old-root", password="x-very-long-pw-1")
    gone.is_active = False
    gone.save()
    root = User.objects.create_superuser("root", password="x-very-long-pw-2")
    call_command("agent_token", "create", agent.name, stdout=StringIO(), stderr=StringIO())
    assert AgentToken.objects.get(agent=agent).created_by == root


def test_notices_skip_people_who_left_and_reviewers_who_may_no_longer_decide(
    make_agent, make_tool, person, system, django_capture_on_commit_callbacks
):
    from governance.models import Notification, ReviewItem
    from governance.services import grants, hygiene, reviews

    owner, requester = person("olga"), person("rick")
    approver = person("erin", roles.APPROVERS)  # approved the grant: barred from its review
    reviewer = person("frank", roles.APPROVERS)
    person("gina", roles.APPROVERS)  # an approver not assigned: cannot decide the item
    person("heidi", roles.ADMINS)  # an admin decides any item
    grant = grants.grant_issue(
        agent=make_agent(owner=owner), tool=make_tool(), actions=["read"], scope="repo:acme/*",
        duration=timedelta(days=6), justification="t", requested_by=requester,
        approved_by=approver, actor=system, at=NOW - timedelta(minutes=30),
    )  # fmt: skip
    requester.is_active = False
    requester.save()
    with django_capture_on_commit_callbacks(execute=True):
        hygiene.grants_notify_expiring(actor=system, at=grant.expires_at - timedelta(minutes=5))
    targets = set(Notification.objects.filter(channel="email").values_list("target", flat=True))
    assert targets == {"olga@example.test"}
    campaign = reviews.review_campaign_open(
        kind="on_demand", reason="probe", actor=system, at=NOW, due_at=NOW + timedelta(days=2)
    )
    (item,) = ReviewItem.objects.filter(campaign=campaign)
    item.reviewer = reviewer
    item.save(update_fields=["reviewer"])
    reviewer.groups.clear()
    Notification.objects.all().delete()
    with django_capture_on_commit_callbacks(execute=True):
        reviews.review_reminders_send(actor=system, at=item.due_at - timedelta(hours=1))
    targets = set(Notification.objects.filter(channel="email").values_list("target", flat=True))
    # frank may no longer decide it: those who may (heidi, an admin with no stake) hear
    # instead; not erin (barred: she approved it) nor gina (not assigned).
    assert targets == {"heidi@example.test"}


def test_a_reactivated_account_starts_with_no_session_and_no_live_token(
    make_agent, alice, bob, system
):
    """Deactivating a person only paused them: switched back on, the very same session
    cookie and personal token worked again (an agent's resume revokes every token it
    had). The deactivation now ends the sessions and revokes the live personal tokens,
    in its transaction, on record; nobody else's session or token is touched."""
    from django.contrib.sessions.models import Session
    from django.test import Client
    from rest_framework.test import APIClient

    bob.groups.add(Group.objects.get_or_create(name=roles.ADMINS)[0])
    alice.groups.add(Group.objects.get_or_create(name=roles.ADMINS)[0])
    ui, other_ui = Client(), Client()
    ui.force_login(bob)
    other_ui.force_login(alice)
    at = timezone.now()
    token, plaintext = agents.token_issue(created_by=bob, user=bob, actor=system, at=at)
    spent, _ = agents.token_issue(
        created_by=bob, user=bob, actor=system, at=at - timedelta(days=2), days=1
    )
    agents_own, _ = agents.token_issue(created_by=bob, agent=make_agent(), actor=system, at=at)
    alices, _ = agents.token_issue(created_by=alice, user=alice, actor=system, at=at)
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    assert ui.get("/ui/").status_code == 200 and api.get("/api/v1/agents").status_code == 200
    seq = AuditEvent.objects.order_by("-seq").values_list("seq", flat=True).first()

    bob.is_active = False  # a stolen laptop: the account switched off
    bob.save()
    assert Session.objects.count() == 1  # alice's
    token.refresh_from_db()
    assert token.revoked_at is not None
    untouched = AgentToken.objects.filter(pk__in=[spent.pk, agents_own.pk, alices.pk])
    assert not untouched.filter(revoked_at__isnull=False).exists()
    events = AuditEvent.objects.filter(seq__gt=seq).order_by("seq")
    assert [(e.event_type, json.loads(e.data).get("prefix")) for e in events] == [
        ("agent_token.revoked", token.prefix),
        ("person.changed", None),
    ]
    changed = json.loads(events.last().data)
    assert changed["changed"] == {"is_active": {"before": True, "after": False}}
    assert (changed["tokens_revoked"], changed["sessions_ended"]) == ([token.prefix], 1)

    bob.is_active = True  # back, with a new laptop
    bob.save()
    assert ui.get("/ui/").status_code == 302  # to the sign-in page
    assert api.get("/api/v1/agents").status_code == 401
    assert other_ui.get("/ui/").status_code == 200
    reactivated = json.loads(AuditEvent.objects.order_by("-seq").first().data)
    assert "tokens_revoked" not in reactivated  # switching on ends nothing


def test_an_account_deactivated_in_the_django_admin_loses_its_session_and_tokens(client, bob):
    """The Django admin saves the account through the same model save: its deactivation
    ends the person's sessions and personal tokens too, named after the admin."""
    from django.contrib.sessions.models import Session
    from django.test import Client

    boss = User.objects.create_superuser("boss", password="boss-pass-123")
    boss.groups.add(Group.objects.get_or_create(name=roles.ADMINS)[0])
    bob.groups.add(Group.objects.get_or_create(name=roles.ADMINS)[0])
    bobs = Client()
    bobs.force_login(bob)
    token, _ = agents.token_issue(created_by=bob, user=bob, actor=audit_system(), at=timezone.now())
    client.force_login(boss)
    page = f"/admin/auth/user/{bob.pk}/change/"
    form = {
        "username": bob.username, "first_name": "", "last_name": "", "email": "",
        "is_staff": "", "is_active": "", "groups": [g.pk for g in bob.groups.all()],
        "date_joined_0": bob.date_joined.strftime("%Y-%m-%d"),
        "date_joined_1": bob.date_joined.strftime("%H:%M:%S"),
    }  # fmt: skip
    response = client.post(page, form)
    assert response.status_code == 302, response.content[:3000]
    bob.refresh_from_db()
    assert not bob.is_active
    token.refresh_from_db()
    assert token.revoked_at is not None
    assert [s.get_decoded().get("_auth_user_id") for s in Session.objects.all()] == [str(boss.pk)]
    revoked, changed = AuditEvent.objects.order_by("-seq")[:2][::-1]
    assert (revoked.event_type, revoked.actor) == ("agent_token.revoked", "user:boss")
    assert (changed.event_type, changed.actor) == ("person.changed", "user:boss")
    assert json.loads(changed.data)["tokens_revoked"] == [token.prefix]


def audit_system():
    from governance.audit import Actor

    return Actor.system("test")
