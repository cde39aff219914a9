"""Sign-in, sessions and the security headers of the web UI."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urljoin, urlsplit

import pytest
from django.contrib.auth.models import User
from django.test import Client

from governance import ratelimit
from governance.models import AuditEvent, Grant, Tool
from tests import ui_world

ROOT = Path(__file__).resolve().parent.parent


def _login(
    client: Client, username: str, password: str, addr: str = "127.0.0.1", **forwarded: str
) -> Any:
    client.get("/ui/login/")
    return client.post(
        "/ui/login/",
        {
            "username": username,
            "password": password,
            "csrfmiddlewaretoken": client.cookies["csrftoken"].value,
        },
        REMOTE_ADDR=addr,
        **forwarded,
    )


@pytest.mark.django_db
def test_a_person_signs_in_and_reaches_the_dashboard() -> None:
    ui_world.build()
    client = Client(enforce_csrf_checks=True)
    response = _login(client, "carol", ui_world.PASSWORD)
    assert response.status_code == 302 and response["Location"] == "/ui/"
    page = client.get("/ui/")
    assert page.status_code == 200
    assert b"carol (auditor)" in page.content


@pytest.mark.django_db
def test_a_wrong_password_is_refused_without_saying_which_part_was_wrong() -> None:
    ui_world.build()
    client = Client(enforce_csrf_checks=True)
    response = _login(client, "carol", "wrong")
    assert response.status_code == 200
    assert b"Please enter a correct username and password" in response.content
    assert "_auth_user_id" not in client.session


@pytest.mark.django_db
def test_sign_in_is_rate_limited_per_account_across_addresses(settings: object) -> None:
    ui_world.build()
    settings.RATE_LIMITS = {**settings.RATE_LIMITS, "login_account": 3}  # type: ignore[attr-defined]
    client = Client(enforce_csrf_checks=True)
    for i in range(3):
        assert _login(client, "carol", "wrong", addr=f"127.0.0.{i + 1}").status_code == 200
    refused = _login(client, "carol", ui_world.PASSWORD, addr="127.0.0.9")
    assert refused.status_code == 429
    assert int(refused["Retry-After"]) >= 1
    assert b"Too many sign-in attempts" in refused.content
    assert "_auth_user_id" not in client.session  # not even the right password gets in
    # Another account from the same addresses is not affected.
    assert _login(Client(), "bob", ui_world.PASSWORD, addr="127.0.0.9").status_code == 302


@pytest.mark.django_db
def test_sign_in_is_rate_limited_per_address_across_accounts(settings: object) -> None:
    ui_world.build()
    settings.RATE_LIMITS = {**settings.RATE_LIMITS, "login_address": 4}  # type: ignore[attr-defined]
    client = Client()
    for name in ("u1", "u2", "u3", "u4"):
        assert _login(client, name, "guess", addr="127.0.0.5").status_code == 200
    assert _login(client, "carol", ui_world.PASSWORD, addr="127.0.0.5").status_code == 429
    assert _login(client, "carol", ui_world.PASSWORD, addr="127.0.0.6").status_code == 302


@pytest.mark.django_db
def test_sign_in_is_counted_in_redis_across_web_processes(settings: object) -> None:
    """With REDIS_URL the count lives in Redis (real, on 127.0.0.1), so every web
    process sees the same attempts; this test's keys carry a prefix of its own."""
    import uuid

    import redis

    ui_world.build()
    url = f"redis://127.0.0.1:6379/{os.environ.get('TEST_REDIS_DB', '15')}"
    prefix = f"rl-ui-test-{uuid.uuid4().hex}"
    settings.REDIS_URL = url  # type: ignore[attr-defined]
    settings.RATE_LIMIT_KEY_PREFIX = prefix  # type: ignore[attr-defined]
    settings.RATE_LIMITS = {**settings.RATE_LIMITS, "login_account": 2}  # type: ignore[attr-defined]
    ratelimit.reset_memory()
    client = redis.Redis.from_url(url)
    try:
        assert _login(Client(), "carol", "wrong").status_code == 200
        assert _login(Client(), "carol", "wrong").status_code == 200
        assert _login(Client(), "carol", ui_world.PASSWORD).status_code == 429
        keys = sorted(k.decode() for k in client.scan_iter(match=f"{prefix}:*"))
        assert [k.split(":")[1] for k in keys] == ["login_account", "login_address"]
        assert int(client.get(keys[0])) == 3  # the refused attempt counts too
    finally:
        stale = list(client.scan_iter(match=f"{prefix}:*"))
        if stale:
            client.delete(*stale)
        client.close()


