from datetime import timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from governance import audit, roles
from governance.errors import GovernanceError
from governance.management import arguments
from governance.models import Agent
from governance.services.reviews import RESERVED_KEYS, review_campaign_open

# As in the web UI's form; past a few thousand years the due date itself overflows.
MAX_DUE_DAYS = 365


class Command(BaseCommand):
    help = (
        "Open a re-certification campaign now: one item per live grant (optionally one "
        "agent's), each assigned to an approver who neither requested nor approved it."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--reason", type=arguments.text, required=True)
        parser.add_argument(
            "--kind", choices=["on_demand", "incident", "scheduled"], default="on_demand"
        )
        parser.add_argument(
            "--agent", type=arguments.text, default=None, help="only this agent's grants"
        )
        parser.add_argument("--due-days", type=int, default=None, help=f"1-{MAX_DUE_DAYS}")
        parser.add_argument(
            "--user", type=arguments.text, default=None, help="who opens it (username)"
        )
        parser.add_argument(
            "--key",
            type=arguments.line,
            default=None,
            help="opening again with a key is a no-op (1-100 characters)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        # Who opens it: an active admin, as in the web UI (not an auditor, not a
        # deactivated account).
        user = None
        if options["user"]:
            user = arguments.person(options["user"], roles.is_admin, "admin", "--user")
        agent = None
        if options["agent"]:
            agent = Agent.objects.filter(name=options["agent"]).first()
            if agent is None:
                raise CommandError(f"No agent {options['agent']!r}.")
        at = timezone.now()
        due_days, key = options["due_days"], options["key"]
        if due_days is not None and not 1 <= due_days <= MAX_DUE_DAYS:
            raise CommandError(f"--due-days must be 1 to {MAX_DUE_DAYS}, not {due_days}.")
        if key is not None and not 1 <= len(key) <= 100:
            raise CommandError("--key must be 1 to 100 characters.")
        if key is not None and key.startswith(RESERVED_KEYS):
            # The scheduled job's and break-glass's own keys, whatever --kind says: a
            # campaign opened by hand under one blocks the period's (or the incident's).
            raise CommandError(
                f"--key: keys starting {' or '.join(RESERVED_KEYS)} are the system's."
            )
        try:
            campaign = review_campaign_open(
                kind=options["kind"],
                reason=options["reason"],
                key=key,
                agent=agent,
                opened_by=user,
                due_at=at + timedelta(days=due_days) if due_days else None,
                actor=audit.Actor.user(user) if user else audit.Actor.system("command:review_open"),
                at=at,
            )
        except GovernanceError as exc:
            raise CommandError(f"{exc.code}: {exc.message}") from None
        self.stdout.write(
            f"campaign #{campaign.pk} ({campaign.kind}) open with {campaign.items.count()} "
            f"item(s), due {campaign.due_at.isoformat()}"
        )
