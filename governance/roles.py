"""Human roles, as Django groups. A superuser counts as admin."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from governance.errors import Forbidden

ADMINS = "admins"
APPROVERS = "approvers"
AUDITORS = "auditors"


def _in(user: Any, *groups: str) -> bool:
    if user is None or not getattr(user, "is_authenticated", False):
        return False
    if not hasattr(user, "groups"):  # an agent principal
        return False
    if user.is_superuser:
        return True
    names = getattr(user, "_role_names", None)
    if names is None:
        names = set(user.groups.values_list("name", flat=True))
        user._role_names = names
    return bool(names & set(groups))


def is_admin(user: Any) -> bool:
    return _in(user, ADMINS)


def is_approver(user: Any) -> bool:
    return _in(user, ADMINS, APPROVERS)


def may_approve(user: Any) -> bool:
    """An approver who is still active: what an approve confirmation policy's author
    must be for it to answer (policy._policy_verdicts asks the same in SQL)."""
    return user is not None and bool(getattr(user, "is_active", False)) and is_approver(user)


def require_may_approve(user: Any, what: str) -> None:
    """Refuse (Forbidden `not_approver`) a decision on `what` by anyone who may not
    approve now (may_approve): the services' own check, whatever door the call came in
    by (API, UI, command, import)."""
    if not may_approve(user):
        raise Forbidden("not_approver", f"{what} are decided by active approvers or admins only.")


def may_approve_as(*, active: bool, superuser: bool, roles: Iterable[str]) -> bool:
    """may_approve() for an account given as its parts (as it was at a past moment:
    selectors.accounts_at)."""
    return active and (superuser or bool({ADMINS, APPROVERS} & set(roles)))


def is_auditor(user: Any) -> bool:
    """Read-only everything."""
    return _in(user, ADMINS, AUDITORS)


def is_read_only(user: Any) -> bool:
    """An auditor and nothing more (not an approver, admin or superuser): may read
    everything and change nothing, not even for an agent they own."""
    return _in(user, AUDITORS) and not is_approver(user)


def is_human(user: Any) -> bool:
    return hasattr(user, "groups") and getattr(user, "is_authenticated", False)