@pytest.mark.django_db
def test_sign_in_fails_closed_when_the_limiter_is_unreachable(settings: object) -> None:
    ui_world.build()
    # A port nothing listens on, on this machine: the limiter cannot be reached.
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # type: ignore[attr-defined]
    ratelimit.reset_memory()
    response = _login(Client(), "carol", ui_world.PASSWORD)
    assert response.status_code == 503
    assert b"Sign-in is unavailable" in response.content


@pytest.mark.django_db
def test_a_deactivated_users_session_ends_at_once() -> None:
    ui_world.build()
    client = Client()
    assert _login(client, "dave", ui_world.PASSWORD).status_code == 302
    assert client.get("/ui/").status_code == 200
    User.objects.filter(username="dave").update(is_active=False)
    response = client.get("/ui/")
    assert response.status_code == 302 and response["Location"].startswith("/ui/login/")
    # And a forged state change from that session does nothing.
    grant = Grant.objects.filter(status="active").first()
    assert grant is not None
    client.post(f"/ui/grants/{grant.pk}/revoke", {"reason": "x"})
    grant.refresh_from_db()
    assert grant.status == "active"


@pytest.mark.django_db
def test_a_person_without_a_role_gets_403() -> None:
    ui_world.build()
    client = Client()
    client.force_login(User.objects.get(username="alice"))
    assert client.get("/ui/").status_code == 403
    assert client.get("/ui/audit/").status_code == 403


@pytest.mark.django_db
def test_every_page_sends_csp_and_frame_headers() -> None:
    ui_world.build()
    client = ui_world.signed_in("admin")
    for path in ("/ui/", "/ui/matrix/", "/ui/login/", "/ui/audit/", "/ui/reports/print"):
        response = client.get(path, follow=True)
        csp = response["Content-Security-Policy"]
        assert "script-src 'self'" in csp and "'unsafe-inline'" not in csp, path
        assert "frame-ancestors 'none'" in csp
        assert response["X-Frame-Options"] == "DENY"
        assert b"<script>" not in response.content  # no inline script anywhere


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/ui/login/", "/api/v1/authorize"])
def test_answers_made_before_any_view_carry_the_policy_too(path) -> None:
    """A chunked body (411) and a Host not allowed (400) are answered by a middleware
    before any view: the CSP middleware, innermost, never saw them."""
    client = Client()
    chunked = client.post(path, b"{}", content_type="application/json",
                          HTTP_TRANSFER_ENCODING="chunked")  # fmt: skip
    bad_host = client.get(path, HTTP_HOST="evil.example.test")
    for response, status in ((chunked, 411), (bad_host, 400)):
        assert response.status_code == status
        csp = response["Content-Security-Policy"]
        assert "frame-ancestors 'none'" in csp and "'unsafe-inline'" not in csp
    assert AuditEvent.objects.count() == 0  # neither reached anything that writes


@pytest.mark.django_db
def test_no_state_change_on_get() -> None:
    world = ui_world.build()
    client = ui_world.signed_in("admin")
    for path in (
        f"/ui/grants/{world.grant.pk}/revoke",
        f"/ui/inbox/requests/{world.request.pk}/approve",
        f"/ui/inbox/approvals/{world.approval.pk}/approve",
        "/ui/agents/bot-a/suspend",
        "/ui/agents/bot-a/tokens",
        "/ui/tools/repo/approve",
    ):
        before = AuditEvent.objects.count()
        assert client.get(path).status_code == 405, path
        assert AuditEvent.objects.count() == before
    world.request.refresh_from_db()
    assert world.request.status == "pending"


