"""The web UI's listings at a customer's size (100,000 live grants over 1,000 agents,
3,000 pending requests, 2,000 pending approvals, 3,000 pending second looks) cost what
their page shows, not what is pending. The dashboard built every idle grant to show 20
(12.5 s); each inbox asked approvals.stakeholders() item by item, and an admin who
issued the agents' tokens has a stake in every one (6,000 queries, 7-10 s, for an
empty inbox); the second-look inbox put all 3,000 on one page (3.2 MB)."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.contrib.auth.models import Group, User
from django.db import connection
from django.db.models.signals import post_init
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from governance import roles, selectors
from governance.audit import Actor
from governance.models import Agent, Approval, AuditEvent, Grant, GrantActionUse, SecondLook
from governance.services import access, agents, approvals, breakglass, grants, second_look
from governance.services.approvals import stakeholders
from governance.web import lifecycle, queries
from tests.conftest import NOW

pytestmark = pytest.mark.django_db

SYSTEM = Actor.system("test")


def person(name: str, *groups: str) -> User:
    user = User.objects.create_user(name, password=f"pw-{name}-123")
    for group in groups:
        user.groups.add(Group.objects.get_or_create(name=group)[0])
    return user


def signed_in(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


def queries_for(client: Client, path: str) -> tuple[int, str]:
    client.get(path)  # warm: sessions, rate-limit keys
    with CaptureQueriesContext(connection) as captured:
        response = client.get(path)
    assert response.status_code == 200, (path, response.content[:300])
    return len(captured.captured_queries), response.content.decode()


# --- Stakes: the batch answer is stakeholders()'s ---------------------------------------


@pytest.fixture
def stakes_world(make_agent, make_tool, alice, bob, settings) -> dict[str, Any]:
    """Every way to hold a stake, and near misses of each.

    root (alice) > mid (carol) > leaf (erin); lone (frank). pete asked for root's
    delete grant, handed down root > mid > leaf; leaf asks to delete under it. Tokens,
    each against the moments the items are asked at (2 h and 1 h ago, now): tom's on
    root is live throughout; tim's on leaf expired 6 h ago; tara's on mid was revoked
    2 days ago, rex's on mid 90 minutes ago; uma's on leaf expires 90 minutes ago; tess's
    on lone was issued half an hour ago, after most of the requests (it counts: she
    could act as lone from then on). olga opened break-glass for lone; its grant makes
    a destructive call, and its ratification is a pending request. dave, an admin, and
    bob, who approved, have no stake."""
    settings.BREAKGLASS_OPENS_CAMPAIGN = False
    people = {
        name: person(name)
        for name in ("carol", "erin", "frank", "pete", "tom", "tim", "tara", "rex", "uma", "tess")
    }
    people["olga"] = person("olga", roles.APPROVERS)
    people["dave"] = person("dave", roles.ADMINS)
    bob.groups.add(Group.objects.get_or_create(name=roles.APPROVERS)[0])
    people.update(alice=alice, bob=bob)
    root = make_agent("root")
    mid = make_agent("mid", parent=root, owner=people["carol"])
    leaf = make_agent("leaf", parent=mid, owner=people["erin"])
    lone = make_agent("lone", owner=people["frank"])
    repo = make_tool("repo")

    def token(who: str, agent: Agent, at: Any, days: int = 30, revoked_at: Any = None) -> None:
        made, _ = agents.token_issue(
            created_by=people[who], agent=agent, actor=SYSTEM, at=at, days=days
        )
        if revoked_at is not None:
            agents.token_revoke(token=made, actor=SYSTEM, at=revoked_at)

    token("tom", root, NOW - timedelta(hours=20))
    token("tim", leaf, NOW - timedelta(hours=30), days=1)
    token("tara", mid, NOW - timedelta(hours=20), revoked_at=NOW - timedelta(hours=10))
    token("rex", mid, NOW - timedelta(hours=20), revoked_at=NOW - timedelta(minutes=90))
    token("uma", leaf, NOW - timedelta(hours=25, minutes=30), days=1)
    token("tess", lone, NOW - timedelta(minutes=30))

    top = grants.grant_issue(
        agent=root, tool=repo, actions=["read", "delete"], scope="repo:acme/*",
        duration=timedelta(hours=8), justification="cleanup", requested_by=people["pete"],
        approved_by=bob, actor=SYSTEM, at=NOW - timedelta(hours=3), delegable=True,
    )  # fmt: skip
    middle = grants.grant_delegate(
        parent_grant_id=top.pk, child=mid, actions=["read", "delete"], scope="repo:acme/*",
        expires_at=top.expires_at, justification="split", actor=SYSTEM,
        at=NOW - timedelta(hours=2, minutes=30), delegable=True,
    )  # fmt: skip
    bottom = grants.grant_delegate(
        parent_grant_id=middle.pk, child=leaf, actions=["delete"], scope="repo:acme/old/*",
        expires_at=top.expires_at, justification="split", actor=SYSTEM,
        at=NOW - timedelta(hours=2, minutes=30),
    )  # fmt: skip
    glass = breakglass.breakglass_open(
        opener=people["olga"], agent=lone, tool=repo, actions=["read", "delete"],
        scope="repo:ops/*", ticket="INC-1", reason="outage", actor=SYSTEM,
        at=NOW - timedelta(minutes=20),
    )  # fmt: skip

    def ask(
        agent: Agent, moment: Any, by: str | None = None, scope: str = "repo:acme/x/*"
    ) -> Grant:
        return grants.grant_request(
            agent=agent, tool=repo, actions=["read"], scope=scope,
            duration=timedelta(hours=1), justification="work",
            requested_by=people[by] if by else None, requested_by_agent=None if by else agent,
            actor=SYSTEM, at=moment,
        )  # fmt: skip

    for i, moment in enumerate((NOW - timedelta(hours=2), NOW - timedelta(hours=1), NOW)):
        ask(root, moment, scope=f"repo:acme/a{i}/*")
        ask(root, moment, by="pete", scope=f"repo:acme/p{i}/*")
        ask(lone, moment, scope=f"repo:ops/a{i}/*")
        ask(lone, moment, by="carol", scope=f"repo:ops/c{i}/*")
    breakglass.breakglass_ratify(
        breakglass_id=glass.pk, reviewer=people["dave"], comment="was needed", actor=SYSTEM,
        at=NOW - timedelta(minutes=10),
    )  # fmt: skip
    for agent, scope in ((leaf, "repo:acme/old/1"), (root, "repo:acme/2"), (lone, "repo:ops/3")):
        asked = access.access_check(
            agent=agent.name, tool="repo", action="delete", scope=scope, at=NOW
        )
        assert asked.approval_id, asked
    return {
        "people": people,
        "agents": [root, mid, leaf, lone],
        "grants": [top, middle, bottom, glass.grant, *Grant.objects.filter(status="pending")],
        "moments": [NOW + timedelta(minutes=m) for m in (-180, -120, -91, -60, -30, 0, 60)],
    }


def test_the_batch_stake_answer_is_stakeholders_for_every_person_agent_grant_and_moment(
    stakes_world,
):
    """Every person, every agent (owners up the tree), every grant (a delegation chain
    with its requester; a break-glass grant and the request that ratifies it; none),
    at moments before and after each token's end: staked() answers as stakeholders()."""
    calls = [
        approvals.Call(
            (agent.pk, grant.pk if grant else None, at), agent.pk, grant.pk if grant else None, at
        )
        for agent in stakes_world["agents"]
        for grant in [None, *stakes_world["grants"]]
        for at in stakes_world["moments"]
    ]
    every = {}
    for call in calls:
        agent = Agent.objects.get(pk=call.agent_id)
        grant = Grant.objects.get(pk=call.grant_id) if call.grant_id else None
        every[call.key] = stakeholders(agent, grant, at=call.at)
    seen_both = set()
    for user in User.objects.all():
        expected = {key for key, people in every.items() if user.pk in people}
        assert approvals.staked(user.pk, calls, {}, {}) == expected, user.username
        seen_both.add((bool(expected), len(expected) < len(calls)))
    # The world is varied enough: people with some stakes and people with none.
    assert (True, True) in seen_both and (False, True) in seen_both
    # Each kind of stake shows somewhere (named, so a world that lost one fails here).
    holders = set().union(*every.values())
    names = {u.username for u in User.objects.filter(pk__in=holders)}
    assert {"alice", "carol", "erin", "frank", "pete", "tom", "rex", "uma", "tess", "olga"} <= names
    assert not {"tim", "tara"} & names  # their tokens had ended before every moment


