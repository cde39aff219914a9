"""Schemathesis against the live API, as agent A, agent B and an admin.

    python -m fuzz.schemathesis_run          # or: make fuzz

What it does, in order, and why:

1. Drops and recreates a PostgreSQL database of its own (governance_fuzz), migrates
   it and seeds a small world through the services, as production would have it: two
   agents A and B, each with a subagent, live grants (one destructive, one
   irreversible), pending, approved and denied grant requests, pending, approved,
   denied and consumed approvals, and decisions with reported outcomes; an admin, an
   approver and the agents' owner. Tokens for A, B and the admin come from
   services.agents.token_issue; their plaintexts go only into the auth file that
   schemathesis reads (in a private temporary directory, removed afterwards) and into
   this process's own requests, and are printed nowhere.
2. Serves the app with gunicorn (2 workers) on a free port on 127.0.0.1.
3. Runs `schemathesis run` once per identity with every check. A's and B's runs name
   each other as peers, so schemathesis' own object_level_authorization check replays
   what one agent read as the other. Any finding fails the run.
4. Checks by hand that agent B never receives agent A's objects (and back): B's
   lists, and A's ids on every detail endpoint an agent can reach (404, nothing
   written, and an answer no different from a made-up id's), plus a scan of every
   response that schemathesis recorded for B. Then sends the malformed bodies that
   schemathesis does not generate (NUL, lone surrogates, deep nesting, bad bytes):
   each must be a 400 in the API's error shape and write nothing.
5. Fails if the server logged a traceback, stops gunicorn and drops the database.

Exit status 0 only with zero findings. The last line says `fuzz: N passed, M failed`
(N generated cases, M findings). `--keep` keeps the database and the temporary
directory (reports, server log, and the auth file with live tokens) for debugging.

The admin runs last: it may suspend agents and revoke tokens, which would blind the
agents' runs and the cross-agent check.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SERVER = "postgresql://postgres@127.0.0.1:5432"
DEFAULT_DATABASE = "governance_fuzz"
AGENT_A, AGENT_B, ADMIN = "agent-a", "agent-b", "fuzz-admin"
IDENTITY_HEADER = "X-Fuzz-Identity"
# One identity's run takes about a minute at 100 examples per operation on 2 cores.
RUN_TIMEOUT = 900
# Every check schemathesis has. `all` would be the same today; naming them keeps a
# new check from silently changing what CI asserts.
CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_headers_conformance",
    "response_schema_conformance",
    "negative_data_rejection",
    # positive_data_acceptance, less the 400s no schema can rule out (fuzz/hooks.py)
    "positive_data_acceptance_by_form",
    "missing_required_header",
    "unsupported_method",
    "allow_header_conformance",
    "use_after_free",
    "ensure_resource_availability",
    "ignored_auth",
    "object_level_authorization",
)


def log(message: str) -> None:
    print(f"[fuzz] {message}", flush=True)


# --- Database --------------------------------------------------------------------------


def recreate_database(server: str, name: str, *, create: bool = True) -> None:
    import psycopg
    from psycopg import sql

    with psycopg.connect(f"{server}/postgres", autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )
        if create:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


@dataclass
class AgentWorld:
    name: str
    token: str = field(repr=False)
    prefix: str
    grants: set[int] = field(default_factory=set)
    approvals: set[str] = field(default_factory=set)
    approved_approval: str = ""
    decisions: set[str] = field(default_factory=set)


@dataclass
class World:
    agents: dict[str, AgentWorld]
    admin_token: str = field(repr=False)


def seed() -> World:
    """A small world through the services, so every row has its audit event."""
    from django.contrib.auth.models import Group, User
    from django.db import transaction
    from django.utils import timezone

    from governance import roles
    from governance.audit import Actor
    from governance.models import Approval
    from governance.services import agents, tasks, tools

    now = timezone.now()
    earlier = now - timedelta(hours=1)
    system = Actor.system("fuzz")

    def person(name: str, *groups: str, superuser: bool = False) -> User:
        user = User.objects.create_user(
            name, password=secrets.token_urlsafe(16), is_staff=superuser, is_superuser=superuser
        )
        user.groups.set([Group.objects.get_or_create(name=g)[0] for g in groups])
        return user

    def tool(name: str, actions: list[str], **kw: Any) -> Any:
        return tools.tool_register(
            name=name, kind="api", actions=actions, actor=system, at=earlier, **kw
        )

    with transaction.atomic():
        admin = person(ADMIN, roles.ADMINS, roles.APPROVERS, superuser=True)
        people = Seeder(
            owner=person("olivia"),  # owns the agents and asked for their issued grants
            approver=person("pat", roles.APPROVERS),
            admin=admin,
            now=now,
            earlier=earlier,
        )
        person("quinn", roles.AUDITORS)
        tool("repo", ["read", "create", "update", "delete"], description="Source repositories.")
        tool("tickets", ["read", "update"], description="The ticket queue.")
        tool("payments", ["create"], irreversible=True, description="Sends money.")
        tasks.task_open(key="FUZZ-1", title="Fuzzing", owner=people.owner, actor=system, at=earlier)
        world = {name: people.agent(name) for name in (AGENT_A, AGENT_B)}
        _, admin_token = agents.token_issue(
            created_by=admin, user=admin, actor=system, at=now, days=1
        )
    assert Approval.objects.count() == 8
    return World(agents=world, admin_token=admin_token)


@dataclass
class Seeder:
    """Seeds one agent's corner of the world: the same shape for A and B."""

    owner: Any
    approver: Any
    admin: Any
    now: Any
    earlier: Any

    def agent(self, name: str) -> AgentWorld:
        from governance.audit import Actor
        from governance.models import Grant, Tool
        from governance.services import agents, approvals, grants, outcomes

        system = Actor.system("fuzz")
        agent = agents.agent_create(
            name=name,
            owner=self.owner,
            actor=system,
            at=self.earlier,
            description=f"{name} under fuzz",
        )
        sub = agents.agent_create(
            name=f"{name}.sub", owner=self.owner, parent=agent, actor=system, at=self.earlier
        )
        repo, tickets, payments = (
            Tool.objects.get(name=n) for n in ("repo", "tickets", "payments")
        )

        def issue(tool: Tool, actions: list[str], scope: str, **kw: Any) -> Grant:
            return grants.grant_issue(
                agent=agent,
                tool=tool,
                actions=actions,
                scope=scope,
                duration=timedelta(hours=24),
                justification=f"{name}: seeded",
                requested_by=self.owner,
                approved_by=self.approver,
                actor=Actor.user(self.approver),
                at=self.earlier,
                **kw,
            )

        # A destructive grant (delete) and an irreversible tool (payments).
        repo_grant = issue(repo, ["read", "delete"], f"repo:{name}/*", delegable=True)
        issue(payments, ["create"], f"payments:{name}/*", task=self._task())
        # What the API docs' examples for /authorize ask about (the examples phase).
        issue(repo, ["read", "delete"], "repo:acme/api/*")
        grants.grant_delegate(
            parent_grant_id=repo_grant.pk,
            child=sub,
            actions=["read"],
            scope=f"repo:{name}/docs/*",
            expires_at=self.now + timedelta(hours=2),
            justification=f"{name}: docs only",
            actor=Actor.agent(agent),
            at=self.earlier,
        )

        def ask(tool: Tool, actions: list[str], scope: str) -> Grant:
            return grants.grant_request(
                agent=agent,
                tool=tool,
                actions=actions,
                scope=scope,
                duration=timedelta(hours=1),
                justification=f"{name} needs {scope}",
                requested_by_agent=agent,
                actor=Actor.agent(agent),
                at=self.earlier,
            )

        ask(tickets, ["read"], f"tickets:{name}/*")  # stays pending
        denied = ask(tickets, ["update"], f"tickets:{name}/open/*")
        grants.grant_deny(
            grant_id=denied.pk, approver=self.approver, reason="not now", **self._by_approver()
        )
        approved = ask(repo, ["create"], f"repo:{name}/branches/*")
        grants.grant_approve(grant_id=approved.pk, approver=self.approver, **self._by_approver())

        allowed = self._decide(name, "repo", "read", f"repo:{name}/src/main.py")
        assert allowed.allowed, allowed
        outcomes.outcome_report(
            agent=agent, decision_id=allowed.decision_id, outcome="succeeded", at=self.now
        )
        refused = self._decide(name, "tickets", "update", f"tickets:{name}/open/1")
        outcomes.outcome_report(
            agent=agent, decision_id=refused.decision_id, outcome="aborted", at=self.now
        )
        # Approvals: pending, denied, approved and used, approved and left unused.
        self._decide(name, "repo", "delete", f"repo:{name}/old", arguments={"force": True})
        to_deny = self._decide(
            name, "payments", "create", f"payments:{name}/invoice-1", task="FUZZ-1", arguments={}
        )
        approvals.approval_deny(
            approval_id=to_deny.approval_id,
            approver=self.approver,
            reason="no",
            **self._by_approver(),
        )
        call = ("repo", "delete", f"repo:{name}/scratch")
        to_use = self._decide(name, *call, arguments={"path": "scratch"})
        approvals.approval_approve(
            approval_id=to_use.approval_id, approver=self.approver, **self._by_approver()
        )
        used = self._decide(name, *call, arguments={"path": "scratch"}, approval=to_use.approval_id)
        assert used.allowed, used
        outcomes.outcome_report(
            agent=agent, decision_id=used.decision_id, outcome="succeeded", at=self.now
        )
        # Approved and left unused: the other agent presenting it must get nowhere.
        spare = self._decide(
            name, "repo", "delete", f"repo:{name}/spare", arguments={"path": "spare"}
        )
        approvals.approval_approve(
            approval_id=spare.approval_id, approver=self.approver, **self._by_approver()
        )

        token, plaintext = agents.token_issue(
            created_by=self.admin, agent=agent, actor=system, at=self.now, days=1
        )
        return AgentWorld(
            name=name, token=plaintext, prefix=token.prefix, approved_approval=spare.approval_id
        )

    def _task(self) -> Any:
        from governance.models import Task

        return Task.objects.get(key="FUZZ-1")

    def _by_approver(self) -> dict[str, Any]:
        from django.utils import timezone

        from governance.audit import Actor

        return {"actor": Actor.user(self.approver), "at": timezone.now()}

    @staticmethod
    def _decide(agent: str, tool: str, action: str, scope: str, **kw: Any) -> Any:
        from django.utils import timezone

        from governance.services import access

        decision = access.access_check(
            agent=agent, tool=tool, action=action, scope=scope, at=timezone.now(), **kw
        )
        assert decision.decision_id, decision
        return decision


