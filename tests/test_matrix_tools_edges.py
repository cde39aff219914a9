"""The grant matrix import (governance/services/matrix.py) and the tool inventory
(governance/services/tools.py) at the edges a mutation run found untested: each test
here passes on the services and fails on a one-token change of them that the other
tests let through (the run: /tmp/scratch_matrix; each test's docstring names its
mutants). Everything goes through the real services and the matrix_import command;
each test checks the answer, the rows and the audit events."""

from __future__ import annotations

import json
from typing import Any

from governance.models import AuditEvent, Grant
from tests import test_matrix
from tests.test_matrix import counts, rejected, write

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
