from __future__ import annotations

import hashlib
import json
from typing import Any

from django.conf import settings
from django.db import models

from governance.codes import ActionClass
from governance.text import jsonb_form


def definition_hash(name: str, description: str, input_schema: Any) -> str:
    """Pin what the model reads about a tool: name + description + input schema.

    Third-party tool metadata is attacker-influenced (a changed description
    can carry instructions), so any change to these bytes quarantines the tool.
    The schema is hashed in the form jsonb stores it (jsonb_form: 1e16 is kept as
    10000000000000000), so the stored definition still hashes to its pin on
    PostgreSQL; only spellings of the same number are merged, a changed value is not.
    """
    canonical = json.dumps(
        {"name": name, "description": description, "input_schema": jsonb_form(input_schema)},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


class Tool(models.Model):
    """The inventory. A tool that is not here does not exist (`unknown_tool`)."""

    class Kind(models.TextChoices):
        SHELL = "shell"
        FILE = "file"
        NETWORK = "network"
        API = "api"
        CODE_EXEC = "code_exec"
        DATABASE = "database"
        MESSAGING = "messaging"

    name = models.CharField(max_length=100, unique=True)
    kind = models.CharField(max_length=20, choices=Kind.choices)
    description = models.TextField(blank=True)
    input_schema = models.JSONField(default=dict, blank=True)
    # Action classes this tool can perform at all; a grant cannot exceed them.
    actions = models.JSONField(default=list)
    third_party = models.BooleanField(default=False)
    # Publish, pay, send external message: every action passes the gate.
    irreversible = models.BooleanField(default=False)
    definition_hash = models.CharField(max_length=64)
    # The definition an admin approved; a mismatch means quarantine.
    approved_hash = models.CharField(max_length=64)
    approved_definition = models.JSONField(default=dict, blank=True)
    # Who recorded the current definition (null: a sync job or the registration).
    # They cannot also approve it: nobody clears their own change from quarantine.
    definition_updated_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def is_quarantined(self) -> bool:
        return self.definition_hash != self.approved_hash

    def supports(self, action: str) -> bool:
        return action in self.actions

    def is_destructive(self, action: str) -> bool:
        return self.irreversible or action == ActionClass.DELETE
