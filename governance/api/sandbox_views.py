"""The sandbox runner's REST door (the HTTP authorizer adapter, issue #4).

A runner on another host holds an agent's token and reports through these:

    POST sandbox/runs                      ask to run: decision + run record (run_request)
    POST sandbox/runs/{run_id}/started     the sandbox is up (run_started)
    POST sandbox/runs/{run_id}/egress      one connection attempt (egress_attempt)
    POST sandbox/runs/{run_id}/finished    how it ended (run_finished_summary)

Each writes through governance.services.sandbox, the same functions the
in-process adapter calls. The agent is always the token's agent; a report names
the run and the decision id the agent received for it, and a run of another
agent (or a mismatched decision id) answers exactly like a missing one (404).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import math
import re
from typing import Any

import psycopg
from django.db import IntegrityError
from django.utils import timezone
from drf_spectacular.utils import OpenApiExample, extend_schema
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from governance.api.auth import IsAgent
from governance.api.serializers import (
    Declared,
    JSONObjectField,
    LimitsIn,
    ListField,
    StrictBooleanField,
    StrictCharField,
    StrictIntegerField,
    StrictNumberField,
    StrictSerializer,
    exact_char,
    no_query,
)
from governance.api.views import ERRORS, actor_for, limit
from governance.errors import Conflict, GovernanceError, NotFound
from governance.models import SandboxRun
from governance.services import sandbox
from governance.text import is_text
from sandbox_runner.backends import REGISTRY
from sandbox_runner.egress import EgressDecision
from sandbox_runner.spec import (
    DEFAULT_TOOL,
    EXCERPT_CHARS,
    IMAGE_ID,
    LIMIT_NAMES,
    REVIEW_MAX_BYTES,
    RunSpec,
    host_image_problem,
)

SHA256 = re.compile(r"[0-9a-f]{64}")
EGRESS_REASONS = (
    "allowed",
    "not_allowlisted",
    "bad_destination",
    "bad_request",
    "unresolvable",
    "internal_address",
    "sni_mismatch",
    "sni_missing",
    "sni_hidden",
    "not_tls",
    "not_served",  # still waiting to be served when the run ended
    "not_recorded_in_time",  # allowed, but refused: its record was not written in time
    "http_in_tunnel",  # from runners older than not_tls, which replaced it
)


def _sha256(**kw: Any) -> StrictCharField:
    return StrictCharField(
        max_length=64,
        allow_blank=True,
        validators=[_is_sha256],
        declared={"pattern": "^([0-9a-f]{64})?$"},
        **kw,
    )


def _is_sha256(value: str) -> None:
    if value and not SHA256.fullmatch(value):
        raise serializers.ValidationError("Not a lower-case hex SHA-256.")


def _is_image_id(value: str) -> None:
    if value and not IMAGE_ID.fullmatch(value):
        raise serializers.ValidationError("Not an image id: sha256: and 64 lower-case hex digits.")


class StrictUUIDField(serializers.UUIDField):
    """A UUID in a JSON string (DRF would also take an integer, even `false`)."""

    def to_internal_value(self, data: Any) -> Any:
        if not isinstance(data, str):
            self.fail("invalid", value=data)
        return super().to_internal_value(data)


class Base64BytesField(StrictCharField):
    """Bytes as standard, padded base64; at most REVIEW_MAX_BYTES once decoded."""

    default_error_messages = {
        "not_base64": "Not standard, padded base64.",
        "too_long": f"At most {REVIEW_MAX_BYTES} bytes once decoded.",
    }

    def __init__(self, **kw: Any) -> None:
        pattern = "^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"
        super().__init__(
            max_length=4 * -(-REVIEW_MAX_BYTES // 3),
            allow_blank=True,
            declared={"pattern": pattern, "format": "byte"},
            **kw,
        )

    def run_validation(self, data: Any = serializers.empty) -> Any:
        if data == "":  # CharField hands a blank back as it is, never decoded
            return b""
        return super().run_validation(data)

    def to_internal_value(self, data: Any) -> bytes:  # type: ignore[override]
        text = super().to_internal_value(data)
        try:
            raw = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            self.fail("not_base64")
        if len(raw) > REVIEW_MAX_BYTES:
            self.fail("too_long")
        return raw


def _review_bytes(what: str) -> Base64BytesField:
    return Base64BytesField(
        required=False,
        help_text=(
            f"The {what}'s bytes, base64, when at most {REVIEW_MAX_BYTES} bytes: a person "
            f"asked to approve the run reads them (masked). Their SHA-256 must be "
            f"{what}_sha256 when that is sent too."
        ),
    )


class SandboxRunIn(StrictSerializer):
    run_id = StrictUUIDField()
    task = exact_char(max_length=100, required=False, allow_null=True)
    tool = exact_char(max_length=100, required=False, default=DEFAULT_TOOL)
    backend = serializers.ChoiceField(choices=sorted(REGISTRY))
    image = exact_char(
        max_length=300,
        help_text=(
            "The image to run (its name on the runner's engine). A host backend "
            "(bubblewrap) runs the host's /usr, not an image: its runs are the image `host` "
            "(scope `sandbox:host`); it takes `host` or the default name, and any other is "
            "400 `invalid_image`."
        ),
    )
    image_id = StrictCharField(
        max_length=71,
        allow_blank=True,
        required=False,
        default="",
        validators=[_is_image_id],
        declared={"pattern": "^(sha256:[0-9a-f]{64})?$"},
        help_text=(
            "The id of the image `image` names on the runner's engine (`sha256:` and 64 hex "
            "digits), resolved before asking: the decision and any approval bind it, and "
            "the runner starts exactly it. Empty when the backend has no image (bubblewrap) "
            "or the name did not resolve. `started` must report the same image. A docker "
            "or gvisor run without one is refused (`image_unresolved`)."
        ),
    )
    image_problem = exact_char(
        max_length=500,
        required=False,
        allow_blank=True,
        default="",
        help_text="Why the runner could not resolve `image` to an id (kept on the refusal).",
    )
    command = ListField(child=exact_char(max_length=4096), min_length=1, max_length=256)
    script_sha256 = _sha256(required=False, default="")
    input_sha256 = _sha256(required=False, default="")
    script_base64 = _review_bytes("script")
    input_base64 = _review_bytes("input")
    limits = LimitsIn(required=False)
    egress = ListField(
        child=exact_char(max_length=300), max_length=64, required=False, allow_null=True
    )
    approval = exact_char(
        max_length=64,
        required=False,
        allow_null=True,
        help_text=(
            "An approved approval for exactly this run (a destructive execute: the tool is "
            "irreversible), as `approval` in an earlier `approval_required` answer; used once."
        ),
    )

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if problem := host_image_problem(attrs.get("backend", ""), attrs.get("image", "")):
            raise GovernanceError("invalid_image", problem, fields={"image": problem})
        for what in ("script", "input"):
            raw = attrs.get(f"{what}_base64")
            sent = attrs.get(f"{what}_sha256")
            if raw is not None and sent and hashlib.sha256(raw).hexdigest() != sent:
                # A rule across two fields that no schema can state: its own code.
                raise GovernanceError(
                    "hash_mismatch",
                    f"The SHA-256 of {what}_base64 is not {what}_sha256.",
                    fields={f"{what}_base64": f"Its SHA-256 is not {what}_sha256."},
                )
        return attrs


class SandboxLimitsOut(serializers.Serializer):
    memory_mb = serializers.IntegerField()
    cpus = serializers.FloatField()
    pids = serializers.IntegerField()
    wall_seconds = serializers.IntegerField()
    scratch_mb = serializers.IntegerField()


class SandboxRunOut(serializers.Serializer):
    run_id = serializers.UUIDField()
    decision = serializers.CharField()
    reason = serializers.CharField()
    message = serializers.CharField(allow_blank=True)
    decision_id = serializers.CharField(allow_null=True)
    grant = serializers.IntegerField(allow_null=True)
    approval = serializers.CharField(allow_null=True)
    limits = SandboxLimitsOut(allow_null=True)
    egress = serializers.ListField(child=serializers.CharField())


class ReportIn(StrictSerializer):
    decision_id = exact_char(max_length=36, min_length=1)


class DeclaredDictField(Declared, serializers.DictField):
    pass


def _enforcement(value: dict[str, str]) -> None:
    if len(value) > 16 or not all(is_text(k) for k in value):
        raise serializers.ValidationError("At most 16 entries, named in storable text.")


def _enforcement_field() -> serializers.DictField:
    """How each limit was enforced, e.g. {"memory_mb": "cgroup"}."""
    return DeclaredDictField(
        child=exact_char(max_length=40),
        required=False,
        validators=[_enforcement],
        declared={"maxProperties": 16},
    )


class StartedIn(ReportIn):
    container_id = exact_char(max_length=100, allow_blank=True)
    image_digest = exact_char(max_length=100, allow_blank=True)
    deadline = StrictNumberField(min_value=0, max_value=1e11)
    enforcement = _enforcement_field()


class StreamIn(StrictSerializer):
    """One output stream: the start of it (cut at EXCERPT_CHARS, bytes that are not UTF-8
    or NUL shown as U+FFFD), its length and its SHA-256, as the runner captured it. The
    excerpt cannot be longer than the stream, and an excerpt that is the whole stream
    (as many UTF-8 bytes, nothing replaced) must have the stream's hash: a report of
    "all tests passed" with the hash of "FAILED" was stored as it came."""

    excerpt = exact_char(max_length=EXCERPT_CHARS, allow_blank=True)
    sha256 = _sha256()
    bytes = StrictIntegerField(min_value=0, max_value=1 << 62)
    truncated = StrictBooleanField()

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        # Rules across the fields that no schema can state: their own code.
        shown = attrs["excerpt"].encode("utf-8")
        problem = ""
        if len(shown) > attrs["bytes"]:
            problem = f"The excerpt holds {len(shown)} bytes; the stream had {attrs['bytes']}."
        elif len(shown) == attrs["bytes"] and "\ufffd" not in attrs["excerpt"]:
            if hashlib.sha256(shown).hexdigest() != attrs["sha256"]:
                problem = "The excerpt is the whole stream, and sha256 is not its SHA-256."
        if problem:
            raise GovernanceError(
                "stream_mismatch", problem, fields={f"{self.field_name}.sha256": problem}
            )
        return attrs


class FinishedIn(ReportIn):
    """What the run did. `image_digest` and `enforcement` are the runner's report: they
    go on the run's record only for a run that never started; for a started run the
    start's record stands and a report that differs is kept in the finished event."""

    container_id = exact_char(max_length=100, allow_blank=True, required=False, default="")
    image_digest = exact_char(max_length=100, allow_blank=True, required=False, default="")
    enforcement = _enforcement_field()
    exit_code = StrictIntegerField(min_value=-1024, max_value=1024, allow_null=True)
    timed_out = StrictBooleanField()
    oom_killed = StrictBooleanField()
    stdout = StreamIn()
    stderr = StreamIn()
    error = exact_char(max_length=2000, allow_blank=True, required=False, default="")


