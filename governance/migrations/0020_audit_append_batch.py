"""PostgreSQL: many decisions' events appended by one statement (group commit).

Every append holds the chain lock from its insert to its COMMIT, fsync included, so
appends one per statement are serial: under load the log's rate is one commit at a
time, and the requests wait in line for it. governance.audit groups the standalone
decision events that a process's threads submit while an append is in flight, and
appends them with this function: one lock, one statement, one COMMIT for all.

Each event goes through governance_audit_append() itself (migration 0013), in order,
so the link, the gapless seq and the `p_seen` check are exactly a single append's:
an event whose decision read stale state comes back with NULL seq and hash and the
others are written. `events` is a JSON array of objects, one per event, keyed by
that function's parameter names without `p_` (and `row_mac`, `seen`); the rows come
back in the array's order.
"""

from django.db import migrations

SQL = """
CREATE OR REPLACE FUNCTION governance_audit_append_batch(link_key bytea, events jsonb)
RETURNS TABLE (out_seq bigint, out_hash text) AS $$
DECLARE
    e jsonb;
BEGIN
    FOR e IN SELECT x.value FROM jsonb_array_elements(events) WITH ORDINALITY AS x
             ORDER BY x.ordinality
    LOOP
        SELECT a.out_seq, a.out_hash INTO out_seq, out_hash
        FROM governance_audit_append(
            link_key, e->>'row_mac', (e->>'uid')::uuid, (e->>'created_at')::timestamptz,
            e->>'event_type', e->>'actor_type', e->>'actor', e->>'agent', e->>'task',
            e->>'tool', e->>'action', e->>'scope', e->>'arguments', e->>'arguments_hash',
            e->>'decision', e->>'reason', (e->>'grant_id')::bigint, e->>'approval_id',
            (e->>'break_glass')::boolean, e->>'data', (e->>'seen')::bigint
        ) AS a;
        RETURN NEXT;
    END LOOP;
END;
$$ LANGUAGE plpgsql VOLATILE
"""


def up(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(SQL, params=None)


def down(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("DROP FUNCTION governance_audit_append_batch(bytea, jsonb)")


class Migration(migrations.Migration):
    dependencies = [("governance", "0019_grant_within_parent_at_statement_end")]

    operations = [migrations.RunPython(up, down)]
