from django.apps import AppConfig


class GovernanceConfig(AppConfig):
    name = "governance"
    verbose_name = "Agent governance"

    def ready(self) -> None:
        from governance.services import people

        people.connect()  # account and role changes are audit events