def test_check_deploy_reports_no_warnings_with_production_settings(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "governance.settings_production",
        "SECRET_KEY": secrets.token_urlsafe(64),
        "AUDIT_HMAC_KEY": secrets.token_urlsafe(64),
        "REDIS_URL": "redis://127.0.0.1:6379/0",  # required in production
        "ALLOWED_HOSTS": "governance.example.org",
        "SQLITE_PATH": str(tmp_path / "db.sqlite3"),
    }
    env.pop("DATABASE_URL", None)
    # A test-harness switch (the browser tests set it), never a deployment's.
    env.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    result = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "System check identified no issues" in output, output


def test_production_settings_refuse_the_development_secrets(tmp_path: Path) -> None:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "governance.settings_production"}
    env.pop("SECRET_KEY", None)
    result = subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "SECRET_KEY must be set" in result.stderr


@pytest.mark.django_db
def test_the_admin_sites_sign_in_goes_through_the_rate_limited_door() -> None:
    response = Client().get("/admin/login/?next=/admin/")
    assert response.status_code == 302
    assert response["Location"] == "/ui/login/?next=/admin/"


@pytest.mark.django_db
@pytest.mark.parametrize("role", ["approver", "auditor"])
def test_a_signed_in_person_who_may_not_use_the_admin_site_is_not_sent_round_in_circles(
    role: str,
) -> None:
    """/admin/ sends a person without staff status to its sign-in, which is the UI's,
    which sent a signed-in person straight on to `next` = /admin/: a redirect loop (the
    browser's "too many redirects"). They land on the UI instead; staff still go on."""
    ui_world.build()
    client = ui_world.signed_in(role)
    response = client.get("/ui/login/?next=/admin/")
    assert response.status_code == 302 and response["Location"] == "/ui/"
    staff = User.objects.get(username=ui_world.ROLE_USERS["admin"])
    staff.is_staff = True
    staff.save(update_fields=["is_staff"])
    admin_client = ui_world.signed_in("admin")
    assert admin_client.get("/ui/login/?next=/admin/")["Location"] == "/admin/"


@pytest.mark.django_db
@pytest.mark.parametrize("role", ["admin", "auditor", None])
def test_a_sign_in_link_pointing_back_at_itself_is_not_a_server_error(role: str | None) -> None:
    """`/ui/login/?next=/ui/login/` (a crafted or mangled link) made Django's sign-in
    raise "Redirection loop for authenticated user detected" for anyone signed in: a
    500 with its traceback in the log. A signed-in person lands on the UI instead, and
    signing in with that `next` does the same."""
    ui_world.build()
    if role is None:  # signing in, with the looping `next`
        client = Client(enforce_csrf_checks=True)
        client.get("/ui/login/?next=/ui/login/")
        response = client.post(
            "/ui/login/?next=/ui/login/",
            {
                "username": ui_world.ROLE_USERS["approver"],
                "password": ui_world.PASSWORD,
                "next": "/ui/login/",
                "csrfmiddlewaretoken": client.cookies["csrftoken"].value,
            },
        )
        assert response.status_code == 302 and response["Location"] == "/ui/"
        assert client.get("/ui/").status_code == 200
        return
    client = ui_world.signed_in(role)
    before = AuditEvent.objects.count()
    for looping in ("/ui/login/", "/ui/login/?x=1"):
        response = client.get("/ui/login/", {"next": looping})
        assert response.status_code == 302 and response["Location"] == "/ui/"
    assert AuditEvent.objects.count() == before  # a redirect, nothing recorded


@pytest.mark.django_db
def test_the_start_page_shows_the_matrix_to_nobody_without_a_role() -> None:
    """`/` listed every live grant (agent, tool, scope, approver) to any signed-in
    account, a role-less agent owner's included, and counts to anonymous visitors. It
    is the dashboard's door now: sign-in, then 403 without a role."""
    ui_world.build()
    anonymous = Client().get("/", follow=True)
    assert anonymous.redirect_chain[-1][0].startswith("/ui/login/")
    assert b"repo:acme" not in anonymous.content and b"live grants" not in anonymous.content
    alice = Client()
    alice.force_login(User.objects.get(username="alice"))  # owns agents, holds no role
    page = alice.get("/", follow=True)
    assert page.status_code == 403 and b"repo:acme" not in page.content
    approver = ui_world.signed_in("approver").get("/", follow=True)
    assert approver.status_code == 200 and approver.redirect_chain == [("/ui/", 302)]


