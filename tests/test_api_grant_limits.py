"""A grant request over the API can carry code-execution ceilings (limits), which the
sandbox runner then enforces as the most a run may ask for."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.utils import timezone

from governance.audit import Actor
from governance.models import AuditEvent, Grant
from governance.services import grants
from sandbox_runner.spec import DEFAULT_TOOL

pytestmark = pytest.mark.django_db
API = "/api/v1/grant-requests"


@pytest.fixture
def asked(make_agent, make_tool, agent_client):
    coder = make_agent("coder")
    make_tool(DEFAULT_TOOL, actions=("execute",))
    return agent_client(coder)


def body(**limits):
    return {
        "tool": DEFAULT_TOOL,
        "actions": ["execute"],
        "scope": "sandbox:*",
        "duration_seconds": 600,
        "justification": "run the test suite",
        **({"limits": limits} if limits else {}),
    }


def test_requested_limits_are_stored_approved_and_shown(asked, bob, human_client):
    response = asked.post(API, body(cpus=0.5, memory_mb=512, pids=32, scratch_mb=16), format="json")
    assert response.status_code == 201, response.json()
    shown = {"cpus": 0.5, "memory_mb": 512, "pids": 32, "scratch_mb": 16}
    assert response.json()["limits"] == shown
    grant = Grant.objects.get(pk=response.json()["id"])
    assert (grant.limit_cpus, grant.limit_memory_mb, grant.limit_pids) == (0.5, 512, 32)
    assert grant.limit_scratch_mb == 16
    assert grant.limit_wall_seconds is None  # left out: the runner's floor
    assert grant.status == "pending"
    event = AuditEvent.objects.get(grant_id=grant.pk, event_type="grant.requested")
    assert event.actor == "agent:coder"

    approver = human_client(bob, "approvers")
    approved = approver.post(f"{API}/{grant.pk}/approve", {}, format="json")
    assert approved.status_code == 200, approved.json()
    assert approved.json()["limits"] == shown
    assert AuditEvent.objects.filter(grant_id=grant.pk, event_type="grant.issued").exists()


@pytest.mark.parametrize(
    ("limits", "field"),
    [
        ({"cpus": 0}, "cpus"),
        ({"memory_mb": "512"}, "memory_mb"),
        ({"pids": True}, "pids"),
        ({"wall_seconds": 1.5}, "wall_seconds"),
        ({"scratch_mb": 0}, "scratch_mb"),
        ({"scratch_mb": 1 << 21}, "scratch_mb"),
        ({"gpus": 1}, "gpus"),
    ],
)
def test_bad_limits_are_a_400_and_nothing_is_written(asked, limits, field):
    before = AuditEvent.objects.count()
    response = asked.post(API, body(**limits), format="json")
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid_request" and field in json.dumps(error["fields"])
    assert not Grant.objects.exists() and AuditEvent.objects.count() == before


def test_the_service_refuses_a_bad_limit_from_any_caller(make_agent, make_tool, alice):
    """The rule lives in the service, so the UI, the matrix and the API share it."""
    coder = make_agent("coder")
    tool = make_tool(DEFAULT_TOOL, actions=("execute",))
    with pytest.raises(grants.GovernanceError) as refused:
        grants.grant_request(
            agent=coder, tool=tool, actions=["execute"], scope="sandbox:*",
            duration=timedelta(minutes=10), justification="x",
            actor=Actor.system("test"), at=timezone.now(),
            requested_by=alice, limits={"memory_mb": -1},
        )  # fmt: skip
    assert refused.value.code == "invalid_limits"
    assert not Grant.objects.exists()
