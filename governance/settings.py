"""One settings module, read from the environment with strict helpers.

A value that is present but does not parse is an error at start-up
(ImproperlyConfigured), never a silent fallback to the default: a typo in
GRANT_MAX_TTL_HOURS must not quietly hand out week-long grants.
"""

from __future__ import annotations

import ipaddress
import os
import re
from datetime import timedelta
from pathlib import Path
from urllib.parse import SplitResult, parse_qs, unquote, urlsplit

from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent


def env_str(name: str, default: str) -> str:
    value = os.environ.get(name)
    if value is None:
        return default
    if not value.strip():
        raise ImproperlyConfigured(f"{name} is set but empty")
    return value


def env_bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    lowered = value.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ImproperlyConfigured(f"{name}={value!r} is not a boolean (use true/false)")


def env_int(name: str, default: int, *, minimum: int = 0, maximum: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    # ASCII digits only: int() would also take "1_000" and "٣" (Arabic-Indic 3).
    if not re.fullmatch(r"[+-]?[0-9]+", value.strip()):
        raise ImproperlyConfigured(f"{name}={value!r} is not an integer")
    number = int(value.strip(), 10)
    if number < minimum or (maximum is not None and number > maximum):
        raise ImproperlyConfigured(f"{name}={number} is outside [{minimum}, {maximum}]")
    return number


def env_list(name: str, default: list[str]) -> list[str]:
    value = os.environ.get(name)
    if value is None:
        return default
    items = [item.strip() for item in value.split(",")]
    if any(not item for item in items):
        raise ImproperlyConfigured(f"{name}={value!r} has an empty item")
    return items


def _database_host(parts: SplitResult) -> str:
    """The server: a host name or address, or a Unix socket directory, spelled as
    libpq spells it: percent-encoded in the host part (postgresql://u@%2Frun%2Fpg/db)
    or as ?host=/run/pg. A socket skips the TCP stack on both ends of every query."""
    raw = parts.netloc.rpartition("@")[2]
    if raw.startswith("["):  # IPv6 literal: [::1]:5432
        host = parts.hostname or ""
    else:
        host = unquote(raw.rpartition(":")[0] if parts.port is not None else raw)
    query = parse_qs(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    unknown = sorted(set(query) - {"host"})
    if unknown:
        raise ImproperlyConfigured(
            f"DATABASE_URL has unsupported parameter(s) {', '.join(unknown)} (only host)"
        )
    if "host" in query:
        if host or len(query["host"]) != 1 or not query["host"][0].startswith("/"):
            raise ImproperlyConfigured(
                "DATABASE_URL ?host= must be one absolute socket directory, with no host part"
            )
        host = query["host"][0]
    return host


def database_from_url(url: str) -> dict[str, object]:
    """Parse postgresql://user:pass@host:port/name (host may be a Unix socket
    directory, see _database_host) into a Django DATABASES entry."""
    parts = urlsplit(url)
    if parts.scheme not in {"postgres", "postgresql"}:
        raise ImproperlyConfigured(
            f"DATABASE_URL scheme {parts.scheme!r} is not supported (use postgresql://)"
        )
    name = unquote(parts.path.lstrip("/"))
    if not name:
        raise ImproperlyConfigured("DATABASE_URL has no database name")
    try:
        port = parts.port
    except ValueError:
        raise ImproperlyConfigured("DATABASE_URL has an invalid port") from None
    if port is None:
        # `db:` (a colon, no digits) is not the host `db:`: a port left out by mistake.
        if parts.netloc.rpartition("@")[2].endswith(":"):
            raise ImproperlyConfigured("DATABASE_URL has an empty port")
        port = 5432
    elif not 1 <= port <= 65535:
        raise ImproperlyConfigured(f"DATABASE_URL has an invalid port {port}")
    try:
        host = _database_host(parts)
    except ValueError as exc:
        raise ImproperlyConfigured(f"DATABASE_URL has a malformed query: {exc}") from None
    return {
        # Django's backend, with a health check that costs no round trip (see there).
        "ENGINE": "governance.pgbackend",
        "NAME": name,
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": host,
        "PORT": str(port),
        # Persistent connections: a decision should not pay a TCP + auth handshake.
        "CONN_MAX_AGE": CONN_MAX_AGE,
        # No lock is waited on for ever: a session holding the audit chain's lock (or a
        # row every change needs) made every decision and change wait without end,
        # then die with the web worker. Past this, the wait fails: a decision is a
        # deny (503), a change is refused and undone whole.
        "OPTIONS": {"options": f"-c lock_timeout={LOCK_TIMEOUT_SECONDS}s"},
        "CONN_HEALTH_CHECKS": True,
        "TEST": {"NAME": env_str("DATABASE_TEST_NAME", f"test_{name}")},
    }


DEBUG = env_bool("DEBUG", False)
SECRET_KEY = env_str("SECRET_KEY", "dev-only-insecure-secret-key-change-me")
# Separate from SECRET_KEY on purpose: rotating the session key must not
# invalidate the audit chain, and leaking one must not forge the other.
AUDIT_HMAC_KEY = env_str("AUDIT_HMAC_KEY", "dev-only-insecure-audit-key-change-me")
# Compared stripped: the same key with a stray space or newline is still the same key.
if AUDIT_HMAC_KEY.strip() == SECRET_KEY.strip():
    raise ImproperlyConfigured("AUDIT_HMAC_KEY must differ from SECRET_KEY")
# Decisions' events that a process's threads submit while an append is in flight are
# appended together (one chain lock, one COMMIT): governance.audit.GroupCommit.
AUDIT_GROUP_COMMIT = env_bool("AUDIT_GROUP_COMMIT", True)
AUDIT_CHECKPOINT_DIR = Path(env_str("AUDIT_CHECKPOINT_DIR", str(BASE_DIR / "var" / "checkpoints")))
# Deleting the newest events is caught only back to the newest checkpoint: verify fails
# when events exist with no checkpoint, or the newest is older than this (the job that
# writes one a minute has stopped). 0 turns the check off.
AUDIT_CHECKPOINT_MAX_AGE = timedelta(
    minutes=env_int("AUDIT_CHECKPOINT_MAX_AGE_MINUTES", 15, minimum=0, maximum=7 * 24 * 60)
)
# The job writes a checkpoint a minute (525,600 a year); each night, after a full verify
# passed, those older than this many days are compacted to the last of each day, the
# series' first and both sides of every gap, joined by signed bridges
# (audit.compact_checkpoints says what that gives up). 0 keeps every one for ever.
AUDIT_CHECKPOINT_KEEP_DAYS = env_int("AUDIT_CHECKPOINT_KEEP_DAYS", 2, minimum=0, maximum=3660)

# Django's test setup adds its own "testserver"; nothing else should answer to that name.
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["127.0.0.1", "localhost"])

# --- Governance policy knobs -------------------------------------------------
# Every duration below has a maximum: no permanent grants by a huge number, and no
# OverflowError from timedelta at start-up instead of a message naming the setting.
YEAR_HOURS = 365 * 24
# There are no permanent grants: every grant's window is capped by this (a year at most).
GRANT_MAX_TTL = timedelta(
    hours=env_int("GRANT_MAX_TTL_HOURS", 24 * 7, minimum=1, maximum=YEAR_HOURS)
)
# A request nobody decides within this long is closed (denied, undecided), so
# a stale request cannot be approved weeks later by someone missing the context.
GRANT_REQUEST_TTL = timedelta(
    hours=env_int("GRANT_REQUEST_TTL_HOURS", 72, minimum=1, maximum=30 * 24)
)
# Approvals for destructive actions are meant to be used right away.
APPROVAL_TTL = timedelta(minutes=env_int("APPROVAL_TTL_MINUTES", 15, minimum=1, maximum=24 * 60))
# How many of one agent's destructive calls may await a person at once. Each new request
# notifies every approver: past this, a new call is denied (`approval_backlog`) instead of
# burying one harmful request among many. Not a rate limit, so it holds when Redis is down.
APPROVAL_PENDING_MAX = env_int("APPROVAL_PENDING_MAX", 20, minimum=1, maximum=10_000)
# How many of one agent's own grant requests may await a person at once. Each notifies
# every approver and sits in their inbox for GRANT_REQUEST_TTL: past this a new one is
# refused (409 `request_backlog`), so one token cannot bury the inbox (at 30 a minute,
# 72 h of requests was 129,600). Requests people file for an agent are not counted.
GRANT_REQUEST_PENDING_MAX = env_int("GRANT_REQUEST_PENDING_MAX", 20, minimum=1, maximum=10_000)
DELEGATION_MAX_DEPTH = env_int("DELEGATION_MAX_DEPTH", 3, minimum=0, maximum=10)
# Read here, not in governance.celery, so a bad value stops the web process and every
# management command too, not only the worker and beat that schedule from it.
GOVERNANCE_EXPIRY_INTERVAL = timedelta(
    seconds=env_int("GOVERNANCE_EXPIRY_INTERVAL_SECONDS", 60, minimum=1, maximum=3600)
)
AGENT_TOKEN_MAX_DAYS = env_int("AGENT_TOKEN_MAX_DAYS", 90, minimum=1, maximum=365)
# Live tokens one holder (an agent, or a person's own API tokens) may have at once: rate
# limits are per token, and each token is a credential to guard; rotating one means
# issuing the next, then revoking the old (409 too_many_tokens past it).
AGENT_TOKEN_MAX_LIVE = env_int("AGENT_TOKEN_MAX_LIVE", 5, minimum=1, maximum=100)


def env_backends(name: str) -> list[str]:
    """Sandbox backend names from sandbox_runner's registry; at least one, no repeats."""
    from sandbox_runner.backends import REGISTRY

    names = env_list(name, list(REGISTRY))
    unknown = [n for n in names if n not in REGISTRY]
    if unknown or len(set(names)) != len(names):
        raise ImproperlyConfigured(
            f"{name}={','.join(names)!r}: list each of {', '.join(REGISTRY)} at most once"
        )
    return names


# The sandbox backends a run may use. SANDBOX_BACKENDS=gvisor puts every run under
# gVisor's user-space kernel: a run that asks for another backend is denied
# (backend_not_allowed) before anything starts, never moved to another backend.
SANDBOX_BACKENDS = env_backends("SANDBOX_BACKENDS")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "governance",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "governance.web.middleware.LengthRequiredMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "governance.urls"
WSGI_APPLICATION = "governance.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# PostgreSQL's persistent connections (seconds); read, and checked, on SQLite too.
CONN_MAX_AGE = env_int("DATABASE_CONN_MAX_AGE", 60, maximum=86_400)
# PostgreSQL: the longest any statement waits for a lock (0: no limit).
LOCK_TIMEOUT_SECONDS = env_int("DATABASE_LOCK_TIMEOUT_SECONDS", 10, maximum=300)
_database_url = os.environ.get("DATABASE_URL")
if _database_url is not None:
    DATABASES = {"default": database_from_url(_database_url)}
else:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": env_str("SQLITE_PATH", str(BASE_DIR / "db.sqlite3")),
            "OPTIONS": {
                # Take the write lock at BEGIN so two writers queue instead of
                # one failing half-way with "database is locked".
                "transaction_mode": "IMMEDIATE",
                "timeout": 20,
            },
        }
    }

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# People approve what agents may do: no password on the common-password list, all
# digits, or close to the account's own name or address.
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
# Where `manage.py collectstatic` puts them (production serves them from here).
STATIC_ROOT = Path(env_str("STATIC_ROOT", str(BASE_DIR / "var" / "static")))
LOGIN_URL = "/admin/login/"

