"""The grant matrix as a file: export the live matrix as YAML, import one back.

Export writes `selectors.matrix_snapshot(at)`: agents, tools, tasks and the
grants live at `at`, in a stable order so the file diffs cleanly.

Import is plan, then apply. Planning reads the whole file and the database
and collects *every* problem with its line (`matrix.yaml:12: grants[3].scope:
...`); one problem rejects the whole file. Applying runs the plan in one
transaction through the ordinary services (agent_create, tool_register,
task_open, grant_request or grant_issue), so each change writes its own audit
event, and a failure half-way rolls everything back. A dry run stops after
planning and writes nothing.

What the file means on import (the decisions, in one place):
- Grants become pending requests, requested by the importing user; with
  `apply_approved` (an admin importing, a different admin approving, who has
  no stake in the grant's agent: approvals.stakeholders) they become live grants.
  Who the file names as requester/approver is history, not authority: nobody's
  approval is copied from a file.
- A grant already present (live, or pending) with the same agent, tool, task,
  actions and scope is `unchanged`, never duplicated.
- Duration: the grant's `duration` ("8h", "2d", "1d12h"), else
  `expires_at - starts_at` (the window's length: approval restarts the clock).
  Either way it is capped by settings.GRANT_MAX_TTL via validate_shape().
- Delegated and break-glass grants are `skipped`: the first are made by the
  parent agent at run time (so they die with their parent), the second by the
  incident procedure. Importing either would make a free-standing grant.
- Agents, tools and tasks named by a grant must exist or be defined in the
  file; defined ones that do not exist are created. Existing ones are never
  changed by an import: if the file disagrees on identity (owner, parent,
  kind, actions, definition hash) that is an error; on state (suspended,
  quarantined, closed) a warning. A quarantined tool is never created from a
  file: registering approves its definition, which only an admin may do.
- New tasks open at import time; `window.starts_at` is history.
- `review_due_at`, `id`, `requester` and `approver` are read but not applied. The
  review date an export writes is the grant's earliest pending review item's due date;
  only a review campaign makes one, so a grant the import creates has none, and a
  file naming one for it gets a warning saying the date was not applied.
- Confirmation policies have no pending state: a policy is written by a person
  with the approver role and no stake in the agent's calls. So they are created
  only with `apply_approved`, authored by the approving admin (the stake rule is
  confirmation.policy_create's, checked as through the API); otherwise they are
  `skipped`. A live policy with the same agent, tool, task, action, scope and
  verdict makes an entry `unchanged`. `id`, `author`, `starts_at` are history:
  a new policy starts at import time and lives `duration` (or the exported
  window's length), at most GRANT_MAX_TTL, as through the API.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import yaml
from django.contrib.auth import get_user_model
from django.db import transaction
from django.utils.dateparse import parse_datetime
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from governance import audit, roles, selectors
from governance.codes import ACTION_VALUES, EventType, limit_problem
from governance.errors import Forbidden, GovernanceError
from governance.models import Agent, Grant, Task, Tool
from governance.models.tools import definition_hash
from governance.services import agents as agent_service
from governance.services import approvals, confirmation, exports
from governance.services import grants as grant_service
from governance.services import tasks as task_service
from governance.services import tools as tool_service
from governance.text import is_text, json_problem, printable

FORMAT_VERSION = 1
LIMIT_KEYS = ("cpus", "memory_mb", "pids", "wall_seconds", "scratch_mb")

# --- Export --------------------------------------------------------------------


class _Dumper(yaml.SafeDumper):
    """Block style; scalar lists inline; datetimes as ISO 8601 UTC with `Z`."""


def _represent_datetime(dumper: yaml.SafeDumper, value: datetime) -> yaml.ScalarNode:
    text = value.astimezone(UTC).isoformat().replace("+00:00", "Z")
    return dumper.represent_scalar("tag:yaml.org,2002:timestamp", text)


def _represent_list(dumper: yaml.SafeDumper, value: list[Any]) -> yaml.SequenceNode:
    flat = all(v is None or isinstance(v, str | int | float | bool) for v in value)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", value, flow_style=flat)


# Characters YAML reads as line breaks: inside a plain, quoted or literal scalar they
# come back folded or changed, so a value holding one is written double-quoted, where
# YAML escapes them (\N, \L, \P).
_YAML_BREAKS = ("\x85", "\u2028", "\u2029")


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None  # multi-line justifications stay readable
    if any(c in value for c in _YAML_BREAKS):
        style = '"'
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(datetime, _represent_datetime)
_Dumper.add_representer(list, _represent_list)
_Dumper.add_representer(str, _represent_str)

_HEADER = (
    "# Grant matrix: agents, tools, tasks, and the grants and confirmation policies live.\n"
    "# Import with: manage.py matrix_import FILE [--dry-run] --as USERNAME\n"
)


def matrix_export(*, at: datetime) -> str:
    """The live matrix at `at` as YAML text. Same state, same bytes. Reads only: what
    hands the file to someone is matrix_export_recorded."""
    return _yaml(selectors.matrix_snapshot(at))


def matrix_export_recorded(
    *,
    at: datetime,
    actor: audit.Actor,
    deliver: Callable[[str], None],
    params: dict[str, Any] | None = None,
) -> str:
    """The live matrix at `at`, handed to `deliver` (a file, stdout) with the
    `report.exported` event that says who took it (report `matrix`, format `yaml`, rows:
    its grants), in one transaction as every other export (exports.export): a file
    that cannot be delivered leaves no record of an export, and an export that cannot
    be recorded is not delivered."""
    text: str = exports.export(
        report="matrix",
        rows_of=lambda: selectors.matrix_snapshot(at),
        params={"at": at, **(params or {})},
        fmt="yaml",
        formats=("yaml",),
        count=lambda snapshot: len(snapshot["grants"]),
        actor=actor,
        now=at,
        build=_yaml,
        deliver=deliver,
    )
    return text


def _yaml(snapshot: dict[str, Any]) -> str:
    body = yaml.dump(
        snapshot,
        Dumper=_Dumper,
        sort_keys=False,
        default_flow_style=False,
        allow_unicode=True,
        width=100,
    )
    return _HEADER + body


# --- Results -------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    """One finding about the file, located by line and path."""

    line: int
    path: str
    message: str

    def render(self, source: str) -> str:
        where = f"{source}:{self.line}"
        text = f"{where}: {self.path}: {self.message}" if self.path else f"{where}: {self.message}"
        return printable(text)  # a key the file spelled with a lone surrogate, shown escaped


class MatrixInvalid(GovernanceError):
    """The file was rejected as a whole; `problems` lists every reason."""

    def __init__(self, source: str, problems: Sequence[Problem]) -> None:
        self.source = source
        self.problems = sorted(problems, key=lambda p: (p.line, p.path))
        count = len(self.problems)
        super().__init__(
            "invalid_matrix",
            f"{source}: {count} error{'s' if count != 1 else ''}; nothing was imported.",
            fields={p.path or f"line {p.line}": p.message for p in self.problems},
        )

    def render(self) -> str:
        return "\n".join([self.message, *(p.render(self.source) for p in self.problems)])


@dataclass
class Change:
    """One entry of the file and what the import does (or did) with it."""

    kind: str  # agent | tool | task | grant | policy
    outcome: str  # create | unchanged | skipped
    label: str
    line: int
    path: str
    note: str = ""
    grant_id: int | None = None  # the grant created, or the one that made it unchanged
    policy_id: int | None = None  # the same for a confirmation policy
    spec: Any = field(default=None, repr=False, compare=False)


@dataclass
class ImportResult:
    source: str
    mode: str  # "requests" (pending) or "approved" (live grants)
    dry_run: bool
    changes: list[Change]
    warnings: list[Problem]

    def count(self, outcome: str) -> int:
        return sum(1 for c in self.changes if c.outcome == outcome)


# --- Reading the file with line numbers ---------------------------------------


class _Invalid:
    """A value that failed its check (the problem is already recorded)."""

    def __repr__(self) -> str:
        return "<invalid>"


BAD: Any = _Invalid()


def _line(node: Node) -> int:
    return node.start_mark.line + 1


class _Reader:
    """Typed getters over yaml nodes that record problems instead of raising."""

    def __init__(self) -> None:
        self.problems: list[Problem] = []
        self._loader = yaml.SafeLoader("")

    def error(self, node: Node | int, path: str, message: str) -> Any:
        line = node if isinstance(node, int) else _line(node)
        self.problems.append(Problem(line, path, message))
        return BAD

    def mapping(
        self, node: Node, path: str, allowed: Sequence[str], required: Sequence[str] = ()
    ) -> dict[str, Node] | None:
        if not isinstance(node, MappingNode):
            self.error(node, path, "must be a mapping of key: value")
            return None
        found: dict[str, Node] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, ScalarNode) else None
            where = f"{path}.{key}" if path else str(key)
            if not isinstance(key, str):
                self.error(key_node, path, "keys must be plain names")
            elif key in found:
                self.error(key_node, where, "duplicate key")
            elif key not in allowed:
                self.error(key_node, where, f"unknown key; expected one of {', '.join(allowed)}")
            else:
                found[key] = value_node
        for key in required:
            if key not in found:
                self.error(node, path, f"missing required key {key!r}")
        return found

    def sequence(self, node: Node, path: str) -> list[Node] | None:
        if not isinstance(node, SequenceNode):
            self.error(node, path, "must be a list")
            return None
        return list(node.value)

    def _construct(self, node: Node, path: str) -> Any:
        try:
            return self._loader.construct_object(node, deep=True)
        except yaml.YAMLError as exc:
            return self.error(node, path, f"unreadable value ({exc})")
        except (ArithmeticError, LookupError, TypeError, ValueError, AttributeError) as exc:
            # A tag's constructor given what it cannot build (`!!int abc`, `!!bool abc`,
            # a 30th of February, an offset of +99:00) raises its own error, not YAML's.
            detail = f" ({exc})" if isinstance(exc, ValueError) else ""
            if not isinstance(node, ScalarNode):
                return self.error(node, path, f"holds a value that is not valid{detail}")
            kind = node.tag.rsplit(":", 1)[-1]  # int, float, bool, timestamp, ...
            return self.error(node, path, f"not a valid {kind}{detail}")

    def _scalar(self, node: Node, path: str) -> Any:
        if not isinstance(node, ScalarNode):
            return self.error(node, path, "must be a single value")
        return self._construct(node, path)

    def text(self, node: Node | None, path: str, *, nullable: bool = False) -> Any:
        if node is None:
            return None if nullable else BAD
        value = self._scalar(node, path)
        if value is BAD or (value is None and nullable):
            return value
        if not isinstance(value, str) or not value.strip():
            return self.error(node, path, "must be a non-empty string")
        return self._storable(value, node, path)

    def free_text(self, node: Node | None, path: str) -> Any:
        """A string that may be empty (descriptions)."""
        if node is None:
            return ""
        value = self._scalar(node, path)
        if value is not BAD and not isinstance(value, str):
            return self.error(node, path, "must be a string")
        return value if value is BAD else self._storable(value, node, path)

    def _storable(self, value: str, node: Node, path: str) -> Any:
        # A double-quoted "\0" or "\ud800" is text the database cannot store.
        if not is_text(value):
            return self.error(node, path, "must be text: no NUL byte, no lone surrogate")
        return value

    def boolean(self, node: Node | None, path: str) -> Any:
        if node is None:
            return False
        value = self._scalar(node, path)
        if value is not BAD and not isinstance(value, bool):
            return self.error(node, path, "must be true or false")
        return value

    def integer(self, node: Node | None, path: str) -> Any:
        if node is None:
            return None
        value = self._scalar(node, path)
        if value is None or value is BAD:
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            return self.error(node, path, "must be a whole number or null")
        return value

    def texts(self, node: Node | None, path: str) -> Any:
        if node is None:
            return []
        items = self.sequence(node, path)
        if items is None:
            return BAD
        values = [self.text(item, f"{path}[{i}]") for i, item in enumerate(items)]
        return BAD if BAD in values else values

    def when(self, node: Node | None, path: str) -> Any:
        """An aware datetime or null. Naive times are refused: whose clock?"""
        if node is None:
            return None
        value = self._scalar(node, path)
        if value is None or value is BAD:
            return value
        if isinstance(value, str):
            try:
                value = parse_datetime(value) or value
            except ValueError as exc:  # well formed, but no such moment (February 30th)
                return self.error(node, path, f"not a valid date-time ({exc})")
        if not isinstance(value, datetime):
            return self.error(node, path, "must be a date-time like 2026-11-29T12:00:00Z")
        if value.tzinfo is None:
            return self.error(node, path, "needs a time zone (end it with Z for UTC)")
        try:
            # Stored in UTC: 9999-12-31T23:00-12:00 is no such moment. Handed on in UTC
            # too: PostgreSQL takes no offset past 15:59, nor one with a fraction of a
            # second, which Python's (and a file's) +23:00 or +05:45:30.5 are.
            return value.astimezone(UTC)
        except OverflowError:
            return self.error(node, path, "is outside the years 1 to 9999 in UTC")

    def plain_mapping(self, node: Node | None, path: str) -> Any:
        """Free-form data (a tool's input schema)."""
        if node is None:
            return {}
        if not isinstance(node, MappingNode):
            return self.error(node, path, "must be a mapping")
        value = self._construct(node, path)
        # Stored in a JSON column and hashed as JSON, as the API's input_schema is.
        problem = None if value is BAD else json_problem(value)
        if problem:
            return self.error(node, path, f"must be plain JSON; this {problem}")
        return value


# ASCII digits only: `\d` would read "١h" (an Arabic-Indic one) as an hour.
_DURATION = re.compile(r"(?:[0-9]+[wdhms])+")
_UNITS = {"w": "weeks", "d": "days", "h": "hours", "m": "minutes", "s": "seconds"}


def parse_duration(text: str) -> timedelta | None:
    """'8h', '2d', '1d12h', '90m' -> timedelta; None if not that shape."""
    if not _DURATION.fullmatch(text):
        return None
    parts: dict[str, int] = {}
    for amount, unit in re.findall(r"([0-9]+)([wdhms])", text):
        if len(amount.lstrip("0")) > 12:  # far past any maximum (and int() of 4,300+ digits
            return timedelta.max  # refuses): too long, which validate_shape says
        parts[_UNITS[unit]] = parts.get(_UNITS[unit], 0) + int(amount)
    try:
        return timedelta(**parts)
    except OverflowError:
        return timedelta.max  # "99999999999d": too long, which validate_shape says


# --- Planning ------------------------------------------------------------------

TOP_KEYS = ("version", "agents", "tools", "tasks", "grants", "confirmation_policies")
AGENT_KEYS = ("name", "owner", "parent", "status")
TOOL_KEYS = (
    "name",
    "kind",
    "actions",
    "third_party",
    "irreversible",
    "description",
    "input_schema",
    "definition_hash",
    "quarantined",
)
TASK_KEYS = ("key", "owner", "status", "window")
WINDOW_KEYS = ("starts_at", "ends_at")
GRANT_KEYS = (
    "id",
    "agent",
    "tool",
    "task",
    "actions",
    "scope",
    "fields",
    "egress",
    "limits",
    "justification",
    "requester",
    "approver",
    "duration",
    "starts_at",
    "expires_at",
    "review_due_at",
    "delegated_from",
    "delegable",
    "break_glass",
)
POLICY_KEYS = (
    "id",
    "agent",
    "tool",
    "task",
    "action",
    "scope",
    "verdict",
    "reason",
    "author",
    "duration",
    "starts_at",
    "expires_at",
)
# The key of a policy entry that each of confirmation.validate_policy's refusals is about.
_POLICY_BLAME = {
    "invalid_verdict": "verdict",
    "invalid_action": "action",
    "action_not_supported": "action",
    "not_destructive": "action",
    "invalid_scope": "scope",
    "reason_required": "reason",
    "invalid_duration": "duration",
    "duration_too_long": "duration",
}


@dataclass
class _Planner:
    """Walks the parsed file against the database; collects changes and problems."""

    at: datetime
    mode: str
    reader: _Reader = field(default_factory=_Reader)
    approver: Any = None  # who authors the file's policies (apply_approved)
    changes: list[Change] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)
    # Names the file defines and that do not exist yet, mapped to their spec.
    new_agents: dict[str, dict[str, Any]] = field(default_factory=dict)
    new_tools: dict[str, Tool] = field(default_factory=dict)
    new_tasks: dict[str, dict[str, Any]] = field(default_factory=dict)
    users: dict[str, Any] = field(default_factory=dict)
    seen: set[tuple[str, str]] = field(default_factory=set)
    # The first change of each identity in the file, so a repeat is one lookup, not a
    # scan of every change before it (a 20,000-grant file took minutes to plan).
    first_grant: dict[tuple[Any, ...], Change] = field(default_factory=dict)
    first_request: dict[tuple[Any, ...], Change] = field(default_factory=dict)
    first_policy: dict[tuple[Any, ...], Change] = field(default_factory=dict)

    def defined_twice(self, kind: str, name: str) -> bool:
        if (kind, name) in self.seen:
            return True
        self.seen.add((kind, name))
        return False

    def warn(self, node: Node, path: str, message: str) -> None:
        self.warnings.append(Problem(_line(node), path, message))

    def user(self, node: Node | None, path: str) -> Any:
        name = self.reader.text(node, path)
        if name is BAD or node is None:
            return BAD
        if name not in self.users:
            self.users[name] = get_user_model().objects.filter(username=name).first()
        if self.users[name] is None:
            return self.reader.error(node, path, f"no user is named {name!r}")
        return self.users[name]

    def active_owner(self, owner: Any, node: Node, path: str) -> None:
        """Whoever is accountable for something new must still be around."""
        if owner is not BAD and not owner.is_active:
            self.reader.error(node, path, f"user {owner.get_username()!r} is not active")

    def section(self, root: dict[str, Node], key: str, each: Callable[..., None]) -> None:
        if key not in root:
            return
        items = self.reader.sequence(root[key], key)
        for i, item in enumerate(items or []):
            each(item, f"{key}[{i}]")

    # agents -----------------------------------------------------------------

    def agent(self, node: Node, path: str) -> None:
        r = self.reader
        keys = r.mapping(node, path, AGENT_KEYS, ("name", "owner"))
        if keys is None:
            return
        name = r.text(keys.get("name"), f"{path}.name")
        owner = self.user(keys.get("owner"), f"{path}.owner")
        parent = r.text(keys.get("parent"), f"{path}.parent", nullable=True)
        status = r.text(keys.get("status"), f"{path}.status", nullable=True) or "active"
        if status is not BAD and status not in Agent.Status.values:
            status = r.error(keys["status"], f"{path}.status", "must be active or suspended")
        if name is BAD:
            return
        try:
            agent_service.validate_name(name, "agent")
        except GovernanceError as exc:
            r.error(keys["name"], f"{path}.name", exc.message)
            return
        if self.defined_twice("agent", name):
            r.error(keys["name"], f"{path}.name", f"agent {name!r} is defined twice")
            return
        existing = Agent.objects.select_related("owner", "parent").filter(name=name).first()
        if existing is None:
            self.active_owner(owner, keys["owner"], f"{path}.owner")
            spec = {"name": name, "owner": owner, "parent": parent, "status": status}
            spec.update(node=keys.get("parent", node), path=f"{path}.parent")
            self.new_agents[name] = spec
            self.changes.append(Change("agent", "create", name, _line(node), path, spec=spec))
            return
        if owner is not BAD and existing.owner_id != owner.pk:
            r.error(
                keys["owner"],
                f"{path}.owner",
                f"agent {name!r} is owned by {existing.owner.get_username()!r}; "
                "an import does not change existing agents",
            )
        have_parent = existing.parent.name if existing.parent else None
        if "parent" in keys and parent is not BAD and parent != have_parent:
            r.error(
                keys.get("parent", node),
                f"{path}.parent",
                f"agent {name!r} has parent {have_parent!r}; an import does not change it",
            )
        if "status" in keys and status is not BAD and status != existing.status:
            self.warn(
                keys.get("status", node),
                f"{path}.status",
                f"agent {name!r} is {existing.status}; an import does not change that",
            )
        self.changes.append(Change("agent", "unchanged", name, _line(node), path))

    def check_agent_parents(self) -> None:
        """New agents' parents exist somewhere, without cycles among the new ones, and
        none is created under an agent the database holds suspended. A new agent below
        one the file suspends is suspended with it (agent_suspend): a warning."""
        for name, spec in self.new_agents.items():
            parent, seen = spec["parent"], {name}
            suspended_above = None
            while parent is not None and parent is not BAD and parent in self.new_agents:
                if parent in seen:
                    self.reader.error(spec["node"], spec["path"], "the parents form a cycle")
                    break
                seen.add(parent)
                if self.new_agents[parent]["status"] == Agent.Status.SUSPENDED:
                    suspended_above = suspended_above or parent
                parent = self.new_agents[parent]["parent"]
            else:
                existing = (
                    Agent.objects.filter(name=parent).first()
                    if parent is not None and parent is not BAD
                    else None
                )
                if parent is not None and parent is not BAD and existing is None:
                    self.reader.error(
                        spec["node"],
                        spec["path"],
                        f"unknown agent {parent!r} (not in the database, not defined under agents)",
                    )
                elif existing is not None and existing.status != Agent.Status.ACTIVE:
                    self.reader.error(
                        spec["node"],
                        spec["path"],
                        f"agent {parent!r} is suspended; no agent is created under it",
                    )
                elif suspended_above is not None and spec["status"] != Agent.Status.SUSPENDED:
                    self.warn(
                        spec["node"],
                        spec["path"],
                        f"agent {name!r} is suspended with {suspended_above!r}, an agent above it",
                    )

    # tools ------------------------------------------------------------------

    def tool(self, node: Node, path: str) -> None:
        r = self.reader
        keys = r.mapping(node, path, TOOL_KEYS, ("name", "kind", "actions"))
        if keys is None:
            return
        name = r.text(keys.get("name"), f"{path}.name")
        kind = r.text(keys.get("kind"), f"{path}.kind")
        if kind is not BAD and kind not in Tool.Kind.values:
            kind = r.error(keys["kind"], f"{path}.kind", f"must be one of {Tool.Kind.values}")
        actions = r.texts(keys.get("actions"), f"{path}.actions")
        if actions is not BAD and (not actions or not set(actions) <= ACTION_VALUES):
            actions = r.error(
                keys["actions"],
                f"{path}.actions",
                f"must be a non-empty list from {sorted(ACTION_VALUES)}",
            )
        third_party = r.boolean(keys.get("third_party"), f"{path}.third_party")
        irreversible = r.boolean(keys.get("irreversible"), f"{path}.irreversible")
        description = r.free_text(keys.get("description"), f"{path}.description")
        schema = r.plain_mapping(keys.get("input_schema"), f"{path}.input_schema")
        pinned = r.text(keys.get("definition_hash"), f"{path}.definition_hash", nullable=True)
        quarantined = r.boolean(keys.get("quarantined"), f"{path}.quarantined")
        if name is BAD:
            return
        try:
            agent_service.validate_name(name, "tool")
        except GovernanceError as exc:
            r.error(keys["name"], f"{path}.name", exc.message)
            return
        if self.defined_twice("tool", name):
            r.error(keys["name"], f"{path}.name", f"tool {name!r} is defined twice")
            return
        existing = Tool.objects.filter(name=name).first()
        if existing is None:
            if quarantined is True:
                r.error(
                    keys["quarantined"],
                    f"{path}.quarantined",
                    "a quarantined tool is not created from a file: registering it would "
                    "approve its definition; register and approve it as an admin first",
                )
            values = (kind, actions, third_party, irreversible, description, schema, pinned)
            if BAD in values:
                return
            computed = definition_hash(name, description, schema)
            if pinned is not None and pinned != computed:
                r.error(
                    keys["definition_hash"],
                    f"{path}.definition_hash",
                    "does not match the name, description and input_schema given here",
                )
            tool = Tool(
                name=name,
                kind=kind,
                actions=sorted(set(actions)),
                third_party=third_party,
                irreversible=irreversible,
                description=description,
                input_schema=schema,
            )
            self.new_tools[name] = tool
            self.changes.append(Change("tool", "create", name, _line(node), path, spec=tool))
            return
        differs = {
            "kind": (kind, existing.kind),
            "actions": (sorted(actions) if actions is not BAD else BAD, sorted(existing.actions)),
            "third_party": (third_party, existing.third_party),
            "irreversible": (irreversible, existing.irreversible),
            "definition_hash": (pinned or existing.definition_hash, existing.definition_hash),
        }
        for key, (wanted, have) in differs.items():
            if wanted is not BAD and wanted != have and key in keys:
                r.error(
                    keys[key],
                    f"{path}.{key}",
                    f"tool {name!r} has {key} {have!r} in the database; an import does not "
                    "change existing tools (re-register or re-approve it first)",
                )
        if quarantined is not BAD and quarantined != existing.is_quarantined:
            state = "quarantined" if existing.is_quarantined else "not quarantined"
            self.warn(keys.get("quarantined", node), f"{path}.quarantined", f"tool is {state}")
        self.changes.append(Change("tool", "unchanged", name, _line(node), path))

    # tasks ------------------------------------------------------------------

    def task(self, node: Node, path: str) -> None:
        r = self.reader
        keys = r.mapping(node, path, TASK_KEYS, ("key", "owner"))
        if keys is None:
            return
        key = r.text(keys.get("key"), f"{path}.key")
        owner = self.user(keys.get("owner"), f"{path}.owner")
        status = r.text(keys.get("status"), f"{path}.status", nullable=True) or "open"
        if status is not BAD and status not in Task.Status.values:
            status = r.error(keys["status"], f"{path}.status", "must be open or closed")
        ends_at: Any = None
        if "window" in keys:
            window = r.mapping(keys["window"], f"{path}.window", WINDOW_KEYS)
            if window is None:
                ends_at = BAD
            else:
                r.when(window.get("starts_at"), f"{path}.window.starts_at")
                ends_at = r.when(window.get("ends_at"), f"{path}.window.ends_at")
        if key is BAD:
            return
        try:
            task_service.validate_key(key)
        except GovernanceError as exc:
            r.error(keys["key"], f"{path}.key", exc.message)
            return
        if self.defined_twice("task", key):
            r.error(keys["key"], f"{path}.key", f"task {key!r} is defined twice")
            return
        existing = Task.objects.select_related("owner").filter(key=key).first()
        if existing is None:
            self.active_owner(owner, keys["owner"], f"{path}.owner")
            if status == Task.Status.CLOSED:
                r.error(keys["status"], f"{path}.status", "a closed task is not created")
            if ends_at is not None and ends_at is not BAD and ends_at <= self.at:
                r.error(
                    keys["window"],
                    f"{path}.window.ends_at",
                    "is in the past; a new task opens now and must end later",
                )
            spec = {"key": key, "owner": owner, "ends_at": ends_at}
            self.new_tasks[key] = spec
            self.changes.append(Change("task", "create", key, _line(node), path, spec=spec))
            return
        if owner is not BAD and existing.owner_id != owner.pk:
            r.error(
                keys["owner"],
                f"{path}.owner",
                f"task {key!r} is owned by {existing.owner.get_username()!r}; "
                "an import does not change existing tasks",
            )
        if "status" in keys and status is not BAD and status != existing.status:
            self.warn(
                keys.get("status", node), f"{path}.status", f"task {key!r} is {existing.status}"
            )
        self.changes.append(Change("task", "unchanged", key, _line(node), path))

    # grants -----------------------------------------------------------------

    def _entry(
        self, node: Node, path: str, allowed: Sequence[str], required: Sequence[str]
    ) -> tuple[dict[str, Node], Callable[..., Any], tuple[Any, ...]] | None:
        """A grant's or a policy's keys, a getter for them, and the agent, tool and task
        it names, each as (name, object): BAD where it is wrong (recorded)."""
        r = self.reader
        keys = r.mapping(node, path, allowed, required)
        if keys is None:
            return None

        def get(key: str, read: Callable[..., Any], **kw: Any) -> Any:
            return read(keys.get(key), f"{path}.{key}", **kw)

        agent_name = get("agent", r.text)
        tool_name = get("tool", r.text)
        task_key = get("task", r.text, nullable=True)
        named = (
            (agent_name, self._agent_for(keys, path, agent_name)),
            (tool_name, self._tool_for(keys, path, tool_name)),
            (task_key, self._task_for(keys, path, task_key)),
        )
        return keys, get, named

    def grant(self, node: Node, path: str) -> None:
        r = self.reader
        required = ("agent", "tool", "actions", "scope", "justification")
        entry = self._entry(node, path, GRANT_KEYS, required)
        if entry is None:
            return
        keys, get, ((agent_name, agent), (tool_name, tool), (task_key, task)) = entry
        actions = get("actions", r.texts)
        scope = get("scope", r.text)
        fields = get("fields", r.texts)
        egress = get("egress", r.texts)
        justification = get("justification", r.text)
        for informational in ("requester", "approver"):
            get(informational, r.text, nullable=True)
        review_due = get("review_due_at", r.when)
        get("id", r.integer)
        delegated_from = get("delegated_from", r.integer)
        delegable = get("delegable", r.boolean)
        break_glass = get("break_glass", r.boolean)
        limits = self._limits(keys.get("limits"), f"{path}.limits")
        duration, duration_node = self._duration(node, keys, path)

        if tool is not BAD and BAD not in (actions, scope, fields, egress):
            try:
                grant_service.validate_shape(
                    tool=tool,
                    actions=actions,
                    scope=scope,
                    fields=fields,
                    egress=egress,
                    duration=duration if isinstance(duration, timedelta) else None,
                    justification=justification if isinstance(justification, str) else None,
                )
            except GovernanceError as exc:
                for key, message in exc.fields.items():
                    if key == "duration":
                        # Name the key the duration came from: duration, or the window.
                        where, key = (
                            duration_node,
                            "duration" if "duration" in keys else "expires_at",
                        )
                    else:
                        where = keys.get(key, node)
                    r.error(where, f"{path}.{key}", message)
        values = (agent, tool, task, actions, scope, fields, egress, justification, limits)
        if BAD in values or BAD in (duration, delegated_from, delegable, break_glass):
            return

        label = f"{agent_name} {tool_name} [{','.join(actions)}] {scope}"
        label += f" (task {task_key})" if task_key else ""
        spec = {
            "agent": agent,
            "tool": tool,
            "task": task,
            "actions": list(actions),
            "scope": scope,
            "fields": fields,
            "egress": egress,
            "limits": limits,
            "justification": justification,
            "duration": duration,
            "delegable": delegable,
        }
        change = Change("grant", "create", label, _line(node), path, spec=spec)
        if delegated_from is not None:
            change.outcome, change.note = "skipped", "delegated: made by its parent agent"
        elif break_glass:
            change.outcome, change.note = "skipped", "break-glass: opened by the incident process"
        elif (parent := self._parent_of(agent)) is not None:
            # The service refuses it too: caught here so a dry run says so.
            r.error(node, path, grant_service.subagent_refusal(agent_name, parent))
            return
        elif not self._duplicate_in_file(change, node):
            self._compare_with_database(change, keys, node)
            self._second_request_in_file(change, keys)
            if change.outcome == "create" and (refusal := self._issue_refusal(agent)):
                # grant_issue refuses it too: caught here so a dry run says so.
                r.error(node, path, refusal)
                return
        if change.outcome == "create" and review_due is not None and review_due is not BAD:
            # A review date is a review item's due date, set by a campaign; the file's
            # is the exporting system's, and a new grant here has no review pending.
            self.warn(
                keys["review_due_at"],
                f"{path}.review_due_at",
                "not applied: a review date comes from a review campaign, "
                "and the new grant has none pending",
            )
        if change.outcome != "skipped":
            ident = self._identity(change.spec)
            self.first_grant.setdefault(ident, change)
            if change.outcome == "create":
                self.first_request.setdefault(ident[:4], change)
        self.changes.append(change)

    # confirmation policies -----------------------------------------------------

    def policy(self, node: Node, path: str) -> None:
        r = self.reader
        required = ("agent", "tool", "action", "scope", "verdict", "reason")
        entry = self._entry(node, path, POLICY_KEYS, required)
        if entry is None:
            return
        keys, get, ((agent_name, agent), (tool_name, tool), (task_key, task)) = entry
        action = get("action", r.text)
        scope = get("scope", r.text)
        verdict = get("verdict", r.text)
        reason = get("reason", r.text)
        get("author", r.text, nullable=True)
        get("id", r.integer)
        duration, duration_node = self._duration(node, keys, path)
        values = (agent, tool, task, action, scope, verdict, reason, duration)
        if BAD in values:
            return
        try:
            confirmation.validate_policy(
                tool=tool,
                action=action,
                scope=scope,
                verdict=verdict,
                reason=reason,
                duration=duration,
            )
        except GovernanceError as exc:
            key = _POLICY_BLAME.get(exc.code, "")
            where = duration_node if key == "duration" else keys.get(key, node)
            if key == "duration" and "duration" not in keys:
                key = "expires_at"  # the window's length was too long
            r.error(where, f"{path}.{key}" if key else path, exc.message)
            return

        label = f"{agent_name} {tool_name} {action} {scope} {verdict}"
        label += f" (task {task_key})" if task_key else ""
        spec = {
            "agent": agent,
            "tool": tool,
            "task": task,
            "action": action,
            "scope": scope,
            "verdict": verdict,
            "reason": reason,
            "duration": duration,
        }
        change = Change("policy", "create", label, _line(node), path, spec=spec)
        ident = self._policy_identity(spec)
        if (earlier := self.first_policy.get(ident)) is not None:
            r.error(node, path, f"repeats {earlier.path} (line {earlier.line})")
            return
        existing = self._live_policy(spec)
        if existing is not None:
            change.outcome, change.policy_id = "unchanged", existing.pk
            change.note = f"live as policy #{existing.pk}"
        elif self.mode == "requests":
            change.outcome = "skipped"
            change.note = "a policy is written by an approver: import with --apply-approved"
        elif self._author_has_stake(spec):
            # policy_create refuses it too; said here, at its line, so a dry run says it.
            name = self.approver.get_username()
            r.error(node, path, f"{name!r} has a stake in {agent_name!r}: not the author")
            return
        self.first_policy.setdefault(ident, change)
        self.changes.append(change)

    def _author_has_stake(self, spec: dict[str, Any]) -> bool:
        if self.approver is None or spec["verdict"] != "approve":
            return False
        if not isinstance(spec["agent"], Agent) or spec["tool"].pk is None:
            return False  # a new agent's owner is checked when it is created
        people = confirmation.policy_stakeholders(
            spec["agent"], spec["tool"], spec["action"], at=self.at
        )
        return self.approver.pk in people

    def _policy_identity(self, spec: dict[str, Any]) -> tuple[Any, ...]:
        return (
            *self._identity({**spec, "actions": [spec["action"]]})[:4],
            spec["action"],
            spec["verdict"],
        )

    def _live_policy(self, spec: dict[str, Any]) -> Any:
        """The live policy this entry describes, or None (also for new names)."""
        if not _names_exist(spec):
            return None
        return (
            selectors.live_policies(self.at)
            .filter(
                agent=spec["agent"],
                tool=spec["tool"],
                task=spec["task"],
                action=spec["action"],
                scope=spec["scope"],
                verdict=spec["verdict"],
            )
            .order_by("pk")
            .first()
        )

    def _limits(self, node: Node | None, path: str) -> Any:
        r = self.reader
        if node is None:
            return {}
        keys = r.mapping(node, path, LIMIT_KEYS)
        if keys is None:
            return BAD
        limits: dict[str, Any] = {}
        for key, value_node in keys.items():
            value = r._scalar(value_node, f"{path}.{key}")
            if value is None or value is BAD:
                limits[key] = value
                continue
            problem = limit_problem(key, value)  # the bounds every door applies
            if problem:
                value = r.error(value_node, f"{path}.{key}", problem)
            limits[key] = value
        if BAD in limits.values():
            return BAD
        return {k: v for k, v in limits.items() if v is not None}

    def _duration(self, node: Node, keys: dict[str, Node], path: str) -> tuple[Any, Node]:
        r = self.reader
        starts = r.when(keys.get("starts_at"), f"{path}.starts_at")
        expires = r.when(keys.get("expires_at"), f"{path}.expires_at")
        if "duration" in keys:
            text = r.text(keys["duration"], f"{path}.duration")
            if text is BAD:
                return BAD, keys["duration"]
            parsed = parse_duration(text)
            if parsed is None:
                message = "must look like 8h, 2d, 90m or 1d12h"
                parsed = r.error(keys["duration"], f"{path}.duration", message)
            return parsed, keys["duration"]
        where = keys.get("expires_at", node)
        if starts is BAD or expires is BAD:
            return BAD, where
        if starts is None or expires is None:
            message = "needs a duration (like 8h or 2d) or both starts_at and expires_at"
            return r.error(node, path, message), where
        if expires <= starts:
            return r.error(where, f"{path}.expires_at", "must be after starts_at"), where
        return grant_service.whole_seconds(expires - starts), where

    def _agent_for(self, keys: dict[str, Node], path: str, name: Any) -> Any:
        if name is BAD:
            return BAD
        if name in self.new_agents:
            return name  # created during apply, resolved then
        agent = Agent.objects.filter(name=name).first()
        if agent is None:
            return self.reader.error(
                keys["agent"],
                f"{path}.agent",
                f"unknown agent {name!r} (not in the database, not defined under agents)",
            )
        if agent.status != Agent.Status.ACTIVE:
            self.warn(keys["agent"], f"{path}.agent", f"agent {name!r} is {agent.status}")
        return agent

    def _parent_of(self, agent: Any) -> str | None:
        """The name of the agent's parent (`agent`: an Agent, or the name of one this
        file creates), or None for an agent at the top of the tree."""
        if isinstance(agent, str):
            parent = self.new_agents[agent]["parent"]
            return None if parent is BAD else parent
        return agent.parent.name if agent.parent_id is not None else None

    def _issue_refusal(self, agent: Any) -> str | None:
        """Why grant_issue would refuse a live grant to `agent` (an Agent, or the name of
        one this file creates) approved by the approving admin, or None (also in
        requests mode: a request may be filed for a suspended agent, with a warning).
        Grants reach here for agents at the top of the tree only (subagents are refused
        before), so the new agent's owner is its only stakeholder."""
        if self.mode != "approved":
            return None
        if isinstance(agent, str):
            spec = self.new_agents[agent]
            name, status = agent, spec["status"]
            people = set() if spec["owner"] is BAD else {spec["owner"].pk}
        else:
            name, status = agent.name, agent.status
            people = approvals.stakeholders(agent, None, at=self.at)
        if status == Agent.Status.SUSPENDED:
            return (
                f"agent {name!r} is suspended: no live grant is issued to it "
                "(import without --apply-approved to file a request)"
            )
        if self.approver is not None and self.approver.pk in people:
            return (
                f"{self.approver.get_username()!r} has a stake in agent {name!r} (its owner, "
                "or who held a token for it) and cannot approve its grants"
            )
        return None

    def _tool_for(self, keys: dict[str, Node], path: str, name: Any) -> Any:
        if name is BAD:
            return BAD
        if name in self.new_tools:
            return self.new_tools[name]
        tool = Tool.objects.filter(name=name).first()
        if tool is None:
            return self.reader.error(
                keys["tool"],
                f"{path}.tool",
                f"unknown tool {name!r} (not in the inventory, not defined under tools)",
            )
        if tool.is_quarantined:
            self.warn(keys["tool"], f"{path}.tool", f"tool {name!r} is quarantined")
        return tool

    def _task_for(self, keys: dict[str, Node], path: str, key: Any) -> Any:
        if key is None or key is BAD:
            return key
        if key in self.new_tasks:
            return key
        task = Task.objects.filter(key=key).first()
        if task is None:
            return self.reader.error(
                keys["task"],
                f"{path}.task",
                f"unknown task {key!r} (not in the database, not defined under tasks)",
            )
        if not task.is_open_at(self.at):
            return self.reader.error(
                keys["task"],
                f"{path}.task",
                f"task {key!r} is not open; nothing bound to it could ever be used",
            )
        return task

    @staticmethod
    def _identity(spec: dict[str, Any]) -> tuple[Any, ...]:
        def name(value: Any, attr: str) -> Any:
            return getattr(value, attr) if hasattr(value, attr) else value

        return (
            name(spec["agent"], "name"),
            spec["tool"].name,
            name(spec["task"], "key"),
            spec["scope"],
            tuple(sorted(spec["actions"])),
        )

    def _duplicate_in_file(self, change: Change, node: Node) -> bool:
        earlier = self.first_grant.get(self._identity(change.spec))
        if earlier is None:
            return False
        self.reader.error(node, change.path, f"repeats {earlier.path} (line {earlier.line})")
        return True

    def _second_request_in_file(self, change: Change, keys: dict[str, Node]) -> None:
        """One pending request per agent, tool, task and scope (a database rule): two
        entries that would both become requests for them cannot be. Entries already
        live (unchanged), such as two grants that differ only in actions, are fine."""
        if self.mode != "requests" or change.outcome != "create":
            return
        earlier = self.first_request.get(self._identity(change.spec)[:4])
        if earlier is not None:
            self.reader.error(
                keys["actions"],
                f"{change.path}.actions",
                f"{earlier.path} (line {earlier.line}) already requests this agent, "
                "tool, task and scope; merge the actions or import with --apply-approved",
            )

    def _compare_with_database(self, change: Change, keys: dict[str, Node], node: Node) -> None:
        spec = change.spec
        if not _names_exist(spec):
            return  # a new agent, tool or task: nothing to compare with
        wanted = sorted(spec["actions"])
        same = Grant.objects.filter(
            agent=spec["agent"], tool=spec["tool"], task=spec["task"], scope=spec["scope"]
        )
        # Only an ordinary grant makes an entry "unchanged": a break-glass grant ends
        # within hours and a delegated one with its parent.
        ordinary = same.filter(break_glass=False, delegated_from__isnull=True)
        # In force, as authorize() reads it: a task still open, no review fallen due
        # undecided (its job may not have run yet).
        for grant in selectors.grants_in_force(self.at).filter(pk__in=ordinary.values("pk")):
            if sorted(grant.actions) == wanted:
                if differs := _differences(grant, spec):
                    # Never "unchanged" while the live grant allows what the file does not.
                    self.reader.error(
                        node,
                        change.path,
                        f"live grant #{grant.pk} for this agent, tool, task, scope and actions "
                        f"has other {', '.join(differs)}: revoke or narrow it first, or make "
                        "the file match it",
                    )
                    return
                change.outcome, change.grant_id = "unchanged", grant.pk
                change.note = f"live as grant #{grant.pk}"
                return
        pending = same.filter(status=Grant.Status.PENDING).first()
        if pending is None:
            return
        if sorted(pending.actions) == wanted and (differs := _differences(pending, spec)):
            self.reader.error(
                node,
                change.path,
                f"request #{pending.pk} for this agent, tool, task, scope and actions is "
                f"pending with other {', '.join(differs)}; decide it first",
            )
        elif sorted(pending.actions) == wanted:
            change.outcome, change.grant_id = "unchanged", pending.pk
            change.note = f"pending as request #{pending.pk}"
        else:
            # In either mode: a live grant is issued through a pending row of its own
            # (grant_issue), which the one-pending-request rule refuses beside this one,
            # so a dry run with --apply-approved that let it through would promise a
            # grant the import then refuses.
            self.reader.error(
                keys["actions"],
                f"{change.path}.actions",
                f"request #{pending.pk} for this agent, tool, task and scope is already pending "
                f"with actions {pending.actions}; decide it first",
            )


