"""Every code the system speaks, each from one enum.

Reason codes are what a decision says; event codes are what the audit log
says. Namespaced event codes (``grant.issued``) follow pretix's log_action.
"""

from __future__ import annotations

from django.db import models

from sandbox_runner.spec import LIMIT_MAX, LIMIT_MIN, LIMIT_NAMES


class ActionClass(models.TextChoices):
    """Separate grants: read is not write, write is not delete."""

    READ = "read"
    CREATE = "create"
    UPDATE = "update"
    DELETE = "delete"
    EXECUTE = "execute"


ACTION_VALUES: frozenset[str] = frozenset(ActionClass.values)

# A grant's (or a sandbox run's) code-execution ceilings: (least, most) of each, the
# same whichever door a grant comes through (API, matrix file, service). cpus may be a
# fraction; the others are whole numbers (memory_mb: the engine's own minimum is 6).
# One source with the runner's own checks (its CLI refuses what no grant could allow).
LIMIT_BOUNDS: dict[str, tuple[float, int]] = {
    name: (LIMIT_MIN[name], LIMIT_MAX[name]) for name in LIMIT_NAMES
}


def limit_problem(key: str, value: object) -> str | None:
    """What is wrong with `value` as the `key` limit (a sentence's end), or None."""
    least, most = LIMIT_BOUNDS[key]
    kind = (int, float) if key == "cpus" else (int,)
    if isinstance(value, bool) or not isinstance(value, kind):
        return "must be a number" if key == "cpus" else "must be a whole number"
    if not least <= value <= most:  # type: ignore[operator]
        return f"must be between {least} and {most}"
    return None


class Decision(models.TextChoices):
    ALLOW = "allow"
    DENY = "deny"
    APPROVAL_REQUIRED = "approval_required"


class Reason(models.TextChoices):
    """Why authorize() answered as it did. Order mirrors the checklist."""

    ALLOWED = "allowed"
    INVALID_REQUEST = "invalid_request"
    UNKNOWN_AGENT = "unknown_agent"
    AGENT_SUSPENDED = "agent_suspended"
    UNKNOWN_TOOL = "unknown_tool"
    TOOL_QUARANTINED = "tool_quarantined"
    ACTION_NOT_SUPPORTED = "action_not_supported"
    TASK_UNKNOWN = "task_unknown"
    TASK_CLOSED = "task_closed"
    NO_GRANT = "no_grant"
    GRANT_NOT_STARTED = "grant_not_started"
    GRANT_EXPIRED = "grant_expired"
    GRANT_REVOKED = "grant_revoked"
    # A delegated grant's row holds more than the grant it was delegated from (another
    # tool, task or holder, an action or scope beyond it): written around the services.
    DELEGATION_OUTSIDE_PARENT = "delegation_outside_parent"
    SCOPE_MISMATCH = "scope_mismatch"
    APPROVAL_REQUIRED = "approval_required"
    APPROVAL_INVALID = "approval_invalid"
    # A person denied this exact call within APPROVAL_TTL: not asked again.
    APPROVAL_DENIED = "approval_denied"
    # APPROVAL_PENDING_MAX of the agent's calls already await a person: no new request.
    APPROVAL_BACKLOG = "approval_backlog"
    # The API's own refusal, not authorize()'s: the bearer token the request came with
    # was revoked after the request was let in, before its decision was recorded.
    TOKEN_REVOKED = "token_revoked"
    ERROR = "error"


