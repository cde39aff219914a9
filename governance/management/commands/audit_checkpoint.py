from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from governance import audit


class Command(BaseCommand):
    help = "Sign the audit chain's head to AUDIT_CHECKPOINT_DIR (outside the database)."

    def handle(self, *args: object, **options: object) -> None:
        try:
            body = audit.write_checkpoint(timezone.now())
        except audit.ChainBroken as exc:
            # Exit 1: signing over a damaged log would bless the damage.
            seq, problem = exc.problem
            raise CommandError(
                f"refused: not signed over a damaged log: seq {seq}: {problem}"
            ) from None
        self.stdout.write(f"checkpoint {body['file']}: seq {body['seq']}, head {body['head']}")
