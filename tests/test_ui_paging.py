"""The pages that list what grows with the fleet show a page of it at a time, at a cost
that does not grow with it. At a customer's size (100,000 live grants over 1,000 agents
x 50 tools; review campaigns of 40,000 items) the matrix was one page of 8.8 MB drawn in
15-32 s, a campaign's page 10 MB, and a reviewer's items 7.5 MB with a form for each of
4,250. Here a few hundred rows stand in for them: more than a page, so the old pages
(every row at once) fail, and twice as many must cost the same queries."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from governance.models import Agent, AuditEvent, Grant, ReviewCampaign, ReviewItem
from tests import ui_world
from tests.conftest import last_event

pytestmark = pytest.mark.django_db

MATRIX_ROW = re.compile(r'<tr><th><a href="/ui/agents/([^/]+)/">')
CAMPAIGN_ROW = re.compile(r'<tr><td><a href="/ui/grants/(\d+)/">')
DECIDE_FORM = re.compile(r'action="/ui/reviews/items/(\d+)/decide"')
# The pages' sizes (queries.MATRIX_PAGE, lifecycle.CAMPAIGN_PAGE and MINE_PAGE).
MATRIX_PAGE, CAMPAIGN_PAGE, MINE_PAGE = 100, 100, 50


def fleet(world: ui_world.World, first: int, count: int) -> list[Grant]:
    """`count` more agents `fleet-NNNN` (no parent, owned by alice), each with a live copy
    of the world's main grant on `repo`. Written in bulk: what is under test is the
    reading, and a service call per row would make a large fleet slow to build."""
    agents = Agent.objects.bulk_create(
        [Agent(name=f"fleet-{i:04d}", owner=world.alice) for i in range(first, first + count)]
    )
    template = {
        f.attname: getattr(world.grant, f.attname)
        for f in Grant._meta.concrete_fields
        if not f.primary_key
    }
    return Grant.objects.bulk_create([Grant(**{**template, "agent_id": a.pk}) for a in agents])


def queries(client: Client, path: str) -> tuple[int, str]:
    """The number of queries a second look at `path` costs (the first warms the
    session), and the page."""
    client.get(path)
    with CaptureQueriesContext(connection) as captured:
        response = client.get(path)
    assert response.status_code == 200, response.content[:300]
    return len(captured.captured_queries), response.content.decode()


def link(page: str, label: str) -> str:
    """The query string of the page link labelled `label`, unescaped."""
    found = re.search(r'<a href="\?([^"]*)">' + re.escape(label) + "</a>", page)
    assert found, f"no {label!r} link"
    return found.group(1).replace("&amp;", "&")


# --- The matrix ------------------------------------------------------------------------


def test_the_matrix_shows_a_page_of_agents_and_costs_the_same_for_twice_the_fleet() -> None:
    world = ui_world.build()
    fleet(world, 0, 230)
    client = ui_world.signed_in("auditor")
    few, page = queries(client, "/ui/matrix/")
    names = MATRIX_ROW.findall(page)
    # By name: bot-a, bot-a.sub, then fleet-0000 onwards, a hundred in all.
    assert len(names) == MATRIX_PAGE
    assert names[:3] == ["bot-a", "bot-a.sub", "fleet-0000"] and names[-1] == "fleet-0097"
    assert "page 1 of 3" in page and "(1–100 of 232 agents)" in page
    assert 'href="/ui/matrix/cell/?agent=fleet-0097&amp;tool=repo"' in page
    assert len(page) < 120_000  # the whole fleet's page grew with every agent

    second = client.get(f"/ui/matrix/?{link(page, 'next →')}").content.decode()
    assert MATRIX_ROW.findall(second)[0] == "fleet-0098" and "fleet-0097" not in second
    last = client.get(f"/ui/matrix/?{link(page, 'last »')}").content.decode()
    assert MATRIX_ROW.findall(last)[-1] == "fleet-0229" and "page 3 of 3" in last

    fleet(world, 230, 230)
    assert queries(client, "/ui/matrix/")[0] == few
    cell = client.get("/ui/matrix/cell/?agent=fleet-0400&tool=repo").content.decode()
    assert "repo:acme/*" in cell  # a cell on a later page still lists its grant


def test_the_matrix_filters_by_agent_name_and_keeps_its_filters_in_the_page_links() -> None:
    world = ui_world.build()
    fleet(world, 0, 230)
    client = ui_world.signed_in("admin")
    page = client.get("/ui/matrix/?agent=FLEET-0&kind=api").content.decode()
    names = MATRIX_ROW.findall(page)
    assert len(names) == 100 and all(n.startswith("fleet-0") for n in names)
    assert "(1–100 of 230 agents)" in page and 'value="FLEET-0"' in page
    assert ">repo</a>" in page and ">mailer</a>" not in page  # the kind filter's columns
    following = link(page, "next →")
    assert sorted(following.split("&")) == ["agent=FLEET-0", "kind=api", "page=2"]
    second = client.get(f"/ui/matrix/?{following}").content.decode()
    assert MATRIX_ROW.findall(second)[:2] == ["fleet-0100", "fleet-0101"]
    only = client.get("/ui/matrix/?agent=0123").content.decode()
    assert MATRIX_ROW.findall(only) == ["fleet-0123"] and "page 1 of" not in only
    assert '<span class="act destructive">delete!</span>' in only  # its cell, as before
    beyond = client.get("/ui/matrix/?agent=fleet&page=99").content.decode()
    assert MATRIX_ROW.findall(beyond)[-1] == "fleet-0229"  # past the end: the last page
    assert client.get("/ui/matrix/?page=0").status_code == 400
    assert client.get("/ui/matrix/?page=x").status_code == 400


# --- Review campaigns ------------------------------------------------------------------


def campaign_with_fleet(world: ui_world.World, grants: list[Grant], reviewer: Any) -> int:
    """The incident campaign (bot-a's four grants) with an item for each of `grants`
    assigned to `reviewer`: the first 30 kept by them, the rest pending."""
    lifecycle = ui_world.build_lifecycle(world)
    campaign = ReviewCampaign.objects.get(pk=lifecycle.campaign_id)
    add_items(campaign, grants[:30], reviewer, kept=True)
    add_items(campaign, grants[30:], reviewer)
    return campaign.pk


def add_items(
    campaign: ReviewCampaign, grants: list[Grant], reviewer: Any, kept: bool = False
) -> None:
    """An item per grant for `reviewer`, pending, or kept by them (in bulk, as fleet())."""
    decided = {"status": "kept", "decided_by": reviewer, "decided_at": timezone.now()}
    ReviewItem.objects.bulk_create(
        [
            ReviewItem(
                campaign=campaign,
                grant=g,
                reviewer=reviewer,
                due_at=campaign.due_at,
                **({**decided, "comment": "still needed"} if kept else {}),
            )
            for g in grants
        ]
    )


def in_order(campaign_pk: int) -> list[int]:
    """The campaign's grant ids as the page lists them: pending first, each group
    soonest due first, then oldest item first."""
    items = ReviewItem.objects.filter(campaign_id=campaign_pk)
    ranked = sorted(items, key=lambda i: (i.status != "pending", i.due_at, i.pk))
    return [i.grant_id for i in ranked]


def test_a_campaign_shows_a_page_of_items_pending_first_and_counts_every_status() -> None:
    world = ui_world.build()
    erin = ui_world.user("erin", "approver")
    campaign = campaign_with_fleet(world, fleet(world, 0, 230), erin)
    client = ui_world.signed_in("auditor")
    few, page = queries(client, f"/ui/reviews/{campaign}/")
    rows = [int(pk) for pk in CAMPAIGN_ROW.findall(page)]
    order = in_order(campaign)
    assert len(order) == 234 and len(rows) == CAMPAIGN_PAGE
    assert rows == order[:100]
    # The kept items are older than the pending ones, and "kept" sorts before "pending":
    # the page began with the decided items.
    assert 'class="status-kept">kept' not in page.split('<table class="dense">')[1]
    assert "234 items:" in page and "pending 204" in page and "kept 30" in page
    assert "revoked 0" in page and "page 1 of 3" in page
    assert len(page) < 120_000

    second = client.get(f"/ui/reviews/{campaign}/?{link(page, 'next →')}").content.decode()
    assert [int(pk) for pk in CAMPAIGN_ROW.findall(second)] == order[100:200]
    last = client.get(f"/ui/reviews/{campaign}/?{link(page, 'last »')}").content.decode()
    assert [int(pk) for pk in CAMPAIGN_ROW.findall(last)] == order[200:]
    assert 'class="status-kept">kept' in last

    more = fleet(world, 230, 230)
    add_items(ReviewCampaign.objects.get(pk=campaign), more, erin)
    assert queries(client, f"/ui/reviews/{campaign}/")[0] == few


def test_a_campaign_filters_by_status_and_keeps_it_in_the_page_links() -> None:
    world = ui_world.build()
    erin = ui_world.user("erin", "approver")
    campaign = campaign_with_fleet(world, fleet(world, 0, 230), erin)
    client = ui_world.signed_in("admin")
    kept = client.get(f"/ui/reviews/{campaign}/?status=kept").content.decode()
    rows = [int(pk) for pk in CAMPAIGN_ROW.findall(kept)]
    assert rows == in_order(campaign)[204:] and len(rows) == 30
    assert "page 1 of" not in kept and "pending 204" in kept  # counts: the whole campaign
    pending = client.get(f"/ui/reviews/{campaign}/?status=pending").content.decode()
    following = link(pending, "next →")
    assert sorted(following.split("&")) == ["page=2", "status=pending"]
    second = client.get(f"/ui/reviews/{campaign}/?{following}").content.decode()
    assert [int(pk) for pk in CAMPAIGN_ROW.findall(second)] == in_order(campaign)[100:200]
    assert client.get(f"/ui/reviews/{campaign}/?status=nope").status_code == 400


# --- A reviewer's items ----------------------------------------------------------------


def signed_in_as(person: Any) -> Client:
    client = Client(enforce_csrf_checks=True)
    client.force_login(person)
    client.get("/ui/")  # the CSRF cookie
    return client


def test_my_items_show_a_page_of_forms_and_cost_the_same_for_twice_the_backlog() -> None:
    world = ui_world.build()
    erin = ui_world.user("erin", "approver")
    campaign = campaign_with_fleet(world, fleet(world, 0, 230), erin)
    client = signed_in_as(erin)
    few, page = queries(client, "/ui/reviews/mine/")
    mine = ReviewItem.objects.filter(reviewer=erin)
    pending = [i.pk for i in mine.filter(status="pending").order_by("due_at", "pk")]
    assert [int(pk) for pk in DECIDE_FORM.findall(page)] == pending[:MINE_PAGE]
    n = len(pending)  # the fleet's 200, and what the incident campaign gave erin
    assert 200 <= n < 210
    assert f"{n} open ({n} assigned to me)" in page and "30 closed" in page
    assert "page 1 of 5" in page and len(page) < 50 * 3_000 + 30_000
    assert f"({n} mine" in client.get("/ui/").content.decode()  # the dashboard counts them

    last = client.get(f"/ui/reviews/mine/?{link(page, 'last »')}").content.decode()
    assert [int(pk) for pk in DECIDE_FORM.findall(last)] == pending[200:]
    # then the closed ones, each without a form
    closed = mine.exclude(status="pending").order_by("due_at", "pk")
    assert all(f'id="item-{i.pk}"' in last for i in closed)

    more = fleet(world, 230, 230)
    add_items(ReviewCampaign.objects.get(pk=campaign), more, erin)
    assert queries(client, "/ui/reviews/mine/")[0] == few


def test_a_decision_on_a_later_page_of_one_campaign_returns_to_that_page() -> None:
    world = ui_world.build()
    erin = ui_world.user("erin", "approver")
    grants = fleet(world, 0, 230)
    campaign = campaign_with_fleet(world, grants, erin)
    due = ReviewCampaign.objects.get(pk=campaign).due_at
    other = ReviewCampaign.objects.create(
        kind="on_demand", reason="another", opened_at=timezone.now(), due_at=due
    )
    add_items(other, grants[:5], erin)
    client = signed_in_as(erin)
    only_other = client.get(f"/ui/reviews/mine/?campaign={other.pk}").content.decode()
    assert len(DECIDE_FORM.findall(only_other)) == 5 and "5 open" in only_other

    page = client.get(f"/ui/reviews/mine/?campaign={campaign}").content.decode()
    following = link(page, "next →")
    assert sorted(following.split("&")) == [f"campaign={campaign}", "page=2"]
    second = client.get(f"/ui/reviews/mine/?{following}").content.decode()
    item = ReviewItem.objects.get(pk=int(DECIDE_FORM.findall(second)[0]))
    assert item.campaign_id == campaign and item.status == "pending"
    form = second.split(f'action="/ui/reviews/items/{item.pk}/decide"', 1)[1]
    assert '<input type="hidden" name="back_page" value="2">' in form.split("</form>")[0]

    done = ui_world.post(client, f"/ui/reviews/items/{item.pk}/decide", {
        "decision": "revoke", "comment": "no longer used",
        "back_page": "2", "back_campaign": str(campaign),
    })  # fmt: skip
    assert done.status_code == 302
    assert done["Location"] == f"/ui/reviews/mine/?campaign={campaign}&page=2"
    item.refresh_from_db()
    assert (item.status, item.decided_by_id, item.comment) == ("revoked", erin.pk, "no longer used")
    assert Grant.objects.get(pk=item.grant_id).status == "revoked"
    decided = AuditEvent.objects.filter(event_type="review.item_decided").get()
    assert (decided.actor, decided.grant_id) == ("user:erin", item.grant_id)
    assert json.loads(decided.data)["decision"] == "revoke"
    revoked = AuditEvent.objects.filter(event_type="grant.revoked").get()  # in its transaction
    assert (revoked.grant_id, revoked.actor, last_event().seq) == (
        item.grant_id, "user:erin", decided.seq,
    )  # fmt: skip
    back = client.get(done["Location"]).content.decode()
    assert f'action="/ui/reviews/items/{item.pk}/decide"' not in back
    refused = ui_world.post(client, f"/ui/reviews/items/{item.pk}/decide", {
        "decision": "keep", "comment": "x", "back_page": "0",
    })  # fmt: skip
    assert refused.status_code == 400  # a malformed page is refused, nothing decided


def test_fallen_items_are_counted_as_the_admins_not_as_waiting_on_an_admin_barred_from_them(
    make_agent, make_tool, make_grant, alice, bob, django_user_model
) -> None:
    """Whether an admin may decide an item fallen to the admins is worked out per page,
    so the dashboard's count of them all said "waiting on me" to alice, who asked for
    the grant and may not review it. Now such items are counted apart, as the admins'."""
    from datetime import timedelta

    from django.contrib.auth.models import Group

    from governance import roles
    from governance.services import reviews

    admins = Group.objects.get_or_create(name=roles.ADMINS)[0]
    ivan = django_user_model.objects.create_user("ivan", email="ivan@example.test")
    for person in (alice, bob, ivan):
        person.groups.add(admins)
    grant = make_grant(make_agent("bot"), make_tool("repo"), starts_at=timezone.now(),
                       duration=timedelta(days=5))  # fmt: skip  # alice asked, bob approved
    campaign = ReviewCampaign.objects.create(
        kind="on_demand", reason="incident", opened_at=timezone.now(),
        due_at=timezone.now() + timedelta(days=7),
    )  # fmt: skip
    item = ReviewItem.objects.create(
        campaign=campaign, grant=grant, reviewer=None, due_at=campaign.due_at
    )
    assert [u.username for u in reviews._reviewers(item)] == ["ivan"]
    for person in (alice, bob, ivan):
        dashboard = signed_in_as(person).get("/ui/").content.decode()
        assert "item waiting on me" not in dashboard, person.username
        assert "1 item fallen to the admins" in dashboard, person.username
