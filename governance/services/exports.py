"""Auditor exports beyond the point-in-time access report: the access report
over a period, the decision log, and the audit log as read in the web UI.

Every read that hands rows out writes its `report.exported` event in the same
transaction that reads the rows (as reports.access_report_export does) and makes
the file (a file that cannot be made leaves no record of an export), and
every look at the audit log in the UI writes `audit.viewed`: who looked at the
record is part of the record. Files are CSV (cells neutralised by
reports.csv_cell), JSON or XLSX (same neutralisation: a spreadsheet would run
a leading `=` in an XLSX string cell as readily as in a CSV one).

The exports of audit events (the audit log, the decision log) are the exception
in CSV and JSON: an agent can make every event carry 8,000 characters of
arguments, and a file of MAX_ROWS of them made whole took gigabytes of a web
worker. Their transaction counts the rows (refusing past the cap), notes the
newest event's seq and records the export; the file is then streamed from the
events up to that seq (EventRows), a chunk at a time, after the record commits.
Events are append-only and a seq is only given out after the one before it
committed (the chain lock), so those are exactly the rows the record counts:
nothing appended later, nothing missing. A download cut short after that (the
client gone, a read failing) leaves the record standing: it says what was handed
out, and the file can be checked against its `rows` and `through_seq`. XLSX is
still made whole, in memory, so it has a lower cap of its own (XLSX_MAX_ROWS).
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import datetime
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.db import transaction
from django.db.models import Q, QuerySet

from governance import audit
from governance.codes import EventType
from governance.errors import GovernanceError
from governance.models import AuditEvent, Grant
from governance.services import reports
from governance.services.outcomes import DECISION_EVENTS
from governance.services.usage import usage_fold

FORMATS = ("csv", "json", "xlsx")

PERIOD_COLUMNS = (
    "grant",
    "agent",
    "owner",
    "tool",
    "actions",
    "scope",
    "fields",
    "egress",
    "limits",
    "task",
    "status",
    "starts_at",
    "expires_at",
    "revoked_at",
    "requester",
    "approver",
    "delegated_from",
    "break_glass",
    "blocked_by",
    "use_count",
    "last_used_at",
    "reviews",
)
# The point-in-time access report's columns (reports.ACCESS_COLUMNS) plus its reviews.
ACCESS_COLUMNS = (*reports.ACCESS_COLUMNS, "reviews")

DECISION_COLUMNS = (
    "seq",
    "event_id",
    "time",
    "event_type",
    "agent",
    "task",
    "tool",
    "action",
    "scope",
    "decision",
    "reason",
    "grant",
    "approval",
    "break_glass",
    "actor",
    "arguments",
)

AUDIT_COLUMNS = (
    "seq",
    "event_id",
    "time",
    "event_type",
    "actor",
    "agent",
    "task",
    "tool",
    "action",
    "scope",
    "decision",
    "reason",
    "grant",
    "approval",
    "break_glass",
    "arguments",
    "data",
    "hash",
)


# "print": the printable report page, read in the browser rather than downloaded.
READABLE = (*FORMATS, "print")


def _check_format(fmt: str, formats: Sequence[str] = READABLE) -> None:
    if fmt not in formats:
        shown = [f for f in formats if f != "print"]
        raise GovernanceError(
            "invalid_format", f"Format must be one of {', '.join(shown)}.", fields={"format": fmt}
        )


def _check_period(start: datetime, end: datetime) -> None:
    if end <= start:
        raise GovernanceError(
            "invalid_period", "The period must end after it starts.", fields={"to": "before from"}
        )


# --- Rows ------------------------------------------------------------------------------


def with_reviews(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add each grant's re-certification record: who kept, narrowed or revoked it, when.

    An auditor asks "who said so": the approver is in the row, and so is every
    reviewer who looked at the grant since.
    """
    from governance.models import ReviewItem

    found: dict[int, list[str]] = {}
    items = (
        ReviewItem.objects.filter(grant_id__in=[r["grant"] for r in rows])
        .exclude(status=ReviewItem.Status.PENDING)
        .select_related("decided_by")
        .order_by("decided_at", "pk")
    )
    for item in items:
        who = item.decided_by.get_username() if item.decided_by else "rule"
        when = item.decided_at.isoformat(timespec="minutes") if item.decided_at else ""
        found.setdefault(item.grant_id, []).append(f"{item.status} by {who} {when}".strip())
    return [{**row, "reviews": "; ".join(found.get(row["grant"], []))} for row in rows]


