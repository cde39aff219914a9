"""Edges of access_check() and of the sandbox's bookkeeping that mutation testing found
unpinned: each test fails on one small wrong change to services/access.py or
services/sandbox.py (a flipped comparison, a dropped filter) and checks the answer,
its audit event and the rows. Sandbox runs here are only asked for and recorded,
through the real services: no engine, no bubblewrap."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from governance.audit import Actor
from governance.errors import Conflict
from governance.models import AuditEvent, SandboxRun
from governance.services import sandbox
from sandbox_runner.egress import EgressDecision
from tests.sandbox_world import events_of, spec

SYSTEM = Actor.system("test")


def decision_event(decision_id: str | None) -> AuditEvent:
    return AuditEvent.objects.get(uid=decision_id)


# --- run_request: the grant is the ceiling, egress included ------------------------------


@pytest.mark.parametrize("wanted", ["evil.example.net:443", "api.example.com"])
def test_a_run_asking_for_egress_the_grant_does_not_name_is_denied_on_record(coder, wanted):
    """The egress ceiling is the grant's list, not the run's own request; an entry that
    is no destination at all is refused the same way (not as an internal error)."""
    asked = spec(egress=(wanted,))
    auth = sandbox.run_request(spec=asked, at=timezone.now())
    assert (auth.outcome, auth.reason) == ("deny", "limit_exceeds_grant")
    assert auth.limits is None and auth.egress == ()
    event = decision_event(auth.decision_id)
    assert (event.event_type, event.reason, event.grant_id) == (
        "access.denied",
        "limit_exceeds_grant",
        coder.grant.pk,
    )
    record = SandboxRun.objects.get(run_id=asked.run_id)
    assert (record.status, record.reason) == ("denied", "limit_exceeds_grant")
    assert [e.event_type for e in events_of(asked.run_id)] == [
        "sandbox.run.requested",
        "sandbox.run.denied",
    ]


def test_an_allowed_run_records_the_grants_egress_and_reports_against_it(coder):
    """A run that does not narrow the list gets the grant's; an allowed attempt there is
    logged allowed, one anywhere else is refused and not logged at all."""
    asked = spec()
    auth = sandbox.run_request(spec=asked, at=timezone.now())
    assert auth.outcome == "allow"
    assert [str(d) for d in auth.egress] == ["api.example.com:443"]
    record = SandboxRun.objects.get(run_id=asked.run_id)
    assert (record.status, record.egress) == ("requested", ["api.example.com:443"])
    now = timezone.now()
    sandbox.run_started(
        run_id=asked.run_id,
        container_id="bwrap-1",
        image_digest="",
        deadline=now.timestamp() + 30,
        enforcement={"pids": "cgroup"},
        at=now,
    )
    sandbox.egress_attempt(
        run_id=asked.run_id,
        decision=EgressDecision(True, "allowed", "API.example.com", 443, "127.0.0.1"),
        at=now,
    )
    allowed = events_of(asked.run_id)[-1]
    assert (allowed.event_type, allowed.decision, allowed.reason) == (
        "sandbox.egress.allowed",
        "allow",
        "egress_allowed",
    )
    assert json.loads(allowed.data)["destination"] == "API.example.com:443"
    before = AuditEvent.objects.count()
    for host, port in (("evil.example.net", 443), ("api.example.com", 80), ("bad host", 1)):
        with pytest.raises(Conflict) as refused:
            sandbox.egress_attempt(
                run_id=asked.run_id,
                decision=EgressDecision(True, "allowed", host, port, "127.0.0.1"),
                at=now,
            )
        assert refused.value.code == "egress_not_in_grant"
    assert AuditEvent.objects.count() == before
    # A denied attempt anywhere is logged, as denied.
    sandbox.egress_attempt(
        run_id=asked.run_id,
        decision=EgressDecision(False, "not_allowlisted", "evil.example.net", 443, None),
        at=now,
    )
    denied = events_of(asked.run_id)[-1]
    assert (denied.event_type, denied.decision, denied.reason) == (
        "sandbox.egress.denied",
        "deny",
        "egress_not_allowlisted",
    )


def test_an_execute_grant_on_a_tool_that_is_not_code_execution_starts_no_sandbox(
    make_agent, make_tool, make_grant
):
    """A live execute grant on a pipeline trigger is no licence to run code: only a
    code-execution tool's grant allows a sandbox run (its kind is checked, not its name)."""
    bot = make_agent("coder")
    trigger = make_tool("ci-trigger", actions=("execute",), kind="api")
    grant = make_grant(
        bot, trigger, ("execute",), "sandbox:*", starts_at=timezone.now() - timedelta(minutes=5)
    )
    asked = spec(tool="ci-trigger", task=None)
    auth = sandbox.run_request(spec=asked, at=timezone.now())
    assert (auth.outcome, auth.reason, auth.limits) == ("deny", "not_code_exec_tool", None)
    event = decision_event(auth.decision_id)
    assert (event.event_type, event.reason, event.grant_id) == (
        "access.denied",
        "not_code_exec_tool",
        grant.pk,
    )
    record = SandboxRun.objects.get(run_id=asked.run_id)
    assert (record.status, record.reason) == ("denied", "not_code_exec_tool")
    assert [e.event_type for e in events_of(asked.run_id)] == [
        "sandbox.run.requested",
        "sandbox.run.denied",
    ]


