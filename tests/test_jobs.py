"""Scheduled jobs: the expiry services (each run twice: idempotent, one event per
transition), the thin tasks and command, and one run of a real Celery worker and
beat against the real Redis and PostgreSQL."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path
from urllib.parse import quote

import pytest
from django.conf import settings
from django.contrib.auth.models import Group
from django.core.management import call_command
from django.db import connection
from django.utils import timezone

from governance import audit, roles, tasks
from governance.celery import app, beat_schedule, expiry_interval
from governance.codes import EventType, Reason
from governance.models import Approval, AuditEvent, Grant, Notification
from governance.policy import authorize
from governance.services import access
from governance.services.approvals import approval_approve, approval_deny, approvals_expire
from governance.services.grants import grants_expire
from tests.conftest import MS, NOW

ROOT = Path(__file__).resolve().parent.parent
# The worker test's own Redis database (flushed by the test); TEST_REDIS_DB lets two
# checkouts run the suite at once without sharing a queue.
REDIS_TEST_URL = f"redis://127.0.0.1:6379/{os.environ.get('TEST_REDIS_DB', '12')}"


def events(event_type: str, **filters: object) -> list[AuditEvent]:
    return list(AuditEvent.objects.filter(event_type=event_type, **filters).order_by("seq"))


# --- grants_expire ---------------------------------------------------------------------------


def test_grants_expire_marks_a_grant_once_however_often_it_runs(
    make_agent, make_tool, make_grant, system
):
    grant = make_grant(make_agent(), make_tool())  # live NOW-30min .. NOW+30min
    assert grants_expire(actor=system, at=grant.expires_at - MS) == 0
    assert grants_expire(actor=system, at=grant.expires_at) == 1
    assert grants_expire(actor=system, at=grant.expires_at + timedelta(minutes=5)) == 0

    grant.refresh_from_db()
    assert grant.status == Grant.Status.EXPIRED
    (event,) = events(EventType.GRANT_EXPIRED, grant_id=grant.pk)
    assert event.actor == "system:test"
    assert json.loads(event.data)["status"] == "expired"


def test_grants_expire_leaves_live_and_revoked_grants_alone(
    make_agent, make_tool, make_grant, system, alice
):
    from governance.services.grants import grant_revoke

    agent, tool = make_agent(), make_tool()
    live = make_grant(agent, tool, duration=timedelta(hours=5))
    revoked = make_grant(agent, tool, scope="repo:acme/web/*")
    grant_revoke(grant_id=revoked.pk, reason="done", actor=system, at=NOW, revoked_by=alice)

    assert grants_expire(actor=system, at=NOW + timedelta(hours=1)) == 0
    assert Grant.objects.get(pk=live.pk).status == Grant.Status.ACTIVE
    assert Grant.objects.get(pk=revoked.pk).status == Grant.Status.REVOKED
    assert events(EventType.GRANT_EXPIRED) == []


# --- approvals_expire ------------------------------------------------------------------------


def _approval(arguments: dict[str, object]) -> Approval:
    decision = access.access_check(
        agent="bot",
        tool="repo",
        action="delete",
        scope="repo:acme/api/x",
        at=NOW,
        arguments=arguments,
    )
    assert decision.reason == Reason.APPROVAL_REQUIRED, decision
    return Approval.objects.get(pk=decision.approval_id)


@pytest.fixture
def approvals(make_agent, make_tool, make_grant, bob, system) -> dict[str, Approval]:
    """One approval in each state, all requested at NOW."""
    make_grant(make_agent("bot"), make_tool("repo"), actions=("delete",))
    pending = _approval({"n": 1})
    approved = _approval({"n": 2})
    denied = _approval({"n": 3})
    approval_approve(approval_id=approved.pk, approver=bob, actor=system, at=NOW + MS)
    approval_deny(approval_id=denied.pk, approver=bob, reason="no", actor=system, at=NOW + MS)
    return {"pending": pending, "approved": approved, "denied": denied}


def test_approvals_expire_marks_pending_and_approved_ones_once(approvals, system):
    expires_at = approvals["pending"].expires_at
    assert approvals_expire(actor=system, at=expires_at - MS) == 0
    assert approvals_expire(actor=system, at=expires_at) == 2
    assert approvals_expire(actor=system, at=expires_at + timedelta(minutes=5)) == 0

    for name, status in [("pending", "expired"), ("approved", "expired"), ("denied", "denied")]:
        approvals[name].refresh_from_db()
        assert approvals[name].status == status, name
    expired = events(EventType.APPROVAL_EXPIRED)
    assert sorted(e.approval_id for e in expired) == sorted(
        str(approvals[name].pk) for name in ("pending", "approved")
    )
    assert {json.loads(e.data)["previous_status"] for e in expired} == {"pending", "approved"}


def test_an_expired_approval_can_no_longer_be_consumed(approvals, system):
    approved, pending = approvals["approved"], approvals["pending"]
    grant = Grant.objects.get()
    mark = AuditEvent.objects.order_by("-seq").values_list("seq", flat=True).first()
    approvals_expire(actor=system, at=approved.expires_at)
    decision = access.access_check(
        agent="bot",
        tool="repo",
        action="delete",
        scope="repo:acme/api/x",
        at=approved.expires_at - MS,  # even a caller whose clock is behind
        arguments={"n": 2},
        approval=str(approved.pk),
    )
    # Refused because it is no longer approved (the job marked it), not for some other
    # reason the same code covers ("already used", "a different call").
    assert (decision.decision, decision.reason) == ("deny", Reason.APPROVAL_INVALID)
    assert decision.message == "The approval is not usable (status expired)."
    assert (decision.approval_id, decision.grant_id) == (str(approved.pk), grant.pk)
    approved.refresh_from_db()
    assert (approved.status, approved.consumed_at) == (Approval.Status.EXPIRED, None)
    assert Approval.objects.filter(status=Approval.Status.CONSUMED).count() == 0
    assert Approval.objects.count() == 3  # no new request either
    # Exactly: the two expiries the job recorded, then the refusal.
    written = list(AuditEvent.objects.filter(seq__gt=mark).order_by("seq"))
    assert [e.event_type for e in written] == ["approval.expired"] * 2 + ["access.denied"]
    assert {e.approval_id for e in written[:2]} == {str(approved.pk), str(pending.pk)}
    refused = written[-1]
    assert str(refused.uid) == decision.decision_id
    assert (refused.decision, refused.reason) == ("deny", "approval_invalid")
    assert (refused.approval_id, refused.grant_id) == (str(approved.pk), grant.pk)
    assert (refused.agent, refused.action, refused.scope) == ("bot", "delete", "repo:acme/api/x")
    assert refused.arguments_hash == approved.arguments_hash


# --- tasks and the command -------------------------------------------------------------------


def test_the_expire_task_and_command_call_the_same_services(
    make_agent, make_tool, make_grant, approvals
):
    # Everything in these fixtures ended long before the real "now".
    grant = Grant.objects.get()
    summary = tasks.expire_due()
    assert summary == {"tasks": 0, "grants": 1, "approvals": 2, "requests": 0, "tokens": 0}
    out = io.StringIO()
    call_command("expire_now", stdout=out)
    assert out.getvalue().strip() == (
        "closed 0 ended task(s); expired 0 grant(s), 0 approval(s), 0 request(s), 0 token(s)"
    )
    (event,) = events(EventType.GRANT_EXPIRED, grant_id=grant.pk)
    assert event.actor == "system:celery:expire_due"


def test_one_failing_part_of_the_expiry_job_does_not_stop_the_others(
    make_agent, make_tool, make_grant, approvals, monkeypatch
):
    """A bad row in one part (tasks) used to stop every part after it, on every run
    while the row stayed: grants and approvals were never marked expired. Each part
    runs; the job still fails, naming the part, so the run is not silently green."""
    from governance.services import claims, hygiene

    def boom(**kw: object) -> int:
        raise RuntimeError("one bad task row")

    monkeypatch.setattr(hygiene, "tasks_end", boom)
    grant = Grant.objects.get()
    with pytest.raises(claims.PartlyFailed, match="expire_due: tasks failed"):
        tasks.expire_due()
    grant.refresh_from_db()
    assert grant.status == Grant.Status.EXPIRED
    (event,) = events(EventType.GRANT_EXPIRED, grant_id=grant.pk)
    assert event.actor == "system:celery:expire_due"
    assert len(events(EventType.APPROVAL_EXPIRED)) == 2


def test_one_failing_row_does_not_stop_the_rows_after_it(make_agent, make_tool, make_grant, system):
    """claim_each: the row that fails is rolled back (no half-announced claim), the
    others are claimed and announced, and PartlyFailed says how many failed."""
    from governance.services import claims

    first = make_grant(make_agent("a1"), make_tool("t1"))
    second = make_grant(make_agent("a2"), make_tool("t2"))
    calls: list[int] = []

    def claim(grant: Grant) -> int:
        calls.append(grant.pk)
        return Grant.objects.filter(pk=grant.pk).update(status=Grant.Status.EXPIRED)

    def announce(grant: Grant) -> None:
        if grant.pk == first.pk:
            raise RuntimeError("cannot announce")

    with pytest.raises(claims.PartlyFailed, match="1 row\\(s\\) failed, 1 done"):
        claims.claim_each([first, second], claim, announce)
    assert calls == [first.pk, second.pk]
    first.refresh_from_db()
    second.refresh_from_db()
    assert (first.status, second.status) == ("active", "expired")


def test_the_checkpoint_task_writes_a_checkpoint_even_with_nothing_new(db):
    first = tasks.audit_checkpoint()
    second = tasks.audit_checkpoint()
    # An empty log: the first checkpoint signs the series' start, its only event.
    assert first["seq"] == second["seq"] == 1
    assert events(EventType.AUDIT_CHECKPOINTS_STARTED)[0].seq == 1
    assert len(audit.load_checkpoints()) == 2


def test_the_verify_task_records_a_failure_as_an_event(make_agent, caplog, django_user_model):
    make_agent()
    heidi = django_user_model.objects.create_user("heidi", email="heidi@example.test")
    heidi.groups.add(Group.objects.get_or_create(name=roles.ADMINS)[0])
    assert tasks.audit_verify()["ok"] is True
    assert events(EventType.AUDIT_VERIFY_FAILED) == []

    # A forged checkpoint (its head edited, so its signature no longer matches).
    body = audit.write_checkpoint(timezone.now())
    path = Path(settings.AUDIT_CHECKPOINT_DIR) / body["file"]
    forged = json.loads(path.read_text()) | {"head": "f" * 64}
    path.write_text(json.dumps(forged))

    result = tasks.audit_verify()
    assert result["ok"] is False
    (event,) = events(EventType.AUDIT_VERIFY_FAILED)
    assert "bad signature" in json.loads(event.data)["problem"]
    assert event.actor == "system:celery:audit_verify"
    assert "audit chain verification failed" in caplog.text
    alerts = Notification.objects.filter(event="audit_verify_failed").count()
    assert alerts == 1  # heidi, the admin

    # The same message again (redelivered, a second beat, or sent by anyone who can
    # write to the broker): still a failure, but not a second event nor alert.
    assert tasks.audit_verify()["ok"] is False
    assert events(EventType.AUDIT_VERIFY_FAILED) == [event]
    assert Notification.objects.filter(event="audit_verify_failed").count() == alerts
    # An hour on, the damage still there: recorded again, a reminder once an hour.
    later = timezone.now() + tasks.RECORD_FAILURE_EVERY + timedelta(seconds=1)
    actor = audit.Actor.system("celery:audit_verify")
    again = audit.verify_and_record(actor=actor, at=later, once_within=tasks.RECORD_FAILURE_EVERY)
    assert again.ok is False and len(events(EventType.AUDIT_VERIFY_FAILED)) == 2


def test_a_new_finding_within_the_hour_is_recorded_and_an_outage_is_none(make_agent, monkeypatch):
    """One damage must not hide the next: only the same finding is held back for the
    hour. And a database that fails mid-walk (a cancelled statement, a lost connection)
    is not tampering: it went into the chain for good as "edited outside the
    application", and then hid the real edit found within the hour."""
    from django.db import OperationalError

    from tests.test_audit_chain import sql, triggers_bypassed

    make_agent()
    make_agent("bot-2")
    walk = audit._rows

    def cancelled(after: int = 0):
        raise OperationalError("canceling statement due to statement timeout")
        yield  # a generator, as _rows is

    monkeypatch.setattr(audit, "_rows", cancelled)
    with pytest.raises(OperationalError):
        tasks.audit_verify()
    assert events(EventType.AUDIT_VERIFY_FAILED) == []
    monkeypatch.setattr(audit, "_rows", walk)

    with triggers_bypassed():
        sql("UPDATE governance_auditevent SET scope = 'x' WHERE seq = 2")
    assert tasks.audit_verify()["bad_seq"] == 2
    assert tasks.audit_verify()["bad_seq"] == 2  # the same finding: held back
    (first,) = events(EventType.AUDIT_VERIFY_FAILED)
    with triggers_bypassed():  # another kind of damage, before the first: a new finding
        sql("UPDATE governance_auditevent SET prev_hash = 'x' WHERE seq = 1")
    assert tasks.audit_verify()["bad_seq"] == 1
    found = [json.loads(e.data)["bad_seq"] for e in events(EventType.AUDIT_VERIFY_FAILED)]
    assert found == [2, 1] and events(EventType.AUDIT_VERIFY_FAILED)[0] == first


