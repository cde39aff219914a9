"""Bubblewrap specifics: without cgroups, limits fall back to rlimits and the run
record says so (the probes in test_docker_probes.py cover the cgroup case); a
refusal leaves nothing behind; the start is recorded before the code runs."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import time
import uuid

import pytest

from governance.models import AuditEvent, SandboxRun
from sandbox_runner.authorizers import DatabaseAuthorizer
from sandbox_runner.backends import bubblewrap
from sandbox_runner.runner import EXIT_BACKEND, EXIT_DENIED, workdir_root
from sandbox_runner.spec import Limits
from tests.sandbox_runner.conftest import events_of, leftovers, run_record
from tests.sandbox_runner.test_docker_probes import run

pytestmark = pytest.mark.django_db


def test_without_cgroups_bubblewrap_refuses_to_run_unless_rlimits_are_accepted(
    bwrap_available, code_exec, spec_for, monkeypatch, tmp_path, capfd
):
    """rlimits bind each process: six forks may each hold the memory cap, and each
    burns its own CPU seconds. So without cgroups the backend is unavailable (before
    anything is asked or started) unless the deployment accepts per-process limits."""
    monkeypatch.setattr(bubblewrap, "CGROUP_ROOT", tmp_path / "no-cgroups-here")
    monkeypatch.delenv(bubblewrap.ALLOW_RLIMITS, raising=False)
    code_exec.grant()
    before = AuditEvent.objects.count()
    spec = spec_for("print('ran')", backend="bubblewrap")
    outcome, out, _ = run(spec)
    assert outcome.exit_code == EXIT_BACKEND and out == ""
    said = capfd.readouterr().err
    assert "rlimits, which bind each process" in said and bubblewrap.ALLOW_RLIMITS in said
    assert not SandboxRun.objects.filter(run_id=spec.run_id).exists()
    assert AuditEvent.objects.count() == before


def test_without_cgroups_limits_are_rlimits_and_recorded(
    bwrap_available, code_exec, spec_for, monkeypatch, tmp_path
):
    monkeypatch.setattr(bubblewrap, "CGROUP_ROOT", tmp_path / "no-cgroups-here")
    monkeypatch.setenv(bubblewrap.ALLOW_RLIMITS, "1")
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
    assert record.enforcement["memory"] == "rlimit (per process)"
    assert record.enforcement["pids"] == "rlimit (per user)"
    assert record.enforcement["cpus"] == "rlimit (cpu seconds per process)"


DEV_FILL = """
import errno
for path in ("/dev/fill", "/dev/shm/fill"):
    written = 0
    try:
        with open(path, "wb") as f:
            while written < 96 << 20:  # bounded: no cap fails the test, not the host
                f.write(b"x" * 65536)
                f.flush()
                written += 65536
        print(path, "no cap", written >> 20)
    except OSError as exc:
        print(path, errno.errorcode[exc.errno], written >> 20)
open("/dev/null", "w").write("still a device")
print("/dev/null ok")
"""


@pytest.mark.parametrize("cgroups", [True, False], ids=["cgroups", "rlimits"])
def test_dev_is_read_only_and_dev_shm_is_capped(
    bwrap_available, code_exec, spec_for, monkeypatch, tmp_path, cgroups
):
    """bwrap's /dev was a writable tmpfs of half the host's RAM (not counted by
    RLIMIT_AS): a run could fill the host's memory through it. Now /dev is read-only,
    its devices still work, and /dev/shm is a tmpfs of 64 MiB."""
    if not cgroups:
        monkeypatch.setattr(bubblewrap, "CGROUP_ROOT", tmp_path / "no-cgroups-here")
        monkeypatch.setenv(bubblewrap.ALLOW_RLIMITS, "1")
    code_exec.grant()
    spec = spec_for(DEV_FILL, limits={"memory_mb": 256}, backend="bubblewrap")
    outcome, out, _ = run(spec)
    assert outcome.exit_code == 0, out
    lines = out.splitlines()
    assert lines[0] == "/dev/fill EROFS 0"
    shm = lines[1].split()
    assert shm[:2] == ["/dev/shm/fill", "ENOSPC"] and int(shm[2]) <= 64
    assert lines[2] == "/dev/null ok"


TMP_FILL = """
import errno
written = 0
try:
    with open("/tmp/fill", "wb") as f:
        while written < 96 << 20:  # bounded: no cap fails the test, not the disk
            f.write(b"x" * 65536)
            f.flush()
            written += 65536
    print("no cap", written >> 20)
