"""Sandbox runs in the web UI: the list and one run's page (what ran, on which image,
under which grant, with which limits and egress, and how it ended). Before, nothing in
the UI showed a run: an admin or auditor had to read it out of raw audit events."""

from __future__ import annotations

import json
import re
import uuid

import pytest

from governance.models import AuditEvent, SandboxRun
from tests import ui_world

pytestmark = pytest.mark.django_db


def test_the_list_shows_every_run_and_filters_by_agent_and_status() -> None:
    world = ui_world.build()
    run_id = ui_world.make_run(world)
    client = ui_world.signed_in("auditor")
    page = client.get("/ui/runs/").content.decode()
    assert f'href="/ui/runs/{run_id}/"' in page
    assert ui_world.IMAGE_ID[7:19] in page and 'class="run-finished">finished' in page
    assert f'href="/ui/runs/{run_id}/"' in client.get("/ui/runs/?status=finished").content.decode()
    for query in ("?status=denied", "?agent=bot-a.sub"):
        assert run_id not in client.get(f"/ui/runs/{query}").content.decode()
    # A filter it does not know is an error that says so, not an unfiltered list.
    for query in ("?status=exploded", "?colour=red", "?before=0"):
        refused = client.get(f"/ui/runs/{query}")
        assert refused.status_code == 400 and b"The form is not valid." in refused.content


def test_the_list_pages_newest_first() -> None:
    world = ui_world.build()
    first = ui_world.make_run(world)
    run = SandboxRun.objects.get(run_id=first)
    # 100 more (copies of the record; no events needed for the list).
    SandboxRun.objects.bulk_create(
        [
            SandboxRun(**{**_fields(run), "run_id": uuid.uuid4(), "agent": "bot-a"})
            for _ in range(100)
        ]
    )
    client = ui_world.signed_in("admin")
    page = client.get("/ui/runs/").content.decode()
    assert first not in page and "older →" in page
    older = page.split('href="?', 1)[1].split('"', 1)[0].replace("&amp;", "&")
    assert first in client.get(f"/ui/runs/?{older}").content.decode()


def _fields(run: SandboxRun) -> dict:
    return {
        f.name: getattr(run, f.name)
        for f in SandboxRun._meta.concrete_fields
        if f.name not in ("id", "grant")
    } | {"grant_id": run.grant_id}


def test_a_run_page_shows_what_ran_and_is_itself_on_record() -> None:
    world = ui_world.build()
    run_id = ui_world.make_run(world)
    run = SandboxRun.objects.get(run_id=run_id)
    client = ui_world.signed_in("auditor")
    before = AuditEvent.objects.count()
    response = client.get(f"/ui/runs/{run_id}/")
    assert response.status_code == 200
    page = response.content.decode()
    # The image bound by the decision and the one the backend started.
    assert f'class="image-id">{ui_world.IMAGE_ID}<' in page
    assert f'class="image-digest">{ui_world.IMAGE_ID}<' in page
    assert f'href="/ui/grants/{run.grant_id}/"' in page
    assert f'href="/ui/explain/{run.decision_id}/"' in page
    # Limits: asked, got, and how each was enforced.
    assert "<td>memory_mb</td><td>128</td><td>128</td><td>docker</td>" in page
    # Each egress attempt, with the proxy's verdict.
    assert "127.0.0.1:9</code>" in page and "denied (not_allowlisted)" in page
    # Refused before any lookup, it has no address (null in its event): a dash, not a 500.
    assert "127.0.0.1:9</code></td><td>—</td>" in page
    assert "127.0.0.1:8443</code>" in page and "allowed (allowed)" in page
    # The command, with the secrets on its line masked as in its event (and on record).
    assert "curl -H" in page and "[secret]" in page
    for secret in ui_world.RUN_SECRETS:
        assert secret not in page and secret not in json.dumps(run.command)
    # Output is shown escaped, its direction controls as code points.
    assert "<script>alert(1)</script>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "[U+202E bidi]" in page
    assert "\u202e" not in page
    assert "40 bytes in all, sha256 <code>" + "ab" * 32 in page
    # Its events, in order.
    for kind in ("sandbox.run.requested", "sandbox.run.started", "sandbox.egress.denied",
                 "sandbox.egress.allowed", "sandbox.run.finished"):  # fmt: skip
        assert kind in page
    # The look is on record.
    assert AuditEvent.objects.count() == before + 1
    look = AuditEvent.objects.order_by("-seq").first()
    assert (look.event_type, look.actor) == ("audit.viewed", "user:carol")
    assert json.loads(look.data) == {"view": "sandbox_run", "run_id": run_id}


def test_an_unknown_or_malformed_run_is_404() -> None:
    ui_world.build()
    client = ui_world.signed_in("admin")
    before = AuditEvent.objects.count()
    assert client.get(f"/ui/runs/{uuid.uuid4()}/").status_code == 404
    assert client.get("/ui/runs/not-a-run/").status_code == 404
    assert AuditEvent.objects.count() == before


