"""The audit log's agent and event_type columns keep one plain b-tree each.

db_index on a CharField gives PostgreSQL a second, varchar_pattern_ops index
for LIKE queries; nothing runs those on the audit log (its filters are exact),
and every event paid for writing both. The model now declares Meta.indexes.

The database side is written out instead of Django's AlterField: on SQLite an
AlterField rebuilds the table, and the rebuilt table would lose the triggers
that refuse UPDATE and DELETE (migration 0002). Dropping and creating indexes
touches no row and no trigger.
"""

from django.db import migrations, models

TABLE = "governance_auditevent"
OLD = {  # the names db_index gave them (Django's deterministic index names)
    "agent": "governance_auditevent_agent_05b1eb47",
    "event_type": "governance_auditevent_event_type_58da5cd8",
}
NEW = {"agent": "audit_agent", "event_type": "audit_event_type"}


def forwards(apps, schema_editor):
    for column, old in OLD.items():
        if schema_editor.connection.vendor == "postgresql":
            schema_editor.execute(f"DROP INDEX IF EXISTS {old}_like")
        schema_editor.execute(f"DROP INDEX IF EXISTS {old}")
        schema_editor.execute(f"CREATE INDEX {NEW[column]} ON {TABLE} ({column})")


def backwards(apps, schema_editor):
    for column, old in OLD.items():
        schema_editor.execute(f"DROP INDEX IF EXISTS {NEW[column]}")
        schema_editor.execute(f"CREATE INDEX {old} ON {TABLE} ({column})")
        if schema_editor.connection.vendor == "postgresql":
            schema_editor.execute(
                f"CREATE INDEX {old}_like ON {TABLE} ({column} varchar_pattern_ops)"
            )


class Migration(migrations.Migration):
    dependencies = [("governance", "0009_audit_append_fk_checks_first")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunPython(forwards, backwards)],
            state_operations=[
                migrations.AlterField(
                    model_name="auditevent",
                    name="agent",
                    field=models.CharField(blank=True, max_length=100),
                ),
                migrations.AlterField(
                    model_name="auditevent",
                    name="event_type",
                    field=models.CharField(max_length=50),
                ),
                migrations.AddIndex(
                    model_name="auditevent",
                    index=models.Index(fields=["event_type"], name="audit_event_type"),
                ),
                migrations.AddIndex(
                    model_name="auditevent",
                    index=models.Index(fields=["agent"], name="audit_agent"),
                ),
            ],
        )
    ]