# --- REST API -------------------------------------------------------------------
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["governance.api.auth.BearerAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["governance.api.serializers.JSONParser"],
    "DEFAULT_CONTENT_NEGOTIATION_CLASS": "governance.api.serializers.Negotiation",
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "governance.api.errors.exception_handler",
    "UNAUTHENTICATED_USER": None,
    # Throttling is ours (governance.ratelimit): atomic, and fail-closed.
    "DEFAULT_THROTTLE_CLASSES": [],
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Agent governance API",
    "DESCRIPTION": (
        "Agents authorize every tool call here with a per-agent bearer token. "
        "Default deny: a well-formed question always gets a 200 with a decision; "
        "errors are {error: {code, message, fields}}."
    ),
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    # The schema and the docs are public: a caller's credentials are not read there,
    # so a runner whose token just expired still gets the schema (not a 401 in YAML
    # or HTML that no error parser reads).
    "SERVE_AUTHENTICATION": [],
    "COMPONENT_SPLIT_REQUEST": True,
    "SCHEMA_PATH_PREFIX": "/api/v1",
    # Swagger UI served from this app, not a CDN: the docs work offline and
    # no third-party script runs next to an admin's session.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "ENUM_NAME_OVERRIDES": {
        "ActionEnum": "governance.codes.ActionClass",
        "DecisionEnum": "governance.codes.Decision",
        "ReasonEnum": "governance.codes.Reason",
    },
}


