"""The database itself refuses UPDATE and DELETE on audit events.

Application code already never issues them; this stops everything else that
connects as the application's role (a shell, a stray script, an injected
query). Someone who can drop triggers can still edit rows, which is what
the HMAC chain and the external checkpoints are for.
"""

from django.db import migrations

POSTGRES_UP = """
CREATE OR REPLACE FUNCTION governance_audit_append_only() RETURNS trigger AS $$
BEGIN
    RAISE EXCEPTION 'audit events are append-only (% refused)', TG_OP
        USING ERRCODE = 'insufficient_privilege';
END;
$$ LANGUAGE plpgsql;
CREATE TRIGGER governance_auditevent_no_update BEFORE UPDATE ON governance_auditevent
    FOR EACH ROW EXECUTE FUNCTION governance_audit_append_only();
CREATE TRIGGER governance_auditevent_no_delete BEFORE DELETE ON governance_auditevent
    FOR EACH ROW EXECUTE FUNCTION governance_audit_append_only();
"""
POSTGRES_DOWN = """
DROP TRIGGER IF EXISTS governance_auditevent_no_update ON governance_auditevent;
DROP TRIGGER IF EXISTS governance_auditevent_no_delete ON governance_auditevent;
DROP FUNCTION IF EXISTS governance_audit_append_only();
"""
SQLITE_UP = [
    """CREATE TRIGGER governance_auditevent_no_update BEFORE UPDATE ON governance_auditevent
       BEGIN SELECT RAISE(ABORT, 'audit events are append-only (UPDATE refused)'); END;""",
    """CREATE TRIGGER governance_auditevent_no_delete BEFORE DELETE ON governance_auditevent
       BEGIN SELECT RAISE(ABORT, 'audit events are append-only (DELETE refused)'); END;""",
]
SQLITE_DOWN = [
    "DROP TRIGGER IF EXISTS governance_auditevent_no_update",
    "DROP TRIGGER IF EXISTS governance_auditevent_no_delete",
]


def up(apps, schema_editor):
    vendor = schema_editor.connection.vendor
    if vendor == "postgresql":
        schema_editor.execute(POSTGRES_UP, params=None)
    elif vendor == "sqlite":
        for statement in SQLITE_UP:
            schema_editor.execute(statement)
    else:
        raise RuntimeError(f"no append-only triggers for {vendor}")


def down(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(POSTGRES_DOWN)
    else:
        for statement in SQLITE_DOWN:
            schema_editor.execute(statement)


class Migration(migrations.Migration):
    dependencies = [("governance", "0001_initial")]

    operations = [migrations.RunPython(up, down)]
