"""Auditor exports beyond the point-in-time access report: the access report
over a period, the decision log, and the audit log as read in the web UI.

Every read that hands rows out writes its `report.exported` event in the same
transaction that reads the rows (as reports.access_report_export does) and makes
the file (a file that cannot be made leaves no record of an export), and
every look at the audit log in the UI writes `audit.viewed`: who looked at the
record is part of the record. Files are CSV (cells neutralised by
reports.csv_cell), JSON or XLSX (same neutralisation: a spreadsheet would run
a leading `=` in an XLSX string cell as readily as in a CSV one).
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Callable, Sequence
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

FORMATS = ("csv", "json", "xlsx")
MAX_ROWS = 100_000

PERIOD_COLUMNS = (
    "grant",
    "agent",
    "owner",
    "tool",
    "actions",
    "scope",
    "task",
    "status",
    "starts_at",
    "expires_at",
    "revoked_at",
    "requester",
    "approver",
    "delegated_from",
    "break_glass",
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


def _check_format(fmt: str) -> None:
    # "print": the printable report page, read in the browser rather than downloaded.
    if fmt not in (*FORMATS, "print"):
        raise GovernanceError(
            "invalid_format", f"Format must be one of {', '.join(FORMATS)}.", fields={"format": fmt}
        )


def _at_most(items: Any) -> list[Any]:
    """Every row or none: an export holding more than MAX_ROWS is refused (narrow it),
    never cut short, so a file an auditor receives is always the whole answer."""
    found = list(items[: MAX_ROWS + 1])
    if len(found) > MAX_ROWS:
        raise GovernanceError(
            "too_many_rows",
            f"The export would hold more than {MAX_ROWS:,} rows; narrow the period or "
            "filter by agent, task or tool.",
        )
    return found


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


def access_period_rows(start: datetime, end: datetime) -> list[dict[str, Any]]:
    """Every grant that was live at some moment in [start, end), each with its widest
    shape in the period: as it was at `start` (reports.shapes_at)."""
    _check_period(start, end)
    grants = (
        Grant.objects.exclude(status__in=[Grant.Status.PENDING, Grant.Status.DENIED])
        .filter(starts_at__lt=end, expires_at__gt=start)
        .filter(Q(revoked_at__isnull=True) | Q(revoked_at__gt=start))
        .select_related("agent__owner", "tool", "task", "requested_by", "approved_by")
        .select_related("requested_by_agent")
    )
    order = lambda g: (g.agent.name, g.tool.name, g.task.key if g.task else "", g.pk)  # noqa: E731
    rows = _at_most(sorted(grants, key=order))
    shapes = reports.shapes_at(rows, start)
    return with_reviews(
        [
            {
                "grant": g.pk,
                "agent": g.agent.name,
                "owner": g.agent.owner.get_username(),
                "tool": g.tool.name,
                "actions": shapes[g.pk]["actions"],
                "scope": shapes[g.pk]["scope"],
                "task": g.task.key if g.task else None,
                "status": g.status,
                "starts_at": g.starts_at,
                "expires_at": shapes[g.pk]["expires_at"],
                "revoked_at": g.revoked_at,
                "requester": reports._requester(g),
                "approver": g.approved_by.get_username() if g.approved_by else None,
                "delegated_from": g.delegated_from_id,
                "break_glass": g.break_glass,
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


def decision_rows(
    start: datetime, end: datetime, *, agent: str = "", task: str = "", tool: str = ""
) -> list[dict[str, Any]]:
    """Every decision (allow, deny, approval required) in [start, end), oldest first."""
    _check_period(start, end)
    qs = AuditEvent.objects.filter(event_type__in=DECISION_EVENTS)
    qs = audit_filter(qs, start=start, end=end, agent=agent, task=task, tool=tool)
    return [_event_row(e) for e in _at_most(qs.order_by("seq"))]


def audit_rows(**filters: Any) -> list[dict[str, Any]]:
    qs = audit_filter(AuditEvent.objects.all(), **filters)
    return [_event_row(e) for e in _at_most(qs.order_by("seq"))]


# --- Writing the record of the read ---------------------------------------------------------


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, cls=DjangoJSONEncoder))


def export(
    *,
    report: str,
    rows_of: Any,
    params: dict[str, Any],
    fmt: str,
    actor: audit.Actor,
    now: datetime,
    build: Callable[[list[dict[str, Any]]], Any] | None = None,
) -> Any:
    """Read the rows and write who read them, in one transaction; with `build`, the
    file is made in it too (and returned), so a file that cannot be made leaves no
    record of an export that never left."""
    _check_format(fmt)
    with transaction.atomic():
        rows = rows_of()
        audit.append(
            event_type=EventType.REPORT_EXPORTED,
            actor=actor,
            at=now,
            data={"report": report, "format": fmt, "rows": len(rows), **_jsonable(params)},
        )
        return build(rows) if build is not None else rows


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
    import csv

    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n")
    writer.writerow(columns)
    for row in rows:
        writer.writerow([reports.csv_cell(row[c]) for c in columns])
    return out.getvalue()


def to_json(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    return json.dumps({**meta, "count": len(rows), "rows": rows}, cls=DjangoJSONEncoder, indent=1)


# The characters XML 1.0, so XLSX, cannot hold (openpyxl refuses a cell with one).
_XLSX_ILLEGAL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f]")


def _xlsx_value(value: Any) -> Any:
    # Numbers stay numbers; everything else is text that cannot be a formula, with the
    # control characters XLSX cannot hold (XML 1.0) shown as `\x01`, as the audit log
    # stores them, instead of failing the whole file.
    if isinstance(value, bool) or value is None or not isinstance(value, int | float):
        return _XLSX_ILLEGAL.sub(_escaped, reports.csv_cell(value))
    return value


def _escaped(match: re.Match[str]) -> str:
    return f"\\x{ord(match.group(0)):02x}"


def to_xlsx(rows: list[dict[str, Any]], columns: Sequence[str], title: str) -> bytes:
    from openpyxl import Workbook

    book = Workbook(write_only=True)
    sheet = book.create_sheet(title=title[:31])
    sheet.append(list(columns))
    for row in rows:
        sheet.append([_xlsx_value(row[c]) for c in columns])
    out = io.BytesIO()
    book.save(out)
    return out.getvalue()
