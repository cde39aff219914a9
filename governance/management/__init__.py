from __future__ import annotations

from typing import Any


def revoked_line(token: Any, at: Any) -> str:
    """What `agent_token revoke` and `api_token revoke` print: whether this run revoked
    the token, or it already was (nothing changed, no event)."""
    if token.revoked_at == at:
        return f"revoked {token.prefix}"
    return f"{token.prefix} was already revoked at {token.revoked_at.isoformat()}; nothing changed"
