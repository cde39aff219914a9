"""Edges of the auditor's access reports (services/reports.py, services/exports.py):
what a report says at a moment T, or over a period, where one wrong token would tell
an auditor something false about who could do what."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from typing import Any

import pytest

from governance.audit import Actor
from governance.models import AuditEvent
from governance.services import exports, grants, reports
from tests.conftest import NOW, last_event

H = timedelta(hours=1)
M = timedelta(minutes=1)


def _report(carol: Any, at: Any, **narrow: str) -> list[dict[str, Any]]:
    """The point-in-time report as an auditor reads it, with its report.exported event."""
    before = AuditEvent.objects.count()
    rows = reports.access_report_export(
        at=at, fmt="json", actor=Actor.user(carol), now=NOW + H, **narrow
    )
    assert AuditEvent.objects.count() == before + 1
    event = last_event()
    data = json.loads(event.data)
    assert (event.event_type, event.actor) == ("report.exported", "user:carol")
    assert (data["report"], data["at"], data["rows"]) == ("access", at.isoformat(), len(rows))
    assert {k: data[k] for k in narrow if narrow[k]} == {k: v for k, v in narrow.items() if v}
    return rows


def test_a_grant_narrowed_twice_after_t_is_reported_as_it_was_at_t(
    carol, make_agent, make_tool, make_grant, system
):
    """The first narrowing after T holds the shape at T; the second holds the shape
    between the two. Read in the wrong order, the report at T showed the middle one."""
    grant = make_grant(
        make_agent("bot"), make_tool("repo"), ("read", "update", "delete"), "repo:acme/*",
        starts_at=NOW - H, duration=2 * H,
    )  # fmt: skip
    grants.grant_narrow(
        grant_id=grant.pk, actions=["read", "update"], scope="repo:acme/api/*",
        expires_at=NOW + 30 * M, reason="least privilege", actor=system, at=NOW - 20 * M,
    )  # fmt: skip
    grants.grant_narrow(
        grant_id=grant.pk, actions=["read"], scope="repo:acme/api/docs/*",
        reason="least privilege", actor=system, at=NOW - 10 * M,
    )  # fmt: skip
    for at, actions, scope, expiry in [
        (NOW - 30 * M, {"read", "update", "delete"}, "repo:acme/*", NOW + H),
        (NOW - 15 * M, {"read", "update"}, "repo:acme/api/*", NOW + 30 * M),
        (NOW, {"read"}, "repo:acme/api/docs/*", NOW + 30 * M),
    ]:
        (row,) = _report(carol, at)
        assert (row["grant"], set(row["actions"]), row["scope"], row["expires_at"]) == (
            grant.pk, actions, scope, expiry,
        )  # fmt: skip
    # A period from before both reports the widest shape it held.
    (row,) = exports.access_period_rows(NOW - 30 * M, NOW)
    assert (set(row["actions"]), row["scope"], row["expires_at"]) == (
        {"read", "update", "delete"}, "repo:acme/*", NOW + H,
    )  # fmt: skip


def _forge(event_type: str, at: Any, *, seq: int = 0, agent: str = "", grant: int | None = None,
           data: dict[str, Any] | None = None) -> None:  # fmt: skip
    """A row put into the audit table by hand, outside the chain (seq 0): a finding of
    verify, never evidence of what anyone could do."""
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute(
            "INSERT INTO governance_auditevent (seq, uid, created_at, event_type, actor_type,"
            " actor, agent, task, tool, action, scope, arguments, arguments_hash, decision,"
            " reason, grant_id, approval_id, break_glass, data, prev_hash, hash) VALUES (%s,"
            " %s, %s, %s, 'system', 'system:x', %s, '', 'repo', '', '', '{}', '', '', '',"
            " %s, '', %s, %s, 'x', 'y')",
            [seq, uuid.uuid4().hex, at, event_type, agent, grant,
             False, json.dumps(data or {})],
        )  # fmt: skip


@pytest.mark.parametrize("forged", ["grant.narrowed", "agent.suspended"])
def test_an_event_at_seq_zero_changes_nothing_a_report_says(
    carol, make_agent, make_tool, make_grant, forged
):
    """A hand-made grant.narrowed row (seq 0) claiming the grant was wider before, or a
    hand-made agent.suspended one, is not evidence: the report at T and over a period
    say what the chain says (seq is unique, so one such row a test; the decision log's
    test used seq -1, which `seq >= 0` passed too)."""
    grant = make_grant(make_agent("bot"), make_tool("repo"), ("read",), "repo:acme/api/*",
                       starts_at=NOW - H, duration=2 * H)  # fmt: skip
    if forged == "grant.narrowed":
        wider = {"actions": ["read", "delete"], "scope": "repo:*",
                 "expires_at": (NOW + 9 * H).isoformat()}  # fmt: skip
        _forge(forged, NOW - 10 * M, grant=grant.pk, data={"before": wider})
    else:
        _forge(forged, NOW - 40 * M, agent="bot")
    (row,) = _report(carol, NOW - 20 * M)
    assert (row["actions"], row["scope"], row["expires_at"], row["blocked_by"]) == (
        ["read"], "repo:acme/api/*", grant.expires_at, None,
    )  # fmt: skip
    (row,) = exports.access_period_rows(NOW - 30 * M, NOW)
    assert (row["actions"], row["scope"], row["blocked_by"]) == (["read"], "repo:acme/api/*", None)


def test_rows_read_past_the_cap_are_refused_never_cut_short(db, monkeypatch):
    """The count before the read can be passed by grants written between the two
    statements: the rows read are held to the cap again, whole or refused (read as
    `items[:MAX_ROWS]`, the file silently lost its last row)."""
    from governance.errors import GovernanceError

    monkeypatch.setattr(reports, "MAX_ROWS", 3)
    before = AuditEvent.objects.count()
    assert reports.at_most([1, 2, 3]) == [1, 2, 3]
    with pytest.raises(GovernanceError) as err:
        reports.at_most([1, 2, 3, 4])
    assert err.value.code == "too_many_rows" and "3 rows" in err.value.message
    assert AuditEvent.objects.count() == before


def test_a_report_narrowed_to_an_agent_or_tool_names_exactly_that_one(
    carol, make_agent, make_tool, make_grant
):
    """`repo` is not `repo-admin`, nor `bot` `bot-2`: a filter by prefix put another
    tool's (or agent's) grants in a report that says it is about one."""
    bot, bot2 = make_agent("bot"), make_agent("bot-2")
    repo, admin = make_tool("repo"), make_tool("repo-admin")
    mine = make_grant(bot, repo, starts_at=NOW - H, duration=2 * H)
    make_grant(bot, admin, starts_at=NOW - H, duration=2 * H)
    make_grant(bot2, repo, starts_at=NOW - H, duration=2 * H)
    assert len(_report(carol, NOW)) == 3
    for narrow in ({"tool": "repo", "agent": "bot"}, {"agent": "bot", "tool": "repo"}):
        assert [r["grant"] for r in _report(carol, NOW, **narrow)] == [mine.pk]
    assert {(r["agent"], r["tool"]) for r in _report(carol, NOW, tool="repo")} == {
        ("bot", "repo"), ("bot-2", "repo"),
    }  # fmt: skip
    assert {(r["agent"], r["tool"]) for r in _report(carol, NOW, agent="bot")} == {
        ("bot", "repo"), ("bot", "repo-admin"),
    }  # fmt: skip
    period = exports.access_period_rows(NOW - 10 * M, NOW, tool="repo", agent="bot")
    assert [r["grant"] for r in period] == [mine.pk]


def test_a_quarantine_lifted_by_a_tool_saying_its_approved_text_again_ends_the_block(
    carol, make_agent, make_tool, make_grant, system
):
    """A quarantined tool whose definition goes back to the approved one is approved
    again (tool.updated, not tool.approved): from then the report says nothing blocks
    its grants, and a period spanning it says the grant could allow something."""
    from governance.services import tools

    repo = make_tool("repo")
    grant = make_grant(make_agent("bot"), repo, starts_at=NOW - H, duration=2 * H)
    tools.tool_update_definition(tool=repo, description="now says more", actor=system,
                                 at=NOW - 40 * M)  # fmt: skip
    tools.tool_update_definition(tool=repo, description="repo tool", actor=system,
                                 at=NOW - 20 * M)  # fmt: skip
    assert list(
        AuditEvent.objects.filter(tool="repo", event_type__startswith="tool.")
        .order_by("seq").values_list("event_type", flat=True)
    ) == ["tool.registered", "tool.quarantined", "tool.updated"]  # fmt: skip
    for at, blocked in [(NOW - 50 * M, None), (NOW - 30 * M, "tool_quarantined"),
                        (NOW - 20 * M, None), (NOW, None)]:  # fmt: skip
        (row,) = _report(carol, at)
        assert (row["grant"], row["blocked_by"]) == (grant.pk, blocked), at
    (row,) = exports.access_period_rows(NOW - 35 * M, NOW - 25 * M)
    assert row["blocked_by"] == "tool_quarantined"
    (row,) = exports.access_period_rows(NOW - 35 * M, NOW)
    assert row["blocked_by"] is None


def test_a_delegation_is_judged_against_its_parent_as_the_parent_was_then(
    carol, make_agent, make_tool, make_grant, system
):
    """lead handed helper `delete`; lead's grant was then narrowed twice (the first
    narrowing took delete away and so ended the delegation). At a moment before both,
    the delegation fitted inside lead's grant as it was: nothing blocked it. Read with
    the later narrowing's `before`, it looked outside its parent."""
    lead = make_agent("lead")
    helper = make_agent("helper", parent=lead)
    repo = make_tool("repo")

    def issue() -> Any:
        return make_grant(lead, repo, ("read", "update", "delete"), "repo:acme/*",
                          starts_at=NOW - H, duration=2 * H, delegable=True)  # fmt: skip

    parent, spare = issue(), []
    if parent.pk == lead.pk:  # `delegated_from` must not read the same as lead's pk
        spare, parent = [parent.pk], issue()
    child = grants.grant_delegate(
        parent_grant_id=parent.pk, child=helper, actions=["delete"], scope="repo:acme/api/*",
        expires_at=parent.expires_at, justification="subtask", actor=Actor.agent(lead),
        at=NOW - 50 * M,
    )  # fmt: skip
    for at, actions in [(NOW - 20 * M, ["read", "update"]), (NOW - 10 * M, ["read"])]:
        grants.grant_narrow(grant_id=parent.pk, actions=actions, reason="least privilege",
                            actor=system, at=at)  # fmt: skip
    child.refresh_from_db()
    assert (child.status, child.revoked_at) == ("revoked", NOW - 20 * M)
    rows = {r["grant"]: r for r in _report(carol, NOW - 30 * M)}
    assert (rows[child.pk]["delegated_from"], rows[parent.pk]["delegated_from"]) == (
        parent.pk,
        None,
    )
    assert (rows[child.pk]["actions"], rows[child.pk]["blocked_by"]) == (["delete"], None)
    assert rows[parent.pk]["blocked_by"] is None
    assert {r["grant"] for r in _report(carol, NOW - 20 * M)} == {parent.pk, *spare}
    period = {r["grant"]: r for r in exports.access_period_rows(NOW - 30 * M, NOW)}
    assert (period[child.pk]["blocked_by"], period[child.pk]["status"]) == (None, "revoked")
    assert period[child.pk]["revoked_at"] == NOW - 20 * M