def test_the_inboxes_offer_each_person_exactly_what_they_may_decide(stakes_world):
    """The requests and approvals each person is offered are the ones the old per-item
    walk offered: the SQL's plain exclusions, then no stake as stakeholders() says."""
    pending = Grant.objects.filter(status="pending").order_by("created_at", "pk")
    approvals = Approval.objects.filter(status="pending", expires_at__gt=NOW).order_by(
        "expires_at", "pk"
    )
    assert pending.count() == 13 and approvals.count() == 3
    offered_any = set()
    for user in User.objects.all():
        requests_before = [
            g.pk
            for g in pending
            if g.requested_by_id != user.pk
            and not (g.requested_by_agent_id and g.agent.owner_id == user.pk)
            and user.pk not in stakeholders(g.agent, g, at=g.created_at)
        ]
        approvals_before = [
            a.pk
            for a in approvals
            if a.agent.owner_id != user.pk
            and a.grant.requested_by_id != user.pk
            and user.pk not in stakeholders(a.agent, a.grant, at=a.requested_at)
        ]
        requests_now = [g.pk for g in queries.pending_requests_for(user, 200)]
        approvals_now = [a.pk for a in queries.pending_approvals_for(user, NOW, 200)]
        assert requests_now == requests_before, user.username
        assert approvals_now == approvals_before, user.username
        assert [g.pk for g in queries.pending_requests_for(user, 2)] == requests_before[:2]
        offered_any.add((len(requests_now), len(approvals_now)))
    assert len(offered_any) > 3  # different people are offered different things