def test_a_missing_or_stale_checkpoint_is_recorded_once_an_hour_not_once_a_message(
    make_agent, settings
):
    """Its finding names the head's seq (which each recorded event moves) or the
    checkpoint's age in minutes: compared whole, every audit_verify message while the
    checkpoint job was down recorded one more event and alerted every admin again."""
    settings.AUDIT_CHECKPOINT_MAX_AGE = timedelta(minutes=5)
    make_agent()
    for _ in range(3):
        assert tasks.audit_verify()["ok"] is False  # no checkpoint at all
    assert len(events(EventType.AUDIT_VERIFY_FAILED)) == 1

    audit.write_checkpoint(timezone.now() - timedelta(minutes=30))
    actor, now = audit.Actor.system("celery:audit_verify"), timezone.now()
    for minute in range(3):  # stale, and a minute staler each time
        verdict = audit.verify_and_record(
            actor=actor, at=now + timedelta(minutes=minute), once_within=tasks.RECORD_FAILURE_EVERY
        )
        assert not verdict.ok and "old" in verdict.problem
    assert len(events(EventType.AUDIT_VERIFY_FAILED)) == 2  # one for each kind


def test_a_notification_message_names_a_row_id_or_nothing(db):
    """A forged message's "1", 1.9 or true each acted on notification 1."""
    for forged in ("1", 1.9, True, 0, -1, None, [1], {"id": 1}):
        assert tasks.notification_deliver.apply(args=[forged]).get() == {
            "id": None, "outcome": "refused",
        }  # fmt: skip


