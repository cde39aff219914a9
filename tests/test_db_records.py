"""What the database itself refuses on PostgreSQL (migrations 0018, 0019): deleting the
governance records, a grant window past the hard maximum, a delegation outliving its
parent. SQLite, the embedded default, relies on the services for these."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import transaction
from django.db.utils import DatabaseError

from governance.audit import Actor
from governance.models import Agent, Grant, Task, Tool
from governance.services import grants
from tests.conftest import NOW

pytestmark = pytest.mark.django_db


def _refused(work) -> bool:
    """Did the database refuse `work` (at the statement or at commit)?"""
    try:
        with transaction.atomic():
            work()
    except DatabaseError:
        return True
    return False


def test_the_database_refuses_deleting_governance_records(
    postgres_only, make_agent, make_tool, make_task, make_grant
):
    agent, tool, task = make_agent(), make_tool(), make_task("T-KEEP")
    grant = make_grant(agent, tool, task=task)
    for model, pk in ((Grant, grant.pk), (Agent, agent.pk), (Tool, tool.pk), (Task, task.pk)):
        assert _refused(lambda m=model, k=pk: m.objects.filter(pk=k)._raw_delete(m.objects.db))
        assert model.objects.filter(pk=pk).exists()


def test_the_database_refuses_a_grant_window_past_the_hard_maximum(
    postgres_only, make_agent, make_tool, make_grant
):
    grant = make_grant(make_agent(), make_tool())
    year = grant.starts_at + timedelta(hours=8760)
    assert _refused(
        lambda: Grant.objects.filter(pk=grant.pk).update(expires_at=year + timedelta(seconds=1))
    )
    assert not _refused(lambda: Grant.objects.filter(pk=grant.pk).update(expires_at=year))


def test_the_database_refuses_a_delegation_outliving_its_parent(
    postgres_only, make_agent, make_tool, make_grant, system
):
    lead = make_agent("lead")
    helper = make_agent("helper", parent=lead)
    parent = make_grant(lead, make_tool(), scope="repo:acme/*", delegable=True)
    child = grants.grant_delegate(
        parent_grant_id=parent.pk,
        child=helper,
        actions=["read"],
        scope="repo:acme/x/*",
        expires_at=parent.expires_at,
        justification="hand-off",
        actor=system,
        at=NOW,
    )
    later = parent.expires_at + timedelta(hours=1)
    earlier = parent.expires_at - timedelta(minutes=15)
    assert _refused(lambda: Grant.objects.filter(pk=child.pk).update(expires_at=later))
    # The service's way: the parent narrowed, the child that no longer fits revoked with
    # it, in one transaction.
    grants.grant_narrow(
        grant_id=parent.pk,
        expires_at=earlier,
        reason="shorter",
        actor=Actor.system("test"),
        at=NOW,
    )
    child.refresh_from_db()
    assert child.status == Grant.Status.REVOKED


def test_one_statement_moving_a_parent_and_its_child_together_is_judged_at_its_end(
    postgres_only, make_agent, make_tool, make_grant, system
):
    """Both moved to the same later expiry in one UPDATE: allowed whichever row the scan
    reaches first (the parent's row is rewritten first so the child comes before it in
    the table). Row by row, the child was judged against the parent's old expiry."""
    lead = make_agent("lead")
    helper = make_agent("helper", parent=lead)
    parent = make_grant(lead, make_tool(), scope="repo:acme/*", delegable=True)
    child = grants.grant_delegate(
        parent_grant_id=parent.pk, child=helper, actions=["read"], scope="repo:acme/x/*",
        expires_at=parent.expires_at, justification="hand-off", actor=system, at=NOW,
    )  # fmt: skip
    Grant.objects.filter(pk=parent.pk).update(justification="moved to the table's end")
    later = parent.expires_at + timedelta(hours=1)
    pair = Grant.objects.filter(pk__in=[parent.pk, child.pk])
    assert not _refused(lambda: pair.update(expires_at=later))
    assert set(pair.values_list("expires_at", flat=True)) == {later}
    # The child alone past its parent is still refused, at the statement's end.
    assert _refused(
        lambda: Grant.objects.filter(pk=child.pk).update(expires_at=later + timedelta(hours=1))
    )
    assert Grant.objects.get(pk=child.pk).expires_at == later
