"""The reaper against a real engine: a runner killed with SIGKILL leaves its
container behind, and the reaper kills it at its deadline and marks the run;
a suspended agent's sandbox dies at the next pass (the kill switch)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection

from governance.audit import Actor
from governance.models import Agent, AuditEvent, SandboxRun
from governance.services.agents import agent_suspend
from governance.services.sandbox import ORPHAN_GRACE, reap_all
from governance.tasks import sandbox_reap
from sandbox_runner.authorizers import DatabaseAuthorizer
from sandbox_runner.backends.base import LABEL_AGENT
from sandbox_runner.runner import EXIT_BACKEND, execute, workdir_root
from tests.sandbox_runner.conftest import SOME_IMAGE_ID, containers_of, events_of, run_record


def _sandboxes_of(client, agent):
    return client.containers.list(all=True, filters={"label": f"{LABEL_AGENT}={agent}"})


def _sleeping_runner(tmp_path, *options: str) -> subprocess.Popen[bytes]:
    """`python -m sandbox_runner run` in a process of its own (it must reach the
    test's database, so PostgreSQL only), running a script that prints "up" and
    sleeps two minutes."""
    if connection.vendor != "postgresql":
        pytest.skip("needs PostgreSQL (set DATABASE_URL): SQLite's test database is in memory")
    script = tmp_path / "sleep.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(120)\n")
    url = "postgresql://postgres@127.0.0.1:5432/" + connection.settings_dict["NAME"]
    argv = [sys.executable, "-m", "sandbox_runner", "run", "--agent", "coder", "--task", "SBX-1"]
    return subprocess.Popen(
        [*argv, *options, "--script", str(script)],
        env={**os.environ, "DATABASE_URL": url},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _running_run() -> SandboxRun:
    """The one run, once the runner has recorded its start (right after starting it)."""
    for _ in range(100):
        run = SandboxRun.objects.get()
        if run.status == "running":
            return run
        time.sleep(0.1)
    raise AssertionError(f"the run is still {run.status}")


@pytest.mark.django_db(transaction=True)
def test_a_sigkilled_runners_container_is_reaped_at_its_deadline(
    docker_client, code_exec, tmp_path
):
    code_exec.grant()
    runner = _sleeping_runner(tmp_path, "--timeout", "4")
    try:
        assert runner.stdout.readline() == b"up\n"  # the sandbox is running
        run = _running_run()
        runner.send_signal(signal.SIGKILL)
        runner.wait(timeout=10)
    finally:
        runner.kill()
    run_id = str(run.run_id)
    assert len(containers_of(docker_client, run_id)) == 1  # orphaned, still running
    assert reap_all(docker_client) == []  # before the deadline: left alone
    time.sleep(max(0.0, run.deadline_at.timestamp() - time.time()) + 0.2)
    assert sandbox_reap() == {"orphans": [], "reaped": [f"{run_id}:deadline"]}  # scheduled
    assert containers_of(docker_client, run_id) == []
    run.refresh_from_db()
    assert run.status == "reaped" and run.timed_out
    assert run.error == "killed by the reaper: deadline"
    assert events_of(run_id) == [
        "sandbox.run.requested",
        "sandbox.run.started",
        "sandbox.run.reaped",
    ]
    reaped = AuditEvent.objects.get(event_type="sandbox.run.reaped")
    assert reaped.actor == "system:sandbox_reaper"
    assert reap_all(docker_client) == []  # nothing left; a second pass does nothing


@pytest.mark.django_db
def test_suspending_the_agent_gets_its_running_sandbox_reaped(docker_client, code_exec, spec_for):
    code_exec.grant()
    spec = spec_for("import time; time.sleep(60)", limits={"wall_seconds": 50})
    reaped = []

    def kill_switch(spec, handle):
        agent_suspend(
            agent=code_exec.agent,
            reason="incident",
            actor=Actor.system("test"),
            at=datetime.now(UTC),
        )
        reaped.extend(reap_all(docker_client))

    started = time.monotonic()
    outcome = execute(spec, DatabaseAuthorizer(), stdout=io.BytesIO(), on_started=kill_switch)
    assert time.monotonic() - started < 20  # not left to run to its 50 s deadline
    assert (spec.run_id, "agent_suspended") in reaped
    # SIGKILLed: 137 when the engine reported the kill before the removal, otherwise
    # the runner has no exit status and says so (EXIT_BACKEND).
    assert outcome.exit_code in (137, EXIT_BACKEND)
    record = run_record(spec.run_id)
    # The reaper won the claim: the runner's own finish does not overwrite it.
    assert record.status == "reaped" and not record.timed_out
    assert events_of(spec.run_id) == [
        "sandbox.run.requested",
        "sandbox.run.started",
        "sandbox.run.reaped",
    ]
    assert json.loads(AuditEvent.objects.get(event_type="sandbox.run.reaped").data)["why"] == (
        "agent_suspended"
    )
    # Removed by the reaper (or the runner's cleanup, whichever came second): a removal
    # the engine still has in progress lists the container for a moment on a loaded
    # machine (seen once in a full run), so it is given a few seconds, and what is
    # still there is named with its state.
    left = _sandboxes_of(docker_client, "coder")
    for _ in range(50):
        if not left:
            break
        time.sleep(0.2)
        left = _sandboxes_of(docker_client, "coder")
    assert [(c.short_id, c.status) for c in left] == []


@pytest.mark.django_db
def test_a_run_reaped_before_its_start_was_recorded_is_still_marked(code_exec, spec_for):
    from governance.services.sandbox import run_reaped, run_request

    code_exec.grant()
    spec = spec_for("print(1)")
    assert run_request(spec=spec, at=datetime.now(UTC)).allowed
    actor = Actor.system("sandbox_reaper")
    assert run_reaped(run_id=spec.run_id, why="deadline", actor=actor, at=datetime.now(UTC))
    assert run_record(spec.run_id).status == "reaped"
    assert events_of(spec.run_id) == ["sandbox.run.requested", "sandbox.run.reaped"]
    # Once only: a second reaper (or the runner) finds nothing left to claim.
    assert run_reaped(run_id=spec.run_id, why="deadline", actor=actor, at=datetime.now(UTC)) is None


@pytest.mark.django_db(transaction=True)
def test_a_sigkilled_runner_takes_its_bubblewrap_sandbox_with_it(
    bwrap_available, code_exec, tmp_path
):
    """No daemon keeps a bwrap sandbox alive: --die-with-parent kills it with the runner."""
    from sandbox_runner.backends.bubblewrap import CGROUP_NAME, CGROUP_ROOT

    code_exec.grant()
    runner = _sleeping_runner(tmp_path, "--backend", "bubblewrap", "--timeout", "2")
    try:
        assert runner.stdout.readline() == b"up\n"
        _running_run()
        run_id = str(SandboxRun.objects.get().run_id)
        v1 = CGROUP_ROOT / "pids" / CGROUP_NAME / run_id / "cgroup.procs"
        procs = v1 if v1.exists() else CGROUP_ROOT / CGROUP_NAME / run_id / "cgroup.procs"
        assert procs.read_text().split()  # the sandbox is running in its cgroup
        runner.send_signal(signal.SIGKILL)
        runner.wait(timeout=10)
    finally:
        runner.kill()
    for _ in range(40):
        if not procs.read_text().split():
            break
        time.sleep(0.05)
    assert procs.read_text().split() == []  # every sandbox process died with the runner
    # The record is closed, and what the runner left (cgroups, /tmp mount, work
    # directory) cleaned, once the run is past its deadline plus the grace.
    run = SandboxRun.objects.get()
    assert run.status == "running"
    wait = run.deadline_at.timestamp() + ORPHAN_GRACE.total_seconds() - time.time()
    assert sandbox_reap()["orphans"] == []  # still inside the grace
    time.sleep(max(0.0, wait) + 0.3)
    assert sandbox_reap()["orphans"] == [f"{run_id}:runner_gone"]
    run.refresh_from_db()
    assert run.status == "reaped" and run.error == "killed by the reaper: runner_gone"
    assert not procs.parent.exists()
    assert list(workdir_root().glob(f"run-{run_id}-*")) == []
    assert events_of(run_id)[-1] == "sandbox.run.reaped"


@pytest.mark.django_db
def test_a_run_its_runner_left_held_is_closed_and_its_processes_killed(code_exec, spec_for):
    """The runner died after the decision, before recording the start: the sandbox
    was held (its code never ran: the start gate) and is in no cgroup yet. After
    HELD_GRACE the reaper closes the run and kills what names it."""
    from governance.services.sandbox import HELD_GRACE, reap_orphans, run_request

    code_exec.grant()
    spec = spec_for("print(1)", backend="bubblewrap")
    at = datetime.now(UTC)
    assert run_request(spec=spec, at=at).allowed
    # A process naming the run the way bwrap's command line does, in no cgroup.
    left = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; time.sleep(60)",
            "--setenv",
            "SANDBOX_RUN_ID",
            spec.run_id,
        ]
    )
    try:
        # Not yet: within the grace the runner may still be recording its start.
        assert reap_orphans(at=at + HELD_GRACE / 2) == []
        assert left.poll() is None and run_record(spec.run_id).status == "requested"
        closed = reap_orphans(at=at + HELD_GRACE + timedelta(seconds=1))
        assert closed == [(spec.run_id, "runner_gone")]
        assert left.wait(timeout=10) == -signal.SIGKILL
    finally:
        left.kill()
    assert run_record(spec.run_id).status == "reaped"
    assert events_of(spec.run_id) == ["sandbox.run.requested", "sandbox.run.reaped"]
    assert reap_orphans(at=at + HELD_GRACE * 2) == [], "closed once"


@pytest.mark.django_db
def test_a_container_run_left_running_without_its_container_is_closed(
    docker_client, code_exec, spec_for
):
    """Its runner recorded the start, then died or could not record the end, and the
    container is gone: the next pass closes the run as runner_gone, once."""
    from governance.services.sandbox import run_request, run_started

    code_exec.grant()
    spec = spec_for("print(1)")
    now = datetime.now(UTC)
    assert run_request(spec=spec, at=now).allowed
    deadline = (now - ORPHAN_GRACE - timedelta(seconds=1)).timestamp()
    run_started(
        run_id=spec.run_id, container_id="gone", image_digest=SOME_IMAGE_ID,
        deadline=deadline, enforcement={}, at=now,
    )  # fmt: skip
    fresh = spec_for("print(2)")
    assert run_request(spec=fresh, at=now).allowed
    run_started(
        run_id=fresh.run_id, container_id="alive-elsewhere", image_digest=SOME_IMAGE_ID,
        deadline=now.timestamp() + 60, enforcement={}, at=now,
    )  # fmt: skip
    assert (spec.run_id, "runner_gone") in reap_all(docker_client)
    assert run_record(spec.run_id).status == "reaped"
    assert run_record(fresh.run_id).status == "running"  # before its deadline: left alone
    reaped = AuditEvent.objects.filter(event_type="sandbox.run.reaped")
    assert [json.loads(e.data)["run_id"] for e in reaped] == [spec.run_id]
    assert (spec.run_id, "runner_gone") not in reap_all(docker_client)  # once


@pytest.mark.django_db
def test_a_worker_without_a_docker_engine_still_closes_stale_container_runs(
    code_exec, spec_for, monkeypatch
):
    """Remote container runs (another host's engine) whose end never came, e.g. a
    suspended agent's runner whose token is refused: past deadline plus grace they
    are closed as runner_gone by a worker that has no Docker engine at all."""
    import docker

    from governance.services.sandbox import run_request, run_started

    def no_engine(**kwargs):
        raise docker.errors.DockerException("no engine on this host")

    monkeypatch.setattr(docker, "from_env", no_engine)
    code_exec.grant()
    now = datetime.now(UTC)
    stale, fresh = spec_for("print(1)", backend="docker"), spec_for("print(2)", backend="docker")
    for spec, deadline in ((stale, now - ORPHAN_GRACE - timedelta(seconds=1)),
                           (fresh, now + timedelta(seconds=60))):  # fmt: skip
        assert run_request(spec=spec, at=now).allowed
        run_started(run_id=spec.run_id, container_id="remote", image_digest=SOME_IMAGE_ID,
                    deadline=deadline.timestamp(), enforcement={}, at=now)  # fmt: skip

    summary = sandbox_reap()
    assert summary["skipped"].startswith("no Docker engine")
    assert summary["reaped"] == [f"{stale.run_id}:runner_gone"]
    assert run_record(stale.run_id).status == "reaped"
    assert run_record(fresh.run_id).status == "running"  # before its deadline: left alone
    assert events_of(stale.run_id)[-1] == "sandbox.run.reaped"
    assert sandbox_reap()["reaped"] == []  # once


class SuspendedWhileStarting(DatabaseAuthorizer):
    """The kill switch lands while the backend builds the sandbox: after the allow,
    before the start is recorded."""

    def started(self, spec, auth, result, deadline):
        agent = Agent.objects.get(name=spec.agent)
        now = datetime.now(UTC)
        agent_suspend(agent=agent, reason="kill switch", actor=Actor.system("test"), at=now)
        super().started(spec, auth, result, deadline)


@pytest.mark.django_db
def test_the_start_gate_refuses_a_run_whose_agent_was_suspended_after_the_allow(
    bwrap_available, code_exec, spec_for
):
    code_exec.grant()
    spec = spec_for("print('ran', flush=True)", backend="bubblewrap")
    out = io.BytesIO()
    outcome = execute(spec, SuspendedWhileStarting(), stdout=out, stderr=io.BytesIO())
    assert outcome.exit_code == EXIT_BACKEND
    assert out.getvalue() == b"" and outcome.result.stdout.total == 0  # the code never ran
    record = run_record(spec.run_id)
    assert record.status == "failed" and record.started_at is None
    assert "grant can no longer allow it (agent_suspended)" in record.error
    assert events_of(spec.run_id) == [
        "sandbox.run.requested",
        "sandbox.run.start_refused",  # the gate's deny, on record before the close
        "sandbox.run.finished",
    ]


def _suspend(spec) -> str:
    agent = Agent.objects.get(name=spec.agent)
    agent_suspend(agent=agent, reason="kill switch", actor=Actor.system("test"),
                  at=datetime.now(UTC))  # fmt: skip
    return "agent_suspended"


def _revoke(spec) -> str:
    from governance.services.grants import grant_revoke

    grant_revoke(grant_id=run_record(spec.run_id).grant_id, reason="incident",
                 actor=Actor.system("test"), at=datetime.now(UTC))  # fmt: skip
    return "grant_revoked"


def _narrow(spec) -> str:
    from governance.services.grants import grant_narrow

    grant_narrow(grant_id=run_record(spec.run_id).grant_id, reason="review",
                 actor=Actor.system("test"), at=datetime.now(UTC),
                 scope="sandbox:some-other-image")  # fmt: skip
    return "scope_mismatch"


@pytest.mark.django_db
@pytest.mark.parametrize("kill", [_suspend, _revoke, _narrow], ids=["suspend", "revoke", "narrow"])
def test_the_runner_stops_its_sandbox_when_its_grant_can_no_longer_allow_it(
    backend, code_exec, spec_for, kill, capfd
):
    """The kill switch, from the runner's side: it asks every LIVE_CHECK seconds whether
    the grant can still allow the run, so any backend (bubblewrap has no container for
    the reaper to find) stops within seconds, long before its deadline. Such a run is
    denied: it exits EXIT_DENIED (77), not 137, the status of the SIGKILL that stopped it
    (which a caller reads as the code's own out-of-memory death), and its record and
    `sandbox.run.finished` event say why."""
    from sandbox_runner.runner import EXIT_DENIED, LIVE_CHECK

    code_exec.grant()
    spec = spec_for(
        "import time\nprint('up', flush=True)\ntime.sleep(50)\n",
        backend=backend,
        limits={"wall_seconds": 60},
    )
    why: list[str] = []
    started = time.monotonic()
    outcome = execute(
        spec, DatabaseAuthorizer(), stdout=io.BytesIO(), stderr=io.BytesIO(),
        on_started=lambda spec, handle: why.append(kill(spec)),
    )  # fmt: skip
    elapsed = time.monotonic() - started
    assert elapsed < LIVE_CHECK + 10, elapsed  # not the 60 s deadline
    assert outcome.exit_code == EXIT_DENIED
    stopped = f"stopped: its grant can no longer allow it ({why[0]})"
    assert f"denied while it ran: {stopped}" in capfd.readouterr().err
    record = run_record(spec.run_id)
    assert record.status == "finished" and not record.timed_out
    assert record.error == stopped
    assert events_of(spec.run_id)[-1] == "sandbox.run.finished"
    finished = AuditEvent.objects.filter(event_type="sandbox.run.finished").get()
    assert json.loads(finished.data)["error"] == stopped
    assert events_of(spec.run_id)[-1] == "sandbox.run.finished"


class _Labelled:
    def __init__(self, labels: dict[str, str]) -> None:
        self.labels = labels
        self.removed = False

    def kill(self) -> None:
        pass

    def remove(self, **kw: object) -> None:
        self.removed = True


class _Listing:
    def __init__(self, containers: list[_Labelled]) -> None:
        outer = containers

        class Containers:
            def list(self, **kw: object) -> list[_Labelled]:
                return outer

        self.containers = Containers()


@pytest.mark.parametrize(
    "label",
    ["{root}/..", "{root}/../someone-else", "{root}/run-{other}-x", "{parent}/run-{run}-x", ""],
)
def test_the_reaper_never_deletes_outside_the_runs_own_work_directory(tmp_path, label):
    """The work directory comes from a container label, which the engine reports: a label
    of `<root>/..` passed the old check (its parent is the root) and the reaper, as root,
    deleted the work area's parent (by default /tmp)."""
    import uuid

    from sandbox_runner import reaper
    from sandbox_runner.backends.base import LABEL_DEADLINE, LABEL_RUN, LABEL_WORKDIR

    parent = tmp_path / "parent"
    root = parent / "governance-sandbox"
    root.mkdir(parents=True)
    keep = parent / "someone-elses-file"
    keep.write_text("precious")
    run_id, other = str(uuid.uuid4()), str(uuid.uuid4())
    theirs = root / f"run-{other}-x"
    theirs.mkdir()
    ours = root / f"run-{run_id}-abc"
    ours.mkdir()
    workdir = label.format(root=root, parent=parent, run=run_id, other=other)
    container = _Labelled({LABEL_RUN: run_id, LABEL_DEADLINE: "0", LABEL_WORKDIR: workdir})
    killed = reaper.reap(_Listing([container]), reaper.past_deadline, lambda r, w: None, root)
    assert killed == [(run_id, "deadline")] and container.removed
    assert keep.exists() and theirs.exists() and root.exists()
    # Its own directory, named exactly, is cleaned.
    container = _Labelled({LABEL_RUN: run_id, LABEL_DEADLINE: "0", LABEL_WORKDIR: str(ours)})
    reaper.reap(_Listing([container]), reaper.past_deadline, lambda r, w: None, root)
    assert not ours.exists()
