"""Sandbox runs: every change to a run record, each with its audit event.

run_request   decide (access_check, `execute` on the tool) and apply the grant's
              ceiling to the requested limits and egress; record the run
              (sandbox.run.requested, and sandbox.run.denied unless allowed)
run_started   the container is up (sandbox.run.started), or the start gate refuses
              it (sandbox.run.start_refused)
run_finished  exit code, timeout, OOM, output hashes (sandbox.run.finished)
run_reaped    killed by the reaper (sandbox.run.reaped)
egress_attempt  one event per connection attempt through the proxy

The runner's core (sandbox_runner) knows nothing of Django; the in-process
authorizer (sandbox_runner.authorizers.DatabaseAuthorizer) calls these.
Transitions are claimed with a conditional UPDATE (status must still be what
the caller expects), so the runner and the reaper never both finish a run.
"""

from __future__ import annotations

import functools
import math
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import JSONField

from governance import audit, db
from governance.codes import ActionClass, EventType, Reason
from governance.codes import Decision as Verdict
from governance.errors import Conflict
from governance.models import Grant, SandboxRun, Tool
from governance.policy import call_dead_reason
from governance.services import access
from governance.services.access import ATTEMPTS, access_check
from sandbox_runner.backends import IMAGE_BACKENDS, IMAGE_UNRESOLVED
from sandbox_runner.egress import EgressDecision, destination_of, parse_destination
from sandbox_runner.spec import (
    EXCERPT_CHARS,
    LIMIT_NAMES,
    REVIEW_MAX_BYTES,
    Authorization,
    OverCeiling,
    RunResult,
    RunSpec,
    effective,
    image_scope,
)

LIMIT_EXCEEDED = "limit_exceeds_grant"
BACKEND_NOT_ALLOWED = "backend_not_allowed"
NOT_CODE_EXEC = "not_code_exec_tool"
GRANT_CEILING = (*(f"limit_{name}" for name in LIMIT_NAMES), "egress")


def _event(
    run: SandboxRun,
    event_type: str,
    actor: audit.Actor,
    at: datetime,
    verdict: tuple[str, str] | None = None,
    seen_seq: int | None = None,
    **data: Any,
) -> None:
    decision, reason = verdict or (run.decision, run.reason)
    audit.append(
        seen_seq=seen_seq,
        event_type=event_type,
        actor=actor,
        at=at,
        agent=run.agent,
        task=run.task,
        tool=run.tool,
        action=ActionClass.EXECUTE,
        scope=f"sandbox:{run.image}"[:500],
        decision=decision,
        reason=reason,
        grant_id=run.grant_id,
        break_glass=run.grant is not None and run.grant.break_glass,
        data={"run_id": str(run.run_id), "status": run.status, **data},
    )


def _actor(agent: str) -> audit.Actor:
    return audit.Actor("agent", f"agent:{agent}")


def review_attachments(spec: RunSpec) -> dict[str, Any]:
    """The run's script and input as a person asked to approve the run reads them:
    masked text, or why it is not shown. Only what the request carried (a remote runner
    sends the bytes up to REVIEW_MAX_BYTES, always their hash); the bytes are the ones
    the hashes in the decision's arguments were taken of, so this is what would run."""
    shown: dict[str, Any] = {}
    for name, data, digest in (
        ("script", spec.script, spec.script_sha256),
        ("input", spec.input, spec.input_sha256),
    ):
        if data is None:
            continue
        item: dict[str, Any] = {"sha256": digest, "bytes": len(data)}
        try:
            text = data.decode("utf-8") if len(data) <= REVIEW_MAX_BYTES else None
        except UnicodeDecodeError:
            item["not_shown"] = "not UTF-8 text"
        else:
            if text is None:
                item["not_shown"] = f"longer than {REVIEW_MAX_BYTES} bytes"
            elif "\x00" in text:  # no JSON column can hold a NUL character
                item["not_shown"] = "holds NUL characters"
            else:
                item["text"], item["masked_lines"] = audit.mask_review_text(text)
        shown[name] = item
    return shown


