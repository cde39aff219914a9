"""Break-glass and reviews in the web UI: through the lifecycle services, each
change with its audit event; the banner on every page while any is active."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.conf import settings
from django.contrib.auth.models import Group
from django.utils import timezone

from governance import roles, tasks
from governance.audit import Actor
from governance.models import Agent, AuditEvent, BreakGlass, Grant, ReviewCampaign, ReviewItem
from governance.services import access, agents, grants
from tests import ui_world
from tests.conftest import last_event

pytestmark = pytest.mark.django_db

PAGES = (
    "/ui/",
    "/ui/matrix/",
    "/ui/inbox/requests/",
    "/ui/inbox/approvals/",
    "/ui/agents/",
    "/ui/agents/bot-a/",
    "/ui/tools/",
    "/ui/audit/",
    "/ui/what-if/",
    "/ui/exports/",
    "/ui/reports/print",
    "/ui/reviews/",
    "/ui/reviews/mine/",
    "/ui/break-glass/",
)


def _open(client: object, **overrides: str) -> object:
    body = {
        "agent": "bot-a",
        "tool": "repo",
        "actions": ["read", "update"],
        "scope": "repo:acme/hot/*",
        "ticket": "INC-77",
        "reason": "database on fire",
        "ttl_minutes": "30",
        **overrides,
    }
    return ui_world.post(client, "/ui/break-glass/open", body)


def test_break_glass_opens_a_live_grant_and_the_banner_is_on_every_page() -> None:
    ui_world.build()
    client = ui_world.signed_in("approver")
    for path in PAGES:
        assert b"break-glass-banner" not in client.get(path).content, path
    assert _open(client).status_code == 302
    bg = BreakGlass.objects.get()
    assert bg.opened_by.username == "bob" and bg.ticket == "INC-77"
    assert bg.expires_at - bg.opened_at == timedelta(minutes=30)
    assert AuditEvent.objects.filter(event_type="breakglass.opened", grant_id=bg.grant_id).exists()
    decision = access.access_check(
        agent="bot-a", tool="repo", action="update", scope="repo:acme/hot/x", at=timezone.now()
    )
    assert decision.decision == "allow" and decision.break_glass
    assert last_event().break_glass
    # Every page, for every role.
    for role in ("auditor", "approver", "admin"):
        viewer = ui_world.signed_in(role)
        for path in PAGES:
            body = viewer.get(path).content.decode()  # exports: a 403 page for approvers
            assert 'id="break-glass-banner"' in body, (role, path)
            assert "INC-77" in body and "opened by bob" in body


def test_the_ttl_picker_stops_at_the_maximum_and_a_longer_ttl_is_refused() -> None:
    ui_world.build()
    client = ui_world.signed_in("approver")
    page = client.get("/ui/break-glass/").content.decode()
    cap = int(settings.BREAKGLASS_MAX_TTL.total_seconds() // 60)
    offered = [int(v) for v in __import__("re").findall(r'option value="(\d+)"', page)]
    assert max(offered) == cap
    response = _open(client, ttl_minutes=str(cap + 1))
    assert response.status_code == 400 and b"breakglass_ttl_too_long" in response.content
    assert not BreakGlass.objects.exists()


def test_the_ttl_picker_stops_at_the_longest_grant_too(settings: object) -> None:
    """With 1-hour grants (GRANT_MAX_TTL_HOURS=1) and the break-glass defaults (60 and
    240 minutes) the picker offered 2 h and 4 h: no grant lives longer than an hour."""
    ui_world.build()
    settings.GRANT_MAX_TTL = timedelta(hours=1)  # type: ignore[attr-defined]
    client = ui_world.signed_in("approver")
    page = client.get("/ui/break-glass/").content.decode()
    offered = [int(v) for v in __import__("re").findall(r'option value="(\d+)"', page)]
    assert max(offered) == 60 and 60 in offered
    response = _open(client, ttl_minutes="61")
    assert response.status_code == 400 and b"breakglass_ttl_too_long" in response.content
    assert not BreakGlass.objects.exists()


@pytest.mark.parametrize("missing", ["ticket", "reason"])
def test_break_glass_needs_a_ticket_and_a_reason(missing: str) -> None:
    ui_world.build()
    response = _open(ui_world.signed_in("approver"), **{missing: ""})
    assert response.status_code == 400
    assert not BreakGlass.objects.exists()


def test_break_glass_closes_early_and_is_ratified_by_another_approver() -> None:
    ui_world.build()
    opener = ui_world.signed_in("approver")
    _open(opener)
    bg = BreakGlass.objects.get()
    closed = ui_world.post(opener, f"/ui/break-glass/{bg.pk}/close", {"comment": "fixed"})
    assert closed.status_code == 302
    bg.refresh_from_db()
    assert bg.closed_at is not None and bg.grant.status == Grant.Status.REVOKED
    assert last_event().event_type == "grant.revoked"
    assert b"break-glass-banner" not in opener.get("/ui/").content
    # The opener cannot ratify their own; another approver (dave) can.
    refused = ui_world.post(opener, f"/ui/break-glass/{bg.pk}/ratify", {"comment": "fine"})
    assert refused.status_code == 403 and b"self_review" in refused.content
    admin = ui_world.signed_in("admin")
    assert (
        ui_world.post(admin, f"/ui/break-glass/{bg.pk}/ratify", {"comment": ""}).status_code == 400
    )
    done = ui_world.post(admin, f"/ui/break-glass/{bg.pk}/ratify", {"comment": "was needed"})
    assert done.status_code == 302
    bg.refresh_from_db()
    assert bg.review_status == "ratified" and bg.reviewed_by.username == "dave"
    event = AuditEvent.objects.filter(event_type="breakglass.ratified").get()
    assert event.actor == "user:dave"
    page = admin.get("/ui/break-glass/").content.decode()
    assert "ratified by dave: was needed" in page


def test_an_opener_who_is_now_an_auditor_sees_no_close_button_and_cannot_close() -> None:
    """Auditors are read-only, even for a break-glass they opened as an approver."""
    world = ui_world.build()
    bob = world.users["approver"]
    opener = ui_world.signed_in("approver")
    _open(opener)
    bg = BreakGlass.objects.get()
    bob.groups.clear()
    bob.groups.add(Group.objects.get_or_create(name=roles.AUDITORS)[0])
    assert b"Close early" not in opener.get("/ui/break-glass/").content
    before = AuditEvent.objects.count()
    refused = ui_world.post(opener, f"/ui/break-glass/{bg.pk}/close", {"comment": "done"})
    assert refused.status_code == 403
    bg.refresh_from_db()
    assert bg.closed_at is None and bg.grant.status == Grant.Status.ACTIVE
    assert AuditEvent.objects.count() == before
    assert b"Close early" in ui_world.signed_in("admin").get("/ui/break-glass/").content


def test_a_break_glass_whose_opener_is_deactivated_is_not_shown_active() -> None:
    """The banner (and authorize()) treat it as ended; the list still showed it active,
    with its time left and a Close early form."""
    world = ui_world.build()
    extra = ui_world.build_lifecycle(world)
    client = ui_world.signed_in("approver")

    def row() -> str:
        page = client.get("/ui/break-glass/").content.decode()
        return page.split(f'id="bg-{extra.breakglass_id}"')[1].split("</tr>")[0]

    assert 'class="bg-active"' in row()
    opener = BreakGlass.objects.get(pk=extra.breakglass_id).opened_by
    opener.is_active = False
    opener.save()
    assert 'class="bg-active"' not in row()
    assert "break-glass-banner" not in client.get("/ui/").content.decode()


def test_an_overdue_ratification_shows_on_the_list_and_the_dashboard() -> None:
    world = ui_world.build()
    extra = ui_world.build_lifecycle(world)
    BreakGlass.objects.filter(pk=extra.breakglass_id).update(
        review_due_at=timezone.now() - timedelta(minutes=1)
    )
    client = ui_world.signed_in("approver")
    assert "OVERDUE" in client.get("/ui/break-glass/").content.decode()
    dashboard = client.get("/ui/").content.decode()
    assert "Overdue ratifications" in dashboard and "INC-1" in dashboard


def _open_25_hours_ago(
    world: ui_world.World, ticket: str = "INC-25", agent: Agent | None = None
) -> BreakGlass:
    """The reproduction: break-glass for 30 minutes, then 25 hours on, the scheduled
    jobs run. The elevation has ended; its review is an hour overdue. On the mailer, so
    build_lifecycle's break-glass on repo may still be opened beside it."""
    from governance.services import breakglass

    dave = world.users["admin"]
    bg = breakglass.breakglass_open(
        opener=dave, agent=agent or world.agent, tool=world.gate_tool, actions=["execute"],
        scope="mail:customers/*", ticket=ticket, reason="outage",
        ttl=timedelta(minutes=30), actor=Actor.user(dave),
        at=timezone.now() - timedelta(hours=25),
    )  # fmt: skip
    tasks.expire_due()
    tasks.breakglass_overdue()
    assert BreakGlass.objects.get(pk=bg.pk).overdue_at is not None
    return bg


