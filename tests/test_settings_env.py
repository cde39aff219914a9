"""Settings read from the environment: integers in ASCII digits within a maximum,
REDIS_URL a Redis URL or unset, and production refusing what would quietly weaken it.

Each case starts Django in a fresh interpreter, as a deployment would: the settings
module runs once per process, so that is where a bad value has to stop it."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from governance import settings as app_settings

ROOT = Path(__file__).resolve().parent.parent
GOOD_SECRET = secrets.token_urlsafe(64)
GOOD_AUDIT_KEY = secrets.token_urlsafe(32)


def start(module: str, **env: str | None) -> subprocess.CompletedProcess[str]:
    """`django.setup()` with these variables (None: unset) in a fresh interpreter."""
    environ = {**os.environ, "DJANGO_SETTINGS_MODULE": module}
    for name in ("REDIS_URL", "SECRET_KEY", "AUDIT_HMAC_KEY", "DATABASE_URL"):
        environ.pop(name, None)
    environ.update({name: value for name, value in env.items() if value is not None})
    return subprocess.run(  # noqa: S603 - our own interpreter
        [sys.executable, "-c", "import django; django.setup()"],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
    )


def assert_refused(proc: subprocess.CompletedProcess[str], *words: str) -> None:
    assert proc.returncode != 0, proc.stderr
    assert "ImproperlyConfigured" in proc.stderr
    for word in words:
        assert word in proc.stderr, proc.stderr


# --- Integers -----------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["1_000", "٣", "１２", "0x10", "1e3", "12 34", "+", ""])
def test_an_integer_is_ascii_digits_only(monkeypatch, value):
    # int() alone takes "1_000" (1000), "٣" (Arabic-Indic 3) and "１２" (fullwidth 12).
    monkeypatch.setenv("SOME_NUMBER", value)
    with pytest.raises(ImproperlyConfigured, match="SOME_NUMBER"):
        app_settings.env_int("SOME_NUMBER", 5, minimum=1)


@pytest.mark.parametrize(("value", "number"), [("12", 12), (" +7 ", 7), ("-0", 0)])
def test_a_plain_integer_still_parses(monkeypatch, value, number):
    monkeypatch.setenv("SOME_NUMBER", value)
    assert app_settings.env_int("SOME_NUMBER", 5) == number


@pytest.mark.parametrize(
    ("name", "value"),
    [
        # Past timedelta's range: before, an OverflowError that named no setting.
        ("GRANT_MAX_TTL_HOURS", "100000000000"),
        ("GRANT_MAX_TTL_HOURS", str(365 * 24 + 1)),  # no grant longer than a year
        ("GRANT_REQUEST_TTL_HOURS", str(30 * 24 + 1)),
        ("AGENT_TOKEN_MAX_DAYS", "366"),
        # DESIGN: break-glass "ratified by a review within 24 h".
        ("BREAKGLASS_REVIEW_HOURS", "25"),
        ("BREAKGLASS_MAX_TTL_MINUTES", "100000000000000"),
        ("REVIEW_DUE_DAYS", "1000000000"),
        ("GRANT_EXPIRING_NOTICE_MINUTES", "100000000000000"),
        ("AUDIT_CHECKPOINT_MAX_AGE_MINUTES", "100000000000000"),
        # A mail server may hold a delivery no longer than a webhook may.
        ("EMAIL_TIMEOUT", "61"),
        ("EMAIL_TIMEOUT", "0"),
        # Read by the settings: before, only the worker and beat died of it, while the
        # web process served on with nothing expiring or checkpointing the chain.
        ("GOVERNANCE_EXPIRY_INTERVAL_SECONDS", "3601"),
        ("GOVERNANCE_EXPIRY_INTERVAL_SECONDS", "0"),
        # A connection age is checked on SQLite too, where it is not used (yet).
        ("DATABASE_CONN_MAX_AGE", "86401"),
    ],
)
def test_a_duration_past_its_maximum_stops_start_up(name, value):
    assert_refused(start("governance.settings", **{name: value}), name, "outside")


def test_the_largest_allowed_durations_start():
    proc = start(
        "governance.settings",
        GRANT_MAX_TTL_HOURS=str(365 * 24),
        BREAKGLASS_REVIEW_HOURS="24",
        BREAKGLASS_MAX_TTL_MINUTES=str(24 * 60),
    )
    assert proc.returncode == 0, proc.stderr


def test_a_break_glass_default_longer_than_any_grant_stops_start_up():
    """README: "GRANT_MAX_TTL_HOURS: no grant lives longer", break-glass's grant too. A
    default lifetime past it would refuse every break-glass opened without one; the
    maximum may stay above it (a request past the grant maximum is refused)."""
    assert_refused(
        start("governance.settings", GRANT_MAX_TTL_HOURS="1", BREAKGLASS_DEFAULT_TTL_MINUTES="61"),
        "BREAKGLASS_DEFAULT_TTL_MINUTES=61",
        "GRANT_MAX_TTL_HOURS=1",
    )
    # The defaults (60 and 240 minutes) start with 1-hour grants, as they always did.
    ok = start("governance.settings", GRANT_MAX_TTL_HOURS="1")
    assert ok.returncode == 0, ok.stderr


def test_an_unused_threshold_no_grant_lives_to_reach_stops_start_up():
    """UNUSED_GRANT_DAYS=30 against 7-day grants flagged nothing, ever. The threshold is
    in hours now and must be below the longest grant; the old name is refused, not
    silently ignored."""
    assert_refused(start("governance.settings", UNUSED_GRANT_HOURS="168"), "UNUSED_GRANT_HOURS=168")
    assert_refused(
        start("governance.settings", GRANT_MAX_TTL_HOURS="24", UNUSED_GRANT_HOURS="24"),
        "no grant would live long enough",
    )
    assert_refused(start("governance.settings", UNUSED_GRANT_DAYS="3"), "UNUSED_GRANT_HOURS")
    ok = start("governance.settings", GRANT_MAX_TTL_HOURS="2", UNUSED_GRANT_HOURS=None)
    assert ok.returncode == 0, ok.stderr  # the default follows a short maximum (1 hour)
    # The shortest maximum (1 hour) starts as it always did: the scan is off (0).
    for unused in (None, "0"):
        ok = start("governance.settings", GRANT_MAX_TTL_HOURS="1", UNUSED_GRANT_HOURS=unused)
        assert ok.returncode == 0, ok.stderr


# --- REDIS_URL ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("", "REDIS_URL is set but empty"),  # before: silently "no Redis"
        ("   ", "REDIS_URL is set but empty"),
        ("notaurl", "redis:// or rediss://"),
        ("http://127.0.0.1:6379/0", "redis:// or rediss://"),
        ("unix:///run/redis.sock", "redis:// or rediss://"),  # Celery has no unix transport
    ],
)
def test_a_bad_redis_url_stops_start_up(value, words):
    assert_refused(start("governance.settings", REDIS_URL=value), words)


def test_a_bad_redis_url_is_not_echoed(monkeypatch):
    monkeypatch.setenv("REDIS_URL", "memcache://:s3cret@cache:11211")
    with pytest.raises(ImproperlyConfigured) as caught:
        app_settings.env_redis_url("REDIS_URL")
    assert "s3cret" not in str(caught.value)


@pytest.mark.parametrize("value", ["redis://127.0.0.1:6379/0", "rediss://:pw@redis.internal/1"])
def test_a_redis_url_is_taken(monkeypatch, value):
    monkeypatch.setenv("REDIS_URL", f" {value} ")
    assert app_settings.env_redis_url("REDIS_URL") == value
    monkeypatch.delenv("REDIS_URL")
    assert app_settings.env_redis_url("REDIS_URL") is None


# --- The audit key and production ---------------------------------------------------------


def test_the_audit_key_must_differ_from_the_secret_key_even_by_a_trailing_space():
    proc = start("governance.settings", SECRET_KEY=GOOD_SECRET, AUDIT_HMAC_KEY=GOOD_SECRET + " ")
    assert_refused(proc, "AUDIT_HMAC_KEY must differ from SECRET_KEY")


PRODUCTION = {
    "SECRET_KEY": GOOD_SECRET,
    "AUDIT_HMAC_KEY": GOOD_AUDIT_KEY,
    "REDIS_URL": "redis://127.0.0.1:6379/0",
}


def test_production_settings_start_with_a_key_a_redis_url_and_a_secret():
    proc = start("governance.settings_production", **PRODUCTION)
    assert proc.returncode == 0, proc.stderr


def test_production_refuses_an_hsts_age_past_two_years():
    proc = start(
        "governance.settings_production", **{**PRODUCTION, "SECURE_HSTS_SECONDS": "9" * 20}
    )
    assert_refused(proc, "SECURE_HSTS_SECONDS", "outside")


def test_only_this_machines_names_are_allowed_hosts_by_default():
    """`testserver` was in the default list, so a production run that set no
    ALLOWED_HOSTS answered `Host: testserver` (Django's test setup adds its own)."""
    proc = subprocess.run(  # noqa: S603 - our own interpreter
        [sys.executable, "-c", "from governance import settings; print(settings.ALLOWED_HOSTS)"],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k != "ALLOWED_HOSTS"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.stdout.strip() == "['127.0.0.1', 'localhost']", proc.stderr


@pytest.mark.parametrize("key", ["a", "x" * 31, " " * 20 + "y" * 31])
def test_production_refuses_a_short_audit_key(key):
    proc = start("governance.settings_production", **{**PRODUCTION, "AUDIT_HMAC_KEY": key})
    assert_refused(proc, "AUDIT_HMAC_KEY must be set to a random value of 32+ characters")


DEV_SECRET = "dev-only-insecure-secret-key-change-me"
DEV_AUDIT_KEY = "dev-only-insecure-audit-key-change-me"


@pytest.mark.parametrize(
    ("name", "key"),
    [
        # The published development keys behind padding or a prefix: the check was a
        # plain startswith() on the raw value, and the length counted the spaces.
        ("AUDIT_HMAC_KEY", " " + DEV_AUDIT_KEY),
        ("AUDIT_HMAC_KEY", "x" + DEV_AUDIT_KEY),
        ("SECRET_KEY", " " + DEV_SECRET + " " * 12),
        ("SECRET_KEY", "prod-" + DEV_SECRET.upper() + "-0123456789"),
        ("SECRET_KEY", "s3cret" + " " * 44),  # 6 characters padded to 50
        ("AUDIT_HMAC_KEY", GOOD_AUDIT_KEY + "\n"),  # a file's newline is not key material
        # Long enough, but no random value: too few distinct characters.
        ("AUDIT_HMAC_KEY", "a" * 32),
        ("AUDIT_HMAC_KEY", "0" * 64),
        ("AUDIT_HMAC_KEY", "abab" * 10),
        ("SECRET_KEY", "xyz" * 20),
    ],
)
def test_production_refuses_a_key_that_is_not_a_random_value(name, key):
    proc = start("governance.settings_production", **{**PRODUCTION, name: key})
    assert_refused(proc, f"{name} must be set to a random value")


def test_production_takes_a_random_hex_key():
    """A 32-character hex key has 16 symbols to draw from: it must pass."""
    key = secrets.token_hex(16)
    proc = start("governance.settings_production", **{**PRODUCTION, "AUDIT_HMAC_KEY": key})
    assert proc.returncode == 0, proc.stderr


def test_a_mistyped_email_backend_stops_start_up():
    """It started, and every notification e-mail then failed in the worker."""
    proc = start(
        "governance.settings", EMAIL_BACKEND="django.core.mail.backends.smtp.EmailBackendd"
    )
    assert_refused(proc, "EMAIL_BACKEND=", "cannot be imported")


def test_a_connection_age_past_a_day_stops_start_up():
    """A 400-digit DATABASE_CONN_MAX_AGE was taken, then overflowed at the first query."""
    proc = start(
        "governance.settings",
        DATABASE_URL="postgresql://postgres@127.0.0.1:5432/unused",  # read, never opened
        DATABASE_CONN_MAX_AGE="1" + "0" * 400,
    )
    assert_refused(proc, "DATABASE_CONN_MAX_AGE", "outside")


@pytest.mark.parametrize("value", ["10.0.0.0/33", "10.0.0.1/8", "proxy.internal", "10.0.0.1,"])
def test_a_trusted_proxy_that_is_not_an_address_or_network_stops_start_up(value):
    proc = start("governance.settings", TRUSTED_PROXIES=value)
    assert_refused(proc, "TRUSTED_PROXIES")


def test_an_ipv6_sign_in_prefix_outside_32_to_128_stops_start_up():
    """The network an IPv6 sign-in is counted by: a typo must not count every IPv6
    client as one (/0) or each address alone (the limit a /64 walks around)."""
    for value in ("16", "129", "64.0", "/64", "", "６４"):
        assert_refused(start("governance.settings", LOGIN_IPV6_PREFIX=value), "LOGIN_IPV6_PREFIX")
    assert start("governance.settings", LOGIN_IPV6_PREFIX="56").returncode == 0


def test_an_unknown_log_level_stops_start_up_naming_the_setting():
    """LOG_LEVEL=VERBOSE stopped start-up with logging's ValueError, naming no setting."""
    assert_refused(start("governance.settings", LOG_LEVEL="VERBOSE"), "LOG_LEVEL")
    assert start("governance.settings", LOG_LEVEL="warning").returncode == 0


@pytest.mark.parametrize("value", ["", "  "])
def test_a_blank_trusted_proxies_is_none(monkeypatch, value):
    """docker-compose.yml passes `${TRUSTED_PROXIES:-}`: blank, so production refused to
    start ("has an empty item") unless one was named."""
    monkeypatch.setenv("TRUSTED_PROXIES", value)
    assert app_settings.env_networks("TRUSTED_PROXIES") == ()


@pytest.mark.parametrize(
    "url", ["postgresql://u:p@db:0/gov", "postgresql://u:p@db:/gov", "postgresql://u@db:99999/g"]
)
def test_a_database_url_with_a_bad_port_is_refused(url):
    """Port 0 became 5432 (`parts.port or 5432`), and `db:` became the host `db:`."""
    with pytest.raises(ImproperlyConfigured, match="port"):
        app_settings.database_from_url(url)


@pytest.mark.parametrize("value", ["0_1", "٠.٥", "1e-1", "nan", ".5.", ""])
def test_a_fraction_is_an_ascii_decimal(monkeypatch, value):
    """float() took "0_1" as 1.0 (every approval sampled) and Arabic-Indic digits."""
    monkeypatch.setenv("SECOND_LOOK_FRACTION", value)
    with pytest.raises(ImproperlyConfigured, match="SECOND_LOOK_FRACTION"):
        app_settings.env_fraction("SECOND_LOOK_FRACTION", 0.1)


@pytest.mark.parametrize(
    ("value", "number"), [("0.25", 0.25), (" 1 ", 1.0), ("0", 0.0), (".5", 0.5)]
)
def test_a_plain_fraction_still_parses(monkeypatch, value, number):
    monkeypatch.setenv("SECOND_LOOK_FRACTION", value)
    assert app_settings.env_fraction("SECOND_LOOK_FRACTION", 0.1) == number


def test_trivial_passwords_are_refused() -> None:
    from django.contrib.auth.models import User
    from django.contrib.auth.password_validation import validate_password
    from django.core.exceptions import ValidationError

    carol = User(username="carol.approver", email="carol@example.com")
    for weak in ("password", "12345678", "qwertyui", "90817263", "carol.approver1"):
        with pytest.raises(ValidationError):
            validate_password(weak, carol)
    validate_password("correct horse battery staple", carol)


def test_production_requires_redis():
    proc = start("governance.settings_production", **{**PRODUCTION, "REDIS_URL": None})
    assert_refused(proc, "REDIS_URL must be set in production")