def _names_exist(spec: dict[str, Any]) -> bool:
    """Are the entry's agent, tool and task (if any) in the database already? (Names the
    file defines are planned as strings, an unsaved Tool.)"""
    task_ok = spec["task"] is None or isinstance(spec["task"], Task)
    return isinstance(spec["agent"], Agent) and spec["tool"].pk is not None and task_ok


def _differences(grant: Grant, spec: dict[str, Any]) -> list[str]:
    """What else a grant with the file entry's agent, tool, task, scope and actions
    says differently: field list, egress list, sandbox limits, delegable."""
    differs = []
    if sorted(grant.fields) != sorted(spec["fields"] or []):
        differs.append("fields")
    if sorted(grant.egress) != sorted(spec["egress"] or []):
        differs.append("egress")
    if grant.limits() != (spec["limits"] or {}):
        differs.append("limits")
    if bool(grant.delegable) != bool(spec["delegable"]):
        differs.append("delegable")
    return differs


# Deeper than any matrix (an input_schema holds at most 32 levels, as over the API).
MAX_DEPTH = 48
_OPENS = (
    yaml.BlockMappingStartToken,
    yaml.BlockSequenceStartToken,
    yaml.FlowMappingStartToken,
    yaml.FlowSequenceStartToken,
)
_CLOSES = (yaml.BlockEndToken, yaml.FlowMappingEndToken, yaml.FlowSequenceEndToken)


