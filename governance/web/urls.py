from django.urls import path

from governance.web import views

app_name = "ui"

urlpatterns = [
    path("login/", views.LoginView.as_view(), name="login"),
    path("logout/", views.LogoutView.as_view(), name="logout"),
    path("", views.dashboard, name="dashboard"),
    path("matrix/", views.matrix, name="matrix"),
    path("matrix/cell/", views.matrix_cell, name="matrix-cell"),
    path("grants/<int:grant_id>/", views.grant_detail, name="grant"),
    path("grants/<int:grant_id>/revoke", views.grant_revoke, name="grant-revoke"),
    path("inbox/requests/", views.inbox_requests, name="inbox-requests"),
    path("inbox/requests/<int:grant_id>/approve", views.request_approve, name="request-approve"),
    path("inbox/requests/<int:grant_id>/deny", views.request_deny, name="request-deny"),
    path("inbox/approvals/", views.inbox_approvals, name="inbox-approvals"),
    path(
        "inbox/approvals/<str:approval_id>/approve",
        views.approval_approve,
        name="approval-approve",
    ),
    path("inbox/approvals/<str:approval_id>/deny", views.approval_deny, name="approval-deny"),
    path("agents/", views.agent_list, name="agents"),
    path("agents/<str:name>/", views.agent_detail, name="agent"),
    path("agents/<str:name>/suspend", views.agent_suspend, name="agent-suspend"),
    path("agents/<str:name>/tokens", views.token_issue, name="token-issue"),
    path("tokens/<str:prefix>/revoke", views.token_revoke, name="token-revoke"),
    path("tools/", views.tool_list, name="tools"),
    path("tools/<str:name>/", views.tool_detail, name="tool"),
    path("tools/<str:name>/approve", views.tool_approve, name="tool-approve"),
    path("audit/", views.audit_log, name="audit"),
    path("audit/export", views.audit_export, name="audit-export"),
    path("audit/<int:seq>/", views.audit_event, name="audit-event"),
    path("explain/<str:uid>/", views.explain, name="explain"),
    path("what-if/", views.what_if, name="what-if"),
    path("exports/", views.exports_page, name="exports"),
    path("exports/access", views.export_access, name="export-access"),
    path("exports/decisions", views.export_decisions, name="export-decisions"),
    path("reports/print", views.report_print, name="report-print"),
]
