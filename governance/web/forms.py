"""Strict forms: every field typed and bounded, unknown fields refused.

Forms only parse; the rules (what may be narrowed, who may approve) live in
the services, which the views call with the cleaned values.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from django import forms
from django.conf import settings

from governance.codes import ActionClass, Decision, EventType, Reason
from governance.models import ReviewItem, SandboxRun, Tool
from governance.services import exports

ACTION_CHOICES = ActionClass.choices


class StrictForm(forms.Form):
    """Refuses fields it does not know (a typo must not be silently ignored)."""

    ALWAYS_ALLOWED = frozenset({"csrfmiddlewaretoken"})

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        unknown = set(self.data) - set(self.fields) - self.ALWAYS_ALLOWED
        if unknown:
            raise forms.ValidationError(f"Unknown field(s): {', '.join(sorted(unknown))}.")
        return cleaned


# A day inside the calendar's ends, so the moment, in UTC and a day either side of it
# (a window, a page's local time), is still a date Python and the databases can hold.
_EARLIEST = datetime(1, 1, 2, tzinfo=UTC)
_LATEST = datetime(9999, 12, 30, tzinfo=UTC)


class MomentField(forms.DateTimeField):
    """A date-time a page can use: `0001-01-01T00:00+05:00` is a valid ISO string but
    a moment before year 1 in UTC, which would crash the query or the page. Refused
    with a message, as any malformed value is."""

    def to_python(self, value: Any) -> datetime | None:
        moment = super().to_python(value)
        if moment is None:
            return None
        try:
            in_range = _EARLIEST <= moment.astimezone(UTC) <= _LATEST
        except OverflowError:
            in_range = False
        if not in_range:
            raise forms.ValidationError(
                "Give a moment between 0001-01-02 and 9999-12-30 (UTC).", code="out_of_range"
            )
        # In UTC from here on: PostgreSQL refuses an offset past 15:59 or with a fraction
        # of a second (`+23:00`, `+05:45:30.5`), both of which Python accepts.
        return moment.astimezone(UTC)


class ReasonForm(StrictForm):
    reason = forms.CharField(max_length=1000, required=False, strip=True)


class RequiredReasonForm(StrictForm):
    reason = forms.CharField(max_length=1000, required=True, strip=True)


class ToolApproveForm(StrictForm):
    """The definition the approver reviewed, by its hash (the page sends it)."""

    definition_hash = forms.RegexField(regex=r"\A[0-9a-f]{64}\Z", required=True)


class ApproveRequestForm(StrictForm):
    """Approve, optionally narrowed: fewer actions, a narrower scope, a shorter window,
    not delegable though the request asked."""

    actions = forms.MultipleChoiceField(choices=ACTION_CHOICES, required=False)
    # Set by the page's form, whose checkboxes list the requested actions: then
    # no box ticked means "no actions" (refused), not "as requested".
    actions_listed = forms.BooleanField(required=False)
    scope = forms.CharField(max_length=500, required=False, strip=True)
    duration_hours = forms.DecimalField(
        min_value=0.01, max_digits=8, decimal_places=2, required=False
    )
    reason = forms.CharField(max_length=1000, required=False, strip=True)
    delegable = forms.BooleanField(required=False)
    # Set by the page beside its delegable checkbox: an unticked box sends nothing, and
    # must read as "not delegable", not "as requested".
    delegable_listed = forms.BooleanField(required=False)

    def narrowing(self) -> dict[str, Any]:
        data = self.cleaned_data
        out: dict[str, Any] = {}
        if data.get("actions") or data.get("actions_listed"):
            out["actions"] = list(data.get("actions") or [])
        if data.get("delegable") or data.get("delegable_listed"):
            out["delegable"] = bool(data.get("delegable"))
        if data.get("scope"):
            out["scope"] = data["scope"]
        if data.get("duration_hours"):
            out["duration"] = timedelta(hours=float(data["duration_hours"]))
        return out


class TokenForm(StrictForm):
    days = forms.IntegerField(min_value=1, max_value=3650, initial=30)
    # The one-time id of the form as the agent's page showed it (views.token_issue).
    form_id = forms.CharField(max_length=64)

    def clean_days(self) -> int:
        days = self.cleaned_data["days"]
        if days > settings.AGENT_TOKEN_MAX_DAYS:
            raise forms.ValidationError(f"At most {settings.AGENT_TOKEN_MAX_DAYS} days.")
        return days


# A page number past the last page shows the last; past this one it is malformed.
PAGE_MAX = 1_000_000
ID_MAX = 2**63 - 1  # a larger id would overflow the database's bigint: a 500, not a 400


def _choices(values: list[str]) -> list[tuple[str, str]]:
    return [("", "any"), *[(v, v) for v in values]]


class MatrixFilterForm(StrictForm):
    task = forms.CharField(max_length=100, required=False)
    owner = forms.CharField(max_length=150, required=False)
    kind = forms.ChoiceField(choices=_choices(list(Tool.Kind.values)), required=False)
    agent = forms.CharField(max_length=100, required=False, label="agent name contains")
    page = forms.IntegerField(min_value=1, max_value=PAGE_MAX, required=False)


class AuditFilterForm(StrictForm):
    start = MomentField(required=False, label="from")
    end = MomentField(required=False, label="to")
    agent = forms.CharField(max_length=100, required=False)
    task = forms.CharField(max_length=100, required=False)
    tool = forms.CharField(max_length=100, required=False)
    decision = forms.ChoiceField(choices=_choices(list(Decision.values)), required=False)
    reason = forms.ChoiceField(choices=_choices(list(Reason.values)), required=False)
    actor = forms.CharField(max_length=200, required=False)
    event_type = forms.ChoiceField(choices=_choices(list(EventType.values)), required=False)
    before = forms.IntegerField(min_value=1, required=False)
    format = forms.ChoiceField(choices=_choices(list(exports.FORMATS)), required=False)

    def filters(self) -> dict[str, Any]:
        data = self.cleaned_data
        keys = ("start", "end", "agent", "task", "tool", "decision", "reason", "actor")
        out = {k: data[k] for k in keys if data.get(k) not in (None, "")}
        if data.get("event_type"):
            out["event_type"] = data["event_type"]
        return out


class RunFilterForm(StrictForm):
    agent = forms.CharField(max_length=100, required=False)
    status = forms.ChoiceField(choices=_choices(list(SandboxRun.Status.values)), required=False)
    before = forms.IntegerField(min_value=1, required=False)


class WhatIfForm(StrictForm):
    agent = forms.CharField(max_length=100)
    tool = forms.CharField(max_length=100)
    action = forms.ChoiceField(choices=ACTION_CHOICES)
    scope = forms.CharField(max_length=500)
    task = forms.CharField(max_length=100, required=False)
    # For field-limited grants: the call names the fields it touches (arguments.fields).
    fields = forms.CharField(max_length=500, required=False, help_text="comma-separated")
    at = MomentField(required=False, help_text="UTC; empty means now")

    def arguments(self) -> dict[str, Any] | None:
        raw = self.cleaned_data.get("fields") or ""
        names = [name.strip() for name in raw.split(",") if name.strip()]
        return {"fields": names} if names else None


class AccessExportForm(StrictForm):
    """A moment (`at`) or a period (`start`..`end`), optionally one agent, task or tool."""

    at = MomentField(required=False)
    start = MomentField(required=False, label="from")
    end = MomentField(required=False, label="to")
    agent = forms.CharField(max_length=100, required=False)
    task = forms.CharField(max_length=100, required=False)
    tool = forms.CharField(max_length=100, required=False)
    format = forms.ChoiceField(choices=[(f, f) for f in exports.FORMATS])

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        period = data.get("start") is not None or data.get("end") is not None
        if period and (data.get("start") is None or data.get("end") is None):
            raise forms.ValidationError("A period needs both from and to.")
        if period and data.get("at") is not None:
            raise forms.ValidationError("Give a moment or a period, not both.")
        if period and data["end"] <= data["start"]:
            raise forms.ValidationError("The period must end after it starts.")
        return data


class DecisionExportForm(StrictForm):
    start = MomentField(label="from")
    end = MomentField(label="to")
    agent = forms.CharField(max_length=100, required=False)
    task = forms.CharField(max_length=100, required=False)
    tool = forms.CharField(max_length=100, required=False)
    format = forms.ChoiceField(choices=[(f, f) for f in exports.FORMATS])

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        if data.get("start") and data.get("end") and data["end"] <= data["start"]:
            raise forms.ValidationError("The period must end after it starts.")
        return data


class ReportForm(StrictForm):
    """The printable access report: a moment, optionally one agent, task or tool (as
    the access export and the API's report are narrowed), so an organisation past the
    rows' cap can still print it a part at a time."""

    at = MomentField(required=False)
    agent = forms.CharField(max_length=100, required=False)
    task = forms.CharField(max_length=100, required=False)
    tool = forms.CharField(max_length=100, required=False)


# --- Break-glass and reviews ------------------------------------------------------------


def breakglass_ttl_choices() -> list[tuple[int, str]]:
    """The TTL picker: common lifetimes up to the configured maximum, never beyond
    (nor beyond GRANT_MAX_TTL, which no grant outlives: the service's ttl_cap)."""
    from governance.services.breakglass import ttl_cap

    cap = int(ttl_cap().total_seconds() // 60)
    default = int(settings.BREAKGLASS_DEFAULT_TTL.total_seconds() // 60)
    minutes = sorted({m for m in (15, 30, 60, 120, 240, 480) if m <= cap} | {cap, default})
    return [(m, f"{m // 60} h {m % 60:02d} min" if m >= 60 else f"{m} min") for m in minutes]


class BreakGlassOpenForm(StrictForm):
    agent = forms.CharField(max_length=100)
    tool = forms.CharField(max_length=100)
    actions = forms.MultipleChoiceField(choices=ACTION_CHOICES)
    scope = forms.CharField(max_length=500)
    task = forms.CharField(max_length=100, required=False)
    ticket = forms.CharField(max_length=100)
    reason = forms.CharField(max_length=2000)
    # Any whole number of minutes parses; the service refuses more than the maximum
    # (breakglass_ttl_too_long: BREAKGLASS_MAX_TTL or GRANT_MAX_TTL, the shorter), so a
    # forged value gets the service's own answer.
    ttl_minutes = forms.IntegerField(min_value=1, max_value=100_000)


class ConfirmationPolicyForm(StrictForm):
    agent = forms.CharField(max_length=100)
    tool = forms.CharField(max_length=100)
    action = forms.ChoiceField(choices=ACTION_CHOICES)
    scope = forms.CharField(max_length=500)
    task = forms.CharField(max_length=100, required=False)
    verdict = forms.ChoiceField(choices=[("approve", "approve"), ("deny", "deny")])
    reason = forms.CharField(max_length=2000, strip=True)
    # Any whole number of hours parses; the service refuses more than GRANT_MAX_TTL.
    hours = forms.IntegerField(min_value=1, max_value=100_000)


class CommentForm(StrictForm):
    comment = forms.CharField(max_length=2000, strip=True)


class ReviewOpenForm(StrictForm):
    """An on-demand campaign: why, optionally one agent's grants, optionally when due."""

    reason = forms.CharField(max_length=1000, strip=True)
    agent = forms.CharField(max_length=100, required=False)
    due_days = forms.IntegerField(min_value=1, max_value=365, required=False)


class ReviewDecideForm(StrictForm):
    decision = forms.ChoiceField(
        choices=[("keep", "keep"), ("narrow", "narrow"), ("revoke", "revoke")]
    )
    # Required for every decision, keep included: there is no silent "keep all".
    comment = forms.CharField(max_length=2000, strip=True)
    actions = forms.MultipleChoiceField(choices=ACTION_CHOICES, required=False)
    actions_listed = forms.BooleanField(required=False)
    scope = forms.CharField(max_length=500, required=False, strip=True)
    expires_at = MomentField(required=False)
    delegable = forms.BooleanField(required=False)
    delegable_listed = forms.BooleanField(required=False)  # as ApproveRequestForm's
    # The page of "my items" the form was on, to go back to it once decided.
    back_page = forms.IntegerField(min_value=1, max_value=PAGE_MAX, required=False)
    back_campaign = forms.IntegerField(min_value=1, max_value=ID_MAX, required=False)

    def narrowing(
        self, grant_scope: str, grant_actions: list[str], grant_delegable: bool
    ) -> dict[str, Any]:
        """Only what differs from the grant as it is; the service refuses anything wider."""
        data = self.cleaned_data
        out: dict[str, Any] = {}
        if data.get("delegable") or data.get("delegable_listed"):
            if bool(data.get("delegable")) != grant_delegable:
                out["delegable"] = bool(data.get("delegable"))
        if data.get("actions_listed") and sorted(data.get("actions") or []) != sorted(
            grant_actions
        ):
            out["actions"] = list(data.get("actions") or [])
        if data.get("scope") and data["scope"] != grant_scope:
            out["scope"] = data["scope"]
        if data.get("expires_at"):
            out["expires_at"] = data["expires_at"]
        return out


class ReviewItemsFilterForm(StrictForm):
    """A campaign's items: one status, a page."""

    status = forms.ChoiceField(choices=_choices(list(ReviewItem.Status.values)), required=False)
    page = forms.IntegerField(min_value=1, max_value=PAGE_MAX, required=False)


class ReviewMineFilterForm(StrictForm):
    """A reviewer's items: one campaign's, a page."""

    campaign = forms.IntegerField(min_value=1, max_value=ID_MAX, required=False)
    page = forms.IntegerField(min_value=1, max_value=PAGE_MAX, required=False)


class SecondLookForm(StrictForm):
    verdict = forms.ChoiceField(choices=[("confirm", "confirm"), ("flag", "flag")])
    comment = forms.CharField(max_length=2000, strip=True)
