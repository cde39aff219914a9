from django.core.management.base import BaseCommand
from django.utils import timezone

from governance import audit
from governance.services.hygiene import expire_due


class Command(BaseCommand):
    help = (
        "Close tasks past their end, mark grants and approvals past their end as expired "
        "and close grant requests left undecided too long, now, one audit event each "
        "(what the scheduled job does every minute). Safe to run at any time."
    )

    def handle(self, *args: object, **options: object) -> None:
        done = expire_due(actor=audit.Actor.system("command:expire_now"), at=timezone.now())
        self.stdout.write(
            f"closed {done['tasks']} ended task(s); expired {done['grants']} grant(s), "
            f"{done['approvals']} approval(s), {done['requests']} request(s), "
            f"{done['tokens']} token(s)"
        )
