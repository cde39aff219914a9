from datetime import timedelta
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from governance import audit
from governance.errors import GovernanceError
from governance.management import arguments
from governance.models import Agent, Task, Tool
from governance.services.breakglass import breakglass_open

# As the API's bound; the service holds the lifetime to BREAKGLASS_MAX_TTL_MINUTES (and
# GRANT_MAX_TTL_HOURS). Far past it, the lifetime could not even be computed
# (OverflowError, a traceback).
MAX_TTL_MINUTES = 7 * 24 * 60


class Command(BaseCommand):
    help = (
        "Open break-glass for an agent on behalf of a named person (an approver, an admin "
        "or the agent's owner): a live grant at once, flagged break-glass, with a "
        "post-incident review due within 24 h. A ticket reference is required."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--user", type=arguments.text, required=True, help="who opens it (username)"
        )
        parser.add_argument("--agent", type=arguments.text, required=True)
        parser.add_argument("--tool", type=arguments.text, required=True)
        parser.add_argument(
            "--actions",
            type=arguments.text,
            required=True,
            help="comma-separated, e.g. read,update",
        )
        parser.add_argument("--scope", type=arguments.text, required=True)
        parser.add_argument("--ticket", type=arguments.text, required=True)
        parser.add_argument("--reason", type=arguments.text, required=True)
        parser.add_argument(
            "--ttl-minutes", type=int, default=None, help="BREAKGLASS_DEFAULT/MAX_TTL_MINUTES"
        )
        parser.add_argument(
            "--task", type=arguments.text, default=None, help="task key to bind the grant to"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        def one(model: Any, label: str, **lookup: Any) -> Any:
            found = model.objects.filter(**lookup).first()
            if found is None:
                raise CommandError(f"No {label} {next(iter(lookup.values()))!r}.")
            return found

        user = one(get_user_model(), "active user", username=options["user"], is_active=True)
        ttl = options["ttl_minutes"]
        if ttl is not None and not 1 <= ttl <= MAX_TTL_MINUTES:
            raise CommandError(f"--ttl-minutes must be 1 to {MAX_TTL_MINUTES}, not {ttl}.")
        try:
            bg = breakglass_open(
                opener=user,
                agent=one(Agent, "agent", name=options["agent"]),
                tool=one(Tool, "tool", name=options["tool"]),
                actions=[a.strip() for a in options["actions"].split(",") if a.strip()],
                scope=options["scope"],
                ticket=options["ticket"],
                reason=options["reason"],
                ttl=timedelta(minutes=ttl) if ttl is not None else None,
                task=one(Task, "task", key=options["task"]) if options["task"] else None,
                actor=audit.Actor.user(user),
                at=timezone.now(),
            )
        except GovernanceError as exc:
            raise CommandError(f"{exc.code}: {exc.message}") from None
        self.stdout.write(
            f"break-glass #{bg.pk} open: grant #{bg.grant_id} until {bg.expires_at.isoformat()}, "
            f"review due by {bg.review_due_at.isoformat()}"
        )