def collect_objects(agent: AgentWorld) -> None:
    """Everything the agent owns now, seeded or created while fuzzing."""
    from governance.models import Approval, AuditEvent, Grant
    from governance.services.outcomes import DECISION_EVENTS

    mine = [agent.name, f"{agent.name}.sub"]
    agent.grants = set(Grant.objects.filter(agent__name__in=mine).values_list("pk", flat=True))
    agent.approvals = {
        str(pk) for pk in Approval.objects.filter(agent__name__in=mine).values_list("pk", flat=True)
    }
    agent.decisions = {
        str(uid)
        for uid in AuditEvent.objects.filter(
            event_type__in=DECISION_EVENTS, actor__in=[f"agent:{n}" for n in mine]
        ).values_list("uid", flat=True)
    }


# --- The server ------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    """gunicorn on 127.0.0.1, its output in a log file read for tracebacks."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = log_path.open("wb")
        self.process = subprocess.Popen(  # noqa: S603 - our own interpreter and arguments
            [
                sys.executable,
                "-m",
                "gunicorn",
                "governance.wsgi:application",
                "--bind",
                f"127.0.0.1:{self.port}",
                "--workers",
                "2",
                "--timeout",
                "60",
                "--graceful-timeout",
                "5",
            ],
            cwd=ROOT,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_healthy(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"gunicorn exited with {self.process.returncode}:\n{self.tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/healthz", timeout=2) as resp:  # noqa: S310
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"gunicorn did not answer /healthz in {timeout:g} s:\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def tracebacks(self) -> list[str]:
        self._log.flush()
        text = self.log_path.read_text(errors="replace")
        return text.split("Traceback (most recent call last):")[1:]

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()


# --- Schemathesis ----------------------------------------------------------------------


@dataclass
class RunResult:
    identity: str
    exit_code: int
    cases: int
    failures: int
    seconds: float
    har: Path


def write_auth_file(tmp: Path, world: World) -> Path:
    """The WFC auth document: the one place the plaintexts are written (mode 0600, in a
    private temporary directory that is removed at the end)."""
    entries = [
        {
            "name": name,
            "fixedHeaders": [
                {"name": "Authorization", "value": f"Bearer {token}"},
                # Names the sender in the HAR report, where the token is filtered out.
                {"name": IDENTITY_HEADER, "value": name},
            ],
        }
        for name, token in [
            (AGENT_A, world.agents[AGENT_A].token),
            (AGENT_B, world.agents[AGENT_B].token),
            (ADMIN, world.admin_token),
        ]
    ]
    wfc = tmp / "auth.json"
    fd = os.open(wfc, os.O_WRONLY | os.O_CREAT | os.O_EXCL, stat.S_IRUSR | stat.S_IWUSR)
    with os.fdopen(fd, "w") as out:
        json.dump({"auth": entries}, out)
    return wfc


def write_config(path: Path, wfc: Path, identity: str) -> None:
    """Every request as `identity`; A and B are peers, whose objects stay apart."""
    peers = json.dumps([AGENT_A, AGENT_B])
    path.write_text(
        "[auth.wfc]\n"
        f"path = {json.dumps(str(wfc))}\n"
        f"user = {json.dumps(identity)}\n"
        f"peers = {peers}\n"
    )


_CASES = re.compile(r"Test cases:\s*\n?\s*(\d+) generated", re.MULTILINE)


def run_schemathesis(
    *,
    url: str,
    identity: str,
    wfc: Path,
    tmp: Path,
    max_examples: int,
    seed: int,
    workers: int,
) -> RunResult:
    config = tmp / f"schemathesis-{identity}.toml"
    write_config(config, wfc, identity)
    report_dir = tmp / f"report-{identity}"
    har = report_dir / "har.json"
    command = [
        str(Path(sys.executable).parent / "schemathesis"),
        "--config-file",
        str(config),
        "--no-color",
        "run",
        f"{url}/api/v1/schema/",
        "--checks",
        ",".join(CHECKS),
        "--max-examples",
        str(max_examples),
        "--seed",
        str(seed),
        "--workers",
        str(workers),
        "--request-timeout",
        "30",
        "--generation-database",
        "none",
        # Text as JSON carries it: valid Unicode without NUL. (The API still answers
        # either with a 400, never a 500; tests/ and the cross-checks cover that.)
        "--generation-codec",
        "utf-8",
        "--generation-allow-x00",
        "false",
        "--report",
        "har,junit",
        "--report-dir",
        str(report_dir),
        "--report-har-path",
        str(har),
        "--suppress-health-check",
        "too_slow,filter_too_much",
        "--warnings",
        "off",
    ]
    log(f"schemathesis as {identity}: {' '.join(command[3:6])} ... (max {max_examples}/operation)")
    started = time.monotonic()
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "fuzz.hooks", "PYTHONPATH": str(ROOT)}
    try:
        proc = subprocess.run(  # noqa: S603
            command,
            cwd=tmp,
            env=env,
            capture_output=True,
            text=True,
            check=False,
            timeout=RUN_TIMEOUT,
        )
        exit_code, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        # A hung run is a finding too; what it printed so far says where it was.
        exit_code = -1
        parts = [exc.stdout, exc.stderr]  # bytes here, even with text=True
        output = "".join(
            p.decode(errors="replace") if isinstance(p, bytes) else p or "" for p in parts
        )
        output += f"\nTimed out after {RUN_TIMEOUT} s"
    seconds = time.monotonic() - started
    (tmp / f"schemathesis-{identity}.log").write_text(output)
    print(output, flush=True)
    cases = count_cases(output)
    failures = count_failures(report_dir)
    return RunResult(identity, exit_code, cases, failures, seconds, har)


