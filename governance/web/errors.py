"""The 403 and 404 pages outside the API: UI pages, drawn on ui/base.html, so a person
with a role keeps the navigation and the break-glass banners (Django's bare default
pages had neither, so an incident under way was out of view there). Someone not signed
in gets the same page without them (governance.web.context.ui tells them nothing)."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.template.loader import render_to_string


def _page(request: HttpRequest, status: int, title: str, message: str) -> HttpResponse:
    context = {"status": status, "title": title, "message": message}
    return render(request, "ui/http_error.html", context, status=status)


def not_found(request: HttpRequest) -> HttpResponse:
    # Never the exception's text: the resolver's 404 carries the URL patterns it tried.
    return _page(request, 404, "Not found", "There is no such page or object.")


def permission_denied(request: HttpRequest, exception: Exception | None) -> HttpResponse:
    # The UI's own refusals name the right that is missing (web.access.require); any
    # other (the admin's) says only no.
    said = exception.args[0] if exception is not None and exception.args else None
    message = said if isinstance(said, str) else "You do not have the right to see this page."
    return _page(request, 403, "Not allowed", message)


def server_error(request: HttpRequest) -> HttpResponse:
    # No request context: the failure may be the database's, which the banners and the
    # navigation ask (a second failure here would leave Django's bare page after all).
    return HttpResponse(render_to_string("ui/server_error.html"), status=500)
