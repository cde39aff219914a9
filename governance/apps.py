from django.apps import AppConfig
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string


class GovernanceConfig(AppConfig):
    name = "governance"
    verbose_name = "Agent governance"

    def ready(self) -> None:
        from governance.services import people

        # A mistyped backend would start, then fail every e-mail in the worker: stop here.
        try:
            import_string(settings.EMAIL_BACKEND)
        except ImportError as exc:
            raise ImproperlyConfigured(
                f"EMAIL_BACKEND={settings.EMAIL_BACKEND!r} cannot be imported: {exc}"
            ) from None
        people.connect()  # account and role changes are audit events