class EgressIn(ReportIn):
    # Allowed exactly when the reason is `allowed`: one field, so they cannot disagree.
    reason = serializers.ChoiceField(choices=EGRESS_REASONS)
    host = exact_char(max_length=300, min_length=1)
    port = StrictIntegerField(min_value=0, max_value=65535)
    address = exact_char(max_length=64, required=False, allow_null=True, default=None)


class ReportOut(serializers.Serializer):
    run_id = serializers.UUIDField()
    status = serializers.CharField()


class EgressOut(serializers.Serializer):
    run_id = serializers.UUIDField()
    logged = JSONObjectField()


class LiveOut(serializers.Serializer):
    run_id = serializers.UUIDField()
    live = serializers.BooleanField()
    reason = serializers.CharField(
        allow_null=True,
        help_text="Why the run must stop now (the grant's dead reason), or null.",
    )


def _run_body(run_id: str, auth: Any) -> dict[str, Any]:
    limits = auth.limits
    return {
        "run_id": run_id,
        "decision": auth.outcome,
        "reason": auth.reason,
        "message": auth.message,
        "decision_id": auth.decision_id,
        "grant": auth.grant_id if auth.outcome == "allow" else None,  # as /authorize
        "approval": auth.approval_id,
        "limits": {n: getattr(limits, n) for n in LIMIT_NAMES} if limits else None,
        "egress": [str(d) for d in auth.egress],
    }


