from __future__ import annotations

import uuid

from django.db import models


class AuditEvent(models.Model):
    """One append-only event per decision and per state change.

    `seq` is gapless and assigned under the chain lock; `hash` links the event
    to `prev_hash` with two HMACs keyed from AUDIT_HMAC_KEY (governance.audit:
    row_mac over the content, then the link over prev_hash, seq and row_mac). Editing,
    deleting, inserting or reordering any row breaks the chain, and the
    database refuses UPDATE and DELETE outright (triggers in migration 0002).
    Names are stored as text, not foreign keys, so the log stands on its own.
    Only governance.audit writes these rows.
    """

    seq = models.BigIntegerField(primary_key=True)
    uid = models.UUIDField(unique=True, default=uuid.uuid4, editable=False)
    created_at = models.DateTimeField(db_index=True)
    event_type = models.CharField(max_length=50)
    actor_type = models.CharField(max_length=10)
    actor = models.CharField(max_length=200)
    agent = models.CharField(max_length=100, blank=True)
    task = models.CharField(max_length=100, blank=True)
    tool = models.CharField(max_length=100, blank=True)
    # A grant's events hold its whole action list, comma-joined: all five classes are
    # 34 characters (migration 0026; it was 10, which cut `read,delete` short).
    action = models.CharField(max_length=64, blank=True)
    scope = models.CharField(max_length=500, blank=True)
    # Canonical JSON text, not a JSON column: the bytes hashed are the bytes
    # stored (jsonb would re-normalise numbers and key order under the HMAC).
    arguments = models.TextField(default="{}", help_text="Masked arguments, canonical JSON")
    arguments_hash = models.CharField(max_length=64, blank=True)
    decision = models.CharField(max_length=20, blank=True)
    reason = models.CharField(max_length=40, blank=True)
    grant_id = models.BigIntegerField(null=True, blank=True, db_index=True)
    approval_id = models.CharField(max_length=36, blank=True)
    break_glass = models.BooleanField(default=False)
    data = models.TextField(default="{}", help_text="Event details, canonical JSON")
    prev_hash = models.CharField(max_length=64)
    hash = models.CharField(max_length=64)

    class Meta:
        ordering = ["seq"]
        # Plain b-trees for the exact filters (Meta.indexes, not db_index: on
        # PostgreSQL db_index on a CharField adds a second, varchar_pattern_ops
        # index for LIKE, which nothing here runs, and every event would pay
        # for writing it).
        # An agent's events and a tool's come newest first (the agent and tool pages'
        # latest 20-25): (agent, seq) serves both the filter and the order, and the
        # tool's index holds only events that are not decisions (a tool's changes,
        # few, among millions of decisions that do not pay to write it).
        indexes = [
            models.Index(fields=["event_type"], name="audit_event_type"),
            models.Index(fields=["agent", "seq"], name="audit_agent_seq"),
            models.Index(
                fields=["tool", "seq"],
                name="audit_tool_seq_not_decisions",
                condition=~models.Q(
                    event_type__in=["access.allowed", "access.denied", "access.approval_required"]
                ),
            ),
        ]

    def __str__(self) -> str:
        return f"#{self.seq} {self.event_type}"

    def save(self, *args: object, **kwargs: object) -> None:
        # The ORM cannot be allowed to UPDATE an event: only audit.append inserts.
        if not self._state.adding:
            raise PermissionError("audit events are append-only")
        super().save(*args, **kwargs)  # type: ignore[arg-type]

    def delete(self, *args: object, **kwargs: object) -> tuple[int, dict[str, int]]:
        raise PermissionError("audit events are append-only")
