from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from governance.audit import Actor
from governance.errors import GovernanceError
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
        create.add_argument("agent")
        create.add_argument("--expires", type=int, default=30, metavar="DAYS")
        create.add_argument("--by", default=None, help="admin username recorded as creator")
        revoke = sub.add_parser("revoke", help="revoke the token with PREFIX")
        revoke.add_argument("prefix")

    def handle(self, *args: Any, **options: Any) -> None:
        now = timezone.now()
        actor = Actor.system("manage.py agent_token")
        if options["verb"] == "revoke":
            token = AgentToken.objects.filter(prefix=options["prefix"]).first()
            if token is None:
                raise CommandError(f"No token has the prefix {options['prefix']!r}.")
            agents.token_revoke(token=token, actor=actor, at=now)
            self.stdout.write(f"revoked {token.prefix}")
            return
        agent = Agent.objects.filter(name=options["agent"]).first()
        if agent is None:
            raise CommandError(f"No agent is named {options['agent']!r}.")
        users = get_user_model().objects
        creator = (
            users.filter(username=options["by"]).first()
            if options["by"]
            else users.filter(is_superuser=True).order_by("id").first()
        )
        if creator is None:
            raise CommandError("No admin to record as the token's creator (use --by USER).")
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