# Pages that carried no overdue ratification, and the 403 and 404 pages.
EVERY_KIND_OF_PAGE = (*PAGES, "/ui/tasks/", "/ui/runs/", "/ui/grants/99999/", "/ui/nowhere")


def test_an_overdue_ratification_is_in_a_banner_on_every_page_until_it_is_ratified() -> None:
    world = ui_world.build()
    bg = _open_25_hours_ago(world)
    for role in ("auditor", "approver", "admin"):
        viewer = ui_world.signed_in(role)
        for path in EVERY_KIND_OF_PAGE:
            body = viewer.get(path).content.decode()
            assert 'id="break-glass-overdue-banner"' in body, (role, path)
            banner = body.split('id="break-glass-overdue-banner"')[1].split("</div>")[0]
            assert "INC-25" in banner and "opened by dave" in banner, (role, path)
            assert 'href="/ui/break-glass/"' in banner, (role, path)
            assert 'id="break-glass-banner"' not in body, (role, path)  # it has ended
    approver = ui_world.signed_in("approver")
    done = ui_world.post(approver, f"/ui/break-glass/{bg.pk}/ratify", {"comment": "was needed"})
    assert done.status_code == 302
    assert "break-glass-overdue-banner" not in approver.get("/ui/matrix/").content.decode()


