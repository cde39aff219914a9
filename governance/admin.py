"""Django admin: read-only windows onto the data.

Every state change must go through a service so it writes its audit event;
the admin's generic add/change/delete would bypass that, so it is switched
off here. Approving, revoking and the rest live in the governance UI and API.
"""

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from governance.models import Agent, AgentToken, Approval, AuditEvent, Grant, Task, Tool


class ReadOnlyAdmin(admin.ModelAdmin):
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


@admin.register(AuditEvent)
class AuditEventAdmin(ReadOnlyAdmin):
    list_display = (
        "seq",
        "created_at",
        "event_type",
        "actor",
        "agent",
        "tool",
        "decision",
        "reason",
    )
    list_filter = ("event_type", "decision")
