"""Django admin: read-only windows onto the data.

Every state change must go through a service so it writes its audit event;
the admin's generic add/change/delete would bypass that, so it is switched
off here. Approving, revoking and the rest live in the governance UI and API.

The site is for people with the admins role (and staff status): it is where accounts
and their roles are managed (each change a person.* event, services/people.py). The
audit log is not shown here: it is read in the UI and its exports, where each look is
an audit.viewed event.
"""

import json
from collections.abc import Callable, Sequence
from typing import Any

from django.contrib import admin
from django.db import models
from django.http import HttpRequest
from django.utils.safestring import SafeString, mark_safe

from governance import roles
from governance.models import Agent, AgentToken, Approval, Grant, Task, Tool
from governance.web import reveal

# The read-only field that stands in for a text or JSON field (ReadOnlyAdmin).
SHOWN = "_shown"


def admins_only(request: HttpRequest) -> bool:
    user = request.user
    return bool(user.is_active and user.is_staff and roles.is_admin(user))


admin.site.has_permission = admins_only  # type: ignore[method-assign]


def _revealed(field: models.Field) -> Callable[[Any], SafeString]:
    """`field` of a row as the UI shows text (web.reveal): escaped, bidi controls and
    invisible characters as code points, line breaks kept; JSON as Django writes it."""

    @admin.display(description=field.verbose_name)
    def show(obj: Any) -> SafeString:
        value = getattr(obj, field.attname)
        if isinstance(field, models.JSONField):
            value = json.dumps(value, ensure_ascii=False, cls=field.encoder)
        shown = reveal.reveal("" if value is None else str(value))
        return mark_safe(shown.replace("\n", "<br>"))  # noqa: S308 - reveal escaped it

    return show


class ReadOnlyAdmin(admin.ModelAdmin):
    """A model's rows, read only. Each text and JSON field (but a choice) is shown
    through reveal, as the UI shows text: Django prints bidi controls raw, and a U+202E
    in what an agent or a third-party tool wrote (a grant request's justification, a
    call's arguments, a tool's description) turns the rest of the line around."""

    def __init__(self, model: type[models.Model], admin_site: admin.AdminSite) -> None:
        super().__init__(model, admin_site)
        self.revealed = {
            field.name: field.name + SHOWN
            for field in model._meta.concrete_fields
            if isinstance(field, models.CharField | models.TextField | models.JSONField)
            and not field.choices
        }
        for field in model._meta.concrete_fields:
            if field.name in self.revealed:
                setattr(self, self.revealed[field.name], _revealed(field))

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Sequence[str]:
        return [*super().get_readonly_fields(request, obj), *self.revealed.values()]

    def get_fields(self, request: HttpRequest, obj: Any = None) -> Sequence[str]:
        # Django's list is the form's fields, then the read-only ones: each text field
        # in its place, shown by its stand-in, and the stand-ins not again at the end.
        stand_ins = set(self.revealed.values())
        return [
            self.revealed.get(name, name)
            for name in super().get_fields(request, obj)
            if name not in stand_ins
        ]

    def has_module_permission(self, request: HttpRequest) -> bool:
        return admins_only(request)

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return admins_only(request)

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Agent)
class AgentAdmin(ReadOnlyAdmin):
    list_display = ("name", "owner", "parent", "status", "created_at")
    list_filter = ("status",)


@admin.register(AgentToken)
class AgentTokenAdmin(ReadOnlyAdmin):
    list_display = ("prefix", "agent", "user", "expires_at", "revoked_at", "last_used_at")
    exclude = ("digest",)

    def lookup_allowed(self, lookup: str, value: str, request: Any = None) -> bool:
        # `?digest__startswith=ab` would read the stored digest out a character at a
        # time (as Django's UserAdmin refuses password lookups).
        if lookup.split("__")[0] == "digest":
            return False
        return bool(super().lookup_allowed(lookup, value, request))


@admin.register(Tool)
class ToolAdmin(ReadOnlyAdmin):
    list_display = ("name", "kind", "third_party", "irreversible", "is_quarantined")


@admin.register(Task)
class TaskAdmin(ReadOnlyAdmin):
    list_display = ("key", "title", "owner", "status", "starts_at", "closed_at")


@admin.register(Grant)
class GrantAdmin(ReadOnlyAdmin):
    list_display = ("id", "agent", "tool", "actions", "scope", "status", "expires_at", "use_count")
    list_filter = ("status", "break_glass")


@admin.register(Approval)
class ApprovalAdmin(ReadOnlyAdmin):
    list_display = ("id", "agent", "tool", "action", "scope", "status", "expires_at")
    list_filter = ("status",)