@pytest.fixture
def busy_inboxes(make_agent, make_tool, alice, settings) -> Any:
    """add(n): n more pending requests and n more destructive calls awaiting approval,
    spread over five agents whose tokens dave (an admin) issued: he has a stake in
    every one, bob (an approver) in none."""
    settings.GRANT_REQUEST_PENDING_MAX = settings.APPROVAL_PENDING_MAX = 100
    settings.GRANT_MAX_TTL = timedelta(days=30)
    dave, bob = person("dave", roles.ADMINS), person("bob", roles.APPROVERS)
    repo = make_tool("repo")
    now = timezone.now()
    bots = [make_agent(f"bot{i}") for i in range(5)]
    for bot in bots:
        agents.token_issue(created_by=dave, agent=bot, actor=SYSTEM, at=now - timedelta(hours=1))
        grants.grant_issue(
            agent=bot, tool=repo, actions=["read", "delete"], scope="repo:*",
            duration=timedelta(days=3), justification="work", requested_by=alice,
            approved_by=bob, actor=SYSTEM, at=now - timedelta(hours=1),
        )  # fmt: skip
    made = [0]

    def add(n: int) -> None:
        for i in range(made[0], made[0] + n):
            bot = bots[i % len(bots)]
            grants.grant_request(
                agent=bot, tool=repo, actions=["read"], scope=f"repo:r{i}/*",
                duration=timedelta(hours=1), justification="more", requested_by_agent=bot,
                actor=SYSTEM, at=now,
            )  # fmt: skip
            asked = access.access_check(
                agent=bot.name, tool="repo", action="delete", scope=f"repo:d{i}", at=now
            )
            assert asked.approval_id, asked
        made[0] += n

    return dave, bob, add


INBOXES = ("/ui/", "/ui/inbox/requests/", "/ui/inbox/approvals/")


def test_an_inbox_costs_the_same_queries_for_5_or_60_pending_whoever_reads_it(busy_inboxes):
    """dave has a stake in every pending item: the inbox walked all of them asking
    stakeholders() two or three queries each (6,000 at a customer's size). bob has a
    stake in none and is offered them all. Either way the count is the page's own."""
    dave, bob, add = busy_inboxes
    readers = {"dave": signed_in(dave), "bob": signed_in(bob)}

    def count() -> dict[tuple[str, str], int]:
        return {
            (who, path): queries_for(client, path)[0]
            for who, client in readers.items()
            for path in INBOXES
        }

    add(5)
    few = count()
    add(55)
    assert count() == few
    # What each was offered: dave nothing, bob all 60 of each (the page's limit is 200).
    _, page = queries_for(readers["dave"], "/ui/inbox/requests/")
    assert 'id="req-' not in page
    _, page = queries_for(readers["bob"], "/ui/inbox/requests/")
    assert page.count('id="req-') == 60
    assert len(queries.pending_approvals_for(bob, timezone.now(), 200)) == 60
    assert queries.pending_approvals_for(dave, timezone.now(), 200) == []


# --- A review campaign: its reviewers drawn for all its grants at once ------------------


def test_a_campaign_bars_from_each_grant_exactly_whom_the_per_grant_rule_bars(stakes_world):
    """The reviewer pool's bars, read for all the campaign's grants at once, are
    _barred(grant)'s for every grant of the varied world (a delegation chain, a
    break-glass grant and the request ratifying it, tokens live or ended at each
    grant's creation), for every person who could be drawn."""
    from governance.services import reviews

    everyone = list(User.objects.order_by("pk"))
    listed = list(Grant.objects.select_related("agent").order_by("pk"))
    assert len(listed) >= 10
    together = reviews._barred_among(listed, everyone)
    pks = {u.pk for u in everyone}
    for grant in listed:
        assert together[grant.pk] == reviews._barred(grant) & pks, grant.pk
    # Varied enough: some grants bar several people, and everyone is barred somewhere
    # or free somewhere.
    assert max(len(b) for b in together.values()) >= 3
    assert any(not together[g.pk] >= pks for g in listed)


