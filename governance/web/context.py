"""Template context for every UI page (and the admin's, and the 403 and 404 pages): the
signed-in person's rights (which buttons to draw) and the two break-glass banners, the
active sessions and the overdue post-incident reviews. One query each, whatever the page."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from django.utils import timezone

from governance.web import lifecycle
from governance.web.access import has_any_role, rights_of


def ui(request: HttpRequest) -> dict[str, Any]:
    user = getattr(request, "user", None)
    # Someone not signed in (a 404 reached without a session), or with no role, is told
    # nothing about incidents: which agent, which ticket, who opened it.
    if user is None or not user.is_authenticated or not has_any_role(user):
        return {"ui_rights": {}, "break_glass_active": [], "break_glass_overdue": []}
    now = timezone.now()
    return {
        "ui_rights": rights_of(user),
        "break_glass_active": lifecycle.active_break_glass(now),
        "break_glass_overdue": lifecycle.overdue_break_glass(now),
    }