@pytest.mark.django_db
def test_behind_a_trusted_proxy_sign_ins_are_counted_per_forwarded_address(settings) -> None:
    """Behind the production proxy every sign-in came from the proxy's address: one
    per-address limit for the whole world, which 20 junk attempts a minute used up."""
    import ipaddress

    ui_world.build()
    settings.RATE_LIMITS = {**settings.RATE_LIMITS, "login_address": 3}
    settings.TRUSTED_PROXIES = (ipaddress.ip_network("172.18.0.0/16"),)
    proxy, stranger = "172.18.0.1", "192.0.2.50"

    def via(peer: str, forwarded: str, name: str, password: str = "x") -> int:
        return _login(Client(), name, password, peer, HTTP_X_FORWARDED_FOR=forwarded).status_code

    for i in range(3):
        assert via(proxy, f"198.51.100.{i}", f"nobody{i}") == 200
    # Three strangers used up their own counts, not carol's address's.
    assert via(proxy, "203.0.113.7", "carol", ui_world.PASSWORD) == 302
    # One stranger is limited however its own X-Forwarded-For entries read: the proxy
    # appends the real peer last, and entries left of it are the client's to forge.
    for i in range(3):
        assert via(proxy, f"10.9.9.{i}, 198.51.100.77", "mallory") == 200
    assert via(proxy, "1.2.3.4, 198.51.100.77", "bob", ui_world.PASSWORD) == 429
    # A peer that is no trusted proxy is counted itself, whatever it forwards.
    for i in range(3):
        assert via(stranger, f"198.51.100.{100 + i}", "m2") == 200
    assert via(stranger, "203.0.113.9", "bob", ui_world.PASSWORD) == 429
    # A dual-stack server sees the proxy as ::ffff:172.18.0.1: the same proxy.
    for i in range(3):
        assert via("::ffff:172.18.0.1", f"198.51.100.{200 + i}", f"v6{i}") == 200
    assert via("::ffff:172.18.0.1", "203.0.113.10", "carol", ui_world.PASSWORD) == 302


@pytest.mark.django_db
@pytest.mark.parametrize("via_proxy", [False, True])
def test_sign_ins_from_one_ipv6_network_share_one_address_limit(settings, via_proxy) -> None:
    """Each IPv6 address had a count of its own, and any client holds a whole /64: it
    sprayed passwords from a new address each time and was never limited, directly or
    behind a trusted proxy. Its /64 (LOGIN_IPV6_PREFIX) is counted as one address now."""
    import ipaddress

    ui_world.build()
    settings.RATE_LIMITS = {**settings.RATE_LIMITS, "login_address": 3}
    settings.TRUSTED_PROXIES = (ipaddress.ip_network("10.0.0.0/8"),)
    events = AuditEvent.objects.count()

    def attempt(address: str, name: str, password: str = "Winter2026!") -> Any:
        client = Client()
        if via_proxy:
            return client, _login(client, name, password, "10.0.0.5", HTTP_X_FORWARDED_FOR=address)
        return client, _login(client, name, password, address)

    for i in range(3):  # three accounts, three addresses of one /64
        assert attempt(f"2001:db8:1:2::{i + 1:x}", f"nobody{i}")[1].status_code == 200
    # A fourth address of the same /64, and the right password: still refused.
    client, refused = attempt("2001:db8:1:2:ffff:ffff:ffff:fffe", "bob", ui_world.PASSWORD)
    assert refused.status_code == 429 and b"Too many sign-in attempts" in refused.content
    assert "_auth_user_id" not in client.session
    assert User.objects.get(username="bob").last_login is None
    # The neighbouring /64 is another client.
    assert attempt("2001:db8:1:3::1", "bob", ui_world.PASSWORD)[1].status_code == 302
    assert AuditEvent.objects.count() == events  # a sign-in is no change: nothing recorded