def access_period_rows(start: datetime, end: datetime, **narrow: str) -> list[dict[str, Any]]:
    """Every grant that was live at some moment in [start, end) (of one agent, task or
    tool, when named), each with its widest shape in the period: as it was at `start`
    (reports.shapes_at), and `blocked_by`: why it could allow nothing at any moment of
    the period, or None (reports.blocked_over: the point-in-time report's answer).
    `use_count` and `last_used_at` are the grant's to date, with every decision made so
    far folded in first (as a campaign and the unused scan do): the scheduled fold runs
    every minute, and a file made right after an incident said "never used" of a grant
    the agent had just used."""
    _check_period(start, end)
    usage_fold()
    grants = (
        reports.narrowed(Grant.objects.all(), **narrow)
        .exclude(status__in=[Grant.Status.PENDING, Grant.Status.DENIED])
        .filter(starts_at__lt=end, expires_at__gt=start)
        .filter(Q(revoked_at__isnull=True) | Q(revoked_at__gt=start))
        .select_related("agent__owner", "tool", "task", "requested_by", "approved_by")
        .select_related("requested_by_agent")
    )
    order = lambda g: (g.agent.name, g.tool.name, g.task.key if g.task else "", g.pk)  # noqa: E731
    rows = sorted(reports.at_most(grants), key=order)
    shapes = reports.shapes_at(rows, start)
    blocked = reports.blocked_over(rows, start, end, task=narrow.get("task", ""))
    return with_reviews(
        [
            {
                "grant": g.pk,
                "agent": g.agent.name,
                "owner": g.agent.owner.get_username(),
                "tool": g.tool.name,
                "actions": shapes[g.pk]["actions"],
                "scope": shapes[g.pk]["scope"],
                **reports.envelope(g),
                "task": g.task.key if g.task else None,
                "status": g.status,
                "starts_at": g.starts_at,
                "expires_at": shapes[g.pk]["expires_at"],
                "revoked_at": g.revoked_at,
                "requester": reports._requester(g),
                "approver": g.approved_by.get_username() if g.approved_by else None,
                "delegated_from": g.delegated_from_id,
                "break_glass": g.break_glass,
                "blocked_by": blocked[g.pk],
                "use_count": g.use_count,
                "last_used_at": g.last_used_at,
            }
            for g in rows
        ]
    )


def audit_filter(
    qs: QuerySet[AuditEvent],
    *,
    start: datetime | None = None,
    end: datetime | None = None,
    agent: str = "",
    task: str = "",
    tool: str = "",
    decision: str = "",
    reason: str = "",
    actor: str = "",
    event_type: str = "",
) -> QuerySet[AuditEvent]:
    """The audit log's filters, shared by the page, its export and the decision log."""
    if start is not None:
        qs = qs.filter(created_at__gte=start)
    if end is not None:
        qs = qs.filter(created_at__lt=end)
    exact = {
        "agent": agent,
        "task": task,
        "tool": tool,
        "decision": decision,
        "reason": reason,
        "event_type": event_type,
    }
    qs = qs.filter(**{field: value for field, value in exact.items() if value})
    if actor:
        qs = qs.filter(actor__icontains=actor)
    return qs


def _event_row(event: AuditEvent) -> dict[str, Any]:
    return {
        "seq": event.seq,
        "event_id": str(event.uid),
        "time": event.created_at,
        "event_type": event.event_type,
        "actor": event.actor,
        "agent": event.agent,
        "task": event.task,
        "tool": event.tool,
        "action": event.action,
        "scope": event.scope,
        "decision": event.decision,
        "reason": event.reason,
        "grant": event.grant_id,
        "approval": event.approval_id,
        "break_glass": event.break_glass,
        "arguments": event.arguments,
        "data": event.data,
        "hash": event.hash,
    }


# Events read by one query while an export of them is written: a few megabytes at
# most (arguments are cut to 8,000 characters when stored), however long the file.
CHUNK_ROWS = 200


class EventRows:
    """The audit events an export hands out: those `events` matches with a seq up to
    `through_seq` (the newest event when the export was recorded), oldest first, as
    `_event_row`s. Iterating reads them CHUNK_ROWS at a time, each chunk one short
    query after the last seq seen, so a file of any length holds one chunk in memory.

    Not one query's `.iterator()`: that keeps a cursor open for as long as the
    download takes. On SQLite (no WAL here) an open read holds the lock every writer
    must wait for to commit, so a slow client would stall every decision past its
    20 s busy timeout; on PostgreSQL, outside a transaction, Django declares the
    cursor WITH HOLD, which the server copies out whole before the first row.
    Between two chunks nothing is held."""

    def __init__(self, events: QuerySet[AuditEvent], through_seq: int, count: int) -> None:
        self.events = events.filter(seq__lte=through_seq).order_by("seq")
        self.through_seq = through_seq
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[dict[str, Any]]:
        chunk = list(self.events[:CHUNK_ROWS])
        while chunk:
            yield from (_event_row(event) for event in chunk)
            if len(chunk) < CHUNK_ROWS:
                return
            chunk = list(self.events.filter(seq__gt=chunk[-1].seq)[:CHUNK_ROWS])