def test_a_period_blocked_throughout_names_what_blocked_it_when_its_window_opened(
    carol, make_agent, make_tool, make_grant, system
):
    """The agent was suspended when the period began and its tool quarantined; the
    agent came back mid-period, the tool never did. Nothing could be done at any
    moment, and the row says why from the start (agent_suspended), as the report at
    the period's first moment does, not the last reason found (tool_quarantined)."""
    from governance.services import agents, tools

    bot, repo = make_agent("bot"), make_tool("repo")
    grant = make_grant(bot, repo, starts_at=NOW - H, duration=2 * H)
    tools.tool_update_definition(tool=repo, description="changed", actor=system, at=NOW - 50 * M)
    agents.agent_suspend(agent=bot, reason="incident", actor=system, at=NOW - 40 * M)
    agents.agent_resume(agent=bot, reason="cleared", actor=system, at=NOW - 20 * M)
    (row,) = _report(carol, NOW - 30 * M)
    assert (row["grant"], row["blocked_by"]) == (grant.pk, "agent_suspended")
    (row,) = _report(carol, NOW - 15 * M)
    assert row["blocked_by"] == "tool_quarantined"
    (row,) = exports.access_period_rows(NOW - 30 * M, NOW - 10 * M)
    assert (row["grant"], row["blocked_by"]) == (grant.pk, "agent_suspended")
    (row,) = exports.access_period_rows(NOW - 15 * M, NOW - 10 * M)
    assert row["blocked_by"] == "tool_quarantined"