def env_redis_url(name: str) -> str | None:
    """A redis:// or rediss:// URL, or None when unset. Set but empty is an error, not
    "no Redis": that would quietly count rate limits per process. unix:// is refused
    too: redis-py reads it, but Celery's broker (kombu) has no such transport."""
    value = os.environ.get(name)
    if value is None:
        return None
    value = env_str(name, "").strip()
    try:
        scheme = urlsplit(value).scheme
    except ValueError:  # e.g. an unclosed [ in an IPv6 host
        scheme = ""
    if scheme not in {"redis", "rediss"}:
        # The value may hold a password: name the problem, never echo it.
        raise ImproperlyConfigured(f"{name} must be a redis:// or rediss:// URL")
    return value


# Unset: rate limits are counted in this process's memory, and the Celery broker is a
# folder (embedded mode; production settings require it).
REDIS_URL = env_redis_url("REDIS_URL")
# Requests per minute per token, by bucket.
RATE_LIMITS = {
    "authorize": env_int("RATE_LIMIT_AUTHORIZE_PER_MINUTE", 6000, minimum=1),
    "grant_request": env_int("RATE_LIMIT_GRANT_REQUESTS_PER_MINUTE", 30, minimum=1),
    "approval": env_int("RATE_LIMIT_APPROVALS_PER_MINUTE", 60, minimum=1),
    # A sandbox's egress attempts, reported by its runner (the token's other budget).
    "sandbox_egress": env_int("RATE_LIMIT_SANDBOX_EGRESS_PER_MINUTE", 6000, minimum=1),
}

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_LEVEL = env_str("LOG_LEVEL", "INFO").strip().upper()
if LOG_LEVEL not in LOG_LEVELS:  # logging's own error names no setting (a ValueError)
    raise ImproperlyConfigured(f"LOG_LEVEL={LOG_LEVEL!r} is not one of {', '.join(LOG_LEVELS)}")

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {"no_4xx_tracebacks": {"()": "governance.logs.NoClientErrorTracebacks"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "filters": ["no_4xx_tracebacks"]}},
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
}

