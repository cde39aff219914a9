"""Who may open which page: one decorator per kind of right.

    read    any role (admin, approver, auditor): every page that only shows
    export  auditors and admins: exports, the printable report
    decide  approvers and admins: approve or deny requests and approvals
    admin   admins: revoke, suspend and resume agents, tokens, re-approve tools

Not signed in: redirect to the sign-in page. Signed in without the right:
403, whatever the method, so a forged POST changes nothing. A deactivated
user has no session any more: the deactivation deletes their sessions (and
revokes their personal tokens, services.people), so the next request is
anonymous, and stays so if the account is switched on again.

A view says no by raising, and the decorator answers: a form that is not valid
(common.cleaned) with a 400 showing its errors, a service's refusal
(GovernanceError) with its code, sentence and status (common.failed). Nothing was
written: a service changes state in one transaction.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from django.contrib.auth.views import redirect_to_login
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse

from governance import roles
from governance.errors import GovernanceError
from governance.web import common

LOGIN_URL = "/ui/login/"


def has_any_role(user: Any) -> bool:
    return roles.is_approver(user) or roles.is_auditor(user)


RIGHTS: dict[str, Callable[[Any], bool]] = {
    "read": has_any_role,
    "export": roles.is_auditor,
    "decide": roles.is_approver,
    "admin": roles.is_admin,
}

View = Callable[..., HttpResponse]


def require(right: str) -> Callable[[View], View]:
    check = RIGHTS[right]

    def decorator(view: View) -> View:
        @wraps(view)
        def wrapped(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            if not request.user.is_authenticated:
                return redirect_to_login(request.get_full_path(), LOGIN_URL)
            if not check(request.user):
                raise PermissionDenied(f"This needs the {right} right.")
            try:
                return view(request, *args, **kwargs)
            except common.Invalid as exc:
                return common.invalid(request, exc.form)
            except GovernanceError as exc:
                return common.failed(request, exc)

        wrapped.ui_right = right  # type: ignore[attr-defined]
        return wrapped

    return decorator


def rights_of(user: Any) -> dict[str, bool]:
    """For templates: which buttons to show (the views check again on POST)."""
    return {name: check(user) for name, check in RIGHTS.items()}
