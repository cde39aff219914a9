"""One error shape for the whole API: {"error": {"code", "message", "fields"}}."""

from __future__ import annotations

import logging
from typing import Any

import psycopg
from django.conf import settings
from django.core.exceptions import (
    ObjectDoesNotExist,
    RequestDataTooBig,
    SuspiciousOperation,
    TooManyFieldsSent,
)
from django.db import DatabaseError
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.views.defaults import bad_request as django_bad_request
from rest_framework import exceptions, status
from rest_framework.response import Response

from governance.errors import GovernanceError
from governance.text import printable
from governance.web import errors as web_errors

log = logging.getLogger(__name__)
# A 400 names at most this many fields (a body with a million bad items is one mistake).
MAX_FIELD_ERRORS = 20


def error_body(code: str, message: str, fields: dict[str, Any] | None = None) -> dict[str, Any]:
    # A message may quote what the client sent: never anything the renderer cannot
    # encode (a lone surrogate), or the error itself would become a 500 HTML page.
    shown = {
        printable(str(key)): printable(value) if isinstance(value, str) else value
        for key, value in (fields or {}).items()
    }
    return {"error": {"code": printable(code), "message": printable(message), "fields": shown}}


def not_found(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    """Django's 404 for a URL that no route matches (`/api/v1/grants/abc`, where the
    route wants digits): under /api/ in the API's one error shape, elsewhere the UI's
    page (with its navigation and break-glass banners), not Django's bare one."""
    if request.path.startswith("/api/"):
        return JsonResponse(error_body("not_found", "No such endpoint or object."), status=404)
    return web_errors.not_found(request)


def permission_denied(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    """Django's 403 for a PermissionDenied raised outside a DRF view (a UI page without
    the right, the admin): under /api/ in the API's one error shape, the one DRF gives
    its own PermissionDenied; elsewhere the UI's page, as for a 404."""
    if request.path.startswith("/api/"):
        denied = exceptions.PermissionDenied()
        return JsonResponse(error_body(denied.default_code, str(denied.detail)), status=403)
    return web_errors.permission_denied(request, exception)


def server_error(request: HttpRequest) -> HttpResponse:
    """Django's 500, for a failure no view handled (the UI's views catch only the
    services' refusals; a database fault was Django's bare "Server Error (500)"): under
    /api/ in the API's one error shape, elsewhere a UI page that says what to do."""
    if request.path.startswith("/api/"):
        body = error_body("internal_error", "The request failed inside the service; try again.")
        return JsonResponse(body, status=500)
    return web_errors.server_error(request)


def bad_request(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    """Django's 400 for a request refused before any view (a Host header not in
    ALLOWED_HOSTS): under /api/ in the API's one error shape, not an HTML page."""
    if request.path.startswith("/api/"):
        return JsonResponse(error_body("invalid_request", "The request is malformed."), status=400)
    return django_bad_request(request, exception)  # type: ignore[arg-type]


def field_errors(detail: Any) -> dict[str, str]:
    """A validation error's fields as a 400 names them: `a.b` paths, at most
    MAX_FIELD_ERRORS of them."""
    return dict(list(_flatten(detail).items())[:MAX_FIELD_ERRORS])


def _flatten(detail: Any) -> dict[str, str]:
    if isinstance(detail, dict):
        out = {}
        for key, value in detail.items():
            if isinstance(value, dict):
                for sub, msg in _flatten(value).items():
                    out[f"{key}.{sub}"] = msg
            elif isinstance(value, list) and value:
                out[str(key)] = " ".join(str(v) for v in value if not isinstance(v, dict)) or str(
                    value
                )
            else:
                out[str(key)] = str(value)
        return out
    if isinstance(detail, list):
        return {"non_field_errors": " ".join(str(v) for v in detail)}
    return {"non_field_errors": str(detail)}


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response:
    response = _error_response(exc)
    if response.status_code == 503 and getattr(context.get("view"), "failure_is_a_deny", False):
        # /authorize promises "503 + deny" on any internal failure, also one before its
        # view ran (the token's lookup, when the database is down): a client reading
        # `decision` finds one, not a KeyError.
        return Response(failure_deny(response.data["error"]["message"]), status=503)
    return response


def failure_deny(message: str) -> dict[str, Any]:
    """The answer of a decision that could not be made: deny, reason `error`."""
    return {
        "decision": "deny",
        "reason": "error",
        "message": message,
        "decision_id": None,
        "grant": None,
        "approval": None,
        "expires_at": None,
        "break_glass": False,
    }


def _error_response(exc: Exception) -> Response:
    if isinstance(exc, GovernanceError):
        retry = getattr(exc, "retry_after", None)
        headers = {"Retry-After": str(retry)} if retry else {}
        if exc.status == 401:  # as at the door: the same body and challenge
            headers["WWW-Authenticate"] = 'Bearer realm="api"'
        return Response(
            error_body(exc.code, exc.message, exc.fields),
            status=exc.status,
            headers=headers or None,
        )
    if isinstance(exc, Http404 | ObjectDoesNotExist):
        exc = exceptions.NotFound()
    if isinstance(exc, RequestDataTooBig):
        return Response(
            error_body(
                "request_too_large",
                f"The request body is over {settings.DATA_UPLOAD_MAX_MEMORY_SIZE} bytes.",
            ),
            status=413,
        )
    if isinstance(exc, TooManyFieldsSent):
        return Response(
            error_body(
                "invalid_request",
                f"The request has more than {settings.DATA_UPLOAD_MAX_NUMBER_FIELDS} "
                "query or form parameters.",
            ),
            status=400,
        )
    if isinstance(exc, SuspiciousOperation):  # Django refused the request as malformed
        return Response(error_body("invalid_request", "The request is malformed."), status=400)
    if isinstance(exc, exceptions.ValidationError):
        fields = _flatten(exc.detail)
        shown = field_errors(exc.detail)
        message = "The request is not valid: " + "; ".join(f"{k}: {v}" for k, v in shown.items())
        if len(fields) > len(shown):
            message += f"; and {len(fields) - len(shown)} more"
        return Response(error_body("invalid_request", message, shown), status=400)
    if isinstance(exc, exceptions.NotAuthenticated | exceptions.AuthenticationFailed):
        # Same body whatever was wrong with the token: no hint which check failed.
        return Response(
            error_body("unauthenticated", "A valid bearer token is required."),
            status=401,
            headers={"WWW-Authenticate": 'Bearer realm="api"'},
        )
    if isinstance(exc, exceptions.Throttled):
        wait = int(exc.wait or 1)
        return Response(
            error_body("rate_limited", f"Too many requests; retry in {wait} s."),
            status=429,
            headers={"Retry-After": str(wait)},
        )
    if isinstance(exc, exceptions.APIException):
        code = exc.get_codes() if isinstance(exc.get_codes(), str) else exc.default_code
        return Response(error_body(str(code), str(exc.detail)), status=exc.status_code)
    # The hot path's raw psycopg cursor raises psycopg's errors, not Django's.
    if isinstance(exc, DatabaseError | psycopg.Error):
        log.exception("database error in API view")
        return Response(
            error_body("unavailable", "The service cannot reach its database; try again."),
            status=status.HTTP_503_SERVICE_UNAVAILABLE,
        )
    log.exception("unhandled error in API view")
    return Response(
        error_body("internal_error", "The request failed inside the service; try again."),
        status=status.HTTP_503_SERVICE_UNAVAILABLE,
    )
