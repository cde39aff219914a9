"""The web UI's pages. Thin: check the right, parse a strict form, call the one
service (which writes the audit event in its transaction), render.

GET never changes state, with one deliberate kind of exception: reading the
audit log or an export writes the event that says who read it (as the API's
report endpoint does). POST is CSRF-checked by Django's middleware.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import secrets
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar
from urllib.parse import urlsplit

from django.conf import settings
from django.contrib import messages
from django.contrib.auth import views as auth_views
from django.contrib.auth.forms import UsernameField
from django.db.models import Count
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.http.response import HttpResponseBase
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST

from governance import policy, ratelimit, roles, selectors
from governance.admin import admins_only
from governance.errors import Conflict
from governance.models import (
    Agent,
    AgentToken,
    Approval,
    AuditEvent,
    ConfirmationPolicy,
    Grant,
    Task,
    Tool,
)
from governance.services import agents as agent_services
from governance.services import approvals as approval_services
from governance.services import confirmation, exports, reports
from governance.services import grants as grant_services
from governance.services import tasks as task_services
from governance.services import tools as tool_services
from governance.services.outcomes import DECISION_EVENTS
from governance.services.usage import grant_action_usage, grant_usage
from governance.web import charts, common, forms, lifecycle, queries, reveal
from governance.web.access import require

log = logging.getLogger(__name__)

PAGE = 100


# --- Sign-in -----------------------------------------------------------------------------


def _account_key(username: str) -> str:
    """The account a sign-in names, as the sign-in form reads it: Django's UsernameField
    normalizes to NFKC, so a fullwidth `ｃａｒｏｌ` signs in as `carol` and must count
    against her limit, not a limit of its own."""
    named = UsernameField().to_python(username) or ""
    return hashlib.sha256(named.strip().lower().encode()).hexdigest()[:32]


def client_address(request: HttpRequest) -> str:
    """Who is signing in: the peer, or, while the address in hand is a trusted proxy
    (TRUSTED_PROXIES), the X-Forwarded-For entry it added (read right to left). The
    entries left of the first untrusted one are the client's own to write: never read."""
    address = request.META.get("REMOTE_ADDR") or "unknown"
    hops = [hop.strip() for hop in request.META.get("HTTP_X_FORWARDED_FOR", "").split(",")]
    while _trusted_proxy(address) and hops and _parsed(hops[-1]) is not None:
        address = hops.pop()
    return str(_parsed(address) or address)


def address_bucket(address: str) -> str:
    """What one client's sign-ins are counted against: an IPv4 address (`::ffff:a.b.c.d`
    is one) on its own, an IPv6 address by its network of LOGIN_IPV6_PREFIX bits. Every
    client holds a whole /64 (often a /56 or /48): counted per /128, it could spray
    passwords from a new address each time and the per-address limit would never bite."""
    parsed = _parsed(address)
    if isinstance(parsed, ipaddress.IPv6Address):
        # From the integer: a scope (`fe80::1%eth0`) is part of no network's spelling.
        network = ipaddress.IPv6Network((int(parsed), settings.LOGIN_IPV6_PREFIX), strict=False)
        return str(network)
    return str(parsed or address)


