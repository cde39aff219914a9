"""PostgreSQL: the audit chain lock is the last lock a transaction takes.

Found by the fuzzer as a 503: one transaction created an agent (a deferred
foreign-key check on its owner, run at COMMIT) and appended its event (chain
lock); another locked that owner's row and then waited for the chain lock.
At the first one's COMMIT the key check waited for the second: a deadlock.
Real threads, real locks, real deadlock detector; no mocks.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.db import connection, transaction

from governance import audit
from governance.models import Agent
from tests.conftest import NOW

pytestmark = pytest.mark.django_db(transaction=True)


def _event(label: str) -> None:
    audit.append(event_type="agent.created", actor=audit.Actor.system(label), at=NOW)


@pytest.mark.parametrize("no_key", [False, True], ids=["for-update", "for-no-key-update"])
def test_a_deferred_key_check_never_waits_under_the_chain_lock(postgres_only, no_key):
    owner = User.objects.create_user("owner")
    appended = threading.Event()
    errors: list[BaseException] = []

    def creator() -> None:
        """Inserts a row referencing `owner` (checked at COMMIT), appends, then commits
        while the locker is already queued on the chain lock."""
        try:
            with transaction.atomic():
                Agent.objects.create(name="made-under-lock", owner_id=owner.pk)
                _event("creator")
                appended.set()
                time.sleep(0.5)  # the locker now holds the owner's row and waits
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            appended.set()
        finally:
            connection.close()

    def locker() -> None:
        try:
            appended.wait(timeout=10)
            with transaction.atomic():
                User.objects.select_for_update(no_key=no_key).get(pk=owner.pk)
                _event("locker")
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=creator), threading.Thread(target=locker)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    assert Agent.objects.filter(name="made-under-lock").exists()
    assert audit.verify_chain().ok
    assert timedelta(seconds=time.monotonic() - started) < timedelta(seconds=20)
