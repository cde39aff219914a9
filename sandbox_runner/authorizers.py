"""The runner's one narrow door to governance, with two adapters.

- DatabaseAuthorizer (in-process): Django settings are available; calls
  governance.services.sandbox directly (access_check, run record, audit
  events, all through the services and their transactions).
- HttpAuthorizer: a runner on another host; POST /api/v1/authorize with a
  bearer token (governance.client), the grant's ceiling from GET /api/v1/me,
  and the outcome reported to POST /api/v1/decisions/{id}/outcome.

Both fail closed: anything but a clean allow is a refusal, and no exception
escapes authorize(). Django is imported only inside DatabaseAuthorizer.
"""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime
from typing import Any, Protocol

from sandbox_runner.egress import EgressDecision
from sandbox_runner.spec import Authorization, OverCeiling, RunResult, RunSpec, effective


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


class HttpAuthorizer:
    """Over the REST API. Until the API records sandbox runs, the run record
    lives only as the decision's outcome (digest and excerpt) on the server,
    and egress attempts are logged locally (stderr, one JSON line each)."""

    def __init__(self, url: str, token: str, timeout: float = 5.0) -> None:
        from governance.client import GovernanceClient

        self.client = GovernanceClient(url, token, timeout=timeout)

    def authorize(self, spec: RunSpec) -> Authorization:
        try:
            return self._authorize(spec)
        except Exception as exc:  # fail closed, whatever the shape of the failure
            return _refusal(spec, "malformed", "error", f"{type(exc).__name__}: {exc}")

    def _authorize(self, spec: RunSpec) -> Authorization:
        decision = self.client.authorize(
            spec.tool, "execute", spec.scope, task=spec.task, arguments=spec.arguments()
        )
        if decision.reason == "unreachable":
            return _refusal(spec, "unreachable", decision.reason, decision.message)
        if (
            decision.reason == "error"
            and decision.message.startswith("HTTP ")
            and (decision.status != 503)
        ):
            # The client's words for "an answer that is not a decision".
            return _refusal(spec, "malformed", decision.reason, decision.message)
        if not decision.allowed:
            return Authorization(
                outcome=decision.decision,
                reason=decision.reason,
                message=decision.message,
                run_id=spec.run_id,
                grant_id=decision.grant,
                approval_id=decision.approval,
                decision_id=decision.decision_id,
            )
        me = self.client._checked(self.client._call("GET", "/me"), expect=200)
        grant = next((g for g in me.get("grants", []) if g.get("id") == decision.grant), None)
        if not isinstance(grant, dict):
            return _refusal(spec, "malformed", "error", "the allowing grant is not in /me")
        # Without the grant's limits there is no ceiling to hold the request to: refuse
        # (the runner's floor could be above a grant's own limits).
        ceiling = grant.get("limits")
        if not isinstance(ceiling, dict):
            return _refusal(spec, "malformed", "error", "the server does not show the limits")
        try:
            limits, egress = effective(spec, ceiling, grant.get("egress") or [])
        except (OverCeiling, ValueError) as exc:
            self._report(decision.decision_id, "aborted", excerpt=f"limit_exceeds_grant: {exc}")
            return _refusal(spec, "deny", "limit_exceeds_grant", str(exc))
        return Authorization(
            outcome="allow",
            reason=decision.reason,
            message=decision.message,
            run_id=spec.run_id,
            limits=limits,
            egress=egress,
            grant_id=decision.grant,
            decision_id=decision.decision_id,
        )

    def _report(self, decision_id: str | None, outcome: str, **kw: Any) -> None:
        if not decision_id:
            return
        try:
            self.client.report_outcome(decision_id, outcome, **kw)
        except Exception as exc:
            print(f"sandbox_runner: outcome not reported: {exc}", file=sys.stderr)

    def started(
        self, spec: RunSpec, auth: Authorization, result: RunResult, deadline: float
    ) -> None:
        return None

    def finished(self, spec: RunSpec, auth: Authorization, result: RunResult) -> None:
        summary = result.summary()
        self._report(
            auth.decision_id,
            "succeeded" if result.exit_code == 0 else "failed",
            result_digest=summary["stdout"]["sha256"],
            excerpt=json.dumps(
                {k: summary[k] for k in ("run_id", "exit_code", "timed_out", "oom_killed")}
            ),
        )

    def egress(self, spec: RunSpec, decision: EgressDecision) -> None:
        line = {
            "event": "sandbox.egress." + ("allowed" if decision.allowed else "denied"),
            "run_id": spec.run_id,
            "destination": f"{decision.host}:{decision.port}",
            "address": decision.address,
            "reason": decision.reason,
        }
        print(json.dumps(line), file=sys.stderr, flush=True)
