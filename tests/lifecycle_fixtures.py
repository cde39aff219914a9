"""Fixtures for lifecycle tests: people with roles and e-mail, and a real local webhook;
and the helpers the break-glass and review tests share."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from django.contrib.auth.models import Group, User
from django.core import mail

from governance import roles
from governance.audit import Actor
from governance.models import AuditEvent, BreakGlass, Grant, Notification, ReviewCampaign
from governance.services import reviews
from tests.conftest import NOW


def breakglass_written() -> tuple[int, ...]:
    """What a break-glass call can write: its rows, events, notices and campaigns."""
    return (
        BreakGlass.objects.count(),
        Grant.objects.count(),
        AuditEvent.objects.count(),
        Notification.objects.count(),
        ReviewCampaign.objects.count(),
        len(mail.outbox),
    )


def open_campaign(at: Any = NOW, **kw: Any) -> ReviewCampaign:
    """An on-demand review campaign opened by the system."""
    kw.setdefault("kind", "on_demand")
    kw.setdefault("reason", "edges")
    return reviews.review_campaign_open(actor=Actor.system("test"), at=at, **kw)


def decide(item: Any, decision: str, *, reviewer: Any = None, at: Any = NOW,
           comment: str = "checked", **kw: Any) -> Any:  # fmt: skip
    """A review item decided by its reviewer (or `reviewer`)."""
    reviewer = reviewer or item.reviewer
    return reviews.review_item_decide(
        item_id=item.pk, reviewer=reviewer, decision=decision, comment=comment,
        actor=Actor.user(reviewer), at=at, **kw,
    )  # fmt: skip


@pytest.fixture
def person(db: None) -> Callable[..., User]:
    """A user with an e-mail address and the given role groups."""

    def make(name: str, *groups: str) -> User:
        user = User.objects.create_user(name, email=f"{name}@example.test", password="pw-123456")
        for group in groups:
            user.groups.add(Group.objects.get_or_create(name=group)[0])
        return user

    return make


BG_SCOPE = "repo:acme/api/*"
BG_REASON = "prod outage, on-call cannot reach an approver"


@pytest.fixture
def bg_world(make_agent: Any, make_tool: Any, approvers: list[User]) -> dict[str, Any]:
    """An agent and a tool for break-glass, and the approvers (erin opens by default)."""
    erin, frank, grace, heidi = approvers
    return {
        "agent": make_agent(),
        "tool": make_tool(),
        "erin": erin,
        "frank": frank,
        "grace": grace,
        "heidi": heidi,
    }


@pytest.fixture
def open_bg(bg_world: dict[str, Any]) -> Callable[..., Any]:
    """Open break-glass on bg_world's agent and tool (read + update on BG_SCOPE)."""
    from governance.audit import Actor
    from governance.services import breakglass
    from tests.conftest import NOW

    def open_(opener: Any = None, *, at: Any = NOW, ticket: str = "INC-42",
              scope: str = BG_SCOPE, **kw: Any) -> Any:  # fmt: skip
        opener = opener or bg_world["erin"]
        return breakglass.breakglass_open(
            opener=opener,
            agent=kw.pop("agent", bg_world["agent"]),
            tool=kw.pop("tool", bg_world["tool"]),
            actions=kw.pop("actions", ["read", "update"]),
            scope=scope,
            ticket=ticket,
            reason=kw.pop("reason", BG_REASON),
            actor=Actor.agent(opener.agent) if hasattr(opener, "agent") else Actor.user(opener),
            at=at,
            **kw,
        )

    return open_


@pytest.fixture
def approvers(person: Callable[..., User]) -> list[User]:
    """Three approvers (erin, frank, grace) and an admin (heidi)."""
    return [
        person("erin", roles.APPROVERS),
        person("frank", roles.APPROVERS),
        person("grace", roles.APPROVERS),
        person("heidi", roles.ADMINS),
    ]


class Webhook:
    """A real HTTP server on 127.0.0.1 that records each POST and answers with the next
    status in `script` (then 200 for ever)."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.script: list[int] = []
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                length = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(length) or b"null")
                hook.requests.append({"path": self.path, "body": body})
                status = hook.script.pop(0) if hook.script else 200
                self.send_response(status)
                self.send_header("Content-Length", "0")
                if 300 <= status < 400:
                    self.send_header("Location", "http://127.0.0.1:9/elsewhere")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook/s3cr3t-path"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def webhook(settings: Any) -> Iterator[Webhook]:
    hook = Webhook()
    settings.NOTIFY_WEBHOOK_URLS = [hook.url]
    settings.NOTIFY_WEBHOOK_FORMAT = "json"
    try:
        yield hook
    finally:
        hook.close()