def test_the_nightly_verify_compacts_old_checkpoints_after_it_passes(db, settings):
    """A checkpoint a minute piles up for ever unless something prunes it: the nightly
    job does, after its full walk passed, and the chain still verifies."""
    from tests.test_audit_chain import _four_days

    settings.AUDIT_CHECKPOINT_KEEP_DAYS = 1
    today = timezone.now().replace(hour=0, minute=15, second=0, microsecond=0)
    series = _four_days(today - timedelta(days=4))
    result = tasks.audit_verify()
    left = audit.load_checkpoints()
    assert result["ok"] is True and result["compacted"] == len(series) - len(left) > 100
    (event,) = events(EventType.AUDIT_CHECKPOINTS_COMPACTED)
    assert event.actor == "system:celery:audit_verify"
    assert json.loads(event.data)["deleted"] == result["compacted"]
    assert tasks.audit_verify() == {
        "ok": True, "count": event.seq, "bad_seq": None, "compacted": 0,
    }  # fmt: skip


def test_the_nightly_verify_keeps_every_checkpoint_of_a_damaged_log(db, settings):
    from tests.test_audit_chain import _four_days, sql, triggers_bypassed

    settings.AUDIT_CHECKPOINT_KEEP_DAYS = 1
    today = timezone.now().replace(hour=0, minute=15, second=0, microsecond=0)
    series = _four_days(today - timedelta(days=4))
    with triggers_bypassed():
        sql("DELETE FROM governance_auditevent WHERE seq > %s", [series[-1]["seq"] - 1])
    result = tasks.audit_verify()
    assert result["ok"] is False and "compacted" not in result
    assert audit.load_checkpoints() == series
    assert events(EventType.AUDIT_CHECKPOINTS_COMPACTED) == []


