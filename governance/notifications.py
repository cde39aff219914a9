"""The ONE place that sends: e-mail through Django's mail backends and JSON webhooks.

Services call one function per event, inside the transaction that makes the change:

    request_pending(grant=..., at=...)          a grant request awaits an approver
    approval_needed(approval=..., at=...)       a destructive call awaits confirmation
    breakglass_opened(breakglass=..., notify=[users], at=...)
    review_due(users=[...], subject=..., body=..., data=..., at=...)
    review_overdue(users=[...], subject=..., body=..., data=..., at=...)
    grant_expiring(grant=..., at=...)
    grant_unused(grant=..., proposal=..., idle_actions=[...], keep_actions=[...], at=...)
    audit_verify_failed(bad_seq=..., problem=..., at=...)
    second_look_flagged(look=..., at=...)
    policy_written(policy=..., at=...)           a rule now answers the confirmation gate

Each writes one Notification row per target (an outbox, in the caller's transaction, so
a rolled-back change announces nothing) and, only after the commit, hands the ids to the
Celery task `notification_deliver`. Delivery happens in the worker: a slow or failing
webhook never blocks, and never rolls back, the change it announces. A failed attempt is
recorded on the row and retried with doubling backoff up to NOTIFY_MAX_ATTEMPTS; if the
broker itself is down at commit time the row waits for `notifications_sweep` (every
minute). Two workers never both send one row: delivery claims it with a conditional UPDATE.

Targets: each person's e-mail address (people without one are skipped) and every URL in
NOTIFY_WEBHOOK_URLS, as the generic JSON event or, with NOTIFY_WEBHOOK_FORMAT=slack, a
Slack-compatible {"text": ...}. Webhook URLs often embed a secret, so a row stores the
URL's SHA-256, the URL is looked up in settings at delivery time, and an error stored or
logged never quotes it. Subject, body and the free-text values of the data are masked as
the audit log masks them (audit.mask) before the row is written: a justification typed
with a password in it must not reach a third-party chat service or a mailbox.

Time: one webhook delivery has NOTIFY_WEBHOOK_TIMEOUT_SECONDS in all (at most a minute),
the task a hard limit of a few minutes, both well inside STUCK_AFTER: a row the sweep
takes back from a silent worker is never still being sent by it.
"""

from __future__ import annotations

import hashlib
import http.client
import ipaddress
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timedelta
from functools import partial
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.core.mail import EmailMessage
from django.db import transaction
from django.db.models import F

from governance import audit
from governance.client import connect_within, resolve_within
from governance.codes import NotificationEvent
from governance.models import Approval, BreakGlass, ConfirmationPolicy, Grant, Notification

log = logging.getLogger(__name__)

# A delivery claimed this long ago and never finished belongs to a worker that died.
STUCK_AFTER = timedelta(minutes=10)
MAX_BACKOFF = timedelta(hours=1)


def url_digest(url: str) -> str:
    return hashlib.sha256(url.encode()).hexdigest()


# --- Queueing --------------------------------------------------------------------------


def notify(
    event: str,
    *,
    subject: str,
    body: str,
    at: datetime,
    users: Iterable[Any] = (),
    data: dict[str, Any] | None = None,
) -> list[Notification]:
    """Queue `event` for every given person's e-mail and every configured webhook. A
    person who was deactivated (left) is not written to: what goes on is none of theirs."""
    addresses = sorted(
        {
            u.email
            for u in users
            if u is not None and getattr(u, "email", "") and getattr(u, "is_active", True)
        }
    )
    subject, body = audit.mask(subject), audit.mask(body)
    payload = {"event": event, **audit.masked_data(data or {})}
    rows = [
        Notification(channel=Notification.Channel.EMAIL, target=address) for address in addresses
    ] + [
        Notification(channel=Notification.Channel.WEBHOOK, target=url_digest(url))
        for url in settings.NOTIFY_WEBHOOK_URLS
    ]
    if not rows:
        return []
    for row in rows:
        row.event = event
        row.subject = subject[:200]
        row.body = body
        row.data = payload
        row.created_at = at
        row.next_attempt_at = at
    with transaction.atomic():
        created = Notification.objects.bulk_create(rows)
        ids = [row.pk for row in created]
        # After the commit only: a rolled-back change must not announce itself, and a
        # worker must not look for a row that is not visible yet.
        transaction.on_commit(partial(dispatch, ids))
    return created


