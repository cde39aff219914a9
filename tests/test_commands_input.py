"""Bad command-line input is a CommandError naming the argument, and nothing is written.

A command line that is not UTF-8 reaches Python as lone surrogates (`\\udcff`), which no
database driver encodes; call_command() can pass a NUL, which PostgreSQL refuses; an empty
value from an unset shell variable was read as "not given" (`review_open --agent ""`
opened a campaign over every agent). Each was a traceback or a wider act than asked."""

from __future__ import annotations

from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import Group, User
from django.core.management import CommandError, call_command

from governance import roles
from governance.models import (
    Agent,
    AgentToken,
    AuditEvent,
    BreakGlass,
    Grant,
    ReviewCampaign,
    Task,
    Tool,
)
from tests.conftest import last_event

BAD = {
    "not_utf8": ("\udcff", "is not valid UTF-8 text"),
    "nul": ("a\x00b", "holds a NUL character"),
    "empty": ("", "is empty"),
}

BREAKGLASS = [
    "--user", "ada", "--agent", "bot", "--tool", "repo", "--actions", "read",
    "--scope", "repo:acme/x", "--ticket", "INC-1", "--reason", "outage",
]  # fmt: skip

# (command, argv, the argument to spoil, how argparse names it)
CASES: list[tuple[str, list[str], str, str]] = [
    ("agent_token", ["create", "bot"], "bot", "agent"),
    ("agent_token", ["create", "bot", "--by", "ada"], "ada", "--by"),
    ("agent_token", ["revoke", "abcd1234"], "abcd1234", "prefix"),
    ("api_token", ["create", "ada"], "ada", "username"),
    ("api_token", ["revoke", "abcd1234"], "abcd1234", "prefix"),
    ("review_open", ["--reason", "after INC-9"], "after INC-9", "--reason"),
    ("review_open", ["--reason", "r", "--agent", "bot"], "bot", "--agent"),
    ("review_open", ["--reason", "r", "--user", "ada"], "ada", "--user"),
    ("review_open", ["--reason", "r", "--key", "k1"], "k1", "--key"),
    *[
        ("breakglass_open", BREAKGLASS, BREAKGLASS[i + 1], BREAKGLASS[i])
        for i in range(0, len(BREAKGLASS), 2)
    ],
    ("breakglass_open", [*BREAKGLASS, "--task", "TICKET-1"], "TICKET-1", "--task"),
    ("matrix_import", ["{file}", "--as", "ada"], "ada", "--as"),
    ("matrix_import", ["{file}", "--as", "ada", "--approver", "ada"], "ada", "--approver"),
    (
        "audit_checkpoint",
        ["--start-new-series", "--reason", "restored", "--as", "ada"],
        "restored",
        "--reason",
    ),
    ("audit_checkpoint", ["--start-new-series", "--reason", "r", "--as", "ada"], "ada", "--as"),
]


@pytest.fixture
def world(make_agent, make_tool, make_task, alice: User, tmp_path: Path) -> Path:
    ada = User.objects.create_user("ada")
    for role in (roles.ADMINS, roles.APPROVERS):
        ada.groups.add(Group.objects.get_or_create(name=role)[0])
    make_agent("bot")
    make_tool("repo")
    make_task("TICKET-1")
    matrix = tmp_path / "matrix.yaml"
    matrix.write_text("tasks:\n- {key: OPS-7, owner: ada}\n")
    return matrix


def _counts() -> list[int]:
    models = (AuditEvent, AgentToken, ReviewCampaign, BreakGlass, Grant, Agent, Tool, Task)
    return [model.objects.count() for model in models]


def _spoil(argv: list[str], good: str, bad: str, file: Path) -> list[str]:
    out = [str(file) if arg == "{file}" else arg for arg in argv]
    index = len(out) - 1 - out[::-1].index(good)  # the last one: `--reason r` comes first
    out[index] = bad
    return out


@pytest.mark.parametrize("kind", list(BAD))
@pytest.mark.parametrize(
    ("command", "argv", "good", "name"),
    CASES,
    ids=[f"{c[0]}-{c[3].lstrip('-')}" for c in CASES],
)
def test_a_bad_argument_is_a_command_error_naming_it_and_nothing_is_written(
    world: Path, command: str, argv: list[str], good: str, name: str, kind: str
) -> None:
    bad, problem = BAD[kind]
    before, newest = _counts(), last_event().seq
    with pytest.raises(CommandError) as caught:
        call_command(command, *_spoil(argv, good, bad, world), stdout=StringIO())
    assert f"argument {name}: {problem}" in str(caught.value)
    assert _counts() == before and last_event().seq == newest


