"""Production settings: the base module plus what HTTPS deployments need.

Use with DJANGO_SETTINGS_MODULE=governance.settings_production. The secrets
must come from the environment: the development defaults are refused here,
and `manage.py check --deploy` reports no warnings with this module
(tests/test_ui_security.py runs it).
"""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured

from governance.settings import *  # noqa: F403
from governance.settings import AUDIT_HMAC_KEY, SECRET_KEY, env_bool, env_int

if SECRET_KEY.startswith("dev-only") or len(SECRET_KEY) < 50:
    raise ImproperlyConfigured("SECRET_KEY must be set to a random value of 50+ characters")
if AUDIT_HMAC_KEY.startswith("dev-only"):
    raise ImproperlyConfigured("AUDIT_HMAC_KEY must be set in production")

DEBUG = False
# Behind a TLS-terminating proxy that sets X-Forwarded-Proto.
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", True)
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 31_536_000)
SECURE_HSTS_INCLUDE_SUBDOMAINS = True
SECURE_HSTS_PRELOAD = True
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
SESSION_COOKIE_SECURE = True
CSRF_COOKIE_SECURE = True
SESSION_COOKIE_HTTPONLY = True
X_FRAME_OPTIONS = "DENY"