def test_opening_a_campaign_costs_the_same_queries_for_5_or_40_grants(
    make_agent, make_tool, alice, bob, settings
):
    """Each grant's bars were read with two queries (the break-glass opened up its chain,
    the tokens live at its creation): 4,000 queries and 20 s for 2,000 grants. Now the
    campaign's count does not grow with its grants, and each item still gets a reviewer
    with no stake in it (owner, requester, approver, token creator excluded)."""
    from governance.models import ReviewItem
    from governance.services import reviews

    settings.BREAKGLASS_OPENS_CAMPAIGN = False
    carol = person("carol", roles.APPROVERS)
    tina = person("tina", roles.APPROVERS)  # creates the agents' tokens: a stake in each
    repo = make_tool("repo")
    made: list[Agent] = []

    def add(n: int) -> None:
        for i in range(len(made), len(made) + n):
            agent = make_agent(f"bot-{i}")
            made.append(agent)
            agents.token_issue(created_by=tina, agent=agent, actor=SYSTEM, at=NOW)
            grants.grant_issue(
                agent=agent, tool=repo, actions=["read"], scope=f"repo:acme/{i}/*",
                duration=timedelta(hours=8), justification="work", requested_by=alice,
                approved_by=bob, actor=SYSTEM, at=NOW,
            )  # fmt: skip

    def open_campaign(reason: str) -> tuple[int, Any]:
        with CaptureQueriesContext(connection) as seen:
            campaign = reviews.review_campaign_open(
                kind="on_demand", reason=reason, agent=None, opened_by=None,
                actor=SYSTEM, at=NOW + timedelta(minutes=1),
            )  # fmt: skip
        return len(seen.captured_queries), campaign

    add(5)
    open_campaign("warm-up")  # the first usage fold (a campaign folds first) makes its row
    few, first = open_campaign("first")
    add(35)
    many, second = open_campaign("second")
    assert many == few
    items = ReviewItem.objects.filter(campaign=second).select_related("reviewer")
    assert items.count() == 40 and first.items.count() == 5
    # bob approved every grant, alice asked for them and owns the agents, tina made
    # their tokens: carol, the one approver with no stake, reviews every item.
    assert {item.reviewer for item in items} == {carol}
    event = AuditEvent.objects.filter(event_type="review.campaign_opened").latest("seq")
    assert [i["reviewer"] for i in json.loads(event.data)["items"]] == ["carol"] * 40


# --- Unused grants on the dashboard: the page's 20, read as such ------------------------


def test_the_dashboard_builds_only_the_unused_grants_it_shows(make_agent, make_tool, settings):
    """60 idle grants: the dashboard built all of them (50,430 at a customer's size, 12.5 s)
    with their relations to keep 20. Now it reads 20, the same 20 the full scan puts first."""
    settings.UNUSED_GRANT_HOURS = 1
    settings.GRANT_MAX_TTL = timedelta(days=30)
    now = timezone.now()
    bob, dave = person("bob", roles.APPROVERS), person("dave", roles.ADMINS)
    repo = make_tool("repo")
    for i in range(60):
        grants.grant_issue(
            agent=make_agent(f"bot{i:02}"), tool=repo, actions=["read"], scope="repo:*",
            duration=timedelta(days=3), justification="idle", requested_by=dave,
            approved_by=bob, actor=SYSTEM, at=now - timedelta(hours=2),
        )  # fmt: skip
    built = []

    def count(sender: Any, instance: Grant, **kwargs: Any) -> None:
        built.append(instance.pk)

    post_init.connect(count, sender=Grant)
    try:
        page = signed_in(dave).get("/ui/").content.decode()
    finally:
        post_init.disconnect(count, sender=Grant)

    assert len(built) <= 20
    first = selectors.unused_grants(timezone.now())[:20]
    assert len(first) == 20 and [g.agent.name for g in first] == [f"bot{i:02}" for i in range(20)]
    for grant in first:
        assert f'href="/ui/grants/{grant.pk}/"' in page
    assert "bot20" not in page


