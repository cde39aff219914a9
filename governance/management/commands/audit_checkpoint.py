from django.core.management.base import BaseCommand
from django.utils import timezone

from governance import audit


class Command(BaseCommand):
    help = "Sign the audit chain's head to AUDIT_CHECKPOINT_DIR (outside the database)."

    def handle(self, *args: object, **options: object) -> None:
        body = audit.write_checkpoint(timezone.now())
        self.stdout.write(f"checkpoint {body['file']}: seq {body['seq']}, head {body['head']}")
