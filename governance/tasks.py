"""Celery tasks: thin. Each calls a service as the system and returns a small
summary for the worker log. The rules live in the services; the schedule
lives in governance/celery.py."""

from __future__ import annotations

from typing import Any

from celery import shared_task
from django.utils import timezone

from governance import audit
from governance.services.approvals import approvals_expire
from governance.services.grants import grant_requests_expire, grants_expire


@shared_task(name="governance.tasks.expire_due")
def expire_due() -> dict[str, int]:
    """Mark grants and approvals past their end as expired (bookkeeping only),
    and close grant requests left undecided past GRANT_REQUEST_TTL.

    Agent tokens are not included: they have no status column, so an expired
    token is simply refused at authentication time and there is nothing to mark.
    """
    actor = audit.Actor.system("celery:expire_due")
    at = timezone.now()
    return {
        "grants": grants_expire(actor=actor, at=at),
        "approvals": approvals_expire(actor=actor, at=at),
        "requests": grant_requests_expire(actor=actor, at=at),
    }


@shared_task(name="governance.tasks.audit_checkpoint")
def audit_checkpoint() -> dict[str, Any]:
    body = audit.write_checkpoint(timezone.now())
    return {"file": body["file"], "seq": body["seq"]}


@shared_task(name="governance.tasks.audit_verify")
def audit_verify() -> dict[str, Any]:
    verdict = audit.verify_and_record(
        actor=audit.Actor.system("celery:audit_verify"), at=timezone.now()
    )
    return {"ok": verdict.ok, "count": verdict.count, "bad_seq": verdict.bad_seq}


# --- Lifecycle (issue #5) --------------------------------------------------------------


@shared_task(bind=True, name="governance.tasks.notification_deliver", max_retries=None)
def notification_deliver(self: Any, notification_id: int) -> dict[str, Any]:
    """One delivery attempt; a failure is recorded on the row and retried after its
    backoff (notifications.deliver gives up after NOTIFY_MAX_ATTEMPTS)."""
    from governance import notifications

    outcome, wait = notifications.deliver(notification_id=notification_id, at=timezone.now())
    if outcome == "retry" and wait is not None:
        raise self.retry(countdown=wait.total_seconds())
    return {"id": notification_id, "outcome": outcome}


@shared_task(name="governance.tasks.notifications_sweep")
def notifications_sweep() -> dict[str, int]:
    from governance import notifications

    return {"queued": notifications.sweep(at=timezone.now())}