def _period(auditor_session: Any, start: Any, end: Any, **narrow: str) -> dict[int, Any]:
    """The period export as an auditor downloads it (JSON), with its record."""
    query = {"format": "json", "start": start.isoformat(), "end": end.isoformat(), **narrow}
    response = auditor_session.get("/ui/exports/access", query)
    assert response.status_code == 200, response.content[:300]
    body = json.loads(response.content)
    event = last_event()
    data = json.loads(event.data)
    assert (event.event_type, event.actor, data["report"]) == (
        "report.exported", "user:carol", "access_period",
    )  # fmt: skip
    assert data["rows"] == body["count"] == len(body["rows"])
    return {row["grant"]: row for row in body["rows"]}


def test_a_period_holds_exactly_the_grants_live_at_some_moment_of_it(
    auditor_session, make_agent, make_tool, make_grant, system
):
    """[start, end): a grant that expired or was revoked exactly at `start`, or starts
    exactly at `end`, was live at no moment of the period; one that expires a
    millisecond after `start`, or starts a millisecond before `end`, was."""
    from tests.conftest import MS

    bot, repo = make_agent("bot"), make_tool("repo")
    start, end = NOW - 30 * M, NOW
    inside = {
        "expires_just_after": make_grant(bot, repo, starts_at=start - H + MS, duration=H),
        "starts_just_before": make_grant(bot, repo, starts_at=end - MS, duration=H),
        "revoked_just_after": make_grant(bot, repo, starts_at=start - H, duration=2 * H),
    }
    outside = {
        "expired_at_start": make_grant(bot, repo, starts_at=start - H, duration=H),
        "starts_at_end": make_grant(bot, repo, starts_at=end, duration=H),
        "revoked_at_start": make_grant(bot, repo, starts_at=start - H, duration=2 * H),
    }
    for name, at in [("revoked_just_after", start + MS), ("revoked_at_start", start)]:
        grant = inside.get(name) or outside[name]
        grants.grant_revoke(grant_id=grant.pk, reason="incident", actor=system, at=at)
    rows = _period(auditor_session, start, end)
    assert set(rows) == {g.pk for g in inside.values()}
    revoked = rows[inside["revoked_just_after"].pk]
    assert (revoked["status"], revoked["revoked_at"]) == ("revoked", (start + MS).isoformat()
                                                           .replace("+00:00", "Z"))  # fmt: skip
    assert all(row["blocked_by"] is None for row in rows.values())


