from django.core.management.base import BaseCommand
from django.utils import timezone

from governance import audit
from governance.services.approvals import approvals_expire
from governance.services.grants import grant_requests_expire, grants_expire
from governance.services.hygiene import tokens_expire


class Command(BaseCommand):
    help = (
        "Mark grants and approvals past their end as expired and close grant requests "
        "left undecided too long, now, one audit event each (what the scheduled job "
        "does every minute). Safe to run at any time."
    )

    def handle(self, *args: object, **options: object) -> None:
        actor = audit.Actor.system("command:expire_now")
        at = timezone.now()
        grants = grants_expire(actor=actor, at=at)
        approvals = approvals_expire(actor=actor, at=at)
        requests = grant_requests_expire(actor=actor, at=at)
        tokens = tokens_expire(actor=actor, at=at)
        self.stdout.write(
            f"expired {grants} grant(s), {approvals} approval(s), {requests} request(s), "
            f"{tokens} token(s)"
        )