def run_request(*, spec: RunSpec, at: datetime, token_id: int | None = None) -> Authorization:
    """Ask governance whether this run may start; record the run either way.

    One transaction: the decision's event (access_check), the run record and
    its events commit together. Raises only if nothing could be recorded; the
    runner treats that as a denial.

    `token_id`: the bearer token the request came with (the API; None in-process). A
    token revoked after the request was let in gets deny `token_revoked`, as
    /authorize does (access.token_refusal, asked after the run's own limits): no run
    is allowed under a token after its revoke.
    """
    arguments = spec.arguments()
    # NaN and the infinities are not JSON: jsonb refused the run record, the whole
    # transaction rolled back and the attempt went unrecorded. Kept as their text here;
    # effective() refuses them below, on record.
    arguments["limits"] = {
        name: str(value) if isinstance(value, float) and not math.isfinite(value) else value
        for name, value in arguments["limits"].items()
    }
    with transaction.atomic():
        # Written once, at the end (one INSERT, no UPDATE): the decision and the
        # requested event come first, in this transaction.
        run = SandboxRun(
            run_id=uuid.UUID(spec.run_id),
            agent=spec.agent[:100],
            task=(spec.task or "")[:100],
            tool=spec.tool[:100],
            backend=spec.backend[:20],
            image=spec.image[:300],
            image_id=spec.image_id,
            # Kept as its event keeps it: a command line can carry a secret (a header,
            # a --password=), and the record is shown to every role. The decision binds
            # the whole command through the arguments' keyed hash.
            command=audit.mask(list(spec.command)),
            script_sha256=spec.script_sha256,
            input_sha256=spec.input_sha256,
            requested_limits=arguments["limits"],
            egress=arguments["egress"] or [],
            requested_at=at,
        )
        ceiling: dict[str, Any] = {}

        def limits_refusal(decision: Any) -> tuple[str, str] | None:
            """The run's own limits: a code-execution tool, an allowed backend, a
            resolved image, the grant's ceiling."""
            if not Tool.objects.filter(name=spec.tool, kind=Tool.Kind.CODE_EXEC).exists():
                # An execute grant on a pipeline trigger or a mailer is not a licence to
                # run arbitrary code: only a code-execution tool's grant starts a sandbox.
                return NOT_CODE_EXEC, (
                    f"{spec.tool!r} is not a code-execution tool: it cannot start a sandbox"
                )
            if spec.backend not in settings.SANDBOX_BACKENDS:
                allowed = ", ".join(settings.SANDBOX_BACKENDS)
                return BACKEND_NOT_ALLOWED, (
                    f"this deployment runs sandboxes only under {allowed}"
                    f" (SANDBOX_BACKENDS); the run asked for {spec.backend}"
                )
            if spec.backend in IMAGE_BACKENDS and not spec.image_id:
                # Nothing to bind the decision (or an approval) to: the name alone could
                # be moved to other bytes before the start.
                return IMAGE_UNRESOLVED, (
                    f"image {spec.image!r} did not resolve to an image id on the runner: "
                    + (spec.image_problem or "the runner sent none")
                )
            grant = _ceiling(decision.grant_id)
            limits = {name: grant[f"limit_{name}"] for name in LIMIT_NAMES}
            try:
                ceiling["effective"] = effective(spec, limits, grant["egress"])
            except (OverCeiling, ValueError) as exc:
                return LIMIT_EXCEEDED, str(exc)
            return None

        token_refusal = access.token_refusal(token_id) if token_id is not None else None

        def refuse(decision: Any) -> tuple[str, str] | None:
            """The run's own limits, then the request's token, asked before the
            confirmation gate, so a run that would be refused anyway neither asks a
            person nor uses an approval up."""
            refused = limits_refusal(decision)
            if refused is None and token_refusal is not None:
                refused = token_refusal(decision)
            return refused

        # The decision first: its gate may consume or open an approval (a row change),
        # and every row change comes before this transaction's first event, which takes
        # the chain lock (see tests/conftest.py::_events_last).
        decision = access_check(
            agent=spec.agent,
            tool=spec.tool,
            action=ActionClass.EXECUTE,
            scope=spec.scope,
            task=spec.task,
            arguments=arguments,
            approval=spec.approval,
            refuse=refuse,
            attachments=review_attachments(spec),
            at=at,
        )
        # Before the requested event, so it names the grant that answered (and says
        # break-glass when that grant is one), as the decision's event just before does.
        run.grant_id = decision.grant_id
        _event(
            run,
            EventType.SANDBOX_RUN_REQUESTED,
            _actor(run.agent),
            at,
            arguments=audit.mask(arguments),  # a command line can carry a secret
            decision_id=decision.decision_id or "",  # the decision's event, just before
        )
        outcome, reason, message = decision.decision, decision.reason, decision.message
        limits, egress = ceiling.get("effective", (None, ())) if decision.allowed else (None, ())
        if decision.allowed and limits is None:  # an allow no ceiling was applied to
            outcome, reason, message = Verdict.DENY, Reason.ERROR, "no ceiling was applied"
        run.decision, run.reason, run.message = outcome, reason, message[:2000]
        run.decision_id = decision.decision_id or ""
        if limits is not None:
            run.limits = {name: getattr(limits, name) for name in LIMIT_NAMES}
            run.egress = [str(d) for d in egress]
        else:
            run.status = SandboxRun.Status.DENIED
        _insert(run)
        if run.status == SandboxRun.Status.DENIED:
            _event(run, EventType.SANDBOX_RUN_DENIED, _actor(run.agent), at, message=message)
    return Authorization(
        outcome=outcome,
        reason=reason,
        message=message,
        run_id=spec.run_id,
        limits=limits,
        egress=tuple(egress),
        grant_id=decision.grant_id,
        approval_id=decision.approval_id,
        decision_id=decision.decision_id,
    )


