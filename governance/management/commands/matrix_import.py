"""Apply a grant-matrix YAML file: grants become pending requests (or, with
--apply-approved, live grants approved by a second admin, who also authors the
file's confirmation policies). All or nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from governance.audit import Actor
from governance.errors import GovernanceError
from governance.management import arguments
from governance.services.matrix import ImportResult, MatrixInvalid, matrix_import
from governance.text import printable


class Command(BaseCommand):
    help = (
        "Import a grant matrix file (the shape matrix_export writes). Grants become pending "
        "requests by the --as user; with --apply-approved --approver USER (both admins, "
        "different people) they become live grants, and the file's confirmation policies "
        "are written with the approver as their author (without it they are skipped). "
        "Unchanged grants and policies are not duplicated. "
        "A file with any error is rejected as a whole, with every error and its line."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("file", type=arguments.path, metavar="FILE")
        parser.add_argument(
            "--dry-run", action="store_true", help="report what would change; write nothing"
        )
        parser.add_argument(
            "--as",
            dest="as_user",
            type=arguments.text,
            metavar="USERNAME",
            help="the importing user (requester)",
        )
        parser.add_argument(
            "--apply-approved",
            action="store_true",
            help="create live grants instead of requests (admins only; needs --approver)",
        )
        parser.add_argument(
            "--approver", type=arguments.text, metavar="USERNAME", help="the admin who approved"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        path = Path(options["file"])
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CommandError(f"{printable(str(path))}: cannot read: {exc}") from None
        requested_by = _user(options["as_user"], "--as")
        approver = _user(options["approver"], "--approver")
        try:
            result = matrix_import(
                text=text,
                # A file name that is not UTF-8 (surrogates) is named by its escapes: it
                # goes into the audit event and the report, which must encode.
                source=printable(str(path)),
                actor=Actor.user(requested_by) if requested_by else None,
                at=timezone.now(),
                requested_by=requested_by,
                approver=approver,
                apply_approved=options["apply_approved"],
                dry_run=options["dry_run"],
            )
        except MatrixInvalid as exc:
            raise CommandError(exc.render()) from None
        except GovernanceError as exc:
            raise CommandError(f"{exc.code}: {exc.message}") from None
        self._report(result)

    def _report(self, result: ImportResult) -> None:
        target = "live grants" if result.mode == "approved" else "pending requests"
        for change in result.changes:
            note = f"  ({change.note})" if change.note else ""
            if change.kind == "grant" and change.outcome == "create":
                made = f"#{change.grant_id} " if change.grant_id else ""
                note = f"  ({made}{target[:-1]})"
            elif change.kind == "policy" and change.outcome == "create":
                made = f"#{change.policy_id} " if change.policy_id else ""
                note = f"  ({made}live policy)"
            self.stdout.write(
                f"{result.source}:{change.line}: {change.outcome:<9} {change.kind:<5} "
                f"{change.label}{note}"
            )
        for warning in result.warnings:
            self.stderr.write(f"warning: {warning.render(result.source)}")
        summary = (
            f"{result.count('create')} to create, {result.count('unchanged')} unchanged, "
            f"{result.count('skipped')} skipped; grants as {target}."
        )
        if result.dry_run:
            self.stdout.write(f"{summary} Dry run: nothing was written.")
        else:
            self.stdout.write(summary.replace("to create", "created"))


def _user(username: str | None, flag: str) -> Any:
    if username is None:
        return None
    user = get_user_model().objects.filter(username=username).first()
    if user is None:
        raise CommandError(f"{flag}: no user is named {username!r}")
    return user