def _event_rows(events: QuerySet[AuditEvent]) -> EventRows:
    """`events` up to the newest event now, counted (past MAX_ROWS: refused, as
    reports.at_most refuses) but not read: call it inside the export's transaction."""
    through_seq = audit.head_seq()
    count = events.filter(seq__lte=through_seq)[: reports.MAX_ROWS + 1].count()
    reports.refuse_past_cap(count)
    return EventRows(events, through_seq, count)


def decision_rows(
    start: datetime, end: datetime, *, agent: str = "", task: str = "", tool: str = ""
) -> EventRows:
    """Every decision (allow, deny, approval required) in [start, end), oldest first.
    Only events in the chain: a row put in by hand outside it (seq 0 or below) is a
    finding of verify, never a decision in the log an auditor exports."""
    _check_period(start, end)
    qs = AuditEvent.objects.filter(event_type__in=DECISION_EVENTS, seq__gt=0)
    return _event_rows(audit_filter(qs, start=start, end=end, agent=agent, task=task, tool=tool))


def audit_rows(**filters: Any) -> EventRows:
    """The audit log as the page filters it, oldest first (EventRows)."""
    return _event_rows(audit_filter(AuditEvent.objects.all(), **filters))


# --- Writing the record of the read ---------------------------------------------------------


class _Encoder(DjangoJSONEncoder):
    """Django's, but a time keeps its microseconds (Django's drops the last three
    digits): the JSON file says what the CSV and XLSX say, and the record of an
    export names the exact moment exported."""

    def default(self, o: Any) -> Any:
        if isinstance(o, datetime):
            text = o.isoformat()
            return text.removesuffix("+00:00") + "Z" if text.endswith("+00:00") else text
        return super().default(o)


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, cls=_Encoder))


def export(
    *,
    report: str,
    rows_of: Any,
    params: dict[str, Any],
    fmt: str,
    actor: audit.Actor,
    now: datetime,
    build: Callable[[Any], Any] | None = None,
    deliver: Callable[[Any], None] | None = None,
    formats: Sequence[str] = READABLE,
    count: Callable[[Any], int] = len,
) -> Any:
    """Read the rows and write who read them, in one transaction; with `build`, the
    file is made in it too (and returned), so a file that cannot be made leaves no
    record of an export that never left. `formats`: those this report is made in;
    `count`: how many rows what `rows_of` returned holds (the matrix file: its grants).

    The file is made before the record is appended: the append takes the chain lock,
    held until COMMIT, and every decision of every agent waits for it, so nothing
    slow (an XLSX of 10,000 rows takes seconds) may run after it. `deliver` (a file,
    stdout) is what must not happen unless the record does: it is handed the file
    after the append, in the same transaction, so a file that cannot be delivered
    leaves no record either.

    Audit events (EventRows) are only counted here; `build` returns a response that
    streams them once this transaction has committed, and the record names the last
    seq the file holds (`through_seq`), so the file can be told apart from the log
    as it grew after."""
    _check_format(fmt, formats)
    with transaction.atomic():
        rows = rows_of()
        if fmt == "xlsx":
            _check_xlsx_rows(count(rows))
        made = build(rows) if build is not None else rows
        snapshot = {"through_seq": rows.through_seq} if isinstance(rows, EventRows) else {}
        audit.append(
            event_type=EventType.REPORT_EXPORTED,
            actor=actor,
            at=now,
            data={
                "report": report,
                "format": fmt,
                "rows": count(rows),
                **snapshot,
                **_jsonable(params),
            },
        )
        if deliver is not None:
            deliver(made)
        return made


def audit_viewed(*, actor: audit.Actor, at: datetime, what: str, params: dict[str, Any]) -> None:
    """Looking at the audit log (a page of it, or one event) is itself an event."""
    with transaction.atomic():
        audit.append(
            event_type=EventType.AUDIT_VIEWED,
            actor=actor,
            at=at,
            data={"view": what, **_jsonable(params)},
        )


# --- Files -------------------------------------------------------------------------------


def to_csv(rows: list[dict[str, Any]], columns: Sequence[str]) -> str:
    return reports.csv_text(rows, columns)


