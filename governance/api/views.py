"""The agent-facing API: thin views. Parse, call access_check() or a service,
render. Object-level checks: an agent only ever sees its own objects, and
someone else's object answers exactly like a missing one (404)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.db.models import Q, QuerySet
from django.utils import timezone
from drf_spectacular.utils import OpenApiExample, OpenApiResponse, extend_schema
from rest_framework import status
from rest_framework.exceptions import Throttled, ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from governance import ratelimit, roles, selectors
from governance.api import serializers as s
from governance.api.auth import AgentPrincipal, IsAgent, IsApprover, agent_of
from governance.api.errors import field_errors
from governance.audit import Actor
from governance.codes import Reason
from governance.errors import Forbidden, GovernanceError, NotFound, Unavailable
from governance.models import Agent, Approval, Grant, Task, Tool
from governance.services import access, approvals, grants, outcomes
from governance.text import is_text

ERRORS = {
    400: OpenApiResponse(s.ErrorSerializer, description="Malformed request"),
    401: OpenApiResponse(s.ErrorSerializer, description="Missing or invalid token"),
    403: OpenApiResponse(s.ErrorSerializer, description="Not allowed"),
    404: OpenApiResponse(s.ErrorSerializer, description="No such object (or not yours)"),
    413: OpenApiResponse(s.ErrorSerializer, description="Request body too large"),
    415: OpenApiResponse(s.ErrorSerializer, description="A body that is not JSON in UTF-8"),
    429: OpenApiResponse(s.ErrorSerializer, description="Rate limited; see Retry-After"),
}


def actor_for(request: Request) -> Actor:
    """Who makes the request's change, under the token it was let in with: every event
    of the change asks whether that token still holds (audit.append), so a change under
    a token revoked while the request was on its way is the door's 401, not written."""
    user, token_id = request.user, request.auth.pk if request.auth is not None else None
    if isinstance(user, AgentPrincipal):
        return Actor.agent(user.agent, token_id)
    return Actor.user(user, token_id)


def limit(request: Request, bucket: str, *, fail_closed: bool) -> None:
    """Count the request against its token; raise 429 past the limit.

    A limiter that cannot be reached refuses requests that change state
    (fail closed) and lets decisions through to authorize(), whose default
    is deny: an outage never turns anything into an allow.
    """
    try:
        ratelimit.check(bucket, request.auth.pk)
    except ratelimit.RateLimited as exc:
        raise Throttled(wait=exc.retry_after) from None
    except ratelimit.LimiterUnavailable:
        if fail_closed:
            # 503, not 4xx: the request was fine, the service is not; nothing was written.
            raise Unavailable(
                "rate_limit_unavailable",
                "The rate limiter cannot be reached, so the request is refused; try again.",
            ) from None


def _decision_body(decision: Any) -> dict[str, Any]:
    # `grant` and `expires_at` say what a call was allowed under, and until when: only an
    # allow carries them. An `approval_required` answer or a gate's denial found a live
    # grant too, but a client reading "grant 4 until 11:35" off a non-allow must not
    # take it for leave to act (the audit event names the grant either way).
    allowed = decision.allowed
    return {
        "decision": decision.decision,
        "reason": decision.reason,
        "message": decision.message,
        "decision_id": decision.decision_id,
        "grant": decision.grant_id if allowed else None,
        "approval": decision.approval_id,
        "expires_at": decision.expires_at if allowed else None,
        "break_glass": decision.break_glass,
    }


