"""Confinement seen from inside a real sandbox, where the other probes only read what
the engine was told (inspect) or miss a layer: the namespaces the code shares with the
host, the size of the engine's /tmp and /dev/shm, and the run's host directory once the
run is over. Each one was a mutant of the container's configuration that every other
sandbox test let through. Network: none (nothing here opens a socket).

Also an image that asks for root: the default image says USER 1000:1000 itself, so a
runner that stopped passing the user went unseen by every probe (and by inspect,
which then shows the image's user)."""

from __future__ import annotations

import io
import os
import uuid

import pytest

from sandbox_runner.runner import workdir_root
from sandbox_runner.spec import DEFAULT_IMAGE
from tests.sandbox_runner.conftest import events_of, leftovers, run_record
from tests.sandbox_runner.test_docker_probes import run

pytestmark = pytest.mark.django_db

NAMESPACES = ("pid", "ipc", "net", "uts", "mnt", "cgroup")

SHARED = """
import os
for ns in {namespaces!r}:
    try:
        print(ns, os.readlink(f"/proc/self/ns/{{ns}}"))
    except OSError as exc:
        print(ns, "unreadable", exc.errno)
print("processes", len([p for p in os.listdir("/proc") if p.isdigit()]))
try:
    with open("/proc/self/cgroup") as f:
        paths = {{line.rstrip("\\n").split(":", 2)[2] for line in f if line.count(":") >= 2}}
    print("cgroup-paths", ",".join(sorted(paths)))
except OSError as exc:
    print("cgroup-paths", "unreadable", exc.errno)
"""


def test_the_sandbox_shares_no_namespace_with_the_host(backend, code_exec, spec_for):
    """`pid_mode="host"` or `ipc_mode="host"` passed every other probe: the code then
    sees (and, as uid 1000, can signal or read /proc of) the host's processes, or
    shares its System V IPC and /dev/shm. From inside, each namespace must be another
    one than the runner's own, and only the sandbox's own processes are visible."""
    code_exec.grant()
    spec = spec_for(SHARED.format(namespaces=NAMESPACES), backend=backend)
    outcome, out, err = run(spec)
    assert outcome.exit_code == 0, err
    seen = dict(line.split(" ", 1) for line in out.splitlines())
    for ns in NAMESPACES:
        inside = seen[ns]
        if backend == "gvisor" and inside.startswith("unreadable"):
            continue  # gVisor's own kernel has no such link for some: nothing shared
        assert inside != os.readlink(f"/proc/self/ns/{ns}"), (ns, inside)
    # gVisor's kernel shows these two for its sandbox too: never the host's.
    assert seen["pid"].startswith("pid:[") and seen["net"].startswith("net:[")
    # The code (and, under bubblewrap, bwrap's init and the gate's shell): a handful,
    # where the host's pid namespace shows every process on the machine.
    assert int(seen["processes"]) <= 3, out
    # Its own cgroup namespace: on a cgroup v1 host Docker's default was the host's,
    # and /proc/self/cgroup named the host's layout (/docker/<container id>). Under
    # Docker each group is the namespace's root. bubblewrap's namespace is made
    # before the runner moves the sandbox into the run's groups, so those show as
    # paths outside the root: only ever the run's own groups, nothing else of the host.
    # gVisor's own kernel lists no cgroup at all there.
    paths = seen["cgroup-paths"].split(",")
    if backend == "bubblewrap":
        own = f"governance-sandbox/{spec.run_id}"
        assert all(p == "/" or p.endswith(own) for p in paths), out
    elif backend == "gvisor":
        assert paths in ([""], ["/"]) or paths[0].startswith("unreadable"), out
    else:
        assert paths == ["/"], out
    record = run_record(spec.run_id)
    assert (record.status, record.exit_code) == ("finished", 0)
    assert events_of(spec.run_id)[-1] == "sandbox.run.finished"
    assert leftovers(backend, spec.run_id) == []


TMPFS_FILL = """
import errno, os
for where in ("/tmp", "/dev/shm"):
    if not os.path.isdir(where):
        print(where, "absent")
        continue
    path, written = os.path.join(where, "fill"), 0
    try:
        with open(path, "wb") as f:
            while written < 96 << 20:  # bounded: past the cap, so no cap shows as "no cap"
                f.write(b"x" * 65536)
                f.flush()
                written += 65536
        print(where, "no-cap", written >> 20)
    except OSError as exc:
        print(where, errno.errorcode[exc.errno], written >> 20)
    os.remove(path)
"""


