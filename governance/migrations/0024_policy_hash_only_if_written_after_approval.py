"""An approve policy written before its tool's last approved definition stops answering.

0022 filled each existing policy's `definition_hash` with its tool's definition approved
*then* (at the upgrade), "the best the rows say". But the log says more: a policy
written before the tool's definition last changed and was approved (`tool.approved`)
was written against an older definition, and 0022 made it answer for the new one,
auto-approving destructive calls the new definition describes (928a7da's rule, undone
for old rows). Such policies are emptied here ('' matches no definition): they no
longer answer and a person is asked, which is what the current code does for a policy
written before a re-approval. Failing closed, this also empties a policy whose tool
was changed and approved back to the same definition; its author can write it again.

Not an audit event: a migration runs outside the application (as 0022 did); the
change is a policy falling silent, never one starting to answer.
"""

from django.db import migrations

EMPTY_STALE = """
UPDATE governance_confirmationpolicy SET definition_hash = ''
WHERE definition_hash <> '' AND created_at < (
    SELECT MAX(e.created_at) FROM governance_auditevent e
    JOIN governance_tool t ON t.name = e.tool
    WHERE t.id = governance_confirmationpolicy.tool_id AND e.event_type = 'tool.approved'
)
"""


def empty_stale(apps, schema_editor):
    schema_editor.execute(EMPTY_STALE)


class Migration(migrations.Migration):
    dependencies = [("governance", "0023_audit_no_replace_sqlite")]

    operations = [migrations.RunPython(empty_stale, migrations.RunPython.noop)]
