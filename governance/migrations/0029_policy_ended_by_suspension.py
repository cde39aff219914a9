"""A confirmation policy ended by a suspension (services.confirmation.approve_policies_end)
has no person as its revoker: the constraint now asks that every end name a person or
say why."""

from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("governance", "0028_usage_per_action"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.RemoveConstraint(
            model_name="confirmationpolicy",
            name="confirm_policy_revoked_by",
        ),
        migrations.AddConstraint(
            model_name="confirmationpolicy",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    ("revoked_at__isnull", True),
                    ("revoked_by__isnull", False),
                    models.Q(("revoke_reason", ""), _negated=True),
                    _connector="OR",
                ),
                name="confirm_policy_revoked_by",
            ),
        ),
    ]
