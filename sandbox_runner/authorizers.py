"""The runner's one narrow door to governance, with two adapters.

- DatabaseAuthorizer (in-process): Django settings are available; calls
  governance.services.sandbox directly (access_check, run record, audit
  events, all through the services and their transactions).
- HttpAuthorizer: a runner on another host; the sandbox endpoints of the REST
  API with an agent token (POST /api/v1/sandbox/runs, then started, egress and
  finished reports): the server keeps the same run record and audit events.

Both fail closed: anything but a clean allow is a refusal, and no exception
escapes authorize(). Django is imported only inside DatabaseAuthorizer.
"""

from __future__ import annotations

import base64
import sys
from datetime import UTC, datetime
from typing import Any, Protocol

from sandbox_runner.egress import EgressDecision, parse_destination
from sandbox_runner.spec import (
    LIMIT_MIN,
    LIMIT_NAMES,
    REVIEW_MAX_BYTES,
    Authorization,
    Limits,
    RunResult,
    RunSpec,
)


class Authorizer(Protocol):
    def authorize(self, spec: RunSpec) -> Authorization:
        """Governance's answer; never raises."""
        ...

    def started(
        self, spec: RunSpec, auth: Authorization, result: RunResult, deadline: float
    ) -> None:
        """The sandbox is running (container id, image digest, deadline)."""
        ...

    def finished(self, spec: RunSpec, auth: Authorization, result: RunResult) -> None:
        """The sandbox is gone; record how it ended."""
        ...

    def egress(self, spec: RunSpec, decision: EgressDecision) -> None:
        """One connection attempt through the proxy, allowed or denied."""
        ...

    def dead_reason(self, spec: RunSpec) -> str | None:
        """Asked every few seconds while the sandbox runs: why its grant can no longer
        allow it (agent suspended, grant revoked or expired, ...), or None."""
        ...


def _refusal(spec: RunSpec, outcome: str, reason: str, message: str) -> Authorization:
    return Authorization(outcome=outcome, reason=reason, message=message, run_id=spec.run_id)


def _now() -> datetime:
    return datetime.now(UTC)


class DatabaseAuthorizer:
    """In-process: the governance services, same transaction rules as the API."""

    def __init__(self) -> None:
        import django
        from django.conf import settings

        if not settings.configured:
            import os

            os.environ.setdefault("DJANGO_SETTINGS_MODULE", "governance.settings")
            django.setup()
        from governance.services import sandbox

        self.services = sandbox

    def authorize(self, spec: RunSpec) -> Authorization:
        from django.db import DatabaseError, InterfaceError, OperationalError

        try:
            return self.services.run_request(spec=spec, at=_now())
        except (OperationalError, InterfaceError) as exc:
            return _refusal(spec, "unreachable", "error", f"database unreachable: {exc}")
        except DatabaseError as exc:
            return _refusal(spec, "deny", "error", f"the run could not be recorded: {exc}")
        except Exception as exc:
            return _refusal(spec, "deny", "error", f"{type(exc).__name__}: {exc}")

    def started(
        self, spec: RunSpec, auth: Authorization, result: RunResult, deadline: float
    ) -> None:
        self.services.run_started(
            run_id=spec.run_id,
            container_id=result.container_id,
            image_digest=result.image_digest,
            deadline=deadline,
            enforcement=result.enforcement,
            at=_now(),
        )

    def finished(self, spec: RunSpec, auth: Authorization, result: RunResult) -> None:
        self.services.run_finished(run_id=spec.run_id, result=result, at=_now())

    def egress(self, spec: RunSpec, decision: EgressDecision) -> None:
        self.services.egress_attempt(run_id=spec.run_id, decision=decision, at=_now())

    def dead_reason(self, spec: RunSpec) -> str | None:
        # The reaper's own question, without its deadline part (the runner owns that).
        return self.services.reap_reason(run_id=spec.run_id, deadline=float("inf"), at=_now())


