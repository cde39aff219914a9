"""governance.notifications: one outbox row per target written with the change, handed to
Celery only after the commit, delivered by e-mail (Django's locmem backend here) and to a
real webhook on 127.0.0.1; a failing webhook is retried and never undoes the change."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from django.core import mail
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction

from governance import audit, notifications
from governance import settings as app_settings
from governance.codes import EventType, NotificationEvent
from governance.models import AuditEvent, Grant, Notification
from governance.services import grants
from tests.conftest import NOW


@pytest.fixture
def ask(make_agent, make_tool, alice, system):
    agent, tool = make_agent(), make_tool()

    def make(scope: str = "repo:acme/api/*", justification: str = "need it") -> Grant:
        return grants.grant_request(
            agent=agent,
            tool=tool,
            actions=["read"],
            scope=scope,
            duration=timedelta(hours=1),
            justification=justification,
            requested_by=alice,
            actor=system,
            at=NOW,
        )

    return make


def test_a_grant_request_emails_every_approver_after_the_commit(
    ask, approvers, webhook, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        grant = ask()
        # Queued with the change, not yet sent: delivery waits for the commit.
        assert mail.outbox == [] and webhook.requests == []
    assert len(callbacks) == 1

    assert Grant.objects.get(pk=grant.pk).status == Grant.Status.PENDING
    assert AuditEvent.objects.filter(event_type=EventType.GRANT_REQUESTED).count() == 1
    rows = Notification.objects.filter(event=NotificationEvent.REQUEST_PENDING)
    assert sorted(r.target for r in rows if r.channel == "email") == [
        f"{u.username}@example.test" for u in approvers
    ]
    assert {r.status for r in rows} == {Notification.Status.SENT}
    assert sorted(m.to[0] for m in mail.outbox) == [f"{u.username}@example.test" for u in approvers]
    assert "awaits approval" in mail.outbox[0].subject
    (hit,) = webhook.requests
    assert hit["body"]["event"] == "request_pending"
    assert hit["body"]["data"]["grant_id"] == grant.pk
    # The webhook URL (a secret) is not stored: only its digest.
    (hook_row,) = rows.filter(channel="webhook")
    assert hook_row.target == notifications.url_digest(webhook.url) and "s3cr3t" not in str(
        hook_row.target
    )


def test_a_request_tells_the_approvers_whether_the_agent_may_hand_it_on(
    ask, make_agent, make_tool, system, approvers, webhook, django_capture_on_commit_callbacks
):
    """A delegable grant goes to the agent's subagents with nobody asked: the message an
    approver decides from says so, in its text and its data."""
    lead = make_agent("lead")
    with django_capture_on_commit_callbacks(execute=True):
        plain = ask()
        handed_on = grants.grant_request(
            agent=lead, tool=make_tool("mail"), actions=["read"], scope="mail:inbox/*",
            duration=timedelta(hours=1), justification="helpers read", requested_by_agent=lead,
            delegable=True, actor=system, at=NOW,
        )  # fmt: skip
    assert Grant.objects.get(pk=handed_on.pk).delegable is True
    requested = AuditEvent.objects.filter(
        event_type=EventType.GRANT_REQUESTED, grant_id=handed_on.pk
    ).get()
    assert json.loads(requested.data)["delegable"] is True
    yes = (
        "Delegable: yes — the agent may hand this grant, narrowed, to its subagents without "
        "asking anyone."
    )
    sent = {hit["body"]["data"]["grant_id"]: hit["body"] for hit in webhook.requests}
    assert sent[handed_on.pk]["data"]["delegable"] is True and yes in sent[handed_on.pk]["text"]
    assert sent[plain.pk]["data"]["delegable"] is False
    assert "Delegable: no." in sent[plain.pk]["text"]
    mails = [m for m in mail.outbox if f"#{handed_on.pk} " in m.subject]
    assert len(mails) == len(approvers) and all(yes in m.body for m in mails)


def test_the_requester_and_the_agents_owner_are_not_asked_to_approve(
    ask, person, django_capture_on_commit_callbacks
):
    from django.contrib.auth.models import Group, User

    alice = User.objects.get(username="alice")
    alice.email = "alice@example.test"
    alice.save()
    alice.groups.add(Group.objects.get_or_create(name="approvers")[0])
    person("erin", "approvers")
    with django_capture_on_commit_callbacks(execute=True):
        ask()
    assert [m.to for m in mail.outbox] == [["erin@example.test"]]


def test_a_rolled_back_change_announces_nothing(
    ask, approvers, webhook, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        with pytest.raises(RuntimeError), transaction.atomic():
            ask()
            raise RuntimeError("the caller's transaction fails after the request")
    assert callbacks == []
    assert Notification.objects.count() == 0 and Grant.objects.count() == 0
    assert mail.outbox == [] and webhook.requests == []


def test_a_webhook_that_fails_first_is_retried_and_then_delivered(
    ask, webhook, settings, django_capture_on_commit_callbacks
):
    # Eager Celery runs the retry at once, not after its countdown; with no backoff the
    # retry is due then (a retry arriving before it is due is skipped).
    settings.NOTIFY_RETRY_BASE_SECONDS = 0
    webhook.script = [500]
    with django_capture_on_commit_callbacks(execute=True):
        grant = ask()
    (row,) = Notification.objects.filter(channel="webhook")
    assert (row.status, row.attempts, row.last_error) == (Notification.Status.SENT, 2, "")
    assert [r["body"]["data"]["grant_id"] for r in webhook.requests] == [grant.pk, grant.pk]
    # The change stood throughout.
    assert Grant.objects.get(pk=grant.pk).status == Grant.Status.PENDING


def test_a_webhook_that_keeps_failing_is_given_up_and_the_change_stands(
    ask, webhook, settings, django_capture_on_commit_callbacks
):
    settings.NOTIFY_MAX_ATTEMPTS = 3
    settings.NOTIFY_RETRY_BASE_SECONDS = 0  # eager retries run at once: due at once
    webhook.script = [503, 500, 502, 200]
    with django_capture_on_commit_callbacks(execute=True):
        grant = ask()
    (row,) = Notification.objects.filter(channel="webhook")
    assert (row.status, row.attempts) == (Notification.Status.FAILED, 3)
    assert "502" in row.last_error
    assert len(webhook.requests) == 3
    assert Grant.objects.get(pk=grant.pk).status == Grant.Status.PENDING
    assert AuditEvent.objects.filter(event_type=EventType.GRANT_REQUESTED).count() == 1


def test_a_redirecting_webhook_is_a_failure_not_followed(ask, webhook, settings):
    settings.NOTIFY_MAX_ATTEMPTS = 1
    webhook.script = [302]
    grant = ask()
    (row,) = Notification.objects.filter(channel="webhook")
    assert notifications.deliver(notification_id=row.pk, at=NOW) == ("failed", None)
    row.refresh_from_db()
    assert row.status == Notification.Status.FAILED and "302" in row.last_error
    assert len(webhook.requests) == 1 and grant.pk


def test_delivery_backs_off_and_a_second_worker_never_sends_twice(ask, webhook, settings):
    settings.NOTIFY_RETRY_BASE_SECONDS = 30
    webhook.script = [500]
    ask()
    (row,) = Notification.objects.filter(channel="webhook")
    outcome, wait = notifications.deliver(notification_id=row.pk, at=NOW)
    assert (outcome, wait) == ("retry", timedelta(seconds=30))
    row.refresh_from_db()
    assert row.next_attempt_at == NOW + timedelta(seconds=30)
    # Not due yet for the sweep; then due, delivered once; a second delivery is a no-op.
    assert notifications.sweep(at=NOW + timedelta(seconds=29)) == 0
    assert notifications.deliver(notification_id=row.pk, at=NOW + timedelta(seconds=30)) == (
        "sent",
        None,
    )
    assert notifications.deliver(notification_id=row.pk, at=NOW + timedelta(seconds=31)) == (
        "skipped",
        None,
    )
    assert len(webhook.requests) == 2
    assert notifications.backoff(3) == timedelta(seconds=120)
    assert notifications.backoff(50) == timedelta(hours=1)


def test_a_broker_outage_at_commit_leaves_the_row_for_the_sweep(
    ask, webhook, monkeypatch, django_capture_on_commit_callbacks
):
    from governance import tasks

    def broker_down(*args: object, **kwargs: object) -> None:
        raise ConnectionError("broker unreachable")

    with monkeypatch.context() as patched:
        patched.setattr(tasks.notification_deliver, "apply_async", broker_down)
        with django_capture_on_commit_callbacks(execute=True):
            grant = ask()
    (row,) = Notification.objects.filter(channel="webhook")
    assert row.status == Notification.Status.PENDING and webhook.requests == []
    assert Grant.objects.get(pk=grant.pk).status == Grant.Status.PENDING

    assert notifications.sweep(at=NOW) == 1
    row.refresh_from_db()
    assert row.status == Notification.Status.SENT and len(webhook.requests) == 1
    assert notifications.sweep(at=NOW) == 0


def test_a_worker_that_died_mid_send_is_picked_up_by_the_sweep(ask, webhook):
    ask()
    (row,) = Notification.objects.filter(channel="webhook")
    Notification.objects.filter(pk=row.pk).update(status="sending", claimed_at=NOW)
    assert notifications.sweep(at=NOW + timedelta(minutes=5)) == 0
    assert notifications.sweep(at=NOW + timedelta(minutes=10)) == 1
    row.refresh_from_db()
    assert row.status == Notification.Status.SENT


def test_the_slack_format_posts_only_text(
    ask, webhook, settings, django_capture_on_commit_callbacks
):
    settings.NOTIFY_WEBHOOK_FORMAT = "slack"
    with django_capture_on_commit_callbacks(execute=True):
        ask()
    (hit,) = webhook.requests
    assert set(hit["body"]) == {"text"} and "awaits approval" in hit["body"]["text"]


def test_slack_shows_what_an_agent_typed_and_never_obeys_it(
    ask, webhook, settings, django_capture_on_commit_callbacks
):
    """A justification is an agent's free text: `<!channel>` pinged the whole channel
    and `<url|label>` showed a phishing link as a button of the service."""
    settings.NOTIFY_WEBHOOK_FORMAT = "slack"
    with django_capture_on_commit_callbacks(execute=True):
        ask(justification="<!channel> urgent: <https://evil.example/x|Approve> & go")
    (hit,) = webhook.requests
    text = hit["body"]["text"]
    assert "&lt;!channel&gt; urgent: &lt;https://evil.example/x|Approve&gt; &amp; go" in text
    assert "<!channel>" not in text and "<https://" not in text


@pytest.fixture
def resolving(monkeypatch):
    """Name `hooks.test` resolve to the given addresses, and refuse (record) any connect
    to a non-loopback one: the test itself never sends traffic elsewhere, whatever the
    code under test does."""
    tried: list[str] = []
    real_resolve, real_connect = socket.getaddrinfo, socket.socket.connect

    def resolve(host, port, *args, **kwargs):
        if host != "hooks.test":
            return real_resolve(host, port, *args, **kwargs)
        return [
            (socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "",
             (a, port) if ":" not in a else (a, port, 0, 0))
            for a in resolving.addresses
        ]  # fmt: skip

    def connect(sock, address):
        if address[0] not in ("127.0.0.1", "::1"):
            tried.append(address[0])
            raise ConnectionRefusedError("the test refuses any address but loopback")
        return real_connect(sock, address)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    monkeypatch.setattr(socket.socket, "connect", connect)
    resolving.addresses, resolving.tried = [], tried
    return resolving


def test_a_webhook_is_never_posted_to_a_link_local_or_reserved_address(
    ask, webhook, settings, resolving
):
    """The host was resolved and connected to as is: one that resolves (or is rebound)
    to 169.254.169.254, a cloud's metadata service, was posted to. Resolved once, each
    address checked, the socket connected to a checked address itself."""
    port = webhook.server.server_address[1]
    settings.NOTIFY_WEBHOOK_URLS = [f"http://hooks.test:{port}/hook"]
    resolving.addresses = ["169.254.169.254", "fe80::1", "224.0.0.1", "0.0.0.0", "240.0.0.1"]
    ask()
    (row,) = Notification.objects.filter(channel="webhook")
    assert notifications.deliver(notification_id=row.pk, at=NOW)[0] == "retry"
    row.refresh_from_db()
    assert "resolves only to addresses a webhook is never sent to" in row.last_error
    assert "169.254.169.254" in row.last_error
    assert resolving.tried == [] and webhook.requests == []
    # Among them a loopback one (the operator's own relay): that one is used.
    resolving.addresses = ["169.254.169.254", "127.0.0.1"]
    later = NOW + timedelta(hours=2)  # past its retry's backoff
    assert notifications.deliver(notification_id=row.pk, at=later)[0] == "sent"
    assert resolving.tried == [] and len(webhook.requests) == 1


def test_a_webhook_deadline_bounds_connecting_to_several_addresses(ask, settings, resolving):
    """Each address was tried for the whole timeout: a host with 4 unanswering addresses
    held a 1 s delivery for 4 s. Each is tried only for the time left."""
    listener = socket.socket()  # its accept queue full: a connect to it hangs
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(4):
        filler = socket.socket()
        filler.setblocking(False)
        try:
            filler.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        fillers.append(filler)
    time.sleep(0.2)
    resolving.addresses = ["127.0.0.1"] * 4
    try:
        outcome, took, row = _deliver_in_one_second(ask, settings, f"http://hooks.test:{port}/h")
    finally:
        for filler in fillers:
            filler.close()
        listener.close()
    assert outcome == "retry" and took < 2.5, took
    assert "timed out" in row.last_error or "within 1 s" in row.last_error, row.last_error


def _deliver_in_one_second(ask: Any, settings: Any, url: str) -> tuple[str, float, Any]:
    """A request's webhook delivered once to `url` with a 1 s deadline: the outcome,
    how long it took (seconds), the row after it."""
    settings.NOTIFY_WEBHOOK_URLS = [url]
    settings.NOTIFY_WEBHOOK_TIMEOUT_SECONDS = 1
    ask()
    (row,) = Notification.objects.filter(channel="webhook")
    started = time.monotonic()
    outcome, _ = notifications.deliver(notification_id=row.pk, at=NOW)
    took = time.monotonic() - started
    row.refresh_from_db()
    return outcome, took, row


def test_a_webhook_removed_from_settings_fails_at_once(ask, webhook, settings):
    ask()  # queued; the commit callback does not run in this test's transaction
    (row,) = Notification.objects.filter(channel="webhook")
    settings.NOTIFY_WEBHOOK_URLS = []
    assert notifications.deliver(notification_id=row.pk, at=NOW) == ("failed", None)
    row.refresh_from_db()
    assert (row.status, row.attempts) == (Notification.Status.FAILED, 1)
    assert "no longer" in row.last_error and webhook.requests == []


def test_a_failed_audit_verify_alerts_the_admins(
    person, system, monkeypatch, django_capture_on_commit_callbacks
):
    heidi = person("heidi", "admins")
    person("erin", "approvers")
    bad = audit.Verdict(ok=False, count=3, head="x", bad_seq=2, problem="edited")
    monkeypatch.setattr(audit, "verify_chain", lambda at=None: bad)
    with django_capture_on_commit_callbacks(execute=True):
        assert audit.verify_and_record(actor=system, at=NOW) == bad
    (row,) = Notification.objects.filter(event=NotificationEvent.AUDIT_VERIFY_FAILED)
    assert row.target == heidi.email and row.status == Notification.Status.SENT
    assert AuditEvent.objects.filter(event_type=EventType.AUDIT_VERIFY_FAILED).count() == 1
    assert [m.to for m in mail.outbox] == [[heidi.email]]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("NOTIFY_WEBHOOK_URLS", "ftp://example.test/x"),
        ("NOTIFY_WEBHOOK_URLS", "http://"),
        ("NOTIFY_WEBHOOK_URLS", "https://a.test/x,,https://b.test/y"),
        # Credentials or a "port" that is a password: every delivery would fail, quoting it.
        ("NOTIFY_WEBHOOK_URLS", "https://hookuser:hunter2@hooks.example.test/x"),
        ("NOTIFY_WEBHOOK_URLS", "https://hunter2@hooks.example.test/x"),
        ("NOTIFY_WEBHOOK_URLS", "https://hooks.example.test:hunter2/x"),
        ("NOTIFY_WEBHOOK_URLS", "https://hooks.example.test:99999/x"),
        ("NOTIFY_WEBHOOK_FORMAT", "teams"),
    ],
)
def test_notification_settings_are_parsed_strictly(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    parse = {
        "NOTIFY_WEBHOOK_URLS": lambda: app_settings.env_webhook_urls(name),
        "NOTIFY_WEBHOOK_FORMAT": lambda: app_settings.env_choice(name, "json", {"json", "slack"}),
    }[name]
    with pytest.raises(ImproperlyConfigured) as caught:
        parse()
    # A URL may hold a secret: never echoed.
    assert "example.test" not in str(caught.value) and "hunter2" not in str(caught.value)


def test_good_webhook_settings_parse(monkeypatch):
    monkeypatch.setenv("NOTIFY_WEBHOOK_URLS", "https://a.test/x, http://127.0.0.1:8080/y")
    assert app_settings.env_webhook_urls("NOTIFY_WEBHOOK_URLS") == [
        "https://a.test/x",
        "http://127.0.0.1:8080/y",
    ]


def test_a_destructive_call_asks_the_approvers_once(
    make_agent, make_tool, make_grant, approvers, django_capture_on_commit_callbacks
):
    from governance.services.access import access_check

    agent, tool = make_agent(), make_tool()
    make_grant(agent, tool, actions=("delete",))
    question = {"agent": agent, "tool": tool.name, "action": "delete", "scope": "repo:acme/api/x"}
    with django_capture_on_commit_callbacks(execute=True):
        first = access_check(at=NOW, **question)
        again = access_check(at=NOW, **question)  # the same open request, reused
    assert first.decision == again.decision == "approval_required"
    assert first.approval_id == again.approval_id
    assert AuditEvent.objects.filter(event_type=EventType.ACCESS_APPROVAL_REQUIRED).count() == 2
    rows = Notification.objects.filter(event=NotificationEvent.APPROVAL_NEEDED)
    assert rows.count() == len(approvers)
    assert {r.data["approval_id"] for r in rows} == {first.approval_id}
    assert len(mail.outbox) == len(approvers)


def test_a_failing_alert_never_undoes_the_verify_failed_event(db, system, monkeypatch):
    bad = audit.Verdict(ok=False, count=3, head="x", bad_seq=2, problem="edited")
    monkeypatch.setattr(audit, "verify_chain", lambda at=None: bad)

    def broken(**kwargs: object) -> None:
        raise RuntimeError("outbox unavailable")

    monkeypatch.setattr(notifications, "audit_verify_failed", broken)
    assert audit.verify_and_record(actor=system, at=NOW) == bad
    assert AuditEvent.objects.filter(event_type=EventType.AUDIT_VERIFY_FAILED).count() == 1
    assert Notification.objects.count() == 0


# --- What leaves the service: masked text, no URL secrets, bounded time -------------------


def test_free_text_reaches_webhooks_and_mail_masked_as_in_the_audit_log(
    ask, approvers, webhook, django_capture_on_commit_callbacks
):
    typed = "deploy with password=hunter2 then mail jane.doe@corp.example"
    with django_capture_on_commit_callbacks(execute=True):
        ask(justification=typed)
        notifications.notify(
            "review_overdue",
            subject=f"Overdue: {typed}",
            body="see data",
            at=NOW,
            data={"reason": typed, "comment": {"note": typed}, "grant_id": 7},
        )
    event = AuditEvent.objects.get(event_type=EventType.GRANT_REQUESTED)
    assert "hunter2" not in event.data and "jane.doe" not in event.data
    sent = [json.dumps(hit["body"]) for hit in webhook.requests] + [
        f"{m.subject} {m.body}" for m in mail.outbox
    ]
    stored = [f"{r.subject} {r.body} {json.dumps(r.data)}" for r in Notification.objects.all()]
    assert len(webhook.requests) == 2 and mail.outbox
    for text in sent + stored:
        assert "hunter2" not in text and "jane.doe" not in text, text
    assert "password=[secret]" in webhook.requests[0]["body"]["text"]
    # Names and ids the reader needs are kept.
    assert webhook.requests[1]["body"]["data"]["grant_id"] == 7
    assert "[email]" in webhook.requests[1]["body"]["data"]["reason"]


@pytest.mark.parametrize(
    "url",
    [
        "https://127.0.0.1:hunter2/hook",  # the password typed where the port goes
        "http://127.0.0.1:{port}/hook/hunter2 x",  # a path http.client quotes in its error
    ],
)
def test_a_failed_delivery_never_stores_or_logs_the_webhooks_secret(
    ask, webhook, settings, caplog, url
):
    url = url.format(port=webhook.server.server_address[1])
    settings.NOTIFY_WEBHOOK_URLS = [url]  # as if set before start-up checks refused it
    settings.NOTIFY_MAX_ATTEMPTS = 2
    ask()
    (row,) = Notification.objects.filter(channel="webhook")
    with caplog.at_level(logging.WARNING, logger="governance.notifications"):
        assert notifications.deliver(notification_id=row.pk, at=NOW)[0] == "retry"
    row.refresh_from_db()
    assert row.last_error and "hunter2" not in row.last_error
    assert "attempt 1 failed" in caplog.text and "hunter2" not in caplog.text
    assert webhook.requests == []


class TrickleHook:
    """A real HTTP server on 127.0.0.1 that reads the POST and then answers one byte every
    0.3 s: each read is quick, the whole answer takes seconds."""

    def __init__(self) -> None:
        self.posts = 0
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                hook.posts += 1
                try:
                    for byte in b"HTTP/1.0 200 OK\r\nX-Slow: " + b"a" * 20 + b"\r\n\r\n":
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                        time.sleep(0.3)
                except OSError:
                    pass  # the client cut the connection: what the test wants

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_a_trickling_webhook_is_cut_at_its_deadline_not_per_read(ask, settings):
    hook = TrickleHook()
    try:
        outcome, took, row = _deliver_in_one_second(ask, settings, hook.url)
    finally:
        hook.server.shutdown()
        hook.server.server_close()
    # The whole answer takes 14 s; no single read takes 1 s.
    assert took < 3 and outcome == "retry" and hook.posts == 1
    assert row.status == Notification.Status.PENDING
    assert "did not answer within 1 s" in row.last_error


def test_the_delivery_task_ends_well_before_the_sweep_takes_its_row_back():
    from governance import tasks

    stuck = notifications.STUCK_AFTER.total_seconds()
    task = tasks.notification_deliver
    assert isinstance(task.soft_time_limit, int) and isinstance(task.time_limit, int)
    assert task.soft_time_limit < task.time_limit <= stuck / 2
    # And a webhook's own deadline is inside the soft limit, at its largest allowed value.
    assert 60 < task.soft_time_limit


def test_a_row_stuck_in_sending_past_its_last_attempt_is_given_up_not_resent(
    ask, webhook, settings
):
    settings.NOTIFY_MAX_ATTEMPTS = 3
    ask()
    (row,) = Notification.objects.filter(channel="webhook")
    # Its third claim hung the worker (killed at the task's hard limit).
    Notification.objects.filter(pk=row.pk).update(status="sending", claimed_at=NOW, attempts=3)
    assert notifications.sweep(at=NOW + timedelta(minutes=10)) == 0
    row.refresh_from_db()
    assert (row.status, row.attempts) == (Notification.Status.FAILED, 3)
    assert "never finished" in row.last_error or "died or hung" in row.last_error
    assert webhook.requests == []
    assert notifications.sweep(at=NOW + timedelta(hours=2)) == 0 and webhook.requests == []


def test_a_duplicate_queue_message_before_the_backoff_is_due_is_skipped(ask, webhook, settings):
    settings.NOTIFY_RETRY_BASE_SECONDS = 30
    settings.NOTIFY_MAX_ATTEMPTS = 3
    webhook.script = [500, 500, 500]
    ask()
    (row,) = Notification.objects.filter(channel="webhook")
    assert notifications.deliver(notification_id=row.pk, at=NOW)[0] == "retry"
    # A Celery retry and the sweep both queue it: the early copies do nothing.
    for seconds in (1, 2, 29):
        at = NOW + timedelta(seconds=seconds)
        assert notifications.deliver(notification_id=row.pk, at=at) == ("skipped", None)
    row.refresh_from_db()
    assert (row.status, row.attempts, len(webhook.requests)) == ("pending", 1, 1)
    assert notifications.deliver(notification_id=row.pk, at=NOW + timedelta(seconds=30)) == (
        "retry",
        timedelta(seconds=60),
    )
    assert len(webhook.requests) == 2


def test_an_smtp_server_that_never_greets_times_out_by_default(ask, person, settings):
    from django.conf import settings as live

    # The project's default, not one set by this test: the webhook's timeout.
    assert live.EMAIL_TIMEOUT == app_settings.NOTIFY_WEBHOOK_TIMEOUT_SECONDS == 5
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(5)  # accepts connections (the kernel does) and never says a word
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST, settings.EMAIL_PORT = "127.0.0.1", listener.getsockname()[1]
    settings.NOTIFY_WEBHOOK_URLS = []
    person("erin", "approvers")
    ask()
    (row,) = Notification.objects.filter(channel="email")
    failure: list[BaseException] = []

    def send() -> None:
        try:
            notifications._send(row)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            failure.append(exc)

    worker = threading.Thread(target=send, daemon=True)
    worker.start()
    worker.join(15)
    listener.close()
    assert not worker.is_alive(), "the mail delivery still waits for a greeting after 15 s"
    assert failure and "timed out" in str(failure[0])


def test_a_host_lookup_that_hangs_is_cut_at_the_webhooks_deadline(ask, settings, monkeypatch):
    """A resolver that does not answer (its own timeouts and retries add up to tens of
    seconds) held the delivery past its deadline. A fake getaddrinfo stands in for the
    hanging DNS server: the tests may not reach any resolver beyond 127.0.0.1."""
    from tests.conftest import lookup_hangs

    with lookup_hangs(monkeypatch, "hook.invalid"):
        outcome, took, row = _deliver_in_one_second(ask, settings, "http://hook.invalid:9/hook")
    assert took < 3 and outcome == "retry"
    assert row.status == Notification.Status.PENDING and row.attempts == 1
    assert "looked up" in row.last_error


def test_a_broker_that_never_answers_does_not_hold_the_request():
    """A Redis that accepts connections but never answers (stopped, paused, black-holed:
    here a listening socket nobody reads) held the request handing over its
    notifications for ever, after its change had committed. Now one bounded try (the
    broker's socket timeout), and what was not queued is left to the sweep. In a fresh
    interpreter, as a web process configures Celery from REDIS_URL at start."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    black_hole = socket.socket()
    black_hole.bind(("127.0.0.1", 0))
    black_hole.listen(16)
    port = black_hole.getsockname()[1]
    code = (
        "import django; django.setup()\n"
        "from governance import notifications\n"
        "notifications.dispatch([1, 2, 3])\n"
        "print('handed over')\n"
    )
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "governance.settings"}
    env["REDIS_URL"] = f"redis://127.0.0.1:{port}/0"
    try:
        done = subprocess.run(  # noqa: S603 - our own interpreter
            [sys.executable, "-c", code],
            cwd=Path(__file__).resolve().parent.parent,
            env=env,
            capture_output=True,
            text=True,
            timeout=90,  # a hang, not a speed: one try waits at most ~7 s
        )
    except subprocess.TimeoutExpired:
        pytest.fail("dispatch() still waited on the broker after 90 s")
    finally:
        black_hole.close()
    assert done.returncode == 0 and "handed over" in done.stdout, done.stderr[-2000:]
    assert "could not queue notifications [1, 2, 3]; the sweep will retry them" in done.stderr