# --- the schedule ----------------------------------------------------------------------------


def test_every_scheduled_entry_names_a_registered_task():
    app.loader.import_default_modules()
    for name, entry in beat_schedule().items():
        assert entry["task"] in app.tasks, name


def test_the_expiry_interval_is_the_settings_one(settings):
    """Parsed strictly by the settings (tests/test_settings_env.py: a bad value stops
    start-up); beat schedules the expiry job from it."""
    assert expiry_interval() == timedelta(minutes=1)
    settings.GOVERNANCE_EXPIRY_INTERVAL = timedelta(seconds=2)
    assert expiry_interval() == timedelta(seconds=2)
    assert beat_schedule()["expire-due"]["schedule"] == timedelta(seconds=2)


# --- a real worker and beat ------------------------------------------------------------------


def _database_url() -> str:
    """The test database pytest-django created, so the worker sees this test's rows."""
    db = connection.settings_dict
    user = quote(db["USER"] or "", safe="")
    password = f":{quote(db['PASSWORD'], safe='')}" if db["PASSWORD"] else ""
    host = quote(db["HOST"], safe="")  # a socket directory is percent-encoded
    return f"postgresql://{user}{password}@{host}:{db['PORT']}/{quote(db['NAME'])}"


def _start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(  # noqa: S603 - our own interpreter and arguments
            [sys.executable, "-m", "celery", "-A", "governance", *args],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)