class SandboxRunView(APIView):
    permission_classes = [IsAgent]

    @extend_schema(
        operation_id="sandbox_run_request",
        request=SandboxRunIn,
        responses={201: SandboxRunOut, 409: ERRORS[400], **ERRORS},
        description=(
            "Ask to run code in a sandbox: an `execute` decision on the tool for the token's "
            "agent, with the grant's limits and egress as the ceiling. The run is recorded "
            "whatever the answer; only `decision: allow` (with limits) may start anything."
        ),
        examples=[
            OpenApiExample(
                "A Python script in the default image",
                value={
                    "run_id": "0b5f2c1e-8f43-4c59-9e0f-3b7c2a1d9e10",
                    "task": "SBX-1",
                    "backend": "docker",
                    "image": "governance-sandbox:bookworm",
                    "command": ["python3", "/sandbox/script"],
                    "script_sha256": "a" * 64,
                    "limits": {"memory_mb": 128},
                },
                request_only=True,
            )
        ],
    )
    def post(self, request: Request) -> Response:
        limit(request, "authorize", fail_closed=False)
        body = SandboxRunIn(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        run_id = str(data["run_id"])
        if SandboxRun.objects.filter(run_id=run_id).exists():
            raise Conflict("run_exists", "A run with this run_id is already recorded.")
        limits = data.get("limits") or {}
        spec = RunSpec(
            agent=request.user.agent.name,
            task=data.get("task"),
            command=tuple(data["command"]),
            tool=data["tool"],
            backend=data["backend"],
            image=data["image"],
            image_id=data["image_id"],
            image_problem=data["image_problem"],
            limits={n: limits.get(n) for n in LIMIT_NAMES},
            egress=tuple(data["egress"]) if data.get("egress") is not None else None,
            run_id=run_id,
            # With the bytes, their hash is taken here (and was checked against the one
            # sent); without them, the hash sent is what the decision binds.
            script=data.get("script_base64"),
            input=data.get("input_base64"),
            script_hash=data["script_sha256"],
            input_hash=data["input_sha256"],
            approval=data.get("approval"),
        )
        try:
            auth = sandbox.run_request(spec=spec, at=timezone.now(), token_id=request.auth.pk)
        except (IntegrityError, psycopg.errors.UniqueViolation):  # one run_id, twice at once
            raise Conflict("run_exists", "A run with this run_id is already recorded.") from None
        return Response(SandboxRunOut(_run_body(run_id, auth)).data, status=201)


def _own_run(request: Request, run_id: Any, decision_id: str) -> SandboxRun:
    """The caller's run (another agent's is a 404), reported under its decision id."""
    run = SandboxRun.objects.filter(run_id=run_id, agent=request.user.agent.name).first()
    if run is None:
        raise NotFound("not_found", "No such sandbox run.")
    if not run.decision_id or run.decision_id != decision_id:
        raise Conflict(
            "decision_mismatch",
            "This run was decided under another decision id; report it under that one.",
        )
    return run


def _conflict(run: SandboxRun, what: str) -> Conflict:
    return Conflict("run_state", f"The run is {run.status}; it cannot be {what} now.")


class SandboxStartedView(APIView):
    permission_classes = [IsAgent]

    @extend_schema(
        operation_id="sandbox_run_started",
        request=StartedIn,
        responses={200: ReportOut, 409: ERRORS[400], **ERRORS},
        description="The allowed run's sandbox is up. Once per run, yours only.",
    )
    def post(self, request: Request, run_id: Any) -> Response:
        # Not counted: accepted once per run, and the run was counted when it was
        # asked for. An agent that spends its /authorize budget must not leave its
        # runs without their start and end on the record.
        body = StartedIn(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        run = _own_run(request, run_id, data["decision_id"])
        try:
            run = sandbox.run_started(
                run_id=str(run.run_id),
                container_id=data["container_id"],
                image_digest=data["image_digest"],
                deadline=data["deadline"],
                enforcement=data.get("enforcement") or {},
                at=timezone.now(),
                actor=actor_for(request),
            )
        except RuntimeError:
            run.refresh_from_db()
            raise _conflict(run, "started") from None
        return Response(ReportOut({"run_id": run.run_id, "status": run.status}).data)


class SandboxFinishedView(APIView):
    permission_classes = [IsAgent]

    @extend_schema(
        operation_id="sandbox_run_finished",
        request=FinishedIn,
        responses={200: ReportOut, 409: ERRORS[400], **ERRORS},
        description=(
            "How the run ended (exit code, timeout, OOM, output hashes and excerpts). "
            "A run never started is closed as failed; a run already closed is a conflict."
        ),
    )
    def post(self, request: Request, run_id: Any) -> Response:
        # Not counted: accepted once per run (see SandboxStartedView).
        body = FinishedIn(data=request.data)
        body.is_valid(raise_exception=True)
        data = dict(body.validated_data)
        run = _own_run(request, run_id, data.pop("decision_id"))
        closed = sandbox.run_finished_summary(
            run_id=str(run.run_id), summary=data, at=timezone.now(), actor=actor_for(request)
        )
        if closed is None:
            run.refresh_from_db()
            raise _conflict(run, "finished")
        return Response(ReportOut({"run_id": closed.run_id, "status": closed.status}).data)


class SandboxEgressView(APIView):
    permission_classes = [IsAgent]

    @extend_schema(
        operation_id="sandbox_run_egress",
        request=EgressIn,
        responses={201: EgressOut, 409: ERRORS[400], **ERRORS},
        description="One connection attempt through the run's egress proxy, allowed or denied.",
    )
    def post(self, request: Request, run_id: Any) -> Response:
        # Its own budget: an agent spending its /authorize one does not silence the
        # record of its sandbox's connections. Spent, the runner stops the sandbox.
        limit(request, "sandbox_egress", fail_closed=False)
        body = EgressIn(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        run = _own_run(request, run_id, data["decision_id"])
        if run.status != SandboxRun.Status.RUNNING:
            raise _conflict(run, "reporting egress")
        decision = EgressDecision(
            allowed=data["reason"] == "allowed",
            reason=data["reason"],
            host=data["host"],
            port=data["port"],
            address=data["address"],
        )
        sandbox.egress_attempt(
            run_id=str(run.run_id), decision=decision, at=timezone.now(), actor=actor_for(request)
        )
        logged = {"destination": f"{decision.host}:{decision.port}", "allowed": decision.allowed}
        return Response(
            EgressOut({"run_id": run.run_id, "logged": logged}).data,
            status=status.HTTP_201_CREATED,
        )


class SandboxLiveView(APIView):
    permission_classes = [IsAgent]

    @extend_schema(
        operation_id="sandbox_run_live",
        responses={200: LiveOut, **ERRORS},
        description=(
            "May this run go on? Asked by a remote runner every few seconds while its "
            "sandbox runs: live is false once the grant can no longer allow it (agent "
            "suspended, grant revoked or expired, tool quarantined, task closed), and the "
            "runner stops it. Yours only."
        ),
    )
    def get(self, request: Request, run_id: Any) -> Response:
        no_query(request.query_params)
        # Not rate-limited: the agent holds the same token, and could otherwise spend
        # its own limit so that the runner's question gets a 429 (no answer, so the run
        # goes on) and a revocation never reaches its sandbox.
        run = SandboxRun.objects.filter(run_id=run_id, agent=request.user.agent.name).first()
        if run is None:
            raise NotFound("not_found", "No such sandbox run.")
        # The runner owns the deadline; this is the reaper's other question.
        reason = sandbox.reap_reason(run_id=str(run.run_id), deadline=math.inf, at=timezone.now())
        return Response(
            LiveOut({"run_id": run.run_id, "live": reason is None, "reason": reason}).data
        )