def _parsed(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """An address; an IPv4 one a dual-stack socket shows as `::ffff:a.b.c.d` as IPv4."""
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return None
    mapped = getattr(parsed, "ipv4_mapped", None)
    return mapped if mapped is not None else parsed


def _trusted_proxy(address: str) -> bool:
    parsed = _parsed(address)
    return parsed is not None and any(parsed in net for net in settings.TRUSTED_PROXIES)


class LoginView(auth_views.LoginView):
    """Django's sign-in, counted per account and per address (an IPv6 client per
    network: address_bucket) before the password is even checked, so guessing is
    slow whether one account is tried from many places or many accounts from one.
    A limiter that cannot be reached refuses sign-in (fail closed) rather than let
    guessing run unmetered."""

    template_name = "ui/login.html"
    redirect_authenticated_user = True

    def post(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        try:
            ratelimit.check("login_address", address_bucket(client_address(request)))
            ratelimit.check("login_account", _account_key(request.POST.get("username", "")))
        except ratelimit.RateLimited as exc:
            response = self._refuse(
                f"Too many sign-in attempts; try again in {exc.retry_after} s.", 429
            )
            response["Retry-After"] = str(exc.retry_after)
            return response
        except ratelimit.LimiterUnavailable:
            return self._refuse("Sign-in is unavailable for a moment; try again shortly.", 503)
        return super().post(request, *args, **kwargs)

    def _refuse(self, message: str, status: int) -> HttpResponse:
        context = self.get_context_data(form=self.get_form_class()(self.request), refused=message)
        return render(self.request, self.template_name, context, status=status)

    def get_redirect_url(self) -> str:
        """Where `next` points, unless that is Django's admin site for someone who may
        not use it: the site sends them back here, and sending them on would loop."""
        url = super().get_redirect_url()
        if url.startswith("/admin/") and not admins_only(self.request):
            return ""  # the UI's start page instead
        if urlsplit(url).path == self.request.path:
            # Back to this page: Django's sign-in refuses that for a signed-in person
            # with a ValueError (a 500), and after a sign-in it would only bounce.
            return ""
        return url


class LogoutView(auth_views.LogoutView):
    next_page = "/ui/login/"


# --- Dashboard ---------------------------------------------------------------------------


@require("read")
@require_GET
def dashboard(request: HttpRequest) -> HttpResponse:
    now = timezone.now()
    labels, series = queries.live_grants_per_day(now)
    day_labels, per_day = queries.decisions_per_day(now)
    context = {
        "now": now,
        "requests": queries.pending_requests_for(request.user, 20),
        "approvals": queries.pending_approvals_for(request.user, now, 20),
        "expiring": queries.expiring_soon(now)[:50],
        "unused": selectors.unused_grants(now, limit=20),
        "summary": selectors.matrix_summary(),
        "unused_hours": settings.UNUSED_GRANT_HOURS,
        "grants_chart": charts.line_chart(labels, series, "Live grants per day"),
        "decisions_chart": charts.stacked_bars(
            day_labels,
            [
                ("allow", charts.ALLOW, per_day["allow"]),
                ("approval", charts.ASK, per_day["approval_required"]),
                ("deny", charts.DENY, per_day["deny"]),
            ],
            "Decisions per day",
        ),
    }
    context.update(lifecycle.dashboard_context(request.user, now))
    return render(request, "ui/dashboard.html", context)


# --- Matrix and grants -------------------------------------------------------------------


@require("read")
@require_GET
def matrix(request: HttpRequest) -> HttpResponse:
    form = forms.MatrixFilterForm(request.GET or None)
    filters = common.optional(form)
    page, tools, cells = queries.matrix(timezone.now(), **filters)
    rows = [
        (agent, [(tool, cells.get((agent.pk, tool.pk), [])) for tool in tools])
        for agent in page.object_list
    ]
    return render(
        request,
        "ui/matrix.html",
        {
            "form": form,
            "tools": tools,
            "rows": rows,
            "page": page,
            "page_links": common.page_links(request, page),
            "tasks": Task.objects.filter(status=Task.Status.OPEN).order_by("key"),
        },
    )


def _with_chains(grants: Any) -> list[Grant]:
    """The grants, each with `chain` (itself and what it was delegated from, nearest
    first) read for all of them at once: _grant_rows.html shows it, and the model's
    own chain() walked it a query per link per grant."""
    listed = list(grants)
    chains = queries.delegation_chains(listed)
    for grant in listed:
        grant.chain = chains[grant.pk]  # type: ignore[attr-defined]
    return listed


@require("read")
@require_GET
def matrix_cell(request: HttpRequest) -> HttpResponse:
    agent = common.one(Agent.objects.all(), name=request.GET.get("agent", ""))
    tool = common.one(Tool.objects.all(), name=request.GET.get("tool", ""))
    now = timezone.now()
    live = list(selectors.live_grants(now).filter(agent=agent, tool=tool).order_by("pk"))
    _with_chains(live)
    return render(
        request, "ui/matrix_cell.html", {"agent": agent, "tool": tool, "grants": live, "now": now}
    )


def _grants() -> Any:
    return Grant.objects.select_related(
        "agent__owner",
        "tool",
        "task",
        "requested_by",
        "requested_by_agent",
        "approved_by",
        "revoked_by",
    )


@require("read")
@require_GET
def grant_detail(request: HttpRequest, grant_id: int) -> HttpResponse:
    grant = common.one(_grants(), pk=grant_id)
    now = timezone.now()
    # The page shows the grant's audit events: a look at the log, on record.
    exports.audit_viewed(
        actor=common.actor(request), at=now, what="grant", params={"grant": grant.pk}
    )
    uses, last_used = grant_usage(grant)
    return render(
        request,
        "ui/grant.html",
        {
            "grant": grant,
            "uses": uses,
            "last_used": last_used,
            "action_usage": grant_action_usage(grant),
            "chain": queries.delegation_chain(grant),
            "delegations": _grants().filter(delegated_from=grant).order_by("pk"),
            "dead": policy.grant_dead_reason(grant.pk, now) if grant.starts_at else "pending",
            "events": AuditEvent.objects.filter(grant_id=grant.pk).order_by("-seq")[:30],
            "now": now,
        },
    )


@require("decide")  # approvers and admins revoke (DESIGN: who uses the web UI)
@require_POST
def grant_revoke(request: HttpRequest, grant_id: int) -> HttpResponse:
    grant = common.one(Grant.objects.all(), pk=grant_id)
    data = common.cleaned(forms.RequiredReasonForm(request.POST))
    ended = grant_services.grant_revoke(
        grant_id=grant.pk,
        reason=data["reason"],
        revoked_by=request.user,
        actor=common.actor(request),
        at=timezone.now(),
    )
    messages.success(request, f"Revoked {len(ended)} grant(s).")
    return redirect("ui:grant", grant_id=grant.pk)


# --- Inboxes -----------------------------------------------------------------------------


@require("read")
@require_GET
def inbox_requests(request: HttpRequest) -> HttpResponse:
    pending = (
        queries.pending_requests_for(request.user, 200)
        if not request.GET.get("all")
        else Grant.objects.filter(status=Grant.Status.PENDING)
        .select_related("agent__owner", "tool", "task", "requested_by", "requested_by_agent")
        .order_by("created_at")[:200]
    )
    return render(
        request,
        "ui/inbox_requests.html",
        {"requests": pending, "actions": queries.ACTIONS, "now": timezone.now()},
    )


@require("decide")
@require_POST
def request_approve(request: HttpRequest, grant_id: int) -> HttpResponse:
    grant = common.one(Grant.objects.all(), pk=grant_id)
    form = forms.ApproveRequestForm(request.POST)
    grant = grant_services.grant_approve(
        grant_id=grant.pk,
        approver=request.user,
        reason=common.cleaned(form)["reason"],
        actor=common.actor(request),
        at=timezone.now(),
        **form.narrowing(),
    )
    messages.success(request, f"Approved grant #{grant.pk} for {grant.agent.name}.")
    return redirect("ui:inbox-requests")


@require("decide")
@require_POST
def request_deny(request: HttpRequest, grant_id: int) -> HttpResponse:
    grant = common.one(Grant.objects.all(), pk=grant_id)
    data = common.cleaned(forms.RequiredReasonForm(request.POST))
    grant_services.grant_deny(
        grant_id=grant.pk,
        approver=request.user,
        reason=data["reason"],
        actor=common.actor(request),
        at=timezone.now(),
    )
    messages.success(request, f"Denied request #{grant.pk}.")
    return redirect("ui:inbox-requests")


@require("read")
@require_GET
def inbox_approvals(request: HttpRequest) -> HttpResponse:
    now = timezone.now()
    return render(
        request,
        "ui/inbox_approvals.html",
        {
            "approvals": queries.pending_approvals_for(request.user, now, 200),
            "policies": queries.live_confirmation_policies(now),
            "actions": forms.ACTION_CHOICES,
            "now": now,
        },
    )


def _decide_approval(request: HttpRequest, approval_id: str, approve: bool) -> HttpResponse:
    approval = common.one(Approval.objects.all(), pk=approval_id)
    data = common.cleaned((forms.ReasonForm if approve else forms.RequiredReasonForm)(request.POST))
    decide: Callable[..., Approval] = (
        approval_services.approval_approve if approve else approval_services.approval_deny
    )
    decide(
        approval_id=approval.pk,
        approver=request.user,
        reason=data["reason"],
        actor=common.actor(request),
        at=timezone.now(),
    )
    messages.success(request, f"{'Approved' if approve else 'Denied'} the {approval.action} call.")
    return redirect("ui:inbox-approvals")


@require("decide")
@require_POST
def approval_approve(request: HttpRequest, approval_id: str) -> HttpResponse:
    return _decide_approval(request, approval_id, approve=True)


@require("decide")
@require_POST
def approval_deny(request: HttpRequest, approval_id: str) -> HttpResponse:
    return _decide_approval(request, approval_id, approve=False)


@require("decide")
@require_POST
def policy_create(request: HttpRequest) -> HttpResponse:
    data = common.cleaned(forms.ConfirmationPolicyForm(request.POST))
    policy = confirmation.policy_create(
        author=request.user,
        agent=selectors.by_name(Agent, "agent", name=data["agent"]),
        tool=selectors.by_name(Tool, "tool", name=data["tool"]),
        task=selectors.by_name(Task, "task", key=data["task"]) if data.get("task") else None,
        action=data["action"],
        scope=data["scope"],
        verdict=data["verdict"],
        reason=data["reason"],
        duration=timedelta(hours=data["hours"]),
        actor=common.actor(request),
        at=timezone.now(),
    )
    messages.warning(request, f"Confirmation policy #{policy.pk} ({policy.verdict}) is live.")
    return redirect("ui:inbox-approvals")


@require("decide")
@require_POST
def policy_revoke(request: HttpRequest, pk: int) -> HttpResponse:
    policy = common.one(ConfirmationPolicy.objects.all(), pk=pk)
    data = common.cleaned(forms.RequiredReasonForm(request.POST))
    confirmation.policy_revoke(
        policy_id=policy.pk,
        by=request.user,
        reason=data["reason"],
        actor=common.actor(request),
        at=timezone.now(),
    )
    messages.success(request, f"Revoked confirmation policy #{policy.pk}.")
    return redirect("ui:inbox-approvals")


# --- Agents and tokens -------------------------------------------------------------------


@require("read")
@require_GET
def agent_list(request: HttpRequest) -> HttpResponse:
    now = timezone.now()
    agents = Agent.objects.select_related("owner", "parent").order_by("name")
    live = dict(selectors.live_grants(now).values_list("agent_id").annotate(n=Count("id")))
    rows = list(agents)
    for agent in rows:
        agent.live_count = live.get(agent.pk, 0)  # type: ignore[attr-defined]
    return render(request, "ui/agents.html", {"agents": rows})


def _agent_page(
    request: HttpRequest, agent: Agent, *, new_token: str = "", status: int = 200
) -> HttpResponse:
    now = timezone.now()
    ancestors = queries.ancestors(agent)
    response = render(
        request,
        "ui/agent.html",
        {
            "agent": agent,
            "ancestors": ancestors,
            # The topmost agent above that is suspended (the one to resume first): while
            # there is one, this agent cannot be resumed (agent_resume), so the page says
            # so instead of showing a form.
            "suspended_above": next(
                (a for a in ancestors if a.status != Agent.Status.ACTIVE), None
            ),
            "tree": queries.subagent_tree(agent),
            "grants": _with_chains(
                selectors.live_grants(now).filter(agent=agent).order_by("tool__name", "pk")
            ),
            "decisions": AuditEvent.objects.filter(
                agent=agent.name, event_type__in=DECISION_EVENTS
            ).order_by("-seq")[:25],
            "tokens": AgentToken.objects.filter(agent=agent)
            .select_related("created_by")
            .order_by("-created_at", "-pk")[:50],
            "pending_approvals": Approval.objects.filter(
                agent=agent, status=Approval.Status.PENDING, expires_at__gt=now
            ).count(),
            "token_form": forms.TokenForm(),
            # Shown where the page shows the form (agent.html): admins, an active agent.
            "token_form_id": _token_form_shown(request)
            if roles.is_admin(request.user) and agent.status == Agent.Status.ACTIVE
            else "",
            "new_token": new_token,
            "now": now,
        },
        status=status,
    )
    if new_token:
        # The plaintext is in this response only: never cached, never shown again.
        response["Cache-Control"] = "no-store"
    return response


@require("read")
@require_GET
def agent_detail(request: HttpRequest, name: str) -> HttpResponse:
    agent = common.one(Agent.objects.select_related("owner", "parent"), name=name)
    # The page lists the agent's decisions from the audit log: a look at it, on record.
    exports.audit_viewed(
        actor=common.actor(request), at=timezone.now(), what="agent", params={"agent": agent.name}
    )
    return _agent_page(request, agent)


@require("admin")
@require_POST
def agent_suspend(request: HttpRequest, name: str) -> HttpResponse:
    """The kill switch: agent_suspend denies every decision from now and voids
    the agent's open approvals, in one transaction with its event."""
    agent = common.one(Agent.objects.all(), name=name)
    data = common.cleaned(forms.RequiredReasonForm(request.POST))
    agent_services.agent_suspend(
        agent=agent,
        reason=data["reason"],
        actor=common.actor(request),
        at=timezone.now(),
    )
    messages.success(request, f"{agent.name} is suspended: every decision for it is denied.")
    return redirect("ui:agent", name=agent.name)


@require("admin")
@require_POST
def agent_resume(request: HttpRequest, name: str) -> HttpResponse:
    """The way back from the kill switch, for this agent only: agent_resume makes its
    decisions again under its grants, revokes its tokens (a new one is issued here)
    and leaves its subagents suspended, in one transaction with its events."""
    agent = common.one(Agent.objects.all(), name=name)
    data = common.cleaned(forms.RequiredReasonForm(request.POST))
    agent_services.agent_resume(
        agent=agent,
        reason=data["reason"],
        actor=common.actor(request),
        at=timezone.now(),
    )
    still = Agent.objects.filter(parent=agent, status=Agent.Status.SUSPENDED).count()
    below = (
        f" Its subagents stay suspended until each is resumed ({still} directly below it)."
        if still
        else ""
    )
    messages.success(
        request,
        f"{agent.name} is active again. Its earlier tokens no longer work: issue it a new "
        f"one.{below}",
    )
    return redirect("ui:agent", name=agent.name)


# The ids of the token forms this session was shown, each good for one token: the page
# that shows a new token answers a POST, so reloading it sends the form again, and it
# minted a second live token nobody saw (the first one's plaintext on screen).
_TOKEN_FORMS = "token_forms"


def _token_form_shown(request: HttpRequest) -> str:
    form_id = secrets.token_urlsafe(16)
    shown = request.session.get(_TOKEN_FORMS, [])[-9:]
    request.session[_TOKEN_FORMS] = [*shown, form_id]
    return form_id


def _token_form_used(request: HttpRequest, form_id: str) -> bool:
    """True if the form was already used (or never shown to this session); else it is
    used up now."""
    shown = request.session.get(_TOKEN_FORMS, [])
    if form_id not in shown:
        return True
    request.session[_TOKEN_FORMS] = [other for other in shown if other != form_id]
    return False


@require("admin")
@require_POST
def token_issue(request: HttpRequest, name: str) -> HttpResponse:
    agent = common.one(Agent.objects.select_related("owner", "parent"), name=name)
    data = common.cleaned(forms.TokenForm(request.POST))
    if _token_form_used(request, data["form_id"]):
        raise Conflict(
            "form_used",
            "This form already issued a token (reloading the page sends it again): "
            "no other was made. Open the agent's page for a new form, and revoke any "
            "token whose value was not saved.",
        )
    _token, plaintext = agent_services.token_issue(
        created_by=request.user,
        agent=agent,
        days=data["days"],
        actor=common.actor(request),
        at=timezone.now(),
    )
    # Rendered, not redirected: the plaintext must never travel through a URL or session.
    return _agent_page(request, agent, new_token=plaintext, status=201)


@require("admin")
@require_POST
def token_revoke(request: HttpRequest, prefix: str) -> HttpResponse:
    token = common.one(AgentToken.objects.select_related("agent"), prefix=prefix)
    common.cleaned(forms.StrictForm(request.POST))
    agent_services.token_revoke(token=token, actor=common.actor(request), at=timezone.now())
    messages.success(request, f"Token {token.prefix}… revoked.")
    if token.agent is not None:
        return redirect("ui:agent", name=token.agent.name)
    return redirect("ui:agents")


# --- Tasks -------------------------------------------------------------------------------


@require("read")
@require_GET
def task_list(request: HttpRequest) -> HttpResponse:
    now = timezone.now()
    tasks = list(Task.objects.select_related("owner").order_by("-starts_at", "key")[:500])
    live = dict(
        selectors.live_grants(now)
        .filter(task__isnull=False)
        .values_list("task_id")
        .annotate(n=Count("id"))
    )
    for task in tasks:
        task.live_count = live.get(task.pk, 0)  # type: ignore[attr-defined]
        task.open_now = task.is_open_at(now)  # type: ignore[attr-defined]
    return render(request, "ui/tasks.html", {"tasks": tasks})


@require("admin")
@require_POST
def task_close(request: HttpRequest, key: str) -> HttpResponse:
    """Closing a task ends every grant bound to it, in the service's one transaction."""
    task = common.one(Task.objects.all(), key=key)
    common.cleaned(forms.StrictForm(request.POST))
    task_services.task_close(
        task=task, closed_by=request.user, actor=common.actor(request), at=timezone.now()
    )
    messages.success(request, f"Task {task.key} is closed; its grants are revoked.")
    return redirect("ui:tasks")


# --- Tools -------------------------------------------------------------------------------


@require("read")
@require_GET
def tool_list(request: HttpRequest) -> HttpResponse:
    tools = list(Tool.objects.order_by("name"))
    quarantined = [t for t in tools if t.is_quarantined]
    return render(request, "ui/tools.html", {"tools": tools, "quarantined": quarantined})


@require("read")
@require_GET
def tool_detail(request: HttpRequest, name: str) -> HttpResponse:
    tool = common.one(Tool.objects.select_related("definition_updated_by"), name=name)
    # The page shows the tool's audit events: a look at the log, on record.
    exports.audit_viewed(
        actor=common.actor(request), at=timezone.now(), what="tool", params={"tool": tool.name}
    )
    approved = tool.approved_definition or {}
    current = {
        "name": tool.name,
        "description": tool.description,
        "input_schema": tool.input_schema,
    }
    return render(
        request,
        "ui/tool.html",
        {
            "tool": tool,
            "diff": reveal.side_by_side(approved, current),
            "events": AuditEvent.objects.filter(tool=tool.name)
            .exclude(event_type__in=DECISION_EVENTS)
            .order_by("-seq")[:20],
        },
    )


@require("admin")
@require_POST
def tool_approve(request: HttpRequest, name: str) -> HttpResponse:
    tool = common.one(Tool.objects.all(), name=name)
    data = common.cleaned(forms.ToolApproveForm(request.POST))
    tool_services.tool_approve_definition(
        tool=tool,
        definition_hash=data["definition_hash"],
        approver=request.user,
        actor=common.actor(request),
        at=timezone.now(),
    )
    messages.success(request, f"{tool.name}'s definition is approved; it left quarantine.")
    return redirect("ui:tool", name=tool.name)


# --- Audit log, explain, what-if ---------------------------------------------------------


@require("read")
@require_GET
def audit_log(request: HttpRequest) -> HttpResponse:
    form = forms.AuditFilterForm(request.GET or None)
    before = common.optional(form).get("before")
    filters = form.filters() if form.is_bound else {}
    now = timezone.now()
    # The look itself is recorded first, so the page shows its own event.
    exports.audit_viewed(
        actor=common.actor(request), at=now, what="log", params={**filters, "before": before}
    )
    qs = exports.audit_filter(AuditEvent.objects.all(), **filters)
    if before:
        qs = qs.filter(seq__lt=before)
    page = list(qs.order_by("-seq")[: PAGE + 1])
    more, page = len(page) > PAGE, page[:PAGE]
    next_query = common.older_query(request, page[-1].seq if more else None)
    export_query = request.GET.copy()
    export_query.pop("before", None)
    return render(
        request,
        "ui/audit.html",
        {
            "form": form,
            "events": page,
            "next_query": next_query,
            "export_query": export_query.urlencode(),
            "chain": queries.chain_status(now),
            "verify_button": True,
            "decision_events": DECISION_EVENTS,
        },
    )


@require("export")
@require_POST
def audit_verify(request: HttpRequest) -> HttpResponse:
    """Walk the whole chain (an auditor's button): the nightly job, queued now. Not in
    this request: at 500,000 events a walk takes longer than gunicorn lets a worker
    answer, which killed it before anything was recorded. The job records what it
    finds (a failure as audit.verify_failed, alerted) and the page shows it."""
    from governance import tasks

    now = timezone.now()
    try:
        tasks.audit_verify.apply_async()
        queued = True
    except Exception:  # noqa: BLE001 - a broker outage is said on the page, not a 500
        log.warning("could not queue the audit verify job", exc_info=True)
        queued = False
    # Who asked for a walk is on the record; what it found is the job's to record.
    exports.audit_viewed(
        actor=common.actor(request), at=now, what="verify", params={"queued": queued}
    )
    if queued:
        messages.success(
            request, "A full walk of the chain is queued; this page shows its verdict once run."
        )
    else:
        messages.error(request, "The verify job could not be queued (is the broker up?).")
    return redirect("ui:audit")


@require("read")
@require_GET
def audit_event(request: HttpRequest, seq: int) -> HttpResponse:
    event = common.one(AuditEvent.objects.all(), seq=seq)
    exports.audit_viewed(
        actor=common.actor(request), at=timezone.now(), what="event", params={"seq": seq}
    )
    return render(
        request,
        "ui/audit_event.html",
        {
            "event": event,
            "arguments": reveal.pretty_json(event.arguments),
            "data": reveal.pretty_json(event.data),
            "is_decision": event.event_type in DECISION_EVENTS,
        },
    )


@require("export")
@require_GET
def audit_export(request: HttpRequest) -> HttpResponseBase:
    form = forms.AuditFilterForm(request.GET)
    if not form.is_valid() or not form.cleaned_data.get("format"):
        return common.invalid(request, form)
    filters = form.filters()
    fmt = form.cleaned_data["format"]
    now = timezone.now()
    return exports.export(
        report="audit",
        rows_of=lambda: exports.audit_rows(**filters),
        params=filters,
        fmt=fmt,
        actor=common.actor(request),
        now=now,
        build=lambda rows: _streamed(
            rows, exports.AUDIT_COLUMNS, fmt, "audit", now, {"filters": filters}
        ),
    )


def _explanation(reason: str, scope: str) -> list[dict[str, str]]:
    """Each checklist step: passed, decided here, or never reached."""
    deciding = policy.deciding_step(reason, scope)
    steps, reached = [], True
    for key, label, _reasons in policy.CHECKLIST:
        if reason == "error":
            state = "error"
        elif deciding is None:
            state = "passed"
        elif key == deciding:
            state, reached = "decided", False
        else:
            state = "passed" if reached else "not reached"
        steps.append({"key": key, "label": label, "state": state})
    return steps


@require("read")
@require_GET
def explain(request: HttpRequest, uid: str) -> HttpResponse:
    event = common.one(AuditEvent.objects.filter(event_type__in=DECISION_EVENTS), uid=uid)
    # It shows a logged decision and its arguments: reading it is logged, as for the log.
    exports.audit_viewed(
        actor=common.actor(request), at=timezone.now(), what="explain", params={"seq": event.seq}
    )
    grant = _grants().filter(pk=event.grant_id).first() if event.grant_id else None
    return render(
        request,
        "ui/explain.html",
        {
            "event": event,
            "steps": _explanation(event.reason, event.scope),
            "grant": grant,
            "chain": queries.delegation_chain(grant) if grant else [],
            "approval": Approval.objects.filter(pk=event.approval_id).first()
            if event.approval_id
            else None,
        },
    )


@require("read")
@require_GET
def what_if(request: HttpRequest) -> HttpResponse:
    """authorize() as it would answer: pure, so nothing is consumed, counted or logged."""
    form = forms.WhatIfForm(request.GET or None)
    answer = None
    status = 200
    if form.is_bound:
        if form.is_valid():
            data = form.cleaned_data
            at = data.get("at") or timezone.now()
            answer = policy.authorize(
                agent=data["agent"],
                tool=data["tool"],
                action=data["action"],
                scope=data["scope"],
                task=data.get("task") or None,
                arguments=form.arguments(),
                at=at,
            )
            answer_steps = _explanation(answer.reason, data["scope"])
            grant = _grants().filter(pk=answer.grant_id).first() if answer.grant_id else None
            return render(
                request,
                "ui/what_if.html",
                {
                    "form": form,
                    "answer": answer,
                    "steps": answer_steps,
                    "at": at,
                    "grant": grant,
                    **_what_if_choices(),
                },
            )
        status = 400
    return render(request, "ui/what_if.html", {"form": form, **_what_if_choices()}, status=status)


def _what_if_choices() -> dict[str, Any]:
    return {
        "agent_names": Agent.objects.order_by("name").values_list("name", flat=True),
        "tool_names": Tool.objects.order_by("name").values_list("name", flat=True),
        "task_keys": Task.objects.filter(status=Task.Status.OPEN)
        .order_by("key")
        .values_list("key", flat=True),
    }


# --- Exports and the printable report ----------------------------------------------------

CONTENT_TYPES = {
    "csv": "text/csv; charset=utf-8",
    "json": "application/json",
    "xlsx": "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet",
}


_Response = TypeVar("_Response", bound=HttpResponseBase)


def _file(
    rows: list[dict[str, Any]],
    columns: tuple[str, ...],
    fmt: str,
    name: str,
    now: datetime,
    meta: dict[str, Any],
) -> HttpResponse:
    body: str | bytes
    if fmt == "csv":
        body = exports.to_csv(rows, columns)
    elif fmt == "json":
        body = exports.to_json(rows, {"report": name, "produced_at": now, **meta})
    else:
        body = exports.to_xlsx(rows, columns, name)
    return _attachment(HttpResponse(body, content_type=CONTENT_TYPES[fmt]), fmt, name, now)


def _streamed(
    rows: exports.EventRows,
    columns: tuple[str, ...],
    fmt: str,
    name: str,
    now: datetime,
    meta: dict[str, Any],
) -> HttpResponseBase:
    """Audit events in CSV or JSON, written as they are read once the export's record
    has committed (exports.EventRows): the file _file would make, never held whole.
    XLSX is made whole, in the transaction, within exports.XLSX_MAX_ROWS."""
    if fmt == "xlsx":
        return _attachment(
            HttpResponse(exports.to_xlsx(rows, columns, name), content_type=CONTENT_TYPES[fmt]),
            fmt,
            name,
            now,
        )
    lines = (
        reports.csv_lines(rows, columns)
        if fmt == "csv"
        else exports.json_lines(rows, {"report": name, "produced_at": now, **meta}, len(rows))
    )
    return _attachment(
        StreamingHttpResponse(lines, content_type=CONTENT_TYPES[fmt]), fmt, name, now
    )


def _attachment(response: _Response, fmt: str, name: str, now: datetime) -> _Response:
    stamp = now.astimezone(UTC).strftime("%Y%m%dT%H%M%SZ")
    response["Content-Disposition"] = f'attachment; filename="{name}-{stamp}.{fmt}"'
    response["Cache-Control"] = "no-store"
    return response


@require("export")
@require_GET
def exports_page(request: HttpRequest) -> HttpResponse:
    return render(
        request,
        "ui/exports.html",
        {
            "access_form": forms.AccessExportForm(),
            "decision_form": forms.DecisionExportForm(),
            "max_rows": f"{reports.MAX_ROWS:,}",
            "xlsx_max_rows": f"{exports.XLSX_MAX_ROWS:,}",
        },
    )


@require("export")
@require_GET
def export_access(request: HttpRequest) -> HttpResponse:
    data, now = common.cleaned(forms.AccessExportForm(request.GET)), timezone.now()
    fmt = data["format"]
    narrow = {k: data[k] for k in ("agent", "task", "tool") if data.get(k)}
    if data.get("start"):
        params = {"from": data["start"], "to": data["end"], **narrow}
        return exports.export(
            report="access_period",
            rows_of=lambda: exports.access_period_rows(data["start"], data["end"], **narrow),
            params=params,
            fmt=fmt,
            actor=common.actor(request),
            now=now,
            build=lambda rows: _file(
                rows, exports.PERIOD_COLUMNS, fmt, "access-period", now, params
            ),
        )
    at = data.get("at") or now
    params = {"at": at, **narrow}
    return exports.export(
        report="access",
        rows_of=lambda: exports.with_reviews(reports.access_rows(at, **narrow)),
        params=params,
        fmt=fmt,
        actor=common.actor(request),
        now=now,
        build=lambda rows: _file(rows, exports.ACCESS_COLUMNS, fmt, "access", now, params),
    )


@require("export")
@require_GET
def export_decisions(request: HttpRequest) -> HttpResponseBase:
    data, now = common.cleaned(forms.DecisionExportForm(request.GET)), timezone.now()
    params = {k: data[k] for k in ("start", "end", "agent", "task", "tool") if data.get(k)}
    return exports.export(
        report="decisions",
        rows_of=lambda: exports.decision_rows(
            data["start"],
            data["end"],
            agent=data["agent"],
            task=data["task"],
            tool=data["tool"],
        ),
        params=params,
        fmt=data["format"],
        actor=common.actor(request),
        now=now,
        build=lambda rows: _streamed(
            rows, exports.DECISION_COLUMNS, data["format"], "decisions", now, params
        ),
    )


@require("export")
@require_GET
def report_print(request: HttpRequest) -> HttpResponse:
    """The access report as a page that prints cleanly to PDF, naming the audit
    checkpoint and chain state it was produced against."""
    form = forms.ReportForm(request.GET or None)
    data, now = common.optional(form), timezone.now()
    at = data.get("at") or now
    narrow = {k: data[k] for k in ("agent", "task", "tool") if data.get(k)}
    chain = queries.chain_status(now)
    rows = exports.export(
        report="access",
        rows_of=lambda: exports.with_reviews(reports.access_rows(at, **narrow)),
        params={
            "at": at,
            **narrow,
            "checkpoint": chain["checkpoint"]["file"] if chain["checkpoint"] else None,
        },
        fmt="print",
        actor=common.actor(request),
        now=now,
    )
    return render(
        request,
        "ui/report.html",
        {"rows": rows, "at": at, "now": now, "chain": chain, "narrow": narrow, "form": form},
    )