def _refuse_deep_nesting(text: str, source: str) -> None:
    """The scanner is a loop; the composer recurses, and 5,000 `[` would exhaust the
    stack (a RecursionError, not an error at its line). So depth is counted first."""
    depth = 0
    for token in yaml.scan(text, Loader=yaml.SafeLoader):
        if isinstance(token, _OPENS):
            depth += 1
            if depth > MAX_DEPTH:
                problem = Problem(
                    token.start_mark.line + 1, "", f"nested more than {MAX_DEPTH} levels deep"
                )
                raise MatrixInvalid(source, [problem])
        elif isinstance(token, _CLOSES):
            depth -= 1


def _parse(text: str, source: str) -> tuple[_Reader, Node]:
    reader = _Reader()
    try:
        _refuse_deep_nesting(text, source)
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else 1
        raise MatrixInvalid(source, [Problem(line, "", f"YAML syntax: {exc.problem}")]) from None
    except yaml.YAMLError as exc:
        raise MatrixInvalid(source, [Problem(1, "", f"YAML: {exc}")]) from None
    if root is None:
        raise MatrixInvalid(source, [Problem(1, "", "the file is empty")])
    _refuse_aliases(root, source)
    return reader, root


def _refuse_aliases(root: Node, source: str) -> None:
    """A node reached twice is an alias. Refused: nested aliases expand
    exponentially ("billion laughs") once anything serialises the value."""
    seen: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            problem = Problem(_line(node), "", "anchors and aliases (&, *) are not supported")
            raise MatrixInvalid(source, [problem])
        seen.add(id(node))
        if isinstance(node, SequenceNode):
            stack.extend(node.value)
        elif isinstance(node, MappingNode):
            for key, value in node.value:
                stack.extend((key, value))


