from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DatabaseError
from django.utils import timezone

from governance import audit, roles
from governance.management import arguments


class Command(BaseCommand):
    help = (
        "Sign the audit chain's head to AUDIT_CHECKPOINT_DIR (outside the database). "
        "--start-new-series --reason TEXT --as ADMIN: after restoring the database from a "
        "backup, move the old series aside (kept, named in an audit event) and start anew."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--start-new-series", action="store_true")
        parser.add_argument("--reason", type=arguments.text, default=None)
        parser.add_argument(
            "--as", dest="as_user", type=arguments.text, default=None, metavar="USERNAME"
        )

    def handle(self, *args: object, **options: Any) -> None:
        now = timezone.now()
        if not options["start_new_series"] and (options["reason"] or options["as_user"]):
            # Silently writing a plain checkpoint would let the admin believe the series
            # was restarted (and by whom, and why).
            raise CommandError("--reason and --as go with --start-new-series only")
        try:
            if options["start_new_series"]:
                body = audit.restart_checkpoints(
                    reason=options["reason"] or "",
                    actor=audit.Actor.user(self._admin(options)),
                    at=now,
                )
            else:
                body = audit.write_checkpoint(now)
        except audit.ChainBroken as exc:
            # Exit 1: signing over a damaged log would bless the damage.
            seq, problem = exc.problem
            raise CommandError(
                f"refused: not signed over a damaged log: seq {seq}: {problem} (after a "
                "restore from backup: --start-new-series --reason TEXT --as ADMIN)"
            ) from None
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        except OSError as exc:  # AUDIT_CHECKPOINT_DIR cannot be made or written
            raise CommandError(f"the checkpoint cannot be written: {exc}") from None
        except DatabaseError as exc:  # read-only (a restored server still recovering)
            raise CommandError(
                f"the database refused the change; nothing was moved or signed: {exc}"
            ) from None
        self.stdout.write(f"checkpoint {body['file']}: seq {body['seq']}, head {body['head']}")

    def _admin(self, options: dict[str, Any]) -> Any:
        name = options["as_user"]
        if not name:
            raise CommandError("--start-new-series needs --as ADMIN (who restarts the series)")
        return arguments.person(name, roles.is_admin, "admin")
