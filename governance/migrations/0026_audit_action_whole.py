"""The audit log's `action` column holds a grant's whole action list.

A grant's events (grant.requested, grant.revoked, grant.unused_flagged, ...) write
its actions comma-joined, and the 10-character column cut `read,delete` to
`read,dele…`: an auditor scanning the column, or an export of it, for `delete`
did not see that the grant held it (the whole list was only in data.actions).
64 characters hold every combination of the five action classes (all five are
34), and any action a decision is asked about up to 64.

Written out instead of Django's AlterField, as in migration 0010:
- PostgreSQL: widening a varchar changes only the catalogue (no rewrite, no row
  touched); the triggers of migrations 0002 and 0012 stay, and
  governance_audit_append() (0007, 0009, 0013) takes p_action as text, so nothing
  else names the width.
- SQLite: an AlterField rebuilds the table (new table, copy, drop, rename), and
  the copy would lose the triggers that refuse UPDATE, DELETE (0002) and REPLACE
  (0023). SQLite never enforces a varchar's length, so there is nothing to change
  there: the declared type keeps saying varchar(10) and holds 64 characters, as
  it would have held more.
The chain does not know the width: row_mac covers each value as stored, so events
written before this migration, whose action was cut, verify as they are.
"""

from django.db import migrations, models

TABLE = "governance_auditevent"


def forwards(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"ALTER TABLE {TABLE} ALTER COLUMN action TYPE varchar(64)")


def backwards(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    with schema_editor.connection.cursor() as cur:
        cur.execute(f"SELECT min(seq) FROM {TABLE} WHERE length(action) > 10")
        (seq,) = cur.fetchone()
    if seq is not None:
        # Narrowing would have to cut or refuse them, and an event cannot be edited.
        raise RuntimeError(
            f"cannot narrow the audit log's action column: the event at seq {seq} "
            "(and maybe later ones) holds an action longer than 10 characters"
        )
    schema_editor.execute(f"ALTER TABLE {TABLE} ALTER COLUMN action TYPE varchar(10)")


class Migration(migrations.Migration):
    dependencies = [("governance", "0025_audit_agent_and_tool_indexes")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunPython(forwards, backwards)],
            state_operations=[
                migrations.AlterField(
                    model_name="auditevent",
                    name="action",
                    field=models.CharField(blank=True, max_length=64),
                ),
            ],
        )
    ]