def matrix_plan(
    *, text: str, source: str, at: datetime, mode: str = "requests", approver: Any = None
) -> ImportResult:
    """Read the file against the database. Raises MatrixInvalid listing every problem."""
    reader, root = _parse(text, source)
    planner = _Planner(at=at, mode=mode, reader=reader, approver=approver)
    top = reader.mapping(root, "", TOP_KEYS)
    if top is None:
        raise MatrixInvalid(source, reader.problems)
    if "version" in top:
        version = reader._scalar(top["version"], "version")
        if version is not BAD and version != FORMAT_VERSION:
            reader.error(top["version"], "version", f"must be {FORMAT_VERSION}")
    planner.section(top, "agents", planner.agent)
    planner.check_agent_parents()
    planner.section(top, "tools", planner.tool)
    planner.section(top, "tasks", planner.task)
    planner.section(top, "grants", planner.grant)
    planner.section(top, "confirmation_policies", planner.policy)
    if reader.problems:
        raise MatrixInvalid(source, reader.problems)
    return ImportResult(
        source=source,
        mode=mode,
        dry_run=True,
        changes=planner.changes,
        warnings=sorted(planner.warnings, key=lambda p: (p.line, p.path)),
    )


# --- Applying ------------------------------------------------------------------


def _is_admin(user: Any) -> bool:
    """An active admin by the one role rule (governance.roles): is_staff only opens
    Django's read-only admin site and makes nobody an approver."""
    return bool(user is not None and user.is_active and roles.is_admin(user))


