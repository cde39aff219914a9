from django.urls import path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

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
        views.GrantRequestDecideView.as_view(approve=True),
        name="grant-request-approve",
    ),
    path(
        "grant-requests/<int:grant_id>/deny",
        views.GrantRequestDecideView.as_view(approve=False),
        name="grant-request-deny",
    ),
    path("delegations", views.DelegationView.as_view(), name="delegations"),
    path("me", views.MeView.as_view(), name="me"),
    path("schema/", SpectacularAPIView.as_view(), name="schema"),
    path("docs/", SpectacularSwaggerView.as_view(url_name="api:schema"), name="docs"),
]
