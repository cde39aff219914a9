"""Break-glass and reviews in the UI. Filled in once the lifecycle services exist."""

from __future__ import annotations

from datetime import datetime
from typing import Any


def active_break_glass(now: datetime) -> list[Any]:
    return []


def dashboard_context(user: Any, now: datetime) -> dict[str, Any]:
    return {}
