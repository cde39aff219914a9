"""Edges of the sandbox's server side (services/sandbox.py, api/sandbox_views.py) that
mutation testing found unpinned: each test fails on one small wrong change (a dropped
field, a flipped comparison) and checks the answer, the audit events and the rows.
Runs here are only asked for and recorded, through the real services and the REST
door: no engine, no bubblewrap."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from governance.models import AuditEvent, SandboxRun
from governance.services import sandbox
from tests.sandbox_world import events_of, spec

STREAM = {"excerpt": "", "sha256": "0" * 64, "bytes": 0, "truncated": False}
SUMMARY = {"exit_code": 0, "timed_out": False, "oom_killed": False}


def start(run_id: str, at: Any) -> SandboxRun:
    return sandbox.run_started(
        run_id=run_id,
        container_id="bwrap-1",
        image_digest="",
        deadline=at.timestamp() + 30,
        enforcement={"pids": "cgroup"},
        at=at,
    )


# --- every event of a run says the status the run has after it ---------------------------


def test_each_event_of_a_run_names_the_status_it_left_the_run_in(coder):
    """An auditor reads a run's life from its events alone: each says the status the
    run was in once it was written (requested, running, finished; denied)."""
    asked = spec()
    assert sandbox.run_request(spec=asked, at=timezone.now()).allowed
    now = timezone.now()
    start(asked.run_id, now)
    finished = sandbox.run_finished_summary(
        run_id=asked.run_id, summary={**SUMMARY, "stdout": STREAM, "stderr": STREAM}, at=now
    )
    assert finished is not None and finished.status == "finished"
    assert SandboxRun.objects.get(run_id=asked.run_id).status == "finished"
    assert [(e.event_type, json.loads(e.data)["status"]) for e in events_of(asked.run_id)] == [
        ("sandbox.run.requested", "requested"),
        ("sandbox.run.started", "running"),
        ("sandbox.run.finished", "finished"),
    ]

    refused = spec(egress=("evil.example.net:443",))
    assert sandbox.run_request(spec=refused, at=timezone.now()).outcome == "deny"
    assert SandboxRun.objects.get(run_id=refused.run_id).status == "denied"
    assert [(e.event_type, json.loads(e.data)["status"]) for e in events_of(refused.run_id)] == [
        ("sandbox.run.requested", "requested"),
        ("sandbox.run.denied", "denied"),
    ]


# --- the reaper's bookkeeping: a run whose runner is gone is closed once, not before ------

SOME_IMAGE_ID = "sha256:" + "5" * 64


def closed_by_reaper(run_id: str) -> None:
    record = SandboxRun.objects.get(run_id=run_id)
    assert (record.status, record.error) == ("reaped", "killed by the reaper: runner_gone")
    reaped = events_of(run_id)[-1]
    assert (reaped.event_type, reaped.actor) == ("sandbox.run.reaped", "system:sandbox_reaper")
    assert json.loads(reaped.data)["why"] == "runner_gone"


def test_a_bubblewrap_run_past_its_deadline_is_left_to_its_runner_for_the_grace(coder):
    """A runner kills and records within a poll of the deadline: only a run still
    running ORPHAN_GRACE past it has lost its runner."""
    asked = spec()
    now = timezone.now()
    assert sandbox.run_request(spec=asked, at=now).allowed
    started = start(asked.run_id, now)
    deadline = started.deadline_at
    assert deadline is not None

    assert sandbox.reap_orphans(at=deadline + sandbox.ORPHAN_GRACE / 2) == []
    assert SandboxRun.objects.get(run_id=asked.run_id).status == "running"
    assert events_of(asked.run_id)[-1].event_type == "sandbox.run.started"

    later = deadline + sandbox.ORPHAN_GRACE + timedelta(seconds=1)
    assert sandbox.reap_orphans(at=later) == [(asked.run_id, "runner_gone")]
    closed_by_reaper(asked.run_id)
    assert sandbox.reap_orphans(at=later) == [], "closed once"


def test_a_gvisor_run_left_running_is_closed_like_a_docker_one(coder, settings):
    """gVisor runs under the Docker engine: a remote one whose end never came is
    closed past its deadline plus the grace by a worker that cannot see its engine."""
    settings.SANDBOX_BACKENDS = ["gvisor"]
    asked = spec(backend="gvisor", image_id=SOME_IMAGE_ID)
    now = timezone.now()
    assert sandbox.run_request(spec=asked, at=now).allowed
    started = sandbox.run_started(
        run_id=asked.run_id,
        container_id="remote",
        image_digest=SOME_IMAGE_ID,
        deadline=now.timestamp() + 30,
        enforcement={},
        at=now,
    )
    assert started.deadline_at is not None
    later = started.deadline_at + sandbox.ORPHAN_GRACE + timedelta(seconds=1)
    assert sandbox.close_stale_container_runs(at=later) == [(asked.run_id, "runner_gone")]
    closed_by_reaper(asked.run_id)
    assert sandbox.close_stale_container_runs(at=later) == [], "closed once"


def test_a_container_run_allowed_and_never_started_is_closed_only_after_the_grace(coder):
    """Within HELD_GRACE of its allow the runner may still be recording the start; after
    it the allow can no longer start anything and the run is closed. A denied run is
    closed already and never touched."""
    allowed, denied = spec(backend="docker", image_id=SOME_IMAGE_ID), spec(backend="docker")
    now = timezone.now()
    assert sandbox.run_request(spec=allowed, at=now).allowed
    assert sandbox.run_request(spec=denied, at=now).reason == "image_unresolved"

    assert sandbox.close_stale_container_runs(at=now + sandbox.HELD_GRACE / 2) == []
    assert SandboxRun.objects.get(run_id=allowed.run_id).status == "requested"
    assert events_of(allowed.run_id)[-1].event_type == "sandbox.run.requested"

    later = now + sandbox.HELD_GRACE + timedelta(seconds=1)
    assert sandbox.close_stale_container_runs(at=later) == [(allowed.run_id, "runner_gone")]
    closed_by_reaper(allowed.run_id)
    assert SandboxRun.objects.get(run_id=denied.run_id).status == "denied"
    assert [e.event_type for e in events_of(denied.run_id)] == [
        "sandbox.run.requested",
        "sandbox.run.denied",
    ]


# --- the REST door ------------------------------------------------------------------------

RUNS = "/api/v1/sandbox/runs"


def ask(run_id: str, **kw: Any) -> dict[str, Any]:
    body = {"run_id": run_id, "task": "SBX-1", "backend": "bubblewrap",
            "image": "host", "command": ["python3", "-c", "1"]}  # fmt: skip
    return {**body, **kw}


def test_only_an_allowed_run_answer_names_its_grant(coder, agent_client):
    """As /authorize: an allow names the grant that answered; a refusal does not tell
    the agent which grant it came near, though the record and the log keep it."""
    client = agent_client(coder.agent)
    allowed_id, refused_id = str(uuid.uuid4()), str(uuid.uuid4())
    allowed = client.post(RUNS, ask(allowed_id), format="json")
    assert allowed.status_code == 201
    assert (allowed.json()["decision"], allowed.json()["grant"]) == ("allow", coder.grant.pk)
    assert SandboxRun.objects.get(run_id=allowed_id).grant_id == coder.grant.pk

    refused = client.post(RUNS, ask(refused_id, limits={"memory_mb": 1 << 20}), format="json")
    assert refused.status_code == 201
    body = refused.json()
    assert (body["decision"], body["reason"], body["grant"]) == (
        "deny",
        "limit_exceeds_grant",
        None,
    )
    record = SandboxRun.objects.get(run_id=refused_id)
    assert (record.status, record.grant_id) == ("denied", coder.grant.pk)
    denied = AuditEvent.objects.get(uid=body["decision_id"])
    assert (denied.event_type, denied.grant_id) == ("access.denied", coder.grant.pk)


def test_a_run_asked_over_rest_gets_the_limits_and_egress_it_asked_for_under_the_ceiling(
    coder, agent_client
):
    """The grant is a ceiling, not an allotment: limits asked below it are the run's
    limits (the rest the ceiling's), and an egress list narrowed to nothing is no egress
    at all, not the grant's whole list. Egress the grant does not name is refused."""
    client = agent_client(coder.agent)
    small = str(uuid.uuid4())
    body = ask(small, limits={"memory_mb": 64, "wall_seconds": 10}, egress=[])
    answer = client.post(RUNS, body, format="json").json()
    limits = {"memory_mb": 64, "cpus": 1.0, "pids": 64, "wall_seconds": 10, "scratch_mb": 64}
    assert (answer["decision"], answer["limits"], answer["egress"]) == ("allow", limits, [])
    record = SandboxRun.objects.get(run_id=small)
    assert (record.status, record.limits, record.egress) == ("requested", limits, [])
    requested = events_of(small)[-1]
    assert requested.event_type == "sandbox.run.requested"
    asked_for = json.loads(requested.data)["arguments"]
    assert (asked_for["limits"]["memory_mb"], asked_for["egress"]) == (64, [])

    wide = str(uuid.uuid4())
    answer = client.post(RUNS, ask(wide, egress=["evil.example.net:443"]), format="json").json()
    assert (answer["decision"], answer["reason"], answer["egress"]) == (
        "deny",
        "limit_exceeds_grant",
        [],
    )
    record = SandboxRun.objects.get(run_id=wide)
    assert (record.status, record.limits, record.egress) == (
        "denied",
        {},
        ["evil.example.net:443"],
    )
    assert [e.event_type for e in events_of(wide)] == [
        "sandbox.run.requested",
        "sandbox.run.denied",
    ]


def snapshot() -> tuple[Any, ...]:
    runs = tuple(SandboxRun.objects.order_by("id").values_list("status", "deadline_at", "error"))
    return AuditEvent.objects.count(), runs


@pytest.mark.parametrize("deadline", [1e11 + 1, 1e15])
def test_a_start_reported_with_a_deadline_no_clock_reaches_is_a_400(coder, agent_client, deadline):
    """A deadline is a Unix time a date can hold: one past it is refused as bad input,
    not met by an error turning it into a date (a 503), or by a 409 about wall time."""
    client = agent_client(coder.agent)
    run_id = str(uuid.uuid4())
    decided = client.post(RUNS, ask(run_id), format="json").json()
    assert decided["decision"] == "allow"
    before = snapshot()
    report = {"decision_id": decided["decision_id"], "container_id": "c1", "image_digest": "",
              "deadline": deadline, "enforcement": {}}  # fmt: skip
    answer = client.post(f"{RUNS}/{run_id}/started", report, format="json")
    assert answer.status_code == 400, answer.content
    assert answer.json()["error"]["code"] == "invalid_request"
    assert "deadline" in answer.json()["error"]["fields"]
    assert snapshot() == before
    assert SandboxRun.objects.get(run_id=run_id).status == "requested"


# --- the grant's limits are a ceiling, to the last unit -----------------------------------

CEILING = {"memory_mb": 100, "cpus": 0.5, "pids": 10, "wall_seconds": 30, "scratch_mb": 20}
ABOVE = {"memory_mb": 101, "cpus": 0.51, "pids": 11, "wall_seconds": 31, "scratch_mb": 21}


@pytest.fixture
def capped(make_agent, make_tool, make_task, make_grant) -> Any:
    """coder's execute grant on a code-execution tool, with every limit set."""
    return make_grant(
        make_agent("coder"),
        make_tool("code-exec", actions=("execute",), kind="code_exec"),
        actions=("execute",),
        scope="sandbox:*",
        task=make_task("SBX-1"),
        starts_at=timezone.now() - timedelta(minutes=30),
        duration=timedelta(days=3),
        limits=CEILING,
    )


def test_a_run_may_ask_for_exactly_the_grants_limits(capped):
    asked = spec(limits=dict(CEILING))
    auth = sandbox.run_request(spec=asked, at=timezone.now())
    assert (auth.outcome, auth.grant_id) == ("allow", capped.pk)
    assert auth.limits is not None
    assert {name: getattr(auth.limits, name) for name in CEILING} == CEILING
    record = SandboxRun.objects.get(run_id=asked.run_id)
    assert (record.status, record.limits) == ("requested", CEILING)
    assert [e.event_type for e in events_of(asked.run_id)] == ["sandbox.run.requested"]


@pytest.mark.parametrize("name", sorted(CEILING))
def test_a_run_asking_one_unit_above_a_grant_limit_is_denied(capped, name):
    asked = spec(limits={**CEILING, name: ABOVE[name]})
    auth = sandbox.run_request(spec=asked, at=timezone.now())
    assert (auth.outcome, auth.reason, auth.limits) == ("deny", "limit_exceeds_grant", None)
    assert f"{name} {ABOVE[name]} is above the grant's {CEILING[name]}" in auth.message
    decided = AuditEvent.objects.get(uid=auth.decision_id)
    assert (decided.event_type, decided.reason, decided.grant_id) == (
        "access.denied",
        "limit_exceeds_grant",
        capped.pk,
    )
    record = SandboxRun.objects.get(run_id=asked.run_id)
    assert (record.status, record.reason, record.limits) == ("denied", "limit_exceeds_grant", {})
    assert [e.event_type for e in events_of(asked.run_id)] == [
        "sandbox.run.requested",
        "sandbox.run.denied",
    ]