def test_the_banners_cost_a_page_the_same_queries_for_one_overdue_review_or_three() -> None:
    """Each banner is one query on every page, however many rows it lists: what a row
    shows (agent, tool, opener) comes with it."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    world = ui_world.build()
    viewer = ui_world.signed_in("auditor")

    def queries() -> int:
        viewer.get("/ui/tools/")  # warm: the session
        with CaptureQueriesContext(connection) as captured:
            assert "break-glass-overdue-banner" in viewer.get("/ui/tools/").content.decode()
        return len(captured.captured_queries)

    _open_25_hours_ago(world, "INC-25")
    one = queries()
    for name, ticket in (("bot-b", "INC-26"), ("bot-c", "INC-27")):
        agent = agents.agent_create(
            name=name,
            owner=world.alice,
            actor=Actor.system("test"),
            at=timezone.now() - timedelta(days=2),
        )
        _open_25_hours_ago(world, ticket, agent)
    assert queries() == one
    assert "INC-27" in viewer.get("/ui/tools/").content.decode()


def test_a_review_not_yet_due_puts_no_overdue_banner_up() -> None:
    ui_world.build_lifecycle(ui_world.build())
    body = ui_world.signed_in("approver").get("/ui/matrix/").content.decode()
    assert 'id="break-glass-banner"' in body
    assert "break-glass-overdue-banner" not in body


def test_the_active_banner_is_on_the_404_and_403_pages_with_the_navigation() -> None:
    """Django's bare default pages had neither: an approver who followed a stale link
    lost sight of the incident under way."""
    ui_world.build_lifecycle(ui_world.build())
    approver = ui_world.signed_in("approver")
    for path, status in (
        ("/ui/grants/99999/", 404),
        ("/ui/agents/nope/", 404),
        ("/ui/nowhere", 404),
        ("/nowhere", 404),
        ("/ui/exports/", 403),  # an approver is not an auditor
        ("/ui/reports/print", 403),
    ):
        response = approver.get(path)
        body = response.content.decode()
        assert response.status_code == status, path
        assert 'id="break-glass-banner"' in body and "INC-1" in body, path
        assert 'href="/ui/matrix/"' in body and "bob (approver)" in body, path
    assert "This needs the export right." in approver.get("/ui/exports/").content.decode()


def test_the_admin_site_shows_the_active_and_the_overdue_banners() -> None:
    world = ui_world.build()
    _open_25_hours_ago(world)
    ui_world.build_lifecycle(world)  # INC-1, active now
    dave = world.users["admin"]
    dave.is_staff = dave.is_superuser = True  # as the admin accounts that change roles are
    dave.save()
    admin = ui_world.signed_in("admin")
    pages = ("/admin/", "/admin/auth/user/", f"/admin/auth/user/{world.alice.pk}/change/",
             "/admin/governance/agent/")  # fmt: skip
    for path in pages:
        response = admin.get(path)
        body = response.content.decode()
        assert response.status_code == 200, path
        active = body.split('id="break-glass-banner"')[1].split("</div>")[0]
        overdue = body.split('id="break-glass-overdue-banner"')[1].split("</div>")[0]
        assert "INC-1" in active and "INC-25" in overdue, path
        assert "/static/ui/banner.css" in body, path  # drawn as a banner there too


def test_a_404_shown_to_someone_without_a_role_names_no_break_glass() -> None:
    """The banners name agents, tickets and who opened them: not for someone not signed
    in, nor for an account with no role (both are refused every page, and a 404 page
    must not become the way round)."""
    world = ui_world.build()
    _open_25_hours_ago(world)
    ui_world.build_lifecycle(world)
    anonymous, no_role = ui_world.signed_in(None), ui_world.signed_in(None)
    no_role.force_login(world.alice)
    for client in (anonymous, no_role):
        for path in ("/ui/nowhere", "/nowhere", "/ui/grants/abc/"):
            response = client.get(path)
            body = response.content.decode()
            assert response.status_code == 404, path
            assert "Not found" in body, path
            for detail in ("break-glass", "INC-", "bot-a", "dave", 'href="/ui/matrix/"'):
                assert detail not in body, (path, detail)


PERSON_ON_ME = {
    "error": {"code": "permission_denied", "message": "This endpoint is for agents.", "fields": {}}
}


def test_the_api_keeps_its_json_error_bodies_for_404_and_403(human_client) -> None:
    """The UI's pages are for everything but /api/: an API client still reads
    {"error": {...}}, whatever the break-glass state."""
    from django.core.exceptions import PermissionDenied
    from django.test import RequestFactory

    from governance.api import errors

    world = ui_world.build()
    ui_world.build_lifecycle(world)
    missing = ui_world.signed_in("approver").get("/api/v1/nowhere")
    assert missing.status_code == 404 and missing["Content-Type"] == "application/json"
    assert missing.json() == {
        "error": {"code": "not_found", "message": "No such endpoint or object.", "fields": {}}
    }
    # No API route raises Django's PermissionDenied past DRF today: the handler itself,
    # for the one that someday does, answers in the shape DRF gives its own refusal.
    denied = errors.permission_denied(RequestFactory().get("/api/v1/me"), PermissionDenied("x"))
    assert denied.status_code == 403 and denied["Content-Type"] == "application/json"
    forbidden = {
        "error": {
            "code": "permission_denied",
            "message": "You do not have permission to perform this action.",
            "fields": {},
        }
    }
    assert json.loads(denied.content) == forbidden
    # An API 403 from a view: a person's token may not ask as an agent.
    as_person = human_client(world.users["approver"]).get("/api/v1/me")
    assert (as_person.status_code, as_person.json()) == (403, PERSON_ON_ME)


def test_a_review_revokes_a_grant_with_a_comment() -> None:
    world = ui_world.build()
    extra = ui_world.build_lifecycle(world)
    client = ui_world.signed_in("admin")
    mine = client.get("/ui/reviews/mine/").content.decode()
    assert f'id="item-{extra.item_id}"' in mine
    assert "Keep all" not in mine and "keep all" not in mine.replace('no "keep all"', "")
    assert "Last used" in mine and "Uses" in mine
    url = f"/ui/reviews/items/{extra.item_id}/decide"
    no_comment = ui_world.post(client, url, {"decision": "keep", "comment": ""})
    assert no_comment.status_code == 400
    assert ReviewItem.objects.get(pk=extra.item_id).status == "pending"
    done = ui_world.post(client, url, {"decision": "revoke", "comment": "not needed"})
    assert done.status_code == 302
    item = ReviewItem.objects.get(pk=extra.item_id)
    assert item.status == "revoked" and item.comment == "not needed"
    world.grant.refresh_from_db()
    assert world.grant.status == "revoked"
    event = AuditEvent.objects.filter(event_type="review.item_decided").get()
    assert event.grant_id == world.grant.pk and event.actor == "user:dave"
    decision = access.access_check(
        agent="bot-a", tool="repo", action="read", scope="repo:acme/api", at=timezone.now()
    )
    assert decision.decision == "deny"
    campaigns = client.get("/ui/reviews/").content.decode()
    # progress: one of the four decided (the three live grants and the live break-glass one)
    assert "1/4" in campaigns


def test_an_admin_opens_a_campaign_on_demand_for_one_agent() -> None:
    world = ui_world.build()
    client = ui_world.signed_in("admin")
    page = client.get("/ui/reviews/").content.decode()
    assert 'action="/ui/reviews/open"' in page
    assert (
        'action="/ui/reviews/open"'
        not in ui_world.signed_in("approver").get("/ui/reviews/").content.decode()
    )  # approvers review; admins open campaigns
    no_reason = ui_world.post(client, "/ui/reviews/open", {"reason": " "})
    assert no_reason.status_code == 400
    unknown = ui_world.post(client, "/ui/reviews/open", {"reason": "x", "agent": "nobody"})
    assert unknown.status_code == 400 and b"unknown_agent" in unknown.content
    assert not ReviewCampaign.objects.exists()

    before = last_event().seq
    done = ui_world.post(
        client, "/ui/reviews/open", {"reason": "team change", "agent": "bot-a", "due_days": "3"}
    )
    campaign = ReviewCampaign.objects.get()
    assert done.status_code == 302 and done["Location"] == f"/ui/reviews/{campaign.pk}/"
    assert (campaign.kind, campaign.reason, campaign.agent.name) == (
        "on_demand", "team change", "bot-a",
    )  # fmt: skip
    assert campaign.opened_by.username == "dave"
    assert timedelta(days=3) - timedelta(minutes=1) < campaign.due_at - campaign.opened_at
    live = Grant.objects.filter(agent__name="bot-a", status="active")
    items = ReviewItem.objects.filter(campaign=campaign)
    assert {i.grant_id for i in items} <= set(live.values_list("pk", flat=True))
    assert items.filter(grant=world.grant).exists()
    opened = AuditEvent.objects.filter(seq__gt=before, event_type="review.campaign_opened").get()
    assert opened.actor == "user:dave"


def test_an_item_whose_reviewer_left_is_listed_for_the_admins_to_decide() -> None:
    """An item whose reviewer lost the approver role falls to the admins (they are told
    so), but no page listed it for them: nobody decided it and the default rule revoked
    the grant at the due date. It is among each admin's items, with its form."""
    ui_world.build()
    erin = ui_world.user("erin", "approver")
    dave = ui_world.signed_in("admin")
    opened = ui_world.post(dave, "/ui/reviews/open", {"reason": "team change", "agent": "bot-a"})
    assert opened.status_code == 302
    item = ReviewItem.objects.filter(reviewer=erin).first()
    assert item is not None
    form = f'action="/ui/reviews/items/{item.pk}/decide"'
    assert form not in dave.get("/ui/reviews/mine/").content.decode()  # erin's to decide
    erin.groups.remove(Group.objects.get(name=roles.APPROVERS))
    assert form in dave.get("/ui/reviews/mine/").content.decode()
    grant = item.grant
    done = ui_world.post(dave, f"/ui/reviews/items/{item.pk}/decide", {
        "decision": "keep", "comment": "still needed", "actions_listed": "1",
        "actions": list(grant.actions), "scope": grant.scope,
    })  # fmt: skip
    item.refresh_from_db()
    assert done.status_code == 302 and (item.status, item.decided_by.username) == ("kept", "dave")
    assert last_event().event_type == "review.item_decided" and last_event().actor == "user:dave"
    assert form not in dave.get("/ui/reviews/mine/").content.decode()


