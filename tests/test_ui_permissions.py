"""Who may do what in the web UI: every page and action x every role, as one table.

Columns: anonymous, auditor (carol), approver (bob), admin (dave). Every POST
carries a real CSRF token from a client that enforces CSRF
(Client(enforce_csrf_checks=True)), so a 403 here is the role check, not a
missing token; test_a_post_without_a_csrf_token_is_refused covers the token.
Anonymous callers are sent to the sign-in page (302) whatever the method.
Each case runs on a fresh world. test_the_table_covers_every_ui_route fails
when a route is added without a row.
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from django.urls import get_resolver
from django.utils import timezone

from governance.audit import Actor
from governance.models import (
    Agent,
    AgentToken,
    Approval,
    AuditEvent,
    BreakGlass,
    ConfirmationPolicy,
    Grant,
    ReviewItem,
    SecondLook,
    Tool,
)
from governance.services import agents, confirmation, tools
from tests import ui_world
from tests.ui_world import World

ROLES = ("anon", "auditor", "approver", "admin")
# Another tool than the world's own break-glass (one live per agent and tool); the
# world's agent, since a subagent gets no break-glass of its own.
BREAK_GLASS = {"agent": "bot-a", "tool": "mailer", "actions": ["execute"],
               "scope": "mail:acme/hot/*", "ticket": "INC-2", "reason": "db down",
               "ttl_minutes": "30"}  # fmt: skip
POLICY = {"agent": "bot-a", "tool": "repo", "action": "delete", "scope": "repo:acme/tmp/*",
          "verdict": "approve", "reason": "scratch", "hours": "1"}  # fmt: skip
LIFECYCLE = ("/ui/break-glass/", "/ui/reviews/", "/ui/inbox/second-look/")

# fmt: off
TABLE: list[tuple[str, str, Any, str]] = [
    # method path                                   body                         anon/aud/appr/admin
    ("GET",  "/ui/",                                    None,                    "302 200 200 200"),
    ("GET",  "/ui/matrix/",                             None,                    "302 200 200 200"),
    ("GET",  "/ui/matrix/?kind=api&owner=alice",        None,                    "302 200 200 200"),
    ("GET",  "/ui/matrix/cell/?agent=bot-a&tool=repo",  None,                    "302 200 200 200"),
    ("GET",  "/ui/grants/{grant}/",                     None,                    "302 200 200 200"),
    ("POST", "/ui/grants/{grant}/revoke",               {"reason": "done"},      "302 403 302 302"),
    ("GET",  "/ui/inbox/requests/",                     None,                    "302 200 200 200"),
    ("POST", "/ui/inbox/requests/{request}/approve",    {},                      "302 403 302 302"),
    ("POST", "/ui/inbox/requests/{request}/deny",       {"reason": "no"},        "302 403 302 302"),
    ("GET",  "/ui/inbox/approvals/",                    None,                    "302 200 200 200"),
    ("POST", "/ui/inbox/approvals/{approval}/approve",  {},                      "302 403 302 302"),
    ("POST", "/ui/inbox/approvals/{approval}/deny",     {"reason": "no"},        "302 403 302 302"),
    # Confirmation policies: approvers and admins write and revoke; {policy} is dave's.
    ("POST", "/ui/inbox/approvals/policies/new",        POLICY,                  "302 403 302 302"),
    ("POST", "/ui/inbox/approvals/policies/{policy}/revoke", {"reason": "done"}, "302 403 302 302"),
    ("GET",  "/ui/agents/",                             None,                    "302 200 200 200"),
    ("GET",  "/ui/agents/bot-a/",                       None,                    "302 200 200 200"),
    ("POST", "/ui/agents/bot-a/suspend",                {"reason": "incident"},  "302 403 403 302"),
    # bot-a suspended first (test_permission_table), so there is something to resume.
    ("POST", "/ui/agents/bot-a/resume",                 {"reason": "cleared"},   "302 403 403 302"),
    ("POST", "/ui/agents/bot-a/tokens",                 {"days": "7"},           "302 403 403 201"),
    ("POST", "/ui/tokens/{token}/revoke",               {},                      "302 403 403 302"),
    ("GET",  "/ui/tasks/",                              None,                    "302 200 200 200"),
    ("POST", "/ui/tasks/TICKET-9/close",                {},                      "302 403 403 302"),
    ("GET",  "/ui/tools/",                              None,                    "302 200 200 200"),
    ("GET",  "/ui/tools/repo/",                         None,                    "302 200 200 200"),
    ("POST", "/ui/tools/repo/approve",                  {},                      "302 403 403 302"),
    ("GET",  "/ui/runs/",                               None,                    "302 200 200 200"),
    ("GET",  "/ui/runs/?agent=bot-a&status=finished",   None,                    "302 200 200 200"),
    ("GET",  "/ui/runs/{run}/",                         None,                    "302 200 200 200"),
    ("GET",  "/ui/audit/",                              None,                    "302 200 200 200"),
    ("GET",  "/ui/audit/?decision=allow&agent=bot-a",   None,                    "302 200 200 200"),
    ("GET",  "/ui/audit/1/",                            None,                    "302 200 200 200"),
    ("GET",  "/ui/audit/export?format=csv",             None,                    "302 200 403 200"),
    ("POST", "/ui/audit/verify",                        {},                      "302 302 403 302"),
    ("GET",  "/ui/explain/{decision}/",                 None,                    "302 200 200 200"),
    ("GET",  "/ui/what-if/",                            None,                    "302 200 200 200"),
    ("GET",  "/ui/what-if/?agent=bot-a&tool=repo&action=read&scope=repo:acme/x",
                                                        None,                    "302 200 200 200"),
    ("GET",  "/ui/exports/",                            None,                    "302 200 403 200"),
    ("GET",  "/ui/exports/access?format=json",          None,                    "302 200 403 200"),
    ("GET",  "/ui/exports/decisions?format=csv&start=2000-01-01T00:00&end=2100-01-01T00:00",
                                                        None,                    "302 200 403 200"),
    ("GET",  "/ui/reports/print",                       None,                    "302 200 403 200"),
    # Break-glass: dave (admin) opened {bg}; bob (approver) is the other approver.
    ("GET",  "/ui/break-glass/",                        None,                    "302 200 200 200"),
    ("POST", "/ui/break-glass/open",                    BREAK_GLASS,             "302 403 302 302"),
    ("POST", "/ui/break-glass/{bg}/close",              {"comment": "over"},     "302 403 302 302"),
    # The opener does not review their own break-glass (self_review).
    ("POST", "/ui/break-glass/{bg}/ratify",             {"comment": "ok"},       "302 403 302 403"),
    ("POST", "/ui/break-glass/{bg}/confirm-closed",     {"comment": "ok"},       "302 403 302 403"),
    ("GET",  "/ui/reviews/",                            None,                    "302 200 200 200"),
    ("POST", "/ui/reviews/open",                        {"reason": "audit asked"},
                                                                                 "302 403 403 302"),
    ("GET",  "/ui/reviews/mine/",                       None,                    "302 200 200 200"),
    ("GET",  "/ui/reviews/{campaign}/",                 None,                    "302 200 200 200"),
    # The item is dave's; bob approved the grant, so he may not re-certify it.
    ("POST", "/ui/reviews/items/{item}/decide",         {"decision": "revoke", "comment": "unused"},
                                                                                 "302 403 403 302"),
    # dave's second look at bob's approval; bob may not second-look his own.
    ("GET",  "/ui/inbox/second-look/",                  None,                    "302 200 200 200"),
    ("POST", "/ui/inbox/second-look/{look}/decide",     {"verdict": "confirm", "comment": "ok"},
                                                                                 "302 403 403 302"),
    ("POST", "/ui/logout/",                             {},                      "302 302 302 302"),
    ("GET",  "/ui/login/",                              None,                    "200 302 302 302"),
]
# fmt: on


CASES = [
    pytest.param(method, path, body, role, int(expected.split()[i]), id=f"{method} {path} {role}")
    for method, path, body, expected in TABLE
    for i, role in enumerate(ROLES)
]


def _fill(
    path: str,
    world: World,
    extra: ui_world.Lifecycle | None = None,
    policy: int = 0,
    run: str = "",
) -> str:
    return path.format(
        policy=policy,
        run=run,
        bg=extra.breakglass_id if extra else 0,
        campaign=extra.campaign_id if extra else 0,
        item=extra.item_id if extra else 0,
        look=extra.second_look_id if extra else 0,
        grant=world.grant.pk,
        request=world.request.pk,
        approval=world.approval.pk,
        token=world.token_prefix,
        decision=world.decision_uid,
    )


def _state(world: World) -> tuple[Any, ...]:
    """Everything the POSTs in the table could change."""
    return (
        tuple(Grant.objects.order_by("pk").values_list("pk", "status", "scope")),
        tuple(Approval.objects.values_list("pk", "status")),
        tuple(Agent.objects.values_list("name", "status")),
        tuple(AgentToken.objects.order_by("pk").values_list("prefix", "revoked_at")),
        tuple(Tool.objects.values_list("name", "approved_hash")),
        tuple(BreakGlass.objects.order_by("pk").values_list("pk", "closed_at", "review_status")),
        tuple(ReviewItem.objects.order_by("pk").values_list("pk", "status")),
        tuple(SecondLook.objects.order_by("pk").values_list("pk", "status")),
        tuple(ConfirmationPolicy.objects.order_by("pk").values_list("pk", "revoked_at")),
    )


@pytest.mark.django_db
@pytest.mark.parametrize(("method", "path", "body", "role", "expected"), CASES)
def test_permission_table(method: str, path: str, body: Any, role: str, expected: int) -> None:
    world = ui_world.build()
    if "tools/repo/approve" in path:
        # Something to re-approve: a changed definition, recorded by the system.
        tools.tool_update_definition(
            tool=world.tool,
            description="changed",
            input_schema={},
            actor=Actor.system("sync"),
            at=timezone.now(),
        )
        world.tool.refresh_from_db()
        body = {**body, "definition_hash": world.tool.definition_hash}
    if path.endswith("/resume"):
        agents.agent_suspend(
            agent=world.agent, reason="incident", actor=Actor.system("test"), at=timezone.now()
        )
    extra = ui_world.build_lifecycle(world) if path.startswith(LIFECYCLE) else None
    policy = 0
    if "{policy}" in path:
        dave = world.users["admin"]
        policy = confirmation.policy_create(
            author=dave, agent=world.agent, tool=world.tool, action="delete",
            scope="repo:acme/tmp/*", verdict="deny", reason="freeze",
            duration=timedelta(hours=1), actor=Actor.user(dave), at=timezone.now(),
        ).pk  # fmt: skip
    run = ui_world.make_run(world) if "{run}" in path else ""
    client = ui_world.signed_in(None if role == "anon" else role)
    if path.endswith("/tokens") and role != "anon":
        body = {**body, **ui_world.token_form(client)}  # the page's one-time form id
    url = _fill(path, world, extra, policy, run)
    before = _state(world)
    events_before = AuditEvent.objects.count()
    if method == "GET":
        response = client.get(url)
    else:
        response = ui_world.post(client, url, body)
    assert response.status_code == expected, (url, role, response.content[:500])
    if method == "POST" and "logout" not in path:
        if role == "anon" or expected == 403:
            # Refused (or sent to sign in): nothing changed, nothing was recorded.
            assert _state(world) == before
            assert AuditEvent.objects.count() == events_before
            if role == "anon":
                assert response["Location"].startswith("/ui/login/")
        else:
            # Done: the change happened and wrote its event (a chain walk changes
            # nothing but is on the record).
            assert _state(world) != before or path == "/ui/audit/verify"
            assert AuditEvent.objects.count() > events_before


def test_the_table_covers_every_ui_route() -> None:
    ui = next(p for p in get_resolver().url_patterns if getattr(p, "namespace", None) == "ui")
    filled = [re.sub(r"\{\w+\}", "1", path.split("?")[0]) for _, path, _, _ in TABLE]
    missing = []
    for route in ui.url_patterns:
        pattern = re.sub(r"<(int|str|uuid|path):\w+>", "[^/]+", str(route.pattern))
        if not any(re.fullmatch("/ui/" + pattern, url) for url in filled):
            missing.append(str(route.pattern))
    assert not missing, f"UI routes without a row in TABLE: {missing}"


@pytest.mark.django_db
def test_a_post_without_a_csrf_token_is_refused() -> None:
    world = ui_world.build()
    client = ui_world.signed_in("admin")
    response = client.post(f"/ui/grants/{world.grant.pk}/revoke", {"reason": "x"})
    assert response.status_code == 403
    world.grant.refresh_from_db()
    assert world.grant.status == Grant.Status.ACTIVE
