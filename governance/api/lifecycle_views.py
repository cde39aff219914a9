"""Break-glass and review endpoints (issue #5): thin, each calling one service.

Break-glass is opened by people only: an agent's token gets 403 here before the service
is reached (HumanOnly), and the service refuses agents again (human_only). Reviews and
break-glass reviews are decided by approvers and admins (IsApprover); the services
enforce who in particular (never the opener, the grant's approver or its requester).
Closing break-glass early is for approvers, admins and whoever opened it (the service).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.utils import timezone
from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.permissions import BasePermission
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from governance import roles, selectors
from governance.api import serializers as s
from governance.api.admin_views import CONFLICT, _parse
from governance.api.auth import IsApprover
from governance.api.views import ERRORS, _get, actor_for
from governance.errors import NotFound
from governance.models import BreakGlass, ReviewItem, Task, Tool
from governance.services import breakglass, reviews


class HumanOnly(BasePermission):
    message = "Break-glass is opened by a person, never by an agent's token."

    def has_permission(self, request: Request, view: Any) -> bool:
        return roles.is_human(request.user)


def _breakglass(pk: int) -> BreakGlass:
    return _get(
        BreakGlass.objects.select_related(
            "grant__agent",
            "grant__tool",
            "grant__task",
            "grant__requested_by",
            "grant__approved_by",
            "opened_by",
            "reviewed_by",
        ),
        "break-glass",
        pk=pk,
    )


class BreakGlassOpenView(APIView):
    permission_classes = [HumanOnly]

    @extend_schema(
        operation_id="breakglass_open",
        request=s.BreakGlassIn,
        responses={201: s.BreakGlassOut, **CONFLICT, **ERRORS},
        description=(
            "Open break-glass: a live grant at once, flagged break-glass in every decision "
            "and audit event, every other approver notified, a post-incident review due "
            "within 24 h. People only (approvers, admins, the agent's owner; never an "
            "auditor: 403 auditor_read_only); a ticket reference is required; longer than "
            "the hard maximum is refused. 409 breakglass_active: one is already live for "
            "this agent and tool; 409 breakglass_unreviewed: an earlier one for them awaits "
            "its review. 429 (with Retry-After): the opener's hourly limit."
        ),
    )
    def post(self, request: Request) -> Response:
        data = _parse(s.BreakGlassIn, request.data)
        ttl = data.get("ttl_minutes")
        bg = breakglass.breakglass_open(
            opener=request.user,
            agent=selectors.agent_named_by(request.user, data["agent"]),
            tool=selectors.by_name(Tool, "tool", name=data["tool"]),
            task=selectors.by_name(Task, "task", key=data["task"]) if data.get("task") else None,
            actions=data["actions"],
            scope=data["scope"],
            ticket=data["ticket"],
            reason=data["reason"],
            ttl=timedelta(minutes=ttl) if ttl else None,
            actor=actor_for(request),
            at=timezone.now(),
        )
        return Response(s.BreakGlassOut(_breakglass(bg.pk)).data, status=status.HTTP_201_CREATED)


class BreakGlassActView(APIView):
    """close | ratify | confirm-closed, each with a comment. Closing early is also open
    to the person who opened it (an agent's owner need not be an approver); the
    service checks who, so any person's token gets that far."""

    permission_classes = [IsApprover]
    act = "close"

    def get_permissions(self) -> list[BasePermission]:
        if self.act == "close":
            return [HumanOnly()]
        return super().get_permissions()  # type: ignore[return-value]

    @extend_schema(request=s.CommentIn, responses={200: s.BreakGlassOut, **CONFLICT, **ERRORS})
    def post(self, request: Request, breakglass_id: int) -> Response:
        comment = _parse(s.CommentIn, request.data)["comment"]
        bg = _breakglass(breakglass_id)
        # A person who may not read break-glass records (no approver or auditor role) is
        # told of none but their own: 404, as for an id that does not exist, not a 403
        # that would confirm this one does.
        user = request.user
        if not (roles.is_approver(user) or roles.is_auditor(user) or bg.opened_by_id == user.pk):
            raise NotFound("not_found", "No such break-glass.")
        common = {"breakglass_id": bg.pk, "comment": comment, "actor": actor_for(request)}
        now = timezone.now()
        if self.act == "close":
            breakglass.breakglass_close(closed_by=request.user, at=now, **common)
        elif self.act == "ratify":
            breakglass.breakglass_ratify(reviewer=request.user, at=now, **common)
        else:
            breakglass.breakglass_confirm_closed(reviewer=request.user, at=now, **common)
        return Response(s.BreakGlassOut(_breakglass(bg.pk)).data)


class ReviewItemDecideView(APIView):
    permission_classes = [IsApprover]

    @extend_schema(
        operation_id="review_item_decide",
        request=s.ReviewDecideIn,
        responses={200: s.ReviewItemOut, **CONFLICT, **ERRORS},
        description=(
            "Keep, narrow or revoke the item's grant, with a comment, at once. A narrow "
            "names fewer `actions`, a `scope` inside the grant's, an earlier `expires_at` "
            "or `delegable: false` (the agent may no longer hand the grant to its "
            "subagents; its live delegations are revoked). Never wider: 403 "
            "`wider_actions`, `wider_scope`, `longer_expiry`, `wider_delegation`."
        ),
    )
    def post(self, request: Request, item_id: int) -> Response:
        data = _parse(s.ReviewDecideIn, request.data)
        item = _get(ReviewItem.objects.all(), "review item", pk=item_id)
        reviews.review_item_decide(
            item_id=item.pk,
            reviewer=request.user,
            actor=actor_for(request),
            at=timezone.now(),
            **data,
        )
        item = ReviewItem.objects.select_related(
            "grant__agent",
            "grant__tool",
            "grant__task",
            "grant__requested_by",
            "grant__approved_by",
            "reviewer",
            "decided_by",
        ).get(pk=item.pk)
        return Response(s.ReviewItemOut(item).data)
