"""Bearer tokens for agents and humans, and the API's permission classes.

Token checks run in a fixed order (format, prefix lookup, constant-time
digest, expiry, revocation, holder active), like netbox's token checks; every
failure is the same 401 body so a caller learns nothing about which check
failed. A suspended agent's tokens stop working at once because the agent's
status is read with the token on every request.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.db import connection, models
from django.utils import timezone
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication
from rest_framework.permissions import BasePermission
from rest_framework.request import Request

from governance import db, roles
from governance.models import Agent, AgentToken

# agt_ for an agent's token, usr_ for a person's (tokens issued before usr_ existed
# are agt_ whoever holds them, and keep working).
_TOKEN = re.compile(r"(?:agt|usr)_([0-9a-f]{8})_[A-Za-z0-9_-]{20,100}")
# last_used_at is bookkeeping: refreshing it at most once a minute keeps a
# hot agent from turning every decision into an UPDATE of its token row.
LAST_USED_GRANULARITY = timedelta(seconds=60)


@dataclass
class AgentPrincipal:
    """request.user for an agent's token."""

    agent: Agent
    token: AgentToken
    is_authenticated: bool = True
    is_active: bool = True
    is_superuser: bool = False
    is_staff: bool = False

    def __str__(self) -> str:
        return f"agent:{self.agent.name}"


class Unauthenticated(exceptions.AuthenticationFailed):
    default_detail = "A valid bearer token is required."
    default_code = "unauthenticated"


def _columns(model: type[models.Model], alias: str) -> tuple[str, list[Any]]:
    fields = list(model._meta.concrete_fields)
    return ", ".join(f"{alias}.{connection.ops.quote_name(f.column)}" for f in fields), fields


def _instance(model: type[models.Model], fields: list[Any], values: Sequence[Any]) -> Any:
    """A model instance from a db.query() row, as the ORM would build it. These
    models hold only integers, booleans, text and datetimes (read as integer
    microseconds, turned back into datetimes here)."""
    values = [
        db.from_us(v) if v is not None and isinstance(f, models.DateTimeField) else v
        for f, v in zip(fields, values, strict=True)
    ]
    return model.from_db(connection.alias, [f.attname for f in fields], values)


@functools.cache
def _token_query() -> tuple[str, str, list[Any], list[Any]]:
    token_cols, token_fields = _columns(AgentToken, "t")
    agent_cols, agent_fields = _columns(Agent, "a")
    sql = (
        f"SELECT {token_cols}, {agent_cols} FROM {AgentToken._meta.db_table} t "
        f"LEFT JOIN {Agent._meta.db_table} a ON a.id = t.agent_id WHERE t.prefix = %s"
    )
    kinds = "".join(db.kind_of(f) for f in token_fields + agent_fields)
    return sql, kinds, token_fields, agent_fields


def _token_by_prefix(prefix: str) -> AgentToken | None:
    """The token with this prefix and its agent, in one prepared statement.

    The same row the ORM's select_related("agent") would read, without building
    and compiling the query on every request (most of a request's cost before
    this). A personal token's user is loaded when it is first read.
    """
    sql, kinds, token_fields, agent_fields = _token_query()
    rows = db.query(sql, [prefix], kinds)
    if not rows:
        return None
    row = rows[0]
    token = _instance(AgentToken, token_fields, row[: len(token_fields)])
    agent = None
    if token.agent_id is not None:
        agent = _instance(Agent, agent_fields, row[len(token_fields) :])
    AgentToken.agent.field.set_cached_value(token, agent)
    return token


class BearerAuthentication(BaseAuthentication):
    keyword = "Bearer"

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="api"'

    def authenticate(self, request: Request) -> tuple[Any, AgentToken] | None:
        header = request.META.get("HTTP_AUTHORIZATION")
        if header is None:
            return None  # IsAuthenticated turns this into the same 401
        scheme, _, value = header.partition(" ")
        # The scheme is case-insensitive (RFC 9110 11.1): `bearer` is `Bearer`.
        match = _TOKEN.fullmatch(value.strip()) if scheme.lower() == "bearer" else None
        if match is None:
            raise Unauthenticated()
        token = _token_by_prefix(match.group(1))
        now = timezone.now()
        # Revoked is refused whatever `revoked_at` says against this host's clock (a
        # revoke stamped by a host whose clock runs ahead).
        if (
            token is None
            or not token.matches(value.strip())
            or token.revoked_at is not None
            or not token.is_live_at(now)
        ):
            raise Unauthenticated()
        if token.agent is not None:
            if token.agent.status != Agent.Status.ACTIVE:
                raise Unauthenticated()
            principal: Any = AgentPrincipal(agent=token.agent, token=token)
        else:
            if token.user is None or not token.user.is_active:
                raise Unauthenticated()
            principal = token.user
        if token.last_used_at is None or token.last_used_at < now - LAST_USED_GRANULARITY:
            AgentToken.objects.filter(pk=token.pk).update(last_used_at=now)
        return principal, token


class BearerScheme(OpenApiAuthenticationExtension):
    target_class = "governance.api.auth.BearerAuthentication"
    name = "bearerAuth"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {
            "type": "http",
            "scheme": "bearer",
            "description": (
                "Per-agent token (agt_xxxxxxxx_...) or personal token (usr_xxxxxxxx_...): "
                "Authorization: Bearer <token>"
            ),
        }


class IsAgent(BasePermission):
    message = "This endpoint is for agents."

    def has_permission(self, request: Request, view: Any) -> bool:
        return isinstance(request.user, AgentPrincipal)


class IsAdminRole(BasePermission):
    message = "This needs the admin role."

    def has_permission(self, request: Request, view: Any) -> bool:
        return roles.is_admin(request.user)


class IsApprover(BasePermission):
    message = "This needs the approver role."

    def has_permission(self, request: Request, view: Any) -> bool:
        return roles.is_approver(request.user)


class AdminOrAuditorReadOnly(BasePermission):
    """Admins do everything; auditors read."""

    message = "This needs the admin role (auditors may only read)."

    def has_permission(self, request: Request, view: Any) -> bool:
        if request.method in ("GET", "HEAD", "OPTIONS"):
            return roles.is_auditor(request.user)
        return roles.is_admin(request.user)


class ApproverOrAuditorReadOnly(BasePermission):
    """Approvers (admins included) write; auditors read."""

    message = "This needs the approver role (auditors may only read)."

    def has_permission(self, request: Request, view: Any) -> bool:
        if request.method in ("GET", "HEAD", "OPTIONS"):
            return roles.is_auditor(request.user) or roles.is_approver(request.user)
        return roles.is_approver(request.user)


def agent_of(request: Request) -> Agent | None:
    user = request.user
    return user.agent if isinstance(user, AgentPrincipal) else None
