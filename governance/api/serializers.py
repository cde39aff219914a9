"""Explicit input and output shapes. Validation of form only: the rules live
in authorize() and the services, never here.

Where a service checks the form of a value (a name's characters, a scope
pattern, the longest grant), the serializer leaves the check to it, so the
caller gets the service's own error code, but the OpenAPI schema declares the
rule (`declared=`), so a client or a fuzzer knows which values are well formed.
Input objects are closed (additionalProperties: false), as StrictSerializer is.
"""

from __future__ import annotations

import codecs
import copy
import re
from datetime import UTC
from typing import Any

from django.conf import settings
from django.http import Http404, QueryDict
from drf_spectacular.extensions import OpenApiSerializerExtension
from drf_spectacular.utils import extend_schema_field
from rest_framework import parsers, serializers
from rest_framework.exceptions import NotAcceptable, ParseError, UnsupportedMediaType
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.utils import json as drf_json

from governance.codes import LIMIT_BOUNDS, ActionClass, Reason
from governance.codes import Decision as Verdict
from governance.models import Grant, Tool
from governance.text import is_text, is_utf8, json_problem

# --- Form rules declared in the schema -----------------------------------------------------
# Each mirrors the service check named beside it exactly: a stricter pattern would make
# well-formed values look malformed, a looser one the reverse.

# services.agents.validate_name (agents and tools)
NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,99}$"
# policy.pattern_is_valid: `*` alone, or segments split on `/` (after an optional
# `kind:` prefix, a name: policy._KIND), none empty, ending in a dot, holding a `;` or
# an NTFS stream name (`::`, `:$`), `*` only as a whole segment.
_SEG = r"(?:\*|\.*{c}(?:(?:{c}|\.)*{c})?)"
_PLAIN = "A-Za-z0-9_~@!$&'()+,;="  # and `-`, which goes last inside [...]
_NO_SEMI = _PLAIN.replace(";", "")
_SEG_NO_COLON = _SEG.format(c=f"[{_NO_SEMI}-]")
_SEG_COLON = _SEG.format(c=f"(?:[{_NO_SEMI}-]|:(?![:$]))")
_KIND = r"[A-Za-z][A-Za-z0-9_+-]*(?:\.[A-Za-z0-9_+-]+)*"  # policy._KIND: a name, no path
SCOPE_PATTERN = (
    rf"^(?:{_SEG_NO_COLON}(?:/{_SEG_NO_COLON})*|{_KIND}:{_SEG_COLON}(?:/{_SEG_COLON})*)$"
)
# services.grants.validate_shape: host or [ipv6]:port, the port 1-65535 in 1 to 5 digits.
_PORT = (
    r"(?:[1-9][0-9]{0,3}|0[1-9][0-9]{0,2}|00[1-9][0-9]?|000[1-9]"
    r"|0(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"
    r"|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])"
)
# The host as sandbox_runner.egress.parse_destination reads it: DNS labels (1-63
# characters, no leading or trailing hyphen) or a bracketed IPv6 address. (Names over
# 253 characters are refused too; a pattern cannot say that without a lookahead.)
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_H16 = r"[0-9a-fA-F]{1,4}"
_IPV6 = (
    rf"(?:(?:{_H16}:){{7}}{_H16}|(?:{_H16}:){{1,7}}:|(?:{_H16}:){{1,6}}:{_H16}"
    rf"|(?:{_H16}:){{1,5}}(?::{_H16}){{1,2}}|(?:{_H16}:){{1,4}}(?::{_H16}){{1,3}}"
    rf"|(?:{_H16}:){{1,3}}(?::{_H16}){{1,4}}|(?:{_H16}:){{1,2}}(?::{_H16}){{1,5}}"
    rf"|{_H16}:(?::{_H16}){{1,6}}|:(?:(?::{_H16}){{1,7}}|:))"
)
EGRESS_PATTERN = rf"^(?:\[{_IPV6}\]|{_LABEL}(?:\.{_LABEL})*):{_PORT}$"
# A grant's field name (services.grants.FIELD_NAME): printable ASCII, no space or comma.
FIELD_PATTERN = r"^[!-+\--~]+$"
# What Python's str.strip() removes, spelled out: regex engines disagree about `\s`
# (ECMA's has U+FEFF but not U+001C-U+001F), and the services strip with Python.
_SPACE = (
    r"\t\n\u000b\u000c\r\u001c-\u0020\u0085\u00a0\u1680\u2000-\u200a"
    r"\u2028\u2029\u202f\u205f\u3000"
)
# Free text a service refuses when it is only whitespace (justification, reasons).
NOT_BLANK_PATTERN = rf"[^{_SPACE}]"
# services.tasks.validate_key: a key is printable ASCII not padded with spaces, with
# no `.` or `..` part between slashes, and does not end in `/close` (its URL would be
# the close action's).
_CONTROL = r"\x00-\x1f\x7f"
TASK_KEY_PATTERN = r"^(?!(?:.*/)?\.{1,2}(?:/|$))(?!.*/close$)[!-~](?:[ -~]*[!-~])?$"
# services.tasks.task_open: a title is one line with no control characters.
TASK_TITLE_PATTERN = rf"^[^{_CONTROL}]*$"


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise ValueError(f"the key {key!r} is given twice in one object")
        seen.add(key)
    return dict(pairs)


