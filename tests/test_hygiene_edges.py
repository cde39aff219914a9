"""Edges of the unused-grant rule, usage folding and re-certification that the mutation
run of services/hygiene.py, services/usage.py and services/reviews.py
(/tmp/scratch_hygiene) left untested: each test fails on the mutant named in its
docstring. Everything goes through the real services; each outcome is checked in its
answer, the rows and its audit events."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from governance.audit import Actor
from governance.codes import EventType
from governance.models import AuditEvent, Grant
from governance.services import access, hygiene, reviews
from governance.services.usage import usage_fold
from tests.conftest import NOW

H = timedelta(hours=1)


def events(event_type: str, **filters: object) -> list[AuditEvent]:
    return list(AuditEvent.objects.filter(event_type=event_type, **filters).order_by("seq"))


def use(grant: Grant, action: str, at) -> None:
    decision = access.access_check(
        agent=grant.agent.name, tool=grant.tool.name, action=action, scope="repo:acme/api/x",
        at=at,
    )  # fmt: skip
    assert decision.allowed, decision
    assert AuditEvent.objects.get(uid=decision.decision_id).event_type == "access.allowed"


def open_campaign(at=NOW, **kw):
    kw.setdefault("kind", "on_demand")
    kw.setdefault("reason", "hygiene edges")
    return reviews.review_campaign_open(actor=Actor.system("test"), at=at, **kw)


def decide(item, decision, *, reviewer=None, at=NOW, comment="checked", **kw):
    reviewer = reviewer or item.reviewer
    return reviews.review_item_decide(
        item_id=item.pk, reviewer=reviewer, decision=decision, comment=comment,
        actor=Actor.user(reviewer), at=at, **kw,
    )  # fmt: skip


@pytest.fixture
def idle_world(make_agent, make_tool, settings, approvers):
    """A day's idleness makes a right unused; grants from T0, three days before NOW;
    erin, frank, grace approve and heidi is an admin (bob approved every grant)."""
    settings.GRANT_MAX_TTL = timedelta(days=60)
    settings.UNUSED_GRANT_HOURS = 24
    return {"agent": make_agent("bot"), "tool": make_tool("repo"), "t0": NOW - timedelta(days=3)}


def long_grant(idle_world, make_grant, actions):
    return make_grant(idle_world["agent"], idle_world["tool"], actions=actions,
                      starts_at=idle_world["t0"], duration=timedelta(days=20))  # fmt: skip


# --- the unused rule --------------------------------------------------------------------


def test_a_grant_used_while_the_scan_reads_is_not_flagged_and_the_scan_goes_on(
    idle_world, make_grant, system, monkeypatch
):
    """A real bug: the scan reads the uses since the cutoff, then each candidate's last
    uses in a second query. A fold committing between the two (the minutely beat, while
    a scan of many grants runs) made a candidate busy; it was returned anyway, with
    none of its idle attributes, and the flag job failed on it (PartlyFailed; before
    flagging anyone when it had been flagged before). The grant used meanwhile is not
    idle; the other idle grant is flagged, and the job ends normally."""
    from governance import selectors

    busy = long_grant(idle_world, make_grant, ("read", "update"))
    idle = make_grant(idle_world["agent"], idle_world["tool"], scope="repo:acme/web/*",
                      starts_at=idle_world["t0"], duration=timedelta(days=20))  # fmt: skip
    use(busy, "read", NOW - H)
    real = selectors._action_uses

    def used_meanwhile(pks):
        # The agent updates through the busy grant and a fold commits, between the scan's
        # read of the uses since the cutoff and this read of the candidates' last uses.
        use(busy, "update", NOW - H)
        assert usage_fold() == 1
        return real(pks)

    monkeypatch.setattr(selectors, "_action_uses", used_meanwhile)
    assert hygiene.grants_flag_unused(actor=system, at=NOW) == 1
    (event,) = events(EventType.GRANT_UNUSED_FLAGGED)
    data = json.loads(event.data)
    assert (event.grant_id, data["proposal"], data["idle_actions"]) == (idle.pk, "remove", ["read"])
    flags = dict(Grant.objects.values_list("pk", "unused_flagged_at"))
    assert flags == {busy.pk: None, idle.pk: NOW}