# --- run_finished / run_reaped / reap_reason: each closes a run once ---------------------


def _allowed_run(coder: Any) -> str:
    asked = spec()
    assert sandbox.run_request(spec=asked, at=timezone.now()).allowed
    return asked.run_id


def test_a_finish_report_for_a_run_the_reaper_took_changes_nothing(coder):
    run_id = _allowed_run(coder)
    now = timezone.now()
    reaped = sandbox.run_reaped(run_id=run_id, why="deadline", actor=SYSTEM, at=now)
    assert reaped is not None and (reaped.status, reaped.timed_out) == ("reaped", True)
    event = events_of(run_id)[-1]
    assert event.event_type == "sandbox.run.reaped"
    assert json.loads(event.data)["why"] == "deadline"
    before = AuditEvent.objects.count()
    stream = {"excerpt": "", "sha256": "0" * 64, "bytes": 0, "truncated": False}
    summary = {"exit_code": 0, "timed_out": False, "oom_killed": False}
    assert (
        sandbox.run_finished_summary(
            run_id=run_id, summary={**summary, "stdout": stream, "stderr": stream}, at=now
        )
        is None
    )
    record = SandboxRun.objects.get(run_id=run_id)
    assert (record.status, record.exit_code, record.timed_out) == ("reaped", None, True)
    assert AuditEvent.objects.count() == before


def test_a_run_reaped_for_another_reason_than_its_deadline_did_not_time_out(coder):
    run_id = _allowed_run(coder)
    reaped = sandbox.run_reaped(run_id=run_id, why="grant_revoked", actor=SYSTEM, at=timezone.now())
    assert reaped is not None and (reaped.status, reaped.timed_out) == ("reaped", False)
    assert SandboxRun.objects.get(run_id=run_id).error == "killed by the reaper: grant_revoked"
    assert json.loads(events_of(run_id)[-1].data)["why"] == "grant_revoked"


def test_a_sandbox_dies_at_the_very_instant_of_its_deadline(coder):
    run_id = _allowed_run(coder)
    at = timezone.now()
    assert sandbox.reap_reason(run_id=run_id, deadline=at.timestamp(), at=at) == "deadline"
    assert sandbox.reap_reason(run_id=run_id, deadline=at.timestamp() + 1, at=at) is None
    # A container of no recorded run dies at its deadline too, and not before.
    stray = str(uuid.uuid4())
    assert sandbox.reap_reason(run_id=stray, deadline=at.timestamp(), at=at) == "deadline"
    assert sandbox.reap_reason(run_id=stray, deadline=at.timestamp() + 1, at=at) is None


# --- access_check: a caller's refusal comes before the gate --------------------------------


