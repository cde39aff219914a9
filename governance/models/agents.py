from __future__ import annotations

import hashlib
import secrets
from datetime import datetime

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone


class Agent(models.Model):
    """One identity per agent, never shared, with an accountable human owner.

    A subagent names its parent; it can only ever hold a subset of the
    parent's grants: it gets them by delegation only (the services refuse it a
    request or break-glass of its own, and authorize() counts neither such a
    grant nor a delegated one whose ancestors are not live).
    """

    class Status(models.TextChoices):
        ACTIVE = "active"
        SUSPENDED = "suspended"

    name = models.CharField(max_length=100, unique=True)
    description = models.TextField(blank=True)
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="owned_agents"
    )
    parent = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.PROTECT, related_name="subagents"
    )
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.ACTIVE)
    created_at = models.DateTimeField(auto_now_add=True)
    suspended_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(
                condition=~Q(parent=models.F("id")), name="agent_not_own_parent"
            ),
        ]

    def __str__(self) -> str:
        return self.name


TOKEN_PREFIX_LEN = 8


def token_digest(secret: str) -> str:
    """SHA-256 of a high-entropy token: a slow KDF buys nothing for 256-bit secrets."""
    return hashlib.sha256(secret.encode()).hexdigest()


class AgentToken(models.Model):
    """A bearer credential, stored only as a digest plus a lookup prefix.

    The plaintext is shown once at creation (netbox Token, zulip MCP tokens).
    Exactly one of agent/user holds it: agents authorize tool calls, humans
    use personal tokens limited by their role.
    """

    agent = models.ForeignKey(
        Agent, null=True, blank=True, on_delete=models.PROTECT, related_name="tokens"
    )
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="api_tokens",
    )
    prefix = models.CharField(max_length=TOKEN_PREFIX_LEN, unique=True)
    digest = models.CharField(max_length=64)
    # The `at` of its issue (services.agents.token_issue), as expires_at is counted from
    # it: a report about a moment before then does not count its holder's stake in the
    # agent (policy.stake_check), which a wall-clock stamp taken apart from `at` broke.
    created_at = models.DateTimeField(default=timezone.now)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+"
    )
    expires_at = models.DateTimeField()
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    # Set once by the expiry job when it announces the expiry (refused before that anyway).
    expiry_announced_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=(Q(agent__isnull=False) & Q(user__isnull=True))
                | (Q(agent__isnull=True) & Q(user__isnull=False)),
                name="token_has_exactly_one_holder",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.prefix}…"

    @staticmethod
    def generate(personal: bool = False) -> tuple[str, str, str]:
        """Return (plaintext, prefix, digest). The plaintext is never stored. A person's
        token reads usr_..., an agent's agt_... (a leaked one says whose it is at a
        glance); the digest covers the whole text, so the two cannot be swapped."""
        prefix = secrets.token_hex(TOKEN_PREFIX_LEN // 2)
        kind = "usr" if personal else "agt"
        plaintext = f"{kind}_{prefix}_{secrets.token_urlsafe(32)}"
        return plaintext, prefix, token_digest(plaintext)

    def matches(self, plaintext: str) -> bool:
        return secrets.compare_digest(self.digest, token_digest(plaintext))

    def is_live_at(self, at: datetime) -> bool:
        return self.expires_at > at and (self.revoked_at is None or self.revoked_at > at)
