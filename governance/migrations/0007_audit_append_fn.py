"""PostgreSQL: append an audit event in one round trip, link computed under the lock.

governance_audit_append() takes the chain lock (an advisory transaction lock,
held until the caller's COMMIT), reads the head in a statement of its own and
inserts the event. The function is VOLATILE, so each statement in it takes a
fresh snapshot (READ COMMITTED): the head read, which starts only once the
lock is granted, sees the previous holder's committed event. The link hash

    hash = HMAC-SHA256(link_key, prev_hash || ':' || seq || ':' || row_mac)

is computed here with pgcrypto's hmac(), because only the server knows the
head under the lock; row_mac (an HMAC of the event's content under another
key derived from AUDIT_HMAC_KEY) comes from the client and is not stored.
The link key arrives as a bind parameter, never in SQL text. The critical
section is therefore this function's work plus the caller's COMMIT, instead
of several client round trips. SQLite computes the same formula in Python
(governance.audit).
"""

from django.db import migrations

LOCK_KEY = 7_305_010_101  # governance.audit.CHAIN_LOCK_KEY (a constant, not imported:
# migrations must not change when application code does)

POSTGRES_UP = f"""
CREATE EXTENSION IF NOT EXISTS pgcrypto;
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
    PERFORM pg_advisory_xact_lock({LOCK_KEY});
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
POSTGRES_DOWN = """
DROP FUNCTION IF EXISTS governance_audit_append(
    bytea, text, uuid, timestamptz, text, text, text, text, text, text, text, text,
    text, text, text, text, bigint, text, boolean, text);
"""


def up(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(POSTGRES_UP, params=None)


def down(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(POSTGRES_DOWN, params=None)


class Migration(migrations.Migration):
    dependencies = [("governance", "0006_merge_0005_lifecycle_0005_sandbox_run")]

    operations = [migrations.RunPython(up, down)]