def _is_uuid(value: str) -> bool:
    try:
        uuid.UUID(value)
    except (ValueError, TypeError, AttributeError):
        return False
    return True


# The statements on the runner's path (request, start, finish) are fixed: written
# once per vendor from the models' own fields and run through governance.db,
# without the ORM's per-call query building.


@functools.cache
def _converters(vendor: str, model: Any, names: tuple[str, ...] | None) -> tuple[Any, ...]:
    """Per column (the model's concrete fields, or those named), the ORM's own
    converters for it: looked up once per vendor, not per row."""
    meta = model._meta
    fields = meta.concrete_fields if names is None else [meta.get_field(n) for n in names]
    return tuple(
        tuple(
            (convert, field.cached_col)
            for convert in connection.ops.get_db_converters(field.cached_col)
            + field.cached_col.get_db_converters(connection)
        )
        for field in fields
    )


def _from_db(model: Any, names: tuple[str, ...] | None, row: Any) -> list[Any]:
    """A row read through governance.db, converted as the ORM converts it."""
    values = []
    for steps, value in zip(_converters(connection.vendor, model, names), row, strict=True):
        for convert, col in steps:
            value = convert(value, col, connection)
        values.append(value)
    return values


@functools.cache
def _ceiling_query(vendor: str) -> tuple[str, str]:
    """The statement and its db.query() kinds (built once per vendor)."""
    quote = connection.ops.quote_name
    meta = Grant._meta
    fields = [meta.get_field(name) for name in GRANT_CEILING]
    # JSON columns as JSON text on PostgreSQL (db.query's "s"; SQLite stores text).
    json_cast = "::text" if vendor == "postgresql" else ""
    columns = [
        quote(field.column) + (json_cast if isinstance(field, JSONField) else "")
        for field in fields
    ]
    sql = f"SELECT {', '.join(columns)} FROM {quote(meta.db_table)} WHERE {quote('id')} = %s"
    return sql, "".join(db.kind_of(field) for field in fields)


def _ceiling(grant_id: int) -> dict[str, Any]:
    """The grant's limits and egress list (one prepared statement)."""
    sql, kinds = _ceiling_query(connection.vendor)
    row = db.query(sql, [grant_id], kinds)[0]
    return dict(zip(GRANT_CEILING, _from_db(Grant, GRANT_CEILING, row), strict=True))


def _insert_fields() -> list[Any]:
    return [field for field in SandboxRun._meta.concrete_fields if not field.primary_key]


@functools.cache
def _insert_sql(vendor: str) -> str:
    quote = connection.ops.quote_name
    fields = _insert_fields()
    columns = ", ".join(quote(field.column) for field in fields)
    values = ", ".join(["%s"] * len(fields))
    table = quote(SandboxRun._meta.db_table)
    return f"INSERT INTO {table} ({columns}) VALUES ({values}) RETURNING {quote('id')}"