def _check_people(*, requested_by: Any, approver: Any, apply_approved: bool, dry_run: bool) -> None:
    if requested_by is None and (not dry_run or apply_approved):
        raise GovernanceError(
            "requester_required", "Name the importing user (--as): grants need a requester."
        )
    if requested_by is not None and not requested_by.is_active:
        raise Forbidden("inactive_user", f"User {requested_by.get_username()!r} is not active.")
    if requested_by is not None and roles.is_read_only(requested_by):
        raise Forbidden("auditor_read_only", "Auditors are read-only: they cannot import a matrix.")
    if approver is not None and not apply_approved:
        raise GovernanceError(
            "approver_without_apply", "An approver is only used with --apply-approved."
        )
    if not apply_approved:
        return
    if approver is None:
        raise GovernanceError("approver_required", "--apply-approved needs --approver USERNAME.")
    if not _is_admin(requested_by):
        raise Forbidden(
            "not_admin", "Only an admin (group admins or superuser) may import approved grants."
        )
    if approver.pk == requested_by.pk:
        raise Forbidden("self_approval", "Nobody approves their own request: name another admin.")
    if not _is_admin(approver):
        raise Forbidden(
            "approver_not_admin",
            f"{approver.get_username()!r} is not an active admin and cannot approve grants.",
        )