class HttpAuthorizer:
    """Over the REST API (governance/api/sandbox_views.py): the server decides,
    applies the grant's ceiling and keeps the run record and every audit event,
    through the same services as DatabaseAuthorizer. Each report names the run
    and the decision id the server gave for it.

    authorize() fails closed; started/finished/egress raise when the server did
    not record them (the runner then kills the sandbox, as with a database error
    in-process)."""

    def __init__(self, url: str, token: str, timeout: float = 5.0) -> None:
        from governance.client import GovernanceClient

        self.client = GovernanceClient(url, token, timeout=timeout)
        self._decisions: dict[str, str | None] = {}  # run id -> the server's decision id

    def authorize(self, spec: RunSpec) -> Authorization:
        try:
            auth = self._authorize(spec)
            self._decisions[spec.run_id] = auth.decision_id
            return auth
        except Exception as exc:  # fail closed, whatever the shape of the failure
            return _refusal(spec, "malformed", "error", f"{type(exc).__name__}: {exc}")

    def _authorize(self, spec: RunSpec) -> Authorization:
        from governance.client import GovernanceClientError

        asked = spec.arguments()
        payload: dict[str, Any] = {
            key: asked[key]
            for key in ("backend", "image", "command", "script_sha256", "input_sha256")
        }
        if spec.image_id:
            payload["image_id"] = spec.image_id
        if spec.image_problem:
            payload["image_problem"] = spec.image_problem
        # The bytes too when short enough, so a person asked to approve the run reads
        # what would run (the server checks them against the hashes).
        for what, data in (("script", spec.script), ("input", spec.input)):
            if data is not None and len(data) <= REVIEW_MAX_BYTES:
                payload[f"{what}_base64"] = base64.b64encode(data).decode("ascii")
        payload["run_id"] = spec.run_id
        payload["tool"] = spec.tool
        payload["limits"] = {k: v for k, v in asked["limits"].items() if v is not None}
        if spec.task is not None:
            payload["task"] = spec.task
        if spec.egress is not None:
            payload["egress"] = list(spec.egress)
        if spec.approval is not None:
            payload["approval"] = spec.approval
        answer = self.client._call("POST", "/sandbox/runs", payload)
        # What each answer that is not a decision means (the README's exit statuses):
        # - none, a 5xx (the service or a proxy in front of it failing) or a 429 (this
        #   token is rate limited): no decision was given, "unreachable" (69): try again
        #   later, as after a refused connection; a 429 says when, if the server did;
        # - 400 or 413 (the request refused as invalid), 401 or 403 (the token refused:
        #   unknown, revoked, expired, its agent suspended), 409 (this run id is taken):
        #   governance refused, "deny" (77);
        # - a 404 (no such endpoint: the URL is not governance's API), a redirect or any
        #   other status: "malformed" (76), not an answer from governance at all.
        if answer.status == 429:
            when = (
                f"retry after {answer.retry_after} s (Retry-After)"
                if answer.retry_after is not None
                else "no Retry-After given"
            )
            message = f"governance: rate limited (HTTP 429): {when}"
            return _refusal(spec, "unreachable", "rate_limited", message)
        if answer.status is None or answer.status >= 500:
            why = answer.problem
            if answer.status is not None:
                why = f"the service answered {answer.status}" + (f" ({why})" if why else "")
            return _refusal(spec, "unreachable", "unreachable", f"governance: {why}")
        try:
            body = self.client._checked(answer, expect=201)
        except GovernanceClientError as exc:
            if exc.status == 404:
                message = (
                    f"HTTP 404: no sandbox API at {self.client.base_url} (is it governance's "
                    f"URL?): {exc.message}"
                )
                return _refusal(spec, "malformed", "error", message)
            outcome = "deny" if exc.status in (400, 401, 403, 409, 413) else "malformed"
            return _refusal(spec, outcome, exc.code, exc.message)
        return _parse_run(spec, body)

    def _post(self, spec: RunSpec, what: str, payload: dict[str, Any], expect: int) -> None:
        path = f"/sandbox/runs/{spec.run_id}/{what}"
        self.client._checked(self.client._call("POST", path, payload), expect=expect)

    def started(
        self, spec: RunSpec, auth: Authorization, result: RunResult, deadline: float
    ) -> None:
        self._post(
            spec,
            "started",
            {
                "decision_id": auth.decision_id,
                "container_id": result.container_id[:100],
                "image_digest": result.image_digest[:100],
                "deadline": deadline,
                "enforcement": dict(result.enforcement),
            },
            expect=200,
        )

    def finished(self, spec: RunSpec, auth: Authorization, result: RunResult) -> None:
        summary = result.summary()
        streams = {}
        for name in ("stdout", "stderr"):
            streams[name] = dict(summary[name])  # excerpt already cut, NUL-free
        self._post(
            spec,
            "finished",
            {
                "decision_id": auth.decision_id,
                "container_id": result.container_id[:100],
                "image_digest": result.image_digest[:100],
                "enforcement": dict(result.enforcement),
                "exit_code": result.exit_code,
                "timed_out": result.timed_out,
                "oom_killed": result.oom_killed,
                "error": result.error[:2000],
                **streams,
            },
            expect=200,
        )
        # And the decision's own outcome, as any agent reports one (best effort: the
        # run record above is the record of the run).
        if auth.decision_id:
            try:
                self.client.report_outcome(
                    auth.decision_id,
                    "succeeded" if result.exit_code == 0 else "failed",
                    result_digest=result.stdout.sha256,
                )
            except Exception as exc:
                print(f"sandbox_runner: outcome not reported: {exc}", file=sys.stderr)

    def egress(self, spec: RunSpec, decision: EgressDecision) -> None:
        self._post(
            spec,
            "egress",
            {
                "decision_id": self._decisions.get(spec.run_id),
                "reason": decision.reason,
                "host": decision.host[:300],
                "port": decision.port,
                "address": decision.address,
            },
            expect=201,
        )

    def dead_reason(self, spec: RunSpec) -> str | None:
        """The server's answer (GET .../live). A token the server no longer takes
        (the agent suspended, the token revoked or expired) stops the run too: its
        authority is gone. No answer (unreachable, 5xx, 429) leaves it running to its
        deadline: a blip of the service does not kill work in flight."""
        answer = self.client._call("GET", f"/sandbox/runs/{spec.run_id}/live")
        if answer.status in (401, 403):
            return "token_refused"
        if answer.status == 404:
            return "run_unknown"
        body = answer.body if answer.status == 200 and isinstance(answer.body, dict) else None
        if body is None or body.get("live") is not False:
            return None
        reason = body.get("reason")
        return reason[:100] if isinstance(reason, str) and reason else "not_live"


