"""Explicit input and output shapes. Validation of form only: the rules live
in authorize() and the services, never here."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from governance.codes import ActionClass, Reason
from governance.codes import Decision as Verdict
from governance.models import Grant, Tool


class StrictSerializer(serializers.Serializer):
    """Unknown keys are an error, not silently ignored: a body naming an
    `agent` must be refused, never half-obeyed."""

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = sorted(set(data) - set(self.fields))
            if unknown:
                raise serializers.ValidationError(
                    {key: "This field is not accepted here." for key in unknown}
                )
        return super().to_internal_value(data)


class StrictCharField(serializers.CharField):
    """A string, not something that can be turned into one (7 is not "7")."""

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


def exact_char(**kw: Any) -> serializers.CharField:
    """Names and scopes are compared byte for byte: never trimmed."""
    return StrictCharField(trim_whitespace=False, **kw)


class ErrorDetailSerializer(serializers.Serializer):
    code = serializers.CharField()
    message = serializers.CharField()
    fields = serializers.DictField(child=serializers.CharField())


class ErrorSerializer(serializers.Serializer):
    error = ErrorDetailSerializer()


class AuthorizeIn(StrictSerializer):
    tool = exact_char(max_length=100)
    action = serializers.ChoiceField(choices=ActionClass.choices)
    scope = exact_char(max_length=500)
    task = exact_char(max_length=100, required=False, allow_null=True)
    arguments = serializers.DictField(required=False, allow_null=True)
    approval = exact_char(max_length=64, required=False, allow_null=True)


class DecisionOut(serializers.Serializer):
    decision = serializers.ChoiceField(choices=Verdict.choices)
    reason = serializers.ChoiceField(choices=Reason.choices)
    message = serializers.CharField()
    decision_id = serializers.CharField(allow_null=True)
    grant = serializers.IntegerField(allow_null=True)
    approval = serializers.CharField(allow_null=True)
    expires_at = serializers.DateTimeField(allow_null=True)
    break_glass = serializers.BooleanField()


class OutcomeIn(StrictSerializer):
    outcome = serializers.ChoiceField(choices=["succeeded", "failed", "aborted"])
    result_digest = exact_char(max_length=128, required=False, allow_blank=True)
    excerpt = serializers.CharField(max_length=2000, required=False, allow_blank=True)


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
    status = serializers.CharField()
    requested_at = serializers.DateTimeField()
    expires_at = serializers.DateTimeField()
    decided_by = serializers.CharField(source="decided_by.username", allow_null=True, default=None)
    decided_at = serializers.DateTimeField(allow_null=True)
    decision_reason = serializers.CharField()


class ReasonIn(StrictSerializer):
    reason = serializers.CharField(max_length=1000, required=False, allow_blank=True, default="")


class RequiredReasonIn(StrictSerializer):
    reason = serializers.CharField(max_length=1000)


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

    def get_requested_duration_seconds(self, grant: Any) -> int | None:
        duration = grant.requested_duration
        return int(duration.total_seconds()) if duration is not None else None


class GrantRequestIn(StrictSerializer):
    agent = exact_char(max_length=100, required=False, help_text="Humans only: whose grant")
    tool = exact_char(max_length=100)
    actions = serializers.ListField(
        child=serializers.ChoiceField(choices=ActionClass.choices), min_length=1, max_length=5
    )
    scope = exact_char(max_length=500)
    task = exact_char(max_length=100, required=False, allow_null=True)
    duration_seconds = serializers.IntegerField(min_value=1, max_value=10 * 365 * 24 * 3600)
    justification = serializers.CharField(max_length=2000)
    fields = serializers.ListField(
        child=exact_char(max_length=100), required=False, default=list, max_length=100
    )
    egress = serializers.ListField(
        child=exact_char(max_length=300), required=False, default=list, max_length=100
    )
    delegable = serializers.BooleanField(required=False, default=False)


class DelegationIn(StrictSerializer):
    grant = serializers.IntegerField(min_value=1, max_value=2**62)
    agent = exact_char(max_length=100, help_text="The subagent receiving the grant")
    actions = serializers.ListField(
        child=serializers.ChoiceField(choices=ActionClass.choices), min_length=1, max_length=5
    )
    scope = exact_char(max_length=500)
    expires_at = serializers.DateTimeField()
    justification = serializers.CharField(max_length=2000)


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


class EmptyIn(StrictSerializer):
    """A POST that takes no body: anything sent is refused, not ignored."""


class AgentIn(StrictSerializer):
    name = exact_char(max_length=100)
    owner = exact_char(max_length=150, help_text="Username of the accountable human")
    parent = exact_char(max_length=100, required=False, allow_null=True)
    description = StrictCharField(max_length=2000, required=False, allow_blank=True, default="")


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
    expires_days = serializers.IntegerField(
        min_value=1, max_value=3650, required=False, default=30, help_text="Lifetime in days"
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
    name = exact_char(max_length=100)
    kind = serializers.ChoiceField(choices=Tool.Kind.choices)
    actions = serializers.ListField(
        child=serializers.ChoiceField(choices=ActionClass.choices), min_length=1, max_length=5
    )
    # The definition is pinned by hash exactly as sent: never trimmed.
    description = exact_char(max_length=20000, required=False, allow_blank=True, default="")
    input_schema = serializers.DictField(required=False, default=dict)
    third_party = serializers.BooleanField(required=False, default=False)
    irreversible = serializers.BooleanField(required=False, default=False)


class ToolDefinitionIn(StrictSerializer):
    """What the tool now says about itself. A change quarantines the tool."""

    description = exact_char(max_length=20000, required=False, allow_blank=True)
    input_schema = serializers.DictField(required=False)

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
    key = exact_char(max_length=100)
    title = StrictCharField(max_length=200, required=False, allow_blank=True, default="")
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
    limits = serializers.SerializerMethodField()
    delegations = serializers.SerializerMethodField()

    @extend_schema_field(serializers.DictField(child=serializers.FloatField()))
    def get_limits(self, grant: Any) -> dict[str, float]:
        values = {
            "cpus": grant.limit_cpus,
            "memory_mb": grant.limit_memory_mb,
            "pids": grant.limit_pids,
            "wall_seconds": grant.limit_wall_seconds,
        }
        return {key: value for key, value in values.items() if value is not None}

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


class AccessRowOut(serializers.Serializer):
    grant = serializers.IntegerField()
    agent = serializers.CharField()
    owner = serializers.CharField()
    tool = serializers.CharField()
    actions = serializers.ListField(child=serializers.CharField())
    scope = serializers.CharField()
    task = serializers.CharField(allow_null=True)
    starts_at = serializers.DateTimeField()
    expires_at = serializers.DateTimeField()
    requester = serializers.CharField(allow_null=True)
    approver = serializers.CharField(allow_null=True)
    delegated_from = serializers.IntegerField(allow_null=True)
    break_glass = serializers.BooleanField()


class AccessReportOut(serializers.Serializer):
    at = serializers.DateTimeField()
    count = serializers.IntegerField()
    rows = AccessRowOut(many=True)
