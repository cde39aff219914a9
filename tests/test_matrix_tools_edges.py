"""The grant matrix import (governance/services/matrix.py) and the tool inventory
(governance/services/tools.py) at the edges a mutation run found untested: each test
here passes on the services and fails on a one-token change of them that the other
tests let through (the run: /tmp/scratch_matrix; each test's docstring names its
mutants). Everything goes through the real services and the matrix_import command;
each test checks the answer, the rows and the audit events."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import Group

from governance import roles
from governance.models import AuditEvent, Grant
from governance.services import agents as agent_service
from tests import test_matrix
from tests.conftest import NOW
from tests.test_matrix import counts, rejected, run_import, write

# test_matrix's world (two agents, three tools, a task, grants in every state), its
# admins ada (imports) and cy (approves), and its clock frozen at NOW (autouse).
world, ada, cy, frozen = test_matrix.world, test_matrix.ada, test_matrix.cy, test_matrix.frozen


def data(event: AuditEvent) -> dict[str, Any]:
    return json.loads(event.data)


def one_grant(extra: str, scope: str = "repo:acme/new/*") -> str:
    """A file with one request for bot on repo, `extra` keys appended."""
    return (
        "grants:\n"
        f'- {{agent: bot, tool: repo, actions: [read], scope: "{scope}", justification: j, '
        f"{extra}}}\n"
    )


# --- Durations ------------------------------------------------------------------------


@pytest.mark.parametrize("duration", ["1h30", "8hours", "2d 4h"])
def test_a_duration_with_anything_after_its_last_unit_is_refused_at_its_line(
    world, tmp_path, duration
):
    """Mutant M1 (fullmatch -> match): "1h30" read as one hour, "8hours" as eight,
    the rest of the text dropped without a word."""
    path = write(tmp_path, one_grant(f'duration: "{duration}"'))
    before = counts()

    message = rejected(path, "--as", "alice")

    assert "matrix.yaml:2: grants[0].duration: must look like 8h, 2d, 90m or 1d12h" in message
    assert counts() == before


def test_a_unit_named_twice_adds_up(world, tmp_path, ada):
    """Mutant M3 (the second amount of a unit replaces the first): "4h20h" is 24 hours,
    not 20."""
    path = write(tmp_path, one_grant("duration: 4h20h"))

    run_import(path, "--as", "ada")

    grant = Grant.objects.get(scope="repo:acme/new/*")
    assert (grant.status, grant.requested_duration) == ("pending", timedelta(hours=24))
    requested = AuditEvent.objects.get(event_type="grant.requested", grant_id=grant.pk)
    assert data(requested)["duration_seconds"] == 24 * 3600


def test_a_duration_too_long_for_python_is_too_long_not_malformed(world, tmp_path):
    """Mutant M4 (an overflow read as "not a duration"): 999,999,999,999 weeks is a
    well-formed duration past any maximum; the file is told it is too long."""
    path = write(tmp_path, one_grant("duration: 999999999999w"))
    before = counts()

    message = rejected(path, "--as", "alice")

    assert "matrix.yaml:2: grants[0].duration: Duration exceeds the maximum grant" in message
    assert "must look like" not in message
    assert counts() == before


# --- Reading the file ---------------------------------------------------------------------


def test_a_file_nested_exactly_as_deep_as_allowed_is_read_and_one_more_is_not(world, tmp_path):
    """Mutant M5 (> MAX_DEPTH -> >=): 48 levels (the top mapping and 47 lists) are read,
    so the file gets the error of what it says; 49 are refused before composing."""
    before = counts()

    def nested(levels: int) -> str:
        return rejected(
            write(tmp_path, f"version: {'[' * levels}1{']' * levels}\n"), "--as", "alice"
        )

    at_most = nested(47)
    assert "matrix.yaml:1: version: must be a single value" in at_most
    assert "levels deep" not in at_most
    assert "matrix.yaml:1: nested more than 48 levels deep" in nested(48)
    assert counts() == before


def test_an_alias_used_only_as_a_key_is_refused(world, tmp_path, ada):
    """Mutant M9 (keys not walked for aliases): an anchored key repeated as `*k` in the
    next entry was let through, and the file created both agents."""
    path = write(
        tmp_path,
        "agents:\n- &k name: newbot\n  owner: alice\n- *k : otherbot\n  owner: alice\n",
    )
    before = counts()

    message = rejected(path, "--as", "ada")

    assert "anchors and aliases (&, *) are not supported" in message
    assert counts() == before


# --- What a plan promises is what the import does ---------------------------------------


def test_a_dry_run_with_apply_approved_refuses_an_entry_beside_a_pending_request(
    world, tmp_path, ada, cy
):
    """Bug (and mutant M23): bot has a pending request for repo:acme/web/* (update). A
    file asking for read on the same agent, tool and scope was refused with
    --apply-approved only by the import (grant_issue files a pending row of its own,
    which the one-pending-request rule refuses): the dry run promised a live grant.
    Now both say so at the entry's line, in both modes, and nothing is written."""
    pending = Grant.objects.get(status="pending", scope="repo:acme/web/*")
    path = write(tmp_path, one_grant("duration: 1h", scope="repo:acme/web/*"))
    expected = (
        f"matrix.yaml:2: grants[0].actions: request #{pending.pk} for this agent, tool, "
        "task and scope is already pending with actions ['update']; decide it first"
    )
    before = counts()
    approved = ("--as", "ada", "--apply-approved", "--approver", "cy")

    assert expected in rejected(path, "--dry-run", *approved)
    assert expected in rejected(path, *approved)
    assert expected in rejected(path, "--as", "ada")

    assert counts() == before
    assert list(Grant.objects.filter(scope="repo:acme/web/*").values_list("status", "actions")) == [
        ("pending", ["update"])
    ]
    events = AuditEvent.objects.filter(scope="repo:acme/web/*")
    assert list(events.values_list("event_type", flat=True)) == ["grant.requested"]
    assert not AuditEvent.objects.filter(event_type="matrix.imported").exists()


def test_a_dry_run_with_apply_approved_refuses_an_approver_with_a_stake_in_the_agent(
    world, tmp_path, ada, alice
):
    """Bug: alice, an admin, owns bot. A dry run naming her the approver promised a
    live grant for bot; only the import refused it (grant_issue's stake rule). The plan
    now refuses the entry at its line, as it already did for an approve policy, and
    nothing is written either way."""
    alice.groups.add(Group.objects.get_or_create(name=roles.ADMINS)[0])
    path = write(tmp_path, one_grant("duration: 1h"))
    approved = ("--as", "ada", "--apply-approved", "--approver", "alice")
    before = counts()

    for args in (("--dry-run", *approved), approved):
        message = rejected(path, *args)
        assert "matrix.yaml:2: grants[0]: 'alice' has a stake in agent 'bot'" in message
        assert "cannot approve its grants" in message

    assert counts() == before
    assert not Grant.objects.filter(scope="repo:acme/new/*").exists()


def test_a_dry_run_with_apply_approved_refuses_a_grant_for_a_suspended_agent(
    world, tmp_path, ada, cy, system
):
    """Bug: bot is suspended. A dry run with --apply-approved planned a live grant for
    it with a warning; the import then refused it (grant_issue: no grant is issued to a
    suspended agent). Now the plan refuses the entry; a request (without
    --apply-approved) is still filed (with a warning)."""
    agent_service.agent_suspend(agent=world["bot"], reason="incident", actor=system, at=NOW)
    path = write(tmp_path, one_grant("duration: 1h"))
    approved = ("--as", "ada", "--apply-approved", "--approver", "cy")
    before = counts()

    for args in (("--dry-run", *approved), approved):
        message = rejected(path, *args)
        assert "matrix.yaml:2: grants[0]: agent 'bot' is suspended: no live grant" in message
    assert counts() == before

    run_import(path, "--as", "ada")

    grant = Grant.objects.get(scope="repo:acme/new/*")
    assert (grant.status, grant.requested_by, grant.approved_by) == ("pending", ada, None)
    events = AuditEvent.objects.filter(grant_id=grant.pk)
    assert list(events.values_list("event_type", flat=True)) == ["grant.requested"]
