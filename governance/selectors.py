"""Read queries shared by the UI, the API, reports and commands."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db.models import Q, QuerySet
from django.utils import timezone

from governance.models import Agent, Approval, AuditEvent, Grant, Tool


def live_grants(at: datetime) -> QuerySet[Grant]:
    """Grants whose own window is open at `at` (ancestors are checked by authorize())."""
    return (
        Grant.objects.exclude(status__in=[Grant.Status.PENDING, Grant.Status.DENIED])
        .filter(starts_at__lte=at, expires_at__gt=at)
        .filter(Q(revoked_at__isnull=True) | Q(revoked_at__gt=at))
        .select_related("agent", "tool", "task", "requested_by", "approved_by", "delegated_from")
    )


def matrix_summary() -> dict[str, Any]:
    now = timezone.now()
    return {
        "agents": Agent.objects.count(),
        "tools": Tool.objects.count(),
        "live_grants": live_grants(now).count(),
        "pending_requests": Grant.objects.filter(status=Grant.Status.PENDING).count(),
        "pending_approvals": Approval.objects.filter(
            status=Approval.Status.PENDING, expires_at__gt=now
        ).count(),
        "events": AuditEvent.objects.count(),
        "grants": live_grants(now).order_by("agent__name", "tool__name")[:200],
    }
