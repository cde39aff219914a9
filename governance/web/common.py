"""Small helpers every UI view uses: who acts, how a refusal is shown, lookups."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.core.paginator import Page
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render

from governance import audit
from governance.errors import GovernanceError
from governance.text import is_text


def actor(request: HttpRequest) -> audit.Actor:
    return audit.Actor.user(request.user)


def failed(request: HttpRequest, exc: GovernanceError) -> HttpResponse:
    """A service said no: the person sees its code and sentence, the status says
    what kind of no (400, 403, 409, 429); nothing was written."""
    response = render(request, "ui/error.html", {"error": exc}, status=exc.status)
    if retry := getattr(exc, "retry_after", None):
        response["Retry-After"] = str(retry)  # a 429 says when to try again
    return response


def older_query(request: HttpRequest, before: Any) -> str:
    """The query string of the next (older) page: this page's filters, `before` set."""
    if before is None:
        return ""
    params = request.GET.copy()
    params["before"] = str(before)
    return params.urlencode()


def page_links(request: HttpRequest, page: Page) -> dict[str, str]:
    """The query strings of the first, previous, next and last pages around `page`, each
    keeping this page's filters (only the ones that exist)."""

    def to(number: int) -> str:
        params = request.GET.copy()
        params["page"] = str(number)
        return params.urlencode()

    links = {}
    if page.has_previous():
        links["first"], links["previous"] = to(1), to(page.previous_page_number())
    if page.has_next():
        links["next"], links["last"] = to(page.next_page_number()), to(page.paginator.num_pages)
    return links


def invalid(request: HttpRequest, form: Any) -> HttpResponse:
    error = GovernanceError("invalid_request", "The form is not valid.")
    return render(request, "ui/error.html", {"error": error, "form": form}, status=400)


class Invalid(Exception):
    """A form that is not valid (cleaned): web.access.require answers it with `invalid`."""

    def __init__(self, form: Any) -> None:
        super().__init__("invalid_request")
        self.form = form


def cleaned(form: Any) -> dict[str, Any]:
    """The form's cleaned data; a form that is not valid is a 400 showing its errors,
    with nothing done (Invalid, answered by web.access.require)."""
    if not form.is_valid():
        raise Invalid(form)
    return form.cleaned_data


def optional(form: Any) -> dict[str, Any]:
    """A page's filter form (bound to the query string, or None when it has none): {}
    when nothing was asked; else its cleaned data (cleaned: a 400 if not valid)."""
    return cleaned(form) if form.is_bound else {}


def one(qs: Any, **lookup: Any) -> Any:
    """The object, or 404 (also for a malformed id, or a name that is not text: a NUL
    from `%00` would make PostgreSQL refuse the query, a 500)."""
    if not all(is_text(value) for value in lookup.values() if isinstance(value, str)):
        raise Http404("No such object.")
    try:
        found = qs.filter(**lookup).first()
    except (ValueError, TypeError, ValidationError) as exc:
        raise Http404("No such object.") from exc
    if found is None:
        raise Http404("No such object.")
    return found
