"""Fixtures for the sandbox probes: a real Docker engine (or bwrap), the default
image, and governance objects made through the real services.

Without a reachable engine the Docker probes skip and say why; with
SANDBOX_REQUIRE_DOCKER=1 (set by .ci/run) they fail instead, so CI can never
pass by skipping the adversarial suite."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from governance.models import AuditEvent, SandboxRun
from sandbox_runner.backends import IMAGE_BACKENDS
from sandbox_runner.backends.base import LABEL_RUN
from sandbox_runner.spec import DEFAULT_IMAGE, SCRIPT_PATH, RunSpec

REQUIRE_DOCKER = os.environ.get("SANDBOX_REQUIRE_DOCKER") == "1"


def _unusable(reason: str) -> None:
    if REQUIRE_DOCKER:
        pytest.fail(f"SANDBOX_REQUIRE_DOCKER=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def docker_client() -> Any:
    try:
        import docker

        client = docker.from_env(timeout=30)
        client.ping()
    except Exception as exc:
        _unusable(f"no Docker engine is reachable ({type(exc).__name__}: {exc})")
    try:
        client.images.get(DEFAULT_IMAGE)
    except Exception:
        _unusable(f"image {DEFAULT_IMAGE} is missing: run scripts/build_sandbox_image.sh")
    return client


@pytest.fixture(scope="session")
def bwrap_available() -> None:
    if shutil.which("bwrap") is None:
        _unusable("bwrap is not installed (apt-get install bubblewrap)")
    probe = subprocess.run(
        ["bwrap", "--unshare-all", "--ro-bind", "/", "/", "true"], capture_output=True, check=False
    )
    if probe.returncode != 0:
        _unusable(f"bwrap cannot create namespaces here: {probe.stderr.decode()[:200]}")


@pytest.fixture
def code_exec(make_agent: Any, make_tool: Any, make_task: Any, make_grant: Any) -> Any:
    """An agent with a live `execute` grant on code-exec for task SBX-1."""

    class World:
        agent = make_agent("coder")
        tool = make_tool("code-exec", actions=("execute",), kind="code_exec")
        task = make_task("SBX-1")

        def grant(self, **kw: Any) -> Any:
            # Around the real clock, not the fixed NOW: runs ask at the time they run.
            kw.setdefault("duration", timedelta(days=3))
            kw.setdefault("starts_at", timezone.now() - timedelta(minutes=30))
            return make_grant(
                self.agent, self.tool, actions=("execute",), scope="sandbox:*", task=self.task, **kw
            )

    return World()


@pytest.fixture
def irreversible(code_exec: Any, make_tool: Any, make_grant: Any) -> Any:
    """make(name, kind, **grant): an irreversible tool and a live execute grant on it for
    coder's task SBX-1, around the real clock."""

    def make(name: str, kind: str = "code_exec", **kw: Any) -> Any:
        tool = make_tool(name, actions=("execute",), irreversible=True, kind=kind)
        return make_grant(
            code_exec.agent,
            tool,
            actions=("execute",),
            scope="sandbox:*",
            task=code_exec.task,
            starts_at=timezone.now() - timedelta(minutes=30),
            duration=timedelta(days=3),
            **kw,
        )

    return make


SOME_IMAGE_ID = "sha256:" + "5" * 64


@pytest.fixture
def spec_for() -> Callable[..., RunSpec]:
    def make(script: str | None = None, *command: str, **kw: Any) -> RunSpec:
        kw.setdefault("agent", "coder")
        kw.setdefault("task", "SBX-1")
        if kw.get("backend", "docker") in IMAGE_BACKENDS:
            # What a runner resolved and sends (execute() resolves it again, for real).
            kw.setdefault("image_id", SOME_IMAGE_ID)
        if script is not None:
            return RunSpec(command=("python3", SCRIPT_PATH), script=script.encode(), **kw)
        return RunSpec(command=tuple(command), **kw)

    return make


def events_of(run_id: str) -> list[str]:
    return [
        e.event_type for e in AuditEvent.objects.order_by("seq") if f'"run_id":"{run_id}"' in e.data
    ]


def run_record(run_id: str) -> SandboxRun:
    return SandboxRun.objects.get(run_id=run_id)


def containers_of(client: Any, run_id: str) -> list[Any]:
    return client.containers.list(all=True, filters={"label": f"{LABEL_RUN}={run_id}"})


@pytest.fixture(params=["docker", "bubblewrap", "gvisor"])
def backend(request: pytest.FixtureRequest) -> str:
    """The probes that apply to every backend run once per backend. gVisor is
    optional: it skips unless the engine has runsc registered, or fails when
    SANDBOX_REQUIRE_GVISOR=1."""
    if request.param == "bubblewrap":
        request.getfixturevalue("bwrap_available")
        return request.param
    client = request.getfixturevalue("docker_client")
    if request.param == "gvisor" and "runsc" not in client.info().get("Runtimes", {}):
        reason = "gVisor: no runsc runtime registered with the engine (optional)"
        if os.environ.get("SANDBOX_REQUIRE_GVISOR") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return request.param


def leftovers(backend: str, run_id: str) -> list[Any]:
    """What a finished run left behind: containers (Docker) or cgroups (bubblewrap)."""
    if backend in ("docker", "gvisor"):
        import docker

        return containers_of(docker.from_env(), run_id)

    from sandbox_runner.backends.bubblewrap import CGROUP_NAME, CGROUP_ROOT

    return [p for p in CGROUP_ROOT.glob(f"*/{CGROUP_NAME}/{run_id}") if p.exists()]