@pytest.mark.django_db
def test_the_ipv6_network_a_sign_in_is_counted_by_is_configurable(settings) -> None:
    """LOGIN_IPV6_PREFIX=48 counts a provider's whole /48 as one client; 128, each
    address. An IPv4 address, also spelled `::ffff:a.b.c.d`, is counted on its own."""
    from governance.web.views import address_bucket

    settings.LOGIN_IPV6_PREFIX = 48
    assert address_bucket("2001:db8:1:2::1") == address_bucket("2001:db8:1:ff::9")
    assert address_bucket("2001:db8:1:2::1") == "2001:db8:1::/48"
    assert address_bucket("2001:db8:1:2::1") != address_bucket("2001:db8:2:2::1")
    settings.LOGIN_IPV6_PREFIX = 128
    assert address_bucket("2001:db8::1") != address_bucket("2001:db8::2")
    settings.LOGIN_IPV6_PREFIX = 64
    assert address_bucket("fe80::1%eth0") == "fe80::/64"  # a scope is no part of it
    assert address_bucket("::ffff:198.51.100.7") == address_bucket("198.51.100.7")
    assert address_bucket("198.51.100.7") != address_bucket("198.51.100.8")
    assert address_bucket("unknown") == "unknown"


@pytest.mark.django_db
def test_look_alike_spellings_of_an_account_share_its_sign_in_limit(settings) -> None:
    """The form signs `ｃａｒｏｌ` (fullwidth) in as carol (NFKC), but each spelling had a
    per-account count of its own: guessing at one account was not limited."""
    ui_world.build()
    settings.RATE_LIMITS = {**settings.RATE_LIMITS, "login_account": 3}
    for i, name in enumerate(["carol", "\uff43arol", "c\uff41rol"]):
        assert _login(Client(), name, "wrong", addr=f"127.0.1.{i + 1}").status_code == 200
    fullwidth = "\uff43\uff41\uff52\uff4f\uff4c"
    assert _login(Client(), fullwidth, ui_world.PASSWORD, addr="127.0.1.9").status_code == 429
    assert _login(Client(), "bob", ui_world.PASSWORD, addr="127.0.1.9").status_code == 302


@pytest.mark.django_db
def test_the_admin_site_is_for_admins_and_does_not_show_the_audit_log() -> None:
    """A staff account with a view permission and no role got into /admin/ and read
    every audit event there, with no audit.viewed event: the UI is where the log is
    read, and each look is recorded."""
    from django.contrib.auth.models import Permission

    ui_world.build()
    peeker = User.objects.create_user("peeker", is_staff=True)
    peeker.user_permissions.add(Permission.objects.get(codename="view_grant"))
    client = Client()
    client.force_login(peeker)
    refused = client.get("/admin/governance/grant/")
    assert refused.status_code == 302 and refused["Location"].startswith("/admin/login/")
    admin = User.objects.get(username=ui_world.ROLE_USERS["admin"])
    admin.is_staff = True
    admin.save(update_fields=["is_staff"])
    admin_client = ui_world.signed_in("admin")
    assert admin_client.get("/admin/governance/grant/").status_code == 200
    assert admin_client.get("/admin/governance/auditevent/").status_code == 404
    assert b"auditevent" not in admin_client.get("/admin/").content


def test_a_refused_request_is_logged_in_one_line_and_a_server_error_with_its_traceback() -> None:
    """The console handler's filter (settings.LOGGING): Django logs a 403 with the
    PermissionDenied traceback, a screenful per refusal that buries real errors."""
    import logging
    import sys

    from django.conf import settings

    from governance.logs import NoClientErrorTracebacks

    assert settings.LOGGING["handlers"]["console"]["filters"] == ["no_4xx_tracebacks"]
    try:
        raise PermissionError("no")
    except PermissionError:
        info = sys.exc_info()
    refused = logging.LogRecord("django.request", logging.WARNING, "x", 1, "Forbidden", (), info)
    refused.status_code = 403
    failed = logging.LogRecord("django.request", logging.ERROR, "x", 1, "Error", (), info)
    failed.status_code = 500
    keep = NoClientErrorTracebacks()
    assert keep.filter(refused) and refused.exc_info is None
    assert keep.filter(failed) and failed.exc_info is info