def dispatch(ids: Sequence[int]) -> None:
    """Hand rows to the worker. Never raises: a broker outage leaves the rows pending
    for notifications_sweep, and the change they announce is already committed."""
    from governance.tasks import notification_deliver

    for n, pk in enumerate(ids):
        try:
            # One try: a broker that is down is the sweep's to catch up with, not a
            # reason to hold the request that made the change (each try may wait out
            # the broker's socket timeout, so the first failure leaves the rest too).
            notification_deliver.apply_async(args=[pk], retry=False)
        except Exception:  # noqa: BLE001 - the sweep retries; the change must stand
            log.warning(
                "could not queue notifications %s; the sweep will retry them", list(ids[n:])
            )
            return


# --- Delivering --------------------------------------------------------------------------


def backoff(attempts: int) -> timedelta:
    """30 s, 60 s, 2 min, ... (NOTIFY_RETRY_BASE_SECONDS doubled), at most an hour."""
    # The exponent is capped before it can overflow timedelta; the result at MAX_BACKOFF.
    exponent = min(max(attempts - 1, 0), 20)
    wait = settings.NOTIFY_RETRY_BASE_SECONDS * 2**exponent
    return min(timedelta(seconds=wait), MAX_BACKOFF)


class PermanentFailure(Exception):
    """Retrying cannot help (the webhook is no longer configured)."""


def _slack_text(text: str) -> str:
    """Slack reads <...> as a control sequence (<!channel> pings everyone, <url|label>
    shows any link as any label) and & as an entity: text an agent typed (a request's
    justification) is escaped as Slack asks, so it is shown, never obeyed."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def webhook_payload(row: Notification) -> dict[str, Any]:
    if settings.NOTIFY_WEBHOOK_FORMAT == "slack":
        return {"text": f"*{_slack_text(row.subject)}*\n{_slack_text(row.body)}"}
    return {
        "event": row.event,
        "subject": row.subject,
        "text": row.body,
        "data": row.data,
        "notification_id": row.pk,
        "created_at": row.created_at.isoformat(),
    }


def _deliverable(address: str) -> bool:
    """An address a webhook may be posted to: not link-local (169.254.169.254 is a cloud's
    metadata service), multicast, unspecified or reserved. Loopback and private
    addresses are the operator's own hosts (an internal relay) and are allowed."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return not (ip.is_link_local or ip.is_multicast or ip.is_unspecified or ip.is_reserved)


def _checked_connection(deadline: float) -> Callable[..., socket.socket]:
    """http.client's _create_connection for one delivery: the host is resolved once,
    its addresses are checked (_deliverable) and the socket is connected to a checked
    one itself, so no later lookup (DNS rebinding) can send it elsewhere; each address
    is tried only for the time left before the delivery's deadline."""

    def create(address: tuple[str, int], timeout: Any = None, source: Any = None) -> socket.socket:
        host, port = address
        found = resolve_within(host, port, deadline)
        allowed = [info for info in found if _deliverable(str(info[4][0]))]
        if not allowed:
            refused = sorted({str(info[4][0]) for info in found})
            raise OSError(
                f"the webhook's host resolves only to addresses a webhook is never sent to "
                f"(link-local, multicast, reserved): {', '.join(refused)}"
            )
        return connect_within(allowed, deadline, timeout)

    return create


def _post(url: str, body: bytes, *, seconds: float) -> int:
    """POST `body` to `url` and return the status, all within `seconds`.

    urllib's (and http.client's) timeout bounds each socket operation, not the exchange:
    a server answering one byte every half second held a 1 s delivery for 18 s. A timer
    cuts the connection at the deadline instead. http.client follows no redirects (a
    webhook that redirects is misconfigured; following it would re-send the payload
    somewhere nobody configured) and uses no proxy from the environment (a webhook goes
    exactly to its configured host)."""
    parts = urlsplit(url)
    connection_class = (
        http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    )
    port = parts.port or (443 if parts.scheme == "https" else 80)
    conn = connection_class(parts.hostname or "", port, timeout=seconds)
    conn._create_connection = _checked_connection(time.monotonic() + seconds)  # type: ignore[attr-defined]
    expired = threading.Event()

    def cut() -> None:
        expired.set()
        sock = conn.sock
        if sock is not None:
            try:  # the plain socket's shutdown: wakes a read blocked in another thread
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
            except OSError:
                pass

    timer = threading.Timer(seconds, cut)
    timer.daemon = True
    timer.start()
    try:
        conn.connect()
        if expired.is_set():  # the deadline passed while connecting (no socket to cut)
            raise TimeoutError
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request(
            "POST",
            path,
            body=body,
            headers={"Content-Type": "application/json", "User-Agent": "agent-governance"},
        )
        with conn.getresponse() as response:
            return response.status
    except Exception as exc:
        if expired.is_set() or isinstance(exc, TimeoutError):
            # The timer's cut, or the deadline seen first by the lookup or a connect (the
            # timer's thread may not have run yet): one message either way.
            said = f": {exc}" if isinstance(exc, TimeoutError) and str(exc) else ""
            raise TimeoutError(f"the webhook did not answer within {seconds:g} s{said}") from None
        raise
    finally:
        timer.cancel()
        conn.close()