@pytest.mark.django_db(transaction=True)
def test_a_real_worker_and_beat_mark_an_expired_grant_within_seconds(
    postgres_only, make_agent, make_tool, make_grant, tmp_path
):
    import redis

    broker = redis.Redis.from_url(REDIS_TEST_URL)
    broker.flushdb()  # no stale messages from an earlier run
    env = os.environ | {
        "DJANGO_SETTINGS_MODULE": "governance.settings",
        "DATABASE_URL": _database_url(),
        "DATABASE_CONN_MAX_AGE": "0",
        "REDIS_URL": REDIS_TEST_URL,
        "GOVERNANCE_EXPIRY_INTERVAL_SECONDS": "1",
        "AUDIT_CHECKPOINT_DIR": str(tmp_path / "checkpoints"),
    }
    agent, tool = make_agent(), make_tool()
    worker_log, beat_log = tmp_path / "worker.log", tmp_path / "beat.log"
    node = f"jobs-test-{uuid.uuid4().hex[:8]}@%h"
    worker = _start(
        ["worker", "--pool=solo", "-l", "INFO", "-n", node, "--without-gossip", "--without-mingle"],
        env,
        worker_log,
    )
    beat = None
    try:
        deadline = time.monotonic() + 60
        while "ready." not in worker_log.read_text():
            assert worker.poll() is None, worker_log.read_text()
            assert time.monotonic() < deadline, "worker not ready:\n" + worker_log.read_text()
            time.sleep(0.1)
        beat = _start(["beat", "-l", "INFO", "-s", str(tmp_path / "beat-schedule")], env, beat_log)

        grant = make_grant(agent, tool, starts_at=timezone.now(), duration=timedelta(seconds=2))
        question = {"agent": agent.name, "tool": tool.name, "action": "read"}
        question["scope"] = "repo:acme/api/x"
        # Refused from expires_at on by the decision alone, before any job could act.
        assert authorize(at=grant.expires_at - MS, **question).allowed
        refused = authorize(at=grant.expires_at + MS, **question)
        assert (refused.allowed, refused.reason) == (False, Reason.GRANT_EXPIRED)
        assert timezone.now() < grant.expires_at, "the checks above took too long to mean much"
        assert Grant.objects.get(pk=grant.pk).status == Grant.Status.ACTIVE

        # The scheduled job (every second here) does the bookkeeping within a few seconds.
        deadline = time.monotonic() + 2 + 10
        while Grant.objects.get(pk=grant.pk).status != Grant.Status.EXPIRED:
            assert worker.poll() is None, worker_log.read_text()
            assert beat.poll() is None, beat_log.read_text()
            assert time.monotonic() < deadline, (
                "not expired in time\n" + worker_log.read_text() + beat_log.read_text()
            )
            time.sleep(0.2)
        (event,) = events(EventType.GRANT_EXPIRED, grant_id=grant.pk)
        assert event.actor == "system:celery:expire_due"
        assert not authorize(at=timezone.now(), **question).allowed
    finally:
        for process in (beat, worker):
            if process is not None:
                _stop(process)
        broker.flushdb()
        broker.close()


def _drop_producer_pool() -> None:
    if app._pool is not None:
        app._pool.force_close_all()
    app._pool = None
    app.amqp._producer_pool = None