@pytest.mark.django_db
def test_an_argument_name_that_looks_like_another_is_shown_escaped_with_a_warning() -> None:
    """`{"path": "/srv/prod", "pаth": "/tmp/cache"}` with a Cyrillic а: the API refuses
    a key given twice, but this is two keys, and the approval page showed them as
    `path` twice, the harmless value last (where "last one wins" would put it), while
    the tool reads `path`. The look-alike is shown escaped, under a warning."""
    import json

    from django.utils import timezone
    from rest_framework.test import APIClient

    from governance.audit import Actor, arguments_digest
    from governance.models import Approval
    from governance.services import agents

    world = ui_world.build()
    _, token = agents.token_issue(
        created_by=world.alice, agent=world.agent, actor=Actor.system("t"), at=timezone.now()
    )
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    raw = (
        '{"tool":"repo","action":"delete","scope":"repo:acme/tmp/cache",'
        '"arguments":{"path":"/srv/prod","p\\u0430th":"/tmp/cache"}}'
    )
    answer = api.post("/api/v1/authorize", raw, content_type="application/json").json()
    assert answer["decision"] == "approval_required"
    approval = Approval.objects.get(pk=answer["approval"])
    assert approval.arguments_hash == arguments_digest(json.loads(raw)["arguments"])
    event = AuditEvent.objects.get(uid=answer["decision_id"])
    assert (event.event_type, event.reason) == ("access.approval_required", "approval_required")

    page = ui_world.signed_in("approver").get("/ui/inbox/approvals/").content.decode()
    card = page.split(f'id="ap-{approval.pk}"', 1)[1].split("</section>", 1)[0]
    shown = card.split("<tr><th>Arguments (masked)</th>", 1)[1].split("</tr>", 1)[0]
    assert "p\\\\u0430th" in shown and "p\u0430th" not in shown
    assert "&#x27;path&#x27;: &#x27;/srv/prod&#x27;" in shown
    assert 'class="warn-box lookalike-keys">1 argument name below uses' in shown


@pytest.mark.django_db
def test_what_an_agent_asked_for_is_shown_with_its_bidi_controls_revealed() -> None:
    """An agent asked for a tool named `\\u202eliame`: denied, and shown raw on the
    audit pages, where the override turned the row around to read as a call to a tool
    named "email". The agent's own text (agent, task, tool, scope) is revealed."""
    from django.utils import timezone
    from rest_framework.test import APIClient

    from governance.audit import Actor
    from governance.services import agents

    world = ui_world.build()
    _, token = agents.token_issue(
        created_by=world.alice, agent=world.agent, actor=Actor.system("t"), at=timezone.now()
    )
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    body = {"tool": "\u202eliame", "action": "read", "scope": "repo:acme/x"}
    answer = api.post("/api/v1/authorize", body, format="json").json()
    assert (answer["decision"], answer["reason"]) == ("deny", "unknown_tool")
    event = AuditEvent.objects.get(uid=answer["decision_id"])
    assert event.tool == "\u202eliame"
    auditor = ui_world.signed_in("auditor")
    for page in (f"/ui/audit/{event.seq}/", f"/ui/explain/{event.uid}/", "/ui/audit/"):
        html = auditor.get(page).content.decode()
        assert "\u202e" not in html, page
        assert "[U+202E bidi]" in html, page


# Agent text that turns a line around: a right-to-left override, markup, a zero-width space.
HOSTILE = '"<zq1>\u202egnp.exe\u200b'


