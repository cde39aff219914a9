"""A code-execution world for the sandbox's server-side tests: runs are only asked for
and recorded, through the real services (no engine, no bubblewrap)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from governance.models import AuditEvent
from sandbox_runner.spec import RunSpec


@pytest.fixture
def coder(make_agent, make_tool, make_task, make_grant) -> Any:
    """coder, a code-execution tool and a live execute grant on it for task SBX-1
    that names one egress destination, around the real clock (runs ask at the time
    they run)."""

    class World:
        agent = make_agent("coder")
        tool = make_tool("code-exec", actions=("execute",), kind="code_exec")
        task = make_task("SBX-1")
        grant = make_grant(
            agent,
            tool,
            actions=("execute",),
            scope="sandbox:*",
            task=task,
            starts_at=timezone.now() - timedelta(minutes=30),
            duration=timedelta(days=3),
            egress=["api.example.com:443"],
        )

    return World()


def spec(**kw: Any) -> RunSpec:
    kw.setdefault("agent", "coder")
    kw.setdefault("task", "SBX-1")
    kw.setdefault("tool", "code-exec")
    kw.setdefault("backend", "bubblewrap")
    return RunSpec(command=("python3", "-c", "print(1)"), **kw)


def events_of(run_id: str) -> list[AuditEvent]:
    return [e for e in AuditEvent.objects.order_by("seq") if f'"run_id":"{run_id}"' in e.data]