# --- Web UI (governance/web) ---------------------------------------------------------------
LOGIN_URL = "/ui/login/"
LOGIN_REDIRECT_URL = "/ui/"
MIDDLEWARE += ["governance.web.middleware.CurrentRequestMiddleware"]
# Outermost: every answer carries the policy, also one a middleware gives before any view
# (411 for a chunked body, 400 for a Host not allowed, a redirect to HTTPS).
MIDDLEWARE.insert(0, "governance.web.middleware.ContentSecurityPolicyMiddleware")
TEMPLATES[0]["OPTIONS"]["context_processors"].append("governance.web.context.ui")  # type: ignore[index]
X_FRAME_OPTIONS = "DENY"
# Sessions are rows in the database (Django's default, named): a person's deactivation
# deletes theirs in its own transaction (services.people), so reactivating the account
# does not bring an old session back.
SESSION_ENGINE = "django.contrib.sessions.backends.db"
SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SAMESITE = "Lax"
CSRF_COOKIE_SAMESITE = "Lax"
# A UI session ends after this long (and at once, for good, when the user is deactivated).
SESSION_COOKIE_AGE = env_int("UI_SESSION_HOURS", 12, minimum=1, maximum=24 * 30) * 3600
# Sign-in attempts per minute: per account (whatever address) and per address.
RATE_LIMITS["login_account"] = env_int("RATE_LIMIT_LOGIN_ACCOUNT_PER_MINUTE", 5, minimum=1)
RATE_LIMITS["login_address"] = env_int("RATE_LIMIT_LOGIN_ADDRESS_PER_MINUTE", 20, minimum=1)
# An IPv6 client holds a whole network, not one address (a home line or a VM gets a /64
# at least): counted per address, it could try a new one each time and never be limited.
# Its sign-ins are counted per network of this prefix length; IPv4 per address.
LOGIN_IPV6_PREFIX = env_int("LOGIN_IPV6_PREFIX", 64, minimum=32, maximum=128)