def _seed_hostile_agent_text(world: ui_world.World) -> dict[str, str]:
    """HOSTILE through every door an agent (or its runner, or a third-party tool's
    metadata) writes text by: what each call left, by name, for the checks below."""
    import uuid

    from django.utils import timezone
    from rest_framework.test import APIClient

    from governance.audit import Actor
    from governance.models import Approval, SandboxRun
    from governance.services import agents, tools

    now = timezone.now()
    ui_world.make_run(world)  # code-exec, with a sandbox:* grant allowing 127.0.0.1:8443
    tools.tool_register(
        name="helper", kind="api", actions=["read"], description=f"Helps. {HOSTILE}",
        third_party=True, actor=Actor.system("t"), at=now,
    )  # fmt: skip
    _, token = agents.token_issue(
        created_by=world.alice, agent=world.agent, actor=Actor.system("t"), at=now
    )
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")

    def call(path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = api.post(f"/api/v1/{path}", body, format="json")
        assert response.status_code in (200, 201), (path, response.content)
        return response.json()

    args = {HOSTILE: HOSTILE, "k": HOSTILE}
    unknown = call("authorize", {"tool": HOSTILE, "action": "read", "scope": HOSTILE,
                                 "task": HOSTILE, "arguments": args})  # fmt: skip
    allowed = call("authorize", {"tool": "repo", "action": "read", "scope": "repo:acme/x",
                                 "arguments": args})  # fmt: skip
    assert allowed["decision"] == "allow"
    call(f"decisions/{allowed['decision_id']}/outcome",
         {"outcome": "failed", "excerpt": HOSTILE})  # fmt: skip
    asked = call("authorize", {"tool": "repo", "action": "delete", "scope": "repo:acme/y",
                               "arguments": args})  # fmt: skip
    assert asked["decision"] == "approval_required"
    assert Approval.objects.get(pk=asked["approval"]).arguments_preview[HOSTILE] == HOSTILE
    request = call("grant-requests", {"tool": "repo", "actions": ["read"],
                                      "scope": "repo:acme/zz/*", "duration_seconds": 3600,
                                      "justification": HOSTILE})  # fmt: skip

    def run(**body: Any) -> dict[str, Any]:
        base = {"run_id": str(uuid.uuid4()), "backend": "docker", "tool": "code-exec",
                "image": "alpine:" + HOSTILE, "image_id": ui_world.IMAGE_ID,
                "command": ["python", HOSTILE]}  # fmt: skip
        return {**call("sandbox/runs", {**base, **body}), "run_id": base["run_id"]}

    unknown_run = run(tool=HOSTILE, task=HOSTILE, egress=[HOSTILE])
    assert unknown_run["reason"] == "unknown_tool"
    unresolved = run(image_id="", image_problem=HOSTILE)
    assert unresolved["reason"] == "image_unresolved"
    allowed_run = run(egress=["127.0.0.1:8443"])
    assert allowed_run["decision"] == "allow", allowed_run
    decision = {"decision_id": allowed_run["decision_id"]}
    call(f"sandbox/runs/{allowed_run['run_id']}/started",
         {**decision, "container_id": HOSTILE, "image_digest": ui_world.IMAGE_ID,
          "deadline": now.timestamp() + 60, "enforcement": {"memory": HOSTILE}})  # fmt: skip
    call(f"sandbox/runs/{allowed_run['run_id']}/egress",
         {**decision, "reason": "not_allowlisted", "host": HOSTILE, "port": 80})  # fmt: skip
    stream = {"excerpt": HOSTILE, "sha256": "ab" * 32, "bytes": 4096, "truncated": True}
    call(f"sandbox/runs/{allowed_run['run_id']}/finished",
         {**decision, "exit_code": 1, "timed_out": False, "oom_killed": False,
          "stdout": stream, "stderr": stream, "error": HOSTILE})  # fmt: skip
    assert SandboxRun.objects.get(run_id=allowed_run["run_id"]).error == HOSTILE
    return {
        "unknown": unknown["decision_id"],
        "request": str(request["id"]),
        "approval": asked["approval"],
        "unknown_run": unknown_run["run_id"],
        "unresolved_run": unresolved["run_id"],
        "allowed_run": allowed_run["run_id"],
    }


def _positions(text: str, char: str) -> list[int]:
    return [at for at, ch in enumerate(text) if ch == char]


@dataclass
class _Page:
    status: int
    html: str  # empty for anything else (a file, a redirect)
    body: bytes


def _crawl(client: Client, start: list[str], limit: int = 3000) -> dict[str, _Page]:
    """Every page reachable from `start` by the links on the pages, by URL. Not
    sign-out, not the admin's filter and sort variants (the same rows again)."""
    import html
    import re

    seen: dict[str, _Page] = {}
    queue = list(start)
    while queue:
        url = queue.pop(0)
        if url in seen:
            continue
        assert len(seen) < limit, "the crawl keeps finding pages: is a link growing?"
        response = client.get(url)
        body = b"".join(response.streaming_content) if response.streaming else response.content
        text = body.decode() if "html" in response.get("Content-Type", "") else ""
        seen[url] = _Page(response.status_code, text, body)
        for href in re.findall(r'href="([^"#]*)', text):
            target = urljoin(url, html.unescape(href))
            parts = urlsplit(target)
            if parts.netloc or not parts.path.startswith(("/ui/", "/admin/")):
                continue
            if parts.path.endswith(("/logout/", "/password_change/")):
                continue
            if parts.path.startswith("/admin/") and parts.query:
                continue
            queue.append(target)
    return seen


@pytest.mark.django_db
def test_no_page_shows_agent_text_with_its_bidi_controls_raw() -> None:
    """Agent text went through `revealed` on some pages only: an event's task, a run's
    task, tool, image, egress, container, error and the refusal quoting the runner's
    reason were printed raw (the U+202E turning the rest of the cell around), the
    what-if form took an event's scope into its box, and the admin site showed a grant
    request's justification, a call's arguments and a tool's description raw. Every UI
    and admin page a signed-in admin can reach is read here (and every UI page a GET
    answers must be one of them), and no page may hold a bidi control raw."""
    from django.urls import resolve, reverse

    from governance.web import urls as ui_urls

    world = ui_world.build()
    ui_world.build_lifecycle(world)
    made = _seed_hostile_agent_text(world)
    dave = User.objects.get(username=ui_world.ROLE_USERS["admin"])
    dave.is_staff = True
    dave.save()
    admin = ui_world.signed_in("admin")
    # Besides the links: the pages a form's GET reaches.
    period = "start=2000-01-01T00:00&end=2100-01-01T00:00"
    forms = [
        "/ui/login/",
        "/ui/exports/access?format=json",
        f"/ui/exports/decisions?format=json&{period}",
    ]
    pages = _crawl(admin, ["/ui/", "/admin/", *forms])
    assert not [url for url, page in pages.items() if page.status >= 500]

    raw = []
    for url, page in pages.items():
        raw += [(url, page.html[max(0, at - 80) : at]) for at in _positions(page.html, "\u202e")]
    assert not raw, "\n".join(f"{url}: …{before!r}" for url, before in raw)

    # The admin site shows each text field through reveal, and still no token's digest.
    from governance.models import AgentToken

    digests = list(AgentToken.objects.values_list("digest", flat=True))
    assert any(url.startswith("/admin/governance/agenttoken/") for url in pages)
    assert not [url for url, page in pages.items() if any(d.encode() in page.body for d in digests)]

    # The crawl read what was seeded, each shown as a code point.
    grant_id = made["request"]
    tool_id = Tool.objects.get(name="helper").pk
    seq = AuditEvent.objects.get(uid=made["unknown"]).seq
    for url in (
        f"/ui/audit/{seq}/",
        f"/ui/explain/{made['unknown']}/",
        "/ui/runs/",
        f"/ui/runs/{made['unknown_run']}/",
        f"/ui/runs/{made['unresolved_run']}/",
        f"/ui/runs/{made['allowed_run']}/",
        "/ui/inbox/requests/",
        "/ui/tools/helper/",
        f"/admin/governance/grant/{grant_id}/change/",
        f"/admin/governance/tool/{tool_id}/change/",
        f"/admin/governance/approval/{made['approval']}/change/",
    ):
        assert url in pages, f"the crawl never reached {url}"
        assert pages[url].status == 200, url
        assert "[U+202E bidi]" in pages[url].html, url
    # The explain page's "ask again" link carries the agent's scope to the what-if form.
    asked_again = [url for url in pages if url.startswith("/ui/what-if/?") and "scope=%22" in url]
    assert asked_again
    for url in asked_again:
        assert 'class="warn-box hidden-input"' in pages[url].html, url

    # Every UI page that answers a GET was crawled: a new page must be linked from one.
    visited = {resolve(urlsplit(url).path).url_name for url in pages}
    missing = []
    for pattern in ui_urls.urlpatterns:
        if pattern.name in visited:
            continue
        sample = reverse(
            f"ui:{pattern.name}", kwargs=dict.fromkeys(pattern.pattern.converters, "1")
        )
        if admin.get(sample).status_code != 405:  # not a form's target (POST only)
            missing.append(pattern.name)
    assert not missing, f"UI pages the crawl never reached (link or seed them): {missing}"