@pytest.mark.parametrize("lead", ["\r", "\t"])
def test_a_cell_starting_with_a_carriage_return_or_tab_is_never_a_formula(db, lead):
    """OWASP's list: a cell starting with tab or CR is neutralised whatever follows
    (a reader that drops the character then sees the rest as the cell's start)."""
    before = AuditEvent.objects.count()
    for text in (f"{lead}cmd|' /C calc'!A0", f"{lead}=1+1", f"{lead}x"):
        assert reports.csv_cell(text) == reports.xlsx_cell(text) == "'" + text
    assert reports.csv_cell(f"x{lead}y") == f"x{lead}y"
    row = {column: "" for column in reports.ACCESS_COLUMNS} | {"scope": f"{lead}cmd"}
    assert f'"\'{lead}cmd"' in reports.access_csv([row])
    assert AuditEvent.objects.count() == before


def test_the_decision_log_leaves_out_a_decision_put_in_at_seq_zero(db, carol, make_agent):
    """Only events in the chain (seq 1 and up) are decisions: the existing test used
    seq -1, so a row at seq 0 passed `seq >= 0` into the auditor's decision log."""
    make_agent("bot")
    _forge("access.allowed", NOW, agent="bot")
    rows = exports.export(
        report="decisions", rows_of=lambda: exports.decision_rows(NOW - H, NOW + H),
        params={"start": NOW - H, "end": NOW + H}, fmt="json", actor=Actor.user(carol), now=NOW,
    )  # fmt: skip
    assert (len(rows), list(rows)) == (0, [])
    event = last_event()
    data = json.loads(event.data)
    assert (event.event_type, data["report"], data["rows"]) == ("report.exported", "decisions", 0)
    assert data["through_seq"] == event.seq - 1


def test_an_empty_period_is_refused_not_answered(db, carol, make_agent, make_tool, make_grant):
    """[T, T) holds no moment: answering it listed the grants live at T as if they had
    been live "in" it, and the decision log for it said nothing happened. Refused, with
    nothing recorded, whoever asks (the form checks it too; the services do not rely
    on that)."""
    from governance.errors import GovernanceError

    make_grant(make_agent("bot"), make_tool("repo"), starts_at=NOW - H, duration=2 * H)
    before = AuditEvent.objects.count()
    for rows_of in (exports.access_period_rows, exports.decision_rows):
        with pytest.raises(GovernanceError) as err:
            exports.export(
                report="x", rows_of=lambda: rows_of(NOW, NOW), params={}, fmt="json",  # noqa: B023
                actor=Actor.user(carol), now=NOW,
            )  # fmt: skip
        assert (err.value.code, err.value.fields) == ("invalid_period", {"to": "before from"})
    assert AuditEvent.objects.count() == before
    assert len(exports.access_period_rows(NOW, NOW + timedelta(milliseconds=1))) == 1


