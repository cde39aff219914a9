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
                          "password": "changed" (never the hash)
    person.roles_changed  groups added / removed and the roles that result
    person.deleted        username

A login (last_login) is not a change. The actor is the signed-in person of the
request that made the change (the web UI, the admin, the API), else
`system:unattributed` (a shell or a command: the operator is outside the app).
"""

from __future__ import annotations

import contextvars
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.db import transaction
from django.db.models.signals import m2m_changed, post_delete, post_save, pre_save
from django.utils import timezone

from governance import audit
from governance.codes import EventType

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


def _append(event_type: str, user: Any, **data: Any) -> None:
    with transaction.atomic():
        audit.append(
            event_type=event_type,
            actor=_actor(),
            at=timezone.now(),
            data={"person": user.get_username(), "person_id": user.pk, **data},
        )


def _before_save(sender: Any, instance: Any, **kwargs: Any) -> None:
    if instance.pk is None or kwargs.get("raw"):
        instance._governance_before = None
        return
    instance._governance_before = (
        sender.objects.filter(pk=instance.pk).values(*TRACKED, "password").first()
    )


def _saved(sender: Any, instance: Any, created: bool, **kwargs: Any) -> None:
    if kwargs.get("raw"):
        return
    now = {name: getattr(instance, name) for name in TRACKED}
    before = getattr(instance, "_governance_before", None)
    instance._governance_before = None
    if created or before is None:
        _append(EventType.PERSON_CREATED, instance, **now)
        return
    changed: dict[str, Any] = {
        name: {"before": before[name], "after": now[name]}
        for name in TRACKED
        if before[name] != now[name]
    }
    if before["password"] != instance.password:
        changed["password"] = "changed"
    if changed:
        _append(EventType.PERSON_CHANGED, instance, changed=changed)


def _groups_changed(
    sender: Any, instance: Any, action: str, reverse: bool, pk_set: Any, **kwargs: Any
) -> None:
    user_model = get_user_model()
    if action == "pre_clear":
        # Nothing says afterwards what a clear removed: note it now.
        if reverse:
            instance._governance_cleared = list(instance.user_set.values_list("pk", flat=True))
        else:
            instance._governance_cleared = _roles(instance)
        return
    if action not in ("post_add", "post_remove", "post_clear"):
        return
    verb = "added" if action == "post_add" else "removed"
    if reverse:  # group.user_set.add(...): one event per person
        pks = pk_set if action != "post_clear" else instance._governance_cleared
        for user in user_model.objects.filter(pk__in=pks):
            _append(
                EventType.PERSON_ROLES_CHANGED, user, **{verb: [instance.name]}, roles=_roles(user)
            )
        return
    if action == "post_clear":
        names = instance._governance_cleared
    else:
        names = sorted(Group.objects.filter(pk__in=pk_set).values_list("name", flat=True))
    if names:
        _append(EventType.PERSON_ROLES_CHANGED, instance, **{verb: names}, roles=_roles(instance))


def _deleted(sender: Any, instance: Any, **kwargs: Any) -> None:
    _append(EventType.PERSON_DELETED, instance)


def connect() -> None:
    """From GovernanceConfig.ready(): once per process."""
    user_model = get_user_model()
    pre_save.connect(_before_save, sender=user_model, dispatch_uid="governance.people.pre")
    post_save.connect(_saved, sender=user_model, dispatch_uid="governance.people.post")
    post_delete.connect(_deleted, sender=user_model, dispatch_uid="governance.people.delete")
    m2m_changed.connect(
        _groups_changed, sender=user_model.groups.through, dispatch_uid="governance.people.groups"
    )
