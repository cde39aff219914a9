"""Template context for every UI page: the signed-in person's rights (which
buttons to draw) and the active break-glass sessions (the banner)."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from django.utils import timezone

from governance.web import lifecycle
from governance.web.access import has_any_role, rights_of


def ui(request: HttpRequest) -> dict[str, Any]:
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated or not has_any_role(user):
        return {"ui_rights": {}, "break_glass_active": []}
    return {
        "ui_rights": rights_of(user),
        "break_glass_active": lifecycle.active_break_glass(timezone.now()),
    }