def test_the_first_unused_grants_are_the_full_scans_first_with_used_delegations_left_out(
    make_agent, make_tool, make_grant, settings
):
    """A parent grant its subagents use is not idle (two levels down too). Asked for
    the first k, the selector answers the full scan's first k for every k, reading a
    page at a time and looking below only the grants on it."""
    settings.UNUSED_GRANT_HOURS = 1
    repo = make_tool("repo")
    long = timedelta(hours=20)
    later = NOW + timedelta(hours=3)
    top, mid, leaf = make_agent("a-top"), None, None
    mid = make_agent("a-mid", parent=top)
    leaf = make_agent("a-leaf", parent=mid)
    idle = []
    for name in ("b", "c", "d", "e", "f"):
        idle.append(make_grant(make_agent(name), repo, duration=long))
    busy_top = make_grant(top, repo, scope="repo:acme/*", duration=long, delegable=True)
    quiet_top = make_grant(top, repo, scope="repo:web/*", duration=long, delegable=True)

    def hand(parent: Grant, child: Agent, delegable: bool = False) -> Grant:
        return grants.grant_delegate(
            parent_grant_id=parent.pk, child=child, actions=["read"], scope=parent.scope,
            expires_at=parent.expires_at, justification="split", actor=SYSTEM,
            at=NOW - timedelta(minutes=20), delegable=delegable,
        )  # fmt: skip

    busy_mid = hand(busy_top, mid, delegable=True)
    used_leaf = hand(busy_mid, leaf)
    quiet_mid = hand(quiet_top, mid)

    def used(grant: Grant, at: datetime) -> None:  # as the usage fold records a read
        Grant.objects.filter(pk=grant.pk).update(last_used_at=at, use_count=1)
        GrantActionUse.objects.create(grant=grant, action="read", use_count=1, last_used_at=at)

    used(used_leaf, later - timedelta(minutes=5))
    used(quiet_mid, NOW - timedelta(hours=10))  # used long ago: not busy

    everything = [g.pk for g in selectors.unused_grants(later)]
    assert busy_top.pk not in everything and busy_mid.pk not in everything
    assert quiet_top.pk in everything and all(g.pk in everything for g in idle)
    for k in range(1, len(everything) + 2):
        with CaptureQueriesContext(connection) as captured:
            first = selectors.unused_grants(later, limit=k)
        assert [g.pk for g in first] == everything[:k], k
        assert all(g.proposal and g.idle_since for g in first)
        # A page, a level below it at a time, and the accounts: never a query per grant.
        assert len(captured.captured_queries) <= 12, k


# --- Second look: the oldest, capped, with the count --------------------------------------


def test_the_second_look_inbox_shows_the_oldest_capped_with_how_many_wait(
    make_agent, make_tool, make_grant, bob, monkeypatch
):
    """Every pending second look was on the page (3,000 at a customer's size: 3.2 MB).
    Now the oldest SECOND_LOOKS_SHOWN (200; 5 here), the reader's own first, the total
    said, and the page costs no more queries however many wait."""
    monkeypatch.setattr(lifecycle, "SECOND_LOOKS_SHOWN", 5, raising=False)
    bob.groups.add(Group.objects.get_or_create(name=roles.APPROVERS)[0])
    dave = person("dave", roles.ADMINS)
    person("heidi", roles.APPROVERS)  # a third approver: looks fall to each in turn
    bot, repo = make_agent("bot"), make_tool("repo")

    def sample(n: int, hours_ago: int) -> None:
        at = timezone.now() - timedelta(hours=hours_ago)
        for i in range(n):
            make_grant(bot, repo, scope=f"repo:s{hours_ago}-{i}/*", starts_at=at)
        assert second_look.second_looks_sample(actor=SYSTEM, at=at, fraction=1.0) == n

    sample(3, hours_ago=30)
    reader = signed_in(dave)
    few, page = queries_for(reader, "/ui/inbox/second-look/")
    assert page.count('class="card second-look"') == 3 and "Showing the oldest" not in page
    sample(9, hours_ago=3)
    many, page = queries_for(reader, "/ui/inbox/second-look/")

    assert many <= few  # (fewer when the reader's own fill the page: no others read)
    assert page.count('class="card second-look"') == 5
    assert "Showing the oldest 5 of 12 pending" in page
    pending = SecondLook.objects.filter(status="pending")
    mine = list(pending.filter(reviewer=dave).order_by("sampled_at", "pk"))
    others = list(pending.exclude(reviewer=dave).order_by("sampled_at", "pk"))
    assert f"{len(mine)} mine, {len(others)} other pending" in page
    # The reader's own first, then the others, each oldest first.
    shown = [look.pk for look in (mine + others)[:5]]
    assert [int(p.split('"')[0]) for p in page.split('id="look-')[1:]] == shown
    assert len(mine) > 1 and len(mine) + len(others) == 12
