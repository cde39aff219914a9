"""The one Celery app and the ONE beat schedule.

Broker: Redis at settings.REDIS_URL when it is set (production: docker-compose,
any number of workers). Unset, an embedded broker that needs no service: kombu's
filesystem transport in var/celery, which a separate worker and beat process on
the same machine share through plain files (`make run` starts both).

The schedule only does bookkeeping and checks. Decisions never depend on it:
authorize() refuses an expired grant from its expires_at on whether or not a
job has run (DESIGN.md invariant 2).

Configuration is read when the app is first used (worker or beat start, first
send), not at import: importing this module (governance/tasks.py does, to bind
every task to this app) must not force Django's settings to load.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

from celery import Celery
from celery.schedules import crontab

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "governance.settings")

app = Celery("governance")

# The embedded broker's message folder (relative to the project, like db.sqlite3).
EMBEDDED_BROKER_DIR = Path(__file__).resolve().parent.parent / "var" / "celery"


def expiry_interval() -> timedelta:
    """Seconds between expiry runs: 60, or GOVERNANCE_EXPIRY_INTERVAL_SECONDS (read by
    the settings; the integration test sets 1 so it need not wait a minute)."""
    from django.conf import settings

    return settings.GOVERNANCE_EXPIRY_INTERVAL


def beat_schedule() -> dict[str, dict[str, Any]]:
    return {
        # Expired grants and approvals are already refused at decision time; this marks
        # them `expired` and writes their one audit event each, so the matrix, the
        # dashboard and the reports show what is really live. Every minute keeps that
        # lag short; the services claim each row, so overlapping runs are harmless.
        "expire-due": {
            "task": "governance.tasks.expire_due",
            "schedule": expiry_interval(),
        },
        # A signed checkpoint outside the database every minute, even with no new
        # events: deleting the newest events (or the whole table) is then caught by
        # verify, and a gap in the checkpoint series shows the job itself stopped.
        "audit-checkpoint": {
            "task": "governance.tasks.audit_checkpoint",
            "schedule": timedelta(minutes=1),
            # A backlog (worker down for an hour) is dropped, not run 60 times at once.
            "options": {"expires": 50},
        },
        # Walking the whole chain costs time proportional to the log, so once a night
        # (quiet hours, UTC) is enough to catch tampering; a failure is logged as an
        # error and recorded as an `audit.verify_failed` event. After a pass, checkpoints
        # older than AUDIT_CHECKPOINT_KEEP_DAYS are compacted (one a minute would
        # otherwise pile up for ever, and every verify reads them all).
        "audit-verify-nightly": {
            "task": "governance.tasks.audit_verify",
            "schedule": crontab(hour=3, minute=17),
        },
        # --- Lifecycle (issue #5) ---
        # A notification whose dispatch was lost (broker down at commit) or whose retry
        # message vanished with a worker is re-queued here; without it an alert could
        # sit unsent for ever. Same cadence as expiry: the sweep is one indexed query.
        "notifications-sweep": {
            "task": "governance.tasks.notifications_sweep",
            "schedule": expiry_interval(),
        },
        # A break-glass review left open past its 24 h is shown as overdue from its due
        # time anyway; this sends the overdue alert within five minutes of it.
        "breakglass-overdue": {
            "task": "governance.tasks.breakglass_overdue",
            "schedule": timedelta(minutes=5),
        },
        # Grants ending within GRANT_EXPIRING_NOTICE: a heads-up to requester and owner,
        # so a renewal is asked for in daylight rather than after the agent fails.
        "expiring-notices": {
            "task": "governance.tasks.expiring_notices",
            "schedule": timedelta(minutes=15),
        },
        # Opens the period's re-certification campaign (quarterly by default). Daily,
        # so a beat that was down on the first day of a quarter still opens it the next
        # day; the campaign's key makes every later run that quarter a no-op.
        "review-campaign-scheduled": {
            "task": "governance.tasks.review_campaign_scheduled",
            "schedule": crontab(hour=6, minute=5),
        },
        # Items undecided at their due date get the configured rule (default revoke),
        # items whose grant already ended are closed, finished campaigns are closed.
        # Hourly: a due date is a day, not a second.
        "review-due": {
            "task": "governance.tasks.review_due",
            "schedule": crontab(minute=23),
        },
        # Reminders before the due date, once per item, in working hours (UTC).
        "review-reminders": {
            "task": "governance.tasks.review_reminders",
            "schedule": crontab(hour=8, minute=0),
        },
        # A decision records a grant's use only as its audit event (no UPDATE of the
        # grant row per call); this adds those events to use_count / last_used_at, so
        # the pages and reports lag by at most a minute. Jobs that act on usage (the
        # unused scan, campaigns) fold first themselves.
        "usage-fold": {
            "task": "governance.tasks.usage_fold",
            "schedule": timedelta(minutes=1),
        },
        # Grants unused for UNUSED_GRANT_HOURS are flagged for the dashboard and the next
        # campaign. Usage is counted per decision; a day's granularity is plenty.
        "unused-scan": {
            "task": "governance.tasks.unused_scan",
            "schedule": crontab(hour=2, minute=40),
        },
        # The daily count of live grants (total and per agent) that shows the matrix
        # staying flat or shrinking; just after midnight so each row is one whole day.
        "trend-snapshot": {
            "task": "governance.tasks.trend_snapshot",
            "schedule": crontab(hour=0, minute=10),
        },
        # Samples the previous 24 h of approvals for a second look by another approver;
        # daily, after the day's approvals, before reviewers start their day.
        "second-look-sample": {
            "task": "governance.tasks.second_look_sample",
            "schedule": crontab(hour=5, minute=30),
        },
        # The runner kills its sandbox at the deadline itself; this is the backstop for
        # when the runner is gone (SIGKILL, host reboot) and for the kill switch: a
        # sandbox whose agent was suspended (or whose grant was revoked) dies within
        # one interval instead of running to its deadline. Cheap (one engine listing).
        "sandbox-reap": {
            "task": "governance.tasks.sandbox_reap",
            "schedule": timedelta(seconds=15),
        },
    }


def _config() -> dict[str, Any]:
    from django.conf import settings

    config: dict[str, Any] = {
        "timezone": "UTC",
        "enable_utc": True,
        "beat_schedule": beat_schedule(),
        # Tasks return a small summary for the worker log; nobody waits on results.
        "task_ignore_result": True,
        # A job lost with its worker is run again by the next tick, not redelivered late.
        "task_acks_late": False,
        "worker_hijack_root_logger": False,
        "broker_connection_retry_on_startup": True,
    }
    if settings.REDIS_URL:
        config["broker_url"] = settings.REDIS_URL
        # Bounded waits on the broker: a web request hands its notifications over after
        # its change has committed, and a Redis that accepts connections but never
        # answers (stopped, paused, black-holed) held that request for ever. Longer
        # than the worker's 1 s BRPOP poll, which the socket timeout must not cut.
        config["broker_transport_options"] = {"socket_timeout": 5, "socket_connect_timeout": 2}
        config["broker_connection_timeout"] = 2
    else:
        EMBEDDED_BROKER_DIR.mkdir(parents=True, exist_ok=True)
        folder = str(EMBEDDED_BROKER_DIR)
        config["broker_url"] = "filesystem://"
        config["broker_transport_options"] = {
            # One folder in and out: every process on this machine shares one queue.
            "data_folder_in": folder,
            "data_folder_out": folder,
            "store_processed": False,
            # Broadcast (ping, shutdown) state here too, not in the working directory.
            "control_folder": str(EMBEDDED_BROKER_DIR / "control"),
        }
    return config


# Evaluated lazily, when the app's configuration is first read.
app.add_defaults(_config)
app.autodiscover_tasks(["governance"])