def test_a_refused_request_line_carrying_a_secret_is_masked_in_its_event() -> None:
    """A refused request is recorded with what the sandbox sent (its first line), which
    can carry a key or a password: the append-only log kept them in clear."""
    from django.utils import timezone

    from governance.services import sandbox
    from sandbox_runner.egress import EgressDecision

    world = ui_world.build()
    run_id = ui_world.make_run(world, finish=False)  # egress is reported while it runs
    key, password = "sk_live_51H" + "q7Zt" * 6, "Sup3rS3cretPassw0rd"
    for sent in (
        f"GET /v1/charges?api_key={key} HTTP/1.1",
        f"CONNECT admin:{password}@evil.example:443 HTTP/1.1",
    ):
        decision = EgressDecision(False, "bad_request", sent, 0)
        sandbox.egress_attempt(run_id=run_id, decision=decision, at=timezone.now())
    denied = AuditEvent.objects.filter(event_type="sandbox.egress.denied").order_by("seq")
    stored = [json.loads(e.data)["destination"] for e in denied][-2:]
    assert stored[0] == "GET /v1/charges?api_key=[secret] HTTP/1.1:0"
    assert password not in stored[1] and key not in stored[0]
    page = ui_world.signed_in("auditor").get(f"/ui/runs/{run_id}/").content.decode()
    assert key not in page and password not in page


def test_a_run_recorded_under_a_name_that_is_no_agent_or_tool_still_shows() -> None:
    """A refused run is recorded with the names it was asked under: an agent's token
    may name any tool (`no/such`), the in-process runner any agent. A name with a slash
    cannot be a link to a page, and the run's page (the tool) and the whole runs list
    (the agent) answered 500 for every role. Names that are no agent's or tool's are
    shown as text now; the refusal itself is on record and on the pages."""
    from django.utils import timezone
    from rest_framework.test import APIClient

    from governance.audit import Actor
    from governance.services import agents, sandbox
    from sandbox_runner.spec import RunSpec

    world = ui_world.build()
    _, token = agents.token_issue(
        created_by=world.alice, agent=world.agent, actor=Actor.system("test"), at=timezone.now()
    )
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    by_agent = str(uuid.uuid4())
    asked = api.post(
        "/api/v1/sandbox/runs",
        {"run_id": by_agent, "tool": "no/such", "backend": "docker", "image": "python:3",
         "image_id": ui_world.IMAGE_ID, "command": ["true"]},
        format="json",
    )  # fmt: skip
    assert asked.status_code == 201 and asked.json()["decision"] == "deny"
    assert asked.json()["reason"] == "unknown_tool"
    in_process = RunSpec(agent="ops/bot", task=None, command=("true",), image_id=ui_world.IMAGE_ID)
    assert not sandbox.run_request(spec=in_process, at=timezone.now()).allowed
    for run_id, agent in ((by_agent, "bot-a"), (in_process.run_id, "ops/bot")):
        (denied,) = AuditEvent.objects.filter(
            event_type="sandbox.run.denied", data__contains=run_id
        )
        assert denied.agent == agent
    client = ui_world.signed_in("auditor")
    listed = client.get("/ui/runs/")
    assert listed.status_code == 200
    page = listed.content.decode()
    assert (
        f'href="/ui/runs/{by_agent}/"' in page and f'href="/ui/runs/{in_process.run_id}/"' in page
    )
    assert "<td>ops/bot</td>" in page and 'href="/ui/agents/bot-a/"' in page
    for run_id, shown in (
        (by_agent, "<tr><th>Tool</th><td>no/such <small"),
        (in_process.run_id, "<tr><th>Agent</th><td>ops/bot</td>"),
    ):
        before = AuditEvent.objects.count()
        response = client.get(f"/ui/runs/{run_id}/")
        assert response.status_code == 200 and shown in response.content.decode()
        assert AuditEvent.objects.count() == before + 1  # the look, on record


def test_every_why_link_in_a_run_pages_events_opens_its_explanation() -> None:
    """A run's events carry a decision (requested, egress verdicts, finished), but only
    a decision's own event has an explanation: a "why" beside the others led to a 404."""
    world = ui_world.build()
    run_id = ui_world.make_run(world)
    run = SandboxRun.objects.get(run_id=run_id)
    client = ui_world.signed_in("auditor")
    page = client.get(f"/ui/runs/{run_id}/").content.decode()
    links = set(re.findall(r'href="(/ui/explain/[^"]+/)">why<', page))
    # The decision that let the run start is in the list, and is explained.
    assert f"/ui/explain/{run.decision_id}/" in links
    sandbox_events = AuditEvent.objects.filter(event_type__startswith="sandbox.")
    assert sandbox_events.exclude(decision="").exists()  # they carry a decision
    for event in sandbox_events:
        assert f"/ui/explain/{event.uid}/" not in links
    for link in links:
        assert client.get(link).status_code == 200, link
