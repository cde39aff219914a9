"""SQLite: the database refuses an insert that would replace an audit event.

`INSERT OR REPLACE` / `REPLACE INTO` with an existing event's seq or uid deletes
that event and writes the new row, and SQLite fires no DELETE trigger for a
replace (unless recursive_triggers is on, which any connection can turn off):
the UPDATE and DELETE triggers of 0002 did not stop it. An append never collides
with an existing seq or uid, so refusing every colliding insert costs the
application nothing. PostgreSQL has no REPLACE; its `ON CONFLICT DO UPDATE` fires
the UPDATE trigger.
"""

from django.db import migrations

SQLITE_UP = """
CREATE TRIGGER governance_auditevent_no_replace BEFORE INSERT ON governance_auditevent
WHEN EXISTS (SELECT 1 FROM governance_auditevent WHERE seq = NEW.seq OR uid = NEW.uid)
BEGIN SELECT RAISE(ABORT, 'audit events are append-only (REPLACE refused)'); END;
"""
SQLITE_DOWN = "DROP TRIGGER IF EXISTS governance_auditevent_no_replace"


def up(apps, schema_editor):
    if schema_editor.connection.vendor == "sqlite":
        schema_editor.execute(SQLITE_UP)


def down(apps, schema_editor):
    if schema_editor.connection.vendor == "sqlite":
        schema_editor.execute(SQLITE_DOWN)


class Migration(migrations.Migration):
    dependencies = [("governance", "0022_policy_definition_hash")]

    operations = [migrations.RunPython(up, down)]