def _send(row: Notification) -> None:
    if row.channel == Notification.Channel.EMAIL:
        EmailMessage(row.subject, row.body, settings.DEFAULT_FROM_EMAIL, [row.target]).send()
        return
    url = next((u for u in settings.NOTIFY_WEBHOOK_URLS if url_digest(u) == row.target), None)
    if url is None:
        raise PermanentFailure("the webhook is no longer in NOTIFY_WEBHOOK_URLS")
    status = _post(
        url,
        json.dumps(webhook_payload(row)).encode(),
        seconds=settings.NOTIFY_WEBHOOK_TIMEOUT_SECONDS,
    )
    if not 200 <= status < 300:
        raise OSError(f"webhook answered HTTP {status}")


def without_urls(text: str) -> str:
    """Error text with every configured webhook URL's secret parts (credentials, path,
    query, a "port" that is not one) replaced: it is stored on the row and logged."""
    for url in settings.NOTIFY_WEBHOOK_URLS:
        parts = urlsplit(url)
        userinfo, _, hostport = parts.netloc.rpartition("@")
        port = hostport.rpartition(":")[2] if ":" in hostport else ""
        pieces = [url, parts.netloc, userinfo, *userinfo.split(":"), parts.path, parts.query]
        if port and not port.isdigit():
            pieces.append(port)
        # Longest first, so a part of a longer piece does not break its replacement;
        # one-character pieces ("/") are no secret and would garble the text.
        for piece in sorted({p for p in pieces if len(p) > 1}, key=len, reverse=True):
            text = text.replace(piece, "[webhook]")
    return audit.mask(text)


def deliver(*, notification_id: int, at: datetime) -> tuple[str, timedelta | None]:
    """One delivery attempt. Returns (outcome, wait): "sent"; "retry" with the backoff
    to wait; "failed" (given up); or "skipped" (someone else has it, it is done, or its
    retry is not due yet: a duplicate queue message, from a Celery retry and the sweep,
    must not skip the backoff and spend every attempt within seconds)."""
    claimed = Notification.objects.filter(
        pk=notification_id, status=Notification.Status.PENDING, next_attempt_at__lte=at
    ).update(status=Notification.Status.SENDING, claimed_at=at, attempts=F("attempts") + 1)
    if not claimed:
        return "skipped", None
    row = Notification.objects.get(pk=notification_id)
    try:
        _send(row)
    except Exception as exc:  # noqa: BLE001 - every failure is recorded on the row
        error = without_urls(f"{type(exc).__name__}: {exc}")[:1000]
        final = isinstance(exc, PermanentFailure) or row.attempts >= settings.NOTIFY_MAX_ATTEMPTS
        wait = backoff(row.attempts)
        Notification.objects.filter(pk=row.pk, status=Notification.Status.SENDING).update(
            status=Notification.Status.FAILED if final else Notification.Status.PENDING,
            last_error=error,
            next_attempt_at=at if final else at + wait,
        )
        if final:
            log.error("notification %s (%s) failed for good: %s", row.pk, row.event, error)
            return "failed", None
        log.warning("notification %s attempt %s failed: %s", row.pk, row.attempts, error)
        return "retry", wait
    Notification.objects.filter(pk=row.pk, status=Notification.Status.SENDING).update(
        status=Notification.Status.SENT, sent_at=at, last_error=""
    )
    return "sent", None


