"""Security headers the UI relies on: a Content-Security-Policy on every response.

Django 5.2 has no built-in CSP, so this is one small middleware. The policy
allows only this origin's own scripts and styles (no inline script, no CDN),
which is why every chart is inline SVG drawn with presentation attributes and
the only script is a static file.
"""

from __future__ import annotations

from collections.abc import Callable

from django.http import HttpRequest, HttpResponse, JsonResponse

from governance.services import people

POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "font-src 'self'; connect-src 'self'; object-src 'none'; base-uri 'none'; "
    "form-action 'self'; frame-ancestors 'none'"
)
# drf-spectacular's Swagger page starts itself with an inline script (the API's
# own docs, not the UI): it alone may run inline script, nothing else is relaxed.
DOCS_POLICY = POLICY.replace("script-src 'self'", "script-src 'self' 'unsafe-inline'").replace(
    "style-src 'self'", "style-src 'self' 'unsafe-inline'"
)
RELAXED_PREFIXES = ("/api/v1/docs/",)


class CurrentRequestMiddleware:
    """Makes the request (and so its signed-in person) known to the account-change
    audit handlers (services.people), which Django's signals do not pass it to."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        token = people.set_request(request)
        try:
            return self.get_response(request)
        finally:
            people.reset_request(token)


class ContentSecurityPolicyMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        if "Content-Security-Policy" not in response:
            relaxed = request.path.startswith(RELAXED_PREFIXES)
            response["Content-Security-Policy"] = DOCS_POLICY if relaxed else POLICY
        return response


class LengthRequiredMiddleware:
    """A body sent chunked (Transfer-Encoding, no Content-Length) reaches Django as no
    body at all (WSGI servers pass it on, Django reads Content-Length bytes): the
    request then ran as if empty, with every default (a token for 30 days where 1 was
    asked, a reason lost, an unknown key not refused). It is refused: 411."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if "HTTP_TRANSFER_ENCODING" not in request.META:
            return self.get_response(request)
        message = "Send the body with a Content-Length: a chunked body is not read."
        if request.path.startswith("/api/"):
            from governance.api.errors import error_body

            return JsonResponse(error_body("length_required", message), status=411)
        return HttpResponse(message, status=411, content_type="text/plain; charset=utf-8")
