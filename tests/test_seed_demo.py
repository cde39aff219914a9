from django.core.management import call_command
from django.utils import timezone

from governance import audit, selectors
from governance.models import Agent, Approval, Grant, Tool


def test_the_demo_world_has_every_kind_of_object_and_a_valid_chain(db, capsys):
    call_command("seed_demo")
    out = capsys.readouterr().out
    assert "Sign in at http://127.0.0.1:8000/admin/login/ as 'admin'" in out

    now = timezone.now()
    assert Agent.objects.filter(parent__isnull=False).exists(), "a subagent"
    assert selectors.live_grants(now).filter(delegated_from__isnull=False).exists()
    assert selectors.live_grants(now).count() >= 4
    assert Grant.objects.filter(status="revoked").exists()
    assert Grant.objects.filter(expires_at__lte=now).exists(), "an expired grant"
    assert Grant.objects.filter(status="pending").exists(), "a pending request"
    assert Approval.objects.filter(status="pending").exists(), "a pending approval"
    assert any(t.is_quarantined for t in Tool.objects.all()), "a quarantined tool"
    assert audit.verify_chain().ok

    call_command("seed_demo")  # idempotent
    assert "already present" in capsys.readouterr().out
    assert Agent.objects.filter(name="triage-bot").count() == 1