def sweep(*, at: datetime) -> int:
    """Re-queue what is due: rows whose dispatch was lost (broker down at commit), whose
    retry is due, or whose worker died mid-send. Returns how many were queued.

    A row stuck in "sending" counts its claim as an attempt: past NOTIFY_MAX_ATTEMPTS it
    is given up, so a message that kills or hangs its worker every time is not sent for
    ever."""
    stuck = Notification.objects.filter(
        status=Notification.Status.SENDING, claimed_at__lte=at - STUCK_AFTER
    )
    stuck.filter(attempts__gte=settings.NOTIFY_MAX_ATTEMPTS).update(
        status=Notification.Status.FAILED,
        last_error=f"no attempt finished within {STUCK_AFTER} (the worker died or hung)",
    )
    stuck.update(status=Notification.Status.PENDING)
    due = list(
        Notification.objects.filter(
            status=Notification.Status.PENDING, next_attempt_at__lte=at
        ).values_list("pk", flat=True)[:1000]
    )
    dispatch(due)
    return len(due)


# --- One function per event ----------------------------------------------------------------


def _approvers(exclude: Iterable[Any]) -> list[Any]:
    from governance.selectors import approver_users

    return approver_users(exclude=list(exclude))


def _grant_line(grant: Grant) -> str:
    task = f" for task {grant.task.key}" if grant.task_id else ""
    return (
        f"agent {grant.agent.name}: {', '.join(grant.actions)} on {grant.tool.name} "
        f"{grant.scope}{task}"
    )


def _delegable_line(grant: Grant) -> str:
    """Said to whoever decides: a delegable grant is handed on with no person asked."""
    if grant.delegable:
        return (
            "Delegable: yes — the agent may hand this grant, narrowed, to its subagents "
            "without asking anyone"
        )
    return "Delegable: no"


def _grant_data(grant: Grant) -> dict[str, Any]:
    return {
        "grant_id": grant.pk,
        "agent": grant.agent.name,
        "tool": grant.tool.name,
        "actions": list(grant.actions),
        "scope": grant.scope,
        "delegable": grant.delegable,
        "break_glass": grant.break_glass,
        "expires_at": grant.expires_at.isoformat() if grant.expires_at else None,
    }


def request_pending(*, grant: Grant, at: datetime) -> list[Notification]:
    """A grant request awaits a decision: every approver but the requester and owner."""
    return notify(
        NotificationEvent.REQUEST_PENDING,
        subject=f"Grant request #{grant.pk} awaits approval",
        body=(
            f"Requested: {_grant_line(grant)}.\n{_delegable_line(grant)}.\n"
            f"Justification: {grant.justification}"
        ),
        users=_approvers([grant.requested_by_id, grant.agent.owner_id]),
        data=_grant_data(grant),
        at=at,
    )


def approval_needed(*, approval: Approval, at: datetime) -> list[Notification]:
    """A destructive call awaits confirmation before it expires (APPROVAL_TTL)."""
    return notify(
        NotificationEvent.APPROVAL_NEEDED,
        subject=f"Confirm a destructive call by {approval.agent.name}",
        body=(
            f"Agent {approval.agent.name} wants to {approval.action} {approval.scope} with "
            f"{approval.tool.name}. Approval {approval.pk} expires at "
            f"{approval.expires_at.isoformat()}."
        ),
        users=_approvers([approval.agent.owner_id, approval.grant.requested_by_id]),
        data={
            "approval_id": str(approval.pk),
            "agent": approval.agent.name,
            "tool": approval.tool.name,
            "action": approval.action,
            "scope": approval.scope,
            "expires_at": approval.expires_at.isoformat(),
        },
        at=at,
    )


def policy_written(*, policy: ConfirmationPolicy, at: datetime) -> list[Notification]:
    """A confirmation policy now answers for people: the agent's owner and every other
    approver are told (a standing approval or refusal is a decision people should see,
    and revoke if they disagree)."""
    owner = policy.agent.owner
    others = _approvers([policy.created_by_id, policy.agent.owner_id])
    people = ([owner] if owner.pk != policy.created_by_id else []) + others
    where = f" under task {policy.task.key}" if policy.task_id else ""
    return notify(
        NotificationEvent.POLICY_WRITTEN,
        subject=(
            f"Confirmation policy #{policy.pk}: {policy.verdict} {policy.agent.name}'s "
            f"{policy.action} calls on {policy.tool.name}"
        ),
        body=(
            f"{policy.created_by.get_username()} wrote a policy that will {policy.verdict} "
            f"every {policy.action} by {policy.agent.name} with {policy.tool.name} on "
            f"{policy.scope}{where} without asking a person, until "
            f"{policy.expires_at.isoformat()}.\nWhy: {policy.reason}"
        ),
        users=people,
        data={
            "policy": policy.pk,
            "verdict": policy.verdict,
            "agent": policy.agent.name,
            "tool": policy.tool.name,
            "action": policy.action,
            "scope": policy.scope,
            "expires_at": policy.expires_at.isoformat(),
            "reason": policy.reason,
        },
        at=at,
    )


