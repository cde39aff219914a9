"""PostgreSQL: governance_audit_append() finds the chain head by its index, always.

A new deployment's audit log is analyzed while it is empty; the planner then reads
the head (ORDER BY seq DESC LIMIT 1) with a sequential scan and a sort, and the
function keeps that cached plan until autovacuum analyzes the table again, so until
then every append, under the chain lock, scans the whole log. Planning the function
with sequential scans off makes the head (and the key checks it runs first) index
probes whatever the statistics say. Body and signature unchanged (migration 0009).
"""

from django.db import migrations

SIGNATURE = (
    "governance_audit_append(bytea, text, uuid, timestamptz, text, text, text, text, text, "
    "text, text, text, text, text, text, text, bigint, text, boolean, text)"
)


def up(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"ALTER FUNCTION {SIGNATURE} SET enable_seqscan = off", params=None)


def down(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"ALTER FUNCTION {SIGNATURE} RESET enable_seqscan", params=None)


class Migration(migrations.Migration):
    dependencies = [("governance", "0009_audit_append_fk_checks_first")]

    operations = [migrations.RunPython(up, down)]
