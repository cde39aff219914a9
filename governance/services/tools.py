"""The tool inventory: register, update (a changed definition quarantines), approve."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from django.db import IntegrityError, transaction

from governance import audit, roles
from governance.codes import ACTION_VALUES, EventType
from governance.errors import Conflict, Forbidden, GovernanceError
from governance.models import Approval, Tool
from governance.models.tools import definition_hash
from governance.services.agents import validate_name
from governance.text import jsonb_form


def _definition(name: str, description: str, input_schema: Any) -> dict[str, Any]:
    return {"name": name, "description": description, "input_schema": input_schema}


def _validate(kind: str, actions: Sequence[str]) -> None:
    if kind not in Tool.Kind.values:
        raise GovernanceError("invalid_tool_kind", f"Kind must be one of {Tool.Kind.values}.")
    if not actions or any(a not in ACTION_VALUES for a in actions):
        raise GovernanceError(
            "invalid_actions", f"Actions must be a non-empty list from {sorted(ACTION_VALUES)}."
        )


def tool_register(
    *,
    name: str,
    kind: str,
    actions: Sequence[str],
    actor: audit.Actor,
    at: datetime,
    description: str = "",
    input_schema: Any = None,
    third_party: bool = False,
    irreversible: bool = False,
) -> Tool:
    """Registering is approving the definition as it is now (an admin act)."""
    validate_name(name, "tool")  # exact ASCII names: no look-alikes, no padding
    _validate(kind, actions)
    # Stored in the form it is hashed in, which is the form jsonb gives back: the
    # stored definition keeps hashing to its pin (a no-op update stays a no-op).
    schema = jsonb_form(input_schema or {})
    digest = definition_hash(name, description, schema)
    try:
        with transaction.atomic():
            tool = Tool.objects.create(
                name=name,
                kind=kind,
                description=description,
                input_schema=schema,
                actions=sorted(set(actions)),
                third_party=third_party,
                irreversible=irreversible,
                definition_hash=digest,
                approved_hash=digest,
                approved_definition=_definition(name, description, schema),
            )
            audit.append(
                event_type=EventType.TOOL_REGISTERED,
                actor=actor,
                at=at,
                tool=name,
                data={"definition_hash": digest, "third_party": third_party},
            )
    except IntegrityError:
        raise Conflict("tool_exists", f"A tool named {name!r} already exists.") from None
    return tool


KEEP: Any = object()  # a part of the definition the update leaves as it is


def tool_update_definition(
    *,
    tool: Tool,
    actor: audit.Actor,
    at: datetime,
    description: Any = KEEP,
    input_schema: Any = KEEP,
    updated_by: Any = None,
) -> Tool:
    """Record what the tool now says about itself. Any change quarantines it
    until an admin re-approves: tool metadata is untrusted content. A part left as
    KEEP is the locked row's: read before the lock, a concurrent update would be
    written back over (and a quarantine lifted by writing back the approved text)."""
    with transaction.atomic():
        tool = Tool.objects.select_for_update(no_key=True).get(pk=tool.pk)
        if description is KEEP:
            description = tool.description
        if input_schema is KEEP:
            input_schema = tool.input_schema
        schema = jsonb_form(input_schema or {})  # as stored and hashed (see tool_register)
        digest = definition_hash(tool.name, description, schema)
        if digest == tool.definition_hash:
            return tool
        tool.description = description
        tool.input_schema = schema
        tool.definition_hash = digest
        tool.definition_updated_by = updated_by
        tool.save()
        quarantined = tool.is_quarantined
        data: dict[str, Any] = {"definition_hash": digest, "approved_hash": tool.approved_hash}
        if quarantined:
            # A person confirmed each open approval against what the tool said then;
            # none of them fires after the tool says something else, even once its new
            # definition is approved.
            voided = Approval.objects.filter(
                tool=tool, status__in=[Approval.Status.PENDING, Approval.Status.APPROVED]
            ).update(status=Approval.Status.EXPIRED)
            if voided:
                data["approvals_voided"] = voided
        audit.append(
            event_type=EventType.TOOL_QUARANTINED if quarantined else EventType.TOOL_UPDATED,
            actor=actor,
            at=at,
            tool=tool.name,
            data=data,
        )
    return tool


def tool_approve_definition(
    *, tool: Tool, definition_hash: str, approver: Any, actor: audit.Actor, at: datetime
) -> Tool:
    """Approve the definition the approver reviewed, named by its hash: if it changed
    since (another update landed while they read the diff), nothing is approved
    (Conflict `definition_changed`), so nobody approves a definition they never saw.
    Approving what is already approved changes nothing and records nothing. Only
    someone who may approve now (an active approver or admin: roles.require_may_approve,
    403 `not_approver`) approves, whatever door the call came by."""
    roles.require_may_approve(approver, "Tool definitions")
    with transaction.atomic():
        tool = Tool.objects.select_for_update(no_key=True).get(pk=tool.pk)
        if definition_hash != tool.definition_hash:
            raise Conflict(
                "definition_changed",
                "The tool's definition is not the one you reviewed (it changed since, or "
                "the hash is wrong): review the current definition and approve that.",
                fields={"definition_hash": f"the current definition is {tool.definition_hash}"},
            )
        if tool.approved_hash == tool.definition_hash:
            return tool  # already approved as it is: nothing changes, nothing to record
        if (
            tool.definition_updated_by_id is not None
            and tool.definition_updated_by_id == approver.pk
        ):
            raise Forbidden(
                "self_approval", "The person who changed a tool's definition cannot approve it."
            )
        tool.approved_hash = tool.definition_hash
        tool.approved_definition = _definition(tool.name, tool.description, tool.input_schema)
        tool.save()
        audit.append(
            event_type=EventType.TOOL_APPROVED,
            actor=actor,
            at=at,
            tool=tool.name,
            data={"definition_hash": tool.definition_hash, "approver": approver.get_username()},
        )
    return tool
