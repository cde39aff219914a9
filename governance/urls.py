from django.contrib import admin
from django.urls import include, path

from governance import views

urlpatterns = [
    path("", views.home, name="home"),
    path("healthz", views.healthz, name="healthz"),
    path("admin/", admin.site.urls),
    path("api/v1/", include("governance.api.urls")),
]
