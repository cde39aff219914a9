"""Bubblewrap specifics: without cgroups, limits fall back to rlimits and the run
record says so (the probes in test_docker_probes.py cover the cgroup case); a
refusal leaves nothing behind; the start is recorded before the code runs."""

from __future__ import annotations

import os
import time

import pytest

from sandbox_runner.authorizers import DatabaseAuthorizer
from sandbox_runner.backends import bubblewrap
from sandbox_runner.runner import EXIT_BACKEND, EXIT_DENIED, workdir_root
from tests.sandbox_runner.conftest import events_of, leftovers, run_record
from tests.sandbox_runner.test_docker_probes import run

pytestmark = pytest.mark.django_db


def test_without_cgroups_limits_are_rlimits_and_recorded(
    bwrap_available, code_exec, spec_for, monkeypatch, tmp_path
):
    monkeypatch.setattr(bubblewrap, "CGROUP_ROOT", tmp_path / "no-cgroups-here")
    code_exec.grant()
    spec = spec_for(
        "b = []\ntry:\n    while True: b.append(bytearray(8 * 1024 * 1024))\n"
        "except MemoryError:\n    print('MemoryError', len(b) * 8)\n",
        limits={"memory_mb": 128},
        backend="bubblewrap",
    )
    outcome, out, _ = run(spec)
    assert outcome.exit_code == 0
    word, mb = out.split()
    assert word == "MemoryError" and int(mb) < 128  # RLIMIT_AS, not the OOM killer
    record = run_record(spec.run_id)
    assert not record.oom_killed
    assert record.enforcement["memory"] == record.enforcement["pids"] == "rlimit"
    assert record.enforcement["cpus"] == "rlimit"


def test_a_refused_run_leaves_nothing_behind(bwrap_available, code_exec, spec_for):
    """The cgroups made while governance decides (BubblewrapBackend.prepare) are
    gone once a refusal returns, and nothing was started."""
    spec = spec_for("print('never')", backend="bubblewrap")  # no grant
    outcome, out, _ = run(spec)
    assert outcome.exit_code == EXIT_DENIED and out == ""
    assert run_record(spec.run_id).status == "denied"
    assert events_of(spec.run_id) == ["sandbox.run.requested", "sandbox.run.denied"]
    assert leftovers("bubblewrap", spec.run_id) == []
    assert list(workdir_root().glob(f"run-{spec.run_id}-*")) == []


class StartNotRecorded(DatabaseAuthorizer):
    """The database fails (slowly) exactly when the start is to be recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.pid = 0

    def started(self, spec, auth, result, deadline):
        self.pid = int(result.container_id.removeprefix("bwrap:"))
        os.kill(self.pid, 0)  # bwrap is up (held before the code, --block-fd)
        time.sleep(0.5)  # ample time for the script to print, were it running
        raise RuntimeError("the database went away")


def test_a_start_that_cannot_be_recorded_never_runs_the_code(bwrap_available, code_exec, spec_for):
    code_exec.grant()
    spec = spec_for("print('ran', flush=True)", backend="bubblewrap")
    authorizer = StartNotRecorded()
    outcome, out, _ = run(spec, authorizer)
    assert outcome.exit_code == EXIT_BACKEND
    assert out == "" and outcome.result.stdout.total == 0  # the code never ran
    with pytest.raises(ProcessLookupError):
        os.kill(authorizer.pid, 0)  # bwrap was killed (and reaped)
    record = run_record(spec.run_id)
    assert record.status == "failed" and record.exit_code is None
    assert "the database went away" in record.error
    assert events_of(spec.run_id) == ["sandbox.run.requested", "sandbox.run.finished"]
    assert leftovers("bubblewrap", spec.run_id) == []
    assert list(workdir_root().glob(f"run-{spec.run_id}-*")) == []
