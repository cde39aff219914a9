from django.urls import path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from governance.api import admin_views as admin
from governance.api import lifecycle_views as lifecycle
from governance.api import sandbox_views as sandbox
from governance.api import views

app_name = "api"

urlpatterns = [
    path("authorize", views.AuthorizeView.as_view(), name="authorize"),
    path(
        "decisions/<str:decision_id>/outcome", views.OutcomeView.as_view(), name="decision-outcome"
    ),
    path("approvals/<str:approval_id>", views.ApprovalDetailView.as_view(), name="approval"),
    path(
        "approvals/<str:approval_id>/approve",
        views.ApprovalDecideView.as_view(approve=True),
        name="approval-approve",
    ),
    path(
        "approvals/<str:approval_id>/deny",
        views.ApprovalDecideView.as_view(approve=False),
        name="approval-deny",
    ),
    path("grant-requests", views.GrantRequestListView.as_view(), name="grant-requests"),
    path(
        "grant-requests/<int:grant_id>",
        views.GrantRequestDetailView.as_view(),
        name="grant-request",
    ),
    path(
        "grant-requests/<int:grant_id>/approve",
        views.GrantRequestApproveView.as_view(),
        name="grant-request-approve",
    ),
    path(
        "grant-requests/<int:grant_id>/deny",
        views.GrantRequestDenyView.as_view(),
        name="grant-request-deny",
    ),
    path("delegations", views.DelegationView.as_view(), name="delegations"),
    path("me", views.MeView.as_view(), name="me"),
    # Admin and automation (admins; auditors read).
    path("agents", admin.AgentListView.as_view(), name="agents"),
    path("agents/<str:name>", admin.AgentDetailView.as_view(), name="agent"),
    path("agents/<str:name>/suspend", admin.AgentSuspendView.as_view(), name="agent-suspend"),
    path("agents/<str:name>/resume", admin.AgentResumeView.as_view(), name="agent-resume"),
    path("agents/<str:name>/tokens", admin.AgentTokensView.as_view(), name="agent-tokens"),
    path("tokens/<str:prefix>/revoke", admin.TokenRevokeView.as_view(), name="token-revoke"),
    path("tools", admin.ToolListView.as_view(), name="tools"),
    path("tools/<str:name>", admin.ToolDetailView.as_view(), name="tool"),
    path("tools/<str:name>/approve", admin.ToolApproveView.as_view(), name="tool-approve"),
    path("tasks", admin.TaskListView.as_view(), name="tasks"),
    # A task key may hold `/` (a ticket such as `acme/api#42`): <path:key>, and the
    # close route first, so `tasks/acme/api#42/close` is not read as a key.
    path("tasks/<path:key>/close", admin.TaskCloseView.as_view(), name="task-close"),
    path("tasks/<path:key>", admin.TaskDetailView.as_view(), name="task"),
    path("grants", admin.GrantListView.as_view(), name="grants"),
    path("grants/<int:grant_id>", admin.GrantDetailView.as_view(), name="grant"),
    path("grants/<int:grant_id>/revoke", admin.GrantRevokeView.as_view(), name="grant-revoke"),
    path("reports/access", admin.AccessReportView.as_view(), name="report-access"),
    path(
        "confirmation-policies",
        admin.ConfirmationPolicyListView.as_view(),
        name="confirmation-policies",
    ),
    path(
        "confirmation-policies/<int:policy_id>/revoke",
        admin.ConfirmationPolicyRevokeView.as_view(),
        name="confirmation-policy-revoke",
    ),
    # Break-glass and reviews (issue #5).
    path("breakglass", lifecycle.BreakGlassOpenView.as_view(), name="breakglass-open"),
    path(
        "breakglass/<int:breakglass_id>/close",
        lifecycle.BreakGlassActView.as_view(act="close"),
        name="breakglass-close",
    ),
    path(
        "breakglass/<int:breakglass_id>/ratify",
        lifecycle.BreakGlassActView.as_view(act="ratify"),
        name="breakglass-ratify",
    ),
    path(
        "breakglass/<int:breakglass_id>/confirm-closed",
        lifecycle.BreakGlassActView.as_view(act="confirm-closed"),
        name="breakglass-confirm-closed",
    ),
    path(
        "reviews/items/<int:item_id>/decide",
        lifecycle.ReviewItemDecideView.as_view(),
        name="review-item-decide",
    ),
    # The sandbox runner's HTTP adapter (issue #4).
    path("sandbox/runs", sandbox.SandboxRunView.as_view(), name="sandbox-runs"),
    path(
        "sandbox/runs/<uuid:run_id>/started",
        sandbox.SandboxStartedView.as_view(),
        name="sandbox-run-started",
    ),
    path(
        "sandbox/runs/<uuid:run_id>/egress",
        sandbox.SandboxEgressView.as_view(),
        name="sandbox-run-egress",
    ),
    path(
        "sandbox/runs/<uuid:run_id>/finished",
        sandbox.SandboxFinishedView.as_view(),
        name="sandbox-run-finished",
    ),
    path(
        "sandbox/runs/<uuid:run_id>/live",
        sandbox.SandboxLiveView.as_view(),
        name="sandbox-run-live",
    ),
    path("schema/", SpectacularAPIView.as_view(), name="schema"),
    path("docs/", SpectacularSwaggerView.as_view(url_name="api:schema"), name="docs"),
]
