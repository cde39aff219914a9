"""Accounts and roles are state: who may approve, review or export. Every change to a
person's account or role groups is an audit event (governance.services.people), made
through the Django admin, a shell or a command alike, never with the password hash."""

from __future__ import annotations

import json

import pytest
from django.contrib.auth.models import Group, User
from django.contrib.auth.signals import user_logged_in
from django.core.management import call_command
from django.test import RequestFactory
from django.utils import timezone

from governance.models import AuditEvent
from governance.services import people

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