def breakglass_opened(
    *, breakglass: BreakGlass, notify_users: Iterable[Any], at: datetime
) -> list[Notification]:
    grant = breakglass.grant
    return notify(
        NotificationEvent.BREAKGLASS_OPENED,
        subject=f"BREAK-GLASS opened by {breakglass.opened_by.get_username()} "
        f"({breakglass.ticket})",
        body=(
            f"{breakglass.opened_by.get_username()} opened break-glass for {_grant_line(grant)}, "
            f"without approval, until {breakglass.expires_at.isoformat()}.\n"
            f"Ticket: {breakglass.ticket}\nReason: {breakglass.reason}\n"
            f"Post-incident review due by {breakglass.review_due_at.isoformat()}."
        ),
        users=notify_users,
        data={
            **_grant_data(grant),
            "breakglass_id": breakglass.pk,
            "ticket": breakglass.ticket,
            "opened_by": breakglass.opened_by.get_username(),
            "review_due_at": breakglass.review_due_at.isoformat(),
        },
        at=at,
    )


def review_due(
    *, users: Iterable[Any], subject: str, body: str, data: dict[str, Any], at: datetime
) -> Any:
    return notify(
        NotificationEvent.REVIEW_DUE, subject=subject, body=body, users=users, data=data, at=at
    )


def review_overdue(
    *, users: Iterable[Any], subject: str, body: str, data: dict[str, Any], at: datetime
) -> list[Notification]:
    return notify(
        NotificationEvent.REVIEW_OVERDUE, subject=subject, body=body, users=users, data=data, at=at
    )


def grant_expiring(*, grant: Grant, at: datetime) -> list[Notification]:
    """The grant ends soon: its requester and the agent's owner, so a renewal can be
    requested in time (or, better, the grant left to end)."""
    assert grant.expires_at is not None
    return notify(
        NotificationEvent.GRANT_EXPIRING,
        subject=f"Grant #{grant.pk} expires at {grant.expires_at.isoformat()}",
        body=f"Expiring soon: {_grant_line(grant)}.",
        users=[grant.requested_by, grant.agent.owner],
        data=_grant_data(grant),
        at=at,
    )


def grant_unused(
    *, grant: Grant, proposal: str, idle_actions: list[str], keep_actions: list[str], at: datetime
) -> list[Notification]:
    """A live grant's rights went unused (hygiene.grants_flag_unused): its requester and
    the agent's owner, who can give it back (revoke or narrow it) before a reviewer has
    to take it away."""
    what = (
        "proposed for removal"
        if not keep_actions
        else f"proposed for narrowing to {', '.join(keep_actions)}"
    )
    return notify(
        NotificationEvent.GRANT_UNUSED,
        subject=f"Grant #{grant.pk} unused: {what}",
        body=(
            f"Unused for {settings.UNUSED_GRANT_HOURS} hours ({', '.join(idle_actions)}): "
            f"{_grant_line(grant)}.\nIt is {what} at its next review; revoke or narrow it "
            "now if the agent no longer needs it."
        ),
        users=[grant.requested_by, grant.agent.owner],
        data={**_grant_data(grant), "proposal": proposal, "idle_actions": idle_actions},
        at=at,
    )


def audit_verify_failed(*, bad_seq: int | None, problem: str, at: datetime) -> Any:
    from django.contrib.auth import get_user_model

    from governance import roles

    admins = get_user_model().objects.filter(is_active=True, groups__name=roles.ADMINS)
    supers = get_user_model().objects.filter(is_active=True, is_superuser=True)
    return notify(
        NotificationEvent.AUDIT_VERIFY_FAILED,
        subject="Audit chain verification FAILED",
        body=f"The audit chain does not verify at seq {bad_seq}: {problem}",
        users=list({u.pk: u for u in [*admins, *supers]}.values()),
        data={"bad_seq": bad_seq, "problem": problem},
        at=at,
    )


def second_look_flagged(*, look: Any, users: Iterable[Any], at: datetime) -> list[Notification]:
    return notify(
        NotificationEvent.SECOND_LOOK_FLAGGED,
        subject=f"Second look #{look.pk} flagged an approval",
        body=f"{look.decided_by.get_username()} flagged a {look.kind} approval: {look.comment}",
        users=users,
        data={"second_look_id": look.pk, "kind": look.kind, "grant_id": look.grant_id},
        at=at,
    )
