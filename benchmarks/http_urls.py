"""URLs for benchmarks.http_authorize: the app's URLs plus the framework floor.

FloorView is what DRF costs on this stack before any of our work: the same
middleware, the same bearer-token authentication (one token + agent lookup),
the same IsAgent permission and the same JSON renderer as AuthorizeView, and a
fixed small JSON answer. It does not read the body, rate-limit, decide or audit.
It lives only here, never in governance.urls.
"""

from __future__ import annotations

from django.urls import path
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from governance.api.auth import IsAgent
from governance.urls import handler404  # noqa: F401 (the app's JSON 404s)
from governance.urls import urlpatterns as app_urlpatterns

FLOOR_BODY = {"decision": "deny", "reason": "floor", "message": "constant"}


class FloorView(APIView):
    # Authentication and renderer are the REST_FRAMEWORK defaults, as for AuthorizeView.
    permission_classes = [IsAgent]

    def post(self, request: Request) -> Response:
        return Response(FLOOR_BODY)


urlpatterns = [
    path("bench/floor", FloorView.as_view(), name="bench-floor"),
    *app_urlpatterns,
]