@pytest.mark.django_db(transaction=True)
def test_a_real_worker_retries_a_failing_webhook_until_it_is_delivered(
    postgres_only, make_agent, make_tool, alice, tmp_path, settings
):
    """The whole path for real: commit -> on_commit -> Redis -> worker -> webhook on
    127.0.0.1 answers 500 -> the worker records the failure and retries after its backoff
    -> 200. The grant request stands throughout."""
    import redis

    from governance.models import Notification
    from governance.services import grants as grant_services
    from tests.lifecycle_fixtures import Webhook

    hook = Webhook()
    hook.script = [500]
    settings.NOTIFY_WEBHOOK_URLS = [hook.url]
    broker = redis.Redis.from_url(REDIS_TEST_URL)
    broker.flushdb()
    env = os.environ | {
        "DJANGO_SETTINGS_MODULE": "governance.settings",
        "DATABASE_URL": _database_url(),
        "DATABASE_CONN_MAX_AGE": "0",
        "REDIS_URL": REDIS_TEST_URL,
        "NOTIFY_WEBHOOK_URLS": hook.url,
        "NOTIFY_RETRY_BASE_SECONDS": "1",
        "AUDIT_CHECKPOINT_DIR": str(tmp_path / "checkpoints"),
    }
    worker_log = tmp_path / "worker.log"
    node = f"notify-test-{uuid.uuid4().hex[:8]}@%h"
    worker = _start(
        ["worker", "--pool=solo", "-l", "INFO", "-n", node, "--without-gossip", "--without-mingle"],
        env,
        worker_log,
    )
    # This process sends to the same Redis, not eagerly: the production path.
    # Eager apply_async still acquires a producer, so a pool bound to the embedded broker
    # may exist from earlier tests: drop it, and drop ours afterwards.
    saved = (app.conf.task_always_eager, app.conf.broker_url, app.conf.broker_write_url)
    _drop_producer_pool()
    app.conf.task_always_eager = False
    app.conf.broker_url = app.conf.broker_write_url = REDIS_TEST_URL
    try:
        deadline = time.monotonic() + 60
        while "ready." not in worker_log.read_text():
            assert worker.poll() is None, worker_log.read_text()
            assert time.monotonic() < deadline, "worker not ready:\n" + worker_log.read_text()
            time.sleep(0.1)
        grant = grant_services.grant_request(
            agent=make_agent(),
            tool=make_tool(),
            actions=["read"],
            scope="repo:acme/api/*",
            duration=timedelta(hours=1),
            justification="worker test",
            requested_by=alice,
            actor=audit.Actor.system("test"),
            at=timezone.now(),
        )
        (row,) = Notification.objects.filter(channel="webhook")
        deadline = time.monotonic() + 30
        while Notification.objects.get(pk=row.pk).status != Notification.Status.SENT:
            assert worker.poll() is None, worker_log.read_text()
            assert time.monotonic() < deadline, "not delivered:\n" + worker_log.read_text()
            time.sleep(0.2)
        row.refresh_from_db()
        assert row.attempts == 2 and row.last_error == ""
        assert [r["body"]["data"]["grant_id"] for r in hook.requests] == [grant.pk, grant.pk]
        # Both attempts ran in the worker, the second after the task's own retry.
        log = worker_log.read_text()
        assert "notification_deliver" in log and "retry: Retry in 1.0s" in log, log
        assert Grant.objects.get(pk=grant.pk).status == Grant.Status.PENDING
    finally:
        app.conf.task_always_eager, app.conf.broker_url, app.conf.broker_write_url = saved
        _drop_producer_pool()
        _stop(worker)
        hook.close()
        broker.flushdb()
        broker.close()


# --- catch-up: what ended on its own is recorded as it ended -----------------------------


def test_catch_up_marks_a_grant_that_expired_before_its_task_ended_as_expired(
    make_agent, make_tool, make_task, make_grant, system
):
    """The job closed the task first and revoked its grants: a grant that had run out a
    day before its task ended was recorded as "revoked by task X ended", at the task's
    end, after it was dead."""
    from governance.services import hygiene

    task = make_task("OPS-1", ends_at=NOW + timedelta(days=2))
    grant = make_grant(make_agent(), make_tool(), task=task, duration=timedelta(days=1))
    hygiene.expire_due(actor=system, at=NOW + timedelta(days=7))
    grant.refresh_from_db()
    assert (grant.status, grant.revoked_at) == (Grant.Status.EXPIRED, None)
    kinds = set(AuditEvent.objects.filter(grant_id=grant.pk).values_list("event_type", flat=True))
    assert EventType.GRANT_EXPIRED in kinds and EventType.GRANT_REVOKED not in kinds