class AuthorizeView(APIView):
    permission_classes = [IsAgent]
    failure_is_a_deny = True  # errors.exception_handler: a 503 is a DecisionOut deny

    @extend_schema(
        operation_id="authorize",
        request=s.AuthorizeIn,
        responses={
            200: s.DecisionOut,
            503: OpenApiResponse(s.DecisionOut, description="Internal failure: always deny"),
            **ERRORS,
        },
        description="Ask before every tool call. The agent is the token's agent.",
        examples=[
            OpenApiExample(
                "Read a file",
                value={"tool": "repo", "action": "read", "scope": "repo:acme/api/README.md"},
                request_only=True,
            ),
            OpenApiExample(
                "Delete a branch (destructive: needs an approval)",
                value={
                    "tool": "repo",
                    "action": "delete",
                    "scope": "repo:acme/api/branches/old-release",
                    "arguments": {"force": True},
                },
                request_only=True,
            ),
        ],
    )
    def post(self, request: Request) -> Response:
        limit(request, "authorize", fail_closed=False)
        data = s.authorize_body(request.data)
        if data is None:  # not plainly well formed: AuthorizeIn decides, and words the error
            body = s.AuthorizeIn(data=request.data)
            if not body.is_valid():
                # Refused 400, and on record: an agent probing with tool names or
                # actions outside the schema leaves a trace, as an unknown tool does.
                access.record_malformed(
                    agent=request.user.agent.name,
                    body=request.data,
                    problems=field_errors(body.errors),
                    at=timezone.now(),
                )
                raise ValidationError(body.errors)
            data = body.validated_data
        decision = access.access_check(
            agent=request.user.agent.name,
            tool=data["tool"],
            action=data["action"],
            scope=data["scope"],
            task=data.get("task"),
            arguments=data.get("arguments"),
            approval=data.get("approval"),
            at=timezone.now(),
            refuse=access.token_refusal(request.auth.pk),
        )
        code = 503 if decision.reason == Reason.ERROR else 200
        return Response(s.decision_out(_decision_body(decision)), status=code)


class OutcomeView(APIView):
    permission_classes = [IsAgent]

    @extend_schema(
        operation_id="report_outcome",
        request=s.OutcomeIn,
        responses={201: s.OutcomeOut, 409: ERRORS[400], **ERRORS},
        description="Say what a decided tool call did. Once per decision, and only your own.",
        examples=[
            OpenApiExample(
                "It worked",
                value={"outcome": "succeeded", "result_digest": "sha256:9f86d081884c7d65"},
                request_only=True,
            )
        ],
    )
    def post(self, request: Request, decision_id: str) -> Response:
        body = s.OutcomeIn(data=request.data)
        body.is_valid(raise_exception=True)
        written = outcomes.outcome_report(
            agent=request.user.agent,
            actor=actor_for(request),
            decision_id=decision_id,
            at=timezone.now(),
            **body.validated_data,
        )
        out = {
            "decision_id": decision_id,
            "outcome": body.validated_data["outcome"],
            "event_id": written.uid,
        }
        return Response(s.OutcomeOut(out).data, status=status.HTTP_201_CREATED)


def _visible_approvals(request: Request) -> QuerySet[Approval]:
    qs = Approval.objects.select_related("agent", "tool", "task", "decided_by")
    agent = agent_of(request)
    if agent is not None:
        return qs.filter(agent=agent)
    if roles.is_approver(request.user) or roles.is_auditor(request.user):
        return qs
    return qs.none()


def _get(qs: QuerySet[Any], what: str, **lookup: Any) -> Any:
    # A value that is not text (`%00` in the path) names nothing; PostgreSQL would
    # refuse the query itself, which read as "cannot reach its database" (503).
    if not all(is_text(value) for value in lookup.values() if isinstance(value, str)):
        raise NotFound("not_found", f"No such {what}.")
    try:
        return qs.get(**lookup)
    except (qs.model.DoesNotExist, ValueError, TypeError):
        raise NotFound("not_found", f"No such {what}.") from None
    except Exception as exc:  # malformed UUIDs raise ValidationError
        if exc.__class__.__name__ == "ValidationError":
            raise NotFound("not_found", f"No such {what}.") from None
        raise


class ApprovalDetailView(APIView):
    @extend_schema(operation_id="approval_get", responses={200: s.ApprovalOut, **ERRORS})
    def get(self, request: Request, approval_id: str) -> Response:
        s.no_query(request.query_params)
        approval = _get(_visible_approvals(request), "approval", pk=approval_id)
        return Response(s.ApprovalOut(approval).data)


class DecideView(APIView):
    """Approve or deny something pending: approvers only, rate-limited, fail closed."""

    permission_classes = [IsApprover]
    approve = True

    def get_serializer_class(self) -> type[s.StrictSerializer]:
        # Also the request schema: a denial must say why, an approval may.
        return s.ReasonIn if self.approve else s.RequiredReasonIn

    def body(self, request: Request) -> dict[str, Any]:
        limit(request, "approval", fail_closed=True)
        body = self.get_serializer_class()(data=request.data)
        body.is_valid(raise_exception=True)
        return dict(body.validated_data)

    def reason(self, request: Request) -> str:
        return str(self.body(request)["reason"])