_ADMIN_KINDS = ("agent", "tool", "task")


def _check_creations(result: ImportResult, requested_by: Any) -> None:
    """Agents, tools and tasks are created by admins, as through the API: a file is not
    a way around that."""
    made = sorted(
        {c.kind for c in result.changes if c.outcome == "create" and c.kind in _ADMIN_KINDS}
    )
    if made and requested_by is not None and not _is_admin(requested_by):
        raise Forbidden(
            "not_admin",
            f"The file creates {' and '.join(k + 's' for k in made)}: only an admin (group "
            "admins or superuser) may import it; others may import grants only.",
        )


@contextmanager
def _entry(change: Change, source: str) -> Iterator[None]:
    """A service refusing one entry (a race since planning) names that entry's line."""
    try:
        yield
    except GovernanceError as exc:
        raise MatrixInvalid(source, [Problem(change.line, change.path, exc.message)]) from exc


def _apply(
    result: ImportResult, *, requested_by: Any, approver: Any, actor: audit.Actor, at: datetime
) -> None:
    agents: dict[str, Agent] = {}
    tools: dict[str, Tool] = {}
    tasks: dict[str, Task] = {}
    waiting = [c for c in result.changes if c.kind == "agent" and c.outcome == "create"]
    # Parents before children: each pass creates the agents whose parent now exists.
    while waiting:
        still_waiting = []
        for change in waiting:
            spec = change.spec
            parent_name = spec["parent"]
            parent = None
            if parent_name is not None:
                parent = agents.get(parent_name) or Agent.objects.filter(name=parent_name).first()
                if parent is None:
                    still_waiting.append(change)
                    continue
            with _entry(change, result.source):
                agent = agent_service.agent_create(
                    name=spec["name"], owner=spec["owner"], parent=parent, actor=actor, at=at
                )
            agents[agent.name] = agent
        if len(still_waiting) == len(waiting):  # planning rules this out; belt and braces
            raise MatrixInvalid(
                result.source, [Problem(c.line, c.path, "parent cycle") for c in waiting]
            )
        waiting = still_waiting
    # Suspended once the whole tree exists: suspending an agent suspends every agent
    # below it, and no agent can be created under a suspended one.
    for change in result.changes:
        if change.kind == "agent" and change.outcome == "create":
            if change.spec["status"] == Agent.Status.SUSPENDED:
                with _entry(change, result.source):
                    agents[change.spec["name"]] = agent_service.agent_suspend(
                        agent=agents[change.spec["name"]],
                        reason=f"suspended in {result.source}",
                        actor=actor,
                        at=at,
                    )

    for change in result.changes:
        if change.outcome != "create" or change.kind == "agent":
            continue
        spec = change.spec
        with _entry(change, result.source):
            if change.kind == "tool":
                tools[spec.name] = tool_service.tool_register(
                    name=spec.name,
                    kind=spec.kind,
                    actions=spec.actions,
                    description=spec.description,
                    input_schema=spec.input_schema,
                    third_party=spec.third_party,
                    irreversible=spec.irreversible,
                    actor=actor,
                    at=at,
                )
            elif change.kind == "task":
                tasks[spec["key"]] = task_service.task_open(
                    key=spec["key"],
                    owner=spec["owner"],
                    ends_at=spec["ends_at"],
                    actor=actor,
                    at=at,
                )
            elif change.kind == "grant":
                change.grant_id = _apply_grant(
                    spec,
                    mode=result.mode,
                    made=(agents, tools, tasks),
                    requested_by=requested_by,
                    approver=approver,
                    actor=actor,
                    at=at,
                ).pk
            elif change.kind == "policy":
                agent, tool, task = _resolve(spec, (agents, tools, tasks))
                change.policy_id = confirmation.policy_create(
                    author=approver,
                    agent=agent,
                    tool=tool,
                    task=task,
                    action=spec["action"],
                    scope=spec["scope"],
                    verdict=spec["verdict"],
                    reason=spec["reason"],
                    duration=spec["duration"],
                    actor=actor,
                    at=at,
                ).pk