def _insert(run: SandboxRun) -> None:
    """run.save(force_insert=True), as one fixed prepared statement."""
    params = [
        field.get_db_prep_save(field.pre_save(run, True), connection) for field in _insert_fields()
    ]
    run.pk = db.query(_insert_sql(connection.vendor), params, "i")[0][0]
    run._state.adding = False
    run._state.db = connection.alias


@functools.cache
def _claim_sql(vendor: str, names: tuple[str, ...]) -> str:
    """One statement per vendor and set of changed columns (built once)."""
    quote = connection.ops.quote_name
    meta = SandboxRun._meta
    sets = ", ".join(f"{quote(meta.get_field(name).column)} = %s" for name in names)
    columns = ", ".join(quote(field.column) for field in meta.concrete_fields)
    return (
        f"UPDATE {quote(meta.db_table)} SET {sets} "
        f"WHERE {quote('run_id')} = %s AND {quote('status')} = %s RETURNING {columns}"
    )


def _claim(run_id: str, expected: str, **changes: Any) -> SandboxRun | None:
    """Move a run on from `expected`; None if someone else moved it first.

    One conditional UPDATE ... RETURNING (PostgreSQL; SQLite >= 3.35): the claim
    and the row the event is written from in one round trip, without the ORM's
    per-call query building (this is
    on the runner's start and finish path). The values are prepared and the row
    converted by the model's own fields, so the instance is what .get() returns.
    """
    if not _is_uuid(run_id):
        return None
    meta = SandboxRun._meta
    names = tuple(sorted(changes))
    params = [meta.get_field(name).get_db_prep_save(changes[name], connection) for name in names]
    params += [db.param_uuid(run_id), expected]
    rows = db.execute(_claim_sql(connection.vendor, names), params)
    if not rows:
        return None
    return SandboxRun.from_db(connection.alias, None, _from_db(SandboxRun, None, rows[0]))


def run_started(
    *,
    run_id: str,
    container_id: str,
    image_digest: str,
    deadline: float,
    enforcement: dict[str, str],
    at: datetime,
    actor: audit.Actor | None = None,
) -> SandboxRun:
    """The start gate: the run may start only if what it was allowed still holds now.
    A state change (a suspension, a revoke) committing while the gate checks makes the
    gate check again, so `sandbox.run.started` is never recorded after a change that
    would have refused it (as access_check() does for decisions). `actor`: who reports
    it (the API's: the run's agent, under its token); the run's agent by default."""
    for _attempt in range(ATTEMPTS):
        try:
            return _run_started(
                run_id=run_id,
                container_id=container_id,
                image_digest=image_digest,
                deadline=deadline,
                enforcement=enforcement,
                at=at,
                actor=actor,
            )
        except audit.StateChanged:
            continue
        except Conflict as refused:
            _start_refused(run_id, refused, container_id, image_digest, at, actor)
            raise
    raise Conflict(
        "state_changing",
        f"The state kept changing over {ATTEMPTS} checks of the start gate; ask again.",
    )


def _start_refused(
    run_id: str,
    refused: Conflict,
    container_id: str,
    image_digest: str,
    at: datetime,
    actor: audit.Actor | None,
) -> None:
    """The start gate's refusal is a decision too: `sandbox.run.start_refused` (deny,
    the refusal's code), in a transaction of its own since the gate's rolled back. The
    run stays `requested`: the runner closes it as failed (or the reaper does)."""
    with transaction.atomic():
        run = (
            SandboxRun.objects.select_related("grant")
            .filter(run_id=run_id, status=SandboxRun.Status.REQUESTED)
            .first()
        )
        if run is None:
            return
        _event(
            run,
            EventType.SANDBOX_RUN_START_REFUSED,
            actor or _actor(run.agent),
            at,
            verdict=(Verdict.DENY, refused.code),
            refused=refused.code,
            message=refused.message,
            container_id=container_id,
            image_digest=image_digest,
        )