def test_the_unspoiled_arguments_work(world: Path, capsys: Any) -> None:
    """The table above spoils commands that run: each case's error is its argument's."""
    call_command("agent_token", "create", "bot", "--by", "ada", stdout=StringIO())
    call_command("review_open", "--reason", "r", "--agent", "bot", "--key", "k1", stdout=StringIO())
    call_command("breakglass_open", *BREAKGLASS, "--task", "TICKET-1", stdout=StringIO())
    call_command("matrix_import", str(world), "--as", "ada", stdout=StringIO(), stderr=StringIO())
    kinds = list(AuditEvent.objects.values_list("event_type", flat=True))
    for kind in ("agent_token.issued", "review.campaign_opened", "breakglass.opened"):
        assert kind in kinds
    assert last_event().event_type == "matrix.imported"


@pytest.mark.parametrize(
    ("command", "argv", "name"),
    [
        ("matrix_import", ["a\x00b.yaml", "--as", "ada"], "FILE"),
        ("matrix_import", ["", "--as", "ada"], "FILE"),
        ("matrix_export", ["-o", "a\x00b.yaml"], "-o/--output"),
        ("matrix_export", ["-o", ""], "-o/--output"),
        ("seed_demo", ["--address", "\udcff"], "--address"),
        ("seed_demo", ["--address", "127.0.0.1:8000\n"], "--address"),
        ("seed_demo", ["--address", ""], "--address"),
    ],
)
def test_a_bad_file_name_or_address_is_a_command_error(
    db: None, command: str, argv: list[str], name: str
) -> None:
    """A NUL in a file name was a ValueError; an empty -o wrote to stdout instead; the
    demo was seeded and committed before a bad --address failed to print."""
    before = _counts()
    with pytest.raises(CommandError, match=f"argument {name}: "):
        call_command(command, *argv, stdout=StringIO(), stderr=StringIO())
    assert _counts() == before and not Agent.objects.exists()


def test_a_file_whose_name_is_not_utf8_imports_and_is_named_by_its_escapes(
    world: Path, tmp_path: Path
) -> None:
    """A legitimate file name in another encoding (bytes 0xff as `\\udcff`): the import
    ran, then the audit event naming the file could not be written."""
    path = tmp_path / "matrix-\udcff.yaml"
    path.write_bytes(world.read_bytes())
    out = StringIO()
    call_command("matrix_import", str(path), "--as", "ada", stdout=out, stderr=StringIO())
    assert Task.objects.filter(key="OPS-7").exists()
    event = last_event()
    assert (event.event_type, event.actor) == ("matrix.imported", "user:ada")
    assert "matrix-\\\\udcff.yaml" in event.data  # the escape, JSON-quoted
    assert "matrix-\\udcff.yaml" in out.getvalue()


def test_restarting_checkpoints_with_a_reason_that_is_not_text_moves_nothing_aside(
    world: Path, settings: Any
) -> None:
    """The old series was moved aside first, then the event failed on the reason: the
    checkpoints were archived with nothing on record. Now refused before the move,
    also when the service is called with such a reason directly."""
    from django.utils import timezone

    from governance import audit

    call_command("audit_checkpoint", stdout=StringIO())
    directory = Path(settings.AUDIT_CHECKPOINT_DIR)
    files = sorted(p.name for p in directory.iterdir())
    before = _counts()
    with pytest.raises(ValueError, match="UTF-8 text"):
        audit.restart_checkpoints(
            reason="restored \udcff", actor=audit.Actor.system("t"), at=timezone.now()
        )
    with pytest.raises(CommandError, match="argument --reason: is not valid UTF-8"):
        argv = ["--start-new-series", "--reason", "restored \udcff", "--as", "ada"]
        call_command("audit_checkpoint", *argv, stdout=StringIO())
    assert sorted(p.name for p in directory.iterdir()) == files
    assert _counts() == before and audit.verify_chain().ok
