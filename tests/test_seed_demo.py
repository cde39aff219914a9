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


def test_the_demo_never_takes_over_an_existing_account(db):
    """It reset the password and the roles of an existing `alice` (and would make an
    existing `admin` a superuser): seeding into a real database took its accounts."""
    import pytest
    from django.contrib.auth.models import Group, User
    from django.core.management import CommandError

    from governance.models import AuditEvent

    real = User.objects.create_user("alice", password="my-own-pass-123")
    real.groups.add(Group.objects.get_or_create(name="admins")[0])
    before = AuditEvent.objects.count()
    with pytest.raises(CommandError, match="would overwrite existing ones \\(alice\\)"):
        call_command("seed_demo")
    real.refresh_from_db()
    assert real.check_password("my-own-pass-123") and not real.is_superuser
    assert list(real.groups.values_list("name", flat=True)) == ["admins"]
    assert not Agent.objects.exists() and AuditEvent.objects.count() == before


def test_a_demo_whose_password_cannot_be_kept_is_not_left_behind(db, settings, tmp_path):
    """The password file was written after the commit: when it could not be, the demo
    stood with accounts whose password was lost, and a traceback."""
    import pytest
    from django.contrib.auth.models import User
    from django.core.management import CommandError

    base = tmp_path / "base"
    base.mkdir()
    (base / "var").write_text("a file where the directory goes")
    settings.BASE_DIR = base
    with pytest.raises(CommandError, match="password cannot be written"):
        call_command("seed_demo")
    assert not Agent.objects.exists() and not User.objects.filter(username="admin").exists()