def env_networks(name: str) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    """Comma-separated addresses or CIDR blocks (`10.0.0.0/8, ::1`). Set but blank is
    none, as unset is (docker-compose.yml passes `${TRUSTED_PROXIES:-}` through)."""
    if not os.environ.get(name, "").strip():
        return ()
    networks = []
    for item in env_list(name, []):
        try:
            networks.append(ipaddress.ip_network(item, strict=True))
        except ValueError:
            raise ImproperlyConfigured(f"{name}: {item!r} is not an address or network") from None
    return tuple(networks)


# The reverse proxies in front of the web service. A request from one of them is
# counted against the address its X-Forwarded-For names (the rightmost one that is
# not itself a trusted proxy); without this, behind a proxy every sign-in would come
# from the proxy's address and share one per-address limit. Empty: the peer counts.
TRUSTED_PROXIES = env_networks("TRUSTED_PROXIES")

# --- Lifecycle: notifications, break-glass, reviews (issue #5) -----------------------------


def env_webhook_urls(name: str) -> list[str]:
    """Comma-separated http(s) URLs with a host; anything else is a start-up error
    (a typo must not silently drop every alert). No user:password@ and only a numeric
    port: delivery would fail on every attempt, and urllib's error text (stored on the row,
    logged) quotes the credentials or the "port" (https://host:password/ is a common slip)."""
    urls = env_list(name, [])
    for position, url in enumerate(urls, start=1):
        # The value itself may be a secret (Slack webhook URLs are): name the position only.
        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018 - parsing it is the check
        except ValueError:
            raise ImproperlyConfigured(
                f"{name}: item {position} has an invalid host or port"
            ) from None
        if parts.scheme not in {"http", "https"} or not parts.hostname:
            raise ImproperlyConfigured(f"{name}: item {position} is not an http(s) URL")
        if "@" in parts.netloc:
            raise ImproperlyConfigured(
                f"{name}: item {position} has credentials (user:password@); put the secret "
                "in the path or query, as webhook services do"
            )
    return urls


def env_choice(name: str, default: str, choices: set[str]) -> str:
    value = env_str(name, default).strip()
    if value not in choices:
        raise ImproperlyConfigured(f"{name}={value!r} is not one of {sorted(choices)}")
    return value


def env_regex(name: str, default: str) -> str:
    import re

    value = env_str(name, default)
    try:
        re.compile(value)
    except re.error as exc:
        raise ImproperlyConfigured(f"{name} is not a valid regular expression: {exc}") from None
    return value