def test_the_decision_log_for_a_period_holds_its_first_moment_and_not_its_end(
    carol, make_agent, make_tool, make_grant
):
    """[start, end): a decision made exactly at `start` is in the period's log, one made
    exactly at `end` is in the next period's, never in both or neither."""
    from governance.services.access import access_check

    make_grant(make_agent("bot"), make_tool("repo"), starts_at=NOW - H, duration=2 * H)
    ask = {"agent": "bot", "tool": "repo", "action": "read", "scope": "repo:acme/api/x"}
    start, end = NOW - 20 * M, NOW - 10 * M
    for at in (start, end):
        assert access_check(**ask, at=at).allowed
    decided = dict(
        AuditEvent.objects.filter(event_type="access.allowed").values_list("created_at", "seq")
    )
    assert set(decided) == {start, end}

    def log(frm: Any, to: Any) -> list[int]:
        rows = exports.export(
            report="decisions", rows_of=lambda: exports.decision_rows(frm, to, agent="bot"),
            params={"start": frm, "end": to, "agent": "bot"}, fmt="csv",
            actor=Actor.user(carol), now=NOW,
        )  # fmt: skip
        data = json.loads(last_event().data)
        assert (data["report"], data["rows"], data["agent"]) == ("decisions", len(rows), "bot")
        return [row["seq"] for row in rows]

    # The row carries the usage folded as the file is made (not as of the minutely
    # fold: an auditor's file right after an incident said "never used").
    (row,) = exports.access_period_rows(start, NOW)
    assert (row["use_count"], row["last_used_at"]) == (2, end)
    assert log(start, end) == [decided[start]]
    assert log(end, NOW) == [decided[end]]
    assert log(start - M, start) == []


def test_a_long_value_is_cut_into_full_pieces_and_never_before_a_formula(monkeypatch, db):
    """Pieces are as long as a cell allows, each cut moved back only past = + - @ (so
    the next piece does not start with one): cut anywhere else, a 40,000-character
    value became thousands of one-character pieces."""
    monkeypatch.setattr(exports, "XLSX_CELL_MAX", 10)
    before = AuditEvent.objects.count()
    assert exports._parts("a" * 25) == ["a" * 10, "a" * 10, "a" * 5]
    text = "a" * 10 + "=1" + "c" * 8
    assert exports._parts(text) == ["a" * 9, "a=1" + "c" * 7, "c"]
    assert AuditEvent.objects.count() == before


def test_the_audit_log_export_finds_an_actor_by_part_of_its_name(db, carol, make_agent):
    """The audit log's actor filter is a search (`bob` finds `user:bob`), as its page
    says: an exact match found nothing for any name typed without its prefix."""
    make_agent("bot")  # agent.created by system:test
    rows = exports.export(
        report="audit", rows_of=lambda: exports.audit_rows(actor="test"), params={"actor": "test"},
        fmt="json", actor=Actor.user(carol), now=NOW,
    )  # fmt: skip
    found = list(rows)
    assert [(r["event_type"], r["actor"]) for r in found] == [("agent.created", "system:test")]
    data = json.loads(last_event().data)
    assert (data["report"], data["rows"], data["actor"]) == ("audit", 1, "test")


def test_an_xlsx_cell_holds_a_value_of_exactly_a_cells_length_and_booleans_as_text(monkeypatch, db):
    """A value exactly as long as a cell holds stays in its cell (only a longer one goes
    to `long values`); true and false are written as the CSV writes them."""
    import io

    from openpyxl import load_workbook

    monkeypatch.setattr(exports, "XLSX_CELL_MAX", 10)
    before = AuditEvent.objects.count()
    rows = [{"seq": 1, "data": "a" * 10, "flag": True}, {"seq": 2, "data": "b" * 11, "flag": False}]
    book = load_workbook(io.BytesIO(exports.to_xlsx(rows, ["seq", "data", "flag"], "audit")))
    main = list(book["audit"].iter_rows(min_row=2, values_only=True))
    assert main[0] == (1, "a" * 10, "true")
    assert main[1][0] == 2 and "row 3" in main[1][1] and main[1][2] == "false"
    assert list(book["long values"].iter_rows(min_row=2, values_only=True)) == [
        (3, "data", 1, 2, "b" * 10), (3, "data", 2, 2, "b"),
    ]  # fmt: skip
    assert AuditEvent.objects.count() == before
