"""People and their roles: every change to an account or its role groups is an event.

Who may approve, review or export is state as much as a grant is: someone who
can put a second account in `approvers`, or reset an approver's password, can
approve their own request. Accounts and groups are changed through Django's
admin, `createsuperuser` or a shell rather than a governance service, so the
events are written by signal handlers on the user model and its groups, each in
the change's own transaction (a savepoint inside the admin's; alone, the event
commits right after the change):

    person.created        username, active, superuser, staff
    person.changed        which of those changed (before and after), and
                          "password": "changed" (never the hash); a deactivation
                          (is_active true -> false) also ends the person's web
                          sessions and revokes their live personal tokens, in the
                          same transaction (`agent_token.revoked` each, before it;
                          `sessions_ended`, `tokens_revoked` in it), so switching
                          the account back on brings neither back
    person.roles_changed  groups added / removed and the roles that result
    person.permissions_changed
                          Django permissions ("app.codename") added / removed, the
                          person's own or through a group (`group`): they open the
                          Django admin's account and group pages
    person.deleted        username

A login (last_login) is not a change. The actor is the signed-in person of the
request that made the change (the web UI, the admin, the API), else
`system:unattributed` (a shell or a command: the operator is outside the app).

Outside a transaction (a shell, `createsuperuser`) a change has already committed when
its signal runs: if its event then cannot be written, the change is undone (the new
account deleted, the old values or the group's old name put back) and the error raised
(a relation's add or remove runs in its own transaction already). Renaming a group
(`person.roles_changed` with `renamed`) or deleting one (`removed`) is an event for each
member. Not seen: `QuerySet.update()` on accounts sends no signal, so code must not
change accounts that way (nothing in this project does).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from datetime import datetime
from typing import Any

from django.contrib.auth import SESSION_KEY, get_user_model
from django.contrib.auth.models import Group
from django.contrib.sessions.models import Session
from django.db import transaction
from django.db.models.signals import m2m_changed, post_delete, post_save, pre_delete, pre_save
from django.utils import timezone

from governance import audit
from governance.codes import EventType
from governance.services import agents

TRACKED = ("username", "is_active", "is_superuser", "is_staff")
_request: contextvars.ContextVar[Any] = contextvars.ContextVar("governance_request", default=None)


def set_request(request: Any) -> contextvars.Token[Any]:
    """Called by web.middleware.CurrentRequestMiddleware around each request."""
    return _request.set(request)


def reset_request(token: contextvars.Token[Any]) -> None:
    _request.reset(token)


def _actor() -> audit.Actor:
    request = _request.get()
    user = getattr(request, "user", None) if request is not None else None
    if user is not None and user.is_authenticated:
        return audit.Actor.user(user)
    return audit.Actor.system("unattributed")


def _roles(user: Any) -> list[str]:
    return sorted(user.groups.values_list("name", flat=True))


def _append(event_type: str, user: Any, at: datetime | None = None, **data: Any) -> None:
    with transaction.atomic():
        audit.append(
            event_type=event_type,
            actor=_actor(),
            at=at or timezone.now(),
            data={"person": user.get_username(), "person_id": user.pk, **data},
        )


def _sessions_end(user: Any, at: datetime) -> int:
    """Delete the person's web sessions (SESSION_ENGINE is the database's, so this is
    part of the caller's transaction); how many. A session names its user only inside
    its signed data, so each unexpired one is read: deactivations are rare and the
    sessions few (SESSION_COOKIE_AGE). A request of theirs in flight cannot save its
    session back (Django's database session refuses to update a deleted row)."""
    key = str(user.pk)
    ended = [
        session.session_key
        for session in Session.objects.filter(expire_date__gt=at).iterator()
        if session.get_decoded().get(SESSION_KEY) == key
    ]
    Session.objects.filter(session_key__in=ended).delete()
    return len(ended)


def _deactivated(user: Any, at: datetime) -> dict[str, Any]:
    """A person switched off (is_active True -> False; a stolen laptop, someone who left):
    what they signed in with is ended, not paused, so switching the account back on
    never brings it back. Their web sessions end, and each personal token still live is
    revoked (`agent_token.revoked` each, as agent_resume revokes a resumed agent's
    tokens: it may have been compromised). The row changes come before the token events
    (the chain lock is the last lock taken). What the person.changed event adds."""
    sessions = _sessions_end(user, at)
    tokens = agents.tokens_revoke_live(user=user, actor=_actor(), at=at)
    return {"sessions_ended": sessions, "tokens_revoked": tokens}


def _before_save(sender: Any, instance: Any, **kwargs: Any) -> None:
    if instance.pk is None or kwargs.get("raw"):
        instance._governance_before = None
        return
    instance._governance_before = (
        sender.objects.filter(pk=instance.pk).values(*TRACKED, "password").first()
    )


_undoing: contextvars.ContextVar[bool] = contextvars.ContextVar("governance_undo", default=False)


def _or_undo(write: Callable[[], None], undo: Callable[[], Any]) -> None:
    """Write the events for a change post_save reports. Inside a transaction (the admin,
    the UI, a service) they commit together or not at all. Outside one (a shell,
    `createsuperuser`) the change has already committed when post_save runs: if its
    events cannot be written, the change is undone, so it never stands without them."""
    alone = not transaction.get_connection().in_atomic_block
    try:
        with transaction.atomic():
            write()
    except Exception:
        if alone:
            token = _undoing.set(True)
            try:
                undo()
            finally:
                _undoing.reset(token)
        raise


def _saved(sender: Any, instance: Any, created: bool, **kwargs: Any) -> None:
    if kwargs.get("raw"):
        return
    now = {name: getattr(instance, name) for name in TRACKED}
    before = getattr(instance, "_governance_before", None)
    instance._governance_before = None
    rows = sender.objects.filter(pk=instance.pk)
    if created or before is None:
        _or_undo(lambda: _append(EventType.PERSON_CREATED, instance, **now), rows.delete)
        return
    # Only what this save wrote: save(update_fields=[...]) leaves every other column as
    # the row has it, whatever the instance holds (changed in memory, or a stale copy),
    # and an event saying it changed would be false (a superuser never made, an
    # account switched off that is still on).
    fields = kwargs.get("update_fields")
    written = [name for name in (*TRACKED, "password") if fields is None or name in fields]
    changed: dict[str, Any] = {
        name: {"before": before[name], "after": now[name]}
        for name in TRACKED
        if name in written and before[name] != now[name]
    }
    if "password" in written and before["password"] != instance.password:
        changed["password"] = "changed"
    deactivated = "is_active" in changed and not now["is_active"]

    def write() -> None:
        at = timezone.now()
        ended = _deactivated(instance, at) if deactivated else {}
        _append(EventType.PERSON_CHANGED, instance, at=at, changed=changed, **ended)

    if changed:
        _or_undo(write, lambda: rows.update(**before))


def _relation_changed(
    instance: Any,
    action: str,
    reverse: bool,
    pk_set: Any,
    model: Any,
    sides: tuple[str, str],
    **kwargs: Any,
) -> tuple[str, list[Any], list[Any]] | None:
    """What an m2m_changed between holders (people or groups) and what they hold (groups or
    permissions) did: (verb, holders, items), or None when there is nothing to say yet.
    `sides` names the relation's attribute on a holder and on an item."""
    if action == "pre_clear":
        # Nothing says afterwards what a clear removed: note it now.
        side = sides[1] if reverse else sides[0]
        instance._governance_cleared = list(getattr(instance, side).values_list("pk", flat=True))
        return None
    if action not in ("post_add", "post_remove", "post_clear"):
        return None
    pks = instance._governance_cleared if action == "post_clear" else pk_set
    others = list(model.objects.filter(pk__in=pks).order_by("pk"))
    verb = "added" if action == "post_add" else "removed"
    return (verb, others, [instance]) if reverse else (verb, [instance], others)


def _groups_changed(sender: Any, instance: Any, **kwargs: Any) -> None:
    changed = _relation_changed(instance, sides=("groups", "user_set"), **kwargs)
    if changed is None:
        return
    verb, people, groups = changed
    names = sorted(group.name for group in groups)
    for user in people if names else ():
        _append(EventType.PERSON_ROLES_CHANGED, user, **{verb: names}, roles=_roles(user))


def _permissions_changed(sender: Any, instance: Any, **kwargs: Any) -> None:
    """A Django permission given to or taken from a person, or a group (every member)."""
    through_group = sender is Group.permissions.through
    sides = ("permissions", "group_set") if through_group else ("user_permissions", "user_set")
    changed = _relation_changed(instance, sides=sides, **kwargs)
    if changed is None:
        return
    verb, holders, permissions = changed
    labels = sorted(f"{p.content_type.app_label}.{p.codename}" for p in permissions)
    for holder in holders if labels else ():
        if not through_group:
            _append(EventType.PERSON_PERMISSIONS_CHANGED, holder, **{verb: labels})
            continue
        for user in holder.user_set.order_by("pk"):
            _append(EventType.PERSON_PERMISSIONS_CHANGED, user, **{verb: labels}, group=holder.name)


def _deleted(sender: Any, instance: Any, **kwargs: Any) -> None:
    if not _undoing.get():  # an account undone for want of its event was never announced
        _append(EventType.PERSON_DELETED, instance)


def _group_before(sender: Any, instance: Any, **kwargs: Any) -> None:
    """A role is a group's name: renaming a group changes every member's roles."""
    if kwargs.get("raw") or instance.pk is None:
        instance._governance_name = None
        return
    instance._governance_name = (
        sender.objects.filter(pk=instance.pk).values_list("name", flat=True).first()
    )


def _group_saved(sender: Any, instance: Any, created: bool, **kwargs: Any) -> None:
    old = getattr(instance, "_governance_name", None)
    if kwargs.get("raw") or created or old is None or old == instance.name:
        return

    def write() -> None:
        for user in instance.user_set.order_by("pk"):
            _append(
                EventType.PERSON_ROLES_CHANGED, user, renamed={"from": old, "to": instance.name},
                roles=_roles(user),
            )  # fmt: skip

    # QuerySet.update() sends no signal: the undo is not itself a rename to announce.
    _or_undo(write, lambda: sender.objects.filter(pk=instance.pk).update(name=old))


def _group_deleting(sender: Any, instance: Any, **kwargs: Any) -> None:
    """Deleting a group removes it from every member, and no m2m_changed says so: its
    members are noted now, and each gets an event once the rows are gone."""
    instance._governance_members = list(instance.user_set.values_list("pk", flat=True))


def _group_deleted(sender: Any, instance: Any, **kwargs: Any) -> None:
    members = getattr(instance, "_governance_members", [])
    for user in get_user_model().objects.filter(pk__in=members).order_by("pk"):
        _append(EventType.PERSON_ROLES_CHANGED, user, removed=[instance.name], roles=_roles(user))


def connect() -> None:
    """From GovernanceConfig.ready(): once per process."""
    user_model = get_user_model()
    pre_save.connect(_before_save, sender=user_model, dispatch_uid="governance.people.pre")
    post_save.connect(_saved, sender=user_model, dispatch_uid="governance.people.post")
    post_delete.connect(_deleted, sender=user_model, dispatch_uid="governance.people.delete")
    m2m_changed.connect(
        _groups_changed, sender=user_model.groups.through, dispatch_uid="governance.people.groups"
    )
    for through, uid in (
        (user_model.user_permissions.through, "governance.people.permissions"),
        (Group.permissions.through, "governance.people.group_permissions"),
    ):
        m2m_changed.connect(_permissions_changed, sender=through, dispatch_uid=uid)
    pre_save.connect(_group_before, sender=Group, dispatch_uid="governance.people.group_pre")
    post_save.connect(_group_saved, sender=Group, dispatch_uid="governance.people.group_post")
    pre_delete.connect(_group_deleting, sender=Group, dispatch_uid="governance.people.group_del")
    post_delete.connect(_group_deleted, sender=Group, dispatch_uid="governance.people.group_gone")
