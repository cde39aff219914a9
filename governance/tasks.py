"""Celery tasks: thin. Each calls a service as the system and returns a small
summary for the worker log. The rules live in the services; the schedule
lives in governance/celery.py."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.utils import timezone

from governance import audit
from governance.celery import app


@app.task(name="governance.tasks.expire_due")
def expire_due() -> dict[str, int]:
    """Close tasks past their end, mark grants and approvals past their end as expired,
    close grant requests left undecided past GRANT_REQUEST_TTL and announce expired
    tokens (bookkeeping only: services.hygiene.expire_due)."""
    from governance.services.hygiene import expire_due as expire

    return expire(actor=audit.Actor.system("celery:expire_due"), at=timezone.now())


# A damaged log is recorded and alerted at most once in this long, by either job.
RECORD_FAILURE_EVERY = timedelta(hours=1)


@app.task(name="governance.tasks.audit_checkpoint")
def audit_checkpoint() -> dict[str, Any]:
    """Sign the head; refused over a damaged log, which is then verified and recorded
    (the audit.verify_failed event and its alert) as the nightly job would, at most
    once an hour while the damage stays."""
    now = timezone.now()
    try:
        body = audit.write_checkpoint(now)
    except audit.ChainBroken as exc:
        # Every minute while the damage stays: recorded and alerted once an hour, not
        # sixty times (each record is itself an event, and a mail to every admin).
        actor = audit.Actor.system("celery:audit_checkpoint")
        audit.record_refusal_once(actor=actor, at=now, window=RECORD_FAILURE_EVERY)
        return {"refused": True, "bad_seq": exc.problem[0], "problem": exc.problem[1]}
    return {"file": body["file"], "seq": body["seq"]}


@app.task(name="governance.tasks.audit_verify")
def audit_verify() -> dict[str, Any]:
    """The nightly full verify; only when it passes, old checkpoints are compacted
    (audit.compact_checkpoints): a damaged series keeps every file as evidence. Its
    message may come twice (or from anyone who can write to the broker): a failure is
    recorded and alerted once in RECORD_FAILURE_EVERY, not once per message."""
    now = timezone.now()
    actor = audit.Actor.system("celery:audit_verify")
    verdict = audit.verify_and_record(actor=actor, at=now, once_within=RECORD_FAILURE_EVERY)
    result: dict[str, Any] = {"ok": verdict.ok, "count": verdict.count, "bad_seq": verdict.bad_seq}
    if verdict.ok:
        try:
            result["compacted"] = audit.compact_checkpoints(at=now, actor=actor)["deleted"]
        except audit.ChainBroken as exc:  # damage since the walk: the next verify says it
            result["compaction_refused"] = exc.problem[1]
    return result


# --- Lifecycle (issue #5) --------------------------------------------------------------


# Time limits well inside notifications.STUCK_AFTER (10 min), so the sweep never takes
# back a row that a live worker is still sending (it would be sent twice). A webhook has
# its own total deadline (at most a minute); SMTP only a per-read timeout, so the soft
# limit ends a trickling mail server: the attempt is recorded as failed and retried. The
# hard limit kills a worker that ignores it; the sweep takes its row back later.
@app.task(
    bind=True,
    name="governance.tasks.notification_deliver",
    max_retries=None,
    soft_time_limit=120,
    time_limit=150,
)
def notification_deliver(self: Any, notification_id: int) -> dict[str, Any]:
    """One delivery attempt; a failure is recorded on the row and retried after its
    backoff (notifications.deliver gives up after NOTIFY_MAX_ATTEMPTS)."""
    from governance import notifications

    # A message is JSON anyone with the broker could write: "1", 1.9 and true each
    # named notification 1. Only a row id is one.
    if type(notification_id) is not int or notification_id < 1:
        return {"id": None, "outcome": "refused"}

    outcome, wait = notifications.deliver(notification_id=notification_id, at=timezone.now())
    if outcome == "retry" and wait is not None:
        raise self.retry(countdown=wait.total_seconds())
    return {"id": notification_id, "outcome": outcome}


@app.task(name="governance.tasks.notifications_sweep")
def notifications_sweep() -> dict[str, int]:
    from governance import notifications

    return {"queued": notifications.sweep(at=timezone.now())}


def _job(name: str) -> tuple[audit.Actor, Any]:
    return audit.Actor.system(f"celery:{name}"), timezone.now()


@app.task(name="governance.tasks.breakglass_overdue")
def breakglass_overdue() -> dict[str, int]:
    from governance.services.breakglass import breakglass_reviews_mark_overdue

    actor, at = _job("breakglass_overdue")
    return {"overdue": breakglass_reviews_mark_overdue(actor=actor, at=at)}


@app.task(name="governance.tasks.review_campaign_scheduled")
def review_campaign_scheduled() -> dict[str, Any]:
    from governance.services.reviews import review_campaign_open_scheduled

    actor, at = _job("review_campaign_scheduled")
    campaign = review_campaign_open_scheduled(actor=actor, at=at)
    return {"campaign": campaign.pk, "key": campaign.key}


@app.task(name="governance.tasks.review_due")
def review_due() -> dict[str, int]:
    from governance.services.claims import run_parts
    from governance.services.reviews import review_campaigns_close, review_items_apply_due_rule

    actor, at = _job("review_due")
    # Each part runs even if the other failed: one bad item must not keep every
    # finished campaign open.
    return run_parts(
        "review_due",
        {
            "items": lambda: review_items_apply_due_rule(actor=actor, at=at),
            "campaigns_closed": lambda: review_campaigns_close(actor=actor, at=at),
        },
    )


@app.task(name="governance.tasks.review_reminders")
def review_reminders() -> dict[str, int]:
    from governance.services.reviews import review_reminders_send

    actor, at = _job("review_reminders")
    return {"reminded": review_reminders_send(actor=actor, at=at)}


@app.task(name="governance.tasks.unused_scan")
def unused_scan() -> dict[str, int]:
    from governance.services.hygiene import grants_flag_unused

    actor, at = _job("unused_scan")
    return {"flagged": grants_flag_unused(actor=actor, at=at)}


@app.task(name="governance.tasks.trend_snapshot")
def trend_snapshot() -> dict[str, Any]:
    from governance.services.hygiene import trend_snapshot_record

    actor, at = _job("trend_snapshot")
    snap = trend_snapshot_record(actor=actor, at=at)
    return {"day": snap.day.isoformat(), "total": snap.total}


@app.task(name="governance.tasks.second_look_sample")
def second_look_sample() -> dict[str, int]:
    from governance.services.second_look import second_looks_sample

    actor, at = _job("second_look_sample")
    return {"sampled": second_looks_sample(actor=actor, at=at)}


@app.task(name="governance.tasks.expiring_notices")
def expiring_notices() -> dict[str, int]:
    from governance.services.hygiene import grants_notify_expiring

    actor, at = _job("expiring_notices")
    return {"notified": grants_notify_expiring(actor=actor, at=at)}


@app.task(name="governance.tasks.sandbox_reap")
def sandbox_reap() -> dict[str, Any]:
    """Kill and record sandboxes past their deadline or whose grant died.

    Bubblewrap runs whose runner is gone are closed too; a worker on a host
    without a Docker engine skips the container part and says so, and still
    closes container runs (remote ones) left running past their deadline.
    """
    from governance.services.sandbox import close_stale_container_runs, reap_all, reap_orphans

    summary: dict[str, Any] = {
        "orphans": [f"{run_id}:{why}" for run_id, why in reap_orphans(at=timezone.now())]
    }
    try:
        import docker

        client = docker.from_env(timeout=30)
        client.ping()
    except Exception as exc:
        summary["skipped"] = f"no Docker engine: {type(exc).__name__}"
        # Runs on other hosts' engines still end on record here, past their deadline.
        reaped = close_stale_container_runs(at=timezone.now())
    else:
        reaped = reap_all(client)
    summary["reaped"] = [f"{run_id}:{why}" for run_id, why in reaped]
    return summary


@app.task(name="governance.tasks.usage_fold")
def usage_fold() -> dict[str, int]:
    from governance.services.usage import usage_fold as fold

    return {"uses": fold(at=timezone.now())}
