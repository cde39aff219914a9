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


@shared_task(name="governance.tasks.sandbox_reap")
def sandbox_reap() -> dict[str, Any]:
    """Kill and record sandboxes past their deadline or whose grant died.

    Bubblewrap runs whose runner is gone are closed too; a worker on a host
    without a Docker engine skips the container part and says so.
    """
    from governance.services.sandbox import reap_all, reap_orphans

    summary: dict[str, Any] = {
        "orphans": [f"{run_id}:{why}" for run_id, why in reap_orphans(at=timezone.now())]
    }
    try:
        import docker

        client = docker.from_env(timeout=30)
        client.ping()
    except Exception as exc:
        summary["skipped"] = f"no Docker engine: {type(exc).__name__}"
        return summary
    summary["reaped"] = [f"{run_id}:{why}" for run_id, why in reap_all(client)]
    return summary