_Made = tuple[dict[str, Agent], dict[str, Tool], dict[str, Task]]


def _resolve(spec: dict[str, Any], made: _Made) -> tuple[Agent, Tool, Task | None]:
    """An entry's agent, tool and task: names the file defined were planned as strings
    (an unsaved Tool), and exist by now."""
    agents, tools, tasks = made
    agent = spec["agent"] if isinstance(spec["agent"], Agent) else agents[spec["agent"]]
    tool = spec["tool"] if spec["tool"].pk else tools[spec["tool"].name]
    task = spec["task"]
    if task is not None and not isinstance(task, Task):
        task = tasks[task]
    return agent, tool, task


def _apply_grant(
    spec: dict[str, Any],
    *,
    mode: str,
    made: _Made,
    requested_by: Any,
    approver: Any,
    actor: audit.Actor,
    at: datetime,
) -> Grant:
    agent, tool, task = _resolve(spec, made)
    common: dict[str, Any] = {
        "agent": agent,
        "tool": tool,
        "task": task,
        "actions": spec["actions"],
        "scope": spec["scope"],
        "fields": spec["fields"],
        "egress": spec["egress"],
        "limits": spec["limits"],
        "justification": spec["justification"],
        "duration": spec["duration"],
        "delegable": spec["delegable"],
        "actor": actor,
        "at": at,
    }
    if mode == "approved":
        return grant_service.grant_issue(requested_by=requested_by, approved_by=approver, **common)
    return grant_service.grant_request(requested_by=requested_by, **common)