_DECIMAL = re.compile(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+", re.ASCII)


def env_fraction(name: str, default: float) -> float:
    value = os.environ.get(name)
    if value is None:
        return default
    # ASCII decimals only, as env_int: float() also takes "0_1" (1.0), other scripts'
    # digits, exponents and "nan".
    if not _DECIMAL.fullmatch(value.strip()):
        raise ImproperlyConfigured(f"{name}={value!r} is not a decimal number like 0.25")
    number = float(value.strip())
    if not 0.0 <= number <= 1.0:
        raise ImproperlyConfigured(f"{name}={number} is outside [0, 1]")
    return number


# Every notification goes out by e-mail (Django's EMAIL_BACKEND) to the people concerned
# and as JSON to each of these webhooks. "slack" posts {"text": ...} (Slack, Mattermost,
# Teams-compatible incoming webhooks); "json" posts the whole event.
EMAIL_BACKEND = env_str("EMAIL_BACKEND", "django.core.mail.backends.console.EmailBackend")
DEFAULT_FROM_EMAIL = env_str("DEFAULT_FROM_EMAIL", "governance@localhost")
NOTIFY_WEBHOOK_URLS = env_webhook_urls("NOTIFY_WEBHOOK_URLS")
NOTIFY_WEBHOOK_FORMAT = env_choice("NOTIFY_WEBHOOK_FORMAT", "json", {"json", "slack"})
# The whole delivery of one webhook (connect, send, answer), not each socket read; at
# most a minute, well inside the ten minutes after which the sweep takes a claimed row back.
NOTIFY_WEBHOOK_TIMEOUT_SECONDS = env_int("NOTIFY_WEBHOOK_TIMEOUT_SECONDS", 5, minimum=1, maximum=60)
# Django's SMTP backend waits for ever without it (a server that never greets holds the
# worker). Per socket operation (smtplib has no total deadline): the task's time limit
# (governance/tasks.py) bounds the whole attempt.
EMAIL_TIMEOUT = env_int("EMAIL_TIMEOUT", NOTIFY_WEBHOOK_TIMEOUT_SECONDS, minimum=1, maximum=60)
# Delivery attempts before a notification is given up as failed (backoff doubles each time).
NOTIFY_MAX_ATTEMPTS = env_int("NOTIFY_MAX_ATTEMPTS", 6, minimum=1, maximum=20)
NOTIFY_RETRY_BASE_SECONDS = env_int("NOTIFY_RETRY_BASE_SECONDS", 30, minimum=1, maximum=3600)
# Grants expiring within this window are announced once to requester and agent owner.
GRANT_EXPIRING_NOTICE = timedelta(
    minutes=env_int("GRANT_EXPIRING_NOTICE_MINUTES", 24 * 60, minimum=1, maximum=30 * 24 * 60)
)

# Break-glass: a ticket reference in this format is required (full match).
BREAKGLASS_TICKET_PATTERN = env_regex("BREAKGLASS_TICKET_PATTERN", r"[A-Z][A-Z0-9]+-[0-9]+")
# Both at most a day: break-glass must end by its review deadline (at most 24 h, below).
BREAKGLASS_DEFAULT_TTL = timedelta(
    minutes=env_int("BREAKGLASS_DEFAULT_TTL_MINUTES", 60, minimum=1, maximum=24 * 60)
)
# Longer requests are refused, never clamped: the opener must know what they got.
BREAKGLASS_MAX_TTL = timedelta(
    minutes=env_int("BREAKGLASS_MAX_TTL_MINUTES", 4 * 60, minimum=1, maximum=24 * 60)
)
if BREAKGLASS_DEFAULT_TTL > BREAKGLASS_MAX_TTL:
    raise ImproperlyConfigured("BREAKGLASS_DEFAULT_TTL_MINUTES exceeds BREAKGLASS_MAX_TTL_MINUTES")
# No grant lives longer than GRANT_MAX_TTL, break-glass's neither: the service refuses a
# lifetime past it, so a default past it would refuse every break-glass opened without
# one. The maximum may stay above it (the service holds requests to the shorter one).
if BREAKGLASS_DEFAULT_TTL > GRANT_MAX_TTL:
    raise ImproperlyConfigured(
        f"BREAKGLASS_DEFAULT_TTL_MINUTES={int(BREAKGLASS_DEFAULT_TTL.total_seconds() // 60)} "
        f"exceeds GRANT_MAX_TTL_HOURS={int(GRANT_MAX_TTL.total_seconds() // 3600)}: no grant "
        "lives longer than GRANT_MAX_TTL, a break-glass grant neither; lower the default"
    )
BREAKGLASS_MAX_PER_HOUR = env_int("BREAKGLASS_MAX_PER_HOUR", 3, minimum=1)
# DESIGN: break-glass is "ratified by a review within 24 h": sooner may be asked, later not.
BREAKGLASS_REVIEW_WITHIN = timedelta(
    hours=env_int("BREAKGLASS_REVIEW_HOURS", 24, minimum=1, maximum=24)
)
if BREAKGLASS_MAX_TTL > BREAKGLASS_REVIEW_WITHIN:
    # Unreviewed break-glass must have ended by the time its review is overdue
    # (DESIGN: "ratified by a review within 24 h, or it is flagged and expires").
    raise ImproperlyConfigured(
        "BREAKGLASS_MAX_TTL_MINUTES exceeds BREAKGLASS_REVIEW_HOURS: break-glass would "
        "outlive its review deadline"
    )
# Opening break-glass also opens an incident review campaign for that agent's grants.
BREAKGLASS_OPENS_CAMPAIGN = env_bool("BREAKGLASS_OPENS_CAMPAIGN", True)

# Re-certification campaigns.
REVIEW_DUE = timedelta(days=env_int("REVIEW_DUE_DAYS", 14, minimum=1, maximum=90))
# What happens to an item nobody decided by its due date.
REVIEW_DEFAULT_RULE = env_choice("REVIEW_DEFAULT_RULE", "revoke", {"revoke", "keep"})
REVIEW_REMIND_BEFORE = timedelta(
    hours=env_int("REVIEW_REMIND_BEFORE_HOURS", 72, minimum=1, maximum=90 * 24)
)
# A grant unused this long is proposed for removal (write/destructive: narrowing to read).
# Hours, and shorter than GRANT_MAX_TTL: a threshold no grant lives to reach flags
# nothing (the old UNUSED_GRANT_DAYS=30 against 7-day grants did exactly that).
if "UNUSED_GRANT_DAYS" in os.environ:
    raise ImproperlyConfigured("UNUSED_GRANT_DAYS is now UNUSED_GRANT_HOURS (hours)")
_TTL_HOURS = int(GRANT_MAX_TTL.total_seconds() // 3600)
# 0 turns the scan off (the default when grants live at most an hour: none could idle).
UNUSED_GRANT_HOURS = env_int(
    "UNUSED_GRANT_HOURS", min(72, _TTL_HOURS // 2), minimum=0, maximum=YEAR_HOURS
)
if UNUSED_GRANT_HOURS >= _TTL_HOURS:
    raise ImproperlyConfigured(
        f"UNUSED_GRANT_HOURS={UNUSED_GRANT_HOURS} is not below GRANT_MAX_TTL_HOURS="
        f"{_TTL_HOURS}: no grant would live long enough to be found unused"
    )
# Share of yesterday's approved grant requests and destructive actions sampled for a
# second look by another approver.
SECOND_LOOK_FRACTION = env_fraction("SECOND_LOOK_FRACTION", 0.1)
# Scheduled campaigns open once per period of this many months (3: quarterly).
REVIEW_EVERY_MONTHS = env_int("REVIEW_EVERY_MONTHS", 3, minimum=1, maximum=12)
if 12 % REVIEW_EVERY_MONTHS:
    raise ImproperlyConfigured("REVIEW_EVERY_MONTHS must divide 12 (1, 2, 3, 4, 6 or 12)")