def test_a_review_narrows_a_grant_and_never_widens_it() -> None:
    world = ui_world.build()
    extra = ui_world.build_lifecycle(world)
    client = ui_world.signed_in("admin")
    url = f"/ui/reviews/items/{extra.item_id}/decide"
    wider = ui_world.post(client, url, {"decision": "narrow", "comment": "x", "scope": "repo:*"})
    assert wider.status_code in (400, 403)
    narrowed = ui_world.post(
        client,
        url,
        {"decision": "narrow", "comment": "read only", "actions_listed": "1", "actions": ["read"]},
    )
    assert narrowed.status_code == 302
    world.grant.refresh_from_db()
    assert world.grant.actions == ["read"] and world.grant.status == "active"
    assert AuditEvent.objects.filter(event_type="grant.narrowed", grant_id=world.grant.pk).exists()


DELEGABLE_YES = (
    "yes</span> — the agent may hand this grant, narrowed, to its subagents without asking anyone"
)


def test_a_review_shows_a_delegable_grant_and_switching_it_off_ends_its_delegations() -> None:
    """The review item and the second look said nothing of a grant being delegable, and
    a review could not take it away: the agent went on handing it to its subagents.
    Now both cards say so, and a narrow with the box unticked stops it and revokes what
    was handed down (as a narrowing revokes delegations that no longer fit)."""
    world = ui_world.build()
    extra = ui_world.build_lifecycle(world)
    child = grants.grant_delegate(
        parent_grant_id=world.grant.pk, child=Agent.objects.get(name="bot-a.sub"),
        actions=["read"], scope="repo:acme/api/*", justification="sub reads the api",
        expires_at=world.grant.expires_at, actor=Actor.system("test"), at=timezone.now(),
    )  # fmt: skip
    client = ui_world.signed_in("admin")
    mine = client.get("/ui/reviews/mine/").content.decode()
    card = mine.split(f'id="item-{extra.item_id}"', 1)[1].split("</section>", 1)[0]
    assert "<th>Delegable</th>" in card and DELEGABLE_YES in card
    assert '<input type="checkbox" name="delegable" value="1" checked>' in card
    looks = client.get("/ui/inbox/second-look/").content.decode()
    look = looks.split(f'id="look-{extra.second_look_id}"', 1)[1].split("</section>", 1)[0]
    assert DELEGABLE_YES in look

    url = f"/ui/reviews/items/{extra.item_id}/decide"
    as_is = {"actions_listed": "1", "actions": ["read", "delete"], "scope": "repo:acme/*"}
    done = ui_world.post(
        client, url,
        {"decision": "narrow", "comment": "no subagents", "delegable_listed": "1", **as_is},
    )  # fmt: skip
    assert done.status_code == 302
    world.grant.refresh_from_db()
    assert (world.grant.status, world.grant.delegable, world.grant.actions) == (
        "active", False, ["read", "delete"],
    )  # fmt: skip
    child.refresh_from_db()
    assert (child.status, child.revoked_by.username) == ("revoked", "dave")
    assert ReviewItem.objects.get(pk=extra.item_id).status == "narrowed"
    revoked, narrowed, decided = AuditEvent.objects.order_by("-seq")[:3][::-1]
    assert (revoked.event_type, revoked.grant_id, revoked.actor) == (
        "grant.revoked", child.pk, "user:dave",
    )  # fmt: skip
    assert "may no longer be delegated" in revoked.data
    assert (narrowed.event_type, narrowed.grant_id) == ("grant.narrowed", world.grant.pk)
    data = json.loads(narrowed.data)
    assert (data["before"]["delegable"], data["delegable"]) == (True, False)
    assert (decided.event_type, decided.actor) == ("review.item_decided", "user:dave")
    page = client.get(f"/ui/grants/{world.grant.pk}/").content.decode()
    assert "<th>Delegable</th><td>no</td>" in page