except OSError as exc:
    print("stopped", errno.errorcode[exc.errno], written >> 20)
"""


def test_a_runner_that_cannot_mount_tmp_noexec_still_caps_it(
    bwrap_available, code_exec, spec_for, monkeypatch
):
    """Not root: the runner cannot mount its noexec tmpfs, and /tmp used to be a plain
    host directory with no size. It is bwrap's own 64 MiB tmpfs, and the record says
    exec is allowed there."""
    monkeypatch.setattr(bubblewrap, "mount_noexec_tmp", lambda path: path.mkdir() or False)
    code_exec.grant()
    spec = spec_for(TMP_FILL, backend="bubblewrap")
    outcome, out, _ = run(spec)
    assert outcome.exit_code == 0, out
    words = out.split()
    assert words[:2] == ["stopped", "ENOSPC"] and 60 <= int(words[2]) <= 64, out
    record = run_record(spec.run_id)
    assert record.enforcement["tmp"] == "bwrap tmpfs (exec allowed: not root)"
    assert leftovers("bubblewrap", spec.run_id) == []


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


@pytest.fixture
def victim():
    """A process in a cgroup of its own (the test's, beside the runner's groups), as
    another service on the host would be."""
    name = f"governance-test-victim-{uuid.uuid4().hex[:8]}"
    groups = [bubblewrap.CGROUP_ROOT / c / name for c in ("memory", "pids", "cpu")]
    if os.geteuid() != 0 or not groups[1].parent.is_dir():
        pytest.skip("needs root and a cgroup v1 pids hierarchy")
    groups[1].mkdir()
    proc = subprocess.Popen(["sleep", "60"])
    (groups[1] / "cgroup.procs").write_text(str(proc.pid))
    yield name, proc
    proc.kill()
    proc.wait()
    for group in groups:
        with contextlib.suppress(FileNotFoundError):
            group.rmdir()


@pytest.mark.parametrize("run_id", ["../{victim}", "../../pids/{victim}"])
def test_a_run_id_that_is_not_a_uuid_is_refused_before_anything_is_touched(
    bwrap_available, victim, spec_for, run_id
):
    """The run id names the run's cgroups, and a refused run removes its cgroups,
    killing every process in them: "../victim" named another group on the host."""
    name, proc = victim
    with pytest.raises(ValueError, match="run_id must be a UUID"):
        spec = spec_for("print('never')", backend="bubblewrap", run_id=run_id.format(victim=name))
        run(spec)  # no grant: refused (before, its cgroups were the victim's)
    time.sleep(0.2)
    assert proc.poll() is None  # still running
    assert [c for c in ("memory", "cpu") if (bubblewrap.CGROUP_ROOT / c / name).exists()] == []
    assert not SandboxRun.objects.exists() and not AuditEvent.objects.exists()


@pytest.mark.parametrize(
    "run_id",
    [
        "",
        "not-a-uuid",
        "0B5F2C1E-8F43-4C59-9E0F-3B7C2A1D9E10",  # upper case
        "{0b5f2c1e-8f43-4c59-9e0f-3b7c2a1d9e10}",
        "0b5f2c1e8f434c599e0f3b7c2a1d9e10",
        "0b5f2c1e-8f43-4c59-9e0f-3b7c2a1d9e10/..",
    ],
)
def test_only_a_canonical_uuid_is_a_run_id(spec_for, run_id):
    with pytest.raises(ValueError, match="run_id must be a UUID in canonical form"):
        spec_for(None, "true", run_id=run_id)
    run_id = str(uuid.uuid4())
    assert spec_for(None, "true", run_id=run_id).run_id == run_id


def test_a_refused_run_with_a_live_runs_id_leaves_that_run_alone(
    bwrap_available, code_exec, spec_for
):
    """A second request with the id of a run in progress is refused (the id is on
    record already); its cgroups were that run's, so its refusal killed it. A group
    that exists is never taken over: the live run finishes as it would have."""
    code_exec.grant()
    spec = spec_for("import time; time.sleep(1); print('finished')", backend="bubblewrap")
    refusals = []

    def second_request(spec, handle):  # the first run is released and running
        again = spec_for("print('never')", backend="bubblewrap", run_id=spec.run_id)
        refusals.append(run(again))

    outcome, out, _ = run(spec, on_started=second_request)
    ((refused, refused_out, _),) = refusals
    assert refused.exit_code == EXIT_DENIED and refused_out == ""
    assert refused.auth.reason == "error" and "run_id" in refused.auth.message  # a duplicate
    assert outcome.exit_code == 0 and out == "finished\n"
    record = run_record(spec.run_id)
    assert record.status == "finished" and record.exit_code == 0
    assert record.enforcement["pids"] == "cgroup"  # the first run's own groups
    assert events_of(spec.run_id) == [  # the refusal wrote nothing of its own
        "sandbox.run.requested",
        "sandbox.run.started",
        "sandbox.run.finished",
    ]
    assert leftovers("bubblewrap", spec.run_id) == []


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


# The runner's side of held starts, in a process of its own (the runner's core
# needs no Django): start SANDBOXES sandboxes held, then die by SIGKILL before any
# release(). Several at once because what bwrap does then is a race (its sandbox
# arms --die-with-parent only after the block pipe says "go", by which time its
# parent may be dead): one held sandbox shows the unguarded code running only
# some of the time, twenty show it nearly always.
SANDBOXES = 20
HELD_THEN_KILLED = r"""
import os, signal, sys
from sandbox_runner.backends.bubblewrap import BubblewrapBackend
from sandbox_runner.runner import prepare_workdir
from sandbox_runner.spec import SCRIPT_PATH, Authorization, Limits, RunSpec

