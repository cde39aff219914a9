"""A Hypothesis state machine over the grant lifecycle: request, approve, deny, revoke,
time passing, the expiry job, break-glass (open, confirm closed), delegation and review
(keep / narrow / revoke). After every step it checks:

1. authorize() allows exactly when an independent reading of the rows finds a live
   grant (own window, not revoked, every ancestor live) covering the call: in particular
   never an allow without a live grant;
2. no grant the machine revoked, and none past its expiry, ever allows anything;
3. every transition wrote exactly the audit events it should (one per object changed,
   none for a refused call), and break-glass opens only when no other is live for the
   agent and tool and none awaits its review;
4. a delegated grant that is still active never exceeds its parent (actions, scope,
   expiry), and one whose parent was revoked is not active.

Each example runs inside a savepoint that is rolled back, so examples do not see each
other. Deterministic by default (CI says the same thing twice); set HYPOTHESIS_EXPLORE=1
to draw new examples.
"""

from __future__ import annotations

import os
from collections import Counter
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.contrib.auth.models import Group, User
from django.db import transaction
from hypothesis import HealthCheck
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from governance import roles
from governance.audit import Actor
from governance.errors import GovernanceError
from governance.models import AuditEvent, BreakGlass, Grant, ReviewItem
from governance.policy import authorize, pattern_within, scope_matches
from governance.services import agents, breakglass, grants, reviews, tools
from tests.conftest import NOW

SCOPES = ["repo:acme/api/*", "repo:acme/web/*", "repo:acme/api/docs/*"]
RESOURCES = ["repo:acme/api/x", "repo:acme/web/y", "repo:acme/api/docs/z"]
ACTIONS = ["read", "update"]
SYSTEM = Actor.system("machine")


def _live(grant: Grant, at: datetime, rows: dict[int, Grant]) -> bool:
    """An independent reading of DESIGN.md's liveness, from the rows alone."""
    if grant.status in ("pending", "denied") or grant.starts_at is None:
        return False
    assert grant.expires_at is not None
    if not (grant.starts_at <= at < grant.expires_at):
        return False
    if grant.revoked_at is not None and grant.revoked_at <= at:
        return False
    parent = rows.get(grant.delegated_from_id) if grant.delegated_from_id else None
    return parent is None or _live(parent, at, rows)


class LifecycleMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.savepoint = transaction.savepoint()
        self.now = NOW
        self.users = {}
        for name, group in [
            ("alice", None),
            ("bob", roles.APPROVERS),
            ("carol", roles.APPROVERS),
            ("erin", roles.APPROVERS),
            ("dave", roles.ADMINS),
        ]:
            user = User.objects.create_user(name, email=f"{name}@example.test")
            if group:
                user.groups.add(Group.objects.get_or_create(name=group)[0])
            self.users[name] = user
        at = NOW - timedelta(days=1)
        self.bot = agents.agent_create(name="bot", owner=self.users["alice"], actor=SYSTEM, at=at)
        self.sub = agents.agent_create(
            name="sub", owner=self.users["alice"], parent=self.bot, actor=SYSTEM, at=at
        )
        tools.tool_register(name="repo", kind="api", actions=ACTIONS, actor=SYSTEM, at=at)
        self.tool = tools.Tool.objects.get(name="repo")
        self.revoked: set[int] = set()
        self.seq = self._head()

    def teardown(self) -> None:
        transaction.savepoint_rollback(self.savepoint)

    # --- helpers -----------------------------------------------------------------------

    @staticmethod
    def _head() -> int:
        last = AuditEvent.objects.order_by("-seq").first()
        return last.seq if last else 0

    def expect(self, *pairs: tuple[str, int | None]) -> None:
        """The new audit events are exactly these (event type, grant id), once each."""
        new = AuditEvent.objects.filter(seq__gt=self.seq)
        got = Counter((e.event_type, e.grant_id) for e in new)
        assert got == Counter(pairs), (got, pairs)
        self.seq = self._head()

    def ids(self, **filters: Any) -> list[int]:
        return list(Grant.objects.filter(**filters).order_by("id").values_list("pk", flat=True))

    # --- rules -------------------------------------------------------------------------

    @rule(
        scope=st.sampled_from(SCOPES),
        actions=st.sampled_from([["read"], ["update"], ["read", "update"]]),
        hours=st.sampled_from([1, 4, 48]),
        delegable=st.booleans(),
    )
    def request(self, scope: str, actions: list[str], hours: int, delegable: bool) -> None:
        try:
            grant = grants.grant_request(
                agent=self.bot,
                tool=self.tool,
                actions=actions,
                scope=scope,
                duration=timedelta(hours=hours),
                justification="machine",
                requested_by=self.users["alice"],
                delegable=delegable,
                actor=SYSTEM,
                at=self.now,
            )
        except GovernanceError as exc:
            assert exc.code == "duplicate_request"
            return self.expect()
        self.expect(("grant.requested", grant.pk))

    @precondition(lambda self: self.ids(status="pending"))
    @rule(data=st.data(), approve=st.booleans())
    def decide(self, data: st.DataObject, approve: bool) -> None:
        gid = data.draw(st.sampled_from(self.ids(status="pending")))
        bob = self.users["bob"]
        if approve:
            grants.grant_approve(grant_id=gid, approver=bob, actor=Actor.user(bob), at=self.now)
            self.expect(("grant.issued", gid))
        else:
            grants.grant_deny(
                grant_id=gid, approver=bob, reason="no", actor=Actor.user(bob), at=self.now
            )
            self.expect(("grant.denied", gid))
        # Deciding again is refused and writes nothing.
        with pytest.raises(GovernanceError):
            grants.grant_approve(grant_id=gid, approver=bob, actor=Actor.user(bob), at=self.now)
        self.expect()

    @precondition(lambda self: self.ids(status__in=["pending", "active"]))
    @rule(data=st.data())
    def revoke(self, data: st.DataObject) -> None:
        gid = data.draw(st.sampled_from(self.ids(status__in=["pending", "active"])))
        ended = grants.grant_revoke(
            grant_id=gid, reason="machine", revoked_by=self.users["bob"], actor=SYSTEM, at=self.now
        )
        self.revoked.update(g.pk for g in ended)
        # The event says what the row now says: a started grant is revoked, a request
        # that never started is refused (denied).
        assert all(g.status == ("revoked" if g.starts_at else "denied") for g in ended)
        self.expect(*[(f"grant.{g.status}", g.pk) for g in ended])
        # Twice: nothing more happens.
        assert grants.grant_revoke(grant_id=gid, reason="again", actor=SYSTEM, at=self.now) == []
        self.expect()

    @rule(minutes=st.sampled_from([1, 30, 90, 600, 3000]))
    def tick(self, minutes: int) -> None:
        self.now += timedelta(minutes=minutes)

    @rule()
    def expiry_job(self) -> None:
        due = self.ids(status="active", expires_at__lte=self.now)
        assert grants.grants_expire(actor=SYSTEM, at=self.now) == len(due)
        assert grants.grants_expire(actor=SYSTEM, at=self.now) == 0
        self.expect(*[("grant.expired", g) for g in due])

    @rule(
        scope=st.sampled_from(SCOPES),
        minutes=st.sampled_from([30, 60]),
        opener=st.sampled_from(["carol", "bob"]),
    )
    def breakglass_open(self, scope: str, minutes: int, opener: str) -> None:
        carol = self.users[opener]
        # The rules, read from the rows: at most one live break-glass per agent and
        # tool (whoever opened it), and none while an earlier one awaits its review.
        live = [
            bg
            for bg in BreakGlass.objects.select_related("grant").filter(closed_at=None)
            if bg.expires_at > self.now
            and bg.grant.status == "active"
            and bg.grant.expires_at > self.now
        ]
        unreviewed = BreakGlass.objects.filter(review_status="pending").exists()
        try:
            bg = breakglass.breakglass_open(
                opener=carol,
                agent=self.bot,
                tool=self.tool,
                actions=["read", "update"],
                scope=scope,
                ticket=f"INC-{BreakGlass.objects.count() + 1}",
                reason="machine",
                ttl=timedelta(minutes=minutes),
                actor=Actor.user(carol),
                at=self.now,
            )
        except GovernanceError as exc:
            assert exc.code == ("breakglass_active" if live else "breakglass_unreviewed"), exc
            assert live or unreviewed
            return self.expect()  # refused: nothing written
        assert not live and not unreviewed
        assert bg.grant.break_glass
        self.expect(("breakglass.opened", bg.grant_id))
        again = breakglass.breakglass_open(
            opener=carol,
            agent=self.bot,
            tool=self.tool,
            actions=["read", "update"],
            scope=scope,
            ticket=bg.ticket,
            reason="machine",
            ttl=timedelta(minutes=minutes),
            actor=Actor.user(carol),
            at=self.now,
        )
        assert again.pk == bg.pk
        self.expect()  # the same break-glass asked for twice: still one
        with pytest.raises(GovernanceError) as other:
            breakglass.breakglass_open(
                opener=self.users["bob" if opener == "carol" else "carol"],
                agent=self.bot,
                tool=self.tool,
                actions=["read"],
                scope=scope,
                ticket=f"INC-{BreakGlass.objects.count() + 1}",
                reason="machine",
                actor=Actor.user(carol),
                at=self.now,
            )
        assert other.value.code == "breakglass_active"
        self.expect()  # someone else, at the same time: refused, nothing written

    @precondition(lambda self: BreakGlass.objects.filter(review_status="pending").exists())
    @rule(data=st.data())
    def breakglass_confirm(self, data: st.DataObject) -> None:
        pending = list(BreakGlass.objects.filter(review_status="pending").order_by("id"))
        bg = data.draw(st.sampled_from(pending))
        # Past its TTL it has expired (the job marks it): nothing is left to revoke.
        live_before = bg.grant.status == "active" and bg.grant.expires_at > self.now
        erin = self.users["erin"]
        bg = breakglass.breakglass_confirm_closed(
            breakglass_id=bg.pk, reviewer=erin, comment="over", actor=Actor.user(erin), at=self.now
        )
        revoked = [
            ("grant.revoked", g) for g in self.ids(status="revoked") if g not in self.revoked
        ]
        self.revoked.update(g for _, g in revoked)
        # The grant (and what was delegated from it) is revoked iff it was still active.
        assert bool(revoked) == live_before
        ended = Grant.objects.get(pk=bg.grant_id)
        assert ended.status != "active" or ended.expires_at <= self.now
        self.expect(("breakglass.confirmed_closed", bg.grant_id), *revoked)

    @precondition(lambda self: self.ids(status="active", delegable=True, delegated_from=None))
    @rule(data=st.data(), narrower=st.booleans(), minutes=st.sampled_from([20, 600]))
    def delegate(self, data: st.DataObject, narrower: bool, minutes: int) -> None:
        gid = data.draw(st.sampled_from(self.ids(status="active", delegable=True)))
        parent = Grant.objects.get(pk=gid)
        scope = parent.scope
        if narrower and parent.scope == "repo:acme/api/*":
            scope = "repo:acme/api/docs/*"
        try:
            child = grants.grant_delegate(
                parent_grant_id=gid,
                child=self.sub,
                actions=parent.actions[:1],
                scope=scope,
                expires_at=min(parent.expires_at, self.now + timedelta(minutes=minutes)),
                justification="machine",
                actor=SYSTEM,
                at=self.now,
            )
        except GovernanceError:
            return self.expect()  # parent not live (expired by time), or past its end
        self.expect(("grant.delegated", child.pk))

    @precondition(lambda self: self.ids(status="active", delegated_from=None, break_glass=False))
    @rule(data=st.data(), decision=st.sampled_from(["keep", "narrow", "revoke"]))
    def review(self, data: st.DataObject, decision: str) -> None:
        campaign = reviews.review_campaign_open(
            kind="on_demand", reason="machine", actor=SYSTEM, at=self.now
        )
        items = list(campaign.items.select_related("grant", "reviewer").order_by("id"))
        self.expect(("review.campaign_opened", None))
        if not items:
            return
        item = data.draw(st.sampled_from(items))
        grant = item.grant
        kwargs: dict[str, Any] = {}
        if decision == "narrow":
            kwargs["actions"] = grant.actions[:1]
            if grant.scope == "repo:acme/api/*":
                kwargs["scope"] = "repo:acme/api/docs/*"
        before = set(self.ids(status="active"))
        try:
            reviews.review_item_decide(
                item_id=item.pk,
                reviewer=item.reviewer,
                decision=decision,
                comment="machine",
                actor=Actor.user(item.reviewer),
                at=self.now,
                **kwargs,
            )
        except GovernanceError as exc:
            assert exc.code == "grant_not_live"  # narrowing a grant already past its end
            return self.expect()
        ended = sorted(before - set(self.ids(status="active")))
        self.revoked.update(ended)
        expected = [("review.item_decided", grant.pk), *[("grant.revoked", g) for g in ended]]
        if decision == "narrow" and (kwargs["actions"] != grant.actions or "scope" in kwargs):
            expected.append(("grant.narrowed", grant.pk))
        self.expect(*expected)
        assert ReviewItem.objects.get(pk=item.pk).status != "pending"

    # --- invariants ----------------------------------------------------------------------

    @invariant()
    def decisions_match_the_rows(self) -> None:
        rows = {g.pk: g for g in Grant.objects.all()}
        for agent in ("bot", "sub"):
            for action in ACTIONS:
                for resource in RESOURCES:
                    decision = authorize(
                        agent=agent, tool="repo", action=action, scope=resource, at=self.now
                    )
                    covering = [
                        g
                        for g in rows.values()
                        if g.agent.name == agent
                        and action in g.actions
                        and scope_matches(g.scope, resource)
                        and _live(g, self.now, rows)
                    ]
                    assert decision.allowed == bool(covering), (agent, action, resource, decision)
                    if decision.allowed:
                        used = rows[decision.grant_id]
                        assert used in covering
                        assert used.pk not in self.revoked
                        assert used.expires_at > self.now
                        assert decision.break_glass == used.break_glass

    @invariant()
    def revoked_grants_stay_ended(self) -> None:
        statuses = dict(Grant.objects.filter(pk__in=self.revoked).values_list("pk", "status"))
        assert all(s in ("revoked", "denied") for s in statuses.values()), statuses

    @invariant()
    def delegations_never_exceed_their_parent(self) -> None:
        for child in Grant.objects.filter(delegated_from__isnull=False).select_related(
            "delegated_from"
        ):
            parent = child.delegated_from
            if parent.status == "revoked":
                assert child.status != "active", (child.pk, parent.pk)
            if child.status != "active":
                continue
            assert set(child.actions) <= set(parent.actions)
            assert child.scope == parent.scope or pattern_within(child.scope, parent.scope)
            assert child.expires_at <= parent.expires_at


def test_the_grant_lifecycle_keeps_its_invariants(db, settings):
    settings.BREAKGLASS_OPENS_CAMPAIGN = False  # campaigns are driven by the review rule
    settings.BREAKGLASS_MAX_PER_HOUR = 1000
    settings.NOTIFY_WEBHOOK_URLS = []
    run_state_machine_as_test(
        LifecycleMachine,
        settings=hsettings(
            max_examples=int(os.environ.get("LIFECYCLE_MAX_EXAMPLES", "30")),
            stateful_step_count=25,
            deadline=None,
            database=None,
            derandomize=not os.environ.get("HYPOTHESIS_EXPLORE"),
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