class ApprovalDecideView(DecideView):
    @extend_schema(responses={200: s.ApprovalOut, 409: ERRORS[400], **ERRORS})
    def post(self, request: Request, approval_id: str) -> Response:
        reason = self.reason(request)
        approval = _get(_visible_approvals(request), "approval", pk=approval_id)
        decide = approvals.approval_approve if self.approve else approvals.approval_deny
        approval = decide(
            approval_id=approval.pk,
            approver=request.user,
            reason=reason,
            actor=actor_for(request),
            at=timezone.now(),
        )
        return Response(s.ApprovalOut(approval).data)


def _grant_qs() -> QuerySet[Grant]:
    return Grant.objects.select_related(
        "agent", "tool", "task", "requested_by", "requested_by_agent", "approved_by"
    )


def _visible_requests(request: Request) -> QuerySet[Grant]:
    agent = agent_of(request)
    if agent is not None:
        return _grant_qs().filter(agent=agent, requested_by_agent=agent)
    if roles.is_approver(request.user) or roles.is_auditor(request.user):
        return _grant_qs().filter(
            Q(requested_by__isnull=False) | Q(requested_by_agent__isnull=False)
        )
    return _grant_qs().filter(requested_by=request.user)


class GrantRequestListView(APIView):
    @extend_schema(
        operation_id="grant_requests_list", responses={200: s.GrantOut(many=True), **ERRORS}
    )
    def get(self, request: Request) -> Response:
        s.no_query(request.query_params)
        qs = _visible_requests(request).order_by("-id")[:500]
        return Response(s.GrantOut(qs, many=True).data)

    @extend_schema(
        operation_id="grant_request_create",
        request=s.GrantRequestIn,
        responses={201: s.GrantOut, 409: ERRORS[400], **ERRORS},
        description=(
            "Ask for a grant. It is created pending; a human approves it. 409 "
            "`duplicate_request` if the same one is pending; 409 `request_backlog` if "
            "GRANT_REQUEST_PENDING_MAX of the agent's own requests already are."
        ),
        examples=[
            OpenApiExample(
                "Read the support queue for an hour",
                value={
                    "tool": "tickets",
                    "actions": ["read"],
                    "scope": "tickets:queue/support/*",
                    "duration_seconds": 3600,
                    "justification": "Triage the support queue",
                },
                request_only=True,
            )
        ],
    )
    def post(self, request: Request) -> Response:
        limit(request, "grant_request", fail_closed=True)
        body = s.GrantRequestIn(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        agent = agent_of(request)
        if agent is not None:
            if "agent" in data and data["agent"] != agent.name:
                raise GovernanceError(
                    "agent_mismatch",
                    "An agent can only request grants for itself.",
                    fields={"agent": "must be omitted or your own name"},
                )
            requester: dict[str, Any] = {"requested_by_agent": agent}
        else:
            if "agent" not in data:
                raise GovernanceError(
                    "agent_required", "Name the agent.", fields={"agent": "required"}
                )
            # Auditors are read-only, whoever the agent: that, not whose agent it is, is
            # why they are refused. A person asks for their own agents; admins for any.
            grants.refuse_read_only(request.user)
            agent = selectors.agent_named_by(request.user, data["agent"])
            if agent.owner_id != request.user.pk and not roles.is_admin(request.user):
                raise Forbidden(
                    "not_agent_owner", "Only the agent's owner or an admin can request its grants."
                )
            requester = {"requested_by": request.user}
        grant = grants.grant_request(
            agent=agent,
            tool=selectors.by_name(Tool, "tool", name=data["tool"]),
            task=selectors.by_name(Task, "task", key=data["task"]) if data.get("task") else None,
            actions=data["actions"],
            scope=data["scope"],
            fields=data["fields"],
            egress=data["egress"],
            limits={k: v for k, v in (data.get("limits") or {}).items() if v is not None},
            delegable=data["delegable"],
            duration=timedelta(seconds=data["duration_seconds"]),
            justification=data["justification"],
            actor=actor_for(request),
            at=timezone.now(),
            **requester,
        )
        return Response(s.GrantOut(grant).data, status=status.HTTP_201_CREATED)


class GrantRequestDetailView(APIView):
    @extend_schema(operation_id="grant_request_get", responses={200: s.GrantOut, **ERRORS})
    def get(self, request: Request, grant_id: int) -> Response:
        s.no_query(request.query_params)
        return Response(s.GrantOut(_get(_visible_requests(request), "request", pk=grant_id)).data)


class GrantRequestApproveView(DecideView):
    def get_serializer_class(self) -> type[s.StrictSerializer]:
        return s.GrantApproveIn

    @extend_schema(
        request=s.GrantApproveIn,
        responses={200: s.GrantOut, 409: ERRORS[400], **ERRORS},
        description=(
            "Approve a pending grant request: the clock starts now. An optional `reason` "
            "is kept with the grant. `delegable: false` takes away the request's ask to "
            "hand the grant to the agent's subagents (recorded as narrowed in the "
            "grant.issued event); `delegable: true` on a request that did not ask is 400 "
            "`invalid_narrowing`: an approval never widens. 403 `self_approval`; 409 "
            "`not_pending`, `request_expired`, `agent_suspended`, `task_closed`."
        ),
    )
    def post(self, request: Request, grant_id: int) -> Response:
        body = self.body(request)
        grant = _get(_visible_requests(request), "request", pk=grant_id)
        grant = grants.grant_approve(
            grant_id=grant.pk,
            approver=request.user,
            reason=body["reason"],
            delegable=body.get("delegable"),
            actor=actor_for(request),
            at=timezone.now(),
        )
        return Response(s.GrantOut(grant).data)


class GrantRequestDenyView(DecideView):
    approve = False

    @extend_schema(
        request=s.RequiredReasonIn, responses={200: s.GrantOut, 409: ERRORS[400], **ERRORS}
    )
    def post(self, request: Request, grant_id: int) -> Response:
        reason = self.reason(request)
        grant = _get(_visible_requests(request), "request", pk=grant_id)
        grant = grants.grant_deny(
            grant_id=grant.pk,
            approver=request.user,
            reason=reason,
            actor=actor_for(request),
            at=timezone.now(),
        )
        return Response(s.GrantOut(grant).data)


class DelegationView(APIView):
    permission_classes = [IsAgent]

    @extend_schema(
        operation_id="delegate",
        request=s.DelegationIn,
        responses={
            201: s.GrantOut,
            200: OpenApiResponse(
                s.GrantOut, description="The same delegation, asked again: the grant made then"
            ),
            409: OpenApiResponse(s.ErrorSerializer, description="The subagent is suspended"),
            **ERRORS,
        },
        description=(
            "Hand one of your live grants, narrowed, to one of your subagents: a subset of "
            "its actions, a scope inside its scope, an expiry no later than its, and "
            "optionally fewer fields, fewer egress entries and lower limits. Anything "
            "wider is 403 with the reason (wider_actions, wider_scope, longer_expiry, "
            "wider_fields, wider_egress, wider_limits, not_delegable, depth_exceeded)."
        ),
    )
    def post(self, request: Request) -> Response:
        # Each delegation is a live grant: counted with the token's grant requests, or a
        # loop could mint thousands (and flood the trend and review campaigns).
        limit(request, "grant_request", fail_closed=True)
        body = s.DelegationIn(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        agent = request.user.agent
        parent = _get(_grant_qs().filter(agent=agent), "grant", pk=data["grant"])
        child = Agent.objects.filter(name=data["agent"], parent=agent).first()
        if child is None:
            raise NotFound("not_found", "No such subagent.")
        at = timezone.now()
        grant = grants.grant_delegate(
            parent_grant_id=parent.pk,
            child=child,
            actions=data["actions"],
            scope=data["scope"],
            expires_at=data["expires_at"],
            justification=data["justification"],
            fields=data.get("fields"),
            egress=data.get("egress"),
            limits={k: v for k, v in (data.get("limits") or {}).items() if v is not None},
            delegable=data["delegable"],
            actor=actor_for(request),
            at=at,
        )
        # The same delegation asked again returns the grant made then (made at `at`: new).
        made = grant.created_at == at
        return Response(
            s.GrantOut(grant).data, status=status.HTTP_201_CREATED if made else status.HTTP_200_OK
        )


class MeView(APIView):
    permission_classes = [IsAgent]

    @extend_schema(operation_id="me", responses={200: s.MeOut, **ERRORS})
    def get(self, request: Request) -> Response:
        s.no_query(request.query_params)
        agent = request.user.agent
        live = selectors.live_grants(timezone.now()).filter(agent=agent).order_by("id")
        body = {
            "agent": agent.name,
            "owner": agent.owner.username,
            "parent": agent.parent.name if agent.parent else None,
            "status": agent.status,
            "grants": live,
        }
        return Response(s.MeOut(body).data)