def test_a_review_never_makes_a_grant_delegable() -> None:
    """The mailer grant was not approved delegable: a narrow that ticks the (disabled)
    box is refused, and nothing is written."""
    world = ui_world.build()
    ui_world.build_lifecycle(world)
    item = ReviewItem.objects.get(grant__tool=world.gate_tool)
    client = ui_world.signed_in("admin")
    card = client.get("/ui/reviews/mine/").content.decode().split(f'id="item-{item.pk}"', 1)[1]
    assert "<th>Delegable</th><td>no</td>" in card.split("</section>", 1)[0]
    before = AuditEvent.objects.count()
    refused = ui_world.post(client, f"/ui/reviews/items/{item.pk}/decide", {
        "decision": "narrow", "comment": "hand it on", "delegable_listed": "1", "delegable": "1",
    })  # fmt: skip
    assert refused.status_code == 403 and b"wider_delegation" in refused.content
    assert Grant.objects.get(pk=item.grant_id).delegable is False
    assert ReviewItem.objects.get(pk=item.pk).status == "pending"
    assert AuditEvent.objects.count() == before


def test_a_keep_with_the_narrowing_fields_changed_is_refused_not_read_as_keep_all() -> None:
    """The page ticks only `read` for a narrow_to_read proposal; a reviewer who left the
    decision on keep kept every action without a word, the unticked ones included (the
    view dropped the fields; the service and the API refuse them). Now the page proposes
    narrow for such an item, and a keep with changed fields is a 400, nothing written."""
    from governance.models import ReviewItem

    world = ui_world.build()
    extra = ui_world.build_lifecycle(world)
    client = ui_world.signed_in("admin")
    url = f"/ui/reviews/items/{extra.item_id}/decide"
    ReviewItem.objects.filter(pk=extra.item_id).update(proposal="narrow_to_read")
    page = client.get("/ui/reviews/mine/").content.decode()
    form = page.split(f'action="{url}"')[1].split("</form>")[0]
    assert '<option value="narrow" selected>narrow</option>' in form
    before = (list(world.grant.actions), AuditEvent.objects.count())
    only_read = {"actions_listed": "1", "actions": ["read"]}
    kept = ui_world.post(client, url, {"decision": "keep", "comment": "ok", **only_read})
    assert kept.status_code == 400 and b"invalid_decision" in kept.content
    world.grant.refresh_from_db()
    assert (list(world.grant.actions), AuditEvent.objects.count()) == before
    assert ReviewItem.objects.get(pk=extra.item_id).status == "pending"
    # Revoking ends everything: the fields are moot, and it goes through.
    revoked = ui_world.post(client, url, {"decision": "revoke", "comment": "gone", **only_read})
    assert revoked.status_code == 302
    world.grant.refresh_from_db()
    assert world.grant.status == "revoked"


