"""A small world for the web UI's tests, built through the real services."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.contrib.auth.models import Group, User
from django.test import Client
from django.utils import timezone

from governance import roles
from governance.audit import Actor
from governance.models import Agent, Approval, Grant, Tool
from governance.services import access, agents, grants, sandbox, tasks, tools
from governance.services.usage import usage_fold

PASSWORD = "pw-ui-test-123"
ROLE_USERS = {"admin": "dave", "approver": "bob", "auditor": "carol"}
ROLE_GROUPS = {"admin": roles.ADMINS, "approver": roles.APPROVERS, "auditor": roles.AUDITORS}


@dataclass
class World:
    alice: User
    users: dict[str, User]
    agent: Agent
    tool: Tool
    gate_tool: Tool
    grant: Grant
    request: Grant
    approval: Approval
    decision_uid: str
    token_prefix: str


def user(name: str, role: str | None = None) -> User:
    person = User.objects.filter(username=name).first() or User.objects.create_user(
        name, password=PASSWORD
    )
    person.set_password(PASSWORD)
    person.save()
    if role:
        person.groups.add(Group.objects.get_or_create(name=ROLE_GROUPS[role])[0])
    return person


def build() -> World:
    now = timezone.now()
    system = Actor.system("test")
    alice = user("alice")
    users = {role: user(name, role) for role, name in ROLE_USERS.items()}
    earlier = now - timedelta(hours=2)
    agent = agents.agent_create(name="bot-a", owner=alice, actor=system, at=earlier)
    agents.agent_create(name="bot-a.sub", owner=alice, parent=agent, actor=system, at=earlier)
    tool = tools.tool_register(
        name="repo",
        kind="api",
        actions=["read", "create", "update", "delete"],
        description="Source repositories",
        actor=system,
        at=earlier,
    )
    gate_tool = tools.tool_register(
        name="mailer",
        kind="messaging",
        actions=["execute"],
        irreversible=True,
        description="Sends mail outside",
        actor=system,
        at=earlier,
    )
    grant = grants.grant_issue(
        agent=agent,
        tool=tool,
        actions=["read", "delete"],
        scope="repo:acme/*",
        duration=timedelta(hours=8),
        justification="triage",
        requested_by=alice,
        approved_by=users["approver"],
        actor=system,
        at=now - timedelta(minutes=5),
        delegable=True,
    )
    grants.grant_issue(
        agent=agent,
        tool=gate_tool,
        actions=["execute"],
        scope="mail:customers/*",
        duration=timedelta(hours=8),
        justification="notify",
        requested_by=alice,
        approved_by=users["approver"],
        actor=system,
        at=now - timedelta(minutes=5),
    )
    task = tasks.task_open(key="TICKET-9", owner=alice, title="docs", actor=system, at=earlier)
    grants.grant_issue(
        agent=agent,
        tool=tool,
        actions=["update"],
        scope="repo:acme/docs/*",
        task=task,
        duration=timedelta(hours=2),
        justification="edit docs for the ticket",
        requested_by=alice,
        approved_by=users["approver"],
        actor=system,
        at=now - timedelta(minutes=5),
    )
    request = grants.grant_request(
        agent=agent,
        tool=tool,
        actions=["read", "create"],
        scope="repo:acme/docs/*",
        duration=timedelta(hours=4),
        justification="write the docs",
        requested_by=alice,
        actor=system,
        at=now,
    )
    allowed = access.access_check(
        agent="bot-a", tool="repo", action="read", scope="repo:acme/api", at=now
    )
    asked = access.access_check(
        agent="bot-a",
        tool="repo",
        action="delete",
        scope="repo:acme/old",
        arguments={"force": True, "token": "s3cr3t-value"},
        at=now,
    )
    assert asked.approval_id
    usage_fold(at=now)  # what the scheduled fold does within a minute: lists show the use
    token, _ = agents.token_issue(created_by=alice, agent=agent, actor=system, at=now)
    return World(
        alice=alice,
        users=users,
        agent=agent,
        tool=tool,
        gate_tool=gate_tool,
        grant=grant,
        request=request,
        approval=Approval.objects.get(pk=asked.approval_id),
        decision_uid=str(allowed.decision_id),
        token_prefix=token.prefix,
    )


def signed_in(role: str | None) -> Client:
    """A CSRF-enforcing client, signed in as the role's user (None: anonymous)."""
    client = Client(enforce_csrf_checks=True)
    if role is not None:
        client.force_login(User.objects.get(username=ROLE_USERS[role]))
    # Any page with a form sets the CSRF cookie: the sign-in page, or (signed
    # in) the dashboard's sign-out form.
    client.get("/ui/" if role else "/ui/login/")
    return client


def csrf(client: Client) -> str:
    return client.cookies["csrftoken"].value


