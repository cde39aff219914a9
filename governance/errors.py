"""One error family: a machine-readable code and a sentence for a person."""

from __future__ import annotations


class GovernanceError(Exception):
    """Raised by services for a request that cannot be carried out.

    The API renders it as {"error": {"code", "message", "fields"}} with
    `status`; the UI and commands show the message. Nothing is half-written:
    services raise before, or inside, their transaction.
    """

    status = 400

    def __init__(self, code: str, message: str, *, fields: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.fields = fields or {}


class Unauthenticated(GovernanceError):
    """The request's bearer token no longer holds (revoked while the request was on its
    way to its write): the API answers as it answers at the door, the same 401."""

    status = 401

    def __init__(self) -> None:
        super().__init__("unauthenticated", "A valid bearer token is required.")


class NotFound(GovernanceError):
    status = 404


class Forbidden(GovernanceError):
    status = 403


class Conflict(GovernanceError):
    status = 409


class Unavailable(GovernanceError):
    """Something the request depends on is down; nothing was done. Retry later."""

    status = 503


class RateLimited(GovernanceError):
    """Too many of something per person per period; try later or another way.

    `retry_after` (seconds) is when trying again can succeed; the API sends it as
    the Retry-After header."""

    status = 429

    def __init__(
        self,
        code: str,
        message: str,
        *,
        retry_after: int | None = None,
        fields: dict[str, str] | None = None,
    ) -> None:
        super().__init__(code, message, fields=fields)
        self.retry_after = retry_after
