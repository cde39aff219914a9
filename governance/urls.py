from django.contrib import admin
from django.urls import include, path
from django.views.generic import RedirectView

from governance import views

urlpatterns = [
    # The start page is the UI's dashboard: it shows the matrix to a person with a role
    # and nothing to anyone else (the sign-in page, or 403 for an account with no role).
    path("", RedirectView.as_view(url="/ui/"), name="home"),
    path("healthz", views.healthz, name="healthz"),
    # One sign-in door, rate-limited: the admin site's login sends people to the UI's.
    path("admin/login/", RedirectView.as_view(url="/ui/login/", query_string=True)),
    path("admin/", admin.site.urls),
    path("api/v1/", include("governance.api.urls")),
    path("ui/", include("governance.web.urls")),
]

# Under /api/ the API's error shape (JSON); elsewhere the UI's pages, which carry the
# navigation and the break-glass banners (Django's bare defaults carried neither).
handler404 = "governance.api.errors.not_found"
handler403 = "governance.api.errors.permission_denied"
handler400 = "governance.api.errors.bad_request"
handler500 = "governance.api.errors.server_error"