def _parse_run(spec: RunSpec, body: dict[str, Any]) -> Authorization:
    """The server's answer to POST /sandbox/runs, checked; "malformed" unless it is
    a well-formed decision about this run that honours what was asked."""

    def malformed(why: str) -> Authorization:
        return _refusal(spec, "malformed", "error", f"not a decision about this run: {why}")

    outcome, decision_id = body.get("decision"), body.get("decision_id")
    if body.get("run_id") != spec.run_id:
        return malformed("another run_id")
    if outcome not in ("allow", "deny", "approval_required"):
        return malformed(f"decision {outcome!r}")
    if not isinstance(decision_id, str | None):
        return malformed("decision_id")
    common = {
        "reason": str(body.get("reason", "")),
        "message": str(body.get("message", "")),
        "run_id": spec.run_id,
        "grant_id": body.get("grant") if isinstance(body.get("grant"), int) else None,
        "approval_id": body.get("approval") if isinstance(body.get("approval"), str) else None,
        "decision_id": decision_id,
    }
    if outcome != "allow":
        return Authorization(outcome=outcome, **common)
    raw = body.get("limits")
    if not decision_id or not isinstance(raw, dict):
        return malformed("an allow without a decision id or limits")
    values = {}
    for name in LIMIT_NAMES:
        value = raw.get(name)
        # Each at least its smallest enforceable value, whole where it must be: 0.5 MB
        # or 0.5 pids would be cut to 0 on the way down, which Docker reads as no limit.
        whole = name != "cpus"
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or value != value
            or (whole and value != int(value))
            or value < LIMIT_MIN[name]
        ):
            return malformed(f"limit {name}")
        asked = spec.limits.get(name)
        if asked is not None and value != asked:
            return malformed(f"limit {name} {value} is not the {asked} asked for")
        values[name] = value
    try:
        egress = tuple(parse_destination(e) for e in body.get("egress") or [])
        # Compared as the proxy parses them: the server answers in its own spelling
        # (`localhost:8080` for `LOCALHOST:8080`, `[::1]:8080` for `[0::1]:8080`).
        asked = None if spec.egress is None else {parse_destination(e) for e in spec.egress}
    except ValueError as exc:
        return malformed(f"egress: {exc}")
    if asked is not None and set(egress) - asked:
        return malformed("egress beyond what was asked for")
    limits = Limits.from_values(values)
    return Authorization(outcome="allow", limits=limits, egress=egress, **common)
