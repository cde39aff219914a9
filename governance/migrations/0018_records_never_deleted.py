"""PostgreSQL: the database itself keeps the governance records and their limits.

1. Grants are never deleted (DESIGN: they end as expired, revoked or denied), and
   neither are the other records the access report, reviews and audits are built on:
   agents, their tokens, tools, tasks, approvals, confirmation policies, break-glass,
   review campaigns and items, sandbox runs. A DELETE from anything connected as the
   application's role (a shell, a stray script, an injected query) is refused, as for
   audit events (migration 0002): deleting a grant row would take it out of every
   past-moment access report while the audit chain still verifies. TRUNCATE is not
   refused (a test run's flush empties tables with it; the audit table, which holds
   the history, refuses it: migration 0012).
2. No grant's window is longer than the hard maximum of GRANT_MAX_TTL_HOURS (a year):
   whatever the configured maximum, no row can say "for ten years".
3. A live delegated grant never outlives its parent (DESIGN: "earlier expiry"): its
   row is refused with an expiry past its parent's. (A parent's expiry brought earlier
   is the service's to follow: grant_narrow revokes the children that no longer fit,
   in the same transaction; authorize() already ends a child with its parent.)

SQLite (the embedded default) relies on the services for these.
"""

from django.db import migrations

RECORD_TABLES = (
    "governance_agent",
    "governance_agenttoken",
    "governance_tool",
    "governance_task",
    "governance_grant",
    "governance_approval",
    "governance_confirmationpolicy",
    "governance_breakglass",
    "governance_reviewcampaign",
    "governance_reviewitem",
    "governance_sandboxrun",
)
WINDOW_MAX = "8760 hours"  # governance.settings.YEAR_HOURS: GRANT_MAX_TTL's own maximum

POSTGRES_UP = [
    """CREATE OR REPLACE FUNCTION governance_record_kept() RETURNS trigger AS $$
BEGIN
    RAISE EXCEPTION 'governance records are never deleted (% on % refused)',
        TG_OP, TG_TABLE_NAME USING ERRCODE = 'insufficient_privilege';
END;
$$ LANGUAGE plpgsql""",
    *(
        f"""CREATE TRIGGER {table}_kept BEFORE DELETE ON {table}
            FOR EACH ROW EXECUTE FUNCTION governance_record_kept()"""
        for table in RECORD_TABLES
    ),
    f"""ALTER TABLE governance_grant ADD CONSTRAINT grant_window_within_hard_max CHECK (
        starts_at IS NULL OR expires_at IS NULL
        OR expires_at - starts_at <= interval '{WINDOW_MAX}')""",
    """CREATE OR REPLACE FUNCTION governance_grant_within_parent() RETURNS trigger AS $$
BEGIN
    IF NEW.status = 'active' AND NEW.delegated_from_id IS NOT NULL AND EXISTS (
        SELECT 1 FROM governance_grant p
        WHERE p.id = NEW.delegated_from_id AND NEW.expires_at > p.expires_at
    ) THEN
        RAISE EXCEPTION 'grant % would outlive the grant % it was delegated from',
            NEW.id, NEW.delegated_from_id USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END;
$$ LANGUAGE plpgsql""",
    """CREATE TRIGGER governance_grant_within_parent
        BEFORE INSERT OR UPDATE ON governance_grant
        FOR EACH ROW EXECUTE FUNCTION governance_grant_within_parent()""",
]
POSTGRES_DOWN = [
    "DROP TRIGGER IF EXISTS governance_grant_within_parent ON governance_grant",
    "DROP FUNCTION IF EXISTS governance_grant_within_parent()",
    "ALTER TABLE governance_grant DROP CONSTRAINT IF EXISTS grant_window_within_hard_max",
    *(f"DROP TRIGGER IF EXISTS {table}_kept ON {table}" for table in RECORD_TABLES),
    "DROP FUNCTION IF EXISTS governance_record_kept()",
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
    dependencies = [("governance", "0017_sandboxrun_image_id")]

    operations = [migrations.RunPython(up, down)]
