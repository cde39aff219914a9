"""PostgreSQL: a decision's event is refused if the state it read has changed since.

A decision reads live state without a lock, then appends its event, waiting for the
chain lock. A revoke, a suspension or any other state change holds the chain lock from
its own event to its COMMIT, so a decision could read the state just before that commit,
wait, and be written (and answered) after it: an allow after the revocation.

Every state change writes its event under the chain lock, so the decision's read names
the newest event it could see (`p_seen`) and, once it holds the lock, this function
looks at what committed since: if any of it is a change that can alter a decision,
nothing is written and NULL comes back, and the caller decides again on fresh state.
Decisions themselves (`access.*`), sandbox run records and egress (`sandbox.*`), and
bookkeeping that only restates what time already decides (expiry marks) never force a
retry. An unknown kind of event does: the list names what is harmless, not what is not.

Same body as migration 0009 otherwise; `p_seen` NULL (every other event) checks nothing.
"""

from django.db import migrations

LOCK_KEY = 7_305_010_101  # governance.audit.CHAIN_LOCK_KEY

ARGS = """link_key bytea, row_mac text,
    p_uid uuid, p_created_at timestamptz, p_event_type text, p_actor_type text,
    p_actor text, p_agent text, p_task text, p_tool text, p_action text, p_scope text,
    p_arguments text, p_arguments_hash text, p_decision text, p_reason text,
    p_grant_id bigint, p_approval_id text, p_break_glass boolean, p_data text"""
OLD_SIGNATURE = """(bytea, text, uuid, timestamptz, text, text, text, text, text, text, text,
    text, text, text, text, text, bigint, text, boolean, text)"""

SCAN_LIMIT = 10_000
HARMLESS = (
    "e.event_type LIKE 'access.%' OR e.event_type LIKE 'sandbox.%' OR e.event_type IN ("
    "'grant.expired', 'grant.request_expired', 'approval.expired', 'agent_token.expired', "
    "'audit.checkpoint', 'audit.verify_failed', 'audit.viewed', 'report.exported', "
    "'trend.recorded', 'grant.unused_flagged')"
)


def function_sql(seen: bool) -> str:
    extra = ",\n    p_seen bigint DEFAULT NULL" if seen else ""
    # Bounded on both sides by variables, so even a generic plan walks the primary key
    # over the few events since (`seq > p_seen` alone is planned as a third of the log:
    # a scan of all of it). More than SCAN_LIMIT events since counts as a change.
    check = (
        f"""
    IF p_seen IS NOT NULL AND (
        last_seq - p_seen > {SCAN_LIMIT} OR EXISTS (
            SELECT 1 FROM governance_auditevent e
            WHERE e.seq > p_seen AND e.seq <= last_seq AND NOT ({HARMLESS})
        )
    ) THEN
        RETURN;  -- out_seq and out_hash stay NULL: decide again
    END IF;"""
        if seen
        else ""
    )
    return f"""
CREATE OR REPLACE FUNCTION governance_audit_append(
    {ARGS}{extra},
    OUT out_seq bigint, OUT out_hash text
) AS $$
DECLARE
    last_seq bigint;
    prev text;
BEGIN
    SET CONSTRAINTS ALL IMMEDIATE;
    PERFORM pg_advisory_xact_lock({LOCK_KEY});
    SELECT e.seq, e.hash INTO last_seq, prev
    FROM governance_auditevent e ORDER BY e.seq DESC LIMIT 1;
    IF NOT FOUND THEN
        last_seq := 0;
        prev := repeat('0', 64);
    END IF;{check}
    out_seq := last_seq + 1;
    out_hash := encode(
        hmac(convert_to(prev || ':' || out_seq::text || ':' || row_mac, 'UTF8'),
             link_key, 'sha256'),
        'hex');
    INSERT INTO governance_auditevent (
        seq, uid, created_at, event_type, actor_type, actor, agent, task, tool, action,
        scope, arguments, arguments_hash, decision, reason, grant_id, approval_id,
        break_glass, data, prev_hash, hash
    ) VALUES (
        out_seq, p_uid, p_created_at, p_event_type, p_actor_type, p_actor, p_agent, p_task,
        p_tool, p_action, p_scope, p_arguments, p_arguments_hash, p_decision, p_reason,
        p_grant_id, p_approval_id, p_break_glass, p_data, prev, out_hash
    );
END;
$$ LANGUAGE plpgsql VOLATILE;
"""


NEW_SIGNATURE = OLD_SIGNATURE[:-1] + ", bigint)"


def up(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"DROP FUNCTION governance_audit_append{OLD_SIGNATURE}")
        schema_editor.execute(function_sql(seen=True), params=None)


def down(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"DROP FUNCTION governance_audit_append{NEW_SIGNATURE}")
        schema_editor.execute(function_sql(seen=False), params=None)


class Migration(migrations.Migration):
    dependencies = [("governance", "0012_audit_no_truncate")]

    operations = [migrations.RunPython(up, down)]