def matrix_import(
    *,
    text: str,
    source: str,
    actor: audit.Actor | None,
    at: datetime,
    requested_by: Any = None,
    approver: Any = None,
    apply_approved: bool = False,
    dry_run: bool = False,
) -> ImportResult:
    """Plan the file; unless dry_run, apply it in one transaction.

    Raises Forbidden/GovernanceError for who may do what, MatrixInvalid for
    anything wrong with the file. Either way nothing is written.
    """
    _check_people(
        requested_by=requested_by, approver=approver, apply_approved=apply_approved, dry_run=dry_run
    )
    mode = "approved" if apply_approved else "requests"
    if dry_run:
        planned = matrix_plan(text=text, source=source, at=at, mode=mode, approver=approver)
        _check_creations(planned, requested_by)
        return planned
    assert actor is not None
    with transaction.atomic(), audit.deferred():
        # Planned inside the transaction that applies it, so what was checked
        # is what gets written; a service refusing anything rolls back all of it.
        # Its events are appended together at the end (audit.deferred): the chain
        # lock, which every decision waits for, is not held through the import.
        result = matrix_plan(text=text, source=source, at=at, mode=mode, approver=approver)
        result.dry_run = False
        _check_creations(result, requested_by)
        _apply(result, requested_by=requested_by, approver=approver, actor=actor, at=at)
        created = result.count("create")
        if created:
            audit.append(
                event_type=EventType.MATRIX_IMPORTED,
                actor=actor,
                at=at,
                data={
                    "source": source,
                    "sha256": hashlib.sha256(text.encode()).hexdigest(),
                    "mode": mode,
                    "requested_by": requested_by.get_username(),
                    "approved_by": approver.get_username() if approver else None,
                    "created": {
                        kind: sum(
                            1 for c in result.changes if c.kind == kind and c.outcome == "create"
                        )
                        for kind in ("agent", "tool", "task", "grant", "policy")
                    },
                    "unchanged": result.count("unchanged"),
                    "skipped": result.count("skipped"),
                    "grant_ids": [
                        c.grant_id
                        for c in result.changes
                        if c.kind == "grant" and c.outcome == "create"
                    ],
                    "policy_ids": [
                        c.policy_id
                        for c in result.changes
                        if c.kind == "policy" and c.outcome == "create"
                    ],
                },
            )
    return result
