"""A token's created_at is the `at` its issue was made at (token_issue passes it),
not a wall-clock stamp taken apart from it: a report about a moment counts a stake
from a token only if the token existed then (policy.stake_check). No data changes."""

import django.utils.timezone
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("governance", "0026_audit_action_whole"),
    ]

    operations = [
        migrations.AlterField(
            model_name="agenttoken",
            name="created_at",
            field=models.DateTimeField(default=django.utils.timezone.now),
        ),
    ]
