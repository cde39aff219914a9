"""The production shape: docker-compose.yml and the Dockerfile run what the README calls
production, and production serves its own static files.

The images cannot be pulled or built here (no registry): the compose file and the
Dockerfile are read, and what they run is run in a fresh interpreter the same way."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
APP_SERVICES = ("web", "worker", "beat")


def test_every_app_service_runs_the_production_settings():
    """The compose file never named a settings module: web, worker and beat ran the
    development settings (no Secure cookies, no HSTS, the development keys accepted)."""
    for name in APP_SERVICES:
        env = COMPOSE["services"][name]["environment"]
        assert env["DJANGO_SETTINGS_MODULE"] == "governance.settings_production", name


def test_the_app_waits_for_healthy_services_and_comes_back():
    """`migrate && gunicorn` with a plain depends_on: a database still starting made the
    migrate fail and the web service exit for good."""
    services = COMPOSE["services"]
    for store in ("db", "redis"):
        assert services[store]["healthcheck"]["test"], store
        assert services[store]["restart"] == "unless-stopped"
    for name in APP_SERVICES:
        waits = services[name]["depends_on"]
        assert waits == {
            "db": {"condition": "service_healthy"}, "redis": {"condition": "service_healthy"}
        }, name  # fmt: skip
        assert services[name]["restart"] == "unless-stopped", name


def test_the_image_collects_static_files_and_gives_the_checkpoint_folder_to_its_user():
    """No collectstatic (so no stylesheet and no offline API docs under gunicorn), and a
    /checkpoints that a new named volume made root's: the app user (1000) could never
    write a checkpoint, so audit_verify failed for good."""
    lines = [line.strip() for line in (ROOT / "Dockerfile").read_text().splitlines()]
    user = lines.index("USER 1000:1000")
    collect = next(i for i, line in enumerate(lines) if "collectstatic --noinput" in line)
    owned = lines.index("RUN mkdir /checkpoints && chown 1000:1000 /checkpoints")
    assert collect < user and owned < user
    for name in ("web", "worker"):
        assert "checkpoints:/checkpoints" in COMPOSE["services"][name]["volumes"]


def test_production_serves_the_collected_static_files(tmp_path: Path):
    """DEBUG off and gunicorn in front: nothing served /static/, so the UI had no
    stylesheet and the API docs (which work offline from the bundled Swagger UI) no
    script. Collected as the image does, they are served with a cache header."""
    script = """
import django
from django.core.management import call_command
from django.test import Client
django.setup()
call_command("collectstatic", "--noinput", verbosity=0)
import json
client = Client()
for path in ("/static/ui/ui.css", "/static/admin/css/base.css",
             "/static/drf_spectacular_sidecar/swagger-ui-dist/swagger-ui-bundle.js",
             "/static/ui/nothing-here.css"):
    response = client.get(path, secure=True)
    print(json.dumps([path, response.status_code, dict(response.headers)]))
"""
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "governance.settings_production",
        "SECRET_KEY": secrets.token_urlsafe(64),
        "AUDIT_HMAC_KEY": secrets.token_urlsafe(32),
        "REDIS_URL": "redis://127.0.0.1:6379/14",
        "STATIC_ROOT": str(tmp_path / "static"),
        "ALLOWED_HOSTS": "testserver",
        "AUDIT_CHECKPOINT_DIR": str(tmp_path / "checkpoints"),
    }
    env.pop("DATABASE_URL", None)
    proc = subprocess.run(  # noqa: S603 - our own interpreter
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    served = {path: (status, headers) for path, status, headers in map(json.loads, lines(proc))}
    for path in list(served)[:3]:
        status, headers = served[path]
        assert status == 200, (path, served[path])
        assert "public" in headers["Cache-Control"], path  # WhiteNoise's, not Django's 404
        assert headers["Strict-Transport-Security"].startswith("max-age=31536000"), path
    assert served["/static/ui/nothing-here.css"][0] == 404
    assert (tmp_path / "static" / "ui" / "ui.css").exists()


def lines(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return proc.stdout.splitlines()
