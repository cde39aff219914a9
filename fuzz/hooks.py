"""Schemathesis hooks for fuzz/schemathesis_run.py, loaded through SCHEMATHESIS_HOOKS.

One custom check, `positive_data_acceptance_by_form`: schemathesis' own
positive_data_acceptance (a request that fits the schema must not get a 4xx other
than 401/403/404/409/429), except for the few 400s that no schema can rule out,
because they depend on other data: the body names an owner, tool, task or agent
that does not exist, or a time that has passed. Everything a schema *can* say
(name and scope patterns, unique actions, the longest grant or token) is declared
in it, so a 400 for any of those is still a finding.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import schemathesis
from schemathesis.specs.openapi.checks import positive_data_acceptance

from fuzz import serial_ast

serial_ast.install()


def _always(fields: dict[str, Any]) -> bool:
    return True


# error code -> when its 400 is about other data rather than the request's form
BEYOND_THE_SCHEMA: dict[str, Callable[[dict[str, Any]], bool]] = {
    # The body names something by a name that nothing has.
    "unknown_owner": _always,
    "unknown_parent": _always,
    "unknown_agent": _always,
    "unknown_tool": _always,
    "unknown_task": _always,
    # Who asks decides: an agent may only name itself, a person must name the agent.
    "agent_mismatch": _always,
    "agent_required": _always,
    # A task must end after it opens, i.e. after now.
    "invalid_window": _always,
    # A delegation must expire in the future. (A token's lifetime, blamed on
    # `expires_days`, is declared in the schema: that one stays a finding.)
    "invalid_expiry": lambda fields: not fields,
    # The named tool does not support the action (the form itself is declared).
    "invalid_grant": lambda fields: set(fields) == {"actions"},
    # A review decision "narrow" must name what it narrows: a rule across fields that
    # depends on the value of `decision` (reviews.review_item_decide).
    "invalid_decision": _always,
    # A sandbox run's script or input bytes must hash to the *_sha256 sent beside them.
    "hash_mismatch": _always,
    # A finish report's output excerpt cannot be longer than the stream, and one that is
    # the whole stream must hash to the stream's sha256 sent beside it.
    "stream_mismatch": _always,
    # A host backend (bubblewrap) runs the image `host` (or the default name), no other:
    # a rule across `backend` and `image`, stated in `image`'s description.
    "invalid_image": lambda fields: set(fields) == {"image"},
    # A confirmation policy is for destructive calls the named tool supports: whether
    # the tool is irreversible, and what it supports, is the tool's data.
    "not_destructive": _always,
    "action_not_supported": _always,
}


def _error(response: Any) -> tuple[str, dict[str, Any]]:
    try:
        body = json.loads(response.content or b"")
        error = body["error"]
        return str(error["code"]), dict(error.get("fields") or {})
    except (ValueError, KeyError, TypeError):
        return "", {}


def _long_host(case: Any) -> bool:
    body = case.body if isinstance(case.body, dict) else {}
    entries = body.get("egress") or []
    return any(isinstance(e, str) and len(e.rpartition(":")[0]) > 253 for e in entries)


@schemathesis.check
def positive_data_acceptance_by_form(ctx: Any, response: Any, case: Any) -> bool | None:
    """Schema-valid requests are accepted unless they name what does not exist."""
    if response.status_code == 400:
        code, fields = _error(response)
        rule = BEYOND_THE_SCHEMA.get(code)
        if rule is not None and rule(fields):
            return None
        if code == "invalid_grant" and set(fields) <= {"actions", "egress"} and _long_host(case):
            return None  # a host name over 253 characters: no pattern can say that
    return positive_data_acceptance(ctx, response, case)