def _holds_lone_surrogate(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not is_utf8(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


# A declared charset a JSON body may name (codecs.lookup names: `utf8`, `UTF-8` and
# `us-ascii` are among their aliases; ASCII is UTF-8's subset).
_JSON_CHARSETS = frozenset({"utf-8", "ascii"})


class Negotiation(DefaultContentNegotiation):
    """The API answers JSON whatever the client asks: an unknown `?format=` or an
    `Accept` no renderer meets was a bare 404 or 406 before the token was even read (a
    decision asked with `?format=xml` was never made). The view's first renderer answers."""

    def select_renderer(
        self, request: Any, renderers: list[Any], format_suffix: str | None = None
    ) -> tuple[Any, str]:
        try:
            return super().select_renderer(request, renderers, format_suffix)
        except (Http404, NotAcceptable):
            return renderers[0], renderers[0].media_type


class JSONParser(parsers.JSONParser):
    """DRF's JSON parser (NaN and Infinity refused), and stricter: an object that gives
    one key twice is a malformed request (400), not "the last one wins" (a parser
    further down the line may read the first), a body nested too deeply for the
    decoder (`[[[[...`) is a 400, not a RecursionError (500), and a string or key
    holding a lone surrogate is a 400 (`not_text`): it is not text, cannot be stored,
    and quoting it back in an error would fail the reply itself. A body declared in
    any charset but UTF-8 (or ASCII) is a 415 (`unsupported_charset`)."""

    def parse(self, stream: Any, media_type: Any = None, parser_context: Any = None) -> Any:
        encoding = parsers.get_encoding(parser_context or {})
        if codecs.lookup(encoding).name not in _JSON_CHARSETS:
            # JSON between systems is UTF-8 (RFC 8259, 8.1). Another declared charset
            # (UTF-7, UTF-16, Latin-1) gives the same bytes a second reading: a proxy or
            # filter in front reads `+AC4ALg-` where this service would read `..`.
            raise UnsupportedMediaType(
                media_type,
                detail=f'A JSON body is UTF-8; the request declares charset "{encoding}".',
                code="unsupported_charset",
            )
        try:
            text = codecs.getreader(encoding)(stream).read()
            data = drf_json.loads(
                text, parse_constant=drf_json.strict_constant, object_pairs_hook=_unique_keys
            )
        except RecursionError:
            raise ParseError("JSON parse error - nested too deeply.") from None
        except ValueError as exc:
            raise ParseError(f"JSON parse error - {exc}") from None
        # A lone surrogate reaches the text only as a JSON escape (`\ud800`: the UTF-8
        # decoder refuses an encoded one) or through an odd declared charset (then the
        # text is not ASCII): the common plain body is not walked.
        if ("\\u" in text or not text.isascii()) and _holds_lone_surrogate(data):
            raise ParseError(
                "The body holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
                "escape), which is not text.",
                code="not_text",
            )
        return data


def _merge(schema: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(schema.get(key), dict):
            _merge(schema[key], value)
        else:
            schema[key] = value
    return schema


class ListField(serializers.ListField):
    """A list whose length is checked before its items: DRF validates every item first,
    so 1,200,000 bad items in a 2 MB body held a worker 80 s and answered 90 MB of
    errors, one per item, where the list may hold 256."""

    def to_internal_value(self, data: Any) -> list[Any]:
        if self.max_length is not None and isinstance(data, list) and len(data) > self.max_length:
            self.fail("max_length", max_length=self.max_length)
        return super().to_internal_value(data)


class StrictSerializer(serializers.Serializer):
    """Unknown keys are an error, not silently ignored: a body naming an
    `agent` must be refused, never half-obeyed."""

    # Extra JSON schema for the whole object (minProperties, ...).
    schema_extra: dict[str, Any] = {}

    def to_internal_value(self, data: Any) -> Any:
        # A query string is read as it was sent: a parameter given twice, or given
        # empty (`?tool=`), is an error, not "the last one" or "no filter" (which is
        # what DRF's form handling would make of them).
        if isinstance(data, QueryDict):
            repeated = sorted(key for key, values in data.lists() if len(values) > 1)
            if repeated:
                raise serializers.ValidationError(
                    {key: "Give this parameter once." for key in repeated}
                )
            data = {key: values[0] for key, values in data.lists()}
        if isinstance(data, dict):
            unknown = sorted(set(data) - set(self.fields))
            if unknown:
                raise serializers.ValidationError(
                    {key: "This field is not accepted here." for key in unknown}
                )
        return super().to_internal_value(data)


class StrictSerializerSchema(OpenApiSerializerExtension):
    """The schema of a StrictSerializer: closed, plus each field's declared rules."""

    target_class = StrictSerializer
    match_subclasses = True

    def map_serializer(self, auto_schema: Any, direction: Any) -> Any:
        schema = auto_schema._map_serializer(self.target, direction, bypass_extensions=True)
        schema["additionalProperties"] = False
        _merge(schema, dict(getattr(self.target, "schema_extra", {})))
        serializer = self.target() if isinstance(self.target, type) else self.target
        for name, field in serializer.fields.items():
            declared = getattr(field, "declared", None)
            if declared and name in schema.get("properties", {}):
                _merge(schema["properties"][name], dict(declared))
        return schema


class Declared:
    """A field whose form a service checks; `declared` is its JSON schema for clients."""

    def __init__(self, *args: Any, declared: dict[str, Any] | None = None, **kw: Any) -> None:
        self.declared = declared or {}
        super().__init__(*args, **kw)


class StrictCharField(Declared, serializers.CharField):
    """A string, not something that can be turned into one (7 is not "7"), and
    one that can be stored: no NUL byte, no lone UTF-16 surrogate."""

    default_error_messages = {"not_text": "Not valid text (NUL byte or lone surrogate)."}

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            self.fail("invalid")
        if not is_text(data):
            self.fail("not_text")
        return super().to_internal_value(data)


def exact_char(**kw: Any) -> StrictCharField:
    """Names, scopes and free text are kept byte for byte: never trimmed."""
    return StrictCharField(trim_whitespace=False, **kw)


class StrictIntegerField(Declared, serializers.IntegerField):
    """A JSON number, not a string of digits or a boolean."""

    def to_internal_value(self, data: Any) -> int:
        if isinstance(data, bool) or not isinstance(data, int | float):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictNumberField(serializers.FloatField):
    """A JSON number, not a string of digits or a boolean."""

    def to_internal_value(self, data: Any) -> float:
        if isinstance(data, bool) or not isinstance(data, int | float):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictBooleanField(serializers.BooleanField):
    """true or false, not "yes", 1 or "on"."""

    def to_internal_value(self, data: Any) -> bool:
        if not isinstance(data, bool):
            self.fail("invalid")
        return data


class JSONObjectField(serializers.DictField):
    """A JSON object that can be stored as it is (jsonb refuses NULs, lone surrogates
    and 1e400, read as Infinity; hashing and masking walk it, so its depth is bounded).
    `finite=False` leaves numbers to the service (authorize() denies them, on record)."""

    def __init__(self, *, finite: bool = True, **kw: Any) -> None:
        self.finite = finite
        super().__init__(**kw)

    def to_internal_value(self, data: Any) -> dict[str, Any]:
        value = super().to_internal_value(data)
        problem = json_problem(value, finite=self.finite)
        if problem:
            raise serializers.ValidationError(f"The object {problem}.")
        return value


def _not_only_whitespace(value: str) -> None:
    if not value.strip():
        raise serializers.ValidationError("This field may not be blank.")


def _free_text(**kw: Any) -> StrictCharField:
    """Text that must say something: not blank, not only whitespace. Kept as sent
    (not trimmed), so its length is the length the schema declares."""
    return exact_char(
        declared={"pattern": NOT_BLANK_PATTERN}, validators=[_not_only_whitespace], **kw
    )


class ErrorDetailSerializer(serializers.Serializer):
    code = serializers.CharField()
    message = serializers.CharField()
    fields = serializers.DictField(child=serializers.CharField())


class ErrorSerializer(serializers.Serializer):
    error = ErrorDetailSerializer()


class CopiedFields:
    """Fields copied per instance, not re-built.

    DRF deep-copies every declared field for every serializer instance, which
    re-runs each field's __init__ (a ChoiceField rebuilds its choice maps): about
    half of the cost of reading an /authorize body and rendering its decision.
    A flat field holds no per-request state until bind() gives the copy its name
    and parent, so a shallow copy per instance serves. A field with a child
    (DictField, ListField) is still deep-copied: its child is bound to it.
    """

    _declared_fields: dict[str, serializers.Field]

    def get_fields(self) -> dict[str, serializers.Field]:
        return {
            name: copy.deepcopy(field) if hasattr(field, "child") else _shallow_copy(field)
            for name, field in self._declared_fields.items()
        }


def _shallow_copy(field: serializers.Field) -> serializers.Field:
    # What copy.copy() does for these plain objects, without its generic protocol.
    clone = object.__new__(type(field))
    clone.__dict__.update(field.__dict__)
    return clone


class AuthorizeIn(CopiedFields, StrictSerializer):
    tool = exact_char(max_length=100)
    action = serializers.ChoiceField(choices=ActionClass.choices)
    scope = exact_char(max_length=500)
    task = exact_char(max_length=100, required=False, allow_null=True)
    # 1e400 (read as Infinity) is a denial recorded by authorize(), not a 400.
    arguments = JSONObjectField(finite=False, required=False, allow_null=True)
    approval = exact_char(max_length=64, required=False, allow_null=True)


class DecisionOut(CopiedFields, serializers.Serializer):
    decision = serializers.ChoiceField(choices=Verdict.choices)
    reason = serializers.ChoiceField(choices=Reason.choices)
    message = serializers.CharField()
    decision_id = serializers.CharField(allow_null=True)
    grant = serializers.IntegerField(allow_null=True)
    approval = serializers.CharField(allow_null=True)
    expires_at = serializers.DateTimeField(allow_null=True)
    break_glass = serializers.BooleanField()


# --- /authorize without the serializer machinery ------------------------------------------
# Every agent call goes through /authorize, and building, binding and running
# AuthorizeIn and DecisionOut cost more CPU than the decision's own query. The
# two functions below give the same results for the bodies and decisions they
# handle (tests/test_api_fast_paths.py checks them against the serializers on
# generated input); anything else goes to the serializers, so every error
# still comes from AuthorizeIn, word for word.

_AUTHORIZE_KEYS = frozenset(("tool", "action", "scope", "task", "arguments", "approval"))
_ACTIONS = frozenset(ActionClass.values)
# (key, longest, required): the text fields of AuthorizeIn.
_AUTHORIZE_TEXT = (("tool", 100, True), ("scope", 500, True), ("task", 100, False),
                   ("approval", 64, False))  # fmt: skip


def authorize_body(data: Any) -> dict[str, Any] | None:
    """AuthorizeIn's validated_data for a well-formed body, or None: "ask AuthorizeIn"."""
    if type(data) is not dict or not data.keys() <= _AUTHORIZE_KEYS:
        return None
    out: dict[str, Any] = {}
    for key, longest, required in _AUTHORIZE_TEXT:
        if key not in data:
            if required:
                return None
            continue
        value = data[key]
        if value is None and not required:
            out[key] = None
            continue
        if type(value) is not str or not 0 < len(value) <= longest or not is_text(value):
            return None
        out[key] = value
    action = data.get("action")
    if type(action) is not str or action not in _ACTIONS:
        return None
    out["action"] = action
    if "arguments" in data:
        arguments = data["arguments"]
        if arguments is not None:
            if type(arguments) is not dict or json_problem(arguments, finite=False) is not None:
                return None
            arguments = dict(arguments)
        out["arguments"] = arguments
    return out


def decision_out(body: dict[str, Any]) -> dict[str, Any]:
    """DecisionOut(body).data, for the values a Decision holds."""
    expires = body["expires_at"]
    if expires is not None:
        expires = expires.astimezone(UTC).isoformat()
        if expires.endswith("+00:00"):
            expires = expires[:-6] + "Z"
    decision_id, approval = body["decision_id"], body["approval"]
    return {
        "decision": str(body["decision"]),
        "reason": str(body["reason"]),
        "message": str(body["message"]),
        "decision_id": None if decision_id is None else str(decision_id),
        "grant": None if body["grant"] is None else int(body["grant"]),
        "approval": None if approval is None else str(approval),
        "expires_at": expires,
        "break_glass": bool(body["break_glass"]),
    }


# A digest of what the call returned: hex, optionally named by its algorithm
# ("sha256:9f86d0..."). Nothing else: the field goes into the audit log as sent.
RESULT_DIGEST = re.compile(r"(?:[a-z0-9][a-z0-9-]{0,19}:)?[0-9a-f]{8,128}")


def _is_result_digest(value: str) -> None:
    if value and not RESULT_DIGEST.fullmatch(value):
        raise serializers.ValidationError(
            "Not a digest: lower-case hex (8 to 128 digits), optionally after an "
            'algorithm name and a colon, e.g. "sha256:9f86d081884c7d65".'
        )


class OutcomeIn(StrictSerializer):
    outcome = serializers.ChoiceField(choices=["succeeded", "failed", "aborted"])
    result_digest = exact_char(
        max_length=128,
        required=False,
        allow_blank=True,
        validators=[_is_result_digest],
        declared={"pattern": f"^({RESULT_DIGEST.pattern})?$"},
    )
    excerpt = exact_char(max_length=2000, required=False, allow_blank=True)


class OutcomeOut(serializers.Serializer):
    decision_id = serializers.UUIDField()
    outcome = serializers.CharField()
    event_id = serializers.UUIDField()


class ApprovalOut(serializers.Serializer):
    id = serializers.UUIDField()
    agent = serializers.CharField(source="agent.name")
    tool = serializers.CharField(source="tool.name")
    action = serializers.CharField()
    scope = serializers.CharField()
    task = serializers.CharField(source="task.key", allow_null=True, default=None)
    arguments_hash = serializers.CharField()
    # What would run, secrets and PII masked (as in the audit event): what an approver
    # is asked to approve. A long call is cut, and says so (`_truncated`).
    arguments_preview = serializers.DictField()
    hidden_values = serializers.IntegerField(
        help_text="How many values in arguments_preview are masked (they look like a "
        "credential or personal data): the approval covers them as sent, unseen."
    )
    # A sandbox run's script and input, when its runner sent them: checked against the
    # hashes among the arguments, masked; {"script": {"sha256", "bytes", "text" or
    # "not_shown"}, "input": ...}.
    attachments = serializers.DictField()
    # The confirmation policy that decided it, when no person did.
    policy = serializers.IntegerField(source="policy_id", allow_null=True)
    status = serializers.CharField()
    requested_at = serializers.DateTimeField()
    expires_at = serializers.DateTimeField()
    decided_by = serializers.CharField(source="decided_by.username", allow_null=True, default=None)
    decided_at = serializers.DateTimeField(allow_null=True)
    decision_reason = serializers.CharField()


class ReasonIn(StrictSerializer):
    reason = exact_char(max_length=1000, required=False, allow_blank=True, default="")


class RequiredReasonIn(StrictSerializer):
    reason = _free_text(max_length=1000)


class GrantApproveIn(ReasonIn):
    # Only ever narrows (services.grants._narrowing): false takes away what the request
    # asked for; true on a request that did not ask is 400 invalid_narrowing.
    delegable = StrictBooleanField(
        required=False,
        help_text=(
            "Left out: as requested. false: the agent may not hand the grant to its "
            "subagents (POST /api/v1/delegations), though the request asked for it. true "
            "only on a request that asked for it (else 400 invalid_narrowing): an "
            "approval never widens a request."
        ),
    )


class GrantOut(serializers.Serializer):
    id = serializers.IntegerField()
    agent = serializers.CharField(source="agent.name")
    tool = serializers.CharField(source="tool.name")
    task = serializers.CharField(source="task.key", allow_null=True, default=None)
    actions = serializers.ListField(child=serializers.CharField())
    scope = serializers.CharField()
    fields = serializers.ListField(child=serializers.CharField())
    egress = serializers.ListField(child=serializers.CharField())
    status = serializers.CharField()
    justification = serializers.CharField()
    requested_by = serializers.CharField(
        source="requested_by.username", allow_null=True, default=None
    )
    requested_by_agent = serializers.CharField(
        source="requested_by_agent.name", allow_null=True, default=None
    )
    approved_by = serializers.CharField(
        source="approved_by.username", allow_null=True, default=None
    )
    requested_duration_seconds = serializers.SerializerMethodField()
    starts_at = serializers.DateTimeField(allow_null=True)
    expires_at = serializers.DateTimeField(allow_null=True)
    revoked_at = serializers.DateTimeField(allow_null=True)
    delegated_from = serializers.IntegerField(source="delegated_from_id", allow_null=True)
    delegable = serializers.BooleanField()
    break_glass = serializers.BooleanField()
    use_count = serializers.IntegerField()
    last_used_at = serializers.DateTimeField(allow_null=True)
    # Code-execution ceilings (absent: the runner's floor). In GrantOut, not only the
    # detail view, because a remote sandbox runner reads them from /me.
    limits = serializers.SerializerMethodField()

    @extend_schema_field(serializers.DictField(child=serializers.FloatField()))
    def get_limits(self, grant: Any) -> dict[str, float]:
        return grant.limits()

    def get_requested_duration_seconds(self, grant: Any) -> int | None:
        duration = grant.requested_duration
        return int(duration.total_seconds()) if duration is not None else None


class DeclaredListField(Declared, ListField):
    pass


def _actions(**kw: Any) -> DeclaredListField:
    """Action classes, each at most once (services.grants.validate_shape)."""
    return DeclaredListField(
        child=serializers.ChoiceField(choices=ActionClass.choices),
        min_length=1,
        max_length=5,
        declared={"uniqueItems": True},
        **kw,
    )


def _limit_field(key: str, **kw: Any) -> Any:
    least, most = LIMIT_BOUNDS[key]
    kind = StrictNumberField if key == "cpus" else StrictIntegerField
    return kind(min_value=least, max_value=most, required=False, allow_null=True, **kw)


class LimitsIn(StrictSerializer):
    """Code-execution ceilings: a grant's (requested with it) or a sandbox run's."""

    # codes.LIMIT_BOUNDS: the bounds the service and the matrix file apply too.
    memory_mb = _limit_field("memory_mb")
    cpus = _limit_field("cpus")
    pids = _limit_field("pids")
    wall_seconds = _limit_field("wall_seconds")
    scratch_mb = _limit_field(
        "scratch_mb", help_text="Size of the sandbox's writable /workspace, a tmpfs (MiB)"
    )


class GrantRequestIn(StrictSerializer):
    agent = exact_char(max_length=100, required=False, help_text="Humans only: whose grant")
    tool = exact_char(max_length=100)
    actions = _actions()
    scope = exact_char(max_length=500, declared={"pattern": SCOPE_PATTERN})
    task = exact_char(max_length=100, required=False, allow_null=True)
    # The longest grant is a setting the service enforces (invalid_grant); declared here.
    duration_seconds = StrictIntegerField(
        min_value=1,
        max_value=10 * 365 * 24 * 3600,
        declared={"maximum": int(settings.GRANT_MAX_TTL.total_seconds())},
    )
    justification = _free_text(max_length=2000)
    fields = DeclaredListField(
        child=exact_char(max_length=100),
        required=False,
        default=list,
        max_length=100,
        declared={"items": {"pattern": FIELD_PATTERN}},
    )
    egress = DeclaredListField(
        child=exact_char(max_length=300),
        required=False,
        default=list,
        max_length=100,
        declared={"items": {"pattern": EGRESS_PATTERN}},
    )
    delegable = StrictBooleanField(required=False, default=False)
    # For code execution: the most a sandbox run under this grant may ask for; a key
    # left out takes the runner's floor.
    limits = LimitsIn(required=False, allow_null=True)


class DelegationIn(StrictSerializer):
    grant = StrictIntegerField(min_value=1, max_value=2**62)
    agent = exact_char(max_length=100, help_text="The subagent receiving the grant")
    actions = _actions()
    scope = exact_char(max_length=500, declared={"pattern": SCOPE_PATTERN})
    expires_at = serializers.DateTimeField()
    justification = _free_text(max_length=2000)
    # Left out: the parent grant's own. Given: narrower, or 403 (wider_fields,
    # wider_egress, wider_limits).
    fields = DeclaredListField(
        child=exact_char(max_length=100),
        required=False,
        max_length=100,
        declared={"items": {"pattern": FIELD_PATTERN}},
        help_text="Inside the parent's field list (any list if the parent has none)",
    )
    egress = DeclaredListField(
        child=exact_char(max_length=300),
        required=False,
        max_length=100,
        declared={"items": {"pattern": EGRESS_PATTERN}},
        help_text="Entries of the parent's egress allowlist",
    )
    limits = LimitsIn(
        required=False, allow_null=True, help_text="Each at most the parent's (or the floor)"
    )
    delegable = StrictBooleanField(
        required=False,
        default=False,
        help_text="The subagent may hand it down again, within the depth limit",
    )


class MeOut(serializers.Serializer):
    agent = serializers.CharField()
    owner = serializers.CharField()
    parent = serializers.CharField(allow_null=True)
    status = serializers.CharField()
    grants = GrantOut(many=True)


# --- Admin and automation --------------------------------------------------------------
# Humans with the admin role change the inventory; auditors read it. Same rule as
# above: these check the form of a request, the services check everything else.


def _names(items: Any) -> list[str]:
    return sorted(item.name for item in items.all())


def _sha256_hex(value: str) -> None:
    if not re.fullmatch(r"[0-9a-f]{64}", value):
        raise serializers.ValidationError("A SHA-256 digest: 64 lowercase hex characters.")


class ToolApproveIn(StrictSerializer):
    definition_hash = exact_char(
        min_length=64,
        max_length=64,
        declared={"pattern": "^[0-9a-f]{64}$"},
        validators=[_sha256_hex],
        help_text="The definition_hash of the definition you reviewed (ToolOut)",
    )


class EmptyIn(StrictSerializer):
    """A POST that takes no body: anything sent is refused, not ignored."""


def no_query(query: QueryDict) -> None:
    """A GET that takes no parameters refuses any (400, each named), as the grants
    list refuses a filter it does not know: a misspelled or unsupported filter must
    never be answered with everything."""
    if query:
        EmptyIn(data=query).is_valid(raise_exception=True)


class AgentIn(StrictSerializer):
    name = exact_char(max_length=100, declared={"pattern": NAME_PATTERN})
    owner = exact_char(max_length=150, help_text="Username of the accountable human")
    parent = exact_char(max_length=100, required=False, allow_null=True)
    description = exact_char(max_length=2000, required=False, allow_blank=True, default="")


class AgentOut(serializers.Serializer):
    name = serializers.CharField()
    description = serializers.CharField()
    owner = serializers.CharField(source="owner.username")
    parent = serializers.CharField(source="parent.name", allow_null=True, default=None)
    status = serializers.CharField()
    created_at = serializers.DateTimeField()
    suspended_at = serializers.DateTimeField(allow_null=True)
    subagents = serializers.SerializerMethodField()

    @extend_schema_field(serializers.ListField(child=serializers.CharField()))
    def get_subagents(self, agent: Any) -> list[str]:
        return _names(agent.subagents)


class AgentDetailOut(AgentOut):
    grants = GrantOut(many=True, source="live_grants", help_text="Grants live right now")


class TokenIssueIn(StrictSerializer):
    # The longest lifetime is a setting the service enforces (invalid_expiry); declared here.
    expires_days = StrictIntegerField(
        min_value=1,
        max_value=3650,
        required=False,
        default=30,
        help_text="Lifetime in days",
        declared={"maximum": settings.AGENT_TOKEN_MAX_DAYS},
    )


class TokenOut(serializers.Serializer):
    """A token's bookkeeping. Never its digest, never its plaintext."""

    prefix = serializers.CharField()
    agent = serializers.CharField(source="agent.name", allow_null=True, default=None)
    user = serializers.CharField(source="user.username", allow_null=True, default=None)
    created_at = serializers.DateTimeField()
    created_by = serializers.CharField(source="created_by.username")
    expires_at = serializers.DateTimeField()
    revoked_at = serializers.DateTimeField(allow_null=True)
    last_used_at = serializers.DateTimeField(allow_null=True)


class TokenIssuedOut(TokenOut):
    token = serializers.CharField(
        source="plaintext", help_text="Shown once, stored only as a digest: keep it now."
    )


class ToolIn(StrictSerializer):
    name = exact_char(max_length=100, declared={"pattern": NAME_PATTERN})
    kind = serializers.ChoiceField(choices=Tool.Kind.choices)
    # A repeated action is folded into one by the service, so repeats are allowed here.
    actions = ListField(
        child=serializers.ChoiceField(choices=ActionClass.choices), min_length=1, max_length=5
    )
    # The definition is pinned by hash exactly as sent: never trimmed.
    description = exact_char(max_length=20000, required=False, allow_blank=True, default="")
    input_schema = JSONObjectField(required=False, default=dict)
    third_party = StrictBooleanField(required=False, default=False)
    irreversible = StrictBooleanField(required=False, default=False)


class ToolDefinitionIn(StrictSerializer):
    """What the tool now says about itself. A change quarantines the tool."""

    description = exact_char(max_length=20000, required=False, allow_blank=True)
    input_schema = JSONObjectField(required=False)

    schema_extra = {"minProperties": 1}

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if not attrs:
            raise serializers.ValidationError("Send description, input_schema or both.")
        return attrs


class ToolOut(serializers.Serializer):
    name = serializers.CharField()
    kind = serializers.CharField()
    actions = serializers.ListField(child=serializers.CharField())
    third_party = serializers.BooleanField()
    irreversible = serializers.BooleanField()
    description = serializers.CharField()
    input_schema = serializers.DictField()
    definition_hash = serializers.CharField()
    approved_hash = serializers.CharField()
    approved_definition = serializers.DictField(help_text="The definition an admin approved")
    quarantined = serializers.BooleanField(source="is_quarantined")
    created_at = serializers.DateTimeField()
    updated_at = serializers.DateTimeField()


class TaskIn(StrictSerializer):
    key = exact_char(max_length=100, declared={"pattern": TASK_KEY_PATTERN})
    title = exact_char(
        max_length=200,
        required=False,
        allow_blank=True,
        default="",
        declared={"pattern": TASK_TITLE_PATTERN},
    )
    owner = exact_char(max_length=150, required=False, help_text="Username; default: you")
    ends_at = serializers.DateTimeField(required=False, allow_null=True)


class TaskOut(serializers.Serializer):
    key = serializers.CharField()
    title = serializers.CharField()
    owner = serializers.CharField(source="owner.username")
    status = serializers.CharField()
    starts_at = serializers.DateTimeField()
    ends_at = serializers.DateTimeField(allow_null=True)
    closed_at = serializers.DateTimeField(allow_null=True)


class TaskDetailOut(TaskOut):
    grants = GrantOut(many=True, source="bound_grants", help_text="Every grant bound to the task")


class GrantFilterIn(StrictSerializer):
    agent = exact_char(max_length=100, required=False)
    tool = exact_char(max_length=100, required=False)
    task = exact_char(max_length=100, required=False)
    status = serializers.ChoiceField(choices=Grant.Status.choices, required=False)
    live = serializers.BooleanField(
        required=False, default=False, help_text="Only grants whose window is open now"
    )
    limit = serializers.IntegerField(min_value=1, max_value=500, required=False, default=100)
    before = serializers.IntegerField(
        min_value=1, max_value=2**62, required=False, help_text="Only grants with a lower id"
    )


class GrantDetailOut(GrantOut):
    decided_at = serializers.DateTimeField(allow_null=True)
    decision_reason = serializers.CharField()
    revoked_by = serializers.CharField(source="revoked_by.username", allow_null=True, default=None)
    delegations = serializers.SerializerMethodField()

    @extend_schema_field(serializers.ListField(child=serializers.IntegerField()))
    def get_delegations(self, grant: Any) -> list[int]:
        return sorted(grant.delegations.values_list("pk", flat=True))


class GrantPageOut(serializers.Serializer):
    results = GrantOut(many=True)
    next = serializers.CharField(allow_null=True, help_text="The next page, or null")


class GrantRevokeOut(serializers.Serializer):
    grant = GrantDetailOut()
    ended = serializers.ListField(
        child=serializers.IntegerField(),
        help_text="Grants ended by this call: the grant and its delegated descendants",
    )


class AccessReportIn(StrictSerializer):
    format = serializers.ChoiceField(choices=["json", "csv"], required=False, default="json")
    at = serializers.DateTimeField(required=False, help_text="ISO 8601; default: now")
    agent = serializers.CharField(required=False, max_length=100, help_text="only this agent")
    task = serializers.CharField(
        required=False,
        max_length=100,
        help_text="only calls under this task: its grants and those bound to no task",
    )
    tool = serializers.CharField(required=False, max_length=100, help_text="only this tool")


class AccessRowOut(serializers.Serializer):
    grant = serializers.IntegerField()
    agent = serializers.CharField()
    owner = serializers.CharField()
    tool = serializers.CharField()
    actions = serializers.ListField(child=serializers.CharField())
    scope = serializers.CharField()
    fields = serializers.ListField(
        child=serializers.CharField(), help_text="The argument fields a call may carry (empty: any)"
    )
    egress = serializers.ListField(
        child=serializers.CharField(), help_text="host:port destinations a sandbox run may reach"
    )
    limits = serializers.SerializerMethodField(
        help_text="Code-execution ceilings (absent: the runner's floor)"
    )
    task = serializers.CharField(allow_null=True)
    starts_at = serializers.DateTimeField()
    expires_at = serializers.DateTimeField()
    requester = serializers.CharField(allow_null=True)
    approver = serializers.CharField(allow_null=True)
    delegated_from = serializers.IntegerField(allow_null=True)
    break_glass = serializers.BooleanField()
    blocked_by = serializers.CharField(
        allow_null=True,
        help_text=(
            "Why the grant's live window was not access at `at` (a reason code: the agent "
            "suspended, the tool quarantined, an ancestor grant dead, the task closed; "
            "with `task`, also that task unknown or not open, for a grant bound to no "
            "task), or null."
        ),
    )
    policies = serializers.ListField(
        child=serializers.CharField(),
        help_text=(
            "The confirmation policies in force at `at` that can answer some destructive "
            "call under this grant, as `approve#ID` / `deny#ID`: a destructive call the "
            "grant allows goes ahead without a person when an approve policy covers it, "
            "and is refused when a deny policy does. Listed as the gate would ask them: "
            "the grant's task or none (a task-bound policy while its task is open), an "
            "action the grant holds, a scope overlapping its own, and an approve policy "
            "only while its author has no stake in the agent's calls (owners and tokens "
            "as they are now; the tool's irreversible flag too)."
        ),
    )

    @extend_schema_field(serializers.DictField(child=serializers.FloatField()))
    def get_limits(self, row: dict[str, Any]) -> dict[str, float]:
        return dict(row["limits"])  # as the grant holds them: 512 stays 512


class AccessReportOut(serializers.Serializer):
    at = serializers.DateTimeField()
    count = serializers.IntegerField()
    rows = AccessRowOut(many=True)


# --- Lifecycle: break-glass and reviews (issue #5) ------------------------------------------


class BreakGlassIn(StrictSerializer):
    agent = exact_char(max_length=100)
    tool = exact_char(max_length=100)
    actions = _actions()
    scope = exact_char(max_length=500, declared={"pattern": SCOPE_PATTERN})
    # The format is a setting (BREAKGLASS_TICKET_PATTERN) the service enforces (full match).
    ticket = exact_char(
        max_length=100, declared={"pattern": f"^(?:{settings.BREAKGLASS_TICKET_PATTERN})$"}
    )
    reason = _free_text(max_length=2000)
    # Longer than BREAKGLASS_MAX_TTL or GRANT_MAX_TTL (no grant outlives it), whichever
    # is shorter, is refused by the service (breakglass_ttl_too_long).
    ttl_minutes = StrictIntegerField(
        min_value=1,
        max_value=7 * 24 * 60,
        required=False,
        declared={
            "maximum": int(
                min(settings.BREAKGLASS_MAX_TTL, settings.GRANT_MAX_TTL).total_seconds() // 60
            )
        },
    )
    task = exact_char(max_length=100, required=False, allow_null=True)


class BreakGlassOut(serializers.Serializer):
    id = serializers.IntegerField()
    grant = GrantOut()
    ticket = serializers.CharField()
    reason = serializers.CharField()
    opened_by = serializers.CharField(source="opened_by.username")
    opened_at = serializers.DateTimeField()
    expires_at = serializers.DateTimeField()
    closed_at = serializers.DateTimeField(allow_null=True)
    review_status = serializers.CharField()
    review_due_at = serializers.DateTimeField()
    reviewed_by = serializers.CharField(
        source="reviewed_by.username", allow_null=True, default=None
    )
    review_comment = serializers.CharField()
    ratified_request = serializers.IntegerField(
        source="ratified_request_id", allow_null=True, default=None
    )


class CommentIn(StrictSerializer):
    comment = _free_text(max_length=2000)


class ReviewDecideIn(StrictSerializer):
    decision = serializers.ChoiceField(choices=["keep", "narrow", "revoke"])
    comment = _free_text(max_length=2000)
    # Narrowing only; each optional, never wider than the grant (the service checks).
    actions = _actions(required=False)
    scope = exact_char(max_length=500, required=False, declared={"pattern": SCOPE_PATTERN})
    expires_at = serializers.DateTimeField(required=False)
    delegable = StrictBooleanField(
        required=False,
        help_text=(
            "false: the agent may no longer hand the grant to its subagents, and every "
            "live delegation from it is revoked (with what hangs below). true on a grant "
            "that is not delegable is 403 wider_delegation."
        ),
    )


class ReviewItemOut(serializers.Serializer):
    id = serializers.IntegerField()
    campaign = serializers.IntegerField(source="campaign_id")
    grant = GrantOut()
    reviewer = serializers.CharField(source="reviewer.username", allow_null=True, default=None)
    proposal = serializers.CharField(
        help_text='"remove", "narrow_to_read", "narrow_to_used" or "" (in use)'
    )
    idle_actions = serializers.ListField(
        child=serializers.CharField(), help_text="The actions found unused (with a proposal)"
    )
    status = serializers.CharField()
    due_at = serializers.DateTimeField()
    decided_by = serializers.CharField(source="decided_by.username", allow_null=True, default=None)
    decided_at = serializers.DateTimeField(allow_null=True)
    comment = serializers.CharField()


# --- Confirmation policies -------------------------------------------------------------


class ConfirmationPolicyIn(StrictSerializer):
    agent = exact_char(max_length=100)
    tool = exact_char(max_length=100)
    action = serializers.ChoiceField(choices=ActionClass.choices)
    scope = exact_char(
        max_length=500,
        declared={"pattern": SCOPE_PATTERN},
        help_text="A scope pattern, matched as a grant's. A deny reads wider: its "
        "trailing `*` also covers the resource it sits under, and it matches without "
        "regard to case: `repo:acme/prod/*` denies `repo:acme/prod` and `repo:acme/PROD/x`.",
    )
    task = exact_char(max_length=100, required=False, allow_null=True)
    verdict = serializers.ChoiceField(choices=["approve", "deny"])
    reason = _free_text(max_length=2000)
    # At most GRANT_MAX_TTL, which the service enforces (duration_too_long); declared here.
    duration_seconds = StrictIntegerField(
        min_value=1,
        max_value=10 * 365 * 24 * 3600,
        declared={"maximum": int(settings.GRANT_MAX_TTL.total_seconds())},
    )


class ConfirmationPolicyOut(serializers.Serializer):
    id = serializers.IntegerField()
    agent = serializers.CharField(source="agent.name")
    tool = serializers.CharField(source="tool.name")
    action = serializers.CharField()
    scope = serializers.CharField()
    task = serializers.CharField(source="task.key", allow_null=True, default=None)
    verdict = serializers.CharField()
    reason = serializers.CharField()
    created_by = serializers.CharField(source="created_by.username")
    created_at = serializers.DateTimeField()
    starts_at = serializers.DateTimeField()
    expires_at = serializers.DateTimeField()
    revoked_at = serializers.DateTimeField(allow_null=True)
    revoked_by = serializers.CharField(source="revoked_by.username", allow_null=True, default=None)
    revoke_reason = serializers.CharField()
