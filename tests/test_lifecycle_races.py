"""Two people acting at once on PostgreSQL: break-glass reviews, review items, and the
per-person break-glass limit. Each thread has its own connection; a Barrier releases
them together, over many rounds. SQLite serialises writers, so there is no race there."""

from __future__ import annotations

from datetime import timedelta
from functools import partial

import pytest
from django.utils import timezone

from governance.audit import Actor
from governance.codes import EventType
from governance.errors import Conflict, RateLimited
from governance.models import AuditEvent, BreakGlass, Grant, ReviewItem
from governance.services import breakglass as bgs
from governance.services import reviews
from tests.test_races import together

ROUNDS = 15


def _open(setup, round_no, opener, tool=None):
    return bgs.breakglass_open(
        opener=opener,
        agent=setup["agent"],
        tool=tool or setup["tool"],
        actions=["read"],
        scope=f"repo:acme/r{round_no}/*",
        ticket=f"INC-{round_no}",
        reason="race",
        actor=Actor.user(opener),
        at=timezone.now(),
    )


@pytest.fixture
def setup(make_agent, make_tool, approvers, settings):
    settings.BREAKGLASS_MAX_PER_HOUR = 1000
    settings.BREAKGLASS_OPENS_CAMPAIGN = False
    erin, frank, grace, heidi = approvers
    return {
        "agent": make_agent(),
        "tool": make_tool(),
        # One live break-glass per agent and tool: a round that leaves one live (ratified)
        # must not block the next, so each round has its own tool.
        "tool_for": lambda n: make_tool(f"repo-{n}"),
        "erin": erin,
        "frank": frank,
        "grace": grace,
        "heidi": heidi,
    }


@pytest.mark.django_db(transaction=True)
def test_two_reviewers_closing_one_break_glass_at_once_decide_it_once(postgres_only, setup):
    frank, grace = setup["frank"], setup["grace"]
    for round_no in range(ROUNDS):
        bg = _open(setup, round_no, setup["erin"], setup["tool_for"](round_no))
        ratify = partial(
            bgs.breakglass_ratify,
            breakglass_id=bg.pk,
            reviewer=frank,
            comment="keep it",
            actor=Actor.user(frank),
            at=timezone.now(),
        )
        confirm = partial(
            bgs.breakglass_confirm_closed,
            breakglass_id=bg.pk,
            reviewer=grace,
            comment="done",
            actor=Actor.user(grace),
            at=timezone.now(),
        )
        outcomes = together(ratify, confirm)
        winners = [o for o in outcomes if o is None]
        losers = [o for o in outcomes if o is not None]
        assert len(winners) == 1 and len(losers) == 1, outcomes
        assert isinstance(losers[0], Conflict) and losers[0].code == "already_reviewed"

        bg.refresh_from_db()
        ratified = outcomes[0] is None
        assert bg.review_status == ("ratified" if ratified else "confirmed_closed")
        assert bg.reviewed_by == (frank if ratified else grace)
        decided = AuditEvent.objects.filter(
            grant_id=bg.grant_id,
            event_type__in=[EventType.BREAKGLASS_RATIFIED, EventType.BREAKGLASS_CONFIRMED_CLOSED],
        )
        assert decided.count() == 1 and decided.get().break_glass
        # Exactly the winner's side effect: a new request, or the grant revoked.
        assert (
            Grant.objects.filter(justification__contains=f"INC-{round_no}:").count()
            == (1 if ratified else 0) + 1
        )
        assert Grant.objects.get(pk=bg.grant_id).status == ("active" if ratified else "revoked")


@pytest.mark.django_db(transaction=True)
def test_the_assigned_reviewer_and_an_admin_deciding_at_once_decide_an_item_once(
    postgres_only, make_agent, make_tool, make_grant, approvers
):
    agent, tool = make_agent(), make_tool()
    heidi = approvers[3]  # the admin
    for round_no in range(ROUNDS):
        grant = make_grant(
            agent,
            tool,
            scope=f"repo:acme/r{round_no}/*",
            starts_at=timezone.now(),
            duration=timedelta(days=1),
        )
        campaign = reviews.review_campaign_open(
            kind="on_demand",
            reason=f"round {round_no}",
            actor=Actor.system("test"),
            at=timezone.now(),
        )
        item = campaign.items.get(grant=grant)
        reviewer = item.reviewer
        if reviewer.pk == heidi.pk:
            reviewer = approvers[0]
            ReviewItem.objects.filter(pk=item.pk).update(reviewer=reviewer)
        keep = partial(
            reviews.review_item_decide,
            item_id=item.pk,
            reviewer=reviewer,
            decision="keep",
            comment="fine",
            actor=Actor.user(reviewer),
            at=timezone.now(),
        )
        revoke = partial(
            reviews.review_item_decide,
            item_id=item.pk,
            reviewer=heidi,
            decision="revoke",
            comment="too wide",
            actor=Actor.user(heidi),
            at=timezone.now(),
        )
        outcomes = together(keep, revoke)
        assert sorted(o is None for o in outcomes) == [False, True], outcomes
        loser = next(o for o in outcomes if o is not None)
        assert isinstance(loser, Conflict) and loser.code == "already_decided"
        item.refresh_from_db()
        kept = outcomes[0] is None
        assert item.status == ("kept" if kept else "revoked")
        assert Grant.objects.get(pk=grant.pk).status == ("active" if kept else "revoked")
        assert (
            AuditEvent.objects.filter(
                grant_id=grant.pk, event_type=EventType.REVIEW_ITEM_DECIDED
            ).count()
            == 1
        )


@pytest.mark.django_db(transaction=True)
def test_two_opens_at_once_cannot_both_slip_under_the_hourly_limit(postgres_only, setup, settings):
    settings.BREAKGLASS_MAX_PER_HOUR = 1
    people = [setup["erin"], setup["frank"], setup["grace"], setup["heidi"]]
    for round_no in range(4):
        opener = people[round_no]
        outcomes = together(
            partial(
                _open, setup, 100 + 2 * round_no, opener, setup["tool_for"](100 + 2 * round_no)
            ),
            partial(
                _open, setup, 101 + 2 * round_no, opener, setup["tool_for"](101 + 2 * round_no)
            ),
        )
        assert sorted(o is None for o in outcomes) == [False, True], outcomes
        loser = next(o for o in outcomes if o is not None)
        assert isinstance(loser, RateLimited)
        assert BreakGlass.objects.filter(opened_by=opener).count() == 1


@pytest.mark.django_db(transaction=True)
def test_two_people_opening_for_one_agent_and_tool_at_once_open_one(postgres_only, setup):
    """Each opener's own row lock did not serialise two different people: both could
    open overlapping break-glass for the same agent and tool."""
    pairs = [("erin", "frank"), ("grace", "heidi")]
    for round_no, (a, b) in enumerate(pairs * 4):
        tool = setup["tool_for"](200 + round_no)
        outcomes = together(
            partial(_open, setup, 300 + 2 * round_no, setup[a], tool),
            partial(_open, setup, 301 + 2 * round_no, setup[b], tool),
        )
        assert sorted(o is None for o in outcomes) == [False, True], outcomes
        loser = next(o for o in outcomes if o is not None)
        assert isinstance(loser, Conflict) and loser.code == "breakglass_active"
        assert BreakGlass.objects.filter(grant__tool=tool).count() == 1
        assert (
            AuditEvent.objects.filter(
                event_type=EventType.BREAKGLASS_OPENED, tool=tool.name
            ).count()
            == 1
        )
