from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from governance.audit import Actor
from governance.errors import GovernanceError
from governance.management import arguments, revoked_line
from governance.models import AgentToken
from governance.services import agents


class Command(BaseCommand):
    help = (
        "Create a person's API token (printed once, stored only as a digest; it carries "
        "that person's roles), or revoke one by its prefix."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="verb", required=True)
        create = sub.add_parser("create", help="create a personal token for USERNAME")
        create.add_argument("username", type=arguments.text)
        create.add_argument("--expires", type=int, default=30, metavar="DAYS")
        revoke = sub.add_parser("revoke", help="revoke the personal token with PREFIX")
        revoke.add_argument("prefix", type=arguments.text)

    def handle(self, *args: Any, **options: Any) -> None:
        now = timezone.now()
        actor = Actor.system("manage.py api_token")
        if options["verb"] == "revoke":
            # Agents' tokens have their own command; this one only touches people's.
            token = AgentToken.objects.filter(prefix=options["prefix"], user__isnull=False).first()
            if token is None:
                raise CommandError(f"No personal token has the prefix {options['prefix']!r}.")
            token = agents.token_revoke(token=token, actor=actor, at=now)
            self.stdout.write(revoked_line(token, now))
            return
        user = get_user_model().objects.filter(username=options["username"]).first()
        if user is None:
            raise CommandError(f"No user is named {options['username']!r}.")
        if not user.is_active:
            raise CommandError(f"{user.get_username()} is not active; a token would not work.")
        try:
            token, plaintext = agents.token_issue(
                created_by=user, user=user, actor=actor, at=now, days=options["expires"]
            )
        except GovernanceError as exc:
            raise CommandError(exc.message) from None
        self.stderr.write(
            f"Token for {user.get_username()} (prefix {token.prefix}, expires "
            f"{token.expires_at:%Y-%m-%d}). It is shown once and stored only as a digest:"
        )
        self.stdout.write(plaintext)
