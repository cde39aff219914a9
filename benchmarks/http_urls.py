"""URLs for benchmarks.http_authorize: the app's URLs plus the framework floor.

FloorView is what DRF costs on this stack before any of our work: the same
middleware, the same bearer-token authentication (one token + agent lookup),
the same IsAgent permission and the same JSON renderer as AuthorizeView, and a
fixed small JSON answer. It does not read the body, rate-limit, decide or audit.
It lives only here, never in governance.urls.

The breakdown views (benchmarks.http_authorize --breakdown) add /authorize's work to
the floor one piece at a time, so a run can say what each piece costs under load:

  /bench/limited   the floor plus the rate-limit check /authorize makes (same bucket,
                   same limiter), answering the same constant.
  /bench/decided   that plus the body parsed as /authorize parses it and the decision
                   of governance.policy.authorize() (the one decision function, read
                   only): /authorize without its audit event. Never a way to decide in
                   the service: authorize() alone writes nothing, so it logs nothing.
"""

from __future__ import annotations

from django.urls import path
from django.utils import timezone
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from governance.api import serializers as s
from governance.api.auth import IsAgent
from governance.api.views import _decision_body, limit
from governance.policy import authorize
from governance.urls import handler404  # noqa: F401 (the app's JSON 404s)
from governance.urls import urlpatterns as app_urlpatterns

FLOOR_BODY = {"decision": "deny", "reason": "floor", "message": "constant"}


class FloorView(APIView):
    # Authentication and renderer are the REST_FRAMEWORK defaults, as for AuthorizeView.
    permission_classes = [IsAgent]

    def post(self, request: Request) -> Response:
        return Response(FLOOR_BODY)


class LimitedView(APIView):
    permission_classes = [IsAgent]

    def post(self, request: Request) -> Response:
        limit(request, "authorize", fail_closed=False)
        return Response(FLOOR_BODY)


class DecidedView(APIView):
    permission_classes = [IsAgent]

    def post(self, request: Request) -> Response:
        limit(request, "authorize", fail_closed=False)
        data = s.authorize_body(request.data)
        if data is None:  # the benchmark sends well-formed bodies only
            return Response({"error": "malformed"}, status=400)
        decision = authorize(
            agent=request.user.agent.name,
            tool=data["tool"],
            action=data["action"],
            scope=data["scope"],
            task=data.get("task"),
            arguments=data.get("arguments"),
            approval=data.get("approval"),
            at=timezone.now(),
        )
        return Response(s.decision_out(_decision_body(decision)))


urlpatterns = [
    path("bench/floor", FloorView.as_view(), name="bench-floor"),
    path("bench/limited", LimitedView.as_view(), name="bench-limited"),
    path("bench/decided", DecidedView.as_view(), name="bench-decided"),
    *app_urlpatterns,
]
