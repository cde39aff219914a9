"""The pages that list what grows with the fleet show a page of it at a time, at a cost
that does not grow with it. At a customer's size (100,000 live grants over 1,000 agents
x 50 tools; review campaigns of 40,000 items) the matrix was one page of 8.8 MB drawn in
15-32 s, a campaign's page 10 MB, and a reviewer's items 7.5 MB with a form for each of
4,250. Here a few hundred rows stand in for them: more than a page, so the old pages
(every row at once) fail, and twice as many must cost the same queries."""

from __future__ import annotations

import re

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from governance.models import Agent, Grant
from tests import ui_world

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
