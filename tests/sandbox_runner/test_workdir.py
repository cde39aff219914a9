"""The directory that holds every run's files must not be changeable by anyone else
(it sits under a shared /tmp by default): a symlink, someone else's directory or a
world-writable one is refused before anything is written or run."""

from __future__ import annotations

import os

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
