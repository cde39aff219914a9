"""PostgreSQL: the audit chain lock is the last lock a transaction takes.

Found by the fuzzer as a 503: one transaction created an agent (a deferred
foreign-key check on its owner, run at COMMIT) and appended its event (chain
lock); another locked that owner's row and then waited for the chain lock.
At the first one's COMMIT the key check waited for the second: a deadlock.
Real threads, real locks, real deadlock detector; no mocks.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connection, transaction

from governance import audit
from governance.models import Agent
from tests.conftest import NOW

pytestmark = pytest.mark.django_db(transaction=True)


def each_in_a_thread(*calls: Callable[[], Any]) -> list[BaseException]:
    """Run each call in a thread of its own (its own connection); what they raised."""
    errors: list[BaseException] = []

    def run(call: Callable[[], Any]) -> None:
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(call,)) for call in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return errors


def _event(label: str) -> None:
    audit.append(event_type="agent.created", actor=audit.Actor.system(label), at=NOW)


@pytest.mark.parametrize("no_key", [False, True], ids=["for-update", "for-no-key-update"])
def test_a_deferred_key_check_never_waits_under_the_chain_lock(postgres_only, no_key):
    owner = User.objects.create_user("owner")
    appended = threading.Event()
    errors: list[BaseException] = []

    def creator() -> None:
        """Inserts a row referencing `owner` (checked at COMMIT), appends, then commits
        while the locker is already queued on the chain lock."""
        try:
            with transaction.atomic():
                Agent.objects.create(name="made-under-lock", owner_id=owner.pk)
                _event("creator")
                appended.set()
                time.sleep(0.5)  # the locker now holds the owner's row and waits
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            appended.set()
        finally:
            connection.close()

    def locker() -> None:
        try:
            appended.wait(timeout=10)
            with transaction.atomic():
                User.objects.select_for_update(no_key=no_key).get(pk=owner.pk)
                _event("locker")
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=creator), threading.Thread(target=locker)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    assert Agent.objects.filter(name="made-under-lock").exists()
    assert audit.verify_chain().ok
    assert timedelta(seconds=time.monotonic() - started) < timedelta(seconds=20)


# --- Services that end grants write their events last ----------------------------------------
# Each race: B revokes one grant (row-locked, then held a moment, as any slow request
# would), while A runs a service that also ends or changes that grant. If A appended its
# event (the chain lock) before locking the grant's row, A would wait for B's row and B
# for A's chain lock: PostgreSQL's deadlock detector would abort one of them (a revoke
# lost, a 503), and every decision in the system would wait meanwhile.


def _threads(a: Any, b: Any) -> dict[str, BaseException | None]:
    """Run a as thread A and b as thread B, each on its own connection; what each raised."""
    out: dict[str, BaseException | None] = {}

    def run(name: str, fn: Any) -> None:
        try:
            fn()
            out[name] = None
        except BaseException as exc:  # noqa: BLE001 - reported below
            out[name] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(n, f), name=n) for n, f in (("A", a), ("B", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return out


def _both(monkeypatch: pytest.MonkeyPatch, a: Any, b: Any) -> dict[str, BaseException | None]:
    """B row-locks its grant and holds it a second; A starts once B holds it."""
    from governance.services import grants

    locked = threading.Event()
    real = grants._descendants

    def held(ids: list[int]) -> Any:
        found = real(ids)
        if threading.current_thread().name == "B":
            locked.set()
            time.sleep(1.0)
        return found

    def after_b_locked() -> None:
        assert locked.wait(10)
        a()

    monkeypatch.setattr(grants, "_descendants", held)
    return _threads(after_b_locked, b)


def _revoke(grant_id: int) -> Any:
    from governance.services import grants

    return lambda: grants.grant_revoke(
        grant_id=grant_id, reason="admin", actor=audit.Actor.system("b"), at=NOW + LATER
    )


LATER = timedelta(minutes=1)


def _assert_both_done(out: dict[str, BaseException | None], *grant_ids: int) -> None:
    from governance.models import Grant

    assert out == {"A": None, "B": None}, out
    assert set(Grant.objects.filter(pk__in=grant_ids).values_list("status", flat=True)) == {
        "revoked"
    }
    assert audit.verify_chain().ok


def test_narrowing_a_parent_while_its_child_is_revoked(
    postgres_only, monkeypatch, make_agent, make_tool, make_grant
):
    from governance.services import grants

    bot = make_agent("bot")
    sub = make_agent("sub", parent=bot)
    parent = make_grant(bot, make_tool(), scope="repo:acme/api/*", delegable=True)
    child = grants.grant_delegate(
        parent_grant_id=parent.pk, child=sub, actions=["read"], scope="repo:acme/api/x/*",
        expires_at=parent.expires_at, justification="j", actor=audit.Actor.system("t"), at=NOW,
    )  # fmt: skip

    def narrow() -> None:
        grants.grant_narrow(
            grant_id=parent.pk, scope="repo:acme/api/y/*", reason="review",
            actor=audit.Actor.system("a"), at=NOW + LATER,
        )  # fmt: skip

    _assert_both_done(_both(monkeypatch, narrow, _revoke(child.pk)), child.pk)


def test_closing_a_task_while_its_grant_is_revoked(
    postgres_only, monkeypatch, make_agent, make_tool, make_grant, make_task
):
    from governance.services import tasks

    task = make_task("T-1")
    granted = make_grant(make_agent(), make_tool(), task=task)

    def close() -> None:
        tasks.task_close(task=task, actor=audit.Actor.system("a"), at=NOW + LATER)

    _assert_both_done(_both(monkeypatch, close, _revoke(granted.pk)), granted.pk)


def test_closing_a_task_while_an_approval_of_a_call_under_it_is_decided(
    postgres_only, monkeypatch, make_agent, make_tool, make_grant, make_task, bob
):
    """B approves a call made under T-1 (a grant bound to no task): it holds the
    approval's row a second, then appends. A closes T-1 meanwhile, which voids that
    approval and revokes the task's own grant. Had A voided after its revokes' events
    (the chain lock), A would wait for B's row and B for A's chain lock: a deadlock.
    A waits for B instead, then voids what B approved."""
    from governance.models import Approval, AuditEvent
    from governance.services import access, approvals, tasks

    bot, repo = make_agent("bot"), make_tool("repo")
    task = make_task("T-1")
    make_grant(bot, repo, ("delete",), "repo:acme/*", duration=timedelta(hours=5))
    bound = make_grant(bot, make_tool("db"), ("read",), "db:acme/*", task=task)
    asked = access.access_check(
        agent="bot", tool="repo", action="delete", scope="repo:acme/x", task="T-1", at=NOW
    )
    gated = Approval.objects.get(pk=asked.approval_id).grant_id
    held = threading.Event()
    real = approvals.stakeholders  # called with the approval's row locked

    def slow(*args: Any, **kwargs: Any) -> Any:
        found = real(*args, **kwargs)
        if threading.current_thread().name == "B":
            held.set()
            time.sleep(1.0)
        return found

    monkeypatch.setattr(approvals, "stakeholders", slow)
    at = NOW + timedelta(seconds=1)

    def close() -> None:
        assert held.wait(10)
        tasks.task_close(task=task, actor=audit.Actor.system("a"), at=at)

    def approve() -> None:
        approvals.approval_approve(
            approval_id=asked.approval_id, approver=bob, actor=audit.Actor.user(bob), at=at
        )

    out = _threads(close, approve)
    assert out == {"A": None, "B": None}, out
    assert Approval.objects.get(pk=asked.approval_id).status == "expired"
    newest = list(AuditEvent.objects.order_by("-seq")[:3])
    assert [(e.event_type, e.grant_id) for e in newest] == [
        ("task.closed", None), ("grant.revoked", bound.pk), ("approval.approved", gated),
    ]  # fmt: skip
    assert json.loads(newest[0].data)["approvals_voided"] == 1
    assert audit.verify_chain().ok


def test_confirming_break_glass_closed_while_its_grant_is_revoked(
    postgres_only, monkeypatch, make_agent, make_tool, approvers, settings
):
    from governance.services import breakglass

    settings.BREAKGLASS_OPENS_CAMPAIGN = False
    erin, frank, *_ = approvers
    opened = breakglass.breakglass_open(
        opener=erin, agent=make_agent(), tool=make_tool(), actions=["read"],
        scope="repo:acme/api/*", ticket="INC-1", reason="r", actor=audit.Actor.user(erin), at=NOW,
    )  # fmt: skip

    def confirm() -> None:
        breakglass.breakglass_confirm_closed(
            breakglass_id=opened.pk, reviewer=frank, comment="over",
            actor=audit.Actor.user(frank), at=NOW + LATER,
        )  # fmt: skip

    _assert_both_done(_both(monkeypatch, confirm, _revoke(opened.grant_id)), opened.grant_id)


def test_opening_break_glass_with_its_campaign_while_a_used_grant_is_revoked(
    postgres_only, monkeypatch, make_agent, make_tool, make_grant, approvers, settings
):
    """The incident campaign folds usage (an UPDATE of the used grant's row)."""
    from governance.services import access, breakglass

    settings.BREAKGLASS_OPENS_CAMPAIGN = True
    erin, *_ = approvers
    bot, tool = make_agent("bot"), make_tool()
    used = make_grant(bot, tool)
    call = dict(agent="bot", tool="repo", action="read", scope="repo:acme/api/x", at=NOW)
    assert access.access_check(**call).allowed  # one use, not folded yet

    def open_glass() -> None:
        breakglass.breakglass_open(
            opener=erin, agent=bot, tool=tool, actions=["read"], scope="repo:acme/other/*",
            ticket="INC-9", reason="r", actor=audit.Actor.user(erin), at=NOW + LATER,
        )  # fmt: skip

    _assert_both_done(_both(monkeypatch, open_glass, _revoke(used.pk)), used.pk)


# --- A decision that read the state just before a revoke committed ---------------------------


@pytest.mark.parametrize("kill", ["revoke", "suspend"])
def test_a_decision_that_waited_out_a_revoke_is_made_again(
    postgres_only, monkeypatch, make_agent, make_tool, make_grant, kill
):
    """B revokes (or suspends) and, holding the chain lock, takes a second to commit. A
    decides meanwhile: its read sees the grant still live, then it waits for the chain
    lock. Once B commits, A's event would land after B's and its allow reach the agent
    after the revocation. Instead its append is refused and A decides again: a deny."""
    from governance.services import access, agents, grants

    bot = make_agent("bot")
    granted = make_grant(bot, make_tool())
    killed_at = NOW + LATER
    appended = threading.Event()
    real = audit.append

    def slow(**kwargs: Any) -> Any:
        written = real(**kwargs)
        if threading.current_thread().name == "B":
            appended.set()
            time.sleep(1.0)  # B's change and event are written, not yet committed
        return written

    monkeypatch.setattr(audit, "append", slow)
    result: dict[str, Any] = {}

    def kill_it() -> None:
        actor = audit.Actor.system("b")
        if kill == "revoke":
            grants.grant_revoke(grant_id=granted.pk, reason="incident", actor=actor, at=killed_at)
        else:
            agents.agent_suspend(agent=bot, reason="incident", actor=actor, at=killed_at)

    def decide() -> None:
        assert appended.wait(10)
        result["d"] = access.access_check(
            agent="bot", tool="repo", action="read", scope="repo:acme/api/x",
            at=killed_at + timedelta(seconds=1),
        )  # fmt: skip

    out = _threads(decide, kill_it)
    assert out == {"A": None, "B": None}, out
    decision = result["d"]
    assert not decision.allowed
    assert decision.reason == ("grant_revoked" if kill == "revoke" else "agent_suspended")
    from governance.models import AuditEvent

    newest = list(AuditEvent.objects.order_by("-seq")[:2])
    assert [e.event_type for e in newest] == [
        "access.denied",
        "grant.revoked" if kill == "revoke" else "agent.suspended",
    ]
    assert str(newest[0].uid) == decision.decision_id and newest[0].reason == decision.reason
    assert audit.verify_chain().ok


def test_delegating_to_a_subagent_while_break_glass_opens_for_it_never_deadlocks(
    postgres_only, make_agent, make_tool, make_grant, alice, monkeypatch
):
    """Break-glass locks the agent's row, then its incident campaign folds usage into
    grant rows (the parent's, if used since the last fold). Delegating locked the parent
    grant and then the subagent's row: the opposite order, a deadlock the database broke
    by failing the delegation. Both now take the agent before the grant. Break-glass
    can no longer open for a subagent (no grant of its own), so it opens here for the
    parent, whose grant the fold and the delegation both lock: the two still meet on
    that row, and neither may fail."""
    from django.utils import timezone

    from governance.audit import Actor
    from governance.models import Grant
    from governance.services import access, breakglass, grants, reviews

    parent_agent = make_agent("parent")
    child = make_agent("child", parent=parent_agent)
    repo, other = make_tool("repo"), make_tool("other")
    parent = make_grant(
        parent_agent, repo, ("read",), "repo:acme/*", delegable=True,
        starts_at=timezone.now() - timedelta(minutes=5),
    )  # fmt: skip
    used = access.access_check(
        agent="parent", tool="repo", action="read", scope="repo:acme/x", at=timezone.now()
    )
    assert used.allowed  # a use of the parent grant that no fold has counted yet
    real_fold, agent_held = reviews.usage_fold, threading.Event()

    def slow_fold(**kw: Any) -> Any:
        agent_held.set()  # break-glass holds the subagent's row now
        time.sleep(0.7)  # the delegation starts meanwhile
        return real_fold(**kw)

    monkeypatch.setattr(reviews, "usage_fold", slow_fold)

    def open_breakglass() -> None:
        breakglass.breakglass_open(
            opener=alice, agent=parent_agent, tool=other, actions=["read"], scope="x:y/*",
            ticket="INC-1", reason="incident", actor=Actor.user(alice), at=timezone.now(),
        )  # fmt: skip

    def delegate() -> None:
        assert agent_held.wait(10)
        grants.grant_delegate(
            parent_grant_id=parent.pk, child=child, actions=["read"],
            scope="repo:acme/api/*", expires_at=parent.expires_at, justification="j",
            actor=Actor.agent(parent_agent), at=timezone.now(),
        )  # fmt: skip

    assert each_in_a_thread(open_breakglass, delegate) == []
    assert Grant.objects.filter(delegated_from=parent, agent=child).count() == 1
    assert audit.verify_chain().ok


def test_approving_a_request_while_break_glass_opens_on_its_task_never_deadlocks(
    postgres_only, make_agent, make_tool, make_task, alice, bob, monkeypatch
):
    """Break-glass holds the agent's row and then the task's; approving a request bound to
    that task holds the agent's row too now (a suspension committing meanwhile is seen).
    Taken after the task, that was the opposite order, a deadlock the database broke by
    failing one of them. Both take the agent first."""
    from django.utils import timezone

    from governance.audit import Actor
    from governance.models import Grant
    from governance.services import breakglass, grants

    agent, repo, other = make_agent("bot"), make_tool("repo"), make_tool("other")
    task = make_task("INC-TASK", at=timezone.now() - timedelta(hours=1))
    request = grants.grant_request(
        agent=agent, tool=repo, actions=["read"], scope="repo:acme/*", task=task,
        duration=timedelta(hours=1), justification="j", requested_by=alice,
        actor=Actor.user(alice), at=timezone.now(),
    )  # fmt: skip
    real_check, agent_held = breakglass.require_open_task, threading.Event()

    def slow_check(task_id: Any, at: Any) -> None:
        agent_held.set()  # break-glass holds the agent's row, not yet the task's
        time.sleep(0.7)  # the approval starts meanwhile
        real_check(task_id, at)

    monkeypatch.setattr(breakglass, "require_open_task", slow_check)

    def open_breakglass() -> None:
        breakglass.breakglass_open(
            opener=alice, agent=agent, tool=other, actions=["read"], scope="x:y/*",
            task=task, ticket="INC-1", reason="incident", actor=Actor.user(alice),
            at=timezone.now(),
        )  # fmt: skip

    def approve() -> None:
        assert agent_held.wait(10)
        grants.grant_approve(
            grant_id=request.pk, approver=bob, actor=Actor.user(bob), at=timezone.now()
        )

    assert each_in_a_thread(open_breakglass, approve) == []
    assert Grant.objects.get(pk=request.pk).status == Grant.Status.ACTIVE
    assert audit.verify_chain().ok


# --- A suspension racing a resume is decided in order ------------------------------------


def _slow_appends_in_b(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Thread B's every event is written, then held a second before B goes on (and
    commits): its rows are changed and locked meanwhile. Set once B wrote one."""
    appended = threading.Event()
    real = audit.append

    def slow(**kwargs: Any) -> Any:
        written = real(**kwargs)
        if threading.current_thread().name == "B":
            appended.set()
            time.sleep(1.0)
        return written

    monkeypatch.setattr(audit, "append", slow)
    return appended


def _family(make_agent: Any) -> tuple[Agent, Agent]:
    """parent active; child suspended on its own (an incident of its own)."""
    from governance.services import agents

    parent = make_agent("parent")
    child = make_agent("child", parent=parent)
    agents.agent_suspend(agent=child, reason="own incident", actor=audit.Actor.system("x"), at=NOW)
    return parent, child


def test_a_resume_that_waited_out_a_suspension_above_it_is_refused(
    postgres_only, monkeypatch, make_agent
):
    """B suspends the parent (which reaches the suspended child's row too) and takes a
    second to commit; A resumes the child meanwhile. A's read of the parent would see
    it still active; its row lock on the child makes it wait for B, then read the parent
    suspended: 409 parent_suspended, nothing written. Never an active agent under a
    suspended one."""
    from governance.errors import Conflict
    from governance.models import AuditEvent
    from governance.services import agents

    parent, child = _family(make_agent)
    appended = _slow_appends_in_b(monkeypatch)

    def suspend_parent() -> None:
        agents.agent_suspend(
            agent=parent, reason="incident", actor=audit.Actor.system("b"), at=NOW + LATER
        )

    def resume_child() -> None:
        assert appended.wait(10)
        agents.agent_resume(
            agent=child, reason="cleared", actor=audit.Actor.system("a"), at=NOW + 2 * LATER
        )

    out = _threads(resume_child, suspend_parent)
    assert out["B"] is None, out
    assert isinstance(out["A"], Conflict) and out["A"].code == "parent_suspended", out
    assert dict(Agent.objects.values_list("name", "status")) == {
        "parent": "suspended",
        "child": "suspended",
    }
    assert not AuditEvent.objects.filter(event_type="agent.reactivated").exists()
    assert audit.verify_chain().ok


def test_a_suspension_that_waited_out_a_resume_suspends_the_agent_again(
    postgres_only, monkeypatch, make_agent
):
    """B resumes the child and takes a second to commit; A suspends the parent
    meanwhile, waits for the child's row, then suspends it again: the child ends
    suspended, and the log says so in that order (resume, then both suspensions)."""
    from governance.models import AuditEvent
    from governance.services import agents, reports

    parent, child = _family(make_agent)
    appended = _slow_appends_in_b(monkeypatch)
    seq = AuditEvent.objects.order_by("-seq").values_list("seq", flat=True).first()

    def resume_child() -> None:
        agents.agent_resume(
            agent=child, reason="cleared", actor=audit.Actor.system("b"), at=NOW + LATER
        )

    def suspend_parent() -> None:
        assert appended.wait(10)
        agents.agent_suspend(
            agent=parent, reason="incident", actor=audit.Actor.system("a"), at=NOW + 2 * LATER
        )

    out = _threads(suspend_parent, resume_child)
    assert out == {"A": None, "B": None}, out
    assert dict(Agent.objects.values_list("name", "status")) == {
        "parent": "suspended",
        "child": "suspended",
    }
    events = AuditEvent.objects.filter(seq__gt=seq).order_by("seq")
    assert [(e.event_type, e.agent) for e in events] == [
        ("agent.reactivated", "child"),
        ("agent.suspended", "parent"),
        ("agent.suspended", "child"),
    ]
    past = reports.state_at(NOW + 2 * LATER)
    assert past.suspended_agents == {parent.pk, child.pk}
    assert reports.state_at(NOW + LATER).suspended_agents == set()
    assert audit.verify_chain().ok