def test_the_pages_say_which_rights_went_unused_and_propose_dropping_them(settings) -> None:
    """bot-a reads through its read+delete grant and never deletes: the dashboard, the
    review item, the campaign and the grant page name delete as the idle right, and the
    review form proposes narrowing with read ticked, delete not."""
    settings.UNUSED_GRANT_HOURS = 1
    world = ui_world.build()
    Grant.objects.filter(pk=world.grant.pk).update(starts_at=timezone.now() - timedelta(hours=3))
    extra = ui_world.build_lifecycle(world)
    item = ReviewItem.objects.get(pk=extra.item_id)
    assert (item.proposal, item.idle_actions) == ("narrow_to_read", ["delete"])
    client = ui_world.signed_in("admin")
    dashboard = client.get("/ui/").content.decode().split("Unused grants", 1)[1]
    row = dashboard.split(f'href="/ui/grants/{world.grant.pk}/"', 1)[1].split("</tr>", 1)[0]
    assert '<td class="idle-actions">delete</td>' in row
    assert "<td>narrow_to_read (keep read)</td>" in row
    mine = client.get("/ui/reviews/mine/").content.decode()
    card = mine.split(f'id="item-{item.pk}"', 1)[1].split("</section>", 1)[0]
    assert "narrow_to_read (unused: delete)" in card
    assert '<option value="narrow" selected>narrow</option>' in card
    assert 'value="read" checked> read' in card and 'value="delete"> delete' in card
    campaign = client.get(f"/ui/reviews/{extra.campaign_id}/").content.decode()
    assert "narrow_to_read <small>(idle: delete)</small>" in campaign
    grant = client.get(f"/ui/grants/{world.grant.pk}/").content.decode()
    assert '<span class="act">delete</span> 0 (never used)' in grant
    assert '<span class="act">read</span> 1, last ' in grant


