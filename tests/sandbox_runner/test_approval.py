"""The confirmation gate for code execution: a code-execution tool marked irreversible
(a deploy runner, say) asks a person before each run, and runs once that person has
approved that exact run (same image, command, script and input, limits and egress).

Before, the run's id was part of the hashed arguments, so every try was a new call
with a new approval: an irreversible code-execution tool could never run. The runner
had no way to name an approval either. Real bubblewrap sandboxes, in process and over
HTTP (the live server on 127.0.0.1)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from django.utils import timezone

from governance.audit import Actor
from governance.models import Approval, AuditEvent, SandboxRun
from governance.services import agents, approvals, sandbox
from sandbox_runner.authorizers import DatabaseAuthorizer, HttpAuthorizer
from sandbox_runner.cli import main
from sandbox_runner.runner import EXIT_APPROVAL, EXIT_DENIED
from tests.sandbox_runner.conftest import events_of, run_record
from tests.sandbox_runner.test_docker_probes import run

SCRIPT = "print('deployed')"


@pytest.fixture(params=["database", "http"])
def authorizer(request: pytest.FixtureRequest, code_exec: Any, alice: Any) -> Any:
    if request.param == "database":
        return DatabaseAuthorizer()
    live_server = request.getfixturevalue("live_server")
    _, token = agents.token_issue(
        created_by=alice, agent=code_exec.agent, actor=Actor.system("test"), at=timezone.now()
    )
    return HttpAuthorizer(live_server.url, token)


def decision_event(outcome: Any) -> AuditEvent:
    return AuditEvent.objects.get(uid=outcome.auth.decision_id)


@pytest.fixture
def deploy_grant(irreversible: Any) -> Any:
    return irreversible("deploy-exec")


@pytest.mark.django_db(transaction=True)
def test_an_irreversible_code_exec_tool_runs_once_a_person_approved_that_exact_run(
    bwrap_available, deploy_grant, spec_for, authorizer, bob, capsys
):
    grant = deploy_grant

    def attempt(script: str = SCRIPT, **kw: Any) -> tuple[Any, str, str]:
        spec = spec_for(script, tool="deploy-exec", backend="bubblewrap", **kw)
        return (spec, *run(spec, authorizer))

    # 1. Asked: nothing runs; the run is recorded as refused, with the approval to ask.
    first, outcome, out, _ = attempt()
    assert outcome.exit_code == EXIT_APPROVAL and out == ""
    approval_id = outcome.auth.approval_id
    assert approval_id and f"--approval {approval_id}" in capsys.readouterr().err  # the runner's
    # The person asked reads the script itself (over HTTP, the runner sent its bytes).
    shown = Approval.objects.get(pk=approval_id).attachments["script"]
    assert (shown["text"], shown["sha256"]) == (SCRIPT, first.script_sha256)
    record = run_record(first.run_id)
    assert (record.status, record.reason) == ("denied", "approval_required")
    assert events_of(first.run_id) == ["sandbox.run.requested", "sandbox.run.denied"]
    event = decision_event(outcome)
    assert (event.event_type, event.approval_id) == ("access.approval_required", approval_id)
    # The run id is no longer among the decision's arguments: the run's requested event,
    # right after the decision's, names it.
    requested = AuditEvent.objects.get(seq=event.seq + 1)
    assert requested.event_type == "sandbox.run.requested" and first.run_id in requested.data
    assert json.loads(requested.data)["decision_id"] == str(event.uid)

    # 2. Asked again (a new run id) before anyone decided: the same request, not a new one.
    _, again, _, _ = attempt()
    assert (again.exit_code, again.auth.approval_id) == (EXIT_APPROVAL, approval_id)
    assert Approval.objects.filter(grant=grant).count() == 1

    approvals.approval_approve(
        approval_id=approval_id, approver=bob, actor=Actor.user(bob), at=timezone.now()
    )

    # 3. The approval does not stretch to other code: denied, nothing ran, still unused.
    other, outcome, out, _ = attempt("print('something else')", approval=approval_id)
    assert (outcome.exit_code, outcome.auth.reason) == (EXIT_DENIED, "approval_invalid")
    assert out == "" and run_record(other.run_id).status == "denied"
    assert decision_event(outcome).event_type == "access.denied"
    assert Approval.objects.get(pk=approval_id).status == "approved"

    # 4. The approved run: it runs, and uses the approval up.
    second, outcome, out, _ = attempt(approval=approval_id)
    assert outcome.exit_code == 0 and out == "deployed\n"
    assert run_record(second.run_id).status == "finished"
    event = decision_event(outcome)
    assert (event.event_type, event.approval_id, event.grant_id) == (
        "access.allowed",
        approval_id,
        grant.pk,
    )
    assert Approval.objects.get(pk=approval_id).status == "consumed"

    # 5. Once: the same run again with the same approval is denied.
    _, outcome, out, _ = attempt(approval=approval_id)
    assert (outcome.exit_code, outcome.auth.reason, out) == (EXIT_DENIED, "approval_invalid", "")
    assert decision_event(outcome).event_type == "access.denied"


@pytest.mark.django_db
def test_the_command_line_names_the_approval_and_then_uses_it(
    bwrap_available, deploy_grant, bob, capfd
):
    argv = ["run", "--agent", "coder", "--task", "SBX-1", "--tool", "deploy-exec"]
    argv += ["--backend", "bubblewrap"]
    assert main([*argv, "--", "echo", "shipped"]) == EXIT_APPROVAL
    said = capfd.readouterr()
    asked = re.search(r"--approval ([0-9a-f-]{36})", said.err)
    assert asked and said.out == ""
    (approval,) = Approval.objects.filter(grant=deploy_grant)
    assert str(approval.pk) == asked.group(1)
    approvals.approval_approve(
        approval_id=approval.pk, approver=bob, actor=Actor.user(bob), at=timezone.now()
    )

    assert main([*argv, "--approval", asked.group(1), "--", "echo", "shipped"]) == 0
    assert capfd.readouterr().out == "shipped\n"
    approval.refresh_from_db()
    assert approval.status == "consumed"
    allowed = AuditEvent.objects.get(event_type="access.allowed")
    assert (allowed.approval_id, allowed.tool) == (str(approval.pk), "deploy-exec")
    assert SandboxRun.objects.filter(status="finished").count() == 1


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("limit", "limit_exceeds_grant"),
        ("backend", "backend_not_allowed"),
        ("not_code_exec", "not_code_exec_tool"),
    ],
)
def test_a_run_refused_for_its_own_limits_neither_asks_a_person_nor_spends_an_approval(
    irreversible, spec_for, bob, settings, case, reason
):
    """The sandbox's own refusals (a code-execution tool, an allowed backend, the grant's
    ceiling) come before the confirmation gate: nobody is asked to approve a run that
    could never start, and an approval is not used up by one."""
    irreversible("deploy-exec", limits={"memory_mb": 128})
    irreversible("mailer", kind="api", limits={"memory_mb": 128})
    settings.SANDBOX_BACKENDS = ("docker",)
    fine = {"tool": "deploy-exec", "backend": "docker"}
    refused = {
        "limit": {**fine, "limits": {"memory_mb": 4096}},
        "backend": {**fine, "backend": "bubblewrap"},
        "not_code_exec": {**fine, "tool": "mailer"},
    }[case]

    def ask(**kw: Any) -> Any:
        return sandbox.run_request(spec=spec_for(SCRIPT, **kw), at=timezone.now())

    first = ask(**refused)
    assert (first.outcome, first.reason, first.approval_id) == ("deny", reason, None)
    assert not Approval.objects.exists()  # nobody was asked
    event = AuditEvent.objects.get(uid=first.decision_id)
    assert (event.event_type, event.reason, event.approval_id) == ("access.denied", reason, "")

    asked = ask(**fine)
    assert asked.outcome == "approval_required"
    approvals.approval_approve(
        approval_id=asked.approval_id, approver=bob, actor=Actor.user(bob), at=timezone.now()
    )
    other = ask(approval=asked.approval_id, **refused)  # not the run it approved
    assert (other.outcome, other.reason) == ("deny", "approval_invalid")
    assert Approval.objects.get(pk=asked.approval_id).status == "approved"  # still usable
    used = ask(approval=asked.approval_id, **fine)
    assert (used.outcome, used.limits.memory_mb) == ("allow", 128)
    assert Approval.objects.get(pk=asked.approval_id).status == "consumed"


@pytest.mark.django_db
def test_an_approved_run_the_deployment_no_longer_allows_keeps_its_approval(
    deploy_grant, spec_for, bob, settings
):
    """The approval matches the run exactly, but its backend was taken off
    SANDBOX_BACKENDS after the approval: refused before the gate, approval unspent."""
    settings.SANDBOX_BACKENDS = ("docker", "bubblewrap")
    spec = {"tool": "deploy-exec", "backend": "bubblewrap"}
    asked = sandbox.run_request(spec=spec_for(SCRIPT, **spec), at=timezone.now())
    assert asked.outcome == "approval_required"
    approvals.approval_approve(
        approval_id=asked.approval_id, approver=bob, actor=Actor.user(bob), at=timezone.now()
    )
    settings.SANDBOX_BACKENDS = ("docker",)

    refused = sandbox.run_request(
        spec=spec_for(SCRIPT, approval=asked.approval_id, **spec), at=timezone.now()
    )

    assert (refused.outcome, refused.reason) == ("deny", "backend_not_allowed")
    assert Approval.objects.get(pk=asked.approval_id).status == "approved"
    event = AuditEvent.objects.get(uid=refused.decision_id)
    assert (event.event_type, event.reason) == ("access.denied", "backend_not_allowed")


# --- The image: an approval is for its bytes, not for its name ----------------------------

MARK_SCRIPT = "import os; print(os.environ.get('MARK', 'original'))"
MOVABLE = ("governance-sandbox", "movable")  # a name the tests move between two images


@pytest.fixture
def two_images(docker_client: Any) -> Any:
    """(the name, the sandbox image, another image): the name points at the sandbox image
    at first. The other differs only by an ENV line, so a run's output says which ran."""
    import contextlib
    import io

    import docker.errors

    from sandbox_runner.spec import DEFAULT_IMAGE

    original = docker_client.images.get(DEFAULT_IMAGE)
    dockerfile = f"FROM {DEFAULT_IMAGE}\nENV MARK=moved\n".encode()
    moved, _ = docker_client.images.build(fileobj=io.BytesIO(dockerfile), pull=False, rm=True)
    assert moved.id != original.id
    original.tag(*MOVABLE)
    yield ":".join(MOVABLE), original, moved
    docker_client.images.remove(":".join(MOVABLE))  # the sandbox image keeps its own name
    with contextlib.suppress(docker.errors.ImageNotFound):  # gone with the name above
        docker_client.images.remove(moved.id)