def test_a_call_refused_for_its_revoked_token_neither_names_nor_uses_its_approval(
    make_agent, make_tool, make_grant, alice, bob
):
    """An approved destructive call asked under a token revoked since it was let in is
    denied `token_revoked`: the approval is left unused (the next good call uses it) and
    the denial's event does not name it, as if it had been used."""
    from governance.models import Approval
    from governance.services import access, agents, approvals
    from tests.conftest import MS, NOW, last_event

    bot = make_agent("bot")
    make_grant(bot, make_tool("repo"), ("delete",), "repo:acme/*")
    call = dict(agent="bot", tool="repo", action="delete", scope="repo:acme/x")
    asked = access.access_check(**call, at=NOW)
    assert asked.decision == "approval_required"
    approvals.approval_approve(
        approval_id=asked.approval_id, approver=bob, actor=Actor.user(bob), at=NOW + MS
    )
    token, _ = agents.token_issue(created_by=alice, agent=bot, actor=SYSTEM, at=NOW + MS)
    agents.token_revoke(token=token, actor=SYSTEM, at=NOW + 2 * MS)

    refused = access.access_check(
        **call,
        at=NOW + 3 * MS,
        approval=asked.approval_id,
        refuse=access.token_refusal(token.pk),
    )
    assert (refused.decision, refused.reason, refused.approval_id) == (
        "deny",
        "token_revoked",
        None,
    )
    event = last_event()
    assert (event.event_type, event.reason, event.approval_id) == (
        "access.denied",
        "token_revoked",
        "",
    )
    assert str(event.uid) == refused.decision_id
    assert Approval.objects.get(pk=asked.approval_id).status == "approved"

    used = access.access_check(**call, at=NOW + 4 * MS, approval=asked.approval_id)
    assert (used.decision, used.approval_id) == ("allow", asked.approval_id)
    assert (last_event().event_type, last_event().approval_id) == (
        "access.allowed",
        asked.approval_id,
    )
    assert Approval.objects.get(pk=asked.approval_id).status == "consumed"


def test_a_run_under_break_glass_is_marked_break_glass_on_every_event(
    make_agent, make_tool, make_task, person
):
    """Break-glass is visible wherever its use is: the decision's event and each of the
    run's events say so, and name its grant. The run's requested event said neither (it
    was written before the run record took the decision's grant)."""
    from governance import roles
    from governance.services import breakglass

    erin = person("erin", roles.APPROVERS)
    bot = make_agent("coder")
    tool = make_tool("code-exec", actions=("execute",), kind="code_exec")
    now = timezone.now()
    opened = breakglass.breakglass_open(
        opener=erin, agent=bot, tool=tool, actions=["execute"], scope="sandbox:*",
        ticket="INC-7", reason="outage", actor=Actor.user(erin), at=now - timedelta(minutes=1),
    )  # fmt: skip
    asked = spec(task=None)
    auth = sandbox.run_request(spec=asked, at=now)
    assert auth.outcome == "allow" and auth.grant_id == opened.grant_id
    decided = decision_event(auth.decision_id)
    assert (decided.event_type, decided.break_glass) == ("access.allowed", True)
    sandbox.run_reaped(run_id=asked.run_id, why="deadline", actor=SYSTEM, at=now)
    assert [(e.event_type, e.grant_id, e.break_glass) for e in events_of(asked.run_id)] == [
        ("sandbox.run.requested", opened.grant_id, True),
        ("sandbox.run.reaped", opened.grant_id, True),
    ]


@pytest.mark.parametrize("why", ["image_mismatch", "allow_expired", "grant_not_live"])
def test_a_start_the_gate_refuses_is_on_record_as_a_deny(coder, why):
    """The start gate's refusal is a decision: it rolled back with nothing on record,
    and the log showed only the runner's later report (or the reaper's close), never
    why. Now `sandbox.run.start_refused`: deny, the refusal's code, what was built; the
    run stays requested (the runner, or the reaper, closes it as failed)."""
    image = "sha256:" + "a" * 64
    asked = spec(backend="docker", image="governance-sandbox:bookworm", image_id=image)
    assert sandbox.run_request(spec=asked, at=timezone.now()).allowed
    now, digest = timezone.now(), image
    if why == "image_mismatch":
        digest = "sha256:" + "b" * 64
    elif why == "allow_expired":
        now = now + sandbox.HELD_GRACE + timedelta(seconds=1)
    else:
        from governance.services import grants

        grants.grant_revoke(grant_id=coder.grant.pk, reason="done", actor=SYSTEM, at=now)
        now = now + timedelta(milliseconds=1)
    before = AuditEvent.objects.count()
    with pytest.raises(Conflict) as refused:
        sandbox.run_started(
            run_id=asked.run_id, container_id="c-1", image_digest=digest,
            deadline=now.timestamp() + 30, enforcement={}, at=now,
        )  # fmt: skip
    assert refused.value.code == why
    assert AuditEvent.objects.count() == before + 1
    event = events_of(asked.run_id)[-1]
    assert (event.event_type, event.decision, event.reason) == (
        "sandbox.run.start_refused",
        "deny",
        why,
    )
    assert (event.agent, event.tool, event.grant_id) == ("coder", "code-exec", coder.grant.pk)
    data = json.loads(event.data)
    assert (data["refused"], data["status"], data["image_digest"]) == (why, "requested", digest)
    assert data["container_id"] == "c-1" and data["message"] == refused.value.message
    assert SandboxRun.objects.get(run_id=asked.run_id).status == "requested"