def post(client: Client, path: str, data: dict[str, Any] | None = None) -> Any:
    return client.post(path, {**(data or {}), "csrfmiddlewaretoken": csrf(client)})


def token_form(client: Client, agent: str = "bot-a") -> dict[str, str]:
    """The one-time id of the token form the agent's page shows this session (empty
    for a person who is shown none)."""
    page = client.get(f"/ui/agents/{agent}/").content.decode()
    found = re.search(r'name="form_id" value="([^"]*)"', page)
    return {"form_id": found.group(1) if found else ""}


@dataclass
class Lifecycle:
    breakglass_id: int
    campaign_id: int
    item_id: int
    second_look_id: int


def build_lifecycle(world: World) -> Lifecycle:
    """Break-glass opened by dave (admin) for bot-a, which also opens an incident
    review campaign over bot-a's grants; the item for the main grant (approved
    by bob) is assigned to dave."""
    from governance.models import ReviewItem
    from governance.services import breakglass

    dave = world.users["admin"]
    bg = breakglass.breakglass_open(
        opener=dave,
        agent=world.agent,
        tool=world.tool,
        actions=["read", "update"],
        scope="repo:acme/incident/*",
        ticket="INC-1",
        reason="outage",
        ttl=timedelta(minutes=30),
        actor=Actor.user(dave),
        at=timezone.now(),
    )
    item = ReviewItem.objects.get(grant=world.grant)
    # Every approval of the last day sampled: the main grant's second look goes to
    # dave (bob approved it, alice asked for it).
    from governance.models import SecondLook
    from governance.services import second_look

    second_look.second_looks_sample(actor=Actor.system("test"), at=timezone.now(), fraction=1.0)
    look = SecondLook.objects.get(kind="grant", grant=world.grant)
    return Lifecycle(
        breakglass_id=bg.pk,
        campaign_id=item.campaign_id,
        item_id=item.pk,
        second_look_id=look.pk,
    )


IMAGE_ID = "sha256:" + "7" * 64
HOSTILE_OUTPUT = "done <script>alert(1)</script> \u202etxt.exe\n"


# A command line that carries secrets, as real ones do: never shown in clear.
RUN_SECRETS = ("ghp_" + "a1B2" * 9, "hunter2-" + "x9" * 6)
RUN_COMMAND = (
    "sh",
    "-c",
    f"curl -H 'Authorization: Bearer {RUN_SECRETS[0]}' http://127.0.0.1:8443/ "
    f"--password={RUN_SECRETS[1]}",
)


def make_run(world: World, finish: bool = True) -> str:
    """A finished sandbox run of bot-a's, with one egress attempt denied and one allowed,
    and output that is hostile to a page: its run id. `finish=False`: still running."""
    from sandbox_runner.egress import decide, parse_destination
    from sandbox_runner.spec import RunSpec

    now = timezone.now()
    system = Actor.system("test")
    code_exec = tools.tool_register(
        name="code-exec", kind="code_exec", actions=["execute"], description="Runs code",
        actor=system, at=now - timedelta(hours=1),
    )  # fmt: skip
    grants.grant_issue(
        agent=world.agent, tool=code_exec, actions=["execute"], scope="sandbox:*",
        egress=["127.0.0.1:8443"], duration=timedelta(hours=1), justification="build",
        requested_by=world.alice, approved_by=world.users["approver"], actor=system,
        at=now - timedelta(minutes=5),
    )  # fmt: skip
    spec = RunSpec(
        agent="bot-a", task=None, command=RUN_COMMAND, image_id=IMAGE_ID,
        limits={"memory_mb": 128},
    )  # fmt: skip
    auth = sandbox.run_request(spec=spec, at=now)
    assert auth.allowed, auth
    sandbox.run_started(run_id=spec.run_id, container_id="c0ffee", image_digest=IMAGE_ID,
                        deadline=now.timestamp() + 60, enforcement={"memory": "docker"},
                        at=now)  # fmt: skip
    # Decided by the proxy's own rule: a refusal before any lookup records no address.
    allowlist = [parse_destination("127.0.0.1:8443")]
    for port in (9, 8443):
        decision = decide("127.0.0.1", port, allowlist, resolve=lambda host, port: [])
        sandbox.egress_attempt(run_id=spec.run_id, decision=decision, at=now)
    stream = {"excerpt": HOSTILE_OUTPUT, "sha256": "ab" * 32, "bytes": 40, "truncated": False}
    summary = {"exit_code": 0, "timed_out": False, "oom_killed": False, "stdout": stream,
               "stderr": {**stream, "excerpt": "", "bytes": 0}}  # fmt: skip
    if finish:
        sandbox.run_finished_summary(run_id=spec.run_id, summary=summary, at=now)
    return spec.run_id