def to_json(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    return json.dumps({**meta, "count": len(rows), "rows": rows}, cls=_Encoder, indent=1)


def json_lines(rows: Iterable[dict[str, Any]], meta: dict[str, Any], count: int) -> Iterator[str]:
    """to_json's text a row at a time, as the rows are read (a test holds the two equal
    byte for byte): the head as json.dumps writes it with `rows` last, then each row
    as json.dumps indents it one level down, inside the list."""
    head = json.dumps({**meta, "count": count, "rows": []}, cls=_Encoder, indent=1)
    opened = head.removesuffix("[]\n}") + "[\n"
    first = True
    for row in rows:
        # json.dumps escapes every control character in a string: each line is one
        # line of the structure, and indenting every line moves the row down a level.
        text = json.dumps(row, cls=_Encoder, indent=1).replace("\n", "\n  ")
        yield (opened if first else ",\n") + "  " + text
        first = False
    yield head if first else "\n ]\n}"


# The most rows an XLSX export holds. The file is made whole inside the export's
# transaction, before its record (so not under the chain lock, but a web worker waits
# for it: a zip's directory comes last, it cannot be sent as it is made), and the zip
# is held in memory (openpyxl's write-only sheets go to a temporary file row by row).
# So it is held well below MAX_ROWS: 10,000 events with 8,000 characters of arguments
# each took 7 s here. Past it: too_many_rows, pointing at CSV and JSON, which stream.
XLSX_MAX_ROWS = 10_000


def _check_xlsx_rows(count: int) -> None:
    if count > XLSX_MAX_ROWS:
        raise GovernanceError(
            "too_many_rows",
            f"An XLSX export holds at most {XLSX_MAX_ROWS:,} rows and this one would hold "
            f"{count:,}; narrow the period or filter by agent, task or tool, or export CSV "
            f"or JSON (up to {reports.MAX_ROWS:,} rows).",
            fields={"format": "xlsx"},
        )


# The characters XML 1.0, so XLSX, cannot hold: C0 controls but tab, LF and CR;
# surrogates; U+FFFE and U+FFFF (one in an agent's arguments made the whole file
# unreadable: openpyxl wrote it, and no spreadsheet could open it).
_XLSX_ILLEGAL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")
# The most characters a spreadsheet cell holds (openpyxl cuts a longer one silently).
XLSX_CELL_MAX = 32_767
_FORMULA_START = frozenset("=+-@\t\r")


def _xlsx_value(value: Any) -> Any:
    # Numbers stay numbers; everything else is text that cannot be a formula, with the
    # characters XLSX cannot hold shown as `\x01` / `\ufffe`, as the audit log
    # stores control characters, instead of failing the whole file.
    if isinstance(value, bool) or value is None or not isinstance(value, int | float):
        return _XLSX_ILLEGAL.sub(_escaped, reports.xlsx_cell(value))
    return value


def _escaped(match: re.Match[str]) -> str:
    code = ord(match.group(0))
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def _parts(text: str) -> list[str]:
    """`text` in pieces that each fit a cell, cut where the next piece does not start
    with = + - @, tab or CR when the text allows it (to_xlsx writes every piece as
    text all the same: a run of them longer than a cell leaves no such place)."""
    parts, at = [], 0
    while at < len(text):
        end = min(at + XLSX_CELL_MAX, len(text))
        while end < len(text) and text[end] in _FORMULA_START and end > at + 1:
            end -= 1
        parts.append(text[at:end])
        at = end
    return parts


def to_xlsx(rows: Iterable[dict[str, Any]], columns: Sequence[str], title: str) -> bytes:
    """One sheet of rows. A value too long for a cell (event data listing a whole
    campaign, say) is never cut: its cell says where it is, and the sheet
    `long values` holds it in order, in pieces (row, column, piece, of, text)."""
    from openpyxl import Workbook
    from openpyxl.cell import WriteOnlyCell

    book = Workbook(write_only=True)
    sheet = book.create_sheet(title=title[:31])
    sheet.append(list(columns))
    long_values: list[list[Any]] = []
    for number, row in enumerate(rows, start=2):
        cells = []
        for column in columns:
            value = _xlsx_value(row[column])
            if isinstance(value, str) and len(value) > XLSX_CELL_MAX:
                parts = _parts(value)
                long_values += [
                    [number, column, n, len(parts), part] for n, part in enumerate(parts, 1)
                ]
                value = f"({len(value):,} characters: sheet 'long values', row {number})"
            cells.append(value)
        sheet.append(cells)
    if long_values:
        rest = book.create_sheet(title="long values")
        rest.append(["row", "column", "piece", "of", "text"])
        for *where, text in long_values:
            # Text, always: a piece cut inside a run of = + - @ can still start with
            # one (_parts backs off only so far), and openpyxl writes "=..." as a formula.
            cell = WriteOnlyCell(rest, value=text)
            cell.data_type = "s"
            rest.append([*where, cell])
    out = io.BytesIO()
    book.save(out)
    return out.getvalue()
