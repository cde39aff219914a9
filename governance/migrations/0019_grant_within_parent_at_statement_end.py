"""The check that a live delegated grant does not outlive its parent (0018) runs at the
end of the statement, not row by row: one UPDATE that moves a parent and its child
together (both to the same later expiry) was refused or not depending on which row
the table scan reached first. A constraint trigger (AFTER, not deferred) sees every
row the statement changed. PostgreSQL only, as 0018."""

from django.db import migrations

UP = [
    "DROP TRIGGER IF EXISTS governance_grant_within_parent ON governance_grant",
    """CREATE OR REPLACE FUNCTION governance_grant_within_parent() RETURNS trigger AS $$
BEGIN
    IF EXISTS (
        SELECT 1 FROM governance_grant c JOIN governance_grant p ON p.id = c.delegated_from_id
        WHERE c.id = NEW.id AND c.status = 'active' AND c.expires_at > p.expires_at
    ) THEN
        RAISE EXCEPTION 'grant % would outlive the grant % it was delegated from',
            NEW.id, NEW.delegated_from_id USING ERRCODE = 'check_violation';
    END IF;
    RETURN NULL;
END;
$$ LANGUAGE plpgsql""",
    # Only rows that could break it: a decision's usage update (use_count,
    # last_used_at) sets none of these columns and queues nothing.
    """CREATE CONSTRAINT TRIGGER governance_grant_within_parent
        AFTER INSERT OR UPDATE OF status, expires_at, delegated_from_id ON governance_grant
        FOR EACH ROW WHEN (NEW.delegated_from_id IS NOT NULL AND NEW.status = 'active')
        EXECUTE FUNCTION governance_grant_within_parent()""",
]
DOWN = [
    "DROP TRIGGER IF EXISTS governance_grant_within_parent ON governance_grant",
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


def _run(statements):
    def apply(apps, schema_editor):
        if schema_editor.connection.vendor == "postgresql":
            for statement in statements:
                schema_editor.execute(statement, params=None)

    return apply


class Migration(migrations.Migration):
    dependencies = [("governance", "0018_records_never_deleted")]

    operations = [migrations.RunPython(_run(UP), _run(DOWN))]
