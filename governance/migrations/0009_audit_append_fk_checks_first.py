"""PostgreSQL: the chain lock is the last lock an appending transaction takes.

Django creates foreign keys DEFERRABLE INITIALLY DEFERRED, so a transaction
that inserted a row referencing a user, a tool or a grant checks that
reference (a KEY SHARE lock on the referenced row) at COMMIT, after it took
the chain lock in governance_audit_append(). Another transaction holding that
row locked and waiting for the chain lock then deadlocks with it (seen by the
fuzzer: agent creation against a break-glass opening by the same person).

governance_audit_append() now runs the pending deferred checks first
(SET CONSTRAINTS ALL IMMEDIATE, then takes the lock), so every row lock a
transaction needs for its earlier writes is taken before the chain lock, and
the transaction then holds the chain lock only for the insert and the COMMIT.
Same signature and body otherwise (migration 0007).
"""

from django.db import migrations

LOCK_KEY = 7_305_010_101  # governance.audit.CHAIN_LOCK_KEY


def function_sql(check_first: bool) -> str:
    first = "SET CONSTRAINTS ALL IMMEDIATE;\n    " if check_first else ""
    return f"""
CREATE OR REPLACE FUNCTION governance_audit_append(
    link_key bytea, row_mac text,
    p_uid uuid, p_created_at timestamptz, p_event_type text, p_actor_type text,
    p_actor text, p_agent text, p_task text, p_tool text, p_action text, p_scope text,
    p_arguments text, p_arguments_hash text, p_decision text, p_reason text,
    p_grant_id bigint, p_approval_id text, p_break_glass boolean, p_data text,
    OUT out_seq bigint, OUT out_hash text
) AS $$
DECLARE
    last_seq bigint;
    prev text;
BEGIN
    {first}PERFORM pg_advisory_xact_lock({LOCK_KEY});
    SELECT e.seq, e.hash INTO last_seq, prev
    FROM governance_auditevent e ORDER BY e.seq DESC LIMIT 1;
    IF NOT FOUND THEN
        last_seq := 0;
        prev := repeat('0', 64);
    END IF;
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


def up(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(function_sql(check_first=True), params=None)


def down(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(function_sql(check_first=False), params=None)


class Migration(migrations.Migration):
    dependencies = [("governance", "0008_usage_fold")]

    operations = [migrations.RunPython(up, down)]