@pytest.mark.django_db(transaction=True)
def test_an_approval_is_for_the_image_a_person_saw_not_for_whatever_its_name_points_at(
    two_images, deploy_grant, spec_for, authorizer, bob
):
    """Before, the decision bound the image's name: a run approved on one image could
    run on any other that was tagged with the same name afterwards."""
    name, original, moved = two_images

    def attempt(**kw: Any) -> tuple[Any, Any, str]:
        spec = spec_for(MARK_SCRIPT, tool="deploy-exec", backend="docker", image=name, **kw)
        outcome, out, _ = run(spec, authorizer)
        return spec, outcome, out

    asked, outcome, _ = attempt()
    assert outcome.exit_code == EXIT_APPROVAL
    approval_id = outcome.auth.approval_id
    # The person asked sees which image, by id (the runner resolved the name).
    shown = Approval.objects.get(pk=approval_id).arguments_preview
    assert (shown["image"], shown["image_id"]) == (name, original.id)
    assert run_record(asked.run_id).image_id == original.id
    approvals.approval_approve(
        approval_id=approval_id, approver=bob, actor=Actor.user(bob), at=timezone.now()
    )

    # The name now points at other bytes: the approval does not cover them.
    moved.tag(*MOVABLE)
    other, outcome, out = attempt(approval=approval_id)
    assert (outcome.exit_code, outcome.auth.reason, out) == (EXIT_DENIED, "approval_invalid", "")
    assert decision_event(outcome).event_type == "access.denied"
    assert run_record(other.run_id).image_id == moved.id
    assert Approval.objects.get(pk=approval_id).status == "approved"

    # Back on the approved bytes: it runs, on them, and the approval is used up.
    original.tag(*MOVABLE)
    ran, outcome, out = attempt(approval=approval_id)
    assert (outcome.exit_code, out) == (0, "original\n")
    record = run_record(ran.run_id)
    assert record.image_id == record.image_digest == original.id
    event = decision_event(outcome)
    assert (event.event_type, event.approval_id) == ("access.allowed", approval_id)
    assert json.loads(event.arguments)["image_id"] == original.id
    assert Approval.objects.get(pk=approval_id).status == "consumed"


