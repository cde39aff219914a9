"""Usage per action class, and the grant's dead review column.

1. GrantActionUse: when each grant was last used for each action (read, create, update,
   delete, execute are separate grants), folded from `access.allowed` events as the
   grant's use_count / last_used_at are. Filled here from the events already folded
   (through the usage watermark); the next fold adds the rest. Without it, every grant
   used before this migration would look never used for any action.
2. Grant.unused_flagged_actions: the actions the last `grant.unused_flagged` found idle.
   A grant flagged before this was flagged as a whole: all its actions.
3. ReviewItem.idle_actions and the proposal `narrow_to_used`.
4. Grant.review_due_at is dropped: nothing ever set it (a grant's review date is its
   pending review items' due date, which the matrix export now reads).
"""

import django.db.models.deletion
from django.db import migrations, models
from django.db.models import Count, F, Max

BATCH = 1000


def fill(apps, schema_editor):
    AuditEvent = apps.get_model("governance", "AuditEvent")
    Grant = apps.get_model("governance", "Grant")
    GrantActionUse = apps.get_model("governance", "GrantActionUse")
    UsageFold = apps.get_model("governance", "UsageFold")
    Grant.objects.filter(unused_flagged_at__isnull=False).update(
        unused_flagged_actions=F("actions")
    )
    mark = UsageFold.objects.filter(pk=1).values_list("seq", flat=True).first() or 0
    if not mark:
        return
    uses = (
        AuditEvent.objects.filter(
            seq__lte=mark,
            event_type="access.allowed",
            grant_id__in=Grant.objects.values("pk"),
        )
        .values("grant_id", "action")
        .annotate(n=Count("seq"), last=Max("created_at"))
        .order_by("grant_id", "action")
    )
    batch = []
    for use in uses.iterator():
        batch.append(
            GrantActionUse(
                grant_id=use["grant_id"],
                action=use["action"],
                use_count=use["n"],
                last_used_at=use["last"],
            )
        )
        if len(batch) >= BATCH:
            GrantActionUse.objects.bulk_create(batch)
            batch = []
    GrantActionUse.objects.bulk_create(batch)


class Migration(migrations.Migration):
    dependencies = [
        ("governance", "0027_token_created_at_is_its_issue"),
    ]

    operations = [
        migrations.RemoveField(
            model_name="grant",
            name="review_due_at",
        ),
        migrations.AddField(
            model_name="grant",
            name="unused_flagged_actions",
            field=models.JSONField(blank=True, default=list),
        ),
        migrations.AddField(
            model_name="reviewitem",
            name="idle_actions",
            field=models.JSONField(blank=True, default=list),
        ),
        migrations.AlterField(
            model_name="reviewitem",
            name="proposal",
            field=models.CharField(
                blank=True,
                choices=[
                    ("", "None"),
                    ("remove", "Remove"),
                    ("narrow_to_read", "Narrow To Read"),
                    ("narrow_to_used", "Narrow To Used"),
                ],
                default="",
                max_length=20,
            ),
        ),
        migrations.CreateModel(
            name="GrantActionUse",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("action", models.CharField(max_length=64)),
                ("use_count", models.PositiveBigIntegerField(default=0)),
                ("last_used_at", models.DateTimeField()),
                ("grant", models.ForeignKey(on_delete=django.db.models.deletion.PROTECT, related_name="action_uses", to="governance.grant")),
            ],
            options={
                "indexes": [models.Index(fields=["last_used_at"], name="grant_action_use_last")],
                "constraints": [models.UniqueConstraint(fields=("grant", "action"), name="grant_action_use_once")],
            },
        ),
        migrations.RunPython(fill, migrations.RunPython.noop),
    ]
