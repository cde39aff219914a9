"""Write the live grant matrix as YAML (to stdout, or a file with -o)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from governance.services.matrix import matrix_export


class Command(BaseCommand):
    help = (
        "Export the live grant matrix (agents, tools, tasks, live grants) as YAML, "
        "in a stable order. Re-import it with matrix_import."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")

    def handle(self, *args: Any, **options: Any) -> None:
        text = matrix_export(at=timezone.now())
        if options["output"]:
            try:
                Path(options["output"]).write_text(text, encoding="utf-8")
            except (OSError, UnicodeEncodeError) as exc:
                raise CommandError(f"cannot write {options['output']!r}: {exc}") from None
            self.stderr.write(f"wrote {options['output']}")
        else:
            self.stdout.write(text, ending="")