@pytest.mark.django_db
def test_a_name_moved_after_the_decision_still_runs_the_image_that_was_allowed(
    two_images, code_exec, spec_for
):
    name, original, moved = two_images
    code_exec.grant()

    class MovesTheName(DatabaseAuthorizer):
        """The name is moved to other bytes between the decision and the start."""

        def authorize(self, spec: Any) -> Any:
            auth = super().authorize(spec)
            moved.tag(*MOVABLE)
            return auth

    spec = spec_for(MARK_SCRIPT, image=name)
    outcome, out, _ = run(spec, MovesTheName())
    assert (outcome.exit_code, out) == (0, "original\n")
    record = run_record(spec.run_id)
    assert record.image_id == record.image_digest == original.id
    assert events_of(spec.run_id)[-2:] == ["sandbox.run.started", "sandbox.run.finished"]
    started = AuditEvent.objects.filter(event_type="sandbox.run.started").latest("seq")
    assert json.loads(started.data)["image_digest"] == original.id

    # The next run asks anew, and is allowed for (and runs) what the name holds now.
    again = spec_for(MARK_SCRIPT, image=name)
    outcome, out, _ = run(again, DatabaseAuthorizer())
    assert (outcome.exit_code, out) == (0, "moved\n")
    assert run_record(again.run_id).image_id == moved.id


@pytest.mark.django_db
def test_the_runner_resolves_the_image_itself_and_ignores_an_id_it_is_handed(
    two_images, code_exec, spec_for
):
    """A grant on `sandbox:<name>` is about that name's image: an id named by the caller
    beside an allowed name must not smuggle in other bytes."""
    name, original, moved = two_images
    code_exec.grant()
    spec = spec_for(MARK_SCRIPT, image=name, image_id=moved.id)
    outcome, out, _ = run(spec)
    assert (outcome.exit_code, out) == (0, "original\n")
    assert run_record(spec.run_id).image_id == original.id
    assert json.loads(decision_event(outcome).arguments)["image_id"] == original.id
