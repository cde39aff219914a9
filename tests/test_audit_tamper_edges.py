"""Tampering at the edges of the audit chain, as someone with write access to the
database would do it (raw SQL, the append-only triggers bypassed as in
test_audit_chain.py), each found by verify at the exact first bad event.

Written from a mutation run over governance/audit.py: each test here fails on a
change to the verification or hashing code that every other audit test let pass.
"""

from __future__ import annotations

import hmac
import json
import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.db import connection, transaction

from governance import audit, db
from governance.audit import Actor
from governance.models import AuditEvent
from governance.services import access
from tests import test_audit_chain as base
from tests.conftest import NOW

chain = base.chain  # the same fixture: setup events plus six decisions
sql = base.sql
triggers_bypassed = base.triggers_bypassed


def _verify_fails_at(capsys: Any, seq: int, problem: str) -> None:
    """`manage.py audit_verify` exits 1 naming `seq` and `problem`, and the failure is
    the newest event, chained after the damage, naming the same seq."""
    newest = AuditEvent.objects.order_by("-seq").first().seq
    code, text = base.verify_output(capsys)
    assert code == 1, text
    assert text.strip().startswith(f"FAILED at seq {seq}: {problem}"), text
    failed = AuditEvent.objects.order_by("-seq").first()
    assert (failed.seq, failed.event_type) == (newest + 1, "audit.verify_failed")
    assert json.loads(failed.data)["bad_seq"] == seq


def _changed(column: str, value: Any) -> Any:
    """Another value for `column`, as the database would store it, that still reads
    back cleanly (so it is the HMAC, not a reader, that must notice)."""
    if column == "uid":
        return db.param_uuid(uuid.uuid4())
    if column == "created_at":
        return db.param_dt(value + timedelta(microseconds=1))
    if column == "break_glass":
        return not value
    if column == "grant_id":
        return (value or 0) + 1
    if column in ("arguments", "data"):
        return json.dumps({"tampered": value}, sort_keys=True, separators=(",", ":"))
    # Same length (the varchar widths), one character changed.
    return value[:-1] + ("0" if value[-1:] != "0" else "1") if value else "x"


EDITABLE = [name for name in audit.FIELDS if name != "seq"]  # seq: the reorder tests


