"""Sandbox runs in the web UI: what ran, under which grant, on which image, with which
limits and egress, and how it ended. Read-only: a run is stopped through its grant
(revoke) or its agent (suspend), which reach a running sandbox within seconds."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone
from django.views.decorators.http import require_GET

from governance.models import Agent, AuditEvent, SandboxRun, Tool
from governance.services import exports
from governance.web import common, forms, queries
from governance.web.access import require
from sandbox_runner.spec import LIMIT_NAMES

PAGE = 100


@require("read")
@require_GET
def run_list(request: HttpRequest) -> HttpResponse:
    form = forms.RunFilterForm(request.GET or None)
    data = common.optional(form)
    runs, next_before = queries.runs_page(
        agent=data.get("agent") or "",
        status=data.get("status") or "",
        before=data.get("before"),
        size=PAGE,
    )
    agents = _known(Agent, {run.agent for run in runs})
    for run in runs:
        run.agent_known = run.agent in agents  # type: ignore[attr-defined]
    return render(
        request,
        "ui/runs.html",
        {"form": form, "runs": runs, "next_query": common.older_query(request, next_before)},
    )


def _known(model: type[Agent] | type[Tool], names: set[str]) -> set[str]:
    """Which of the names a run was recorded under are an agent's (or tool's): a refused
    run keeps whatever it was asked under (`no/such`), which has no page to link to
    (and a name with a slash cannot even be made a link: the page answered 500)."""
    return set(model.objects.filter(name__in=names).values_list("name", flat=True))


@require("read")
@require_GET
def run_detail(request: HttpRequest, run_id: str) -> HttpResponse:
    run = common.one(SandboxRun.objects.select_related("grant"), run_id=run_id)
    # The page shows the run's audit events and its (masked) output: a look at the
    # record, recorded like a look at the audit log.
    exports.audit_viewed(
        actor=common.actor(request),
        at=timezone.now(),
        what="sandbox_run",
        params={"run_id": str(run.run_id)},
    )
    events = queries.run_events(run)
    decision = AuditEvent.objects.filter(uid=run.decision_id).first() if run.decision_id else None
    limits = [
        {
            "name": name,
            "requested": run.requested_limits.get(name),
            "granted": run.limits.get(name),
            "enforced_by": run.enforcement.get(name.removesuffix("_mb")),
        }
        for name in LIMIT_NAMES
    ]
    return render(
        request,
        "ui/run.html",
        {
            "run": run,
            "decision": decision,
            "events": events,
            "egress_attempts": queries.egress_attempts(events),
            "limits": limits,
            "agent_known": bool(_known(Agent, {run.agent})),
            "tool_known": bool(_known(Tool, {run.tool})),
        },
    )