def test_a_second_look_is_confirmed_or_flagged_by_another_approver_with_a_comment() -> None:
    from governance.models import SecondLook

    world = ui_world.build()
    extra = ui_world.build_lifecycle(world)
    admin = ui_world.signed_in("admin")
    inbox = admin.get("/ui/inbox/second-look/").content.decode()
    assert f'id="look-{extra.second_look_id}"' in inbox and "bob" in inbox
    url = f"/ui/inbox/second-look/{extra.second_look_id}/decide"
    assert ui_world.post(admin, url, {"verdict": "flag", "comment": ""}).status_code == 400
    done = ui_world.post(admin, url, {"verdict": "flag", "comment": "scope too wide"})
    assert done.status_code == 302
    look = SecondLook.objects.get(pk=extra.second_look_id)
    assert look.status == "flagged" and look.decided_by.username == "dave"
    event = last_event()
    assert event.event_type == "second_look.decided" and event.actor == "user:dave"
    again = ui_world.post(admin, url, {"verdict": "confirm", "comment": "again"})
    assert again.status_code == 409


def test_the_access_report_names_who_reviewed_each_grant() -> None:
    import csv
    import io

    world = ui_world.build()
    extra = ui_world.build_lifecycle(world)
    admin = ui_world.signed_in("admin")
    url = f"/ui/reviews/items/{extra.item_id}/decide"
    assert ui_world.post(admin, url, {"decision": "keep", "comment": "needed"}).status_code == 302
    text = ui_world.signed_in("auditor").get("/ui/exports/access?format=csv").content.decode()
    rows = {int(r["grant"]): r for r in csv.DictReader(io.StringIO(text))}
    assert rows[world.grant.pk]["reviews"].startswith("kept by dave ")
    assert rows[world.grant.pk]["approver"] == "bob"
    body = ui_world.signed_in("auditor").get("/ui/reports/print").content.decode()
    assert "kept by dave" in body


