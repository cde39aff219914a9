"""Production settings: the base module plus what HTTPS deployments need.

Use with DJANGO_SETTINGS_MODULE=governance.settings_production. The secrets
must come from the environment: the development defaults are refused here,
and `manage.py check --deploy` reports no warnings with this module
(tests/test_ui_security.py runs it).
"""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured

from governance.settings import *  # noqa: F403
from governance.settings import (
    AUDIT_HMAC_KEY,
    MIDDLEWARE,
    REDIS_URL,
    SECRET_KEY,
    env_bool,
    env_int,
)


def _weak(key: str, length: int) -> bool:
    """A development key (in any disguise), padding, too short, or too few distinct
    characters (`a` * 32) to have been drawn at random."""
    bare = key.strip()
    return (
        bare != key
        or "dev-only" in bare.lower()
        or len(bare) < length
        or len(set(bare)) < MIN_DISTINCT_KEY_CHARACTERS
    )


# A random key of 32+ characters from any alphabet (hex included) has far more.
MIN_DISTINCT_KEY_CHARACTERS = 8
if _weak(SECRET_KEY, 50):
    raise ImproperlyConfigured(
        "SECRET_KEY must be set to a random value of 50+ characters (no surrounding spaces)"
    )
# Whoever holds this key can rewrite the audit chain undetected: a guessable one is none.
if _weak(AUDIT_HMAC_KEY, 32):
    raise ImproperlyConfigured(
        "AUDIT_HMAC_KEY must be set to a random value of 32+ characters (no surrounding spaces)"
    )
# Without Redis, each web process counts rate limits on its own (N processes: N times
# the limit) and the Celery broker is a local folder that other machines never see.
if REDIS_URL is None:
    raise ImproperlyConfigured("REDIS_URL must be set in production (redis:// or rediss://)")

DEBUG = False
# Behind a TLS-terminating proxy that sets X-Forwarded-Proto.
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", True)
# At most two years (the preload list asks for at least one).
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 31_536_000, maximum=63_072_000)
SECURE_HSTS_INCLUDE_SUBDOMAINS = True
SECURE_HSTS_PRELOAD = True
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
SESSION_COOKIE_SECURE = True
CSRF_COOKIE_SECURE = True
SESSION_COOKIE_HTTPONLY = True
X_FRAME_OPTIONS = "DENY"

# The UI's, the admin's and the API docs' static files (the docs work offline) are served
# by the app itself, after SecurityMiddleware's redirect and headers: gunicorn serves
# none, and nothing else is in front but a TLS proxy. `manage.py collectstatic` fills
# STATIC_ROOT first (the Dockerfile does it when the image is built).
_SECURITY = MIDDLEWARE.index("django.middleware.security.SecurityMiddleware") + 1
MIDDLEWARE = [
    *MIDDLEWARE[:_SECURITY],
    "whitenoise.middleware.WhiteNoiseMiddleware",
    *MIDDLEWARE[_SECURITY:],
]