def _run_started(
    *,
    run_id: str,
    container_id: str,
    image_digest: str,
    deadline: float,
    enforcement: dict[str, str],
    at: datetime,
    actor: audit.Actor | None,
) -> SandboxRun:
    with transaction.atomic():
        run = _claim(
            run_id,
            SandboxRun.Status.REQUESTED,
            status=SandboxRun.Status.RUNNING,
            started_at=at,
            deadline_at=datetime.fromtimestamp(deadline, UTC),
            container_id=container_id[:100],
            image_digest=image_digest[:100],
            enforcement=enforcement,
        )
        if run is None or run.decision != Verdict.ALLOW:
            raise RuntimeError(f"run {run_id} was not authorized or already started")
        # The deadline is the runner's to report, within the wall time it was allowed
        # (a minute's slack for clocks): the record, and the jobs that close runs past
        # their deadline, must not hold a 60 s run open for a month.
        wall = (run.limits or {}).get("wall_seconds")
        if wall is not None and run.deadline_at > at + timedelta(seconds=wall) + HELD_GRACE:
            raise Conflict(
                "deadline_exceeds_limits",
                f"The reported deadline {run.deadline_at.isoformat()} is past the run's "
                f"{wall} s of wall time from its start.",
            )
        # The start gate: the kill switch (or a revoke) may have landed while the
        # backend built the sandbox. The runner kills what it built before the code
        # runs and closes the run as failed.
        if run.requested_at < at - HELD_GRACE:
            raise Conflict(
                "allow_expired",
                f"The run was allowed at {run.requested_at.isoformat()}; an allow is good "
                f"for {HELD_GRACE.total_seconds():g} s to start. Ask again.",
            )
        if (run.image_id or run.backend in IMAGE_BACKENDS) and image_digest != run.image_id:
            # What started is not what was allowed (and perhaps approved): the runner
            # kills it before the code runs.
            raise Conflict(
                "image_mismatch",
                f"The run was allowed for image {run.image_id}; the sandbox was built from "
                f"{image_digest or 'an unnamed image'}.",
            )
        # Before the gate reads the state: a change committed after this is caught
        # at the append (StateChanged), and the gate checks again.
        seen = audit.head_seq()
        dead = _run_dead_reason(run, at)
        if dead is not None:
            raise Conflict("grant_not_live", f"The run's grant can no longer allow it ({dead}).")
        _event(
            run,
            EventType.SANDBOX_RUN_STARTED,
            actor or _actor(run.agent),
            at,
            seen_seq=seen,
            container_id=container_id,
            image_digest=image_digest,
            limits=run.limits,
            enforcement=enforcement,
            egress=run.egress,
            deadline_at=run.deadline_at.isoformat() if run.deadline_at else None,
        )
    return run


def run_finished(*, run_id: str, result: RunResult, at: datetime) -> SandboxRun | None:
    """Record the outcome. A run the reaper already took stays reaped (None)."""
    return run_finished_summary(run_id=run_id, summary=result.summary(), at=at)


def run_finished_summary(
    *, run_id: str, summary: dict[str, Any], at: datetime, actor: audit.Actor | None = None
) -> SandboxRun | None:
    """run_finished from RunResult.summary() (what a remote runner sends). `actor`: as
    for run_started."""
    out, err = summary["stdout"], summary["stderr"]
    error = summary.get("error") or ""
    changes: dict[str, Any] = {
        "finished_at": at,
        "exit_code": summary["exit_code"],
        "timed_out": summary["timed_out"],
        "oom_killed": summary["oom_killed"],
        "stdout_excerpt": audit.mask(out["excerpt"])[:EXCERPT_CHARS],
        "stdout_sha256": out["sha256"],
        "stdout_bytes": out["bytes"],
        "stderr_excerpt": audit.mask(err["excerpt"])[:EXCERPT_CHARS],
        "stderr_sha256": err["sha256"],
        "stderr_bytes": err["bytes"],
        "error": audit.mask(error)[:2000],  # the runner's words: masked as its output is
    }
    # What ran and how it was held are the start gate's record (checked there, and in
    # sandbox.run.started): a finish report cannot rewrite them. Only a run that never
    # started takes the runner's word for them, and its finished event says so.
    reported = {
        "image_digest": (summary.get("image_digest") or "")[:100],
        "enforcement": summary.get("enforcement") or {},
    }
    never_started = {name: value for name, value in reported.items() if value}
    with transaction.atomic():
        run = _claim(
            run_id, SandboxRun.Status.RUNNING, status=SandboxRun.Status.FINISHED, **changes
        )
        if run is None:
            # Never started (the backend failed): close it as failed.
            run = _claim(
                run_id,
                SandboxRun.Status.REQUESTED,
                status=SandboxRun.Status.FAILED,
                **changes,
                **never_started,
            )
            started_record: dict[str, Any] = never_started
        else:
            # A report that disagrees with the start's record is kept beside it, in the
            # log, never in its place.
            started_record = {
                f"reported_{name}": value
                for name, value in reported.items()
                if value and value != getattr(run, name)
            }
        if run is None:
            return None
        _event(
            run,
            EventType.SANDBOX_RUN_FINISHED,
            actor or _actor(run.agent),
            at,
            exit_code=summary["exit_code"],
            timed_out=summary["timed_out"],
            oom_killed=summary["oom_killed"],
            stdout_sha256=out["sha256"],
            stdout_bytes=out["bytes"],
            stderr_sha256=err["sha256"],
            stderr_bytes=err["bytes"],
            error=changes["error"][:500],  # masked, as on the run's row
            **started_record,
        )
    return run


