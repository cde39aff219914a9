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


# --- A change committing while a check reads: held open, then committed ---------------


def _hold_then_commit(work, held, release_after: float, errors: list) -> None:
    """Run `work` in a transaction on this thread's own connection, say so, and commit
    `release_after` seconds later: the other side reads while it is uncommitted."""
    import time

    from django.db import connection, transaction

    try:
        with transaction.atomic():
            work()
            held.set()
            time.sleep(release_after)
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        errors.append(exc)
        held.set()
    finally:
        connection.close()


def _while_held(work, then):
    """`then()` on this thread while another thread holds `work` uncommitted; returns
    then()'s answer (or the Conflict it raised) once `work` has committed."""
    import threading

    held, errors = threading.Event(), []
    other = threading.Thread(target=_hold_then_commit, args=(work, held, 1.0, errors))
    other.start()
    assert held.wait(10)
    try:
        answer = then()
    except Conflict as exc:
        answer = exc
    other.join(10)
    assert not errors, errors
    return answer


@pytest.mark.django_db(transaction=True)
def test_the_start_gate_sees_a_suspension_committing_while_it_checks(
    postgres_only, make_agent, make_tool, make_grant
):
    """The gate read the agent as active, then waited for the chain lock behind the
    suspension, and recorded `sandbox.run.started` after `agent.suspended`: the code ran
    (until the runner's next live check) after the kill switch."""
    from governance.models import Agent
    from governance.services import agents, sandbox
    from sandbox_runner.spec import RunSpec

    image = "sha256:" + "5" * 64
    now = timezone.now()
    bot = make_agent("bot")
    code_exec = make_tool("code-exec", actions=("execute",), kind="code_exec")
    make_grant(bot, code_exec, ("execute",), "sandbox:*", starts_at=now - timedelta(minutes=1))
    auth = sandbox.run_request(
        spec=RunSpec(agent="bot", task=None, command=("true",), image_id=image), at=now
    )
    assert auth.allowed

    def suspend():
        agents.agent_suspend(
            agent=Agent.objects.get(pk=bot.pk),
            reason="kill switch",
            actor=Actor.system("soc"),
            at=timezone.now(),
        )

    def start():
        return sandbox.run_started(
            run_id=auth.run_id,
            container_id="c1",
            image_digest=image,
            deadline=timezone.now().timestamp() + 60,
            enforcement={},
            at=timezone.now(),
        )

    answer = _while_held(suspend, start)
    kinds = list(AuditEvent.objects.order_by("seq").values_list("event_type", flat=True))
    assert isinstance(answer, Conflict) and answer.code == "grant_not_live", (answer, kinds)
    assert "sandbox.run.started" not in kinds
    assert kinds[-2:] == [EventType.AGENT_SUSPENDED, EventType.SANDBOX_RUN_START_REFUSED]


@pytest.mark.django_db(transaction=True)
def test_closing_break_glass_while_an_admin_revokes_its_grant_is_on_record(postgres_only, setup):
    """The close read the grant as live, its revoke then found it revoked and wrote
    nothing: closed_at and closed_by were saved with no event naming who closed it."""
    from governance.services import grants

    frank, heidi = setup["frank"], setup["heidi"]
    bg = _open(setup, 0, setup["erin"])

    def admin_revoke():
        grants.grant_revoke(
            grant_id=bg.grant_id,
            reason="admin cut it",
            actor=Actor.user(heidi),
            at=timezone.now(),
            revoked_by=heidi,
        )

    before = AuditEvent.objects.order_by("-seq").values_list("seq", flat=True).first()

    def close():
        return bgs.breakglass_close(
            breakglass_id=bg.pk,
            closed_by=frank,
            comment="incident over",
            actor=Actor.user(frank),
            at=timezone.now(),
        )

    _while_held(admin_revoke, close)
    bg.refresh_from_db()
    assert bg.closed_by_id == frank.pk
    after = list(AuditEvent.objects.filter(seq__gt=before).order_by("seq"))
    assert [(e.event_type, e.actor) for e in after] == [
        (EventType.GRANT_REVOKED, f"user:{heidi.get_username()}"),
        (EventType.BREAKGLASS_CLOSED, f"user:{frank.get_username()}"),
    ]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("decision", ["keep", "revoke", "narrow"])
