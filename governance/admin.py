"""Django admin: read-only windows onto the data.

Every state change must go through a service so it writes its audit event;
the admin's generic add/change/delete would bypass that, so it is switched
off here. Approving, revoking and the rest live in the governance UI and API.

The site is for people with the admins role (and staff status): it is where accounts
and their roles are managed (each change a person.* event, services/people.py). The
audit log is not shown here: it is read in the UI and its exports, where each look is
an audit.viewed event.
"""

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from governance import roles
from governance.models import Agent, AgentToken, Approval, Grant, Task, Tool


def admins_only(request: HttpRequest) -> bool:
    user = request.user
    return bool(user.is_active and user.is_staff and roles.is_admin(user))


admin.site.has_permission = admins_only  # type: ignore[method-assign]


class ReadOnlyAdmin(admin.ModelAdmin):
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
