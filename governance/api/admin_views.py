"""Admin and automation endpoints: agents, tokens, tools, tasks, grants, reports, and
confirmation policies (approvers write those; auditors read).

For humans only. Admins do everything; auditors read (GET); approvers, plain
users and agents get 403 (AdminOrAuditorReadOnly). Views stay thin: parse the
input, look up the object by its public name (404 if missing), call the one
service that changes it (which writes the audit event in its transaction),
render the output.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, timedelta
from typing import Any

from django.contrib.auth import get_user_model
from django.db.models import QuerySet
from django.http import HttpResponse
from django.utils import timezone
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import status
from rest_framework.renderers import BaseRenderer, JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from governance import selectors
from governance.api import serializers as s
from governance.api.auth import AdminOrAuditorReadOnly, ApproverOrAuditorReadOnly
from governance.api.views import ERRORS, _get, _grant_qs, actor_for
from governance.errors import GovernanceError
from governance.models import Agent, AgentToken, ConfirmationPolicy, Grant, Task, Tool
from governance.services import agents, confirmation, grants, reports, tasks, tools

# Inventory lists (agents, tools, tasks, tokens) are capped; grants, which grow
# without bound, are paged instead.
LIST_CAP = 500
CONFLICT = {409: OpenApiResponse(s.ErrorSerializer, description="Already exists / wrong state")}
# A response carrying a secret or an access report must not sit in any cache.
NO_STORE = {"Cache-Control": "no-store"}


class AdminView(APIView):
    permission_classes = [AdminOrAuditorReadOnly]


def _parse(serializer_class: type[s.StrictSerializer], data: Any) -> dict[str, Any]:
    body = serializer_class(data=data)
    body.is_valid(raise_exception=True)
    return dict(body.validated_data)


@contextmanager
def _blame(**field_for_code: str) -> Iterator[None]:
    """Name the input field a service error is about when the service did not,
    so a client can point at it ({"code": "invalid_agent_name"} -> "name")."""
    try:
        yield
    except GovernanceError as exc:
        field = field_for_code.get(exc.code)
        if field is not None and not exc.fields:
            exc.fields = {field: exc.message}
        raise


def _user(username: str, field: str) -> Any:
    user = get_user_model().objects.filter(username=username, is_active=True).first()
    if user is None:
        raise GovernanceError(
            f"unknown_{field}", f"No active user is named {username!r}.", fields={field: "unknown"}
        )
    return user


def _agents() -> QuerySet[Agent]:
    return Agent.objects.select_related("owner", "parent").prefetch_related("subagents")


def _agent(name: str) -> Agent:
    return _get(_agents(), "agent", name=name)


def _tokens() -> QuerySet[AgentToken]:
    return AgentToken.objects.select_related("agent", "user", "created_by")


def _tasks() -> QuerySet[Task]:
    return Task.objects.select_related("owner")


def _grant(grant_id: int) -> Grant:
    return _get(_grant_qs().select_related("revoked_by"), "grant", pk=grant_id)


# --- Agents --------------------------------------------------------------------------


class AgentListView(AdminView):
    @extend_schema(
        operation_id="agents_list",
        responses={200: s.AgentOut(many=True), **ERRORS},
        description=f"Every agent by name (at most {LIST_CAP}).",
    )
    def get(self, request: Request) -> Response:
        s.no_query(request.query_params)
        return Response(s.AgentOut(_agents().order_by("name")[:LIST_CAP], many=True).data)

    @extend_schema(
        operation_id="agent_create",
        request=s.AgentIn,
        responses={201: s.AgentOut, **CONFLICT, **ERRORS},
        description=(
            "Create an agent with an accountable human owner, optionally a subagent "
            "(409 `parent_suspended` under a suspended agent)."
        ),
    )
    def post(self, request: Request) -> Response:
        data = _parse(s.AgentIn, request.data)
        owner = _user(data["owner"], "owner")
        parent = None
        if data.get("parent") is not None:
            parent = Agent.objects.filter(name=data["parent"]).first()
            if parent is None:
                raise GovernanceError(
                    "unknown_parent",
                    f"No agent is named {data['parent']!r}.",
                    fields={"parent": "unknown"},
                )
        with _blame(invalid_agent_name="name", agent_exists="name"):
            agent = agents.agent_create(
                name=data["name"],
                owner=owner,
                parent=parent,
                description=data["description"],
                actor=actor_for(request),
                at=timezone.now(),
            )
        return Response(s.AgentOut(_agent(agent.name)).data, status=status.HTTP_201_CREATED)


class AgentDetailView(AdminView):
    @extend_schema(operation_id="agent_get", responses={200: s.AgentDetailOut, **ERRORS})
    def get(self, request: Request, name: str) -> Response:
        s.no_query(request.query_params)
        agent = _agent(name)
        agent.live_grants = (  # type: ignore[attr-defined]
            selectors.live_grants(timezone.now()).filter(agent=agent).order_by("id")
        )
        return Response(s.AgentDetailOut(agent).data)


class AgentSuspendView(AdminView):
    @extend_schema(
        operation_id="agent_suspend",
        request=s.RequiredReasonIn,
        responses={200: s.AgentOut, **ERRORS},
        description=(
            "The kill switch: every decision for the agent is denied from now on, its "
            "tokens stop working, its open approvals are voided and the grant requests "
            "it filed itself are closed as denied; so for every "
            "subagent below it. Suspending a suspended agent changes nothing. Undone "
            "one agent at a time by `agents/{name}/resume`."
        ),
    )
    def post(self, request: Request, name: str) -> Response:
        data = _parse(s.RequiredReasonIn, request.data)
        agent = _agent(name)
        agents.agent_suspend(
            agent=agent, reason=data["reason"], actor=actor_for(request), at=timezone.now()
        )
        return Response(s.AgentOut(_agent(name)).data)


class AgentResumeView(AdminView):
    @extend_schema(
        operation_id="agent_resume",
        request=s.RequiredReasonIn,
        responses={
            200: s.AgentOut,
            409: OpenApiResponse(
                s.ErrorSerializer,
                description=(
                    "`agent_not_suspended`, `parent_suspended` (an agent above it is "
                    "suspended) or `resume_before_suspension`"
                ),
            ),
            **ERRORS,
        },
        description=(
            "Lift the kill switch from one suspended agent (a reason is required): its "
            "decisions are made again from now, under its grants as they stand (they are "
            "time-boxed, so one that ended meanwhile stays ended). Its subagents stay "
            "suspended (each is resumed on its own, never under a suspended agent: 409 "
            "`parent_suspended`). Its tokens are revoked with it: issue it a new one. "
            "Approvals voided and requests closed by the suspension stay so. A 409 "
            "`agent_not_suspended` for an agent that is not suspended."
        ),
    )
    def post(self, request: Request, name: str) -> Response:
        data = _parse(s.RequiredReasonIn, request.data)
        agent = _agent(name)
        agents.agent_resume(
            agent=agent, reason=data["reason"], actor=actor_for(request), at=timezone.now()
        )
        return Response(s.AgentOut(_agent(name)).data)


class AgentTokensView(AdminView):
    @extend_schema(
        operation_id="agent_tokens_list",
        responses={200: s.TokenOut(many=True), **ERRORS},
        description="The agent's tokens, newest first. Never a digest or a plaintext.",
    )
    def get(self, request: Request, name: str) -> Response:
        s.no_query(request.query_params)
        agent = _agent(name)
        found = _tokens().filter(agent=agent).order_by("-created_at", "-id")[:LIST_CAP]
        return Response(s.TokenOut(found, many=True).data)

    @extend_schema(
        operation_id="agent_token_issue",
        request=s.TokenIssueIn,
        responses={201: s.TokenIssuedOut, **CONFLICT, **ERRORS},
        description=(
            "Issue a token. The plaintext is in this response only, never again. A "
            "suspended agent gets none (409 `agent_suspended`)."
        ),
    )
    def post(self, request: Request, name: str) -> Response:
        data = _parse(s.TokenIssueIn, request.data)
        agent = _agent(name)
        with _blame(invalid_expiry="expires_days"):
            token, plaintext = agents.token_issue(
                created_by=request.user,
                agent=agent,
                days=data["expires_days"],
                actor=actor_for(request),
                at=timezone.now(),
            )
        token.plaintext = plaintext  # type: ignore[attr-defined]
        return Response(s.TokenIssuedOut(token).data, status=201, headers=NO_STORE)


class TokenRevokeView(AdminView):
    @extend_schema(
        operation_id="token_revoke",
        request=None,
        responses={200: s.TokenOut, **ERRORS},
        description="Revoke an agent's or a person's token by its prefix, at once.",
    )
    def post(self, request: Request, prefix: str) -> Response:
        _parse(s.EmptyIn, request.data)
        token = _get(_tokens(), "token", prefix=prefix)
        token = agents.token_revoke(token=token, actor=actor_for(request), at=timezone.now())
        return Response(s.TokenOut(token).data)


# --- Tools ---------------------------------------------------------------------------


class ToolListView(AdminView):
    @extend_schema(
        operation_id="tools_list",
        responses={200: s.ToolOut(many=True), **ERRORS},
        description=f"The inventory by name (at most {LIST_CAP}).",
    )
    def get(self, request: Request) -> Response:
        s.no_query(request.query_params)
        return Response(s.ToolOut(Tool.objects.order_by("name")[:LIST_CAP], many=True).data)

    @extend_schema(
        operation_id="tool_register",
        request=s.ToolIn,
        responses={201: s.ToolOut, **CONFLICT, **ERRORS},
        description="Add a tool. Registering approves its definition as sent.",
    )
    def post(self, request: Request) -> Response:
        data = _parse(s.ToolIn, request.data)
        with _blame(invalid_tool_name="name", tool_exists="name"):
            tool = tools.tool_register(**data, actor=actor_for(request), at=timezone.now())
        return Response(s.ToolOut(tool).data, status=status.HTTP_201_CREATED)


class BodyRequiredSchema(AutoSchema):
    """A PATCH whose body must name at least one field: the body itself is required
    (drf-spectacular makes every PATCH body optional)."""

    def _get_request_body(self, direction: str = "request") -> Any:
        body = super()._get_request_body(direction)
        if body is not None:
            body["required"] = True
        return body


class ToolDetailView(AdminView):
    schema = BodyRequiredSchema()

    @extend_schema(operation_id="tool_get", responses={200: s.ToolOut, **ERRORS})
    def get(self, request: Request, name: str) -> Response:
        s.no_query(request.query_params)
        return Response(s.ToolOut(_get(Tool.objects.all(), "tool", name=name)).data)

    @extend_schema(
        operation_id="tool_update_definition",
        request=s.ToolDefinitionIn,
        responses={200: s.ToolOut, **ERRORS},
        description=(
            "Record what the tool now says about itself (fields left out keep their value). "
            "Any change quarantines the tool until an admin approves the new definition."
        ),
    )
    def patch(self, request: Request, name: str) -> Response:
        data = _parse(s.ToolDefinitionIn, request.data)
        tool = _get(Tool.objects.all(), "tool", name=name)
        tool = tools.tool_update_definition(
            tool=tool,
            # Left out: the value when the row is locked, not as read here.
            description=data.get("description", tools.KEEP),
            input_schema=data.get("input_schema", tools.KEEP),
            updated_by=request.user,
            actor=actor_for(request),
            at=timezone.now(),
        )
        return Response(s.ToolOut(tool).data)


class ToolApproveView(AdminView):
    @extend_schema(
        operation_id="tool_approve_definition",
        request=s.ToolApproveIn,
        responses={200: s.ToolOut, 409: ERRORS[400], **ERRORS},
        description=(
            "Approve the definition you reviewed, named by its definition_hash: it leaves "
            "quarantine. If the definition changed since, 409 definition_changed and "
            "nothing is approved."
        ),
    )
    def post(self, request: Request, name: str) -> Response:
        tool = _get(Tool.objects.all(), "tool", name=name)
        body = _parse(s.ToolApproveIn, request.data)
        tool = tools.tool_approve_definition(
            tool=tool,
            definition_hash=body["definition_hash"],
            approver=request.user,
            actor=actor_for(request),
            at=timezone.now(),
        )
        return Response(s.ToolOut(tool).data)


# --- Tasks ---------------------------------------------------------------------------


class TaskListView(AdminView):
    @extend_schema(
        operation_id="tasks_list",
        responses={200: s.TaskOut(many=True), **ERRORS},
        description=f"Tasks, most recently started first (at most {LIST_CAP}).",
    )
    def get(self, request: Request) -> Response:
        s.no_query(request.query_params)
        found = _tasks().order_by("-starts_at", "key")[:LIST_CAP]
        return Response(s.TaskOut(found, many=True).data)

    @extend_schema(
        operation_id="task_open",
        request=s.TaskIn,
        responses={201: s.TaskOut, **CONFLICT, **ERRORS},
        description="Open a task now. Grants bound to it die when it closes.",
    )
    def post(self, request: Request) -> Response:
        data = _parse(s.TaskIn, request.data)
        owner = _user(data["owner"], "owner") if "owner" in data else request.user
        with _blame(
            invalid_task_key="key",
            invalid_task_title="title",
            task_exists="key",
            invalid_window="ends_at",
        ):
            task = tasks.task_open(
                key=data["key"],
                title=data["title"],
                owner=owner,
                ends_at=data.get("ends_at"),
                actor=actor_for(request),
                at=timezone.now(),
            )
        return Response(s.TaskOut(task).data, status=status.HTTP_201_CREATED)


class TaskDetailView(AdminView):
    @extend_schema(operation_id="task_get", responses={200: s.TaskDetailOut, **ERRORS})
    def get(self, request: Request, key: str) -> Response:
        s.no_query(request.query_params)
        task = _get(_tasks(), "task", key=key)
        task.bound_grants = _grant_qs().filter(task=task).order_by("id")  # type: ignore[attr-defined]
        return Response(s.TaskDetailOut(task).data)


class TaskCloseView(AdminView):
    @extend_schema(
        operation_id="task_close",
        request=None,
        responses={200: s.TaskOut, **ERRORS},
        description="Close the task and revoke every grant bound to it. Closing twice is a no-op.",
    )
    def post(self, request: Request, key: str) -> Response:
        _parse(s.EmptyIn, request.data)
        task = _get(_tasks(), "task", key=key)
        task = tasks.task_close(
            task=task, closed_by=request.user, actor=actor_for(request), at=timezone.now()
        )
        return Response(s.TaskOut(task).data)


# --- Grants --------------------------------------------------------------------------


def _filtered_grants(query: dict[str, Any], *, at: Any) -> QuerySet[Grant]:
    found = selectors.live_grants(at) if query["live"] else _grant_qs()
    lookups = {
        "agent__name": "agent",
        "tool__name": "tool",
        "task__key": "task",
        "status": "status",
    }
    for lookup, key in lookups.items():
        if key in query:
            found = found.filter(**{lookup: query[key]})
    if "before" in query:
        found = found.filter(pk__lt=query["before"])
    return found.select_related("requested_by_agent").order_by("-id")


class GrantListView(AdminView):
    @extend_schema(
        operation_id="grants_list",
        parameters=[s.GrantFilterIn],
        responses={200: s.GrantPageOut, **ERRORS},
        description="Grants, newest first, a page at a time: follow `next` until it is null.",
    )
    def get(self, request: Request) -> Response:
        query = _parse(s.GrantFilterIn, request.query_params)
        page = list(_filtered_grants(query, at=timezone.now())[: query["limit"] + 1])
        more, page = len(page) > query["limit"], page[: query["limit"]]
        next_url = None
        if more:
            params = request.query_params.copy()
            params["before"] = str(page[-1].pk)
            next_url = f"{request.path}?{params.urlencode()}"
        return Response(s.GrantPageOut({"results": page, "next": next_url}).data)


class GrantDetailView(AdminView):
    @extend_schema(operation_id="grant_get", responses={200: s.GrantDetailOut, **ERRORS})
    def get(self, request: Request, grant_id: int) -> Response:
        s.no_query(request.query_params)
        return Response(s.GrantDetailOut(_grant(grant_id)).data)


class GrantRevokeView(AdminView):
    @extend_schema(
        operation_id="grant_revoke",
        request=s.RequiredReasonIn,
        responses={200: s.GrantRevokeOut, **ERRORS},
        description=(
            "Revoke at once, with every grant delegated from it. An ended grant stays as it "
            "is (`ended` is then empty)."
        ),
    )
    def post(self, request: Request, grant_id: int) -> Response:
        data = _parse(s.RequiredReasonIn, request.data)
        grant = _grant(grant_id)
        with _blame(reason_required="reason"):
            ended = grants.grant_revoke(
                grant_id=grant.pk,
                reason=data["reason"],
                revoked_by=request.user,
                actor=actor_for(request),
                at=timezone.now(),
            )
        body = {"grant": _grant(grant.pk), "ended": [g.pk for g in ended]}
        return Response(s.GrantRevokeOut(body).data)


# --- Reports -------------------------------------------------------------------------


class AccessReportView(AdminView):
    # No HEAD: Django would answer it by running get(), which records an export
    # (`report.exported`) of a body that is never sent.
    http_method_names = ["get", "options"]

    def perform_content_negotiation(
        self, request: Request, force: bool = False
    ) -> tuple[BaseRenderer, str]:
        # `format` is this report's own, validated parameter; DRF's negotiation would
        # answer an unknown one with a bare 404. Errors are always JSON.
        renderer = JSONRenderer()
        return renderer, renderer.media_type

    @extend_schema(
        operation_id="report_access",
        parameters=[s.AccessReportIn],
        responses={
            (200, "application/json"): s.AccessReportOut,
            (200, "text/csv"): OpenApiTypes.STR,
            **ERRORS,
        },
        description=(
            "Who could do what at `at` (default now): one row per grant live then. Reading "
            "it writes a `report.exported` audit event. CSV cells that a spreadsheet would "
            "run as formulas are prefixed with a single quote."
        ),
    )
    def get(self, request: Request) -> Response | HttpResponse:
        query = _parse(s.AccessReportIn, request.query_params)
        now = timezone.now()
        at = query.get("at") or now
        narrow = {k: query[k] for k in ("agent", "task", "tool") if query.get(k)}
        rows = reports.access_report_export(
            at=at, fmt=query["format"], actor=actor_for(request), now=now, **narrow
        )
        if query["format"] == "csv":
            stamp = at.astimezone(UTC).strftime("%Y%m%dT%H%M%SZ")
            response = HttpResponse(
                reports.access_csv(rows), content_type="text/csv; charset=utf-8"
            )
            response["Content-Disposition"] = f'attachment; filename="access-{stamp}.csv"'
            response["Cache-Control"] = "no-store"
            return response
        body = {"at": at, "count": len(rows), "rows": rows}
        return Response(s.AccessReportOut(body).data, headers=NO_STORE)


# --- Confirmation policies -----------------------------------------------------------


def _policies() -> QuerySet[ConfirmationPolicy]:
    return ConfirmationPolicy.objects.select_related(
        "agent", "tool", "task", "created_by", "revoked_by"
    )


class ConfirmationPolicyListView(APIView):
    permission_classes = [ApproverOrAuditorReadOnly]

    @extend_schema(
        operation_id="confirmation_policies_list",
        responses={200: s.ConfirmationPolicyOut(many=True), **ERRORS},
        description=f"Confirmation policies, newest first (at most {LIST_CAP}).",
    )
    def get(self, request: Request) -> Response:
        s.no_query(request.query_params)
        return Response(s.ConfirmationPolicyOut(_policies()[:LIST_CAP], many=True).data)

    @extend_schema(
        operation_id="confirmation_policy_create",
        request=s.ConfirmationPolicyIn,
        responses={
            201: s.ConfirmationPolicyOut,
            200: OpenApiResponse(
                s.ConfirmationPolicyOut,
                description="The same policy, asked for again while it lives: nothing made.",
            ),
            **CONFLICT,
            **ERRORS,
        },
        description=(
            "Answer the confirmation gate by rule for one agent's destructive calls on one "
            "tool and action inside `scope` (and `task`, when named), from now for "
            "`duration_seconds`: `approve` lets each matching call through once, `deny` "
            "refuses each (a deny wins, over a person's approval too). Approvers only, and "
            "none with a stake in the agent (403 `self_approval`). The same policy asked for "
            "again by its author while it lives is that one (200, nothing written)."
        ),
    )
    def post(self, request: Request) -> Response:
        data = _parse(s.ConfirmationPolicyIn, request.data)
        task = data.get("task")
        with _blame(
            not_destructive="action", action_not_supported="action", invalid_scope="scope",
            duration_too_long="duration_seconds", reason_required="reason",
        ):  # fmt: skip
            policy = confirmation.policy_create(
                author=request.user,
                agent=selectors.by_name(Agent, "agent", name=data["agent"]),
                tool=selectors.by_name(Tool, "tool", name=data["tool"]),
                task=selectors.by_name(Task, "task", key=task) if task is not None else None,
                action=data["action"],
                scope=data["scope"],
                verdict=data["verdict"],
                reason=data["reason"],
                duration=timedelta(seconds=data["duration_seconds"]),
                actor=actor_for(request),
                at=(at := timezone.now()),
            )
        made = policy.created_at == at
        return Response(
            s.ConfirmationPolicyOut(_policies().get(pk=policy.pk)).data,
            status=status.HTTP_201_CREATED if made else status.HTTP_200_OK,
        )


class ConfirmationPolicyRevokeView(APIView):
    permission_classes = [ApproverOrAuditorReadOnly]

    @extend_schema(
        operation_id="confirmation_policy_revoke",
        request=s.RequiredReasonIn,
        responses={200: s.ConfirmationPolicyOut, **CONFLICT, **ERRORS},
        description="End the policy now: the calls it covered ask a person again.",
    )
    def post(self, request: Request, policy_id: int) -> Response:
        data = _parse(s.RequiredReasonIn, request.data)
        policy = _get(_policies(), "confirmation policy", pk=policy_id)
        with _blame(reason_required="reason"):
            confirmation.policy_revoke(
                policy_id=policy.pk,
                by=request.user,
                reason=data["reason"],
                actor=actor_for(request),
                at=timezone.now(),
            )
        return Response(s.ConfirmationPolicyOut(_policies().get(pk=policy.pk)).data)