def count_cases(output: str) -> int:
    match = _CASES.search(output)
    return int(match.group(1)) if match else -1


def count_failures(report_dir: Path) -> int:
    import xml.etree.ElementTree as ET  # noqa: N817

    total = 0
    for path in report_dir.glob("*.xml"):
        root = ET.parse(path).getroot()  # noqa: S314 - our own report
        for suite in root.iter("testsuite"):
            total += int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    return total


# --- Cross-agent isolation -------------------------------------------------------------


def _request(
    url: str, token: str, method: str = "GET", body: Any = None, *, raw_body: bytes | None = None
) -> tuple[int, Any]:
    data = raw_body if raw_body is not None else None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(  # noqa: S310 - 127.0.0.1 only
        url,
        data=data,
        method=method,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:  # noqa: S310
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw.decode(errors="replace")


def leaks_of(owner: AgentWorld, body: Any) -> list[str]:
    """Where `body` holds one of the owner's objects or ids, by what each key means.

    Only the identifying keys count, not free text: the peer may itself have written
    the owner's name into a scope or a justification (schemathesis reuses values it
    saw, including those it saw while replaying requests as the owner), and an
    object of the peer's that says so is no leak."""
    names = {owner.name, f"{owner.name}.sub"}
    by_key: dict[str, set[Any]] = {
        "agent": names,
        "id": {*owner.grants, *owner.approvals},
        "grant": set(owner.grants),
        "delegated_from": set(owner.grants),
        "ended": set(owner.grants),
        "delegations": set(owner.grants),
        "approval": set(owner.approvals),
        "decision_id": set(owner.decisions),
        "prefix": {owner.prefix},
    }
    found = []

    def walk(node: Any, key: str | None) -> None:
        if isinstance(node, dict):
            for child_key, value in node.items():
                walk(value, str(child_key))
        elif isinstance(node, list):
            for item in node:
                walk(item, key)
        elif key in by_key and not isinstance(node, bool) and node in by_key[key]:
            found.append(f"{key}={node!r}")

    walk(body, None)
    return found


def cross_agent_check(url: str, owner: AgentWorld, peer: AgentWorld) -> tuple[int, list[str]]:
    """With the peer's token, reach for every one of the owner's objects an agent API
    could show. Returns (requests made, problems)."""
    api = f"{url}/api/v1"
    problems: list[str] = []
    requests = 0

    def get(path: str, method: str = "GET", body: Any = None) -> tuple[int, Any]:
        nonlocal requests
        requests += 1
        status, answer = _request(f"{api}{path}", peer.token, method, body)
        if status >= 500:
            problems.append(f"{method} {path}: {status}")
        for leak in leaks_of(owner, answer):
            problems.append(f"{method} {path} as {peer.name} -> {status} shows {leak}")
        return status, answer

    for path in ("/me", "/grant-requests"):
        status, _ = get(path)
        if status != 200:
            problems.append(f"GET {path} as {peer.name}: {status}, expected 200")
    for grant_id in sorted(owner.grants):
        for path, method, body in (
            (f"/grant-requests/{grant_id}", "GET", None),
            (
                "/delegations",
                "POST",
                {
                    "grant": grant_id,
                    "agent": f"{peer.name}.sub",
                    "actions": ["read"],
                    "scope": f"repo:{owner.name}/docs/x",
                    "expires_at": "2099-01-01T00:00:00Z",
                    "justification": "cross-agent probe",
                },
            ),
        ):
            status, _ = get(path, method, body)
            if status != 404:
                problems.append(f"{method} {path} (of {owner.name}) as {peer.name}: {status}")
    for approval_id in sorted(owner.approvals):
        status, _ = get(f"/approvals/{approval_id}")
        if status != 404:
            problems.append(f"GET /approvals/{approval_id} (of {owner.name}): {status}")
    for decision_id in sorted(owner.decisions):
        path = f"/decisions/{decision_id}/outcome"
        status, _ = get(path, "POST", {"outcome": "succeeded"})
        if status != 404:
            problems.append(f"POST {path} (of {owner.name}) as {peer.name}: {status}")
    # The owner's approved, unused approval, presented by the peer for its own
    # destructive grant: never an allow, and no different from an approval id that
    # does not exist (or the answer tells the peer the owner's approval is real).
    answers = []
    for approval in (owner.approved_approval, str(uuid.uuid4())):
        requests += 1
        status, answer = _request(
            f"{api}/authorize",
            peer.token,
            "POST",
            {
                "tool": "repo",
                "action": "delete",
                "scope": f"repo:{peer.name}/spare",
                "arguments": {"path": "spare"},
                "approval": approval,
            },
        )
        if status != 200 or not isinstance(answer, dict) or answer.get("decision") == "allow":
            problems.append(f"{peer.name} presenting an approval: {status} {answer}")
            return requests, problems
        answer.pop("decision_id", None)
        answers.append(answer)
    mine, unknown = answers
    if mine.get("approval") == owner.approved_approval:
        mine["approval"] = unknown.get("approval")
    if mine != unknown:
        problems.append(
            f"POST /authorize as {peer.name} with {owner.name}'s approval answers "
            f"{mine} but with an unknown approval {unknown}"
        )
    return requests, problems


# Bodies schemathesis is told not to generate (it draws valid UTF-8 without NUL) or
# cannot (raw bytes), each of which must be a 400 in the error shape and write nothing
# but, for an /authorize body that parses, its record: access.denied / invalid_request.
_OK = b'"tool": "repo", "action": "read", "scope": "repo:acme/api/x"'
MALFORMED: list[tuple[str, bytes]] = [
    ("/authorize", b"{" + _OK + b', "arguments": {"a": "\\u0000"}}'),
    ("/authorize", b"{" + _OK + b', "arguments": {"\\u0000": 1}}'),
    ("/authorize", b"{" + _OK + b', "arguments": {"a": "\\ud800"}}'),
    ("/authorize", b"{" + _OK + b', "arguments": ' + b'{"a":' * 40 + b"1" + b"}" * 40 + b"}"),
    ("/authorize", b"{" + _OK + b', "task": "\\ud800"}'),
    ("/authorize", b'{"tool": "re\\u0000po", "action": "read", "scope": "repo:acme/api/x"}'),
    ("/authorize", b"[" * 100_000 + b"]" * 100_000),
    ("/authorize", b"\xff\xfe{}"),
    ("/authorize", b'{"tool": 1e999, "action": "read", "scope": "x"}'),
    ("/authorize", b'{"tool": "repo", "tool": NaN}'),
    (
        "/grant-requests",
        b'{"tool": "repo", "actions": ["read"], "scope": "repo:x/*", '
        b'"duration_seconds": 60, "justification": "why\\u0000"}',
    ),
    (
        "/grant-requests",
        b'{"tool": "repo", "actions": ["read"], "scope": "repo:x/*", '
        b'"duration_seconds": "60", "justification": "why"}',
    ),
    (
        "/grant-requests",
        b'{"tool": "repo", "actions": ["read"], "scope": "repo:x/*", '
        b'"duration_seconds": 60, "justification": "\\u001e \\u3000"}',
    ),
]


ERROR_KEYS = {"code", "message", "fields"}


def malformed_input_check(url: str, agent: AgentWorld) -> tuple[int, list[str]]:
    """Returns (requests made, problems)."""
    from django.db import connections

    from governance.models import AuditEvent, Grant

    def counts() -> tuple[int, int]:
        found = (AuditEvent.objects.order_by("-seq").values_list("seq", flat=True).first() or 0,
                 Grant.objects.count())  # fmt: skip
        connections.close_all()
        return found

    (last_seq, grants), problems = counts(), []
    for path, raw in MALFORMED:
        status, answer = _request(f"{url}/api/v1{path}", agent.token, "POST", raw_body=raw)
        error = answer.get("error") if isinstance(answer, dict) else None
        if status != 400 or not isinstance(error, dict) or set(error) != ERROR_KEYS:
            problems.append(f"POST {path} {raw[:80]!r}...: {status} {str(answer)[:200]}")
    written = list(
        AuditEvent.objects.filter(seq__gt=last_seq).values_list("event_type", "reason", "agent")
    )
    connections.close_all()
    records = len([path for path, _ in MALFORMED if path == "/authorize"])
    refused = ("access.denied", "invalid_request", agent.name)
    if counts()[1] != grants or len(written) > records or set(written) - {refused}:
        problems.append(
            f"malformed requests wrote more than their records: grants {grants} -> "
            f"{counts()[1]}, events {written[:5]} ({len(written)} in all)"
        )
    return len(MALFORMED), problems


def scan_har(har: Path, owner: AgentWorld, peer: AgentWorld) -> tuple[int, list[str]]:
    """Every response schemathesis recorded for requests sent as the peer, searched
    for the owner's objects. (The run also holds the owner's own requests: the
    object-level check replays what the peer read as the owner.)"""
    if not har.exists():
        return 0, [f"no HAR report at {har}"]
    entries = [
        entry
        for entry in json.loads(har.read_text())["log"]["entries"]
        if any(
            h["name"].lower() == IDENTITY_HEADER.lower() and h["value"] == peer.name
            for h in entry["request"]["headers"]
        )
    ]
    problems = []
    for entry in entries:
        response = entry["response"]
        text = response.get("content", {}).get("text") or ""
        try:
            body: Any = json.loads(text)
        except ValueError:
            body = text
        status = int(response.get("status", 0))
        for leak in leaks_of(owner, body):
            request = entry["request"]
            problems.append(f"{request['method']} {request['url']} -> {status} shows {leak}")
    return len(entries), problems


# --- Main ------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default=os.environ.get("FUZZ_POSTGRES", DEFAULT_SERVER))
    parser.add_argument("--database", default=os.environ.get("FUZZ_DATABASE", DEFAULT_DATABASE))
    parser.add_argument(
        "--max-examples", type=int, default=int(os.environ.get("FUZZ_MAX_EXAMPLES", 100))
    )
    parser.add_argument("--seed", type=int, default=int(os.environ.get("FUZZ_SEED", 0)) or None)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--keep", action="store_true", help="keep the database and reports")
    args = parser.parse_args(argv)
    seed_value = args.seed or secrets.randbelow(2**31)
    started = time.monotonic()

    env = {
        **os.environ,
        "DATABASE_URL": f"{args.server}/{args.database}",
        "DJANGO_SETTINGS_MODULE": "governance.settings",
        "DEBUG": "false",
        "ALLOWED_HOSTS": "127.0.0.1",
        # Fuzzing is about what the services say, not about 429s: limits out of reach.
        "RATE_LIMIT_AUTHORIZE_PER_MINUTE": "1000000",
        "RATE_LIMIT_GRANT_REQUESTS_PER_MINUTE": "1000000",
        "RATE_LIMIT_APPROVALS_PER_MINUTE": "1000000",
        "LOG_LEVEL": "WARNING",
    }
    env.pop("REDIS_URL", None)
    os.environ.update({k: env[k] for k in ("DATABASE_URL", "DJANGO_SETTINGS_MODULE")})

    log(f"database {args.database}: drop, create, migrate, seed")
    recreate_database(args.server, args.database)
    tmp = Path(tempfile.mkdtemp(prefix="governance-fuzz-"))
    server: Server | None = None
    failed: list[str] = []
    runs: list[RunResult] = []
    try:
        import django
        from django.core.management import call_command
        from django.db import connections

        django.setup()
        call_command("migrate", verbosity=0, interactive=False)
        world = seed()
        connections.close_all()
        server = Server(env, tmp / "gunicorn.log")
        server.wait_healthy()
        log(f"gunicorn on {server.url} (2 workers); seed {seed_value}")
        wfc = write_auth_file(tmp, world)

        def fuzz(identity: str) -> RunResult:
            result = run_schemathesis(
                url=server.url,  # type: ignore[union-attr]
                identity=identity,
                wfc=wfc,
                tmp=tmp,
                max_examples=args.max_examples,
                seed=seed_value,
                workers=args.workers,
            )
            runs.append(result)
            if result.exit_code != 0 or result.failures:
                failed.append(
                    f"schemathesis as {identity}: exit {result.exit_code}, "
                    f"{result.failures} failing operations"
                )
            if result.cases <= 0:
                failed.append(f"schemathesis as {identity}: could not read the number of cases")
            return result

        a_run = fuzz(AGENT_A)
        b_run = fuzz(AGENT_B)
        a, b = world.agents[AGENT_A], world.agents[AGENT_B]
        collect_objects(a)
        collect_objects(b)
        connections.close_all()
        log(
            f"cross-agent check: {AGENT_A} owns {len(a.grants)} grants, {len(a.approvals)} "
            f"approvals, {len(a.decisions)} decisions"
        )
        probes, problems = cross_agent_check(server.url, a, b)
        reverse, reverse_problems = cross_agent_check(server.url, b, a)
        scanned, scan_problems = scan_har(b_run.har, a, b)
        scanned_back, scan_back_problems = scan_har(a_run.har, b, a)
        isolation = problems + reverse_problems + scan_problems + scan_back_problems
        log(
            f"cross-agent check: {probes + reverse} probes ({AGENT_B} at {AGENT_A}'s objects "
            f"and back), {scanned + scanned_back} responses that schemathesis recorded for "
            f"one agent scanned for the other's objects: {len(isolation)} leaks"
        )
        for problem in isolation:
            log(f"  LEAK {problem}")
        failed += [f"isolation: {p}" for p in isolation]

        malformed, malformed_problems = malformed_input_check(server.url, a)
        log(
            f"malformed input: {malformed} raw requests (NUL, lone surrogates, deep "
            f"nesting, bad bytes, strings for numbers): {len(malformed_problems)} problems"
        )
        for problem in malformed_problems:
            log(f"  MALFORMED {problem}")
        failed += [f"malformed input: {p}" for p in malformed_problems]

        fuzz(ADMIN)
        tracebacks = server.tracebacks()
        if tracebacks:
            failed.append(f"the server logged {len(tracebacks)} tracebacks")
            log(f"server tracebacks (log: {server.log_path}):")
            for block in tracebacks[:5]:
                print("Traceback (most recent call last):" + block[-3000:], flush=True)

        total = sum(r.cases for r in runs)
        log("generated cases per identity:")
        for r in runs:
            log(
                f"  {r.identity:<11} {r.cases:>6} cases  {r.failures} failing operations  "
                f"exit {r.exit_code}  {r.seconds:.0f} s"
            )
        log(f"  {'total':<11} {total:>6} cases")
    finally:
        if server is not None:
            server.stop()
        from django.db import connections

        connections.close_all()
        if args.keep:
            log(f"kept database {args.database} and {tmp}")
        else:
            recreate_database(args.server, args.database, create=False)
            shutil.rmtree(tmp, ignore_errors=True)
        log(f"finished in {time.monotonic() - started:.0f} s")
    cases = sum(r.cases for r in runs)
    if failed:
        log(f"FAILED: {len(failed)} findings")
        for item in failed:
            log(f"  {item}")
    else:
        log("findings: 0")
    # The plain closing line CI reads: generated cases, and findings.
    print(f"fuzz: {max(cases, 0)} passed, {len(failed)} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