def test_deciding_a_review_item_while_its_grant_is_revoked_is_refused(
    postgres_only, make_agent, make_tool, make_grant, approvers, decision
):
    """The keep read the grant as live and committed after the revoke: the log showed a
    reviewer re-certifying a grant that was already revoked. A revoke decision then
    recorded the reviewer as revoking what an admin had (review.item_decided after
    grant.revoked), and a narrowing was refused with the item left pending."""
    from governance.services import grants

    heidi = approvers[3]
    now = timezone.now()
    grant = make_grant(
        make_agent(), make_tool(), ("read", "update"), starts_at=now - timedelta(minutes=5)
    )
    reviews.review_campaign_open(
        kind="on_demand", reason="probe", opened_by=heidi, actor=Actor.user(heidi), at=now
    )
    item = ReviewItem.objects.get(grant=grant)
    reviewer = item.reviewer

    def revoke():
        grants.grant_revoke(
            grant_id=grant.pk,
            reason="compromised",
            actor=Actor.user(heidi),
            at=timezone.now(),
            revoked_by=heidi,
        )

    def decide():
        return reviews.review_item_decide(
            item_id=item.pk,
            reviewer=reviewer,
            decision=decision,
            comment="reviewed",
            actor=Actor.user(reviewer),
            at=timezone.now(),
            **({"actions": ["read"]} if decision == "narrow" else {}),
        )

    answer = _while_held(revoke, decide)
    item.refresh_from_db()
    assert isinstance(answer, Conflict) and answer.code == "grant_not_live", answer
    assert item.status == ReviewItem.Status.ENDED
    assert not AuditEvent.objects.filter(event_type=EventType.REVIEW_ITEM_DECIDED).exists()


@pytest.mark.django_db(transaction=True)
def test_two_due_rule_runs_at_once_close_each_ended_item_once(postgres_only, setup):
    """A backlog of hourly review_due messages run side by side (a prefork pool, two
    beats): items whose grants ended were closed by both runs, two events each. The
    claim filtered across the join to the grant, an UPDATE on `id IN (subquery)` that
    a waiting transaction does not re-check."""
    import json
    from collections import Counter

    from governance.services import grants

    heidi = setup["heidi"]
    now = timezone.now()
    made = [
        grants.grant_issue(
            agent=setup["agent"],
            tool=setup["tool"],
            actions=["read"],
            scope=f"repo:acme/r{i}/*",
            duration=timedelta(hours=1),
            justification="j",
            requested_by=setup["erin"],
            approved_by=setup["frank"],
            actor=Actor.system("t"),
            at=now - timedelta(minutes=5),
        )  # fmt: skip
        for i in range(30)
    ]
    reviews.review_campaign_open(
        kind="on_demand", reason="probe", opened_by=heidi, actor=Actor.user(heidi), at=now
    )
    for grant in made:
        grants.grant_revoke(
            grant_id=grant.pk, reason="gone", actor=Actor.user(heidi), at=now, revoked_by=heidi
        )
    run = partial(reviews.review_items_apply_due_rule, actor=Actor.system("job"), at=now)

    assert together(run, run) == [None, None]

    per_item = Counter(
        json.loads(data)["item_id"]
        for data in AuditEvent.objects.filter(event_type="review.item_due_rule").values_list(
            "data", flat=True
        )
    )
    assert sorted(per_item.values()) == [1] * 30
    assert set(ReviewItem.objects.values_list("status", flat=True)) == {"ended"}


@pytest.mark.django_db(transaction=True)
def test_the_due_rule_racing_a_persons_revoke_records_no_revoke_of_its_own(
    postgres_only, setup, monkeypatch
):
    """The item fell due undecided while an admin's revoke of its grant was being
    written: the run claimed the item, waited for the grant, found it revoked, changed
    nothing, and still recorded and announced "revoke applied". Now the item is closed
    as ended, with no notice of a revoke."""
    import threading
    import time

    from governance.models import Notification
    from governance.services import grants

    heidi = setup["heidi"]
    now = timezone.now()
    grant = grants.grant_issue(
        agent=setup["agent"], tool=setup["tool"], actions=["read"], scope="repo:acme/x/*",
        duration=timedelta(hours=1), justification="j", requested_by=setup["erin"],
        approved_by=setup["frank"], actor=Actor.system("t"), at=now - timedelta(minutes=5),
    )  # fmt: skip
    due = now + timedelta(seconds=2)
    reviews.review_campaign_open(
        kind="on_demand", reason="probe", opened_by=heidi, actor=Actor.user(heidi), at=now,
        due_at=due,
    )  # fmt: skip
    writing = threading.Event()
    withdraw = grants._withdraw_delegation

    def slow(*args, **kwargs):  # the revoke's rows written, its commit still to come
        out = withdraw(*args, **kwargs)
        writing.set()
        time.sleep(0.7)
        return out

    monkeypatch.setattr(grants, "_withdraw_delegation", slow)

    def admin() -> None:
        grants.grant_revoke(
            grant_id=grant.pk, reason="compromised", actor=Actor.user(heidi),
            at=due - timedelta(seconds=1), revoked_by=heidi,
        )  # fmt: skip

    def job() -> None:
        assert writing.wait(10)
        reviews.review_items_apply_due_rule(
            actor=Actor.system("job"), at=due + timedelta(seconds=2)
        )

    assert together(admin, job) == [None, None]

    item = ReviewItem.objects.get(grant=grant)
    assert (item.status, item.comment) == ("ended", "grant already ended")
    revokes = AuditEvent.objects.filter(event_type="grant.revoked", grant_id=grant.pk)
    assert [e.actor for e in revokes] == ["user:heidi"]
    (rule,) = AuditEvent.objects.filter(event_type="review.item_due_rule")
    assert '"rule":"ended"' in rule.data.replace(" ", "")
    assert not Notification.objects.filter(subject__contains="revoke applied").exists()
