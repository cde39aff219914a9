from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db.models import Q
from django.utils import timezone

from governance import roles
from governance.audit import Actor
from governance.errors import GovernanceError
from governance.management import arguments, revoked_line
from governance.models import Agent, AgentToken
from governance.services import agents


class Command(BaseCommand):
    help = (
        "Create a bearer token for an agent (printed once, stored only as a digest), "
        "or revoke one by its prefix."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="verb", required=True)
        create = sub.add_parser("create", help="create a token for AGENT")
        create.add_argument("agent", type=arguments.text)
        create.add_argument("--expires", type=int, default=30, metavar="DAYS")
        create.add_argument(
            "--by",
            type=arguments.text,
            default=None,
            help="active admin recorded as creator (default: the first)",
        )
        revoke = sub.add_parser("revoke", help="revoke the token with PREFIX")
        revoke.add_argument("prefix", type=arguments.text)

    def handle(self, *args: Any, **options: Any) -> None:
        now = timezone.now()
        actor = Actor.system("manage.py agent_token")
        if options["verb"] == "revoke":
            # People's tokens have their own command (api_token); this one only touches
            # agents'.
            token = AgentToken.objects.filter(prefix=options["prefix"], agent__isnull=False).first()
            if token is None:
                raise CommandError(f"No token has the prefix {options['prefix']!r}.")
            token = agents.token_revoke(token=token, actor=actor, at=now)
            self.stdout.write(revoked_line(token, now))
            return
        agent = Agent.objects.filter(name=options["agent"]).first()
        if agent is None:
            raise CommandError(f"No agent is named {options['agent']!r}.")
        # The creator is on record (and has a stake in the agent from now on): an active
        # admin, as the API and the UI require of whoever issues a token.
        admins = (
            get_user_model()
            .objects.filter(is_active=True)
            .filter(Q(is_superuser=True) | Q(groups__name=roles.ADMINS))
            .distinct()
            .order_by("id")
        )
        creator = (admins.filter(username=options["by"]) if options["by"] else admins).first()
        if creator is None:
            raise CommandError(
                f"{options['by']!r} is not an active admin: only an admin issues tokens."
                if options["by"]
                else "No active admin to record as the token's creator (use --by ADMIN)."
            )
        try:
            token, plaintext = agents.token_issue(
                created_by=creator, agent=agent, actor=actor, at=now, days=options["expires"]
            )
        except GovernanceError as exc:
            raise CommandError(exc.message) from None
        self.stderr.write(
            f"Token for {agent.name} (prefix {token.prefix}, expires {token.expires_at:%Y-%m-%d}). "
            "It is shown once and stored only as a digest:"
        )
        self.stdout.write(plaintext)