def test_revoking_a_grant_already_past_its_expiry_leaves_it_as_it_is(
    make_agent, make_tool, make_grant, system, bob
):
    from governance.services.grants import grant_revoke

    grant = make_grant(make_agent(), make_tool(), duration=timedelta(hours=1))
    later = grant.expires_at + timedelta(hours=5)  # the expiry job has not run yet
    seq = AuditEvent.objects.order_by("-seq").values_list("seq", flat=True).first()
    ended = grant_revoke(
        grant_id=grant.pk, reason="cleanup", actor=system, at=later, revoked_by=bob
    )
    grant.refresh_from_db()
    assert ended == [] and (grant.status, grant.revoked_at) == (Grant.Status.ACTIVE, None)
    assert not AuditEvent.objects.filter(seq__gt=seq).exists()
    grants_expire(actor=system, at=later)
    grant.refresh_from_db()
    assert grant.status == Grant.Status.EXPIRED


def test_revoking_a_delegation_that_already_ran_out_does_not_overrule_its_parent(
    make_agent, make_tool, make_grant, system, bob
):
    """Revoking a dead delegated grant took delegation away from its live parent."""
    from governance.services.grants import grant_delegate, grant_revoke

    parent_agent = make_agent("lead")
    child_agent = make_agent("helper", parent=parent_agent)
    parent = make_grant(parent_agent, make_tool(), duration=timedelta(days=2), delegable=True)
    child = grant_delegate(
        parent_grant_id=parent.pk,
        child=child_agent,
        actions=["read"],
        scope="repo:acme/api/*",
        expires_at=NOW + timedelta(hours=1),
        justification="a short hand-off",
        actor=system,
        at=NOW,
    )
    grant_revoke(
        grant_id=child.pk, reason="tidy", actor=system, at=NOW + timedelta(hours=2), revoked_by=bob
    )
    parent.refresh_from_db()
    assert parent.delegable is True
    assert not AuditEvent.objects.filter(
        event_type=EventType.GRANT_DELEGATION_WITHDRAWN, grant_id=parent.pk
    ).exists()


def test_the_api_leaves_a_grant_that_already_ran_out_as_it_is(
    human_client, dave, make_agent, make_tool, make_grant
):
    admin = human_client(dave, "admins")
    now = timezone.now()
    grant = make_grant(
        make_agent(), make_tool(), starts_at=now - timedelta(hours=2), duration=timedelta(hours=1)
    )
    response = admin.post(f"/api/v1/grants/{grant.pk}/revoke", {"reason": "tidy"}, format="json")
    assert response.status_code == 200, response.content
    assert response.json()["ended"] == []
    row = Grant.objects.get(pk=grant.pk)
    assert row.status == Grant.Status.ACTIVE and row.revoked_at is None
    assert not AuditEvent.objects.filter(event_type=EventType.GRANT_REVOKED).exists()


def test_catch_up_dates_an_undecided_request_and_an_ended_task_when_they_ended(
    make_agent, make_tool, make_task, system, alice, settings
):
    """A week's outage: the request was dated closed, and the task closed, at the job's
    run instead of when each ended."""
    from governance.services import grants as grant_services
    from governance.services import hygiene

    request = grant_services.grant_request(
        agent=make_agent(),
        tool=make_tool(),
        actions=["read"],
        scope="repo:acme/api/*",
        duration=timedelta(hours=1),
        justification="need it",
        requested_by=alice,
        actor=system,
        at=NOW,
    )
    assert request.created_at == NOW  # the service's clock, not the wall clock
    task = make_task("OPS-2", ends_at=NOW + timedelta(hours=1))
    hygiene.expire_due(actor=system, at=NOW + timedelta(days=10))
    request.refresh_from_db()
    task.refresh_from_db()
    assert request.decided_at == request.created_at + settings.GRANT_REQUEST_TTL
    assert task.closed_at == task.ends_at
    expired = AuditEvent.objects.get(event_type=EventType.GRANT_REQUEST_EXPIRED)
    closed = AuditEvent.objects.get(event_type=EventType.TASK_CLOSED, task="OPS-2")
    assert json.loads(expired.data)["effective_at"] == request.decided_at.isoformat()
    assert json.loads(closed.data)["effective_at"] == task.ends_at.isoformat()