@pytest.mark.parametrize(
    ("url", "body", "code"),
    [
        ("/ui/break-glass/open", {"tool": "no-such-tool"}, b"unknown_tool"),
        ("/ui/break-glass/open", {"agent": "nobody"}, b"unknown_agent"),
        ("/ui/break-glass/open", {"task": "NO-SUCH-1"}, b"unknown_task"),
        ("/ui/inbox/approvals/policies/new", {"agent": "nobody"}, b"unknown_agent"),
        ("/ui/inbox/approvals/policies/new", {"task": "NO-SUCH-1"}, b"unknown_task"),
    ],
)
def test_a_form_naming_something_that_does_not_exist_is_a_400_that_says_what(url, body, code):
    """A well-formed form naming an unknown agent, tool or task is the person's mistake:
    a 400 with its code and sentence (was Django's bare 404 page); nothing written."""
    ui_world.build()
    client = ui_world.signed_in("approver")
    before = last_event().seq
    if url.endswith("/open"):
        response = _open(client, **body)
    else:
        policy = {"agent": "bot-a", "tool": "repo", "action": "delete", "verdict": "approve"}
        policy |= {"scope": "repo:acme/tmp/*", "reason": "x", "hours": "1"}
        response = ui_world.post(client, url, {**policy, **body})
    assert response.status_code == 400 and code in response.content
    assert last_event().seq == before


def test_a_failure_no_view_handled_is_a_page_that_says_what_to_do(monkeypatch) -> None:
    """A database fault inside a UI page was Django's bare "Server Error (500)": no
    navigation, no word on whether the change was made. The 500 page is drawn without
    the request's context (the banners ask the database, which may be what failed);
    under /api/ it is the API's error shape."""
    from django.db import OperationalError
    from django.test import RequestFactory

    from governance.api import errors
    from governance.web import queries

    ui_world.build()
    approver = ui_world.signed_in("approver")
    approver.raise_request_exception = False

    def down(*args, **kwargs):
        raise OperationalError("the database is down")

    monkeypatch.setattr(queries, "matrix", down)
    response = approver.get("/ui/matrix/")
    body = response.content.decode()
    assert response.status_code == 500
    assert "Something failed inside the service" in body and "reload the page" in body
    assert "Traceback" not in body and "OperationalError" not in body
    api = errors.server_error(RequestFactory().get("/api/v1/me"))
    assert api.status_code == 500 and json.loads(api.content)["error"]["code"] == "internal_error"