for _ in range(int(sys.argv[1])):
    spec = RunSpec(
        agent="bot", task=None, backend="bubblewrap", command=("python3", SCRIPT_PATH),
        script=b"open('/tmp/ran', 'w').write('ran'); print('ran', flush=True)\n",
    )
    auth = Authorization("allow", "allowed", "", spec.run_id,
                         limits=Limits(memory_mb=128, cpus=1.0, pids=32, wall_seconds=30,
                                       scratch_mb=8))
    workdir = prepare_workdir(spec)
    handle = BubblewrapBackend().start(
        spec, auth, workdir, 0.0, lambda b: None, lambda b: None, None
    )
    print(workdir, handle.proc.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # before any release(): the runner is gone
"""


def test_a_runner_killed_while_sandboxes_are_held_never_runs_their_code(bwrap_available):
    """bwrap reads end-of-file on its block pipe as "go"; the gate does not: with the
    runner dead before release(), the code is never run (outside its cgroups, with
    nobody to kill it at the deadline)."""
    import subprocess
    import sys
    from pathlib import Path

    child = subprocess.run(
        [sys.executable, "-c", HELD_THEN_KILLED, str(SANDBOXES)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert child.returncode == -9, child.stderr[-2000:]
    started = [line.split() for line in child.stdout.splitlines()]
    assert len(started) == SANDBOXES
    deadline = time.monotonic() + 15
    for _, pid in started:  # bwrap is nobody's now: wait for each to end
        while time.monotonic() < deadline:
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            pytest.fail("bwrap still running 15 s after its runner died")
    time.sleep(1.0)  # time enough for the scripts, were they running
    ran = [w for w, _ in started if (Path(w) / "tmp" / "ran").exists()]
    _clean_up_after_a_dead_runner([w for w, _ in started])
    assert ran == [], f"{len(ran)} of {SANDBOXES} ran their code with the runner dead"


def _clean_up_after_a_dead_runner(workdirs: list[str]) -> None:
    """What the dead runner left (a bwrap stuck in its own setup, cgroups, /tmp
    mounts, work directories), cleaned the way the reaper cleans an orphan."""
    from pathlib import Path

    for workdir in map(Path, workdirs):
        run_id = workdir.name.removeprefix("run-")[:36]
        bubblewrap.clean_orphan(run_id, workdir.parent)


def _v1_memory_hierarchy() -> None:
    root = bubblewrap.CGROUP_ROOT
    if os.geteuid() != 0 or (root / "cgroup.controllers").exists():
        pytest.skip("needs root on a cgroup v1 host (the v2 case is the unit test below)")
    if not (root / "memory" / "memory.memsw.limit_in_bytes").exists():
        pytest.skip("this cgroup v1 host has no swap accounting to take away")


@pytest.mark.parametrize("swap_accounting", [True, False], ids=["memsw", "no-memsw"])
def test_on_cgroup_v1_the_record_says_whether_swap_is_capped(
    bwrap_available, code_exec, spec_for, monkeypatch, swap_accounting
):
    """cgroup v1 caps swap only through memory.memsw.limit_in_bytes, which exists only
    with swap accounting. When it could not be written the record still said memory was
    enforced by "cgroup", though the run could go on in swap past memory_mb. The host's
    own cgroups are real here; only the memsw write is made to fail, as on a host booted
    without swap accounting."""
    _v1_memory_hierarchy()
    write = bubblewrap.Cgroups._write

    def no_memsw(path, value):
        if path.name == "memory.memsw.limit_in_bytes":
            raise FileNotFoundError(errno.ENOENT, "no swap accounting", str(path))
        write(path, value)

    if not swap_accounting:
        monkeypatch.setattr(bubblewrap.Cgroups, "_write", staticmethod(no_memsw))
    code_exec.grant()
    spec = spec_for("print('ran')", backend="bubblewrap", limits={"memory_mb": 64})
    seen = {}

    def read_limits(spec, handle):
        d = handle.cgroups.dirs["memory"]
        for name in ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"):
            seen[name] = int((d / name).read_text())

    outcome, out, _ = run(spec, on_started=read_limits)
    assert outcome.exit_code == 0 and out == "ran\n"
    assert seen["memory.limit_in_bytes"] == 64 << 20
    swap_capped = seen["memory.memsw.limit_in_bytes"] == 64 << 20
    assert swap_capped is swap_accounting  # what the kernel holds ...
    said = "cgroup" if swap_accounting else "cgroup (swap not capped)"
    record = run_record(spec.run_id)  # ... is what the record and its event say
    assert record.enforcement["memory"] == said
    assert record.enforcement["pids"] == record.enforcement["cpus"] == "cgroup"
    started = AuditEvent.objects.get(event_type="sandbox.run.started")
    assert json.loads(started.data)["enforcement"]["memory"] == said
    assert leftovers("bubblewrap", spec.run_id) == []


def test_on_cgroup_v2_without_a_swap_controller_memory_is_still_capped_and_said_so(
    tmp_path, monkeypatch
):
    """Unit level (this host is cgroup v1, so no v2 hierarchy to use): a fake unified
    tree whose memory.swap.max cannot be written, as on a v2 host without swap
    accounting. That failure lost every cgroup limit (the whole v2 block gave up, and
    the run fell back to rlimits or was refused); now memory, pids and cpus are cgroup
    limits and the record says that swap is not capped."""
    if os.geteuid() != 0:
        pytest.skip("Cgroups only acts as root")
    monkeypatch.setattr(bubblewrap, "CGROUP_ROOT", tmp_path)
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")
    run_id = str(uuid.uuid4())
    groups = bubblewrap.Cgroups(run_id)
    groups.make()
    d = groups.dirs["unified"]
    assert d == tmp_path / bubblewrap.CGROUP_NAME / run_id
    (d / "memory.swap.max").mkdir()  # writing it fails (IsADirectoryError, an OSError)
    limits = Limits(memory_mb=64, cpus=0.5, pids=16, wall_seconds=10, scratch_mb=8)
    assert groups.limit(limits) == {
        "memory": "cgroup (swap not capped)",
        "pids": "cgroup",
        "cpus": "cgroup",
    }
    assert (d / "memory.max").read_text() == str(64 << 20)
    assert (d / "pids.max").read_text() == "16"
    assert (d / "cpu.max").read_text() == "50000 100000"
    (d / "memory.swap.max").rmdir()
    assert groups.limit(limits)["memory"] == "cgroup"  # with it, swap is capped
    assert (d / "memory.swap.max").read_text() == "0"
