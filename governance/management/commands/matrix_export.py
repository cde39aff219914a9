"""Write the live grant matrix as YAML (to stdout, or a file with -o).

Handing out the matrix is an export of access data like any other: it writes a
`report.exported` event (who, format, how many grants) with the file, in one
transaction (services.matrix.matrix_export_recorded).
"""

from __future__ import annotations

import getpass
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from governance import audit, roles
from governance.errors import GovernanceError
from governance.management import arguments
from governance.services.matrix import matrix_export_recorded


class Command(BaseCommand):
    help = (
        "Export the live grant matrix (agents, tools, tasks, live grants) as YAML, "
        "in a stable order. Re-import it with matrix_import. Recorded as a "
        "report.exported event naming --as (an auditor or admin), else system:cli."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "-o",
            "--output",
            type=arguments.path,
            metavar="FILE",
            help="write here instead of stdout",
        )
        parser.add_argument(
            "--as",
            dest="as_user",
            type=arguments.text,
            metavar="USERNAME",
            help="the person taking the export (an active auditor or admin)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        actor = self._actor(options["as_user"])
        output = options["output"]

        def deliver(text: str) -> None:
            if not output:
                self.stdout.write(text, ending="")
                return
            try:
                Path(output).write_text(text, encoding="utf-8")
            except (OSError, UnicodeEncodeError) as exc:
                raise CommandError(f"cannot write {output!r}: {exc}") from None

        try:
            matrix_export_recorded(
                at=timezone.now(),
                actor=actor,
                deliver=deliver,
                params={"output": output or "stdout", "os_user": _os_user()},
            )
        except GovernanceError as exc:
            raise CommandError(f"{exc.code}: {exc.message}") from None
        if output:
            self.stderr.write(f"wrote {output}")

    def _actor(self, name: str | None) -> audit.Actor:
        if name is None:
            return audit.Actor.system("cli")
        return audit.Actor.user(arguments.person(name, roles.is_auditor, "auditor or admin"))


def _os_user() -> str | None:
    """Who ran the command, as the operating system knows them (None: it cannot say)."""
    try:
        return getpass.getuser()
    except Exception:  # no login name, no passwd entry: the event says so rather than fail
        return None
