import re

from django.core.management import call_command
from django.utils import timezone

from governance import audit, selectors
from governance.models import Agent, Approval, ConfirmationPolicy, Grant, Tool


def test_the_demo_world_has_every_kind_of_object_and_a_valid_chain(db, capsys):
    call_command("seed_demo")
    out = capsys.readouterr().out
    assert "Sign in at http://127.0.0.1:8000/ui/login/ as 'admin'" in out

    now = timezone.now()
    assert Agent.objects.filter(parent__isnull=False).exists(), "a subagent"
    assert selectors.live_grants(now).filter(delegated_from__isnull=False).exists()
    assert selectors.live_grants(now).count() >= 4
    assert Grant.objects.filter(status="revoked").exists()
    assert Grant.objects.filter(expires_at__lte=now).exists(), "an expired grant"
    assert Grant.objects.filter(status="pending").exists(), "a pending request"
    assert Approval.objects.filter(status="pending").exists(), "a pending approval"
    assert ConfirmationPolicy.objects.filter(verdict="deny").exists(), "a deny policy"
    assert Approval.objects.filter(policy__verdict="approve", status="consumed").exists()
    assert any(t.is_quarantined for t in Tool.objects.all()), "a quarantined tool"
    assert audit.verify_chain().ok

    call_command("seed_demo", "--address", "127.0.0.1:8001")  # idempotent
    again = capsys.readouterr().out
    assert "already present" in again and "http://127.0.0.1:8001/ui/login/" in again
    assert Agent.objects.filter(name="triage-bot").count() == 1


def test_the_demo_matrix_exports_and_imports_again_unchanged(db, tmp_path):
    """Its two live grants for one agent, tool and scope (read, and update) were
    refused on re-import as two requests for the same scope, though both were live."""
    from io import StringIO

    call_command("seed_demo")
    path = tmp_path / "demo.yaml"
    call_command("matrix_export", "-o", str(path))
    out = StringIO()
    call_command("matrix_import", str(path), "--dry-run", "--as", "admin", stdout=out)
    assert re.search(r"^0 to create, \d+ unchanged, 1 skipped", out.getvalue(), re.M)
    assert Grant.objects.filter(status="pending").count() == 1  # the demo's own, no more