def run_reaped(*, run_id: str, why: str, actor: audit.Actor, at: datetime) -> SandboxRun | None:
    """The reaper killed the run's container. None if the run was already closed."""
    changes = {
        "status": SandboxRun.Status.REAPED,
        "finished_at": at,
        "timed_out": why == "deadline",
        "error": f"killed by the reaper: {why}",
    }
    with transaction.atomic():
        run = _claim(run_id, SandboxRun.Status.RUNNING, **changes)
        if run is None:
            # The runner died between starting the container and recording the start.
            run = _claim(run_id, SandboxRun.Status.REQUESTED, **changes)
        if run is None:
            return None
        _event(run, EventType.SANDBOX_RUN_REAPED, actor, at, why=why)
    return run


def reap_reason(*, run_id: str, deadline: float, at: datetime) -> str | None:
    """Why a still-running sandbox must die now, or None to leave it.

    Past its deadline; or its grant can no longer allow it (agent suspended: the
    kill switch; grant revoked, expired or narrowed so it no longer covers the run;
    the run's task closed; tool quarantined), asked of the one decision module. A
    container with no run record is someone's leftover: it dies at its deadline like
    any other.
    """
    if deadline <= at.timestamp():
        return "deadline"
    if not _is_uuid(run_id):
        return None
    run = SandboxRun.objects.filter(run_id=run_id).only("grant_id", "image", "task").first()
    if run is None or run.grant_id is None:
        return None
    dead = _run_dead_reason(run, at)
    return str(dead) if dead is not None else None


def _run_dead_reason(run: SandboxRun, at: datetime) -> str | None:
    """Why the run's own call (execute, its image, its task) can no longer be allowed
    under its grant, asked of the decision module: revoked, expired, narrowed so it no
    longer covers the run, the task closed, the agent suspended, the tool quarantined."""
    if run.grant_id is None:
        return Reason.NO_GRANT
    return call_dead_reason(
        run.grant_id,
        action=ActionClass.EXECUTE,
        scope=image_scope(run.image),
        task=run.task or None,
        at=at,
    )


def egress_attempt(
    *, run_id: str, decision: EgressDecision, at: datetime, actor: audit.Actor | None = None
) -> None:
    """One audit event per connection attempt, allowed or denied. An "allowed" attempt
    to a destination the run's grant does not name is refused (409), not recorded: the
    log never says policy let a connection through that the grant forbids (a runner
    that reports one is broken or compromised). `actor`: as for run_started."""
    with transaction.atomic():
        # Locked while its event is written: a finish or reap that committed after a
        # caller saw the run running would otherwise be followed by this event.
        run = SandboxRun.objects.select_for_update().get(run_id=run_id)
        if run.status != SandboxRun.Status.RUNNING:
            raise Conflict(
                "run_state", f"The run is {run.status}; it cannot be reporting egress now."
            )
        if decision.allowed and not _egress_allowed(run, decision):
            raise Conflict(
                "egress_not_in_grant",
                f"{decision.host}:{decision.port} is not among the run's allowed destinations; "
                "an attempt there is reported as denied, never as allowed.",
            )
        _event(
            run,
            EventType.SANDBOX_EGRESS_ALLOWED
            if decision.allowed
            else EventType.SANDBOX_EGRESS_DENIED,
            actor or _actor(run.agent),
            at,
            verdict=(
                Verdict.ALLOW if decision.allowed else Verdict.DENY,
                f"egress_{decision.reason}"[:40],
            ),
            # What the sandbox sent, for a refused request (`bad_request`: its first
            # line): it can carry a secret (`?api_key=`, `user:password@`), masked.
            destination=audit.mask(f"{decision.host}:{decision.port}"),
            address=decision.address,
            egress_reason=decision.reason,
        )