class EventType(models.TextChoices):
    """Namespaced audit event codes."""

    ACCESS_ALLOWED = "access.allowed"
    ACCESS_DENIED = "access.denied"
    ACCESS_APPROVAL_REQUIRED = "access.approval_required"
    ACCESS_OUTCOME = "access.outcome"
    AGENT_CREATED = "agent.created"
    AGENT_SUSPENDED = "agent.suspended"
    AGENT_REACTIVATED = "agent.reactivated"
    TOKEN_ISSUED = "agent_token.issued"
    TOKEN_REVOKED = "agent_token.revoked"
    TOOL_REGISTERED = "tool.registered"
    TOOL_UPDATED = "tool.updated"
    TOOL_QUARANTINED = "tool.quarantined"
    TOOL_APPROVED = "tool.approved"
    TASK_OPENED = "task.opened"
    TASK_CLOSED = "task.closed"
    GRANT_REQUESTED = "grant.requested"
    GRANT_ISSUED = "grant.issued"
    GRANT_DENIED = "grant.denied"
    GRANT_REVOKED = "grant.revoked"
    GRANT_EXPIRED = "grant.expired"
    # A request left undecided past GRANT_REQUEST_TTL; the row is closed as denied.
    GRANT_REQUEST_EXPIRED = "grant.request_expired"
    GRANT_DELEGATED = "grant.delegated"
    # A delegation refused (wider than the parent, not delegable, too deep, the parent
    # not live, the subagent not the holder's or suspended): an agent reaching for
    # more than it holds is on record, as a denied call is.
    GRANT_DELEGATION_REFUSED = "grant.delegation_refused"
    APPROVAL_REQUESTED = "approval.requested"
    APPROVAL_APPROVED = "approval.approved"
    APPROVAL_DENIED = "approval.denied"
    APPROVAL_CONSUMED = "approval.consumed"
    APPROVAL_EXPIRED = "approval.expired"
    # A rule that answers the confirmation gate for one agent's calls (approve or deny).
    CONFIRMATION_POLICY_CREATED = "confirmation_policy.created"
    CONFIRMATION_POLICY_REVOKED = "confirmation_policy.revoked"
    MATRIX_IMPORTED = "matrix.imported"
    # Reading who-could-do-what is itself recorded: an export leaves the system.
    REPORT_EXPORTED = "report.exported"
    # The first checkpoint series began (written once in a log's life, and signed by that
    # first checkpoint): from then on an empty checkpoint directory is a finding, not a
    # fresh start.
    AUDIT_CHECKPOINTS_STARTED = "audit.checkpoints_started"
    # An admin started a new checkpoint series (after restoring the database from a
    # backup, say): the old series is kept aside, named in the event.
    AUDIT_CHECKPOINTS_RESTARTED = "audit.checkpoints_restarted"
    # A checkpoint written longer than AUDIT_CHECKPOINT_MAX_AGE after the one before:
    # events written in between were not protected by any checkpoint while it lasted.
    AUDIT_CHECKPOINT_GAP = "audit.checkpoint_gap"
    # Old checkpoints were deleted, signed bridges written in their place
    # (audit.compact_checkpoints): how many, which, and the window kept whole.
    AUDIT_CHECKPOINTS_COMPACTED = "audit.checkpoints_compacted"
    # The nightly chain walk found tampering (or a broken checkpoint).
    AUDIT_VERIFY_FAILED = "audit.verify_failed"
    # Someone read the audit log in the web UI (exports are report.exported).
    AUDIT_VIEWED = "audit.viewed"
    # --- Lifecycle (issue #5) ---
    TOKEN_EXPIRED = "agent_token.expired"
    # Narrowed in place by a review: fewer actions, narrower scope or earlier expiry.
    GRANT_NARROWED = "grant.narrowed"
    # A person overruled a delegation made under this grant (or below it): nothing more
    # is delegated from it. Its actions, scope and window are unchanged.
    GRANT_DELEGATION_WITHDRAWN = "grant.delegation_withdrawn"
    # Unused for UNUSED_GRANT_HOURS: proposed for removal (or narrowing to read).
    GRANT_UNUSED_FLAGGED = "grant.unused_flagged"
    BREAKGLASS_OPENED = "breakglass.opened"
    # Closed early after its grant had already ended elsewhere (a live one's close is
    # its grant.revoked event).
    BREAKGLASS_CLOSED = "breakglass.closed"
    BREAKGLASS_RATIFIED = "breakglass.ratified"
    BREAKGLASS_CONFIRMED_CLOSED = "breakglass.confirmed_closed"
    BREAKGLASS_REVIEW_OVERDUE = "breakglass.review_overdue"
    REVIEW_CAMPAIGN_OPENED = "review.campaign_opened"
    REVIEW_CAMPAIGN_CLOSED = "review.campaign_closed"
    REVIEW_ITEM_DECIDED = "review.item_decided"
    # Left undecided at the due date: REVIEW_DEFAULT_RULE applied by the job.
    REVIEW_ITEM_DUE_RULE = "review.item_due_rule"
    TREND_RECORDED = "trend.recorded"
    SECOND_LOOK_SAMPLED = "second_look.sampled"
    SECOND_LOOK_DECIDED = "second_look.decided"
    # The sandbox runner: one run from request to exit, and every egress attempt.
    SANDBOX_RUN_REQUESTED = "sandbox.run.requested"
    SANDBOX_RUN_DENIED = "sandbox.run.denied"
    SANDBOX_RUN_STARTED = "sandbox.run.started"
    SANDBOX_RUN_START_REFUSED = "sandbox.run.start_refused"
    SANDBOX_RUN_FINISHED = "sandbox.run.finished"
    # Killed by the reaper: past its deadline (runner gone) or its agent suspended.
    SANDBOX_RUN_REAPED = "sandbox.run.reaped"
    SANDBOX_EGRESS_ALLOWED = "sandbox.egress.allowed"
    SANDBOX_EGRESS_DENIED = "sandbox.egress.denied"
    # People and their roles (governance.services.people): who may approve is state too.
    PERSON_CREATED = "person.created"
    PERSON_CHANGED = "person.changed"
    PERSON_ROLES_CHANGED = "person.roles_changed"
    PERSON_PERMISSIONS_CHANGED = "person.permissions_changed"
    PERSON_DELETED = "person.deleted"


class ActorType(models.TextChoices):
    AGENT = "agent"
    USER = "user"
    SYSTEM = "system"


class NotificationEvent(models.TextChoices):
    """What governance.notifications sends about (issue #5)."""

    REQUEST_PENDING = "request_pending"
    APPROVAL_NEEDED = "approval_needed"
    BREAKGLASS_OPENED = "breakglass_opened"
    REVIEW_DUE = "review_due"
    REVIEW_OVERDUE = "review_overdue"
    GRANT_EXPIRING = "grant_expiring"
    # A live grant's rights went unused for UNUSED_GRANT_HOURS: proposed for removal.
    GRANT_UNUSED = "grant_unused"
    AUDIT_VERIFY_FAILED = "audit_verify_failed"
    SECOND_LOOK_FLAGGED = "second_look_flagged"
    # A rule now answers the confirmation gate for an agent's destructive calls.
    POLICY_WRITTEN = "policy_written"
