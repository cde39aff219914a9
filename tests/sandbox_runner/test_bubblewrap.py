"""Bubblewrap without cgroups: limits fall back to rlimits and the run record
says so (the probes in test_docker_probes.py cover the cgroup case)."""

from __future__ import annotations

import pytest

from sandbox_runner.backends import bubblewrap
from tests.sandbox_runner.conftest import run_record
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
