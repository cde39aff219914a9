"""Explicit input and output shapes. Validation of form only: the rules live
in authorize() and the services, never here."""

from __future__ import annotations

from typing import Any

from rest_framework import serializers

from governance.codes import ActionClass, Reason
from governance.codes import Decision as Verdict


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
