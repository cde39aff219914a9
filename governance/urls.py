from django.contrib import admin
from django.urls import include, path

from governance import views

urlpatterns = [
    path("", views.home, name="home"),
    path("healthz", views.healthz, name="healthz"),
    path("admin/", admin.site.urls),
    path("api/v1/", include("governance.api.urls")),
]

# Unmatched URLs under /api/ answer in the API's error shape (JSON), not an HTML page.
handler404 = "governance.api.errors.not_found"