def _egress_allowed(run: SandboxRun, decision: EgressDecision) -> bool:
    """Is the reported destination one of the run's allowed ones, spelled as the proxy
    matches them (sandbox_runner.egress.decide)?"""
    try:
        wanted = destination_of(decision.host, decision.port)
        allowed = {parse_destination(entry) for entry in run.egress or []}
    except ValueError:
        return False
    return wanted in allowed


# A daemon-less run (bubblewrap) has no container for the reaper to find; its sandbox
# dies with its runner. One still "running" this long past its deadline has lost its
# runner (the runner itself kills and records within a poll of the deadline).
ORPHAN_GRACE = timedelta(seconds=5)
# An allowed run is recorded as started within milliseconds of its decision; one still
# "requested" after this long lost its runner while the sandbox was held (the start
# gate never let its code run; bwrap itself may be left blocked in its setup).
HELD_GRACE = timedelta(minutes=1)


def reap_orphans(*, at: datetime) -> list[tuple[str, str]]:
    """Close bubblewrap runs whose runner is gone, and clean what it left behind."""
    from sandbox_runner.backends.bubblewrap import clean_orphan
    from sandbox_runner.runner import workdir_root

    actor = audit.Actor.system("sandbox_reaper")
    bwrap = SandboxRun.objects.filter(backend="bubblewrap")
    due = bwrap.filter(
        status=SandboxRun.Status.RUNNING, deadline_at__lt=at - ORPHAN_GRACE
    ) | bwrap.filter(
        status=SandboxRun.Status.REQUESTED, decision=Verdict.ALLOW, requested_at__lt=at - HELD_GRACE
    )
    closed = []
    for run in due:
        run_id = str(run.run_id)
        clean_orphan(run_id, workdir_root())
        if run_reaped(run_id=run_id, why="runner_gone", actor=actor, at=at):
            closed.append((run_id, "runner_gone"))
    return closed


def reap_all(client: Any = None) -> list[tuple[str, str]]:
    """One reaper pass over the local Docker engine: kill and record every
    sandbox past its deadline or whose grant can no longer allow anything."""
    from django.utils import timezone

    from sandbox_runner import reaper
    from sandbox_runner.runner import workdir_root

    if client is None:
        import docker

        client = docker.from_env(timeout=30)
    actor = audit.Actor.system("sandbox_reaper")

    def why(run_id: str, deadline: float) -> str | None:
        return reap_reason(run_id=run_id, deadline=deadline, at=timezone.now())

    def record(run_id: str, reason: str) -> None:
        try:
            run_reaped(run_id=run_id, why=reason, actor=actor, at=timezone.now())
        except SandboxRun.DoesNotExist:
            pass  # a container with a run id we never recorded: killed, nothing to mark

    reaped = reaper.reap(client, why, record, workdir_root())
    # A container run still "running" past its deadline after that pass has no
    # container here any more (it would have been killed and marked just now).
    return reaped + close_stale_container_runs(at=timezone.now())


def close_stale_container_runs(*, at: datetime) -> list[tuple[str, str]]:
    """Close container runs still "running" well past their deadline: their runner
    died, could not record the end (a refused egress record; a suspended agent's
    remote runner, whose token is refused), or runs on a host whose engine this one
    cannot see. A runner kills its sandbox at the deadline and each host's reaper
    kills what a dead runner left, so nothing of the run is alive by now."""
    actor = audit.Actor.system("sandbox_reaper")
    containers = SandboxRun.objects.filter(backend__in=["docker", "gvisor"])
    stale = containers.filter(
        status=SandboxRun.Status.RUNNING, deadline_at__lt=at - ORPHAN_GRACE
    ) | containers.filter(  # allowed and never started: the allow can no longer start it
        status=SandboxRun.Status.REQUESTED, decision=Verdict.ALLOW, requested_at__lt=at - HELD_GRACE
    )
    closed = []
    for run_id in stale.values_list("run_id", flat=True):
        if run_reaped(run_id=str(run_id), why="runner_gone", actor=actor, at=at):
            closed.append((str(run_id), "runner_gone"))
    return closed
