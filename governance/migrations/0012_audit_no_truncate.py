"""PostgreSQL: the database also refuses TRUNCATE on audit events.

Row triggers (migration 0002) never fire on TRUNCATE, so one statement from
anything connected as the application's role could empty the log; only the
external checkpoints would show it. A statement-level BEFORE TRUNCATE trigger
refuses it, as UPDATE and DELETE are refused, whenever the table holds an event
(`manage.py flush` too: emptying the audit log is never a side effect). An empty
table may be truncated: nothing is lost, and a flush of a database whose log is
already empty (a test run's) still works. SQLite has no TRUNCATE.
"""

from django.db import migrations

POSTGRES_UP = [
    """CREATE OR REPLACE FUNCTION governance_audit_no_truncate() RETURNS trigger AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM governance_auditevent) THEN
        RAISE EXCEPTION 'audit events are append-only (TRUNCATE refused)'
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    RETURN NULL;
END;
$$ LANGUAGE plpgsql""",
    """CREATE TRIGGER governance_auditevent_no_truncate BEFORE TRUNCATE ON governance_auditevent
       FOR EACH STATEMENT EXECUTE FUNCTION governance_audit_no_truncate()""",
]
POSTGRES_DOWN = [
    "DROP TRIGGER IF EXISTS governance_auditevent_no_truncate ON governance_auditevent",
    "DROP FUNCTION IF EXISTS governance_audit_no_truncate()",
]


def up(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        for statement in POSTGRES_UP:
            schema_editor.execute(statement, params=None)


def down(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        for statement in POSTGRES_DOWN:
            schema_editor.execute(statement, params=None)


class Migration(migrations.Migration):
    dependencies = [("governance", "0011_grant_limit_scratch_mb")]

    operations = [migrations.RunPython(up, down)]