@pytest.mark.parametrize("where", ["first", "middle", "newest"])
@pytest.mark.parametrize("column", EDITABLE)
def test_an_edit_to_any_column_of_any_event_is_found_at_that_event(chain, capsys, column, where):
    """Every stored column is covered: the content by row_mac, its place by the link,
    and prev_hash (outside both HMACs) by the walk itself; the chain's first event and
    its newest as much as any other."""
    seq = {"first": 1, "middle": chain // 2, "newest": chain}[where]
    value = AuditEvent.objects.filter(seq=seq).values_list(column, flat=True).get()
    with triggers_bypassed():
        sql(
            f"UPDATE governance_auditevent SET {column} = %s WHERE seq = %s",
            [_changed(column, value), seq],
        )
    assert AuditEvent.objects.filter(seq=seq).values_list(column, flat=True).get() != value
    problem = (
        "prev_hash does not link to the previous event"
        if column == "prev_hash"
        else "content does not match its HMAC"
    )
    _verify_fails_at(capsys, seq, problem)


def _keyed(key: bytes, message: str) -> str:
    return hmac.new(key, message.encode(), "sha256").hexdigest()


def _canonical(value: Any) -> str:
    """The documented canonical form, written out here rather than borrowed from the
    code under test: sorted keys, no spaces, UTF-8."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def test_holding_the_link_key_alone_does_not_let_an_edit_be_rechained(chain, capsys):
    """On PostgreSQL every append sends K_link to the database (migration 0007's bind
    parameter), so someone who can read the database's statements may hold it; row_mac
    is keyed with K_row, which never leaves the application. An event edited and the
    chain re-linked from it with K_link (for both HMACs, the best guess without K_row)
    is found at the edited event."""
    link_key = audit._derived_key(b"audit-link")
    rows = list(AuditEvent.objects.order_by("seq").values(*audit.FIELDS))
    seq = chain // 2
    prev = rows[seq - 2]["hash"]
    with triggers_bypassed():
        for row in rows[seq - 1 :]:
            if row["seq"] == seq:
                row["scope"] = "repo:acme/innocent"
            content = {k: row[k] for k in audit.FIELDS if k not in ("seq", "prev_hash", "hash")}
            content.update(
                uid=str(row["uid"]),
                created_at=audit._iso(row["created_at"]),
                break_glass=bool(row["break_glass"]),
            )
            mac = _keyed(link_key, _canonical(content))
            new = _keyed(link_key, f"{prev}:{row['seq']}:{mac}")
            sql(
                "UPDATE governance_auditevent SET scope = %s, prev_hash = %s, hash = %s "
                "WHERE seq = %s",
                [row["scope"], prev, new, row["seq"]],
            )
            prev = new
    _verify_fails_at(capsys, seq, "content does not match its HMAC")


def _legacy_link(prev: str, row: dict[str, Any]) -> str:
    """The pre-0007 link, from its description rather than legacy_event_hash(): one
    HMAC with AUDIT_HMAC_KEY itself over canonical JSON of every column but `hash`."""
    body = {k: row[k] for k in audit.FIELDS if k != "hash"}
    body.update(
        uid=str(row["uid"]),
        created_at=audit._iso(row["created_at"]),
        prev_hash=prev,
        break_glass=bool(row["break_glass"]),
    )
    return _keyed(settings.AUDIT_HMAC_KEY.encode(), _canonical(body))


def test_an_edit_to_an_event_written_with_the_old_link_is_found(chain, capsys):
    """A log written before migration 0007 (every link the old single HMAC, computed
    here from its description) still verifies, and an edit to one of its events is
    found there: verify accepts the old form only as the keyed HMAC of every column."""
    rows = list(AuditEvent.objects.order_by("seq").values(*audit.FIELDS))
    prev = "0" * 64  # the genesis every log so far starts from, old link or new
    with triggers_bypassed():
        for row in rows:
            new = _legacy_link(prev, row)
            sql(
                "UPDATE governance_auditevent SET prev_hash = %s, hash = %s WHERE seq = %s",
                [prev, new, row["seq"]],
            )
            prev = new
    walked = audit.verify_chain()
    assert (walked.ok, walked.count, walked.head) == (True, chain, prev)
    seq = chain // 2
    with triggers_bypassed():
        sql("UPDATE governance_auditevent SET scope = 'repo:acme/innocent' WHERE seq = %s", [seq])
    _verify_fails_at(capsys, seq, "content does not match its HMAC")


# --- Truncation, held against the checkpoints ----------------------------------------


def test_deleting_only_the_newest_event_is_caught_by_the_checkpoint(chain, capsys):
    """One event, the newest a checkpoint signed, deleted: the rest of the log is a
    whole chain; the checkpoint says one event is missing, and which."""
    signed = audit.write_checkpoint(NOW)
    seq = signed["seq"]
    with triggers_bypassed():
        sql("DELETE FROM governance_auditevent WHERE seq = %s", [seq])
    _verify_fails_at(
        capsys,
        seq,
        f"checkpoint {signed['file']} covers seq {seq} but the log ends at seq {seq - 1}: "
        "the newest 1 event(s) were deleted",
    )


def test_a_log_deleted_whole_and_written_again_past_its_first_checkpoint_is_caught(db, capsys):
    """The first checkpoint of a log's life signs its first event (the series' start,
    seq 1). Every event deleted and ordinary traffic writing a new seq 1 and on: a whole
    chain again, with no series on record, but not the event the checkpoint signed."""
    signed = audit.write_checkpoint(NOW)
    assert (signed["seq"], signed["head"]) == (1, AuditEvent.objects.get(seq=1).hash)
    with triggers_bypassed():
        sql("DELETE FROM governance_auditevent")
    for n in range(3):
        with transaction.atomic():
            audit.append(event_type="test.again", actor=Actor.system("t"), at=NOW, scope=f"s{n}")
    _verify_fails_at(capsys, 1, f"event hash differs from checkpoint {signed['file']}")


# --- Deletion and unreadable values --------------------------------------------------


@pytest.mark.parametrize("first, last", [(1, 1), (2, 4), (5, 5)])
def test_events_deleted_from_the_chain_are_named_by_the_first_missing_seq(
    chain, capsys, first, last
):
    """One event or a run of them deleted (the chain's first among them): verify names
    the first seq missing and the one found in its place."""
    with triggers_bypassed():
        sql("DELETE FROM governance_auditevent WHERE seq BETWEEN %s AND %s", [first, last])
    _verify_fails_at(capsys, first, f"expected seq {first}, found {last + 1}: event(s) deleted")


def test_a_value_no_reader_can_hash_is_a_finding_not_a_crash(chain, capsys):
    """SQLite keeps whatever storage class it is given: a BLOB in a text column reads
    back as bytes, which no canonical form can hash. That is an edit like any other,
    named at its event (and recorded), not a traceback that records nothing."""
    if connection.vendor != "sqlite":
        pytest.skip("PostgreSQL's text columns hold text only")
    seq = chain // 2
    with triggers_bypassed():
        sql("UPDATE governance_auditevent SET scope = CAST(scope AS BLOB) WHERE seq = %s", [seq])
    assert isinstance(AuditEvent.objects.values_list("scope", flat=True).get(seq=seq), bytes)
    _verify_fails_at(capsys, seq, "the event is unreadable (TypeError)")


# --- Checkpoints ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, edit",
    [
        ("head", lambda body, older: older["head"]),  # the head of a log cut back
        ("count", lambda body, older: older["count"]),
        ("time", lambda body, older: (NOW + timedelta(hours=1)).isoformat()),  # fresh-looking
        ("prev_signature", lambda body, older: ""),  # as if it began the series
    ],
)
def test_an_edit_to_any_signed_field_of_a_checkpoint_is_found(chain, capsys, settings, field, edit):
    """Every field a checkpoint holds is signed: the newest checkpoint made to sign an
    older (cut back) head, another count, a later time (as if the job still ran) or no
    predecessor fails its signature, at the seq it covers."""
    older = audit.write_checkpoint(NOW)
    for i in range(2):
        access.access_check(
            agent="bot", tool="repo", action="read", scope=f"repo:acme/n{i}", at=NOW
        )
    newest = audit.write_checkpoint(NOW + timedelta(minutes=1))
    assert audit.verify_chain(NOW + timedelta(minutes=2)).ok
    path = settings.AUDIT_CHECKPOINT_DIR / newest["file"]
    body = json.loads(path.read_text())
    body[field] = edit(body, older)
    assert body[field] != newest[field]
    path.write_text(json.dumps(body))
    _verify_fails_at(capsys, newest["seq"], f"checkpoint {newest['file']} has a bad signature")


def test_a_checkpoint_is_stale_only_once_older_than_the_maximum_age(chain, settings):
    """AUDIT_CHECKPOINT_MAX_AGE old is still recent; a microsecond more and verify
    fails at the seq the checkpoint covers: events after it could be deleted unseen."""
    settings.AUDIT_CHECKPOINT_MAX_AGE = timedelta(minutes=15)
    signed = audit.write_checkpoint(NOW)
    assert audit.verify_chain(NOW + timedelta(minutes=15)).ok
    late = audit.verify_chain(NOW + timedelta(minutes=15, microseconds=1))
    assert (late.ok, late.bad_seq) == (False, signed["seq"])
    assert late.problem.startswith(f"the newest checkpoint, {signed['file']}, is 15 min old")


def test_the_pages_check_walks_a_tail_of_exactly_its_limit_and_finds_an_edit_there(chain):
    """The page's bounded check (verify_tail) leaves unwalked only a tail longer than
    its limit: one exactly as long is walked, and an edit to its newest event found."""
    checkpoint = audit.write_checkpoint(NOW)
    for i in range(4):
        access.access_check(
            agent="bot", tool="repo", action="read", scope=f"repo:acme/t{i}", at=NOW
        )
    newest = checkpoint["seq"] + 4
    with triggers_bypassed():
        sql("UPDATE governance_auditevent SET scope = 'repo:acme/x' WHERE seq = %s", [newest])
    assert audit.verify_tail(checkpoint, NOW, 3) == (checkpoint["seq"], None)
    since, verdict = audit.verify_tail(checkpoint, NOW, 4)
    assert since == checkpoint["seq"] and verdict is not None
    assert (verdict.ok, verdict.bad_seq) == (False, newest)
    assert verdict.problem.startswith("content does not match its HMAC")
    # A question, not a record: the page's check writes nothing.
    assert not AuditEvent.objects.filter(event_type="audit.verify_failed").exists()


def test_the_page_finds_events_a_full_walk_verified_rewritten_before_a_checkpoint_signed_them(
    chain, capsys
):
    """The newest events, verified by the last full walk but not yet signed by a
    checkpoint, deleted and written again; the next checkpoint, which holds only its
    predecessor against the log, then signs the refilled head. The page's own check
    starts at that checkpoint and finds nothing; the log no longer holds the head the
    full walk verified, and the page says so, at that seq. So does the next full walk
    (`manage.py audit_verify`, the nightly job): it passed, and replaced the record
    with the refilled head, and the page said ok again, the evidence gone."""
    from governance import tasks
    from governance.web import queries

    first = audit.write_checkpoint(NOW)
    for i in range(3):
        access.access_check(
            agent="bot", tool="repo", action="read", scope=f"repo:acme/w{i}", at=NOW
        )
    walked = audit.verify_and_record(actor=Actor.system("nightly"), at=NOW)
    assert (walked.ok, walked.count) == (True, first["seq"] + 3)
    with triggers_bypassed():
        sql("DELETE FROM governance_auditevent WHERE seq > %s", [first["seq"]])
    for i in range(4):
        access.access_check(
            agent="bot", tool="repo", action="read", scope=f"repo:acme/r{i}", at=NOW
        )
    audit.write_checkpoint(NOW + timedelta(minutes=1))
    status = queries.chain_status(NOW + timedelta(minutes=2))
    assert (status["state"], status["bad_seq"]) == ("failed", walked.count)
    assert status["problem"].startswith(
        "the log no longer holds the head the last full walk verified there"
    )
    assert [f["source"] for f in status["findings"]] == ["this view's check"]
    signed = (
        f"the last full verify ({audit._iso(NOW)}, by system:nightly) signed head "
        f"{walked.head} at seq {walked.count}; the log now has hash "
        f"{audit._hash_at(walked.count)} there: events up to seq {walked.count} were deleted"
    )
    # Found again by every walk after it, the command's and the nightly job's: the
    # failure is recorded, and the record keeps the head it was held against.
    for _ in range(2):
        _verify_fails_at(capsys, walked.count, signed)
        record = audit.last_full_verify()
        assert (record["ok"], record["bad_seq"]) == (False, walked.count)
        assert (record["held"]["count"], record["held"]["head"]) == (walked.count, walked.head)
        status = queries.chain_status(NOW + timedelta(minutes=3))
        assert (status["state"], status["bad_seq"]) == ("failed", walked.count)
        assert status["problem"].startswith(signed)
        assert status["findings"][0]["source"] == "the last full walk"
    # The nightly job fails too (already recorded within the hour: not recorded again),
    # and its record is the failure's.
    failures = AuditEvent.objects.filter(event_type="audit.verify_failed").count()
    assert tasks.audit_verify.run()["bad_seq"] == walked.count
    assert AuditEvent.objects.filter(event_type="audit.verify_failed").count() == failures
    record = audit.last_full_verify()
    assert (record["ok"], record["bad_seq"], record["by"]) == (
        False,
        walked.count,
        "system:celery:audit_verify",
    )
    assert queries.chain_status(NOW + timedelta(minutes=4))["state"] == "failed"


def test_a_restart_of_the_checkpoints_sets_the_record_of_the_last_full_verify_aside(
    chain, person, settings, capsys
):
    """A database restored from a backup (its newest events gone, a verify's record
    over them) is taken back by restart_checkpoints: the record goes aside with the
    old series, named by the restart's event, and the next verify passes and records
    the restored log's head."""
    audit.write_checkpoint(NOW)
    for i in range(3):
        access.access_check(
            agent="bot", tool="repo", action="read", scope=f"repo:acme/b{i}", at=NOW
        )
    walked = audit.verify_and_record(actor=Actor.system("nightly"), at=NOW)
    assert walked.ok
    with triggers_bypassed():  # "restored": the newest events, since the backup, gone
        sql("DELETE FROM governance_auditevent WHERE seq > %s", [chain + 1])
    audit.restart_checkpoints(
        reason="restored from backup",
        actor=Actor.user(person("heidi", "admins")),
        at=NOW + timedelta(minutes=1),
    )
    restarted = AuditEvent.objects.get(event_type="audit.checkpoints_restarted")
    aside = settings.AUDIT_CHECKPOINT_DIR / json.loads(restarted.data)["archived"]
    assert json.loads((aside / "verified.json").read_text())["head"] == walked.head
    assert audit.last_full_verify() is None
    code, text = base.verify_output(capsys)
    assert code == 0, text
    assert not AuditEvent.objects.filter(event_type="audit.verify_failed").exists()
    head = AuditEvent.objects.order_by("-seq").first()
    assert (audit.last_full_verify()["count"], audit.last_full_verify()["head"]) == (
        head.seq,
        head.hash,
    )


@pytest.mark.parametrize("record", ["not json", "forged"])
def test_an_unreadable_record_of_the_last_full_verify_fails_every_verify_until_a_restart(
    chain, person, settings, capsys, record
):
    """Found unreadable or not signed (written by someone without the key), the record
    no longer says which head the log must hold: a failure, as on the page, never a
    pass, and carried on by the failure's own record, so the next verify does not pass
    over it either. A fresh install, with no record, passes (the other tests)."""
    from governance.web import queries

    audit.write_checkpoint(NOW)
    assert audit.verify_and_record(actor=Actor.system("nightly"), at=NOW).ok
    path = settings.AUDIT_CHECKPOINT_DIR / "verified.json"
    if record == "forged":  # "a later pass", over a log someone cut back
        body = json.loads(path.read_text()) | {"count": 1, "head": audit._hash_at(1)}
        path.write_text(json.dumps(body))
    else:
        path.write_text(record)
    head = AuditEvent.objects.order_by("-seq").first().seq
    for _ in range(2):
        _verify_fails_at(
            capsys, head, "the record of the last full verify (verified.json) was found unreadable"
        )
        head += 1
        assert queries.chain_status(NOW + timedelta(minutes=1))["state"] == "failed"
    audit.restart_checkpoints(
        reason="record checked", actor=Actor.user(person("heidi", "admins")), at=NOW
    )
    assert base.verify_output(capsys)[0] == 0
