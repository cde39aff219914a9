"""The directory that holds every run's files must not be changeable by anyone else
(it sits under a shared /tmp by default): a symlink, someone else's directory or a
world-writable one is refused before anything is written or run."""

from __future__ import annotations

import os
import sys

import pytest

from sandbox_runner.runner import UnsafeWorkdir, prepare_workdir, workdir_root
from sandbox_runner.spec import RunSpec


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("SANDBOX_WORKDIR", str(tmp_path))
    return workdir_root()


def spec() -> RunSpec:
    return RunSpec(agent="bot", task=None, command=("true",), script=b"print(1)\n")


def test_a_fresh_root_is_made_private_and_used(root):
    workdir = prepare_workdir(spec())
    assert workdir.parent == root
    assert oct(os.lstat(root).st_mode & 0o777) == oct(0o711)
    assert (workdir / "in" / "script").read_bytes() == b"print(1)\n"


def test_a_symlinked_root_is_refused(root, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o711)
    root.symlink_to(elsewhere)
    with pytest.raises(UnsafeWorkdir, match="not a directory"):
        prepare_workdir(spec())
    assert list(elsewhere.iterdir()) == []  # nothing was written through it


def test_a_world_writable_root_is_refused(root):
    root.mkdir()
    root.chmod(0o1777)
    with pytest.raises(UnsafeWorkdir, match="writable by others"):
        prepare_workdir(spec())
    assert list(root.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the directory away")
def test_someone_elses_root_is_refused(root):
    root.mkdir(mode=0o711)
    os.chown(root, 4242, 4242)
    with pytest.raises(UnsafeWorkdir, match="belongs to uid 4242"):
        prepare_workdir(spec())
    assert list(root.iterdir()) == []


@pytest.mark.django_db
def test_a_run_over_an_unsafe_root_starts_nothing_and_is_recorded_as_failed(
    root, bwrap_available, code_exec, spec_for
):
    from sandbox_runner.runner import EXIT_BACKEND
    from tests.sandbox_runner.conftest import events_of, run_record
    from tests.sandbox_runner.test_docker_probes import run

    root.mkdir()
    root.chmod(0o777)
    code_exec.grant()
    run_spec = spec_for("print('never')", backend="bubblewrap")
    outcome, out, _ = run(run_spec)
    assert outcome.exit_code == EXIT_BACKEND and out == ""
    record = run_record(run_spec.run_id)
    assert record.status == "failed" and "writable by others" in record.error
    assert events_of(run_spec.run_id) == ["sandbox.run.requested", "sandbox.run.finished"]


def test_a_workdir_that_cannot_be_filled_is_removed(root, monkeypatch):
    """A full disk while the input was copied left the run's directory (with the script
    copy in it) behind: nothing else knows of it, no reaper would ever find it."""
    import errno
    import pathlib

    real = pathlib.Path.write_bytes

    def full_disk(self: pathlib.Path, data: bytes) -> int:
        if self.name == "input":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, data)

    monkeypatch.setattr(pathlib.Path, "write_bytes", full_disk)
    asked = RunSpec(agent="bot", task=None, command=("true",), script=b"x" * 10, input=b"y")
    with pytest.raises(OSError, match="No space left"):
        prepare_workdir(asked)
    assert list(root.iterdir()) == []


SNOOP = r"""
import glob, os, sys, time
pattern, found = sys.argv[1], []
end = time.time() + 30
while time.time() < end and not glob.glob(pattern):
    time.sleep(0.05)
workdir = (glob.glob(pattern) or ["(never made)"])[0]
os.setgroups([])  # found as root (the root folder is not listable); tried as nobody
os.setgid(65534)
os.setuid(65534)
end = time.time() + 4
while time.time() < end:
    for name in ("in/input", "in/script", "tmp/secret.txt"):
        try:
            found.append(f"read {name}: " + open(os.path.join(workdir, name)).read()[:40])
        except OSError:
            pass
    try:
        with open(os.path.join(workdir, "tmp", "planted"), "w") as planted:
            planted.write("from another account")
        found.append("planted")
    except OSError:
        pass
    time.sleep(0.2)
print(os.getuid(), workdir != "(never made)", sorted(set(found)))
"""
WAITS = r"""
import os, time
open("/tmp/secret.txt", "w").write("TOKEN-FETCHED-BY-THE-RUN")
time.sleep(5)
print("planted" in os.listdir("/tmp"))
"""


@pytest.mark.django_db
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another account")
@pytest.mark.parametrize("backend", ["docker", "gvisor", "bubblewrap"], indirect=True)
def test_another_host_account_cannot_enter_a_running_runs_directory(backend, code_exec, spec_for):
    """The run's directory was 0711 with in/ 0755 and its files 0444, and bwrap's /tmp
    (mounted under it) 1777: any account on the host that read the path (a process's
    command line or mounts show it) read the run's input and script, and read and wrote
    the sandbox's /tmp. Now only the runner, the engine and bwrap's own uid enter it."""
    import io
    import subprocess

    from sandbox_runner.authorizers import DatabaseAuthorizer
    from sandbox_runner.runner import execute

    code_exec.grant()
    spec = spec_for(WAITS, backend=backend, input=b"CONFIDENTIAL-INPUT-ROW-1")
    pattern = str(workdir_root() / f"run-{spec.run_id}-*")
    snoop = subprocess.Popen(  # noqa: S603 - fixed argv
        [sys.executable, "-c", SNOOP, pattern], stdout=subprocess.PIPE, text=True
    )
    out, err = io.BytesIO(), io.BytesIO()
    try:
        outcome = execute(spec, DatabaseAuthorizer(), stdout=out, stderr=err)
    finally:
        seen = snoop.communicate(timeout=60)[0]
    assert outcome.exit_code == 0, err.getvalue()
    assert seen.strip() == "65534 True []", seen  # it found the directory, and no way in
    assert out.getvalue().decode().strip() == "False"  # nothing planted in its /tmp
