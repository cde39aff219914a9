import sys

from django.core.management.base import BaseCommand
from django.utils import timezone

from governance import audit


class Command(BaseCommand):
    help = (
        "Verify the audit chain and the latest checkpoint. Exit 0 and print "
        "'ok: N events, head H' (and a warning for each window the checkpoint series did "
        "not cover), or exit 1 naming the first bad sequence number."
    )

    def handle(self, *args: object, **options: object) -> None:
        verdict = audit.verify_and_record(
            actor=audit.Actor.system("manage.py audit_verify"), at=timezone.now()
        )
        if verdict.ok:
            self.stdout.write(verdict.render())
            for gap in verdict.gaps:  # not tampering, but a window nothing protected
                self.stderr.write(f"warning: {gap}")
            return
        self.stderr.write(verdict.render())
        sys.exit(1)