def test_tmp_and_dev_shm_are_capped_at_64_mib(backend, code_exec, spec_for):
    """The engine's /tmp had its size (TMP_SIZE) checked by nothing: without it a run's
    writes to /tmp grow to the host's tmpfs default (half its RAM), bounded only by the
    memory cgroup. Both writable memory file systems stop at 64 MiB with ENOSPC."""
    code_exec.grant()
    spec = spec_for(TMPFS_FILL, backend=backend)
    outcome, out, err = run(spec)
    assert outcome.exit_code == 0, (out, err)
    for line in out.splitlines():
        where, what, mib = line.split()
        assert what == "ENOSPC" and 60 <= int(mib) <= 64, out
    assert [line.split()[0] for line in out.splitlines()] == ["/tmp", "/dev/shm"]
    record = run_record(spec.run_id)
    assert (record.status, record.exit_code, record.oom_killed) == ("finished", 0, False)
    assert events_of(spec.run_id)[-1] == "sandbox.run.finished"
    assert leftovers(backend, spec.run_id) == []


def test_the_runs_host_directory_is_gone_once_the_run_is_over(backend, code_exec, spec_for):
    """The run's directory on the host (its script and input copies) is removed with the
    sandbox: under Docker nothing checked it, so a runner that kept it left every run's
    code on the host's disk."""
    code_exec.grant()
    during = []

    def look(spec, handle):
        during.extend(workdir_root().glob(f"run-{spec.run_id}-*"))

    spec = spec_for("print('ran')", backend=backend)
    outcome, out, err = run(spec, on_started=look)
    assert outcome.exit_code == 0 and out == "ran\n", err
    assert len(during) == 1  # it was there while the code ran
    assert list(workdir_root().glob(f"run-{spec.run_id}-*")) == []
    assert not during[0].exists()
    record = run_record(spec.run_id)
    assert (record.status, record.exit_code) == ("finished", 0)
    assert events_of(spec.run_id)[-1] == "sandbox.run.finished"
    assert leftovers(backend, spec.run_id) == []


@pytest.fixture
def image_that_asks_for_root(docker_client):
    """The default image with USER root (as any image off a registry may say), built
    here (no pull: the base is local) and removed afterwards."""
    tag = f"governance-sandbox-root-test:{uuid.uuid4().hex[:12]}"
    dockerfile = f"FROM {DEFAULT_IMAGE}\nUSER root\n".encode()
    docker_client.images.build(fileobj=io.BytesIO(dockerfile), tag=tag, pull=False, rm=True)
    yield tag
    docker_client.images.remove(tag, force=True)


WHO = """
import os
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
print("uid", os.getuid(), os.getgid(), os.geteuid())
print("CapEff", status["CapEff"].strip())
try:
    open("/workspace/mine", "w").write("x")
    print("owner", os.stat("/workspace/mine").st_uid)
except OSError as exc:
    print("owner", "refused", exc.errno)
"""


@pytest.mark.parametrize("backend", ["docker", "gvisor"], indirect=True)
def test_an_image_that_asks_for_root_still_runs_as_uid_1000(
    backend, code_exec, spec_for, image_that_asks_for_root
):
    """The runner's user is the floor, not the image's: an image whose USER is root
    still runs its code as 1000:1000, with no capability, in a /workspace of its own."""
    code_exec.grant()
    spec = spec_for(WHO, backend=backend, image=image_that_asks_for_root)
    outcome, out, err = run(spec)
    assert outcome.exit_code == 0, err
    seen = dict(line.split(" ", 1) for line in out.splitlines())
    assert seen["uid"] == "1000 1000 1000"
    if backend == "docker":  # gVisor's /proc/self/status is its own kernel's
        assert seen["CapEff"] == "0000000000000000"
    assert seen["owner"] == "1000"
    record = run_record(spec.run_id)
    assert (record.status, record.exit_code) == ("finished", 0)
    assert record.image == image_that_asks_for_root and record.image_id.startswith("sha256:")
    assert events_of(spec.run_id)[-1] == "sandbox.run.finished"
    assert leftovers(backend, spec.run_id) == []
